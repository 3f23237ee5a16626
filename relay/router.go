package relay

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/walbox/walbox/cdc"
)

// Header names walbox sets on every message. The position headers let a
// restarted relay read back the last position it stored in each stream.
const (
	HeaderMsgID = "Nats-Msg-Id"
	// HeaderExpectedLastSeq makes JetStream refuse a message unless the
	// stream's last sequence is this one (strict order). The leader checks
	// it before it proposes, so a mismatch is a rejection on R1 and R3 alike.
	// (Nats-Expected-Last-Msg-Id is checked only when replicas apply the
	// entry, where a mismatch wedges a replicated stream for good.)
	HeaderExpectedLastSeq = "Nats-Expected-Last-Sequence"
	HeaderCommitLSN       = "Walbox-Commit-Lsn"
	HeaderIndex           = "Walbox-Txn-Index"
	HeaderSource          = "Walbox-Source"
	// HeaderSystemID and HeaderTimeline name the WAL history the position
	// headers belong to: the cluster's system identifier and timeline.
	HeaderSystemID      = "Walbox-System-Id"
	HeaderTimeline      = "Walbox-Timeline"
	HeaderCommitTime    = "Walbox-Commit-Time"
	HeaderEventType     = "Walbox-Event-Type"
	HeaderAggregateType = "Walbox-Aggregate-Type"
	HeaderAggregateID   = "Walbox-Aggregate-Id"
	HeaderPartitionKey  = "Walbox-Partition-Key"
	// HeaderCreatedAt is the row's created_at as decoded (when the role is
	// mapped): a mark read back from the stream finds its row's partition
	// with it, as a mark from an ack does with the decoded value.
	HeaderCreatedAt = "Walbox-Created-At"
	// HeaderTable names the event's outbox table (schema.table): an event's
	// identity is its source, its table and its id (two tables may both
	// have a row 1).
	HeaderTable = "Walbox-Table"
	// TableLessTable is Walbox-Table for a table-less event
	// (walbox.emit_message): it has no row in any table.
	TableLessTable = "-"
	// HeaderEventID carries the bare event id where Nats-Msg-Id does not:
	// on a dead letter, and on an event published under a qualified
	// Nats-Msg-Id because another event of the stream has its id.
	HeaderEventID = "Walbox-Event-Id"

	// HeaderClaimCheck carries the reference of a payload stored apart
	// (relay/claim); only the claim check sets it, never a row's headers
	// column: a consumer would fetch the object it names.
	HeaderClaimCheck = "Walbox-Claim-Check"
	// HeaderReplayOf names the event a `walbox replay --force-new-id`
	// delivers again under the id <event id>.replay.<suffix>.
	HeaderReplayOf = "Walbox-Replay-Of"

	HeaderDLQReason          = "Walbox-Dlq-Reason"
	HeaderDLQOriginalSubject = "Walbox-Dlq-Original-Subject"
	// HeaderDLQOriginalTopic and HeaderDLQHeaders keep what the router
	// needs to build the event's message again on retry (its envelope,
	// its subject template): the topic and the headers column.
	HeaderDLQOriginalTopic = "Walbox-Dlq-Original-Topic"
	HeaderDLQHeaders       = "Walbox-Dlq-Headers"
	// HeaderDLQPayloadDropped is set on a dead letter stored without its
	// payload: the payload's size in bytes; the row keeps the payload.
	// HeaderDLQPayloadDroppedReason says why when the dead-letter stream
	// refused it with the payload.
	HeaderDLQPayloadDropped       = "Walbox-Dlq-Payload-Dropped"
	HeaderDLQPayloadDroppedReason = "Walbox-Dlq-Payload-Dropped-Reason"
)

// PoisonError marks an event that can never be published as it is. It is
// dead-lettered with Reason; it never stops the others.
type PoisonError struct{ Reason string }

func (e *PoisonError) Error() string { return "undeliverable event: " + e.Reason }

func poison(format string, args ...any) error {
	return &PoisonError{Reason: fmt.Sprintf(format, args...)}
}

// Route is where one stream's subjects go.
type Route struct {
	Stream   string
	Subjects []string
}

