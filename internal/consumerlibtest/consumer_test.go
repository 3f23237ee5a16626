package consumerlibtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/relaytest"
	walboxsql "github.com/walbox/walbox/sql"
)

const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// accounts is the example handler: create an account for the user of a
// user.created event. The table has no unique constraint on user_id on
// purpose: only the idempotency record keeps it to one row per user.
func accounts(runs *atomic.Int64) consumer.Handler {
	return counted(runs, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		var ev struct {
			UserID string `json:"user_id"`
		}
		if err := msg.Decode(&ev); err != nil {
			return consumer.Permanent(err)
		}
		_, err := tx.Exec(ctx, "INSERT INTO accounts (user_id, event_id) VALUES ($1, $2)", ev.UserID, msg.ID)
		return err
	})
}

// counted is h, counting its runs in runs.
func counted(runs *atomic.Int64, h consumer.Handler) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		runs.Add(1)
		return h(ctx, tx, msg)
	}
}

func TestProcess(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	var runs atomic.Int64
	var mu sync.Mutex
	seen := map[string]consumer.Message{}
	traces := map[string]trace.TraceID{}
	base := accounts(&runs)
	h := func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		mu.Lock()
		seen[msg.ID] = msg
		traces[msg.ID] = trace.SpanContextFromContext(ctx).TraceID()
		mu.Unlock()
		return base(ctx, tx, msg)
	}
	for i := range 3 {
		e.publish("user.created", fmt.Sprintf("evt-%d", i), fmt.Sprintf(`{"user_id": "u-%d"}`, i), map[string]string{"traceparent": traceparent})
	}
	e.publish("user.deleted", "evt-other", `{"user_id": "u-x"}`, nil) // filtered out
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "accounts", FilterSubjects: []string{"user.created"}, DB: e.db, OnOutcome: out.record}, h)
	out.waitFor(t, "3 processed", func() bool { return out.count(consumer.Processed) == 3 })

	if n := e.count("SELECT count(*) FROM accounts"); n != 3 {
		t.Errorf("accounts: %d rows, want 3", n)
	}
	if n := e.count("SELECT count(*) FROM walbox.processed_events WHERE consumer_group = 'accounts'"); n != 3 {
		t.Errorf("processed_events: %d rows, want 3", n)
	}
	m := seen["evt-1"]
	if m.Subject != "user.created" || m.EventType != "user.created" || m.AggregateType != "user" || m.Attempt != 1 ||
		m.Stream != "USERS" || m.Sequence == 0 || m.Timestamp.IsZero() || string(m.Data) != `{"user_id": "u-1"}` {
		t.Errorf("message %+v", m)
	}
	if got := traces["evt-1"].String(); got != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("handler's trace id %s, want the producer's", got)
	}
	if _, ok := seen["evt-other"]; ok {
		t.Error("filtered subject delivered")
	}
	info := e.consumerInfo("accounts")
	if info.Config.AckPolicy != jetstream.AckExplicitPolicy || info.Config.FilterSubject != "user.created" {
		t.Errorf("consumer config %+v", info.Config)
	}
}

func (e *env) consumerInfo(durable string) *jetstream.ConsumerInfo {
	e.t.Helper()
	c, err := e.js.Consumer(relaytest.Ctx(e.t), "USERS", durable)
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := c.Info(relaytest.Ctx(e.t))
	if err != nil {
		e.t.Fatal(err)
	}
	return info
}

// waitSettled waits until the durable consumer has nothing pending or
// unacknowledged.
func (e *env) waitSettled(durable string) {
	e.t.Helper()
	relaytest.Eventually(e.t, 30*time.Second, "consumer "+durable+" settled", func() bool {
		info := e.consumerInfo(durable)
		return info.NumPending == 0 && info.NumAckPending == 0
	})
}

