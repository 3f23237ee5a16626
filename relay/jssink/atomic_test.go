package jssink_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/busops"
	"github.com/walbox/walbox/relay/jssink"
)

func atomicSpec() jssink.StreamSpec {
	sp := ordersSpec()
	sp.Atomic = true
	return sp
}

// txnMsg is event i of transaction txn, expected after sequence expect.
func txnMsg(i int, txn, expect uint64) *relay.Msg {
	m := strictMsg(i, expect)
	m.Txn = txn
	return m
}

// publishTxn publishes events from..to-1 as transaction txn, the first
// expecting the stream's last at expect, and returns their futures. It
// does not end the transaction.
func publishTxn(t *testing.T, s *batchSink, txn uint64, from, to int, expect uint64) []relay.Future {
	t.Helper()
	var futs []relay.Future
	for i := from; i < to; i++ {
		f, err := s.Publish(txnMsg(i, txn, expect))
		if err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
		expect++
		futs = append(futs, f)
	}
	return futs
}

func awaitAll(t *testing.T, futs []relay.Future) []relay.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out []relay.Result
	for i, f := range futs {
		r, err := awaitResult(ctx, f)
		if err != nil {
			t.Fatalf("future %d: %v", i, err)
		}
		out = append(out, r)
	}
	return out
}

// wantHeld checks that the stream holds exactly ids, in order.
func wantHeld(t *testing.T, s *batchSink, ids ...string) {
	t.Helper()
	got := storedIDs(t, s)
	if strings.Join(got, ",") != strings.Join(ids, ",") {
		t.Fatalf("stream holds %v, want %v", got, ids)
	}
}

func eIDs(from, to int) []string {
	var ids []string
	for i := from; i < to; i++ {
		ids = append(ids, fmt.Sprintf("e%d", i))
	}
	return ids
}

// TestAtomicTransactionAllOrNothing: a transaction's messages are invisible
// until its commit; the connection dropped before the commit (a relay
// killed mid-batch) leaves nothing of it in the stream, and the resend on a
// new connection stores it once, each future at its own sequence.
func TestAtomicTransactionAllOrNothing(t *testing.T) {
	srv := natstest.New(t)
	s := batchSinkOn(t, srv.URL(), 5*time.Second, 1024, atomicSpec())
	if !s.paths[0].Atomic {
		t.Fatalf("path %+v: want atomic batches", s.paths[0])
	}
	futs := publishTxn(t, s, 1, 0, 20, 0)
	// Every message is on the server, staged, and the commit never comes.
	if err := s.SendOpenUncommitted(); err != nil {
		t.Fatal(err)
	}
	if err := s.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	wantHeld(t, s)
	s.nc.Close()               // the connection drops before the commit
	s.EndTxn(relay.TxnAbandon) // as the relay does when a publish fails
	for i, r := range awaitAll(t, futs) {
		if r.Err == nil {
			t.Fatalf("event %d acked without a commit: %+v", i, r.Ack)
		}
	}

	s2 := batchSinkOn(t, srv.URL(), 5*time.Second, 1024, atomicSpec())
	wantHeld(t, s2)
	futs = publishTxn(t, s2, 1, 0, 20, 0)
	wantHeld(t, s2)
	s2.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, futs) {
		if r.Err != nil || r.Ack.Stream != "ORDERS" || r.Ack.Sequence != uint64(i+1) || r.Ack.Duplicate {
			t.Fatalf("event %d: %+v, want stored at %d", i, r, i+1)
		}
	}
	wantHeld(t, s2, eIDs(0, 20)...)
	// The next transaction follows, its first message expecting 20.
	futs = publishTxn(t, s2, 2, 20, 25, 20)
	s2.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, futs) {
		if r.Err != nil || r.Ack.Sequence != uint64(21+i) {
			t.Fatalf("event %d: %+v, want stored at %d", 20+i, r, 21+i)
		}
	}
	// Two small transactions read one right after the other share a
	// batch: a consumer sees both at once, never part of either.
	f1 := publishTxn(t, s2, 3, 25, 27, 25)
	f2 := publishTxn(t, s2, 4, 27, 28, 27)
	s2.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, append(f1, f2...)) {
		if r.Err != nil || r.Ack.Sequence != uint64(26+i) {
			t.Fatalf("event %d: %+v, want stored at %d", 25+i, r, 26+i)
		}
	}
	wantHeld(t, s2, eIDs(0, 28)...)
	if st := s2.AtomicStats(); st.Batches != 3 || st.Messages != 28 || st.Splits != 0 || st.Refused != 0 {
		t.Fatalf("atomic stats %+v", st)
	}
}

