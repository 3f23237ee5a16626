package leantrace

import (
	"encoding/binary"
	"math"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/encoding/protowire"
)

// A finished span is written in OTLP's protobuf wire format straight from
// its fields (opentelemetry/proto/trace/v1/trace.proto, common/v1), as
// ScopeSpans' field 2: the export hands the client a ScopeSpans whose
// spans are these bytes, carried as the message's unknown fields, which
// protobuf writes out as they are (and a receiver reads as the spans they
// are). Reflection-based marshalling of the messages was 3.7 µs of a
// span's 14 (BenchmarkSampledSpanCPU); TestExportsWhatTheSDKExports
// checks these bytes against what the SDK's exporter sends. Every nested
// message goes through appendNested, which writes the body first and its
// length after: no size is computed apart from the bytes.

// Field numbers of trace.proto and common.proto.
const (
	scopeSpansSpans = 2

	spanTraceID       = 1
	spanSpanID        = 2
	spanTraceState    = 3
	spanParentSpanID  = 4
	spanName          = 5
	spanKind          = 6
	spanStart         = 7
	spanEnd           = 8
	spanAttributes    = 9
	spanDroppedAttrs  = 10
	spanEvents        = 11
	spanDroppedEvents = 12
	spanLinks         = 13
	spanDroppedLinks  = 14
	spanStatus        = 15
	spanFlags         = 16

	statusMessage = 2
	statusCode    = 3

	eventTime       = 1
	eventName       = 2
	eventAttributes = 3

	linkTraceID    = 1
	linkSpanID     = 2
	linkTraceState = 3
	linkAttributes = 4
	linkFlags      = 6

	kvKey   = 1
	kvValue = 2

	anyString = 1
	anyBool   = 2
	anyInt    = 3
	anyDouble = 4
	anyArray  = 5

	arrayValues = 1
)

// appendSpan appends s as ScopeSpans' field 2.
func appendSpan(b []byte, s *span) []byte {
	return appendNested(b, scopeSpansSpans, func(b []byte) []byte {
		tid, sid := s.sc.TraceID(), s.sc.SpanID()
		b = appendBytes(b, spanTraceID, tid[:])
		b = appendBytes(b, spanSpanID, sid[:])
		if ts := s.parent.TraceState().String(); ts != "" {
			b = appendString(b, spanTraceState, ts)
		}
		if s.parent.IsValid() {
			pid := s.parent.SpanID()
			b = appendBytes(b, spanParentSpanID, pid[:])
		}
		b = appendString(b, spanName, s.name)
		if s.kind != 0 {
			b = protowire.AppendTag(b, spanKind, protowire.VarintType)
			b = protowire.AppendVarint(b, uint64(s.kind))
		}
		b = appendFixed64(b, spanStart, s.start)
		b = appendFixed64(b, spanEnd, s.end)
		for _, kv := range s.attrs {
			b = appendKeyValue(b, spanAttributes, kv)
		}
		b = appendUint32(b, spanDroppedAttrs, s.droppedAttrs)
		for _, e := range s.events {
			b = appendNested(b, spanEvents, e.append)
		}
		b = appendUint32(b, spanDroppedEvents, s.droppedEvents)
		for _, l := range s.links {
			b = appendNested(b, spanLinks, link(l).append)
		}
		b = appendUint32(b, spanDroppedLinks, s.droppedLinks)
		// The status always goes, empty when unset, as the SDK's exporter
		// sends it.
		b = appendNested(b, spanStatus, status{code: s.status, message: s.statusMsg}.append)
		b = protowire.AppendTag(b, spanFlags, protowire.Fixed32Type)
		return protowire.AppendFixed32(b, flags(s.sc, s.parent.IsRemote()))
	})
}

// flags is the flags field of a span or link of sc: its W3C trace flags,
// and whether its parent (a link's: itself) is remote, which walbox
// always knows.
func flags(sc trace.SpanContext, remote bool) uint32 {
	f := uint32(sc.TraceFlags()) | uint32(tracepb.SpanFlags_SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK)
	if remote {
		f |= uint32(tracepb.SpanFlags_SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK)
	}
	return f
}

// appendNested appends a length-delimited field holding the message body
// appends. The body is written first, then moved past its length's
// varint.
func appendNested(b []byte, field protowire.Number, body func([]byte) []byte) []byte {
	b = protowire.AppendTag(b, field, protowire.BytesType)
	start := len(b)
	b = body(b)
	n := len(b) - start
	w := protowire.SizeVarint(uint64(n))
	var room [binary.MaxVarintLen64]byte
	b = append(b, room[:w]...)
	copy(b[start+w:], b[start:start+n])
	protowire.AppendVarint(b[start:start], uint64(n)) // into the room made
	return b
}

