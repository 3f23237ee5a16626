package jssink

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/walbox/walbox/relay"
)

// Fast batches (nats-server 2.14+, ADR-50; stream option allow_batched).
//
// A stream busy enough that per-message acks pile up gets its messages in
// a fast batch: one flow ack from the server every N messages instead of a
// pub ack each, N at most batchFlow (the server lowers it when several
// batches share the stream). The protocol is in the reply subject of each
// message, <inbox>.<lane>.<id>.<flow>.fail.<batch seq>.<op>.$FI, and the
// server answers on it: {"type":"ack","seq":N,"msgs":M} (flow ack),
// {"type":"gap",...}, {"type":"err","seq":N,"error":{...}}, and a pub ack
// with "batch" and "count" when the batch ends (our commit, or a gap or an
// error that ends it). walbox speaks it itself rather than through orbit's
// jetstreamext.FastPublisher: that one blocks its caller on each batch's
// first message and on every stall, drops the count of a batch the server
// ended (orbit.go #78), and does not compare a commit's count with what was
// sent; this sink resolves futures from its reply subscription, as the
// per-message path does.
//
// What a batch's acks prove (gap mode "fail", which walbox always asks
// for, and strict order, which every batched message carries):
//
//   - The server processes a batch's messages in batch order and ends the
//     batch at the first one it does not accept (a gap, a failed check): a
//     flow ack for N or a final count of N says messages 1..N were each
//     either stored or dropped as a Nats-Msg-Id duplicate (nats-server
//     stream.go processJetStreamFastBatchMsg, jetstream_batching.go
//     fastBatchRegisterSequences).
//   - Every batched message carries Nats-Expected-Last-Sequence = the
//     stream's last sequence when its predecessor (batched or not) is
//     stored. A duplicate does not grow the stream, so the next message's
//     expectation fails and the batch ends there. Hence, with walbox the
//     stream's only writer (the relay turns strict order off, and with it
//     batching, for a stream it finds shared): under an ack for N, messages
//     1..N-1 are each stored, message i at sequence expect_i+1. Message N
//     may be a duplicate; it is proven by a later ack, or by the final pub
//     ack's stream sequence: N is stored iff that sequence is expect_N+1
//     (the pub ack's seq is the stream sequence of the batch's last stored
//     message). An N not proven is failed as unknown, and the relay resends
//     it on its own (Msg.MayBeStored), where its own ack says duplicate or
//     stored and where.
//   - An error pub ack on one message (a check failed when it was stored,
//     the batch lost on a restarted server) ends walbox's trust in the
//     batch at once: that message gets its error, every message not yet
//     proven fails as unknown, and later replies for the batch are
//     ignored. The server may go on storing messages behind a message that
//     failed when it was stored (stream.go, the store error after the
//     batch's checks); their replies come after the error on the same
//     subscription, so none of them proves the failed one.
//
// Test for the proofs' failure: TestBatchDuplicateInsideIsNotProven (a
// duplicate inside a batch is resent on its own, not confirmed by the next
// flow ack), TestBatchFinalDuplicateNotProven, TestBatchErrorEndsTrust.

const (
	// batchFlow is the largest ack interval asked for: with the relay's
	// window (1,024 by default) four acks are in flight.
	batchFlow = 256
	// batchEnter: per-message publishes in flight to one stream before its
	// next message opens a batch. A relay keeping up with a live rate has a
	// few in flight; a catch-up fills its window at once.
	batchEnter = 32
	// batchLinger: a batch with no publish for this long is committed, so
	// that the messages after its last flow ack are confirmed by the
	// commit's pub ack.
	batchLinger = time.Millisecond
	// batchPause: how long a stream publishes per message after the server
	// said it has too many batches in flight (10211).
	batchPause = 10 * time.Second
)

// The operations of a fast batch's reply subject (nats-server's
// FastBatchOp*).
const (
	opStart = iota
	opAppend
	opCommit
	opCommitEOB
	opPing
)

// ErrBatchUnproven fails a batched message whose outcome the batch's acks
// do not prove: the relay resends it on its own.
var ErrBatchUnproven = errors.New("fast batch ended without proof that this message is stored; resending it on its own")

// PublishPath says how the sink publishes to a stream and why: Atomic,
// each transaction in an atomic batch (atomic.go); else Batch, in fast
// batches while the stream is busy; else per message.
type PublishPath struct {
	Stream string
	Atomic bool
	Batch  bool
	Why    string
}

