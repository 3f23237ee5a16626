package relay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/walbox/walbox/cdc"
)

// fakeStream is one JetStream stream as the publisher sees it: messages
// stored in arrival order, Nats-Msg-Id deduplication, and the
// Nats-Expected-Last-Sequence check done before storing (as a stream leader
// does it). It can lose a publish the way a stream leader that stops
// mid-window does: the message is never stored and its ack times out, while
// later publishes reach the next leader and are stored.
type fakeStream struct {
	mu      sync.Mutex
	ids     []string
	seqOf   map[string]uint64
	hdrs    []Header
	lastSeq uint64

	publishes int
	// lose: publish numbers (1-based) that vanish: never stored, and their
	// ack times out (or, while hold is on, fails when the test says so).
	lose map[int]bool
	// storeLose: of the lost publishes, these are stored all the same (a
	// broker that stored the record and whose answer was lost).
	storeLose map[int]bool
	reject    map[string]int // event ids always refused with this JetStream error code
	// refuseNext: this many publishes (any event) are refused with
	// refuseCode: a condition of the server's that every message meets.
	refuseNext, refuseCode int
	// foreign: before this publish number, another writer appends a message.
	foreign map[int]bool
	// unavailable: this many publishes get "no responders" (no stream
	// leader) before the stream answers again.
	unavailable int
	// hold: store, but keep the acks back until release (a slow server) or
	// until the test resolves them one by one, in any order (resolve).
	hold    bool
	held    []*heldAck
	maxHeld int
	// reconnectDuring: the sink's connection is re-established while this
	// publish call runs (after the message went out on the old one).
	reconnectDuring map[int]bool
	// callFails: the publish call with this number returns the error itself
	// (the client's connection is closed): nothing is sent.
	callFails map[int]error
	// kafka: no deduplication by id (Kafka has no Nats-Msg-Id), so a
	// resent event is stored again.
	kafka bool
	// expectFirst: the expected last sequence is checked before the
	// duplicate check, as a replica-1 stream does (nats-server's
	// processJetStreamMsg); a replicated stream's leader checks duplicates
	// first (the default here).
	expectFirst bool
	// notify, if set, gets every publish number (dropped when full).
	notify chan int
	// txns, when set (before the relay starts), makes the sink a TxnSink
	// that logs what the relay tells it; it publishes each message at once
	// all the same.
	txns *txnLog

	pubs     []*pubRecord    // every publish, in call order
	acked    map[string]int  // ids whose publish was acked (stored or duplicate)
	readBack map[string]bool // ids a StoredTail returned
	// mixed: publishes sent on one connection while an earlier one's
	// future was unresolved on another (the Sink contract forbids it).
	mixed []string
}

// pubRecord is one publish as the stream saw it.
type pubRecord struct {
	n        int // publish number, 1-based
	id       string
	epoch    uint64 // the sink's epoch when the call began
	at       time.Time
	stored   bool
	resolved bool
	// What the relay told the sink: the stream, and whether the event may
	// be stored already (a sink never batches such a message).
	stream      string
	mayBeStored bool
	txn         uint64 // Msg.Txn
}

// heldAck is a publish whose future the test resolves.
type heldAck struct {
	pub *pubRecord
	ack *Ack // nil: the message was lost, it can only fail
	f   Resolver
}

// resolveLocked sends the ack (err nil) or err to a future, and records it.
func (st *fakeStream) resolveLocked(pub *pubRecord, f Resolver, ack *Ack, err error) {
	pub.resolved = true
	if err != nil {
		f.Resolve(nil, err)
		return
	}
	st.acked[pub.id]++
	f.Resolve(ack, nil)
}

// release sends the acks held back so far, in publish order, and stops
// holding.
func (st *fakeStream) release() {
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, h := range st.held {
		if h.ack == nil {
			st.resolveLocked(h.pub, h.f, nil, errAckTimeout)
		} else {
			st.resolveLocked(h.pub, h.f, h.ack, nil)
		}
	}
	st.held = nil
	st.hold = false
}

// resolve answers held publish n: with its ack when err is nil, else err.
func (st *fakeStream) resolve(n int, err error) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	for i, h := range st.held {
		if h.pub.n != n {
			continue
		}
		if err == nil && h.ack == nil {
			return fmt.Errorf("publish %d (%s) was lost: it can only fail", n, h.pub.id)
		}
		var re *refusedError
		if h.ack != nil && (errors.As(err, &re) || errors.Is(err, ErrOrderRefused)) {
			return fmt.Errorf("publish %d (%s) was stored: it cannot be refused (lose it instead)", n, h.pub.id)
		}
		st.held = append(st.held[:i], st.held[i+1:]...)
		st.resolveLocked(h.pub, h.f, h.ack, err)
		return nil
	}
	return fmt.Errorf("publish %d is not held", n)
}

