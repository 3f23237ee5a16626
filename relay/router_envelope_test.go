package relay

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/cdc"
)

func newOptRouter(t *testing.T, prefix string, routes []Route, o RouterOptions) *Router {
	t.Helper()
	r, err := NewRouterWithOptions(prefix, "db1/walbox", routes, o)
	if err != nil {
		t.Fatalf("NewRouterWithOptions(%+v): %v", o, err)
	}
	return r
}

// ownHeaders are walbox's own headers for goodEvent ev.
func ownHeaders(ev *cdc.Event) map[string]string {
	return map[string]string{
		HeaderMsgID:         ev.ID,
		HeaderCommitLSN:     "16/B374D848",
		HeaderIndex:         "7",
		HeaderSource:        "db1/walbox",
		HeaderCommitTime:    "2025-03-04T04:06:07.890123456Z",
		HeaderEventType:     "OrderCreated",
		HeaderAggregateType: "order",
		HeaderAggregateID:   "o-42",
		HeaderPartitionKey:  "customer-7",
	}
}

// wantOwnHeaders checks walbox's own headers are on m whatever the envelope.
func wantOwnHeaders(t *testing.T, m *Msg, ev *cdc.Event) {
	t.Helper()
	for k, v := range ownHeaders(ev) {
		if got := m.Header.Values(k); len(got) != 1 || got[0] != v {
			t.Errorf("header %s = %q, want [%q]", k, got, v)
		}
	}
}

