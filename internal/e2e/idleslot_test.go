package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestIdleSlotTimeoutInvalidationIsRecovered: PostgreSQL 18 invalidates a
// slot that had no reader for idle_replication_slot_timeout. doctor warns
// about the setting; walbox, started again after longer than that, finds
// its slot invalidated ('idle_timeout'), says so, recreates it and
// republishes what waited. Before 18 there is no such setting: doctor says
// so, and the slot outlives the same pause.
func TestIdleSlotTimeoutInvalidationIsRecovered(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cl := pgtest.StartOwn(ctx, t, pgtest.WithSetting("synchronous_commit", "on"))
	v, err := cl.Version()
	if err != nil {
		t.Fatal(err)
	}
	if v >= 18 {
		if err := cl.Exec(ctx, "postgres", "ALTER SYSTEM SET idle_replication_slot_timeout = '1s'"); err != nil {
			t.Fatal(err)
		}
		if err := cl.Exec(ctx, "postgres", "SELECT pg_reload_conf()"); err != nil {
			t.Fatal(err)
		}
	}
	e := envOn(t, cl, "idle")
	pool := e.pool

	rep := ops.Doctor(ctx, e.cfg)
	var idle *ops.Check
	for i := range rep.Checks {
		if rep.Checks[i].Name == "postgres.idle_replication_slot_timeout" {
			idle = &rep.Checks[i]
		}
	}
	switch {
	case idle == nil:
		t.Fatal("doctor has no idle_replication_slot_timeout check")
	case v >= 18 && (idle.Status != ops.Warn || idle.Fix == ""):
		t.Fatalf("PostgreSQL %d with idle_replication_slot_timeout = 1s: doctor says %+v, want a warning with the fix", v, *idle)
	case v < 18 && idle.Status != ops.OK:
		t.Fatalf("PostgreSQL %d: doctor says %+v, want OK (no such setting)", v, *idle)
	}

	r := e.startRelay()
	first := outboxtest.Load{Producers: 2, MaxRows: 5, Txns: 5}.Run(ctx, pool)
	e.waitDelivered(int(first.Committed.Load()), 30*time.Second)
	r.stop(t)
	waiting := outboxtest.Load{Producers: 2, MaxRows: 5, Txns: 5}.Run(ctx, pool)
	time.Sleep(2 * time.Second) // longer than the timeout
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	sc, err := e.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	st, err := cdc.ReadSlotStatus(ctx, sc.Conn(), e.cfg.Postgres.Slot)
	sc.Release()
	if err != nil {
		t.Fatal(err)
	}
	if v >= 18 && st.InvalidationReason != "idle_timeout" {
		t.Fatalf("PostgreSQL %d: slot invalidation_reason %q after 2 s idle and a checkpoint, want idle_timeout", v, st.InvalidationReason)
	}
	if v < 18 && st.InvalidationReason != "" {
		t.Fatalf("PostgreSQL %d: slot invalidated (%s)", v, st.InvalidationReason)
	}

	e.startRelay()
	e.waitDelivered(int(first.Committed.Load()+waiting.Committed.Load()), 60*time.Second)
	want := 0.0
	if v >= 18 {
		want = 1
	}
	if n := e.counter("walbox_slot_lost_total", map[string]string{"reason": "invalidated"}); n != want {
		t.Fatalf("PostgreSQL %d: walbox_slot_lost_total{reason=invalidated} = %v, want %v", v, n, want)
	}
}

// envOn is a migrated env whose database, name, is on cluster cl (a cluster
// of the test's own, with settings the package cluster does not have).
func envOn(t *testing.T, cl *pgtest.Cluster, name string, mutate ...func(*config.Config)) *env {
	t.Helper()
	ctx := context.Background()
	url, err := cl.CreateDB(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, append([]func(*config.Config){func(c *config.Config) { c.Postgres.URL = url }}, mutate...)...)
	e.dbURL = url
	e.pool = relaytest.Pool(t, url)
	e.migrate()
	return e
}
