package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

func TestConcurrentProducersArriveExactlyOnceInCommitOrder(t *testing.T) {
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	e.startRelay()
	res := outboxtest.Load{Producers: 8, MinRows: 1, MaxRows: 50, Rollback: 0.15, Txns: 40}.Run(context.Background(), e.pool)
	if len(res.RolledBack) == 0 {
		t.Fatal("load rolled nothing back; the test would not show G1")
	}
	rep := e.check(w, res)
	if rep.Checked < 5000 {
		t.Fatalf("only %d events checked", rep.Checked)
	}
	// The slot follows: once everything is acked, confirmed_flush_lsn
	// reaches the last commit.
	var cur string
	_ = e.pool.QueryRow(context.Background(), "SELECT pg_current_wal_lsn()::text").Scan(&cur)
	relaytest.Eventually(t, 15*time.Second, "confirmed_flush_lsn to reach "+cur+" after all events were acked", func() bool {
		return lsnAtLeast(e.slot().Confirmed.String(), cur)
	})
}