// TestDuplicateSuppression forces duplicates both ways JetStream can
// deliver them and checks the handler ran once per event:
//   - the stream holds every event twice under the same Nats-Msg-Id (as
//     after a relay restart past the duplicate window: here a 100 ms window);
//   - every first successful handling is nak'ed after its commit, as if the
//     ack were lost, so JetStream redelivers an event already processed;
//   - four handlers run at once, so copies of one event race each other;
//   - then the durable consumer is deleted and recreated, replaying the
//     whole stream.
func TestDuplicateSuppression(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{Name: "USERS", Subjects: []string{"user.>"}, Duplicates: 100 * time.Millisecond})
	const events = 20
	for i := range events {
		e.publish("user.created", fmt.Sprintf("evt-%02d", i), fmt.Sprintf(`{"user_id": "u-%02d"}`, i), nil)
	}
	// The same ids again, once the duplicate window has let them through.
	for i := range events {
		relaytest.Eventually(t, 10*time.Second, fmt.Sprintf("evt-%02d stored again", i), func() bool {
			return !e.publish("user.created", fmt.Sprintf("evt-%02d", i), fmt.Sprintf(`{"user_id": "u-%02d"}`, i), nil).Duplicate
		})
	}
	st, err := e.js.Stream(relaytest.Ctx(t), "USERS")
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(relaytest.Ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 2*events {
		t.Fatalf("stream holds %d messages, want %d (each event twice)", info.State.Msgs, 2*events)
	}

	var runs atomic.Int64
	loser := newAckLoser()
	out := newOutcomes()
	cfg := consumer.Config{Stream: "USERS", Durable: "accounts", DB: e.db, Concurrency: 4, OnOutcome: out.record}
	stop := e.startWith(loser.jetStream(e.js), cfg, loser.handler(accounts(&runs)))
	// 40 stream messages delivered once each, plus the 20 nak'ed after commit.
	out.waitFor(t, "60 deliveries", func() bool { return out.total() >= 3*events })
	e.waitSettled("accounts")
	stop()

	accountsRows := e.count("SELECT count(*) FROM accounts")
	users := e.count("SELECT count(DISTINCT user_id) FROM accounts")
	records := e.count("SELECT count(*) FROM walbox.processed_events WHERE consumer_group = 'accounts'")
	t.Logf("duplicate suppression: %d events, %d stream messages (each event stored twice), %d deliveries "+
		"(%d forced redeliveries after commit, concurrency 4): handler ran %d times, %d processed, %d skipped as duplicates, %d retrying, %d dead-lettered; "+
		"accounts rows %d (distinct users %d), processed_events rows %d",
		events, info.State.Msgs, out.total(), loser.forced.Load(), runs.Load(), out.count(consumer.Processed), out.count(consumer.Duplicate),
		out.count(consumer.Retrying), out.count(consumer.DeadLettered), accountsRows, users, records)
	if runs.Load() != events || out.count(consumer.Processed) != events || accountsRows != events || users != events || records != events {
		t.Fatalf("handler ran %d times, %d accounts for %d users, %d records; want %d each", runs.Load(), accountsRows, users, records, events)
	}
	if loser.forced.Load() != events {
		t.Errorf("%d acks lost, want %d (one per first processing)", loser.forced.Load(), events)
	}
	if out.count(consumer.Duplicate) != 2*events {
		t.Errorf("%d duplicates skipped, want %d", out.count(consumer.Duplicate), 2*events)
	}

	// Replay: recreate the durable consumer from the start of the stream.
	if err := e.js.DeleteConsumer(relaytest.Ctx(t), "USERS", "accounts"); err != nil {
		t.Fatal(err)
	}
	replay := newOutcomes()
	cfg.OnOutcome = replay.record
	e.start(cfg, accounts(&runs)) // acks arrive
	replay.waitFor(t, "the replay", func() bool { return replay.total() >= 2*events })
	e.waitSettled("accounts")
	accountsRows = e.count("SELECT count(*) FROM accounts")
	t.Logf("replay after recreating the durable consumer: %d deliveries, %d skipped as duplicates; handler ran %d times in all; accounts rows %d",
		replay.total(), replay.count(consumer.Duplicate), runs.Load(), accountsRows)
	if replay.count(consumer.Duplicate) != 2*events || runs.Load() != events || accountsRows != events {
		t.Errorf("replay processed events again")
	}
}

