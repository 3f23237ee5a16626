// Package relaytest is the one kit walbox's tests share to run the relay
// in-process: a bounded test context, one polling helper, a migrated
// database, a JetStream client, the relay started through internal/app as
// `walbox run` starts it, and its metrics read back. Only _test.go files
// import it.
//
// It does not import internal/pgtest or internal/natstest, so their own
// tests may use it too.
package relaytest

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/syncbuf"
	"github.com/walbox/walbox/relay"
	walboxsql "github.com/walbox/walbox/sql"
)

// Ctx is the test's context, cancelled after 60 s or when the test ends.
// Cleanups run after it is cancelled: they need a context of their own.
func Ctx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// pollEvery is how often Eventually asks again.
const pollEvery = 25 * time.Millisecond

// Eventually polls cond until it holds and returns how long that took. It
// fails the test, naming what it waited for, once timeout has passed.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > timeout {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(pollEvery)
	}
	return time.Since(start)
}

// WhileProgressing polls cond until it holds and returns how long that
// took. It fails the test, naming what it waited for and the last
// progress, once progress has returned the same value for stall: the wait
// is bounded by a stall, not by a total, for work whose length is CPU (a
// 64 MiB download under the race detector on a loaded machine) and would
// otherwise make a total's bound a guess of the machine's speed. The test's
// own deadline still bounds it. progress is asked once every
// progressEvery, not at every poll of cond: it may cost requests to the
// servers doing the work it watches.
func WhileProgressing(t testing.TB, stall time.Duration, what string, cond func() bool, progress func() string) time.Duration {
	t.Helper()
	start := time.Now()
	last, since, asked := progress(), start, start
	for !cond() {
		if time.Since(asked) >= progressEvery {
			asked = time.Now()
			if p := progress(); p != last {
				last, since = p, asked
			} else if asked.Sub(since) > stall {
				t.Fatalf("waited %v for %s; no progress for the last %v (progress: %s)", time.Since(start).Round(time.Millisecond), what, stall, last)
			}
		}
		time.Sleep(pollEvery)
	}
	return time.Since(start)
}

// progressEvery is how often WhileProgressing asks for progress.
const progressEvery = time.Second

// Migrate applies walbox's migrations to the database at url.
func Migrate(t testing.TB, url string, p walboxsql.Params) {
	t.Helper()
	WithConn(t, url, func(ctx context.Context, conn *pgx.Conn) error {
		if _, err := walboxsql.Apply(ctx, conn, p); err != nil {
			return fmt.Errorf("apply walbox's migrations: %w", err)
		}
		return nil
	})
}

// Exec runs stmts in order on one connection to the database at url (so a
// SET holds for the statements after it).
func Exec(t testing.TB, url string, stmts ...string) {
	t.Helper()
	WithConn(t, url, func(ctx context.Context, conn *pgx.Conn) error {
		for _, q := range stmts {
			if _, err := conn.Exec(ctx, q); err != nil {
				return fmt.Errorf("%s: %w", q, err)
			}
		}
		return nil
	})
}

// WithConn runs fn on a connection of its own to the database at url,
// closed when fn returns; an error of fn fails the test. Its context is
// bounded (60 s) but not the test's, so a cleanup can use it too.
func WithConn(t testing.TB, url string, fn func(ctx context.Context, conn *pgx.Conn) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer conn.Close(context.Background())
	if err := fn(ctx, conn); err != nil {
		t.Fatal(err)
	}
}

