package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/walbox/walbox/cdc"
)

// The publisher loop on its own: a fake sink whose futures the test
// resolves one by one, in any order, a source fed batch by batch, and
// synctest's clock for the back-off and the drain deadline. Every test
// checks, on each confirmation as it happens, that the confirmed LSN never
// goes back and never passes an event whose publish was not acked.

// loopScript is a run of transactions: event ids "e00", "e01", ... in commit
// order.
type loopScript struct {
	txns [][]cdc.Change
	ids  []string
	end  map[string]cdc.LSN // the end LSN of each event's transaction
	ends []cdc.LSN          // each transaction's end LSN
}

// buildScript makes one transaction per size, with that many events.
func buildScript(sizes ...int) *loopScript {
	sc := &loopScript{end: map[string]cdc.LSN{}}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for t, size := range sizes {
		commit := cdc.LSN(0x1000 + 0x100*t)
		end := commit + 0x10
		txn := []cdc.Change{{Kind: cdc.KindBegin, LSN: commit}}
		for i := range size {
			id := fmt.Sprintf("e%02d", len(sc.ids))
			sc.ids = append(sc.ids, id)
			sc.end[id] = end
			txn = append(txn, cdc.Change{Kind: cdc.KindEvent, Event: cdc.Event{
				Pos: cdc.Position{CommitLSN: commit, Index: uint32(i)}, CommitTime: t0,
				ID: id, Topic: "orders.created", Payload: []byte(`{}`), PayloadIsJSON: true,
			}})
		}
		sc.txns = append(sc.txns, append(txn, cdc.Change{Kind: cdc.KindCommit, LSN: end}))
		sc.ends = append(sc.ends, end)
	}
	return sc
}

// batch returns transactions from..to-1 as one batch.
func (sc *loopScript) batch(from, to int) []cdc.Change {
	var b []cdc.Change
	for _, txn := range sc.txns[from:to] {
		b = append(b, txn...)
	}
	return b
}

// last is the end LSN of the last transaction.
func (sc *loopScript) last() cdc.LSN { return sc.ends[len(sc.ends)-1] }

// loopSource hands the relay the batches the test feeds it and checks every
// confirmation against what the sink has acked.
type loopSource struct {
	t      *testing.T
	sc     *loopScript
	st     *fakeStream
	dlq    *fakeStream
	feed   chan []cdc.Change
	fail   chan error // Run returns what it receives here
	mu     sync.Mutex
	conf   cdc.LSN
	waitAt cdc.LSN
	reach  chan struct{}
	resets int // ResetTaken calls
}

func (s *loopSource) ResetTaken() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resets++
}

func (s *loopSource) resetsTaken() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.resets
}

func (s *loopSource) Run(ctx context.Context, out chan<- []cdc.Change) error {
	for {
		select {
		case b := <-s.feed:
			select {
			case out <- b:
			case <-ctx.Done():
				return nil
			}
		case err := <-s.fail:
			return err
		case <-ctx.Done():
			return nil
		}
	}
}

// Confirm checks that lsn does not go back and passes no event that the
// sink has not acked (in its stream or, dead-lettered, in the DLQ) or shown
// stored in a read-back of the stream (the resume check).
func (s *loopSource) Confirm(lsn cdc.LSN) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if lsn < s.conf {
		s.t.Errorf("confirmed LSN went back from %s to %s", s.conf, lsn)
	}
	s.conf = lsn
	for _, id := range s.sc.ids {
		if s.sc.end[id] <= lsn && !s.acked(id) {
			s.t.Errorf("confirmed %s passes %s (transaction end %s), which is not acked", lsn, id, s.sc.end[id])
		}
	}
	if s.reach != nil && lsn >= s.waitAt {
		close(s.reach)
		s.reach = nil
	}
}

func (s *loopSource) acked(id string) bool {
	for _, st := range []*fakeStream{s.st, s.dlq} {
		st.mu.Lock()
		n, read := st.acked[id], st.readBack[id]
		st.mu.Unlock()
		if n > 0 || read {
			return true
		}
	}
	return false
}

// confirmed is the last LSN confirmed.
func (s *loopSource) confirmed() cdc.LSN {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conf
}

// reached returns a channel closed once lsn is confirmed.
func (s *loopSource) reached(lsn cdc.LSN) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := make(chan struct{})
	if s.conf >= lsn {
		close(ch)
		return ch
	}
	s.waitAt, s.reach = lsn, ch
	return ch
}

// loopRig is a relay running over a fakeSink and a loopSource.
type loopRig struct {
	t       *testing.T
	sc      *loopScript
	sink    *fakeSink
	st      *fakeStream
	dlq     *fakeStream
	src     *loopSource
	m       *Metrics
	cancel  context.CancelFunc
	done    chan error
	stopped bool // Serve's result was taken

	mu        sync.Mutex
	delivered []Delivered
}