// published returns the event ids of every publish so far, in call order.
func (st *fakeStream) published() []string {
	st.mu.Lock()
	defer st.mu.Unlock()
	ids := make([]string, len(st.pubs))
	for i, p := range st.pubs {
		ids[i] = p.id
	}
	return ids
}

func newFakeStream() *fakeStream {
	return &fakeStream{seqOf: map[string]uint64{}, lose: map[int]bool{}, storeLose: map[int]bool{}, reject: map[string]int{}, foreign: map[int]bool{},
		reconnectDuring: map[int]bool{}, callFails: map[int]error{}, acked: map[string]int{}, readBack: map[string]bool{}}
}

// The fake's errors, sorted the way a real sink's Classify sorts them.
var (
	errNoResponders = errors.New("no responders: the stream has no leader")
	errAckTimeout   = errors.New("timeout waiting for the ack")
)

// refusedError is a stream's refusal for good (e.g. too large).
type refusedError struct{ code int }

func (e *refusedError) Error() string { return fmt.Sprintf("refused by the test (code %d)", e.code) }

// fakeSink puts dead letters into one stream, everything else into ORDERS.
type fakeSink struct {
	st, dlq    *fakeStream
	ackTimeout time.Duration
	tailFails  int // reads of the stream's state that fail before one succeeds
	tailReads  int
	// busyWriter: another writer stores a message in the stream while
	// every tail read runs, after the last sequence was read.
	busyWriter bool
	// epoch is the connection's: a test bumps it to simulate a reconnect.
	epoch atomic.Uint64
}

// txnLog is what a fake TxnSink heard: each EndTxn with the number of
// transaction messages published since the one before.
type txnLog struct {
	mu   sync.Mutex
	open int
	last string // the id of the newest transaction message
	ends []txnEndRecord
}

type txnEndRecord struct {
	end  TxnEnd
	msgs int
	last string
}

func (l *txnLog) list() []txnEndRecord {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]txnEndRecord(nil), l.ends...)
}

// EndTxn implements TxnSink (a no-op unless the stream's txns is set).
func (s *fakeSink) EndTxn(end TxnEnd) {
	l := s.st.txns
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open > 0 {
		l.ends = append(l.ends, txnEndRecord{end, l.open, l.last})
		l.open = 0
	}
}

// TxnOpen implements TxnSink.
func (s *fakeSink) TxnOpen() bool {
	l := s.st.txns
	if l == nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.open > 0
}

