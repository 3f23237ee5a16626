// Command bench measures walbox end to end on this machine (issue 7): catch-up
// throughput against the decoding and publishing ceilings, live
// commit-to-ack latency at fixed rates, and the relay's CPU and memory.
//
//	cd bench && go run .          # make bench: the full run (~10 min)
//	cd bench && go run . -quick   # make bench-quick: smaller figures (~3 min)
//	cd bench && go run . claim    # only the claim check beside a raised limit (claim.go)
//
// It needs nothing but the PostgreSQL server binaries: it starts a throwaway
// cluster (internal/pgtest, wal_level=logical), an in-process nats-server
// with a file store (internal/natstest), builds cmd/walbox and runs the relay
// as a subprocess, so the relay's CPU and peak RSS are its own. The table is
// printed and written to bench/results/latest.md (latest-quick.md for
// -quick). Every process and temporary directory is removed at the end, also
// on error and Ctrl-C.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// params are the sizes of one run.
type params struct {
	Quick        bool
	Events       int           // catch-up backlog
	TxnRows      int           // rows per backlog transaction
	Loaders      int           // parallel backlog connections
	PayloadBytes int           // JSON payload size
	Rates        []int         // live rates, events/s
	LiveFor      time.Duration // per rate
	BigRows      int           // rows of the single large transaction
	PeerEvents   int           // catch-up backlog of the peers
	Rounds       int           // catch-up rounds (relay, ceilings, flag off); medians are reported
	Window       int           // publishing ceiling: in-flight bound
	Stall        time.Duration // a phase without progress this long aborts
	SyncCommit   string        // synchronous_commit of the live producer sessions
	Out          string        // results file ("" = default)
	LatencyCSV   string        // directory for per-event live latencies ("" = none)
	CPUProfile   string        // directory for relay CPU profiles ("" = run the walbox binary)
	Sets         []string      // overrides of the relay config, key.path=value
	Peers        bool          // run the polling baseline and Watermill too
	RelayEnv     string        // KEY=VAL,... added to the relay's environment
	Fsync        bool          // the cluster's fsync and synchronous_commit (on: as users run it)
	Profiles     bool          // -cpuprofile into bench/results/profiles
	MaxConns     int           // closed-loop producers of the maximum-rate phase
	ConsoleOnly  bool          // run only the web console's cost (console.go)
	// ServerProfile: with `go run . atomic`, a CPU profile of this process
	// (the embedded nats-server) during each catch-up, in this directory.
	ServerProfile string
	// TracePairs: with `go run . tracing`, that many pairs of fresh
	// relays' catch-ups, tracing off and at 1 %, alternated.
	TracePairs int
}

