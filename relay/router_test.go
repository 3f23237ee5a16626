package relay

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/walbox/walbox/cdc"
)

func TestSubjectMatches(t *testing.T) {
	tests := []struct {
		filter, subject string
		want            bool
	}{
		// exact
		{"orders.created", "orders.created", true},
		{"orders.created", "orders.paid", false},
		{"orders.created", "orders", false},
		{"orders.created", "orders.created.v2", false},
		{"orders", "orders", true},
		{"orders", "Orders", false},
		// * is exactly one token
		{"orders.*", "orders.created", true},
		{"orders.*", "orders", false},
		{"orders.*", "orders.created.v2", false},
		{"*.created", "orders.created", true},
		{"*.created", "orders.paid", false},
		{"*", "orders", true},
		{"*", "orders.created", false},
		{"orders.*.v2", "orders.created.v2", true},
		{"orders.*.v2", "orders.created.v3", false},
		{"*.*", "a.b", true},
		{"*.*", "a", false},
		// > is one or more trailing tokens
		{"orders.>", "orders.created", true},
		{"orders.>", "orders.created.v2", true},
		{"orders.>", "orders", false},
		{"orders.>", "payments.settled", false},
		{">", "orders", true},
		{">", "orders.created.v2", true},
		{"*.>", "orders.created", true},
		{"*.>", "orders", false},
		{"orders.*.>", "orders.created.v2", true},
		{"orders.*.>", "orders.created", false},
		// a token that merely contains * or > is a literal
		{"orders.a*", "orders.ab", false},
		{"orders.a*", "orders.a*", true},
	}
	for _, tt := range tests {
		t.Run(tt.filter+"~"+tt.subject, func(t *testing.T) {
			if got := SubjectMatches(tt.filter, tt.subject); got != tt.want {
				t.Fatalf("SubjectMatches(%q, %q) = %v, want %v", tt.filter, tt.subject, got, tt.want)
			}
		})
	}
}

func TestValidSubject(t *testing.T) {
	tests := []struct {
		subject string
		wantErr string // "" means valid
	}{
		{"orders", ""},
		{"orders.created", ""},
		{"orders.created.v2", ""},
		{"orders-eu_1.created", ""},
		{"orders.a*b", ""}, // not a wildcard token
		{"orders.ä", ""},
		{"", "empty subject"},
		{"orders created", "white space"},
		{"orders.created ", "white space"},
		{" orders", "white space"},
		{"orders\tcreated", "white space"},
		{"orders\ncreated", "white space"},
		{"orders\r.created", "white space"},
		{".orders", "empty token"},
		{"orders.", "empty token"},
		{"orders..created", "empty token"},
		{".", "empty token"},
		{"orders.*", "wildcards"},
		{"*", "wildcards"},
		{"orders.>", "wildcards"},
		{">", "wildcards"},
		{"orders.*.created", "wildcards"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%q", tt.subject), func(t *testing.T) {
			err := ValidSubject(tt.subject)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("ValidSubject(%q) = %v, want nil", tt.subject, err)
			case tt.wantErr != "" && err == nil:
				t.Fatalf("ValidSubject(%q) = nil, want an error about %q", tt.subject, tt.wantErr)
			case tt.wantErr != "" && !strings.Contains(err.Error(), tt.wantErr):
				t.Fatalf("ValidSubject(%q) = %v, want an error about %q", tt.subject, err, tt.wantErr)
			}
		})
	}
}

var testRoutes = []Route{
	{Stream: "ORDERS", Subjects: []string{"orders.>"}},
	{Stream: "PAYMENTS", Subjects: []string{"payments.*", "refunds.*.done"}},
	{Stream: "AUDIT", Subjects: []string{"audit"}},
}

func TestStreamFor(t *testing.T) {
	tests := []struct {
		subject    string
		wantStream string
		wantOK     bool
	}{
		{"orders.created", "ORDERS", true},
		{"orders.created.v2", "ORDERS", true},
		{"payments.settled", "PAYMENTS", true},
		{"refunds.42.done", "PAYMENTS", true},
		{"audit", "AUDIT", true},
		{"orders", "", false},
		{"payments.settled.v2", "", false},
		{"refunds.42.started", "", false},
		{"audit.x", "", false},
		{"inventory.reserved", "", false},
	}
	r := NewRouter("", "src", testRoutes)
	// Twice: the second round answers from the cache and must agree.
	for round := 0; round < 2; round++ {
		for _, tt := range tests {
			got, ok := r.StreamFor(tt.subject)
			if got != tt.wantStream || ok != tt.wantOK {
				t.Fatalf("round %d: StreamFor(%q) = (%q, %v), want (%q, %v)", round, tt.subject, got, ok, tt.wantStream, tt.wantOK)
			}
		}
	}
	if len(r.cache) != len(tests) {
		t.Fatalf("cache holds %d subjects, want %d (hits and misses are both cached)", len(r.cache), len(tests))
	}
}

