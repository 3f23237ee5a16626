package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Tracing's cost (issue 37): the catch-up and the live 1,000/s again with
// the relay exporting a span per event over OTLP/HTTP to a sink in this
// process, sampled at 1 % and at 100 %, beside the same runs with tracing
// off (phases 1 and 2).

// traceRatios are the sampled shares measured, as WALBOX_OTEL_SAMPLE_RATIO.
var traceRatios = []string{"0.01", "1"}

// otlpSink takes OTLP/HTTP exports and drops them: what a collector does
// first, counted.
type otlpSink struct {
	url      string
	requests atomic.Int64
	bytes    atomic.Int64
}

// startOTLPSink listens on localhost until the benchmark's cleanup.
func (b *bench) startOTLPSink() (*otlpSink, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("OTLP sink: %w", err)
	}
	s := &otlpSink{url: "http://" + ln.Addr().String()}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		s.requests.Add(1)
		s.bytes.Add(n)
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK) // an empty ExportTraceServiceResponse
	})}
	go func() { _ = srv.Serve(ln) }()
	b.onCleanup(func() { _ = srv.Close() })
	return s, nil
}

// traceEnv is the relay's environment for sampled share ratio.
func (b *bench) traceEnv(ratio string) []string {
	return []string{"WALBOX_OTEL_ENDPOINT=" + b.otlp.url, "WALBOX_OTEL_SAMPLE_RATIO=" + ratio, "OTEL_BSP_SCHEDULE_DELAY=1000"}
}

// catchUpTraced is phase 1 again with tracing on at ratio.
func (b *bench) catchUpTraced(ctx context.Context, ratio string, res *catchupResult) error {
	res.Events = b.p.Events
	b.logf("catch-up with tracing (sampled %s): loading %d events while the relay is stopped", ratio, b.p.Events)
	var err error
	if res.LoadTook, err = b.loadBacklog(ctx, "bench.catchup.traced", b.p.Events); err != nil {
		return err
	}
	return b.relayCatchup(ctx, "catch-up-traced-"+ratio, res, b.traceEnv(ratio)...)
}

// liveTraced runs 1,000/s (the first live rate) again with a fresh relay
// exporting spans, once per ratio; at 1 % as pairs of fresh relays, one
// with tracing off and one at 1 %, the order flipped each pair: the p99 of
// one fresh relay differs from the next by more than the 10 % the target
// allows, and a pair's two runs share the machine's state.
func (b *bench) liveTraced(ctx context.Context, pool *pgxpool.Pool) error {
	if len(b.p.Rates) == 0 {
		return nil
	}
	rate := b.p.Rates[0]
	run := func(ratio, name string) (liveResult, error) {
		if err := b.vacuum(ctx, "the last live run marked its rows"); err != nil {
			return liveResult{}, err
		}
		env := b.traceEnv(ratio)
		if ratio == "" {
			env = nil
		}
		b.logf("live: starting the relay with tracing %s", cmp.Or(ratio, "off"))
		t, err := b.walboxLive(ctx, pool, "live-traced-"+name, "walbox-traced-"+name, "bench.live.traced."+name, env...)
		if err != nil {
			return liveResult{}, err
		}
		res, err := b.liveRate(ctx, t, rate)
		if serr := b.stopRelay(t.proc); err == nil {
			err = serr
		}
		return res, err
	}
	if b.res.liveTraced == nil {
		b.res.liveTraced = map[string]liveResult{}
	}
	for _, ratio := range traceRatios {
		if ratio == "0.01" {
			continue
		}
		res, err := run(ratio, ratio)
		if err != nil {
			return err
		}
		b.res.liveTraced[ratio] = res
	}
	pairs := 3
	if b.p.Quick {
		pairs = 2
	}
	for i := range pairs {
		var p tracePair
		for _, on := range []bool{i%2 == 0, i%2 != 0} {
			ratio, name := "", fmt.Sprintf("off-p%d", i)
			if on {
				ratio, name = "0.01", fmt.Sprintf("0.01-p%d", i)
			}
			res, err := run(ratio, name)
			if err != nil {
				return err
			}
			if on {
				p.On = res
			} else {
				p.Off = res
			}
		}
		b.res.tracePairs = append(b.res.tracePairs, p)
	}
	b.logf("tracing: the OTLP sink took %d exports, %.1f MB", b.otlp.requests.Load(), mb(b.otlp.bytes.Load()))
	return nil
}