// Router maps events to JetStream messages: subject, stream check, headers.
type Router struct {
	prefix   string
	source   string
	routes   []Route
	maxBytes int
	// claimAbove: payloads larger than this travel apart (the claim
	// check, relay/claim), so the size check counts a reference instead.
	claimAbove int
	// cache remembers subject -> stream: topics repeat, wildcard matching
	// splits strings. Bounded so a flood of distinct topics cannot grow it.
	cache map[string]string

	// shapes are the routing and envelope of each outbox table's events,
	// by cdc.Event.Table (copy on write: AddTable may run beside Message).
	shapes   atomic.Pointer[[]*shape]
	shapesMu sync.Mutex

	// The events of one transaction share their commit LSN and time: their
	// header strings are made once per transaction.
	lastLSN     cdc.LSN
	lastLSNStr  string
	systemID    string // of the current session's origin
	timeline    string
	lastTime    time.Time
	lastTimeStr string
	// free holds messages whose ack resolved (Recycle), for their header
	// maps and value slices to be reused.
	free []*Msg
}

// maxFree bounds the recycled messages kept (about one window's worth).
const maxFree = 4096

// The headers Message sets from the event and the router on every kind of
// event, in the order of a message's slots, and last the one a sink sets
// when it sends (Msg.SetHeader).
var slotKeys = [...]string{HeaderMsgID, HeaderCommitLSN, HeaderIndex, HeaderCommitTime, HeaderSource, HeaderSystemID, HeaderTimeline,
	HeaderEventType, HeaderAggregateType, HeaderAggregateID, HeaderPartitionKey, HeaderTable, HeaderEventID, HeaderCreatedAt, HeaderExpectedLastSeq}

// Slots of slotKeys that the relay rewrites after Message (Msg.Qualify).
const (
	slotMsgID   = 0
	slotEventID = 12
)

// routerSlots is how many of slotKeys Message sets.
const routerSlots = len(slotKeys) - 1

// headerHint sizes a new message's header map: walbox's headers with
// every optional one set are routerSlots less the event-id slot (set only
// when Nats-Msg-Id is qualified: Msg.Qualify) = 13, plus the sink's
// expected sequence. A map of up to 14 keys fits one table of 16 slots; a
// hint of 15 or more doubles it. nats.go walks the map twice for every
// publish (its size, then its bytes), visiting every slot, and a window of
// recycled messages is too many maps for the cache: with the larger table
// that walk was a fifth of the relay's CPU in a catch-up (make bench's
// relay profile). A message with more headers (a headers column, a trace
// context, an envelope's) grows its map once.
const headerHint = 14

// headerSlots hold the values of a message's slotKeys. The header map's
// entry for a slot key is a one-element slice of vals (once set): a
// recycled message's next values are written there, without a map
// operation, and the map changes only when a header comes or goes.
type headerSlots struct {
	vals [len(slotKeys)]string
	set  [len(slotKeys)]bool // the map holds vals[i:i+1] under slotKeys[i]
	n    int                 // how many are set
}

// put sets slot i of h to v (v empty: removes the header).
func (s *headerSlots) put(h Header, i int, v string) {
	switch {
	case v != "":
		s.vals[i] = v
		if !s.set[i] {
			h[slotKeys[i]] = s.vals[i : i+1 : i+1]
			s.set[i] = true
			s.n++
		}
	case s.set[i]:
		delete(h, slotKeys[i])
		s.vals[i], s.set[i] = "", false
		s.n--
	}
}

// Recycle hands back a message made by Message once nothing refers to it
// any more (its ack resolved and the relay is done with it). Messages with
// other headers (an envelope's, the row's own) are left to the GC: Message
// gives them no slots. A sink adds headers only with SetHeader; a message
// with any other is not reused.
func (r *Router) Recycle(m *Msg) {
	if m == nil || m.slots == nil || len(m.Header) != m.slots.n || len(r.free) >= maxFree {
		return
	}
	m.Data = nil
	r.free = append(r.free, m)
}

// tableOf is the Walbox-Table of ev: its outbox table, or TableLessTable.
func (r *Router) tableOf(ev *cdc.Event) string {
	if ev.TableLess {
		return TableLessTable
	}
	return r.shapeFor(ev.Table).table
}

