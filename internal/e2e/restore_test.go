package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
)

// TestCrashConsistentRestore (issue 33, item 1): the database is put back
// from a crash-consistent snapshot (a VM or disk snapshot, a base backup
// started without archive recovery). It keeps its system identifier and its
// timeline, but its WAL is back at a position below events the stream
// already holds.
//
// walbox streams from its own cluster into JetStream (strict order, the
// default window). N1 events are published; then the server is killed like
// a power cut and its data folder copied aside (what a disk snapshot holds)
// and started again. Other tables' writes move the WAL on (a few segment
// switches) and N2 more events are published: more than twice the relay's
// window, so the stream's read-back tail holds only events from after the
// snapshot. The relay and the server are stopped, the copy is put back and
// the server started from it: it has the N1 rows, not the N2 ones, and its
// slot is at the snapshot's position. The relay starts again and N3 new
// events are committed on the restored database, in several transactions:
// their positions are above the snapshot's but below the N2 events' in the
// stream.
//
// Every row the restored database holds (N1 and N3) must be in the stream
// exactly once, in commit order, the N3 events after everything the stream
// held before the restore. The N2 events stay in the stream; their history
// is gone from the database, which is expected.
func TestCrashConsistentRestore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, appURL := startPrimary(ctx, t) // own cluster, database app migrated
	e := newEnv(t)
	e.cfg.Postgres.URL, e.dbURL = appURL, appURL
	e.pool = relaytest.Pool(t, appURL)
	const n1, n3, n3PerTxn = 300, 1000, 50
	window := e.cfg.NATS.Window
	n2 := 2*window + 500 // the read-back tail (2 × window) holds N2 events only
	t.Logf("relay window %d (strict order %v): N1 %d, N2 %d, N3 %d in transactions of %d", window, e.cfg.NATS.StrictOrder, n1, n2, n3, n3PerTxn)

	// Setup before the relay streams: a table of the application's other
	// writes (not in the publication), and the independent commit-order
	// witness (a test_decoding slot never advanced: after the restore it
	// lists exactly what the restored database committed).
	relaytest.Exec(t, appURL, "CREATE TABLE other_writes (id bigserial PRIMARY KEY, note text)")
	var w *outboxtest.Witness
	relaytest.WithConn(t, appURL, func(ctx context.Context, conn *pgx.Conn) error {
		var err error
		w, err = outboxtest.CreateWitness(ctx, conn, "witness", "outbox_events")
		return err
	})

	r := e.startRelay()
	n1IDs := insertEvents(t, appURL, "n1", n1)
	waitStored(t, e, "ORDERS", "the N1 events before the snapshot", n1IDs, 30*time.Second)

	// A snapshot of a relay streaming in its steady state: the first
	// start's backfill confirmed and its marker cleared, and a checkpoint
	// that puts the slot's position on disk. A crash while the marker is
	// still set makes walbox redo that backfill (by design: it recreates
	// the slot), and N2 would then be backfilled, not streamed: the
	// marker's clearing runs a moment after the acks, so without this wait
	// the snapshot sometimes caught it (seen once in a CI run).
	relaytest.Eventually(t, 30*time.Second, "the first start's backfill marker cleared", func() bool {
		var n int
		relaytest.WithConn(t, appURL, func(ctx context.Context, conn *pgx.Conn) error {
			return conn.QueryRow(ctx, "SELECT count(*) FROM walbox.slot_backfill").Scan(&n)
		})
		return n == 0
	})
	relaytest.Exec(t, appURL, "CHECKPOINT")

	// The snapshot: a power cut, the folder copied as it lies on disk.
	snapDir := pgtest.ServerDir(t, "walbox-snapshot-")
	snap := filepath.Join(snapDir, "data")
	if err := c.Kill(); err != nil {
		t.Fatal(err)
	}
	copyDataDir(t, c.DataDir(), snap)
	if err := c.StartAgain(ctx); err != nil {
		t.Fatalf("start after the snapshot's crash: %v", err)
	}
	snapLSN := currentLSN(ctx, t, appURL)

	// Life goes on after the snapshot: other writes, then N2 events.
	relaytest.WithConn(t, appURL, func(ctx context.Context, conn *pgx.Conn) error {
		for range 3 {
			if _, err := conn.Exec(ctx, "INSERT INTO other_writes (note) VALUES ('after the snapshot'); SELECT pg_switch_wal()"); err != nil {
				return err
			}
		}
		return nil
	})
	n2IDs := insertEvents(t, appURL, "n2", n2)
	waitStored(t, e, "ORDERS", "the N2 events after the snapshot", n2IDs, 60*time.Second)
	r.stop(t)
	before := readOrdered(ctx, t, e, "ORDERS")
	preRestoreLastSeq := before[len(before)-1].seq
	n2Oldest := pglogrepl.LSN(0)
	n2Set := setOf(n2IDs)
	for _, m := range before {
		if n2Set[m.id] && (n2Oldest == 0 || m.lsn < n2Oldest) {
			n2Oldest = m.lsn
		}
	}

	// Put the snapshot back.
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(c.DataDir()); err != nil {
		t.Fatal(err)
	}
	copyDataDir(t, snap, c.DataDir())
	if err := c.StartAgain(ctx); err != nil {
		t.Fatalf("start the restored cluster: %v", err)
	}
	restoredLSN := currentLSN(ctx, t, appURL)
	var slotLSN string
	relaytest.WithConn(t, appURL, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT coalesce(confirmed_flush_lsn::text, '') FROM pg_replication_slots WHERE slot_name = $1", e.cfg.Postgres.Slot).Scan(&slotLSN)
	})
	t.Logf("snapshot at WAL %s; N2 stored at commit LSNs from %s on; restored server at WAL %s, its slot confirmed at %q; stream last sequence %d before the restore",
		snapLSN, n2Oldest, restoredLSN, slotLSN, preRestoreLastSeq)

	// The relay again; N3 events on the restored database.
	r = e.startRelay()
	n3IDs := insertTxns(t, appURL, "n3", n3, n3PerTxn)
	n3End := currentLSN(ctx, t, appURL)
	if n3End >= n2Oldest {
		t.Fatalf("scenario not set up: the restored server's WAL (%s after N3) reached the N2 events' positions (%s on); the test is meant to have it below them", n3End, n2Oldest)
	}

	// What the restored database holds: N1 and N3, not N2.
	var held, committed []string
	relaytest.WithConn(t, appURL, func(ctx context.Context, conn *pgx.Conn) error {
		held = queryStrings(ctx, t, conn, "SELECT id::text FROM outbox_events")
		var err error
		committed, err = w.Committed(ctx, conn)
		return err
	})
	want := append(append([]string{}, n1IDs...), n3IDs...)
	if !sameSet(held, want) || !sameSet(committed, want) {
		t.Fatalf("the restore did not take: the restored database holds %d outbox rows and its witness lists %d commits; want the %d N1 and %d N3 rows only (%d of them N2 rows)",
			len(held), len(committed), n1, n3, countIn(held, n2Set))
	}

	// Wait until all N3 events are stored, or until the slot is confirmed
	// past them: a relay confirms only what is acked (or what it decided
	// not to publish), so from then on nothing of N3 is still coming.
	n3Set := setOf(n3IDs)
	arrived := 0
	var confirmed pglogrepl.LSN
	var poll streamPoll
	deadline := time.Now().Add(30 * time.Second)
	for {
		arrived = countIn(poll.ids(ctx, e, "ORDERS"), n3Set)
		confirmed = slotConfirmed(ctx, appURL, e.cfg.Postgres.Slot)
		if arrived == n3 || confirmed >= n3End {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 30 s, %d of the %d N3 events reached the stream and the slot is confirmed at %s, not yet past N3 (%s)", arrived, n3, confirmed, n3End)
		}
		time.Sleep(250 * time.Millisecond)
	}
	if arrived == n3 {
		e.settled() // a late duplicate is seen too
	}

	after := readOrdered(ctx, t, e, "ORDERS")
	streams := map[string][]string{"ORDERS": nil}
	seqOf := map[string]uint64{}
	for _, m := range after {
		streams["ORDERS"] = append(streams["ORDERS"], m.id)
		if _, ok := seqOf[m.id]; !ok {
			seqOf[m.id] = m.seq
		}
	}
	for _, name := range e.streamNames() {
		if name == "ORDERS" {
			continue
		}
		ids, err := outboxtest.ReadStream(ctx, e.js, name)
		if err != nil {
			t.Fatal(err)
		}
		streams[name] = ids
	}
	rep := outboxtest.Check(committed, nil, streams)
	lostN3, lostN1, beforeRestore := 0, 0, 0
	for _, id := range n3IDs {
		seq, ok := seqOf[id]
		switch {
		case !ok:
			lostN3++
		case seq <= preRestoreLastSeq:
			beforeRestore++
		}
	}
	for _, id := range n1IDs {
		if _, ok := seqOf[id]; !ok {
			lostN1++
		}
	}
	n2Kept := countIn(streams["ORDERS"], n2Set)
	var n3Processed int
	relaytest.WithConn(t, appURL, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT count(*) FROM outbox_events WHERE processed AND id::text = ANY($1)", n3IDs).Scan(&n3Processed)
	})
	t.Logf("checker over the restored database's %d rows: %s", len(committed), rep)
	t.Logf("N3: %d of %d lost (slot confirmed at %s, N3 ends at %s; %d N3 rows marked processed so far); N1: %d of %d lost; N2 still in the stream: %d of %d",
		lostN3, n3, confirmed, n3End, n3Processed, lostN1, n1, n2Kept, n2)
	if !rep.OK() || lostN3 != 0 || lostN1 != 0 || beforeRestore != 0 {
		t.Fatalf("events of the restored database lost or misplaced: %d of %d N3 events never published, %d of %d N1 events missing, %d N3 events stored before the restore's stream position %d; checker: %s",
			lostN3, n3, lostN1, n1, beforeRestore, preRestoreLastSeq, rep)
	}
	if n2Kept != n2 {
		t.Fatalf("%d of the %d N2 events left the stream", n2-n2Kept, n2)
	}
	// The restore is reported: the read-back tail's events from the lost
	// history (every one of them is an N2 event, past the restored WAL).
	if lost := relaytest.Metric(t, e.reg, "walbox_resume_lost_history_events", map[string]string{"stream": "ORDERS"}); lost <= 0 || lost > float64(n2) {
		t.Fatalf("walbox_resume_lost_history_events{stream=ORDERS} = %v, want the tail's N2 events (1..%d)", lost, n2)
	}
	// And walbox status says so, from the stream and the server alone.
	st, err := ops.Status(ctx, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	var reported uint64
	for _, lh := range st.LostHistory {
		if lh.Stream == "ORDERS" {
			reported = lh.Messages
		}
	}
	if reported == 0 || reported > uint64(n2) {
		t.Fatalf("walbox status: lost history %+v (errors %v), want ORDERS with the tail's N2 events (1..%d)", st.LostHistory, st.Errors, n2)
	}
	var out strings.Builder
	st.Print(&out)
	if !strings.Contains(out.String(), "lost history") {
		t.Fatalf("walbox status does not print the lost history:\n%s", out.String())
	}
}