func TestStreamForFirstMatchingRouteWins(t *testing.T) {
	r := NewRouter("", "", []Route{
		{Stream: "A", Subjects: []string{"x.y"}},
		{Stream: "B", Subjects: []string{"x.>"}},
	})
	if got, _ := r.StreamFor("x.y"); got != "A" {
		t.Fatalf("StreamFor(x.y) = %q, want A", got)
	}
	if got, _ := r.StreamFor("x.z"); got != "B" {
		t.Fatalf("StreamFor(x.z) = %q, want B", got)
	}
}

func TestStreamForCacheIsBounded(t *testing.T) {
	r := NewRouter("", "", testRoutes)
	for i := 0; i < 25000; i++ {
		subject := fmt.Sprintf("orders.%d", i)
		if i%2 == 1 {
			subject = fmt.Sprintf("unrouted.%d", i)
		}
		got, ok := r.StreamFor(subject)
		if want := i%2 == 0; ok != want || (ok && got != "ORDERS") {
			t.Fatalf("StreamFor(%q) = (%q, %v)", subject, got, ok)
		}
		if len(r.cache) > 10000 {
			t.Fatalf("cache grew to %d entries after %d distinct subjects", len(r.cache), i+1)
		}
	}
	// Answers after the cache was cleared are still right.
	if got, ok := r.StreamFor("orders.0"); !ok || got != "ORDERS" {
		t.Fatalf("StreamFor(orders.0) after cache turnover = (%q, %v)", got, ok)
	}
	if _, ok := r.StreamFor("unrouted.1"); ok {
		t.Fatal("StreamFor(unrouted.1) after cache turnover found a stream")
	}
}

var commitTime = time.Date(2025, 3, 4, 5, 6, 7, 890123456, time.FixedZone("CET", 3600))

func goodEvent() *cdc.Event {
	return &cdc.Event{
		Pos:           cdc.Position{CommitLSN: 0x16B374D848, Index: 7},
		CommitTime:    commitTime,
		ID:            "0195b7a4-1b2c-7d3e-8f90-a1b2c3d4e5f6",
		Topic:         "orders.created",
		EventType:     "OrderCreated",
		AggregateType: "order",
		AggregateID:   "o-42",
		PartitionKey:  "customer-7",
		Payload:       []byte(`{"order":42}`),
		PayloadIsJSON: true,
	}
}

func TestMessageSetsSubjectDataAndHeaders(t *testing.T) {
	r := NewRouter("", "db1/walbox", testRoutes)
	ev := goodEvent()
	m, stream, err := r.Message(ev)
	if err != nil {
		t.Fatalf("Message: %v", err)
	}
	if stream != "ORDERS" {
		t.Fatalf("stream = %q, want ORDERS", stream)
	}
	if m.Subject != "orders.created" {
		t.Fatalf("subject = %q, want orders.created", m.Subject)
	}
	if string(m.Data) != `{"order":42}` {
		t.Fatalf("data = %q, want the raw payload", m.Data)
	}
	wantOwnHeaders(t, m, ev)
	if len(m.Header) != len(ownHeaders(ev)) {
		t.Errorf("headers = %v, want exactly walbox's own", m.Header)
	}
}

func TestMessageCommitLSNHeaderParsesBack(t *testing.T) {
	r := NewRouter("", "", testRoutes)
	for _, lsn := range []cdc.LSN{0, 1, 0x16B374D848, 0xFFFFFFFF00000001} {
		ev := goodEvent()
		ev.Pos = cdc.Position{CommitLSN: lsn, Index: 4294967295}
		m, _, err := r.Message(ev)
		if err != nil {
			t.Fatalf("Message: %v", err)
		}
		var hi, lo uint32
		if _, err := fmt.Sscanf(m.Header.Get(HeaderCommitLSN), "%X/%X", &hi, &lo); err != nil {
			t.Fatalf("%s = %q does not parse: %v", HeaderCommitLSN, m.Header.Get(HeaderCommitLSN), err)
		}
		if got := cdc.LSN(uint64(hi)<<32 | uint64(lo)); got != lsn {
			t.Fatalf("%s round trip = %d, want %d", HeaderCommitLSN, got, lsn)
		}
		if got := m.Header.Get(HeaderIndex); got != "4294967295" {
			t.Fatalf("%s = %q", HeaderIndex, got)
		}
	}
}

