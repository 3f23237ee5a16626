package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestDebeziumLayoutPublishesDebeziumsOutboxTable runs walbox on Debezium's
// outbox table as Debezium users write it: insert the event and delete it
// in the same transaction (the row never stays; only the WAL has it). With
// outbox.layout: debezium the events go to outbox.event.<aggregatetype>,
// with the event id in Nats-Msg-Id and in header id, the type and the
// aggregate id in walbox's headers, and no row is ever updated.
func TestDebeziumLayoutPublishesDebeziumsOutboxTable(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.Outbox = config.Outbox{Table: "public.outboxevent", Layout: config.LayoutDebezium}
		c.NATS.Streams = []config.Stream{{Name: "OUTBOX", Subjects: []string{"outbox.event.>"}, DuplicateWindow: 2 * time.Minute}}
	})
	ctx := relaytest.Ctx(t)
	if _, err := e.pool.Exec(ctx, `CREATE TABLE outboxevent (id uuid NOT NULL PRIMARY KEY, aggregatetype varchar(255) NOT NULL,
		aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)`); err != nil {
		t.Fatal(err)
	}
	e.startRelay()
	type row struct{ id, aggType, aggID, typ string }
	rows := []row{
		{"0f9b2a86-6f6c-4a55-9d8c-6a1e0b1c0001", "Order", "o-1", "OrderCreated"},
		{"0f9b2a86-6f6c-4a55-9d8c-6a1e0b1c0002", "Customer", "c-9", "CustomerMoved"},
		{"0f9b2a86-6f6c-4a55-9d8c-6a1e0b1c0003", "Order", "o-1", "OrderPaid"},
	}
	for _, r := range rows {
		tx, err := e.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) VALUES ($1, $2, $3, $4, '{\"v\": 1}')",
			r.id, r.aggType, r.aggID, r.typ); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "DELETE FROM outboxevent WHERE id = $1", r.id); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	e.waitDelivered(len(rows), 30*time.Second)
	st, err := e.js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range rows {
		m, err := st.GetMsg(ctx, uint64(i+1))
		if err != nil {
			t.Fatal(err)
		}
		h := m.Header
		if m.Subject != "outbox.event."+r.aggType || h.Get("Nats-Msg-Id") != r.id || h.Get("id") != r.id ||
			h.Get("Walbox-Event-Type") != r.typ || h.Get("Walbox-Aggregate-Type") != r.aggType || h.Get("Walbox-Aggregate-Id") != r.aggID ||
			string(m.Data) != `{"v": 1}` {
			t.Fatalf("message %d: %s %v %s", i+1, m.Subject, h, m.Data)
		}
	}
	// Nothing to mark: the table has no processed flag, and the rows are gone.
	if got := e.counter("walbox_sweeper_marked_total", nil); got != 0 {
		t.Errorf("walbox_sweeper_marked_total = %v", got)
	}
}
