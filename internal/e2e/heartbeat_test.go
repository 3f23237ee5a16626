package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestIdleOutboxRetainsNoWALWhileAnotherDatabaseWrites: the outbox is idle,
// another database of the cluster writes heavily; the heartbeat keeps the
// slot moving, so retained WAL stays small.
func TestIdleOutboxRetainsNoWALWhileAnotherDatabaseWrites(t *testing.T) {
	e := newMigratedEnv(t, func(c *config.Config) { c.Postgres.HeartbeatInterval = 2 * time.Second })
	e.startRelay()
	ctx := context.Background()
	otherURL := s.pg.NewDB(t)
	other, err := pgxpool.New(ctx, otherURL)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := other.Exec(ctx, "CREATE TABLE busy (id bigserial primary key, pad text)"); err != nil {
		t.Fatal(err)
	}
	var written, maxRetained int64
	start := time.Now()
	var startLSN string
	_ = e.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&startLSN)
	// Many small transactions, as an OLTP database writes. restart_lsn can
	// only move at the running-transactions records PostgreSQL logs every
	// 15 s, so retained WAL is bounded by about 15 s of writing.
	txns := 0
	// The heartbeat fires once the slot has not moved for 2 s, and status
	// updates go out every second: any WAL position is confirmed within a
	// few seconds, however fast the other database writes. Judge that by
	// time, not by a byte count that grows with the write rate.
	type sample struct {
		at  time.Time
		lsn int64
	}
	var samples []sample
	const within = 8 * time.Second
	var worst time.Duration
	for time.Since(start) < 30*time.Second {
		for i := 0; i < 50; i++ {
			if _, err := other.Exec(ctx, "INSERT INTO busy (pad) VALUES (repeat('x', 100))"); err != nil {
				t.Fatal(err)
			}
			txns++
		}
		var retained, current, confirmed int64
		if err := e.pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,
			pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')::bigint
			FROM pg_replication_slots WHERE slot_name = 'walbox'`).Scan(&retained, &current, &confirmed); err != nil {
			t.Fatal(err)
		}
		now := time.Now()
		samples = append(samples, sample{now, current})
		// The oldest position not yet confirmed: how long ago was it written?
		for _, sm := range samples {
			if sm.lsn > confirmed {
				worst = max(worst, now.Sub(sm.at))
				break
			}
		}
		if time.Since(start) > 20*time.Second {
			maxRetained = max(maxRetained, retained) // once the first heartbeats and snapshots went by
		}
	}
	_ = e.pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint", startLSN).Scan(&written)
	t.Logf("another database committed %d transactions, %.1f MB of WAL in 30 s; the idle outbox's slot retained at most %.2f MB (last 10 s), and confirmed every position within %v of its writing",
		txns, float64(written)/1e6, float64(maxRetained)/1e6, worst.Round(10*time.Millisecond))
	// Retention: restart_lsn can move only at a running-transactions record,
	// which PostgreSQL writes every 15 s while there is activity, or at a
	// checkpoint, and only to before the oldest transaction running in the
	// whole cluster then. Whether the bgwriter's records fell in the window
	// is PostgreSQL's timing, not walbox's: ask for one with a checkpoint,
	// then wait for the slot to release the WAL written before it.
	var mark string
	if err := e.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&mark); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 30*time.Second, "the idle outbox's slot to let go of the WAL from before a checkpoint", func() bool {
		var released bool
		if _, err := other.Exec(ctx, "INSERT INTO busy (pad) VALUES ('x')"); err != nil {
			t.Fatal(err)
		}
		if err := e.pool.QueryRow(ctx, `SELECT restart_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = 'walbox'`, mark).Scan(&released); err != nil {
			t.Fatal(err)
		}
		return released
	})
	if worst > within {
		t.Fatalf("a WAL position waited %v to be confirmed while the outbox was idle (heartbeat 2 s, status every 1 s)", worst)
	}
}