func TestNewRouterWithZeroOptionsMatchesNewRouter(t *testing.T) {
	a := NewRouter("app.", "db1/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"app.orders.>"}}})
	b := newOptRouter(t, "app.", []Route{{Stream: "ORDERS", Subjects: []string{"app.orders.>"}}}, RouterOptions{})
	ev := goodEvent()
	ma, sa, errA := a.Message(ev)
	mb, sb, errB := b.Message(ev)
	if errA != nil || errB != nil {
		t.Fatalf("errors %v, %v", errA, errB)
	}
	if ma.Subject != mb.Subject || sa != sb || string(ma.Data) != string(mb.Data) || len(ma.Header) != len(mb.Header) {
		t.Fatalf("NewRouter gives %s/%s %q %v; with zero options %s/%s %q %v", sa, ma.Subject, ma.Data, ma.Header, sb, mb.Subject, mb.Data, mb.Header)
	}
	if string(mb.Data) != `{"order":42}` || mb.Header.Get(HeaderCESpecVersion) != "" || mb.Header.Get(HeaderContentType) != "" {
		t.Fatalf("raw envelope changed the message: %q %v", mb.Data, mb.Header)
	}
}

func TestNewRouterWithOptionsRejectsBadOptions(t *testing.T) {
	for _, o := range []RouterOptions{
		{SubjectTemplate: "{topic}.{shard}"},
		{SubjectTemplate: "{topic"},
		{SubjectTemplate: "topic}"},
		{SubjectTemplate: "{topic}..x"},
		{SubjectTemplate: "{topic}.*"},
		{Envelope: "protobuf"},
		{PartitionBuckets: -1},
		{Rules: []RoutingRule{{TopicPrefix: "", Stream: "ORDERS"}}},
		{Rules: []RoutingRule{{TopicPrefix: "orders.", Stream: ""}}},
	} {
		if _, err := NewRouterWithOptions("", "", testRoutes, o); err == nil {
			t.Errorf("NewRouterWithOptions(%+v): no error", o)
		}
	}
}

func TestValidateSubjectTemplate(t *testing.T) {
	for _, ok := range []string{"{topic}", "{topic}.{bucket}", "{topic}.{partition}", "x.{event_type}.{aggregate_type}.{topic}", "{topic}.b{bucket}"} {
		if err := ValidateSubjectTemplate(ok); err != nil {
			t.Errorf("ValidateSubjectTemplate(%q): %v", ok, err)
		}
	}
	err := ValidateSubjectTemplate("{topic}.{shard}")
	if err == nil || !strings.Contains(err.Error(), "{shard}") {
		t.Fatalf("unknown placeholder: err = %v, want one naming {shard}", err)
	}
	if err := ValidateSubjectTemplate(""); err == nil {
		t.Fatal("empty template: no error")
	}
}

// SubjectFilter captures every subject a table's events of a topic pattern
// get from that table's template, or is "" where no filter can (replay's
// read-back then reads every subject).
func TestSubjectFilterFollowsTheTablesTemplate(t *testing.T) {
	r := NewRouter("app.", "db/slot", nil)
	for i, tmpl := range []string{"", "billing.{topic}.{bucket}", "outbox.event.{topic}", "{event_type}.{topic}", "{topic}.b{bucket}", "{topic}.x"} {
		if err := r.SetTable(i, RouterOptions{SubjectTemplate: tmpl, Table: fmt.Sprintf("public.t%d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		table       int
		topic, want string
		subject     *cdc.Event // an event of the table whose subject the filter must capture
	}{
		{0, "", "", nil},
		{0, "orders.*", "app.orders.*", &cdc.Event{Topic: "orders.created"}},
		{0, "orders.>", "app.orders.>", &cdc.Event{Topic: "orders.eu.created"}},
		{1, "invoices.*", "app.billing.invoices.*.*", &cdc.Event{Topic: "invoices.paid", AggregateID: "inv-1"}},
		{1, "invoices.>", "", nil}, // > before the bucket token
		{2, "Order", "app.outbox.event.Order", &cdc.Event{Topic: "Order"}},
		{3, "orders.*", "", nil}, // event_type may hold dots
		{4, "orders.*", "", nil}, // the bucket is part of a token
		{5, "*", "app.*.x", &cdc.Event{Topic: "orders"}},
		{9, "orders.*", "app.orders.*", nil}, // an unknown index: the first table's
	} {
		got := r.SubjectFilter(c.table, c.topic)
		if got != c.want {
			t.Errorf("SubjectFilter(%d, %q) = %q, want %q", c.table, c.topic, got, c.want)
			continue
		}
		if c.subject != nil {
			ev := *c.subject
			ev.Table = c.table
			if subj := r.shapeFor(c.table).subject(r.prefix, &ev); !SubjectMatches(got, subj) {
				t.Errorf("filter %q misses the subject %q of table %d", got, subj, c.table)
			}
		}
	}
}

func TestSubjectTemplatePartitionAndBucket(t *testing.T) {
	r := newOptRouter(t, "app.", []Route{{Stream: "ORDERS", Subjects: []string{"app.orders.>"}}},
		RouterOptions{SubjectTemplate: "{topic}.{partition}.{bucket}", PartitionBuckets: 8})
	ev := goodEvent()
	m, stream, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	h := fnv.New32a()
	h.Write([]byte("customer-7"))
	wantBucket := strconv.FormatUint(uint64(h.Sum32()%8), 10)
	if want := "app.orders.created.customer-7." + wantBucket; m.Subject != want || stream != "ORDERS" {
		t.Fatalf("subject %q in %s, want %q in ORDERS", m.Subject, stream, want)
	}
	// Same key, other event: same subject.
	ev2 := goodEvent()
	ev2.ID, ev2.AggregateID, ev2.Payload = "other", "o-43", []byte(`{"order":43}`)
	m2, _, err := r.Message(ev2)
	if err != nil {
		t.Fatal(err)
	}
	if m2.Subject != m.Subject {
		t.Fatalf("same partition key gave %q and %q", m.Subject, m2.Subject)
	}
	// Every bucket is below the modulus, and keys spread over them.
	seen := map[string]bool{}
	for i := range 200 {
		e := goodEvent()
		e.PartitionKey = "k" + strconv.Itoa(i)
		mm, _, err := r.Message(e)
		if err != nil {
			t.Fatal(err)
		}
		tok := mm.Subject[strings.LastIndexByte(mm.Subject, '.')+1:]
		n, err := strconv.Atoi(tok)
		if err != nil || n < 0 || n >= 8 {
			t.Fatalf("bucket token %q of %q is not in [0,8)", tok, mm.Subject)
		}
		seen[tok] = true
	}
	if len(seen) != 8 {
		t.Errorf("200 keys fell in %d of 8 buckets", len(seen))
	}
}

func TestSubjectTemplatePartitionFallbackAndSanitization(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{SubjectTemplate: "{topic}.{partition}"})
	tests := []struct {
		name, key, aggID, want string
	}{
		{"partition key", "customer-7", "o-42", "orders.created.customer-7"},
		{"falls back to aggregate id", "", "o-42", "orders.created.o-42"},
		{"neither: underscore", "", "", "orders.created._"},
		{"dots, spaces and wildcards replaced", "a.b c*d>e/f", "", "orders.created.a_b_c_d_e_f"},
		{"underscore and dash kept", "A_z-9", "", "orders.created.A_z-9"},
		{"non-ASCII replaced by byte", "é", "", "orders.created.__"},
		{"sanitized aggregate id", "", "tenant:1/o.42", "orders.created.tenant_1_o_42"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ev := goodEvent()
			ev.PartitionKey, ev.AggregateID = tt.key, tt.aggID
			m, _, err := r.Message(ev)
			if err != nil {
				t.Fatal(err)
			}
			if m.Subject != tt.want {
				t.Fatalf("subject = %q, want %q", m.Subject, tt.want)
			}
		})
	}
}

func TestSubjectTemplateBucketUsesAggregateIDWithoutPartitionKey(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{SubjectTemplate: "{topic}.{bucket}"})
	a, b := goodEvent(), goodEvent()
	a.PartitionKey, a.AggregateID = "", "o-42"
	b.PartitionKey, b.AggregateID = "o-42", "other"
	ma, _, errA := r.Message(a)
	mb, _, errB := r.Message(b)
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	want := "orders.created." + strconv.FormatUint(uint64(Bucket("o-42", DefaultPartitionBuckets)), 10)
	if ma.Subject != want || mb.Subject != want {
		t.Fatalf("subjects %q, %q, want both %q", ma.Subject, mb.Subject, want)
	}
}

func TestSubjectTemplateEventAndAggregateType(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{SubjectTemplate: "{topic}.{aggregate_type}.{event_type}"})
	ev := goodEvent()
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	if m.Subject != "orders.created.order.OrderCreated" {
		t.Fatalf("subject = %q", m.Subject)
	}
	ev.EventType, ev.AggregateType = "", ""
	if m, _, err = r.Message(ev); err != nil || m.Subject != "orders.created._._" {
		t.Fatalf("empty types: subject %v, err %v; want orders.created._._", m, err)
	}
}