// BatchStats counts the sink's fast batches since it started.
type BatchStats struct {
	Batches  uint64 // opened
	Batched  uint64 // messages sent in a batch
	FlowAcks uint64
	Unproven uint64 // batched messages failed as unproven (resent on their own)
}

type batchCounters struct {
	batches, batched, flowAcks, unproven atomic.Uint64
}

type atomicCounters struct {
	batches, messages, splits, refused atomic.Uint64
}

// BatchStats returns the counts so far.
func (s *Sink) BatchStats() BatchStats {
	c := &s.bstats
	return BatchStats{Batches: c.batches.Load(), Batched: c.batched.Load(), FlowAcks: c.flowAcks.Load(), Unproven: c.unproven.Load()}
}

// lane is one stream's batch state.
type lane struct {
	s      *Sink
	idx    int
	stream string
	single atomic.Int64 // per-message publishes to the stream in flight

	mu      sync.Mutex
	atomic  bool      // transactions in atomic batches (atomic.go)
	aopen   *abatch   // the open atomic batch; nil when none
	aending []*abatch // committed atomic batches, waiting for their acks
	allowed bool
	why     string    // why the stream is published per message
	pause   time.Time // no batch before then (10211)
	open    *batch    // taking messages; nil when none
	ending  []*batch  // committed, waiting for the final pub ack
	said    bool      // the fall-back to per message was logged
}

// batch is one fast batch in flight.
type batch struct {
	id      string
	reply   string // prefix of its reply subjects, up to the batch sequence
	subject string // the last message's, for pings and the commit
	sent    uint64 // batch sequences 1..sent are published
	done    uint64 // futures of 1..done are resolved
	q       []bmsg // batch sequences done+1 .. sent
	acked   uint64 // highest flow ack
	am      uint64 // the server's ack interval (0 until its first flow ack)
	errAt   uint64 // the message a BatchFlowErr named, and its error
	err     error
	gap     bool // the server reported a gap
	started time.Time
	lastPub time.Time
	heard   time.Time // the last reply or ping
}

type bmsg struct {
	resolve relay.Resolver
	expect  uint64
	sentAt  time.Time
}

// Batching is what SetBatching takes.
type Batching struct {
	// Paths: which streams take fast batches (EnsureStreams' answer).
	Paths []PublishPath
	// Window is the relay's window in messages: the ack interval asked
	// for is at most half of it, so that an ack is always on its way while
	// the window is full.
	Window int
	// After is how many per-message publishes to a stream may be in flight
	// before its next message opens a batch (nats.fast_batch_after); 0
	// batches every message that can be, negative means the default (32).
	After int
	// WindowBytes is the relay's byte budget (nats.window_bytes): a
	// transaction's open atomic batches are committed before they hold
	// that much, or Window messages (atomic.go).
	WindowBytes int64
	// OnFallBack hears of a stream that falls back to per-message
	// publishes while walbox runs (the server refused a batch, or answered
	// as a server older than 2.14; for atomic batches, 2.12).
	OnFallBack func(PublishPath)
}

// SetBatching sets up fast batches. Call it once, before publishing.
func (s *Sink) SetBatching(c Batching) {
	paths := c.Paths
	s.flow = batchFlow
	if c.Window > 1 {
		s.flow = min(batchFlow, c.Window/2)
	}
	s.notify = c.OnFallBack
	if c.Window > 0 {
		s.window = c.Window
	}
	if c.WindowBytes > 0 {
		s.windowBytes = c.WindowBytes
	}
	s.enter = batchEnter
	if c.After >= 0 {
		s.enter = c.After
	}
	lanes := make(map[string]*lane, len(paths))
	list := make([]*lane, 0, len(paths))
	for _, p := range paths {
		ln := &lane{s: s, idx: len(list), stream: p.Stream, atomic: p.Atomic, allowed: p.Batch, why: p.Why}
		lanes[p.Stream] = ln
		list = append(list, ln)
	}
	s.lanes.Store(&laneSet{byStream: lanes, list: list})
}

// Paths reports each stream's publish path as it stands.
func (s *Sink) Paths() []PublishPath {
	ls := s.lanes.Load()
	if ls == nil {
		return nil
	}
	var out []PublishPath
	for _, ln := range ls.list {
		ln.mu.Lock()
		out = append(out, PublishPath{Stream: ln.stream, Atomic: ln.atomic, Batch: ln.allowed, Why: ln.why})
		ln.mu.Unlock()
	}
	return out
}