// startLoop starts the relay; cfg's Window and timings are the test's, the
// rest is filled in. setup runs on the fakes before the relay starts.
func startLoop(t *testing.T, sc *loopScript, cfg Config, setup func(st, dlq *fakeStream)) *loopRig {
	t.Helper()
	st, dlq := newFakeStream(), newFakeStream()
	if setup != nil {
		setup(st, dlq)
	}
	rig := &loopRig{t: t, sc: sc, st: st, dlq: dlq, m: NewMetrics(nil), done: make(chan error, 1)}
	rig.sink = &fakeSink{st: st, dlq: dlq, ackTimeout: 5 * time.Second}
	rig.sink.epoch.Store(1)
	rig.src = &loopSource{t: t, sc: sc, st: st, dlq: dlq, feed: make(chan []cdc.Change, 16), fail: make(chan error, 1)}
	cfg.Metrics = rig.m
	also := cfg.OnDelivered
	cfg.OnDelivered = func(d Delivered) {
		rig.mu.Lock()
		rig.delivered = append(rig.delivered, d)
		rig.mu.Unlock()
		if also != nil {
			also(d)
		}
	}
	if cfg.BackoffInitial == 0 {
		cfg.BackoffInitial = 100 * time.Millisecond
	}
	if cfg.BackoffMax == 0 {
		cfg.BackoffMax = time.Second
	}
	router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
	r := New(cfg, rig.sink, router)
	ctx, cancel := context.WithCancel(context.Background())
	rig.cancel = cancel
	go func() { rig.done <- r.Serve(ctx, rig.src) }()
	// A test that fails half-way leaves nothing running in the bubble.
	t.Cleanup(func() {
		if rig.stopped {
			return
		}
		cancel()
		st.release()
		dlq.release()
		<-rig.done
	})
	return rig
}

// loopCase runs body as subtest name in a synctest bubble, with the relay
// started by startLoop on a script of transactions of sizes.
func loopCase(t *testing.T, name string, sizes []int, cfg Config, setup func(st, dlq *fakeStream), body func(t *testing.T, rig *loopRig, sc *loopScript, ids []string)) {
	t.Run(name, func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			sc := buildScript(sizes...)
			body(t, startLoop(t, sc, cfg, setup), sc, sc.ids)
		})
	})
}

// wantRunning fails the test if the relay has returned: it should not
// have, when (say) acks are outstanding.
func (rig *loopRig) wantRunning(when string) {
	rig.t.Helper()
	select {
	case err := <-rig.done:
		rig.stopped = true
		rig.t.Fatalf("relay returned (%v) with %s", err, when)
	default:
	}
}

// feed hands the relay transactions from..to-1 as one batch.
func (rig *loopRig) feed(from, to int) { rig.src.feed <- rig.sc.batch(from, to) }

// resolve answers a held publish of st, failing the test if it is not held.
func (rig *loopRig) resolve(st *fakeStream, n int, err error) {
	rig.t.Helper()
	if e := st.resolve(n, err); e != nil {
		rig.t.Fatal(e)
	}
}

// waitConfirmed blocks until lsn is confirmed: synctest's clock runs on
// meanwhile, through back-offs and ack timeouts.
func (rig *loopRig) waitConfirmed(lsn cdc.LSN) {
	rig.t.Helper()
	select {
	case <-rig.src.reached(lsn):
	case <-time.After(10 * time.Minute): // fake time: only a publisher stuck for good gets here
		rig.t.Fatalf("%s never confirmed; confirmed %s, published %v", lsn, rig.src.confirmed(), rig.st.published())
	}
}

// waitPublish blocks until st sees publish n: synctest's clock runs on
// meanwhile. st.notify must be set.
func (rig *loopRig) waitPublish(st *fakeStream, n int) {
	rig.t.Helper()
	for {
		select {
		case got := <-st.notify:
			if got >= n {
				return
			}
		case <-time.After(10 * time.Minute): // fake time
			rig.t.Fatalf("publish %d never came; published %v", n, st.published())
		}
	}
}

// stop cancels the relay and waits for Serve.
func (rig *loopRig) stop() {
	rig.t.Helper()
	rig.cancel()
	rig.stopped = true
	if err := <-rig.done; err != nil {
		rig.t.Fatalf("relay: %v", err)
	}
}

// returned waits for Serve to return after a cancel, and wants nil.
func (rig *loopRig) returned() {
	rig.t.Helper()
	rig.stopped = true
	if err := <-rig.done; err != nil {
		rig.t.Fatalf("relay: %v", err)
	}
}

// wantConfirmed checks the confirmed LSN now, on the source and the gauge.
func (rig *loopRig) wantConfirmed(want cdc.LSN, when string) {
	rig.t.Helper()
	if got := rig.src.confirmed(); got != want {
		rig.t.Fatalf("%s: confirmed %s, want %s", when, got, want)
	}
	if got := testutil.ToFloat64(rig.m.ConfirmedLSN); got != float64(want) {
		rig.t.Fatalf("%s: walbox_confirmed_lsn = %v, want %v", when, got, float64(want))
	}
}

// wantPublished checks the event ids of every publish to st, in call order.
func (rig *loopRig) wantPublished(st *fakeStream, want []string, when string) {
	rig.t.Helper()
	if got := st.published(); !slices.Equal(got, want) {
		rig.t.Fatalf("%s: published %v, want %v", when, got, want)
	}
}

// deliveredIDs is the ids reported to OnDelivered, in order.
func (rig *loopRig) deliveredIDs() []string {
	rig.mu.Lock()
	defer rig.mu.Unlock()
	var ids []string
	for _, d := range rig.delivered {
		ids = append(ids, d.ID)
	}
	return ids
}

func (rig *loopRig) wantDelivered(want []string, when string) {
	rig.t.Helper()
	if got := rig.deliveredIDs(); !slices.Equal(got, want) {
		rig.t.Fatalf("%s: delivered %v, want %v", when, got, want)
	}
}

