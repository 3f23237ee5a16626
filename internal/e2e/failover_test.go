package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgtest"
	walboxsql "github.com/walbox/walbox/sql"
)

// TestPromotedSyncStandbyLosesNothing is the failover before PostgreSQL 17:
// a synchronous standby (a cold copy), 8 producers, kill -9 of the primary
// mid-load and pg_ctl promote. walbox is given both hosts with
// target_session_attrs=read-write; on the promoted standby its slot does not
// exist, so it recreates it and republishes the unprocessed rows. Every row
// the new primary holds must be in the stream once, and each producer's
// events in the order it wrote them. Events the stream holds that the new
// primary lost (decoded on the old primary before the standby confirmed
// them) are counted apart.
func TestPromotedSyncStandbyLosesNothing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	primary, err := pgtest.Start(ctx, pgtest.WithSetting("synchronous_commit", "on"),
		pgtest.WithSetting("wal_sender_timeout", "5s"), pgtest.WithSetting("track_commit_timestamp", "on"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { primary.Close() })
	pURL, err := primary.CreateDB(ctx, "app")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, pURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{Publication: "walbox"}); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	standby, err := primary.Standby(ctx, "walbox_standby")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Close() })
	if err := primary.Exec(ctx, "postgres", "ALTER SYSTEM SET synchronous_standby_names = 'walbox_standby'"); err != nil {
		t.Fatal(err)
	}
	if err := primary.Exec(ctx, "postgres", "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, "the standby to be synchronous", func() bool {
		c, err := pgx.Connect(ctx, primary.URL("postgres"))
		if err != nil {
			return false
		}
		defer c.Close(ctx)
		var n int
		_ = c.QueryRow(ctx, "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'walbox_standby' AND sync_state = 'sync'").Scan(&n)
		return n == 1
	})

	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/app?sslmode=disable&target_session_attrs=read-write", primary.Port(), standby.Port())
	e := newEnv(t)
	e.cfg.Postgres.URL, e.dbURL = both, both
	pool, err := pgxpool.New(ctx, both)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e.pool = pool
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 8, MaxRows: 10, Rollback: 0.1, Rate: 20})
	time.Sleep(3 * time.Second)
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 60*time.Second, "walbox to stream from the promoted standby", func() bool {
		c, err := pgx.Connect(ctx, standby.URL("app"))
		if err != nil {
			return false
		}
		defer c.Close(ctx)
		var active bool
		_ = c.QueryRow(ctx, "SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = 'walbox'").Scan(&active)
		return active
	})
	resumed := time.Since(promoted)
	time.Sleep(3 * time.Second) // load goes on against the new primary
	res := stop()

	// What committed is what the new primary holds (a synchronous standby
	// has every commit a producer saw succeed).
	c, err := pgx.Connect(ctx, standby.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	rows, err := c.Query(ctx, "SELECT id::text FROM outbox_events")
	if err != nil {
		t.Fatal(err)
	}
	held, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	e.waitDelivered(len(held), 60*time.Second)
	time.Sleep(300 * time.Millisecond)
	onNew := map[string]bool{}
	for _, id := range held {
		onNew[id] = true
	}
	rolledBack := map[string]bool{}
	for _, id := range res.RolledBack {
		rolledBack[id] = true
	}
	seen := map[string]int{}
	var lostByNewPrimary, outOfOrder, fromRolledBack, republished int
	for _, name := range e.streamNames() {
		// Order is per stream: each producer's events in the order written.
		lastByProducer := map[int]string{}
		lastHdr := map[int]string{}
		st, err := e.js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		info, err := st.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
			m, err := st.GetMsg(ctx, seq)
			if err != nil {
				t.Fatal(err)
			}
			id := m.Header.Get("Nats-Msg-Id")
			seen[id]++
			if m.Header.Get("Walbox-Commit-Lsn") == "0/0" {
				republished++
			}
			switch {
			case rolledBack[id]:
				fromRolledBack++
			case !onNew[id]:
				lostByNewPrimary++
			}
			var p struct{ Producer int }
			if err := json.Unmarshal(m.Data, &p); err != nil {
				t.Fatal(err)
			}
			// uuid v7 ids grow with each producer's inserts.
			if last := lastByProducer[p.Producer]; last != "" && strings.Compare(id, last) < 0 {
				outOfOrder++
				if outOfOrder <= 3 {
					t.Logf("producer %d: %s (seq %d, commit %s #%s) after %s (%s)", p.Producer, id, seq, m.Header.Get("Walbox-Commit-Lsn"),
						m.Header.Get("Walbox-Txn-Index"), last, lastHdr[p.Producer])
				}
			}
			lastByProducer[p.Producer] = id
			lastHdr[p.Producer] = fmt.Sprintf("seq %d, commit %s #%s", seq, m.Header.Get("Walbox-Commit-Lsn"), m.Header.Get("Walbox-Txn-Index"))
		}
	}
	var lost, dup int
	for _, id := range held {
		switch n := seen[id]; {
		case n == 0:
			lost++
		case n > 1:
			dup++
		}
	}
	t.Logf("promotion: %d events checked on the new primary, lost %d, duplicated %d, out of order per producer %d, republished from the snapshot %d; "+
		"in the stream but lost by the new primary %d; walbox streamed from the promoted standby %.1f s after pg_ctl promote returned",
		len(held), lost, dup, outOfOrder, republished, lostByNewPrimary, resumed.Seconds())
	if lost+dup+outOfOrder+fromRolledBack != 0 || len(held) == 0 {
		t.Fatalf("guarantees broken: lost %d, duplicated %d, out of order %d, from rolled-back transactions %d", lost, dup, outOfOrder, fromRolledBack)
	}
}

func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