func TestRetryWithBackoffThenSuccess(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	var runs atomic.Int64
	base := accounts(&runs)
	var mu sync.Mutex
	var when []time.Time
	h := func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		mu.Lock()
		when = append(when, time.Now())
		mu.Unlock()
		if err := base(ctx, tx, msg); err != nil { // written, then rolled back below
			return err
		}
		if msg.Attempt < 3 {
			return fmt.Errorf("billing service unavailable (attempt %d)", msg.Attempt)
		}
		return nil
	}
	e.publish("user.created", "evt-retry", `{"user_id": "u-1"}`, nil)
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "accounts", DB: e.db, OnOutcome: out.record,
		Backoff: []time.Duration{50 * time.Millisecond, 100 * time.Millisecond}}, h)
	out.waitFor(t, "processed", func() bool { return out.count(consumer.Processed) == 1 })

	var got []string
	for _, r := range out.snapshot() {
		got = append(got, fmt.Sprintf("%d:%s", r.msg.Attempt, r.outcome))
	}
	if strings.Join(got, " ") != "1:retrying 2:retrying 3:processed" {
		t.Errorf("deliveries %v", got)
	}
	t.Logf("deliveries %v; gaps between attempts %v, %v (backoff 50ms, 100ms)", got, when[1].Sub(when[0]).Round(time.Millisecond), when[2].Sub(when[1]).Round(time.Millisecond))
	if n := e.count("SELECT count(*) FROM accounts"); n != 1 {
		t.Errorf("accounts: %d rows, want 1 (failed attempts roll back)", n)
	}
	if n := e.count("SELECT count(*) FROM walbox.processed_events"); n != 1 {
		t.Errorf("processed_events: %d rows, want 1", n)
	}
	e.waitSettled("accounts")
}

func TestPermanentErrorDeadLetters(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	var runs atomic.Int64
	h := counted(&runs, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		if _, err := tx.Exec(ctx, "INSERT INTO accounts (user_id, event_id) VALUES ('x', $1)", msg.ID); err != nil {
			return err
		}
		return consumer.Permanent(fmt.Errorf("user %s: email is not valid", msg.AggregateID))
	})
	e.publish("user.created", "evt-bad", `{"user_id": "u-1"}`, map[string]string{"traceparent": traceparent, "Walbox-Aggregate-Id": "u-1"})
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "accounts", DB: e.db, OnOutcome: out.record}, h)
	out.waitFor(t, "dead-lettered", func() bool { return out.count(consumer.DeadLettered) == 1 })

	dl := e.deadLetters(1)[0]
	t.Logf("dead letter on %s: %v", dl.Subject(), dl.Headers())
	if dl.Subject() != "walbox.dlq.consumer.accounts" || string(dl.Data()) != `{"user_id": "u-1"}` {
		t.Errorf("dead letter %s %s", dl.Subject(), dl.Data())
	}
	h2 := dl.Headers()
	for k, want := range map[string]string{
		consumer.HeaderError:            "user u-1: email is not valid",
		consumer.HeaderGroup:            "accounts",
		consumer.HeaderAttempts:         "1",
		consumer.HeaderEventID:          "evt-bad",
		consumer.HeaderOriginalSubject:  "user.created",
		consumer.HeaderOriginalStream:   "USERS",
		consumer.HeaderOriginalSequence: "1",
		"Nats-Msg-Id":                   "consumer.accounts.evt-bad",
		"traceparent":                   traceparent,
		"Walbox-Event-Type":             "user.created",
	} {
		if got := h2.Get(k); got != want {
			t.Errorf("dead letter header %s = %q, want %q", k, got, want)
		}
	}
	if runs.Load() != 1 {
		t.Errorf("handler ran %d times, want 1", runs.Load())
	}
	if n := e.count("SELECT count(*) FROM accounts") + e.count("SELECT count(*) FROM walbox.processed_events"); n != 0 {
		t.Errorf("a dead-lettered event left %d rows", n)
	}
	e.waitSettled("accounts") // terminated: not redelivered
}

