package outboxlibtest

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/outbox"
)

func count(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, query string, args ...any) int {
	t.Helper()
	var n int
	if err := q.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// TestEmitMessage checks walbox.emit_message at the SQL level: a pgoutput
// slot with messages 'true' shows one transactional logical message with
// prefix walbox and the documented JSON; a rolled-back call shows nothing.
func TestEmitMessage(t *testing.T) {
	e := newEnv(t)
	ctx := relaytest.Ctx(t)
	var slot string
	if err := e.pool.QueryRow(ctx, "SELECT current_database()").Scan(&slot); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot); err != nil {
		t.Fatal(err)
	}
	// The test cluster runs with synchronous_commit off, and decoding stops
	// at the flushed WAL: make these commits flush before returning.
	conn, err := e.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SET synchronous_commit = on"); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(context.Background(), "RESET synchronous_commit")

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT walbox.emit_message('user.rolled_back', '{}')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	var id string
	err = conn.QueryRow(ctx, `SELECT walbox.emit_message('user.created', '{"user_id": "u-1", "n": [1, 2]}',
		event_type => 'user.created', aggregate_type => 'user', aggregate_id => 'u-1',
		headers => '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}')::text`).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	isV7(t, id)
	if n := count(t, e.pool, "SELECT count(*) FROM outbox_events"); n != 0 {
		t.Errorf("emit_message stored %d rows in outbox_events", n)
	}

	rows, err := e.pool.Query(ctx, `SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
		'proto_version', '1', 'publication_names', 'walbox_outbox', 'messages', 'true')`, slot)
	if err != nil {
		t.Fatal(err)
	}
	var msgs []*pglogrepl.LogicalDecodingMessage
	for rows.Next() {
		var data []byte
		if err := rows.Scan(&data); err != nil {
			t.Fatal(err)
		}
		m, err := pglogrepl.Parse(data)
		if err != nil {
			t.Fatalf("parse pgoutput message %q: %v", data, err)
		}
		if lm, ok := m.(*pglogrepl.LogicalDecodingMessage); ok {
			msgs = append(msgs, lm)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 1 {
		t.Fatalf("%d logical messages decoded, want 1 (the rolled-back call must emit nothing)", len(msgs))
	}
	m := msgs[0]
	if m.Prefix != "walbox" || !m.Transactional {
		t.Errorf("prefix %q transactional %v, want walbox true", m.Prefix, m.Transactional)
	}
	t.Logf("message content: %s", m.Content)
	// The keys, in the documented order.
	var keys []string
	dec := json.NewDecoder(strings.NewReader(string(m.Content)))
	if _, err := dec.Token(); err != nil {
		t.Fatal(err)
	}
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k.(string))
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := strings.Join(keys, ","), "id,topic,payload,event_type,aggregate_type,aggregate_id,partition_key,headers,created_at,table"; got != want {
		t.Errorf("keys %s, want %s", got, want)
	}
	var body struct {
		ID            string            `json:"id"`
		Topic         string            `json:"topic"`
		Payload       json.RawMessage   `json:"payload"`
		EventType     string            `json:"event_type"`
		AggregateType string            `json:"aggregate_type"`
		AggregateID   string            `json:"aggregate_id"`
		PartitionKey  string            `json:"partition_key"`
		Headers       map[string]string `json:"headers"`
		CreatedAt     time.Time         `json:"created_at"`
	}
	if err := json.Unmarshal(m.Content, &body); err != nil {
		t.Fatalf("content is not the documented JSON: %v", err)
	}
	if body.ID != id || body.Topic != "user.created" || body.EventType != "user.created" || body.AggregateType != "user" ||
		body.AggregateID != "u-1" || body.PartitionKey != "u-1" || body.CreatedAt.IsZero() ||
		body.Headers["traceparent"] != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" {
		t.Errorf("body = %+v", body)
	}
	jsonEqual(t, body.Payload, `{"user_id": "u-1", "n": [1, 2]}`)

	// Optional arguments left out are JSON nulls.
	if _, err := conn.Exec(ctx, `SELECT walbox.emit_message('user.bare', '"just a string"')`); err != nil {
		t.Fatal(err)
	}
	var content string
	if err := e.pool.QueryRow(ctx, `SELECT convert_from(substring(data from 22), 'UTF8') FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
		'proto_version', '1', 'publication_names', 'walbox_outbox', 'messages', 'true') WHERE get_byte(data, 0) = ascii('M') OFFSET 1`, slot).Scan(&content); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(content, `"payload" : "just a string"`) || !strings.Contains(content, `"event_type" : null`) || !strings.Contains(content, `"headers" : null`) {
		t.Errorf("bare message: %s", content)
	}

	// Bad arguments are refused.
	for _, q := range []string{
		`SELECT walbox.emit_message(NULL, '{}')`,
		`SELECT walbox.emit_message(' ', '{}')`,
		`SELECT walbox.emit_message('user.x', NULL)`,
		`SELECT walbox.emit_message('user.x', '{}', headers => '[1]')`,
		`SELECT walbox.emit('user.x', NULL)`,
	} {
		if _, err := e.pool.Exec(ctx, q); err == nil {
			t.Errorf("%s: no error", q)
		}
	}
}