func TestSubjectTemplateDeadLetterUsesTheSubject(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{SubjectTemplate: "{topic}.{partition}"})
	ev := goodEvent()
	dl := r.DeadLetter(ev, "walbox.dlq.", "test")
	if dl.Subject != "walbox.dlq.orders.created.customer-7" || dl.Header.Get(HeaderDLQOriginalSubject) != "orders.created.customer-7" {
		t.Fatalf("dead letter %q, original %q", dl.Subject, dl.Header.Get(HeaderDLQOriginalSubject))
	}
}

var agentRoutes = []Route{
	{Stream: "AGENT_RUN", Subjects: []string{"agent.run.>"}},
	{Stream: "AGENT", Subjects: []string{"agent.>"}},
}

func TestRoutingRuleMismatchIsPoison(t *testing.T) {
	// agent.run.* is captured by AGENT_RUN first; the rule for "agent.tool."
	// wants AGENT_RUN but AGENT captures it.
	r := newOptRouter(t, "", agentRoutes, RouterOptions{Rules: []RoutingRule{
		{TopicPrefix: "agent.run.", Stream: "AGENT_RUN"},
		{TopicPrefix: "agent.tool.", Stream: "AGENT_RUN"},
	}})
	ev := goodEvent()
	ev.Topic = "agent.tool.called"
	_, _, err := r.Message(ev)
	reason := poisonReason(t, err)
	for _, want := range []string{"agent.tool.called", `"agent.tool."`, "nats.routes", `"AGENT_RUN"`, `"AGENT"`} {
		if !strings.Contains(reason, want) {
			t.Errorf("reason %q does not mention %s", reason, want)
		}
	}
	// The rule is met: published.
	wantStream(t, r, ev, "agent.run.started", "AGENT_RUN")
	// No rule applies: the stream that captures it.
	wantStream(t, r, ev, "agent.other", "AGENT")
}

// wantJSONStrings checks that each key of want is a JSON string in got
// with want's value.
func wantJSONStrings(t *testing.T, got map[string]json.RawMessage, want map[string]string) {
	t.Helper()
	for k, v := range want {
		var s string
		if err := json.Unmarshal(got[k], &s); err != nil || s != v {
			t.Errorf("%s = %s, want %q", k, got[k], v)
		}
	}
}