// Conn opens a connection to the database at url, closed when the test
// ends.
func Conn(t testing.TB, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(Ctx(t), url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// Pool opens a pool on url, closed when the test ends.
func Pool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatalf("open a pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// MigratedPool migrates the database at url (default parameters) and opens
// a pool on it.
func MigratedPool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	Migrate(t, url, walboxsql.Params{})
	return Pool(t, url)
}

// JetStream connects to the NATS server at url and returns the connection
// (closed when the test ends) and its JetStream client.
func JetStream(t testing.TB, url string, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatalf("connect to NATS: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("JetStream client: %v", err)
	}
	return nc, js
}

// Collect reads stream through an ordered consumer made with cfg until stop
// returns true for a message (which is included), and returns what it read.
// It fails the test if that has not happened within timeout.
func Collect(t testing.TB, js jetstream.JetStream, stream string, cfg jetstream.OrderedConsumerConfig, timeout time.Duration, stop func(jetstream.Msg) bool) []jetstream.Msg {
	t.Helper()
	cons, err := js.OrderedConsumer(Ctx(t), stream, cfg)
	if err != nil {
		t.Fatalf("ordered consumer on %s: %v", stream, err)
	}
	var out []jetstream.Msg
	deadline := time.Now().Add(timeout)
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
	t.Fatalf("stream %s %v: stop condition not met within %v (%d messages read)", stream, cfg.FilterSubjects, timeout, len(out))
	return nil
}

// CollectN reads n messages of stream with Collect.
func CollectN(t testing.TB, js jetstream.JetStream, stream string, cfg jetstream.OrderedConsumerConfig, timeout time.Duration, n int) []jetstream.Msg {
	t.Helper()
	count := 0
	return Collect(t, js, stream, cfg, timeout, func(jetstream.Msg) bool { count++; return count == n })
}

// Throttled is a pipe for Proxy that passes at most rate bytes a second:
// a slow link.
func Throttled(rate int) func(dst io.Writer, src io.Reader) {
	return func(dst io.Writer, src io.Reader) {
		buf := make([]byte, 16<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
				time.Sleep(time.Duration(n) * time.Second / time.Duration(rate)) // pacing: the link's bandwidth
			}
			if err != nil {
				return
			}
		}
	}
}

// Proxy listens on a loopback port and forwards every connection to
// target, copying each way with pipe (io.Copy's when nil). It returns its
// address; when the test ends it closes the listener and every connection
// and waits for its goroutines.
func Proxy(t testing.TB, target string, pipe func(dst io.Writer, src io.Reader)) string {
	t.Helper()
	if pipe == nil {
		pipe = func(dst io.Writer, src io.Reader) { _, _ = io.Copy(dst, src) }
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy: listen: %v", err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, u)
			mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); pipe(u, c); u.Close() }()
			go func() { defer wg.Done(); pipe(c, u); c.Close() }()
		}
	}()
	return ln.Addr().String()
}

// Option adjusts StartRelay.
type Option func(*startOptions)

type startOptions struct {
	log          *zerolog.Logger
	registry     *prometheus.Registry
	onDelivered  func(relay.Delivered)
	startTimeout time.Duration
	dump         func() string
}

// WithLog sends the relay's log to log (default: the test's log, warn level).
func WithLog(log zerolog.Logger) Option { return func(o *startOptions) { o.log = &log } }

// WithRegistry registers the relay's metrics in reg (default: a fresh one).
func WithRegistry(reg *prometheus.Registry) Option {
	return func(o *startOptions) { o.registry = reg }
}

// WithOnDelivered passes f to the relay (see relay.Config.OnDelivered).
func WithOnDelivered(f func(relay.Delivered)) Option {
	return func(o *startOptions) { o.onDelivered = f }
}

// WithStartTimeout bounds the wait for the relay to stream (default 30 s).
func WithStartTimeout(d time.Duration) Option { return func(o *startOptions) { o.startTimeout = d } }

// WithDump adds dump() to the failure when the relay does not start, e.g.
// its captured log.
func WithDump(dump func() string) Option { return func(o *startOptions) { o.dump = dump } }

// Relay is a relay running in-process.
type Relay struct {
	// Registry holds the relay's metrics.
	Registry *prometheus.Registry
	cancel   context.CancelFunc
	exited   chan struct{}
	err      error // set before exited is closed
	once     sync.Once
}

// StartRelay runs app.Run with cfg until the test ends (or Stop) and returns
// once the relay streams. A relay that exits early or does not stream within
// the start timeout fails the test.
func StartRelay(t testing.TB, cfg config.Config, opts ...Option) *Relay {
	t.Helper()
	o := startOptions{startTimeout: 30 * time.Second}
	for _, f := range opts {
		f(&o)
	}
	log := zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
	if o.log != nil {
		log = *o.log
	}
	if o.registry == nil {
		o.registry = prometheus.NewRegistry()
	}
	// Not the test's context: the relay is stopped by a cleanup, after
	// the test's context is cancelled, and must see that stop as its own.
	ctx, cancel := context.WithCancel(context.Background())
	r := &Relay{Registry: o.registry, cancel: cancel, exited: make(chan struct{})}
	ready := make(chan struct{})
	go func() {
		defer close(r.exited)
		r.err = app.Run(ctx, cfg, log, app.Options{Ready: ready, Registry: o.registry, OnDelivered: o.onDelivered})
	}()
	t.Cleanup(func() { r.Stop(t) })
	dump := ""
	select {
	case <-ready:
		return r
	case <-r.exited:
		r.once.Do(func() {}) // reported here; Stop has nothing to add
		if o.dump != nil {
			dump = "\n" + o.dump()
		}
		t.Fatalf("relay exited at start: %v%s", r.err, dump)
	case <-time.After(o.startTimeout):
		if o.dump != nil {
			dump = "\n" + o.dump()
		}
		t.Fatalf("relay did not start streaming within %v%s", o.startTimeout, dump)
	}
	return r
}

// UsersConfig is the config the producer and consumer libraries' tests and
// the examples run the relay with: the (migrated) database at dbURL, its
// slot named after the database (slot names are cluster-wide), NATS at
// natsURL with stream USERS for user.>, retries from 100 ms to 1 s and no
// metrics listener.
func UsersConfig(t testing.TB, dbURL, natsURL string) config.Config {
	t.Helper()
	pc, err := pgx.ParseConfig(dbURL)
	if err != nil {
		t.Fatalf("parse the database URL: %v", err)
	}
	cfg := config.Default()
	cfg.Postgres.URL = dbURL
	cfg.Postgres.Slot = pc.Database
	cfg.NATS.URL = natsURL
	cfg.NATS.Streams = []config.Stream{{Name: "USERS", Subjects: []string{"user.>"}, DuplicateWindow: 2 * time.Minute}}
	cfg.Retry.Initial, cfg.Retry.Max = 100*time.Millisecond, time.Second
	cfg.Metrics.Listen = ""
	return cfg
}

// StartUsersRelay migrates the database at dbURL and runs the relay with
// UsersConfig, changed by mutate, until the test ends.
func StartUsersRelay(t testing.TB, dbURL, natsURL string, mutate ...func(*config.Config)) *Relay {
	t.Helper()
	Migrate(t, dbURL, walboxsql.Params{})
	cfg := UsersConfig(t, dbURL, natsURL)
	for _, f := range mutate {
		f(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("relay config: %v", err)
	}
	return StartRelay(t, cfg)
}

// Done is closed once the relay has returned.
func (r *Relay) Done() <-chan struct{} { return r.exited }

// Stop cancels the relay and waits for it to return; an error it returns
// fails the test. Calls after the first do nothing.
func (r *Relay) Stop(t testing.TB) {
	t.Helper()
	r.once.Do(func() {
		r.cancel()
		select {
		case <-r.exited:
			if r.err != nil {
				t.Errorf("relay: %v", r.err)
			}
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop within 30s")
		}
	})
}

// Metric sums the counters and gauges called name in g whose labels match
// every pair of labels (nil: all series).
func Metric(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather metrics: %v", err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue next
				}
			}
			if c := m.GetCounter(); c != nil {
				sum += c.GetValue()
			}
			if g := m.GetGauge(); g != nil {
				sum += g.GetValue()
			}
		}
	}
	return sum
}

// Buffer is a bytes.Buffer safe for concurrent writers, e.g. a relay's log
// read while it runs.
type Buffer = syncbuf.Buffer
