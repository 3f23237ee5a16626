package outbox

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

func TestParseTableName(t *testing.T) {
	for in, want := range map[string]string{
		"outbox_events":        `"outbox_events"`,
		"public.outbox_events": `"public"."outbox_events"`,
		`app."My.Table"`:       `"app"."My.Table"`,
		`"a""b".c`:             `"a""b"."c"`,
	} {
		id, err := parseTableName(in)
		if err != nil || id.Sanitize() != want {
			t.Errorf("parseTableName(%q) = %s, %v; want %s", in, id.Sanitize(), err, want)
		}
	}
	for _, bad := range []string{"", "a.b.c", `"unterminated`, "a..b", "has space", `"x"y`, "a."} {
		if id, err := parseTableName(bad); err == nil {
			t.Errorf("parseTableName(%q) = %v, want an error", bad, id)
		}
	}
}

func TestInsertStatement(t *testing.T) {
	w, err := New(WithTable("app.events"), WithColumns(map[string]string{"headers": "", "stream": ""}))
	if err != nil {
		t.Fatal(err)
	}
	rows := [][]any{make([]any, len(w.cols)), make([]any, len(w.cols))}
	q, args := w.insert(rows)
	want := `INSERT INTO "app"."events" ("id", "topic", "payload", "event_type", "aggregate_type", "aggregate_id", "partition_key") VALUES ($1, $2, $3, $4, $5, $6, $7), ($8, $9, $10, $11, $12, $13, $14)`
	if q != want || len(args) != 14 {
		t.Errorf("insert =\n%s (%d args)\nwant\n%s", q, len(args), want)
	}
}

func TestRowValues(t *testing.T) {
	w, err := New()
	if err != nil {
		t.Fatal(err)
	}
	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: traceID, SpanID: spanID}))
	tr := w.traceHeaders(ctx)
	if tr["traceparent"] != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00" {
		t.Fatalf("trace headers %v", tr)
	}
	if got := w.traceHeaders(context.Background()); len(got) != 0 {
		t.Errorf("trace headers without a span: %v", got)
	}

	// The caller's traceparent wins over ctx's; partition key from aggregate id.
	row, err := w.row(&Event{Topic: "t", AggregateID: "a-1", Payload: json.RawMessage(` {"x": 1} `),
		Headers: map[string]string{"Traceparent": "mine"}}, tr)
	if err != nil {
		t.Fatal(err)
	}
	byRole := map[role]any{}
	for i, r := range w.roles {
		byRole[r] = row[i]
	}
	if byRole[rolePartitionKey] != "a-1" || byRole[roleAggregateID] != "a-1" || byRole[roleEventType] != nil || byRole[roleStream] != nil {
		t.Errorf("row %v", byRole)
	}
	if byRole[rolePayload] != ` {"x": 1} ` {
		t.Errorf("raw payload changed: %q", byRole[rolePayload])
	}
	if h := byRole[roleHeaders].(string); !strings.Contains(h, `"Traceparent":"mine"`) || strings.Contains(h, "4bf92f") {
		t.Errorf("headers %s", h)
	}
	if id := byRole[roleID].(string); len(id) != 36 || id[14] != '7' {
		t.Errorf("generated id %q is not a UUIDv7", id)
	}

	// A Go string payload is a JSON string; no headers is NULL.
	row, err = w.row(&Event{ID: "given", Topic: "t", PartitionKey: "pk", AggregateID: "a", Payload: "hi"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range w.roles {
		byRole[r] = row[i]
	}
	if byRole[rolePayload] != `"hi"` || byRole[roleHeaders] != nil || byRole[roleID] != "given" || byRole[rolePartitionKey] != "pk" {
		t.Errorf("row %v", byRole)
	}
}

func TestOptions(t *testing.T) {
	for _, opt := range []Option{WithTable("a.b.c"), WithMaxLag(-1), WithSlot(""), WithPropagator(nil),
		WithColumns(map[string]string{"id": ""}), WithColumns(map[string]string{"nope": "x"})} {
		if _, err := New(opt); err == nil {
			t.Errorf("option accepted")
		}
	}
	w, err := New(nil, WithPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})))
	if err != nil || w == nil {
		t.Fatal(err)
	}
}
