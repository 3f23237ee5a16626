package leantrace

import (
	"context"
	"encoding/hex"
	"errors"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/walbox/walbox/internal/otlptest"
	"github.com/walbox/walbox/internal/syncbuf"
)

// receiver is an OTLP/HTTP receiver of the test's.
type receiver struct{ *otlptest.Receiver }

func newReceiver(t *testing.T) receiver { return receiver{otlptest.New(t)} }

func (r receiver) client() otlptrace.Client {
	return otlptracehttp.NewClient(otlptracehttp.WithEndpointURL(r.URL+"/v1/traces"), otlptracehttp.WithRetry(otlptracehttp.RetryConfig{Enabled: false}))
}

// spans is every span received, in order, with its resource and scope.
func (r receiver) spans() []received {
	var out []received
	for _, req := range r.Requests() {
		for _, rs := range req.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					out = append(out, received{rs: rs, ss: ss, s: s})
				}
			}
		}
	}
	return out
}

func (r receiver) batchSizes() []int {
	var out []int
	for _, req := range r.Requests() {
		n := 0
		for _, rs := range req.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				n += len(ss.Spans)
			}
		}
		out = append(out, n)
	}
	return out
}

type received struct {
	rs *tracepb.ResourceSpans
	ss *tracepb.ScopeSpans
	s  *tracepb.Span
}

func newProvider(t *testing.T, o Options) *Provider {
	t.Helper()
	p, err := New(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Shutdown(context.Background()) })
	return p
}

var testResource = resource.NewWithAttributes("https://opentelemetry.io/schemas/1.26.0",
	attribute.String("service.name", "walbox"), attribute.Int64("pid", 42), attribute.StringSlice("tags", []string{"a", "b"}))

// script is what a relay (and any other caller) does with a tracer: a
// root, a child of a remote sampled parent with a trace state, every
// attribute type, a key set twice, a status set twice, an event, an
// error, a link, explicit timestamps.
func script(tr trace.Tracer) {
	t0 := time.Date(2026, 12, 6, 8, 0, 0, 0, time.UTC)
	_, root := tr.Start(context.Background(), "root", trace.WithTimestamp(t0), trace.WithAttributes(attribute.Bool("first", true)))
	root.SetAttributes(attribute.String("s", "x"), attribute.Int64("i", 7), attribute.Float64("f", 1.5), attribute.Bool("b", true),
		attribute.StringSlice("ss", []string{"p", "q"}), attribute.Int64Slice("is", []int64{1, 2}),
		attribute.Float64Slice("fs", []float64{0.5}), attribute.BoolSlice("bs", []bool{true, false}))
	root.SetAttributes(attribute.String("s", "replaced"))
	root.SetStatus(codes.Error, "broke")
	root.SetStatus(codes.Unset, "ignored")
	root.AddEvent("happened", trace.WithTimestamp(t0.Add(time.Millisecond)), trace.WithAttributes(attribute.Int("n", 3)))
	root.RecordError(errors.New("boom"), trace.WithTimestamp(t0.Add(2*time.Millisecond)))
	root.End(trace.WithTimestamp(t0.Add(5 * time.Millisecond)))

	ts, _ := trace.ParseTraceState("vendor=v1")
	remote := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6},
		TraceFlags: trace.FlagsSampled, TraceState: ts, Remote: true})
	ctx := trace.ContextWithRemoteSpanContext(context.Background(), remote)
	cctx, child := tr.Start(ctx, "walbox publish", trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(t0),
		trace.WithLinks(trace.Link{SpanContext: root.SpanContext(), Attributes: []attribute.KeyValue{attribute.String("why", "test")}},
			// A remote link without a trace state: the SDK's exporter
			// leaves a link's trace state out, walbox sends it.
			trace.Link{SpanContext: trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{7}, SpanID: trace.SpanID{7},
				TraceFlags: trace.FlagsSampled, Remote: true})}))
	child.SetStatus(codes.Ok, "")
	child.SetStatus(codes.Error, "too late: Ok is final")
	_, grandchild := tr.Start(cctx, "inner", trace.WithTimestamp(t0.Add(time.Millisecond)))
	grandchild.End(trace.WithTimestamp(t0.Add(2 * time.Millisecond)))
	child.End(trace.WithTimestamp(t0.Add(3 * time.Millisecond)))
}

