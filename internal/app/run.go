// Package app wires walbox's parts from a Config: the cdc source, the
// JetStream sink, the relay and the HTTP endpoints. The CLI and the dev
// command call it; it holds no delivery logic of its own.
package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/redact"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/claim"
	"github.com/walbox/walbox/relay/jssink"
)

// Options adjust Run for embedding (tests, walbox dev).
type Options struct {
	// Registry receives the metrics; nil makes a fresh one.
	Registry *prometheus.Registry
	// OnDelivered is passed to the relay (see relay.Config.OnDelivered).
	OnDelivered func(relay.Delivered)
	// Ready, if set, is closed once the relay has started streaming.
	Ready chan<- struct{}
	// Reload, if set, reads the configuration again (file, environment,
	// flags): when the publication sends a table that is not configured,
	// the relay looks for it there, so a table added to outboxes and the
	// publication (walbox migrate) is published without a restart.
	Reload func() (config.Config, error)
	// Console, if set and console.enabled, makes the web console, served
	// on the metrics listener at /ui/ (cmd/walbox passes internal/console).
	Console func(Live) http.Handler
}

// Run relays until ctx is cancelled. It returns nil after a clean shutdown.
func Run(ctx context.Context, cfg config.Config, log zerolog.Logger, opts Options) error {
	tables, err := cfg.Tables()
	if err != nil {
		return err
	}
	pgcfg, err := pgconn.ParseConfig(cfg.Postgres.URL)
	if err != nil {
		return &config.Error{Key: "postgres.url", Msg: err.Error()}
	}
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	tracer, traceRatio, stopTracing, err := startTracing(ctx, cfg.OTel, log, reg)
	if err != nil {
		return err
	}
	defer stopTracing()
	// The relay's metrics keep their names on both buses, with a sink label.
	sinkReg := prometheus.WrapRegistererWith(prometheus.Labels{"sink": cfg.Sink}, reg)
	metrics := relay.NewMetrics(sinkReg)
	ts := &tableSet{cfg: cfg, log: log, reg: reg, tables: tables, reload: opts.Reload}

	// The leader lock of the current term: the source checks it before
	// every replication session.
	var leader atomic.Pointer[cdc.Leadership]
	src, err := newSource(cfg, ts, metrics, log, &leader)
	if err != nil {
		return err
	}

	bus, err := openBus(ctx, cfg, pgcfg.Database, log, metrics, sinkReg)
	if err != nil {
		return err
	}
	defer bus.close()

	var srv *http.Server
	health := newHealth(src.Connected, bus.up, bus.name, cfg.Metrics.LivenessTimeout, cfg.Metrics.StuckAfter)
	if cfg.Metrics.Listen != "" {
		var ui http.Handler
		if opts.Console != nil && cfg.Console.Enabled {
			ui = opts.Console(live(health, ts, reg))
		}
		srv, err = serveHTTP(cfg.Metrics.Listen, reg, health, ui)
		if err != nil {
			return err
		}
		defer srv.Close()
	}

	routes, err := bus.ensure(ctx)
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil
	}
	source := pgcfg.Database + "/" + cfg.Postgres.Slot
	ts.template = bus.template
	router, err := relay.NewRouterWithOptions(bus.prefix, source, routes, ts.routerOptions(tables[0]))
	if err != nil {
		return err
	}
	ts.router = router
	if bus.claim != nil {
		router.SetClaimThreshold(bus.claim.Threshold())
		bucket := cfg.ClaimBucketSpec().Name
		if cfg.ClaimS3() {
			bucket = "s3://" + cfg.ClaimCheck.S3.Bucket
		}
		log.Info().Str("bucket", bucket).Int("threshold", bus.claim.Threshold()).
			Msg("claim check on: larger payloads go to the object store, their messages carry a reference")
	}
	if bus.claimSweep != nil {
		sweepCtx, stopSweep := context.WithCancel(ctx)
		swept := make(chan struct{})
		go func() { defer close(swept); bus.claimSweep.Run(sweepCtx, cfg.ClaimCheck.SweepInterval) }()
		defer func() { stopSweep(); <-swept }()
	}
	// Dropped marks are caught up from what the streams hold, and at start
	// the newest messages of each stream are read back for the marks a crash
	// left unwritten (at most each table's mark queue, which its sweeper
	// knows, and the publish window).
	readStreams := []string{bus.dlqStream}
	for _, rt := range routes {
		if !slices.Contains(readStreams, rt.Stream) {
			readStreams = append(readStreams, rt.Stream)
		}
	}
	ts.reader, ts.source, ts.streams, ts.window = bus.reader, source, readStreams, 2*cfg.NATS.Window
	// A sweeper per table marks acked rows and maintains partitions and
	// the archive; stopping them writes the marks of the relay's final acks.
	if err := ts.start(ctx); err != nil {
		return err
	}
	defer ts.stop()
	r := relay.New(relay.Config{
		Window:         cfg.NATS.Window,
		WindowBytes:    cfg.NATS.WindowBytes / 4,
		DLQPrefix:      cfg.NATS.DLQ.SubjectPrefix,
		DLQSubject:     bus.dlqSubject,
		StrictOrder:    bus.strict,
		RequireTail:    bus.requireTail,
		TailTimeout:    bus.tailTimeout,
		BackoffInitial: cfg.Retry.Initial,
		BackoffMax:     cfg.Retry.Max,
		OnDelivered:    ts.hook(opts.OnDelivered),
		Alive:          health.alive,
		Metrics:        metrics,
		Logger:         log,
		Tracer:         tracer,
		TraceSystem:    cfg.Sink,
		TraceRatio:     traceRatio,
	}, bus.sink, router)
	health.watch(r.Progress)
	health.started.Store(true)
	if opts.Ready != nil {
		go signalReady(ctx, src, opts.Ready)
	}
	log.Info().Str("postgres", redact.PostgresURL(cfg.Postgres.URL)).Str("sink", cfg.Sink).Str("bus", bus.url).Str("slot", cfg.Postgres.Slot).
		Strs("tables", tableNames(tables)).Int("window", cfg.NATS.Window).Msg("walbox relay starting")
	return lead(ctx, cfg, log, r, src, bus, health, metrics, &leader)
}