// TestAtomicAbandonedStoresNothing: a transaction the relay abandons (it
// stopped publishing after a failure) fails every future, and nothing of
// it is ever stored, not even once the server's batch timeout passed.
func TestAtomicAbandonedStoresNothing(t *testing.T) {
	s := startBatchSink(t, 5*time.Second, 1024, atomicSpec())
	futs := publishTxn(t, s, 1, 0, 10, 0)
	s.EndTxn(relay.TxnAbandon)
	for i, r := range awaitAll(t, futs) {
		if r.Err == nil {
			t.Fatalf("event %d acked after the abandon: %+v", i, r.Ack)
		}
	}
	futs = publishTxn(t, s, 1, 0, 10, 0)
	s.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, futs) {
		if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
			t.Fatalf("event %d: %+v", i, r)
		}
	}
	wantHeld(t, s, eIDs(0, 10)...)
}

// TestAtomicSplitsAtTheLimit: a transaction over the server's batch limit
// (1,000 messages) goes in batches of 1,000, and one whose open messages
// would fill the relay's window is committed when they do; each split is
// counted and every event is stored once, in order.
func TestAtomicSplitsAtTheLimit(t *testing.T) {
	for _, tc := range []struct {
		name           string
		window, n      int
		batches, split uint64
	}{
		{"server limit", 4096, 2500, 3, 2},
		{"relay window", 300, 1000, 4, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startBatchSink(t, 5*time.Second, tc.window, atomicSpec())
			// As the relay does: never more than window in flight.
			var futs []relay.Future
			var res []relay.Result
			for i := range tc.n {
				if len(futs)-len(res) >= tc.window {
					res = append(res, awaitAll(t, futs[len(res):len(res)+1])...)
				}
				f, err := s.Publish(txnMsg(i, 1, uint64(i)))
				if err != nil {
					t.Fatal(err)
				}
				futs = append(futs, f)
			}
			s.EndTxn(relay.TxnCommit)
			res = append(res, awaitAll(t, futs[len(res):])...)
			for i, r := range res {
				if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
					t.Fatalf("event %d: %+v, want stored at %d", i, r, i+1)
				}
			}
			wantHeld(t, s, eIDs(0, tc.n)...)
			if st := s.AtomicStats(); st.Batches != tc.batches || st.Splits != tc.split || st.Messages != uint64(tc.n) {
				t.Fatalf("atomic stats %+v, want %d batches, %d splits", st, tc.batches, tc.split)
			}
		})
	}
}

// TestAtomicDuplicateInsideFallsBack: a transaction holding an event the
// stream stored already is refused whole (10201) and nothing of it is
// stored; each of its futures fails with relay.ErrTxnRefused, and the
// per-message resend stores each event exactly once (the stored one comes
// back as a duplicate of its sequence).
func TestAtomicDuplicateInsideFallsBack(t *testing.T) {
	s := startBatchSink(t, 5*time.Second, 1024, atomicSpec())
	pre := strictMsg(3, 0) // e3 stored on its own before
	f, err := s.Publish(pre)
	if err != nil {
		t.Fatal(err)
	}
	if r := awaitAll(t, []relay.Future{f})[0]; r.Err != nil || r.Ack.Sequence != 1 {
		t.Fatalf("e3 alone: %+v", r)
	}
	futs := publishTxn(t, s, 1, 0, 6, 1)
	s.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, futs) {
		if !errors.Is(r.Err, relay.ErrTxnRefused) || !strings.Contains(r.Err.Error(), "10201") {
			t.Fatalf("event %d: %+v, want the transaction refused for its duplicate (10201)", i, r)
		}
	}
	wantHeld(t, s, "e3")
	if st := s.AtomicStats(); st.Refused != 1 || st.Batches != 0 {
		t.Fatalf("atomic stats %+v, want one refusal", st)
	}

	// The relay's resend: each event on its own (Txn 0), in order.
	expect := uint64(1)
	for i := range 6 {
		m := strictMsg(i, expect)
		m.MayBeStored = true
		f, err := s.Publish(m)
		if err != nil {
			t.Fatal(err)
		}
		r := awaitAll(t, []relay.Future{f})[0]
		switch {
		case i == 3:
			if r.Err != nil || !r.Ack.Duplicate || r.Ack.Sequence != 1 {
				t.Fatalf("e3 resent: %+v, want a duplicate of seq 1", r)
			}
		case r.Err != nil || r.Ack.Duplicate || r.Ack.Sequence != expect+1:
			t.Fatalf("e%d resent: %+v, want stored at %d", i, r, expect+1)
		default:
			expect++
		}
	}
	wantHeld(t, s, "e3", "e0", "e1", "e2", "e4", "e5")
}