// wantJSONObject decodes data as a JSON object and wants the string fields
// of want in it and, besides them, exactly the fields others. It returns
// the object.
func wantJSONObject(t *testing.T, data []byte, want map[string]string, others ...string) map[string]json.RawMessage {
	t.Helper()
	var got map[string]json.RawMessage
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatalf("data is not a JSON object: %v: %s", err, data)
	}
	wantJSONStrings(t, got, want)
	for _, k := range others {
		if _, ok := got[k]; !ok {
			t.Errorf("fields %s lack %s", data, k)
		}
	}
	if len(got) != len(want)+len(others) {
		t.Errorf("fields %s, want exactly %v and %v", data, want, others)
	}
	return got
}

// wantStream routes ev with topic and wants it published to stream.
func wantStream(t *testing.T, r *Router, ev *cdc.Event, topic, stream string) {
	t.Helper()
	ev.Topic = topic
	if _, got, err := r.Message(ev); err != nil || got != stream {
		t.Fatalf("%s: stream %q, err %v; want %s", topic, got, err, stream)
	}
}

func TestRoutingRuleLongestPrefixWinsAndAppliesToTheTopic(t *testing.T) {
	routes := []Route{{Stream: "RUN", Subjects: []string{"p.agent.run.>"}}, {Stream: "AGENT", Subjects: []string{"p.agent.>"}}}
	r := newOptRouter(t, "p.", routes, RouterOptions{SubjectTemplate: "{topic}.{bucket}", Rules: []RoutingRule{
		{TopicPrefix: "agent.", Stream: "AGENT"},
		{TopicPrefix: "agent.run.", Stream: "RUN"},
	}})
	ev := goodEvent()
	wantStream(t, r, ev, "agent.run.x", "RUN")
	wantStream(t, r, ev, "agent.y", "AGENT")
}

func TestCloudEventsBinary(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{Envelope: EnvelopeCloudEvents})
	ev := goodEvent()
	ev.Headers = []byte(`{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","ce-id":"spoof"}`)
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	if string(m.Data) != `{"order":42}` {
		t.Fatalf("data = %q, want the payload", m.Data)
	}
	want := map[string]string{
		"ce-specversion":     "1.0",
		"ce-id":              ev.ID,
		"ce-type":            "OrderCreated",
		"ce-source":          "walbox/db1/walbox",
		"ce-time":            "2025-03-04T04:06:07.890123456Z",
		"ce-subject":         "o-42",
		"ce-datacontenttype": "application/json",
		"traceparent":        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
	}
	for k, v := range want {
		if got := m.Header.Values(k); len(got) != 1 || got[0] != v {
			t.Errorf("header %s = %q, want [%q]", k, got, v)
		}
	}
	wantOwnHeaders(t, m, ev)
	tm, err := time.Parse(time.RFC3339Nano, m.Header.Get("ce-time"))
	if err != nil || !tm.Equal(commitTime) {
		t.Errorf("ce-time %q parses to %v (%v), want %v", m.Header.Get("ce-time"), tm, err, commitTime)
	}
}

func TestCloudEventsBinaryFallbacksAndSource(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{Envelope: EnvelopeCloudEvents, CloudEventsSource: "urn:app:orders"})
	ev := goodEvent()
	ev.EventType, ev.AggregateID = "", ""
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Header.Get("ce-type"); got != "orders.created" {
		t.Errorf("ce-type = %q, want the topic", got)
	}
	if got := m.Header.Get("ce-source"); got != "urn:app:orders" {
		t.Errorf("ce-source = %q, want the configured source", got)
	}
	if _, ok := m.Header["ce-subject"]; ok {
		t.Errorf("ce-subject set without an aggregate id: %q", m.Header.Values("ce-subject"))
	}
}

func TestCloudEventsStructured(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{Envelope: EnvelopeCloudEventsStructured})
	ev := goodEvent()
	ev.Payload = []byte(`{"order": 42, "items": ["a", "b"], "note": "x\"y"}`)
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Header.Get("Content-Type"); got != "application/cloudevents+json" {
		t.Errorf("Content-Type = %q", got)
	}
	if m.Header.Get("ce-id") != "" {
		t.Errorf("structured mode set ce-* headers: %v", m.Header)
	}
	wantOwnHeaders(t, m, ev)
	got := wantJSONObject(t, m.Data, map[string]string{
		"specversion":     "1.0",
		"id":              ev.ID,
		"type":            "OrderCreated",
		"source":          "walbox/db1/walbox",
		"time":            "2025-03-04T04:06:07.890123456Z",
		"subject":         "o-42",
		"datacontenttype": "application/json",
	}, "data")
	// data is the payload as JSON, byte for byte, not a string holding it.
	if string(got["data"]) != string(ev.Payload) {
		t.Fatalf("data = %s, want the payload %s", got["data"], ev.Payload)
	}
	var data struct {
		Order int      `json:"order"`
		Items []string `json:"items"`
		Note  string   `json:"note"`
	}
	if err := json.Unmarshal(got["data"], &data); err != nil || data.Order != 42 || len(data.Items) != 2 || data.Note != `x"y` {
		t.Fatalf("data %s decodes to %+v (%v)", got["data"], data, err)
	}
	// Without an aggregate id, no subject.
	ev.AggregateID = ""
	m, _, _ = r.Message(ev)
	got = nil
	if err := json.Unmarshal(m.Data, &got); err != nil {
		t.Fatal(err)
	}
	if _, ok := got["subject"]; ok {
		t.Errorf("subject present without an aggregate id: %s", m.Data)
	}
}

