// Package leantrace is the relay's OpenTelemetry tracer: a
// trace.TracerProvider whose spans keep their fields and are written in
// OTLP's protobuf wire format when their batch goes (encode.go), handed to
// the OTLP exporter's client (otlptracehttp.NewClient, configured by
// OTEL_EXPORTER_OTLP_* as usual).
//
// Why not the SDK's TracerProvider: a catch-up publishes 60,000 events a
// second at about 7 µs of relay CPU each, and at 1 % sampling the SDK's
// span (its attributes slice, the de-duplicating map at its end, the
// snapshot, the batch processor) and the exporter's conversion of that
// snapshot into these same messages cost 17-22 µs a span in the relay:
// 2.4-3.8 % of its CPU (make bench, section 6), against a target of 3 %.
// A span here is written once, into the bytes the exporter sends.
//
// What it is: ParentBased(AlwaysSample). A span with a sampled parent, or
// none, is recorded; one with an unsampled parent is not (it carries the
// parent's trace with a span id of its own, unsampled), as the SDK does.
// The relay decides sampling itself before it starts a span
// (relay.Config.TraceRatio). Spans end in a bounded queue (OTEL_BSP_*,
// the batch span processor's defaults and variables); a full queue drops
// the span and counts it, never blocks the caller.
package leantrace

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/sdk/resource"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/walbox/walbox/internal/metrics"
)

// The batch span processor's defaults (OpenTelemetry's specification).
const (
	DefaultScheduleDelay   = 5 * time.Second
	DefaultExportTimeout   = 30 * time.Second
	DefaultMaxQueueSize    = 2048
	DefaultMaxExportBatch  = 512
	attributeCountLimit    = 128
	eventAndLinkCountLimit = 128
)

// Options configure a Provider. Zero values take OpenTelemetry's batch
// span processor defaults, or its OTEL_BSP_* variables (BatchFromEnv).
type Options struct {
	// Client sends the batches: otlptracehttp.NewClient(...).
	Client otlptrace.Client
	// Resource describes the process (service.name, ...).
	Resource *resource.Resource
	// ScheduleDelay: the longest a finished span waits to be sent.
	ScheduleDelay time.Duration
	// ExportTimeout bounds one batch's upload.
	ExportTimeout time.Duration
	// MaxQueueSize: finished spans held for export; more are dropped.
	MaxQueueSize int
	// MaxExportBatchSize: spans per upload.
	MaxExportBatchSize int
	Logger             zerolog.Logger
	// Registerer takes walbox_trace_spans_dropped_total (nil: none).
	Registerer prometheus.Registerer
}