func (s *fakeSink) Publish(m *Msg) (Future, error) {
	st := s.st
	if len(m.Subject) > 11 && m.Subject[:11] == "walbox.dlq." {
		st = s.dlq
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	st.publishes++
	n := st.publishes
	id := m.Header.Get(HeaderMsgID)
	pub := &pubRecord{n: n, id: id, epoch: s.Epoch(), at: time.Now(), stream: m.Stream, mayBeStored: m.MayBeStored, txn: m.Txn}
	if l := s.st.txns; l != nil && m.Txn != 0 {
		l.mu.Lock()
		l.open++
		l.last = id
		l.mu.Unlock()
	}
	st.pubs = append(st.pubs, pub)
	for _, q := range st.pubs[:len(st.pubs)-1] {
		if !q.resolved && q.epoch != pub.epoch {
			st.mixed = append(st.mixed, fmt.Sprintf("publish %d (%s) on connection %d while publish %d (%s) of connection %d is unresolved",
				n, id, pub.epoch, q.n, q.id, q.epoch))
		}
	}
	if st.notify != nil {
		select {
		case st.notify <- n:
		default:
		}
	}
	if err := st.callFails[n]; err != nil {
		pub.resolved = true
		return nil, err
	}
	if st.reconnectDuring[n] {
		defer s.epoch.Add(1)
	}
	fut, f := NewFuture()
	if st.unavailable > 0 {
		st.unavailable--
		st.resolveLocked(pub, f, nil, errNoResponders)
		return fut, nil
	}
	if st.lose[n] {
		if st.storeLose[n] {
			h := Header{}
			for k, v := range m.Header {
				h[k] = append([]string(nil), v...)
			}
			st.store(id, h)
		}
		if st.hold {
			st.held = append(st.held, &heldAck{pub: pub, f: f})
			return fut, nil
		}
		time.AfterFunc(s.ackTimeout, func() {
			st.mu.Lock()
			defer st.mu.Unlock()
			st.resolveLocked(pub, f, nil, errAckTimeout)
		})
		return fut, nil
	}
	if st.refuseNext > 0 && !strings.HasPrefix(m.Subject, "walbox.dlq.") {
		st.refuseNext--
		st.resolveLocked(pub, f, nil, &refusedError{code: st.refuseCode})
		return fut, nil
	}
	if code, ok := st.reject[id]; ok {
		// Refused for good (e.g. too large), like a stream leader does.
		st.resolveLocked(pub, f, nil, &refusedError{code: code})
		return fut, nil
	}
	if st.foreign[n] {
		st.store("foreign-"+strconv.Itoa(n), Header{})
	}
	if st.expectFirst && m.ExpectSet && m.Expect != st.lastSeq {
		st.resolveLocked(pub, f, nil, fmt.Errorf("%w: wrong last sequence: %d", ErrOrderRefused, st.lastSeq))
		return fut, nil
	}
	if seq, dup := st.seqOf[id]; dup && !st.kafka {
		st.resolveLocked(pub, f, &Ack{Stream: "ORDERS", Sequence: seq, Duplicate: true}, nil)
		return fut, nil
	}
	if m.ExpectSet && m.Expect != st.lastSeq {
		st.resolveLocked(pub, f, nil, fmt.Errorf("%w: wrong last sequence: %d", ErrOrderRefused, st.lastSeq))
		return fut, nil
	}
	h := Header{}
	for k, v := range m.Header {
		h[k] = append([]string(nil), v...) // the relay reuses m once acked
	}
	if m.ExpectSet { // stored as the JetStream sink sends it
		h.Set(HeaderExpectedLastSeq, strconv.FormatUint(m.Expect, 10))
	}
	pub.stored = true
	ack := &Ack{Stream: "ORDERS", Sequence: st.store(id, h)}
	if st.hold {
		st.held = append(st.held, &heldAck{pub: pub, ack: ack, f: f})
		st.maxHeld = max(st.maxHeld, len(st.held))
		return fut, nil
	}
	st.resolveLocked(pub, f, ack, nil)
	return fut, nil
}

func (st *fakeStream) store(id string, h Header) uint64 {
	st.lastSeq++
	st.ids = append(st.ids, id)
	st.hdrs = append(st.hdrs, h)
	st.seqOf[id] = st.lastSeq
	return st.lastSeq
}

// Classify knows only its own refusal: the relay sorts PoisonError itself.
func (s *fakeSink) Classify(err error) ErrorClass {
	var re *refusedError
	if errors.As(err, &re) {
		return Permanent
	}
	return Transient
}

// fakeDLQStream is the dead-letter stream's name when a test routes it.
const fakeDLQStream = "DLQ"

// StoredIdentity implements DuplicateChecker from the stored headers.
func (s *fakeSink) StoredIdentity(_ context.Context, stream string, seq uint64) (string, string, error) {
	st := s.st
	st.mu.Lock()
	defer st.mu.Unlock()
	if seq == 0 || seq > uint64(len(st.hdrs)) {
		return "", "", fmt.Errorf("no message %d", seq)
	}
	h := st.hdrs[seq-1]
	id := h.Get(HeaderEventID)
	if id == "" {
		id = st.ids[seq-1]
	}
	return h.Get(HeaderSource), IdentityKey(h.Get(HeaderTable), id), nil
}

// ErrorCode implements ErrorCoder: a refusal's code, as a sink's table has it.
func (s *fakeSink) ErrorCode(err error) string {
	var re *refusedError
	if errors.As(err, &re) {
		return strconv.Itoa(re.code)
	}
	return err.Error()
}

func (s *fakeSink) MaxPayload() int { return 1 << 20 }
func (s *fakeSink) Epoch() uint64   { return s.epoch.Load() }

// StoredTail implements Sink over the whole stream (the dead-letter
// stream for fakeDLQStream).
func (s *fakeSink) StoredTail(_ context.Context, stream, source string, n int) (StoredTail, error) {
	st := s.st
	if stream == fakeDLQStream {
		st = s.dlq
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	s.tailReads++
	if s.tailReads <= s.tailFails {
		return StoredTail{}, errors.New("stream info: no responders")
	}
	tail := StoredTail{IDs: map[string]struct{}{}, LastSeq: st.lastSeq, StateRead: true}
	if s.busyWriter {
		st.store("foreign-scan-"+strconv.Itoa(s.tailReads), Header{})
	}
	for i := max(0, len(st.ids)-n); i < len(st.ids); i++ {
		pos, origin, ok := PositionFromHeaders(st.hdrs[i], source)
		if !ok {
			if st.hdrs[i].Get(HeaderSource) != source {
				tail.NewestForeign = uint64(i + 1)
			}
			continue
		}
		tail.Add(IdentityKey(st.hdrs[i].Get(HeaderTable), st.ids[i]), origin, pos)
		st.readBack[st.ids[i]] = true
	}
	return tail, nil
}

// scriptSource hands the relay one batch of transactions, then waits.
type scriptSource struct {
	changes []cdc.Change
	mu      sync.Mutex
	conf    cdc.LSN
	target  cdc.LSN
	reached chan struct{}
}

// newScript builds txns transactions of perTxn events each; event ids are
// "e<txn>-<i>" and come out in that order.
func newScript(txns, perTxn int) (*scriptSource, []string) {
	s := &scriptSource{reached: make(chan struct{})}
	var ids []string
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for t := range txns {
		commit := cdc.LSN(0x1000 + 0x100*t)
		s.changes = append(s.changes, cdc.Change{Kind: cdc.KindBegin, LSN: commit})
		for i := range perTxn {
			id := fmt.Sprintf("e%03d-%d", t, i)
			ids = append(ids, id)
			s.changes = append(s.changes, cdc.Change{Kind: cdc.KindEvent, Event: cdc.Event{
				Pos: cdc.Position{CommitLSN: commit, Index: uint32(i)}, CommitTime: t0,
				ID: id, Topic: "orders.created", Payload: []byte(`{}`), PayloadIsJSON: true,
			}})
		}
		s.target = commit + 0x10
		s.changes = append(s.changes, cdc.Change{Kind: cdc.KindCommit, LSN: s.target})
	}
	return s, ids
}

func (s *scriptSource) Run(ctx context.Context, out chan<- []cdc.Change) error {
	select {
	case out <- s.changes:
	case <-ctx.Done():
		return nil
	}
	<-ctx.Done()
	return nil
}

func (s *scriptSource) Confirm(lsn cdc.LSN) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if lsn < s.conf {
		panic(fmt.Sprintf("confirmed LSN went back from %s to %s", s.conf, lsn))
	}
	s.conf = lsn
	if lsn == s.target {
		close(s.reached)
	}
}

// runPublisher runs the relay over src until every transaction is confirmed.
func runPublisher(t *testing.T, st *fakeStream, src *scriptSource, strict bool) *fakeStream {
	t.Helper()
	return runPublisherDLQ(t, st, newFakeStream(), src, strict)
}

func runPublisherDLQ(t *testing.T, st, dlq *fakeStream, src *scriptSource, strict bool) *fakeStream {
	t.Helper()
	sink := &fakeSink{st: st, dlq: dlq, ackTimeout: 5 * time.Second}
	router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
	r := New(Config{Window: 16, StrictOrder: strict, BackoffInitial: 100 * time.Millisecond, BackoffMax: time.Second}, sink, router)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Serve(ctx, src) }()
	select {
	case <-src.reached:
	case <-time.After(10 * time.Minute): // fake time: only a publisher that is stuck for good gets here
		t.Error("not every transaction was confirmed")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("relay: %v", err)
	}
	return sink.dlq
}

