// Package devenv is `walbox dev`: everything walbox needs, started locally
// for a first look. A throwaway PostgreSQL cluster (or the database the user
// names), an embedded JetStream server, walbox's migrations, the relay
// in-process, a producer committing sample events at a steady rate, and a
// console that prints every event as JetStream stored it, with its
// commit-to-ack latency. When the context ends it stops everything and
// removes what it created.
//
// It lives apart from cmd/walbox so it can be tested, and it links no
// "testing" code: the clusters come from internal/pgcluster and
// internal/natsembed.
package devenv

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kfake"
	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	webconsole "github.com/walbox/walbox/internal/console"
	"github.com/walbox/walbox/internal/natsembed"
	"github.com/walbox/walbox/internal/pgcluster"
	"github.com/walbox/walbox/internal/ports"
	"github.com/walbox/walbox/relay"
	walboxsql "github.com/walbox/walbox/sql"
)

// Defaults of Config.
const (
	DefaultRate         = 5.0
	DefaultDir          = ".walbox-dev"
	DefaultSummaryEvery = 5 * time.Second

	// devDatabase is the database created in the throwaway cluster.
	devDatabase = "walbox"
	// externalSlot is the slot used in a database given by --postgres-url:
	// not "walbox", so a real relay's slot is never touched. It is dropped
	// at exit (unless Keep), so it never holds WAL back afterwards.
	externalSlot = "walbox_dev"
	// drainWait bounds how long shutdown waits for committed sample events
	// to be printed before the relay is stopped.
	drainWait = 5 * time.Second
	// cleanupTimeout bounds each shutdown step that talks to a server.
	cleanupTimeout = 30 * time.Second
)

// Config says what Run starts. A zero field means its default, except Rate.
type Config struct {
	// PostgresURL, if set, is used instead of a throwaway cluster. Its
	// server must run with wal_level=logical.
	PostgresURL string
	// NATSURL, if set, is used instead of the embedded JetStream server.
	NATSURL string
	// Sink is nats (default) or kafka: with kafka, the relay publishes to
	// an in-process Kafka (kfake), or to KafkaBrokers when set.
	Sink         string
	KafkaBrokers []string
	// Rate is the sample events committed per second; 0 commits none, e.g.
	// to watch a service's own events (the CLI's default is DefaultRate).
	Rate float64
	// Duration stops everything after it has run this long, counted from
	// when everything is up (start-up takes a few seconds more); 0 runs
	// until ctx ends.
	Duration time.Duration
	// Dir is where a run's files go (default .walbox-dev in the current
	// directory): each run gets a fresh folder in it. If the PostgreSQL
	// server cannot use it (running as root, with a parent folder others
	// cannot enter), a temporary folder is used instead.
	Dir string
	// Keep leaves the run's files (and the slot in a database given by
	// PostgresURL) in place at exit.
	Keep bool
	// SummaryEvery is the interval of the summary line (default 5 s).
	SummaryEvery time.Duration
	// Out receives the event lines, summaries and progress (nil: discarded).
	Out io.Writer
	// Log receives the relay's own log.
	Log zerolog.Logger
	// BinSearch overrides where the PostgreSQL binaries are looked for
	// (default pgcluster.DefaultBinSearch()).
	BinSearch *pgcluster.BinSearch
}

// Summary is what a run did.
type Summary struct {
	Produced     int64         // sample events committed
	Acked        int64         // events the relay saw acked by JetStream
	DeadLettered int64         // events the relay dead-lettered
	Printed      int64         // messages printed as JetStream stored them
	P50, P99     time.Duration // commit-to-ack latency of the printed events
	FirstEvent   time.Duration // from the start of Run to the first printed event (0: none)
	Elapsed      time.Duration
	KeptDir      string // the run's folder, if Keep left it in place
}

// MissingPostgresError says that no PostgreSQL server binaries were found
// and how to get them.
type MissingPostgresError struct {
	Err *pgcluster.NotFoundError
}

