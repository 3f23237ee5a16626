package ops

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
)

func TestStatusOfRunningRelay(t *testing.T) {
	e := newEnv(t)

	// Before any relay: unknown, nothing held.
	rep, err := Status(e.ctx, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Relay.State != "unknown" || rep.Relay.LockHeld || rep.SlotStatus.Exists {
		t.Fatalf("before the relay: %+v", rep.Relay)
	}
	var out bytes.Buffer
	rep.Print(&out)
	mustContain(t, "status without a relay", out.String(), "relay", "unknown", "not held", "does not exist")

	e.insert("orders.created", `{"n":1}`)
	e.startRelay()
	e.insert("orders.created", `{"n":2}`)
	e.insert("payments.settled", `{"n":3}`)
	e.waitMsgs("ORDERS", 2)
	e.waitMsgs("PAYMENTS", 1)

	// The leader writes relay_status every second; wait for a fresh row.
	relaytest.Eventually(t, 60*time.Second, "the relay to show as running with the lock", func() bool {
		if rep, err = Status(e.ctx, e.cfg); err != nil {
			t.Fatal(err)
		}
		return rep.Relay.State == "running" && rep.Relay.LockHeld
	})
	if !rep.SlotStatus.Exists || !rep.SlotStatus.Active || rep.Relay.Leader == "" || rep.Relay.ConfirmedLSN == "" {
		t.Errorf("status: relay %+v slot %+v", rep.Relay, rep.SlotStatus)
	}
	if rep.Outbox.Unprocessed < 0 || rep.Outbox.DeadLettered < 0 || !rep.Outbox.Partitioned || len(rep.Outbox.Partitions) == 0 || rep.Outbox.Archive == nil {
		t.Errorf("outbox: %+v", rep.Outbox)
	}
	if rep.DLQ == nil || rep.DLQ.Error != "" {
		t.Errorf("dlq: %+v", rep.DLQ)
	}
	out.Reset()
	rep.Print(&out)
	t.Logf("walbox status:\n%s", out.String())
	mustContain(t, "status", out.String(), "running", "held by backend pid", "events/s", "commit->ack", "retained", "unprocessed",
		"dead-lettered", "partitions", "archive", "walbox.outbox_events_archive", "WALBOX_DLQ")
	out.Reset()
	if err := rep.PrintJSON(&out); err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := json.Unmarshal(out.Bytes(), &back); err != nil {
		t.Fatalf("--json does not parse: %v\n%s", err, out.String())
	}
	if back["relay"].(map[string]any)["state"] != "running" {
		t.Errorf("JSON relay state: %v", back["relay"])
	}
}

// With several outbox tables, status reports each of them; outbox stays
// the default one.
func TestStatusOfSeveralTables(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.Outboxes = []config.OutboxEntry{{Outbox: config.Outbox{Table: "public.outbox_events"}},
			{Outbox: config.Outbox{Table: "billing.outbox"}, Default: true}}
	})
	ctx := testCtx(t)
	e.exec("CREATE SCHEMA billing")
	e.exec("CREATE TABLE billing.outbox (id uuid PRIMARY KEY, topic text, payload jsonb, processed boolean NOT NULL DEFAULT false, created_at timestamptz DEFAULT now())")
	e.exec("INSERT INTO billing.outbox (id, topic, payload) VALUES (gen_random_uuid(), 'orders.x', '{}'), (gen_random_uuid(), 'orders.y', '{}')")
	rep, err := Status(ctx, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Outboxes) != 2 || rep.Outboxes[0].Table != "public.outbox_events" || rep.Outboxes[1].Table != "billing.outbox" ||
		rep.Outboxes[1].Unprocessed != 2 || rep.Outbox.Table != "billing.outbox" {
		t.Fatalf("outboxes %+v, outbox %+v", rep.Outboxes, rep.Outbox)
	}
	var out bytes.Buffer
	rep.Print(&out)
	mustContain(t, "status of two tables", out.String(), "tables public.outbox_events, billing.outbox", "\nbilling.outbox\n", "2 unprocessed")
}
