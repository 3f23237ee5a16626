package e2e

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
)

// TestRestartAfterDuplicateWindowPublishesNoDuplicate stops the relay after
// JetStream acked but before the slot was confirmed, waits past a short
// duplicate window, and restarts: Nats-Msg-Id can no longer catch the
// resend, so only the resume check (last position per stream, read back
// from JetStream) keeps the stream free of duplicates.
func TestRestartAfterDuplicateWindowPublishesNoDuplicate(t *testing.T) {
	e := newMigratedEnv(t, func(c *config.Config) {
		c.Postgres.StatusInterval = 30 * time.Second // confirm as late as possible
		for i := range c.NATS.Streams {
			c.NATS.Streams[i].DuplicateWindow = time.Second
		}
	})
	w := e.witness("outbox_events")
	ctx := context.Background()
	total := 0
	for round := 0; round < 5; round++ {
		p := e.spawnRelay()
		var lsn string
		for i := 0; i < 100; i++ {
			if _, err := e.pool.Exec(ctx, "INSERT INTO outbox_events (topic, payload) VALUES ('orders.created', $1)", fmt.Sprintf(`{"round":%d,"i":%d}`, round, i)); err != nil {
				t.Fatal(err)
			}
		}
		total += 100
		_ = e.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn)
		e.waitDelivered(total, 30*time.Second)
		p.signal(t, syscall.SIGKILL)
		if !lsnAtLeast(e.slot().Confirmed.String(), lsn) {
			// Acked, not confirmed: exactly the case under test.
			time.Sleep(2500 * time.Millisecond) // past the 1s duplicate window
			e.spawnRelay()
			e.check(w, nil) // waits until the new relay is past every old event
			return
		}
		t.Logf("round %d: the slot was confirmed before the kill; trying again", round)
	}
	t.Fatal("could not stop the relay between ack and confirm in 5 rounds")
}
