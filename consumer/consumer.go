package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Header names read from walbox's messages and written on dead letters.
const (
	HeaderMsgID         = "Nats-Msg-Id" // the event id
	HeaderEventType     = "Walbox-Event-Type"
	HeaderAggregateType = "Walbox-Aggregate-Type"
	HeaderAggregateID   = "Walbox-Aggregate-Id"
	HeaderPartitionKey  = "Walbox-Partition-Key"
	HeaderCommitTime    = "Walbox-Commit-Time"

	// On dead letters: the error, the consumer group, the deliveries so far,
	// the event id (Nats-Msg-Id of a dead letter is its own) and where the
	// original was.
	HeaderError            = "Walbox-Consumer-Error"
	HeaderGroup            = "Walbox-Consumer-Group"
	HeaderAttempts         = "Walbox-Consumer-Attempts"
	HeaderEventID          = "Walbox-Event-Id"
	HeaderDLQReason        = "Walbox-Dlq-Reason"
	HeaderOriginalSubject  = "Walbox-Dlq-Original-Subject"
	HeaderOriginalStream   = "Walbox-Dlq-Original-Stream"
	HeaderOriginalSequence = "Walbox-Dlq-Original-Sequence"

	// On a retried dead letter (walbox dlq retry): the subject the event
	// had, and the dead letter it came from.
	HeaderRetrySubject = "Walbox-Retry-Subject"
	HeaderRetriedFrom  = "Walbox-Dlq-Retried-From"
)

// Defaults of Config.
const (
	DefaultMaxDeliver = 5
	DefaultAckWait    = 30 * time.Second
	// DefaultDeadLetterPrefix + Durable is the default dead-letter subject;
	// walbox's dead-letter stream (WALBOX_DLQ, walbox.dlq.>) captures it.
	DefaultDeadLetterPrefix = "walbox.dlq.consumer."
	// DefaultRetryPrefix + Durable is the default retry subject: `walbox
	// dlq retry` sends a group's dead letters back there, to that group
	// alone (the other groups already handled the event).
	DefaultRetryPrefix = "walbox.dlq.retry."
)

// DefaultBackoff is the delay before redelivery after the 1st, 2nd and
// later failures.
func DefaultBackoff() []time.Duration {
	return []time.Duration{time.Second, 5 * time.Second, 30 * time.Second}
}

// Handler handles one event inside tx, the consumer database transaction
// that also holds the event's idempotency record. It must do its writes
// through tx and must not commit or roll it back. Return nil to commit and
// ack; an error to roll back and retry later; Permanent(err) to roll back
// and dead-letter at once. ctx carries the producer's trace context and is
// cancelled when Run stops.
type Handler func(ctx context.Context, tx pgx.Tx, msg Message) error

// Message is one delivered event.
type Message struct {
	// ID is the event id: the Nats-Msg-Id header (walbox sets it to the
	// outbox row's id); the idempotency key.
	ID      string
	Subject string
	// Data is the event's payload, verified: the message body, or, for an
	// event walbox stored apart (a Walbox-Claim-Check header, Claim set),
	// the object Run fetched from the store and checked against the
	// reference's size and SHA-256 before the handler runs (an object that
	// is gone or does not match never reaches the handler: the event is
	// dead-lettered with ErrClaimMissing or ErrClaimCorrupt). With
	// Config.ClaimReferenceOnly such an event's Data is empty: fetch and
	// verify it with FetchClaim. (A field, not a method: issue 39's
	// Data() is this field.)
	Data []byte
	// Claim is the claim-check reference of an event whose payload walbox
	// stored apart; nil for the others.
	Claim *ClaimCheck
	// Header holds every message header (traceparent, the Walbox-* headers,
	// the keys of the outbox row's headers column). Do not modify it.
	Header nats.Header
	// From walbox's headers; empty when not set.
	EventType     string
	AggregateType string
	AggregateID   string
	PartitionKey  string
	// Attempt is the delivery count: 1 the first time.
	Attempt int
	// Stream and Sequence locate the message; Timestamp is when the stream
	// stored it.
	Stream    string
	Sequence  uint64
	Timestamp time.Time

	claimErr error // a Walbox-Claim-Check header that does not parse
}

