package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/outboxtest"
)

// TestBackfillInterruptedByCrashIsRedone kills the relay while it publishes
// the rows of its first snapshot. The slot already exists then, and its
// stream starts after the snapshot: only the backfill marker tells the next
// start that those rows still have to go out.
func TestBackfillInterruptedByCrashIsRedone(t *testing.T) {
	e := newMigratedEnv(t)
	ctx := context.Background()
	const rows = 60000
	if _, err := e.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO outbox_events (topic, payload)
		SELECT 'orders.created', jsonb_build_object('n', g) FROM generate_series(1, %d) g`, rows)); err != nil {
		t.Fatal(err)
	}
	p := e.spawnRelay()
	// Kill once some, not all, of the backfill is stored.
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err := e.js.Stream(ctx, "ORDERS")
		if err == nil {
			if info, err := st.Info(ctx); err == nil && info.State.Msgs > 0 {
				if info.State.Msgs >= rows {
					t.Fatalf("backfill finished before the kill (%d stored): the test cannot interrupt it", info.State.Msgs)
				}
				t.Logf("killing the relay with %d of %d backfilled rows stored", info.State.Msgs, rows)
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("backfill did not start")
		}
		time.Sleep(5 * time.Millisecond) // polls fast: the kill must land mid-backfill
	}
	p.signal(t, syscall.SIGKILL)
	e.spawnRelay()
	ids := queryStrings(ctx, t, e.pool, "SELECT id::text FROM outbox_events ORDER BY created_at, id")
	e.waitDelivered(rows, 90*time.Second)
	streams, err := outboxtest.ReadStreams(ctx, e.js, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	rep := outboxtest.Check(ids, nil, streams)
	t.Logf("checker: %s", rep)
	if rep.Lost+rep.Duplicated != 0 {
		t.Fatalf("guarantees broken: %s", rep)
	}
}

// TestCleanStopRightAfterFirstStartDoesNotRedoTheBackfill: a SIGTERM just
// after the slot was created must leave no backfill marker behind when
// everything was confirmed, or the next start recreates the slot for nothing.
func TestCleanStopRightAfterFirstStartDoesNotRedoTheBackfill(t *testing.T) {
	e := newMigratedEnv(t)
	p := e.spawnRelay()
	// The slot shows active while it is being created; wait until the relay
	// streams, then stop it at once (before the marker's periodic upkeep).
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(p.output(), "replication started") {
		if time.Now().After(deadline) {
			t.Fatalf("relay did not start streaming:\n%s", p.output())
		}
		time.Sleep(2 * time.Millisecond) // polls fast: the stop must land before the marker's upkeep
	}
	if code := p.signal(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("exit %d", code)
	}
	var n int
	if err := e.pool.QueryRow(context.Background(), "SELECT count(*) FROM walbox.slot_backfill").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("walbox.slot_backfill holds %d rows after a clean stop of an idle first start", n)
	}
}

// TestBackfillKeepsInsertionOrderInsideTransactions: rows of one
// transaction share created_at (and xmin, and commit time); their ids are
// random. Republished from a snapshot they must still come out in the order
// they were inserted, statement by statement and row by row, and the
// transactions in commit order.
func TestBackfillKeepsInsertionOrderInsideTransactions(t *testing.T) {
	e := newMigratedEnv(t)
	ctx := context.Background()
	// Free space in earlier pages (as the sweeper's marks and vacuum leave
	// it), so the heap does not simply fill up in insertion order.
	for _, q := range []string{
		"INSERT INTO outbox_events (topic, payload, processed) SELECT 'orders.filler', '{}', true FROM generate_series(1, 3000)",
		"DELETE FROM outbox_events WHERE topic = 'orders.filler' AND random() < 0.5",
		"VACUUM outbox_events",
	} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	const txns, stmts, multi = 20, 20, 3 // every 5th statement inserts multi rows
	total := 0
	for tx := range txns {
		var sql strings.Builder
		sql.WriteString("BEGIN;")
		for i := range stmts {
			if i%5 == 4 {
				fmt.Fprintf(&sql, "INSERT INTO outbox_events (topic, payload) SELECT 'orders.created', jsonb_build_object('tx', %d, 'n', %d + g) FROM generate_series(0, %d) g;", tx, 100*i, multi-1)
				total += multi
				continue
			}
			fmt.Fprintf(&sql, "INSERT INTO outbox_events (topic, payload) VALUES ('orders.created', '{\"tx\": %d, \"n\": %d}');", tx, 100*i)
			total++
		}
		sql.WriteString("COMMIT;")
		if _, err := e.pool.Exec(ctx, sql.String()); err != nil {
			t.Fatal(err)
		}
	}
	e.startRelay()
	e.waitDelivered(total, 60*time.Second)
	st, err := e.js.Stream(ctx, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	lastTx, lastN := -1, -1
	for seq := uint64(1); seq <= uint64(total); seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		var v struct{ Tx, N int }
		if err := json.Unmarshal(m.Data, &v); err != nil {
			t.Fatal(err)
		}
		if v.Tx < lastTx || (v.Tx == lastTx && v.N <= lastN) {
			t.Fatalf("stream seq %d holds tx %d row %d after tx %d row %d: backfill order broken", seq, v.Tx, v.N, lastTx, lastN)
		}
		lastTx, lastN = v.Tx, v.N
	}
}
