package outboxlibtest

// The small harness these tests need: one PostgreSQL cluster for the
// package, a fresh database per test, an embedded JetStream and the relay
// in-process (copied in spirit from internal/e2e, which tests must not
// import).

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	walboxsql "github.com/walbox/walbox/sql"
)

var pg *pgtest.Cluster // set once by TestMain

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, &pg)) }

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// env is one test's world: a fresh database with walbox's migrations.
type env struct {
	t     *testing.T
	dbURL string
	pool  *pgxpool.Pool
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, dbURL: pg.NewDB(t)}
	ctx := testCtx(t)
	conn, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{}); err != nil {
		t.Fatalf("walbox migrations: %v", err)
	}
	e.pool, err = pgxpool.New(ctx, e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.pool.Close)
	return e
}

// relayed adds JetStream and a running relay to an env.
type relayed struct {
	*env
	js jetstream.JetStream
}

func newRelayed(t *testing.T) *relayed {
	t.Helper()
	e := newEnv(t)
	ctx := testCtx(t)
	srv := natstest.New(t)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	// Slot names are cluster-wide: name it after the test's database.
	var slot string
	if err := e.pool.QueryRow(ctx, "SELECT current_database()").Scan(&slot); err != nil {
		t.Fatal(err)
	}
	cfg := config.Default()
	cfg.Postgres.URL = e.dbURL
	cfg.Postgres.Slot = slot
	cfg.Postgres.StatusInterval = time.Second
	cfg.NATS.URL = srv.URL()
	cfg.NATS.Streams = []config.Stream{{Name: "USERS", Subjects: []string{"user.>"}, DuplicateWindow: 2 * time.Minute}}
	cfg.Retry.Initial = 100 * time.Millisecond
	cfg.Retry.Max = time.Second
	cfg.Metrics.Listen = ""
	cfg.Log.Format = "json"
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	startRelay(t, cfg)
	return &relayed{env: e, js: js}
}

// startRelay runs the relay in-process until the test ends.
func startRelay(t *testing.T, cfg config.Config) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	done := make(chan error, 1)
	log := zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
	go func() { done <- app.Run(ctx, cfg, log, app.Options{Ready: ready}) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("relay: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop within 30s")
		}
	})
	select {
	case <-ready:
	case err := <-done:
		done <- err
		t.Fatalf("relay exited at start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("relay did not start replicating within 30s")
	}
}

// collect reads the messages of one subject from stream USERS until stop
// returns true for one of them (which is included) or 30 s pass.
func (r *relayed) collect(subject string, stop func(jetstream.Msg) bool) []jetstream.Msg {
	r.t.Helper()
	ctx := testCtx(r.t)
	cons, err := r.js.OrderedConsumer(ctx, "USERS", jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}})
	if err != nil {
		r.t.Fatal(err)
	}
	var out []jetstream.Msg
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		m, err := cons.Next(jetstream.FetchMaxWait(time.Second))
		if err != nil {
			continue
		}
		out = append(out, m)
		if stop(m) {
			return out
		}
	}
	r.t.Fatalf("subject %s: stop condition not met within 30s (%d messages read)", subject, len(out))
	return nil
}

// collectN reads n messages of subject.
func (r *relayed) collectN(subject string, n int) []jetstream.Msg {
	r.t.Helper()
	count := 0
	return r.collect(subject, func(jetstream.Msg) bool { count++; return count == n })
}

// collectUntilID reads the messages of subject up to the one with event id.
func (r *relayed) collectUntilID(subject, id string) []jetstream.Msg {
	r.t.Helper()
	return r.collect(subject, func(m jetstream.Msg) bool { return m.Headers().Get("Nats-Msg-Id") == id })
}