// TestAtomicOrderRefusedStoresNothing: the first message's expectation is
// the whole batch's: a stream whose last sequence is not the expected one
// (a predecessor lost) refuses the batch, nothing of it is stored, and
// every message gets the order refusal the relay resends on.
func TestAtomicOrderRefusedStoresNothing(t *testing.T) {
	s := startBatchSink(t, 5*time.Second, 1024, atomicSpec())
	futs := publishTxn(t, s, 1, 0, 5, 3) // the stream's last is 0, not 3
	s.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, futs) {
		if !errors.Is(r.Err, relay.ErrOrderRefused) {
			t.Fatalf("event %d: %+v, want the order refusal", i, r)
		}
	}
	wantHeld(t, s)
	if st := s.AtomicStats(); st.Refused != 0 {
		t.Fatalf("an order refusal counted as a refused transaction: %+v", st)
	}
}

// TestAtomicUnmanagedStreamWithoutAllowAtomic: a stream walbox does not
// manage and that does not allow atomic batches is published in fast
// batches, and the path says why and what enabling them needs.
func TestAtomicUnmanagedStreamWithoutAllowAtomic(t *testing.T) {
	srv := natstest.New(t)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	sp := atomicSpec()
	sink, err := jssink.New(nc, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c := sp.Config()
	c.AllowBatchPublish = true
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := sink.JetStream().CreateStream(ctx, c); err != nil {
		t.Fatal(err)
	}
	sp.Manage = false
	_, paths, err := jssink.EnsureStreams(ctx, sink.JetStream(), []jssink.StreamSpec{sp})
	if err != nil {
		t.Fatal(err)
	}
	if p := paths[0]; p.Atomic || !p.Batch || !strings.Contains(p.Why, "allow_atomic: true") {
		t.Fatalf("path %+v: want fast batches, saying allow_atomic is off", p)
	}
}

// TestAtomicOldServerPerMessage: on a real nats-server 2.11 walbox creates
// its stream without allow_atomic, says why it does not publish atomic
// batches, and a transaction's events go per message, stored once, in
// order.
func TestAtomicOldServerPerMessage(t *testing.T) {
	p := natstest.NewProcServer(t, oldServer)
	s := batchSinkOn(t, p.URL(), 5*time.Second, 1024, atomicSpec())
	if s.paths[0].Atomic || !strings.Contains(s.paths[0].Why, "2.12.1") {
		t.Fatalf("path on %s: %+v, want per message because of the version", oldServer, s.paths[0])
	}
	futs := publishTxn(t, s, 1, 0, 50, 0)
	s.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, futs) {
		if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
			t.Fatalf("event %d: %+v", i, r)
		}
	}
	wantHeld(t, s, eIDs(0, 50)...)
	if st := s.AtomicStats(); st.Messages != 0 {
		t.Fatalf("atomic batches on an old server: %+v", st)
	}
}

func TestAtomicServerVersions(t *testing.T) {
	for v, want := range map[string]bool{"2.11.9": false, "2.12.0": false, "2.12.1": true, "2.14.0": true, "2.15.3": true, "3.0.0": true, "": false} {
		if got := jssink.AtomicServer(v); got != want {
			t.Errorf("AtomicServer(%q) = %v, want %v", v, got, want)
		}
	}
}

