package outboxlibtest

// The small harness these tests need: one PostgreSQL cluster for the
// package, a fresh database per test, an embedded JetStream and the relay
// in-process, all from internal/relaytest.

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
)

var pg *pgtest.Cluster // set once by TestMain

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, &pg)) }

// env is one test's world: a fresh database with walbox's migrations.
type env struct {
	t     *testing.T
	dbURL string
	pool  *pgxpool.Pool
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, dbURL: pg.NewDB(t)}
	e.pool = relaytest.MigratedPool(t, e.dbURL)
	return e
}

// begin starts a transaction on the pool.
func (e *env) begin(ctx context.Context) pgx.Tx {
	e.t.Helper()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		e.t.Fatalf("begin: %v", err)
	}
	return tx
}

// relayed adds JetStream and a running relay to an env.
type relayed struct {
	*env
	js jetstream.JetStream
}

func newRelayed(t *testing.T) *relayed {
	t.Helper()
	e := newEnv(t)
	srv := natstest.New(t)
	_, js := relaytest.JetStream(t, srv.URL())
	relaytest.StartUsersRelay(t, e.dbURL, srv.URL(), func(cfg *config.Config) {
		cfg.Postgres.StatusInterval = time.Second
		cfg.Log.Format = "json"
	})
	return &relayed{env: e, js: js}
}

// collectN reads n messages of subject from stream USERS.
func (r *relayed) collectN(subject string, n int) []jetstream.Msg {
	r.t.Helper()
	return relaytest.CollectN(r.t, r.js, "USERS", only(subject), 30*time.Second, n)
}

// collectUntilID reads the messages of subject up to the one with event id.
func (r *relayed) collectUntilID(subject, id string) []jetstream.Msg {
	r.t.Helper()
	return relaytest.Collect(r.t, r.js, "USERS", only(subject), 30*time.Second, func(m jetstream.Msg) bool { return m.Headers().Get("Nats-Msg-Id") == id })
}

func only(subject string) jetstream.OrderedConsumerConfig {
	return jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}}
}
