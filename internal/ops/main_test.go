package ops

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"sync"
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
	walboxsql "github.com/walbox/walbox/sql"
)

var pg *pgtest.Cluster // one cluster for the package, set by TestMain

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, &pg)) }

// env is one test's world: a fresh migrated database, a JetStream server and
// a config pointing at both.
type env struct {
	t     *testing.T
	dbURL string
	nats  *natstest.Server
	nc    *nats.Conn
	js    jetstream.JetStream
	cfg   config.Config
	// logLevel of the in-process relay (info unless a test says).
	logLevel zerolog.Level
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func newEnv(t *testing.T, mutate ...func(*config.Config)) *env {
	t.Helper()
	return newEnvWithNATS(t, nil, mutate...)
}

// newEnvWithNATS is newEnv with options for the NATS server (e.g. auth).
func newEnvWithNATS(t *testing.T, natsOpts []natstest.Option, mutate ...func(*config.Config)) *env {
	t.Helper()
	e := &env{t: t, dbURL: pg.NewDB(t), logLevel: zerolog.InfoLevel}
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
	ctx := testCtx(t)
	conn, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// The tests' connections go to e.dbURL; the config's URL may carry a
	// password (trust authentication ignores it).
	if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{Publication: cfg.Postgres.Publication}); err != nil {
		t.Fatal(err)
	}
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

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	// Not the test's context: cleanups run after it is cancelled.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

// insert commits one outbox row and returns its id.
func (e *env) insert(topic, payload string) string {
	e.t.Helper()
	ctx := testCtx(e.t)
	conn, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(ctx)
	var id string
	if err := conn.QueryRow(ctx, `INSERT INTO outbox_events (topic, payload) VALUES ($1, $2) RETURNING id::text`, topic, payload).Scan(&id); err != nil {
		e.t.Fatal(err)
	}
	return id
}

// relayRun is a relay running in-process.
type relayRun struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	log    *syncBuffer
}

// syncBuffer is a bytes.Buffer safe for the relay's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startRelay runs app.Run until the test ends (or stop is called); its log
// (info level, JSON) is kept in the returned run's log.
func (e *env) startRelay() *relayRun {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &relayRun{cancel: cancel, done: make(chan error, 1), log: &syncBuffer{}}
	ready := make(chan struct{})
	log := zerolog.New(r.log).Level(e.logLevel)
	go func() { r.done <- app.Run(ctx, e.cfg, log, app.Options{Ready: ready}) }()
	select {
	case <-ready:
	case err := <-r.done:
		e.t.Fatalf("relay exited at start: %v\n%s", err, r.log.String())
	case <-time.After(45 * time.Second):
		e.t.Fatalf("relay did not start within 45s\n%s", r.log.String())
	}
	e.t.Cleanup(func() { r.stop(e.t) })
	return r
}

func (r *relayRun) stop(t *testing.T) {
	r.once.Do(func() {
		r.cancel()
		select {
		case err := <-r.done:
			if err != nil {
				t.Errorf("relay: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop within 30s")
		}
	})
}

// waitMsgs waits until stream holds n messages.
func (e *env) waitMsgs(stream string, n uint64) {
	e.t.Helper()
	js := e.connectJS()
	ctx := testCtx(e.t)
	var last uint64
	for ctx.Err() == nil {
		if st, err := js.Stream(ctx, stream); err == nil {
			if last = st.CachedInfo().State.Msgs; last >= n {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	e.t.Fatalf("stream %s holds %d messages, want %d", stream, last, n)
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