func TestMessageOmitsEmptyOptionalHeaders(t *testing.T) {
	r := NewRouter("", "", testRoutes) // no source
	ev := goodEvent()
	ev.EventType, ev.AggregateType, ev.AggregateID, ev.PartitionKey = "", "", "", ""
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatalf("Message: %v", err)
	}
	for _, k := range []string{HeaderSource, HeaderEventType, HeaderAggregateType, HeaderAggregateID, HeaderPartitionKey} {
		if _, ok := m.Header[k]; ok {
			t.Errorf("header %s set to %q for an empty value", k, m.Header.Get(k))
		}
	}
	for _, k := range []string{HeaderMsgID, HeaderCommitLSN, HeaderIndex, HeaderCommitTime} {
		if m.Header.Get(k) == "" {
			t.Errorf("header %s missing", k)
		}
	}
}

func TestMessageSubjectPrefix(t *testing.T) {
	r := NewRouter("app.", "", []Route{{Stream: "APP", Subjects: []string{"app.orders.>"}}})
	m, stream, err := r.Message(goodEvent())
	if err != nil {
		t.Fatalf("Message: %v", err)
	}
	if m.Subject != "app.orders.created" || stream != "APP" {
		t.Fatalf("subject, stream = %q, %q; want app.orders.created, APP", m.Subject, stream)
	}
	// The prefix is part of the subject the streams must capture.
	r = NewRouter("app.", "", testRoutes)
	if _, _, err := r.Message(goodEvent()); !isPoison(err) {
		t.Fatalf("Message with prefix no stream captures: err = %v, want a PoisonError", err)
	}
}

func TestMessageHeadersColumn(t *testing.T) {
	tests := []struct {
		name    string
		headers string
		want    map[string]string // header -> value; "" value means absent
	}{
		{"string values", `{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","correlation_id":"c-1"}`,
			map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "correlation_id": "c-1"}},
		{"number", `{"retries":3,"ratio":1.5e3}`, map[string]string{"retries": "3", "ratio": "1.5e3"}},
		{"bool", `{"replay":true}`, map[string]string{"replay": "true"}},
		{"object and array kept as JSON text", `{"meta":{"a":1},"tags":["x","y"]}`,
			map[string]string{"meta": `{"a":1}`, "tags": `["x","y"]`}},
		{"escaped string is unescaped", `{"note":"a\"b\u00e9"}`, map[string]string{"note": `a"bé`}},
		{"cannot override Nats-Msg-Id", `{"Nats-Msg-Id":"forged","x":"1"}`,
			map[string]string{HeaderMsgID: "0195b7a4-1b2c-7d3e-8f90-a1b2c3d4e5f6", "x": "1"}},
		{"cannot override Nats-Msg-Id in another case", `{"nats-msg-id":"forged","NATS-MSG-ID":"forged"}`,
			map[string]string{HeaderMsgID: "0195b7a4-1b2c-7d3e-8f90-a1b2c3d4e5f6", "nats-msg-id": "", "NATS-MSG-ID": ""}},
		{"cannot override position headers", `{"Walbox-Commit-Lsn":"FF/0","walbox-txn-index":"9","Walbox-Source":"other"}`,
			map[string]string{HeaderCommitLSN: "16/B374D848", HeaderIndex: "7", HeaderSource: "src", "walbox-txn-index": ""}},
		{"cannot override event headers walbox set", `{"Walbox-Event-Type":"Forged"}`,
			map[string]string{HeaderEventType: "OrderCreated"}},
		{"keys the NATS client refuses are skipped", `{"a b":"1","a:b":"1","a\nb":"1","":"1","a(b)":"1","a/b":"1","ä":"1","ok-key_1.x":"2"}`,
			map[string]string{"a b": "", "a:b": "", "a\nb": "", "a(b)": "", "a/b": "", "ä": "", "ok-key_1.x": "2"}},
		{"values with line breaks are skipped", `{"evil":"a\r\nNats-Msg-Id: forged","good":"g"}`,
			map[string]string{"evil": "", "good": "g", HeaderMsgID: "0195b7a4-1b2c-7d3e-8f90-a1b2c3d4e5f6"}},
		{"empty object", `{}`, map[string]string{HeaderMsgID: "0195b7a4-1b2c-7d3e-8f90-a1b2c3d4e5f6"}},
		// JetStream acts on its own headers: a rollup purges the subject
		// or the stream, an expected last message id that does not match
		// stops a replicated stream, other expectations refuse the message
		// (and hold the relay's window). A row cannot give them.
		{"JetStream's own headers are skipped", `{"Nats-Rollup":"all","Nats-Expected-Last-Msg-Id":"x","nats-expected-stream":"OTHER",` +
			`"Nats-Expected-Last-Subject-Sequence":"1","Nats-TTL":"1s","NATS-Marker-Reason":"Purge","Nats-Batch-Id":"b","traceparent":"t"}`,
			map[string]string{"Nats-Rollup": "", "Nats-Expected-Last-Msg-Id": "", "nats-expected-stream": "", "Nats-Expected-Last-Subject-Sequence": "",
				"Nats-TTL": "", "NATS-Marker-Reason": "", "Nats-Batch-Id": "", "traceparent": "t"}},
		// A consumer fetches the object a claim-check reference names: only
		// the claim check sets one.
		{"a claim-check reference is skipped", `{"Walbox-Claim-Check":"store=jetstream&bucket=B&key=other","walbox-claim-check":"x"}`,
			map[string]string{HeaderClaimCheck: "", "walbox-claim-check": ""}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewRouter("", "src", testRoutes)
			ev := goodEvent()
			ev.Headers = []byte(tt.headers)
			m, _, err := r.Message(ev)
			if err != nil {
				t.Fatalf("Message: %v", err)
			}
			for k, v := range tt.want {
				got, present := m.Header[k]
				switch {
				case v == "" && present:
					t.Errorf("header %q = %q, want it absent", k, got)
				case v != "" && (len(got) != 1 || got[0] != v):
					t.Errorf("header %q = %q, want [%q]", k, got, v)
				}
			}
			if got := m.Header.Values(HeaderMsgID); len(got) != 1 || got[0] != ev.ID {
				t.Errorf("Nats-Msg-Id = %q, want [%q]", got, ev.ID)
			}
			assertNATSAccepts(t, m)
		})
	}
}

