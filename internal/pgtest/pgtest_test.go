package pgtest

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walbox/walbox/internal/relaytest"
)

// pg is the cluster shared by the tests of this package.
var pg *Cluster

func TestMain(m *testing.M) { os.Exit(Main(m, &pg)) }

func connect(t *testing.T, ctx context.Context, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func show(t *testing.T, ctx context.Context, conn *pgx.Conn, setting string) string {
	t.Helper()
	var v string
	if err := conn.QueryRow(ctx, "SHOW "+setting).Scan(&v); err != nil {
		t.Fatalf("SHOW %s: %v", setting, err)
	}
	return v
}

func TestSharedClusterDefaults(t *testing.T) {
	ctx := relaytest.Ctx(t)
	if pg.Port() <= 0 {
		t.Fatalf("Port() = %d", pg.Port())
	}
	if _, err := os.Stat(filepath.Join(pg.DataDir(), "PG_VERSION")); err != nil {
		t.Fatalf("DataDir() %s is not a data directory: %v", pg.DataDir(), err)
	}
	if _, err := os.Stat(filepath.Join(pg.BinDir(), "pg_ctl")); err != nil {
		t.Fatalf("BinDir() %s has no pg_ctl: %v", pg.BinDir(), err)
	}
	want := "postgres://postgres@127.0.0.1:" + strconv.Itoa(pg.Port()) + "/x?sslmode=disable"
	if got := pg.URL("x"); got != want {
		t.Fatalf("URL(x) = %q, want %q", got, want)
	}

	url := pg.NewDB(t)
	conn := connect(t, ctx, url)
	if got := show(t, ctx, conn, "wal_level"); got != "logical" {
		t.Errorf("wal_level = %q, want logical", got)
	}
	if got := show(t, ctx, conn, "port"); got != strconv.Itoa(pg.Port()) {
		t.Errorf("port = %q, want %d", got, pg.Port())
	}
	if got := show(t, ctx, conn, "max_replication_slots"); got != "32" {
		t.Errorf("max_replication_slots = %q, want 32", got)
	}
	if got := show(t, ctx, conn, "max_slot_wal_keep_size"); got != "-1" {
		t.Errorf("max_slot_wal_keep_size = %q, want -1", got)
	}
	var db string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(db, "walbox_t_testsharedclusterdefaults_") {
		t.Errorf("database name %q does not follow walbox_t_<test>_<n>", db)
	}
}

func TestDBName(t *testing.T) {
	if got := dbName("TestFoo/Sub Case#01", 7); got != "walbox_t_testfoo_sub_case_01_7" {
		t.Errorf("dbName = %q", got)
	}
	long := strings.Repeat("TestVeryLongName/", 10)
	a, b := dbName(long, 1), dbName(long, 12345)
	if len(a) > 63 || len(b) > 63 {
		t.Errorf("names too long: %q (%d), %q (%d)", a, len(a), b, len(b))
	}
	if a == b {
		t.Errorf("names not unique: %q", a)
	}
	if !strings.HasSuffix(b, "_12345") {
		t.Errorf("suffix lost when truncating: %q", b)
	}
}

func TestNewDBUnique(t *testing.T) {
	a, b := pg.NewDB(t), pg.NewDB(t)
	if a == b {
		t.Fatalf("NewDB returned the same URL twice: %s", a)
	}
}

// TestNewDBCleanupDropsSlots checks that the cleanup of NewDB copes with an
// active walsender and an inactive slot in the database.
func TestNewDBCleanupDropsSlots(t *testing.T) {
	ctx := relaytest.Ctx(t)
	var (
		name string
		repl *pgconn.PgConn
	)
	t.Run("inner", func(t *testing.T) {
		url := pg.NewDB(t)
		conn := connect(t, ctx, url)
		if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&name); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "CREATE PUBLICATION p FOR ALL TABLES"); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", name+"_idle"); err != nil {
			t.Fatal(err)
		}

		var err error
		repl, err = pgconn.Connect(ctx, url+"&replication=database")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pglogrepl.CreateReplicationSlot(ctx, repl, name+"_active", "pgoutput", pglogrepl.CreateReplicationSlotOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := pglogrepl.StartReplication(ctx, repl, name+"_active", 0, pglogrepl.StartReplicationOptions{
			PluginArgs: []string{"proto_version '1'", "publication_names 'p'"},
		}); err != nil {
			t.Fatal(err)
		}
		var active bool
		if err := conn.QueryRow(ctx, "SELECT active FROM pg_replication_slots WHERE slot_name = $1", name+"_active").Scan(&active); err != nil || !active {
			t.Fatalf("slot not active: %v %v", active, err)
		}
		// repl is deliberately left streaming: the cleanup must cope.
	})
	if repl != nil {
		defer repl.Close(context.Background())
	}
	if t.Failed() {
		return
	}

	conn := connect(t, ctx, pg.URL("postgres"))
	var dbs, slots int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_database WHERE datname = $1", name).Scan(&dbs); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE database = $1", name).Scan(&slots); err != nil {
		t.Fatal(err)
	}
	if dbs != 0 || slots != 0 {
		t.Errorf("after cleanup: %d databases and %d slots named after %s left", dbs, slots, name)
	}
}