func (e *MissingPostgresError) Error() string {
	return fmt.Sprintf(`walbox dev starts a throwaway PostgreSQL, but its server binaries (initdb, pg_ctl, postgres) were not found
(searched %s). Install them:
  Debian/Ubuntu:  sudo apt-get install postgresql
  Homebrew:       brew install postgresql@17
or use a running server with wal_level=logical: walbox dev --postgres-url postgres://USER:PASS@HOST:5432/DB`,
		strings.Join(e.Err.Searched, ", "))
}

func (e *MissingPostgresError) Unwrap() error { return e.Err }

// Run starts everything, prints events until ctx ends (or cfg.Duration
// passes), then stops and cleans up. It returns nil after a clean stop; an
// interrupt during start-up is a clean stop too.
func Run(ctx context.Context, cfg Config) (Summary, error) {
	cfg = withDefaults(cfg)
	start := time.Now()
	r := &run{cfg: cfg, start: start, con: newConsole(cfg.Out, start, cfg.SummaryEvery)}
	err := r.serve(ctx)
	if err != nil && ctx.Err() != nil && !errors.As(err, new(*MissingPostgresError)) {
		// Interrupted while starting: a clean stop, not a failure.
		r.con.progress("interrupted while starting; stopping")
		err = nil
	}
	if cerr := r.cleanup(); cerr != nil {
		err = errors.Join(err, cerr)
	}
	return r.summary(), err
}

func withDefaults(cfg Config) Config {
	if cfg.Dir == "" {
		cfg.Dir = DefaultDir
	}
	if cfg.SummaryEvery <= 0 {
		cfg.SummaryEvery = DefaultSummaryEvery
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	return cfg
}

// run is one `walbox dev` session. cleanups undo what serve started, newest
// first.
type run struct {
	cfg   Config
	start time.Time
	con   *console

	runDir   string // this run's folder, "" if nothing local was started
	cfgFile  string // the relay's configuration, written into runDir
	pg       *pgcluster.Cluster
	nats     *natsembed.Server
	kafka    *kfake.Cluster
	brokers  []string
	dbURL    string
	natsURL  string
	slot     string
	produced atomic.Int64
	acked    atomic.Int64
	dlq      atomic.Int64

	cleanups []func() error
}

func (r *run) onCleanup(f func() error) { r.cleanups = append(r.cleanups, f) }

func (r *run) cleanup() error {
	var errs []error
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		if err := r.cleanups[i](); err != nil {
			errs = append(errs, err)
		}
	}
	r.cleanups = nil
	return errors.Join(errs...)
}

func (r *run) summary() Summary {
	s := r.con.totals()
	s.Produced = r.produced.Load()
	s.Acked = r.acked.Load()
	s.DeadLettered = r.dlq.Load()
	s.Elapsed = time.Since(r.start)
	if r.cfg.Keep {
		s.KeptDir = r.runDir
	}
	return s
}

