// Package jssink is the relay's JetStream sink: asynchronous publishes with
// a future per message, JetStream's error classes, the streams walbox
// declares, and the read-back of what a stream holds (the resume check's
// tail and the sweeper's catch-up).
package jssink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/relay"
)

// Sink publishes to JetStream and implements relay.Sink and
// sweep.StreamReader.
//
// A publish is a NATS message with a reply subject on one inbox
// subscription the Sink owns; the stream's ack (or error) comes back there
// and resolves the relay's future straight from that subscription's
// callback. nats.go's PublishMsgAsync does the same with a timer, a map
// entry and two channels per message and a goroutine to pass each result on;
// this costs less per message (see BenchmarkPublishSink). Reply tokens count
// up in publish order, so the waiting futures are a queue and the ack
// timeout needs one timer, armed at the oldest future's deadline.
type Sink struct {
	nc         *nats.Conn
	js         jetstream.JetStream
	ackTimeout time.Duration
	prefix     string // a reply subject is prefix + token in base 36
	lastStream string // onReply's, see parseReply

	streamsMu sync.Mutex
	streams   map[string]jetstream.Stream // StoredIdentity's handles

	mu      sync.Mutex
	next    uint64   // the next token
	waiting []waiter // tokens next-len(waiting) .. next-1, in order
	timer   *time.Timer
	armed   bool // timer will fire

	// Fast batches (batch.go): their replies' subject prefix, each
	// stream's lane, the timer that commits idle batches, and who hears of
	// a stream falling back to per-message publishes.
	bprefix string
	lanes   atomic.Pointer[laneSet]
	tick    *time.Timer
	ticking atomic.Bool
	flow    int
	enter   int // batchEnter (tests lower it)
	notify  func(PublishPath)
	bstats  batchCounters

	// Atomic transactions (atomic.go): their commits' reply prefix, the
	// batch limit, the transaction open across lanes, and the relay's
	// window its open messages must leave room in.
	aprefix     string
	amax        int
	open        txnOpen
	window      int
	windowBytes int64
	astats      atomicCounters
}

type waiter struct {
	resolve  relay.Resolver // nil once resolved
	deadline time.Time
	ln       *lane // its stream's lane, whose in-flight count it is in
}

// New wraps a connection and subscribes to its reply subjects. ackTimeout
// bounds how long an ack may take; without it a lost ack would hold the
// window forever.
func New(nc *nats.Conn, ackTimeout time.Duration) (*Sink, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream context: %w", err)
	}
	s := &Sink{nc: nc, js: js, ackTimeout: ackTimeout, prefix: nc.NewInbox() + ".", bprefix: nc.NewInbox() + ".", flow: batchFlow, enter: batchEnter,
		aprefix: nc.NewInbox() + ".", amax: atomicMax, window: 1 << 30, windowBytes: 1 << 62}
	s.timer = time.AfterFunc(time.Hour, s.expire)
	s.timer.Stop()
	s.tick = time.AfterFunc(time.Hour, s.onTick)
	s.tick.Stop()
	for _, sub := range []struct {
		subject string
		cb      nats.MsgHandler
	}{{s.prefix + "*", s.onReply}, {s.bprefix + ">", s.onBatchReply}, {s.aprefix + "*.*", s.onAtomicReply}} {
		sub, err := nc.Subscribe(sub.subject, sub.cb)
		if err != nil {
			return nil, fmt.Errorf("subscribe to the publish acks: %w", err)
		}
		// An ack dropped as a slow consumer's would hold its future until
		// the ack timeout; the relay's window bounds what can pile up.
		if err := sub.SetPendingLimits(-1, -1); err != nil {
			return nil, fmt.Errorf("subscribe to the publish acks: %w", err)
		}
	}
	return s, nil
}

// Conn returns the NATS connection.
func (s *Sink) Conn() *nats.Conn { return s.nc }

// JetStream returns the underlying JetStream context.
func (s *Sink) JetStream() jetstream.JetStream { return s.js }