// BatchFromEnv fills the batch settings o leaves zero from OpenTelemetry's
// OTEL_BSP_SCHEDULE_DELAY, OTEL_BSP_EXPORT_TIMEOUT (milliseconds),
// OTEL_BSP_MAX_QUEUE_SIZE and OTEL_BSP_MAX_EXPORT_BATCH_SIZE, then from
// the defaults. A value that is not a positive integer is ignored, as the
// SDK ignores it.
func (o Options) BatchFromEnv() Options {
	envInt := func(name string) int {
		v, err := strconv.Atoi(os.Getenv(name))
		if err != nil || v <= 0 {
			return 0
		}
		return v
	}
	if o.ScheduleDelay <= 0 {
		o.ScheduleDelay = time.Duration(envInt("OTEL_BSP_SCHEDULE_DELAY")) * time.Millisecond
	}
	if o.ExportTimeout <= 0 {
		o.ExportTimeout = time.Duration(envInt("OTEL_BSP_EXPORT_TIMEOUT")) * time.Millisecond
	}
	if o.MaxQueueSize <= 0 {
		o.MaxQueueSize = envInt("OTEL_BSP_MAX_QUEUE_SIZE")
	}
	if o.MaxExportBatchSize <= 0 {
		o.MaxExportBatchSize = envInt("OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
	}
	return o.withDefaults()
}

func (o Options) withDefaults() Options {
	if o.ScheduleDelay <= 0 {
		o.ScheduleDelay = DefaultScheduleDelay
	}
	if o.ExportTimeout <= 0 {
		o.ExportTimeout = DefaultExportTimeout
	}
	if o.MaxQueueSize <= 0 {
		o.MaxQueueSize = DefaultMaxQueueSize
	}
	if o.MaxExportBatchSize <= 0 {
		o.MaxExportBatchSize = DefaultMaxExportBatch
	}
	// The specification: the batch is at most the queue.
	o.MaxExportBatchSize = min(o.MaxExportBatchSize, o.MaxQueueSize)
	return o
}

// Provider is a trace.TracerProvider exporting through an OTLP client.
type Provider struct {
	embedded.TracerProvider
	opts     Options
	resource *resourcepb.Resource
	schema   string
	log      zerolog.Logger

	// Finished spans wait in pending for the export loop, which wakes
	// when a batch fills (full), at each ScheduleDelay tick, on a flush
	// and at shutdown: not at every span. A channel of spans, as the SDK's
	// batch processor has, woke the loop's goroutine for each sampled
	// span, and those wake-ups cost a catch-up more relay CPU than the
	// spans' own code (go run . tracing -pairs).
	mu       sync.Mutex
	pending  []*span
	spare    []*span // the loop's last batch slice, for pending's next
	inflight int     // spans the loop took from pending and has not exported
	closed   bool
	full     chan struct{} // capacity 1
	flushes  chan chan struct{}
	stopped  chan struct{} // closed by Shutdown
	done     chan struct{} // closed when the export loop ends
	stop     sync.Once

	clientStop sync.Once
	stopErr    error

	tracersMu sync.Mutex
	tracers   map[string]*tracer

	dropped     prometheus.Counter
	droppedN    atomic.Int64
	lastWarning atomic.Int64 // unix nanoseconds of the last export warning
}

// New starts the client and the export loop. Shutdown flushes and stops
// them.
func New(ctx context.Context, opts Options) (*Provider, error) {
	if opts.Client == nil {
		return nil, errors.New("leantrace: no OTLP client")
	}
	opts = opts.withDefaults()
	if err := opts.Client.Start(ctx); err != nil {
		return nil, fmt.Errorf("start the OTLP trace client: %w", err)
	}
	p := &Provider{opts: opts, log: opts.Logger.With().Str("component", "tracing").Logger(),
		full: make(chan struct{}, 1), flushes: make(chan chan struct{}),
		stopped: make(chan struct{}), done: make(chan struct{}), tracers: map[string]*tracer{},
		dropped: metrics.On(opts.Registerer).Counter("walbox_trace_spans_dropped_total",
			"Finished spans not exported: the export queue was full (OTEL_BSP_MAX_QUEUE_SIZE) or their upload failed."),
	}
	if opts.Resource != nil {
		p.resource = &resourcepb.Resource{Attributes: keyValues(opts.Resource.Attributes())}
		p.schema = opts.Resource.SchemaURL()
	}
	go p.run()
	return p, nil
}

// Tracer implements trace.TracerProvider: one scope per name.
func (p *Provider) Tracer(name string, opts ...trace.TracerOption) trace.Tracer {
	cfg := trace.NewTracerConfig(opts...)
	key := name + "\x00" + cfg.InstrumentationVersion() + "\x00" + cfg.SchemaURL()
	p.tracersMu.Lock()
	defer p.tracersMu.Unlock()
	t, ok := p.tracers[key]
	if !ok {
		t = &tracer{p: p, scope: &commonpb.InstrumentationScope{Name: name, Version: cfg.InstrumentationVersion()}, schema: cfg.SchemaURL()}
		p.tracers[key] = t
	}
	return t
}

// Dropped is how many finished spans were not exported.
func (p *Provider) Dropped() int64 { return p.droppedN.Load() }

// ForceFlush uploads every span finished before the call.
func (p *Provider) ForceFlush(ctx context.Context) error {
	ch := make(chan struct{})
	select {
	case p.flushes <- ch:
	case <-p.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("flush spans: %w", ctx.Err())
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("flush spans: %w", ctx.Err())
	}
}

// Shutdown uploads what is queued and stops the client; spans that end
// after it are dropped and counted.
func (p *Provider) Shutdown(ctx context.Context) error {
	p.stop.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		close(p.stopped)
	})
	select {
	case <-p.done:
	case <-ctx.Done():
		return fmt.Errorf("flush spans at shutdown: %w", ctx.Err())
	}
	p.clientStop.Do(func() { p.stopErr = p.opts.Client.Stop(ctx) })
	if p.stopErr != nil {
		return fmt.Errorf("stop the OTLP trace client: %w", p.stopErr)
	}
	return nil
}

