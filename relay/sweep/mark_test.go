package sweep_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/sweep"
)

// Rows are marked processed with the ack time, and only after the ack:
// while NATS is down nothing is acked and nothing is marked.
func TestMarksProcessedOnlyAfterAck(t *testing.T) {
	d := newDB(t, true)
	e := newRelayEnv(t, d)
	e.start()

	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.created', jsonb_build_object('n', g) FROM generate_series(1, 50) g`)
	relaytest.Eventually(t, 30*time.Second, "50 rows marked processed", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 50
	})
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE processed_at IS NULL`); n != 0 {
		t.Fatalf("%d processed rows have no processed_at", n)
	}
	// processed_at is the ack time the relay reported.
	acked := map[string]time.Time{}
	for len(acked) < 50 {
		select {
		case dl := <-e.delivered:
			acked[dl.ID] = dl.AckedAt
		case <-time.After(10 * time.Second):
			t.Fatalf("only %d deliveries reported", len(acked))
		}
	}
	rows, err := d.pool.Query(context.Background(), `SELECT id::text, processed_at FROM outbox_events`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var at time.Time
		if err := rows.Scan(&id, &at); err != nil {
			t.Fatal(err)
		}
		want, ok := acked[id]
		if !ok {
			t.Fatalf("row %s marked but never reported delivered", id)
		}
		if !at.Equal(want.Truncate(time.Microsecond)) {
			t.Errorf("row %s: processed_at %v, acked at %v", id, at, want)
		}
	}
	rows.Close()

	// NATS down: events cannot be acked, so their rows must stay unprocessed.
	e.nats.Stop()
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.late', jsonb_build_object('n', g) FROM generate_series(1, 20) g`)
	// The relay has read the late rows and tried to publish them: they sit
	// in its window unacked, or their publish failed.
	relaytest.Eventually(t, 30*time.Second, "the relay to publish the late rows while NATS is down", func() bool {
		return relaytest.Metric(t, e.reg, "walbox_inflight", nil) > 0 ||
			relaytest.Metric(t, e.reg, "walbox_publish_errors_total", nil) > 0
	})
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.late' AND processed`); n != 0 {
		t.Fatalf("%d rows marked processed while NATS was down (before any ack)", n)
	}
	if err := e.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 60*time.Second, "the late rows marked after NATS came back", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 70
	})
	if got := e.streamMsgs("ORDERS"); got != 70 {
		t.Errorf("stream holds %d messages, want 70", got)
	}
	if v := relaytest.Metric(t, e.reg, "walbox_sweeper_marked_total", nil); v != 70 {
		t.Errorf("walbox_sweeper_marked_total = %v, want 70", v)
	}
}

// A dead-lettered row gets its reason in error and attempts + 1; since the
// dead letter was stored, it also counts as processed.
func TestDeadLetteredRowGetsErrorAndAttempts(t *testing.T) {
	d := newDB(t, true)
	e := newRelayEnv(t, d)
	e.start()
	d.exec(`INSERT INTO outbox_events (topic, payload) VALUES ('nowhere.at.all', '{"a":1}'), ('orders.ok', '{"b":2}')`)
	relaytest.Eventually(t, 30*time.Second, "both rows marked", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 2
	})
	var errText string
	var attempts int
	if err := d.pool.QueryRow(context.Background(), `SELECT coalesce(error, ''), attempts FROM outbox_events WHERE topic = 'nowhere.at.all'`).Scan(&errText, &attempts); err != nil {
		t.Fatal(err)
	}
	if errText == "" || attempts != 1 {
		t.Fatalf("dead-lettered row: error %q, attempts %d; want a reason and 1", errText, attempts)
	}
	if !strings.Contains(errText, "stream") {
		t.Errorf("error %q does not say why (no stream for the subject)", errText)
	}
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.ok' AND (error IS NOT NULL OR attempts <> 0)`); n != 0 {
		t.Error("the acked row got an error")
	}
}

