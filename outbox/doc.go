// Package outbox writes events into walbox's outbox table inside the
// caller's own database transaction, so that an event exists if and only if
// the business change that caused it committed. walbox (the relay) then
// reads the insert from the WAL and publishes it to NATS JetStream with
// Nats-Msg-Id set to the event id.
//
//	tx, _ := pool.Begin(ctx)
//	defer tx.Rollback(ctx)
//	tx.Exec(ctx, "INSERT INTO users (id, email) VALUES ($1, $2)", id, email)
//	outbox.Write(ctx, tx, outbox.Event{
//		Topic: "user.created", EventType: "user.created",
//		AggregateType: "user", AggregateID: id,
//		Payload: map[string]any{"user_id": id, "email": email},
//	})
//	tx.Commit(ctx)
//
// What Write does for you:
//   - generates a UUIDv7 id (time-ordered) when Event.ID is empty;
//   - encodes the payload: json.RawMessage and []byte are taken as JSON text
//     (and checked), anything else goes through encoding/json;
//   - defaults the partition key to the aggregate id;
//   - copies the W3C trace context (traceparent, tracestate) of ctx into the
//     headers column when the caller runs inside an OpenTelemetry span, so a
//     consumer's span continues the producer's trace;
//   - inserts one event with INSERT and many with COPY (pgx CopyFrom) when
//     the transaction supports it;
//   - with WithMaxLag, refuses (ErrBackpressure) while the relay is further
//     behind than allowed, before writing anything.
//
// It works with pgx (pgx.Tx, or anything with the pgx Exec and QueryRow
// methods) and with database/sql (wrap a *sql.Tx with FromSQL: the pgx
// stdlib driver and lib/pq both work; many events then go as multi-row
// INSERTs).
//
// The package is a module of its own (go get github.com/walbox/walbox/outbox)
// and imports none of the relay's code: a service links only pgx,
// google/uuid and the OpenTelemetry API, and its go.sum gets none of the
// relay's dependencies.
//
// Options follow the style of nats.go's jetstream package: build a Writer
// once with New(opts...) and reuse it; the package-level Write uses the
// defaults (table public.outbox_events, every column under its role's name,
// no back-pressure).
package outbox
