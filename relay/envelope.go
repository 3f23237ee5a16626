package relay

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/walbox/walbox/cdc"
)

// Envelopes: what a message's data holds.
const (
	// EnvelopeRaw publishes the payload column as stored.
	EnvelopeRaw = "raw"
	// EnvelopeCloudEvents is CloudEvents 1.0 binary mode: ce-* headers, the
	// payload as data.
	EnvelopeCloudEvents = "cloudevents"
	// EnvelopeCloudEventsStructured is CloudEvents 1.0 structured mode: the
	// data is one JSON event with the payload under "data".
	EnvelopeCloudEventsStructured = "cloudevents-structured"
	// EnvelopeWalbox wraps the payload in walbox's JSON envelope.
	EnvelopeWalbox = "envelope"
)

// Envelopes lists the valid values of RouterOptions.Envelope.
var Envelopes = []string{EnvelopeRaw, EnvelopeCloudEvents, EnvelopeCloudEventsStructured, EnvelopeWalbox}

// DefaultSubjectTemplate makes the topic the subject (before the prefix).
const DefaultSubjectTemplate = "{topic}"

// DefaultPartitionBuckets is the number of {bucket} values by default.
const DefaultPartitionBuckets = 16

// CloudEvents header names (binary mode, NATS protocol binding).
const (
	HeaderCESpecVersion     = "ce-specversion"
	HeaderCEID              = "ce-id"
	HeaderCEType            = "ce-type"
	HeaderCESource          = "ce-source"
	HeaderCETime            = "ce-time"
	HeaderCESubject         = "ce-subject"
	HeaderCEDataContentType = "ce-datacontenttype"
	HeaderContentType       = "Content-Type"
)

// RoutingRule asserts that events whose topic starts with TopicPrefix land
// in Stream; one that would land elsewhere is dead-lettered.
type RoutingRule struct {
	TopicPrefix string
	Stream      string
}

// RouterOptions are the optional parts of a Router. The zero value behaves
// as NewRouter: subject = prefix + topic, raw payload, no rules.
type RouterOptions struct {
	// SubjectTemplate builds the subject (before the prefix) from
	// {topic}, {partition}, {bucket}, {event_type} and {aggregate_type}.
	// "" means DefaultSubjectTemplate.
	SubjectTemplate string
	// PartitionBuckets is the modulus of {bucket}; 0 means
	// DefaultPartitionBuckets.
	PartitionBuckets int
	// Envelope is one of Envelopes; "" means EnvelopeRaw.
	Envelope string
	// CloudEventsSource is ce-source; "" means "walbox/" + the router's
	// source (<database>/<slot>).
	CloudEventsSource string
	// Rules assert the stream of topics by prefix; the longest matching
	// prefix applies.
	Rules []RoutingRule
	// Table names the outbox table, for the table label of the metrics.
	Table string
	// IDHeader, if set, is a header that carries the event id beside
	// Nats-Msg-Id (the debezium layout's "id").
	IDHeader string
}

// shape is how one outbox table's events become messages: subject
// template, buckets, envelope and routing rules.
type shape struct {
	template []tmplSeg // nil: prefix + topic
	buckets  uint32
	envelope string
	ceSource string
	rules    []RoutingRule
	idHeader string
	// msgIDPrefix qualifies the Nats-Msg-Id of every table but the first
	// ("schema.table:"): two tables may both have a row 1, and JetStream
	// would drop the second as a duplicate of the first.
	msgIDPrefix string
	table       string
}

// TableName is the name of outbox table i, as the metrics label it.
func (r *Router) TableName(i int) string { return r.shapeFor(i).table }

// TableIndex is the index of the outbox table named name (a message's
// Walbox-Table), 0 when none has that name.
func (r *Router) TableIndex(name string) int {
	for i, sh := range *r.shapes.Load() {
		if sh != nil && sh.table == name && name != "" {
			return i
		}
	}
	return 0
}

// NewRouterWithOptions builds a router as NewRouter does, with opts for
// the events of every table (table 0, and those AddTable does not set).
func NewRouterWithOptions(prefix, source string, routes []Route, opts RouterOptions) (*Router, error) {
	r := NewRouter(prefix, source, routes)
	sh, err := newShape(source, opts)
	if err != nil {
		return nil, err
	}
	r.shapes.Store(&[]*shape{sh})
	return r, nil
}