// TestLagAndBackpressure uses fake walbox.relay_status rows.
func TestLagAndBackpressure(t *testing.T) {
	e := newEnv(t)
	ctx := relaytest.Ctx(t)
	ev := outbox.Event{Topic: "user.created", Payload: json.RawMessage(`{}`)}

	// No row: Lag says so; WithMaxLag does not hold producers back.
	if _, err := outbox.Lag(ctx, e.pool); !errors.Is(err, outbox.ErrNoRelayStatus) {
		t.Fatalf("Lag without a row: %v, want ErrNoRelayStatus", err)
	}
	strict, err := outbox.New(outbox.WithMaxLag(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return strict.Write(ctx, tx, ev) }); err != nil {
		t.Fatalf("Write with WithMaxLag and no status row: %v", err)
	}

	// The relay reports 120 s of lag just now.
	if _, err := e.pool.Exec(ctx, `INSERT INTO walbox.relay_status (slot_name, updated_at, lag_seconds, lag_bytes)
		VALUES ('walbox', now(), 120, 1000000), ('other', now(), 0.5, 10)`); err != nil {
		t.Fatal(err)
	}
	lag, err := outbox.Lag(ctx, e.pool)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Lag = %v", lag)
	if lag < 120*time.Second || lag > 120*time.Second+time.Hour {
		t.Errorf("Lag = %v, want 120s plus the row's age", lag)
	}
	if other, err := outbox.Lag(ctx, e.pool, outbox.WithSlot("other")); err != nil || other >= 120*time.Second {
		t.Errorf("Lag(WithSlot(other)) = %v, %v", other, err)
	}

	before := count(t, e.pool, "SELECT count(*) FROM outbox_events")
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	err = strict.Write(ctx, tx, ev, ev)
	if !errors.Is(err, outbox.ErrBackpressure) {
		t.Fatalf("Write with lag 120s > max 1m: %v, want ErrBackpressure", err)
	}
	var bp *outbox.BackpressureError
	if !errors.As(err, &bp) || bp.Lag < 120*time.Second || bp.MaxLag != time.Minute || bp.Slot != "walbox" {
		t.Errorf("error %v: want a *BackpressureError with the figures", err)
	}
	t.Logf("back-pressure error: %v", err)
	// The transaction is still usable and holds nothing from the refused Write.
	if n := count(t, tx, "SELECT count(*) FROM outbox_events"); n != before {
		t.Errorf("refused Write wrote %d rows", n-before)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit after a refused Write: %v", err)
	}

	// A larger limit lets it through; so does another slot's status.
	for _, w := range []*outbox.Writer{
		must(outbox.New(outbox.WithMaxLag(10 * time.Minute))),
		must(outbox.New(outbox.WithMaxLag(time.Minute), outbox.WithSlot("other"))),
	} {
		if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return w.Write(ctx, tx, ev) }); err != nil {
			t.Errorf("Write: %v", err)
		}
	}

	// A relay that stopped reporting an hour ago counts as an hour behind.
	if _, err := e.pool.Exec(ctx, `UPDATE walbox.relay_status SET lag_seconds = 0, updated_at = now() - interval '1 hour' WHERE slot_name = 'walbox'`); err != nil {
		t.Fatal(err)
	}
	if lag, err := outbox.Lag(ctx, e.pool); err != nil || lag < time.Hour {
		t.Errorf("Lag of a stale row = %v, %v; want at least 1h", lag, err)
	}

	// database/sql.
	db, err := sql.Open("pgx", e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if lag, err := outbox.Lag(ctx, outbox.FromSQL(db)); err != nil || lag < time.Hour {
		t.Errorf("Lag via database/sql = %v, %v", lag, err)
	}
	if _, err := outbox.Lag(ctx, outbox.FromSQL(db), outbox.WithSlot("missing")); !errors.Is(err, outbox.ErrNoRelayStatus) {
		t.Errorf("Lag via database/sql for a missing slot: %v", err)
	}
	sqlTx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sqlTx.Rollback()
	if err := strict.Write(ctx, outbox.FromSQL(sqlTx), ev); !errors.Is(err, outbox.ErrBackpressure) {
		t.Errorf("database/sql Write with a stale relay: %v, want ErrBackpressure", err)
	}
}