// serve starts the parts in dependency order and blocks until ctx ends or a
// part fails.
func (r *run) serve(ctx context.Context) error {
	if r.cfg.PostgresURL == "" {
		// Fail before creating anything when the binaries are missing.
		if _, err := pgcluster.FindBinDir(r.binSearch()); err != nil {
			var nf *pgcluster.NotFoundError
			if errors.As(err, &nf) {
				return &MissingPostgresError{Err: nf}
			}
			return err
		}
	}
	if r.cfg.PostgresURL == "" || r.cfg.NATSURL == "" || r.kafkaSink() {
		if err := r.makeRunDir(); err != nil {
			return err
		}
	}
	if err := r.startPostgres(ctx); err != nil {
		return err
	}
	if err := r.migrate(ctx); err != nil {
		return err
	}
	if r.kafkaSink() {
		if err := r.startKafka(); err != nil {
			return err
		}
	} else if err := r.startNATS(); err != nil {
		return err
	}
	rcfg, err := r.relayConfig()
	if err != nil {
		return err
	}

	// From here on the parts run concurrently; the first failure stops all.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	defer wg.Wait()

	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRelay()
	if r.pg == nil {
		// The relay creates the slot; the cleanup runs after it stopped.
		r.onCleanup(r.dropExternalSlot)
	}
	ready := make(chan struct{})
	relayDone := make(chan error, 1)
	r.con.progress("starting the relay (slot %s, publication %s, table %s)", rcfg.Postgres.Slot, rcfg.Postgres.Publication, rcfg.Outbox.Table)
	// The web console on the metrics listener, read-only (no token).
	opts, err := webconsole.Attach(relayCtx, webconsole.Options{Config: rcfg, Log: r.cfg.Log}, app.Options{Ready: ready, OnDelivered: r.delivered})
	if err != nil {
		return err
	}
	wg.Go(func() {
		err := app.Run(relayCtx, rcfg, r.cfg.Log, opts)
		if err != nil {
			err = fmt.Errorf("relay: %w", err)
			cancel(err)
		}
		relayDone <- err
	})
	select {
	case <-ready:
	case <-ctx.Done():
		stopRelay()
		return context.Cause(ctx)
	}

	var stopWatch func()
	if r.kafkaSink() {
		w, err := watchKafka(ctx, r.brokers, append(kafkaTopics, rcfg.Kafka.DLQTopic), r.con)
		if err != nil {
			stopRelay()
			return err
		}
		stopWatch = w.stop
	} else {
		w, err := watch(ctx, r.natsURL, []string{"ORDERS", "PAYMENTS", rcfg.NATS.DLQ.Stream}, r.start, r.con)
		if err != nil {
			stopRelay()
			return err
		}
		stopWatch = w.stop
	}
	defer stopWatch()

	r.writeConfig(rcfg)
	r.banner(rcfg)

	prodCtx, stopProducer := context.WithCancel(ctx)
	defer stopProducer()
	prodDone := make(chan struct{})
	if r.cfg.Rate > 0 {
		p := &producer{url: r.dbURL, table: rcfg.Outbox.Table, rate: r.cfg.Rate, log: r.cfg.Log, produced: &r.produced}
		wg.Go(func() {
			defer close(prodDone)
			if err := p.run(prodCtx); err != nil {
				cancel(err)
			}
		})
	} else {
		close(prodDone)
	}
	summaries := r.con.summaries(ctx)

	runCtx := ctx
	if r.cfg.Duration > 0 {
		var cancelRun context.CancelFunc
		runCtx, cancelRun = context.WithTimeout(ctx, r.cfg.Duration)
		defer cancelRun()
	}
	<-runCtx.Done()
	var failure error
	if ctx.Err() != nil {
		failure = context.Cause(ctx)
		if errors.Is(failure, context.Canceled) || errors.Is(failure, context.DeadlineExceeded) {
			failure = nil // Ctrl-C or the caller's deadline: a clean stop
		}
	}

	// Shutdown: producer first, then let the relay deliver what was
	// committed, so the last lines and the counts add up.
	stopProducer()
	<-prodDone
	summaries()
	if failure == nil {
		r.con.waitPrinted(r.produced.Load(), drainWait)
	}
	stopRelay()
	if err := <-relayDone; err != nil && failure == nil {
		failure = err
	}
	stopWatch()
	r.con.final(r.summary())
	return failure
}

func (r *run) delivered(d relay.Delivered) {
	if d.DeadLetter {
		r.dlq.Add(1)
	} else {
		r.acked.Add(1)
	}
}

func (r *run) binSearch() pgcluster.BinSearch {
	if r.cfg.BinSearch != nil {
		return *r.cfg.BinSearch
	}
	return pgcluster.DefaultBinSearch()
}

// cleanLeftovers removes the runs an earlier walbox dev left behind (killed
// before it could clean up): not kept (--keep), and whose walbox is gone. A
// PostgreSQL still running on such a folder is stopped first. It says what
// it did.
func (r *run) cleanLeftovers(parent, prefix string) {
	dirs, _ := filepath.Glob(filepath.Join(parent, prefix))
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "KEPT")); err == nil {
			continue
		}
		if pidAlive(filepath.Join(d, "walbox.pid")) {
			continue // another walbox dev is using it
		}
		note := ""
		pmFile := filepath.Join(d, "postgres", "data", "postmaster.pid")
		if pidAlive(pmFile) {
			if pid, ok := readPID(pmFile); ok {
				_ = syscall.Kill(pid, syscall.SIGQUIT) // immediate shutdown: it is throwaway data
				for i := 0; i < 100 && processAlive(pid); i++ {
					time.Sleep(50 * time.Millisecond)
				}
				note = " (its PostgreSQL was still running: stopped)"
			}
		}
		if err := os.RemoveAll(d); err == nil {
			r.con.progress("removed %s, left behind by an earlier walbox dev%s", r.rel(d), note)
		}
	}
}

