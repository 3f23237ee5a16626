package outboxlibtest

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/otlptest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/outbox"
)

// publishSpan is the relay's span of the event with id, once received.
func publishSpan(rcv *otlptest.Receiver, id string) *tracepb.Span {
	for _, s := range rcv.Spans() {
		if s.Name == "walbox publish" && spanAttr(s, "messaging.message.id") == id {
			return s
		}
	}
	return nil
}

func spanAttr(s *tracepb.Span, key string) string {
	for _, kv := range s.Attributes {
		if kv.Key == key {
			switch v := kv.Value.Value.(type) {
			case *commonpb.AnyValue_StringValue:
				return v.StringValue
			}
			b, _ := json.Marshal(kv.Value)
			return string(b)
		}
	}
	return ""
}

// TestOneTraceFromProducerThroughRelayToConsumer: a producer's span writes
// its event with the outbox library; the relay, exporting to an OTLP/HTTP
// receiver, publishes it in a "walbox publish" span, child of the
// producer's; the consumer library's span is the publish span's child. An
// event no stream captures is dead-lettered in a span that says why.
func TestOneTraceFromProducerThroughRelayToConsumer(t *testing.T) {
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "100") // the relay's batch exporter: every 100 ms
	rcv := otlptest.New(t)
	e := newEnv(t)
	srv := natstest.New(t)
	_, js := relaytest.JetStream(t, srv.URL())
	relaytest.StartUsersRelay(t, e.dbURL, srv.URL(), func(cfg *config.Config) { cfg.OTel.Endpoint = rcv.URL })
	ctx := relaytest.Ctx(t)

	producerSpans := tracetest.NewInMemoryExporter()
	producer := sdktrace.NewTracerProvider(sdktrace.WithSyncer(producerSpans))
	pctx, pspan := producer.Tracer("signup").Start(ctx, "sign up")
	id, lost := outbox.NewID(), outbox.NewID()
	tx := e.begin(pctx)
	for _, ev := range []outbox.Event{{ID: id, Topic: "user.created", Payload: json.RawMessage(`{"user_id":"u-1"}`)},
		{ID: lost, Topic: "nowhere.created", Payload: json.RawMessage(`{}`)}} {
		if err := outbox.Write(pctx, tx, ev); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(pctx); err != nil {
		t.Fatal(err)
	}
	pspan.End()

	if err := consumer.Migrate(ctx, e.pool); err != nil {
		t.Fatal(err)
	}
	consumerSpans := tracetest.NewInMemoryExporter()
	handled := make(chan struct{}, 1)
	cctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		_ = consumer.Run(cctx, js, consumer.Config{Stream: "USERS", Durable: "accounts", DB: e.pool,
			TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSyncer(consumerSpans))},
			func(context.Context, pgx.Tx, consumer.Message) error {
				select {
				case handled <- struct{}{}:
				default:
				}
				return nil
			})
	}()
	select {
	case <-handled:
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer handled nothing")
	}
	var pub, dead *tracepb.Span
	relaytest.Eventually(t, 30*time.Second, "the relay's spans exported", func() bool {
		pub, dead = publishSpan(rcv, id), publishSpan(rcv, lost)
		return pub != nil && dead != nil
	})
	relaytest.Eventually(t, 10*time.Second, "the consumer's span ended", func() bool { return len(consumerSpans.GetSpans()) > 0 })

	ps := producerSpans.GetSpans()[0].SpanContext
	if hex.EncodeToString(pub.TraceId) != ps.TraceID().String() || hex.EncodeToString(pub.ParentSpanId) != ps.SpanID().String() {
		t.Fatalf("publish span trace %x parent %x, want the producer's trace %s and span %s", pub.TraceId, pub.ParentSpanId, ps.TraceID(), ps.SpanID())
	}
	if pub.Kind != tracepb.Span_SPAN_KIND_PRODUCER {
		t.Fatalf("publish span kind %v", pub.Kind)
	}
	for k, want := range map[string]string{"messaging.system": "nats", "messaging.destination.name": "user.created", "walbox.stream": "USERS"} {
		if got := spanAttr(pub, k); got != want {
			t.Errorf("publish span: %s = %q, want %q", k, got, want)
		}
	}
	cs := consumerSpans.GetSpans()[0]
	if cs.Parent.TraceID() != ps.TraceID() || hex.EncodeToString(pub.SpanId) != cs.Parent.SpanID().String() {
		t.Fatalf("consumer span parent %v, want the publish span %x of trace %s", cs.Parent, pub.SpanId, ps.TraceID())
	}
	if dead.Status.GetCode() != tracepb.Status_STATUS_CODE_ERROR || spanAttr(dead, "walbox.dead_letter.reason") == "" ||
		hex.EncodeToString(dead.ParentSpanId) != ps.SpanID().String() {
		t.Fatalf("the dead letter's span: status %v, parent %x, attributes %v", dead.Status, dead.ParentSpanId, dead.Attributes)
	}
}
