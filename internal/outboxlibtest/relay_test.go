package outboxlibtest

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/outbox"
)

// copyCounter is a pgx.Tx that counts CopyFrom calls, to see which path
// Write took.
type copyCounter struct {
	pgx.Tx
	copies int
}

func (c *copyCounter) CopyFrom(ctx context.Context, t pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	c.copies++
	return c.Tx.CopyFrom(ctx, t, cols, src)
}

func jsonEqual(t *testing.T, got []byte, want string) {
	t.Helper()
	var a, b any
	if err := json.Unmarshal(got, &a); err != nil {
		t.Fatalf("payload %s: %v", got, err)
	}
	if err := json.Unmarshal([]byte(want), &b); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(a) != fmt.Sprint(b) {
		t.Errorf("payload = %s, want %s", got, want)
	}
}

func header(t *testing.T, m jetstream.Msg, key, want string) {
	t.Helper()
	if got := m.Headers().Get(key); got != want {
		t.Errorf("header %s = %q, want %q", key, got, want)
	}
}

func isV7(t *testing.T, id string) {
	t.Helper()
	u, err := uuid.Parse(id)
	if err != nil {
		t.Fatalf("id %q is not a UUID: %v", id, err)
	}
	if u.Version() != 7 {
		t.Errorf("id %s is UUID version %d, want 7", id, u.Version())
	}
}

