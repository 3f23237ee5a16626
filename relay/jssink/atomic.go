package jssink

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
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
// holds a batch's messages until it commits it, and then sends them all,
// the last with the commit header (no end-of-batch marker, which a server
// before 2.14 does not know): so it can end a batch at any transaction's
// boundary, and the server stages nothing of a batch never committed. The
// relay says when a batch may end (relay.TxnSink.EndTxn).
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
// catch-up) share a batch: a consumer sees them together, never part of
// one, and the server's cost per batch (on an R1 file stream, a staging
// store of its own) is spread over them. A batch is cut at a transaction's
// boundary when it reaches the server's batch limit (1,000 messages by
// default, jetstream.limits.max_batch_size; a 10199 refusal lowers the
// sink's limit to the server's) or the open messages fill the relay's
// window (nats.window, nats.window_bytes: the relay publishes nothing more
// until its window's head is acked, and that ack is a commit's). Only a
// transaction that alone fills one of those is split, and the split is
// counted (AtomicStats.Splits). The relay commits when nothing more is at
// hand, and a lane holds its batch meanwhile only while its previous one
// waits for its ack (EndTxn), so a live transaction waits for nothing.
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

// abatch is one atomic batch: open (holding its messages, none sent yet)
// or committed (sent, waiting for the commit's pub ack).
type abatch struct {
	id   string
	msgs []amsg // batch sequence i+1
	// last is the transaction of the newest message; msgs[cut:] are its
	// messages, msgs[:cut] whole transactions before it.
	last      uint64
	cut       int
	started   time.Time
	committed time.Time
}

type amsg struct {
	m       *relay.Msg
	resolve relay.Resolver
	size    int64
}

// txnOpen is what the open batches hold across lanes (the relay's window
// counts them all), and the transaction of the newest message. Only the
// publisher goroutine (Publish, EndTxn) touches it.
type txnOpen struct {
	txn   uint64
	msgs  int
	bytes int64
}

// publishAtomic puts m in its lane's open atomic batch. Nothing is sent
// before the batch's commit, so the batch can end at any transaction's
// boundary: the sink cuts it there when a limit is near, and splits a
// transaction only when it alone fills the limit.
func (s *Sink) publishAtomic(ln *lane, m *relay.Msg) (relay.Future, error) {
	s.open.txn = m.Txn
	size := m.Size()
	ln.mu.Lock()
	b := ln.aopen
	if b == nil {
		b = &abatch{id: nuid.Next(), started: time.Now()}
		ln.aopen = b
		ln.s.armTick()
	}
	if b.last != m.Txn {
		b.last, b.cut = m.Txn, len(b.msgs)
	}
	if len(b.msgs) >= s.amax {
		b = ln.cutAtomic(b, false)
	}
	f, resolve := relay.NewFuture()
	b.msgs = append(b.msgs, amsg{m: m, resolve: resolve, size: size})
	ln.mu.Unlock()
	s.astats.messages.Add(1)
	s.open.msgs++
	s.open.bytes += size
	if s.open.msgs >= s.window || s.open.bytes >= s.windowBytes {
		// The relay publishes nothing more until its window's head is
		// acked, and that ack is a commit's: commit the whole
		// transactions, and split the open one only when it alone fills
		// the window.
		s.endOpen(func(ln *lane, b *abatch) {
			if b.last != s.open.txn {
				ln.commitAtomic(b)
			} else if b.cut > 0 {
				ln.cutAtomic(b, false)
			}
		})
		if s.open.msgs >= s.window || s.open.bytes >= s.windowBytes {
			s.astats.splits.Add(1)
			s.endOpen((*lane).commitAtomic)
		}
	}
	return f, nil
}

// cutAtomic commits b up to its newest transaction (all of it when that
// transaction is all of b, or whole: a split, counted), and returns the
// lane's open batch, holding the rest. Lock held.
func (ln *lane) cutAtomic(b *abatch, whole bool) *abatch {
	if whole || b.cut == 0 {
		if !whole {
			ln.s.astats.splits.Add(1)
		}
		ln.commitAtomic(b)
		nb := &abatch{id: nuid.Next(), started: time.Now(), last: b.last}
		ln.aopen = nb
		return nb
	}
	rest := &abatch{id: nuid.Next(), started: time.Now(), last: b.last, msgs: slices.Clone(b.msgs[b.cut:])}
	clear(b.msgs[b.cut:])
	b.msgs = b.msgs[:b.cut]
	ln.commitAtomic(b)
	ln.aopen = rest
	return rest
}

// endOpen calls f on each lane's open batch (lock held), and recounts what
// the open batches hold.
func (s *Sink) endOpen(f func(*lane, *abatch)) {
	ls := s.lanes.Load()
	if ls == nil {
		s.open = txnOpen{}
		return
	}
	open := txnOpen{txn: s.open.txn}
	for _, ln := range ls.list {
		ln.mu.Lock()
		if b := ln.aopen; b != nil {
			f(ln, b)
		}
		if b := ln.aopen; b != nil {
			open.msgs += len(b.msgs)
			for i := range b.msgs {
				open.bytes += b.msgs[i].size
			}
		}
		ln.mu.Unlock()
	}
	s.open = open
}

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
	s.endOpen(func(ln *lane, b *abatch) {
		switch {
		case end == relay.TxnAbandon:
			ln.failAtomic(b, errTxnAbandoned)
		case end == relay.TxnMayCommit && len(ln.aending) > 0:
		default:
			ln.commitAtomic(b)
		}
	})
}

var errTxnAbandoned = errors.New("the transaction's atomic batch was abandoned before its commit (publishing stopped after a failure): nothing of it is stored")

// sendAtomic publishes b's messages, the last with the commit header when
// commit. Only the first carries its expected last sequence (see the proof
// above). The batch headers live in a message only while it is encoded:
// the relay's byte count and its reuse of the message see none. Lock held.
func (ln *lane) sendAtomic(b *abatch, commit bool) error {
	for i := range b.msgs {
		m := b.msgs[i].m
		if i > 0 {
			m.SetHeader(relay.HeaderExpectedLastSeq, "")
		}
		h := nats.Header(m.Header)
		h[hdrBatchID] = []string{b.id}
		h[hdrBatchSeq] = []string{strconv.Itoa(i + 1)}
		reply := ""
		if commit && i == len(b.msgs)-1 {
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
	}
	return nil
}

// commitAtomic sends b with the commit header on its last message.
// Lock held.
func (ln *lane) commitAtomic(b *abatch) {
	if ln.aopen == b {
		ln.aopen = nil
	}
	if len(b.msgs) == 0 {
		return
	}
	if err := ln.sendAtomic(b, true); err != nil {
		// The server stores nothing of a batch without its commit, and
		// drops what it staged after its batch timeout.
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
		b.msgs[0].m.ExpectSet && r.Sequence != b.msgs[0].m.Expect+uint64(n):
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
// 10201 says what is stored) and an open batch held twice as long (a
// safety net: the relay ends every batch it opens; nothing of it was
// sent), and reports whether any batch is left. Lock held.
func (ln *lane) expireAtomic(now time.Time) bool {
	for i := len(ln.aending) - 1; i >= 0; i-- {
		if b := ln.aending[i]; now.Sub(b.committed) >= ln.s.ackTimeout {
			ln.failAtomic(b, jetstream.ErrAsyncPublishTimeout)
		}
	}
	if b := ln.aopen; b != nil && now.Sub(b.started) >= 2*ln.s.ackTimeout {
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