// tracePair is one pair of fresh relays at the first live rate: tracing
// off and sampled at 1 %.
type tracePair struct{ Off, On liveResult }

// tracePairLines: the p99 and CPU of the pairs, the p99's verdict on the
// median of the pairs' ratios.
func (r *results) tracePairLines(add func(what, value, target, verdict string)) {
	if len(r.tracePairs) == 0 {
		return
	}
	var p99s, cpus []float64
	var parts []string
	for _, p := range r.tracePairs {
		if p.Off.P99 <= 0 || p.Off.Events == 0 || p.On.Events == 0 {
			continue
		}
		p99s = append(p99s, float64(p.On.P99)/float64(p.Off.P99))
		cpus = append(cpus, float64(perEvent(p.On.CPU, p.On.Events))/float64(perEvent(p.Off.CPU, p.Off.Events)))
		parts = append(parts, fmt.Sprintf("%s/%s, %.1f/%.1f µs", ms(p.On.P99), ms(p.Off.P99), us(perEvent(p.On.CPU, p.On.Events)), us(perEvent(p.Off.CPU, p.Off.Events))))
	}
	if len(p99s) == 0 {
		return
	}
	rate := r.tracePairs[0].On.Rate
	add(fmt.Sprintf("%d/s, fresh relays in pairs, sampled 1 %% / off: commit → ack p99 and relay CPU per event, per pair", rate), strings.Join(parts, "; "), "", "")
	mp, mc := median(p99s), median(cpus)
	add(fmt.Sprintf("target: %d/s, p99 at 1 %% ÷ off (median of the pairs' ratios); CPU per event the same way", rate),
		fmt.Sprintf("%.2f; CPU %.3f (%+.1f %%, see the profile's row)", mp, mc, (mc-1)*100), "p99 ≤ 1.1× off", verdict(mp <= 1.1))
}

// tracingFrame: a function of tracing's in a relay's profile: the
// OpenTelemetry API, SDK and exporter, walbox's tracer (internal/leantrace)
// and span code (relay/trace.go), and the HTTP client's connection
// goroutines (the OTLP exporter is the only HTTP client of a relay
// configured as the bench's). A sample counts when any frame of its
// stack is one: the protobuf and allocation work under them count too.
func tracingFrame(fn string) bool {
	return strings.HasPrefix(fn, "go.opentelemetry.io/") ||
		strings.HasPrefix(fn, "github.com/walbox/walbox/internal/leantrace.") ||
		strings.HasPrefix(fn, "github.com/walbox/walbox/relay.(*tracing).") ||
		strings.HasPrefix(fn, "github.com/walbox/walbox/relay.headerCarrier.") ||
		strings.HasPrefix(fn, "net/http.(*persistConn).")
}

// tracedProfiles is tracing's share of the relay's CPU at 1 %, read from
// CPU profiles (pprof's 100 Hz) of one catch-up of five times the backlog
// and one long live window, for the share to rest on 1,000 samples or
// more: fresh
// relays differ among themselves by more than the 3 % the target allows,
// while a profile compares tracing's samples with the others of the same
// seconds.
type tracedProfiles struct {
	CatchUp    *profileShare
	Live       *profileShare
	LiveWindow liveResult
	// CatchUpWhere is where the profiled catch-up's CPU went, by group
	// (breakdown.go), and the samples it rests on.
	CatchUpWhere   string
	CatchUpSamples int64
}

// profileDir points the relay's next starts at a fresh profile directory
// until the returned restore.
func (b *bench) profileDir() (dir string, restore func(), err error) {
	dir, err = os.MkdirTemp("", "walbox-bench-profile-")
	if err != nil {
		return "", nil, err
	}
	saved := b.p.CPUProfile
	b.p.CPUProfile = dir
	return dir, func() { b.p.CPUProfile = saved; _ = os.RemoveAll(dir) }, nil
}

