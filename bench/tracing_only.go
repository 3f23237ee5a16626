package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
)

// tracingArg: `go run . tracing [-quick] [-events N]`: only tracing's
// profiled catch-up at 1 % (section 6's verdict row), its profile kept in
// bench/results/profiles/relay-catch-up-traced.pprof for `go tool pprof`.
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
