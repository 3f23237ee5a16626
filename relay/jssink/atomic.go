package jssink

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/walbox/walbox/relay"
)

// Atomic transactions (nats.atomic_transactions; nats-server 2.12.1+, stream
// option allow_atomic).
//
// Each PostgreSQL transaction's messages to one stream go in one atomic
// batch: headers Nats-Batch-Id, Nats-Batch-Sequence 1..n, and
// Nats-Batch-Commit: 1 on the last. The server stages the messages and
// stores none of them before the commit; at the commit it checks them all
// and stores all of them or none (nats-server stream.go
// processJetStreamAtomicBatchMsg). A batch never committed (the relay
// crashed, the connection dropped) is discarded after the server's batch
// timeout (10 s by default); its messages were never visible. The sink
// does not know a message is a transaction's last until the relay says the
// transaction ended (relay.TxnSink.EndTxn) or a message of another
// transaction comes, so it holds each batch's newest message back and
// sends it with the commit header then: no end-of-batch marker, which a
// server before 2.14 does not know.
//
// What the commit's pub ack proves, {"stream":S,"seq":N,"batch":id,"count":n}:
//
//   - All n messages are stored, at N-n+1..N in batch order. The server runs
//     the commit's checks for the whole batch under the stream's clustered
//     sequence lock and then stores (R1: in the stream's one inbound loop,
//     under its isolation lock) or proposes (R3: one ProposeMulti, whose
//     entries the replicas apply as one batch, all or none) the n messages
//     back to back: no other publish comes between them, and it answers
//     only after the last one is stored (or, on R3, applied).
//   - None was dropped as a duplicate: since 2.12.1 a Nats-Msg-Id the
//     stream already holds (or one repeated inside the batch) refuses the
//     whole batch with 10201 and stores nothing. So a committed batch is
//     evidence about each of its messages, including one the relay resends
//     that may be stored already (Msg.MayBeStored): it goes in a batch too,
//     and a 10201 says so.
//
// Strict order: only the first message of a batch may carry
// Nats-Expected-Last-Sequence (the server refuses it on any other). The
// first carries the relay's expectation E for it, the others none. The
// commit checks E against the stream's last sequence (counting what is
// proposed and not yet applied) before anything of the batch is stored, and
// the batch then takes E+1..E+n with nothing between (above): message i is
// at E+i, exactly what the relay's per-message expectations would have
// demanded. A lost predecessor (an R3 leader change) makes the stream's
// last differ from E, and the whole batch is refused (10071) with nothing
// stored: the relay resends in order, as for a refused single publish. The
// sink checks N = E+n when E is set; a mismatch fails the batch as
// unproven.
//
// A batch refused for anything else (10201, a message the stream refuses,
// allow_atomic off, an incomplete batch) fails each of its messages with
// relay.ErrTxnRefused: the relay resends that transaction's messages one at
// a time, where each one's own ack (stored, or a duplicate) or error (the
// dead-letter rules) decides. A poison event inside a transaction thus
// costs the transaction its atomicity, not its other events.
//
// Boundaries: a transaction's messages to several streams are one batch
// per stream (JetStream has no batch across streams), committed one after
// the other. Transactions the relay reads one right after the other (a
// catch-up) share a batch while it holds fewer than a quarter of the
// batch limit (groupMax): a consumer sees them together, never part of
// one, and the server's cost per batch (on a file stream, a staging store
// of its own) is spread over them; the relay commits the batch as soon as
// nothing more is at hand (relay.TxnSink), so a live transaction waits for
// none. A batch ends before its transaction does, and the split is counted
// (AtomicStats.Splits), at the server's batch limit (1,000 messages by
// default, jetstream.limits.max_batch_size; a 10199 refusal lowers the
// sink's limit to the server's), and when the open messages fill the
// relay's window (nats.window, nats.window_bytes): the relay publishes
// nothing more until the head of its window is acked, and that ack is the
// commit's.
//
// Tests for the proofs' failure: TestAtomicDuplicateInsideFallsBack (a
// duplicate inside: 10201, nothing stored, each event stored once by the
// per-message resend), TestAtomicOrderRefusedStoresNothing (a wrong E).

const (
	// atomicMax is nats-server's default atomic batch limit
	// (streamDefaultMaxAtomicBatchSize).
	atomicMax = 1000
	// Atomic batch headers (nats-server stream.go JSBatchId, JSBatchSeq,
	// JSBatchCommit).
	hdrBatchID     = "Nats-Batch-Id"
	hdrBatchSeq    = "Nats-Batch-Sequence"
	hdrBatchCommit = "Nats-Batch-Commit"
)