func TestRestart(t *testing.T) {
	ctx := relaytest.Ctx(t)
	url := pg.NewDB(t)
	before := connect(t, ctx, url)
	var pid1 int
	if err := before.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid1); err != nil {
		t.Fatal(err)
	}

	if err := pg.Restart(ctx); err != nil {
		t.Fatal(err)
	}

	if err := before.Ping(ctx); err == nil {
		t.Error("connection from before the restart still works")
	}
	after := connect(t, ctx, url)
	if got := show(t, ctx, after, "wal_level"); got != "logical" {
		t.Errorf("wal_level after restart = %q", got)
	}
}

// TestKillStartAgain uses its own cluster because killing the shared one
// would break tests running at the same time.
func TestKillStartAgain(t *testing.T) {
	ctx := relaytest.Ctx(t)
	c, err := Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	url := c.URL("postgres")

	conn := connect(t, ctx, url)
	// The cluster runs with synchronous_commit=off, so a commit is only in
	// WAL buffers (lost on SIGKILL) until the walwriter writes it. Make this
	// session's commits write their WAL before returning.
	if _, err := conn.Exec(ctx, "SET synchronous_commit = on"); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE t (v text); INSERT INTO t VALUES ('before kill')"); err != nil {
		t.Fatal(err)
	}
	// conn stays open so a backend process exists while killing.
	if err := c.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := conn.Ping(ctx); err == nil {
		t.Fatal("connection still works after Kill")
	}
	if err := c.Kill(); err == nil {
		t.Error("second Kill succeeded on a dead server")
	}

	if err := c.StartAgain(ctx); err != nil {
		t.Fatal(err)
	}
	conn2 := connect(t, ctx, url)
	var v string
	if err := conn2.QueryRow(ctx, "SELECT v FROM t").Scan(&v); err != nil || v != "before kill" {
		t.Fatalf("row after kill + restart: %q, %v", v, err)
	}
	if _, err := conn2.Exec(ctx, "INSERT INTO t VALUES ('before stop')"); err != nil {
		t.Fatal(err)
	}

	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.StartAgain(ctx); err != nil {
		t.Fatal(err)
	}
	conn3 := connect(t, ctx, url)
	var n int
	if err := conn3.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n); err != nil || n != 2 {
		t.Fatalf("rows after stop + start: %d, %v", n, err)
	}

	base := filepath.Dir(c.DataDir())
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := os.Stat(base); !os.IsNotExist(err) {
		t.Errorf("%s still exists after Close: %v", base, err)
	}
	if err := c.StartAgain(ctx); err == nil {
		t.Error("StartAgain after Close succeeded")
	}
}

func TestWithSettingReplica(t *testing.T) {
	ctx := relaytest.Ctx(t)
	c, err := Start(ctx, WithSetting("wal_level", "replica"), WithSetting("application_name", "it's pgtest"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	if c.Port() == pg.Port() {
		t.Errorf("second cluster got the shared cluster's port %d", c.Port())
	}
	url, err := c.CreateDB(ctx, "replica_test")
	if err != nil {
		t.Fatal(err)
	}
	conn := connect(t, ctx, url)
	if got := show(t, ctx, conn, "wal_level"); got != "replica" {
		t.Errorf("wal_level = %q, want replica", got)
	}
	if got := show(t, ctx, conn, "application_name"); got != "it's pgtest" {
		t.Errorf("application_name = %q", got)
	}
	if err := c.Exec(ctx, "replica_test", "SELECT pg_create_logical_replication_slot('s', 'pgoutput')"); err == nil {
		t.Error("logical slot creation succeeded with wal_level=replica")
	}
}
