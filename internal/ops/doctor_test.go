package ops

import (
	"bytes"
	"context"
	"encoding/json"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay/jssink"
)

func checkOf(t *testing.T, r *DoctorReport, name string) Check {
	t.Helper()
	for _, c := range r.Checks {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no check %s in %+v", name, r.Checks)
	return Check{}
}

// wantCheck fails the test unless check name has status and a fix that
// contains fix ("": any).
func wantCheck(t *testing.T, r *DoctorReport, name string, status CheckStatus, fix string) {
	t.Helper()
	if c := checkOf(t, r, name); c.Status != status || !strings.Contains(c.Fix, fix) {
		t.Errorf("check %s: %+v; want status %s and a fix that says %q", name, c, status, fix)
	}
}

func TestDoctorGoodSetup(t *testing.T) {
	e := newEnv(t)
	ctx := testCtx(t)
	if _, _, err := jssink.EnsureStreams(ctx, e.connectJS(), e.cfg.StreamSpecs()); err != nil {
		t.Fatal(err)
	}
	rep := Doctor(ctx, e.cfg)
	var out bytes.Buffer
	rep.Print(&out)
	if !rep.OK || rep.Failed != 0 {
		t.Fatalf("doctor failed on a good setup:\n%s", out.String())
	}
	for _, name := range []string{"postgres.connect", "postgres.wal_level", "postgres.role", "postgres.replication_connection",
		"postgres.outbox_table", "postgres.outbox_privileges", "postgres.publication", "postgres.slot", "postgres.walbox_schema",
		"nats.connect", "nats.jetstream", "nats.stream.ORDERS", "nats.stream.PAYMENTS", "nats.stream.WALBOX_DLQ"} {
		wantCheck(t, rep, name, OK, "")
	}
	// The test cluster keeps WAL without limit and the streams are R1:
	// warnings with their fix.
	wantCheck(t, rep, "postgres.max_slot_wal_keep_size", Warn, "max_slot_wal_keep_size")
	wantCheck(t, rep, "postgres.sweeper_maintain", OK, "")
	wantCheck(t, rep, "postgres.outbox_partitions", OK, "")
	wantCheck(t, rep, "postgres.unprocessed_index", OK, "")
	wantCheck(t, rep, "postgres.idle_replication_slot_timeout", OK, "")
	c := checkOf(t, rep, "nats.stream.ORDERS.durability")
	if c.Status != Warn || !strings.Contains(c.Detail, "R1 stream: acks are durable only with sync_interval: always on the server; use replicas: 3 for durability") {
		t.Errorf("durability: %+v", c)
	}
	mustContain(t, "doctor output", out.String(), "0 failed", "fix: ALTER SYSTEM SET max_slot_wal_keep_size")

	var js bytes.Buffer
	if err := rep.PrintJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back DoctorReport
	if err := json.Unmarshal(js.Bytes(), &back); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, js.String())
	}
	if !back.OK || len(back.Checks) != len(rep.Checks) {
		t.Fatalf("JSON round trip: %+v", back)
	}
}

func TestDoctorBadRoleStreamsAndNATS(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		f := false
		c.NATS.Streams[1].Manage = &f // PAYMENTS must exist: it does not
		c.NATS.Streams[0].DuplicateWindow = 30 * time.Second
	})
	ctx := testCtx(t)
	role := uniqueName(t, "norepl")
	e.exec("CREATE ROLE " + role + " LOGIN")
	t.Cleanup(func() {
		e.exec("DROP OWNED BY " + role)
		e.exec("DROP ROLE " + role)
	})
	e.exec("GRANT SELECT ON outbox_events TO " + role)
	if _, _, err := jssink.EnsureStreams(ctx, e.connectJS(), e.cfg.StreamSpecs()[:1]); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(e.dbURL)
	u.User = url.User(role)
	cfg := e.cfg
	cfg.Postgres.URL = u.String()

	rep := Doctor(ctx, cfg)
	var out bytes.Buffer
	rep.Print(&out)
	if rep.OK || rep.Failed == 0 {
		t.Fatalf("doctor passed a role without REPLICATION:\n%s", out.String())
	}
	wantCheck(t, rep, "postgres.role", Fail, "WITH REPLICATION")
	wantCheck(t, rep, "postgres.sweeper_maintain", Warn, "sweeper.maintain: false")
	wantCheck(t, rep, "postgres.replication_connection", Skip, "")
	wantCheck(t, rep, "postgres.outbox_privileges", Fail, "GRANT UPDATE (processed, processed_at, error, attempts)")
	wantCheck(t, rep, "nats.stream.PAYMENTS", Fail, "manage: true")
	wantCheck(t, rep, "nats.stream.ORDERS.duplicate_window", Warn, "")
	mustContain(t, "doctor output", out.String(), "FAIL", "ALTER ROLE")

	// NATS down: the connection check fails with its fix, JetStream skips.
	cfg.NATS.URL = "nats://127.0.0.1:1"
	rep = Doctor(ctx, cfg)
	wantCheck(t, rep, "nats.connect", Fail, "nats.url")
	wantCheck(t, rep, "nats.jetstream", Skip, "")
}