// AtomicStats counts the sink's atomic batches since it started.
type AtomicStats struct {
	Batches  uint64 // committed
	Messages uint64 // messages sent in atomic batches
	Splits   uint64 // batches ended before their transaction (a limit)
	Refused  uint64 // batches refused (10201 and others): their transactions resent per message
}

// AtomicStats returns the counts so far.
func (s *Sink) AtomicStats() AtomicStats {
	c := &s.astats
	return AtomicStats{Batches: c.batches.Load(), Messages: c.messages.Load(), Splits: c.splits.Load(), Refused: c.refused.Load()}
}

// abatch is one atomic batch: open (taking messages, its newest held
// back) or committed (waiting for the commit's pub ack).
type abatch struct {
	id        string
	txn       uint64
	msgs      []amsg // batch sequence i+1; the last is held back while open
	epoch     uint64 // the connection its first message went out on (Sink.Epoch)
	started   time.Time
	committed time.Time
}

type amsg struct {
	m       *relay.Msg
	resolve relay.Resolver
	expect  uint64
	strict  bool
}

// txnOpen is the transaction whose batches are open, and what they hold
// across lanes (the relay's window counts them all). Only the publisher
// goroutine (Publish, EndTxn) touches it.
type txnOpen struct {
	txn   uint64
	msgs  int
	bytes int64
}

// publishAtomic puts m in its lane's open atomic batch.
func (s *Sink) publishAtomic(ln *lane, m *relay.Msg) (relay.Future, error) {
	if s.open.txn != m.Txn && s.open.msgs >= s.groupMax() {
		// A message of another transaction: the open ones ended, and
		// they are large enough to go on their own.
		s.EndTxn(relay.TxnCommit)
	}
	s.open.txn = m.Txn
	ln.mu.Lock()
	b := ln.aopen
	if b != nil && len(b.msgs) >= s.amax {
		s.astats.splits.Add(1)
		ln.commitAtomic(b)
		b = nil
	}
	if b == nil {
		b = &abatch{id: nuid.Next(), txn: m.Txn, epoch: s.Epoch(), started: time.Now()}
		ln.aopen = b
		ln.s.armTick()
	}
	first := len(b.msgs) == 0
	if !first {
		// Only a batch's first message may carry an expectation (see
		// the proof above).
		m.SetHeader(relay.HeaderExpectedLastSeq, "")
	}
	if n := len(b.msgs); n > 0 {
		if err := ln.sendAtomic(b, n-1, false); err != nil {
			ln.failAtomic(b, err)
			ln.mu.Unlock()
			return nil, err
		}
	}
	f, resolve := relay.NewFuture()
	b.msgs = append(b.msgs, amsg{m: m, resolve: resolve, expect: m.Expect, strict: m.ExpectSet && first})
	ln.mu.Unlock()
	s.astats.messages.Add(1)
	s.open.msgs++
	s.open.bytes += m.Size()
	if s.open.msgs >= s.window || s.open.bytes >= s.windowBytes {
		// The relay publishes nothing more until its window's head is
		// acked, and that ack is a commit's.
		s.astats.splits.Add(1)
		s.EndTxn(relay.TxnCommit)
	}
	return f, nil
}

// groupMax: a batch takes the next transaction's messages while it holds
// fewer than this, a quarter of the batch limit or the relay's window:
// transactions up to three quarters of it are never split by a limit.
func (s *Sink) groupMax() int { return min(s.amax, s.window) / 4 }

// TxnOpen implements relay.TxnSink.
func (s *Sink) TxnOpen() bool { return s.open.msgs > 0 }