// wantInFlight checks the in-flight gauge.
func (rig *loopRig) wantInFlight(want int, when string) {
	rig.t.Helper()
	if got := testutil.ToFloat64(rig.m.InFlight); got != float64(want) {
		rig.t.Fatalf("%s: walbox_inflight = %v, want %d", when, got, want)
	}
}

// checkStored checks that the stream holds exactly ids, once each and in
// order, and that no publish crossed connections.
func (rig *loopRig) checkStored(st *fakeStream, ids []string) {
	rig.t.Helper()
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := checkStream(st, ids); err != nil {
		rig.t.Fatal(err)
	}
	if len(st.mixed) > 0 {
		rig.t.Fatalf("publishes crossed connections: %v", st.mixed)
	}
}

// publishesAfter returns the publishes of st from number n on (1-based).
func publishesAfter(st *fakeStream, n int) []pubRecord {
	st.mu.Lock()
	defer st.mu.Unlock()
	var out []pubRecord
	for _, p := range st.pubs[n-1:] {
		out = append(out, *p)
	}
	return out
}

// A transient failure with the window full: nothing more is published
// until every in-flight publish has resolved, then the publisher backs off
// and resends from the first failed event, in order; what the stream
// already stored is skipped by the resume check (or, when the stream
// cannot be read back, dropped by the stream as a duplicate).
func TestLoopTransientFailureWithTheWindowFull(t *testing.T) {
	for _, tc := range []struct {
		name       string
		strict     bool
		tailBroken bool
	}{
		{name: "resume check skips the stored one"},
		{name: "resume check skips the stored one, strict order", strict: true},
		{name: "stream drops the stored one as a duplicate", tailBroken: true},
	} {
		loopCase(t, tc.name, []int{1, 2, 2, 3}, Config{Window: 4, StrictOrder: tc.strict}, func(st, _ *fakeStream) {
			st.hold = true
			// The connection drops after e01 is stored: e02 on never
			// arrive, and e01's ack is lost with them.
			st.lose[3], st.lose[4], st.lose[5] = true, true, true
		}, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
			// e00 | e01 e02 | e03 e04 | e05 e06 e07
			rig.feed(0, 4)
			synctest.Wait()
			rig.wantPublished(rig.st, ids[:4], "window full")
			rig.wantInFlight(4, "window full")

			// A failure behind the head changes nothing yet: acks count in order.
			rig.resolve(rig.st, 3, errNoResponders)
			synctest.Wait()
			rig.wantConfirmed(0, "e02 failed, e00 not acked")
			rig.wantPublished(rig.st, ids[:4], "e02 failed, e00 not acked")
			rig.wantInFlight(4, "e02 failed, e00 not acked")

			// e00's ack makes room for one more.
			rig.resolve(rig.st, 1, nil)
			synctest.Wait()
			rig.wantConfirmed(sc.ends[0], "e00 acked")
			rig.wantPublished(rig.st, ids[:5], "e00 acked")

			rig.resolve(rig.st, 2, errAckTimeout)
			synctest.Wait()
			// Failing: the window has room for two, yet nothing goes out
			// while e03 and e04 are in flight.
			rig.wantPublished(rig.st, ids[:5], "failing, e03 and e04 in flight")
			rig.wantInFlight(2, "failing, e03 and e04 in flight")
			if got := testutil.ToFloat64(rig.m.Backoffs); got != 1 {
				t.Fatalf("walbox_publish_backoffs_total = %v, want 1", got)
			}

			if tc.tailBroken {
				rig.st.mu.Lock()
				rig.sink.tailFails = rig.sink.tailReads + 1 // the read after the back-off fails
				rig.st.mu.Unlock()
			}
			rig.resolve(rig.st, 5, errAckTimeout)
			rig.resolve(rig.st, 4, errAckTimeout)
			synctest.Wait()
			settled := time.Now()
			rig.wantPublished(rig.st, ids[:5], "window settled, backing off")
			rig.wantInFlight(0, "window settled")
			rig.wantConfirmed(sc.ends[0], "window settled")

			rig.st.release() // from now on the stream acks at once
			rig.waitConfirmed(sc.last())
			rig.stop()

			resent := ids[2:]
			if tc.tailBroken {
				resent = ids[1:]
			}
			rig.wantPublished(rig.st, append(slices.Clone(ids[:5]), resent...), "after the resend")
			for _, p := range publishesAfter(rig.st, 6) {
				if d := p.at.Sub(settled); d < 80*time.Millisecond {
					t.Fatalf("publish %d (%s) went out %v after the window settled, before the back-off (100 ms, jitter 20%%)", p.n, p.id, d)
				}
			}
			rig.checkStored(rig.st, ids)
			rig.wantDelivered(ids, "end")
			rig.wantConfirmed(sc.last(), "end")
			wantSkipped := 1.0
			if tc.tailBroken {
				wantSkipped = 0
			}
			for name, c := range map[string]struct{ got, want float64 }{
				"walbox_published_total{ORDERS}":         {testutil.ToFloat64(rig.m.Published.WithLabelValues("ORDERS", "")), 8},
				"walbox_publish_errors_total{transient}": {testutil.ToFloat64(rig.m.PublishErrors.WithLabelValues("transient")), 4},
				"walbox_publish_backoffs_total":          {testutil.ToFloat64(rig.m.Backoffs), 1},
				"walbox_resume_skipped_total":            {testutil.ToFloat64(rig.m.Skipped), wantSkipped},
				"walbox_inflight":                        {testutil.ToFloat64(rig.m.InFlight), 0},
			} {
				if c.got != c.want {
					t.Errorf("%s = %v, want %v", name, c.got, c.want)
				}
			}
		})
	}
}

