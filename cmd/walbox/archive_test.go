package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/relay/sweep"
)

// migratedConfig writes a config for a fresh database, with more (YAML of
// other sections) after its postgres and metrics sections, runs walbox
// migrate with it, and connects to the database.
func migratedConfig(ctx context.Context, t *testing.T, more string) (path, url string, conn *pgx.Conn) {
	t.Helper()
	url = freshDB(ctx, t)
	path = filepath.Join(t.TempDir(), "walbox.yaml")
	yaml := fmt.Sprintf("postgres:\n  url: %q\nmetrics:\n  listen: \"\"\n", url) + more
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := runCLI(ctx, "", "migrate", "--config", path); err != nil {
		t.Fatalf("walbox migrate: %v\n%s", err, out)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.WithoutCancel(ctx)) })
	return path, url, conn
}

// walbox archive --now maintains every configured table, each with its own
// settings, and prints each table's report; with sweeper.maintain: false
// it is the only upkeep the tables get (issue 34, item 10).
func TestArchiveNowMaintainsEveryTable(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	path, _, conn := migratedConfig(ctx, t, `sweeper:
  maintain: false
  partitions_ahead: 9
outboxes:
  - table: public.outbox_events
  - table: public.billing_outbox
    sweeper: {partitions_ahead: 12}
`)
	exists := func(rel string) bool {
		var ok bool
		if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, rel).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	dayName := func(table string, days int) string {
		var name string
		if err := conn.QueryRow(ctx, `SELECT $1 || '_p' || to_char((now() + make_interval(days => $2))::date, 'YYYYMMDD')`, table, days).Scan(&name); err != nil {
			t.Fatal(err)
		}
		return name
	}
	// A partition of 100 days ago in each table, its rows all processed.
	old := map[string]string{}
	for _, table := range []string{"outbox_events", "billing_outbox"} {
		name := dayName(table, -100)
		if _, err := conn.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF %s FOR VALUES FROM ((now() - interval '100 days')::date) TO ((now() - interval '99 days')::date)`, name, table)); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (created_at, topic, payload, processed, processed_at)
			SELECT (now() - interval '100 days')::date + g * interval '1 minute', 'orders.x', '{}', true, now() FROM generate_series(0, 9) g`, table)); err != nil {
			t.Fatal(err)
		}
		old[table] = name
	}
	for _, c := range []struct {
		table string
		ahead int
	}{{"outbox_events", 9}, {"billing_outbox", 12}} {
		if exists(dayName(c.table, c.ahead)) {
			t.Fatalf("%s exists before walbox archive", dayName(c.table, c.ahead))
		}
	}

	out, err := runCLI(ctx, "", "archive", "--now", "--config", path)
	if err != nil {
		t.Fatalf("walbox archive --now: %v\n%s", err, out)
	}
	t.Logf("walbox archive --now:\n%s", out)
	for _, c := range []struct {
		table string
		ahead int
	}{{"outbox_events", 9}, {"billing_outbox", 12}} {
		if p := dayName(c.table, c.ahead); !exists(p) {
			t.Errorf("%s: partition %s (partitions_ahead %d) not created", c.table, p, c.ahead)
		}
		if p := "walbox." + c.table + "_archive"; !exists(p) {
			t.Errorf("%s: archive table %s not created", c.table, p)
		}
		var parent string
		if err := conn.QueryRow(ctx, `SELECT coalesce((SELECT inhparent::regclass::text FROM pg_inherits WHERE inhrelid = to_regclass($1)), '')`, old[c.table]).Scan(&parent); err != nil {
			t.Fatal(err)
		}
		if want := "walbox." + c.table + "_archive"; parent != want {
			t.Errorf("%s: old partition %s is attached to %q, want %s", c.table, old[c.table], parent, want)
		}
		if !strings.Contains(out, "maintaining public."+c.table) || !strings.Contains(out, "archived public."+old[c.table]) {
			t.Errorf("the output does not report public.%s's maintenance", c.table)
		}
	}
	// Each table with its own settings: the first keeps 9 days ahead.
	if p := dayName("outbox_events", 12); exists(p) {
		t.Errorf("%s created: outbox_events took billing_outbox's partitions_ahead", p)
	}
	// --json: one report per table, in the config's order.
	out, err = runCLI(ctx, "", "archive", "--dry-run", "--json", "--config", path)
	var reps []sweep.Report
	if err != nil || json.Unmarshal([]byte(out), &reps) != nil {
		t.Fatalf("walbox archive --dry-run --json: %v\n%s", err, out)
	}
	if len(reps) != 2 || reps[0].Table != "public.outbox_events" || reps[1].Table != "public.billing_outbox" || !reps[0].Empty() || !reps[1].Empty() {
		t.Errorf("walbox archive --dry-run --json after the run: %+v, want an empty report of each table", reps)
	}
}

// walbox archive --now behind a reader holding the outbox (a pg_dump):
// without waiting it reports the archival postponed (producers never queue
// behind it); with --wait-postponed it runs again until the reader has
// ended and the partition is archived.
func TestArchiveNowWaitsForPostponedSteps(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	path, url, conn := migratedConfig(ctx, t, `archive:
  after: 24h
`)
	var old string
	if err := conn.QueryRow(ctx, `SELECT 'outbox_events_p' || to_char((now() - interval '3 days')::date, 'YYYYMMDD')`).Scan(&old); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF outbox_events FOR VALUES FROM ((now() - interval '3 days')::date) TO ((now() - interval '2 days')::date)`, old)); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (created_at, topic, payload, processed, processed_at)
		SELECT (now() - interval '3 days')::date + g * interval '1 minute', 'orders.x', '{}', true, now() FROM generate_series(0, 9) g`); err != nil {
		t.Fatal(err)
	}
	parent := func() string {
		var p string
		if err := conn.QueryRow(ctx, `SELECT coalesce((SELECT inhparent::regclass::text FROM pg_inherits WHERE inhrelid = to_regclass($1)), '')`, old).Scan(&p); err != nil {
			t.Fatal(err)
		}
		return p
	}

	// The reader: ACCESS SHARE on the outbox and its partitions, until 4 s
	// into the second command (whose first run postpones at once, within
	// lock_timeout, and whose next run comes 5 s later).
	reader, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close(context.WithoutCancel(ctx))
	tx, err := reader.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE outbox_events IN ACCESS SHARE MODE`); err != nil {
		t.Fatal(err)
	}

	out, err := runCLI(ctx, "", "archive", "--now", "--wait-postponed", "0", "--config", path)
	if err != nil {
		t.Fatalf("walbox archive --now --wait-postponed 0: %v\n%s", err, out)
	}
	if !strings.Contains(out, "postponed: archive public."+old) || parent() == "walbox.outbox_events_archive" {
		t.Fatalf("behind the reader, the archival of %s is not reported postponed (parent %q):\n%s", old, parent(), out)
	}
	release, released := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(released)
		select {
		case <-release:
		case <-time.After(4 * time.Second):
		}
		tx.Commit(context.WithoutCancel(ctx))
	}()
	defer func() { close(release); <-released }() // the reader's connection is used by one goroutine at a time
	out, err = runCLI(ctx, "", "archive", "--now", "--wait-postponed", "60s", "--config", path)
	if err != nil {
		t.Fatalf("walbox archive --now --wait-postponed 60s: %v\n%s", err, out)
	}
	if p := parent(); p != "walbox.outbox_events_archive" || !strings.Contains(out, "waiting 5s for the postponed steps") {
		t.Fatalf("after the reader ended %s belongs to %q; want the archive, reached by waiting:\n%s", old, p, out)
	}
}