// catchUpTracedProfiled is one more catch-up at 1 %, the relay profiled.
func (b *bench) catchUpTracedProfiled(ctx context.Context) error {
	dir, restore, err := b.profileDir()
	if err != nil {
		return err
	}
	defer restore()
	savedEvents := b.p.Events
	b.p.Events *= 5 // 1,500,000 events: about 1,000 samples of the relay at 7 µs an event
	if b.p.Quick {
		b.p.Events = savedEvents * 3
	}
	defer func() { b.p.Events = savedEvents }()
	var res catchupResult
	res.Events = b.p.Events
	b.logf("catch-up with tracing (sampled 0.01), the relay under a CPU profile: loading %d events while the relay is stopped", b.p.Events)
	if res.LoadTook, err = b.loadBacklog(ctx, "bench.catchup.traced", b.p.Events); err != nil {
		return err
	}
	// Without the processed flag: marking 1,500,000 rows takes the
	// sweeper longer than the bench's stall limit, and the marking's CPU
	// is not tracing's (leaving it out makes tracing's share larger, not
	// smaller). settle marks the rows itself.
	if err := b.relayCatchup(ctx, "catch-up-traced-profiled", &res, append(b.traceEnv("0.01"), "WALBOX_SWEEPER_MARK_PROCESSED=false")...); err != nil {
		return err
	}
	prof := filepath.Join(dir, "relay-catch-up-traced-profiled.pprof")
	share, err := readProfileShare(prof, res.CPU, tracingFrame)
	if err != nil {
		return err
	}
	if b.keepProfile != "" {
		if err := copyFile(prof, b.keepProfile); err != nil {
			return err
		}
	}
	b.res.tracedProfiles.CatchUp = &share
	b.res.tracedProfiles.CatchUpWhere, b.res.tracedProfiles.CatchUpSamples, err = relayBreakdown(prof)
	return err
}

// liveTracedProfiled is one more live window at the first rate, 1 %, the
// relay profiled.
func (b *bench) liveTracedProfiled(ctx context.Context, pool *pgxpool.Pool, window time.Duration) error {
	if len(b.p.Rates) == 0 {
		return nil
	}
	if err := b.vacuum(ctx, "the last live run marked its rows"); err != nil {
		return err
	}
	dir, restore, err := b.profileDir()
	if err != nil {
		return err
	}
	defer restore()
	savedFor := b.p.LiveFor
	b.p.LiveFor = window
	defer func() { b.p.LiveFor = savedFor }()
	b.logf("live: the relay with tracing sampled at 0.01 under a CPU profile, %v", window)
	t, err := b.walboxLive(ctx, pool, "live-traced-profiled", "walbox-traced-profiled", "bench.live.traced.profiled",
		b.traceEnv("0.01")...)
	if err != nil {
		return err
	}
	res, err := b.liveRate(ctx, t, b.p.Rates[0])
	procCPU, cerr := t.proc.cpu()
	if serr := b.stopRelay(t.proc); err == nil {
		err = serr
	}
	if err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	share, err := readProfileShare(filepath.Join(dir, "relay-live-traced-profiled.pprof"), procCPU, tracingFrame)
	if err != nil {
		return err
	}
	b.res.tracedProfiles.Live, b.res.tracedProfiles.LiveWindow = &share, res
	return nil
}

// tracedProfileLines: tracing's share at 1 %, the target's verdict.
func (r *results) tracedProfileLines(add func(what, value, target, verdict string)) {
	tp := r.tracedProfiles
	if c := tp.CatchUp; c != nil && c.Samples > 0 {
		add("catch-up, sampled 1 %, the relay under a CPU profile: samples in tracing's code / all",
			fmt.Sprintf("%d / %d; the heaviest: %s", c.Matched, c.Samples, strings.Join(c.Top, ", ")), "", "")
		hi := c.Upper(c.Share())
		add("target: tracing's share of the relay's CPU at 1 %, catch-up (profile; its 95 % upper bound)", fmt.Sprintf("%.2f %% (≤ %.2f %%)", c.Share()*100, hi*100), "≤ 3 %", verdict(hi <= 0.03))
	}
	if l := tp.Live; l != nil && l.Samples > 0 && tp.LiveWindow.CPU > 0 {
		// Over the relay's life ÷ in the window: the warm-up's and
		// start-up's CPU count against tracing (conservative).
		share := max(l.Share()*float64(l.ProcCPU)/float64(tp.LiveWindow.CPU), l.Share())
		add(fmt.Sprintf("%d/s, sampled 1 %%, the relay under a CPU profile: samples in tracing's code / all; commit → ack p99", tp.LiveWindow.Rate),
			fmt.Sprintf("%d / %d; %s; the heaviest: %s", l.Matched, l.Samples, ms(tp.LiveWindow.P99), strings.Join(l.Top, ", ")), "", "")
		hi := l.Upper(share)
		add(fmt.Sprintf("target: tracing's share of the relay's CPU at 1 %%, %d/s (profile; its 95 %% upper bound)", tp.LiveWindow.Rate), fmt.Sprintf("%.2f %% (≤ %.2f %%)", share*100, hi*100), "≤ 3 %", verdict(hi <= 0.03))
	}
}

