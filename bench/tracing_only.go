package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
)

// tracingArg: `go run . tracing [-quick] [-events N] [-pairs N]`: only
// tracing's profiled catch-up at 1 % (section 6's verdict row), its profile
// kept in bench/results/profiles/relay-catch-up-traced.pprof for `go tool
// pprof`; with -pairs, also catch-ups by fresh relays with tracing off and
// at 1 %, alternated (tracePairs).
const tracingArg = "tracing"

func runTracing(ctx context.Context, b *bench) error {
	env, err := b.setup(ctx)
	if err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	b.env = env
	if b.otlp, err = b.startOTLPSink(); err != nil {
		return err
	}
	if err := b.firstStart(ctx); err != nil {
		return err
	}
	b.keepProfile = filepath.Join(env.moduleDir, "bench", "results", "profiles", "relay-catch-up-traced.pprof")
	if err := b.catchUpTracedProfiled(ctx); err != nil {
		return err
	}
	var lines bulletLines
	b.res.tracedProfileLines(lines.add)
	for _, l := range lines {
		fmt.Println(l)
	}
	fmt.Fprintln(os.Stderr, "profile kept in", b.keepProfile)
	return b.tracePairs(ctx)
}

// tracePairs runs b.p.TracePairs pairs of catch-ups of the same backlog
// size, each by a fresh relay, one with tracing off and one sampled at 1 %,
// the order flipped each pair, without the processed flag (the marking is
// PostgreSQL's work and the sweeper's, not tracing's), and prints each
// run's relay CPU per event and the median of the pairs' ratios: a check
// of the profile's share by another method, whose runs differ more among
// themselves than the share it looks for.
func (b *bench) tracePairs(ctx context.Context) error {
	var ratios []float64
	for i := range b.p.TracePairs {
		var cpu [2]float64 // off, traced
		for j := range 2 {
			traced := (i+j)%2 == 1
			env := []string{"WALBOX_SWEEPER_MARK_PROCESSED=false"}
			name := "off"
			if traced {
				env, name = append(env, b.traceEnv(pairRatio())...), "traced"
			}
			var res catchupResult
			res.Events = b.p.Events
			if _, err := b.loadBacklog(ctx, "bench.catchup.pair", b.p.Events); err != nil {
				return err
			}
			if err := b.relayCatchup(ctx, "catch-up-pair-"+name, &res, env...); err != nil {
				return err
			}
			c := float64(perEvent(res.CPU, res.Events).Nanoseconds()) / 1000
			if traced {
				cpu[1] = c
			} else {
				cpu[0] = c
			}
			fmt.Printf("- pair %d, %s: relay CPU %.2f µs/event, %.0f events/s\n", i+1, name, c, rate(res.Events, res.Took))
		}
		ratios = append(ratios, cpu[1]/cpu[0])
	}
	if len(ratios) > 0 {
		slices.Sort(ratios)
		fmt.Printf("- pairs: relay CPU per event at 1 %% ÷ off, median of %d pairs: %.3f (all: %.3f)\n", len(ratios), ratios[len(ratios)/2], ratios)
	}
	return nil
}

// bulletLines collects a phase's report lines as a Markdown list, for the
// runs of one phase alone (go run . atomic, go run . tracing).
type bulletLines []string

func (ls *bulletLines) add(what, value, target, verdict string) {
	l := "- " + what + ": " + value
	if target != "" {
		l += " (target " + target + ": " + verdict + ")"
	}
	*ls = append(*ls, l)
}

// pairRatio is the traced side's sampling ratio in tracePairs: 0.01, or
// BENCH_PAIR_RATIO (to tell the spans' cost from tracing being on).
func pairRatio() string {
	if r := os.Getenv("BENCH_PAIR_RATIO"); r != "" {
		return r
	}
	return "0.01"
}
