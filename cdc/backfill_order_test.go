package cdc

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/pgtest"
)

// The tests in this file check the order in which a backfill hands over the
// rows that were committed before walbox's slot existed, against real
// servers: the stream promises commit order and, inside a transaction,
// insertion order, and the backfill must keep that promise as far as the
// catalogue records it (see planBackfill).

// orderedOutboxDDL is walbox's default outbox layout, reduced to the columns
// these tests need, and partitioned by created_at like the real one: the
// system columns the order uses are read through the partitioned root.
const orderedOutboxDDL = `
CREATE TABLE outbox_events (
    id         uuid        NOT NULL DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now(),
    topic      text        NOT NULL,
    payload    jsonb       NOT NULL DEFAULT '{}',
    processed  boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE outbox_events_today PARTITION OF outbox_events
    FOR VALUES FROM (now() - interval '1 day') TO (now() + interval '1 day');
CREATE TABLE outbox_events_default PARTITION OF outbox_events DEFAULT;
`

// orderCluster starts a cluster of the test's own, with the database app.
func orderCluster(t *testing.T) (*pgtest.Cluster, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	return pgtest.OwnDB(ctx, t)
}

func orderConnect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func orderExec(t *testing.T, conn *pgx.Conn, sql string) {
	t.Helper()
	if _, err := conn.Exec(t.Context(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// insertTopic is an INSERT of one row into the default layout whose topic
// is label: the tests follow rows by their topic.
func insertTopic(label string) string {
	return "INSERT INTO outbox_events (topic) VALUES (" + QuoteLiteral(label) + ")"
}

// backfillLabels runs a backfill of table against the database at url, in a
// snapshot exported the way the slot's is, and returns the rows' labels
// (label reads one from an event) in the order they were handed over.
func backfillLabels(t *testing.T, url string, table TableName, cols Columns, label func(Event) string) []string {
	t.Helper()
	ctx := t.Context()
	snapConn := orderConnect(t, url)
	orderExec(t, snapConn, "BEGIN ISOLATION LEVEL REPEATABLE READ")
	var snapshot string
	if err := snapConn.QueryRow(ctx, "SELECT pg_export_snapshot()").Scan(&snapshot); err != nil {
		t.Fatal(err)
	}
	src := testSource(t, func(c *Config) { c.ConnString, c.Table, c.Columns = url, table, cols })
	out := make(chan []Change, 16)
	done := make(chan []string)
	go func() {
		var got []string
		for b := range out {
			for _, c := range b {
				if c.Kind == KindEvent {
					got = append(got, label(c.Event))
				}
			}
		}
		done <- got
	}()
	err := src.backfill(ctx, snapshot, 0, src.Tables(), out, nil)
	close(out)
	got := <-done
	orderExec(t, snapConn, "COMMIT")
	if err != nil {
		t.Fatalf("backfill: %v", err)
	}
	return got
}

func topicLabel(ev Event) string { return ev.Topic }
func idLabel(ev Event) string    { return ev.ID }

// wantOrder compares a backfill's order with the insertion order of the
// transactions in their commit order, and says where they part.
func wantOrder(t *testing.T, got, want []string) {
	t.Helper()
	if slices.Equal(got, want) {
		return
	}
	at := 0
	for at < len(got) && at < len(want) && got[at] == want[at] {
		at++
	}
	t.Errorf("backfill order differs from commit and insertion order at row %d of %d (got %d rows)\n got %s\nwant %s",
		at, len(want), len(got), excerpt(got, at), excerpt(want, at))
}

func excerpt(s []string, at int) string {
	lo, hi := max(at-2, 0), min(at+4, len(s))
	return fmt.Sprintf("...%v...", s[lo:hi])
}

// savepointTxns writes n transactions that insert a row inside a released
// savepoint and another after it, and every tenth time one that nests
// savepoints and rolls one back, and returns the labels of the rows in
// commit and insertion order.
func savepointTxns(t *testing.T, conn *pgx.Conn, prefix string, n int) []string {
	t.Helper()
	var want []string
	for i := range n {
		a, b := fmt.Sprintf("%s%d.a", prefix, i), fmt.Sprintf("%s%d.b", prefix, i)
		orderExec(t, conn, "BEGIN; SAVEPOINT s; "+insertTopic(a)+"; RELEASE SAVEPOINT s; "+insertTopic(b)+"; COMMIT")
		want = append(want, a, b)
		if i%10 == 0 {
			c := func(k int) string { return fmt.Sprintf("%snested%d.%d", prefix, i, k) }
			orderExec(t, conn, "BEGIN; "+insertTopic(c(0))+"; SAVEPOINT s; "+insertTopic(c(1))+
				"; SAVEPOINT t; "+insertTopic(prefix+"rolled-back")+"; ROLLBACK TO SAVEPOINT t; "+insertTopic(c(2))+
				"; RELEASE SAVEPOINT s; "+insertTopic(c(3))+"; COMMIT")
			want = append(want, c(0), c(1), c(2), c(3))
		}
	}
	return want
}

// outOfOrderPairs counts the savepoint transactions whose outer row (b) was
// handed over before the row inserted inside the savepoint (a).
func outOfOrderPairs(got []string, prefix string, n int) int {
	pos := map[string]int{}
	for i, l := range got {
		pos[l] = i
	}
	bad := 0
	for i := range n {
		a, okA := pos[fmt.Sprintf("%s%d.a", prefix, i)]
		b, okB := pos[fmt.Sprintf("%s%d.b", prefix, i)]
		if !okA || !okB || b < a {
			bad++
		}
	}
	return bad
}

// TestBackfillOrderKeepsInsertionOrderAcrossSavepoints: a row inserted
// inside a savepoint carries the subtransaction's xid, larger than its
// transaction's own, yet it was inserted before the rows that follow the
// RELEASE; the backfill hands them over in insertion order, the rows of a
// savepoint rolled back not at all, and the transactions in commit order.
// It runs without commit timestamps, then with them (after a restart).
func TestBackfillOrderKeepsInsertionOrderAcrossSavepoints(t *testing.T) {
	const n = 200
	pg, _ := orderCluster(t)
	ctx := t.Context()

	t.Run("track_commit_timestamp off", func(t *testing.T) {
		url, err := pg.CreateDB(ctx, "off")
		if err != nil {
			t.Fatal(err)
		}
		conn := orderConnect(t, url)
		orderExec(t, conn, orderedOutboxDDL)
		want := savepointTxns(t, conn, "off", n)
		got := backfillLabels(t, url, outboxTable, DefaultColumns(), topicLabel)
		if bad := outOfOrderPairs(got, "off", n); bad > 0 {
			t.Errorf("%d of %d savepoint transactions backfilled out of insertion order", bad, n)
		}
		wantOrder(t, got, want)
	})

	t.Run("track_commit_timestamp on", func(t *testing.T) {
		if err := pg.Exec(ctx, "postgres", "ALTER SYSTEM SET track_commit_timestamp = on"); err != nil {
			t.Fatal(err)
		}
		if err := pg.Restart(ctx); err != nil {
			t.Fatal(err)
		}
		url, err := pg.CreateDB(ctx, "on")
		if err != nil {
			t.Fatal(err)
		}
		conn := orderConnect(t, url)
		orderExec(t, conn, orderedOutboxDDL)
		want := savepointTxns(t, conn, "on", n)
		// A transaction that began first and committed last: commit
		// timestamps put it after the one that committed in between,
		// where the slot would have put it.
		other := orderConnect(t, url)
		for k := range 10 {
			x := func(i int) string { return fmt.Sprintf("late%d.%d", k, i) }
			orderExec(t, conn, "BEGIN; "+insertTopic(x(0)))
			y := fmt.Sprintf("early%d", k)
			orderExec(t, other, "BEGIN; SAVEPOINT s; "+insertTopic(y+".a")+"; RELEASE SAVEPOINT s; "+insertTopic(y+".b")+"; COMMIT")
			orderExec(t, conn, "SAVEPOINT s; "+insertTopic(x(1))+"; RELEASE SAVEPOINT s; "+insertTopic(x(2))+"; COMMIT")
			want = append(want, y+".a", y+".b", x(0), x(1), x(2))
		}
		got := backfillLabels(t, url, outboxTable, DefaultColumns(), topicLabel)
		if bad := outOfOrderPairs(got, "on", n); bad > 0 {
			t.Errorf("%d of %d savepoint transactions backfilled out of insertion order", bad, n)
		}
		wantOrder(t, got, want)
	})
}

// TestBackfillOrderRowsWithoutCommitTimestampFirst: rows committed while
// track_commit_timestamp was off have no commit timestamp once it is on;
// they are older than every row that has one, so they come first. Checked
// on the default layout and on a table without created_at, whose old rows
// only their xids order.
func TestBackfillOrderRowsWithoutCommitTimestampFirst(t *testing.T) {
	const n = 100
	pg, url := orderCluster(t)
	ctx := t.Context()
	conn := orderConnect(t, url)
	orderExec(t, conn, orderedOutboxDDL+"; CREATE TABLE bare_outbox (id text NOT NULL, topic text NOT NULL, payload text NOT NULL)")
	bare := func(id string) string {
		return "INSERT INTO bare_outbox VALUES (" + QuoteLiteral(id) + ", 't', '{}')"
	}
	var want []string
	// Each transaction writes two rows into each table; the newer ones
	// write the first two inside a savepoint.
	write := func(prefix, savepoint, release string) {
		for i := range n {
			l := func(k int) string { return fmt.Sprintf("%s%d.%d", prefix, i, k) }
			orderExec(t, conn, "BEGIN; "+savepoint+insertTopic(l(0))+"; "+bare(l(0))+"; "+release+
				insertTopic(l(1))+"; "+bare(l(1))+"; COMMIT")
			want = append(want, l(0), l(1))
		}
	}
	write("old", "", "")
	conn.Close(ctx)
	if err := pg.Exec(ctx, "postgres", "ALTER SYSTEM SET track_commit_timestamp = on"); err != nil {
		t.Fatal(err)
	}
	if err := pg.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	conn = orderConnect(t, url)
	var tct string
	if err := conn.QueryRow(ctx, "SHOW track_commit_timestamp").Scan(&tct); err != nil || tct != "on" {
		t.Fatalf("track_commit_timestamp %q after the restart (%v), want on", tct, err)
	}
	write("new", "SAVEPOINT s; ", "RELEASE SAVEPOINT s; ")

	for _, c := range []struct {
		table TableName
		label func(Event) string
	}{
		{outboxTable, topicLabel},
		{TableName{Schema: "public", Name: "bare_outbox"}, idLabel},
	} {
		t.Run(c.table.Name, func(t *testing.T) {
			got := backfillLabels(t, url, c.table, DefaultColumns(), c.label)
			late := 0
			for i, l := range got {
				if strings.HasPrefix(l, "old") && i >= 2*n {
					late++
				}
			}
			if late > 0 {
				t.Errorf("%d of %d rows committed before commit timestamps were on came after newer rows", late, 2*n)
			}
			wantOrder(t, got, want)
		})
	}
}

// wrapTable has only the required columns (id, topic, payload): no
// created_at, no processed flag. Its order rests on xids alone when commit
// timestamps are off.
var wrapTable = TableName{Schema: "public", Name: "wrap_outbox"}

// TestBackfillOrderAcrossXIDWraparound: xids are 32-bit and wrap; a row
// written just after the wrap has a smaller xid than one written just
// before it, and a frozen row keeps its original xid, which after 2^31
// further transactions looks like the future. The backfill orders by the
// xid's age, which is right across the wrap, and takes a frozen row whose
// age no longer makes sense as the oldest.
func TestBackfillOrderAcrossXIDWraparound(t *testing.T) {
	pg, url := orderCluster(t)
	ctx := t.Context()

	t.Run("the xid key alone", func(t *testing.T) {
		// The key the plan uses, on xids standing in for xmin around the
		// server's next xid: two older than the wrap point, two just after
		// it, a recent one, the frozen and bootstrap xids, and one that
		// only a frozen row 2^31 or more transactions old can carry.
		conn := orderConnect(t, url)
		var next uint64
		if err := conn.QueryRow(ctx, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").Scan(&next); err != nil {
			t.Fatal(err)
		}
		xid := func(x uint64) string { return fmt.Sprintf("'%d'::xid", uint32(x)) }
		rows := []string{
			"('recent', " + xid(next-1) + ")",
			"('after-wrap-5', " + xid(5) + ")",
			"('before-wrap-4294967290', " + xid(4294967290) + ")",
			"('frozen-past-2^31', " + xid(next+1000) + ")",
			"('after-wrap-3', " + xid(3) + ")",
			"('frozen', '2'::xid)",
			"('before-wrap-4294967295', " + xid(4294967295) + ")",
			"('bootstrap', '1'::xid)",
		}
		q := "SELECT label FROM (VALUES " + strings.Join(rows, ", ") + ") AS r(label, xmin) ORDER BY " + xidAgeKey + ", label"
		lrows, err := conn.Query(ctx, q)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		got, err := pgx.CollectRows(lrows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		want := []string{"bootstrap", "frozen", "frozen-past-2^31",
			"before-wrap-4294967290", "before-wrap-4294967295", "after-wrap-3", "after-wrap-5", "recent"}
		if !slices.Equal(got, want) {
			t.Errorf("ORDER BY %s\n got %v\nwant %v", xidAgeKey, got, want)
		}
	})

	t.Run("a real wrap", func(t *testing.T) {
		resetwal := filepath.Join(pg.BinDir(), "pg_resetwal")
		if _, err := os.Stat(resetwal); err != nil {
			t.Skipf("no pg_resetwal in %s to move the next xid near the wrap: %v", pg.BinDir(), err)
		}
		conn := orderConnect(t, url)
		orderExec(t, conn, "CREATE TABLE wrap_outbox (id text NOT NULL, topic text NOT NULL, payload text NOT NULL)")
		insert := func(id string) {
			orderExec(t, conn, "INSERT INTO wrap_outbox VALUES ("+QuoteLiteral(id)+", 't', '{}')")
		}
		insert("frozen-0")
		insert("frozen-1")
		conn.Close(ctx)
		// Every row the server will read after the jump must be frozen:
		// an unfrozen xid from before it would look like the future.
		for _, db := range []string{"app", "postgres", "template1"} {
			if err := pg.Exec(ctx, db, "VACUUM FREEZE"); err != nil {
				t.Fatal(err)
			}
		}
		if err := pg.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		const jump = 1<<32 - 100
		asServer(t, pg.DataDir(), resetwal, "-x", fmt.Sprint(jump), "-D", pg.DataDir())
		// pg_resetwal leaves the commit log segment of the new xid to be
		// made (its docs say so): 0FFF holds xids 4293918720 to 2^32-1.
		seg := filepath.Join(pg.DataDir(), "pg_xact", "0FFF")
		if err := os.WriteFile(seg, make([]byte, 32*8192), 0o600); err != nil {
			t.Fatal(err)
		}
		asServerOwner(t, pg.DataDir(), seg)
		if err := pg.StartAgain(ctx); err != nil {
			t.Fatal(err)
		}

		conn = orderConnect(t, url)
		for i := range 3 {
			insert(fmt.Sprintf("before-wrap-%d", i))
		}
		var epoch int64
		for epoch == 0 {
			if err := conn.QueryRow(ctx, "SELECT pg_current_xact_id()::text::bigint >> 32").Scan(&epoch); err != nil {
				t.Fatal(err)
			}
		}
		for i := range 3 {
			insert(fmt.Sprintf("after-wrap-%d", i))
		}
		var first, last uint32
		if err := conn.QueryRow(ctx, `SELECT (SELECT xmin::text::bigint FROM wrap_outbox WHERE id = 'before-wrap-0'),
			(SELECT xmin::text::bigint FROM wrap_outbox WHERE id = 'after-wrap-2')`).Scan(&first, &last); err != nil {
			t.Fatal(err)
		}
		if first < last {
			t.Fatalf("xmin %d before the wrap, %d after: no wrap between them", first, last)
		}
		got := backfillLabels(t, url, wrapTable, DefaultColumns(), idLabel)
		wantOrder(t, got, []string{"frozen-0", "frozen-1", "before-wrap-0", "before-wrap-1", "before-wrap-2",
			"after-wrap-0", "after-wrap-1", "after-wrap-2"})
	})
}

// asServer runs a server program as the owner of the data directory (the
// postgres user when the tests run as root).
func asServer(t *testing.T, dataDir, prog string, args ...string) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), prog, args...)
	cmd.Dir = dataDir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if st, err := os.Stat(dataDir); err == nil && os.Geteuid() == 0 {
		sys := st.Sys().(*syscall.Stat_t)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: sys.Uid, Gid: sys.Gid}}
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v\n%s", prog, args, err, out)
	}
}

// asServerOwner gives file to the owner of the data directory.
func asServerOwner(t *testing.T, dataDir, file string) {
	t.Helper()
	st, err := os.Stat(dataDir)
	if err != nil {
		t.Fatal(err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	if err := os.Chown(file, int(sys.Uid), int(sys.Gid)); err != nil {
		t.Fatal(err)
	}
}