// A connection change under in-flight publishes: the old connection may
// have lost some of them, so the next event must not go out on the new one
// (it would be stored ahead of the lost ones). The publisher stops, lets the
// old window resolve, backs off and resends in order on the new connection.
func TestLoopConnectionChangeMidWindow(t *testing.T) {
	for _, tc := range []struct {
		name   string
		during bool // the reconnect happens inside the publish of e01
	}{
		{name: "between publishes"},
		{name: "during a publish", during: true},
	} {
		loopCase(t, tc.name, []int{2, 2, 2}, Config{Window: 8}, func(st, _ *fakeStream) {
			st.hold = true
			st.lose[2] = true // e01 dies with the old connection
			if tc.during {
				st.reconnectDuring[2] = true
			}
		}, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
			if tc.during {
				rig.feed(0, 2)
			} else {
				rig.feed(0, 1)
				synctest.Wait()
				rig.wantPublished(rig.st, ids[:2], "first transaction")
				rig.sink.epoch.Add(1) // reconnected: e01 is lost, the new connection is fine
				rig.feed(1, 2)
			}
			synctest.Wait()
			rig.wantPublished(rig.st, ids[:2], "after the reconnect")
			if got := testutil.ToFloat64(rig.m.PublishErrors.WithLabelValues("transient")); got != 1 {
				t.Fatalf("walbox_publish_errors_total{transient} = %v, want 1 (the connection change)", got)
			}
			rig.wantInFlight(2, "after the reconnect")

			rig.resolve(rig.st, 1, nil)
			rig.resolve(rig.st, 2, errAckTimeout)
			synctest.Wait()
			rig.wantConfirmed(0, "e01 lost") // e00 alone does not finish its transaction
			rig.wantPublished(rig.st, ids[:2], "backing off")

			rig.st.release()
			rig.feed(2, 3)
			rig.waitConfirmed(sc.last())
			rig.stop()

			rig.wantPublished(rig.st, append(slices.Clone(ids[:2]), ids[1:]...), "end")
			for _, p := range publishesAfter(rig.st, 3) {
				if p.epoch != 2 {
					t.Fatalf("resend %d (%s) went out on connection %d, want 2", p.n, p.id, p.epoch)
				}
			}
			rig.checkStored(rig.st, ids)
			rig.wantDelivered(ids, "end")
			if got := testutil.ToFloat64(rig.m.Backoffs); got != 1 {
				t.Fatalf("walbox_publish_backoffs_total = %v, want 1", got)
			}
		})
	}
}

// A dead letter's ack comes after the acks of the events published behind
// it: a publish refused for good is dead-lettered at the end of the window.
// Its successors are acked first, and the confirmed LSN waits at the
// transaction before it until the dead-letter stream has stored it.
func TestLoopLateAckAfterADeadLetter(t *testing.T) {
	e02 := buildScript(2, 2, 2).ids[2] // the script each case runs
	for _, tc := range []struct {
		name     string
		shutdown bool // the dead letter's ack arrives during the shutdown drain
		refused  bool // the dead-letter stream refuses it once first
	}{
		{name: "running"},
		{name: "during shutdown", shutdown: true},
		{name: "refused by the dead-letter stream first", refused: true},
	} {
		loopCase(t, tc.name, []int{2, 2, 2}, Config{Window: 8}, func(st, dlq *fakeStream) {
			st.hold, dlq.hold = true, true
			st.reject[e02] = 10054 // too large for the stream, say
			if tc.refused {
				dlq.lose[1] = true // refused: not stored
				dlq.notify = make(chan int, 4)
			}
		}, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
			// e00 e01 | e02 e03 | e04 e05
			rig.feed(0, 3)
			synctest.Wait()
			rig.wantPublished(rig.st, ids, "all published")

			rig.resolve(rig.st, 1, nil)
			rig.resolve(rig.st, 2, nil)
			synctest.Wait()
			rig.wantConfirmed(sc.ends[0], "e00 e01 acked")
			// e02's refusal is its own only if a publish behind it is
			// stored: the verdict waits for e03.
			rig.wantPublished(rig.dlq, nil, "e02 refused, e03 not acked")
			if got := testutil.ToFloat64(rig.m.PublishErrors.WithLabelValues("permanent")); got != 1 {
				t.Fatalf("walbox_publish_errors_total{permanent} = %v, want 1", got)
			}
			rig.resolve(rig.st, 4, nil)
			synctest.Wait()
			rig.wantPublished(rig.dlq, ids[2:3], "e02 refused, e03 stored behind it")

			for n := 5; n <= 6; n++ {
				rig.resolve(rig.st, n, nil)
			}
			synctest.Wait()
			rig.wantDelivered([]string{ids[0], ids[1], ids[3], ids[4], ids[5]}, "successors acked")
			rig.wantConfirmed(sc.ends[0], "successors acked, the dead letter not")
			rig.wantInFlight(1, "the dead letter in flight")
			if got := testutil.ToFloat64(rig.m.DeadLettered.WithLabelValues("")); got != 0 {
				t.Fatalf("walbox_dead_lettered_total = %v before the dead-letter stream acked", got)
			}

			if tc.shutdown {
				rig.cancel()
				synctest.Wait()
				rig.wantRunning("the dead letter in flight")
			}
			dlqAcked := 1
			if tc.refused {
				// A dead letter is the event's only record: a refusal of it
				// is waited out and resent, never confirmed.
				rig.resolve(rig.dlq, 1, &refusedError{code: 10077})
				synctest.Wait()
				rig.wantConfirmed(sc.ends[0], "the dead letter refused")
				dlqAcked = 2
				rig.wantPublished(rig.dlq, ids[2:3], "the dead letter refused, backing off")
				rig.waitPublish(rig.dlq, 2)
				synctest.Wait()
				rig.wantPublished(rig.dlq, []string{ids[2], ids[2]}, "the dead letter resent")
				rig.wantConfirmed(sc.ends[0], "the dead letter resent")
			}
			rig.resolve(rig.dlq, dlqAcked, nil)
			if tc.shutdown {
				rig.returned()
			} else {
				rig.waitConfirmed(sc.last())
				rig.stop()
			}
			rig.wantConfirmed(sc.last(), "the dead letter acked")
			rig.wantDelivered([]string{ids[0], ids[1], ids[3], ids[4], ids[5], ids[2]}, "end")
			rig.mu.Lock()
			d := rig.delivered[5]
			rig.mu.Unlock()
			if !d.DeadLetter || !strings.Contains(d.Reason, "code 10054") {
				t.Fatalf("delivered %+v, want e02 dead-lettered for the refusal", d)
			}
			rig.checkStored(rig.st, []string{ids[0], ids[1], ids[3], ids[4], ids[5]})
			rig.checkStored(rig.dlq, ids[2:3])
			if got := testutil.ToFloat64(rig.m.DeadLettered.WithLabelValues("")); got != 1 {
				t.Fatalf("walbox_dead_lettered_total = %v, want 1", got)
			}
			if got := testutil.ToFloat64(rig.m.Published.WithLabelValues("ORDERS", "")); got != 5 {
				t.Fatalf("walbox_published_total{ORDERS} = %v, want 5", got)
			}
		})
	}
}

