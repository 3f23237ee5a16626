package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
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
	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
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
	// relays are those this test started, in process or as processes: a
	// check waits for them to settle only while one runs.
	relays []interface{ running() bool }
}

func newEnv(t *testing.T, mutate ...func(*config.Config)) *env {
	t.Helper()
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
	e.pool = relaytest.Pool(t, e.dbURL)
	e.nc, e.js = relaytest.JetStream(t, e.nats.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	return e
}

// newMigratedEnv is newEnv with walbox's migrations applied.
func newMigratedEnv(t *testing.T, mutate ...func(*config.Config)) *env {
	t.Helper()
	e := newEnv(t, mutate...)
	e.migrate()
	return e
}

// migrate applies walbox's migrations for the default table.
func (e *env) migrate() {
	e.t.Helper()
	relaytest.Migrate(e.t, e.dbURL, walboxsql.Params{Publication: e.cfg.Postgres.Publication})
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
	w, err := outboxtest.CreateWitness(context.Background(), e.conn(), "witness", table)
	if err != nil {
		e.t.Fatal(err)
	}
	return w
}

// inproc is the relay running in-process until stop (or the test's end).
type inproc struct{ *relaytest.Relay }

func (e *env) startRelay() *inproc {
	e.t.Helper()
	r := &inproc{relaytest.StartRelay(e.t, e.cfg)}
	e.reg = r.Registry
	e.relays = append(e.relays, r)
	return r
}

func (r *inproc) stop(t *testing.T) { r.Stop(t) }

func (r *inproc) running() bool {
	select {
	case <-r.Done():
		return false
	default:
		return true
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
	e.relays = append(e.relays, p)
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
	defer func() {
		if e.t.Failed() {
			e.t.Logf("relay output:\n%s", p.output())
		}
	}()
	relaytest.Eventually(e.t, 30*time.Second, "the relay to stream (its slot active)", func() bool {
		if !p.running() {
			e.t.Fatal("relay exited at start")
		}
		var active bool
		_ = e.pool.QueryRow(context.Background(), "SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1", e.cfg.Postgres.Slot).Scan(&active)
		return active
	})
}

type lockedWriter struct{ p *proc }

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.logs.Write(b)
}

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
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

// stream returns the stream name and its info, read now. Either failing
// fails the test.
func (e *env) stream(ctx context.Context, name string) (jetstream.Stream, *jetstream.StreamInfo) {
	e.t.Helper()
	st, err := e.js.Stream(ctx, name)
	if err != nil {
		e.t.Fatalf("stream %s: %v", name, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		e.t.Fatalf("info of stream %s: %v", name, err)
	}
	return st, info
}

// queryStrings runs q, which selects one text column, on db and returns
// the values in the order read.
func queryStrings(ctx context.Context, t *testing.T, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, q string, args ...any) []string {
	t.Helper()
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return vs
}

// waitDelivered waits until the streams hold at least n messages in all.
// firstMsg returns the message at sequence 1 of stream.
func (e *env) firstMsg(ctx context.Context, stream string) *jetstream.RawStreamMsg {
	e.t.Helper()
	st, err := e.js.Stream(ctx, stream)
	if err != nil {
		e.t.Fatalf("stream %s: %v", stream, err)
	}
	m, err := st.GetMsg(ctx, 1)
	if err != nil {
		e.t.Fatalf("message 1 of %s: %v", stream, err)
	}
	return m
}

func (e *env) waitDelivered(n int, timeout time.Duration) {
	e.t.Helper()
	var total uint64
	defer func() {
		if total < uint64(n) {
			e.t.Logf("only %d of %d events reached JetStream", total, n)
		}
	}()
	relaytest.Eventually(e.t, timeout, fmt.Sprintf("%d events in JetStream", n), func() bool {
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
		return total >= uint64(n)
	})
}

// settled waits for a positive sign that every running relay is past all
// that was committed so far: one table-less event per stream, emitted now,
// arrives. A relay publishes in WAL order, resends included, so a late
// duplicate of an earlier event would have been stored before it. With no
// relay running nothing can arrive late, and there is nothing to wait for.
func (e *env) settled() {
	e.t.Helper()
	if !slices.ContainsFunc(e.relays, func(r interface{ running() bool }) bool { return r.running() }) {
		return
	}
	ctx := relaytest.Ctx(e.t)
	for _, st := range e.cfg.NATS.Streams {
		subject := settleSubject(st.Subjects[0])
		var id string
		if err := e.pool.QueryRow(ctx, "SELECT walbox.emit_message($1, '{}')::text", strings.TrimPrefix(subject, e.cfg.NATS.SubjectPrefix)).Scan(&id); err != nil {
			e.t.Fatalf("emit the settle marker for %s: %v", st.Name, err)
		}
		relaytest.Eventually(e.t, 60*time.Second, "the settle marker in "+st.Name, func() bool {
			s, err := e.js.Stream(ctx, st.Name)
			if err != nil {
				return false
			}
			m, err := s.GetLastMsgForSubject(ctx, subject)
			return err == nil && m.Header.Get("Nats-Msg-Id") == id
		})
	}
}

// settleSubject is a subject of the stream pattern p, for settled's marker.
func settleSubject(p string) string {
	tokens := strings.Split(p, ".")
	for i, tok := range tokens {
		if tok == "*" || tok == ">" {
			tokens[i] = "walbox_settled"
		}
	}
	return strings.Join(tokens, ".")
}

// check runs the one checker over the whole run and fails the test on any
// lost, duplicated, out-of-order or rolled-back event.
func (e *env) check(w *outboxtest.Witness, res *outboxtest.Result) outboxtest.Report {
	e.t.Helper()
	ctx := context.Background()
	conn := e.conn()
	committed, err := w.Committed(ctx, conn)
	if err != nil {
		e.t.Fatal(err)
	}
	e.waitDelivered(len(committed), 60*time.Second)
	// A duplicate arriving late is seen too.
	e.settled()
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
	return relaytest.Metric(e.t, e.reg, name, labels)
}

func lsnAtLeast(a, b string) bool {
	x, err1 := pglogrepl.ParseLSN(a)
	y, err2 := pglogrepl.ParseLSN(b)
	return err1 == nil && err2 == nil && x >= y
}