// serveUntilReached runs r until src has seen every transaction confirmed,
// then stops it: Serve must return nil.
func serveUntilReached(t *testing.T, r *Relay, src *scriptSource) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Serve(ctx, src) }()
	<-src.reached
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// wantStoredOnce wants every one of ids in st exactly once (in any order,
// among anything else).
func wantStoredOnce(t *testing.T, st *fakeStream, ids []string) {
	t.Helper()
	seen := map[string]int{}
	for _, id := range st.ids {
		seen[id]++
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Fatalf("%s stored %d times", id, seen[id])
		}
	}
}

// checkStream wants exactly ids, once each, in order (foreign messages aside).
func checkStream(st *fakeStream, ids []string) error {
	var got []string
	for _, id := range st.ids {
		if len(id) > 8 && id[:8] == "foreign-" {
			continue
		}
		got = append(got, id)
	}
	if len(got) != len(ids) {
		return fmt.Errorf("stream holds %d events, want %d: %v", len(got), len(ids), got)
	}
	for i := range ids {
		if got[i] != ids[i] {
			return fmt.Errorf("stream position %d holds %s, want %s (order broken): %v", i, got[i], ids[i], got)
		}
	}
	return nil
}

func TestStrictOrderSurvivesAPublishLostMidWindow(t *testing.T) {
	for _, strict := range []bool{true, false} {
		t.Run("strict="+strconv.FormatBool(strict), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				st := newFakeStream()
				// The stream leader stops under publishes 5 and 6; 7 onwards
				// reach the new leader while 5 and 6 wait for their ack timeout.
				st.lose[5], st.lose[6] = true, true
				src, ids := newScript(10, 3)
				runPublisher(t, st, src, strict)
				err := checkStream(st, ids)
				if strict && err != nil {
					t.Fatal(err)
				}
				if !strict && err == nil {
					t.Fatal("without strict order a lost publish must show up as an order inversion here; the fake no longer models the leader change")
				}
			})
		})
	}
}