// Publish implements relay.Sink. m.Expect becomes the expected-last-sequence
// header; a refusal for it comes back wrapping relay.ErrOrderRefused.
func (s *Sink) Publish(m *relay.Msg) (relay.Future, error) {
	expect := ""
	if m.ExpectSet {
		expect = strconv.FormatUint(m.Expect, 10)
	}
	m.SetHeader(relay.HeaderExpectedLastSeq, expect)
	h := nats.Header(m.Header)
	ln := s.lane(m.Stream)
	if ln != nil && m.Txn != 0 && ln.atomicOn() {
		return s.publishAtomic(ln, m)
	}
	if ln != nil && m.ExpectSet && !m.MayBeStored {
		if fut, ok, err := ln.publish(m, h); ok {
			return fut, err
		}
	}
	if ln != nil {
		ln.single.Add(1)
	}
	fut, resolve := relay.NewFuture()
	s.mu.Lock()
	tok := s.next
	s.next++
	s.waiting = append(s.waiting, waiter{resolve: resolve, deadline: time.Now().Add(s.ackTimeout), ln: ln})
	if !s.armed {
		s.timer.Reset(s.ackTimeout)
		s.armed = true
	}
	s.mu.Unlock()
	// One allocation: the token (a uint64 in base 36) is built on the stack.
	var tokBuf [13]byte
	reply := s.prefix + string(strconv.AppendUint(tokBuf[:0], tok, 36))
	if err := s.nc.PublishMsg(&nats.Msg{Subject: m.Subject, Reply: reply, Header: h, Data: m.Data}); err != nil {
		s.take(tok)
		return nil, wrapOrder(err)
	}
	return fut, nil
}

// onReply resolves the future of the message the reply is for. A reply for
// a future already resolved (it timed out) is dropped.
func (s *Sink) onReply(m *nats.Msg) {
	tok, err := strconv.ParseUint(m.Subject[len(s.prefix):], 36, 64)
	if err != nil {
		return
	}
	resolve := s.take(tok)
	if resolve == nil {
		return
	}
	resolve.Resolve(parseReply(m, &s.lastStream))
}

// take removes the future of tok from the queue and returns its resolver,
// nil if it was resolved already.
func (s *Sink) take(tok uint64) relay.Resolver {
	s.mu.Lock()
	defer s.mu.Unlock()
	first := s.next - uint64(len(s.waiting))
	if tok < first || tok >= s.next {
		return nil
	}
	w := &s.waiting[tok-first]
	resolve := w.resolve
	if resolve != nil && w.ln != nil {
		w.ln.single.Add(-1)
	}
	w.resolve = nil
	s.dropResolvedLocked()
	return resolve
}

func (s *Sink) dropResolvedLocked() {
	n := 0
	for n < len(s.waiting) && s.waiting[n].resolve == nil {
		n++
	}
	switch {
	case n == len(s.waiting):
		clear(s.waiting)
		s.waiting = s.waiting[:0]
	case n > 0:
		clear(s.waiting[:n])
		s.waiting = s.waiting[n:]
	}
}

// expire fails the futures whose ack did not come within the ack timeout
// and arms the timer for the oldest one left. Deadlines grow with tokens,
// so the expired futures are at the front.
func (s *Sink) expire() {
	now := time.Now()
	var expired []relay.Resolver
	s.mu.Lock()
	s.armed = false
	n := 0
	for n < len(s.waiting) && !s.waiting[n].deadline.After(now) {
		if r := s.waiting[n].resolve; r != nil {
			expired = append(expired, r)
			s.waiting[n].resolve = nil
			if ln := s.waiting[n].ln; ln != nil {
				ln.single.Add(-1)
			}
		}
		n++
	}
	s.dropResolvedLocked()
	if len(s.waiting) > 0 {
		s.timer.Reset(s.waiting[0].deadline.Sub(now))
		s.armed = true
	}
	s.mu.Unlock()
	for _, r := range expired {
		r.Resolve(nil, jetstream.ErrAsyncPublishTimeout)
	}
}

// A reply with this status and no data says no stream took the subject.
const (
	statusHeader       = "Status"
	statusNoResponders = "503"
)

// pubAckReply is JetStream's answer to a publish: an ack or an API error.
type pubAckReply struct {
	Error     *jetstream.APIError `json:"error,omitempty"`
	Stream    string              `json:"stream"`
	Sequence  uint64              `json:"seq"`
	Duplicate bool                `json:"duplicate,omitempty"`
}

