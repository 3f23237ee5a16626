package relay

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/leantrace"
)

// TestPublishSpans: each published event gets one "walbox publish" span, a
// child of the traceparent in its headers column (a new root without one);
// the message carries the span's own context onward; a publish lost and
// resent counts one resend on the same span; a dead letter's span says why
// and ends in error.
func TestPublishSpans(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const producer = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
		st := newFakeStream()
		st.lose[2] = true // the second publish vanishes: its event is resent
		src, ids := newScript(2, 2)
		src.changes[1].Event.Headers = []byte(`{"traceparent": "` + producer + `"}`) // e000-0's headers column
		src.changes[2].Event.Topic = "nowhere.created"                               // e000-1: no stream captures it
		exp := traceRelay(t, st, src, "nats", 0, nil, Route{Stream: "ORDERS", Subjects: []string{"orders.>"}}, Route{Stream: "DLQ", Subjects: []string{"walbox.dlq.>"}})

		spans := map[string]tracetest.SpanStub{}
		for _, s := range exp.GetSpans() {
			if s.Name != SpanName || s.SpanKind != trace.SpanKindProducer {
				t.Fatalf("span %q of kind %v", s.Name, s.SpanKind)
			}
			id := attr(s, "messaging.message.id")
			if _, dup := spans[id]; dup {
				t.Fatalf("two spans for event %s", id)
			}
			spans[id] = s
		}
		if len(spans) != len(ids) {
			t.Fatalf("%d spans for %d events: %v", len(spans), len(ids), spans)
		}
		child := spans["e000-0"]
		if child.Parent.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || child.Parent.SpanID().String() != "00f067aa0ba902b7" {
			t.Fatalf("e000-0's span parent %v, want the producer's traceparent", child.Parent)
		}
		if got := st.hdrs[0].Get("traceparent"); got != "00-"+child.SpanContext.TraceID().String()+"-"+child.SpanContext.SpanID().String()+"-01" {
			t.Fatalf("the message carries traceparent %q, want the publish span's", got)
		}
		for k, want := range map[string]string{"messaging.system": "nats", "messaging.operation.type": "send",
			"messaging.destination.name": "orders.created", "walbox.stream": "ORDERS", "walbox.commit_lsn": "0/1000", "walbox.stream_sequence": "1"} {
			if got := attr(child, k); got != want {
				t.Errorf("e000-0's span: %s = %q, want %q", k, got, want)
			}
		}
		if root := spans["e001-0"]; root.Parent.IsValid() {
			t.Fatalf("an event without traceparent got parent %v, want a new root", root.Parent)
		}
		// Publish 2 of the stream is e001-0's first (e000-1 went to the
		// dead-letter stream): lost, then resent once.
		if got := attr(spans["e001-0"], "walbox.resends"); got != "1" {
			t.Fatalf("e001-0's span counts %s resends, want 1", got)
		}
		if got := attr(child, "walbox.resends"); got != "0" {
			t.Fatalf("e000-0's span counts %s resends, want 0", got)
		}
		dl := spans["e000-1"]
		if dl.Status.Code != codes.Error || attr(dl, "walbox.dead_letter.reason") == "" || !strings.HasPrefix(attr(dl, "messaging.destination.name"), "walbox.dlq.") {
			t.Fatalf("the dead letter's span: status %v, attributes %v", dl.Status, dl.Attributes)
		}
	})
}

// traceRelay runs a traced relay over src into st until every transaction
// is confirmed, with sampler in the SDK (nil: its default) and ratio as
// Config.TraceRatio, and returns what it exported.
func traceRelay(t *testing.T, st *fakeStream, src *scriptSource, system string, ratio float64, sampler sdktrace.Sampler, routes ...Route) *tracetest.InMemoryExporter {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	opts := []sdktrace.TracerProviderOption{sdktrace.WithSyncer(exp)}
	if sampler != nil {
		opts = append(opts, sdktrace.WithSampler(sampler))
	}
	tp := sdktrace.NewTracerProvider(opts...)
	sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
	r := New(Config{Window: 16, BackoffInitial: 100 * time.Millisecond, BackoffMax: time.Second,
		Tracer: tp.Tracer("test"), TraceSystem: system, TraceRatio: ratio}, sink, NewRouter("", "app/walbox", routes))
	serveUntilReached(t, r, src)
	return exp
}