// TestWriteThroughRelay writes events with outbox.Write (pgx and
// database/sql) and walbox.emit, and reads them back from JetStream as the
// relay published them. One relay serves all subtests: each uses its own
// subject.
func TestWriteThroughRelay(t *testing.T) {
	r := newRelayed(t)
	if _, err := r.pool.Exec(relaytest.Ctx(t), "CREATE TABLE users (id text PRIMARY KEY, email text NOT NULL UNIQUE)"); err != nil {
		t.Fatal(err)
	}

	t.Run("single insert", func(t *testing.T) {
		ctx := relaytest.Ctx(t)
		tx := r.begin(ctx)
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "INSERT INTO users VALUES ('u-1', 'one@example.com')"); err != nil {
			t.Fatal(err)
		}
		ct := &copyCounter{Tx: tx}
		err := outbox.Write(ctx, ct, outbox.Event{
			Topic: "user.single", EventType: "user.created", AggregateType: "user", AggregateID: "u-1",
			Payload: map[string]any{"user_id": "u-1", "email": "one@example.com"},
			Headers: map[string]string{"correlation_id": "c-1"},
		})
		if err != nil {
			t.Fatal(err)
		}
		if ct.copies != 0 {
			t.Errorf("one event went through COPY")
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		var id string
		if err := r.pool.QueryRow(ctx, "SELECT id::text FROM outbox_events WHERE topic = 'user.single'").Scan(&id); err != nil {
			t.Fatal(err)
		}
		isV7(t, id)
		m := r.collectN("user.single", 1)[0]
		header(t, m, "Nats-Msg-Id", id)
		header(t, m, "Walbox-Event-Type", "user.created")
		header(t, m, "Walbox-Aggregate-Type", "user")
		header(t, m, "Walbox-Aggregate-Id", "u-1")
		header(t, m, "Walbox-Partition-Key", "u-1")
		header(t, m, "correlation_id", "c-1")
		jsonEqual(t, m.Data(), `{"user_id":"u-1","email":"one@example.com"}`)
	})

	t.Run("many with COPY keep insert order", func(t *testing.T) {
		ctx := relaytest.Ctx(t)
		tx := r.begin(ctx)
		defer tx.Rollback(ctx)
		const n = 200
		events := make([]outbox.Event, n)
		for i := range events {
			events[i] = outbox.Event{Topic: "user.many", EventType: "user.bulk", AggregateID: fmt.Sprintf("u-%d", i%7),
				Payload: json.RawMessage(fmt.Sprintf(`{"i": %d}`, i))}
		}
		ct := &copyCounter{Tx: tx}
		if err := outbox.Write(ctx, ct, events...); err != nil {
			t.Fatal(err)
		}
		if ct.copies != 1 {
			t.Errorf("CopyFrom called %d times, want 1", ct.copies)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		msgs := r.collectN("user.many", n)
		seen := map[string]bool{}
		var prev uuid.UUID
		for i, m := range msgs {
			id := m.Headers().Get("Nats-Msg-Id")
			isV7(t, id)
			if seen[id] {
				t.Fatalf("id %s twice", id)
			}
			seen[id] = true
			u := uuid.MustParse(id)
			if i > 0 && u.String() <= prev.String() {
				t.Errorf("ids not increasing in insert order: %s after %s", u, prev)
			}
			prev = u
			jsonEqual(t, m.Data(), fmt.Sprintf(`{"i": %d}`, i))
			header(t, m, "Walbox-Partition-Key", fmt.Sprintf("u-%d", i%7))
		}
	})

	t.Run("rollback publishes nothing", func(t *testing.T) {
		ctx := relaytest.Ctx(t)
		var rolledBack []string
		for _, n := range []int{1, 5} { // INSERT path and COPY path
			tx := r.begin(ctx)
			var events []outbox.Event
			for range n {
				id := outbox.NewID()
				rolledBack = append(rolledBack, id)
				events = append(events, outbox.Event{ID: id, Topic: "user.rollback", Payload: json.RawMessage(`{"rolled_back": true}`)})
			}
			if err := outbox.Write(ctx, tx, events...); err != nil {
				t.Fatal(err)
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
		}
		// A marker committed after the rollbacks: commit order means the
		// rolled-back events, were they published, would come before it.
		marker := outbox.NewID()
		tx := r.begin(ctx)
		if err := outbox.Write(ctx, tx, outbox.Event{ID: marker, Topic: "user.rollback", Payload: json.RawMessage(`{"marker": true}`)}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		msgs := r.collectUntilID("user.rollback", marker)
		if len(msgs) != 1 {
			for _, m := range msgs {
				t.Logf("published: %s %s", m.Headers().Get("Nats-Msg-Id"), m.Data())
			}
			t.Fatalf("%d messages up to the marker, want only the marker (rolled back: %v)", len(msgs), rolledBack)
		}
	})

	t.Run("trace context carried to the message", func(t *testing.T) {
		ctx := relaytest.Ctx(t)
		traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
		spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
		ts, _ := trace.ParseTraceState("vendor=opaque")
		sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled, TraceState: ts})
		ctx = trace.ContextWithSpanContext(ctx, sc)
		id := outbox.NewID()
		tx := r.begin(ctx)
		defer tx.Rollback(ctx)
		if err := outbox.Write(ctx, tx, outbox.Event{ID: id, Topic: "user.traced", Payload: json.RawMessage(`{}`),
			Headers: map[string]string{"baggage": "tenant=t1"}}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		m := r.collectN("user.traced", 1)[0]
		header(t, m, "Nats-Msg-Id", id)
		header(t, m, "traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
		header(t, m, "tracestate", "vendor=opaque")
		header(t, m, "baggage", "tenant=t1")
	})

	t.Run("database/sql", func(t *testing.T) {
		ctx := relaytest.Ctx(t)
		db, err := sql.Open("pgx", r.dbURL)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if _, err := tx.ExecContext(ctx, "INSERT INTO users VALUES ('u-sql', 'sql@example.com')"); err != nil {
			t.Fatal(err)
		}
		first := outbox.NewID()
		if err := outbox.Write(ctx, outbox.FromSQL(tx), outbox.Event{ID: first, Topic: "user.sql", EventType: "user.created",
			AggregateID: "u-sql", Payload: []byte(`{"n": 0}`)}); err != nil {
			t.Fatal(err)
		}
		var more []outbox.Event
		for i := 1; i <= 3; i++ {
			more = append(more, outbox.Event{Topic: "user.sql", Payload: map[string]int{"n": i}, Headers: map[string]string{"k": "v"}})
		}
		if err := outbox.Write(ctx, outbox.FromSQL(tx), more...); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		msgs := r.collectN("user.sql", 4)
		header(t, msgs[0], "Nats-Msg-Id", first)
		header(t, msgs[0], "Walbox-Partition-Key", "u-sql")
		for i, m := range msgs {
			isV7(t, m.Headers().Get("Nats-Msg-Id"))
			jsonEqual(t, m.Data(), fmt.Sprintf(`{"n": %d}`, i))
		}
		header(t, msgs[3], "k", "v")
	})

	t.Run("walbox.emit", func(t *testing.T) {
		ctx := relaytest.Ctx(t)
		// Rolled back first, then committed: only the second is published.
		tx := r.begin(ctx)
		var dropped string
		if err := tx.QueryRow(ctx, `SELECT walbox.emit('user.emitted', '{"dropped": true}')`).Scan(&dropped); err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		tx = r.begin(ctx)
		defer tx.Rollback(ctx)
		var id string
		err := tx.QueryRow(ctx, `SELECT walbox.emit('user.emitted', '{"user_id": "u-9"}',
			event_type => 'user.created', aggregate_type => 'user', aggregate_id => 'u-9',
			headers => '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}')::text`).Scan(&id)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		isV7(t, id)
		msgs := r.collectUntilID("user.emitted", id)
		if len(msgs) != 1 {
			t.Fatalf("%d messages up to the committed one, want 1 (rolled back: %s)", len(msgs), dropped)
		}
		m := msgs[0]
		header(t, m, "Walbox-Event-Type", "user.created")
		header(t, m, "Walbox-Aggregate-Type", "user")
		header(t, m, "Walbox-Aggregate-Id", "u-9")
		header(t, m, "Walbox-Partition-Key", "u-9")
		header(t, m, "traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
		jsonEqual(t, m.Data(), `{"user_id": "u-9"}`)
	})
}