// SetTable sets the routing and envelope of the events of table i
// (cdc.Event.Table). It may be called while Message runs.
func (r *Router) SetTable(i int, opts RouterOptions) error {
	if i < 0 {
		return fmt.Errorf("table index %d", i)
	}
	sh, err := newShape(r.source, opts)
	if err != nil {
		return err
	}
	if i > 0 && opts.Table != "" {
		sh.msgIDPrefix = opts.Table + ":"
	}
	r.shapesMu.Lock()
	defer r.shapesMu.Unlock()
	next := slices.Clone(*r.shapes.Load())
	for len(next) <= i {
		next = append(next, nil)
	}
	next[i] = sh
	r.shapes.Store(&next)
	return nil
}

func newShape(source string, opts RouterOptions) (*shape, error) {
	sh := &shape{idHeader: opts.IDHeader, table: opts.Table}
	if opts.SubjectTemplate != "" && opts.SubjectTemplate != DefaultSubjectTemplate {
		segs, err := parseSubjectTemplate(opts.SubjectTemplate)
		if err != nil {
			return nil, err
		}
		sh.template = segs
	}
	sh.buckets = uint32(DefaultPartitionBuckets)
	if opts.PartitionBuckets < 0 {
		return nil, fmt.Errorf("partition buckets %d: must be positive", opts.PartitionBuckets)
	}
	if opts.PartitionBuckets > 0 {
		sh.buckets = uint32(opts.PartitionBuckets)
	}
	switch opts.Envelope {
	case "", EnvelopeRaw:
		sh.envelope = EnvelopeRaw
	case EnvelopeCloudEvents, EnvelopeCloudEventsStructured, EnvelopeWalbox:
		sh.envelope = opts.Envelope
	default:
		return nil, fmt.Errorf("envelope %q: use one of %s", opts.Envelope, strings.Join(Envelopes, ", "))
	}
	sh.ceSource = opts.CloudEventsSource
	if sh.ceSource == "" {
		sh.ceSource = "walbox/" + source
	}
	for _, rule := range opts.Rules {
		if rule.TopicPrefix == "" || rule.Stream == "" {
			return nil, fmt.Errorf("routing rule %+v: topic prefix and stream are required", rule)
		}
	}
	sh.rules = opts.Rules
	return sh, nil
}

// Template placeholders.
const (
	phTopic         = "topic"
	phPartition     = "partition"
	phBucket        = "bucket"
	phEventType     = "event_type"
	phAggregateType = "aggregate_type"
)

// tmplSeg is a literal (ph == "") or a placeholder.
type tmplSeg struct{ lit, ph string }

// ValidateSubjectTemplate checks a subject template: known placeholders
// only, balanced braces, and a valid subject once filled in.
func ValidateSubjectTemplate(s string) error {
	_, err := parseSubjectTemplate(s)
	return err
}

func parseSubjectTemplate(s string) ([]tmplSeg, error) {
	if s == "" {
		return nil, fmt.Errorf("empty template: use %s at least", DefaultSubjectTemplate)
	}
	var segs []tmplSeg
	rest := s
	for rest != "" {
		i := strings.IndexAny(rest, "{}")
		if i < 0 {
			segs = append(segs, tmplSeg{lit: rest})
			break
		}
		if rest[i] == '}' {
			return nil, fmt.Errorf("%q: '}' without '{'", s)
		}
		if i > 0 {
			segs = append(segs, tmplSeg{lit: rest[:i]})
		}
		j := strings.IndexByte(rest[i:], '}')
		if j < 0 {
			return nil, fmt.Errorf("%q: '{' without '}'", s)
		}
		name := rest[i+1 : i+j]
		switch name {
		case phTopic, phPartition, phBucket, phEventType, phAggregateType:
		default:
			return nil, fmt.Errorf("%q: unknown placeholder {%s}: use {topic}, {partition}, {bucket}, {event_type} or {aggregate_type}", s, name)
		}
		segs = append(segs, tmplSeg{ph: name})
		rest = rest[i+j+1:]
	}
	// Filled in with sample values, the template must give a valid subject.
	sample := renderTemplate(segs, &cdc.Event{Topic: "t", EventType: "e", AggregateType: "a", PartitionKey: "p"}, 16)
	if err := ValidSubject(sample); err != nil {
		return nil, fmt.Errorf("%q does not form a valid subject (e.g. %q): %v", s, sample, err)
	}
	return segs, nil
}

// partitionKey is the event's ordering key: the partition key, else the
// aggregate id, else "".
func partitionKey(ev *cdc.Event) string {
	if ev.PartitionKey != "" {
		return ev.PartitionKey
	}
	return ev.AggregateID
}