func parseFlags() (params, error) {
	quick := flag.Bool("quick", false, "small run (50,000-event backlog, one round, 4 s per live rate, 200,000-row transaction, 5,000-event peer backlog)")
	events := flag.Int("events", 0, "catch-up backlog size (default 300000; -quick 50000)")
	rounds := flag.Int("rounds", 0, "catch-up rounds, each: the relay, both ceilings, the relay without the processed flag; medians are reported (default 3; -quick 1)")
	peerEvents := flag.Int("peer-events", 0, "catch-up backlog of the peers (default 100000; -quick 5000): the pollers drain at a steady rate")
	big := flag.Int("big", 0, "rows of the single large transaction (default 1000000; -quick 200000)")
	rates := flag.String("rates", "", "live rates in events/s, comma separated (default 1000,2000,5000; -quick 1000,2000)")
	liveFor := flag.Duration("live", 0, "duration of each live rate (default 20s; -quick 4s)")
	stall := flag.Duration("stall", 60*time.Second, "abort a phase that makes no progress for this long")
	sync := flag.String("producer-sync-commit", "on", "synchronous_commit of the live producer sessions (the cluster default is off)")
	out := flag.String("out", "", "results file (default bench/results/latest.md, or latest-quick.md with -quick)")
	latCSV := flag.String("latency-csv", "", "write each live event's commit time and latency to DIR/live-<rate>.csv")
	cpuprof := flag.String("cpuprofile", "", "run the relay in-process of a bench child with a CPU profile per phase in DIR (figures include profiling overhead)")
	peers := flag.Bool("peers", true, "also run the polling baseline and the Watermill forwarder on the same workloads")
	relayEnv := flag.String("relay-env", "", "extra environment of the walbox relay, KEY=VAL,... (e.g. GOMAXPROCS=1, GOGC=200)")
	fsync := flag.String("fsync", "on", "the cluster's fsync, synchronous_commit and full_page_writes: on (as users run PostgreSQL) or off (a labelled variant, pgtest's fast defaults)")
	profiles := flag.Bool("profiles", false, "like -cpuprofile, into bench/results/profiles (see its README)")
	consoleOnly := flag.Bool("console-only", false, "measure only the web console's cost: relay CPU at 1,000 events/s without the console and with one live-tail viewer, 3 rounds alternated (-live sets each run's length); results in bench/results/console.md")
	var sets multiFlag
	tracePairs := flag.Int("pairs", 0, "with `go run . tracing`: also that many pairs of catch-ups by fresh relays, tracing off and at 1 %, the order flipped each pair, compared by relay CPU per event")
	serverProf := flag.String("server-profile", "", "with `go run . atomic`: a CPU profile of the embedded nats-server during each catch-up, written to DIR, and the busy share of the stream's loop in the report")
	flag.Var(&sets, "set", "override a key of the relay's config, e.g. -set sweeper.mark_processed=false (repeatable)")
	flag.Parse()
	p := params{
		Quick: *quick, Events: 300_000, TxnRows: 10, Loaders: 4, PayloadBytes: 200,
		Rates: []int{1000, 2000, 5000}, LiveFor: 20 * time.Second, BigRows: 1_000_000,
		PeerEvents: 100_000, Rounds: 3, Window: 1024, Stall: *stall, SyncCommit: *sync, Out: *out, LatencyCSV: *latCSV, CPUProfile: *cpuprof, Sets: sets, Peers: *peers, RelayEnv: *relayEnv,
		Profiles: *profiles, MaxConns: 40, ConsoleOnly: *consoleOnly, ServerProfile: *serverProf, TracePairs: *tracePairs,
	}
	switch *fsync {
	case "on":
		p.Fsync = true
	case "off":
	default:
		return p, fmt.Errorf("-fsync: %q is neither on nor off", *fsync)
	}
	if p.Profiles && p.CPUProfile != "" {
		return p, errors.New("-profiles and -cpuprofile: give one")
	}
	if p.Quick {
		p.Events, p.Rates, p.LiveFor, p.BigRows, p.PeerEvents = 50_000, []int{1000, 2000}, 4*time.Second, 200_000, 5_000
		p.Rounds = 1
	}
	if *events > 0 {
		p.Events = *events
	}
	if *rounds > 0 {
		p.Rounds = *rounds
	}
	if *peerEvents > 0 {
		p.PeerEvents = *peerEvents
	}
	if *big > 0 {
		p.BigRows = *big
	}
	if *liveFor > 0 {
		p.LiveFor = *liveFor
	}
	if *rates != "" {
		p.Rates = nil
		for _, f := range strings.Split(*rates, ",") {
			r, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || r <= 0 {
				return p, fmt.Errorf("-rates: %q is not a positive number", f)
			}
			p.Rates = append(p.Rates, r)
		}
	}
	if p.Events < p.TxnRows {
		return p, fmt.Errorf("-events must be at least %d", p.TxnRows)
	}
	if p.Stall < 5*time.Second {
		return p, errors.New("-stall must be at least 5s")
	}
	return p, nil
}