func must(w *outbox.Writer, err error) *outbox.Writer {
	if err != nil {
		panic(err)
	}
	return w
}

// TestExistingLayout writes into a table of another layout (text ids, fewer
// columns, another name) through WithTable and WithColumns, on both paths.
func TestExistingLayout(t *testing.T) {
	e := newEnv(t)
	ctx := relaytest.Ctx(t)
	if _, err := e.pool.Exec(ctx, `CREATE SCHEMA app; CREATE TABLE app."Outbox" (
		event_id text PRIMARY KEY, stream text, subject text NOT NULL, body jsonb NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now(), processed boolean NOT NULL DEFAULT false)`); err != nil {
		t.Fatal(err)
	}
	w, err := outbox.New(outbox.WithTable(`app."Outbox"`), outbox.WithColumns(map[string]string{
		"id": "event_id", "topic": "subject", "payload": "body",
		"event_type": "", "aggregate_type": "", "aggregate_id": "", "partition_key": "", "headers": "",
	}))
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if err := w.Write(ctx, tx, outbox.Event{ID: "evt-1", Topic: "user.a", Stream: "USERS", Payload: json.RawMessage(`{"a":1}`)}); err != nil {
			return err
		}
		// AggregateID would only derive the partition key: dropped, not refused.
		return w.Write(ctx, tx, outbox.Event{Topic: "user.b", Payload: 1}, outbox.Event{Topic: "user.c", Payload: "x"})
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := count(t, e.pool, `SELECT count(*) FROM app."Outbox"`); n != 3 {
		t.Errorf("%d rows, want 3", n)
	}
	if n := count(t, e.pool, `SELECT count(*) FROM app."Outbox" WHERE event_id = 'evt-1' AND stream = 'USERS' AND body = '{"a":1}'`); n != 1 {
		t.Errorf("evt-1 not written as given")
	}
	// A field with no column is refused rather than dropped.
	err = pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		return w.Write(ctx, tx, outbox.Event{Topic: "user.d", EventType: "x", Payload: 1})
	})
	if err == nil || !strings.Contains(err.Error(), "event_type") {
		t.Errorf("event type without a column: %v", err)
	}
	for _, bad := range []map[string]string{{"colour": "c"}, {"payload": ""}} {
		if _, err := outbox.New(outbox.WithColumns(bad)); err == nil {
			t.Errorf("WithColumns(%v) accepted", bad)
		}
	}
}

// TestInvalidEventWritesNothing: one bad event among many, and nothing of
// the batch is written; the transaction stays usable.
func TestInvalidEventWritesNothing(t *testing.T) {
	e := newEnv(t)
	ctx := relaytest.Ctx(t)
	good := outbox.Event{Topic: "user.ok", Payload: json.RawMessage(`{}`)}
	for name, bad := range map[string]outbox.Event{
		"empty topic":   {Payload: json.RawMessage(`{}`)},
		"nil payload":   {Topic: "user.x"},
		"invalid json":  {Topic: "user.x", Payload: []byte(`{"a":`)},
		"bad header":    {Topic: "user.x", Payload: 1, Headers: map[string]string{"a b": "c"}},
		"msg id header": {Topic: "user.x", Payload: 1, Headers: map[string]string{"nats-msg-id": "c"}},
		"unmarshalable": {Topic: "user.x", Payload: func() {}},
	} {
		tx, err := e.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		err = outbox.Write(ctx, tx, good, bad, good)
		if err == nil {
			t.Errorf("%s: accepted", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Errorf("%s: commit after the refused Write: %v", name, err)
		}
	}
	if n := count(t, e.pool, "SELECT count(*) FROM outbox_events"); n != 0 {
		t.Errorf("%d rows written", n)
	}
	// A database error is wrapped with what was being done.
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	err = outbox.Write(ctx, tx, outbox.Event{ID: "not-a-uuid", Topic: "user.x", Payload: 1})
	if err == nil || !strings.Contains(err.Error(), "insert event into public.outbox_events") {
		t.Errorf("bad id: %v", err)
	}
}
