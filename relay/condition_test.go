package relay

import (
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Issue 33, item 5: when every publish of a window fails with the same
// code, it is the server's condition, not the messages': nothing is
// dead-lettered for it. Here the stream refuses 32 publishes in a row (two
// rounds of a window of 16) with one code its table calls permanent (say
// its max_msg_size was set below every message), then takes them again.
// Before the fix the window's events went to the dead-letter stream. (A
// condition that ends between two publishes of one window still looks like
// the first one's own fault: the one stored behind it is the evidence
// walbox has.)
func TestEveryPublishOfAWindowFailingWithOneCodeDeadLettersNothing(t *testing.T) {
	for _, strict := range []bool{false, true} {
		t.Run("strict="+strconv.FormatBool(strict), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				st, dlq := newFakeStream(), newFakeStream()
				st.refuseNext, st.refuseCode = 32, 10054
				src, ids := newScript(8, 4)
				m := NewMetrics(nil)
				sink := &fakeSink{st: st, dlq: dlq, ackTimeout: 5 * time.Second}
				router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
				r := New(Config{Window: 16, StrictOrder: strict, Metrics: m, BackoffInitial: 100 * time.Millisecond}, sink, router)
				serveUntilReached(t, r, src)
				if len(dlq.ids) != 0 {
					t.Fatalf("%d events dead-lettered for the server's condition: %v", len(dlq.ids), dlq.ids)
				}
				if err := checkStream(st, ids); err != nil {
					t.Fatal(err)
				}
				if got := testutil.ToFloat64(m.Backoffs); got == 0 {
					t.Fatal("no back-off while the server refused everything")
				}
			})
		})
	}
}

// The same code on two events with healthy ones stored behind them in the
// window is the events' own: both are dead-lettered, the rest stored in
// order.
func TestOneCodeOnSomeEventsWithOthersStoredDeadLettersThem(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st, dlq := newFakeStream(), newFakeStream()
		src, ids := newScript(4, 3)
		st.reject[ids[2]], st.reject[ids[3]] = 10054, 10054
		dlq2 := runPublisherDLQ(t, st, dlq, src, false)
		var want []string
		for i, id := range ids {
			if i != 2 && i != 3 {
				want = append(want, id)
			}
		}
		if err := checkStream(st, want); err != nil {
			t.Fatal(err)
		}
		if len(dlq2.ids) != 2 || dlq2.ids[0] != ids[2] || dlq2.ids[1] != ids[3] {
			t.Fatalf("dead letters %v, want [%s %s]", dlq2.ids, ids[2], ids[3])
		}
	})
}