// IdentityOf is ev's identity as the read-back sees it (IdentityKey).
func (r *Router) IdentityOf(ev *cdc.Event) string { return IdentityKey(r.tableOf(ev), ev.ID) }

// Qualify gives m the dedupe key msgID (Nats-Msg-Id) in place of its bare
// event id, which goes in Walbox-Event-Id: the id alone is not unique in
// its stream (a second outbox table's rows, another database's).
func (m *Msg) Qualify(msgID, eventID string) {
	if m.slots != nil {
		m.slots.put(m.Header, slotMsgID, msgID)
		m.slots.put(m.Header, slotEventID, eventID)
		return
	}
	m.Header.Set(HeaderMsgID, msgID)
	m.Header.Set(HeaderEventID, eventID)
}

// SetHeader sets a header of m as a sink sends it (v empty: removes it).
// On a message Router.Message made, the expected-sequence header is written
// in place, without a map operation once it is there.
func (m *Msg) SetHeader(key, v string) {
	if m.slots != nil && key == slotKeys[routerSlots] {
		m.slots.put(m.Header, routerSlots, v)
		return
	}
	if v == "" {
		delete(m.Header, key)
		return
	}
	m.Header[key] = []string{v}
}

// NewRouter builds a router. source identifies this relay's database and slot
// in the position headers.
func NewRouter(prefix, source string, routes []Route) *Router {
	r := &Router{prefix: prefix, source: source, routes: routes, cache: make(map[string]string)}
	r.shapes.Store(&[]*shape{{buckets: DefaultPartitionBuckets, envelope: EnvelopeRaw, ceSource: "walbox/" + source}})
	return r
}

// shapeFor is the shape of the events of table i (the first table's for
// an index it does not know).
func (r *Router) shapeFor(i int) *shape {
	s := *r.shapes.Load()
	if i < 0 || i >= len(s) || s[i] == nil {
		return s[0]
	}
	return s[i]
}

// EventFromHeaders rebuilds, for a retry, the event a dead letter was made
// from: its id, topic, payload and the headers DeadLetter kept.
func EventFromHeaders(h Header, topic, id string, payload []byte) cdc.Event {
	ev := cdc.Event{ID: id, Topic: topic, Payload: payload, PayloadIsJSON: json.Valid(payload),
		EventType: h.Get(HeaderEventType), AggregateType: h.Get(HeaderAggregateType),
		AggregateID: h.Get(HeaderAggregateID), PartitionKey: h.Get(HeaderPartitionKey), CreatedAt: h.Get(HeaderCreatedAt)}
	if hc := h.Get(HeaderDLQHeaders); hc != "" {
		ev.Headers = []byte(hc)
	}
	if lsn, err := pglogrepl.ParseLSN(h.Get(HeaderCommitLSN)); err == nil {
		ev.Pos.CommitLSN = lsn
	}
	if idx, err := strconv.ParseUint(h.Get(HeaderIndex), 10, 32); err == nil {
		ev.Pos.Index = uint32(idx)
	}
	if t, err := time.Parse(time.RFC3339Nano, h.Get(HeaderCommitTime)); err == nil {
		ev.CommitTime = t
	}
	return ev
}

// createdAtHeader is ev's HeaderCreatedAt: its created_at as decoded, or
// "" (no header) when a header would not carry it unchanged. A read-back
// without it matches the row by id alone: slower, never wrong.
func createdAtHeader(ev *cdc.Event) string {
	if !HeaderSafe(ev.CreatedAt) {
		return ""
	}
	return ev.CreatedAt
}

// HeaderSafe reports whether v travels in a NATS header unchanged: nats.go
// trims leading and trailing blanks and turns CR and LF into spaces.
func HeaderSafe(v string) bool {
	return !strings.ContainsAny(v, "\r\n") && strings.Trim(v, " \t") == v
}

// SetOrigin sets the WAL history of the events that follow (from the
// source's KindOrigin).
func (r *Router) SetOrigin(o *cdc.Origin) {
	if o == nil {
		r.systemID, r.timeline = "", ""
		return
	}
	r.systemID, r.timeline = o.SystemID, strconv.FormatInt(int64(o.Timeline), 10)
}

