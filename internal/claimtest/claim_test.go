package claimtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	walboxsql "github.com/walbox/walbox/sql"
)

var pg *pgtest.Cluster // set once by TestMain

func TestMain(m *testing.M) {
	if path := os.Getenv(relayEnv); path != "" {
		os.Exit(runRelay(path))
	}
	os.Exit(pgtest.Main(m, &pg))
}

const MiB = 1 << 20

// env is a migrated database, a nats-server and the relay's config with
// the claim check on (stream USERS for user.>, bucket USERS_CLAIMS).
type env struct {
	t    *testing.T
	ctx  context.Context
	url  string
	nats *natstest.Server
	cfg  config.Config
	js   jetstream.JetStream
	// ids in insert order, and each row's payload as PostgreSQL outputs it.
	ids      []string
	payloads map[string]string
}

func newEnv(t *testing.T, mutate ...func(*config.Config)) *env {
	t.Helper()
	e := &env{t: t, ctx: relaytest.Ctx(t), url: pg.NewDB(t), nats: natstest.New(t), payloads: map[string]string{}}
	relaytest.Migrate(t, e.url, walboxsql.Params{})
	e.cfg = relaytest.UsersConfig(t, e.url, e.nats.URL())
	e.cfg.ClaimCheck.Enabled = true
	for _, f := range mutate {
		f(&e.cfg)
	}
	if err := e.cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	_, e.js = relaytest.JetStream(t, e.nats.URL())
	return e
}

// insert commits one event with a payload of about size bytes and returns
// its id.
func (e *env) insert(size int) string {
	e.t.Helper()
	return e.insertKeyed(size, "")
}

// insertKeyed is insert with key as the event's aggregate id, its
// partition key ("": none).
func (e *env) insertKeyed(size int, key string) string {
	e.t.Helper()
	n := len(e.ids)
	// Varied bytes, so that a payload mixed up with another shows.
	blob := strings.Repeat(fmt.Sprintf("%07d-", n), max(size/8, 1))
	var id, text string
	relaytest.WithConn(e.t, e.url, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `INSERT INTO outbox_events (topic, aggregate_id, payload) VALUES ('user.created', nullif($3, ''), jsonb_build_object('n', $1::int, 'blob', $2::text)) RETURNING id::text, payload::text`,
			n, blob, key).Scan(&id, &text)
	})
	e.ids = append(e.ids, id)
	e.payloads[id] = text
	return id
}

// stored reads USERS back and checks that it holds every inserted event
// once, in insert order; it returns the messages.
func (e *env) stored(timeout time.Duration) []jetstream.Msg {
	e.t.Helper()
	msgs := relaytest.CollectN(e.t, e.js, "USERS", jetstream.OrderedConsumerConfig{}, timeout, len(e.ids))
	var got []string
	for _, m := range msgs {
		got = append(got, m.Headers().Get("Nats-Msg-Id"))
	}
	if strings.Join(got, ",") != strings.Join(e.ids, ",") {
		e.t.Fatalf("USERS holds %d events %v,\nwant once each in insert order %v", len(got), got, e.ids)
	}
	return msgs
}

// consume runs the consumer library over USERS until it has settled n
// events, and returns the payload its handler saw per event id and the
// outcome's error per dead-lettered event id.
func (e *env) consume(n int) (data map[string]string, deadLettered map[string]error) {
	e.t.Helper()
	pool := relaytest.Pool(e.t, e.url)
	if err := consumer.Migrate(e.ctx, pool); err != nil {
		e.t.Fatal(err)
	}
	var mu sync.Mutex
	data, deadLettered = map[string]string{}, map[string]error{}
	settled := 0
	// Its own context: e.ctx's 60 s run from the env's start, and a 64
	// MiB event's relaying may have used most of them.
	ctx, cancel := context.WithCancel(e.t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- consumer.Run(ctx, e.js, consumer.Config{Stream: "USERS", Durable: "claims", DB: pool, MaxDeliver: 1,
			OnOutcome: func(m consumer.Message, o consumer.Outcome, err error) {
				mu.Lock()
				defer mu.Unlock()
				settled++
				if o == consumer.DeadLettered {
					deadLettered[m.ID] = err
				}
			}},
			func(_ context.Context, _ pgx.Tx, m consumer.Message) error {
				mu.Lock()
				defer mu.Unlock()
				data[m.ID] = string(m.Data)
				return nil
			})
	}()
	// Progress is an event settled or a claim-check object's chunk
	// delivered to the consumer's download: a 64 MiB download is CPU (7 s
	// under -race on an idle 2-core machine), so what fails the wait is
	// a stall, not the machine's speed.
	settledCount := func() int {
		mu.Lock()
		defer mu.Unlock()
		return settled
	}
	relaytest.WhileProgressing(e.t, 30*time.Second, fmt.Sprintf("the consumer to settle %d events", n), func() bool { return settledCount() >= n },
		func() string {
			return fmt.Sprintf("%d settled, claim objects' chunks delivered: %s", settledCount(), e.objDelivered(ctx))
		})
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		e.t.Fatalf("consumer: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	return data, deadLettered
}

// objDelivered describes how far the consumers of the claim-check bucket's
// stream (each object download is one) have got: their delivered stream
// sequences, or the error reading them.
func (e *env) objDelivered(ctx context.Context) string {
	st, err := e.js.Stream(ctx, "OBJ_USERS_CLAIMS")
	if err != nil {
		return err.Error()
	}
	var seqs []string
	l := st.ListConsumers(ctx)
	for ci := range l.Info() {
		seqs = append(seqs, fmt.Sprint(ci.Delivered.Stream))
	}
	if err := l.Err(); err != nil {
		return err.Error()
	}
	return "[" + strings.Join(seqs, " ") + "]"
}

// wantHandledAsRows runs the consumer library over every event inserted
// and checks that none is dead-lettered and each handler got its row's
// payload byte for byte.
func (e *env) wantHandledAsRows() {
	e.t.Helper()
	data, dead := e.consume(len(e.ids))
	if len(dead) > 0 {
		e.t.Fatalf("the consumer dead-lettered %v", dead)
	}
	for _, id := range e.ids {
		if data[id] != e.payloads[id] {
			e.t.Errorf("event %s: the handler got %d bytes, want its row's %d bytes byte for byte", id, len(data[id]), len(e.payloads[id]))
		}
	}
}

// TestLargeEventsArriveOnceInOrderAcrossRestarts: events of 0.5, 1.5 and 8
// MiB between small ones, through a relay stopped while large events are in
// flight and a NATS restart, arrive once each, in commit order; the large
// ones as a reference with an empty body, and the consumer library hands
// every handler the payload byte for byte as its row holds it.
func TestLargeEventsArriveOnceInOrderAcrossRestarts(t *testing.T) {
	e := newEnv(t)
	r := relaytest.StartRelay(t, e.cfg)
	for _, size := range []int{100, MiB / 2, 100, 3 * MiB / 2, 100, 8 * MiB, 100} {
		e.insert(size)
	}
	// Stopped with the large events in flight (or uploading), then more
	// written while it is down.
	relaytest.Eventually(t, 30*time.Second, "the first event", func() bool {
		info, err := e.js.Stream(e.ctx, "USERS")
		return err == nil && info.CachedInfo().State.Msgs >= 1
	})
	r.Stop(t)
	for _, size := range []int{3 * MiB / 2, 100} {
		e.insert(size)
	}
	relaytest.StartRelay(t, e.cfg)
	e.stored(60 * time.Second)

	// NATS restarts: the bucket and the stream come back from disk.
	if err := e.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	for _, size := range []int{8 * MiB, 100} {
		e.insert(size)
	}
	msgs := e.stored(60 * time.Second)

	claimed := 0
	for _, m := range msgs {
		id, ref := m.Headers().Get("Nats-Msg-Id"), m.Headers().Get(consumer.HeaderClaimCheck)
		large := len(e.payloads[id]) > MiB
		switch {
		case large && (ref == "" || len(m.Data()) != 0):
			t.Errorf("event %s of %d bytes: reference %q and %d bytes of body, want a reference and an empty body", id, len(e.payloads[id]), ref, len(m.Data()))
		case !large && ref != "":
			t.Errorf("event %s of %d bytes went by reference %q", id, len(e.payloads[id]), ref)
		case !large && string(m.Data()) != e.payloads[id]:
			t.Errorf("event %s: body differs from its row", id)
		}
		if ref != "" {
			claimed++
		}
	}
	if claimed != 4 {
		t.Errorf("%d events went by reference, want 4 (1.5 MiB twice, 8 MiB twice)", claimed)
	}

	e.wantHandledAsRows()
}

// TestClaimCheckBadCases: with the claim check on, an event above NATS's
// max_payload is not dead-lettered for its size; one larger than the
// bucket's max_bytes is, with the store's reason, and the others flow past
// it in order. A consumer meeting a reference whose object is gone
// dead-letters it with an error naming the event and the key.
func TestClaimCheckBadCases(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.ClaimCheck.MaxBytes = 4 * MiB })
	r := relaytest.StartRelay(t, e.cfg)
	small1 := e.insert(100)
	large := e.insert(3 * MiB / 2)
	tooLarge := e.insert(8 * MiB)
	small2 := e.insert(100)
	e.ids = []string{small1, large, small2} // what USERS must hold
	e.stored(60 * time.Second)

	dlq, err := e.js.Stream(e.ctx, "WALBOX_DLQ")
	if err != nil {
		t.Fatal(err)
	}
	var dl *jetstream.RawStreamMsg
	relaytest.Eventually(t, 10*time.Second, "the dead letter", func() bool {
		dl, err = dlq.GetMsg(e.ctx, 1)
		return err == nil
	})
	if id, reason := dl.Header.Get("Nats-Msg-Id"), dl.Header.Get("Walbox-Dlq-Reason"); id != tooLarge || !strings.Contains(reason, "max_bytes") {
		t.Fatalf("dead letter %s with reason %q, want %s with the bucket's max_bytes", id, reason, tooLarge)
	}
	// Counted when the relay takes the dead letter's ack, a moment after
	// the stream stored it.
	relaytest.Eventually(t, 10*time.Second, "the dead letter counted", func() bool {
		return relaytest.Metric(t, r.Registry, "walbox_dead_lettered_total", nil) >= 1
	})
	if n := relaytest.Metric(t, r.Registry, "walbox_dead_lettered_total", nil); n != 1 {
		t.Fatalf("walbox_dead_lettered_total = %v, want 1 (too large for NATS is not dead-lettered with the claim check on)", n)
	}

	// The object of the 1.5 MiB event goes missing.
	obs, err := e.js.ObjectStore(e.ctx, "USERS_CLAIMS")
	if err != nil {
		t.Fatal(err)
	}
	infos, err := obs.List(e.ctx)
	if err != nil || len(infos) != 1 {
		t.Fatalf("bucket holds %d objects (%v), want the 1.5 MiB event's", len(infos), err)
	}
	key := infos[0].Name
	if !strings.HasSuffix(key, "/public.outbox_events/"+large) {
		t.Fatalf("object key %q, want <source>/public.outbox_events/%s", key, large)
	}
	if err := obs.Delete(e.ctx, key); err != nil {
		t.Fatal(err)
	}
	data, dead := e.consume(3)
	cause := dead[large]
	if !errors.Is(cause, consumer.ErrClaimMissing) || !strings.Contains(cause.Error(), large) || !strings.Contains(cause.Error(), key) {
		t.Fatalf("consumer error %v, want ErrClaimMissing naming event %s and key %s", cause, large, key)
	}
	if data[small1] != e.payloads[small1] || data[small2] != e.payloads[small2] {
		t.Fatal("the small events did not reach the handler intact")
	}
}

// TestLargeEventsInAtomicTransactions: with nats.atomic_transactions on,
// the claim check's sink must still tell the relay where transactions end
// (relay.TxnSink): the JetStream sink holds an atomic batch until the relay
// says it may commit, so a decorator that hid the interface would hold
// every event forever. Small and large events arrive once, in order, the
// small ones in atomic batches.
func TestLargeEventsInAtomicTransactions(t *testing.T) {
	e := newEnv(t, func(c *config.Config) { c.NATS.AtomicTransactions = true })
	r := relaytest.StartRelay(t, e.cfg)
	for _, size := range []int{100, 3 * MiB / 2, 100, 100} {
		e.insert(size)
	}
	e.stored(30 * time.Second)
	if n := relaytest.Metric(t, r.Registry, "walbox_nats_atomic_messages_total", nil); n == 0 {
		t.Fatal("no event went in an atomic batch")
	}
}
