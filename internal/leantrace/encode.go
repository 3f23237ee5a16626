package leantrace

import (
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
// checks these bytes against what the SDK's exporter sends.

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

	eventTime         = 1
	eventName         = 2
	eventAttributes   = 3
	eventDroppedAttrs = 4

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

// appendSpan appends s as ScopeSpans' field 2; scratch is reused for the
// span's body, and returned.
func appendSpan(b, scratch []byte, s *span) (out, scratchOut []byte) {
	body := scratch[:0]
	tid, sid := s.sc.TraceID(), s.sc.SpanID()
	body = appendBytes(body, spanTraceID, tid[:])
	body = appendBytes(body, spanSpanID, sid[:])
	if ts := s.parent.TraceState().String(); ts != "" {
		body = appendString(body, spanTraceState, ts)
	}
	if s.parent.IsValid() {
		pid := s.parent.SpanID()
		body = appendBytes(body, spanParentSpanID, pid[:])
	}
	body = appendString(body, spanName, s.name)
	if s.kind != 0 {
		body = protowire.AppendTag(body, spanKind, protowire.VarintType)
		body = protowire.AppendVarint(body, uint64(s.kind))
	}
	body = appendFixed64(body, spanStart, s.start)
	body = appendFixed64(body, spanEnd, s.end)
	for _, kv := range s.attrs {
		body = appendKeyValue(body, spanAttributes, kv)
	}
	body = appendUint32(body, spanDroppedAttrs, s.droppedAttrs)
	for _, e := range s.events {
		body = appendMessage(body, spanEvents, e.size(), e.append)
	}
	body = appendUint32(body, spanDroppedEvents, s.droppedEvents)
	for _, l := range s.links {
		lk := link(l)
		body = appendMessage(body, spanLinks, lk.size(), lk.append)
	}
	body = appendUint32(body, spanDroppedLinks, s.droppedLinks)
	// The status always goes, empty when unset, as the SDK's exporter
	// sends it.
	st := status{code: s.status, message: s.statusMsg}
	body = appendMessage(body, spanStatus, st.size(), st.append)
	body = protowire.AppendTag(body, spanFlags, protowire.Fixed32Type)
	body = protowire.AppendFixed32(body, s.flags)

	b = appendBytes(b, scopeSpansSpans, body)
	return b, body
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

// appendMessage appends a length-delimited field whose body of size
// bytes body appends.
func appendMessage(b []byte, field protowire.Number, size int, body func([]byte) []byte) []byte {
	b = protowire.AppendTag(b, field, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	return body(b)
}

// sizeField is the size of a length-delimited field holding n bytes.
func sizeField(field protowire.Number, n int) int {
	return protowire.SizeTag(field) + protowire.SizeBytes(n)
}

func appendKeyValue(b []byte, field protowire.Number, kv attribute.KeyValue) []byte {
	b = protowire.AppendTag(b, field, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(sizeKeyValue(kv)))
	b = appendString(b, kvKey, string(kv.Key))
	b = protowire.AppendTag(b, kvValue, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(sizeAny(kv.Value)))
	return appendAny(b, kv.Value)
}

func sizeKeyValue(kv attribute.KeyValue) int {
	return sizeField(kvKey, len(kv.Key)) + sizeField(kvValue, sizeAny(kv.Value))
}

func sizeKeyValues(kvs []attribute.KeyValue, field protowire.Number) int {
	n := 0
	for _, kv := range kvs {
		n += sizeField(field, sizeKeyValue(kv))
	}
	return n
}

// An AnyValue's value is a oneof: written even when it is the zero value.

func sizeAny(v attribute.Value) int {
	switch v.Type() {
	case attribute.BOOL:
		return protowire.SizeTag(anyBool) + 1
	case attribute.INT64:
		return protowire.SizeTag(anyInt) + protowire.SizeVarint(uint64(v.AsInt64()))
	case attribute.FLOAT64:
		return protowire.SizeTag(anyDouble) + 8
	case attribute.STRING:
		return sizeField(anyString, len(v.AsString()))
	case attribute.BOOLSLICE, attribute.INT64SLICE, attribute.FLOAT64SLICE, attribute.STRINGSLICE:
		return sizeField(anyArray, sizeArray(v))
	}
	return sizeField(anyString, len(v.Emit()))
}

func sizeArray(v attribute.Value) int {
	n := 0
	switch v.Type() {
	case attribute.BOOLSLICE:
		n = len(v.AsBoolSlice()) * sizeField(arrayValues, protowire.SizeTag(anyBool)+1)
	case attribute.INT64SLICE:
		for _, x := range v.AsInt64Slice() {
			n += sizeField(arrayValues, protowire.SizeTag(anyInt)+protowire.SizeVarint(uint64(x)))
		}
	case attribute.FLOAT64SLICE:
		n = len(v.AsFloat64Slice()) * sizeField(arrayValues, protowire.SizeTag(anyDouble)+8)
	case attribute.STRINGSLICE:
		for _, x := range v.AsStringSlice() {
			n += sizeField(arrayValues, sizeField(anyString, len(x)))
		}
	}
	return n
}

func appendAny(b []byte, v attribute.Value) []byte {
	switch v.Type() {
	case attribute.BOOL:
		return appendBool(b, v.AsBool())
	case attribute.INT64:
		b = protowire.AppendTag(b, anyInt, protowire.VarintType)
		return protowire.AppendVarint(b, uint64(v.AsInt64()))
	case attribute.FLOAT64:
		b = protowire.AppendTag(b, anyDouble, protowire.Fixed64Type)
		return protowire.AppendFixed64(b, math.Float64bits(v.AsFloat64()))
	case attribute.STRING:
		return appendString(b, anyString, v.AsString())
	case attribute.BOOLSLICE, attribute.INT64SLICE, attribute.FLOAT64SLICE, attribute.STRINGSLICE:
		b = protowire.AppendTag(b, anyArray, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(sizeArray(v)))
		return appendArray(b, v)
	}
	// Byte slices, nested slices and maps: their string form (the relay
	// sets none).
	return appendString(b, anyString, v.Emit())
}

func appendBool(b []byte, x bool) []byte {
	b = protowire.AppendTag(b, anyBool, protowire.VarintType)
	return protowire.AppendVarint(b, protowire.EncodeBool(x))
}

func appendArray(b []byte, v attribute.Value) []byte {
	elem := func(b []byte, size int) []byte {
		b = protowire.AppendTag(b, arrayValues, protowire.BytesType)
		return protowire.AppendVarint(b, uint64(size))
	}
	switch v.Type() {
	case attribute.BOOLSLICE:
		for _, x := range v.AsBoolSlice() {
			b = appendBool(elem(b, protowire.SizeTag(anyBool)+1), x)
		}
	case attribute.INT64SLICE:
		for _, x := range v.AsInt64Slice() {
			b = elem(b, protowire.SizeTag(anyInt)+protowire.SizeVarint(uint64(x)))
			b = protowire.AppendTag(b, anyInt, protowire.VarintType)
			b = protowire.AppendVarint(b, uint64(x))
		}
	case attribute.FLOAT64SLICE:
		for _, x := range v.AsFloat64Slice() {
			b = elem(b, protowire.SizeTag(anyDouble)+8)
			b = protowire.AppendTag(b, anyDouble, protowire.Fixed64Type)
			b = protowire.AppendFixed64(b, math.Float64bits(x))
		}
	case attribute.STRINGSLICE:
		for _, x := range v.AsStringSlice() {
			b = appendString(elem(b, sizeField(anyString, len(x))), anyString, x)
		}
	}
	return b
}

// status is a span's Status message.
type status struct {
	code    codes.Code
	message string
}

func (s status) pbCode() tracepb.Status_StatusCode {
	switch s.code {
	case codes.Error:
		return tracepb.Status_STATUS_CODE_ERROR
	case codes.Ok:
		return tracepb.Status_STATUS_CODE_OK
	}
	return tracepb.Status_STATUS_CODE_UNSET
}

func (s status) size() int {
	n := 0
	if s.message != "" {
		n += sizeField(statusMessage, len(s.message))
	}
	if c := s.pbCode(); c != 0 {
		n += protowire.SizeTag(statusCode) + protowire.SizeVarint(uint64(c))
	}
	return n
}

func (s status) append(b []byte) []byte {
	if s.message != "" {
		b = appendString(b, statusMessage, s.message)
	}
	if c := s.pbCode(); c != 0 {
		b = protowire.AppendTag(b, statusCode, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(c))
	}
	return b
}

// event is a span event.
type event struct {
	name    string
	time    uint64
	attrs   []attribute.KeyValue
	dropped uint32
}

func (e event) size() int {
	n := sizeKeyValues(e.attrs, eventAttributes)
	if e.time != 0 {
		n += protowire.SizeTag(eventTime) + 8
	}
	if e.name != "" {
		n += sizeField(eventName, len(e.name))
	}
	if e.dropped != 0 {
		n += protowire.SizeTag(eventDroppedAttrs) + protowire.SizeVarint(uint64(e.dropped))
	}
	return n
}

func (e event) append(b []byte) []byte {
	b = appendFixed64(b, eventTime, e.time)
	if e.name != "" {
		b = appendString(b, eventName, e.name)
	}
	for _, kv := range e.attrs {
		b = appendKeyValue(b, eventAttributes, kv)
	}
	return appendUint32(b, eventDroppedAttrs, e.dropped)
}

// link is a span link.
type link trace.Link

func (l link) flags() uint32 {
	return uint32(l.SpanContext.TraceFlags()) | uint32(tracepb.SpanFlags_SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK)
}

func (l link) size() int {
	n := sizeField(linkTraceID, 16) + sizeField(linkSpanID, 8) + sizeKeyValues(l.Attributes, linkAttributes) +
		protowire.SizeTag(linkFlags) + 4
	if ts := l.SpanContext.TraceState().String(); ts != "" {
		n += sizeField(linkTraceState, len(ts))
	}
	return n
}

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
	return protowire.AppendFixed32(b, l.flags())
}
