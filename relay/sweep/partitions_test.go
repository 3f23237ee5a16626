package sweep_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/sweep"
)

func TestMaintainCreatesPartitionsAhead(t *testing.T) {
	d := newDB(t, true)
	var missing string
	if err := d.pool.QueryRow(context.Background(), `SELECT 'outbox_events_p' || to_char(now() + interval '3 days', 'YYYYMMDD')`).Scan(&missing); err != nil {
		t.Fatal(err)
	}
	d.exec(`DROP TABLE ` + missing)
	sw := d.sweeper(func(c *sweep.Config) { c.PartitionsAhead = 10 })

	dry, err := sw.Maintain(context.Background(), sweep.MaintainOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if !contains(dry.PartitionsCreated, "public."+missing) || len(dry.PartitionsCreated) < 4 {
		t.Fatalf("dry run would create %v; want %s and the days 8 to 10 ahead", dry.PartitionsCreated, missing)
	}
	if d.bool(`SELECT to_regclass($1) IS NOT NULL`, missing) {
		t.Fatal("the dry run created a partition")
	}
	rep, err := sw.Maintain(context.Background(), sweep.MaintainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.PartitionsCreated) != len(dry.PartitionsCreated) {
		t.Errorf("created %v, the dry run said %v", rep.PartitionsCreated, dry.PartitionsCreated)
	}
	for i := 0; i <= 10; i++ {
		if !d.bool(`SELECT to_regclass('outbox_events_p' || to_char(now() + make_interval(days => $1), 'YYYYMMDD')) IS NOT NULL`, i) {
			t.Errorf("no partition %d days ahead", i)
		}
	}
	again, err := sw.Maintain(context.Background(), sweep.MaintainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !again.Empty() {
		t.Errorf("second run did something: %+v", again)
	}
	// Without a default partition, how long INSERTs still find one: from
	// now to the end of the day 10 days ahead.
	if _, err := sw.RefreshGauges(context.Background()); err != nil {
		t.Fatal(err)
	}
	if ahead := time.Duration(testutil.ToFloat64(sw.Metrics().PartitionsAhead) * float64(time.Second)); ahead <= 10*24*time.Hour || ahead > 11*24*time.Hour+time.Hour {
		t.Errorf("walbox_outbox_partitions_ahead_seconds says %v, want 10 to 11 days", ahead)
	}
}

// Rows that landed in the default partition an older walbox created move
// into partitions of their own, keep their flags, and are not published a
// second time: the move inserts only into tables that are not in the
// publication at that moment. The emptied default partition is removed.
func TestMoveDefaultRowsIsNotRepublished(t *testing.T) {
	d := newDB(t, true)
	e := newRelayEnv(t, d)
	e.start()
	// The relay's own sweeper maintains the table at start: hold its lock
	// so that it has either finished or skips (its next run is 10 minutes
	// away), and the moves below are this test's.
	lockConn, err := d.pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer lockConn.Release()
	key := sweep.LockKey("public.outbox_events")
	if _, err := lockConn.Exec(context.Background(), `SELECT pg_advisory_lock($1)`, key); err != nil {
		t.Fatal(err)
	}
	d.exec(`CREATE TABLE outbox_events_default PARTITION OF outbox_events DEFAULT`) // as an older walbox made it
	d.exec(`INSERT INTO outbox_events (topic, payload, created_at) VALUES
		('orders.future', '{"n":1}', now() + interval '30 days'),
		('orders.future', '{"n":2}', now() + interval '30 days'),
		('orders.future', '{"n":3}', now() + interval '31 days'),
		('orders.past', '{"n":4}', now() - interval '100 days'),
		('orders.past', '{"n":5}', now() - interval '100 days' + interval '1 second')`)
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.now', '{}' FROM generate_series(1, 5)`)
	if n := d.int(`SELECT count(*) FROM outbox_events_default`); n != 5 {
		t.Fatalf("%d rows in the default partition, want 5", n)
	}
	relaytest.Eventually(t, 30*time.Second, "10 rows delivered and marked", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == 10
	})
	delivered := drain(e.delivered)

	// An independent pgoutput slot sees what walbox's slot would be sent.
	d.exec(`SELECT pg_create_logical_replication_slot('peek', 'pgoutput')`)
	sw := d.sweeper()
	dry, err := sw.Maintain(context.Background(), sweep.MaintainOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(dry.Moved) != 3 {
		t.Fatalf("dry run would move %+v; want 3 ranges", dry.Moved)
	}
	if _, err := lockConn.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, key); err != nil {
		t.Fatal(err)
	}
	rep, err := sw.Maintain(context.Background(), sweep.MaintainOptions{Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Moved) != 3 || rep.Moved[0].Rows != 2 || rep.Moved[1].Rows != 2 || rep.Moved[2].Rows != 1 {
		t.Fatalf("moved %+v; want 2 rows (past), 2 and 1 (future)", rep.Moved)
	}
	if rep.DefaultRemoved != "public.outbox_events_default" || d.bool(`SELECT to_regclass('outbox_events_default') IS NOT NULL`) {
		t.Fatalf("the emptied default partition was not removed (report: %q)", rep.DefaultRemoved)
	}
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE tableoid::regclass::text LIKE 'outbox_events_p%' AND processed`); n != 10 {
		t.Fatalf("%d processed rows in dated partitions, want all 10", n)
	}
	for _, m := range rep.Moved {
		if !d.bool(`SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass($1) AND inhparent = 'outbox_events'::regclass)`, m.Partition) {
			t.Errorf("%s is not a partition of outbox_events", m.Partition)
		}
	}
	inserts := func() int64 {
		return d.int(`SELECT count(*) FROM pg_logical_slot_peek_binary_changes('peek', NULL, NULL,
			'proto_version', '1', 'publication_names', 'walbox_outbox') WHERE substr(data, 1, 1) = 'I'::bytea`)
	}
	if n := inserts(); n != 0 {
		t.Fatalf("moving rows out of the default partition put %d inserts into the publication's stream", n)
	}
	// Control: a real insert is seen by the peek slot, and reaches the relay.
	d.exec(`INSERT INTO outbox_events (topic, payload) VALUES ('orders.control', '{}')`)
	if n := inserts(); n != 1 {
		t.Fatalf("peek slot saw %d inserts after one real insert", n)
	}
	relaytest.Eventually(t, 30*time.Second, "the control row delivered", func() bool { return e.streamMsgs("ORDERS") == 11 })
	// Whatever the move put into the WAL comes before the control row, so
	// it is reported delivered before it: collect up to the control row.
	var control string
	if err := d.pool.QueryRow(context.Background(), `SELECT id::text FROM outbox_events WHERE topic = 'orders.control'`).Scan(&control); err != nil {
		t.Fatal(err)
	}
	var after []relay.Delivered
	for len(after) == 0 || after[len(after)-1].ID != control {
		select {
		case dl := <-e.delivered:
			after = append(after, dl)
		case <-time.After(30 * time.Second):
			t.Fatalf("the control row %s was never reported delivered; got %+v", control, after)
		}
	}
	after = append(after, drain(e.delivered)...)
	if len(after) != 1 {
		t.Fatalf("after the move the relay delivered %d events, want only the control row: %+v", len(after), after)
	}
	for _, dl := range delivered {
		if dl.ID == after[0].ID {
			t.Fatal("control row id collides")
		}
	}
	// The ranges ensure_partitions skipped are there now.
	if !d.bool(`SELECT to_regclass('outbox_events_p' || to_char(now() + interval '30 days', 'YYYYMMDD')) IS NOT NULL`) {
		t.Error("no partition for the future range")
	}
}

func drain[T any](ch chan T) []T {
	var out []T
	for {
		select {
		case v := <-ch:
			out = append(out, v)
		default:
			return out
		}
	}
}

func contains(xs []string, x string) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// oldPartition creates the day partition daysAgo days back and fills it.
func (d *db) oldPartition(daysAgo, rows int, processed bool) string {
	d.t.Helper()
	var name, from, to string
	if err := d.pool.QueryRow(context.Background(), `SELECT 'outbox_events_p' || to_char(day, 'YYYYMMDD'), day::timestamptz::text, (day + 1)::timestamptz::text
		FROM (SELECT (now() - make_interval(days => $1))::date AS day) x`, daysAgo).Scan(&name, &from, &to); err != nil {
		d.t.Fatal(err)
	}
	d.exec(fmt.Sprintf(`CREATE TABLE %s PARTITION OF outbox_events FOR VALUES FROM ('%s') TO ('%s')`, name, from, to))
	d.fill(from, rows, processed)
	return "public." + name
}

// fill inserts rows spread over the day from start, with awkward payloads.
func (d *db) fill(start string, rows int, processed bool) {
	d.t.Helper()
	d.exec(`INSERT INTO outbox_events (created_at, topic, payload, processed, processed_at)
		SELECT $1::timestamptz + g * (interval '86399 seconds' / $3), 'orders.x',
		       jsonb_build_object('n', g, 's', E'quote " back \\ nl \n tab \t ü €'), $2, CASE WHEN $2 THEN now() END
		FROM generate_series(0, $3 - 1) g`, start, processed, rows)
}

// Without ownership of the table, partition upkeep fails for good: the
// sweeper says so once, with the fix, and keeps marking rows; with
// sweeper.maintain false it does not try.
func TestMaintenanceWithoutOwnershipWarnsOnceAndCanBeTurnedOff(t *testing.T) {
	d := newDB(t, true)
	d.exec(`DO $$ BEGIN CREATE ROLE walbox_sweeper LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$`)
	d.exec(`GRANT USAGE ON SCHEMA walbox TO walbox_sweeper`)
	d.exec(`GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA public TO walbox_sweeper`)
	// A partition due soon is missing: upkeep has work that needs ownership.
	var missing string
	if err := d.pool.QueryRow(context.Background(), `SELECT 'outbox_events_p' || to_char(now() + interval '3 days', 'YYYYMMDD')`).Scan(&missing); err != nil {
		t.Fatal(err)
	}
	d.exec(`DROP TABLE ` + missing)
	u, err := url.Parse(d.url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User("walbox_sweeper")
	for _, off := range []bool{false, true} {
		var logs strings.Builder
		var mu sync.Mutex
		reg := prometheus.NewRegistry()
		sw := d.sweeper(func(c *sweep.Config) {
			c.ConnString = u.String()
			c.MaintenanceInterval = 20 * time.Millisecond
			c.NoMaintenance = off
			c.Registry = reg
			c.Logger = zerolog.New(zerolog.SyncWriter(writerFunc(func(p []byte) (int, error) {
				mu.Lock()
				defer mu.Unlock()
				return logs.Write(p)
			}))).Level(zerolog.InfoLevel)
		})
		stop := sw.Start(context.Background())
		failures := func() float64 { return testutil.ToFloat64(sw.Metrics().MaintainFailures.WithLabelValues("privilege")) }
		if off {
			relaytest.Eventually(t, 10*time.Second, "the note that maintenance is off", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return strings.Contains(logs.String(), "sweeper.maintain is false")
			})
		} else {
			relaytest.Eventually(t, 10*time.Second, "three failed maintenance runs", func() bool {
				if failures() >= 3 {
					return true
				}
				mu.Lock()
				defer mu.Unlock()
				return strings.Count(logs.String(), "maintenance failed") > 3 // another error: fail below with the log
			})
		}
		stop()
		mu.Lock()
		out := logs.String()
		mu.Unlock()
		warned := strings.Count(out, "need ownership")
		switch {
		case off && (warned != 0 || failures() != 0):
			t.Fatalf("maintain off: %v failures, %d warnings:\n%s", failures(), warned, out)
		case !off && warned != 1:
			t.Fatalf("%v failed runs gave %d warnings, want 1 with the fix:\n%s", failures(), warned, out)
		case !off && !strings.Contains(out, "sweeper.maintain: false"):
			t.Fatalf("the warning does not name the fix:\n%s", out)
		}
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
