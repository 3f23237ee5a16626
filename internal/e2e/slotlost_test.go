package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgtest"
)

// checkNoLoss is the checker without the order count: events republished
// after a slot loss go out in created_at order (README, "Guarantees").
func (e *env) checkNoLoss(w *outboxtest.Witness, res *outboxtest.Result) outboxtest.Report {
	e.t.Helper()
	ctx := context.Background()
	committed, err := w.Committed(ctx, e.conn())
	if err != nil {
		e.t.Fatal(err)
	}
	e.waitDelivered(len(committed), 90*time.Second)
	e.settled()
	streams, err := outboxtest.ReadStreams(ctx, e.js, e.streamNames()...)
	if err != nil {
		e.t.Fatal(err)
	}
	rep := outboxtest.Check(committed, res.RolledBack, streams)
	e.t.Logf("checker: %s", rep)
	if rep.Lost+rep.Duplicated+rep.FromRolledBack != 0 || rep.Checked == 0 {
		e.t.Fatalf("guarantees broken: %s", rep)
	}
	return rep
}

func TestSlotDroppedMidStreamIsRecreatedAndNothingIsLost(t *testing.T) {
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 3, MaxRows: 10, Rollback: 0.1, Rate: 30})
	time.Sleep(1500 * time.Millisecond) // pacing: the slot is dropped mid-load
	ctx := context.Background()
	dropped := false
	for i := 0; i < 50 && !dropped; i++ {
		_, _ = e.pool.Exec(ctx, "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'walbox' AND active")
		_, err := e.pool.Exec(ctx, "SELECT pg_drop_replication_slot('walbox')")
		dropped = err == nil
		if err != nil && !strings.Contains(err.Error(), "active") {
			t.Fatal(err)
		}
	}
	if !dropped {
		t.Fatal("could not drop the slot")
	}
	time.Sleep(2 * time.Second) // pacing: load goes on while the slot is recreated
	res := stop()
	e.checkNoLoss(w, res)
	if n := e.counter("walbox_slot_lost_total", map[string]string{"reason": "missing"}); n < 1 {
		t.Fatalf("walbox_slot_lost_total{reason=missing} = %v after the slot was dropped", n)
	}
	if n := e.counter("walbox_slot_lost_total", map[string]string{"reason": "invalidated"}); n != 0 {
		t.Fatalf("walbox_slot_lost_total{reason=invalidated} = %v for a dropped slot", n)
	}
}

func TestInvalidatedSlotIsRecreatedAndUnprocessedRowsRepublished(t *testing.T) {
	ctx := context.Background()
	cl := pgtest.StartOwn(ctx, t,
		pgtest.WithSetting("max_slot_wal_keep_size", "1MB"),
		pgtest.WithSetting("wal_keep_size", "0"),
		pgtest.WithSetting("synchronous_commit", "on"))
	e := envOn(t, cl, "invalidated")
	pool, url := e.pool, e.dbURL
	w := e.witness("outbox_events")
	r := e.startRelay()
	first := outboxtest.Load{Producers: 2, MaxRows: 10, Txns: 10}.Run(ctx, pool)
	e.waitDelivered(int(first.Committed.Load()), 30*time.Second)
	r.stop(t)

	// While walbox is away: rows wait, and enough WAL goes by that the
	// checkpoint removes what the slot needed.
	waiting := outboxtest.Load{Producers: 2, MaxRows: 10, Txns: 10}.Run(ctx, pool)
	for i := 0; i < 5; i++ {
		if _, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS filler (x text); INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 2000); SELECT pg_switch_wal()"); err != nil {
			t.Fatal(err)
		}
	}
	// The witness slot must survive; it is advanced past what it saw.
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	var status string
	if err := pool.QueryRow(ctx, "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'walbox'").Scan(&status); err != nil {
		t.Fatal(err)
	}
	if status != "lost" {
		t.Fatalf("slot wal_status = %q after the checkpoint, want lost (test setup)", status)
	}
	// PostgreSQL 17+ says why; walbox's slot status shows it.
	sc, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	sst, err := cdc.ReadSlotStatus(ctx, sc, "walbox")
	sc.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := cl.Version(); v >= 17 && sst.InvalidationReason != "wal_removed" {
		t.Fatalf("PostgreSQL %d: invalidation_reason %q, want wal_removed", v, sst.InvalidationReason)
	} else if v < 17 && sst.InvalidationReason != "" {
		t.Fatalf("PostgreSQL %d has no invalidation_reason, got %q", v, sst.InvalidationReason)
	}
	_ = w
	e.startRelay()
	// Every row of the table is unprocessed (no sweeper here), so all of
	// them are republished; JetStream drops the ones it already holds.
	ids := queryStrings(ctx, t, pool, "SELECT id::text FROM outbox_events ORDER BY created_at, id")
	if len(ids) != int(first.Committed.Load()+waiting.Committed.Load()) {
		t.Fatalf("table holds %d rows, want %d", len(ids), first.Committed.Load()+waiting.Committed.Load())
	}
	e.waitDelivered(len(ids), 60*time.Second)
	e.settled()
	streams, err := outboxtest.ReadStreams(ctx, e.js, e.streamNames()...)
	if err != nil {
		t.Fatal(err)
	}
	rep := outboxtest.Check(ids, append(first.RolledBack, waiting.RolledBack...), streams)
	t.Logf("after invalidation: %s", rep)
	if rep.Lost+rep.Duplicated+rep.FromRolledBack != 0 {
		t.Fatalf("guarantees broken: %s", rep)
	}
	if n := e.counter("walbox_slot_lost_total", map[string]string{"reason": "invalidated"}); n != 1 {
		t.Fatalf("walbox_slot_lost_total{reason=invalidated} = %v, want 1", n)
	}
	if n := e.counter("walbox_slot_lost_total", map[string]string{"reason": "missing"}); n != 0 {
		t.Fatalf("walbox_slot_lost_total{reason=missing} = %v for an invalidated slot", n)
	}
}
