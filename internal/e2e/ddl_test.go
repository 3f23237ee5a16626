package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestRenamedColumnWithBacklogDeadLettersTheUnmappableRows: a backlog spans
// a rename of the topic column. Rows arrive with the table definition of
// their time: those written before the rename with the old one, which lacks
// the column the config now names. walbox dead-letters them with the
// reason and goes on; rows written after the rename are published. Before,
// the first old row was a configuration error, and walbox exited, started
// again and failed on the same row forever.
func TestRenamedColumnWithBacklogDeadLettersTheUnmappableRows(t *testing.T) {
	e := newMigratedEnv(t)
	ctx := context.Background()
	r := e.startRelay() // creates the slot
	r.stop(t)
	if _, err := e.pool.Exec(ctx, `INSERT INTO outbox_events (topic, payload) SELECT 'orders.before', '{}' FROM generate_series(1, 5)`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `ALTER TABLE outbox_events RENAME COLUMN topic TO subject`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `INSERT INTO outbox_events (subject, payload) SELECT 'orders.after', '{}' FROM generate_series(1, 7)`); err != nil {
		t.Fatal(err)
	}
	e.cfg.Outbox.Columns = map[string]string{"topic": "subject"}
	e.startRelay()
	e.waitDelivered(7, 30*time.Second)
	var st jetstream.Stream
	relaytest.Eventually(t, 30*time.Second, "the 5 rows from before the rename dead-lettered", func() bool {
		var err error
		st, err = e.js.Stream(ctx, "WALBOX_DLQ")
		if err != nil {
			return false
		}
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs == 5
	})
	m, err := st.GetMsg(ctx, st.CachedInfo().State.FirstSeq)
	if err != nil {
		t.Fatal(err)
	}
	if reason := m.Header.Get("Walbox-Dlq-Reason"); !strings.Contains(reason, `no column "subject"`) {
		t.Fatalf("dead letter reason %q does not name the missing column", reason)
	}
}

// A configured column the table does not have now is a configuration error
// at start, naming the key and the fix: every new row would be dead-lettered.
func TestMissingColumnFailsAtStartWithTheKey(t *testing.T) {
	e := newMigratedEnv(t, func(c *config.Config) { c.Outbox.Columns = map[string]string{"topic": "nope"} })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := app.Run(ctx, e.cfg, zerolog.Nop(), app.Options{})
	if err == nil || !strings.Contains(err.Error(), "outbox.columns.topic") || !strings.Contains(err.Error(), `no column "nope"`) {
		t.Fatalf("walbox run with outbox.columns.topic = nope: %v", err)
	}
}