func TestMessageHeadersColumnNotAnObjectIsPoison(t *testing.T) {
	for _, h := range []string{`[1,2]`, `"traceparent"`, `42`, `{"a":`, `not json`} {
		t.Run(h, func(t *testing.T) {
			r := NewRouter("", "", testRoutes)
			ev := goodEvent()
			ev.Headers = []byte(h)
			_, _, err := r.Message(ev)
			if !isPoison(err) || !strings.Contains(err.Error(), "headers column") {
				t.Fatalf("Message with headers %s: err = %v, want a PoisonError about the headers column", h, err)
			}
		})
	}
}

// assertNATSAccepts checks that the NATS client would encode m: a zero
// Conn runs the client's subject and header checks first, then refuses
// because it has no server that supports headers.
func assertNATSAccepts(t *testing.T, rm *Msg) {
	m := natsMsg(rm)
	t.Helper()
	err := (&nats.Conn{}).PublishMsg(m)
	if !errors.Is(err, nats.ErrHeadersNotSupported) {
		t.Fatalf("the NATS client refuses the message (%v): headers %v", err, m.Header)
	}
}

func isPoison(err error) bool {
	var pe *PoisonError
	return errors.As(err, &pe) && pe.Reason != ""
}

// poisonReason is err's reason, failing the test unless err is a
// *PoisonError.
func poisonReason(t *testing.T, err error) string {
	t.Helper()
	var pe *PoisonError
	if !errors.As(err, &pe) {
		t.Fatalf("err = %T %v, want a *PoisonError", err, err)
	}
	return pe.Reason
}