func attr(s tracetest.SpanStub, key string) string {
	for _, kv := range s.Attributes {
		if string(kv.Key) == key {
			return kv.Value.Emit()
		}
	}
	return ""
}

// TestPublishSpansOnKafka: on Kafka the span says where the record went
// as OpenTelemetry's Kafka conventions do: partition and offset.
func TestPublishSpansOnKafka(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src, _ := newScript(1, 2)
		exp := traceRelay(t, newFakeStream(), src, "kafka", 0, nil, Route{Stream: "orders.created", Subjects: []string{"orders.created"}})
		offsets := map[string]string{}
		for _, s := range exp.GetSpans() {
			if attr(s, "messaging.system") != "kafka" || attr(s, "messaging.destination.partition.id") != "0" || attr(s, "walbox.stream") != "" {
				t.Fatalf("a Kafka publish span's attributes: %v", s.Attributes)
			}
			offsets[attr(s, "messaging.message.id")] = attr(s, "messaging.kafka.offset")
		}
		if offsets["e000-0"] != "0" || offsets["e000-1"] != "1" {
			t.Fatalf("offsets %v, want e000-0 at 0 and e000-1 at 1 (sequence - 1)", offsets)
		}
	})
}

// TestUnsampledPublishKeepsTheProducersContext: a span the sampler drops is
// exported nowhere, so the message keeps the producer's traceparent (the
// consumer's span is the producer's child) and an event without one gets
// none.
func TestUnsampledPublishKeepsTheProducersContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const producer = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
		st := newFakeStream()
		src, _ := newScript(1, 2)
		src.changes[1].Event.Headers = []byte(`{"traceparent": "` + producer + `"}`)
		exp := traceRelay(t, st, src, "nats", 0, sdktrace.NeverSample(), Route{Stream: "ORDERS", Subjects: []string{"orders.>"}})
		if n := len(exp.GetSpans()); n != 0 {
			t.Fatalf("%d spans exported, want none", n)
		}
		if got := st.hdrs[0].Get("traceparent"); got != producer {
			t.Fatalf("the first message carries traceparent %q, want the producer's %q", got, producer)
		}
		if got := st.hdrs[1].Get("traceparent"); got != "" {
			t.Fatalf("the second message carries traceparent %q, want none", got)
		}
	})
}

// TestTraceRatioDecidesBeforeAnySpan: the relay samples parent-based before
// it starts a span: a producer's sampled context is followed whatever the
// ratio, an unsampled one is not, and with no parent the ratio decides
// (below 0: none).
func TestTraceRatioDecidesBeforeAnySpan(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src, _ := newScript(1, 3)
		src.changes[1].Event.Headers = []byte(`{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`)
		src.changes[2].Event.Headers = []byte(`{"traceparent": "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"}`)
		exp := traceRelay(t, newFakeStream(), src, "nats", -1, nil, Route{Stream: "ORDERS", Subjects: []string{"orders.>"}})
		var ids []string
		for _, s := range exp.GetSpans() {
			ids = append(ids, attr(s, "messaging.message.id"))
		}
		if len(ids) != 1 || ids[0] != "e000-0" {
			t.Fatalf("spans for %v, want e000-0's alone (its producer's context is sampled)", ids)
		}
	})
}