// SetMaxPayload sets the largest message the server accepts (0: unchecked).
func (r *Router) SetMaxPayload(n int) { r.maxBytes = n }

// ClaimRefAllowance is what the size check counts for the claim-check
// header that takes a moved payload's place (its value names a store, a
// bucket, a key made of the event's identity and, in S3, a UUIDv7, a size
// and a SHA-256).
const ClaimRefAllowance = 1024

// SetClaimThreshold says that payloads larger than n bytes are moved to
// the claim-check store and replaced by a reference (0: none are): the
// size check then counts ClaimRefAllowance for such a payload, and an
// event too large for the server is no longer poison for its payload.
func (r *Router) SetClaimThreshold(n int) { r.claimAbove = n }

// StreamFor returns the stream whose subjects capture subject.
func (r *Router) StreamFor(subject string) (string, bool) {
	if s, ok := r.cache[subject]; ok {
		return s, s != ""
	}
	stream := ""
	for _, rt := range r.routes {
		for _, f := range rt.Subjects {
			if stream == "" && SubjectMatches(f, subject) {
				stream = rt.Stream
			}
		}
	}
	if len(r.cache) >= 10000 {
		clear(r.cache)
	}
	r.cache[subject] = stream
	return stream, stream != ""
}

// Message builds the message for ev (any sink), or a *PoisonError.
func (r *Router) Message(ev *cdc.Event) (*Msg, string, error) {
	if ev.Poison != "" {
		return nil, "", poison("%s", ev.Poison)
	}
	if ev.TopicNull || strings.TrimSpace(ev.Topic) == "" {
		return nil, "", poison("topic is NULL or empty")
	}
	if ev.ID == "" {
		return nil, "", poison("id is NULL or empty")
	}
	if !HeaderSafe(ev.ID) {
		return nil, "", poison("id %q cannot travel unchanged in the Nats-Msg-Id header (NATS trims leading and trailing blanks and turns CR and LF into spaces, so it could collide with another id): give the row an id without them", ev.ID)
	}
	sh := r.shapeFor(ev.Table)
	subject := sh.subject(r.prefix, ev)
	if err := ValidSubject(subject); err != nil {
		return nil, "", poison("invalid subject %q: %v", subject, err)
	}
	stream, ok := r.StreamFor(subject)
	if !ok {
		return nil, "", poison("no configured stream captures subject %q", subject)
	}
	if ev.Stream != "" && ev.Stream != stream {
		return nil, "", poison("row names stream %q but subject %q is captured by stream %q", ev.Stream, subject, stream)
	}
	if rule, ok := sh.ruleFor(ev.Topic); ok && rule.Stream != stream {
		return nil, "", poison("topic %q matches routing rule topic_prefix %q (nats.routes), which requires stream %q, but subject %q is captured by stream %q",
			ev.Topic, rule.TopicPrefix, rule.Stream, subject, stream)
	}
	if ev.PayloadNull {
		return nil, "", poison("payload is NULL")
	}
	if !ev.PayloadIsJSON && !json.Valid(ev.Payload) {
		return nil, "", poison("payload is not valid JSON")
	}
	var m *Msg
	if n := len(r.free); n > 0 {
		m, r.free = r.free[n-1], r.free[:n-1]
	} else {
		m = &Msg{Header: make(Header, headerHint), slots: new(headerSlots)}
	}
	h, sl := m.Header, m.slots
	if ev.Pos.CommitLSN != r.lastLSN || r.lastLSNStr == "" {
		r.lastLSN, r.lastLSNStr = ev.Pos.CommitLSN, ev.Pos.CommitLSN.String()
	}
	if !ev.CommitTime.Equal(r.lastTime) || r.lastTimeStr == "" {
		r.lastTime, r.lastTimeStr = ev.CommitTime, ev.CommitTime.UTC().Format(time.RFC3339Nano)
	}
	for i, v := range [routerSlots]string{ev.ID, r.lastLSNStr, strconv.FormatUint(uint64(ev.Pos.Index), 10), r.lastTimeStr,
		r.source, r.systemID, r.timeline, ev.EventType, ev.AggregateType, ev.AggregateID, ev.PartitionKey, r.tableOf(ev), "", createdAtHeader(ev)} {
		sl.put(h, i, v)
	}
	if sh.msgIDPrefix != "" {
		m.Qualify(sh.msgIDPrefix+ev.ID, ev.ID)
	}
	// A recycled message keeps the sink's expected sequence: the sink sets
	// or removes it when it sends (Msg.Expect says which).
	if sh.idHeader != "" {
		h[sh.idHeader] = []string{ev.ID}
	}
	sh.envelopeHeaders(h, ev)
	if len(ev.Headers) > 0 {
		if err := addJSONHeaders(h, ev.Headers); err != nil {
			return nil, "", poison("headers column: %v", err)
		}
	}
	if sh.idHeader != "" || len(h) != sl.n {
		sl.put(h, routerSlots, "") // the sink's, from the message's last use
		m.slots = nil              // other headers: not reused (see Recycle)
	}
	data, err := sh.envelopeData(ev)
	if err != nil {
		return nil, "", poison("%s envelope: %v", sh.envelope, err)
	}
	m.Subject, m.Data, m.Key = subject, data, partitionKey(ev)
	m.Expect, m.ExpectSet = 0, false
	size := len(data)
	if r.claimAbove > 0 && size > r.claimAbove {
		size = ClaimRefAllowance
	}
	if r.maxBytes > 0 && size+m.headerSize() > r.maxBytes {
		return nil, "", poison("message of %d bytes exceeds the server's max_payload of %d", size+m.headerSize(), r.maxBytes)
	}
	return m, stream, nil
}

