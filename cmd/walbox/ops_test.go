package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay/jssink"
	walboxsql "github.com/walbox/walbox/sql"
)

// runCLI runs the walbox command line in-process with stdin and returns its
// output and error (an exitError carries the exit code).
func runCLI(ctx context.Context, stdin string, args ...string) (string, error) {
	root := newRootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetIn(strings.NewReader(stdin))
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	return out.String(), err
}

func exitCode(err error) int {
	var ee exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	default:
		return 1 // main prints it and exits 1
	}
}

// migratedDB creates a database on c with walbox's migrations applied.
func migratedDB(t *testing.T, ctx context.Context, c *pgtest.Cluster, name string) string {
	t.Helper()
	u, err := c.CreateDB(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	relaytest.Migrate(t, u, walboxsql.Params{})
	return u
}

func writeConfig(t *testing.T, pgURL, natsURL string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "walbox.yaml")
	cfg := fmt.Sprintf(`postgres:
  url: %q
nats:
  url: %q
  streams:
    - {name: ORDERS, subjects: ["orders.>"]}
metrics:
  listen: ""
`, pgURL, natsURL)
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestOpsCommandsExitCodes runs doctor, slot and migrate --print-grants
// through the command line: a good setup, and a wal_level = replica cluster
// with a role that may not replicate.
func TestOpsCommandsExitCodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	good := pgtest.StartOwn(ctx, t)
	bad := pgtest.StartOwn(ctx, t, pgtest.WithSetting("wal_level", "replica"))
	ns := natstest.New(t)

	goodURL := migratedDB(t, ctx, good, "app")
	goodCfg := writeConfig(t, goodURL, ns.URL())
	out, err := runCLI(ctx, "", "doctor", "--config", goodCfg)
	if exitCode(err) != 0 || !strings.Contains(out, "0 failed") {
		t.Fatalf("doctor on a good setup: exit %d (%v)\n%s", exitCode(err), err, out)
	}
	out, err = runCLI(ctx, "", "doctor", "--json", "--config", goodCfg)
	var rep struct {
		OK     bool `json:"ok"`
		Checks []struct{ Name, Status, Detail, Fix string }
	}
	if exitCode(err) != 0 || json.Unmarshal([]byte(out), &rep) != nil || !rep.OK || len(rep.Checks) < 20 {
		t.Fatalf("doctor --json: exit %d, %+v\n%s", exitCode(err), rep, out)
	}

	badURL := migratedDB(t, ctx, bad, "app")
	conn, err := pgx.Connect(ctx, badURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `CREATE ROLE norepl LOGIN; GRANT SELECT ON outbox_events TO norepl`); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	u, _ := url.Parse(badURL)
	u.User = url.User("norepl")
	badCfg := writeConfig(t, u.String(), ns.URL())
	out, err = runCLI(ctx, "", "doctor", "--config", badCfg)
	if exitCode(err) != 1 {
		t.Fatalf("doctor on a bad setup: exit %d (%v)\n%s", exitCode(err), err, out)
	}
	for _, want := range []string{"FAIL  postgres.wal_level", "wal_level is 'replica'", "fix: ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL",
		"FAIL  postgres.role", "ALTER ROLE \"norepl\" WITH REPLICATION", "failed"} {
		if !strings.Contains(out, want) {
			t.Errorf("doctor output lacks %q:\n%s", want, out)
		}
	}
	out, err = runCLI(ctx, "", "doctor", "--json", "--config", badCfg)
	if exitCode(err) != 1 || json.Unmarshal([]byte(out), &rep) != nil || rep.OK {
		t.Fatalf("doctor --json on a bad setup: exit %d, %+v", exitCode(err), rep)
	}

	// slot create / status / drop, the prompt fed on stdin.
	if out, err = runCLI(ctx, "", "slot", "create", "--config", goodCfg); err != nil || !strings.Contains(out, "created slot walbox") {
		t.Fatalf("slot create: %v\n%s", err, out)
	}
	if out, err = runCLI(ctx, "", "slot", "status", "--json", "--config", goodCfg); err != nil || !strings.Contains(out, `"plugin": "pgoutput"`) {
		t.Fatalf("slot status --json: %v\n%s", err, out)
	}
	out, err = runCLI(ctx, "no\n", "slot", "drop", "--config", goodCfg)
	if exitCode(err) != 1 || !strings.Contains(out, "[y/N]") || !strings.Contains(err.Error(), "aborted") {
		t.Fatalf("slot drop answered no: exit %d (%v)\n%s", exitCode(err), err, out)
	}
	if out, err = runCLI(ctx, "", "slot", "drop", "--yes", "--config", goodCfg); err != nil || !strings.Contains(out, "dropped slot walbox") {
		t.Fatalf("slot drop --yes: %v\n%s", err, out)
	}

	// slot adopt: both flags required; another client's slot copied to
	// walbox's, asked first; then walbox's slot exists and adopt refuses.
	if _, err = runCLI(ctx, "", "slot", "adopt", "--config", goodCfg); err == nil || !strings.Contains(err.Error(), "required flag") {
		t.Fatalf("slot adopt without --slot and --publication: %v", err)
	}
	other, err := pgx.Connect(ctx, goodURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Exec(ctx, `SELECT pg_create_logical_replication_slot('debezium', 'pgoutput')`); err != nil {
		t.Fatal(err)
	}
	other.Close(ctx)
	adopt := []string{"slot", "adopt", "--slot", "debezium", "--publication", "walbox_outbox", "--config", goodCfg}
	out, err = runCLI(ctx, "no\n", adopt...)
	if exitCode(err) != 1 || !strings.Contains(out, "Copy slot debezium") || !strings.Contains(out, "[y/N]") || !strings.Contains(err.Error(), "aborted") {
		t.Fatalf("slot adopt answered no: exit %d (%v)\n%s", exitCode(err), err, out)
	}
	out, err = runCLI(ctx, "", append(adopt, "--yes")...)
	if err != nil || !strings.Contains(out, "copied slot debezium to walbox at confirmed_flush_lsn") || !strings.Contains(out, "SELECT pg_drop_replication_slot('debezium');") {
		t.Fatalf("slot adopt --yes: %v\n%s", err, out)
	}
	out, err = runCLI(ctx, "", append(adopt, "--yes", "--drop-source")...)
	if exitCode(err) != 1 || !strings.Contains(err.Error(), `walbox's slot "walbox" (postgres.slot) already exists`) {
		t.Fatalf("slot adopt with walbox's slot there: exit %d (%v)\n%s", exitCode(err), err, out)
	}

	out, err = runCLI(ctx, "", "migrate", "--print-grants", "--role", "app_relay", "--config", goodCfg)
	if err != nil || !strings.Contains(out, `CREATE ROLE "app_relay" LOGIN REPLICATION`) {
		t.Fatalf("migrate --print-grants: %v\n%s", err, out)
	}
	if _, err = runCLI(ctx, "", "replay", "--config", goodCfg); err == nil {
		t.Fatal("replay without a selection succeeded")
	}
	if _, err = runCLI(ctx, "", "dlq", "retry", "--config", goodCfg); err == nil {
		t.Fatal("dlq retry without --seq or --all succeeded")
	}
	// --json on the commands that report (the streams as walbox run makes them).
	gc, err := config.Load(goodCfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if _, _, err := jssink.EnsureStreams(ctx, js, gc.StreamSpecs()); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"replay", "--json", "--dry-run", "--from", "1h"},
		{"dlq", "list", "--json"},
		{"dlq", "retry", "--all", "--yes", "--json"},
		{"archive", "--dry-run", "--json"},
	} {
		out, err := runCLI(ctx, "", append(args, "--config", goodCfg)...)
		if err != nil || !json.Valid([]byte(out)) {
			t.Fatalf("walbox %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

func TestVersionFlag(t *testing.T) {
	out, err := runCLI(t.Context(), "", "--version")
	if err != nil || !strings.HasPrefix(out, "walbox version ") || !strings.Contains(out, "go1.") {
		t.Fatalf("walbox --version: %q, %v", out, err)
	}
}

// The commands that use only PostgreSQL need only a PostgreSQL URL: no
// config file, no nats.streams.
func TestPostgresOnlyCommandsNeedOnlyAURL(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	url := freshDB(ctx, t)
	for _, args := range [][]string{
		{"migrate", "--postgres-url", url},
		{"slot", "create", "--postgres-url", url},
		{"slot", "status", "--postgres-url", url},
		{"archive", "--dry-run", "--postgres-url", url},
		{"slot", "drop", "--yes", "--postgres-url", url},
	} {
		out, err := runCLI(ctx, "", args...)
		if err != nil {
			t.Fatalf("walbox %s with only a PostgreSQL URL: %v\n%s", strings.Join(args[:len(args)-2], " "), err, out)
		}
	}
	// run still needs the streams, and says so.
	if _, err := runCLI(ctx, "", "run", "--postgres-url", url); err == nil || !strings.Contains(err.Error(), "nats.streams") {
		t.Fatalf("walbox run without nats.streams: %v", err)
	}
}

func TestConfigExampleIsTheReference(t *testing.T) {
	ref, err := os.ReadFile("../../testdata/walbox.yaml")
	if err != nil {
		t.Fatal(err)
	}
	out, err := runCLI(t.Context(), "", "config", "example")
	if err != nil || out != string(ref) {
		t.Fatalf("walbox config example differs from testdata/walbox.yaml (cp testdata/walbox.yaml cmd/walbox/walbox.example.yaml): %v", err)
	}
}

// Without --config or WALBOX_CONFIG, ./walbox.yaml is read.
func TestWalboxYAMLInTheWorkingDirectory(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "walbox.yaml"), []byte("postgres:\n  url: postgres://u@127.0.0.1:1/x\n  slot: from_cwd\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	t.Setenv("WALBOX_CONFIG", "")
	cmd := newRootCmd()
	cmd.SetArgs([]string{"slot", "status"})
	var got string
	slot, _, _ := cmd.Find([]string{"slot", "status"})
	if err := slot.ParseFlags(nil); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadPostgresConfig(slot)
	if err != nil {
		t.Fatal(err)
	}
	got = cfg.Postgres.Slot
	if got != "from_cwd" {
		t.Fatalf("slot %q: ./walbox.yaml was not read", got)
	}
}

// walbox status exits 3 when no relay runs and leads, for scripts and probes.
func TestStatusExitCodeWithoutARelay(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	url := freshDB(ctx, t)
	if _, err := runCLI(ctx, "", "migrate", "--postgres-url", url); err != nil {
		t.Fatal(err)
	}
	out, err := runCLI(ctx, "", "status", "--postgres-url", url)
	if exitCode(err) != 3 || !strings.Contains(out, "unknown") {
		t.Fatalf("walbox status with no relay: exit %d (%v)\n%s", exitCode(err), err, out)
	}
}

// freshDB starts a cluster of the test's own and returns the URL of its
// database app; WALBOX_CONFIG is cleared so only flags configure walbox.
func freshDB(ctx context.Context, t *testing.T) string {
	t.Helper()
	_, url := pgtest.OwnDB(ctx, t)
	t.Setenv("WALBOX_CONFIG", "")
	return url
}

// walbox uninstall removes the slot, the publication and schema walbox,
// keeps the outbox table unless asked, and refuses a slot in use.
func TestUninstall(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	url := freshDB(ctx, t)
	for _, args := range [][]string{{"migrate", "--postgres-url", url}, {"slot", "create", "--postgres-url", url}} {
		if out, err := runCLI(ctx, "", args...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	count := func(q string) int {
		var n int
		if err := conn.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	state := func() [4]int {
		return [4]int{count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'walbox'`),
			count(`SELECT count(*) FROM pg_publication WHERE pubname = 'walbox_outbox'`),
			count(`SELECT count(*) FROM pg_namespace WHERE nspname = 'walbox'`),
			count(`SELECT count(*) FROM pg_class WHERE relname = 'outbox_events'`)}
	}
	out, err := runCLI(ctx, "", "uninstall", "--dry-run", "--postgres-url", url)
	if err != nil || !strings.Contains(out, "pg_drop_replication_slot('walbox')") || !strings.Contains(out, "DROP SCHEMA walbox CASCADE") {
		t.Fatalf("uninstall --dry-run: %v\n%s", err, out)
	}
	if s := state(); s != [4]int{1, 1, 1, 1} {
		t.Fatalf("--dry-run changed something: %v", s)
	}
	if _, err := runCLI(ctx, "n\n", "uninstall", "--postgres-url", url); err == nil {
		t.Fatal("uninstall answered n went ahead")
	}
	if out, err := runCLI(ctx, "", "uninstall", "--yes", "--postgres-url", url); err != nil {
		t.Fatalf("uninstall --yes: %v\n%s", err, out)
	}
	if s := state(); s != [4]int{0, 0, 0, 1} {
		t.Fatalf("after uninstall slot/publication/schema/table = %v, want 0 0 0 1 (the table stays)", s)
	}
	if out, err := runCLI(ctx, "", "uninstall", "--yes", "--drop-table", "--postgres-url", url); err != nil || state()[3] != 0 {
		t.Fatalf("uninstall --drop-table: %v %v\n%s", err, state(), out)
	}
}