// Killing the sweeper's connection does not stop publishing; the marks
// catch up once it reconnects.
func TestMarksCatchUpAfterSweeperConnectionIsKilled(t *testing.T) {
	d := newDB(t, true)
	e := newRelayEnv(t, d)
	e.start()
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.a', '{}' FROM generate_series(1, 100)`)
	relaytest.Eventually(t, 30*time.Second, "first rows marked", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 100
	})
	kill := func() int64 {
		return d.int(`SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE application_name = $1 AND datname = current_database()) k`, sweep.ApplicationName)
	}
	if n := kill(); n == 0 {
		t.Fatal("found no sweeper backend to terminate")
	}
	for i := 0; i < 5; i++ {
		d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.b', '{}' FROM generate_series(1, 100)`)
		kill()
		time.Sleep(50 * time.Millisecond) // pacing: spreads the kills over the deliveries
	}
	relaytest.Eventually(t, 30*time.Second, "publishing to go on", func() bool { return e.streamMsgs("ORDERS") == 600 })
	relaytest.Eventually(t, 60*time.Second, "marks to catch up after reconnecting", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 600
	})
}

// PostgreSQL can decode and send a commit before other sessions see it (the
// committing backend leaves the proc array after its WAL is flushed), so a
// mark can reach a row that is not visible yet. That mark is tried again
// until the row shows up, instead of matching nothing and being forgotten.
func TestMarkWaitsForARowNotVisibleYet(t *testing.T) {
	d := newDB(t, true)
	d.exec(`INSERT INTO outbox_events (topic, payload) VALUES ('orders.seen', '{}')`)
	var seen relay.Delivered
	if err := d.pool.QueryRow(context.Background(), `SELECT id::text, created_at::text FROM outbox_events`).Scan(&seen.ID, &seen.CreatedAt); err != nil {
		t.Fatal(err)
	}
	seen.AckedAt, seen.Stream, seen.Seq = time.Now(), "ORDERS", 1
	// An hour ago, with microseconds: a partition covers it (yesterday's
	// at the latest), and its text must round-trip exactly.
	at := time.Now().UTC().Add(-time.Hour).Truncate(time.Second).Add(123456 * time.Microsecond).Format("2006-01-02 15:04:05.000000+00")
	late := relay.Delivered{ID: "0f6f1c2e-7d1a-4c55-9a43-51b0f3c1d001", CreatedAt: at, AckedAt: time.Now(), Stream: "ORDERS", Seq: 2}
	// A dead letter the DLQ stream refused (error only) and one it stored
	// (error and processed): attempts must still count once.
	lost := relay.Delivered{ID: "0f6f1c2e-7d1a-4c55-9a43-51b0f3c1d002", CreatedAt: at, AckedAt: time.Now(), DeadLetter: true, Reason: "refused"}
	stored := relay.Delivered{ID: "0f6f1c2e-7d1a-4c55-9a43-51b0f3c1d003", CreatedAt: at, AckedAt: time.Now(), DeadLetter: true, Reason: "stored",
		Stream: "DLQ", Seq: 1}
	sw := d.sweeper()
	for _, dl := range []relay.Delivered{late, lost, stored, seen} { // rows not there (not visible) yet, then one that is
		sw.OnDelivered(dl)
	}
	stop := sw.Start(context.Background())
	defer stop()
	// The marks go in one batch: once the visible row is marked, the
	// sweeper has tried the others too.
	relaytest.Eventually(t, 20*time.Second, "the visible row marked", func() bool {
		return d.bool(`SELECT processed FROM outbox_events WHERE id = $1`, seen.ID)
	})
	d.exec(`INSERT INTO outbox_events (id, topic, payload, created_at) SELECT id::uuid, 'orders.late', '{}', $2 FROM unnest($1::text[]) id`,
		[]string{late.ID, lost.ID, stored.ID}, at)
	relaytest.Eventually(t, 20*time.Second, "the rows that became visible later written", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.late' AND (processed OR error IS NOT NULL)`) == 3 &&
			d.bool(`SELECT processed FROM outbox_events WHERE id = $1`, stored.ID)
	})
	rows, err := d.pool.Query(context.Background(), `SELECT id::text, processed, coalesce(error, ''), attempts FROM outbox_events WHERE topic = 'orders.late' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var id, reason string
		var processed bool
		var attempts int
		if err := rows.Scan(&id, &processed, &reason, &attempts); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%s %v %q %d", id[len(id)-3:], processed, reason, attempts))
	}
	rows.Close()
	want := []string{`001 true "" 0`, `002 false "refused" 1`, `003 true "stored" 1`}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("late rows (id, processed, error, attempts) = %q, want %q", got, want)
	}
	if v := testutil.ToFloat64(sw.Metrics().Dropped); v != 0 {
		t.Errorf("walbox_sweeper_dropped_total = %v, want 0", v)
	}
	if v := testutil.ToFloat64(sw.Metrics().Unseen); v != 3 {
		t.Errorf("walbox_sweeper_marks_unseen_total = %v, want 3", v)
	}
}

// deliveries returns a delivery of every outbox row, in id order, acked now
// into stream ORDERS (sequences 1, 2, ...) and sent sentAfter after its commit.
func (d *db) deliveries(sentAfter time.Duration) []relay.Delivered {
	d.t.Helper()
	rows, err := d.pool.Query(context.Background(), `SELECT id::text, created_at::text FROM outbox_events ORDER BY id`)
	if err != nil {
		d.t.Fatal(err)
	}
	defer rows.Close()
	var ds []relay.Delivered
	for rows.Next() {
		dl := relay.Delivered{AckedAt: time.Now(), Stream: "ORDERS", Seq: uint64(len(ds) + 1), SentAfter: sentAfter}
		if err := rows.Scan(&dl.ID, &dl.CreatedAt); err != nil {
			d.t.Fatal(err)
		}
		ds = append(ds, dl)
	}
	if err := rows.Err(); err != nil {
		d.t.Fatal(err)
	}
	return ds
}

// A full queue drops marks at once (the relay never waits) and counts them.
func TestFullQueueDropsMarksWithoutBlocking(t *testing.T) {
	d := newDB(t, true)
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.x', '{}' FROM generate_series(1, 25)`)
	sw := d.sweeper(func(c *sweep.Config) { c.QueueSize = 10 })
	ds := d.deliveries(0)
	for _, dl := range ds {
		sw.OnDelivered(dl) // nothing drains the queue yet
	}
	if sw.Pending() != 10 || sw.Dropped() != 15 {
		t.Fatalf("pending %d, dropped %d; want 10 and 15", sw.Pending(), sw.Dropped())
	}
	if v := testutil.ToFloat64(sw.Metrics().Dropped); v != 15 {
		t.Errorf("walbox_sweeper_dropped_total = %v, want 15", v)
	}
	stop := sw.Start(context.Background())
	relaytest.Eventually(t, 20*time.Second, "the queued marks written", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 10
	})
	stop()
	// Re-marking is harmless: the dropped ones can be delivered again later.
	sw2 := d.sweeper()
	stop2 := sw2.Start(context.Background())
	for _, dl := range ds {
		sw2.OnDelivered(dl)
	}
	stop2() // stop flushes what is queued
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE processed`); n != 25 {
		t.Fatalf("%d rows processed after marking again, want 25", n)
	}
	if sw2.Marked() != 15 {
		t.Errorf("second sweeper marked %d rows, want 15 (the 10 already processed are left alone)", sw2.Marked())
	}
}

// The DAARION layout: id text, no attempts column, and no created_at role
// mapped, so rows are matched by id alone.
func TestMarksDAARIONLayoutByID(t *testing.T) {
	d := newDB(t, false)
	d.exec(`CREATE TABLE daarion_outbox (id text PRIMARY KEY, stream text, topic text, payload jsonb,
		created_at timestamptz NOT NULL DEFAULT now(), processed boolean NOT NULL DEFAULT false, processed_at timestamptz, error text)`)
	d.exec(`INSERT INTO daarion_outbox (id, topic, payload) VALUES ('a', 'orders.a', '{}'), ('b', 'orders.b', '{}'), ('c', 'orders.c', '{}'), ('d', 'orders.d', '{}')`)
	sw := d.sweeperOn("daarion_outbox", cdc.RoleEventType, cdc.RoleAggregateType, cdc.RoleAggregateID, cdc.RolePartitionKey, cdc.RoleHeaders, cdc.RoleCreatedAt)
	stop := sw.Start(context.Background())
	at := time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC)
	sw.OnDelivered(relay.Delivered{ID: "a", AckedAt: at, Stream: "ORDERS", Seq: 1})
	sw.OnDelivered(relay.Delivered{ID: "b", AckedAt: at, Stream: "WALBOX_DLQ", Seq: 2, DeadLetter: true, Reason: "too large"})
	sw.OnDelivered(relay.Delivered{ID: "c", AckedAt: at, DeadLetter: true, Reason: "dead-letter stream refused it"})
	stop()
	type row struct {
		processed bool
		at        *time.Time
		err       *string
	}
	get := func(id string) row {
		var r row
		if err := d.pool.QueryRow(context.Background(), `SELECT processed, processed_at, error FROM daarion_outbox WHERE id = $1`, id).Scan(&r.processed, &r.at, &r.err); err != nil {
			t.Fatal(err)
		}
		return r
	}
	if r := get("a"); !r.processed || r.at == nil || !r.at.Equal(at) || r.err != nil {
		t.Errorf("acked row a: %+v", r)
	}
	if r := get("b"); !r.processed || r.err == nil || *r.err != "too large" {
		t.Errorf("stored dead letter b: %+v", r)
	}
	// A dead letter no stream stored is the only record of the event: its
	// row keeps processed = false (and blocks archival) with the reason.
	if r := get("c"); r.processed || r.err == nil || *r.err != "dead-letter stream refused it" {
		t.Errorf("unstored dead letter c: %+v", r)
	}
	if r := get("d"); r.processed || r.err != nil {
		t.Errorf("undelivered row d was touched: %+v", r)
	}
}

// deliveredUnmarked runs the relay with mark_processed: false until n new
// rows are in stream ORDERS, and stops it.
func deliveredUnmarked(t *testing.T, n int) (*db, *relayEnv) {
	t.Helper()
	d := newDB(t, true)
	e := newRelayEnv(t, d, func(c *config.Config) { c.Sweeper.MarkProcessed = false })
	e.start()
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.x', '{}' FROM generate_series(1, $1)`, n)
	relaytest.Eventually(t, 30*time.Second, fmt.Sprintf("%d events published", n), func() bool { return e.streamMsgs("ORDERS") == uint64(n) })
	e.stop()
	return d, e
}