// sanitizeToken makes s one subject token: every byte not [A-Za-z0-9_-]
// becomes '_'; "" becomes "_".
func sanitizeToken(s string) string {
	if s == "" {
		return "_"
	}
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			b[i] = '_'
		}
	}
	return string(b)
}

// Bucket returns the {bucket} of a partition key: FNV-1a 32-bit mod n.
func Bucket(key string, n uint32) uint32 {
	h := fnv.New32a()
	h.Write([]byte(key))
	return h.Sum32() % n
}

func orUnderscore(s string) string {
	if s == "" {
		return "_"
	}
	return s
}

func renderTemplate(segs []tmplSeg, ev *cdc.Event, buckets uint32) string {
	var b strings.Builder
	for _, s := range segs {
		switch s.ph {
		case "":
			b.WriteString(s.lit)
		case phTopic:
			b.WriteString(ev.Topic)
		case phPartition:
			// Sanitized by byte: a multi-byte rune gives several '_'.
			b.WriteString(sanitizeToken(partitionKey(ev)))
		case phBucket:
			b.WriteString(strconv.FormatUint(uint64(Bucket(partitionKey(ev), buckets)), 10))
		case phEventType:
			b.WriteString(orUnderscore(ev.EventType))
		case phAggregateType:
			b.WriteString(orUnderscore(ev.AggregateType))
		}
	}
	return b.String()
}

// subject is the event's subject: prefix + the filled-in template.
func (r *shape) subject(prefix string, ev *cdc.Event) string {
	if r.template == nil {
		return prefix + ev.Topic
	}
	return prefix + renderTemplate(r.template, ev, r.buckets)
}

// SubjectFilter is a subject filter (NATS wildcards) that captures the
// subject of every event of table i (cdc.Event.Table) whose topic matches
// the pattern topic, built from that table's subject template and the
// prefix. It is "" when topic is "" or the template allows no filter
// narrower than every subject: {event_type} and {aggregate_type} may hold
// dots (any number of tokens), and a wildcard must fill a whole token.
// {partition} and {bucket} are one token each: '*'.
func (r *Router) SubjectFilter(i int, topic string) string {
	if topic == "" {
		return ""
	}
	return r.shapeFor(i).filter(r.prefix, topic)
}

func (r *shape) filter(prefix, topic string) string {
	if r.template == nil {
		return prefix + topic
	}
	var b strings.Builder
	b.WriteString(prefix)
	for _, s := range r.template {
		switch s.ph {
		case "":
			b.WriteString(s.lit)
		case phTopic:
			b.WriteString(topic)
		case phPartition, phBucket:
			b.WriteString("*")
		default:
			return ""
		}
	}
	f := b.String()
	toks := strings.Split(f, ".")
	for j, tok := range toks {
		if strings.ContainsAny(tok, "*>") && tok != "*" && tok != ">" || tok == ">" && j != len(toks)-1 {
			return "" // a wildcard inside a token, or > before the end
		}
	}
	return f
}

// ruleFor returns the routing rule with the longest prefix of topic.
func (r *shape) ruleFor(topic string) (RoutingRule, bool) {
	best, ok := RoutingRule{}, false
	for _, rule := range r.rules {
		if strings.HasPrefix(topic, rule.TopicPrefix) && (!ok || len(rule.TopicPrefix) > len(best.TopicPrefix)) {
			best, ok = rule, true
		}
	}
	return best, ok
}

// ceType is the CloudEvents type: the event type, else the topic.
func ceType(ev *cdc.Event) string {
	if ev.EventType != "" {
		return ev.EventType
	}
	return ev.Topic
}

func rfcCommitTime(ev *cdc.Event) string { return ev.CommitTime.UTC().Format(time.RFC3339Nano) }

// envelopeHeaders adds the envelope's headers (before the headers column is
// copied, so that column cannot override them).
func (r *shape) envelopeHeaders(h Header, ev *cdc.Event) {
	switch r.envelope {
	case EnvelopeCloudEvents:
		h[HeaderCESpecVersion] = []string{"1.0"}
		h[HeaderCEID] = []string{ev.ID}
		h[HeaderCEType] = []string{sanitizeHeader(ceType(ev))}
		h[HeaderCESource] = []string{sanitizeHeader(r.ceSource)}
		h[HeaderCETime] = []string{rfcCommitTime(ev)}
		if ev.AggregateID != "" {
			h[HeaderCESubject] = []string{sanitizeHeader(ev.AggregateID)}
		}
		h[HeaderCEDataContentType] = []string{"application/json"}
	case EnvelopeCloudEventsStructured:
		h[HeaderContentType] = []string{"application/cloudevents+json"}
	}
}

