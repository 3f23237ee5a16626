package sweep_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
)

// storedReader reads back fixed messages per stream, and reports each
// stream it has read on read (after the sweeper has written what the
// streams before it held: it reads them one after the other).
type storedReader struct {
	msgs map[string][]relay.StoredEvent
	read chan string
}

func (r storedReader) ReadBack(_ context.Context, stream, _ string, _ relay.ReadBackRange, fn func(relay.StoredEvent) bool) error {
	for _, m := range r.msgs[stream] {
		fn(m)
	}
	r.read <- stream
	return nil
}

// deadLetterRow is a row's dead-letter columns, and its tuple's identity
// (ctid and xmin change with every update of the row).
type deadLetterRow struct {
	processed bool
	err       string
	attempts  int
	tuple     string
}

func (d *db) deadLetterRow(id string) deadLetterRow {
	d.t.Helper()
	var r deadLetterRow
	if err := d.pool.QueryRow(context.Background(), `SELECT processed, coalesce(error, ''), attempts, ctid::text || '/' || xmin::text
		FROM outbox_events WHERE id::text = $1`, id).Scan(&r.processed, &r.err, &r.attempts, &r.tuple); err != nil {
		d.t.Fatal(err)
	}
	return r
}

// Issue 34, item 7: a stored dead letter read back again (every start reads
// the dead-letter stream's newest messages back) leaves its row alone when
// the row already records it: no second attempt counted, error not written
// again. Before the fix each read-back added 1 to attempts and rewrote the
// row: attempts 2 after the second start.
func TestDeadLetterReadBackTwiceCountsOneAttempt(t *testing.T) {
	d := newDB(t, true)
	var dead relay.StoredEvent
	if err := d.pool.QueryRow(context.Background(), `INSERT INTO outbox_events (topic, payload) VALUES ('nowhere', '{}')
		RETURNING id::text, created_at::text`).Scan(&dead.ID, &dead.CreatedAt); err != nil {
		t.Fatal(err)
	}
	dead.Table, dead.Reason = "public.outbox_events", "no configured stream captures subject \"nowhere\""
	// A row never delivered keeps the read-back at start going.
	d.exec(`INSERT INTO outbox_events (topic, payload) VALUES ('orders.x', '{}')`)
	start := func() deadLetterRow {
		t.Helper()
		r := storedReader{msgs: map[string][]relay.StoredEvent{"WALBOX_DLQ": {dead}}, read: make(chan string, 2)}
		sw := d.sweeper()
		sw.SetReader(r, "app/walbox", []string{"WALBOX_DLQ", "ORDERS"}, 10)
		stop := sw.Start(context.Background())
		defer stop()
		for want := range 2 {
			select {
			case <-r.read:
			case <-time.After(20 * time.Second):
				t.Fatalf("the read-back at start read %d streams of 2", want)
			}
		}
		return d.deadLetterRow(dead.ID)
	}
	first := start()
	if !first.processed || first.err != dead.Reason || first.attempts != 1 {
		t.Fatalf("after the first read-back: %+v, want processed, the reason and 1 attempt", first)
	}
	second := start()
	if second.attempts != 1 || second.err != dead.Reason || second.tuple != first.tuple {
		t.Fatalf("after the second read-back: %d attempts (want 1), error %q, row rewritten %v (tuple %s, was %s)",
			second.attempts, second.err, second.tuple != first.tuple, second.tuple, first.tuple)
	}
}

// The same guard on marks from acks: a stored dead letter delivered again
// (a relay restarted before its checkpoint publishes it again, and the
// dead-letter stream answers with the stored one) counts once, and its
// mark is done (not tried again as a row not seen yet). A dead letter the
// dead-letter stream refused is not stored: each one is an attempt of its
// own, and counts.
func TestStoredDeadLetterDeliveredAgainCountsOneAttempt(t *testing.T) {
	d := newDB(t, true)
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'nowhere', '{}' FROM generate_series(1, 2)`)
	ds := d.deliveries(0)
	stored, refused := ds[0], ds[1]
	stored.DeadLetter, stored.Reason, stored.Stream = true, "no stream", "WALBOX_DLQ"
	refused.DeadLetter, refused.Reason, refused.Stream, refused.Seq = true, "refused", "", 0
	sw := d.sweeper()
	stop := sw.Start(context.Background())
	defer stop()
	// Two rounds, each written before the next: the refused dead letter's
	// attempts say when (the stored one's mark is queued before it).
	for round := range 2 {
		sw.OnDelivered(stored)
		sw.OnDelivered(refused)
		relaytest.Eventually(t, 10*time.Second, "the marks written", func() bool { return d.deadLetterRow(refused.ID).attempts == round+1 })
	}
	stop() // a mark found not done would be queued to be tried again by now
	if r := d.deadLetterRow(stored.ID); !r.processed || r.err != "no stream" || r.attempts != 1 {
		t.Errorf("stored dead letter delivered twice: %+v, want processed, its reason and 1 attempt", r)
	}
	if r := d.deadLetterRow(refused.ID); r.processed || r.err != "refused" || r.attempts != 2 {
		t.Errorf("dead letter refused twice: %+v, want unprocessed, its reason and 2 attempts", r)
	}
	if v := testutil.ToFloat64(sw.Metrics().Unseen); v != 0 {
		t.Errorf("walbox_sweeper_marks_unseen_total = %v, want 0", v)
	}
}
