package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/relaytest"
)

// replayJSON is what walbox replay --json prints.
type replayJSON struct {
	Table         string `json:"table"`
	Rows          int64  `json:"rows"`
	Matched       int64  `json:"matched"`
	AlreadyStored int64  `json:"already_stored"`
	Duplicates    int64  `json:"duplicates"`
	Published     int64  `json:"published"`
	DeadLettered  int64  `json:"dead_lettered"`
}

// walbox replay --topic fills gaps only, also for a table with its own
// subject_template and one with layout: debezium: the read-back of what the
// streams hold filters by each table's own subjects (and ids, as the relay
// published them), so events already stored are not published again
// (issue 34, item 8).
func TestReplayTopicOfTablesWithTheirOwnSubjects(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	url := freshDB(ctx, t)
	ns := natstest.New(t)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	// Debezium's outbox table, as its users create it.
	if _, err := conn.Exec(ctx, `CREATE TABLE outboxevent (id uuid NOT NULL PRIMARY KEY, aggregatetype varchar(255) NOT NULL,
		aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)`); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "walbox.yaml")
	yaml := fmt.Sprintf(`postgres:
  url: %q
  status_interval: 1s
nats:
  url: %q
  streams:
    - {name: ORDERS, subjects: ["orders.>"]}
    - {name: BILLING, subjects: ["billing.>"]}
    - {name: OUTBOX, subjects: ["outbox.event.>"]}
outboxes:
  - table: public.outbox_events
  - table: public.billing_outbox
    subject_template: "billing.{topic}.{bucket}"
  - table: public.outboxevent
    layout: debezium
metrics:
  listen: ""
retry:
  initial: 100ms
  max: 1s
`, url, ns.URL())
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := runCLI(ctx, "", "migrate", "--config", path); err != nil {
		t.Fatalf("walbox migrate: %v\n%s", err, out)
	}
	cfg, err := config.Load(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := relaytest.StartRelay(t, cfg, relaytest.WithStartTimeout(45*time.Second))

	for i := range 2 {
		if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (topic, payload) VALUES ('orders.created', $1)`, fmt.Sprintf(`{"n":%d}`, i)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		if _, err := conn.Exec(ctx, `INSERT INTO billing_outbox (topic, payload, aggregate_id) VALUES ('invoices.paid', $1, $2)`,
			fmt.Sprintf(`{"n":%d}`, i), fmt.Sprintf("inv-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	var dbz []string
	for i := range 2 {
		var id string
		if err := conn.QueryRow(ctx, `INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
			VALUES (gen_random_uuid(), 'Order', $1, 'OrderCreated', '{"v":1}') RETURNING id::text`, fmt.Sprintf("o-%d", i)).Scan(&id); err != nil {
			t.Fatal(err)
		}
		dbz = append(dbz, id)
	}
	_, js := relaytest.JetStream(t, ns.URL())
	msgs := func(stream string) uint64 {
		st, err := js.Stream(ctx, stream)
		if err != nil {
			return 0
		}
		info, err := st.Info(ctx)
		if err != nil {
			return 0
		}
		return info.State.Msgs
	}
	want := map[string]uint64{"ORDERS": 2, "BILLING": 3, "OUTBOX": 2}
	for s, n := range want {
		relaytest.Eventually(t, 60*time.Second, fmt.Sprintf("stream %s to hold %d messages", s, n), func() bool { return msgs(s) >= n })
	}
	r.Stop(t)

	replay := func(args ...string) replayJSON {
		t.Helper()
		out, err := runCLI(ctx, "", append([]string{"replay", "--json", "--config", path}, args...)...)
		var res replayJSON
		if err != nil || json.Unmarshal([]byte(out), &res) != nil {
			t.Fatalf("walbox replay %v: %v\n%s", args, err, out)
		}
		return res
	}
	// Without the read-back, only JetStream's duplicate window stops the
	// copies: it does when they carry the Nats-Msg-Id the relay gave them.
	res := replay("--table", "public.billing_outbox", "--from", "1h", "--no-check")
	if res.Duplicates != 3 || res.Published != 0 {
		t.Errorf("replay --no-check of billing_outbox inside the duplicate window: duplicates %d, published %d; want 3 and 0", res.Duplicates, res.Published)
	}
	for _, c := range []struct {
		what    string
		args    []string
		matched int64
	}{
		{"the first table, the sink's template", []string{"--from", "1h", "--topic", "orders.*"}, 2},
		{"a table with its own subject_template", []string{"--table", "public.billing_outbox", "--from", "1h", "--topic", "invoices.*"}, 3},
		{"a table with layout: debezium", []string{"--table", "public.outboxevent", "--id", dbz[0], "--id", dbz[1], "--topic", "Order"}, 2},
	} {
		res := replay(c.args...)
		if res.Matched != c.matched || res.AlreadyStored != c.matched || res.Published != 0 || res.Duplicates != 0 || res.DeadLettered != 0 {
			t.Errorf("replay of %s: matched %d, already stored %d, published %d, duplicates %d, dead-lettered %d; want %d matched, all already stored, nothing published",
				c.what, res.Matched, res.AlreadyStored, res.Published, res.Duplicates, res.DeadLettered, c.matched)
		}
	}
	for s, n := range want {
		if got := msgs(s); got != n {
			t.Errorf("stream %s holds %d messages after the replays, want %d", s, got, n)
		}
	}
}
