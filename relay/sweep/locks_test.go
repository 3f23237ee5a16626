package sweep_test

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/walbox/walbox/relay/sweep"
)

// producerApp is the application_name of the test's producers.
const producerApp = "walbox-test-producer"

// lockWatch runs producers inserting into today's partition and watches
// pg_locks: every time a producer waits for a lock that a sweeper backend
// holds or waits for ahead of it, that is a violation.
type lockWatch struct {
	t        *testing.T
	inserts  atomic.Int64
	maxWait  atomic.Int64 // µs, the slowest INSERT+COMMIT
	mu       sync.Mutex
	blocked  []string // what each violation looked like
	stop     context.CancelFunc
	wg       sync.WaitGroup
	watching atomic.Bool
}

func (d *db) watchProducers(producers int) *lockWatch {
	d.t.Helper()
	u, err := url.Parse(d.url)
	if err != nil {
		d.t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", producerApp)
	u.RawQuery = q.Encode()
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		d.t.Fatal(err)
	}
	cfg.MaxConns = int32(producers)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		d.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &lockWatch{t: d.t, stop: cancel}
	for range producers {
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			for ctx.Err() == nil {
				start := time.Now()
				_, err := pool.Exec(ctx, `INSERT INTO outbox_events (topic, payload) VALUES ('orders.live', '{}')`)
				if err != nil {
					if ctx.Err() == nil {
						d.t.Errorf("producer insert: %v", err)
					}
					return
				}
				w.inserts.Add(1)
				us := time.Since(start).Microseconds()
				for {
					old := w.maxWait.Load()
					if us <= old || w.maxWait.CompareAndSwap(old, us) {
						break
					}
				}
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		for ctx.Err() == nil {
			if w.watching.Load() {
				rows, err := d.pool.Query(ctx, `
					SELECT p.pid, p.query, b.pid, b.query, b.wait_event_type IS NOT DISTINCT FROM 'Lock'
					FROM pg_stat_activity p, unnest(pg_blocking_pids(p.pid)) AS bp(pid)
					JOIN pg_stat_activity b ON b.pid = bp.pid
					WHERE p.application_name = $1 AND p.wait_event_type = 'Lock' AND b.application_name = $2`,
					producerApp, sweep.ApplicationName)
				if err == nil {
					for rows.Next() {
						var pp, bp int
						var pq, bq string
						var bWaits bool
						if rows.Scan(&pp, &pq, &bp, &bq, &bWaits) == nil {
							w.mu.Lock()
							w.blocked = append(w.blocked, fmt.Sprintf("producer %d (%s) waits behind sweeper %d (%s, itself waiting: %v)", pp, pq, bp, bq, bWaits))
							w.mu.Unlock()
						}
					}
					rows.Close()
				}
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	d.t.Cleanup(func() { w.close(); pool.Close() })
	return w
}

func (w *lockWatch) close() {
	w.stop()
	w.wg.Wait()
}

// violations are the distinct waits seen (the first few).
func (w *lockWatch) violations() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := slices.Compact(slices.Clone(w.blocked))
	return out[:min(len(out), 5)]
}

// holdReader holds ACCESS SHARE on the outbox and all its partitions until
// release is closed, as pg_dump does for the whole of a dump; it returns at
// once and closes done when the reader has ended. The reader ends when the
// test says, not after a time: on a loaded machine a maintenance run can
// outlast any fixed hold, and would then do, legitimately, what the test
// says it must not do "during the reader".
func (d *db) holdReader(release <-chan struct{}) (done chan struct{}) {
	d.t.Helper()
	conn, err := pgx.Connect(context.Background(), d.url)
	if err != nil {
		d.t.Fatal(err)
	}
	tx, err := conn.Begin(context.Background())
	if err != nil {
		d.t.Fatal(err)
	}
	if _, err := tx.Exec(context.Background(), `LOCK TABLE outbox_events IN ACCESS SHARE MODE`); err != nil {
		d.t.Fatal(err)
	}
	done = make(chan struct{})
	go func() {
		defer close(done)
		<-release
		tx.Commit(context.Background())
		conn.Close(context.Background())
	}()
	return done
}

// While a reader holds ACCESS SHARE on the outbox (a pg_dump, a report, a
// backfill's snapshot), the sweeper's maintenance (partitions ahead,
// archival) never makes a producer's INSERT into today's partition wait:
// no producer waits for a lock behind a sweeper backend. What needs the
// reader gone is done after it ends. Before, ensure_partitions queued its
// ACCESS EXCLUSIVE lock behind the reader and every INSERT queued behind
// it until the reader ended (and the archival's DETACH did the same for up
// to lock_timeout, then failed).
func TestMaintenanceNeverQueuesInsertsBehindItsLocks(t *testing.T) {
	d := newDB(t, true)
	var ahead string
	if err := d.pool.QueryRow(context.Background(), `SELECT 'outbox_events_p' || to_char(now() + interval '3 days', 'YYYYMMDD')`).Scan(&ahead); err != nil {
		t.Fatal(err)
	}
	d.exec(`DROP TABLE ` + ahead)
	old := d.oldPartition(3, 2000, true)
	sw := d.sweeper(func(c *sweep.Config) { c.Archive.After = 24 * time.Hour })

	w := d.watchProducers(4)
	time.Sleep(100 * time.Millisecond)
	w.watching.Store(true)
	release := make(chan struct{})
	readerDone := d.holdReader(release)
	time.Sleep(100 * time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	started := time.Now()
	rep, err := sw.Maintain(ctx, sweep.MaintainOptions{})
	took := time.Since(started)
	close(release)
	<-readerDone
	w.watching.Store(false)
	t.Logf("maintenance during the reader took %v: %+v (err %v)", took.Round(time.Millisecond), rep, err)
	if v := w.violations(); len(v) > 0 {
		t.Errorf("producers waited behind the sweeper's locks (slowest INSERT %v):\n%v", time.Duration(w.maxWait.Load())*time.Microsecond, v)
	}
	if !d.bool(`SELECT to_regclass($1) IS NOT NULL`, ahead) {
		t.Errorf("partition %s was not created while the reader held its lock (ATTACH does not conflict with readers)", ahead)
	}

	if len(rep.Postponed) != 1 || rep.Postponed[0].Object != old {
		t.Errorf("postponed %+v; want the archival of %s (its detach waits for the reader's transaction)", rep.Postponed, old)
	}
	// The concurrent detach's first transaction is done: no new query sees
	// the partition; FINALIZE is left for the next run.
	if !d.bool(`SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass($1)`, old) || d.journalState(old) != "detaching" {
		t.Errorf("%s: detach pending %v, journal %q; want pending and detaching", old,
			d.bool(`SELECT coalesce((SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass($1)), false)`, old), d.journalState(old))
	}

	// After the reader: what waited for it is done.
	rep, err = sw.Maintain(ctx, sweep.MaintainOptions{})
	if err != nil {
		t.Fatalf("maintenance after the reader: %v (%+v)", err, rep)
	}
	if parent := d.parentOf(old); parent != "walbox.outbox_events_archive" || !slices.Contains(rep.Resumed, old) {
		t.Errorf("%s belongs to %q after the reader ended (resumed %v), want the archive, by FINALIZE", old, parent, rep.Resumed)
	}
	w.close()
	t.Logf("%d inserts, slowest INSERT+COMMIT %v", w.inserts.Load(), time.Duration(w.maxWait.Load())*time.Microsecond)
}

// An older walbox's default partition holding rows (a range no partition
// took): while a reader holds the outbox, moving the rows and removing the
// emptied default are postponed, and no producer waits; once the reader
// has ended, the rows have partitions of their own and the default is gone.
// Before, the move detached the default under ACCESS EXCLUSIVE on the outbox.
func TestOlderDefaultPartitionIsEmptiedAndRemovedWithoutStallingInserts(t *testing.T) {
	d := newDB(t, true)
	d.exec(`CREATE TABLE outbox_events_default PARTITION OF outbox_events DEFAULT`)
	d.exec(`INSERT INTO outbox_events (topic, payload, created_at, processed) VALUES
		('orders.future', '{}', now() + interval '40 days', true), ('orders.past', '{}', now() - interval '40 days', false)`)
	sw := d.sweeper()

	w := d.watchProducers(4)
	time.Sleep(100 * time.Millisecond)
	w.watching.Store(true)
	release := make(chan struct{})
	readerDone := d.holdReader(release)
	time.Sleep(1200 * time.Millisecond) // the reader's transaction is older than a second
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rep, err := sw.Maintain(ctx, sweep.MaintainOptions{})
	close(release)
	<-readerDone
	w.watching.Store(false)
	t.Logf("during the reader: %+v (err %v)", rep, err)
	if v := w.violations(); len(v) > 0 {
		t.Errorf("producers waited behind the sweeper's locks:\n%v", v)
	}
	if d.int(`SELECT count(*) FROM outbox_events_default`) != 2 || rep.DefaultRemoved != "" {
		t.Errorf("the default partition changed while the reader held it: report %+v", rep)
	}
	if len(rep.Postponed) == 0 {
		t.Errorf("nothing postponed while the reader held the default partition: %+v", rep)
	}

	rep, err = sw.Maintain(ctx, sweep.MaintainOptions{})
	if err != nil {
		t.Fatalf("maintenance after the reader: %v (%+v)", err, rep)
	}
	if len(rep.Moved) != 2 || rep.DefaultRemoved != "public.outbox_events_default" {
		t.Fatalf("after the reader: moved %+v, default removed %q; want 2 ranges and the default", rep.Moved, rep.DefaultRemoved)
	}
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE topic IN ('orders.future', 'orders.past')`); n != 2 {
		t.Errorf("%d of the 2 moved rows are in the outbox", n)
	}
	if !d.bool(`SELECT NOT processed FROM outbox_events WHERE topic = 'orders.past'`) {
		t.Error("the moved unprocessed row lost its flag")
	}
}

// A row that arrives in a partition between the unprocessed count and the
// detach (a producer writing an old created_at) is found by the count after
// the detach, and the partition goes back into the outbox: its row is marked
// and a backfill finds it as before, instead of sitting unprocessed in the
// archive.
func TestRowArrivingDuringConcurrentDetachPutsThePartitionBack(t *testing.T) {
	d := newDB(t, true)
	old := d.oldPartition(3, 100, true)
	sw := d.sweeper(func(c *sweep.Config) { c.Archive.After = 24 * time.Hour })
	sweep.SetCrashAt(func(step string) error {
		if step == "detaching" {
			d.exec(`INSERT INTO outbox_events (topic, payload, created_at) VALUES ('orders.late', '{}', now() - interval '3 days')`)
		}
		return nil
	})
	defer sweep.SetCrashAt(nil)
	rep := maintain(t, sw)
	if len(rep.Blocked) != 1 || rep.Blocked[0].Partition != old || rep.Blocked[0].Unprocessed != 1 || len(rep.Archived) != 0 {
		t.Fatalf("report %+v; want %s blocked by the row that arrived", rep, old)
	}
	if parent := d.parentOf(old); parent != "outbox_events" || d.journalState(old) != "" {
		t.Fatalf("%s belongs to %q (journal %q); want it back in the outbox, out of the journal", old, parent, d.journalState(old))
	}
	if n := d.int(`SELECT count(*) FROM outbox_events WHERE topic = 'orders.late' AND NOT processed`); n != 1 {
		t.Fatalf("the late row is not visible through the outbox (%d)", n)
	}
}