// TestResendsMayBeStored: the relay names each message's stream and marks
// every resend as possibly stored already, so that a sink publishes it on
// its own (a fast batch's acks cannot say which of its messages was a
// duplicate, and a resent batch full of duplicates would be refused again
// and again). A first publish is marked only when the resume check cannot
// rule it out.
func TestResendsMayBeStored(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		st.lose[5], st.storeLose[5] = true, true // stored, its ack lost: the resend is a duplicate
		st.lose[9] = true
		src, ids := newScript(10, 3)
		runPublisher(t, st, src, true)
		if err := checkStream(st, ids); err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		resends, fresh := 0, 0
		for _, p := range st.pubs {
			if p.stream != "ORDERS" {
				t.Fatalf("publish %d (%s) named stream %q", p.n, p.id, p.stream)
			}
			switch {
			case seen[p.id] && !p.mayBeStored:
				t.Fatalf("publish %d (%s) is a resend not marked as possibly stored", p.n, p.id)
			case seen[p.id]:
				resends++
			case !p.mayBeStored:
				fresh++ // a first publish is marked only when the resume check cannot rule it out
			}
			seen[p.id] = true
		}
		if resends == 0 || fresh == 0 {
			t.Fatalf("%d resends, %d unmarked first publishes: the test lost its fault", resends, fresh)
		}
	})
}

func TestStrictOrderRebasesAfterADuplicateAndARejection(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		src, ids := newScript(8, 4)
		// Event 3 is already in the stream, stored without walbox's position
		// headers, so the resume check cannot know it: its ack is a
		// duplicate and the stream does not grow, which puts the
		// expectations of the publishes behind it one off.
		st.store(ids[2], Header{HeaderMsgID: {ids[2]}})
		// Event 12 is refused for good (too large for the stream): it is
		// dead-lettered, and the stream does not grow either.
		st.reject[ids[11]] = 10054
		dlq := runPublisher(t, st, src, true)
		want := []string{ids[2]}
		for i, id := range ids {
			if i != 2 && i != 11 {
				want = append(want, id)
			}
		}
		if err := checkStream(st, want); err != nil {
			t.Fatal(err)
		}
		if len(dlq.ids) != 1 || dlq.ids[0] != ids[11] {
			t.Fatalf("dead letters: %v, want [%s]", dlq.ids, ids[11])
		}
	})
}

func TestStrictOrderReportsAnotherWriterAndLosesNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		st.foreign[4], st.foreign[20] = true, true
		src, ids := newScript(12, 2)
		m := NewMetrics(nil)
		sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
		r := New(Config{Window: 16, StrictOrder: true, Metrics: m, BackoffInitial: 100 * time.Millisecond}, sink, router)
		serveUntilReached(t, r, src)
		if got := testutil.ToFloat64(m.OtherWriters.WithLabelValues("ORDERS")); got != 1 {
			t.Fatalf("walbox_strict_order_other_writer_total = %v, want 1", got)
		}
		wantStoredOnce(t, st, ids)
		// Once reported, no more expectations: the second foreign message
		// costs no refusal.
		last := st.hdrs[len(st.hdrs)-1]
		if v := last.Get(HeaderExpectedLastSeq); v != "" {
			t.Fatalf("strict order still on after another writer was found: %s", v)
		}
	})
}