func TestMessagePoison(t *testing.T) {
	tests := []struct {
		name   string
		prefix string
		max    int
		edit   func(ev *cdc.Event)
		reason string // substring of the poison reason
	}{
		{"NULL topic", "", 0, func(ev *cdc.Event) { ev.Topic, ev.TopicNull = "", true }, "topic is NULL or empty"},
		{"empty topic", "", 0, func(ev *cdc.Event) { ev.Topic = "" }, "topic is NULL or empty"},
		{"blank topic", "", 0, func(ev *cdc.Event) { ev.Topic = "  " }, "topic is NULL or empty"},
		{"empty topic with a prefix", "app.", 0, func(ev *cdc.Event) { ev.Topic = "" }, "topic is NULL or empty"},
		{"empty id", "", 0, func(ev *cdc.Event) { ev.ID = "" }, "id is NULL or empty"},
		{"id with a trailing blank", "", 0, func(ev *cdc.Event) { ev.ID = "x " }, "cannot travel unchanged in the Nats-Msg-Id header"},
		{"id with a leading tab", "", 0, func(ev *cdc.Event) { ev.ID = "\tx" }, "cannot travel unchanged"},
		{"id with a line break", "", 0, func(ev *cdc.Event) { ev.ID = "x\ny" }, "cannot travel unchanged"},
		{"id with a carriage return", "", 0, func(ev *cdc.Event) { ev.ID = "x\ry" }, "cannot travel unchanged"},
		{"subject with a space", "", 0, func(ev *cdc.Event) { ev.Topic = "orders.created now" }, "invalid subject"},
		{"subject with a tab", "", 0, func(ev *cdc.Event) { ev.Topic = "orders.\tcreated" }, "invalid subject"},
		{"subject with a * wildcard", "", 0, func(ev *cdc.Event) { ev.Topic = "orders.*" }, "invalid subject"},
		{"subject with a > wildcard", "", 0, func(ev *cdc.Event) { ev.Topic = "orders.>" }, "invalid subject"},
		{"subject with an empty token", "", 0, func(ev *cdc.Event) { ev.Topic = "orders..created" }, "invalid subject"},
		{"subject ending in a dot", "", 0, func(ev *cdc.Event) { ev.Topic = "orders." }, "invalid subject"},
		{"no stream captures the subject", "", 0, func(ev *cdc.Event) { ev.Topic = "inventory.reserved" }, `no configured stream captures subject "inventory.reserved"`},
		{"no stream captures the bare token", "", 0, func(ev *cdc.Event) { ev.Topic = "orders" }, "no configured stream captures"},
		{"row names another stream", "", 0, func(ev *cdc.Event) { ev.Stream = "PAYMENTS" },
			`row names stream "PAYMENTS" but subject "orders.created" is captured by stream "ORDERS"`},
		{"row names an unknown stream", "", 0, func(ev *cdc.Event) { ev.Stream = "NOPE" }, `row names stream "NOPE"`},
		{"row names the stream in another case", "", 0, func(ev *cdc.Event) { ev.Stream = "orders" }, `row names stream "orders"`},
		{"NULL payload", "", 0, func(ev *cdc.Event) { ev.Payload, ev.PayloadNull = nil, true }, "payload is NULL"},
		{"invalid JSON in a text payload", "", 0, func(ev *cdc.Event) { ev.Payload, ev.PayloadIsJSON = []byte(`{"order":`), false }, "not valid JSON"},
		{"plain text in a text payload", "", 0, func(ev *cdc.Event) { ev.Payload, ev.PayloadIsJSON = []byte(`hello`), false }, "not valid JSON"},
		{"empty text payload", "", 0, func(ev *cdc.Event) { ev.Payload, ev.PayloadIsJSON = []byte{}, false }, "not valid JSON"},
		{"too large for max payload", "", 1024, func(ev *cdc.Event) { ev.Payload = []byte(`"` + strings.Repeat("x", 2000) + `"`) }, "exceeds the server's max_payload of 1024"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewRouter(tt.prefix, "src", testRoutes)
			r.SetMaxPayload(tt.max)
			ev := goodEvent()
			tt.edit(ev)
			m, stream, err := r.Message(ev)
			if err == nil {
				t.Fatalf("Message = %v (stream %q), want a PoisonError about %q", m.Subject, stream, tt.reason)
			}
			if reason := poisonReason(t, err); !strings.Contains(reason, tt.reason) {
				t.Fatalf("reason = %q, want it to contain %q", reason, tt.reason)
			}
			if m != nil || stream != "" {
				t.Fatalf("poison returned a message (%v) or stream (%q)", m, stream)
			}
		})
	}
}

func TestMessageNotPoison(t *testing.T) {
	tests := []struct {
		name string
		edit func(ev *cdc.Event)
	}{
		{"row names the capturing stream", func(ev *cdc.Event) { ev.Stream = "ORDERS" }},
		{"valid JSON in a text payload", func(ev *cdc.Event) { ev.Payload, ev.PayloadIsJSON = []byte(` [1, "two"] `), false }},
		{"JSON scalar in a text payload", func(ev *cdc.Event) { ev.Payload, ev.PayloadIsJSON = []byte(`"s"`), false }},
		{"json column is trusted as is", func(ev *cdc.Event) { ev.Payload, ev.PayloadIsJSON = []byte(`not json but jsonb said so`), true }},
		{"empty JSON object", func(ev *cdc.Event) { ev.Payload = []byte(`{}`) }},
		{"deep subject", func(ev *cdc.Event) { ev.Topic = "orders.eu.created.v2" }},
		{"wildcard filter with more tokens", func(ev *cdc.Event) { ev.Topic, ev.Stream = "refunds.42.done", "PAYMENTS" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewRouter("", "src", testRoutes)
			ev := goodEvent()
			tt.edit(ev)
			m, _, err := r.Message(ev)
			if err != nil {
				t.Fatalf("Message: %v", err)
			}
			if string(m.Data) != string(ev.Payload) {
				t.Fatalf("data = %q, want %q", m.Data, ev.Payload)
			}
			assertNATSAccepts(t, m)
		})
	}
}

// wireSize is what the server compares with max_payload: headers plus data.
func wireSize(rm *Msg) int {
	m := natsMsg(rm)
	return m.Size() - len(m.Subject) - len(m.Reply)
}