type laneSet struct {
	byStream map[string]*lane
	list     []*lane
}

func (s *Sink) lane(stream string) *lane {
	ls := s.lanes.Load()
	if ls == nil || stream == "" {
		return nil
	}
	return ls.byStream[stream]
}

// publish sends m in the lane's batch when the stream is busy; ok false:
// send it on its own.
func (ln *lane) publish(m *relay.Msg, h nats.Header) (fut relay.Future, ok bool, err error) {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	b := ln.open
	now := time.Now()
	if b == nil {
		if !ln.allowed || ln.single.Load() < int64(ln.s.enter) || now.Before(ln.pause) {
			return nil, false, nil
		}
		b = ln.start(now)
	}
	seq := b.sent + 1
	op := opAppend
	if seq == 1 {
		op = opStart
	}
	f, resolve := relay.NewFuture()
	if err := ln.s.nc.PublishMsg(&nats.Msg{Subject: m.Subject, Reply: b.replyFor(seq, op), Header: h, Data: m.Data}); err != nil {
		// Not sent: the batch ends before it, and the commit confirms
		// what went out.
		ln.commit(b)
		return nil, true, wrapOrder(err)
	}
	b.sent = seq
	ln.s.bstats.batched.Add(1)
	b.q = append(b.q, bmsg{resolve: resolve, expect: m.Expect, sentAt: now})
	b.subject, b.lastPub = m.Subject, now
	return f, true, nil
}

// start opens a batch. Lock held.
func (ln *lane) start(now time.Time) *batch {
	id := nuid.Next()
	b := &batch{id: id, started: now, heard: now,
		reply: ln.s.bprefix + strconv.Itoa(ln.idx) + "." + id + "." + strconv.Itoa(ln.s.flow) + ".fail."}
	ln.open = b
	ln.s.bstats.batches.Add(1)
	ln.s.armTick()
	return b
}

func (b *batch) replyFor(seq uint64, op int) string {
	return b.reply + strconv.FormatUint(seq, 10) + "." + strconv.Itoa(op) + ".$FI"
}

// commit ends b with an end-of-batch marker: the server answers with the
// pub ack that counts what it stored. Lock held.
func (ln *lane) commit(b *batch) {
	if ln.open == b {
		ln.open = nil
	}
	if b.sent == 0 {
		return
	}
	if err := ln.s.nc.PublishRequest(b.subject, b.replyFor(b.sent+1, opCommitEOB), nil); err != nil {
		ln.end(b, 0, 0, fmt.Errorf("commit the fast batch: %w", err))
		return
	}
	ln.ending = append(ln.ending, b)
}

// end resolves what b's acks prove (1..proven stored; the message after
// them gets errNext when set) and fails the rest as unproven, and forgets
// b. count > 0: the final pub ack counted count messages, and lastSeq is
// the stream's last sequence it reported. Lock held.
func (ln *lane) end(b *batch, count, lastSeq uint64, errNext error) {
	proven := b.acked
	if proven > 0 {
		proven-- // the last one acked may be a duplicate
	}
	if count > 0 {
		proven = count - 1
		if count > b.done && count <= b.sent && lastSeq == b.q[count-1-b.done].expect+1 {
			proven = count // the stream's last is the batch's last: stored
		}
	}
	if b.errAt > 0 {
		proven = min(proven, b.errAt-1)
	}
	ln.confirm(b, proven)
	for i := range b.q {
		if b.q[i].resolve == nil {
			continue // resolved by its own pub ack (single1)
		}
		seq := b.done + 1 + uint64(i)
		err := error(ErrBatchUnproven)
		switch {
		case seq == b.errAt && b.err != nil:
			err = b.err
		case seq == proven+1 && errNext != nil:
			err = errNext
		}
		if err == ErrBatchUnproven {
			ln.s.bstats.unproven.Add(1)
		}
		b.q[i].resolve.Resolve(nil, err)
	}
	b.done += uint64(len(b.q))
	b.q = nil
	if ln.open == b {
		ln.open = nil
	}
	for i, e := range ln.ending {
		if e == b {
			ln.ending = append(ln.ending[:i], ln.ending[i+1:]...)
			break
		}
	}
}

