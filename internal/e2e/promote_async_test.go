package e2e

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgcluster"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestPromotedAsyncStandby (issue 33, item 2): an asynchronous standby
// stops receiving WAL, the old primary goes on writing for 2 s (events the
// relay publishes from WAL the standby never gets), then the primary is
// killed with -9 and the standby promoted. There is no failover slot (before
// PostgreSQL 17 there is none; on 17 it is not asked for): walbox finds no
// slot on the new primary, recreates it and republishes the rows the new
// primary holds unprocessed. Many of those are already in the stream (acked
// on the old primary, but the sweeper's mark had not reached the standby
// when it was cut off) and older than the stream's read-back tail (2 ×
// window), which holds the old primary's last 2 s: JetStream drops them as
// duplicates. Under strict order (the default) publishing must go on.
//
// Every row the new primary holds must be in the stream exactly once, in
// commit order (the old primary's for rows from before the promotion, the
// new primary's after it; rows republished from the recreated slot's
// snapshot carry no WAL position and their order is counted apart, as the
// checker does everywhere), and the first row written after the promotion
// must be acked within 10 s of it. The old primary's last events are in the
// stream but not in the database: expected, counted apart.
//
// How: the standby is cut off with an empty primary_conninfo (a reload stops
// its WAL receiver) mid-load, at a moment the primary holds at least
// promoUnmarkedAtCut rows not yet marked processed (the sweeper runs every
// second here, so its marks trail the acks as under a heavy load); the
// relay's window is small (64: a tail of 128 per stream) and the load about
// 400 rows a second, so the old primary's last 2 s outgrow the tail. The
// test checks it set the scenario up: stored unmarked rows older than the
// tail, and events in the stream the new primary lacks.
//
// Commit order comes from two witness slots (test_decoding): one on the old
// primary, read just before the kill (the standby was cut off before, so
// it lists every row the standby holds), and one on the new primary,
// created right after the promotion and before the producers write to it.
// So the producers pause for the promotion itself (well under a second).
//
// Variants: stream replicas 1 (one server) and 3 (an in-process 3-node
// cluster): the server's order of the duplicate check and the expected
// last sequence check differs between the two. The PostgreSQL major is the
// harness's (WALBOX_PG_BINDIR selects another; run it on 15 and 17).
//
// The relay's log (info, with the time to the millisecond) says where a
// slow resume spent its time.
func TestPromotedAsyncStandby(t *testing.T) {
	for _, replicas := range []int{1, 3} {
		t.Run(fmt.Sprintf("R%d", replicas), func(t *testing.T) { testPromotedAsyncStandby(t, replicas) })
	}
}

const (
	// promoWindow is the relay's publish window: its read-back tail is
	// 2 × promoWindow messages per stream, which the old primary's last 2 s
	// (several hundred events per stream) must outgrow.
	promoWindow = 64
	// promoLostFor is how long the old primary writes after the standby
	// stopped receiving WAL.
	promoLostFor = 2 * time.Second
	// promoResumeWithin bounds promotion to the first ack of a row written
	// after it.
	promoResumeWithin = 10 * time.Second
	// promoDeliverWithin bounds the wait for every row of the new primary,
	// counted from the end of the load.
	promoDeliverWithin = 20 * time.Second
	// promoSweepEvery is the sweeper's interval: its marks trail the acks
	// by up to a second, as under a heavy load, so that the standby holds
	// rows the stream has and it does not know are processed.
	promoSweepEvery = time.Second
	// promoUnmarkedAtCut is how many rows the primary must hold unmarked
	// when the standby is cut off.
	promoUnmarkedAtCut = 150
)

// promoLoad is about 400 committed rows a second (8 producers, 10
// transactions a second each, 1 to 10 rows, 10% rolled back), over both
// streams, so the sweeper's marks trail the acks by some hundred rows.
var promoLoad = outboxtest.Load{Producers: 8, MinRows: 1, MaxRows: 10, Rollback: 0.1, Rate: 10}