// mark_processed: false turns marking off.
func TestMarkProcessedOff(t *testing.T) {
	d, _ := deliveredUnmarked(t, 10)
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE processed`); n != 0 {
		t.Fatalf("%d rows marked with mark_processed off", n)
	}
}

// Dropped marks are caught up once the relay's confirmed position has passed
// a horizon taken after the drop: rows of transactions that finished before
// it are marked; newer ones are not.
// The review's reproduction: rows committed before a slot made without a
// snapshot (walbox slot create) were never delivered, and a mark dropped
// under load must not get them marked. Marks are caught up only from ids
// read back from the stream.
func TestDroppedMarksAreCaughtUpFromTheStreamOnly(t *testing.T) {
	d := newDB(t, true)
	e := newRelayEnv(t, d, func(c *config.Config) { c.Sweeper.BatchSize = 1 })
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.before', '{}' FROM generate_series(1, 100)`)
	d.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, e.cfg.Postgres.Slot)
	e.start()
	defer e.stop()
	for range 10 {
		d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.after', '{}' FROM generate_series(1, 100)`)
	}
	relaytest.Eventually(t, 60*time.Second, "the 1,000 events published", func() bool { return e.streamMsgs("ORDERS") == 1000 })
	relaytest.Eventually(t, 60*time.Second, "every delivered row marked (queued or caught up)", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.after' AND processed`) == 1000
	})
	if dropped := relaytest.Metric(t, e.reg, "walbox_sweeper_dropped_total", nil); dropped == 0 {
		t.Fatal("no mark was dropped: the test did not exercise the catch-up (queue of 10 marks, 1,000 events)")
	}
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.before' AND processed`); n != 0 {
		t.Fatalf("%d rows that never reached the stream were marked processed", n)
	}
}

