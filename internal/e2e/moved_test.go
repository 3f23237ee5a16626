package e2e

import (
	"context"
	"fmt"
	"net/url"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	walboxsql "github.com/walbox/walbox/sql"
)

// secondCluster starts another PostgreSQL cluster with a database of the
// same name as e's: what walbox meets after a restore to a new cluster, or
// a shard that reuses the names.
func (e *env) secondCluster() (*pgtest.Cluster, string) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	b := pgtest.StartOwn(ctx, e.t, pgtest.WithSetting("synchronous_commit", "on"), pgtest.WithSetting("wal_sender_timeout", "5s"))
	u, err := url.Parse(e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	bURL, err := b.CreateDB(ctx, u.Path[1:])
	if err != nil {
		e.t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, bURL)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{Publication: e.cfg.Postgres.Publication}); err != nil {
		e.t.Fatal(err)
	}
	return b, bURL
}

func insertEvents(t *testing.T, dbURL, prefix string, n int) []string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var ids []string
	for i := range n {
		var id string
		if err := conn.QueryRow(ctx, `INSERT INTO outbox_events (topic, payload) VALUES ('orders.created', $1) RETURNING id::text`,
			fmt.Sprintf(`{"n":"%s-%d"}`, prefix, i)).Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	return ids
}

// TestMovedClusterEventsAreNotSkipped: walbox ran against cluster A, whose
// WAL is far ahead, then the same config meets cluster B (a restore, a new
// cluster, a shard with the same names). B's events have lower positions
// than everything the stream holds of "this" source; none may be taken for
// already stored.
func TestMovedClusterEventsAreNotSkipped(t *testing.T) {
	e := newMigratedEnv(t)
	_, bURL := e.secondCluster()

	ctx := context.Background()
	conn := e.conn()
	for range 40 { // push A's WAL well past B's
		if _, err := conn.Exec(ctx, "INSERT INTO outbox_events (topic, payload, processed) VALUES ('orders.filler', '{}', true); SELECT pg_switch_wal()"); err != nil {
			t.Fatal(err)
		}
	}
	r := e.startRelay()
	aIDs := insertEvents(t, e.dbURL, "a", 20)
	e.waitDelivered(len(aIDs), 30*time.Second)
	r.stop(t)

	e.cfg.Postgres.URL = bURL
	r = e.startRelay()
	bIDs := insertEvents(t, bURL, "b", 20)
	e.waitDelivered(len(aIDs)+len(bIDs), 30*time.Second)
	r.stop(t)

	ids := e.storedIDs("ORDERS")
	for _, id := range append(aIDs, bIDs...) {
		if ids[id] != 1 {
			t.Fatalf("event %s stored %d times", id, ids[id])
		}
	}
}

// storedIDs counts the Nats-Msg-Ids a stream holds.
func (e *env) storedIDs(stream string) map[string]int {
	e.t.Helper()
	got := map[string]int{}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, info := e.stream(ctx, stream)
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		got[m.Header.Get("Nats-Msg-Id")]++
	}
	return got
}

// slotActiveOn reports whether a walsender streams from slot on the server
// of dbURL.
func slotActiveOn(ctx context.Context, dbURL, slot string) bool {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return false
	}
	defer conn.Close(ctx)
	var active bool
	_ = conn.QueryRow(ctx, "SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&active)
	return active
}

func waitSlotOn(t *testing.T, dbURL, slot string, p *proc) {
	t.Helper()
	defer func() {
		if t.Failed() {
			t.Logf("relay output:\n%s", p.output())
		}
	}()
	relaytest.Eventually(t, 60*time.Second, "the relay to stream from "+dbURL, func() bool {
		if !p.running() {
			t.Fatal("relay exited")
		}
		return slotActiveOn(context.Background(), dbURL, slot)
	})
}

// TestSlotRecreatedOnAnotherClusterRedoesACutBackfill: walbox streams from
// cluster A (WAL far ahead), A goes away and the multi-host URL lands on
// cluster B, which has no slot and rows waiting. walbox recreates the slot
// there and backfills; the relay is killed before any backfilled row is
// acked. What was confirmed on A must not count on B: the backfill marker
// stays, and the next start redoes the backfill.
func TestSlotRecreatedOnAnotherClusterRedoesACutBackfill(t *testing.T) {
	e := newEnv(t)
	a, aURL := e.secondCluster()
	b, bURL := e.secondCluster()
	u, _ := url.Parse(aURL)
	e.cfg.Postgres.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d%s?sslmode=disable", a.Port(), b.Port(), u.Path)
	ctx := context.Background()
	ac, err := pgx.Connect(ctx, aURL)
	if err != nil {
		t.Fatal(err)
	}
	for range 40 {
		if _, err := ac.Exec(ctx, "INSERT INTO outbox_events (topic, payload, processed) VALUES ('orders.filler', '{}', true); SELECT pg_switch_wal()"); err != nil {
			t.Fatal(err)
		}
	}
	ac.Close(ctx)

	p := e.startProc()
	waitSlotOn(t, aURL, e.cfg.Postgres.Slot, p)
	aIDs := insertEvents(t, aURL, "a", 10)
	e.waitDelivered(len(aIDs), 30*time.Second)

	bIDs := insertEvents(t, bURL, "b", 50) // waiting on B: the backfill's work
	e.nats.Stop()                          // nothing of B's backfill can be acked
	if err := a.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	waitSlotOn(t, bURL, e.cfg.Postgres.Slot, p)
	bc, err := pgx.Connect(ctx, bURL)
	if err != nil {
		t.Fatal(err)
	}
	defer bc.Close(ctx)
	// The marker is cleared on a 200 ms tick once the confirmed position
	// covers the backfill. Give a wrong one time to act, measured by the
	// relay itself: two standby status updates (one status interval, 1 s)
	// reach B after it streams from there.
	replies := map[string]bool{}
	relaytest.Eventually(t, 30*time.Second, "two status updates from the relay on B", func() bool {
		var at string
		err := bc.QueryRow(ctx, `SELECT coalesce(reply_time::text, '') FROM pg_stat_replication
			WHERE pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1)`, e.cfg.Postgres.Slot).Scan(&at)
		if err == nil && at != "" {
			replies[at] = true
		}
		return len(replies) >= 3
	})
	var markers int
	if err := bc.QueryRow(ctx, "SELECT count(*) FROM walbox.slot_backfill WHERE slot_name = $1", e.cfg.Postgres.Slot).Scan(&markers); err != nil {
		t.Fatal(err)
	}
	if markers != 1 {
		t.Fatalf("backfill marker on B gone before any backfilled row was acked (cluster A's confirmed position counted on B)\n%s", p.output())
	}
	p.signal(t, syscall.SIGKILL)

	if err := e.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	p = e.startProc()
	e.waitDelivered(len(aIDs)+len(bIDs), 60*time.Second)
	ids := e.storedIDs("ORDERS")
	for _, id := range append(aIDs, bIDs...) {
		if ids[id] != 1 {
			t.Fatalf("event %s stored %d times\n%s", id, ids[id], p.output())
		}
	}
}