func TestMaxDeliverDeadLetters(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	var runs atomic.Int64
	h := counted(&runs, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		return errors.New("partner API timed out")
	})
	e.publish("user.created", "evt-flaky", `{"user_id": "u-1"}`, nil)
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "accounts", DB: e.db, OnOutcome: out.record,
		MaxDeliver: 3, Backoff: []time.Duration{10 * time.Millisecond}}, h)
	out.waitFor(t, "dead-lettered", func() bool { return out.count(consumer.DeadLettered) == 1 })
	var got []string
	for _, r := range out.snapshot() {
		got = append(got, fmt.Sprintf("%d:%s", r.msg.Attempt, r.outcome))
	}
	if strings.Join(got, " ") != "1:retrying 2:retrying 3:dead-lettered" || runs.Load() != 3 {
		t.Errorf("deliveries %v, handler runs %d", got, runs.Load())
	}
	dl := e.deadLetters(1)[0]
	if dl.Headers().Get(consumer.HeaderError) != "partner API timed out" || dl.Headers().Get(consumer.HeaderAttempts) != "3" ||
		!strings.Contains(dl.Headers().Get(consumer.HeaderDLQReason), "3 of at most 3") {
		t.Errorf("dead letter headers %v", dl.Headers())
	}
	e.waitSettled("accounts")
}

// A message without an event id cannot be deduplicated; a panicking handler
// is an error like any other.
func TestUnprocessableMessages(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	var runs atomic.Int64
	h := counted(&runs, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		panic("nil map")
	})
	e.publish("user.created", "", `{}`, nil)
	e.publish("user.created", "evt-panic", `{}`, nil)
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "accounts", DB: e.db, OnOutcome: out.record, MaxDeliver: 1}, h)
	out.waitFor(t, "2 dead letters", func() bool { return out.count(consumer.DeadLettered) == 2 })
	dls := e.deadLetters(2)
	if !strings.Contains(dls[0].Headers().Get(consumer.HeaderError), "no Nats-Msg-Id") {
		t.Errorf("first dead letter: %v", dls[0].Headers())
	}
	if !strings.Contains(dls[1].Headers().Get(consumer.HeaderError), "handler panicked: nil map") {
		t.Errorf("second dead letter: %v", dls[1].Headers())
	}
	if runs.Load() != 1 {
		t.Errorf("handler ran %d times, want 1", runs.Load())
	}
}

func TestRunChecksItsPrerequisites(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	ctx := relaytest.Ctx(t)
	h := func(context.Context, pgx.Tx, consumer.Message) error { return nil }
	bare := pg.NewDB(t)
	bareDB, err := pgx.Connect(ctx, bare)
	if err != nil {
		t.Fatal(err)
	}
	defer bareDB.Close(context.Background())
	for name, tc := range map[string]struct {
		cfg  consumer.Config
		want string
	}{
		"no stream":           {consumer.Config{Stream: "NOPE", Durable: "a", DB: e.db}, "stream NOPE"},
		"no dead-letter":      {consumer.Config{Stream: "USERS", Durable: "a", DB: e.db, DeadLetterSubject: "nowhere.dlq"}, "no stream captures the dead-letter subject nowhere.dlq"},
		"bad durable":         {consumer.Config{Stream: "USERS", Durable: "a.b", DB: e.db}, "Durable"},
		"no database":         {consumer.Config{Stream: "USERS", Durable: "a"}, "Config.DB"},
		"wildcard dlq":        {consumer.Config{Stream: "USERS", Durable: "a", DB: e.db, DeadLetterSubject: "walbox.dlq.>"}, "plain subject"},
		"negative max":        {consumer.Config{Stream: "USERS", Durable: "a", DB: e.db, MaxDeliver: -1}, "MaxDeliver"},
		"negative backoff":    {consumer.Config{Stream: "USERS", Durable: "a", DB: e.db, Backoff: []time.Duration{-1}}, "Backoff"},
		"missing idempotency": {consumer.Config{Stream: "USERS", Durable: "a", DB: relaytest.Pool(t, bare)}, "consumer.Migrate"},
	} {
		err := consumer.Run(ctx, e.js, tc.cfg, h)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Run = %v, want an error about %q", name, err, tc.want)
		}
	}
	// A cancelled context is a clean stop.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := consumer.Run(cctx, e.js, consumer.Config{Stream: "USERS", Durable: "a", DB: e.db}, h); err != nil {
		t.Errorf("Run with a cancelled context: %v", err)
	}
}