func main() {
	if len(os.Args) == 4 && os.Args[1] == profiledRelayArg {
		os.Exit(runProfiledRelay(os.Args[2], os.Args[3]))
	}
	if len(os.Args) == 7 && os.Args[1] == publisherArg {
		os.Exit(runPublisher(os.Args[2], os.Args[3], os.Args[4], os.Args[5], os.Args[6]))
	}
	if len(os.Args) == 5 && os.Args[1] == bareRelayArg {
		os.Exit(runBareRelay(os.Args[2], os.Args[3], os.Args[4]))
	}
	if len(os.Args) == 5 && os.Args[1] == pollRelayArg {
		os.Exit(runPollRelay(os.Args[2], os.Args[3], os.Args[4]))
	}
	if len(os.Args) >= 2 && os.Args[1] == maintenanceArg {
		if err := runMaintenanceBench(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "bench: FAILED:", err)
			os.Exit(1)
		}
		return
	}
	pgsideOnly := len(os.Args) >= 2 && os.Args[1] == pgsideArg
	atomicOnly := len(os.Args) >= 2 && os.Args[1] == atomicArg
	claimOnly := len(os.Args) >= 2 && os.Args[1] == claimArg
	tracingOnly := len(os.Args) >= 2 && os.Args[1] == tracingArg
	if pgsideOnly || atomicOnly || claimOnly || tracingOnly {
		os.Args = append(os.Args[:1], os.Args[2:]...)
	}
	p, err := parseFlags()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	b := &bench{p: p, start: time.Now()}
	switch {
	case pgsideOnly:
		err = runPGSide(ctx, b)
	case atomicOnly:
		err = runAtomic(ctx, b)
	case claimOnly:
		err = runClaim(ctx, b)
	case tracingOnly:
		err = runTracing(ctx, b)
	default:
		err = b.run(ctx)
	}
	interrupted := ctx.Err() != nil
	stop()
	b.logf("cleanup: stopping the relay, PostgreSQL and nats-server, removing temp dirs")
	b.cleanup()
	if err != nil {
		if interrupted {
			fmt.Fprintln(os.Stderr, "bench: interrupted")
			os.Exit(130)
		}
		fmt.Fprintln(os.Stderr, "bench: FAILED:", err)
		os.Exit(1)
	}
}

// bench is one run: its servers, the relay binary and the results.
type bench struct {
	p     params
	start time.Time

	mu       sync.Mutex
	cleanups []func()

	env  *environment
	res  results
	otlp *otlpSink // where traced relays export (tracing.go)
	// keepProfile, when set, is where the profiled traced catch-up's
	// profile is copied (go run . tracing).
	keepProfile string
	// serverProfiles counts the nats-server profiles written (atomic.go).
	serverProfiles int

	seen      map[int]procSample // children of the postmaster and of this process, most CPU seen
	accounted map[int]bool       // ... and those known to be gone
}

// onCleanup registers f to run at the end, in reverse order of registration.
func (b *bench) onCleanup(f func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cleanups = append(b.cleanups, f)
}

func (b *bench) cleanup() {
	b.mu.Lock()
	fs := b.cleanups
	b.cleanups = nil
	b.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}

// logf prints one progress line with the time since the start.
func (b *bench) logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[%6.1fs] %s\n", time.Since(b.start).Seconds(), fmt.Sprintf(format, args...))
}