// natsMsg is m as the JetStream sink sends it.
func natsMsg(m *Msg) *nats.Msg {
	return &nats.Msg{Subject: m.Subject, Header: nats.Header(m.Header), Data: m.Data}
}

func TestMessageMaxPayloadCountsHeadersAndData(t *testing.T) {
	r := NewRouter("", "src", testRoutes)
	ev := goodEvent()
	ev.Headers = []byte(`{"traceparent":"00-abc-def-01"}`)
	ev.Payload = []byte(`"` + strings.Repeat("p", 500) + `"`)
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatalf("Message unchecked: %v", err)
	}
	size := wireSize(m)
	if size <= len(ev.Payload) {
		t.Fatalf("wire size %d does not count the headers", size)
	}
	tests := []struct {
		max    int
		poison bool
	}{
		{0, false}, // unchecked
		{size, false},
		{size + 1, false},
		{size - 1, true},
		{len(ev.Payload), true}, // the payload alone fits, the headers do not
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.max), func(t *testing.T) {
			r.SetMaxPayload(tt.max)
			_, _, err := r.Message(ev)
			if tt.poison != isPoison(err) {
				t.Fatalf("max %d (message is %d bytes): err = %v, want poison %v", tt.max, size, err, tt.poison)
			}
		})
	}
}

func TestDeadLetter(t *testing.T) {
	tests := []struct {
		name        string
		prefix      string
		edit        func(ev *cdc.Event)
		wantSubject string
		wantOrig    string
	}{
		{"valid subject without a stream", "", func(ev *cdc.Event) { ev.Topic = "inventory.reserved" },
			"walbox.dlq.inventory.reserved", "inventory.reserved"},
		{"valid subject, routed (e.g. refused by the server)", "", func(ev *cdc.Event) {},
			"walbox.dlq.orders.created", "orders.created"},
		{"with a subject prefix", "app.", func(ev *cdc.Event) {},
			"walbox.dlq.app.orders.created", "app.orders.created"},
		{"NULL topic", "", func(ev *cdc.Event) { ev.Topic, ev.TopicNull = "", true }, "walbox.dlq.invalid", ""},
		{"NULL topic with a prefix", "app.", func(ev *cdc.Event) { ev.Topic, ev.TopicNull = "", true }, "walbox.dlq.invalid", "app."},
		{"empty topic", "", func(ev *cdc.Event) { ev.Topic = "" }, "walbox.dlq.invalid", ""},
		{"subject with a space", "", func(ev *cdc.Event) { ev.Topic = "orders created" }, "walbox.dlq.invalid", "orders created"},
		{"subject with a wildcard", "", func(ev *cdc.Event) { ev.Topic = "orders.*" }, "walbox.dlq.invalid", "orders.*"},
		{"subject with a line break", "", func(ev *cdc.Event) { ev.Topic = "orders\r\nX: y" }, "walbox.dlq.invalid", "orders  X: y"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewRouter(tt.prefix, "db1/walbox", testRoutes)
			ev := goodEvent()
			tt.edit(ev)
			m := r.DeadLetter(ev, "walbox.dlq.", "the reason")
			if m.Subject != tt.wantSubject {
				t.Fatalf("subject = %q, want %q", m.Subject, tt.wantSubject)
			}
			if err := ValidSubject(m.Subject); err != nil {
				t.Fatalf("dead-letter subject %q is itself invalid: %v", m.Subject, err)
			}
			want := map[string]string{
				HeaderDLQReason:          "the reason",
				HeaderDLQOriginalSubject: tt.wantOrig,
				HeaderMsgID:              ev.ID,
				"Walbox-Event-Id":        ev.ID,
				HeaderCommitLSN:          "16/B374D848",
				HeaderIndex:              "7",
				HeaderCommitTime:         "2025-03-04T04:06:07.890123456Z",
				HeaderSource:             "db1/walbox",
			}
			for k, v := range want {
				if got := m.Header.Values(k); len(got) != 1 || got[0] != v {
					t.Errorf("header %s = %q, want [%q]", k, got, v)
				}
			}
			if string(m.Data) != string(ev.Payload) {
				t.Errorf("data = %q, want the original payload", m.Data)
			}
			if _, ok := m.Header["Walbox-Dlq-Payload-Dropped"]; ok {
				t.Error("payload marked dropped without a size limit")
			}
			assertNATSAccepts(t, m)
		})
	}
}

func TestDeadLetterWithoutID(t *testing.T) {
	r := NewRouter("", "", testRoutes)
	ev := goodEvent()
	ev.ID = ""
	m := r.DeadLetter(ev, "walbox.dlq.", "id is NULL or empty")
	for _, k := range []string{HeaderMsgID, "Walbox-Event-Id", HeaderSource} {
		if _, ok := m.Header[k]; ok {
			t.Errorf("header %s set: %q", k, m.Header.Get(k))
		}
	}
	if m.Subject != "walbox.dlq.orders.created" {
		t.Fatalf("subject = %q", m.Subject)
	}
}