// TestNoHeadersColumnMeansNoParent: the relay skips the traceparent
// lookup for an event without a headers column, which holds only while no
// message without one carries a traceparent. The case where that proof
// would fail: a sampled event's message, its span's context injected, is
// recycled for the events after it, and an unsampled one among them would
// carry the stale context to its consumer. At ratio 0.5 over 400 events
// (recycled as they are acked) that case comes up about 100 times: every
// message carries its own span's context or none.
func TestNoHeadersColumnMeansNoParent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		src, ids := newScript(400, 1)
		exp := traceRelay(t, st, src, "nats", 0.5, nil, Route{Stream: "ORDERS", Subjects: []string{"orders.>"}})
		spanOf := map[string]string{}
		for _, sp := range exp.GetSpans() {
			spanOf[attr(sp, "messaging.message.id")] = sp.SpanContext.SpanID().String()
		}
		if n := len(spanOf); n < 100 || n > 300 {
			t.Fatalf("%d of 400 events got a span at ratio 0.5", n)
		}
		if len(st.hdrs) != len(ids) {
			t.Fatalf("%d messages stored, want %d", len(st.hdrs), len(ids))
		}
		for i, h := range st.hdrs {
			tp, span := h.Get("traceparent"), spanOf[st.ids[i]]
			if span == "" && tp != "" || span != "" && !strings.Contains(tp, "-"+span+"-") {
				t.Fatalf("message %d (%s) carries traceparent %q; its own span: %q", i, st.ids[i], tp, span)
			}
		}
	})
}

// TestTraceRatioIsDrawnOncePerEvent: an event without a producer context
// is sampled at the ratio, not at the ratio squared (the draw that skips
// the propagator for such events must be the only one). 20,000 events at
// 0.5: 10,000 expected, σ ≈ 71; drawn twice it would be about 5,000.
func TestTraceRatioIsDrawnOncePerEvent(t *testing.T) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sdktrace.NewBatchSpanProcessor(discardExporter{})))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	tr := newTracing(tp.Tracer("test"), "nats", 0.5)
	const n = 20000
	spans := 0
	for i := range n {
		p := &pending{ev: cdc.Event{ID: fmt.Sprint(i)}, msg: &Msg{Subject: "orders.created", Header: Header{"Nats-Msg-Id": {fmt.Sprint(i)}}}, sentAt: time.Now()}
		tr.published(p)
		if p.span != nil {
			spans++
			tr.acked(p, &Ack{Stream: "ORDERS", Sequence: uint64(i + 1)}, time.Now(), "public.outbox_events")
		}
	}
	if spans < 9500 || spans > 10500 {
		t.Fatalf("%d of %d events got a span at ratio 0.5, want about 10,000", spans, n)
	}
}

// TestTraceGapsAreBernoulli: the sampler draws the gap to the next sampled
// event instead of a number per event; the events it samples must be what
// a draw per event would give. At 1 % over 400,000 events: 4,000 sampled
// (σ ≈ 63; allowed ± 5σ); the share of gaps of 0 (two sampled events in
// a row) 1 % and of gaps of at least 100 (1 - 0.01)^100 = 36.6 %, each
// within 5σ of its binomial; and the first event of a fresh relay is not
// always sampled (1,000 relays: 10 expected, allowed 0 < n < 30).
func TestTraceGapsAreBernoulli(t *testing.T) {
	tr := &tracing{ratio: 0.01}
	tr.skip = tr.gap()
	const n = 400000
	var sampled, zero, long int
	last := -1
	for i := range n {
		if !tr.sampled(trace.SpanContext{}) {
			continue
		}
		sampled++
		if last >= 0 {
			switch gap := i - last - 1; {
			case gap == 0:
				zero++
			case gap >= 100:
				long++
			}
		}
		last = i
	}
	within := func(what string, got int, of int, p float64) {
		t.Helper()
		mean, sd := float64(of)*p, math.Sqrt(float64(of)*p*(1-p))
		if math.Abs(float64(got)-mean) > 5*sd {
			t.Errorf("%s: %d of %d, want %.0f ± %.0f", what, got, of, mean, 5*sd)
		}
	}
	within("sampled events", sampled, n, 0.01)
	within("gaps of 0", zero, sampled-1, 0.01)
	within("gaps of 100 or more", long, sampled-1, math.Pow(0.99, 100))
	first := 0
	for range 1000 {
		fresh := &tracing{ratio: 0.01}
		fresh.skip = fresh.gap()
		if fresh.sampled(trace.SpanContext{}) {
			first++
		}
	}
	if first == 0 || first >= 30 {
		t.Errorf("the first event of 1,000 fresh relays was sampled %d times, want about 10", first)
	}
}