// Marks a crash left unwritten are caught up at the next start from the
// newest messages of each stream.
func TestMarksLostInACrashAreCaughtUpAtStart(t *testing.T) {
	d, e := deliveredUnmarked(t, 300) // as if the marks died with the process
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE processed`); n != 0 {
		t.Fatalf("%d rows marked with marking off", n)
	}
	e.cfg.Sweeper.MarkProcessed = true
	e.start()
	defer e.stop()
	relaytest.Eventually(t, 30*time.Second, "the rows caught up at start", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed AND processed_at IS NOT NULL`) == 300
	})
}

// A stop while the sweeper yielded to a catch-up leaves more delivered rows
// unmarked than the mark queue and the publish window. The read-back at
// start takes as many of the newest messages as there are unprocessed rows,
// so those are caught up too. Before, only the fixed tail (here 10 × 1 +
// 2 × 100 = 210 messages) was read back and 790 rows stayed unprocessed.
func TestUnmarkedRowsBeyondTheTailAreCaughtUpAtStart(t *testing.T) {
	d, e := deliveredUnmarked(t, 1000) // as if a stop left the deferred marks unwritten
	e.cfg.Sweeper.MarkProcessed = true
	e.cfg.Sweeper.BatchSize = 1
	e.cfg.NATS.Window = 100
	e.start()
	defer e.stop()
	relaytest.Eventually(t, 60*time.Second, "the 1,000 delivered rows caught up at start", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed AND processed_at IS NOT NULL`) == 1000
	})
}

// A nullable processed column: a NULL is unprocessed everywhere. Before,
// a NULL row was never marked (NOT NULL is NULL), never counted and never
// backfilled, and archival did not see it as blocking.
func TestNullProcessedIsUnprocessed(t *testing.T) {
	d := newDB(t, false)
	d.exec(`CREATE TABLE nullable_outbox (id text PRIMARY KEY, topic text, payload jsonb,
		created_at timestamptz NOT NULL DEFAULT now(), processed boolean, processed_at timestamptz)`)
	d.exec(`INSERT INTO nullable_outbox (id, topic, payload) VALUES ('a', 'orders.a', '{}'), ('b', 'orders.b', '{}')`)
	sw := d.sweeperOn("nullable_outbox", cdc.RoleStream, cdc.RoleEventType, cdc.RoleAggregateType, cdc.RoleAggregateID, cdc.RolePartitionKey, cdc.RoleHeaders)
	st, err := sw.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Unprocessed != 2 {
		t.Fatalf("status counts %d unprocessed rows, want the 2 NULL ones", st.Unprocessed)
	}
	stop := sw.Start(context.Background())
	sw.OnDelivered(relay.Delivered{ID: "a", AckedAt: time.Now(), Stream: "ORDERS", Seq: 1})
	stop()
	if n := d.int(`SELECT count(*) FROM nullable_outbox WHERE processed`); n != 1 {
		t.Fatalf("%d rows marked, want the acked NULL row", n)
	}
}

// While the relay catches up (its events were sent a second or more after
// their commit) the sweeper writes nothing: marks wait in the queue, and
// those beyond it are deferred to the read-back, counted apart from drops.
// Once late marks stop coming it writes again; an on-time mark ends the
// yield at once.
func TestSweeperYieldsWhileTheRelayCatchesUp(t *testing.T) {
	d := newDB(t, true)
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.x', '{}' FROM generate_series(1, 30)`)
	sw := d.sweeper(func(c *sweep.Config) { c.QueueSize, c.BatchSize, c.YieldAfter = 10, 5, time.Second })
	ds := d.deliveries(5 * time.Second)
	stop := sw.Start(context.Background())
	defer stop()
	for _, dl := range ds[:25] {
		sw.OnDelivered(dl)
	}
	if sw.Pending() != 10 || sw.Deferred() != 15 || sw.Dropped() != 0 {
		t.Fatalf("pending %d, deferred %d, dropped %d; want 10, 15 and 0", sw.Pending(), sw.Deferred(), sw.Dropped())
	}
	if v := testutil.ToFloat64(sw.Metrics().Deferred); v != 15 {
		t.Errorf("walbox_sweeper_marks_deferred_total = %v, want 15", v)
	}
	// Late marks keep coming for 1.5 s (the same row again: harmless), 30
	// times the sweeper's interval: it writes nothing meanwhile.
	for range 30 {
		sw.OnDelivered(ds[24])
		time.Sleep(50 * time.Millisecond)
		if n := d.int(`SELECT count(*) FROM outbox_events WHERE processed`); n != 0 {
			t.Fatalf("%d rows marked while the relay was catching up", n)
		}
	}
	// They stop: after the hold (500 ms) the queued marks are written.
	relaytest.Eventually(t, 10*time.Second, "the queued marks written once late marks stopped", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 10
	})
	// Yielding again, then an on-time mark: the yield ends at once, without
	// waiting for the hold to pass.
	sw.OnDelivered(ds[25])
	if !sw.Yielding() {
		t.Fatal("not yielding after a mark sent 5 s after its commit")
	}
	onTime := ds[26]
	onTime.SentAfter = 3 * time.Millisecond
	sw.OnDelivered(onTime)
	if sw.Yielding() {
		t.Fatal("still yielding after a mark sent 3 ms after its commit")
	}
	relaytest.Eventually(t, 10*time.Second, "the marks after the on-time one written", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 12
	})
	if sw.Dropped() != 0 {
		t.Errorf("%d marks dropped; deferred ones are not drops", sw.Dropped())
	}
}

