package sweep_test

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
)

// primaryKeyScans is, by partition of outbox_events, the scans of its
// primary key since the statistics were reset, once the sweeper's backends
// have reported theirs: a backend reports its counters when it exits at the
// latest, so the caller stops the sweeper and this waits until every
// partition of want shows up.
func (d *db) primaryKeyScans(want []string) map[string]int64 {
	d.t.Helper()
	scans := map[string]int64{}
	relaytest.Eventually(d.t, 20*time.Second, "the sweeper's backends to report their index scans", func() bool {
		rows, err := d.pool.Query(context.Background(), `SELECT s.relname::text, s.idx_scan FROM pg_stat_user_indexes s
			JOIN pg_index i ON i.indexrelid = s.indexrelid
			WHERE i.indisprimary AND s.idx_scan > 0
			  AND s.relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'outbox_events'::regclass)`)
		if err != nil {
			d.t.Fatal(err)
		}
		clear(scans)
		for rows.Next() {
			var name string
			var n int64
			if err := rows.Scan(&name, &n); err != nil {
				d.t.Fatal(err)
			}
			scans[name] = n
		}
		if err := rows.Err(); err != nil {
			d.t.Fatal(err)
		}
		for _, w := range want {
			if scans[w] == 0 {
				return false
			}
		}
		return true
	})
	return scans
}

// Issue 34, item 4: a mark read back from the stream carries the event's
// created_at (header Walbox-Created-At), so its UPDATE prunes to the one
// partition that holds the row, as a live mark's does. Before, read-back
// marks matched by id alone and probed the primary key of every partition
// (about 97 with the defaults; a start read-back of up to 10^6 ids made
// ~10^8 probes). The outbox has nine partitions, each with enough rows that
// the planner looks rows up by their primary key; the rows whose marks a
// crash lost are all in one. Before the fix the read-back probed every
// partition's primary key (all ten, with the default partition walbox then
// made).
func TestReadBackMarksProbeOnlyTheirRowsPartition(t *testing.T) {
	d := newDB(t, true)
	// Processed rows spread over yesterday, today and the 7 days ahead:
	// nothing to publish, but partitions the planner scans by their
	// primary key.
	d.exec(`INSERT INTO outbox_events (topic, payload, processed, created_at)
		SELECT 'filler', '{}', true, now() + (g % 9 - 1) * interval '1 day' FROM generate_series(1, 50000) g`)
	e := newRelayEnv(t, d, func(c *config.Config) {
		c.Sweeper.MarkProcessed = false // as if the marks died with the process
		c.Sweeper.Maintain = false      // no other statement of the sweeper's reads the primary keys
	})
	e.start()
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.x', '{}' FROM generate_series(1, 5)`)
	relaytest.Eventually(t, 30*time.Second, "5 events published", func() bool { return e.streamMsgs("ORDERS") == 5 })
	e.stop()
	if n := d.int(`SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox_events'::regclass`); n != 9 {
		t.Fatalf("outbox_events has %d partitions, want 9", n)
	}
	var theirs []string
	rows, err := d.pool.Query(context.Background(), `SELECT DISTINCT tableoid::regclass::text FROM outbox_events WHERE topic = 'orders.x' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var p string
		if err := rows.Scan(&p); err != nil {
			t.Fatal(err)
		}
		theirs = append(theirs, p)
	}
	rows.Close()
	d.exec(`ANALYZE outbox_events`)
	d.exec(`SELECT pg_stat_reset()`)

	e.cfg.Sweeper.MarkProcessed = true
	e.start()
	relaytest.Eventually(t, 30*time.Second, "the 5 rows caught up at start", func() bool {
		return d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.x' AND processed`) == 5
	})
	e.stop() // the sweeper's backends exit and report their statistics
	scans := d.primaryKeyScans(theirs)
	if probed := slices.Sorted(maps.Keys(scans)); !slices.Equal(probed, theirs) {
		t.Fatalf("the read-back of 5 marks probed the primary key of %d partitions (index scans by partition: %v); want only the rows' own %v",
			len(probed), scans, theirs)
	}
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'filler' AND NOT processed`); n != 0 {
		t.Fatalf("%d filler rows touched", n)
	}
}

// Issue 34, item 6 (and item 5 on a real stream): the start read-back looks
// for this table's own messages. Two outbox tables publish into one stream,
// and the other table's messages are the newest, far more than the read-back
// wants (here 10 × 1 + 2 × 10 = 30, or the 40 unprocessed rows). The 20 rows
// of this table whose marks were lost must be marked after the restart: the
// read-back goes on to older messages until it has seen as many of this
// table's as it wants, or the stream's start. The other table's messages
// carry the ids of 20 rows of this table that were never delivered (inserted
// before the slot, which has no snapshot): those must stay unprocessed.
// Before the fix the read-back took the stream's newest 40 messages, all
// the other table's, and marked none of the 20 rows.
func TestStartReadBackFindsTheTablesRowsBehindAnotherTablesMessages(t *testing.T) {
	d := newDB(t, true)
	d.exec(`CREATE TABLE other_outbox (id uuid PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now(), processed boolean NOT NULL DEFAULT false, processed_at timestamptz)`)
	d.exec(`ALTER PUBLICATION walbox_outbox ADD TABLE other_outbox`)
	e := newRelayEnv(t, d, func(c *config.Config) {
		c.Outboxes = []config.OutboxEntry{{Outbox: config.Outbox{Table: "public.outbox_events"}, Default: true},
			{Outbox: config.Outbox{Table: "public.other_outbox"}}}
		c.Sweeper.MarkProcessed = false // as if the marks died with the process
		c.Sweeper.BatchSize = 1
		c.NATS.Window = 10
	})
	// Never delivered: committed before the slot, which has no snapshot.
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.never', '{}' FROM generate_series(1, 20)`)
	d.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, e.cfg.Postgres.Slot)
	e.start()
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.mine', '{}' FROM generate_series(1, 20)`)
	relaytest.Eventually(t, 30*time.Second, "this table's 20 events published", func() bool { return e.streamMsgs("ORDERS") == 20 })
	d.exec(`INSERT INTO other_outbox (id, topic, payload) SELECT id, 'orders.theirs', '{}' FROM outbox_events WHERE topic = 'orders.never'`)
	d.exec(`INSERT INTO other_outbox (id, topic, payload) SELECT gen_random_uuid(), 'orders.theirs', '{}' FROM generate_series(1, 280)`)
	relaytest.Eventually(t, 30*time.Second, "the other table's 300 events published", func() bool { return e.streamMsgs("ORDERS") == 320 })
	e.stop()

	e.cfg.Sweeper.MarkProcessed = true
	e.start()
	defer e.stop()
	relaytest.Eventually(t, 30*time.Second, "the other table's rows caught up at start", func() bool {
		return d.int(`SELECT count(*) FROM other_outbox WHERE processed`) == 300
	})
	mine := func() int64 {
		return d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.mine' AND processed`)
	}
	if !within(10*time.Second, func() bool { return mine() == 20 }) {
		t.Fatalf("%d of this table's 20 delivered rows marked after the restart, want 20", mine())
	}
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.never' AND processed`); n != 0 {
		t.Fatalf("%d never-delivered rows marked from the other table's messages with their ids", n)
	}
}