// BenchmarkTracingPerEvent is tracing's cost per event in the relay's own
// code (the span's open at publish and its end at the ack), by sampling
// ratio, for events whose headers column carries no trace context: a
// catch-up's usual case. make bench measures the whole relay's CPU.
func BenchmarkTracingPerEvent(b *testing.B) {
	for _, ratio := range []float64{-1, 0.01, 1} { // -1: tracing off
		b.Run(fmt.Sprintf("ratio=%g", ratio), func(b *testing.B) {
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sdktrace.NewBatchSpanProcessor(discardExporter{})))
			defer func() { _ = tp.Shutdown(context.Background()) }()
			var tr *tracing
			if ratio >= 0 {
				tr = newTracing(tp.Tracer("bench"), "nats", ratio)
			}
			ev := cdc.Event{ID: "0190a0b0-0000-7000-8000-000000000001", CommitTime: time.Now()}
			ack := &Ack{Stream: "ORDERS", Sequence: 1}
			now := time.Now() // the relay reads the clock anyway: not tracing's cost
			b.ReportAllocs()
			for b.Loop() {
				p := &pending{ev: ev, msg: &Msg{Subject: "orders.created", Header: Header{
					"Nats-Msg-Id": {ev.ID}, HeaderSource: {"app/walbox"}, HeaderCommitLSN: {"0/16B3748"},
					HeaderTable: {"public.outbox_events"}, "Content-Type": {"application/json"},
				}}, sentAt: now}
				if tr != nil {
					tr.published(p)
					tr.acked(p, ack, now, "public.outbox_events")
				}
			}
		})
	}
}

type discardExporter struct{}

func (discardExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardExporter) Shutdown(context.Context) error                             { return nil }

// BenchmarkSampledSpanCPU is the process's CPU per sampled span
// (cpu-ns/op, from getrusage: the export goroutines and the local OTLP
// server included, which ns/op misses): the SDK's provider with a
// discarding exporter and with the OTLP/HTTP exporter, and
// internal/leantrace (what walbox runs) with the OTLP/HTTP client. The
// SDK's batch processor blocks when its queue is full rather than drop,
// so every span is exported and the queue stays at its default size.
func BenchmarkSampledSpanCPU(b *testing.B) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	for _, name := range []string{"sdk-discard", "sdk-otlphttp", "lean-otlphttp"} {
		b.Run(name, func(b *testing.B) {
			var tp interface {
				trace.TracerProvider
				Shutdown(context.Context) error
			}
			switch name {
			case "sdk-discard":
				tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sdktrace.NewBatchSpanProcessor(discardExporter{}, sdktrace.WithBlocking())))
			case "sdk-otlphttp":
				exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(srv.URL), otlptracehttp.WithInsecure())
				if err != nil {
					b.Fatal(err)
				}
				tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sdktrace.NewBatchSpanProcessor(exp, sdktrace.WithBlocking())))
			default:
				lp, err := leantrace.New(context.Background(), leantrace.Options{
					Client: otlptracehttp.NewClient(otlptracehttp.WithEndpointURL(srv.URL), otlptracehttp.WithInsecure()), MaxQueueSize: 1 << 16})
				if err != nil {
					b.Fatal(err)
				}
				tp = lp
				defer func() {
					if d := lp.Dropped(); d > 0 {
						b.Fatalf("%d spans dropped", d)
					}
				}()
			}
			tr := newTracing(tp.Tracer("bench"), "nats", 1)
			ev := cdc.Event{ID: "0190a0b0-0000-7000-8000-000000000001", CommitTime: time.Now()}
			ack := &Ack{Stream: "ORDERS", Sequence: 1}
			b.ReportAllocs()
			var ru0, ru1 syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
			for b.Loop() {
				p := &pending{ev: ev, msg: &Msg{Subject: "orders.created", Header: Header{"Nats-Msg-Id": {ev.ID}}}, sentAt: time.Now()}
				tr.published(p)
				tr.acked(p, ack, time.Now(), "public.outbox_events")
			}
			_ = tp.Shutdown(context.Background())
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
			cpu := time.Duration(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
			b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
		})
	}
}