// EndTxn implements relay.TxnSink. With TxnMayCommit a lane whose earlier
// batch still waits for its ack keeps its open batch: the server takes the
// commits of a stream one after the other, so committing now would gain
// nothing, while the batch can take the transactions that come meanwhile
// (on a file stream every batch costs the server a staging store of its
// own). A live relay has no batch in flight when a transaction ends, so
// its transactions go at once.
func (s *Sink) EndTxn(end relay.TxnEnd) {
	if s.open.msgs == 0 {
		return
	}
	ls := s.lanes.Load()
	if ls == nil {
		s.open = txnOpen{}
		return
	}
	left := txnOpen{}
	for _, ln := range ls.list {
		ln.mu.Lock()
		if b := ln.aopen; b != nil {
			switch {
			case end == relay.TxnAbandon:
				ln.failAtomic(b, errTxnAbandoned)
			case end == relay.TxnMayCommit && len(ln.aending) > 0:
				left.txn = s.open.txn
				left.msgs += len(b.msgs)
				for i := range b.msgs {
					left.bytes += b.msgs[i].m.Size()
				}
			default:
				ln.commitAtomic(b)
			}
		}
		ln.mu.Unlock()
	}
	s.open = left
}

var errAtomicReconnected = errors.New("the connection was re-established while the transaction's atomic batch was open: nothing of it is committed")

var errTxnAbandoned = errors.New("the transaction's atomic batch was abandoned before its commit (publishing stopped after a failure): nothing of it is stored")

// sendAtomic publishes message i of b, with the commit header when commit.
// The batch headers live in the message only while it is encoded: the
// relay's byte count and its reuse of the message see none. Lock held.
func (ln *lane) sendAtomic(b *abatch, i int, commit bool) error {
	m := b.msgs[i].m
	h := nats.Header(m.Header)
	h[hdrBatchID] = []string{b.id}
	h[hdrBatchSeq] = []string{strconv.Itoa(i + 1)}
	reply := ""
	if commit {
		h[hdrBatchCommit] = []string{"1"}
		reply = ln.s.aprefix + strconv.Itoa(ln.idx) + "." + b.id
	}
	err := ln.s.nc.PublishMsg(&nats.Msg{Subject: m.Subject, Reply: reply, Header: h, Data: m.Data})
	delete(h, hdrBatchID)
	delete(h, hdrBatchSeq)
	delete(h, hdrBatchCommit)
	if err != nil {
		return fmt.Errorf("publish an atomic batch's message: %w", wrapOrder(err))
	}
	return nil
}

// commitAtomic sends b's held-back last message with the commit header.
// Lock held.
func (ln *lane) commitAtomic(b *abatch) {
	if ln.aopen == b {
		ln.aopen = nil
	}
	if len(b.msgs) == 0 {
		return
	}
	if ln.s.Epoch() != b.epoch {
		// Messages sent before a reconnect may be lost: the server would
		// refuse the commit as incomplete, and the relay then resend the
		// transaction per message. Failed now, it is resent whole.
		ln.failAtomic(b, errAtomicReconnected)
		return
	}
	if err := ln.sendAtomic(b, len(b.msgs)-1, true); err != nil {
		ln.failAtomic(b, err)
		return
	}
	b.committed = time.Now()
	ln.aending = append(ln.aending, b)
	ln.s.armTick()
}

// failAtomic fails every message of b with err and forgets b. Lock held.
func (ln *lane) failAtomic(b *abatch, err error) {
	for i := range b.msgs {
		b.msgs[i].resolve.Resolve(nil, err)
	}
	b.msgs = nil
	if ln.aopen == b {
		ln.aopen = nil
	}
	ln.dropEnding(b)
}

func (ln *lane) dropEnding(b *abatch) {
	for i, e := range ln.aending {
		if e == b {
			ln.aending = append(ln.aending[:i], ln.aending[i+1:]...)
			return
		}
	}
}

// atomicReply is a commit's answer: a pub ack with the batch's id and
// count, or an error.
type atomicReply struct {
	Error    *jetstream.APIError `json:"error"`
	Stream   string              `json:"stream"`
	Sequence uint64              `json:"seq"`
	Batch    string              `json:"batch"`
	Count    int                 `json:"count"`
}

