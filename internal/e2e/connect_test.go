package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	walboxsql "github.com/walbox/walbox/sql"

	"github.com/jackc/pgx/v5"
)

// hbaCluster starts a cluster whose pg_hba.conf is hba (plus local trust
// for the test's own set-up over the socket... and over loopback for the
// superuser), with database app migrated and role walbox (password pw).
func hbaCluster(t *testing.T, hba string) *pgtest.Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, url := pgtest.OwnDB(ctx, t)
	relaytest.Migrate(t, url, walboxsql.Params{})
	relaytest.Exec(t, url,
		"SET password_encryption = 'scram-sha-256'",
		"CREATE ROLE walbox LOGIN REPLICATION PASSWORD 'pw'",
		"GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA public TO walbox",
		"GRANT USAGE, CREATE ON SCHEMA walbox TO walbox",
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA walbox TO walbox",
		"ALTER PUBLICATION walbox_outbox OWNER TO walbox",
	)
	full := "# written by the test\nhost all postgres 127.0.0.1/32 trust\nhost replication postgres 127.0.0.1/32 trust\n" + hba
	if err := os.WriteFile(filepath.Join(cl.DataDir(), "pg_hba.conf"), []byte(full), 0o600); err != nil {
		t.Fatal(err)
	}
	relaytest.Exec(t, url, "SELECT pg_reload_conf()")
	return cl
}

// runExits runs `walbox run` with dbURL and wants it to exit with code 1
// within 30 s, saying all of want.
func (e *env) runExits(dbURL string, want ...string) {
	e.t.Helper()
	e.cfg.Postgres.URL = dbURL
	e.cfgFile = ""
	p := e.startProc()
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		e.t.Fatalf("walbox run with %s still running after 30 s; want exit 1 naming the fix\n%s", dbURL, p.output())
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 1 {
		e.t.Fatalf("walbox run with %s: exit %d, want 1\n%s", dbURL, code, p.output())
	}
	for _, w := range want {
		if !strings.Contains(p.output(), w) {
			e.t.Fatalf("walbox run with %s does not say %q:\n%s", dbURL, w, p.output())
		}
	}
}

// TestRunFailsFastOnPermanentConnectionErrors: a wrong database, an unknown
// role and a wrong password are not outages: walbox run exits 1 with the
// cause and the fix instead of retrying silently forever.
func TestRunFailsFastOnPermanentConnectionErrors(t *testing.T) {
	cl := hbaCluster(t, "host app walbox 127.0.0.1/32 scram-sha-256\nhost all all 127.0.0.1/32 trust\n")
	e := newEnv(t)
	port := cl.Port()
	e.runExits(fmt.Sprintf("postgres://postgres@127.0.0.1:%d/nosuchdb?sslmode=disable", port), "does not exist", "check the database name in postgres.url")
	e.runExits(fmt.Sprintf("postgres://nobody@127.0.0.1:%d/app?sslmode=disable", port), "may not log in", "--print-grants")
	e.runExits(fmt.Sprintf("postgres://walbox:wrong@127.0.0.1:%d/app?sslmode=disable", port), "password authentication failed", "postgres.password_file")
}