// Acks resolved out of publish order are taken in publish order: nothing is
// delivered or confirmed past the oldest unresolved publish. A failure
// resolved before earlier acks takes effect only when its turn comes.
func TestLoopOutOfOrderAcks(t *testing.T) {
	loopCase(t, "all acked", []int{1, 2, 1, 2}, Config{Window: 8}, func(st, _ *fakeStream) { st.hold = true }, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
		// e00 | e01 e02 | e03 | e04 e05
		rig.feed(0, 4)
		synctest.Wait()
		rig.wantPublished(rig.st, ids, "all published")
		for _, n := range []int{6, 4, 5, 3} {
			rig.resolve(rig.st, n, nil)
			synctest.Wait()
			rig.wantConfirmed(0, fmt.Sprintf("publish %d acked, e00 not", n))
			rig.wantDelivered(nil, fmt.Sprintf("publish %d acked, e00 not", n))
			rig.wantInFlight(6, fmt.Sprintf("publish %d acked, e00 not", n))
		}
		rig.resolve(rig.st, 1, nil)
		synctest.Wait()
		rig.wantConfirmed(sc.ends[0], "e00 acked, e01 not")
		rig.wantDelivered(ids[:1], "e00 acked, e01 not")
		rig.resolve(rig.st, 2, nil)
		rig.waitConfirmed(sc.last())
		rig.wantDelivered(ids, "all acked")
		rig.wantInFlight(0, "all acked")
		rig.stop()
		rig.mu.Lock()
		for i, d := range rig.delivered {
			if d.Stream != "ORDERS" || d.Seq != uint64(i+1) {
				t.Errorf("%s delivered at %s/%d, want ORDERS/%d", d.ID, d.Stream, d.Seq, i+1)
			}
		}
		rig.mu.Unlock()
		rig.checkStored(rig.st, ids)
	})
	loopCase(t, "a failure resolved before earlier acks", []int{1, 2, 1, 2}, Config{Window: 8}, func(st, _ *fakeStream) {
		st.hold = true
		st.lose[4], st.lose[5], st.lose[6] = true, true, true // e03 on are never stored
	}, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
		// e00 | e01 e02 | e03 | e04 e05
		rig.feed(0, 4)
		synctest.Wait()
		for _, n := range []int{6, 4, 2, 5, 3} {
			err := errAckTimeout
			if n <= 3 {
				err = nil
			}
			rig.resolve(rig.st, n, err)
			synctest.Wait()
			rig.wantConfirmed(0, fmt.Sprintf("publish %d resolved, e00 not", n))
			if got := testutil.ToFloat64(rig.m.PublishErrors.WithLabelValues("transient")); got != 0 {
				t.Fatalf("a failure behind an unresolved publish was taken: walbox_publish_errors_total{transient} = %v", got)
			}
		}
		rig.resolve(rig.st, 1, nil)
		synctest.Wait()
		rig.wantConfirmed(sc.ends[1], "e00 to e02 acked, e03 failed")
		rig.wantDelivered(ids[:3], "e00 to e02 acked, e03 failed")
		rig.wantPublished(rig.st, ids, "backing off")
		rig.st.release()
		rig.waitConfirmed(sc.last())
		rig.stop()
		rig.wantPublished(rig.st, append(slices.Clone(ids), ids[3:]...), "end")
		rig.checkStored(rig.st, ids)
		rig.wantDelivered(ids, "end")
	})
}