// enqueue hands a finished span to the export loop, or drops it.
func (p *Provider) enqueue(f *span) {
	p.mu.Lock()
	if p.closed || len(p.pending)+p.inflight >= p.opts.MaxQueueSize {
		p.mu.Unlock()
		p.drop(1)
		return
	}
	p.pending = append(p.pending, f)
	n := len(p.pending)
	p.mu.Unlock()
	if n >= p.opts.MaxExportBatchSize {
		p.wake()
	}
}

// wake tells the export loop a batch is full.
func (p *Provider) wake() {
	select {
	case p.full <- struct{}{}:
	default: // the loop has a wake-up coming
	}
}

func (p *Provider) drop(n int) {
	p.droppedN.Add(int64(n))
	p.dropped.Add(float64(n))
}

// run is the export loop: the full batches go when one fills; what is
// left of a batch at the next ScheduleDelay tick, so a span waits at most
// about that long; everything on a flush and at shutdown.
func (p *Provider) run() {
	defer close(p.done)
	var enc encoder
	tick := time.NewTicker(p.opts.ScheduleDelay)
	defer tick.Stop()
	// send exports what is pending in batches of MaxExportBatchSize: all
	// of it, or only the full batches (the rest goes back, to wait for
	// the next tick). It takes the whole slice at once, so that spans
	// ending meanwhile go to a fresh one without waiting for the upload.
	send := func(all bool) {
		size := p.opts.MaxExportBatchSize
		p.mu.Lock()
		taken := p.pending
		if !all && len(taken) < size {
			p.mu.Unlock()
			return
		}
		p.pending, p.spare = p.spare[:0], nil
		p.inflight = len(taken)
		p.mu.Unlock()
		i := 0
		for len(taken)-i >= size || (all && i < len(taken)) {
			n := min(size, len(taken)-i)
			p.export(&enc, taken[i:i+n])
			i += n
			p.mu.Lock()
			p.inflight -= n
			p.mu.Unlock()
		}
		p.mu.Lock()
		p.pending = append(p.pending, taken[i:]...)
		p.inflight = 0
		clear(taken)
		p.spare = taken[:0]
		full := len(p.pending) >= size
		p.mu.Unlock()
		if full { // the spans put back and those ended meanwhile
			p.wake()
		}
	}
	for {
		select {
		case <-p.full:
			send(false)
		case <-tick.C:
			send(true)
		case ch := <-p.flushes:
			send(true)
			close(ch)
		case <-p.stopped:
			send(true)
			return
		}
	}
}

// encoder holds the export loop's buffers from one batch to the next.
type encoder struct {
	scopes map[*tracer][]byte
	order  []*tracer
}

// export uploads one batch: its spans encoded (appendSpan), grouped by
// their tracer's scope.
func (p *Provider) export(enc *encoder, batch []*span) {
	if len(batch) == 0 {
		return
	}
	if enc.scopes == nil {
		enc.scopes = map[*tracer][]byte{}
	}
	enc.order = enc.order[:0]
	for _, s := range batch {
		b, ok := enc.scopes[s.t]
		if !ok || len(b) == 0 {
			enc.order = append(enc.order, s.t)
		}
		enc.scopes[s.t] = appendSpan(b, s)
	}
	rs := &tracepb.ResourceSpans{Resource: p.resource, SchemaUrl: p.schema}
	for _, t := range enc.order {
		ss := &tracepb.ScopeSpans{Scope: t.scope, SchemaUrl: t.schema}
		ss.ProtoReflect().SetUnknown(protoreflect.RawFields(enc.scopes[t]))
		rs.ScopeSpans = append(rs.ScopeSpans, ss)
	}
	defer func() {
		for _, t := range enc.order {
			enc.scopes[t] = enc.scopes[t][:0]
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), p.opts.ExportTimeout)
	defer cancel()
	// The client marshals the request before it sends it (and retries the
	// bytes), so the buffers are free again when it returns.
	if err := p.opts.Client.UploadTraces(ctx, []*tracepb.ResourceSpans{rs}); err != nil {
		p.drop(len(batch))
		// One warning a minute: a collector that is down would otherwise
		// log every batch.
		now := time.Now().UnixNano()
		if last := p.lastWarning.Load(); now-last > int64(time.Minute) && p.lastWarning.CompareAndSwap(last, now) {
			p.log.Warn().Err(err).Int("spans", len(batch)).Int64("dropped_total", p.droppedN.Load()).
				Msg("tracing: cannot export spans to the OTLP endpoint; they are dropped (walbox_trace_spans_dropped_total)")
		}
	}
}