// canonical is a received span with its ids replaced by their roles
// (which are random), as JSON with sorted attributes: what two exporters
// of the same calls must agree on.
func canonical(t *testing.T, all []received) []string {
	t.Helper()
	names := map[string]string{}
	for _, r := range all {
		names[hex.EncodeToString(r.s.SpanId)] = r.s.Name
	}
	var out []string
	for _, r := range all {
		s := proto.Clone(r.s).(*tracepb.Span)
		s.SpanId = nil
		if p := hex.EncodeToString(s.ParentSpanId); names[p] != "" {
			s.ParentSpanId = []byte("parent:" + names[p])
		}
		if hex.EncodeToString(s.TraceId) != "01020300000000000000000000000000" {
			s.TraceId = []byte("random")
		}
		for _, l := range s.Links {
			l.TraceId, l.SpanId = []byte("link"), []byte(names[hex.EncodeToString(l.SpanId)])
		}
		sort.Slice(s.Attributes, func(i, j int) bool { return s.Attributes[i].Key < s.Attributes[j].Key })
		for _, e := range s.Events {
			sort.Slice(e.Attributes, func(i, j int) bool { return e.Attributes[i].Key < e.Attributes[j].Key })
		}
		b, err := protojson.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		rb, _ := protojson.Marshal(r.rs.Resource)
		sb, _ := protojson.Marshal(r.ss.Scope)
		out = append(out, string(b)+" resource="+string(rb)+" schema="+r.rs.SchemaUrl+" scope="+string(sb))
	}
	slices.Sort(out)
	return out
}

// TestExportsWhatTheSDKExports: the same calls on the SDK's provider
// (ParentBased(AlwaysSample), batch processor, OTLP/HTTP exporter) and on
// this one reach an OTLP receiver as the same spans: names, kinds,
// parents, trace states, flags, attributes (a key set twice keeps its
// last value), status, events, links, timestamps, resource and scope.
func TestExportsWhatTheSDKExports(t *testing.T) {
	ctx := context.Background()
	sdkRcv := newReceiver(t)
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(sdkRcv.URL+"/v1/traces"))
	if err != nil {
		t.Fatal(err)
	}
	sdk := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(testResource))
	script(sdk.Tracer("github.com/walbox/walbox/relay", trace.WithInstrumentationVersion("v1.2.3")))
	if err := sdk.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}

	leanRcv := newReceiver(t)
	p := newProvider(t, Options{Client: leanRcv.client(), Resource: testResource})
	script(p.Tracer("github.com/walbox/walbox/relay", trace.WithInstrumentationVersion("v1.2.3")))
	if err := p.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}

	want, got := canonical(t, sdkRcv.spans()), canonical(t, leanRcv.spans())
	if len(want) != 3 {
		t.Fatalf("the SDK exported %d spans, want 3", len(want))
	}
	if !slices.Equal(got, want) {
		t.Fatalf("exported spans differ from the SDK's:\n got: %s\nwant: %s", strings.Join(got, "\n      "), strings.Join(want, "\n      "))
	}
}

// TestUnsampledParentIsNotRecorded: a child of an unsampled parent is not
// recorded nor exported, and carries the parent's trace, unsampled, with
// a span id of its own (what the message would carry onward).
func TestUnsampledParentIsNotRecorded(t *testing.T) {
	rcv := newReceiver(t)
	p := newProvider(t, Options{Client: rcv.client()})
	parent := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{9}, SpanID: trace.SpanID{8}, Remote: true})
	ctx, s := p.Tracer("t").Start(trace.ContextWithRemoteSpanContext(context.Background(), parent), "x")
	sc := s.SpanContext()
	if s.IsRecording() || sc.IsSampled() || sc.TraceID() != parent.TraceID() || sc.SpanID() == parent.SpanID() || !sc.SpanID().IsValid() {
		t.Fatalf("child of an unsampled parent: recording %v, context %+v", s.IsRecording(), sc)
	}
	if !trace.SpanContextFromContext(ctx).Equal(sc) {
		t.Fatal("the returned context does not carry the child")
	}
	s.End()
	if err := p.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := len(rcv.spans()); n != 0 {
		t.Fatalf("%d spans exported, want none", n)
	}
}

// TestBatchesBySize: a full batch goes at once, the rest waits for the
// schedule delay (an hour here) or a flush.
func TestBatchesBySize(t *testing.T) {
	rcv := newReceiver(t)
	p := newProvider(t, Options{Client: rcv.client(), MaxExportBatchSize: 3, ScheduleDelay: time.Hour})
	tr := p.Tracer("t")
	for range 7 {
		_, s := tr.Start(context.Background(), "s")
		s.End()
	}
	waitSpans(t, rcv, 6)
	if got := rcv.batchSizes(); !slices.Equal(got, []int{3, 3}) {
		t.Fatalf("batches %v before the flush, want [3 3]", got)
	}
	if err := p.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := rcv.batchSizes(); !slices.Equal(got, []int{3, 3, 1}) {
		t.Fatalf("batches %v after the flush, want [3 3 1]", got)
	}
}

// TestBatchGoesAfterTheDelay: a batch that never fills goes once the
// schedule delay has passed since its first span, without a flush.
func TestBatchGoesAfterTheDelay(t *testing.T) {
	rcv := newReceiver(t)
	p := newProvider(t, Options{Client: rcv.client(), ScheduleDelay: 50 * time.Millisecond})
	_, s := p.Tracer("t").Start(context.Background(), "s")
	s.End()
	waitSpans(t, rcv, 1)
}