// Issue 34, item 6: the start read-back is sized by the table's own sweeper
// settings (outboxes[].sweeper.batch_size) where it has its own. A crash can
// leave up to its mark queue (10 × its batch_size) and the publish window
// unmarked, older than rows marked since: here 10 rows, behind 100 newer
// rows that are marked. With the table's batch_size of 100 the read-back
// covers 1,000 + 2 × 10 of its messages; with the global one (1) only 30,
// all marked already. Before the fix the 10 rows stayed unprocessed.
func TestStartReadBackFollowsTheTablesOwnBatchSize(t *testing.T) {
	d := newDB(t, true)
	e := newRelayEnv(t, d, func(c *config.Config) {
		c.Outboxes = []config.OutboxEntry{{Outbox: config.Outbox{Table: "public.outbox_events"},
			Sweeper: &config.TableSweeper{BatchSize: 100}}}
		c.Sweeper.MarkProcessed = false // as if the marks died with the process
		c.Sweeper.BatchSize = 1
		c.NATS.Window = 10
	})
	e.start()
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.lost', '{}' FROM generate_series(1, 10)`)
	d.exec(`INSERT INTO outbox_events (topic, payload) SELECT 'orders.later', '{}' FROM generate_series(1, 100)`)
	relaytest.Eventually(t, 30*time.Second, "110 events published", func() bool { return e.streamMsgs("ORDERS") == 110 })
	e.stop()
	// The newer rows' marks were written; the older ones' were lost.
	d.exec(`UPDATE outbox_events SET processed = true, processed_at = now() WHERE topic = 'orders.later'`)

	e.cfg.Sweeper.MarkProcessed = true
	e.start()
	defer e.stop()
	lost := func() int64 {
		return d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.lost' AND processed`)
	}
	if !within(10*time.Second, func() bool { return lost() == 10 }) {
		t.Fatalf("%d of the 10 rows marked after the restart, want 10", lost())
	}
}

// within polls cond until it holds or d has passed, and reports whether it
// held: for a failure that says how far things got.
func within(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); ; time.Sleep(50 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}
