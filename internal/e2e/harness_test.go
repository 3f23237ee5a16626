package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgtest"
	walboxsql "github.com/walbox/walbox/sql"
)

// suite holds what every test in the package shares: one PostgreSQL cluster
// and one walbox binary (for tests that kill the relay as a real process).
type suite struct {
	pg     *pgtest.Cluster
	binary string
}

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

var s suite // set once by TestMain, read-only afterwards

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "walbox-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	s.binary = filepath.Join(dir, "walbox")
	out, err := exec.Command("go", "build", "-o", s.binary, "github.com/walbox/walbox/cmd/walbox").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "build walbox: %v\n%s", err, out)
		return 1
	}
	return pgtest.Main(m, &s.pg,
		// Crash tests must not lose commits the producer saw succeed.
		pgtest.WithSetting("synchronous_commit", "on"),
		// Short, so a relay that stops sending status updates while NATS is
		// down would be dropped within the test's outage.
		pgtest.WithSetting("wal_sender_timeout", "5s"),
		// Lets a recreated slot's backfill go out in commit order.
		pgtest.WithSetting("track_commit_timestamp", "on"),
	)
}

// env is one test's world: a fresh database with the migrations applied, a
// JetStream server, and a config pointing at both.
type env struct {
	t       *testing.T
	dbURL   string
	pool    *pgxpool.Pool
	nats    *natstest.Server
	nc      *nats.Conn
	js      jetstream.JetStream
	cfg     config.Config
	cfgFile string
	reg     *prometheus.Registry // metrics of the last relay started in process
}

func newEnv(t *testing.T, mutate ...func(*config.Config)) *env {
	t.Helper()
	ctx := context.Background()
	e := &env{t: t, dbURL: s.pg.NewDB(t)}
	e.nats = natstest.New(t)
	cfg := config.Default()
	cfg.Postgres.URL = e.dbURL
	cfg.Postgres.StatusInterval = time.Second
	cfg.NATS.URL = e.nats.URL()
	cfg.NATS.Streams = []config.Stream{
		{Name: "ORDERS", Subjects: []string{"orders.>"}, DuplicateWindow: 2 * time.Minute},
		{Name: "PAYMENTS", Subjects: []string{"payments.>"}, DuplicateWindow: 2 * time.Minute},
	}
	cfg.Retry.Initial = 100 * time.Millisecond
	cfg.Retry.Max = 2 * time.Second
	cfg.Metrics.Listen = ""
	cfg.Log.Level = "info"
	cfg.Log.Format = "json"
	for _, f := range mutate {
		f(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	e.cfg = cfg
	pool, err := pgxpool.New(ctx, e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e.pool = pool
	nc, err := nats.Connect(e.nats.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	e.nc = nc
	e.js, err = jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// migrate applies walbox's migrations for the default table.
func (e *env) migrate() {
	e.t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{Publication: e.cfg.Postgres.Publication}); err != nil {
		e.t.Fatal(err)
	}
}

// conn opens a connection closed at the end of the test.
func (e *env) conn() *pgx.Conn {
	e.t.Helper()
	c, err := pgx.Connect(context.Background(), e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

// witness creates the independent commit-order witness slot.
func (e *env) witness(table string) *outboxtest.Witness {
	e.t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(ctx)
	w, err := outboxtest.CreateWitness(ctx, conn, "witness", table)
	if err != nil {
		e.t.Fatal(err)
	}
	return w
}

// relay runs the relay in-process until the returned stop is called.
type inproc struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

func (e *env) startRelay() *inproc {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	r := &inproc{cancel: cancel, done: make(chan error, 1)}
	log := zerolog.New(zerolog.NewTestWriter(e.t)).Level(zerolog.WarnLevel)
	e.reg = prometheus.NewRegistry()
	reg := e.reg
	go func() { r.done <- app.Run(ctx, e.cfg, log, app.Options{Ready: ready, Registry: reg}) }()
	select {
	case <-ready:
	case err := <-r.done:
		e.t.Fatalf("relay exited at start: %v", err)
	case <-time.After(30 * time.Second):
		e.t.Fatal("relay did not start replicating within 30s")
	}
	e.t.Cleanup(func() { r.stop(e.t) })
	return r
}

func (r *inproc) stop(t *testing.T) {
	r.once.Do(func() { r.stopOnce(t) })
}

func (r *inproc) stopOnce(t *testing.T) {
	r.cancel()
	select {
	case err, ok := <-r.done:
		if ok && err != nil {
			t.Errorf("relay: %v", err)
		}
		close(r.done)
	case <-time.After(30 * time.Second):
		t.Error("relay did not stop within 30s")
	}
}

// writeConfig writes the config as YAML for the subprocess relay.
func (e *env) writeConfig() string {
	e.t.Helper()
	if e.cfgFile != "" {
		return e.cfgFile
	}
	data, err := yaml.Marshal(e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.cfgFile = filepath.Join(e.t.TempDir(), "walbox.yaml")
	if err := os.WriteFile(e.cfgFile, data, 0o600); err != nil {
		e.t.Fatal(err)
	}
	return e.cfgFile
}

// proc is the relay as a real process, for kill -9.
type proc struct {
	cmd  *exec.Cmd
	mu   sync.Mutex
	logs strings.Builder
	done chan struct{}
}

func (e *env) spawnRelay() *proc {
	e.t.Helper()
	p := e.startProc()
	e.waitSlotActive(p)
	return p
}

// startProc starts `walbox run` with extra environment (WALBOX_* overrides)
// and returns at once.
func (e *env) startProc(environ ...string) *proc {
	e.t.Helper()
	cfgFile := e.writeConfig()
	p := &proc{done: make(chan struct{})}
	p.cmd = exec.Command(s.binary, "run", "--config", cfgFile)
	p.cmd.Env = append(os.Environ(), environ...)
	p.cmd.Stdout = &lockedWriter{p}
	p.cmd.Stderr = &lockedWriter{p}
	if err := p.cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.done) }()
	e.t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
		if e.t.Failed() {
			e.t.Logf("relay output:\n%s", p.output())
		}
	})
	return p
}

// waitSlotActive waits until the relay holds the slot, i.e. streams.
func (e *env) waitSlotActive(p *proc) {
	e.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var active bool
		_ = e.pool.QueryRow(context.Background(), "SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1", e.cfg.Postgres.Slot).Scan(&active)
		if active {
			return
		}
		select {
		case <-p.done:
			e.t.Fatalf("relay exited at start:\n%s", p.output())
		case <-time.After(50 * time.Millisecond):
		}
	}
	e.t.Fatalf("relay did not start streaming within 30s:\n%s", p.output())
}

type lockedWriter struct{ p *proc }

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.logs.Write(b)
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.logs.String()
}

// signal sends sig and waits for the process to exit, returning its exit code.
func (p *proc) signal(t *testing.T, sig syscall.Signal) int {
	t.Helper()
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("relay did not exit after %v", sig)
	}
	return p.cmd.ProcessState.ExitCode()
}