// headerSize is headerSize(m.Header) without the sink's header, from the
// slots while the map holds only them: the same for a recycled message
// (which keeps the sink's last one) as for a new one.
func (m *Msg) headerSize() int {
	sl := m.slots
	if sl == nil || len(m.Header) != sl.n {
		return headerSize(m.Header)
	}
	n := 12
	for i, v := range sl.vals[:routerSlots] {
		if sl.set[i] {
			n += len(slotKeys[i]) + len(v) + 4
		}
	}
	return n
}

// headerSize is the size of h written as NATS headers.
func headerSize(h Header) int {
	n := 12
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// addJSONHeaders copies a JSON object's keys into message headers. Values
// that are not strings are kept as their JSON text. A key never overrides a
// header walbox set itself (the position headers, ...); keys the NATS client
// would refuse are skipped (one bad key fails the whole publish with
// nats.ErrBadHeaderMsg, which is not a per-event error), and so are
// JetStream's own, Nats-*: the server acts on them (Nats-Msg-Id deduplicates,
// Nats-Rollup purges, an unmet Nats-Expected-* refuses the message or stops
// a replicated stream), and a row must not steer it; nor Walbox-Claim-Check, which would make a
// consumer fetch the object it names.
func addJSONHeaders(h Header, raw []byte) error {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil {
		return fmt.Errorf("want a JSON object: %w", err)
	}
	own := make([]string, 0, len(h))
	for k := range h {
		own = append(own, k)
	}
	for k, v := range obj {
		if !validHeaderKey(k) || jetStreamHeader(k) || strings.EqualFold(k, HeaderClaimCheck) ||
			slices.ContainsFunc(own, func(o string) bool { return strings.EqualFold(o, k) }) {
			continue
		}
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			s = string(v)
		}
		if strings.ContainsAny(s, "\r\n") {
			continue
		}
		h[k] = []string{s}
	}
	return nil
}

// jetStreamHeader reports whether k is one of JetStream's own headers:
// Nats-*, in any case.
func jetStreamHeader(k string) bool { return len(k) >= 5 && strings.EqualFold(k[:5], "Nats-") }

