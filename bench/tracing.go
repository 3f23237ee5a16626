package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
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
// exporting spans, once per ratio.
func (b *bench) liveTraced(ctx context.Context, pool *pgxpool.Pool) error {
	if len(b.p.Rates) == 0 {
		return nil
	}
	rate := b.p.Rates[0]
	for _, ratio := range traceRatios {
		if err := b.vacuum(ctx, "the last live run marked its rows"); err != nil {
			return err
		}
		b.logf("live: starting the relay with tracing sampled at %s", ratio)
		t, err := b.walboxLive(ctx, pool, "live-traced-"+ratio, "walbox-traced-"+ratio, "bench.live.traced."+ratio, b.traceEnv(ratio)...)
		if err != nil {
			return err
		}
		res, err := b.liveRate(ctx, t, rate)
		if err != nil {
			return err
		}
		if b.res.liveTraced == nil {
			b.res.liveTraced = map[string]liveResult{}
		}
		b.res.liveTraced[ratio] = res
		if err := b.stopRelay(t.proc); err != nil {
			return err
		}
	}
	b.logf("tracing: the OTLP sink took %d exports, %.1f MB", b.otlp.requests.Load(), mb(b.otlp.bytes.Load()))
	return nil
}

// tracingReport adds the cost rows: relay CPU per event and throughput
// (catch-up) or p99 (live) with tracing off, at 1 % and at 100 %.
func (r *results) tracingReport(head func(string), add func(what, value, target, verdict string)) {
	if len(r.tracedRuns) == 0 && len(r.liveTraced) == 0 {
		return
	}
	head("6. Tracing: a span per event exported over OTLP/HTTP, sampled at 1 % and 100 %, beside tracing off")
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
		}
		add(fmt.Sprintf("catch-up, sampled %s%%: relay CPU per event (off: %.1f µs)", pctRatio(ratio), us(offCPU)),
			fmt.Sprintf("%.1f µs (%+.1f%%); %.0f events/s (off: %.0f)%s", us(onCPU), cost*100, rate(on.Events, on.Took), rate(off.Events, off.Took),
				runsString(runs, func(x catchupResult) float64 { return rate(x.Events, x.Took) })), target, v)
	}
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
		target, v := "p99 unchanged (≤ 1.1× off)", verdict(on.P99 <= time.Duration(float64(offLive.P99)*1.1))
		if ratio == "0.01" {
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