// TestDoctorPublicationViaRoot: publish_via_partition_root off, as a
// Debezium publication has it, is fine for an outbox that is not
// partitioned and a failure for one that is.
// The partitions the outbox has left, its default partition and its index
// for unprocessed rows: each bad state with its fix (docs/sweeper.md).
func TestDoctorPartitionsAndUnprocessedIndex(t *testing.T) {
	e := newEnv(t)
	ctx := testCtx(t)
	// An older walbox's default partition: the sweeper removes it.
	e.exec(`CREATE TABLE outbox_events_default PARTITION OF outbox_events DEFAULT`)
	if c := checkOf(t, Doctor(ctx, e.cfg), "postgres.outbox_partitions"); c.Status != OK || !strings.Contains(c.Detail, "removes it") {
		t.Errorf("an older walbox's default partition: %+v", c)
	}
	// A default partition of the DBA's: kept, and archival cannot detach
	// concurrently next to it.
	e.exec(`ALTER TABLE outbox_events_default RENAME TO outbox_events_catchall`)
	if c := checkOf(t, Doctor(ctx, e.cfg), "postgres.outbox_partitions"); c.Status != Warn || !strings.Contains(c.Fix, "DETACH PARTITION") {
		t.Errorf("a DBA's default partition: %+v", c)
	}
	e.exec(`DROP TABLE outbox_events_catchall`)
	// Partitions running out: only yesterday's and today's left.
	e.exec(`DO $$ DECLARE p text; BEGIN
		FOR p IN SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		         WHERE i.inhparent = 'outbox_events'::regclass AND c.relname > 'outbox_events_p' || to_char(now(), 'YYYYMMDD') LOOP
			EXECUTE format('DROP TABLE %I', p);
		END LOOP; END $$`)
	if c := checkOf(t, Doctor(ctx, e.cfg), "postgres.outbox_partitions"); c.Status != Fail || !strings.Contains(c.Fix, "walbox.ensure_partitions") {
		t.Errorf("partitions running out: %+v", c)
	}
	// No index for unprocessed rows in the queries' form.
	e.exec(`DO $$ DECLARE i text; BEGIN
		FOR i IN SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = 'outbox_events'::regclass AND indpred IS NOT NULL LOOP
			EXECUTE 'DROP INDEX ' || i;
		END LOOP; END $$`)
	e.exec(`CREATE INDEX outbox_events_wrong_form ON outbox_events (created_at) WHERE processed IS NOT TRUE`)
	if c := checkOf(t, Doctor(ctx, e.cfg), "postgres.unprocessed_index"); c.Status != Warn || !strings.Contains(c.Fix, "WHERE NOT processed") {
		t.Errorf("index in the wrong form: %+v", c)
	}
}

func TestDoctorPublicationViaRoot(t *testing.T) {
	e := debeziumEnv(t)
	ctx := testCtx(t)
	cfg := e.cfg
	cfg.Postgres.Publication = "dbz_publication"
	if c := checkOf(t, Doctor(ctx, cfg), "postgres.publication"); c.Status != OK || !strings.Contains(c.Detail, "not partitioned") {
		t.Errorf("publication without partition root, plain table: %+v", c)
	}
	e.exec(`CREATE PUBLICATION dbz_partitioned FOR TABLE public.outbox_events`)
	cfg.Postgres.Publication = "dbz_partitioned"
	cfg.Outbox.Table = "public.outbox_events"
	cfg.Outbox.Layout = config.LayoutWalbox
	if c := checkOf(t, Doctor(ctx, cfg), "postgres.publication"); c.Status != Fail || !strings.Contains(c.Fix, "publish_via_partition_root = true") {
		t.Errorf("publication without partition root, partitioned table: %+v", c)
	}
}

