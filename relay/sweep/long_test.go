package sweep_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay/sweep"
)

// The measurements for the issue note; WALBOX_LONG=1 runs them. They log
// numbers and assert none (this machine is shared).
func long(t *testing.T) {
	if os.Getenv("WALBOX_LONG") != "1" {
		t.Skip("set WALBOX_LONG=1 to run the measurements")
	}
}

// Catch-up of a 100,000-event WAL backlog through the relay, with and
// without marking rows processed.
func TestLongCatchUpThroughput(t *testing.T) {
	long(t)
	const events = 100_000
	for _, mark := range []bool{false, true} {
		name := "mark_processed=false"
		if mark {
			name = "mark_processed=true"
		}
		t.Run(name, func(t *testing.T) {
			d := newDB(t, true)
			e := newRelayEnv(t, d, func(c *config.Config) { c.Sweeper.MarkProcessed = mark })
			e.start() // creates the slot
			e.stop()
			for i := 0; i < events/1000; i++ {
				d.exec(`INSERT INTO outbox_events (topic, payload, aggregate_id) SELECT 'orders.created', jsonb_build_object('n', g, 'note', 'a typical small event payload'), 'agg-' || (g % 97) FROM generate_series(1, 1000) g`)
			}
			started := time.Now()
			e.start()
			relaytest.Eventually(t, 5*time.Minute, "the backlog published", func() bool { return e.streamMsgs("ORDERS") >= events })
			published := time.Since(started)
			var marked time.Duration
			if mark {
				relaytest.Eventually(t, 5*time.Minute, "the backlog marked", func() bool {
					return d.int(`SELECT count(*) FROM outbox_events WHERE processed`) == events
				})
				marked = time.Since(started)
			}
			dropped := relaytest.Metric(t, e.reg, "walbox_sweeper_dropped_total", nil)
			e.stop()
			t.Logf("%s: %d events published in %v = %.0f events/s", name, events, published.Round(time.Millisecond), events/published.Seconds())
			if mark {
				t.Logf("%s: all %d rows marked processed %v after start = %.0f rows/s (marks dropped: %v)", name, events,
					marked.Round(time.Millisecond), events/marked.Seconds(), dropped)
			}
		})
	}
}

// Archiving and exporting one partition of 1,000,000 rows.
func TestLongArchiveMillionRows(t *testing.T) {
	long(t)
	const rows = 1_000_000
	d := newDB(t, true)
	started := time.Now()
	part := d.oldPartition(100, rows, true)
	d.exec(`ANALYZE ` + part)
	t.Logf("filled %s with %d rows in %v", part, rows, time.Since(started).Round(time.Millisecond))
	var size int64
	size = d.int(`SELECT pg_total_relation_size($1::regclass)`, part)

	sw := d.sweeper(archiving(90 * day))
	started = time.Now()
	rep := maintain(t, sw)
	if len(rep.Archived) != 1 {
		t.Fatalf("archived %v", rep.Archived)
	}
	t.Logf("archive (detach from outbox, attach to archive) of %d rows (%.0f MB on disk): %v", rows, float64(size)/1e6, time.Since(started).Round(time.Millisecond))

	dir, _ := sweep.NewDirStore(t.TempDir())
	sw2 := d.sweeper(exporting(dir, 90*day, 95*day, 0), func(c *sweep.Config) {})
	started = time.Now()
	rep, err := sw2.Maintain(context.Background(), sweep.MaintainOptions{Progress: testWriter{t}})
	if err != nil || len(rep.Exported) != 1 {
		t.Fatalf("export: %v %+v", err, rep)
	}
	took := time.Since(started)
	ex := rep.Exported[0]
	t.Logf("export to a directory and drop: %d rows, %.1f MB gzip JSON Lines in %v = %.0f rows/s", ex.Rows, float64(ex.Bytes)/1e6, took.Round(time.Millisecond), float64(ex.Rows)/took.Seconds())
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