// copyDataDir copies a stopped cluster's data folder with cp -a, which keeps
// the server user's ownership and the 0700 mode the server insists on.
func copyDataDir(t *testing.T, from, to string) {
	t.Helper()
	if out, err := exec.Command("cp", "-a", from, to).CombinedOutput(); err != nil {
		t.Fatalf("cp -a %s %s: %v\n%s", from, to, err, out)
	}
}

// insertTxns commits n events on topic orders.created in transactions of
// perTxn rows, one after another, and returns their ids in commit order.
func insertTxns(t *testing.T, dbURL, prefix string, n, perTxn int) []string {
	t.Helper()
	var ids []string
	relaytest.WithConn(t, dbURL, func(ctx context.Context, conn *pgx.Conn) error {
		for len(ids) < n {
			err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				for j := 0; j < perTxn && len(ids) < n; j++ {
					var id string
					if err := tx.QueryRow(ctx, `INSERT INTO outbox_events (topic, payload) VALUES ('orders.created', $1) RETURNING id::text`,
						fmt.Sprintf(`{"n":"%s-%d"}`, prefix, len(ids))).Scan(&id); err != nil {
						return err
					}
					ids = append(ids, id)
				}
				return nil
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
	return ids
}

func currentLSN(ctx context.Context, t *testing.T, dbURL string) pglogrepl.LSN {
	t.Helper()
	var s string
	relaytest.WithConn(t, dbURL, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&s)
	})
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		t.Fatal(err)
	}
	return lsn
}