// parseReply reads the reply to a publish. stream holds the last stream
// name read, so that the replies of one stream share one string.
func parseReply(m *nats.Msg, stream *string) (*relay.Ack, error) {
	if len(m.Data) == 0 && m.Header.Get(statusHeader) == statusNoResponders {
		return nil, jetstream.ErrNoStreamResponse
	}
	if name, seq, dup, ok := scanAck(m.Data); ok {
		if string(name) != *stream {
			*stream = string(name)
		}
		return &relay.Ack{Stream: *stream, Sequence: seq, Duplicate: dup}, nil
	}
	var r pubAckReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		return nil, jetstream.ErrInvalidJSAck
	}
	if r.Error != nil {
		return nil, wrapOrder(r.Error)
	}
	if r.Stream == "" {
		return nil, jetstream.ErrInvalidJSAck
	}
	return &relay.Ack{Stream: r.Stream, Sequence: r.Sequence, Duplicate: r.Duplicate}, nil
}

// wrapOrder marks JetStream's wrong-last-sequence refusal as
// relay.ErrOrderRefused.
func wrapOrder(err error) error {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && ErrKind(apiErr) == KindOrderRefused {
		return fmt.Errorf("%w: %w", relay.ErrOrderRefused, err)
	}
	return err
}

// Epoch implements relay.Sink: the client's reconnect count.
func (s *Sink) Epoch() uint64 { return s.nc.Stats().Reconnects }

// MaxPayload implements relay.Sink.
func (s *Sink) MaxPayload() int { return int(s.nc.MaxPayload()) }

// Classify implements relay.Sink.
func (s *Sink) Classify(err error) relay.ErrorClass { return Classify(err) }

// Classify sorts JetStream publish errors by their row in Table (see
// classify.go): only a permanent kind, the message's own fault, is
// dead-lettered; an error the table does not know is transient.
func Classify(err error) relay.ErrorClass { return ErrKind(err).Class() }

// EnsureStreams creates or updates the configured streams (manage = true)
// or checks they exist. It returns the routes for the router, taken from the
// server's view of each stream, and how the sink is to publish to each
// (SetBatching).
func EnsureStreams(ctx context.Context, js jetstream.JetStream, streams []StreamSpec) ([]relay.Route, []PublishPath, error) {
	var routes []relay.Route
	var paths []PublishPath
	version := js.Conn().ConnectedServerVersion()
	for _, sp := range streams {
		var info *jetstream.StreamInfo
		if sp.Manage {
			c := sp.Config()
			// A server before 2.14 may refuse a field it does not know.
			c.AllowBatchPublish = sp.FastBatch && sp.NoBatch == "" && FastBatchServer(version)
			c.AllowAtomicPublish = sp.Atomic && AtomicServer(version)
			st, err := js.CreateOrUpdateStream(ctx, c)
			if err != nil {
				return nil, nil, fmt.Errorf("create or update stream %s: %w", sp.Name, err)
			}
			info = st.CachedInfo()
		} else {
			st, err := js.Stream(ctx, sp.Name)
			if err != nil {
				return nil, nil, fmt.Errorf("stream %s (nats.streams[].manage is false, so walbox only checks it): %w", sp.Name, err)
			}
			info = st.CachedInfo()
		}
		routes = append(routes, relay.Route{Stream: sp.Name, Subjects: info.Config.Subjects})
		paths = append(paths, PathFor(sp, info, version))
	}
	return routes, paths, nil
}

// PathFor says how walbox publishes to the stream sp, whose server's view is
// info (nil: not created yet) on a server of version: in fast batches when
// it is configured, the server knows them (2.14+) and the stream allows
// them (allow_batched, which walbox sets on a stream it manages); per
// message otherwise, and why.
//
// With nats.atomic_transactions (sp.Atomic) each transaction goes in an
// atomic batch where the server (2.12.1+) and the stream (allow_atomic)
// allow them; elsewhere the path above stands, and Why says why it is not
// atomic.
func PathFor(sp StreamSpec, info *jetstream.StreamInfo, version string) PublishPath {
	p := fastPathFor(sp, info, version)
	if !sp.Atomic {
		return p
	}
	var why string
	switch {
	case !AtomicServer(version):
		why = fmt.Sprintf("nats-server %s has no atomic batches that refuse a duplicate inside: upgrade to 2.12.1 or later", version)
	case info == nil:
		p.Atomic, p.Why = true, "walbox sets allow_atomic when it creates the stream"
		return p
	case info.Config.Mirror != nil:
		why = "the stream is a mirror"
	case !info.Config.AllowAtomicPublish && sp.Manage:
		why = "the server did not keep allow_atomic on the stream"
	case !info.Config.AllowAtomicPublish:
		why = fmt.Sprintf("stream %s does not allow atomic batches: set allow_atomic: true in its configuration (or let walbox manage it)", sp.Name)
	default:
		p.Atomic, p.Why = true, "each transaction in an atomic batch"
		return p
	}
	how := "per message"
	if p.Batch {
		how = "fast batches while the stream is busy"
	} else if p.Why != "" {
		how += " (" + p.Why + ")"
	}
	p.Why = "nats.atomic_transactions is on, but " + why + "; publishing in " + how
	return p
}

