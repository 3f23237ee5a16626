package relay

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func TestParsePubAckReadsEveryReplyShape(t *testing.T) {
	cases := []struct {
		name, data string
		header     nats.Header
		want       jetstream.PubAck
		wantCode   jetstream.ErrorCode // an *APIError with this code
		wantErr    error               // errors.Is
		anyErr     bool
	}{
		{name: "stored", data: `{"stream":"ORDERS","seq":42}`, want: jetstream.PubAck{Stream: "ORDERS", Sequence: 42}},
		{name: "duplicate", data: `{"stream":"ORDERS","seq":7,"duplicate":true}`, want: jetstream.PubAck{Stream: "ORDERS", Sequence: 7, Duplicate: true}},
		{name: "domain (slow path)", data: `{"stream":"ORDERS","domain":"hub","seq":9}`, want: jetstream.PubAck{Stream: "ORDERS", Sequence: 9, Domain: "hub"}},
		{name: "spaces (slow path)", data: `{ "stream": "ORDERS", "seq": 3 }`, want: jetstream.PubAck{Stream: "ORDERS", Sequence: 3}},
		{name: "escaped stream name (slow path)", data: `{"stream":"A\u0042","seq":1}`, want: jetstream.PubAck{Stream: "AB", Sequence: 1}},
		{name: "largest sequence", data: `{"stream":"S","seq":18446744073709551615}`, want: jetstream.PubAck{Stream: "S", Sequence: 1<<64 - 1}},
		{name: "wrong last msg id", data: `{"error":{"code":400,"err_code":10071,"description":"wrong last msg ID: x"},"stream":"S","seq":0}`, wantCode: 10071},
		{name: "stream error", data: `{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}`, wantCode: 10008},
		{name: "no responders", header: nats.Header{"Status": {"503"}}, wantErr: jetstream.ErrNoStreamResponse},
		{name: "other status", header: nats.Header{"Status": {"408"}, "Description": {"Request Timeout"}}, anyErr: true},
		{name: "garbage", data: `not json`, anyErr: true},
		{name: "no stream", data: `{"seq":5}`, anyErr: true},
		{name: "truncated", data: `{"stream":"S","seq":5`, anyErr: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := &nats.Msg{Data: []byte(c.data), Header: c.header}
			got, err := parsePubAck(m, map[string]string{})
			switch {
			case c.wantCode != 0:
				var apiErr *jetstream.APIError
				if !errors.As(err, &apiErr) || apiErr.ErrorCode != c.wantCode {
					t.Fatalf("err = %v, want an API error with err_code %d", err, c.wantCode)
				}
				if ClassifyJetStream(err) != ClassifyJetStream(&jetstream.APIError{Code: apiErr.Code, ErrorCode: c.wantCode}) {
					t.Fatal("classified differently from the library's error")
				}
			case c.wantErr != nil:
				if !errors.Is(err, c.wantErr) {
					t.Fatalf("err = %v, want %v", err, c.wantErr)
				}
			case c.anyErr:
				if err == nil {
					t.Fatalf("no error for %q; got %+v", c.data, got)
				}
			default:
				if err != nil || got != c.want {
					t.Fatalf("got %+v, %v; want %+v", got, err, c.want)
				}
			}
		})
	}
}

// The fast path agrees with encoding/json on every ack it accepts.
func TestFastPubAckAgreesWithJSON(t *testing.T) {
	streams := map[string]string{}
	for i := range 2000 {
		seq := uint64(i) * 7919 * 104729
		name := fmt.Sprintf("S%d_x-y", i%13)
		data := fmt.Sprintf(`{"stream":%q,"seq":%d}`, name, seq)
		if i%3 == 0 {
			data = fmt.Sprintf(`{"stream":%q,"seq":%d,"duplicate":true}`, name, seq)
		}
		fast, ok := fastPubAck([]byte(data), streams)
		if !ok {
			t.Fatalf("fast path refused %s", data)
		}
		var slow pubAckReply
		if err := json.Unmarshal([]byte(data), &slow); err != nil {
			t.Fatal(err)
		}
		if fast.Stream != slow.Stream || fast.Sequence != slow.Sequence || fast.Duplicate != slow.Duplicate {
			t.Fatalf("%s: fast %+v, json %+v", data, fast, slow)
		}
	}
	if len(streams) != 13 {
		t.Fatalf("interned %d stream names, want 13", len(streams))
	}
}

func FuzzParsePubAck(f *testing.F) {
	for _, s := range []string{`{"stream":"S","seq":1}`, `{"stream":"S","seq":1,"duplicate":true}`, `{"error":{"code":503}}`, `{"stream":"S","seq":99999999999999999999}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		ack, err := parsePubAck(&nats.Msg{Data: data}, map[string]string{})
		if err != nil || len(data) == 0 {
			return
		}
		// Whatever is accepted must be what encoding/json reads.
		var slow pubAckReply
		if jerr := json.Unmarshal(data, &slow); jerr != nil {
			t.Fatalf("accepted %q that encoding/json refuses: %v", data, jerr)
		}
		if slow.Error != nil || ack.Stream != slow.Stream || ack.Sequence != slow.Sequence || ack.Duplicate != slow.Duplicate {
			t.Fatalf("%q: got %+v, encoding/json %+v", data, ack, slow)
		}
	})
}