// TestAtomicSmallTransactionsShareBatches: transactions read one right
// after the other share a batch up to the server's limit, cut at a
// transaction's boundary: never one split, every event at its sequence.
func TestAtomicSmallTransactionsShareBatches(t *testing.T) {
	s := startBatchSink(t, 5*time.Second, 1024, atomicSpec())
	var futs []relay.Future
	for txn := range 100 { // 1,000 events, then one of 7 that does not fit
		futs = append(futs, publishTxn(t, s, uint64(txn+1), txn*10, txn*10+10, uint64(txn*10))...)
	}
	futs = append(futs, publishTxn(t, s, 101, 1000, 1007, 1000)...)
	s.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, futs) {
		if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
			t.Fatalf("event %d: %+v, want stored at %d", i, r, i+1)
		}
	}
	wantHeld(t, s, eIDs(0, 1007)...)
	if st := s.AtomicStats(); st.Batches != 2 || st.Splits != 0 {
		t.Fatalf("atomic stats %+v, want a batch of 100 transactions and one of 1, no split", st)
	}
}

// TestAtomicMayCommitHoldsOnlyBehindABatchInFlight: a transaction that
// ends with nothing in flight on its stream (a live relay) is committed at
// once; one that ends while an earlier batch waits for its ack may wait
// for that ack, and then goes.
func TestAtomicMayCommitHoldsOnlyBehindABatchInFlight(t *testing.T) {
	s := startBatchSink(t, 5*time.Second, 1024, atomicSpec())
	f1 := publishTxn(t, s, 1, 0, 10, 0)
	s.EndTxn(relay.TxnCommit)
	f2 := publishTxn(t, s, 2, 10, 20, 10)
	s.EndTxn(relay.TxnMayCommit)
	held := s.TxnOpen()
	awaitAll(t, f1)
	if held {
		s.EndTxn(relay.TxnMayCommit) // as the relay does when its head resolves
	}
	if s.TxnOpen() {
		t.Fatal("a transaction with nothing in flight before it was not committed")
	}
	for i, r := range awaitAll(t, append(f1, f2...)[10:]) {
		if r.Err != nil || r.Ack.Sequence != uint64(11+i) {
			t.Fatalf("event %d: %+v", 10+i, r)
		}
	}
	f3 := publishTxn(t, s, 3, 20, 25, 20)
	s.EndTxn(relay.TxnMayCommit)
	if s.TxnOpen() {
		t.Fatal("a live transaction waited")
	}
	awaitAll(t, f3)
	wantHeld(t, s, eIDs(0, 25)...)
	t.Logf("the second transaction waited for the first's ack: %v", held)
}

// The atomic path's cost per message against the same embedded server as
// BenchmarkPublishStrictFastBatch, transactions of 10 events in batches
// of up to 1,000, on a file and on a memory stream (an R1 file stream
// stages each atomic batch in a file store of its own; a memory or
// replicated one in memory):
//
//	go test ./relay/jssink -run '^$' -bench 'Atomic' -benchtime 100000x -count 3
func BenchmarkPublishAtomicFile(b *testing.B)   { benchAtomic(b, "file") }
func BenchmarkPublishAtomicMemory(b *testing.B) { benchAtomic(b, "memory") }

func benchAtomic(b *testing.B, storage string) {
	sp := jssink.StreamSpec{Name: "BENCH", Subjects: []string{"bench.>"}, Storage: storage, Manage: true,
		DuplicateWindow: 2 * time.Minute, Atomic: true}
	window := benchWindow
	if w, err := strconv.Atoi(os.Getenv("ATOMIC_BENCH_WINDOW")); err == nil {
		window = w
	}
	s := startBatchSink(b, 10*time.Second, window, sp)
	if !s.paths[0].Atomic {
		b.Fatalf("path %+v", s.paths[0])
	}
	expect := uint64(0)
	windowedN(b, window, func(i int) func() error {
		m := benchMsg(i)
		m.Stream, m.Expect, m.ExpectSet, m.Txn = "BENCH", expect, true, uint64(i/10+1)
		expect++
		f, err := s.Publish(m)
		if err != nil {
			b.Fatal(err)
		}
		if i%10 == 9 {
			s.EndTxn(relay.TxnMayCommit)
		}
		return func() error {
			select {
			case r := <-f:
				return r.Err
			default:
			}
			s.EndTxn(relay.TxnMayCommit) // as the relay does while it waits
			return (<-f).Err
		}
	})
	b.ReportMetric(float64(s.AtomicStats().Batches), "batches")
}

