package cdc

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/pgtest"
)

// After a failover the replication connection can reach the new primary
// before the lock's watcher notices that the lock's session on the old one
// is gone; a session started then (a slot recreated, a backfill begun) was
// cut short a moment later and redone. Check asks the lock's session at
// once: gone, it reports it and closes Lost, so no session starts.
func TestLeadershipCheckSeesALostSessionAtOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, url := pgtest.OwnDB(ctx, t)
	// A watcher that would take an hour to notice.
	l, err := AcquireLeadership(ctx, url, "walbox", time.Hour, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if err := l.Check(ctx); err != nil {
		t.Fatalf("a live lock's session: %v", err)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted`); err != nil {
		t.Fatal(err)
	}
	err = l.Check(ctx)
	if !errors.Is(err, errLeadershipLost) {
		t.Fatalf("Check after the lock's session was terminated: %v, want the leadership lost", err)
	}
	select {
	case <-l.Lost():
	default:
		t.Fatal("Lost not closed by Check")
	}
	if err := l.Check(ctx); !errors.Is(err, errLeadershipLost) {
		t.Fatalf("a second Check: %v", err)
	}
}