// A server that carries Amazon RDS's setting is recognised: the wal_level
// fix names the parameter group (ALTER SYSTEM is not allowed there), and a
// role without the REPLICATION attribute that is a member of rds_replication
// passes, as on RDS (a local role mimics it).
func TestDoctorRecognisesRDS(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, dbURL := pgtest.OwnDB(ctx, t, pgtest.WithSetting("rds.logical_replication", "0"), pgtest.WithSetting("wal_level", "replica"))
	relaytest.Exec(t, dbURL, "CREATE ROLE rds_replication", "CREATE ROLE app_walbox LOGIN", "GRANT rds_replication TO app_walbox", "CREATE ROLE app_plain LOGIN")
	e := newEnv(t)
	as := func(role string) *DoctorReport {
		u, _ := url.Parse(dbURL)
		u.User = url.User(role)
		cfg := e.cfg
		cfg.Postgres.URL = u.String()
		return Doctor(ctx, cfg)
	}
	rep := as("app_walbox")
	if c := checkOf(t, rep, "postgres.provider"); c.Status != OK || !strings.Contains(c.Detail, "Amazon RDS") {
		t.Errorf("provider: %+v", c)
	}
	if c := checkOf(t, rep, "postgres.wal_level"); c.Status != Fail || !strings.Contains(c.Fix, "rds.logical_replication = 1") || !strings.Contains(c.Fix, "parameter group") {
		t.Errorf("wal_level on RDS: %+v", c)
	}
	if c := checkOf(t, rep, "postgres.role"); c.Status != OK || !strings.Contains(c.Detail, "rds_replication") {
		t.Errorf("a member of rds_replication: %+v", c)
	}
	if c := checkOf(t, as("app_plain"), "postgres.role"); c.Status != Fail || !strings.Contains(c.Fix, "GRANT rds_replication TO") {
		t.Errorf("a role without it: %+v", c)
	}
}

// Something between walbox and the server (here a TCP proxy, as a pooler
// would be) shows as a port that differs from the server's own.
func TestDoctorSeesSomethingInBetween(t *testing.T) {
	e := newEnv(t)
	u, _ := url.Parse(e.dbURL)
	proxy := relaytest.Proxy(t, u.Host, nil)
	if c := checkOf(t, Doctor(e.ctx, e.cfg), "postgres.direct"); c.Status != OK {
		t.Errorf("direct connection: %+v", c)
	}
	u.Host = proxy
	cfg := e.cfg
	cfg.Postgres.URL = u.String()
	if c := checkOf(t, Doctor(e.ctx, cfg), "postgres.direct"); c.Status != Warn || !strings.Contains(c.Fix, "pooler") {
		t.Errorf("through a proxy: %+v", c)
	}
}

// TestGrantsRecipeRunsTheRelay applies the printed recipe and runs doctor and
// the relay as the role it creates.
func TestGrantsRecipeRunsTheRelay(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.Postgres.CreatePublication = false
		c.Archive.After = 0 // partition upkeep needs ownership; the recipe says so
	})
	ctx := testCtx(t)
	role := uniqueName(t, "walbox_least")
	sql := Grants(e.cfg, role)
	for _, want := range []string{"CREATE ROLE " + `"` + role + `"` + " LOGIN REPLICATION", "GRANT SELECT ON \"public\".\"outbox_events\"",
		"GRANT UPDATE (processed, processed_at, error, attempts)", "GRANT USAGE ON SCHEMA walbox", "walbox.relay_status",
		"create_publication: false", "host", "replication"} {
		if !strings.Contains(sql, want) {
			t.Errorf("recipe lacks %q:\n%s", want, sql)
		}
	}
	conn := relaytest.Conn(t, e.dbURL)
	if _, err := conn.PgConn().Exec(ctx, sql).ReadAll(); err != nil {
		t.Fatalf("the recipe does not run: %v\n%s", err, sql)
	}
	t.Cleanup(func() {
		e.exec(`DROP OWNED BY "` + role + `"`)
		e.exec(`DROP ROLE "` + role + `"`)
	})

	u, _ := url.Parse(e.dbURL)
	u.User = url.User(role)
	e.cfg.Postgres.URL = u.String()
	rep := Doctor(ctx, e.cfg)
	for _, name := range []string{"postgres.role", "postgres.replication_connection", "postgres.outbox_privileges", "postgres.publication", "postgres.walbox_schema"} {
		wantCheck(t, rep, name, OK, "")
	}
	if !rep.OK {
		t.Errorf("doctor as the least-privilege role failed: %+v", rep.Checks)
	}

	e.startRelay()
	id := e.insert("orders.created", `{"least":"privilege"}`)
	e.waitMsgs("ORDERS", 1)
	if got := e.streamIDs("ORDERS"); len(got) != 1 || got[0] != id {
		t.Fatalf("ORDERS: %v", got)
	}
	// The sweeper marks the row as the role.
	relaytest.Eventually(t, 60*time.Second, "the row marked processed by the least-privilege role", func() bool {
		var done bool
		if err := conn.QueryRow(ctx, "SELECT processed FROM outbox_events WHERE id = $1", id).Scan(&done); err != nil {
			t.Fatal(err)
		}
		return done
	})
	// relay_status is written by the role, too.
	relaytest.Eventually(t, 60*time.Second, "relay_status written by the role", func() bool {
		rep, err := Status(ctx, e.cfg)
		if err != nil {
			t.Fatal(err)
		}
		return rep.Relay.State == "running"
	})
}