// onAtomicReply handles the answer to a commit: <aprefix><lane>.<id>.
func (s *Sink) onAtomicReply(m *nats.Msg) {
	idxS, id, ok := strings.Cut(m.Subject[len(s.aprefix):], ".")
	idx, err := strconv.Atoi(idxS)
	ls := s.lanes.Load()
	if !ok || err != nil || ls == nil || idx < 0 || idx >= len(ls.list) {
		return
	}
	ln := ls.list[idx]
	ln.mu.Lock()
	defer ln.mu.Unlock()
	var b *abatch
	for _, e := range ln.aending {
		if e.id == id {
			b = e
		}
	}
	if b == nil {
		return // timed out: its messages were failed as unknown
	}
	if len(m.Data) == 0 && m.Header.Get(statusHeader) == statusNoResponders {
		ln.failAtomic(b, jetstream.ErrNoStreamResponse)
		return
	}
	var r atomicReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		ln.failAtomic(b, jetstream.ErrInvalidJSAck)
		return
	}
	n := len(b.msgs)
	switch {
	case r.Error != nil:
		ln.refusedAtomic(b, r.Error)
	case r.Batch == "":
		// A server that ignored the batch headers stored each message
		// as a single publish: nothing is atomic, and only the last
		// message's outcome is known. Resent on their own, each one's ack
		// says where it is.
		ln.atomicOff("the server took an atomic batch as single messages (nats-server before 2.12)")
		ln.failAtomic(b, ErrBatchUnproven)
	case r.Batch != b.id || r.Count != n || r.Sequence < uint64(n) ||
		b.msgs[0].strict && r.Sequence != b.msgs[0].expect+uint64(n):
		ln.failAtomic(b, fmt.Errorf("%w (the commit's ack for %d messages at %d does not match the batch of %d)", ErrBatchUnproven, r.Count, r.Sequence, n))
	default:
		s.astats.batches.Add(1)
		first := r.Sequence - uint64(n) + 1
		for i := range b.msgs {
			b.msgs[i].resolve.Resolve(&relay.Ack{Stream: r.Stream, Sequence: first + uint64(i)}, nil)
		}
		b.msgs = nil
		ln.dropEnding(b)
	}
}

// refusedAtomic fails b, which the server refused as a whole with apiErr.
// Lock held.
func (ln *lane) refusedAtomic(b *abatch, apiErr *jetstream.APIError) {
	err := wrapOrder(apiErr)
	switch {
	case errors.Is(err, relay.ErrOrderRefused):
		// The expectation of its first message failed, so nothing is
		// stored: the relay resends in order, in a batch again.
		ln.failAtomic(b, err)
		return
	case apiErr.ErrorCode == errAtomicTooLarge:
		// The server's limit is lower than the sink's: take it, and
		// resend the transaction in batches that fit.
		if max, ok := limitOf(apiErr.Description); ok && max < ln.s.amax {
			ln.s.amax = max
		}
		ln.failAtomic(b, fmt.Errorf("atomic batch over the server's limit, resent in batches of %d: %w", ln.s.amax, apiErr))
		return
	case apiErr.ErrorCode == errAtomicDisabled:
		ln.atomicOff(fmt.Sprintf("stream %s does not allow atomic batches (allow_atomic is off)", ln.stream))
	}
	ln.s.astats.refused.Add(1)
	ln.failAtomic(b, fmt.Errorf("%w: %w", relay.ErrTxnRefused, err))
}

const (
	errAtomicDisabled = 10174
	errAtomicTooLarge = 10199
)

// limitOf reads the limit out of "atomic publish batch is too large: N".
func limitOf(desc string) (int, bool) {
	i := strings.LastIndexByte(desc, ' ')
	n, err := strconv.Atoi(desc[i+1:])
	return n, err == nil && n > 0
}

// atomicOff turns atomic batches off for the lane, and says so once.
// Lock held.
func (ln *lane) atomicOff(why string) {
	if !ln.atomic {
		return
	}
	ln.atomic, ln.why = false, why
	if ln.s.notify != nil {
		ln.s.notify(PublishPath{Stream: ln.stream, Why: why})
	}
}

// expireAtomic fails the committed batches whose ack is overdue (the
// outcome is unknown: the relay resends, and the next commit's ack or a
// 10201 says what is stored) and an open batch older than the ack timeout
// (not committed, so nothing of it is stored; the server drops it after its
// batch timeout), and reports whether any batch is left. Lock held.
func (ln *lane) expireAtomic(now time.Time) bool {
	for i := len(ln.aending) - 1; i >= 0; i-- {
		if b := ln.aending[i]; now.Sub(b.committed) >= ln.s.ackTimeout {
			ln.failAtomic(b, jetstream.ErrAsyncPublishTimeout)
		}
	}
	if b := ln.aopen; b != nil && now.Sub(b.started) >= ln.s.ackTimeout {
		ln.failAtomic(b, errTxnAbandoned)
	}
	return len(ln.aending) > 0 || ln.aopen != nil
}

// atomicOn reports whether the lane takes atomic batches.
func (ln *lane) atomicOn() bool {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	return ln.atomic
}