// tracer is one instrumentation scope of a Provider.
type tracer struct {
	embedded.Tracer
	p      *Provider
	scope  *commonpb.InstrumentationScope
	schema string
}

// Start implements trace.Tracer.
func (t *tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	cfg := trace.NewSpanStartConfig(opts...)
	parent := trace.SpanContextFromContext(ctx)
	if cfg.NewRoot() {
		parent = trace.SpanContext{}
	}
	sid := rand.Uint64()
	for sid == 0 {
		sid = rand.Uint64()
	}
	scc := trace.SpanContextConfig{SpanID: spanID(sid), TraceFlags: trace.FlagsSampled}
	if parent.IsValid() {
		scc.TraceID, scc.TraceState = parent.TraceID(), parent.TraceState()
		if !parent.IsSampled() {
			// ParentBased: not recorded; the child carries the parent's
			// trace, unsampled, as the SDK's non-recording span does.
			scc.TraceFlags = parent.TraceFlags()
			ctx = trace.ContextWithSpanContext(ctx, trace.NewSpanContext(scc))
			return ctx, trace.SpanFromContext(ctx)
		}
	} else {
		hi, lo := rand.Uint64(), rand.Uint64()
		for hi == 0 && lo == 0 {
			hi, lo = rand.Uint64(), rand.Uint64()
		}
		scc.TraceID = traceID(hi, lo)
	}
	start := cfg.Timestamp()
	if start.IsZero() {
		start = time.Now()
	}
	s := &span{t: t, sc: trace.NewSpanContext(scc), parent: parent, name: name, kind: kind(cfg.SpanKind()), start: unixNano(start)}
	s.setAttributes(cfg.Attributes())
	for _, l := range cfg.Links() {
		s.addLink(l)
	}
	return trace.ContextWithSpan(ctx, s), s
}

func spanID(v uint64) (id trace.SpanID) {
	binary.BigEndian.PutUint64(id[:], v)
	return id
}

func traceID(hi, lo uint64) (id trace.TraceID) {
	binary.BigEndian.PutUint64(id[:8], hi)
	binary.BigEndian.PutUint64(id[8:], lo)
	return id
}

func unixNano(t time.Time) uint64 {
	if n := t.UnixNano(); n > 0 {
		return uint64(n)
	}
	return 0
}

func kind(k trace.SpanKind) tracepb.Span_SpanKind {
	switch k {
	case trace.SpanKindInternal:
		return tracepb.Span_SPAN_KIND_INTERNAL
	case trace.SpanKindServer:
		return tracepb.Span_SPAN_KIND_SERVER
	case trace.SpanKindClient:
		return tracepb.Span_SPAN_KIND_CLIENT
	case trace.SpanKindProducer:
		return tracepb.Span_SPAN_KIND_PRODUCER
	case trace.SpanKindConsumer:
		return tracepb.Span_SPAN_KIND_CONSUMER
	}
	return tracepb.Span_SPAN_KIND_INTERNAL // the API's default (unspecified)
}

// span is a recording span. Its fields are written out at export
// (appendSpan); after End only the export loop reads them.
type span struct {
	embedded.Span
	t      *tracer
	sc     trace.SpanContext
	parent trace.SpanContext // invalid for a root

	mu            sync.Mutex
	ended         bool
	name          string
	kind          tracepb.Span_SpanKind
	start, end    uint64 // Unix nanoseconds
	attrs         []attribute.KeyValue
	events        []event
	links         []trace.Link
	status        codes.Code
	statusMsg     string
	droppedAttrs  uint32
	droppedEvents uint32
	droppedLinks  uint32
}

// SpanContext implements trace.Span.
func (s *span) SpanContext() trace.SpanContext { return s.sc }

