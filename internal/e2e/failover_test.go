package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgcluster"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
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
//
// With an asynchronous standby (sync=false) the new primary may lack the
// last commits: every event it holds must still be delivered once and in
// order, and what the stream holds beyond it is reported.
func TestPromotedSyncStandbyLosesNothing(t *testing.T) {
	for _, sync := range []bool{true, false} {
		name := "synchronous"
		if !sync {
			name = "asynchronous"
		}
		t.Run(name, func(t *testing.T) { testPromotion(t, sync) })
	}
}

func testPromotion(t *testing.T, sync bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	primary, _ := startPrimary(ctx, t)
	standby, err := primary.Standby(ctx, pgcluster.StandbyOptions{ApplicationName: "walbox_standby"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Close() })
	syncNames := "walbox_standby"
	if !sync {
		syncNames = ""
	}
	if err := primary.Exec(ctx, "postgres", "ALTER SYSTEM SET synchronous_standby_names = '"+syncNames+"'"); err != nil {
		t.Fatal(err)
	}
	if err := primary.Exec(ctx, "postgres", "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 30*time.Second, "the standby to stream", func() bool {
		c, err := pgx.Connect(ctx, primary.URL("postgres"))
		if err != nil {
			return false
		}
		defer c.Close(ctx)
		var n int
		_ = c.QueryRow(ctx, "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'walbox_standby' AND sync_state = $1", map[bool]string{true: "sync", false: "async"}[sync]).Scan(&n)
		return n == 1
	})

	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/app?sslmode=disable&target_session_attrs=read-write", primary.Port(), standby.Port())
	e := newEnv(t)
	e.cfg.Postgres.URL, e.dbURL = both, both
	e.pool = relaytest.Pool(t, both)
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 8, MaxRows: 10, Rollback: 0.1, Rate: 20})
	time.Sleep(3 * time.Second) // pacing: the failover lands mid-load
	st := e.failOverUnderLoad(ctx, "promotion", primary, standby, stop)
	if st.lost+st.dup+st.outOfOrder+st.fromRolledBack != 0 || st.checked == 0 {
		t.Fatalf("guarantees broken: lost %d, duplicated %d, out of order %d, from rolled-back transactions %d", st.lost, st.dup, st.outOfOrder, st.fromRolledBack)
	}
}

// failOverUnderLoad fails over from primary to standby while the load
// goes on, stops the load, and checks what the promoted standby holds.
func (e *env) failOverUnderLoad(ctx context.Context, what string, primary *pgtest.Cluster, standby *pgcluster.Cluster, stop func() *outboxtest.Result) promotionStats {
	e.t.Helper()
	resumed := failOver(ctx, e.t, primary, standby)
	time.Sleep(3 * time.Second) // pacing: load goes on against the new primary
	res := stop()
	st := e.checkPromotion(ctx, standby.URL("app"), res)
	e.t.Logf("%s: %d events checked on the new primary, lost %d, duplicated %d, out of order per producer %d, republished from a snapshot %d; "+
		"in the stream but lost by the new primary %d; walbox streamed from the promoted standby %.1f s after pg_ctl promote returned",
		what, st.checked, st.lost, st.dup, st.outOfOrder, st.republished, st.lostByNewPrimary, resumed.Seconds())
	return st
}

type promotionStats struct {
	checked, lost, dup, outOfOrder, fromRolledBack, republished, lostByNewPrimary int
}

// checkPromotion compares the streams with what the new primary holds
// (a synchronous standby has every commit a producer saw succeed): each row
// once, each producer's events in the order written per stream; events the
// stream holds that the new primary lost are counted apart.
func (e *env) checkPromotion(ctx context.Context, newPrimaryURL string, res *outboxtest.Result) promotionStats {
	t := e.t
	t.Helper()
	c, err := pgx.Connect(ctx, newPrimaryURL)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	held := queryStrings(ctx, t, c, "SELECT id::text FROM outbox_events")
	e.waitDelivered(len(held), 60*time.Second)
	e.settled()
	onNew := map[string]bool{}
	for _, id := range held {
		onNew[id] = true
	}
	rolledBack := map[string]bool{}
	for _, id := range res.RolledBack {
		rolledBack[id] = true
	}
	var s promotionStats
	s.checked = len(held)
	seen := map[string]int{}
	for _, name := range e.streamNames() {
		// Order is per stream: each producer's events in the order written.
		lastByProducer := map[int]string{}
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
				s.republished++
			}
			switch {
			case rolledBack[id]:
				s.fromRolledBack++
			case !onNew[id]:
				s.lostByNewPrimary++
			}
			var p struct{ Producer int }
			if err := json.Unmarshal(m.Data, &p); err != nil {
				t.Fatal(err)
			}
			// uuid v7 ids grow with each producer's inserts.
			if last := lastByProducer[p.Producer]; last != "" && strings.Compare(id, last) < 0 {
				s.outOfOrder++
				if s.outOfOrder <= 3 {
					t.Logf("stream %s seq %d: producer %d's %s after its %s", name, seq, p.Producer, id, last)
				}
			}
			lastByProducer[p.Producer] = id
		}
	}
	for _, id := range held {
		switch n := seen[id]; {
		case n == 0:
			s.lost++
		case n > 1:
			s.dup++
		}
	}
	return s
}