// signalReady closes ready once the source streams.
func signalReady(ctx context.Context, src *cdc.Source, ready chan<- struct{}) {
	for !src.Connected() {
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
	close(ready)
}

// lead streams while this relay holds the slot's leader lock, waits as a
// standby while another does, and takes over when the leader dies, until
// ctx ends (nil) or the relay fails for good.
func lead(ctx context.Context, cfg config.Config, log zerolog.Logger, r *relay.Relay, src *cdc.Source, bus *bus, health *health, metrics *relay.Metrics, leader *atomic.Pointer[cdc.Leadership]) error {
	for {
		// Several relays may run for one database: one holds the leader
		// lock and streams, the others wait here and take over when it dies.
		// Each poll of the lock is a turn of the main loop (liveness).
		health.alive()
		var lastWarn time.Time
		told := false
		lock, err := cdc.AcquireLeadership(ctx, cfg.Postgres.URL, cfg.Postgres.Slot, time.Second, func() {
			health.standingBy()
			if !told {
				told = true
				log.Info().Str("slot", cfg.Postgres.Slot).Msg("standby: another walbox holds the leader lock for this slot; waiting to take over")
			}
		}, func(err error) {
			health.cannotAsk()
			// Once, then every 30 s: the cause, not a silent loop.
			if time.Since(lastWarn) >= 30*time.Second {
				lastWarn = time.Now()
				log.Warn().Err(err).Str("postgres", redact.PostgresURL(cfg.Postgres.URL)).Msg("cannot connect to PostgreSQL; retrying every second")
			}
		})
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("take leader lock: %w", err)
		}
		health.lead(true)
		leader.Store(lock)
		metrics.Leader.Set(1)
		log.Info().Str("slot", cfg.Postgres.Slot).Msg("leader: streaming")
		runCtx, cancel := context.WithCancel(ctx)
		var fenced <-chan struct{}
		if bus.takeOver != nil {
			// The fence comes first: the previous leader, if it is only
			// paused, can store nothing from now on, so what the relay
			// reads back is final.
			if err := bus.takeOver(runCtx); err != nil {
				cancel()
				health.lead(false)
				leader.Store(nil)
				lock.Release()
				metrics.Leader.Set(0)
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			fenced = bus.fenced()
		}
		var wasFenced atomic.Bool
		go func() {
			select {
			case <-lock.Lost():
				log.Warn().Msg("leader lock session lost; stopping to let a live relay lead")
				cancel()
			case <-fenced:
				wasFenced.Store(true)
				log.Warn().Msg("fenced by another walbox's producer; stopping to let it lead")
				cancel()
			case <-runCtx.Done():
			}
		}()
		status := &relay.StatusWriter{ConnString: cfg.Postgres.URL, Slot: cfg.Postgres.Slot, Relay: r, Confirmed: src.Confirmed, Log: log}
		go status.Run(runCtx)
		go monitorSlot(runCtx, cfg.Postgres.URL, cfg.Postgres.Slot, 5*time.Second, r, metrics, log)
		err = r.Serve(runCtx, src)
		cancel()
		health.lead(false)
		leader.Store(nil)
		lock.Release()
		metrics.Leader.Set(0)
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			log.Info().Stringer("confirmed", src.Confirmed()).Msg("walbox relay stopped")
			return nil
		}
		if wasFenced.Load() {
			// Whoever fenced this relay leads now, or shares its
			// transactional id by mistake: do not fence it back at once.
			// The wait is a turn of the main loop every second (liveness).
			if !waitAlive(ctx, cfg.Retry.Max, health) {
				return nil
			}
		}
	}
}