// TestAtomicDoctorSaysThePath: walbox doctor's publish check says a
// stream takes atomic batches, or why not and what enabling them needs.
func TestAtomicDoctorSaysThePath(t *testing.T) {
	srv := natstest.New(t)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	shared := atomicSpec()
	shared.Name, shared.Subjects, shared.Manage = "SHARED", []string{"shared.>"}, false
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, shared.Config()); err != nil {
		t.Fatal(err)
	}
	managed := atomicSpec()
	dlq := jssink.StreamSpec{Name: "WALBOX_DLQ", Subjects: []string{"walbox.dlq.>"}, Manage: true}
	o, err := jssink.OpenOps(nc, jssink.OpsConfig{Streams: []jssink.StreamSpec{managed, shared, dlq}, AckTimeout: 5 * time.Second,
		RedactURL: func(s string) string { return s }})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	o.Check(ctx, func(name string, st busops.Status, detail, fix string) {
		got[name] = fmt.Sprintf("%v: %s | %s", st, detail, fix)
	})
	if r := got["nats.stream.ORDERS.publish"]; !strings.Contains(r, "atomic batch") {
		t.Errorf("managed stream: %s", r)
	}
	if r := got["nats.stream.SHARED.publish"]; !strings.Contains(r, "allow_atomic: true") || !strings.Contains(r, "nats.atomic_transactions is on, but") {
		t.Errorf("unmanaged stream without allow_atomic: %s", r)
	}
}

// TestAtomicSplitsAtTheByteBudget: a transaction whose open messages reach
// the relay's byte budget (nats.window_bytes) is committed there, counted
// as a split, and every event is stored once, in order.
func TestAtomicSplitsAtTheByteBudget(t *testing.T) {
	s := startBatchSink(t, 5*time.Second, 4096, atomicSpec())
	budget := 300 * txnMsg(0, 1, 0).Size()
	s.SetBatching(jssink.Batching{Paths: s.paths, Window: 4096, WindowBytes: budget})
	var futs []relay.Future
	var res []relay.Result
	var sizes []int64
	var held int64
	for i := range 1000 {
		m := txnMsg(i, 1, uint64(i))
		for held >= budget { // as the relay does: no more while the budget is spent
			res = append(res, awaitAll(t, futs[len(res):len(res)+1])...)
			held -= sizes[len(res)-1]
		}
		f, err := s.Publish(m)
		if err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, m.Size()) // as the relay counts it: after Publish
		held += m.Size()
		futs = append(futs, f)
	}
	s.EndTxn(relay.TxnCommit)
	res = append(res, awaitAll(t, futs[len(res):])...)
	for i, r := range res {
		if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
			t.Fatalf("event %d: %+v", i, r)
		}
	}
	wantHeld(t, s, eIDs(0, 1000)...)
	if st := s.AtomicStats(); st.Splits < 3 {
		t.Fatalf("atomic stats %+v: want the transaction split at the byte budget", st)
	}
	t.Logf("%+v", s.AtomicStats())
}

// TestAtomicR3: on a replicated stream (the server stages a batch in
// memory and proposes it whole) a commit's ack proves each message at its
// sequence, transactions share a batch, and a duplicate inside refuses the
// batch with nothing stored.
func TestAtomicR3(t *testing.T) {
	c := natstest.NewCluster(t, 3)
	sp := atomicSpec()
	sp.Replicas = 3
	s := batchSinkOn(t, c.URLs(), 10*time.Second, 1024, sp)
	natstest.WaitStreamReady(t, c, s.js, sp.Name, "orders.created")
	if !s.paths[0].Atomic {
		t.Fatalf("path %+v", s.paths[0])
	}
	var futs []relay.Future
	for txn := range 30 { // 30 transactions of 1..30 events: 465
		from := txn * (txn + 1) / 2
		futs = append(futs, publishTxn(t, s, uint64(txn+1), from, from+txn+1, uint64(from))...)
	}
	s.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, futs) {
		if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
			t.Fatalf("event %d: %+v", i, r)
		}
	}
	futs = publishTxn(t, s, 31, 465, 470, 465)
	dup := txnMsg(7, 32, 470) // e7, stored at 8
	f, err := s.Publish(dup)
	if err != nil {
		t.Fatal(err)
	}
	s.EndTxn(relay.TxnCommit)
	for i, r := range awaitAll(t, append(futs, f)) {
		if !errors.Is(r.Err, relay.ErrTxnRefused) {
			t.Fatalf("event %d of the batch with a duplicate: %+v, want refused", i, r)
		}
	}
	wantHeld(t, s, eIDs(0, 465)...)
	t.Logf("%+v", s.AtomicStats())
}