// validHeaderKey reports whether the NATS client accepts k as a header key:
// printable ASCII without the separators it forbids (ADR-4, nats.go).
func validHeaderKey(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if c < 33 || c > 126 || strings.IndexByte(`"()/,:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// DeadLetter builds the dead-letter message for an event that cannot be
// published: the original payload (dropped if it alone is too large) and
// headers naming the original subject and the reason.
func (r *Router) DeadLetter(ev *cdc.Event, dlqPrefix, reason string) *Msg {
	orig := r.shapeFor(ev.Table).subject(r.prefix, ev)
	suffix := orig
	if ev.TopicNull || ValidSubject(orig) != nil {
		suffix = "invalid"
	}
	h := Header{
		HeaderDLQReason:          {reason},
		HeaderDLQOriginalSubject: {sanitizeHeader(orig)},
		HeaderCommitLSN:          {ev.Pos.CommitLSN.String()},
		HeaderIndex:              {strconv.FormatUint(uint64(ev.Pos.Index), 10)},
		HeaderCommitTime:         {ev.CommitTime.UTC().Format(time.RFC3339Nano)},
	}
	for k, v := range map[string]string{HeaderEventType: ev.EventType, HeaderAggregateType: ev.AggregateType,
		HeaderAggregateID: ev.AggregateID, HeaderPartitionKey: ev.PartitionKey, HeaderDLQHeaders: string(ev.Headers), HeaderCreatedAt: createdAtHeader(ev)} {
		if v != "" && HeaderSafe(v) && !strings.ContainsAny(v, "\r\n") {
			h[k] = []string{v}
		}
	}
	if !ev.TopicNull && ev.Topic != "" && HeaderSafe(ev.Topic) {
		h[HeaderDLQOriginalTopic] = []string{ev.Topic}
	}
	switch {
	case ev.ID != "" && HeaderSafe(ev.ID):
		h[HeaderMsgID] = []string{r.shapeFor(ev.Table).msgIDPrefix + ev.ID}
		h[HeaderEventID] = []string{ev.ID}
	case ev.ID != "":
		// The id itself is the poison: no Nats-Msg-Id (it would be altered
		// and could collide), and the exact id quoted, Go-style.
		h["Walbox-Event-Id-Quoted"] = []string{strconv.Quote(ev.ID)}
	}
	if r.source != "" {
		h[HeaderSource] = []string{r.source}
	}
	if t := r.tableOf(ev); t != "" {
		h[HeaderTable] = []string{t}
	}
	if r.systemID != "" {
		h[HeaderSystemID] = []string{r.systemID}
		h[HeaderTimeline] = []string{r.timeline}
	}
	data := ev.Payload
	if r.maxBytes > 0 && len(data)+headerSize(h) > r.maxBytes {
		data = nil
		h[HeaderDLQPayloadDropped] = []string{strconv.Itoa(len(ev.Payload))}
	}
	return &Msg{Subject: dlqPrefix + suffix, Key: partitionKey(ev), Data: data, Header: h}
}

// dropPayload takes the payload off dead letter m, which the dead-letter
// stream refused with it for why, and says so in its headers.
func dropPayload(m *Msg, why string) {
	m.Header[HeaderDLQPayloadDropped] = []string{strconv.Itoa(len(m.Data))}
	if why = strings.TrimSpace(sanitizeHeader(why)); why != "" && HeaderSafe(why) {
		m.Header[HeaderDLQPayloadDroppedReason] = []string{why}
	}
	m.Data = nil
}

func sanitizeHeader(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '\r' || r == '\n' {
			return ' '
		}
		return r
	}, s)
}

// ValidSubject checks a publish subject: non-empty tokens, no wildcards, no
// white space.
func ValidSubject(s string) error {
	if s == "" {
		return errors.New("empty subject")
	}
	if strings.ContainsAny(s, " \t\r\n") {
		return errors.New("contains white space")
	}
	for tok := range strings.SplitSeq(s, ".") {
		switch tok {
		case "":
			return errors.New("empty token")
		case "*", ">":
			return errors.New("wildcards are not allowed in a publish subject")
		}
	}
	return nil
}

// SubjectMatches reports whether subject is captured by filter, which may use
// the NATS wildcards * (one token) and > (one or more trailing tokens).
func SubjectMatches(filter, subject string) bool {
	ft := strings.Split(filter, ".")
	st := strings.Split(subject, ".")
	for i, f := range ft {
		if f == ">" {
			return len(st) > i
		}
		if i >= len(st) {
			return false
		}
		if f != "*" && f != st[i] {
			return false
		}
	}
	return len(ft) == len(st)
}
