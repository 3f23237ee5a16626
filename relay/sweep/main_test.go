package sweep_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
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
	d := &db{t: t, url: pg.NewDB(t)}
	if migrate {
		relaytest.Migrate(t, d.url, walboxsql.Params{})
	}
	d.pool = relaytest.Pool(t, d.url)
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
	return queryOne[int64](d, sql, args...)
}

func (d *db) bool(sql string, args ...any) bool { d.t.Helper(); return queryOne[bool](d, sql, args...) }

// queryOne is the one value sql returns.
func queryOne[T any](d *db, sql string, args ...any) T {
	d.t.Helper()
	var v T
	if err := d.pool.QueryRow(context.Background(), sql, args...).Scan(&v); err != nil {
		d.t.Fatalf("%s: %v", sql, err)
	}
	return v
}

func testLogger(t *testing.T) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
}

// sweeperOn builds a sweeper on d for table public.name, whose default
// columns lack the roles unmapped.
func (d *db) sweeperOn(name string, unmapped ...cdc.Role) *sweep.Sweeper {
	d.t.Helper()
	cols := cdc.DefaultColumns()
	for _, r := range unmapped {
		cols[r] = ""
	}
	return d.sweeper(func(c *sweep.Config) {
		c.Table = cdc.TableName{Schema: "public", Name: name}
		c.Columns = cols
	})
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
	reg       *prometheus.Registry // metrics of the last start
	delivered chan relay.Delivered
	run       *relaytest.Relay
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
	_, e.js = relaytest.JetStream(t, e.nats.URL())
	return e
}

func (e *relayEnv) start() {
	e.t.Helper()
	e.run = relaytest.StartRelay(e.t, e.cfg, relaytest.WithLog(testLogger(e.t)),
		relaytest.WithOnDelivered(func(d relay.Delivered) {
			select {
			case e.delivered <- d:
			default:
			}
		}))
	e.reg = e.run.Registry
}

// stop stops the relay started last, if it runs.
func (e *relayEnv) stop() {
	if e.run != nil {
		e.run.Stop(e.t)
	}
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