func TestDeadLetterCarriesThePoisonReason(t *testing.T) {
	r := NewRouter("", "", testRoutes)
	ev := goodEvent()
	ev.Stream = "PAYMENTS"
	_, _, err := r.Message(ev)
	reason := poisonReason(t, err)
	m := r.DeadLetter(ev, "walbox.dlq.", reason)
	if got := m.Header.Get(HeaderDLQReason); got != reason {
		t.Fatalf("reason header = %q, want %q", got, reason)
	}
	// It keeps what a retry needs to build the event's message again: the
	// topic and the event's own headers (walbox dlq retry).
	if m.Header.Get(HeaderEventType) != ev.EventType || m.Header.Get(HeaderDLQOriginalTopic) != ev.Topic {
		t.Errorf("dead letter lacks the event type or topic: %v", m.Header)
	}
	back := EventFromHeaders(m.Header, m.Header.Get(HeaderDLQOriginalTopic), ev.ID, m.Data)
	if back.EventType != ev.EventType || back.AggregateID != ev.AggregateID || back.Pos != ev.Pos || !back.CommitTime.Equal(ev.CommitTime) {
		t.Errorf("event rebuilt from the dead letter: %+v, want %+v", back, *ev)
	}
}

func TestDeadLetterDropsPayloadWhenTooLarge(t *testing.T) {
	r := NewRouter("", "src", testRoutes)
	ev := goodEvent()
	ev.Payload = []byte(`"` + strings.Repeat("x", 5000) + `"`)
	r.SetMaxPayload(0)
	full := r.DeadLetter(ev, "walbox.dlq.", "too large")
	size := wireSize(full)
	tests := []struct {
		name    string
		max     int
		dropped bool
	}{
		{"unchecked", 0, false},
		{"fits exactly", size, false},
		{"room to spare", size * 2, false},
		{"one byte over", size - 1, true},
		{"far over", 1024, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r.SetMaxPayload(tt.max)
			m := r.DeadLetter(ev, "walbox.dlq.", "too large")
			_, marked := m.Header["Walbox-Dlq-Payload-Dropped"]
			if tt.dropped {
				if len(m.Data) != 0 {
					t.Fatalf("payload of %d bytes kept with max %d", len(m.Data), tt.max)
				}
				if got := m.Header.Get("Walbox-Dlq-Payload-Dropped"); got != fmt.Sprint(len(ev.Payload)) {
					t.Fatalf("Walbox-Dlq-Payload-Dropped = %q, want %d", got, len(ev.Payload))
				}
				if wireSize(m) > tt.max {
					t.Fatalf("dead letter is %d bytes, still over max %d", wireSize(m), tt.max)
				}
			} else {
				if marked || string(m.Data) != string(ev.Payload) {
					t.Fatalf("payload dropped (marked %v, %d bytes) with max %d for a %d-byte message", marked, len(m.Data), tt.max, size)
				}
			}
			if m.Header.Get(HeaderDLQReason) != "too large" || m.Header.Get(HeaderMsgID) != ev.ID {
				t.Fatalf("headers lost: %v", m.Header)
			}
		})
	}
}

func TestPoisonErrorMessage(t *testing.T) {
	err := poison("payload is %s", "NULL")
	if got := err.Error(); got != "undeliverable event: payload is NULL" {
		t.Fatalf("Error() = %q", got)
	}
}

func TestDeadLetterOfAnIDNoHeaderCarries(t *testing.T) {
	r := NewRouter("", "src", testRoutes)
	ev := goodEvent()
	ev.ID = "x "
	m := r.DeadLetter(ev, "walbox.dlq.", "bad id")
	if _, ok := m.Header[HeaderMsgID]; ok {
		t.Fatalf("dead letter of id %q carries Nats-Msg-Id %q: it could collide with id \"x\"", ev.ID, m.Header.Get(HeaderMsgID))
	}
	if got := m.Header.Get("Walbox-Event-Id-Quoted"); got != `"x "` {
		t.Fatalf("Walbox-Event-Id-Quoted = %s, want the exact id quoted", got)
	}
	ev.ID = "x"
	if _, _, err := r.Message(ev); err != nil {
		t.Fatalf("id %q: %v", ev.ID, err)
	}
}