// TestPgHBAForLogicalReplicationIsTheDatabaseLine: with pg_hba.conf as the
// old advice had it (the database line for normal connections, a
// `replication` line for the replication connection, and nothing else),
// walbox's logical replication connection is refused: it is matched by
// database name. With the line the advice now gives, one per database, it
// runs. The refusal names that line.
func TestPgHBAForLogicalReplicationIsTheDatabaseLine(t *testing.T) {
	ctx := context.Background()
	old := hbaCluster(t, "host replication walbox 127.0.0.1/32 scram-sha-256\n")
	e := newEnv(t)
	e.runExits(fmt.Sprintf("postgres://walbox:pw@127.0.0.1:%d/app?sslmode=disable", old.Port()), "`host app walbox <walbox address>/32", "matched by database name")

	good := hbaCluster(t, "host app walbox 127.0.0.1/32 scram-sha-256\n")
	e.cfg.Postgres.URL = fmt.Sprintf("postgres://walbox:pw@127.0.0.1:%d/app?sslmode=disable", good.Port())
	e.cfgFile = ""
	p := e.startProc()
	defer func() {
		if t.Failed() {
			t.Logf("relay output:\n%s", p.output())
		}
	}()
	relaytest.Eventually(t, 30*time.Second, "walbox to stream with the advised pg_hba.conf line", func() bool {
		var active bool
		c, err := pgx.Connect(ctx, good.URL("app"))
		if err == nil {
			_ = c.QueryRow(ctx, "SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = 'walbox'").Scan(&active)
			c.Close(ctx)
		}
		return active
	})
	// doctor agrees: both connections pass with that one line.
	rep := ops.Doctor(ctx, e.cfg)
	for _, c := range rep.Checks {
		if (c.Name == "postgres.connect" || c.Name == "postgres.replication_connection") && c.Status != ops.OK {
			t.Fatalf("doctor with the advised pg_hba.conf line: %s is %v: %s", c.Name, c.Status, c.Detail)
		}
	}
	// And the recipe prints that line, not a `replication` one.
	recipe := ops.Grants(config.Default(), "walbox")
	if !strings.Contains(recipe, "hostssl <database>  walbox") || strings.Contains(recipe, "hostssl replication") {
		t.Fatalf("--print-grants' pg_hba.conf advice:\n%s", recipe)
	}
}

// TestReplicasAboveOneOnASingleServerFailsFast: the README's own minimal
// config (replicas: 3) against one NATS server looped forever on "replicas >
// 1 not supported in non-clustered mode", and doctor called it OK. Now
// doctor fails with the fix and walbox run exits 1 with it.
func TestReplicasAboveOneOnASingleServerFailsFast(t *testing.T) {
	e := newMigratedEnv(t)
	for i := range e.cfg.NATS.Streams {
		e.cfg.NATS.Streams[i].Replicas = 3
	}
	rep := ops.Doctor(context.Background(), e.cfg)
	found := false
	for _, c := range rep.Checks {
		if c.Name == "nats.stream.ORDERS.replicas" {
			found = true
			if c.Status != ops.Fail || !strings.Contains(c.Fix, "replicas: 1") {
				t.Fatalf("doctor: %+v, want a failure with the fix", c)
			}
		}
	}
	if !found {
		t.Fatal("doctor has no replicas check for ORDERS")
	}
	e.runExits(e.dbURL, "nats.streams[].replicas", "not clustered", "replicas: 1")
}

// TestWrongNATSAddressSaysConnectionRefused: walbox keeps retrying and
// stays not ready, and says why: the connection is refused (it used to
// print "outbound buffer limit exceeded" forever).
func TestWrongNATSAddressSaysConnectionRefused(t *testing.T) {
	e := newMigratedEnv(t)
	addr := freeAddr(t)
	e.cfg.NATS.URL = "nats://" + freeAddr(t) // nothing listens there
	e.cfg.Metrics.Listen = addr
	p := e.startProc()
	defer func() {
		if t.Failed() {
			t.Logf("relay output:\n%s", p.output())
		}
	}()
	relaytest.Eventually(t, 30*time.Second, "walbox to say the connection is refused", func() bool {
		return strings.Contains(p.output(), "connection refused")
	})
	if strings.Contains(p.output(), "outbound buffer limit exceeded") {
		t.Fatalf("walbox still reports the unsent request instead of the cause:\n%s", p.output())
	}
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d while NATS is unreachable, want 503", resp.StatusCode)
	}
	select {
	case <-p.done:
		t.Fatalf("walbox exited on an unreachable NATS; it must keep retrying:\n%s", p.output())
	default:
	}
}

// A configured table that does not exist: the error says so and names
// walbox migrate (it suggested ALTER PUBLICATION ... ADD TABLE, which fails
// for a missing table).
func TestMissingOutboxTableNamesMigrate(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.Outbox.Table = "public.no_such_outbox" })
	e.migrate() // creates the publication (for the default table)
	e.runExits(e.dbURL, "outbox table public.no_such_outbox does not exist", "walbox migrate")
}
