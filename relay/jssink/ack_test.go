package jssink

import (
	"encoding/json"
	"testing"

	"github.com/nats-io/nats.go"
)

var ackSamples = []string{
	// What nats-server writes.
	`{"stream":"OUTBOX","seq":1}`,
	`{"stream":"OUTBOX","domain":"hub","seq":18446744073709551615}`,
	`{"stream":"OUTBOX","seq":42,"duplicate":true}`,
	`{"stream":"OUTBOX", "seq":7}`,
	// Other valid JSON it reads itself.
	" {\n\t\"seq\" : 3 , \"stream\" : \"A-b_c\" , \"duplicate\" : false } ",
	`{"stream":"S","seq":5,"duplicate":true,"duplicate":false}`,
	// Left to encoding/json.
	`{"error":{"code":503,"err_code":10039,"description":"jetstream not enabled"}}`,
	`{"stream":"S","seq":5,"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 4"}}`,
	`{"Stream":"S","seq":1}`,
	`{"stream":"S\u0041","seq":1}`,
	`{"stream":"S","seq":18446744073709551616}`,
	`{"stream":"S","seq":1.0}`,
	`{"stream":"S","seq":1e3}`,
	`{"stream":"S","seq":-1}`,
	`{"stream":"S","seq":01}`,
	`{"stream":"S","seq":"1"}`,
	`{"stream":"S","seq":1,"batch":"b","count":2}`,
	`{"stream":"S","stream":"T","seq":1}`,
	`{"stream":"","seq":1}`,
	`{"stream":"S"}`,
	`{"seq":1}`,
	`{"stream":"S","seq":1,}`,
	`{"stream":"S","seq":1}x`,
	`{"stream":"S","seq":1`,
	`{"stream":"S","seq":1,"duplicate":tru}`,
	`{"stream":"S","seq":1,"duplicate":null}`,
	`{"stream":"é","seq":1}`,
	`[]`,
	``,
	`+OK`,
}

// TestScanAckAgreesWithEncodingJSON: wherever scanAck reads a reply, it
// reads what encoding/json does; where it declines, parseReply still
// answers as before (from encoding/json).
func TestScanAckAgreesWithEncodingJSON(t *testing.T) {
	read := 0
	for _, in := range ackSamples {
		if checkScanAck(t, []byte(in)) {
			read++
		}
	}
	if read != 6 {
		t.Fatalf("scanAck read %d of the samples, want the 6 valid acks", read)
	}
}

func FuzzScanAck(f *testing.F) {
	for _, in := range ackSamples {
		f.Add([]byte(in))
	}
	f.Fuzz(func(t *testing.T, data []byte) { checkScanAck(t, data) })
}

// checkScanAck fails t where scanAck reads data differently from
// encoding/json, and reports whether scanAck read it.
func checkScanAck(t *testing.T, data []byte) bool {
	t.Helper()
	stream, seq, dup, ok := scanAck(data)
	if !ok {
		return false
	}
	var r pubAckReply
	if err := json.Unmarshal(data, &r); err != nil {
		t.Fatalf("scanAck read %q, which encoding/json refuses: %v", data, err)
	}
	if r.Error != nil || r.Stream != string(stream) || r.Sequence != seq || r.Duplicate != dup {
		t.Fatalf("%q: scanAck read stream %q seq %d duplicate %v; encoding/json %+v", data, stream, seq, dup, r)
	}
	return true
}

// TestParseReplySharesTheStreamName: replies of one stream share one name
// string, and a reply of another stream gets its own.
func TestParseReplySharesTheStreamName(t *testing.T) {
	var last string
	a, err := parseReply(&nats.Msg{Data: []byte(`{"stream":"A","seq":1}`)}, &last)
	if err != nil || a.Stream != "A" || a.Sequence != 1 {
		t.Fatalf("ack %+v, %v", a, err)
	}
	again := &nats.Msg{Data: []byte(`{"stream":"A","seq":2}`)}
	allocs := testing.AllocsPerRun(100, func() { _, _ = parseReply(again, &last) })
	if allocs > 1 { // the Ack
		t.Fatalf("%v allocations per reply of the same stream, want 1", allocs)
	}
	b, err := parseReply(&nats.Msg{Data: []byte(`{"stream":"B","seq":9,"duplicate":true}`)}, &last)
	if err != nil || b.Stream != "B" || b.Sequence != 9 || !b.Duplicate {
		t.Fatalf("ack %+v, %v", b, err)
	}
	if _, err := parseReply(&nats.Msg{Data: []byte(`{"error":{"code":503,"err_code":10039,"description":"x"}}`)}, &last); err == nil {
		t.Fatal("an API error parsed as an ack")
	}
}