// CloudEvent is a structured-mode CloudEvents 1.0 event as walbox writes it.
type CloudEvent struct {
	SpecVersion     string          `json:"specversion"`
	ID              string          `json:"id"`
	Type            string          `json:"type"`
	Source          string          `json:"source"`
	Time            string          `json:"time"`
	Subject         string          `json:"subject,omitempty"`
	DataContentType string          `json:"datacontenttype"`
	Data            json.RawMessage `json:"data"`
}

// Envelope is walbox's JSON envelope (nats.envelope: envelope).
type Envelope struct {
	EventID       string            `json:"event_id"`
	EventType     string            `json:"event_type"`
	AggregateType string            `json:"aggregate_type"`
	AggregateID   string            `json:"aggregate_id"`
	Timestamp     string            `json:"timestamp"`
	Payload       json.RawMessage   `json:"payload"`
	Metadata      map[string]string `json:"metadata"`
}

// envelopeData returns the message data for ev's payload (valid JSON). The
// payload is embedded byte for byte (json.Marshal would compact it).
func (r *shape) envelopeData(ev *cdc.Event) ([]byte, error) {
	switch r.envelope {
	case EnvelopeCloudEventsStructured:
		b := make([]byte, 0, len(ev.Payload)+256)
		b = appendStringField(b, '{', "specversion", "1.0")
		b = appendStringField(b, ',', "id", ev.ID)
		b = appendStringField(b, ',', "type", ceType(ev))
		b = appendStringField(b, ',', "source", r.ceSource)
		b = appendStringField(b, ',', "time", rfcCommitTime(ev))
		if ev.AggregateID != "" {
			b = appendStringField(b, ',', "subject", ev.AggregateID)
		}
		b = appendStringField(b, ',', "datacontenttype", "application/json")
		b = append(b, `,"data":`...)
		b = append(b, ev.Payload...)
		return append(b, '}'), nil
	case EnvelopeWalbox:
		md, err := metadata(ev.Headers)
		if err != nil {
			return nil, err
		}
		mdJSON, err := json.Marshal(md)
		if err != nil {
			return nil, err
		}
		b := make([]byte, 0, len(ev.Payload)+len(mdJSON)+256)
		b = appendStringField(b, '{', "event_id", ev.ID)
		b = appendStringField(b, ',', "event_type", ev.EventType)
		b = appendStringField(b, ',', "aggregate_type", ev.AggregateType)
		b = appendStringField(b, ',', "aggregate_id", ev.AggregateID)
		b = appendStringField(b, ',', "timestamp", rfcCommitTime(ev))
		b = append(b, `,"payload":`...)
		b = append(b, ev.Payload...)
		b = append(b, `,"metadata":`...)
		b = append(b, mdJSON...)
		return append(b, '}'), nil
	}
	return ev.Payload, nil
}

// appendStringField appends sep, "key": and the JSON string of val.
func appendStringField(b []byte, sep byte, key, val string) []byte {
	b = append(b, sep, '"')
	b = append(b, key...)
	b = append(b, '"', ':')
	v, _ := json.Marshal(val) // a string always marshals
	return append(b, v...)
}

// metadata is the envelope's metadata: every key of the headers column as
// a string (non-strings as their JSON text), and trace_id from traceparent.
func metadata(raw []byte) (map[string]string, error) {
	md := map[string]string{}
	if len(raw) == 0 {
		return md, nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil {
		return nil, fmt.Errorf("headers column: want a JSON object: %w", err)
	}
	for k, v := range obj {
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			s = string(v)
		}
		md[k] = s
	}
	if id, ok := traceID(md["traceparent"]); ok {
		md["trace_id"] = id
	}
	return md, nil
}

// traceID returns the trace-id field of a W3C traceparent
// (version-traceid-parentid-flags).
func traceID(tp string) (string, bool) {
	parts := strings.Split(strings.TrimSpace(tp), "-")
	if len(parts) < 4 || len(parts[1]) != 32 {
		return "", false
	}
	for _, c := range parts[1] {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return "", false
		}
	}
	if parts[1] == strings.Repeat("0", 32) {
		return "", false
	}
	return parts[1], true
}