// The whole path: a relay catching up on a backlog makes the sweeper yield;
// the marks beyond its queue are read back from the stream once the relay
// has caught up, and every row ends processed with nothing dropped.
func TestCatchUpDefersMarksToTheReadBack(t *testing.T) {
	d := newDB(t, true)
	e := newRelayEnv(t, d, func(c *config.Config) {
		c.Sweeper.BatchSize = 10 // a queue of 100 marks
		c.Sweeper.YieldAfter = 300 * time.Millisecond
	})
	d.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, e.cfg.Postgres.Slot)
	for range 20 {
		d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.backlog', '{}' FROM generate_series(1, 100)`)
	}
	time.Sleep(400 * time.Millisecond) // the backlog is older than yield_after when the relay reads it
	e.start()
	defer e.stop()
	relaytest.Eventually(t, 60*time.Second, "the 2,000 events published", func() bool { return e.streamMsgs("ORDERS") == 2000 })
	relaytest.Eventually(t, 60*time.Second, "every row marked (queued or read back)", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed AND processed_at IS NOT NULL`) == 2000
	})
	deferred := relaytest.Metric(t, e.reg, "walbox_sweeper_marks_deferred_total", nil)
	t.Logf("%v marks deferred to the read-back", deferred)
	// All 1,900 beyond the queue when nothing stalls; fewer when the relay
	// paused for longer than the yield's hold (a loaded machine), during
	// which the sweeper writes.
	if deferred == 0 {
		t.Error("no mark deferred: the sweeper did not yield to the catching-up relay")
	}
	if dropped := relaytest.Metric(t, e.reg, "walbox_sweeper_dropped_total", nil); dropped != 0 {
		t.Errorf("%v marks dropped while yielding; deferred marks are not drops", dropped)
	}
	// Live events after the catch-up are marked from their acks again.
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.live', '{}' FROM generate_series(1, 50)`)
	relaytest.Eventually(t, 30*time.Second, "live rows marked", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.live' AND processed`) == 50
	})
}