// TestMigrateMatchesWalbox: consumer.Migrate creates the same
// walbox.processed_events as `walbox migrate`, and both can run in any
// order, again and again.
func TestMigrateMatchesWalbox(t *testing.T) {
	ctx := relaytest.Ctx(t)
	describe := func(url string) string {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		var s string
		err = conn.QueryRow(ctx, `SELECT string_agg(column_name || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, ''), ', ' ORDER BY ordinal_position)
			|| ' / ' || (SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = 'walbox.processed_events'::regclass AND contype = 'p')
			FROM information_schema.columns WHERE table_schema = 'walbox' AND table_name = 'processed_events'`).Scan(&s)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	viaWalbox, viaConsumer := pg.NewDB(t), pg.NewDB(t)
	conn, err := pgx.Connect(ctx, viaWalbox)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{}); err != nil {
		t.Fatal(err)
	}
	if err := consumer.Migrate(ctx, conn); err != nil { // after walbox migrate: a no-op
		t.Fatal(err)
	}
	pool := relaytest.Pool(t, viaConsumer)
	var wg sync.WaitGroup
	for range 3 { // concurrent starts
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := consumer.Migrate(ctx, pool); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	a, b := describe(viaWalbox), describe(viaConsumer)
	t.Logf("walbox.processed_events: %s", a)
	if a != b {
		t.Errorf("walbox migrate: %s\nconsumer.Migrate: %s", a, b)
	}
}

// Retention prunes the group's old idempotency records, and only its own
// and only the old ones.
func TestRetentionPrunesOldIdempotencyRecords(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	ctx := relaytest.Ctx(t)
	if _, err := e.db.Exec(ctx, `INSERT INTO walbox.processed_events (consumer_group, event_id, processed_at)
		SELECT g, 'old-' || n, now() - interval '3 hours' FROM unnest(ARRAY['accounts', 'billing']) g, generate_series(1, 20005) n`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(ctx, `INSERT INTO walbox.processed_events (consumer_group, event_id) VALUES ('accounts', 'recent')`); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	stop := e.start(consumer.Config{Stream: "USERS", Durable: "accounts", DB: e.db, Retention: time.Hour}, accounts(&runs))
	defer stop()
	relaytest.Eventually(t, 30*time.Second, "the group's old records pruned", func() bool {
		return e.count("SELECT count(*) FROM walbox.processed_events WHERE consumer_group = 'accounts' AND event_id LIKE 'old-%'") == 0
	})
	if n := e.count("SELECT count(*) FROM walbox.processed_events WHERE consumer_group = 'accounts' AND event_id = 'recent'"); n != 1 {
		t.Fatal("a recent record was pruned")
	}
	if n := e.count("SELECT count(*) FROM walbox.processed_events WHERE consumer_group = 'billing'"); n != 20005 {
		t.Fatalf("another group's records: %d left, want 20005", n)
	}
}