// fastPathFor is PathFor without atomic transactions.
func fastPathFor(sp StreamSpec, info *jetstream.StreamInfo, version string) PublishPath {
	p := PublishPath{Stream: sp.Name}
	switch {
	case sp.NoBatch != "":
		p.Why = sp.NoBatch
	case !sp.FastBatch:
		p.Why = "nats.fast_batch is false"
	case !FastBatchServer(version):
		p.Why = fmt.Sprintf("nats-server %s has no fast batches: upgrade to 2.14 or later", version)
	case info == nil:
		p.Batch, p.Why = true, "walbox sets allow_batched when it creates the stream"
	case info.Config.Mirror != nil:
		p.Why = "the stream is a mirror"
	case !info.Config.AllowBatchPublish && sp.Manage:
		p.Why = "the server did not keep allow_batched on the stream"
	case !info.Config.AllowBatchPublish:
		p.Why = fmt.Sprintf("stream %s does not allow fast batches: set allow_batched: true in its configuration (or let walbox manage it)", sp.Name)
	default:
		p.Batch = true
	}
	return p
}

// FastBatchServer reports whether a nats-server of version has fast batches
// (2.14.0 and later).
func FastBatchServer(version string) bool {
	var major, minor int
	if _, err := fmt.Sscanf(version, "%d.%d", &major, &minor); err != nil {
		return false
	}
	return major > 2 || major == 2 && minor >= 14
}

// AtomicServer reports whether a nats-server of version has atomic batches
// that refuse a duplicate Nats-Msg-Id inside as a whole (10201): 2.12.1 and
// later. 2.12.0 has atomic batches, but a commit's ack there would not
// prove each message stored anew.
func AtomicServer(version string) bool {
	var major, minor, patch int
	if _, err := fmt.Sscanf(version, "%d.%d.%d", &major, &minor, &patch); err != nil {
		return false
	}
	return major > 2 || major == 2 && (minor > 12 || minor == 12 && patch >= 1)
}

// StreamSpec is a stream as the config declares it.
type StreamSpec struct {
	Name            string
	Subjects        []string
	Storage         string // file or memory
	Replicas        int
	DuplicateWindow time.Duration
	MaxAge          time.Duration
	MaxMsgSize      int32
	Manage          bool
	// FastBatch: publish in fast batches where the server and the stream
	// allow them (nats.fast_batch); NoBatch, when set, says why this stream
	// never takes them (strict order off, the dead-letter stream).
	FastBatch bool
	NoBatch   string
	// Atomic: publish each transaction in an atomic batch where the server
	// and the stream allow it (nats.atomic_transactions).
	Atomic bool
}

// Config is the JetStream stream configuration sp declares.
func (sp StreamSpec) Config() jetstream.StreamConfig {
	c := jetstream.StreamConfig{
		Name:       sp.Name,
		Subjects:   sp.Subjects,
		Replicas:   sp.Replicas,
		Duplicates: sp.DuplicateWindow,
		MaxAge:     sp.MaxAge,
		MaxMsgSize: sp.MaxMsgSize,
	}
	if sp.Storage == "memory" {
		c.Storage = jetstream.MemoryStorage
	} else {
		c.Storage = jetstream.FileStorage
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	return c
}

// NATSMsg is m as a NATS message, for the tools that publish with their own
// connection (replay, dead-letter retry). It shares m's header map.
func NATSMsg(m *relay.Msg) *nats.Msg {
	if m.ExpectSet {
		m.SetHeader(relay.HeaderExpectedLastSeq, strconv.FormatUint(m.Expect, 10))
	}
	return &nats.Msg{Subject: m.Subject, Header: nats.Header(m.Header), Data: m.Data}
}
