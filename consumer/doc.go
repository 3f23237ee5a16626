// Package consumer runs idempotent JetStream consumers for events published
// by walbox (or anything that sets Nats-Msg-Id to an event id).
//
// Run pulls from a durable consumer with explicit acks. Each message is
// handled inside a PostgreSQL transaction of the consumer's own database,
// together with its idempotency record:
//
//	BEGIN;
//	INSERT INTO walbox.processed_events (consumer_group, event_id) VALUES ($durable, $event_id)
//	    ON CONFLICT DO NOTHING;           -- no row inserted: already processed, ack and skip
//	... the handler's own writes, in the same transaction ...
//	COMMIT;                               -- then ack
//
// so an event changes the consumer's database at most once per consumer
// group, however often JetStream delivers it (redelivery after a lost ack
// or a crash, a stream holding a republished event after its duplicate
// window, a durable consumer recreated from the start of the stream), and at
// least once, since the ack follows the commit.
//
// Failures: a handler error rolls the transaction back. An error wrapped
// with Permanent is dead-lettered at once; any other error is retried with
// NakWithDelay after Config.Backoff[attempt-1] (default 1s, 5s, 30s, the last
// repeated), and dead-lettered once the handler has failed on MaxDeliver
// (default 5) deliveries. A dead letter is the original message (data and
// headers) published to Config.DeadLetterSubject (default
// walbox.dlq.consumer.<durable>, which walbox's WALBOX_DLQ stream captures)
// with the error in the Walbox-Consumer-Error header; the original is then
// terminated. Failures of the consumer's own database (begin, idempotency
// insert) never dead-letter: the message is retried until the database is
// back.
//
// Tracing: the W3C trace context in the message headers (traceparent,
// tracestate, which outbox.Write stores with the event) is extracted into the
// handler's context, under a consumer span "process <subject>" of the global
// OpenTelemetry tracer provider (or Config.TracerProvider).
//
// The idempotency table is walbox.processed_events, which `walbox migrate`
// creates in the outbox's database; a consumer with a database of its own
// creates it with Migrate. Like outbox, this package is a module of its own
// (go get github.com/walbox/walbox/consumer) and imports none of the relay's
// code: a service links pgx, nats.go and the OpenTelemetry API.
package consumer