// Shutdown stops reading and publishing, waits for the in-flight acks,
// confirms what they finish (and the bookkeeping already handed over that
// follows them), and confirms nothing past the first publish that failed or
// never resolved.
func TestLoopDrainOnShutdown(t *testing.T) {
	loopCase(t, "acks during the drain are confirmed", []int{2, 2, 2, 2}, Config{Window: 4}, func(st, _ *fakeStream) { st.hold = true }, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
		// e00 e01 | e02 e03 | e04 e05 | e06 e07, the window holds four
		rig.feed(0, 4)
		synctest.Wait()
		rig.wantPublished(rig.st, ids[:4], "window full")
		rig.wantConfirmed(0, "window full")

		rig.cancel()
		synctest.Wait()
		rig.wantRunning("four acks outstanding")
		for _, n := range []int{4, 2, 3, 1} {
			rig.resolve(rig.st, n, nil)
		}
		rig.returned()
		// The commit of e02 e03 was still in the batch behind the full
		// window: the drain takes it once its events are acked.
		rig.wantConfirmed(sc.ends[1], "drained")
		rig.wantPublished(rig.st, ids[:4], "drained: nothing new is published")
		rig.wantDelivered(ids[:4], "drained")
		rig.wantInFlight(0, "drained")
		rig.checkStored(rig.st, ids[:4])
	})
	loopCase(t, "bookkeeping handed over is confirmed, events are not", []int{2, 2, 0, 1}, Config{Window: 4}, func(st, _ *fakeStream) { st.hold = true }, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
		// e00 e01 | e02 e03 | (empty) | e04
		rig.feed(0, 2)
		keepalive := sc.ends[2] + 0x8 // WAL end past the empty transaction
		rig.src.feed <- append(sc.batch(2, 3), cdc.Change{Kind: cdc.KindWALEnd, LSN: keepalive})
		rig.feed(3, 4)
		synctest.Wait()
		rig.wantPublished(rig.st, ids[:4], "window full")

		rig.cancel()
		synctest.Wait()
		rig.resolve(rig.st, 1, nil)
		rig.resolve(rig.st, 2, nil)
		rig.resolve(rig.st, 3, nil)
		synctest.Wait()
		rig.wantConfirmed(sc.ends[0], "e00 e01 acked in the drain")
		rig.resolve(rig.st, 4, nil)
		rig.returned()
		// The empty transaction was read in the drain and is confirmed
		// with the acks; the keepalive came while events were in flight,
		// and e04 was never published.
		rig.wantConfirmed(sc.ends[2], "drained")
		rig.wantPublished(rig.st, ids[:4], "drained")
		rig.wantDelivered(ids[:4], "drained")
	})
	loopCase(t, "a failed ack stops the confirmation", []int{1, 2, 1}, Config{Window: 4}, func(st, _ *fakeStream) { st.hold = true }, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
		// e00 | e01 e02 | e03
		rig.feed(0, 3)
		synctest.Wait()
		rig.cancel()
		synctest.Wait()
		rig.resolve(rig.st, 4, nil)
		rig.resolve(rig.st, 3, errAckTimeout)
		rig.resolve(rig.st, 2, nil)
		rig.resolve(rig.st, 1, nil)
		rig.returned()
		// e01 is acked but its transaction is not (e02 failed); e03 is
		// stored and acked behind the failure: it is left to the next
		// start, whose resume check skips it.
		rig.wantConfirmed(sc.ends[0], "drained")
		rig.wantDelivered(ids[:2], "drained")
		rig.wantPublished(rig.st, ids, "drained: nothing is resent")
		if got := testutil.ToFloat64(rig.m.Published.WithLabelValues("ORDERS", "")); got != 2 {
			t.Fatalf("walbox_published_total{ORDERS} = %v, want 2", got)
		}
	})
	loopCase(t, "the source failing drains too", []int{1, 2}, Config{Window: 4}, func(st, _ *fakeStream) { st.hold = true }, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
		// e00 | e01 e02
		rig.feed(0, 2)
		synctest.Wait()
		failure := errors.New("replication connection lost for good")
		rig.src.fail <- failure
		synctest.Wait()
		for n := 3; n >= 1; n-- {
			rig.resolve(rig.st, n, nil)
		}
		rig.stopped = true
		if err := <-rig.done; !errors.Is(err, failure) {
			t.Fatalf("Serve returned %v, want the source's error", err)
		}
		rig.wantConfirmed(sc.ends[1], "drained")
		rig.wantDelivered(ids, "drained")
	})
	loopCase(t, "acks that never come are given up after the drain timeout", []int{1, 2, 1}, Config{Window: 4, DrainTimeout: 3 * time.Second}, func(st, _ *fakeStream) { st.hold = true }, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
		// e00 | e01 e02 | e03
		rig.feed(0, 3)
		synctest.Wait()
		rig.resolve(rig.st, 1, nil)
		rig.resolve(rig.st, 3, nil)
		synctest.Wait()
		start := time.Now()
		rig.cancel()
		rig.returned()
		if d := time.Since(start); d != 3*time.Second {
			t.Fatalf("the drain gave up after %v, want the drain timeout, 3s", d)
		}
		rig.wantConfirmed(sc.ends[0], "gave up")
		rig.wantDelivered(ids[:1], "gave up")
	})
}