// waitAlive waits d, recording a turn of the main loop every second; false
// when ctx ended first.
func waitAlive(ctx context.Context, d time.Duration, h *health) bool {
	end := time.NewTimer(d)
	defer end.Stop()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-end.C:
			return true
		case <-tick.C:
			h.alive()
		}
	}
}

// newSource is the cdc source of the configured slot and tables.
func newSource(cfg config.Config, ts *tableSet, metrics *relay.Metrics, log zerolog.Logger, leader *atomic.Pointer[cdc.Leadership]) (*cdc.Source, error) {
	cdcTables, defaultTable := ts.cdcTables()
	return cdc.NewSource(cdc.Config{
		ConnString:        cfg.Postgres.URL,
		Slot:              cfg.Postgres.Slot,
		Publication:       cfg.Postgres.Publication,
		Tables:            cdcTables,
		DefaultTable:      defaultTable,
		OnUnknownTable:    ts.unknown,
		CreatePublication: cfg.Postgres.CreatePublication,
		StatusInterval:    cfg.Postgres.StatusInterval,
		BatchSize:         cfg.NATS.Window / 2,
		BatchBytes:        cfg.NATS.WindowBytes / 8,
		BackoffInitial:    cfg.Retry.Initial,
		BackoffMax:        cfg.Retry.Max,
		FailOnSlotLost:    cfg.Postgres.OnSlotLost == "fail",
		FailoverSlot:      cfg.Postgres.FailoverSlot,
		Origin:            cfg.Postgres.Origin,
		OnSlotLost:        func(reason, _ string) { metrics.SlotLost.WithLabelValues(reason).Inc() },
		OnReconnect:       func() { metrics.Reconnects.WithLabelValues("postgres").Inc() },
		HeartbeatInterval: cfg.Postgres.HeartbeatInterval,
		SessionGate: func(ctx context.Context) error {
			if l := leader.Load(); l != nil {
				return l.Check(ctx)
			}
			return nil
		},
		Logger: log,
	})
}

// connectNATS connects with unlimited reconnects. The reconnect buffer is off:
// while disconnected a publish fails at once, and the relay backs off and
// resends in order, instead of the library buffering behind its back.
func connectNATS(ctx context.Context, cfg config.Config, log zerolog.Logger, m *relay.Metrics, lastErr *atomic.Pointer[error]) (*nats.Conn, error) {
	nlog := log.With().Str("component", "nats").Logger()
	auth, err := NATSOptions(cfg.NATS)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(cfg.NATS.URL, append(auth,
		nats.Name("walbox"),
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(time.Second),
		nats.ReconnectJitter(200*time.Millisecond, time.Second),
		nats.ReconnectBufSize(-1),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err == nil {
				return // our own Close at shutdown
			}
			nlog.Warn().Err(err).Msg("disconnected from NATS")
		}),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				lastErr.Store(&err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) {
			m.Reconnects.WithLabelValues("nats").Inc()
			nlog.Info().Str("url", c.ConnectedUrlRedacted()).Msg("reconnected to NATS")
		}),
	)...)
	if err != nil {
		return nil, &config.Error{Key: "nats.url", Msg: ScrubNATSError(err, cfg.NATS)}
	}
	return nc, nil
}

// jsErrClusterNoPeers is JetStream's "no suitable peers for placement"
// (nats-server's JSClusterNoPeersErr; nats.go names no constant for it).
const jsErrClusterNoPeers jetstream.ErrorCode = 10005