// waitSpans waits until rcv holds n spans.
func waitSpans(t *testing.T, rcv receiver, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for len(rcv.spans()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d spans received after 30 s, want %d", len(rcv.spans()), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestFullQueueDropsWithoutBlocking: while the collector hangs, End never
// waits; what the queue cannot hold is dropped and counted; what it holds
// is exported once the collector answers.
func TestFullQueueDropsWithoutBlocking(t *testing.T) {
	rcv := newReceiver(t)
	gate := make(chan struct{})
	rcv.Hold(gate)
	reg := prometheus.NewRegistry()
	p := newProvider(t, Options{Client: rcv.client(), MaxQueueSize: 4, MaxExportBatchSize: 1, Registerer: reg})
	tr := p.Tracer("t")
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		for range 50 {
			_, s := tr.Start(context.Background(), "s")
			s.End()
		}
	}()
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("End blocked while the collector hangs")
	}
	// One span is in the hanging upload, four in the queue at most.
	if d := p.Dropped(); d < 45 || d > 49 {
		t.Fatalf("dropped %d of 50 with one upload in flight and a queue of 4, want 45-49", d)
	}
	close(gate)
	if err := p.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, d := len(rcv.spans()), int(p.Dropped()); got+d != 50 {
		t.Fatalf("exported %d + dropped %d, want 50", got, d)
	}
	if v := testutil.ToFloat64(p.dropped); int64(v) != p.Dropped() {
		t.Fatalf("walbox_trace_spans_dropped_total %v, want %d", v, p.Dropped())
	}
}

// TestFailedUploadIsCountedAndLogged: a batch the collector refuses is
// dropped, counted and logged once.
func TestFailedUploadIsCountedAndLogged(t *testing.T) {
	rcv := newReceiver(t)
	rcv.Refuse()
	var logs syncbuf.Buffer
	p := newProvider(t, Options{Client: rcv.client(), Logger: zerolog.New(&logs)})
	tr := p.Tracer("t")
	for range 2 {
		for range 3 {
			_, s := tr.Start(context.Background(), "s")
			s.End()
		}
		if err := p.ForceFlush(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if d := p.Dropped(); d != 6 {
		t.Fatalf("dropped %d, want 6", d)
	}
	if n := strings.Count(logs.String(), "cannot export spans"); n != 1 {
		t.Fatalf("%d warnings, want 1 (a minute apart): %s", n, logs.String())
	}
}

// TestShutdownFlushes: Shutdown exports what is queued; a span that ends
// after it is dropped.
func TestShutdownFlushes(t *testing.T) {
	rcv := newReceiver(t)
	p := newProvider(t, Options{Client: rcv.client(), ScheduleDelay: time.Hour})
	tr := p.Tracer("t")
	for range 5 {
		_, s := tr.Start(context.Background(), "s")
		s.End()
	}
	_, late := tr.Start(context.Background(), "late")
	if err := p.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	late.End()
	if n := len(rcv.spans()); n != 5 {
		t.Fatalf("%d spans exported at shutdown, want 5", n)
	}
	if d := p.Dropped(); d != 1 {
		t.Fatalf("dropped %d, want the late one", d)
	}
}

// TestConcurrentSpans: spans started, changed and ended from many
// goroutines all arrive whole, with distinct ids (run with -race).
func TestConcurrentSpans(t *testing.T) {
	rcv := newReceiver(t)
	p := newProvider(t, Options{Client: rcv.client(), MaxQueueSize: 10000})
	tr := p.Tracer("t")
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				_, s := tr.Start(context.Background(), "s")
				go s.SetAttributes(attribute.Int("other", 1))
				s.SetAttributes(attribute.Int("g", g), attribute.Int("i", i))
				s.End()
				s.End() // a second End does nothing
			}
		})
	}
	wg.Wait()
	if err := p.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	spans := rcv.spans()
	ids := map[string]bool{}
	for _, r := range spans {
		ids[hex.EncodeToString(r.s.SpanId)] = true
		if len(r.s.TraceId) != 16 || len(r.s.SpanId) != 8 || r.s.EndTimeUnixNano < r.s.StartTimeUnixNano {
			t.Fatalf("malformed span %v", r.s)
		}
	}
	if len(spans) != 1600 || len(ids) != 1600 || p.Dropped() != 0 {
		t.Fatalf("%d spans, %d distinct ids, %d dropped; want 1600, 1600, 0", len(spans), len(ids), p.Dropped())
	}
}

// TestBatchFromEnv: OpenTelemetry's OTEL_BSP_* variables, the defaults for
// what is unset or not a positive integer, and the batch never above the
// queue.
func TestBatchFromEnv(t *testing.T) {
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
	t.Setenv("OTEL_BSP_EXPORT_TIMEOUT", "-1")
	t.Setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
	t.Setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512")
	o := Options{}.BatchFromEnv()
	if o.ScheduleDelay != 250*time.Millisecond || o.ExportTimeout != DefaultExportTimeout || o.MaxQueueSize != 100 || o.MaxExportBatchSize != 100 {
		t.Fatalf("options %+v", o)
	}
	if o := (Options{MaxQueueSize: 7}).BatchFromEnv(); o.MaxQueueSize != 7 {
		t.Fatalf("a set option lost to the environment: %+v", o)
	}
}