func TestStrictOrderWaitsForTheStreamStateBeforePublishing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		st.store("earlier", Header{}) // the stream is not empty: expecting 0 would be wrong
		src, ids := newScript(3, 2)
		sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second, tailFails: 2}
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
		r := New(Config{Window: 16, StrictOrder: true, BackoffInitial: 100 * time.Millisecond}, sink, router)
		serveUntilReached(t, r, src)
		if sink.tailReads != 3 {
			t.Fatalf("stream state read %d times, want 3 (two failures, then the read publishing waited for)", sink.tailReads)
		}
		for i, h := range st.hdrs[1:] {
			if h.Get(HeaderExpectedLastSeq) != strconv.Itoa(i+1) {
				t.Fatalf("publish %d went out with expectation %q, want %d", i+1, h.Get(HeaderExpectedLastSeq), i+1)
			}
		}
		if err := checkStream(st, append([]string{"earlier"}, ids...)); err != nil {
			t.Fatal(err)
		}
	})
}

// A dead letter is confirmed only after the dead-letter stream stored it:
// "no responders" from it (its only replica restarting) is waited out.
func TestDeadLetterIsConfirmedOnlyOnceTheDLQStoredIt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st, dlq := newFakeStream(), newFakeStream()
		dlq.unavailable = 3
		src, ids := newScript(4, 2)
		for i := range src.changes {
			if c := &src.changes[i]; c.Kind == cdc.KindEvent && c.Event.ID == ids[3] {
				c.Event.TopicNull = true // poison: dead-lettered at once
			}
		}
		runPublisherDLQ(t, st, dlq, src, true)
		if len(dlq.ids) != 1 || dlq.ids[0] != ids[3] {
			t.Fatalf("dead-letter stream holds %v, want [%s]: the dead letter was confirmed without it", dlq.ids, ids[3])
		}
		if err := checkStream(st, append(append([]string{}, ids[:3]...), ids[4:]...)); err != nil {
			t.Fatal(err)
		}
	})
}

// Memory is bounded by bytes, not only by count: with large events and a
// slow server the window holds what fits in WindowBytes (and always one).
func TestWindowIsBoundedByBytes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		st.hold = true
		src, ids := newScript(20, 1)
		big := []byte(`"` + strings.Repeat("x", 256<<10) + `"`) // 256 KiB each
		for i := range src.changes {
			if src.changes[i].Kind == cdc.KindEvent {
				src.changes[i].Event.Payload = big
			}
		}
		sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: time.Hour}
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
		r := New(Config{Window: 1024, WindowBytes: 768 << 10, StrictOrder: true}, sink, router)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Serve(ctx, src) }()
		synctest.Wait() // the relay is blocked: the window is full
		st.mu.Lock()
		inFlight := len(st.held)
		st.mu.Unlock()
		if inFlight != 3 {
			cancel()
			st.release()
			<-done
			t.Fatalf("%d events of 256 KiB in flight with window_bytes 768 KiB, want 3 (count alone would allow 20)", inFlight)
		}
		for {
			st.release()
			st.mu.Lock()
			st.hold = true
			st.mu.Unlock()
			synctest.Wait()
			select {
			case <-src.reached:
			default:
				continue
			}
			break
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if st.maxHeld > 3 {
			t.Fatalf("up to %d events in flight, want at most 3", st.maxHeld)
		}
		if err := checkStream(st, ids); err != nil {
			t.Fatal(err)
		}
	})
}

// TestRequireTailWaitsForTheTailBeforePublishing: on a bus that keeps
// resent duplicates (Kafka), a restarted relay whose tail read-back fails
// backs off and reads again before it publishes anything, and then skips
// what the stream already holds: nothing is stored twice.
func TestRequireTailWaitsForTheTailBeforePublishing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		src, ids := newScript(3, 2)
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
		// A first relay stored the first transaction, then died before
		// confirming it.
		first := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
		for _, ch := range src.changes[1:3] {
			m, _, err := router.Message(&ch.Event)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := first.Publish(m); err != nil {
				t.Fatal(err)
			}
		}
		sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second, tailFails: 2}
		r := New(Config{Window: 16, RequireTail: true, BackoffInitial: 100 * time.Millisecond}, sink, router)
		serveUntilReached(t, r, src)
		if sink.tailReads != 3 {
			t.Fatalf("tail read %d times, want 3 (two failures, then the read publishing waited for)", sink.tailReads)
		}
		if err := checkStream(st, ids); err != nil {
			t.Fatal(err)
		}
	})
}