// confirm resolves b's messages up to batch sequence n as stored, each at
// the sequence its expectation names (see the proof above). Lock held.
func (ln *lane) confirm(b *batch, n uint64) {
	if n <= b.done {
		return
	}
	k := min(n-b.done, uint64(len(b.q)))
	for i := range k {
		if bm := &b.q[i]; bm.resolve != nil {
			bm.resolve.Resolve(&relay.Ack{Stream: ln.stream, Sequence: bm.expect + 1}, nil)
		}
	}
	clear(b.q[:k])
	b.q = b.q[k:]
	b.done += k
}

// batchReply is any reply on a batch's subject: a flow ack, gap or error
// (Type set), or a pub ack.
type batchReply struct {
	Type      string              `json:"type"`
	Seq       uint64              `json:"seq"`
	Msgs      uint64              `json:"msgs"`
	LastSeq   uint64              `json:"last_seq"`
	Error     *jetstream.APIError `json:"error"`
	Stream    string              `json:"stream"`
	Batch     string              `json:"batch"`
	Count     uint64              `json:"count"`
	Duplicate bool                `json:"duplicate"`
}

// onBatchReply handles a reply on a batch's subject. The subscription
// delivers them in the order the server sent them.
func (s *Sink) onBatchReply(m *nats.Msg) {
	idx, id, seq, ok := parseBatchSubject(m.Subject[len(s.bprefix):])
	ls := s.lanes.Load()
	if !ok || ls == nil || idx >= len(ls.list) {
		return
	}
	ln := ls.list[idx]
	ln.mu.Lock()
	defer ln.mu.Unlock()
	b := ln.find(id)
	if b == nil {
		return // ended: its outcome is settled
	}
	b.heard = time.Now()
	if len(m.Data) == 0 && m.Header.Get(statusHeader) == statusNoResponders {
		// No stream took the message: nothing at or after it is stored.
		ln.failFrom(b, seq, jetstream.ErrNoStreamResponse)
		return
	}
	var r batchReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		ln.failFrom(b, seq, jetstream.ErrInvalidJSAck)
		return
	}
	switch r.Type {
	case "ack":
		s.bstats.flowAcks.Add(1)
		if r.Seq > b.acked {
			b.acked = r.Seq
		}
		b.am = r.Msgs
		if b.acked > 0 {
			ln.confirm(b, min(b.acked-1, b.sent))
		}
		return
	case "gap":
		b.gap = true // the pub ack that ends the batch follows
		return
	case "err":
		if r.Error != nil && (b.errAt == 0 || r.Seq < b.errAt) {
			b.errAt, b.err = r.Seq, wrapOrder(r.Error)
		}
		return
	}
	// A pub ack.
	switch {
	case r.Error != nil:
		err := wrapOrder(r.Error)
		if errors.Is(err, errBatchDisabled) {
			ln.fallBack("the stream does not allow fast batches (allow_batched is off)", time.Time{})
		} else if errors.Is(err, errBatchTooMany) {
			ln.fallBack("", time.Now().Add(batchPause))
		}
		ln.failFrom(b, seq, err)
	case r.Batch == "" && r.Count == 0:
		// A server older than 2.14 took the message as an ordinary
		// publish: this is that message's own pub ack, and every message
		// of the batch gets one.
		ln.fallBack("the server does not know fast batches (nats-server 2.14 or later does)", time.Time{})
		if ln.open == b {
			// No commit: that server would store the marker as a message.
			ln.open = nil
			ln.ending = append(ln.ending, b)
		}
		ln.single1(b, seq, &relay.Ack{Stream: r.Stream, Sequence: r.Seq, Duplicate: r.Duplicate})
	default:
		var errNext error
		if b.gap {
			errNext = errBatchGap
		}
		ln.end(b, r.Count, r.Seq, errNext)
	}
}

var (
	errBatchDisabled = &jetstream.APIError{ErrorCode: 10205}
	errBatchTooMany  = &jetstream.APIError{ErrorCode: 10211}
	errBatchGap      = errors.New("the server saw a gap in the fast batch (a message lost on the way): it ended the batch before this message")
)

// find returns the batch with id, open or ending. Lock held.
func (ln *lane) find(id string) *batch {
	if ln.open != nil && ln.open.id == id {
		return ln.open
	}
	for _, b := range ln.ending {
		if b.id == id {
			return b
		}
	}
	return nil
}

