package pgtest

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/pgcluster"
)

// Main starts one cluster for a whole test package, stores it in *cluster,
// runs the tests and closes the cluster, returning the exit code for
// os.Exit. Sharing one cluster keeps tests fast (initdb costs about a
// second); tests isolate themselves with NewDB. Use it as
//
//	var pg *pgtest.Cluster
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, &pg)) }
//
// If the cluster cannot be started the error is printed and 1 is returned,
// so a missing PostgreSQL installation fails loudly instead of skipping.
func Main(m *testing.M, cluster **Cluster, opts ...Option) int {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	c, err := Start(ctx, opts...)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	*cluster = c
	if v, err := c.Version(); err == nil && os.Getenv("WALBOX_PG_BINDIR") != "" {
		// A matrix run says which major it ran against.
		fmt.Fprintf(os.Stderr, "pgtest: PostgreSQL %d from %s\n", v, c.BinDir())
	}
	code := m.Run()
	if err := c.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// ServerDir returns an empty folder, removed when the test ends, that the
// PostgreSQL server user can reach when the tests run as root (t.TempDir
// cannot be): for a data directory or a walbox dev run.
func ServerDir(t testing.TB, pattern string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", pattern)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// StartOwn starts a cluster of the test's own, for settings the shared one
// lacks or to stop and restart it, closed when the test ends.
func StartOwn(ctx context.Context, t testing.TB, opts ...Option) *Cluster {
	t.Helper()
	c, err := Start(ctx, opts...)
	if err != nil {
		t.Fatalf("pgtest: start a cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// OwnDB is StartOwn with a database app created on the cluster: it returns
// the cluster and that database's URL.
func OwnDB(ctx context.Context, t testing.TB, opts ...Option) (*Cluster, string) {
	t.Helper()
	c := StartOwn(ctx, t, opts...)
	u, err := c.CreateDB(ctx, "app")
	if err != nil {
		t.Fatalf("pgtest: create database app: %v", err)
	}
	return c, u
}

// NewDB creates a fresh database named after the test, so tests sharing a
// cluster do not see each other's tables, publications or slots, and returns
// its URL. The name is walbox_t_<test name>_<n>: lower-case, only
// [a-z0-9_], at most 63 bytes (longer names would be truncated by the
// server), unique within the cluster.
//
// A cleanup registered with t drops the database again. Logical replication
// slots pin a database (DROP DATABASE fails while one exists, even WITH
// (FORCE)), so the cleanup first terminates walsenders using slots of the
// database and drops those slots.
func (c *Cluster) NewDB(t testing.TB) string {
	t.Helper()
	name := dbName(t.Name(), c.dbSeq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	u, err := c.CreateDB(ctx, name)
	if err != nil {
		t.Fatalf("pgtest: NewDB: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := c.dropDB(ctx, name); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})
	return u
}

// dropDB removes the replication slots of database name and then the
// database itself, disconnecting its sessions.
func (c *Cluster) dropDB(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())

	// A walsender releases its slot only some time after it was
	// terminated, so repeat until no slot of the database is left.
	for {
		if _, err := conn.Exec(ctx,
			`SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
			 WHERE database = $1 AND active_pid IS NOT NULL`, name); err != nil {
			return fmt.Errorf("terminate walsenders: %w", err)
		}
		if _, err := conn.Exec(ctx,
			`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
			 WHERE database = $1 AND NOT active`, name); err != nil {
			return fmt.Errorf("drop replication slots: %w", err)
		}
		var left int
		if err := conn.QueryRow(ctx,
			`SELECT count(*) FROM pg_replication_slots WHERE database = $1`, name).Scan(&left); err != nil {
			return fmt.Errorf("count replication slots: %w", err)
		}
		if left == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d replication slot(s) still in use: %w", left, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}

	_, err = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
	return err
}

// dbName builds NewDB's database name from a test name such as
// "TestFoo/sub_case#01" and a sequence number.
func dbName(testName string, n int64) string {
	var b strings.Builder
	underscore := false
	for _, r := range strings.ToLower(testName) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
			underscore = false
		} else if !underscore {
			b.WriteByte('_')
			underscore = true
		}
	}
	slug := strings.Trim(b.String(), "_")
	suffix := "_" + strconv.FormatInt(n, 10)
	if max := pgcluster.MaxIdentLen - len(dbPrefix) - len(suffix); len(slug) > max {
		slug = strings.TrimRight(slug[:max], "_")
	}
	return dbPrefix + slug + suffix
}
