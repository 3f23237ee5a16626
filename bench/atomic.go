package main

// Atomic transactions (issue 36, item 2): the catch-up with
// nats.atomic_transactions on, each transaction of the backlog (TxnRows
// events) one JetStream atomic batch, beside the default fast-batch path.
// `go run . atomic` runs only these two catch-ups, on backlogs of their own.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"time"
)

const (
	atomicArg = "atomic" // `go run . atomic`: only the two catch-ups
	// atomicEnv turns atomic transactions on in the relay.
	atomicEnv = "WALBOX_NATS_ATOMIC_TRANSACTIONS=true"
	// The relay's atomic-batch counters (internal/app/bus.go).
	metricAtomic        = "walbox_nats_atomic_messages_total"
	metricAtomicBatches = "walbox_nats_atomic_batches_total"
	// targetAtomic: atomic transactions' catch-up ÷ fast batches' (issue 36).
	targetAtomic = 0.8
)

// catchUpAtomic is phase 1 again on its own backlog with atomic
// transactions on.
func (b *bench) catchUpAtomic(ctx context.Context, res *catchupResult) error {
	res.Events = b.p.Events
	b.logf("catch-up with atomic transactions: loading %d events (%d per transaction) while the relay is stopped", b.p.Events, b.p.TxnRows)
	var err error
	if res.LoadTook, err = b.loadBacklog(ctx, "bench.catchup.atomic", b.p.Events); err != nil {
		return err
	}
	b.logf("catch-up with atomic transactions: starting the relay with %s", atomicEnv)
	if err := b.serverProfiled("atomic", res, func() error { return b.relayCatchup(ctx, "catch-up-atomic", res, atomicEnv) }); err != nil {
		return err
	}
	if res.Batch.Atomic != uint64(res.Events) {
		return fmt.Errorf("the relay with %s published %s, not all %d events in atomic batches", atomicEnv, res.Batch, res.Events)
	}
	return nil
}

// catchUpFast is phase 1's relay run on a backlog of its own, for the
// atomic-only run.
func (b *bench) catchUpFast(ctx context.Context, res *catchupResult) error {
	res.Events = b.p.Events
	b.logf("catch-up with fast batches: loading %d events (%d per transaction) while the relay is stopped", b.p.Events, b.p.TxnRows)
	var err error
	if res.LoadTook, err = b.loadBacklog(ctx, "bench.catchup.fast", b.p.Events); err != nil {
		return err
	}
	return b.serverProfiled("fast", res, func() error { return b.relayCatchup(ctx, "catch-up", res) })
}