// Decode unmarshals the JSON payload into v.
func (m Message) Decode(v any) error {
	if err := json.Unmarshal(m.Data, v); err != nil {
		return fmt.Errorf("decode event %s on %s: %w", m.ID, m.Subject, err)
	}
	return nil
}

// Outcome is what happened to one delivery (see Config.OnOutcome).
type Outcome int

const (
	// Processed: the handler ran and its transaction committed; acked.
	Processed Outcome = iota + 1
	// Duplicate: the group had already processed the event; acked without
	// running the handler.
	Duplicate
	// Retrying: the handler or the database failed; redelivered after a
	// delay.
	Retrying
	// DeadLettered: published to the dead-letter subject; terminated.
	DeadLettered
)

func (o Outcome) String() string {
	switch o {
	case Processed:
		return "processed"
	case Duplicate:
		return "duplicate"
	case Retrying:
		return "retrying"
	case DeadLettered:
		return "dead-lettered"
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// Config configures Run. Stream, Durable and DB are required.
type Config struct {
	// Stream is the JetStream stream to consume (it must exist; walbox
	// creates the streams in its config).
	Stream string
	// Durable is the durable consumer's name and the consumer group of the
	// idempotency records: every instance of one service uses the same
	// name, and they share the work. Letters, digits, - and _.
	Durable string
	// FilterSubjects limits the consumer to these subjects (wildcards
	// allowed); empty: the whole stream.
	FilterSubjects []string
	// MaxDeliver is how many deliveries the handler may fail before the
	// event is dead-lettered (default 5). Counted by Run from the delivery
	// count, not by the server (the JetStream consumer is created with
	// unlimited deliveries), so an event is never dropped silently: a
	// delivery whose dead letter cannot be published is retried.
	MaxDeliver int
	// Backoff is the delay before the next delivery after the 1st, 2nd, ...
	// failure; the last one repeats (default 1s, 5s, 30s).
	Backoff []time.Duration
	// AckWait is how long JetStream waits for an ack before redelivering
	// (default 30s). A handler running longer is kept alive with
	// in-progress acks.
	AckWait time.Duration
	// Concurrency is how many messages are handled at once (default 1).
	// Above 1 events are processed out of order.
	Concurrency int
	// DB is the consumer's own database, holding walbox.processed_events
	// (see Migrate) and the tables the handler writes.
	DB *pgxpool.Pool
	// DeadLetterSubject is where dead letters go (default
	// "walbox.dlq.consumer.<Durable>"). A stream must capture it; Run checks.
	DeadLetterSubject string
	// Retention deletes this group's idempotency records
	// (walbox.processed_events) older than it, in batches, every
	// Retention/10 (at most hourly). 0 keeps them forever. Make it longer
	// than any redelivery or replay of an event can come: after it, the
	// same event would be handled again.
	Retention time.Duration
	// RetrySubject is where `walbox dlq retry` sends this group's dead
	// letters back (default "walbox.dlq.retry.<Durable>"). A stream must
	// capture it (WALBOX_DLQ does); Run consumes it with a second durable
	// consumer, <Durable>-retry, through the same handler.
	RetrySubject string
	// Retryable decides whether a handler error is worth retrying (default:
	// every error not wrapped with Permanent).
	Retryable func(error) bool
	// OnOutcome, if set, is called after each delivery is settled, from the
	// goroutine that handled it (for metrics and logs). err is the handler
	// or database error for Retrying and DeadLettered.
	OnOutcome func(msg Message, outcome Outcome, err error)
	// ClaimReferenceOnly hands an event whose payload walbox stored apart
	// to the handler with its reference (Message.Claim) and an empty Data,
	// for a handler that streams the object itself (FetchClaim reads it
	// whole). Otherwise Run fetches and verifies the payload first.
	ClaimReferenceOnly bool
	// ClaimMinRate is the slowest transfer, in bytes a second, the fetch
	// of a claim-check object is given time for: it may take 10 s plus
	// the object's size at this rate before the delivery is retried (0:
	// DefaultClaimMinRate, 1 MiB/s; 74 s for 64 MiB).
	ClaimMinRate int64
	// Logger receives warnings (retries, dead letters, ack failures); nil:
	// silent.
	Logger *slog.Logger
	// TracerProvider makes the consumer spans (default: otel's global one).
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context from the headers (default
	// propagation.TraceContext{}).
	Propagator propagation.TextMapPropagator
}

// validDurable allows what JetStream allows in a durable name and in a
// subject token: letters, digits, - and _.
func validDurable(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

func (c Config) withDefaults() (Config, error) {
	switch {
	case c.Stream == "":
		return c, errors.New("Config.Stream is required")
	case c.Durable == "":
		return c, errors.New("Config.Durable (the consumer group) is required")
	case !validDurable(c.Durable):
		return c, fmt.Errorf("Config.Durable %q: use letters, digits, - and _", c.Durable)
	case c.DB == nil:
		return c, errors.New("Config.DB (the consumer's database) is required")
	case c.MaxDeliver < 0:
		return c, fmt.Errorf("Config.MaxDeliver %d: must not be negative", c.MaxDeliver)
	case c.Concurrency < 0:
		return c, fmt.Errorf("Config.Concurrency %d: must not be negative", c.Concurrency)
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = DefaultMaxDeliver
	}
	if len(c.Backoff) == 0 {
		c.Backoff = DefaultBackoff()
	}
	for _, d := range c.Backoff {
		if d < 0 {
			return c, fmt.Errorf("Config.Backoff: negative delay %v", d)
		}
	}
	if c.AckWait <= 0 {
		c.AckWait = DefaultAckWait
	}
	if c.Concurrency == 0 {
		c.Concurrency = 1
	}
	if c.DeadLetterSubject == "" {
		c.DeadLetterSubject = DefaultDeadLetterPrefix + c.Durable
	}
	if strings.ContainsAny(c.DeadLetterSubject, "*> \t\r\n") {
		return c, fmt.Errorf("Config.DeadLetterSubject %q: must be a plain subject", c.DeadLetterSubject)
	}
	if c.RetrySubject == "" {
		c.RetrySubject = DefaultRetryPrefix + c.Durable
	}
	if strings.ContainsAny(c.RetrySubject, "*> \t\r\n") {
		return c, fmt.Errorf("Config.RetrySubject %q: must be a plain subject", c.RetrySubject)
	}
	if c.Retryable == nil {
		c.Retryable = func(err error) bool { return !IsPermanent(err) }
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.Propagator == nil {
		c.Propagator = propagation.TraceContext{}
	}
	return c, nil
}

// runner is one Run's state.
type runner struct {
	cfg     Config
	js      jetstream.JetStream
	handler Handler
	tracer  trace.Tracer
	log     *slog.Logger
	retry   bool // consumes the group's retry subject
}

// Run consumes until ctx ends, then waits for the messages in hand to
// settle and returns nil. It first checks what it needs (the idempotency
// table, the stream, a stream for the dead letters) and creates or updates
// the durable consumer; a problem there is returned at once.
func Run(ctx context.Context, js jetstream.JetStream, cfg Config, handler Handler) error {
	if js == nil || handler == nil {
		return errors.New("consumer: Run needs a JetStream and a handler")
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	r := &runner{
		cfg: cfg, js: js, handler: handler,
		tracer: cfg.TracerProvider.Tracer("github.com/walbox/walbox/consumer"),
		log:    cfg.Logger.With("stream", cfg.Stream, "durable", cfg.Durable),
	}
	cons, err := r.setup(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	rr := *r
	rr.retry = true
	rr.log = r.log.With("retry", true)
	rcons, err := rr.setupRetry(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	// Both loops stop when ctx ends; if one fails, the other is stopped too.
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if r.cfg.Retention > 0 {
		pruned := make(chan struct{})
		defer func() { <-pruned }()
		go func() { defer close(pruned); r.prune(lctx) }()
	}
	retryDone := make(chan error, 1)
	go func() {
		err := rr.loop(lctx, rcons)
		if err != nil {
			cancel()
		}
		retryDone <- err
	}()
	err = r.loop(lctx, cons)
	cancel()
	if rerr := <-retryDone; err == nil {
		err = rerr
	}
	return err
}

// prune deletes the group's idempotency records older than Retention, in
// batches, now and then every Retention/10 (at most hourly), until ctx ends.
func (r *runner) prune(ctx context.Context) {
	every := min(r.cfg.Retention/10, time.Hour)
	for {
		for {
			tag, err := r.cfg.DB.Exec(ctx, `DELETE FROM walbox.processed_events WHERE ctid IN (
				SELECT ctid FROM walbox.processed_events WHERE consumer_group = $1 AND processed_at < now() - $2::interval LIMIT 10000)`,
				r.cfg.Durable, r.cfg.Retention.String())
			if err != nil {
				if ctx.Err() == nil {
					r.log.Warn("prune idempotency records", "err", err)
				}
				break
			}
			if tag.RowsAffected() < 10000 {
				break
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(every):
		}
	}
}

// setupRetry creates or updates the durable consumer of the group's retry
// subject, on the stream that captures it.
func (r *runner) setupRetry(ctx context.Context) (jetstream.Consumer, error) {
	stream, err := r.js.StreamNameBySubject(ctx, r.cfg.RetrySubject)
	if err != nil {
		return nil, fmt.Errorf("consumer %s: no stream captures the retry subject %s (walbox's WALBOX_DLQ captures walbox.dlq.>; or set Config.RetrySubject): %w",
			r.cfg.Durable, r.cfg.RetrySubject, err)
	}
	cons, err := r.js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:       r.cfg.Durable + "-retry",
		Description:   "walbox consumer group " + r.cfg.Durable + ": dead letters sent back by walbox dlq retry",
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       r.cfg.AckWait,
		MaxDeliver:    -1,
		FilterSubject: r.cfg.RetrySubject,
	})
	if err != nil {
		return nil, fmt.Errorf("consumer %s: create or update the retry consumer on stream %s: %w", r.cfg.Durable, stream, err)
	}
	return cons, nil
}

func (r *runner) setup(ctx context.Context) (jetstream.Consumer, error) {
	if _, err := r.cfg.DB.Exec(ctx, "SELECT 1 FROM walbox.processed_events LIMIT 0"); err != nil {
		return nil, fmt.Errorf("consumer %s: check the idempotency table walbox.processed_events (create it with consumer.Migrate or `walbox migrate`): %w", r.cfg.Durable, err)
	}
	if _, err := r.js.Stream(ctx, r.cfg.Stream); err != nil {
		return nil, fmt.Errorf("consumer %s: look up stream %s: %w", r.cfg.Durable, r.cfg.Stream, err)
	}
	if _, err := r.js.StreamNameBySubject(ctx, r.cfg.DeadLetterSubject); err != nil {
		return nil, fmt.Errorf("consumer %s: no stream captures the dead-letter subject %s (walbox's WALBOX_DLQ captures walbox.dlq.>; or set Config.DeadLetterSubject): %w",
			r.cfg.Durable, r.cfg.DeadLetterSubject, err)
	}
	cc := jetstream.ConsumerConfig{
		Durable:       r.cfg.Durable,
		Description:   "walbox consumer group " + r.cfg.Durable,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       r.cfg.AckWait,
		MaxDeliver:    -1, // Run counts deliveries and dead-letters itself
	}
	switch len(r.cfg.FilterSubjects) {
	case 0:
	case 1:
		cc.FilterSubject = r.cfg.FilterSubjects[0]
	default:
		cc.FilterSubjects = r.cfg.FilterSubjects
	}
	cons, err := r.js.CreateOrUpdateConsumer(ctx, r.cfg.Stream, cc)
	if err != nil {
		return nil, fmt.Errorf("consumer %s: create or update the durable consumer on stream %s: %w", r.cfg.Durable, r.cfg.Stream, err)
	}
	return cons, nil
}

func (r *runner) loop(ctx context.Context, cons jetstream.Consumer) error {
	// Buffer few messages: a buffered message's ack wait is already running.
	it, err := cons.Messages(jetstream.PullMaxMessages(2 * r.cfg.Concurrency))
	if err != nil {
		return fmt.Errorf("consumer %s: start pulling from stream %s: %w", r.cfg.Durable, r.cfg.Stream, err)
	}
	defer it.Stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	slots := make(chan struct{}, r.cfg.Concurrency)
	for {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			r.giveBack(it)
			return nil
		}
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			<-slots
			if ctx.Err() != nil {
				r.giveBack(it)
				return nil
			}
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) || errors.Is(err, jetstream.ErrConsumerDeleted) {
				return fmt.Errorf("consumer %s: pulling from stream %s stopped: %w", r.cfg.Durable, r.cfg.Stream, err)
			}
			// Missed heartbeats and the like: the iterator recovers.
			r.log.Warn("pull from JetStream", "err", err)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			r.handle(ctx, msg)
		}()
	}
}

// giveBack stops pulling and naks the messages pulled but not handled, so
// another instance gets them now rather than after the ack wait.
func (r *runner) giveBack(it jetstream.MessagesContext) {
	it.Drain()
	for {
		msg, err := it.Next(jetstream.NextMaxWait(time.Second))
		if err != nil {
			return
		}
		_ = msg.Nak()
	}
}

// handle settles one delivery.
func (r *runner) handle(ctx context.Context, jm jetstream.Msg) {
	m := newMessage(jm)
	ctx = r.cfg.Propagator.Extract(ctx, headerCarrier(jm.Headers()))
	ctx, span := r.tracer.Start(ctx, "process "+m.Subject, trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("messaging.system", "nats"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.destination.name", m.Subject),
			attribute.String("messaging.consumer.group.name", r.cfg.Durable),
			attribute.String("messaging.message.id", m.ID),
			attribute.Int("messaging.delivery.attempt", m.Attempt),
		))
	defer span.End()
	stop := r.keepAlive(jm)
	outcome, err := r.settle(ctx, jm, m)
	stop()
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.SetAttributes(attribute.String("walbox.consumer.outcome", outcome.String()))
	if r.cfg.OnOutcome != nil && outcome != 0 {
		r.cfg.OnOutcome(m, outcome, err)
	}
}

// keepAlive sends in-progress acks while a handler runs long, so JetStream
// does not redeliver it meanwhile. The returned func stops it.
func (r *runner) keepAlive(jm jetstream.Msg) func() {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(r.cfg.AckWait / 2)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				_ = jm.InProgress()
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}

// settle processes m and acks, naks or dead-letters it. It returns 0 when
// the message was left for redelivery because Run is stopping.
func (r *runner) settle(ctx context.Context, jm jetstream.Msg, m Message) (Outcome, error) {
	if m.ID == "" {
		return r.deadLetter(ctx, jm, m, Permanent(errors.New("the message has no Nats-Msg-Id header: no event id to deduplicate by")))
	}
	if m.claimErr != nil {
		return r.deadLetter(ctx, jm, m, Permanent(fmt.Errorf("event %s: %w", m.ID, m.claimErr)))
	}
	if m.Claim != nil && !r.cfg.ClaimReferenceOnly && len(m.Data) == 0 {
		data, err := FetchClaim(ctx, r.js, m.ID, m.Claim, WithMinRate(r.cfg.ClaimMinRate))
		switch {
		case err == nil:
			m.Data = data
		case ctx.Err() != nil:
			r.ackErr(jm.Nak(), "nak", m)
			return 0, nil
		case errors.Is(err, ErrClaimMissing), errors.Is(err, ErrClaimCorrupt):
			return r.deadLetter(ctx, jm, m, Permanent(err))
		default:
			delay := r.backoff(m.Attempt)
			r.log.Warn("cannot read the event's payload from the claim-check store; retrying", "event_id", m.ID, "key", m.Claim.Key, "retry_in", delay, "err", err)
			r.ackErr(jm.NakWithDelay(delay), "nak", m)
			return Retrying, err
		}
	}
	outcome, err := r.process(ctx, m)
	switch {
	case err == nil:
		r.ackErr(jm.Ack(), "ack", m)
		return outcome, nil
	case ctx.Err() != nil:
		// Stopping: not the event's fault. Let another instance have it.
		r.ackErr(jm.Nak(), "nak", m)
		return 0, nil
	case outcome == 0: // the database failed before the handler ran
		delay := r.backoff(m.Attempt)
		r.log.Warn("consumer database unavailable; retrying", "event_id", m.ID, "attempt", m.Attempt, "retry_in", delay, "err", err)
		r.ackErr(jm.NakWithDelay(delay), "nak", m)
		return Retrying, err
	case !r.cfg.Retryable(err) || m.Attempt >= r.cfg.MaxDeliver:
		return r.deadLetter(ctx, jm, m, err)
	default:
		delay := r.backoff(m.Attempt)
		r.log.Warn("handler failed; retrying", "event_id", m.ID, "subject", m.Subject, "attempt", m.Attempt, "max_deliver", r.cfg.MaxDeliver, "retry_in", delay, "err", err)
		r.ackErr(jm.NakWithDelay(delay), "nak", m)
		return Retrying, err
	}
}

// process runs the handler in a transaction with the idempotency record.
// It returns (0, err) when the database failed before the handler ran,
// (Duplicate, nil) when the group had processed the event, and (Processed,
// err) otherwise, err being the handler's or the commit's error.
func (r *runner) process(ctx context.Context, m Message) (outcome Outcome, err error) {
	tx, err := r.cfg.DB.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin a transaction in the consumer database: %w", err)
	}
	defer func() {
		if outcome != Processed || err != nil {
			// Also when ctx is done (Run stopping), bounded all the same.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = tx.Rollback(rctx)
			cancel()
		}
	}()
	tag, err := tx.Exec(ctx, `INSERT INTO walbox.processed_events (consumer_group, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`, r.cfg.Durable, m.ID)
	if err != nil {
		return 0, fmt.Errorf("record event %s in walbox.processed_events: %w", m.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return Duplicate, nil
	}
	if err := r.call(ctx, tx, m); err != nil {
		return Processed, err
	}
	if err := tx.Commit(ctx); err != nil {
		return Processed, fmt.Errorf("commit the handler's transaction: %w", err)
	}
	return Processed, nil
}

// call runs the handler, turning a panic into an error.
func (r *runner) call(ctx context.Context, tx pgx.Tx, m Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("handler panicked: %v", p)
		}
	}()
	return r.handler(ctx, tx, m)
}

func (r *runner) backoff(attempt int) time.Duration {
	i := min(max(attempt-1, 0), len(r.cfg.Backoff)-1)
	return r.cfg.Backoff[i]
}

// deadLetter publishes the message to the dead-letter subject and
// terminates it; if the publish fails it is retried later instead.
func (r *runner) deadLetter(ctx context.Context, jm jetstream.Msg, m Message, cause error) (Outcome, error) {
	reason := fmt.Sprintf("consumer %s: handler failed on %d of at most %d deliveries", r.cfg.Durable, m.Attempt, r.cfg.MaxDeliver)
	if !r.cfg.Retryable(cause) {
		reason = fmt.Sprintf("consumer %s: permanent error", r.cfg.Durable)
	}
	dl := nats.NewMsg(r.cfg.DeadLetterSubject)
	dl.Data = m.Data
	if m.Claim != nil {
		dl.Data = nil // the reference header travels with the dead letter
	}
	for k, vs := range m.Header {
		if strings.HasPrefix(strings.ToLower(k), "nats-") {
			continue // Nats-Msg-Id, Nats-Expected-*, ...: they would change how the dead letter is stored
		}
		dl.Header[k] = append([]string(nil), vs...)
	}
	dl.Header.Set(HeaderError, headerValue(cause.Error()))
	dl.Header.Set(HeaderDLQReason, reason)
	dl.Header.Set(HeaderGroup, r.cfg.Durable)
	dl.Header.Set(HeaderAttempts, strconv.Itoa(m.Attempt))
	dl.Header.Set(HeaderOriginalSubject, m.Subject)
	dl.Header.Del(HeaderRetrySubject)
	dl.Header.Del(HeaderRetriedFrom)
	dl.Header.Set(HeaderOriginalStream, m.Stream)
	dl.Header.Set(HeaderOriginalSequence, strconv.FormatUint(m.Sequence, 10))
	// One dead letter per group and event, even if this runs twice.
	dedup := m.Stream + "." + strconv.FormatUint(m.Sequence, 10)
	if m.ID != "" {
		dl.Header.Set(HeaderEventID, m.ID)
		dedup = m.ID
	}
	if r.retry {
		// A retried event failing again is a new dead letter: its first
		// one's id may still be inside the duplicate window.
		dedup += ".retry." + m.Stream + "." + strconv.FormatUint(m.Sequence, 10)
	}
	dl.Header.Set(HeaderMsgID, "consumer."+r.cfg.Durable+"."+dedup)
	if _, err := r.js.PublishMsg(ctx, dl); err != nil {
		delay := r.backoff(r.cfg.MaxDeliver)
		r.log.Error("publish dead letter failed; retrying the event", "event_id", m.ID, "subject", r.cfg.DeadLetterSubject, "retry_in", delay, "err", err, "cause", cause)
		r.ackErr(jm.NakWithDelay(delay), "nak", m)
		return Retrying, fmt.Errorf("%w (and publishing the dead letter to %s failed: %v)", cause, r.cfg.DeadLetterSubject, err)
	}
	r.log.Warn("event dead-lettered", "event_id", m.ID, "subject", m.Subject, "attempt", m.Attempt, "dead_letter_subject", r.cfg.DeadLetterSubject, "err", cause)
	r.ackErr(jm.TermWithReason(headerValue(reason)), "term", m)
	return DeadLettered, cause
}

func (r *runner) ackErr(err error, what string, m Message) {
	if err != nil {
		// The message comes back after the ack wait; the idempotency
		// record makes that harmless.
		r.log.Warn(what+" failed; JetStream will redeliver", "event_id", m.ID, "err", err)
	}
}

// headerValue makes s fit a NATS header value: one line, bounded.
func headerValue(s string) string {
	s = strings.Map(func(r rune) rune {
		if r == '\r' || r == '\n' {
			return ' '
		}
		return r
	}, s)
	const maxLen = 4096
	if len(s) > maxLen {
		s = s[:maxLen] + "..."
	}
	return s
}

func newMessage(jm jetstream.Msg) Message {
	h := jm.Headers()
	m := Message{
		ID:            h.Get(HeaderMsgID),
		Subject:       jm.Subject(),
		Data:          jm.Data(),
		Header:        h,
		EventType:     h.Get(HeaderEventType),
		AggregateType: h.Get(HeaderAggregateType),
		AggregateID:   h.Get(HeaderAggregateID),
		PartitionKey:  h.Get(HeaderPartitionKey),
	}
	m.Claim, m.claimErr = ParseClaimCheck(h)
	if meta, err := jm.Metadata(); err == nil {
		m.Attempt = int(meta.NumDelivered)
		m.Stream = meta.Stream
		m.Sequence = meta.Sequence.Stream
		m.Timestamp = meta.Timestamp
	}
	if m.Attempt < 1 {
		m.Attempt = 1
	}
	// A dead letter sent back by walbox dlq retry: the event's own id and
	// subject, not the retry message's.
	if subj := h.Get(HeaderRetrySubject); subj != "" {
		m.Subject = subj
		if id := h.Get(HeaderEventID); id != "" {
			m.ID = id
		}
	}
	return m
}

// headerCarrier reads trace headers from NATS headers, whose keys keep
// their case (walbox copies "traceparent" as written in the headers column).
type headerCarrier nats.Header

func (c headerCarrier) Get(key string) string {
	if vs := c[key]; len(vs) > 0 {
		return vs[0]
	}
	for k, vs := range c {
		if strings.EqualFold(k, key) && len(vs) > 0 {
			return vs[0]
		}
	}
	return ""
}

func (c headerCarrier) Set(key, value string) { c[key] = []string{value} }

func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