// tracingReport adds the cost rows: relay CPU per event and throughput
// (catch-up) or p99 (live) with tracing off, at 1 % and at 100 %.
func (r *results) tracingReport(head func(string), add func(what, value, target, verdict string)) {
	if len(r.tracedRuns) == 0 && len(r.liveTraced) == 0 && len(r.tracePairs) == 0 {
		return
	}
	head("6. Tracing: a span per event exported over OTLP/HTTP, sampled at 1 % and 100 %, beside tracing off")
	defer r.tracedProfileLines(add)
	off := r.catchup
	offCPU := perEvent(off.CPU, off.Events)
	for _, ratio := range traceRatios {
		runs := r.tracedRuns[ratio]
		if len(runs) == 0 {
			continue
		}
		on := medianRun(runs, func(c catchupResult) float64 { return rate(c.Events, c.Took) })
		onCPU := perEvent(on.CPU, on.Events)
		cost := 0.0
		if offCPU > 0 {
			cost = float64(onCPU)/float64(offCPU) - 1
		}
		target, v := "", ""
		if ratio == "0.01" {
			target, v = "≤ 3%", verdict(cost <= 0.03)
			if r.tracedProfiles.CatchUp != nil {
				target, v = "", "see the profile's row"
			}
		}
		add(fmt.Sprintf("catch-up, sampled %s%%: relay CPU per event (off: %.1f µs)", pctRatio(ratio), us(offCPU)),
			fmt.Sprintf("%.1f µs (%+.1f%%); %.0f events/s (off: %.0f)%s", us(onCPU), cost*100, rate(on.Events, on.Took), rate(off.Events, off.Took),
				runsString(runs, func(x catchupResult) float64 { return rate(x.Events, x.Took) })), target, v)
	}
	r.tracePairLines(add)
	for _, ratio := range traceRatios {
		on, ok := r.liveTraced[ratio]
		if !ok || on.Events == 0 {
			continue
		}
		// Tracing off: phase 2's run at the same rate.
		i := slices.IndexFunc(r.live, func(l liveResult) bool { return l.Rate == on.Rate && l.Events > 0 })
		if i < 0 {
			continue
		}
		offLive := r.live[i]
		cost := float64(perEvent(on.CPU, on.Events))/float64(perEvent(offLive.CPU, offLive.Events)) - 1
		// The targets are 1 %'s (the pairs' and the profile's rows); 100 %
		// is what sampling everything costs.
		target, v := "", ""
		if ratio == "0.01" { // from an older run without pairs
			target, v = "≤ 3% CPU, p99 ≤ 1.1× off", verdict(cost <= 0.03 && on.P99 <= time.Duration(float64(offLive.P99)*1.1))
		}
		add(fmt.Sprintf("%d/s, sampled %s%%: relay CPU per event / commit → ack p99", on.Rate, pctRatio(ratio)),
			fmt.Sprintf("%.1f µs (%+.1f%%) / %s; off (phase 2): %.1f µs / %s", us(perEvent(on.CPU, on.Events)), cost*100, ms(on.P99),
				us(perEvent(offLive.CPU, offLive.Events)), ms(offLive.P99)), target, v)
	}
}

func pctRatio(r string) string {
	if r == "1" {
		return "100"
	}
	if r == "0.01" {
		return "1"
	}
	return r
}

// copyFile copies src to dst.
func copyFile(src, dst string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, data, 0o644)
}