// TestRecycledMessagesCarryOnlyTheirOwnHeaders: a message built from a
// recycled one has exactly the headers a fresh router gives the same event,
// whatever the events before it carried (optional headers that come and go,
// an origin that changes, the sink's expected sequence, a headers column,
// an envelope's headers).
func TestRecycledMessagesCarryOnlyTheirOwnHeaders(t *testing.T) {
	reused := NewRouter("", "src", testRoutes)
	for i := range 400 {
		ev := goodEvent()
		ev.ID = fmt.Sprintf("e%d", i)
		ev.Pos.Index = uint32(i)
		ev.CommitTime = time.Unix(int64(i/7), 0)
		ev.EventType, ev.AggregateType, ev.AggregateID, ev.PartitionKey = "", "", "", ""
		if i%2 == 0 {
			ev.EventType = fmt.Sprintf("type%d", i)
		}
		if i%3 == 0 {
			ev.AggregateType, ev.AggregateID = "order", fmt.Sprint(i)
		}
		if i%5 == 0 {
			ev.PartitionKey = "k"
		}
		if i%11 == 0 {
			ev.Headers = []byte(`{"trace":"t` + fmt.Sprint(i) + `"}`)
		}
		var origin *cdc.Origin
		if i%13 != 0 {
			origin = &cdc.Origin{SystemID: "7441", Timeline: int32(1 + i/100)}
		}
		reused.SetOrigin(origin)
		fresh := NewRouter("", "src", testRoutes)
		fresh.SetOrigin(origin)
		want, _, err := fresh.Message(ev)
		if err != nil {
			t.Fatal(err)
		}
		got, _, err := reused.Message(ev)
		if err != nil {
			t.Fatal(err)
		}
		if g, w := got.headerSize(), headerSize(want.Header); g != w {
			t.Fatalf("event %d: header size %d, want %d", i, g, w)
		}
		// The sink sends every other message with an expected sequence,
		// as the JetStream sink does, and never with the previous one's.
		expect := ""
		if i%4 < 2 {
			expect = fmt.Sprint(i)
		}
		got.SetHeader(HeaderExpectedLastSeq, expect)
		want.SetHeader(HeaderExpectedLastSeq, expect)
		if !maps.EqualFunc(got.Header, want.Header, slices.Equal) {
			t.Fatalf("event %d: headers\n%v\nwant\n%v", i, got.Header, want.Header)
		}
		if i%17 != 0 { // some are never handed back
			reused.Recycle(got)
		}
	}
	if len(reused.free) == 0 {
		t.Fatal("no message was recycled")
	}
}

// BenchmarkRouterMessage builds the message of a typical event (the
// benchmark's: a uuid, a two-token topic, a 200-byte JSON payload), sets
// the expected sequence as the sink does and hands it back as the relay
// does once its ack resolved.
func BenchmarkRouterMessage(b *testing.B) {
	r := NewRouter("", "db1/walbox", testRoutes)
	r.SetOrigin(&cdc.Origin{SystemID: "7441234567890123456", Timeline: 1})
	r.SetMaxPayload(1 << 20) // as the relay sets it from the server's max_payload
	ev := cdc.Event{ID: "0193a4b2-7c1d-7e3f-9a8b-1c2d3e4f5a6b", Topic: "orders.created", EventType: "OrderCreated",
		AggregateType: "order", AggregateID: "4711", Payload: []byte(`{"order":4711,"note":"` + strings.Repeat("x", 170) + `"}`),
		PayloadIsJSON: true, CommitTime: time.Unix(1_780_000_000, 123456000)}
	b.ReportAllocs()
	for i := range b.N {
		ev.Pos.CommitLSN, ev.Pos.Index = cdc.LSN(0x16B3748+i/10*256), uint32(i%10)
		m, _, err := r.Message(&ev)
		if err != nil {
			b.Fatal(err)
		}
		m.SetHeader(HeaderExpectedLastSeq, "4711") // as the JetStream sink sends it (nats.strict_order)
		r.Recycle(m)
	}
}

// With the claim check on, a payload above its threshold travels apart: the
// size check counts the reference, so the event is not poison for its
// payload; headers that alone exceed the limit still are.
func TestClaimedPayloadIsNotTooLarge(t *testing.T) {
	r := NewRouter("", "src", testRoutes)
	r.SetMaxPayload(4096)
	ev := goodEvent()
	ev.Payload = []byte(`"` + strings.Repeat("x", 10000) + `"`)
	if _, _, err := r.Message(ev); err == nil || !strings.Contains(err.Error(), "max_payload") {
		t.Fatalf("without the claim check: %v, want too large", err)
	}
	r.SetClaimThreshold(2048)
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatalf("with the claim check: %v", err)
	}
	if len(m.Data) != len(ev.Payload) {
		t.Fatal("the router must leave the payload to the claim-check sink")
	}
	r.SetMaxPayload(ClaimRefAllowance) // no room for the headers beside the reference
	if _, _, err := r.Message(ev); err == nil {
		t.Fatal("headers and reference over max_payload passed")
	}
}