// serverProfiled runs f, with -server-profile under a CPU profile of this
// process (the embedded nats-server, and the bench's own polling), and
// reads from it how busy the stream's loop was: nats-server takes every
// message of a stream, staged or stored, in that one goroutine
// ((*stream).internalLoop), so its busy share says whether the server is
// what limits the catch-up.
func (b *bench) serverProfiled(name string, res *catchupResult, f func() error) error {
	if b.p.ServerProfile == "" {
		return f()
	}
	if err := os.MkdirAll(b.p.ServerProfile, 0o755); err != nil {
		return err
	}
	b.serverProfiles++
	path := filepath.Join(b.p.ServerProfile, fmt.Sprintf("nats-server-%s-%d.pprof", name, b.serverProfiles))
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	defer out.Close()
	if err := pprof.StartCPUProfile(out); err != nil {
		return fmt.Errorf("profile nats-server: %w", err)
	}
	t0 := time.Now()
	err = f()
	pprof.StopCPUProfile()
	wall := time.Since(t0)
	if err != nil {
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	loop, err := readProfileShare(path, 0, func(fn string) bool {
		return strings.HasSuffix(fn, "server.(*stream).internalLoop")
	})
	if err != nil {
		return err
	}
	// pprof samples at 100 Hz: a sample is 10 ms of one goroutine's CPU.
	// The loop's work falls within the catch-up (relay spawn → last ack);
	// the profile also spans the settling after it, where the loop idles.
	res.ServerLoopBusy = float64(loop.Matched) * 10 * float64(time.Millisecond) / float64(res.Took)
	b.logf("%s: the stream's loop in nats-server was busy %.0f %% of the catch-up's %v (%d samples in a profile of %v: %s)", name, res.ServerLoopBusy*100, res.Took.Round(time.Millisecond), loop.Matched, wall.Round(time.Millisecond), path)
	return nil
}

// atomicLines are the report's lines for atomic transactions beside fast
// batches (c), the medians of runs and fastRuns (round by round).
func atomicLines(c, a catchupResult, fastRuns, runs []catchupResult, add func(what, value, target, verdict string)) {
	if a.Events == 0 {
		return
	}
	fast, at := rate(c.Events, c.Took), rate(a.Events, a.Took)
	add("atomic transactions on: catch-up events/s (fast batches, the default, beside it)",
		fmt.Sprintf("%.0f (fast batches %.0f)%s", at, fast, runsString(runs, func(x catchupResult) float64 { return rate(x.Events, x.Took) })), "", "")
	add("  atomic transactions on: events in atomic batches; relay / walsender / nats-server (+ bench process) CPU µs/event",
		fmt.Sprintf("%d of %d in %d batches; %.1f / %.1f / %.1f", a.Batch.Atomic, a.Events, a.Batch.AtomicBatches,
			us(perEvent(a.CPU, a.Events)), us(perEvent(a.WalsenderCPU, a.Events)), us(perEvent(a.DriverCPU, a.Events))), "", "")
	x := ratioOf(at, fast)
	perRound := ""
	if len(runs) > 1 && len(runs) == len(fastRuns) {
		// The machine's load moves between rounds: the ratio within each
		// round says more than the ratio of two medians.
		perRound = "; round by round"
		for i := range runs {
			perRound += fmt.Sprintf(" %.2f", ratioOf(rate(runs[i].Events, runs[i].Took), rate(fastRuns[i].Events, fastRuns[i].Took)))
		}
	}
	if a.ServerLoopBusy > 0 {
		add("  nats-server's stream loop (one goroutine: stages and stores every message of the stream) busy, share of the catch-up: fast batches / atomic transactions",
			fmt.Sprintf("%.0f %% / %.0f %%", c.ServerLoopBusy*100, a.ServerLoopBusy*100), "", "")
	}
	add("  why: all processes' CPU per event (foreign load left out), atomic transactions / fast batches; machine busy; the rates' ratio that CPU and busy allow",
		whyRates(allCPU(a.Where), allCPU(c.Where), a.Events, c.Events, a.Busy, c.Busy), "", "")
	add("target: atomic transactions' catch-up events/s ÷ fast batches'", fmt.Sprintf("%.2f%s", x, perRound), fmt.Sprintf("≥ %.1f", targetAtomic), met(x >= targetAtomic))
}

// runAtomic is `go run . atomic`: the fast-batch and the atomic catch-up,
// Rounds times each, alternating, and their medians.
func runAtomic(ctx context.Context, b *bench) error {
	env, err := b.setup(ctx)
	if err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	b.env = env
	if err := b.firstStart(ctx); err != nil {
		return err
	}
	var fastRuns, atomicRuns []catchupResult
	for round := range b.p.Rounds {
		b.logf("round %d of %d", round+1, b.p.Rounds)
		var c, a catchupResult
		if err := b.catchUpFast(ctx, &c); err != nil {
			return fmt.Errorf("fast batches: %w", err)
		}
		if err := b.catchUpAtomic(ctx, &a); err != nil {
			return fmt.Errorf("atomic transactions: %w", err)
		}
		fastRuns, atomicRuns = append(fastRuns, c), append(atomicRuns, a)
	}
	med := func(rs []catchupResult) catchupResult {
		return medianRun(rs, func(c catchupResult) float64 { return rate(c.Events, c.Took) })
	}
	var lines bulletLines
	atomicLines(med(fastRuns), med(atomicRuns), fastRuns, atomicRuns, lines.add)
	e := env.info
	text := fmt.Sprintf("# walbox benchmark: atomic transactions beside fast batches (`go run . atomic`)\n\n"+
		"- Date: %s (run took %s)\n- Machine: %d CPUs (%s), %s memory, Linux %s\n"+
		"- Versions: walbox %s, %s, PostgreSQL %s (%s)\n- Backlog: %d events per run, %d per transaction, %d round(s)\n\n",
		time.Now().UTC().Format("2006-01-02 15:04 MST"), time.Since(b.start).Round(time.Second),
		e.CPUs, e.CPUModel, e.MemTotal, e.Kernel, e.Walbox, e.GoVersion, e.PGVersion, e.PGSet, b.p.Events, b.p.TxnRows, b.p.Rounds)
	for _, l := range lines {
		text += l + "\n"
	}
	fmt.Print(text)
	out := b.p.Out
	if out == "" {
		out = filepath.Join(env.moduleDir, "bench", "results", "atomic.md")
	}
	if err := os.WriteFile(out, []byte(text), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", out, err)
	}
	b.logf("done: results written to %s", out)
	return nil
}