// startPrimary starts a cluster to promote away from, with database app
// migrated: commits wait for the WAL flush, and commit times are kept so a
// republished backfill can keep commit order.
func startPrimary(ctx context.Context, t *testing.T) (*pgtest.Cluster, string) {
	t.Helper()
	primary, pURL := pgtest.OwnDB(ctx, t, pgtest.WithSetting("synchronous_commit", "on"),
		pgtest.WithSetting("wal_sender_timeout", "5s"), pgtest.WithSetting("track_commit_timestamp", "on"))
	relaytest.Migrate(t, pURL, walboxsql.Params{Publication: "walbox"})
	return primary, pURL
}

// failOver kills the primary with -9, promotes the standby, and returns how
// long after pg_ctl promote returned walbox streamed from it.
func failOver(ctx context.Context, t *testing.T, primary *pgtest.Cluster, standby *pgcluster.Cluster) time.Duration {
	t.Helper()
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 60*time.Second, "walbox to stream from the promoted standby", func() bool {
		return slotActiveOn(ctx, standby.URL("app"), "walbox")
	})
	return time.Since(promoted)
}

// TestFailoverSlotFollowsPromotion is the failover from PostgreSQL 17 on:
// walbox creates its slot with failover (postgres.failover_slot), the
// standby keeps a synced copy (sync_replication_slots, a physical slot named
// in synchronized_standby_slots, hot_standby_feedback), and after kill -9 of
// the primary and pg_ctl promote walbox continues from the synced slot: no
// snapshot, nothing republished, nothing lost, duplicated or reordered.
// Before 17 walbox refuses the setting with the fix.
func TestFailoverSlotFollowsPromotion(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	primary, pURL := startPrimary(ctx, t)
	v, err := primary.Version()
	if err != nil {
		t.Fatal(err)
	}
	if v < 17 {
		e := newEnv(t)
		e.cfg.Postgres.URL, e.cfg.Postgres.FailoverSlot = pURL, true
		runCtx, stop := context.WithTimeout(ctx, 30*time.Second)
		defer stop()
		err := app.Run(runCtx, e.cfg, zerolog.Nop(), app.Options{})
		if err == nil || !strings.Contains(err.Error(), "PostgreSQL 17") || !strings.Contains(err.Error(), "failover_slot: false") {
			t.Fatalf("PostgreSQL %d with postgres.failover_slot: %v; want a refusal naming 17 and the fix", v, err)
		}
		return
	}
	if err := primary.Exec(ctx, "postgres", "SELECT pg_create_physical_replication_slot('standby_phys')"); err != nil {
		t.Fatal(err)
	}
	standby, err := primary.Standby(ctx, pgcluster.StandbyOptions{ApplicationName: "walbox_standby", DBName: "app", PrimarySlot: "standby_phys",
		Settings: map[string]string{"sync_replication_slots": "on", "hot_standby_feedback": "on"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Close() })
	for _, q := range []string{
		"ALTER SYSTEM SET synchronized_standby_slots = 'standby_phys'",
		"ALTER SYSTEM SET synchronous_standby_names = 'walbox_standby'",
		"SELECT pg_reload_conf()",
	} {
		if err := primary.Exec(ctx, "postgres", q); err != nil {
			t.Fatal(err)
		}
	}

	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/app?sslmode=disable&target_session_attrs=read-write", primary.Port(), standby.Port())
	e := newEnv(t)
	e.cfg.Postgres.URL, e.dbURL, e.cfg.Postgres.FailoverSlot = both, both, true
	standbyChecks := func() map[string]ops.Check {
		rep := &ops.DoctorReport{OK: true}
		ops.DoctorStandby(ctx, e.cfg, standby.URL("app"), rep)
		got := map[string]ops.Check{}
		for _, c := range rep.Checks {
			got[c.Name] = c
		}
		return got
	}
	if c := standbyChecks()["standby.slot"]; c.Status != ops.Fail || c.Fix == "" {
		t.Fatalf("doctor --standby before walbox made its slot: %+v, want a failure with the fix", c)
	}
	e.pool = relaytest.Pool(t, both)
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 8, MaxRows: 10, Rollback: 0.1, Rate: 20})
	// A synced slot is usable after a failover only once it is persisted
	// (synced and not temporary); the primary's slot must first move past
	// the standby's catalog xmin. Decoded traffic and a standby snapshot
	// record in the WAL hurry that along.
	start := time.Now()
	relaytest.Eventually(t, 90*time.Second, "the standby's copy of the slot to be synced and persisted", func() bool {
		_ = primary.Exec(ctx, "app", "SELECT pg_log_standby_snapshot()")
		c, err := pgx.Connect(ctx, standby.URL("app"))
		if err != nil {
			return false
		}
		defer c.Close(ctx)
		var ok bool
		_ = c.QueryRow(ctx, "SELECT coalesce(bool_or(synced AND NOT temporary), false) FROM pg_replication_slots WHERE slot_name = 'walbox'").Scan(&ok)
		return ok
	})
	t.Logf("standby's slot synced and persisted %.1f s after walbox started", time.Since(start).Seconds())
	for name, c := range standbyChecks() {
		if c.Status != ops.OK {
			t.Fatalf("doctor --standby with the slot synced and persisted: %s is %v: %s", name, c.Status, c.Detail)
		}
	}
	st := e.failOverUnderLoad(ctx, "failover slot", primary, standby, stop)
	if st.lost+st.dup+st.outOfOrder+st.fromRolledBack+st.republished != 0 || st.checked == 0 {
		t.Fatalf("guarantees broken (or the slot did not follow: %d republished)", st.republished)
	}
	if n := e.counter("walbox_slot_lost_total", nil); n != 0 {
		t.Fatalf("walbox_slot_lost_total = %v: the synced slot was not used", n)
	}
}
