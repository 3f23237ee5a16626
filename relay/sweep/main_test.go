package sweep_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/sweep"
	walboxsql "github.com/walbox/walbox/sql"
)

var pg *pgtest.Cluster

func TestMain(m *testing.M) {
	// Commits flushed at once: a pgoutput peek right after a commit must
	// see it (tests that prove something is *not* published rely on it).
	os.Exit(pgtest.Main(m, &pg, pgtest.WithSetting("synchronous_commit", "on")))
}

// db is one test's database with walbox's migrations applied.
type db struct {
	t    *testing.T
	url  string
	pool *pgxpool.Pool
}

func newDB(t *testing.T, migrate bool) *db {
	t.Helper()
	ctx := context.Background()
	d := &db{t: t, url: pg.NewDB(t)}
	if migrate {
		conn, err := pgx.Connect(ctx, d.url)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{}); err != nil {
			t.Fatal(err)
		}
		conn.Close(ctx)
	}
	pool, err := pgxpool.New(ctx, d.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	d.pool = pool
	return d
}

func (d *db) exec(sql string, args ...any) {
	d.t.Helper()
	if _, err := d.pool.Exec(context.Background(), sql, args...); err != nil {
		d.t.Fatalf("%s: %v", sql, err)
	}
}

func (d *db) int(sql string, args ...any) int64 {
	d.t.Helper()
	var n int64
	if err := d.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		d.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func (d *db) bool(sql string, args ...any) bool {
	d.t.Helper()
	var b bool
	if err := d.pool.QueryRow(context.Background(), sql, args...).Scan(&b); err != nil {
		d.t.Fatalf("%s: %v", sql, err)
	}
	return b
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func testLogger(t *testing.T) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
}

// newSweeper builds a sweeper on d for the default table.
func (d *db) sweeper(mutate ...func(*sweep.Config)) *sweep.Sweeper {
	d.t.Helper()
	cfg := sweep.Config{
		ConnString:     d.url,
		Table:          cdc.TableName{Schema: "public", Name: "outbox_events"},
		Columns:        cdc.DefaultColumns(),
		MarkProcessed:  true,
		Interval:       20 * time.Millisecond,
		BackoffInitial: 50 * time.Millisecond,
		BackoffMax:     500 * time.Millisecond,
		Logger:         testLogger(d.t),
		Registry:       prometheus.NewRegistry(),
	}
	for _, f := range mutate {
		f(&cfg)
	}
	sw, err := sweep.New(cfg)
	if err != nil {
		d.t.Fatal(err)
	}
	d.t.Cleanup(sw.Close)
	return sw
}

// relayEnv runs the whole relay in-process (app.Run, so the sweeper is
// wired as in production) against d and an embedded JetStream.
type relayEnv struct {
	*db
	cfg       config.Config
	nats      *natstest.Server
	js        jetstream.JetStream
	reg       *prometheus.Registry
	delivered chan relay.Delivered
	cancel    context.CancelFunc
	done      chan error
}

func newRelayEnv(t *testing.T, d *db, mutate ...func(*config.Config)) *relayEnv {
	t.Helper()
	e := &relayEnv{db: d, nats: natstest.New(t), delivered: make(chan relay.Delivered, 1<<20)}
	cfg := config.Default()
	cfg.Postgres.URL = d.url
	cfg.Postgres.StatusInterval = time.Second
	cfg.NATS.URL = e.nats.URL()
	cfg.NATS.Streams = []config.Stream{{Name: "ORDERS", Subjects: []string{"orders.>"}, DuplicateWindow: 2 * time.Minute}}
	cfg.Retry.Initial = 50 * time.Millisecond
	cfg.Retry.Max = 500 * time.Millisecond
	cfg.Metrics.Listen = ""
	cfg.Sweeper.Interval = 20 * time.Millisecond
	for _, f := range mutate {
		f(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	e.cfg = cfg
	nc, err := nats.Connect(e.nats.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	e.js, _ = jetstream.New(nc)
	return e
}

func (e *relayEnv) start() {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	e.cancel, e.done = cancel, make(chan error, 1)
	e.reg = prometheus.NewRegistry()
	ready := make(chan struct{})
	go func() {
		e.done <- app.Run(ctx, e.cfg, testLogger(e.t), app.Options{Registry: e.reg, Ready: ready,
			OnDelivered: func(d relay.Delivered) {
				select {
				case e.delivered <- d:
				default:
				}
			}})
	}()
	select {
	case <-ready:
	case err := <-e.done:
		e.t.Fatalf("relay exited at start: %v", err)
	case <-time.After(30 * time.Second):
		e.t.Fatal("relay did not start within 30s")
	}
	e.t.Cleanup(e.stop)
}

func (e *relayEnv) stop() {
	if e.cancel == nil {
		return
	}
	e.cancel()
	select {
	case err := <-e.done:
		if err != nil {
			e.t.Errorf("relay: %v", err)
		}
	case <-time.After(30 * time.Second):
		e.t.Error("relay did not stop within 30s")
	}
	e.cancel = nil
}

// streamMsgs is the number of messages in stream name.
func (e *relayEnv) streamMsgs(name string) uint64 {
	st, err := e.js.Stream(context.Background(), name)
	if err != nil {
		return 0
	}
	info, err := st.Info(context.Background())
	if err != nil {
		return 0
	}
	return info.State.Msgs
}

// metric reads a counter or gauge from the relay's registry.
func metricValue(t *testing.T, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var sum float64
		for _, m := range mf.GetMetric() {
			if c := m.GetCounter(); c != nil {
				sum += c.GetValue()
			}
			if g := m.GetGauge(); g != nil {
				sum += g.GetValue()
			}
		}
		return sum
	}
	return 0
}
