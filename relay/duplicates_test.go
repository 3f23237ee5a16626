package relay

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/walbox/walbox/cdc"
)

// backfillScript is one backfilled transaction (no WAL positions, as
// cdc's backfill hands rows over) of n events "b<i>", ending at end.
func backfillScript(n int, end cdc.LSN) (*scriptSource, []string) {
	s := &scriptSource{reached: make(chan struct{}), target: end}
	var ids []string
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s.changes = append(s.changes, cdc.Change{Kind: cdc.KindBegin})
	for i := range n {
		id := fmt.Sprintf("b%04d", i)
		ids = append(ids, id)
		s.changes = append(s.changes, cdc.Change{Kind: cdc.KindEvent, Event: cdc.Event{
			Pos: cdc.Position{CommitLSN: 0, Index: uint32(i)}, CommitTime: t0,
			ID: id, Topic: "orders.created", Payload: []byte(`{}`), PayloadIsJSON: true,
		}})
	}
	s.changes = append(s.changes, cdc.Change{Kind: cdc.KindCommit, LSN: end})
	return s, ids
}

// Issue 33, item 2: a promoted standby's backfill resends rows that the
// stream already holds, older than the read-back tail. JetStream drops each
// as a duplicate without growing the stream; a replica-1 stream checks the
// expected last sequence before the duplicate, a replicated one after. On
// both, a duplicate ack and the refusals it causes must leave the relay
// publishing, with no back-off and nothing out of order. Before the fix a
// replica-1 stream cost a back-off round per duplicate (every later publish
// expected one more message than the stream held): 40 back-offs here, and
// with thousands of duplicates and the default 1 s back-off, hours.
func TestStrictOrderDuplicatesOlderThanTheTailKeepPublishing(t *testing.T) {
	for _, r1 := range []bool{true, false} {
		t.Run("expectation checked first="+strconv.FormatBool(r1), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				st := newFakeStream()
				st.expectFirst = r1
				src, ids := backfillScript(80, 0x5000)
				// The stream holds every other one of the first 80 rows
				// (published before the failover, their marks lost), then
				// 100 newer events of the old primary: the tail read back
				// (2 x window = 32) holds none of the rows.
				var stored []string
				for i := 0; i < 80; i += 2 {
					st.store(ids[i], Header{HeaderMsgID: {ids[i]}, HeaderSource: {"app/walbox"}})
					stored = append(stored, ids[i])
				}
				for i := range 100 {
					st.store(fmt.Sprintf("old-%d", i), Header{HeaderSource: {"app/walbox"}, HeaderCommitLSN: {"0/9000"}, HeaderIndex: {strconv.Itoa(i)}})
				}
				m := NewMetrics(nil)
				sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
				router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
				r := New(Config{Window: 16, StrictOrder: true, Metrics: m, BackoffInitial: time.Second, BackoffMax: time.Minute}, sink, router)
				start := time.Now()
				serveUntilReached(t, r, src)
				took := time.Since(start)

				var want []string
				want = append(want, stored...)
				for i := range 100 {
					want = append(want, fmt.Sprintf("old-%d", i))
				}
				for i := 1; i < 80; i += 2 {
					want = append(want, ids[i])
				}
				if err := checkStream(st, want); err != nil {
					t.Fatal(err)
				}
				if got := testutil.ToFloat64(m.Backoffs); got != 0 {
					t.Fatalf("%v back-offs (%s of fake time) for 40 duplicates: a duplicate must not stop publishing", got, took)
				}
				if got := testutil.ToFloat64(m.OtherWriters.WithLabelValues("ORDERS")); got != 0 {
					t.Fatalf("duplicates taken for another writer (%v)", got)
				}
				// Each row goes out once or, behind a duplicate, at most
				// twice: not a window of refusals per duplicate.
				if n := len(st.pubs); n > 2*80 {
					t.Fatalf("%d publishes for 80 rows", n)
				}
			})
		})
	}
}

// A duplicate nobody could foresee (the stream holds the event without
// walbox's headers) in the middle of a full window: on a replica-1 stream
// every publish behind it is refused. The relay resends them at once, with
// the right expectations, and backs off not at all.
func TestStrictOrderUnforeseenDuplicateMidWindowOnReplicaOne(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		st.expectFirst = true
		src, ids := newScript(8, 4)
		st.store(ids[2], Header{HeaderMsgID: {ids[2]}})
		m := NewMetrics(nil)
		sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
		r := New(Config{Window: 16, StrictOrder: true, Metrics: m, BackoffInitial: time.Second}, sink, router)
		serveUntilReached(t, r, src)
		want := []string{ids[2]}
		for i, id := range ids {
			if i != 2 {
				want = append(want, id)
			}
		}
		if err := checkStream(st, want); err != nil {
			t.Fatal(err)
		}
		if got := testutil.ToFloat64(m.Backoffs); got != 0 {
			t.Fatalf("%v back-offs for one duplicate", got)
		}
	})
}

// Issue 33, item 6: a quiet relay beside a busy writer. The last sequence
// is read before the tail is scanned; the other writer stores in between,
// so the first publish after every read-back is refused, and nothing of
// this relay's is stored behind a refusal for the old rule (a stored
// message behind a refused one) to see the other writer. The refusal and a
// foreign message newer than the refused expectation in the tail prove it.
// Before the fix: no event stored in 2 hours of fake time (refused on
// every round).
func TestStrictOrderFindsABusyWriterThatStoresDuringTheReadBack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		src, ids := newScript(1, 1) // quiet: the window holds one event
		m := NewMetrics(nil)
		sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second, busyWriter: true}
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
		r := New(Config{Window: 16, StrictOrder: true, Metrics: m, BackoffInitial: time.Second, BackoffMax: time.Minute}, sink, router)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Serve(ctx, src) }()
		select {
		case <-src.reached:
		case <-time.After(2 * time.Hour):
			st.mu.Lock()
			t.Errorf("nothing confirmed in 2 hours of fake time: %d publishes, %d messages of the other writer", st.publishes, len(st.ids))
			st.mu.Unlock()
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if got := testutil.ToFloat64(m.OtherWriters.WithLabelValues("ORDERS")); got != 1 {
			t.Fatalf("walbox_strict_order_other_writer_total = %v, want 1", got)
		}
		wantStoredOnce(t, st, ids)
	})
}