// A replication reset (the source reconnected and replays from the slot's
// confirmed position) waits for the window to settle, and with strict order
// nothing of the replay is published until the stream's state has been read
// back: a failed read backs off instead of publishing unguarded.
func TestLoopResetWaitsForTheWindowAndTheStreamState(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// e00 e01 | e02 | e03; the session breaks inside the second
		// transaction, which the new session sends again.
		sc := buildScript(2, 1, 1)
		ids := sc.ids
		rig := startLoop(t, sc, Config{Window: 8, StrictOrder: true}, func(st, _ *fakeStream) { st.hold = true })
		t1 := sc.txns[1]
		b := append(sc.batch(0, 1), t1[:len(t1)-1]...)
		b = append(b, cdc.Change{Kind: cdc.KindReset})
		rig.src.feed <- append(b, sc.batch(1, 3)...)
		synctest.Wait()
		rig.wantPublished(rig.st, ids[:3], "before the reset")
		if n := rig.src.resetsTaken(); n != 0 {
			t.Fatalf("reset taken %d times with e00 to e02 in flight", n)
		}

		rig.st.mu.Lock()
		rig.sink.tailFails = rig.sink.tailReads + 1 // the read-back after the reset fails
		rig.st.mu.Unlock()
		for n := 1; n <= 3; n++ {
			rig.resolve(rig.st, n, nil)
		}
		synctest.Wait()
		if n := rig.src.resetsTaken(); n != 1 {
			t.Fatalf("resets taken: %d, want 1", n)
		}
		rig.wantConfirmed(sc.ends[0], "reset taken") // e02's first transaction never committed
		rig.wantPublished(rig.st, ids[:3], "stream state unread")

		rig.st.release()
		rig.waitConfirmed(sc.last())
		rig.stop()
		// The replayed e02 is found in the stream and skipped; e03 goes out
		// expecting the stream's real last sequence.
		rig.wantPublished(rig.st, ids, "end")
		rig.checkStored(rig.st, ids)
		rig.st.mu.Lock()
		for i, h := range rig.st.hdrs {
			if got, want := h.Get(HeaderExpectedLastSeq), fmt.Sprint(i); got != want {
				t.Errorf("%s stored expecting last sequence %q, want %q", rig.st.ids[i], got, want)
			}
		}
		rig.st.mu.Unlock()
		if got := testutil.ToFloat64(rig.m.Skipped); got != 1 {
			t.Fatalf("walbox_resume_skipped_total = %v, want 1", got)
		}
	})
}

// A publish call that fails by itself (the client's connection is closed)
// while earlier publishes are in flight: their acks, even successful ones,
// cannot be taken in order past the failure, so they join the resend; after
// the back-off the resume check finds them stored and only the failed event
// and its successors go out again.
func TestLoopPublishCallFailsWithAcksInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// e00 e01 | e02 e03 | e04 e05
		sc := buildScript(2, 2, 2)
		ids := sc.ids
		rig := startLoop(t, sc, Config{Window: 4}, func(st, _ *fakeStream) {
			st.hold = true
			st.callFails[6] = errNoResponders // the call for e05, once e00 and e01 made room
		})
		rig.feed(0, 3)
		synctest.Wait()
		rig.wantPublished(rig.st, ids[:4], "window full")
		rig.resolve(rig.st, 1, nil)
		rig.resolve(rig.st, 2, nil)
		synctest.Wait()
		// e04 went out (publish 5); e05's call (publish 6) failed: failing.
		rig.wantPublished(rig.st, ids[:6], "the call for e05 failed")
		rig.wantConfirmed(sc.ends[0], "the call for e05 failed")
		rig.wantInFlight(3, "the call for e05 failed")
		for _, n := range []int{5, 3, 4} {
			rig.resolve(rig.st, n, nil)
		}
		synctest.Wait()
		// Stored and acked, but behind the failure in the checkpoint's
		// eyes they are resent, not delivered: nothing moves yet.
		rig.wantConfirmed(sc.ends[0], "acked while failing")
		rig.wantDelivered(ids[:2], "acked while failing")
		rig.wantPublished(rig.st, ids[:6], "backing off")

		rig.st.release()
		rig.waitConfirmed(sc.last())
		rig.stop()
		rig.wantPublished(rig.st, append(slices.Clone(ids), ids[5]), "end")
		rig.checkStored(rig.st, ids)
		rig.wantDelivered(ids, "end")
		for name, c := range map[string]struct{ got, want float64 }{
			"walbox_resume_skipped_total":            {testutil.ToFloat64(rig.m.Skipped), 3},
			"walbox_publish_errors_total{transient}": {testutil.ToFloat64(rig.m.PublishErrors.WithLabelValues("transient")), 4},
			"walbox_published_total{ORDERS}":         {testutil.ToFloat64(rig.m.Published.WithLabelValues("ORDERS", "")), 6},
		} {
			if c.got != c.want {
				t.Errorf("%s = %v, want %v", name, c.got, c.want)
			}
		}
	})
}

