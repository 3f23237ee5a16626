package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

func TestPoisonEventsAreDeadLetteredAndNeverStopTheOthers(t *testing.T) {
	e := newMigratedEnv(t)
	e.startRelay()
	ctx := context.Background()
	rows := []struct{ id, topic, stream, payload string }{
		{"00000000-0000-0000-0000-000000000001", "orders.created", "", `{"n":1}`},
		{"00000000-0000-0000-0000-000000000002", "nobody.listens", "", `{"n":2}`}, // no stream captures it
		{"00000000-0000-0000-0000-000000000003", "orders.created", "", `{"n":3}`},
		{"00000000-0000-0000-0000-000000000004", "orders. bad", "", `{"n":4}`},            // white space in subject
		{"00000000-0000-0000-0000-000000000005", "orders.*", "", `{"n":5}`},               // wildcard
		{"00000000-0000-0000-0000-000000000006", "orders.created", "PAYMENTS", `{"n":6}`}, // stream column disagrees
		{"00000000-0000-0000-0000-000000000007", "orders.created", "ORDERS", `{"n":7}`},
	}
	for _, r := range rows {
		var stream any
		if r.stream != "" {
			stream = r.stream
		}
		if _, err := e.pool.Exec(ctx, "INSERT INTO outbox_events (id, topic, stream, payload) VALUES ($1, $2, $3, $4)", r.id, r.topic, stream, r.payload); err != nil {
			t.Fatal(err)
		}
	}
	e.waitDelivered(3, 30*time.Second)
	got, err := outboxtest.ReadStream(ctx, e.js, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{rows[0].id, rows[2].id, rows[6].id}
	if len(got) != len(want) {
		t.Fatalf("ORDERS holds %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("ORDERS holds %v, want %v", got, want)
		}
	}
	dlq, err := e.js.Stream(ctx, "WALBOX_DLQ")
	if err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 10*time.Second, "4 messages in the dead-letter stream", func() bool {
		info, err := dlq.Info(ctx)
		return err == nil && info.State.Msgs == 4
	})
	for seq := uint64(1); seq <= 4; seq++ {
		m, err := dlq.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		if m.Header.Get("Walbox-Dlq-Reason") == "" || m.Header.Get("Walbox-Dlq-Original-Subject") == "" {
			t.Fatalf("dead letter %d lacks reason or original subject: %v", seq, m.Header)
		}
		t.Logf("dead letter %s on %s: %s", m.Header.Get("Nats-Msg-Id"), m.Subject, m.Header.Get("Walbox-Dlq-Reason"))
	}
}

func TestTooLargeAndInvalidJSONPayloadsAreDeadLettered(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.Outbox.Table = "public.text_outbox"
		c.Outbox.Columns = map[string]string{"event_type": "", "aggregate_type": "", "aggregate_id": "", "partition_key": "", "headers": "", "stream": ""}
	})
	ctx := context.Background()
	// A legacy table whose payload column is text: JSON is not enforced.
	if _, err := e.pool.Exec(ctx, `CREATE TABLE text_outbox (id text primary key, topic text, payload text, created_at timestamptz default now())`); err != nil {
		t.Fatal(err)
	}
	e.startRelay()
	big := `{"blob":"` + strings.Repeat("x", 2<<20) + `"}` // above NATS's 1 MB max_payload
	rows := [][3]string{
		{"ok-1", "orders.created", `{"n":1}`},
		{"bad-json", "orders.created", `{"n":`},
		{"too-big", "orders.created", big},
		{"ok-2", "orders.created", `{"n":2}`},
	}
	for _, r := range rows {
		if _, err := e.pool.Exec(ctx, "INSERT INTO text_outbox (id, topic, payload) VALUES ($1, $2, $3)", r[0], r[1], r[2]); err != nil {
			t.Fatal(err)
		}
	}
	// A NULL topic too.
	if _, err := e.pool.Exec(ctx, "INSERT INTO text_outbox (id, topic, payload) VALUES ('null-topic', NULL, '{}')"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, "INSERT INTO text_outbox (id, topic, payload) VALUES ('ok-3', 'orders.created', '{}')"); err != nil {
		t.Fatal(err)
	}
	e.waitDelivered(3, 30*time.Second)
	got, err := outboxtest.ReadStream(ctx, e.js, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, ",") != "ok-1,ok-2,ok-3" {
		t.Fatalf("ORDERS holds %v, want ok-1, ok-2, ok-3", got)
	}
	dlq, _ := e.js.Stream(ctx, "WALBOX_DLQ")
	reasons := map[string]string{}
	relaytest.Eventually(t, 10*time.Second, "3 dead letters", func() bool {
		info, err := dlq.Info(ctx)
		if err != nil {
			return false
		}
		for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
			if m, err := dlq.GetMsg(ctx, seq); err == nil {
				reasons[m.Header.Get("Nats-Msg-Id")] = m.Header.Get("Walbox-Dlq-Reason")
			}
		}
		return len(reasons) >= 3
	})
	for id, want := range map[string]string{"bad-json": "not valid JSON", "too-big": "max_payload", "null-topic": "topic is NULL"} {
		if !strings.Contains(reasons[id], want) {
			t.Errorf("dead letter %s: reason %q, want it to mention %q", id, reasons[id], want)
		}
	}
}

// A dead letter is confirmed only once the dead-letter stream stored it: for
// a table-less event it is the only record. With the stream gone, publishing
// waits at the dead letter; once the stream is back, everything goes out in
// order and the dead letter is kept.
func TestMissingDeadLetterStreamHoldsTheDeadLetterUntilItIsBack(t *testing.T) {
	e := newMigratedEnv(t)
	e.startRelay()
	ctx := context.Background()
	dlq, err := e.js.Stream(ctx, "WALBOX_DLQ")
	if err != nil {
		t.Fatal(err)
	}
	dlqCfg := dlq.CachedInfo().Config
	if err := e.js.DeleteStream(ctx, "WALBOX_DLQ"); err != nil {
		t.Fatal(err)
	}
	for i, topic := range []string{"orders.created", "nobody.listens", "orders.created"} {
		if _, err := e.pool.Exec(ctx, "INSERT INTO outbox_events (topic, payload) VALUES ($1, $2)", topic, fmt.Sprintf(`{"i":%d}`, i)); err != nil {
			t.Fatal(err)
		}
	}
	e.waitDelivered(1, 30*time.Second)
	if _, err := e.js.CreateStream(ctx, dlqCfg); err != nil {
		t.Fatal(err)
	}
	e.waitDelivered(2, 30*time.Second)
	relaytest.Eventually(t, 30*time.Second, "the 1 dead letter in the dead-letter stream after it came back", func() bool {
		st, err := e.js.Stream(ctx, "WALBOX_DLQ")
		if err != nil {
			return false
		}
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs == 1
	})
}

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