func TestWalboxEnvelope(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{Envelope: EnvelopeWalbox})
	ev := goodEvent()
	ev.Headers = []byte(`{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","correlation_id":"corr-9","tenant":"t1","attempt":3,"flags":{"a":true}}`)
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	wantOwnHeaders(t, m, ev)
	if got := m.Header.Get("correlation_id"); got != "corr-9" {
		t.Errorf("headers column no longer copied to headers: correlation_id = %q", got)
	}
	got := wantJSONObject(t, m.Data, map[string]string{
		"event_id":       ev.ID,
		"event_type":     "OrderCreated",
		"aggregate_type": "order",
		"aggregate_id":   "o-42",
		"timestamp":      "2025-03-04T04:06:07.890123456Z",
	}, "payload", "metadata")
	if !json.Valid(m.Data) || string(got["payload"]) != `{"order":42}` {
		t.Errorf("payload = %s, want the raw payload object", got["payload"])
	}
	var md map[string]string
	if err := json.Unmarshal(got["metadata"], &md); err != nil {
		t.Fatalf("metadata %s is not an object of strings: %v", got["metadata"], err)
	}
	wantMD := map[string]string{
		"trace_id":       "4bf92f3577b34da6a3ce929d0e0e4736",
		"correlation_id": "corr-9",
		"traceparent":    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"tenant":         "t1",
		"attempt":        "3",
		"flags":          `{"a":true}`,
	}
	if len(md) != len(wantMD) {
		t.Errorf("metadata = %v, want %v", md, wantMD)
	}
	for k, v := range wantMD {
		if md[k] != v {
			t.Errorf("metadata[%s] = %q, want %q", k, md[k], v)
		}
	}
}

func TestWalboxEnvelopeWithoutHeadersOrTraceparent(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{Envelope: EnvelopeWalbox})
	ev := goodEvent()
	ev.EventType, ev.AggregateType, ev.AggregateID = "", "", ""
	ev.Payload = []byte(`[1, 2, 3]`)
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	var env Envelope
	if err := json.Unmarshal(m.Data, &env); err != nil {
		t.Fatal(err)
	}
	if env.EventID != ev.ID || env.EventType != "" || env.AggregateID != "" || string(env.Payload) != `[1, 2, 3]` || len(env.Metadata) != 0 {
		t.Fatalf("envelope = %+v (%s)", env, m.Data)
	}
	if !strings.Contains(string(m.Data), `"metadata":{}`) {
		t.Errorf("metadata not an empty object: %s", m.Data)
	}
	// A malformed traceparent gives no trace_id; the key itself is kept.
	ev.Headers = []byte(`{"traceparent":"garbage"}`)
	m, _, err = r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	env = Envelope{}
	if err := json.Unmarshal(m.Data, &env); err != nil {
		t.Fatal(err)
	}
	if _, ok := env.Metadata["trace_id"]; ok || env.Metadata["traceparent"] != "garbage" {
		t.Fatalf("metadata = %v", env.Metadata)
	}
}

func TestEnvelopeCountsTowardsMaxPayload(t *testing.T) {
	r := newOptRouter(t, "", testRoutes, RouterOptions{Envelope: EnvelopeWalbox})
	ev := goodEvent()
	raw, _, err := NewRouter("", "db1/walbox", testRoutes).Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	// Room for the raw message but not for the envelope around it.
	r.SetMaxPayload(len(raw.Data) + headerSize(raw.Header) + 10)
	_, _, err = r.Message(ev)
	if reason := poisonReason(t, err); !strings.Contains(reason, "max_payload") {
		t.Fatalf("reason %q, want one about max_payload", reason)
	}
}
