package devenv_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/devenv"
	"github.com/walbox/walbox/internal/pgcluster"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// runDir returns an empty folder for Config.Dir that the PostgreSQL server
// user can reach when the tests run as root (t.TempDir cannot be).
func runDir(t *testing.T) string {
	t.Helper()
	return pgtest.ServerDir(t, "walbox-devenv-test-*")
}

func testLogger(t *testing.T) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
}

func entries(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

func TestDevPrintsEveryCommittedEventAsJetStreamStoresIt(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(runDir(t), ".walbox-dev")
	var out bytes.Buffer
	s, err := devenv.Run(t.Context(), devenv.Config{
		Rate:         20,
		Duration:     10 * time.Second,
		Dir:          dir,
		SummaryEvery: 2 * time.Second,
		Out:          &out,
		Log:          testLogger(t),
	})
	t.Logf("summary: %+v\n%s", s, out.String())
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if s.Produced == 0 || s.Acked == 0 || s.Printed == 0 {
		t.Fatalf("nothing flowed: produced %d, acked %d, printed %d", s.Produced, s.Acked, s.Printed)
	}
	// Shutdown stops the producer first and waits for the relay, so every
	// committed sample event was acked and printed.
	if s.Acked < s.Produced || s.Printed < s.Produced {
		t.Errorf("produced %d, but acked %d and printed %d", s.Produced, s.Acked, s.Printed)
	}
	if s.DeadLettered != 0 {
		t.Errorf("%d sample events dead-lettered", s.DeadLettered)
	}
	if s.P50 <= 0 || s.P99 < s.P50 {
		t.Errorf("latency percentiles p50 %s p99 %s", s.P50, s.P99)
	}
	if s.FirstEvent <= 0 {
		t.Errorf("no time to first event: %s", s.FirstEvent)
	}
	text := out.String()
	for _, want := range []string{"COMMIT->ACK", "ORDERS", "PAYMENTS", "orders.created", "payments.settled", "orders.shipped", `"order_id":"o-1001"`, "-- last", "p50", "p99", "stopped after"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	var eventLines int
	for _, line := range strings.Split(text, "\n") {
		if strings.Contains(line, "orders.") || strings.Contains(line, "payments.") {
			if strings.Contains(line, "ms  {") {
				eventLines++
			}
		}
	}
	if int64(eventLines) != s.Printed {
		t.Errorf("%d event lines, summary says %d printed", eventLines, s.Printed)
	}
	if names := entries(t, dir); len(names) != 0 {
		t.Errorf("%s still holds %v after the run (no --keep)", dir, names)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the .walbox-dev folder Run created was not removed: %v", err)
	}
}

// TestDevWithKafkaPrintsEveryCommittedEventAsKafkaStoresIt is the demo on
// the Kafka sink: an in-process Kafka (kfake), every committed sample event
// acked, printed from its topic, none dead-lettered.
func TestDevWithKafkaPrintsEveryCommittedEventAsKafkaStoresIt(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	s, err := devenv.Run(t.Context(), devenv.Config{
		Sink:     "kafka",
		Rate:     20,
		Duration: 5 * time.Second,
		Dir:      filepath.Join(runDir(t), ".walbox-dev"),
		Out:      &out,
		Log:      testLogger(t),
	})
	t.Logf("summary: %+v\n%s", s, out.String())
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if s.Produced == 0 || s.Acked < s.Produced || s.Printed < s.Produced || s.DeadLettered != 0 {
		t.Fatalf("produced %d, acked %d, printed %d, dead-lettered %d", s.Produced, s.Acked, s.Printed, s.DeadLettered)
	}
	for _, want := range []string{"in-process Kafka", "orders.created/", "payments.settled/", "orders.shipped/"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

func TestDevKeepLeavesTheDataInPlace(t *testing.T) {
	t.Parallel()
	dir := runDir(t)
	s, err := devenv.Run(t.Context(), devenv.Config{Rate: 10, Duration: 3 * time.Second, Dir: dir, Keep: true, Log: testLogger(t)})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if s.KeptDir == "" || filepath.Dir(s.KeptDir) != dir {
		t.Fatalf("KeptDir = %q, want a folder in %s", s.KeptDir, dir)
	}
	for _, f := range []string{"postgres/data/PG_VERSION", "postgres/data/logfile", "nats/jetstream"} {
		if _, err := os.Stat(filepath.Join(s.KeptDir, f)); err != nil {
			t.Errorf("kept run lacks %s: %v", f, err)
		}
	}
	// A fast shutdown, not a crash: nothing is left running on the data.
	if _, err := os.Stat(filepath.Join(s.KeptDir, "postgres/data/postmaster.pid")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("postmaster.pid left behind: %v", err)
	}
}

func TestDevAgainstAGivenDatabaseDropsItsSlotAtExit(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pg, err := pgcluster.Start(ctx, pgcluster.WithSetting("synchronous_commit", "on"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })
	url, err := pg.CreateDB(ctx, "app")
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	s, err := devenv.Run(ctx, devenv.Config{PostgresURL: url, Rate: 10, Duration: 5 * time.Second, Dir: runDir(t), Out: &out, Log: testLogger(t)})
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, out.String())
	}
	if s.Printed == 0 {
		t.Fatalf("no events printed:\n%s", out.String())
	}
	conn := relaytest.Conn(t, url)
	var slots, rows int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots").Scan(&slots); err != nil {
		t.Fatal(err)
	}
	if slots != 0 {
		t.Errorf("%d replication slots left in the user's database", slots)
	}
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM outbox_events").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if int64(rows) < s.Produced {
		t.Errorf("outbox_events holds %d rows, %d were produced", rows, s.Produced)
	}
}

func TestDevWithoutPostgresBinariesSaysWhatToInstall(t *testing.T) {
	t.Parallel()
	// A fake install root with a version folder but no programs in it, no
	// pg_config and an empty PATH: like a machine without PostgreSQL.
	fake := t.TempDir()
	if err := os.MkdirAll(filepath.Join(fake, "17", "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), ".walbox-dev")
	start := time.Now()
	_, err := devenv.Run(t.Context(), devenv.Config{
		Rate:      5,
		Dir:       dir,
		Log:       testLogger(t),
		BinSearch: &pgcluster.BinSearch{Globs: []string{filepath.Join(fake, "*", "bin")}},
	})
	if err == nil {
		t.Fatal("Run succeeded without PostgreSQL binaries")
	}
	t.Logf("error after %s:\n%v", time.Since(start), err)
	var missing *devenv.MissingPostgresError
	if !errors.As(err, &missing) {
		t.Errorf("error is %T, want *devenv.MissingPostgresError", err)
	}
	for _, want := range []string{"apt-get install postgresql", "brew install postgresql@17", "--postgres-url", filepath.Join(fake, "*", "bin")} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q", want)
		}
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Run created %s before failing: %v", dir, err)
	}
}