func testPromotedAsyncStandby(t *testing.T, replicas int) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	testStart := time.Now()

	// PostgreSQL: a primary and an asynchronous streaming standby.
	primary, primaryURL := startPrimary(ctx, t)
	version, err := primary.Version()
	if err != nil {
		t.Fatal(err)
	}
	standby, err := primary.Standby(ctx, pgcluster.StandbyOptions{ApplicationName: "walbox_async"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Close() })
	if err := primary.Exec(ctx, "postgres", "ALTER SYSTEM SET synchronous_standby_names = ''"); err != nil {
		t.Fatal(err)
	}
	if err := primary.Exec(ctx, "postgres", "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 30*time.Second, "the standby to stream asynchronously (pg_stat_replication: walbox_async, async)", func() bool {
		return promoReplicationRows(ctx, primaryURL, "async") == 1
	})
	standbyURL := standby.URL("app")

	// NATS and the relay, given both hosts (read-write wins), strict order
	// (the default), a small window.
	var cl *natstest.Cluster
	if replicas == 3 {
		cl = natstest.NewCluster(t, 3)
	}
	e := newEnv(t, func(c *config.Config) {
		c.NATS.Window = promoWindow
		c.Sweeper.Interval = promoSweepEvery
		if cl != nil {
			c.NATS.URL = cl.URLs()
			for i := range c.NATS.Streams {
				c.NATS.Streams[i].Replicas = 3
			}
		}
	})
	if cl != nil {
		_, e.js = relaytest.JetStream(t, cl.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	}
	if !e.cfg.NATS.StrictOrder {
		t.Fatal("strict order is not the default any more: the test is about strict order")
	}
	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/app?sslmode=disable&target_session_attrs=read-write", primary.Port(), standby.Port())
	e.cfg.Postgres.URL, e.dbURL = both, both
	e.pool = relaytest.Pool(t, both)
	t.Logf("PostgreSQL %d, stream replicas %d, window %d (read-back tail %d per stream), strict order %v, sweeper every %v",
		version, replicas, e.cfg.NATS.Window, 2*e.cfg.NATS.Window, e.cfg.NATS.StrictOrder, e.cfg.Sweeper.Interval)

	// The old primary's witness, created after the standby was copied so
	// that only the primary has it.
	oldConn, err := pgx.Connect(ctx, primaryURL)
	if err != nil {
		t.Fatal(err)
	}
	defer oldConn.Close(context.Background())
	oldWitness, err := outboxtest.CreateWitness(ctx, oldConn, "witness", "outbox_events")
	if err != nil {
		t.Fatal(err)
	}

	// The relay's info lines, with the time to the millisecond: where a
	// slow resume spent its time.
	relayLog := zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel).Hook(zerolog.HookFunc(func(ev *zerolog.Event, _ zerolog.Level, _ string) {
		ev.Str("at", time.Now().Format("15:04:05.000"))
	}))
	r := &inproc{relaytest.StartRelay(t, e.cfg, relaytest.WithLog(relayLog))}
	e.reg = r.Registry
	e.relays = append(e.relays, r)
	stop1 := promoLoadOn(t, relaytest.Pool(t, primaryURL))
	// Let the load and the relay reach a steady state.
	var total uint64
	relaytest.Eventually(t, 30*time.Second, "1,000 events in the streams before the standby is cut off", func() bool {
		total = promoTotal(ctx, e)
		return total >= 1000
	})
	// The cut lands mid-load, while the sweeper's marks trail the acks:
	// rows not yet marked are share-locked until the standby's copy is
	// fixed, so that the sweeper (every second) cannot mark them all
	// between this check and the cut. (Without the lock, CI saw a sweep
	// land in between: the standby then held no unmarked row and the
	// scenario was not set up.)
	lockConn, err := pgx.Connect(ctx, primaryURL)
	if err != nil {
		t.Fatal(err)
	}
	defer lockConn.Close(context.Background())
	var unmarkedAtCut int
	var hold pgx.Tx
	relaytest.Eventually(t, 10*time.Second, fmt.Sprintf("%d rows not yet marked processed on the primary, share-locked", promoUnmarkedAtCut), func() bool {
		tx, err := lockConn.Begin(ctx)
		if err != nil {
			return false
		}
		if tx.QueryRow(ctx, "SELECT count(*) FROM (SELECT 1 FROM outbox_events WHERE NOT processed FOR SHARE) u").Scan(&unmarkedAtCut) == nil && unmarkedAtCut >= promoUnmarkedAtCut {
			hold = tx
			return true
		}
		_ = tx.Rollback(ctx)
		return false
	})

	// Cut the standby off: no primary_conninfo, no WAL receiver.
	if err := standby.Exec(ctx, "postgres", "ALTER SYSTEM SET primary_conninfo = ''"); err != nil {
		t.Fatal(err)
	}
	if err := standby.Exec(ctx, "postgres", "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	cutAt := time.Now()
	relaytest.Eventually(t, 10*time.Second, "the primary to lose its standby (no walbox_async in pg_stat_replication)", func() bool {
		return promoReplicationRows(ctx, primaryURL, "") == 0
	})
	// What the standby holds is fixed now: wait until it has replayed all it
	// received, then note its rows that are not marked processed.
	var standbyLSN pglogrepl.LSN
	var unmarked []string
	var standbyRows int
	relaytest.Eventually(t, 10*time.Second, "the standby to replay all the WAL it received", func() bool {
		c, err := pgx.Connect(ctx, standbyURL)
		if err != nil {
			return false
		}
		defer c.Close(ctx)
		var recv, replay string
		if c.QueryRow(ctx, "SELECT coalesce(pg_last_wal_receive_lsn(), '0/0')::text, coalesce(pg_last_wal_replay_lsn(), '0/0')::text").Scan(&recv, &replay) != nil {
			return false
		}
		// Replayed all it received, or all it can: the receiver can be cut
		// off inside a WAL record, whose torn end the startup process never
		// replays; it then waits for more WAL, and what it holds is fixed.
		var waiting bool
		if !lsnAtLeast(replay, recv) && (c.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE backend_type = 'startup' AND wait_event = 'RecoveryRetrieveRetryInterval')`).Scan(&waiting) != nil || !waiting) {
			return false
		}
		standbyLSN, _ = pglogrepl.ParseLSN(replay)
		unmarked = queryStrings(ctx, t, c, "SELECT id::text FROM outbox_events WHERE NOT processed")
		return c.QueryRow(ctx, "SELECT count(*) FROM outbox_events").Scan(&standbyRows) == nil
	})
	if err := hold.Rollback(ctx); err != nil { // the sweeper may mark them on the old primary now
		t.Fatal(err)
	}
	time.Sleep(time.Until(cutAt.Add(promoLostFor))) // fault timing: the old primary writes on, the standby gets none of it

	// The old primary's commit order, then kill -9.
	var primaryLSN string
	if err := oldConn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&primaryLSN); err != nil {
		t.Fatal(err)
	}
	oldOrder, err := oldWitness.Committed(ctx, oldConn)
	if err != nil {
		t.Fatal(err)
	}
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	killedAt := time.Now()
	res1 := stop1()
	// What the stream held before the promotion: the old relay's last acks
	// land within moments of the kill.
	preSeq := promoStableLastSeqs(ctx, t, e)

	promotedAt := time.Now()
	t.Logf("promoting at %s", promotedAt.Format("15:04:05.000"))
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	promoteTook := time.Since(promotedAt)
	newConn, err := pgx.Connect(ctx, standbyURL)
	if err != nil {
		t.Fatal(err)
	}
	defer newConn.Close(context.Background())
	newWitness, err := outboxtest.CreateWitness(ctx, newConn, "witness_new", "outbox_events")
	if err != nil {
		t.Fatal(err)
	}
	stop2 := promoLoadOn(t, relaytest.Pool(t, standbyURL))
	time.Sleep(3 * time.Second) // pacing: the load goes on against the new primary
	res2 := stop2()
	loadEnd := time.Now()

	held := queryStrings(ctx, t, newConn, "SELECT id::text FROM outbox_events")
	newOrder, err := newWitness.Committed(ctx, newConn)
	if err != nil {
		t.Fatal(err)
	}
	heldSet := setOfIDs(held)
	var committed []string // commit order of every row the new primary holds
	for _, id := range oldOrder {
		if heldSet[id] {
			committed = append(committed, id)
		}
	}
	preRows := len(committed)
	committed = append(committed, newOrder...)
	if len(committed) != len(held) || len(setOfIDs(committed)) != len(held) {
		t.Fatalf("the witnesses do not cover the new primary: it holds %d rows, the old primary's witness lists %d of them and the new one's %d",
			len(held), preRows, len(newOrder))
	}

	// Wait for every row of the new primary: the streams must grow by the
	// rows they did not hold before the promotion.
	before := promoRead(ctx, t, e)
	storedBefore, preTotal := 0, 0
	for name, ms := range before {
		for _, m := range ms {
			if m.seq <= preSeq[name] {
				preTotal++
				if heldSet[m.id] {
					storedBefore++
				}
			}
		}
	}
	target := uint64(preTotal + len(held) - storedBefore)
	delivered := true
	deadline := loadEnd.Add(promoDeliverWithin)
	for total = promoTotal(ctx, e); total < target; total = promoTotal(ctx, e) {
		if time.Now().After(deadline) {
			delivered = false
			t.Logf("after %v, the streams hold %d messages; every row of the new primary once would make %d", promoDeliverWithin, total, target)
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	if delivered {
		e.settled() // a late duplicate is seen too
	}

	// Judge.
	after := promoRead(ctx, t, e)
	streams := map[string][]string{}
	snapshot := map[string]bool{}
	seqOf := map[string]uint64{}
	streamOf := map[string]string{}
	var firstNewAck, firstAfterPromotion time.Time
	newSet := setOfIDs(newOrder)
	for name, ms := range after {
		for _, m := range ms {
			streams[name] = append(streams[name], m.id)
			if m.lsn == 0 {
				snapshot[m.id] = true
			}
			if _, ok := seqOf[m.id]; !ok {
				seqOf[m.id], streamOf[m.id] = m.seq, name
			}
			if m.seq > preSeq[name] && (firstAfterPromotion.IsZero() || m.stored.Before(firstAfterPromotion)) {
				firstAfterPromotion = m.stored
			}
			if newSet[m.id] && (firstNewAck.IsZero() || m.stored.Before(firstNewAck)) {
				firstNewAck = m.stored
			}
		}
	}
	var rolledBack []string
	rolledBack = append(append(rolledBack, res1.RolledBack...), res2.RolledBack...)
	rep := outboxtest.CheckStreamed(committed, rolledBack, streams, snapshot)

	// The scenario itself: the standby fell behind, its unmarked rows were
	// in the stream already, and older than the read-back tail.
	oldHeld := setOfIDs(oldOrder)
	lostByNew := 0
	for id := range seqOf {
		if oldHeld[id] && !heldSet[id] {
			lostByNew++
		}
	}
	storedUnmarked, olderThanTail := 0, 0
	for _, id := range unmarked {
		seq, ok := seqOf[id]
		if !ok || seq > preSeq[streamOf[id]] {
			continue
		}
		storedUnmarked++
		if seq+uint64(2*e.cfg.NATS.Window) <= preSeq[streamOf[id]] {
			olderThanTail++
		}
	}
	var lastHeldSeq []string
	for _, name := range e.streamNames() {
		newest := uint64(0)
		for _, m := range before[name] {
			if m.seq <= preSeq[name] && heldSet[m.id] && m.seq > newest {
				newest = m.seq
			}
		}
		lastHeldSeq = append(lastHeldSeq, fmt.Sprintf("%s: %d of the old primary's lost events after the standby's newest row (seq %d of %d)", name, preSeq[name]-newest, newest, preSeq[name]))
	}

	resume := "never"
	resumeDur := time.Duration(-1)
	if !firstNewAck.IsZero() {
		resumeDur = firstNewAck.Sub(promotedAt)
		resume = fmt.Sprintf("%.2f s", resumeDur.Seconds())
	}
	firstAny := "none"
	if !firstAfterPromotion.IsZero() {
		firstAny = fmt.Sprintf("%.2f s", firstAfterPromotion.Sub(promotedAt).Seconds())
	}
	t.Logf("cut-off standby at WAL %s with %d rows (%d unmarked, %d of them already in the stream, %d older than the read-back tail); old primary at WAL %s when killed, %.1f s after the cut; pg_ctl promote took %.2f s",
		standbyLSN, standbyRows, len(unmarked), storedUnmarked, olderThanTail, primaryLSN, killedAt.Sub(cutAt).Seconds(), promoteTook.Seconds())
	t.Logf("streams before the promotion: %s", strings.Join(lastHeldSeq, "; "))
	t.Logf("new primary: %d rows (%d from before the promotion, %d written after it); %d events of the old primary in the stream but not on the new primary",
		len(held), preRows, len(newOrder), lostByNew)
	t.Logf("checker over the new primary's rows: %s", rep.String())
	t.Logf("first publish after the promotion %s after pg_ctl promote started; first ack of a row written after the promotion: %s; all delivered: %v",
		firstAny, resume, delivered)
	t.Logf("relay: publish errors %v (by class: %s), back-offs %v, slot lost %v; test took %.1f s",
		e.counter("walbox_publish_errors_total", nil), promoErrorsByClass(t, e), e.counter("walbox_publish_backoffs_total", nil),
		e.counter("walbox_slot_lost_total", nil), time.Since(testStart).Seconds())
	t.Logf("RESULT PG%d R%d: lost %d, duplicated %d, out of order %d, from rolled back %d, resume %s",
		version, replicas, rep.Lost, rep.Duplicated, rep.OutOfOrder, rep.FromRolledBack, resume)

	if lostByNew == 0 {
		t.Fatalf("scenario not set up: the stream holds no event of the old primary's last %v that the standby lacks", promoLostFor)
	}
	if olderThanTail == 0 {
		t.Fatalf("scenario not set up: of the cut-off standby's %d unmarked rows, %d were in the stream already and none older than the read-back tail (%d per stream)",
			len(unmarked), storedUnmarked, 2*e.cfg.NATS.Window)
	}
	if !rep.OK() || rep.Checked == 0 {
		t.Fatalf("guarantees broken over the new primary's %d rows: lost %d, duplicated %d, out of order %d, from rolled-back transactions %d",
			len(held), rep.Lost, rep.Duplicated, rep.OutOfOrder, rep.FromRolledBack)
	}
	if resumeDur < 0 || resumeDur > promoResumeWithin {
		t.Fatalf("publishing did not resume within %v of the promotion: first ack of a row written after it: %s", promoResumeWithin, resume)
	}
}

// promoLoadOn runs promoLoad against pool until the returned stop, or the
// test's end.
func promoLoadOn(t *testing.T, pool *pgxpool.Pool) (stop func() *outboxtest.Result) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var res *outboxtest.Result
	finished := make(chan struct{})
	go func() { res = promoLoad.Run(ctx, pool); close(finished) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-finished:
		case <-time.After(30 * time.Second):
		}
	})
	return func() *outboxtest.Result {
		t.Helper()
		cancel()
		select {
		case <-finished:
			return res
		case <-time.After(30 * time.Second):
			t.Fatal("the producers did not stop within 30 s of being told to")
			return nil
		}
	}
}

// promoReplicationRows counts the primary's walsenders for walbox_async
// (of the given sync_state, any when empty); -1 when it cannot tell.
func promoReplicationRows(ctx context.Context, url, state string) int {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return -1
	}
	defer c.Close(ctx)
	n := -1
	if err := c.QueryRow(ctx, "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'walbox_async' AND ($1 = '' OR sync_state = $1)", state).Scan(&n); err != nil {
		return -1
	}
	return n
}

// promoTotal is the number of messages in the user streams, 0 for streams
// that cannot be read now.
func promoTotal(ctx context.Context, e *env) uint64 {
	var total uint64
	for _, name := range e.streamNames() {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if st, err := e.js.Stream(rctx, name); err == nil {
			if info, err := st.Info(rctx); err == nil {
				total += info.State.Msgs
			}
		}
		cancel()
	}
	return total
}

// promoStableLastSeqs reads every user stream's last sequence until two
// reads 300 ms apart agree.
func promoStableLastSeqs(ctx context.Context, t *testing.T, e *env) map[string]uint64 {
	t.Helper()
	read := func() map[string]uint64 {
		m := map[string]uint64{}
		for _, name := range e.streamNames() {
			_, info := e.stream(ctx, name)
			m[name] = info.State.LastSeq
		}
		return m
	}
	prev := read()
	deadline := time.Now().Add(10 * time.Second)
	for {
		time.Sleep(300 * time.Millisecond)
		cur := read()
		if fmt.Sprint(cur) == fmt.Sprint(prev) {
			return cur
		}
		if time.Now().After(deadline) {
			t.Fatalf("the streams did not stop growing within 10 s of the old primary's kill: %v then %v", prev, cur)
		}
		prev = cur
	}
}

// promoRead reads every user stream in full, in stream order.
func promoRead(ctx context.Context, t *testing.T, e *env) map[string][]storedMsg {
	t.Helper()
	out := map[string][]storedMsg{}
	for _, name := range e.streamNames() {
		var ms []storedMsg
		var err error
		// A cluster may answer "no responders" for a moment; retry.
		for attempt := 0; attempt < 10; attempt++ {
			if ms, err = readStreamMsgs(ctx, e.js, name); err == nil {
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
		if err != nil {
			t.Fatalf("read stream %s: %v", name, err)
		}
		out[name] = ms
	}
	return out
}

// promoErrorsByClass lists the relay's publish errors by class.
func promoErrorsByClass(t *testing.T, e *env) string {
	t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var parts []string
	for _, mf := range mfs {
		if mf.GetName() != "walbox_publish_errors_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var class string
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "class" {
					class = lp.GetValue()
				}
			}
			parts = append(parts, fmt.Sprintf("%s=%v", class, m.GetCounter().GetValue()))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

// setOfIDs is the set of ids.
func setOfIDs(ids []string) map[string]bool {
	s := make(map[string]bool, len(ids))
	for _, id := range ids {
		s[id] = true
	}
	return s
}