func (b *bench) run(ctx context.Context) error {
	mode := "full"
	if b.p.Quick {
		mode = "quick"
	}
	b.logf("walbox bench (%s): backlog %d events, live %v for %v each, one %d-row transaction",
		mode, b.p.Events, b.p.Rates, b.p.LiveFor, b.p.BigRows)
	env, err := b.setup(ctx)
	if err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	b.env = env
	b.res.env = env.info
	if b.otlp, err = b.startOTLPSink(); err != nil {
		return err
	}
	if b.p.Profiles {
		b.p.CPUProfile = filepath.Join(env.moduleDir, "bench", "results", "profiles")
		b.logf("relay CPU profiles go to %s", b.p.CPUProfile)
	}
	// Other load on the machine skews every figure: measure it for a second.
	m := b.startPhase(0)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Second):
	}
	b.res.idleBusy, b.res.idleWhere, _ = m.stop()
	if b.res.idleBusy > 0.10 {
		b.logf("WARNING: the machine is %.0f%% busy before the benchmark starts (%s); the figures will be noisy",
			b.res.idleBusy*100, b.res.whereString(b.res.idleWhere))
	}
	if b.p.ConsoleOnly {
		return b.consoleOnly(ctx)
	}
	if err := b.catchUp(ctx); err != nil {
		return fmt.Errorf("catch-up: %w", err)
	}
	if err := b.live(ctx); err != nil {
		return fmt.Errorf("live latency: %w", err)
	}
	if err := b.bigTxn(ctx); err != nil {
		return fmt.Errorf("large transaction: %w", err)
	}
	if b.p.Peers {
		if err := b.peers(ctx); err != nil {
			return fmt.Errorf("peers: %w", err)
		}
	}
	if err := b.claimCheck(ctx); err != nil { // after walbox's other phases and the peers: its slots and servers are its own
		return fmt.Errorf("claim check: %w", err)
	}
	pgside, err := b.pgSide(ctx) // last: the other phases' figures stay comparable with earlier runs
	if err != nil {
		return fmt.Errorf("pgside: %w", err)
	}
	b.res.params = b.p
	b.res.finished = time.Now()
	b.res.took = time.Since(b.start)
	table := b.res.render()
	fmt.Println()
	fmt.Print(b.res.text(table))
	fmt.Print(pgside.markdown())
	out := b.p.Out
	if out == "" {
		name := "latest.md"
		if b.p.Quick {
			name = "latest-quick.md"
		}
		out = filepath.Join(env.moduleDir, "bench", "results", name)
		switch {
		case b.p.CPUProfile != "": // profiled figures are not the results
			out = filepath.Join(b.p.CPUProfile, "results.md")
		case len(b.p.Sets) > 0: // neither are those of another config
			out = filepath.Join(env.moduleDir, "bench", "results", "latest-custom.md")
		case !b.p.Fsync: // nor those of the fsync=off variant
			name = strings.TrimSuffix(name, ".md") + "-fsync-off.md"
			out = filepath.Join(env.moduleDir, "bench", "results", name)
		}
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	png := strings.TrimSuffix(out, ".md") + ".png"
	if err := b.res.writeChart(png); err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	b.res.chart = filepath.Base(png)
	if err := os.WriteFile(out, []byte(b.res.markdown(table)+pgside.markdown()), 0o644); err != nil {
		return err
	}
	b.logf("done: results written to %s and %s", out, png)
	return nil
}

// watch returns a context that is cancelled, with a clear cause, when
// progress() has returned the same value for the stall limit. progress must
// be cheap and bounded; it is called once a second. It also prints a
// progress line every 10 s for long phases.
func (b *bench) watch(ctx context.Context, what string, progress func() int64, show func(int64) string) (context.Context, func()) {
	wctx, cancel := context.WithCancelCause(ctx)
	go func() {
		last, lastChange, lastShown := progress(), time.Now(), time.Now()
		tk := time.NewTicker(time.Second)
		defer tk.Stop()
		for {
			select {
			case <-wctx.Done():
				return
			case <-tk.C:
			}
			v := progress()
			if show != nil && time.Since(lastShown) >= 10*time.Second {
				b.logf("  ... %s: %s", what, show(v))
				lastShown = time.Now()
			}
			if v != last {
				last, lastChange = v, time.Now()
				continue
			}
			if time.Since(lastChange) >= b.p.Stall {
				cancel(fmt.Errorf("%s made no progress for %s (stuck at %d); aborting", what, b.p.Stall, v))
				return
			}
		}
	}()
	return wctx, func() { cancel(nil) }
}

// cause returns why ctx ended: the watchdog's reason when it fired.
func cause(ctx context.Context, err error) error {
	if c := context.Cause(ctx); c != nil && ctx.Err() != nil {
		return c
	}
	return err
}

// multiFlag collects a repeatable string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }
