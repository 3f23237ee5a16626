package consumerlibtest

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
)

var pg *pgtest.Cluster // set once by TestMain

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, &pg)) }

// env: the consumer's own database (idempotency table and an accounts
// table) and a JetStream server with stream USERS and walbox's dead-letter
// stream.
type env struct {
	t    *testing.T
	url  string
	db   *pgxpool.Pool
	nc   *nats.Conn
	js   jetstream.JetStream
	dlqs jetstream.Stream
}

func newEnv(t *testing.T, users jetstream.StreamConfig) *env {
	t.Helper()
	ctx := relaytest.Ctx(t)
	e := &env{t: t, url: pg.NewDB(t)}
	e.db = relaytest.Pool(t, e.url)
	if err := consumer.Migrate(ctx, e.db); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(ctx, `CREATE TABLE accounts (id bigserial PRIMARY KEY, user_id text NOT NULL, event_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	e.nc, e.js = relaytest.JetStream(t, natstest.New(t).URL())
	if users.Name == "" {
		users = jetstream.StreamConfig{Name: "USERS", Subjects: []string{"user.>"}}
	}
	if _, err := e.js.CreateStream(ctx, users); err != nil {
		t.Fatal(err)
	}
	var err error
	e.dlqs, err = e.js.CreateStream(ctx, jetstream.StreamConfig{Name: "WALBOX_DLQ", Subjects: []string{"walbox.dlq.>"}})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// publish stores one event as walbox would publish it.
func (e *env) publish(subject, id, data string, extra map[string]string) *jetstream.PubAck {
	e.t.Helper()
	m := nats.NewMsg(subject)
	m.Data = []byte(data)
	if id != "" {
		m.Header.Set("Nats-Msg-Id", id)
	}
	m.Header.Set("Walbox-Event-Type", "user.created")
	m.Header.Set("Walbox-Aggregate-Type", "user")
	for k, v := range extra {
		m.Header[k] = []string{v}
	}
	ack, err := e.js.PublishMsg(relaytest.Ctx(e.t), m)
	if err != nil {
		e.t.Fatal(err)
	}
	return ack
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.db.QueryRow(relaytest.Ctx(e.t), query, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", query, err)
	}
	return n
}

// outcomes collects what Run reports, for waiting on it.
type outcomes struct {
	mu  sync.Mutex
	all []result
}

type result struct {
	msg     consumer.Message
	outcome consumer.Outcome
	err     error
}

func newOutcomes() *outcomes { return &outcomes{} }

func (o *outcomes) record(m consumer.Message, out consumer.Outcome, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.all = append(o.all, result{m, out, err})
}

func (o *outcomes) count(out consumer.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, r := range o.all {
		if r.outcome == out {
			n++
		}
	}
	return n
}

func (o *outcomes) total() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.all)
}

func (o *outcomes) snapshot() []result {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]result(nil), o.all...)
}

// waitFor waits until cond holds, 30 s at most.
func (o *outcomes) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	relaytest.Eventually(t, 30*time.Second, what, cond)
}

// start runs consumer.Run until the test ends (or stop is called) and
// checks it returned nil.
func (e *env) start(cfg consumer.Config, h consumer.Handler) (stop func()) {
	e.t.Helper()
	return e.startWith(e.js, cfg, h)
}

// startWith is start with another JetStream, such as an ackLoser's.
func (e *env) startWith(js jetstream.JetStream, cfg consumer.Config, h consumer.Handler) (stop func()) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- consumer.Run(ctx, js, cfg, h) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					e.t.Errorf("Run: %v", err)
				}
			case <-time.After(30 * time.Second):
				e.t.Error("Run did not return within 30s of cancel")
			}
		})
	}
	e.t.Cleanup(stop)
	return stop
}

// deadLetters reads the first n messages of the dead-letter stream.
func (e *env) deadLetters(n int) []jetstream.Msg {
	e.t.Helper()
	return relaytest.CollectN(e.t, e.js, "WALBOX_DLQ", jetstream.OrderedConsumerConfig{}, 30*time.Second, n)
}
