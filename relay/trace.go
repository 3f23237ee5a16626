package relay

import (
	"context"
	"encoding/json"
	"math"
	"math/rand/v2"
	"net/textproto"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// SpanName is the name of the span the relay opens for each event it
// publishes.
const SpanName = "walbox publish"

// Tracing: each event the relay publishes gets a span, SpanName, of kind
// producer: a child of the trace context the producer wrote into the
// event's headers column (traceparent, tracestate), a new root otherwise.
// The message carries the span's own context onward, so a consumer's span
// is its child: one trace from the producer's transaction to the
// consumer's handler. The span starts at the first publish, counts the
// resends, and ends at the ack (or the dead letter's ack).

// Span attributes of walbox's own, beside OpenTelemetry's messaging ones.
const (
	AttrCommitLSN   = attribute.Key("walbox.commit_lsn")
	AttrTable       = attribute.Key("walbox.table")
	AttrStream      = attribute.Key("walbox.stream")
	AttrSequence    = attribute.Key("walbox.stream_sequence")
	AttrCommitToAck = attribute.Key("walbox.commit_to_ack_ms")
	AttrResends     = attribute.Key("walbox.resends")
	AttrDuplicate   = attribute.Key("walbox.duplicate")
	AttrDeadLetter  = attribute.Key("walbox.dead_letter.reason")
)

// tracing is the relay's tracer, nil when tracing is off.
type tracing struct {
	t      trace.Tracer
	system attribute.KeyValue
	kafka  bool
	prop   propagation.TextMapPropagator
	ratio  float64 // share of events without a parent that get a span
	// skip: events without a parent to leave out before the next one
	// sampled at ratio (a geometric draw: see sampled). Only the relay's
	// loop goroutine touches it, and attrs.
	skip int64
	// attrs is acked's scratch: a span copies the attributes it is given,
	// and a slice handed through the Span interface escapes (1 KB a span
	// on the heap when it was a fresh array each time).
	attrs []attribute.KeyValue
}

func newTracing(t trace.Tracer, system string, ratio float64) *tracing {
	if t == nil {
		return nil
	}
	switch {
	case ratio == 0 || ratio > 1:
		ratio = 1
	case ratio < 0:
		ratio = 0
	}
	tr := &tracing{t: t, system: semconv.MessagingSystemKey.String(system), kafka: system == "kafka",
		prop: propagation.TraceContext{}, ratio: ratio}
	tr.skip = tr.gap()
	return tr
}

// gap draws how many events without a parent go unsampled before the
// next sampled one: the number of failures before the first success of
// independent trials that each succeed with probability ratio, P(k) =
// (1-ratio)^k · ratio, by inversion (k = ⌊ln U / ln(1-ratio)⌋, U uniform
// on (0,1]). Drawing the gaps gives the same sampled events, in law, as a
// draw per event, at one draw per sampled event: in a catch-up at 1 % the
// per-event draw was 0.3 % of the relay's CPU (make bench, section 6).
func (tr *tracing) gap() int64 {
	if tr.ratio >= 1 || tr.ratio <= 0 {
		return 0
	}
	k := math.Floor(math.Log(1-rand.Float64()) / math.Log1p(-tr.ratio))
	return int64(min(k, math.MaxInt64/2))
}

// sampled decides, before any span exists, whether p gets one: the
// producer's sampled flag where it sent a context (parent-based), else the
// ratio. An event that gets none costs a header lookup: a catch-up of
// 60,000 events/s would pay several per cent of its CPU for spans nobody
// exports (make bench, section 6).
func (tr *tracing) sampled(parent trace.SpanContext) bool {
	if parent.IsValid() {
		return parent.IsSampled()
	}
	switch {
	case tr.ratio >= 1:
		return true
	case tr.ratio <= 0:
		return false
	case tr.skip > 0:
		tr.skip--
		return false
	}
	tr.skip = tr.gap()
	return true
}

// headerCarrier lets the propagator read and write a message's headers.
// The headers column keeps its keys as written: a read falls back to any
// case.
type headerCarrier Header

func (c headerCarrier) Get(key string) string {
	if v := Header(c).Get(key); v != "" {
		return v
	}
	// Traceparent, as HTTP spells it. The two keys the propagator reads
	// are spelled out: canonicalizing allocates, and every event pays the
	// lookup, sampled or not (BenchmarkTracingPerEvent).
	switch key {
	case "traceparent":
		return Header(c).Get("Traceparent")
	case "tracestate":
		return Header(c).Get("Tracestate")
	}
	return Header(c).Get(textproto.CanonicalMIMEHeaderKey(key))
}

func (c headerCarrier) Set(key, value string) {
	for k := range c {
		if k != key && strings.EqualFold(k, key) {
			delete(c, k) // one spelling: the span's context replaces the producer's
		}
	}
	Header(c).Set(key, value)
}

func (c headerCarrier) Keys() []string {
	out := make([]string, 0, len(c))
	for k := range c {
		out = append(out, k)
	}
	return out
}

// published is called at each publish of p: the first opens its span, a
// later one counts a resend; each writes the span's context into the
// message (a dead letter is a new message).
func (tr *tracing) published(p *pending) {
	if p.untraced {
		return
	}
	if p.span == nil {
		parent := context.Background()
		if !p.dlq && (len(p.ev.Headers) == 0 || headerCarrier(p.msg.Header).Get("traceparent") == "") {
			// No producer context (the propagator reads traceparent
			// first and finds none either): the ratio alone decides, and
			// most events of a catch-up at 1 % cost a counter's decrement
			// (sampled). A dead letter reads the headers column below.
			//
			// Without a headers column the message holds no traceparent,
			// so the lookup is skipped (it cost 150 ns an event in a
			// catch-up, 2.3 % of the relay's CPU: the map is cold by
			// then). Proof: the router writes walbox's own keys and then
			// the headers column's (Router.Route); none of walbox's is
			// traceparent; a recycled message keeps only walbox's keys
			// (Router.Recycle refuses one holding any other, such as a
			// context injected below); and this span's own context is
			// injected only once the span exists (p.span set, this branch
			// not taken). TestNoHeadersColumnMeansNoParent covers a
			// recycled message that carried a sampled span's context.
			if !tr.sampled(trace.SpanContext{}) {
				p.untraced = true
				return
			}
		} else {
			parent = tr.prop.Extract(parent, headerCarrier(p.msg.Header))
			if p.dlq && !trace.SpanContextFromContext(parent).IsValid() && len(p.ev.Headers) > 0 {
				// A dead letter does not carry the headers column as headers:
				// the producer's context is read from the column itself.
				var cols map[string]any
				if json.Unmarshal(p.ev.Headers, &cols) == nil {
					h := Header{}
					for k, v := range cols {
						if s, ok := v.(string); ok {
							h.Set(k, s)
						}
					}
					parent = tr.prop.Extract(context.Background(), headerCarrier(h))
				}
			}
			if !tr.sampled(trace.SpanContextFromContext(parent)) {
				p.untraced = true
				return
			}
		}
		// Its attributes are set at its end, in one call: the SDK grows the
		// span's slice at each call and copies it (1.4 KB a span when they
		// were set at both ends).
		_, p.span = tr.t.Start(parent, SpanName, trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(p.sentAt))
	} else {
		p.resends++
	}
	if p.span.IsRecording() {
		// An unsampled span is exported nowhere: the message keeps the
		// producer's context (or none), and a consumer's span is the
		// producer's child. A sampled one is the consumer's parent.
		tr.prop.Inject(trace.ContextWithSpan(context.Background(), p.span), headerCarrier(p.msg.Header))
	}
}

// acked ends p's span with where the event was stored; table is its
// outbox table.
func (tr *tracing) acked(p *pending, ack *Ack, now time.Time, table string) {
	s := p.span
	if s == nil {
		return
	}
	p.span = nil
	if !s.IsRecording() {
		s.End()
		return
	}
	// The destination is where it went last: a dead letter's is the
	// dead-letter subject or topic.
	attrs := append(tr.attrs[:0], tr.system, semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("publish"),
		semconv.MessagingMessageID(p.ev.ID), semconv.MessagingDestinationName(p.msg.Subject),
		AttrCommitLSN.String(p.ev.Pos.CommitLSN.String()), AttrResends.Int(p.resends),
		AttrCommitToAck.Float64(float64(now.Sub(p.ev.CommitTime).Microseconds())/1000))
	if table != "" {
		attrs = append(attrs, AttrTable.String(table))
	}
	if tr.kafka {
		attrs = append(attrs, semconv.MessagingDestinationPartitionID(strconv.Itoa(int(ack.Partition))))
		if ack.Sequence > 0 {
			attrs = append(attrs, semconv.MessagingKafkaOffset(int(ack.Sequence-1)))
		}
	} else {
		attrs = append(attrs, AttrStream.String(ack.Stream), AttrSequence.Int64(int64(ack.Sequence)))
	}
	if ack.Duplicate {
		attrs = append(attrs, AttrDuplicate.Bool(true))
	}
	if p.dlq {
		attrs = append(attrs, AttrDeadLetter.String(p.reason))
		s.SetStatus(codes.Error, "dead-lettered: "+p.reason)
	}
	s.SetAttributes(attrs...)
	clear(attrs) // no strings kept alive by the scratch
	tr.attrs = attrs[:0]
	s.End(trace.WithTimestamp(now))
}
