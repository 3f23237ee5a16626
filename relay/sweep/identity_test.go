package sweep_test

import (
	"context"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/sweep"
)

// tableReader reads back a fixed list of stored messages (table, id).
type tableReader struct{ msgs [][2]string }

func (r tableReader) ReadBack(_ context.Context, _, _ string, _ relay.ReadBackRange, fn func(relay.StoredEvent) bool) error {
	for _, m := range r.msgs {
		fn(relay.StoredEvent{Table: m[0], ID: m[1]})
	}
	return nil
}

// Issue 33, item 4: a row is marked only from evidence about its own event,
// its table and its id. Two outbox tables with the same ids publish into one
// stream; the catch-up read-back of this table's sweeper meets the other
// table's message with this table's row's id, and must not mark the row
// (archival would then delete a row whose event is not stored). A message
// that names no table (a relay from before walbox recorded it) is the first
// table's only. Before the fix the read-back marked by id alone: 2 rows
// marked that were not stored.
func TestCatchUpMarksOnlyRowsOfItsOwnTable(t *testing.T) {
	for _, first := range []bool{false, true} {
		name := "second table"
		if first {
			name = "first table"
		}
		t.Run(name, func(t *testing.T) {
			d := newDB(t, true)
			ids := map[string]string{}
			for _, k := range []string{"mine", "others", "unlabelled"} {
				ids[k] = queryOne[string](d, `INSERT INTO outbox_events (topic, payload) VALUES ('orders.x', '{}') RETURNING id::text`)
			}
			sw := d.sweeper(func(c *sweep.Config) { c.Unlabelled = first })
			sw.SetReader(tableReader{msgs: [][2]string{
				{"public.outbox_events", ids["mine"]},
				{"public.other_outbox", ids["others"]},
				{"", ids["unlabelled"]},
			}}, "app/walbox", []string{"ORDERS"}, 10)
			stop := sw.Start(context.Background())
			defer stop()
			want := int64(1)
			if first {
				want = 2
			}
			// The read-back's marks go in one batch: a wrong one would be
			// there with the right ones.
			relaytest.Eventually(t, 10*time.Second, "the catch-up marks its rows", func() bool {
				return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) >= want
			})
			if d.bool(`SELECT processed FROM outbox_events WHERE id::text = $1`, ids["others"]) {
				t.Fatal("the row was marked from another table's message with its id")
			}
			if got := d.bool(`SELECT processed FROM outbox_events WHERE id::text = $1`, ids["unlabelled"]); got != first {
				t.Fatalf("the row of a message naming no table marked = %v, want %v (only the first table's)", got, first)
			}
			if !d.bool(`SELECT processed FROM outbox_events WHERE id::text = $1`, ids["mine"]) {
				t.Fatal("the row of this table's message was not marked")
			}
		})
	}
}

// slowReader hands back its messages after a pause, as a read-back does
// that meets messages stored while it scans, and records when it did.
type slowReader struct {
	msgs  [][2]string
	pause time.Duration
	at    chan time.Time
}

func (r slowReader) ReadBack(ctx context.Context, _, _ string, _ relay.ReadBackRange, fn func(relay.StoredEvent) bool) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(r.pause):
	}
	r.at <- time.Now()
	for _, m := range r.msgs {
		fn(relay.StoredEvent{Table: m[0], ID: m[1]})
	}
	return nil
}

// A row's processed_at is no earlier than the evidence that its event was
// stored. The start read-back scans the stream while the relay publishes:
// a message stored during the scan was marked with the time the scan
// began, before the message existed (TestTablesSharingIDs, in CI: "1 rows
// with processed_at before their message's stored time"). Before the fix:
// processed_at 200 ms before the read-back handed the message over.
func TestCatchUpStampsAMarkNoEarlierThanItsEvidence(t *testing.T) {
	d := newDB(t, true)
	id := queryOne[string](d, `INSERT INTO outbox_events (topic, payload) VALUES ('orders.x', '{}') RETURNING id::text`)
	sw := d.sweeper()
	r := slowReader{msgs: [][2]string{{"public.outbox_events", id}}, pause: 200 * time.Millisecond, at: make(chan time.Time, 1)}
	sw.SetReader(r, "app/walbox", []string{"ORDERS"}, 10)
	stop := sw.Start(context.Background())
	defer stop()
	relaytest.Eventually(t, 10*time.Second, "the catch-up marks the row", func() bool {
		return d.bool(`SELECT processed FROM outbox_events WHERE id::text = $1`, id)
	})
	seen := <-r.at
	got := queryOne[time.Time](d, `SELECT processed_at FROM outbox_events WHERE id::text = $1`, id)
	// processed_at holds microseconds.
	if got.Before(seen.Truncate(time.Microsecond)) {
		t.Fatalf("processed_at %s is %v before the read-back saw the event stored (%s)", got.Format(time.RFC3339Nano), seen.Sub(got), seen.Format(time.RFC3339Nano))
	}
}