// IsRecording implements trace.Span: until its end.
func (s *span) IsRecording() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.ended
}

// TracerProvider implements trace.Span.
func (s *span) TracerProvider() trace.TracerProvider { return s.t.p }

// SetName implements trace.Span.
func (s *span) SetName(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ended {
		s.name = name
	}
}

// SetStatus implements trace.Span as the SDK does: Ok is final, Error
// replaces Unset with its description, Unset is ignored.
func (s *span) SetStatus(code codes.Code, description string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended || code == codes.Unset || s.status == codes.Ok {
		return
	}
	s.status, s.statusMsg = code, ""
	if code == codes.Error {
		s.statusMsg = description
	}
}

// SetAttributes implements trace.Span: a key set again takes the new value.
func (s *span) SetAttributes(kv ...attribute.KeyValue) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ended {
		s.setAttributes(kv)
	}
}

func (s *span) setAttributes(kvs []attribute.KeyValue) {
	for _, kv := range kvs {
		if !kv.Valid() {
			s.droppedAttrs++
			continue
		}
		replaced := false
		for i := range s.attrs {
			if s.attrs[i].Key == kv.Key {
				s.attrs[i].Value = kv.Value
				replaced = true
				break
			}
		}
		switch {
		case replaced:
		case len(s.attrs) >= attributeCountLimit:
			s.droppedAttrs++
		default:
			if s.attrs == nil {
				s.attrs = make([]attribute.KeyValue, 0, len(kvs))
			}
			s.attrs = append(s.attrs, kv)
		}
	}
}

// AddEvent implements trace.Span.
func (s *span) AddEvent(name string, opts ...trace.EventOption) {
	cfg := trace.NewEventConfig(opts...)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.addEvent(name, cfg)
}

func (s *span) addEvent(name string, cfg trace.EventConfig) {
	if s.ended {
		return
	}
	if len(s.events) >= eventAndLinkCountLimit {
		s.droppedEvents++
		return
	}
	ts := cfg.Timestamp()
	if ts.IsZero() {
		ts = time.Now()
	}
	s.events = append(s.events, event{name: name, time: unixNano(ts), attrs: cfg.Attributes()})
}

// RecordError implements trace.Span: an "exception" event, as the SDK
// records one.
func (s *span) RecordError(err error, opts ...trace.EventOption) {
	if err == nil {
		return
	}
	cfg := trace.NewEventConfig(append(opts, trace.WithAttributes(
		attribute.String("exception.type", fmt.Sprintf("%T", err)), attribute.String("exception.message", err.Error())))...)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.addEvent("exception", cfg)
}

// AddLink implements trace.Span.
func (s *span) AddLink(l trace.Link) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ended {
		s.addLink(l)
	}
}

func (s *span) addLink(l trace.Link) {
	if !l.SpanContext.IsValid() {
		return
	}
	if len(s.links) >= eventAndLinkCountLimit {
		s.droppedLinks++
		return
	}
	s.links = append(s.links, l)
}

// End implements trace.Span: the span goes to the export queue.
func (s *span) End(opts ...trace.SpanEndOption) {
	var end time.Time
	if len(opts) > 0 {
		cfg := trace.NewSpanEndConfig(opts...)
		end = cfg.Timestamp()
	}
	if end.IsZero() {
		end = time.Now()
	}
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended = true
	s.end = unixNano(end)
	s.mu.Unlock()
	s.t.p.enqueue(s)
}

// keyValues is attributes as OTLP key-values (the resource's).
func keyValues(kvs []attribute.KeyValue) []*commonpb.KeyValue {
	if len(kvs) == 0 {
		return nil
	}
	out := make([]*commonpb.KeyValue, 0, len(kvs))
	for _, kv := range kvs {
		out = append(out, &commonpb.KeyValue{Key: string(kv.Key), Value: value(kv.Value)})
	}
	return out
}

// value is v as an OTLP value, through the same encoding as spans'.
func value(v attribute.Value) *commonpb.AnyValue {
	av := &commonpb.AnyValue{}
	if err := proto.Unmarshal(appendAny(nil, v), av); err != nil {
		panic(fmt.Sprintf("leantrace: an attribute value does not encode: %v", err)) // appendAny writes valid AnyValues
	}
	return av
}