// failFrom ends b at message seq, which failed with err: see the proof
// above (an error pub ack ends the trust in the batch). Lock held.
func (ln *lane) failFrom(b *batch, seq uint64, err error) {
	if seq >= 1 && (b.errAt == 0 || seq < b.errAt) {
		b.errAt, b.err = seq, err
	}
	ln.end(b, 0, 0, nil)
}

// single1 resolves message seq of b by its own pub ack (a server that
// took it as an ordinary publish). Lock held.
func (ln *lane) single1(b *batch, seq uint64, ack *relay.Ack) {
	if seq <= b.done || seq > b.sent {
		return
	}
	bm := &b.q[seq-1-b.done]
	if bm.resolve == nil {
		return
	}
	bm.resolve.Resolve(ack, nil)
	bm.resolve = nil
	for len(b.q) > 0 && b.q[0].resolve == nil {
		b.q = b.q[1:]
		b.done++
	}
	if len(b.q) == 0 && ln.open != b {
		ln.end(b, 0, 0, nil)
	}
}

// fallBack turns batches off for the lane (why set), or pauses them until
// then. Lock held.
func (ln *lane) fallBack(why string, until time.Time) {
	if why != "" {
		ln.allowed, ln.why = false, why
		if !ln.said && ln.s.notify != nil {
			ln.said = true
			ln.s.notify(PublishPath{Stream: ln.stream, Why: why})
		}
	}
	if until.After(ln.pause) {
		ln.pause = until
	}
}

// armTick starts the batches' timer unless it runs.
func (s *Sink) armTick() {
	if s.ticking.CompareAndSwap(false, true) {
		s.tick.Reset(batchLinger)
	}
}

// onTick commits idle batches, pings stalled ones and fails what waited
// longer than the ack timeout. It runs every batchLinger while a batch is
// in flight.
func (s *Sink) onTick() {
	ls := s.lanes.Load()
	if ls == nil {
		s.ticking.Store(false)
		return
	}
	now := time.Now()
	busy := false
	for _, ln := range ls.list {
		ln.mu.Lock()
		// A batch is committed (and pinged) only once the server has
		// answered its first message with a flow ack: a server that does
		// not know fast batches would store the marker (and the ping) as a
		// message.
		if b := ln.open; b != nil && b.am > 0 {
			ackComing := b.sent-b.acked >= b.am
			if now.Sub(b.lastPub) >= batchLinger && !ackComing {
				ln.commit(b)
			}
		}
		// From the newest down: end takes a batch out of ln.ending, which
		// moves only the batches after it. The open batch comes last (i = -1).
		for i := len(ln.ending) - 1; i >= -1; i-- {
			b := ln.open
			if i >= 0 {
				b = ln.ending[i]
			}
			if b == nil || len(b.q) == 0 {
				continue
			}
			if now.Sub(b.q[0].sentAt) >= s.ackTimeout {
				ln.end(b, 0, 0, jetstream.ErrAsyncPublishTimeout)
				continue
			}
			if b == ln.open && b.am > 0 && now.Sub(b.heard) >= s.ackTimeout/3 {
				// A flow ack may be lost: the server resends its latest.
				b.heard = now
				_ = s.nc.PublishRequest(b.subject, b.replyFor(b.sent, opPing), nil)
			}
		}
		aBusy := ln.expireAtomic(now)
		busy = busy || ln.open != nil || len(ln.ending) > 0 || aBusy
		ln.mu.Unlock()
	}
	if busy {
		s.tick.Reset(batchLinger)
		return
	}
	s.ticking.Store(false)
	// A batch opened between the check and the store armed nothing.
	for _, ln := range ls.list {
		ln.mu.Lock()
		open := ln.open != nil || len(ln.ending) > 0 || len(ln.aending) > 0 || ln.aopen != nil
		ln.mu.Unlock()
		if open {
			s.armTick()
			return
		}
	}
}

// parseBatchSubject reads <lane>.<id>.<flow>.<gap>.<seq>.<op>.$FI.
func parseBatchSubject(sub string) (idx int, id string, seq uint64, ok bool) {
	t := strings.Split(sub, ".")
	if len(t) != 7 || t[6] != "$FI" {
		return 0, "", 0, false
	}
	idx, err := strconv.Atoi(t[0])
	if err != nil {
		return 0, "", 0, false
	}
	seq, err = strconv.ParseUint(t[4], 10, 64)
	if err != nil {
		return 0, "", 0, false
	}
	return idx, t[1], seq, true
}