// slotConfirmed is slot's confirmed_flush_lsn on the server of dbURL, 0 when
// it cannot be read.
func slotConfirmed(ctx context.Context, dbURL, slot string) pglogrepl.LSN {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return 0
	}
	defer conn.Close(ctx)
	var s string
	if err := conn.QueryRow(ctx, "SELECT coalesce(confirmed_flush_lsn, '0/0')::text FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&s); err != nil {
		return 0
	}
	lsn, _ := pglogrepl.ParseLSN(s)
	return lsn
}

// waitStored waits until stream holds every id of ids.
func waitStored(t *testing.T, e *env, stream, what string, ids []string, timeout time.Duration) {
	t.Helper()
	want := setOf(ids)
	var p streamPoll
	got := 0
	deadline := time.Now().Add(timeout)
	for {
		got = countIn(p.ids(context.Background(), e, stream), want)
		if got == len(want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s: %d of %d in %s", timeout, what, got, len(want), stream)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// streamPoll reads a stream's ids for a polling loop, again only when its
// last sequence moved.
type streamPoll struct {
	last uint64
	read []string
}

// ids lists the Nats-Msg-Ids stream holds now (what was read last on an
// error: the caller polls).
func (p *streamPoll) ids(ctx context.Context, e *env, stream string) []string {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	st, err := e.js.Stream(ctx, stream)
	if err != nil {
		return p.read
	}
	info, err := st.Info(ctx)
	if err != nil || (p.read != nil && info.State.LastSeq == p.last) {
		return p.read
	}
	ms, err := readStreamMsgs(ctx, e.js, stream)
	if err != nil {
		return p.read
	}
	ids := make([]string, len(ms))
	for i, m := range ms {
		ids[i] = m.id
	}
	p.last, p.read = info.State.LastSeq, ids
	return ids
}

// storedMsg is one message of a stream: its sequence, event id, commit
// position header (0 when it has none or a backfilled row's 0/0) and the
// time the server stored it (its ack).
type storedMsg struct {
	seq    uint64
	id     string
	lsn    pglogrepl.LSN
	stored time.Time
}

func readOrdered(ctx context.Context, t *testing.T, e *env, stream string) []storedMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ms, err := readStreamMsgs(ctx, e.js, stream)
	if err != nil {
		t.Fatalf("read stream %s: %v", stream, err)
	}
	if len(ms) == 0 {
		t.Fatalf("stream %s is empty", stream)
	}
	return ms
}

// readStreamMsgs reads every message of stream, in stream order, through an
// ordered consumer.
func readStreamMsgs(ctx context.Context, js jetstream.JetStream, stream string) ([]storedMsg, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, err
	}
	if info.State.Msgs == 0 {
		return nil, nil
	}
	last := info.State.LastSeq
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, err
	}
	var out []storedMsg
	for {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, err
		}
		var seq uint64
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				return nil, err
			}
			seq = md.Sequence.Stream
			lsn, _ := pglogrepl.ParseLSN(m.Headers().Get(relay.HeaderCommitLSN))
			out = append(out, storedMsg{seq: seq, id: m.Headers().Get(relay.HeaderMsgID), lsn: lsn, stored: md.Timestamp})
			if seq >= last {
				// Done: a short last batch would otherwise wait out
				// FetchMaxWait.
				return out, nil
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
			return nil, err
		}
		if seq >= last || (len(out) > 0 && out[len(out)-1].seq >= last) {
			return out, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
}

func setOf(ids []string) map[string]bool {
	s := make(map[string]bool, len(ids))
	for _, id := range ids {
		s[id] = true
	}
	return s
}

// countIn counts the distinct ids of ids that are in set.
func countIn(ids []string, set map[string]bool) int {
	seen := map[string]bool{}
	for _, id := range ids {
		if set[id] {
			seen[id] = true
		}
	}
	return len(seen)
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	sa := setOf(a)
	if len(sa) != len(a) {
		return false
	}
	for _, id := range b {
		if !sa[id] {
			return false
		}
	}
	return true
}