func readPID(file string) (int, bool) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	return pid, err == nil && pid > 0
}

func pidAlive(file string) bool {
	pid, ok := readPID(file)
	return ok && processAlive(pid)
}

func processAlive(pid int) bool {
	return pid != os.Getpid() && syscall.Kill(pid, 0) == nil
}

// makeRunDir creates this run's folder in cfg.Dir, or in a temporary
// folder when the PostgreSQL server could not reach cfg.Dir.
func (r *run) makeRunDir() error {
	parent, prefix := r.cfg.Dir, "run-*"
	created := false
	if _, err := os.Stat(parent); errors.Is(err, os.ErrNotExist) {
		created = true
	}
	var unusable error
	if err := os.MkdirAll(parent, 0o755); err != nil {
		unusable = fmt.Errorf("cannot create %s: %w", parent, err)
	} else if r.cfg.PostgresURL == "" {
		unusable = pgcluster.CheckReachable(parent)
	}
	if unusable != nil {
		if created {
			_ = os.Remove(parent)
		}
		r.con.progress("note: %v; using a temporary folder instead", unusable)
		parent = os.TempDir()
		if r.cfg.PostgresURL == "" && pgcluster.CheckReachable(parent) != nil {
			parent = "/tmp"
		}
		created = false
		prefix = "walbox-dev-*"
	}
	r.cleanLeftovers(parent, prefix)
	dir, err := os.MkdirTemp(parent, prefix)
	if err != nil {
		return fmt.Errorf("create a run folder in %s: %w", parent, err)
	}
	// Which process owns the run, so a later one can tell a run that is
	// still going from one a killed walbox left behind.
	_ = os.WriteFile(filepath.Join(dir, "walbox.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644)
	// MkdirTemp makes it 0700; the server user must be able to enter it.
	if err := os.Chmod(dir, 0o755); err != nil {
		_ = os.RemoveAll(dir)
		return fmt.Errorf("chmod %s: %w", dir, err)
	}
	r.runDir = dir
	r.onCleanup(func() error {
		if r.cfg.Keep {
			_ = os.WriteFile(filepath.Join(dir, "KEPT"), []byte("kept by walbox dev --keep\n"), 0o644)
			r.con.progress("kept %s (PostgreSQL data in postgres/data, its log in postgres/data/logfile, JetStream store in nats/); remove it with: rm -rf %s", dir, dir)
			return nil
		}
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("remove %s: %w", dir, err)
		}
		if created {
			_ = os.Remove(parent) // only if empty: earlier kept runs stay
		}
		return nil
	})
	return nil
}

// startPostgres starts the throwaway cluster, or checks the given database.
func (r *run) startPostgres(ctx context.Context) error {
	if r.cfg.PostgresURL != "" {
		r.dbURL = r.cfg.PostgresURL
		r.slot = externalSlot
		return nil
	}
	t0 := time.Now()
	r.con.progress("starting a throwaway PostgreSQL in %s", r.rel(filepath.Join(r.runDir, "postgres")))
	pg, err := pgcluster.Start(ctx,
		pgcluster.WithBaseDir(filepath.Join(r.runDir, "postgres")),
		pgcluster.WithBinSearch(r.binSearch()),
		// The default (off) lets a commit return before its WAL is flushed,
		// and the walsender only sends flushed WAL: latency would show the
		// WAL writer's 200 ms delay instead of walbox's.
		pgcluster.WithSetting("synchronous_commit", "on"),
		pgcluster.WithSetting("application_name", "walbox-dev"),
	)
	if err != nil {
		return fmt.Errorf("start PostgreSQL: %w", err)
	}
	r.pg = pg
	r.onCleanup(r.stopPostgres)
	cctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
	defer cancel()
	u, err := pg.CreateDB(cctx, devDatabase)
	if err != nil {
		return fmt.Errorf("create database %s: %w", devDatabase, err)
	}
	r.dbURL = u
	r.slot = "walbox"
	r.con.progress("PostgreSQL ready in %s (%s)", time.Since(t0).Round(time.Millisecond), pg.BinDir())
	return nil
}

func (r *run) stopPostgres() error {
	if r.cfg.Keep {
		// A fast shutdown writes a checkpoint, so the kept data directory
		// starts again without recovery.
		ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		defer cancel()
		if err := r.pg.Stop(ctx); err != nil {
			return errors.Join(fmt.Errorf("stop PostgreSQL: %w", err), r.pg.Kill())
		}
		return nil
	}
	if err := r.pg.Close(); err != nil {
		return fmt.Errorf("stop PostgreSQL: %w", err)
	}
	return nil
}

// dropExternalSlot removes the dev slot from a database the user named, so
// it does not retain WAL after the session.
func (r *run) dropExternalSlot() error {
	if r.cfg.Keep {
		r.con.progress("kept replication slot %s in the database; drop it with: SELECT pg_drop_replication_slot('%s')", r.slot, r.slot)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, r.dbURL)
	if err != nil {
		return fmt.Errorf("drop replication slot %s: connect: %w", r.slot, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	// The walsender releases the slot shortly after the relay disconnects.
	for {
		var left int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM (
			SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active) d`, r.slot).Scan(&left)
		if err != nil {
			return fmt.Errorf("drop replication slot %s: %w", r.slot, err)
		}
		var exists bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)", r.slot).Scan(&exists); err != nil {
			return fmt.Errorf("drop replication slot %s: %w", r.slot, err)
		}
		if !exists {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("drop replication slot %s: still in use: %w", r.slot, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (r *run) migrate(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, r.dbURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL for migrations: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var level string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if level != "logical" {
		return fmt.Errorf("the database's wal_level is %q; set wal_level = logical in postgresql.conf and restart the server", level)
	}
	applied, err := walboxsql.Apply(ctx, conn, walboxsql.Params{})
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if len(applied) == 0 {
		r.con.progress("migrations: already up to date")
	} else {
		r.con.progress("migrations: applied %s", strings.Join(applied, ", "))
	}
	return nil
}

func (r *run) startNATS() error {
	if r.cfg.NATSURL != "" {
		r.natsURL = r.cfg.NATSURL
		return nil
	}
	t0 := time.Now()
	s, err := natsembed.Start(natsembed.WithStoreDir(filepath.Join(r.runDir, "nats")))
	if err != nil {
		return fmt.Errorf("start the embedded NATS server: %w", err)
	}
	r.nats = s
	r.natsURL = s.URL()
	r.onCleanup(func() error {
		if r.cfg.Keep {
			s.Stop()
		} else {
			s.Close()
		}
		return nil
	})
	r.con.progress("NATS JetStream ready in %s", time.Since(t0).Round(time.Millisecond))
	return nil
}

func (r *run) kafkaSink() bool { return r.cfg.Sink == config.SinkKafka }

// relayConfig is the configuration `walbox run` would load, with dev's
// endpoints and two sample streams.
func (r *run) relayConfig() (config.Config, error) {
	c := config.Default()
	c.Postgres.URL = r.dbURL
	c.Postgres.Slot = r.slot
	c.Postgres.StatusInterval = time.Second
	c.NATS.URL = r.natsURL
	c.NATS.Streams = []config.Stream{
		{Name: "ORDERS", Subjects: []string{"orders.>"}, Storage: "file"},
		{Name: "PAYMENTS", Subjects: []string{"payments.>"}, Storage: "file"},
	}
	// Events of any size out of the box (README, Large events); the
	// claim check has no store for Kafka yet.
	c.ClaimCheck.Enabled = !r.kafkaSink()
	if r.kafkaSink() {
		c.Sink = config.SinkKafka
		c.Kafka.Brokers = r.brokers
		for _, t := range kafkaTopics {
			c.Kafka.Topics = append(c.Kafka.Topics, config.KafkaTopic{Name: t, Partitions: 3})
		}
	}
	c.Retry.Initial = 200 * time.Millisecond
	c.Retry.Max = 5 * time.Second
	res, err := ports.Reserve(1)
	if err != nil {
		return c, fmt.Errorf("pick the metrics port: %w", err)
	}
	r.onCleanup(func() error { res.Release(); return nil })
	c.Metrics.Listen = net.JoinHostPort("127.0.0.1", strconv.Itoa(res.Ports[0]))
	if err := c.Validate(); err != nil {
		return c, fmt.Errorf("dev configuration: %w", err)
	}
	return c, nil
}

// rel shows path relative to the working directory when it is below it.
func (r *run) rel(path string) string {
	wd, err := os.Getwd()
	if err != nil {
		return path
	}
	if rel, err := filepath.Rel(wd, path); err == nil && filepath.IsLocal(rel) {
		return rel
	}
	return path
}

// banner tells a newcomer what runs where and what to try.
func (r *run) banner(c config.Config) {
	var b strings.Builder
	b.WriteString("\nwalbox dev is running:\n")
	pgNote := "(your database)"
	if r.pg != nil {
		pgNote = "(throwaway cluster)"
	}
	fmt.Fprintf(&b, "  PostgreSQL  %s  %s\n", c.Postgres.URL, pgNote)
	if r.kafkaSink() {
		kafkaNote := "(your brokers)"
		if r.kafka != nil {
			kafkaNote = "(in-process Kafka, kfake)"
		}
		fmt.Fprintf(&b, "  Kafka       %s  %s\n", strings.Join(c.Kafka.Brokers, ","), kafkaNote)
		fmt.Fprintf(&b, "  topics      %s (key: the order id), dead letters in %s\n", strings.Join(kafkaTopics, ", "), c.Kafka.DLQTopic)
	} else {
		natsNote := "(your server)"
		if r.nats != nil {
			natsNote = "(embedded JetStream)"
		}
		fmt.Fprintf(&b, "  NATS        %s  %s\n", c.NATS.URL, natsNote)
		fmt.Fprintf(&b, "  streams     ORDERS <- orders.>, PAYMENTS <- payments.>, %s <- %s>\n", c.NATS.DLQ.Stream, c.NATS.DLQ.SubjectPrefix)
	}
	fmt.Fprintf(&b, "  relay       slot %s, publication %s, metrics http://%s/metrics\n", c.Postgres.Slot, c.Postgres.Publication, c.Metrics.Listen)
	fmt.Fprintf(&b, "  console     http://%s/ui/ (read-only: set console.token to retry dead letters from it)\n", c.Metrics.Listen)
	if r.cfg.Rate > 0 {
		fmt.Fprintf(&b, "  producer    %g sample events/s, one transaction each, into %s\n", r.cfg.Rate, c.Outbox.Table)
	}
	fmt.Fprintf(&b, "Write your own event:\n  psql '%s' -c \"INSERT INTO outbox_events (topic, payload) VALUES ('orders.created', '{\\\"hello\\\": \\\"world\\\"}')\"\n", c.Postgres.URL)
	stop := "Ctrl-C stops everything"
	if r.cfg.Duration > 0 {
		stop = fmt.Sprintf("Stops after %s (or Ctrl-C)", r.cfg.Duration)
	}
	if r.runDir != "" && !r.cfg.Keep {
		stop += " and removes " + r.rel(r.runDir) + " (--keep keeps it)"
	}
	b.WriteString(stop + ".\n")
	if r.cfgFile != "" {
		cf := r.rel(r.cfgFile)
		fmt.Fprintf(&b, "The run's configuration is %s; against it, from another terminal:\n", cf)
		if r.kafkaSink() {
			fmt.Fprintf(&b, "  walbox status --config %s\n  kcat -C -b %s -t orders.created -J\n", cf, strings.Join(c.Kafka.Brokers, ","))
		} else {
			fmt.Fprintf(&b, "  walbox status --config %s\n  walbox tail 'orders.>' --config %s\n  walbox dlq list --config %s\n", cf, cf, cf)
		}
	}
	r.con.printf("%s", b.String())
}

// writeConfig writes the relay's configuration into the run folder, so the
// other commands can be pointed at this run.
func (r *run) writeConfig(c config.Config) {
	if r.runDir == "" {
		return
	}
	data, err := yaml.Marshal(c)
	if err != nil {
		return
	}
	f := filepath.Join(r.runDir, "walbox.yaml")
	if err := os.WriteFile(f, data, 0o600); err == nil {
		r.cfgFile = f
	}
}