// Commit → ack is split at the server's send time: the part before it is
// PostgreSQL's (its walsender, its WAL flush), the part after walbox's and
// JetStream's. An event without a send time (backfilled) is in neither.
func TestLoopSplitsCommitToAckAtTheServersSend(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sc := buildScript(1, 1, 1)
		commit := time.Now().Add(-50 * time.Millisecond)
		for i, txn := range sc.txns {
			ev := &txn[1].Event
			ev.CommitTime = commit
			if i < 2 {
				ev.SentAfter = 30 * time.Millisecond
			}
		}
		rig := startLoop(t, sc, Config{Window: 8}, func(st, _ *fakeStream) { st.hold = true })
		rig.feed(0, 3)
		synctest.Wait()
		time.Sleep(20 * time.Millisecond) // the ack comes 70 ms after the commit
		for n := 1; n <= 3; n++ {
			rig.resolve(rig.st, n, nil)
		}
		rig.waitConfirmed(sc.last())
		rig.stop()
		for _, h := range []struct {
			name       string
			m          prometheus.Histogram
			count      uint64
			sumSeconds float64
		}{
			{"walbox_commit_to_ack_seconds", rig.m.CommitToAck, 3, 3 * 0.070},
			{"walbox_commit_to_sent_seconds", rig.m.CommitToSent, 2, 2 * 0.030},
			{"walbox_sent_to_ack_seconds", rig.m.SentToAck, 2, 2 * 0.040},
		} {
			var m dto.Metric
			if err := h.m.Write(&m); err != nil {
				t.Fatal(err)
			}
			got := m.GetHistogram()
			if got.GetSampleCount() != h.count || math.Abs(got.GetSampleSum()-h.sumSeconds) > 1e-9 {
				t.Errorf("%s: %d samples summing to %.6fs, want %d summing to %.6fs", h.name, got.GetSampleCount(), got.GetSampleSum(), h.count, h.sumSeconds)
			}
		}
	})
}

// TestLoopAliveTicksWhileTheLoopTurns: Alive, the liveness probe's
// heartbeat, is called every second by the loop itself, idle or not, and
// not at all while the loop is blocked (here in OnDelivered, which must
// not block: the wedge a liveness probe exists for).
func TestLoopAliveTicksWhileTheLoopTurns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ticks atomic.Int64
		var blocking atomic.Bool
		gate := make(chan struct{})
		cfg := Config{Window: 4,
			Alive: func() { ticks.Add(1) },
			OnDelivered: func(Delivered) {
				if blocking.Load() {
					<-gate
				}
			}}
		rig := startLoop(t, buildScript(1, 1), cfg, nil)
		time.Sleep(10*time.Second + time.Millisecond)
		synctest.Wait()
		if n := ticks.Load(); n != 11 { // once at the start, then every second
			t.Fatalf("idle for 10 s: %d heartbeats, want 11", n)
		}
		blocking.Store(true)
		rig.feed(0, 1)
		synctest.Wait() // the loop is blocked in OnDelivered now
		rig.wantDelivered(rig.sc.ids[:1], "blocked in OnDelivered")
		before := ticks.Load()
		time.Sleep(time.Minute)
		synctest.Wait()
		if n := ticks.Load(); n != before {
			t.Fatalf("%d heartbeats while the loop was blocked, want none", n-before)
		}
		close(gate)
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if n := ticks.Load(); n <= before {
			t.Fatal("no heartbeat after the loop was unblocked")
		}
		rig.stop()
	})
}

// TestLoopTellsATxnSinkWhereTransactionsEnd: a TxnSink gets each event with
// its transaction's number, hears that a unit may end only between
// transactions (never inside one), hears it abandoned when a publish fails,
// and a transaction whose unit the broker refused (ErrTxnRefused) is resent
// event by event (Txn 0) and confirmed.
func TestLoopTellsATxnSinkWhereTransactionsEnd(t *testing.T) {
	refused := fmt.Errorf("%w: by the test", ErrTxnRefused)
	loopCase(t, "txn sink", []int{3, 2, 4}, Config{Window: 16}, func(st, _ *fakeStream) {
		st.callFails = map[int]error{7: refused} // e06, the third transaction's second event
		st.txns = &txnLog{}
	}, func(t *testing.T, rig *loopRig, sc *loopScript, ids []string) {
		log := rig.st.txns
		rig.feed(0, 3)
		rig.waitConfirmed(sc.last())
		rig.checkStored(rig.st, ids)

		txnOf := map[string]uint64{}
		var resent []pubRecord
		for _, p := range publishesAfter(rig.st, 1) {
			if _, seen := txnOf[p.id]; seen {
				resent = append(resent, p)
				continue
			}
			txnOf[p.id] = p.txn
		}
		for i, want := range []int{0, 0, 0, 1, 1, 2, 2, 2, 2} {
			if got, first := txnOf[ids[i]], txnOf[ids[[]int{0, 3, 5}[want]]]; got == 0 || got != first {
				t.Fatalf("%s published with Txn %d, its transaction's first with %d", ids[i], got, first)
			}
		}
		if txnOf[ids[0]] == txnOf[ids[3]] || txnOf[ids[3]] == txnOf[ids[5]] {
			t.Fatalf("two transactions share a Txn: %v", txnOf)
		}
		for _, p := range resent {
			if p.txn != 0 {
				t.Fatalf("%s resent with Txn %d after its transaction was refused, want 0 (on its own)", p.id, p.txn)
			}
		}
		if len(resent) == 0 {
			t.Fatal("nothing resent after the refusal")
		}
		var abandoned bool
		for _, e := range log.list() {
			switch {
			case e.end == TxnAbandon:
				abandoned = true
			case e.last != ids[2] && e.last != ids[4] && e.last != ids[8]:
				t.Fatalf("a unit may end after %s, inside its transaction: %+v", e.last, log.list())
			}
		}
		if !abandoned {
			t.Fatalf("the failed publish did not abandon the open unit: %+v", log.list())
		}
	})
}
