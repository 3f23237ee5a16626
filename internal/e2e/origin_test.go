package e2e

import (
	"context"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
	walboxsql "github.com/walbox/walbox/sql"
)

// TestOriginNoneSkipsRowsASubscriptionApplied: in a bidirectional set-up
// rows arrive in the outbox through a logical replication subscription;
// their own walbox publishes them. With postgres.origin: none (PostgreSQL
// 16+) walbox publishes only rows written here. Before 16 the setting is
// refused with the fix.
func TestOriginNoneSkipsRowsASubscriptionApplied(t *testing.T) {
	v, err := s.pg.Version()
	if err != nil {
		t.Fatal(err)
	}
	e := newMigratedEnv(t, func(c *config.Config) { c.Postgres.Origin = "none" })
	if v < 16 {
		e.runExits(e.dbURL, "postgres.origin: none needs PostgreSQL 16", "postgres.origin: any")
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Database b writes its own outbox, replicated into e's by a subscription.
	bURL := s.pg.NewDB(t)
	relaytest.Migrate(t, bURL, walboxsql.Params{Publication: "b_walbox"})
	relaytest.Exec(t, bURL,
		"CREATE PUBLICATION to_a FOR TABLE outbox_events WITH (publish = 'insert', publish_via_partition_root = true)",
		"SELECT pg_create_logical_replication_slot('to_a', 'pgoutput')",
	)
	bu, _ := url.Parse(bURL)
	if _, err := e.pool.Exec(ctx, fmt.Sprintf(`CREATE SUBSCRIPTION from_b CONNECTION 'host=127.0.0.1 port=%d dbname=%s user=postgres'
		PUBLICATION to_a WITH (create_slot = false, slot_name = 'to_a', copy_data = false)`, s.pg.Port(), bu.Path[1:])); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range []string{"ALTER SUBSCRIPTION from_b DISABLE", "ALTER SUBSCRIPTION from_b SET (slot_name = NONE)", "DROP SUBSCRIPTION from_b"} {
			_, _ = e.pool.Exec(context.Background(), q)
		}
	})
	e.startRelay()
	mine := insertEvents(t, e.dbURL, "a", 5)
	applied := insertEvents(t, bURL, "b", 5)
	relaytest.Eventually(t, 60*time.Second, "the subscription to apply b's rows", func() bool {
		var n int
		_ = e.pool.QueryRow(ctx, "SELECT count(*) FROM outbox_events WHERE payload->>'n' LIKE 'b-%'").Scan(&n)
		return n == len(applied)
	})
	// A row written here after them: once it is stored, the applied rows
	// before it in the WAL were passed over, not just not yet published.
	mine = append(mine, insertEvents(t, e.dbURL, "a-after", 1)...)
	e.waitDelivered(len(mine), 30*time.Second)
	ids := e.storedIDs("ORDERS")
	for _, id := range mine {
		if ids[id] != 1 {
			t.Fatalf("row %s written here stored %d times", id, ids[id])
		}
	}
	for _, id := range applied {
		if ids[id] != 0 {
			t.Fatalf("row %s applied by the subscription was published with origin none", id)
		}
	}
}