// ensureStreams creates or checks the configured streams, retrying while
// NATS is unreachable: an outage at start is an outage like any other.
func ensureStreams(ctx context.Context, sink *jssink.Sink, store *claim.JetStreamStore, cfg config.Config, log zerolog.Logger, lastErr *atomic.Pointer[error]) ([]relay.Route, error) {
	return retryEnsure(ctx, cfg, 10*time.Second,
		func(ctx context.Context) ([]relay.Route, error) {
			routes, paths, err := jssink.EnsureStreams(ctx, sink.JetStream(), cfg.StreamSpecs())
			if err != nil {
				return nil, err
			}
			if store != nil {
				if err := store.Ensure(ctx); err != nil {
					return nil, err
				}
			}
			for _, p := range paths {
				if p.Atomic {
					log.Info().Str("stream", p.Stream).Msg("publishing each transaction in an atomic batch (nats.atomic_transactions)")
				} else if p.Batch {
					log.Info().Str("stream", p.Stream).Str("why", p.Why).Msg("publishing in fast batches while the stream is busy, per message otherwise")
				} else {
					log.Info().Str("stream", p.Stream).Str("why", p.Why).Msg("publishing per message")
				}
			}
			sink.SetBatching(jssink.Batching{Paths: paths, Window: cfg.NATS.Window, WindowBytes: cfg.NATS.WindowBytes, After: cfg.NATS.FastBatchAfter, OnFallBack: func(p jssink.PublishPath) {
				log.Warn().Str("stream", p.Stream).Str("why", p.Why).Msg("batches off for this stream: publishing per message")
			}})
			return routes, nil
		},
		func(err error) (retry, permanent error) {
			stop, err := streamsError(err)
			if stop {
				return nil, err
			}
			if nc := sink.Conn(); !nc.IsConnected() {
				// Not an API error: the connection is not up. Say why, not
				// what the unsent request ran into.
				cause := nc.LastError()
				if p := lastErr.Load(); p != nil {
					cause = *p
				}
				if cause == nil {
					cause = errors.New("not connected yet")
				}
				err = fmt.Errorf("cannot reach NATS at %s: %w", ScrubNATSError(errors.New(cfg.NATS.URL), cfg.NATS), cause)
			}
			return err, nil
		},
		func(err error, wait time.Duration) {
			log.Warn().Err(err).Str("retry_in", wait.Round(time.Millisecond).String()).Msg("JetStream not ready; retrying")
		})
}

// streamsError sorts an error of creating or checking the streams: a
// configuration no retry cures (permanent, returned with its fix), or an
// outage to wait out (retried, with what to check when it lasts).
func streamsError(err error) (permanent bool, out error) {
	var apiErr *jetstream.APIError
	switch {
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.ErrorCode(10074):
		// replicas > 1 on a server that is not clustered: no retry helps.
		return true, &config.Error{Key: "nats.streams[].replicas",
			Msg: fmt.Sprintf("%v: the NATS server is not clustered; set replicas: 1 (durable only with sync_interval: always on the server) or run a NATS cluster of at least that many nodes", err)}
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrClusterNoPeers:
		// No suitable peers: a node is offline (a rolling restart, a
		// cluster that has just started and not heard from every peer) or
		// the cluster is smaller than replicas. The first two pass.
		return false, fmt.Errorf("%w (waiting for enough JetStream peers; if the cluster has fewer nodes than nats.streams[].replicas, lower replicas)", err)
	case errors.As(err, &apiErr) && apiErr.Code >= 400 && apiErr.Code < 500 && apiErr.ErrorCode != jetstream.JSErrCodeStreamNotFound:
		// The stream API refused the configuration itself (these are not
		// publish errors: jssink's table does not apply).
		return true, fmt.Errorf("%w (fix nats.streams in the config, or the stream on the server)", err)
	}
	return false, err
}

func serveHTTP(addr string, reg *prometheus.Registry, h *health, ui http.Handler) (*http.Server, error) {
	mux := http.NewServeMux()
	mountConsole(mux, ui)
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	// Probes: docs/kubernetes.md says what each checks and why.
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		ok, why := h.live()
		answer(w, ok, why)
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		ok, _, why := h.ready()
		answer(w, ok, why)
	})
	mux.HandleFunc("/leader", func(w http.ResponseWriter, _ *http.Request) {
		_, leader, why := h.ready()
		answer(w, leader, why)
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, &config.Error{Key: "metrics.listen", Msg: fmt.Sprintf("cannot listen on %s: %v (set metrics.listen to a free address, or \"\" to disable)", addr, err)}
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	return srv, nil
}

// answer writes a probe's verdict: 200 or 503, and why, on one line.
func answer(w http.ResponseWriter, ok bool, why string) {
	if !ok {
		http.Error(w, why, http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintln(w, why)
}

func tableNames(ts []config.Table) []string {
	out := make([]string, len(ts))
	for i, t := range ts {
		out[i] = t.Name.String()
	}
	return out
}