// slot reads walbox's slot from pg_replication_slots.
type slotRow struct {
	Active    bool
	PID       int
	Confirmed pglogrepl.LSN
}

func (e *env) slot() slotRow {
	e.t.Helper()
	var r slotRow
	var lsn string
	err := e.pool.QueryRow(context.Background(),
		"SELECT active, coalesce(active_pid, 0), coalesce(confirmed_flush_lsn, '0/0')::text FROM pg_replication_slots WHERE slot_name = $1",
		e.cfg.Postgres.Slot).Scan(&r.Active, &r.PID, &lsn)
	if err != nil {
		e.t.Fatalf("read slot: %v", err)
	}
	r.Confirmed, _ = pglogrepl.ParseLSN(lsn)
	return r
}

// streamNames are the user streams of the config.
func (e *env) streamNames() []string {
	var names []string
	for _, st := range e.cfg.NATS.Streams {
		names = append(names, st.Name)
	}
	return names
}

// waitDelivered waits until the streams hold at least n messages in all.
func (e *env) waitDelivered(n int, timeout time.Duration) {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	var total uint64
	for time.Now().Before(deadline) {
		total = 0
		for _, name := range e.streamNames() {
			st, err := e.js.Stream(context.Background(), name)
			if err != nil {
				continue
			}
			info, err := st.Info(context.Background())
			if err == nil {
				total += info.State.Msgs
			}
		}
		if total >= uint64(n) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	e.t.Fatalf("only %d of %d events reached JetStream within %v", total, n, timeout)
}

// check runs the one checker over the whole run and fails the test on any
// lost, duplicated, out-of-order or rolled-back event.
func (e *env) check(w *outboxtest.Witness, res *outboxtest.Result) outboxtest.Report {
	e.t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(ctx)
	committed, err := w.Committed(ctx, conn)
	if err != nil {
		e.t.Fatal(err)
	}
	e.waitDelivered(len(committed), 60*time.Second)
	// A moment more, so a duplicate arriving late is seen too.
	time.Sleep(300 * time.Millisecond)
	streams, snapshot, err := outboxtest.ReadStreamsSnapshot(ctx, e.js, e.streamNames()...)
	if err != nil {
		e.t.Fatal(err)
	}
	var rolledBack []string
	if res != nil {
		rolledBack = res.RolledBack
	}
	// Order is judged on the events streamed from the WAL; events a slot
	// recreation republished from its snapshot have no WAL position (README,
	// "Guarantees") and are counted apart.
	rep := outboxtest.CheckStreamed(committed, rolledBack, streams, snapshot)
	e.t.Logf("checker: %s", rep.String())
	if !rep.OK() {
		e.t.Fatalf("guarantees broken: %s", rep)
	}
	if rep.Checked == 0 {
		e.t.Fatal("checker saw no committed events: the test produced nothing")
	}
	return rep
}

// counter reads a counter of the last in-process relay, by its labels.
func (e *env) counter(name string, labels map[string]string) float64 {
	e.t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		e.t.Fatal(err)
	}
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
			return m.GetCounter().GetValue()
		}
	}
	return 0
}