func appendBytes(b []byte, field protowire.Number, v []byte) []byte {
	b = protowire.AppendTag(b, field, protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

func appendString(b []byte, field protowire.Number, v string) []byte {
	b = protowire.AppendTag(b, field, protowire.BytesType)
	return protowire.AppendString(b, v)
}

func appendFixed64(b []byte, field protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = protowire.AppendTag(b, field, protowire.Fixed64Type)
	return protowire.AppendFixed64(b, v)
}

// appendUint32 appends a proto3 uint32: nothing when zero.
func appendUint32(b []byte, field protowire.Number, v uint32) []byte {
	if v == 0 {
		return b
	}
	b = protowire.AppendTag(b, field, protowire.VarintType)
	return protowire.AppendVarint(b, uint64(v))
}

func appendKeyValue(b []byte, field protowire.Number, kv attribute.KeyValue) []byte {
	return appendNested(b, field, func(b []byte) []byte {
		b = appendString(b, kvKey, string(kv.Key))
		return appendNested(b, kvValue, func(b []byte) []byte { return appendAny(b, kv.Value) })
	})
}

// appendAny appends the fields of an AnyValue. Its value is a oneof:
// written even when it is the zero value.
func appendAny(b []byte, v attribute.Value) []byte {
	switch v.Type() {
	case attribute.BOOL:
		b = protowire.AppendTag(b, anyBool, protowire.VarintType)
		return protowire.AppendVarint(b, protowire.EncodeBool(v.AsBool()))
	case attribute.INT64:
		b = protowire.AppendTag(b, anyInt, protowire.VarintType)
		return protowire.AppendVarint(b, uint64(v.AsInt64()))
	case attribute.FLOAT64:
		b = protowire.AppendTag(b, anyDouble, protowire.Fixed64Type)
		return protowire.AppendFixed64(b, math.Float64bits(v.AsFloat64()))
	case attribute.STRING:
		return appendString(b, anyString, v.AsString())
	case attribute.BOOLSLICE, attribute.INT64SLICE, attribute.FLOAT64SLICE, attribute.STRINGSLICE:
		return appendNested(b, anyArray, func(b []byte) []byte { return appendArray(b, v) })
	}
	// Byte slices, nested slices and maps: their string form (the relay
	// sets none).
	return appendString(b, anyString, v.Emit())
}

// appendArray appends the values of a slice of v's type as an
// ArrayValue's.
func appendArray(b []byte, v attribute.Value) []byte {
	elem := func(b []byte, x attribute.Value) []byte {
		return appendNested(b, arrayValues, func(b []byte) []byte { return appendAny(b, x) })
	}
	switch v.Type() {
	case attribute.BOOLSLICE:
		for _, x := range v.AsBoolSlice() {
			b = elem(b, attribute.BoolValue(x))
		}
	case attribute.INT64SLICE:
		for _, x := range v.AsInt64Slice() {
			b = elem(b, attribute.Int64Value(x))
		}
	case attribute.FLOAT64SLICE:
		for _, x := range v.AsFloat64Slice() {
			b = elem(b, attribute.Float64Value(x))
		}
	case attribute.STRINGSLICE:
		for _, x := range v.AsStringSlice() {
			b = elem(b, attribute.StringValue(x))
		}
	}
	return b
}

// status is a span's Status message.
type status struct {
	code    codes.Code
	message string
}

func (s status) append(b []byte) []byte {
	if s.message != "" {
		b = appendString(b, statusMessage, s.message)
	}
	c := tracepb.Status_STATUS_CODE_UNSET
	switch s.code {
	case codes.Error:
		c = tracepb.Status_STATUS_CODE_ERROR
	case codes.Ok:
		c = tracepb.Status_STATUS_CODE_OK
	}
	if c != 0 {
		b = protowire.AppendTag(b, statusCode, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(c))
	}
	return b
}

// event is a span event.
type event struct {
	name  string
	time  uint64
	attrs []attribute.KeyValue
}

func (e event) append(b []byte) []byte {
	b = appendFixed64(b, eventTime, e.time)
	if e.name != "" {
		b = appendString(b, eventName, e.name)
	}
	for _, kv := range e.attrs {
		b = appendKeyValue(b, eventAttributes, kv)
	}
	return b
}

// link is a span link.
type link trace.Link

func (l link) append(b []byte) []byte {
	tid, sid := l.SpanContext.TraceID(), l.SpanContext.SpanID()
	b = appendBytes(b, linkTraceID, tid[:])
	b = appendBytes(b, linkSpanID, sid[:])
	if ts := l.SpanContext.TraceState().String(); ts != "" {
		b = appendString(b, linkTraceState, ts)
	}
	for _, kv := range l.Attributes {
		b = appendKeyValue(b, linkAttributes, kv)
	}
	b = protowire.AppendTag(b, linkFlags, protowire.Fixed32Type)
	return protowire.AppendFixed32(b, flags(l.SpanContext, l.SpanContext.IsRemote()))
}
