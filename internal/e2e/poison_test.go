package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/outboxtest"
)

func TestPoisonEventsAreDeadLetteredAndNeverStopTheOthers(t *testing.T) {
	e := newEnv(t)
	e.migrate()
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
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, _ := dlq.Info(ctx)
		if info.State.Msgs == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dead-letter stream holds %d, want 4", info.State.Msgs)
		}
		time.Sleep(100 * time.Millisecond)
	}
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
