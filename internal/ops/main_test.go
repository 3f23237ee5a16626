package ops

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	walboxsql "github.com/walbox/walbox/sql"
)

var pg *pgtest.Cluster // one cluster for the package, set by TestMain

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, &pg)) }

// env is one test's world: a fresh migrated database, a JetStream server and
// a config pointing at both.
type env struct {
	t     *testing.T
	ctx   context.Context // the test's, bounded
	dbURL string
	nats  *natstest.Server
	nc    *nats.Conn
	js    jetstream.JetStream
	cfg   config.Config
	// logLevel of the in-process relay (info unless a test says).
	logLevel zerolog.Level
}

// testCtx is the test's bounded context.
func testCtx(t *testing.T) context.Context { return relaytest.Ctx(t) }

func newEnv(t *testing.T, mutate ...func(*config.Config)) *env {
	t.Helper()
	return newEnvWithNATS(t, nil, mutate...)
}

// newEnvWithNATS is newEnv with options for the NATS server (e.g. auth).
func newEnvWithNATS(t *testing.T, natsOpts []natstest.Option, mutate ...func(*config.Config)) *env {
	t.Helper()
	e := &env{t: t, ctx: testCtx(t), dbURL: pg.NewDB(t), logLevel: zerolog.InfoLevel}
	e.nats = natstest.New(t, natsOpts...)
	cfg := config.Default()
	cfg.Postgres.URL = e.dbURL
	cfg.Postgres.StatusInterval = time.Second
	cfg.NATS.URL = e.nats.URL()
	cfg.NATS.Streams = []config.Stream{
		{Name: "ORDERS", Subjects: []string{"orders.>"}},
		{Name: "PAYMENTS", Subjects: []string{"payments.>"}},
	}
	cfg.Retry.Initial = 100 * time.Millisecond
	cfg.Retry.Max = time.Second
	cfg.Metrics.Listen = ""
	cfg.Log.Format = "json"
	for _, f := range mutate {
		f(&cfg)
	}
	e.cfg = cfg
	// The tests' connections go to e.dbURL; the config's URL may carry a
	// password (trust authentication ignores it).
	relaytest.Migrate(t, e.dbURL, walboxsql.Params{Publication: cfg.Postgres.Publication})
	return e
}

// connectJS opens a client connection of the test's own, with the config's
// credentials.
func (e *env) connectJS() jetstream.JetStream {
	e.t.Helper()
	if e.js != nil {
		return e.js
	}
	opts, err := app.NATSOptions(e.cfg.NATS)
	if err != nil {
		e.t.Fatal(err)
	}
	nc, err := nats.Connect(e.cfg.NATS.URL, opts...)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(nc.Close)
	e.nc = nc
	e.js, err = jetstream.New(nc)
	if err != nil {
		e.t.Fatal(err)
	}
	return e.js
}

// exec runs sql on a connection of its own (cleanups may call it).
func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	relaytest.WithConn(e.t, e.dbURL, func(ctx context.Context, conn *pgx.Conn) error {
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			return fmt.Errorf("%s: %w", sql, err)
		}
		return nil
	})
}

// insert commits one outbox row and returns its id.
func (e *env) insert(topic, payload string) string {
	e.t.Helper()
	return e.insertID(`INSERT INTO outbox_events (topic, payload) VALUES ($1, $2) RETURNING id::text`, topic, payload)
}

// insertID commits one row with sql (an INSERT ... RETURNING id::text) on
// a connection of its own and returns the id.
func (e *env) insertID(sql string, args ...any) string {
	e.t.Helper()
	var id string
	relaytest.WithConn(e.t, e.dbURL, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, sql, args...).Scan(&id)
	})
	return id
}

// relayRun is a relay running in-process, its log kept.
type relayRun struct {
	*relaytest.Relay
	log *relaytest.Buffer
}

// startRelay runs app.Run until the test ends (or stop is called); its log
// (info level, JSON) is kept in the returned run's log.
func (e *env) startRelay() *relayRun {
	e.t.Helper()
	r := &relayRun{log: &relaytest.Buffer{}}
	r.Relay = relaytest.StartRelay(e.t, e.cfg, relaytest.WithLog(zerolog.New(r.log).Level(e.logLevel)),
		relaytest.WithStartTimeout(45*time.Second), relaytest.WithDump(r.log.String))
	e.t.Cleanup(func() {
		if e.t.Failed() { // what the relay did is the first thing a failure needs
			e.t.Logf("the relay's log:\n%s", r.log.String())
		}
	})
	return r
}

func (r *relayRun) stop(t *testing.T) { r.Stop(t) }

// waitMsgs waits until stream holds n messages.
func (e *env) waitMsgs(stream string, n uint64) {
	e.t.Helper()
	js := e.connectJS()
	ctx := testCtx(e.t)
	relaytest.Eventually(e.t, 60*time.Second, fmt.Sprintf("stream %s to hold %d messages", stream, n), func() bool {
		st, err := js.Stream(ctx, stream)
		return err == nil && st.CachedInfo().State.Msgs >= n
	})
}

// streamIDs returns the Nats-Msg-Id of every message of stream, in order.
func (e *env) streamIDs(stream string) []string {
	e.t.Helper()
	js := e.connectJS()
	ctx := testCtx(e.t)
	st, err := js.Stream(ctx, stream)
	if err != nil {
		e.t.Fatal(err)
	}
	info := st.CachedInfo()
	var ids []string
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			continue // deleted
		}
		ids = append(ids, m.Header.Get("Nats-Msg-Id"))
	}
	return ids
}

func mustContain(t *testing.T, what, s string, wants ...string) {
	t.Helper()
	for _, w := range wants {
		if !bytes.Contains([]byte(s), []byte(w)) {
			t.Errorf("%s does not contain %q:\n%s", what, w, s)
		}
	}
}

func uniqueName(t *testing.T, prefix string) string {
	return fmt.Sprintf("%s_%d", prefix, time.Now().UnixNano()%1_000_000_000)
}