// Ids, created_at texts and reasons go to PostgreSQL as array literals: each
// mark finds its row whatever its id holds (quotes, backslashes, commas,
// braces, spaces, the word NULL), and processed_at is the ack time to the
// microsecond, before 1970 too.
func TestMarksRowsWhateverTheirIDsHold(t *testing.T) {
	d := newDB(t, false)
	d.exec(`CREATE TABLE odd_outbox (id text, stream text, topic text, payload jsonb, created_at timestamptz NOT NULL DEFAULT now(),
		processed boolean NOT NULL DEFAULT false, processed_at timestamptz, error text, attempts int NOT NULL DEFAULT 0, PRIMARY KEY (id, created_at))`)
	ids := []string{`a,b`, `{x}`, `say "hi"`, `back\slash`, `\"`, `NULL`, ` spaced `, `ünï`, `'q'`, `}{","\`}
	for _, id := range ids {
		d.exec(`INSERT INTO odd_outbox (id, topic, payload) VALUES ($1, 'orders.x', '{}')`, id)
	}
	d.exec(`INSERT INTO odd_outbox (id, topic, payload) VALUES ('by id', 'orders.x', '{}'), ('dlq "1"', 'x', '{}'), ('dlq\2', 'x', '{}'), ('untouched', 'x', '{}')`)
	sw := d.sweeperOn("odd_outbox", cdc.RoleEventType, cdc.RoleAggregateType, cdc.RoleAggregateID, cdc.RolePartitionKey, cdc.RoleHeaders)
	stop := sw.Start(context.Background())
	at := map[string]time.Time{}
	for i, id := range ids {
		at[id] = time.Date(1969+i, 7, 20, 20, 17, 40, 123456789, time.UTC)
		created := queryOne[string](d, `SELECT created_at::text FROM odd_outbox WHERE id = $1`, id)
		sw.OnDelivered(relay.Delivered{ID: id, CreatedAt: created, AckedAt: at[id], Stream: "ORDERS", Seq: uint64(i + 1)})
	}
	at["by id"] = time.Date(2031, 1, 1, 0, 0, 0, 1000, time.UTC)
	sw.OnDelivered(relay.Delivered{ID: "by id", AckedAt: at["by id"], Stream: "ORDERS", Seq: 100})
	reasons := map[string]string{`dlq "1"`: "refused: \"x\", {y}\nline two \\ end", `dlq\2`: `NULL`}
	sw.OnDelivered(relay.Delivered{ID: `dlq "1"`, CreatedAt: queryOne[string](d, `SELECT created_at::text FROM odd_outbox WHERE id = 'dlq "1"'`),
		AckedAt: time.Now(), Stream: "WALBOX_DLQ", Seq: 1, DeadLetter: true, Reason: reasons[`dlq "1"`]})
	sw.OnDelivered(relay.Delivered{ID: `dlq\2`, AckedAt: time.Now(), DeadLetter: true, Reason: reasons[`dlq\2`]})
	stop()

	for id, want := range at {
		var processed bool
		var got *time.Time
		if err := d.pool.QueryRow(context.Background(), `SELECT processed, processed_at FROM odd_outbox WHERE id = $1`, id).Scan(&processed, &got); err != nil {
			t.Fatalf("row %q: %v", id, err)
		}
		if !processed || got == nil || !got.Equal(want.Truncate(time.Microsecond)) {
			t.Errorf("row %q: processed %v at %v, want true at %v", id, processed, got, want.Truncate(time.Microsecond))
		}
	}
	for id, reason := range reasons {
		var processed bool
		var errText *string
		var attempts int
		if err := d.pool.QueryRow(context.Background(), `SELECT processed, error, attempts FROM odd_outbox WHERE id = $1`, id).Scan(&processed, &errText, &attempts); err != nil {
			t.Fatalf("row %q: %v", id, err)
		}
		if errText == nil || *errText != reason || attempts != 1 || processed != (id == `dlq "1"`) {
			t.Errorf("dead letter %q: processed %v, error %v, attempts %d; want error %q, attempts 1, processed only when stored", id, processed, errText, attempts, reason)
		}
	}
	if n := d.int(`SELECT count(*) FROM odd_outbox WHERE id = 'untouched' AND (processed OR error IS NOT NULL OR attempts <> 0)`); n != 0 {
		t.Error("an undelivered row was touched")
	}
}
