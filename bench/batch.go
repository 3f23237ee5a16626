package main

import (
	"context"
	"fmt"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// Fast batches (issue 36): the relay's default path for a busy stream
// (relay/jssink/batch.go) beside the per-message path it keeps with
// nats.fast_batch off, in catch-up, at the first live rate and in the
// large transaction; a publishing ceiling that batches too (orbit's
// FastPublisher), alone and together with pg_recvlogical. The relay's
// counters say which path each run took.

// perMsgEnv turns fast batches off: the relay publishes every message on
// its own, as before issue 36.
const perMsgEnv = "WALBOX_NATS_FAST_BATCH=false"

// Fast-batch publishing ceiling: the flow the relay asks for (jssink's
// batchFlow), orbit's default of two flow acks outstanding, and batches of
// batchCeilSize messages, each closed (committed) before the next opens.
const (
	batchCeilFlow        = 256
	batchCeilOutstanding = 2
	batchCeilSize        = 10_000
)

// The relay's fast-batch counters (internal/app/bus.go).
const (
	metricBatches  = "walbox_nats_batches_total"
	metricBatched  = "walbox_nats_batched_messages_total"
	metricUnproven = "walbox_nats_batch_unproven_total"
)

// batchCounts are a relay's fast-batch counters, or their growth over a
// run, and its atomic-batch counters (atomic.go; 0 from a relay without them).
type batchCounts struct {
	Batches, Batched, Unproven uint64
	Atomic, AtomicBatches      uint64
}

func (c batchCounts) String() string {
	s := fmt.Sprintf("%d events in %d fast batches, %d unproven", c.Batched, c.Batches, c.Unproven)
	if c.Atomic > 0 {
		s += fmt.Sprintf("; %d events in %d atomic batches", c.Atomic, c.AtomicBatches)
	}
	return s
}

func (c batchCounts) since(before batchCounts) batchCounts {
	return batchCounts{c.Batches - before.Batches, c.Batched - before.Batched, c.Unproven - before.Unproven,
		c.Atomic - before.Atomic, c.AtomicBatches - before.AtomicBatches}
}

// relayBatchCounts reads the fast-batch counters from the relay's /metrics;
// a relay without them (built before fast batches) is an error, since the
// report's split between the paths rests on them.
func relayBatchCounts(ctx context.Context, addr string) (batchCounts, error) {
	var c batchCounts
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return c, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return c, fmt.Errorf("read the relay's metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return c, fmt.Errorf("read the relay's metrics: %s", resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return c, fmt.Errorf("parse the relay's metrics: %w", err)
	}
	for _, m := range []struct {
		name     string
		dst      *uint64
		optional bool
	}{{metricBatches, &c.Batches, false}, {metricBatched, &c.Batched, false}, {metricUnproven, &c.Unproven, false},
		{metricAtomic, &c.Atomic, true}, {metricAtomicBatches, &c.AtomicBatches, true}} {
		f := fams[m.name]
		if f == nil && m.optional {
			continue
		}
		if f == nil {
			return c, fmt.Errorf("the relay's metrics have no %s", m.name)
		}
		var sum float64
		for _, x := range f.GetMetric() {
			switch {
			case x.GetCounter() != nil:
				sum += x.GetCounter().GetValue()
			case x.GetUntyped() != nil:
				sum += x.GetUntyped().GetValue()
			}
		}
		*m.dst = uint64(sum)
	}
	return c, nil
}

// catchUpPerMsg is phase 1 again on its own backlog with fast batches off.
func (b *bench) catchUpPerMsg(ctx context.Context, res *catchupResult) error {
	res.Events = b.p.Events
	b.logf("catch-up on the per-message path: loading %d events while the relay is stopped", b.p.Events)
	var err error
	if res.LoadTook, err = b.loadBacklog(ctx, "bench.catchup.permsg", b.p.Events); err != nil {
		return err
	}
	b.logf("catch-up on the per-message path: starting the relay with %s", perMsgEnv)
	if err := b.relayCatchup(ctx, "catch-up-permsg", res, perMsgEnv); err != nil {
		return err
	}
	if res.Batch.Batched != 0 {
		return fmt.Errorf("the relay with %s published %s", perMsgEnv, res.Batch)
	}
	return nil
}

// batchPublishCeiling is publishCeiling with orbit's fast-batch publisher:
// the same messages (Nats-Msg-Id each) into a file stream that allows
// batches, in batches of batchCeilSize, flow batchCeilFlow. With a gate (the
// concurrent ceiling) it starts on the gate's signal and the caller
// measures the CPU.
func (b *bench) batchPublishCeiling(ctx context.Context, res *ceilingResult, g *gate) error {
	p := b.p
	n := p.Events
	b.logf("batched publishing ceiling: building %d messages of %d bytes with Nats-Msg-Id", n, p.PayloadBytes)
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err := b.env.js.CreateStream(qctx, jetstream.StreamConfig{Name: ceilBatchStream, Subjects: []string{"ceilb.>"},
		Storage: jetstream.FileStorage, Duplicates: dupWindow, AllowBatchPublish: true})
	cancel()
	if err != nil {
		return fmt.Errorf("create stream %s: %w", ceilBatchStream, err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = b.env.js.DeleteStream(dctx, ceilBatchStream)
	}()
	msgs := make([]*nats.Msg, n)
	for i := range msgs {
		msgs[i] = &nats.Msg{Subject: "ceilb.events", Data: []byte(payloadFor(i, p.PayloadBytes, 0)),
			Header: nats.Header{"Nats-Msg-Id": []string{uuid.NewString()}}}
	}
	nc, err := nats.Connect(b.env.ns.URL(), nats.Name("walbox-bench-batch-publisher"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	b.logf("batched publishing ceiling: publishing %d messages in batches of %d, flow %d, %d flow acks outstanding",
		n, batchCeilSize, batchCeilFlow, batchCeilOutstanding)
	var acked atomic.Int64
	wctx, done := b.watch(ctx, "batched publishing ceiling", acked.Load, nil)
	defer done()
	if err := g.wait(wctx); err != nil {
		return err
	}
	var meter *phaseMeter
	if g == nil {
		meter = b.startPhase(0)
	}
	self0 := selfCPU()
	t0 := time.Now()
	if err := fastPublishAll(wctx, js, n, batchCeilSize, func(i int) *nats.Msg { return msgs[i] }, func(n int64) { acked.Store(n) }); err != nil {
		return cause(wctx, err)
	}
	took := time.Since(t0)
	res.Events, res.Took, res.ServerCPU = n, took, selfCPU()-self0
	if meter != nil {
		res.Busy, res.Where, res.Span = meter.stop()
	}
	done()
	got, err := b.streamMsgs(ctx, ceilBatchStream)
	if err != nil {
		return err
	}
	if got != uint64(n) {
		return fmt.Errorf("stream %s holds %d messages, want %d", ceilBatchStream, got, n)
	}
	b.logf("batched publishing ceiling: %d messages stored in %.2fs: %.0f msgs/s", n, took.Seconds(), rate(n, took))
	return nil
}

// fastPublishAll publishes n messages, the i-th msg(i), with orbit's
// FastPublisher in batches of size, each closed before the next opens, and
// checks each batch's count in its commit ack; progress (nil: none) gets
// the messages acked so far. msg may reuse a message once AddMsg has
// returned: nats.go has buffered it by then.
func fastPublishAll(ctx context.Context, js jetstream.JetStream, n, size int, msg func(i int) *nats.Msg, progress func(int64)) error {
	if progress == nil {
		progress = func(int64) {}
	}
	var stored int64
	for start := 0; start < n; start += size {
		end := min(n, start+size)
		// AddMsg takes no context: it blocks on a stall at most the ack
		// timeout; ctx is checked between messages and bounds the commit.
		fp, err := jetstreamext.NewFastPublisher(js, jetstreamext.FastPublishFlowControl{
			Flow: batchCeilFlow, MaxOutstandingAcks: batchCeilOutstanding, AckTimeout: 30 * time.Second})
		if err != nil {
			return fmt.Errorf("fast publisher: %w", err)
		}
		for i := start; i < end; i++ {
			if err := ctx.Err(); err != nil {
				return err
			}
			ack, err := fp.AddMsg(msg(i))
			if err != nil {
				return fmt.Errorf("batch publish: %w", err)
			}
			progress(stored + int64(ack.AckSequence))
		}
		back, err := fp.Close(ctx)
		if err != nil {
			return fmt.Errorf("batch commit: %w", err)
		}
		if back.BatchSize != uint64(end-start) {
			return fmt.Errorf("batch commit: the server counted %d messages of %d", back.BatchSize, end-start)
		}
		stored += int64(back.BatchSize)
		progress(stored)
	}
	return nil
}

// livePerMsg runs the first live rate again with a fresh relay on the
// per-message path: the reference for the default relay's p99 there.
func (b *bench) livePerMsg(ctx context.Context, pool *pgxpool.Pool) error {
	if len(b.p.Rates) == 0 {
		return nil
	}
	if err := b.vacuum(ctx, "the last live run marked its rows"); err != nil {
		return err
	}
	b.logf("live: starting the relay on the per-message path (%s)", perMsgEnv)
	t, err := b.walboxLive(ctx, pool, "live-permsg", "walbox-permsg", "bench.live.permsg", perMsgEnv)
	if err != nil {
		return err
	}
	res, err := b.liveRate(ctx, t, b.p.Rates[0])
	if err != nil {
		return err
	}
	if res.Batch.Batched != 0 {
		return fmt.Errorf("the relay with %s published %s", perMsgEnv, res.Batch)
	}
	b.res.livePerMsg = res
	return b.stopRelay(t.proc)
}

// Issue 36's targets, with the figures of the last full run before fast
// batches (bench/results/latest.md at 0946773) as the reference.
const (
	targetBatchConc      = 1.25 // catch-up / concurrent ceiling (per-message publisher)
	refBatchConc         = 0.85
	targetBatchConcB     = 0.9 // catch-up / concurrent ceiling (batched publisher)
	targetBatchCPU       = 0.4 // relay CPU per event / walsender's, catch-up
	refBatchCPU          = 0.64
	targetBatchNATS      = 9 * time.Microsecond // nats-server (+ bench process) per event, catch-up
	refBatchNATS         = 18.1                 // µs
	targetBatchWS        = 11 * time.Microsecond
	refBatchWS           = 13.3 // µs
	targetBatchLiveCPU   = 1.0
	refBatchLiveCPU      = 1.21
	refBatchLiveP99      = 7.15 // ms
	targetBatchLiveP99   = 1.1  // "no worse than the per-message path", read as ≤ 1.1× its p99
	targetBatchBigFaster = 1.5  // 1M-row transaction, fast / per-message events/s
)

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "missed"
}

func ratioOf(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return a / b
}

// batchReport adds the section: both paths' catch-up side by side, the
// batched ceilings, then issue 36's targets with the reference figures.
func (r *results) batchReport(head func(string), add func(what, value, target, verdict string)) {
	c, pm := r.catchup, r.perMsg
	if pm.Events == 0 {
		return
	}
	head("Batched publishing (issue 36): fast batches (default) beside the per-message path (WALBOX_NATS_FAST_BATCH=false)")
	both := func(f func(catchupResult) string) string { return f(c) + " / " + f(pm) }
	usPer := func(d time.Duration, n int) string { return fmt.Sprintf("%.1f", us(perEvent(d, n))) }
	add("catch-up, fast batches / per message: events in fast batches (relay's walbox_nats_batched_messages_total)",
		fmt.Sprintf("%d of %d (%d batches, %d unproven) / %d of %d", c.Batch.Batched, c.Events, c.Batch.Batches, c.Batch.Unproven, pm.Batch.Batched, pm.Events), "", "")
	add("catch-up, fast batches / per message: events/s", both(func(x catchupResult) string { return fmt.Sprintf("%.0f", rate(x.Events, x.Took)) })+
		runsString(r.perMsgRuns, func(x catchupResult) float64 { return rate(x.Events, x.Took) })+" (per message)", "", "")
	add("catch-up, fast batches / per message: relay CPU µs/event", both(func(x catchupResult) string { return usPer(x.CPU, x.Events) }), "", "")
	add("catch-up, fast batches / per message: walsender CPU µs/event", both(func(x catchupResult) string { return usPer(x.WalsenderCPU, x.Events) }), "", "")
	add("catch-up, fast batches / per message: nats-server (+ bench process) CPU µs/event", both(func(x catchupResult) string { return usPer(x.DriverCPU, x.Events) }), "", "")
	add("catch-up, fast batches / per message: relay CPU ÷ walsender CPU", both(func(x catchupResult) string {
		return fmt.Sprintf("%.2f", ratioOf(float64(x.CPU), float64(x.WalsenderCPU)))
	}), "", "")
	add("  catch-up, per message: CPU by process group", perEventWhere(pm.Where, pm.Events), "", "")
	atomicLines(c, r.atomic, r.catchupRuns, r.atomicRuns, add)
	bp, cb, cc := r.batchPub, r.concBatch, r.conc
	add(fmt.Sprintf("batched publishing ceiling: orbit FastPublisher, batches of %d, flow %d, %d acks outstanding / per-message async publisher (phase 1)",
		batchCeilSize, batchCeilFlow, batchCeilOutstanding),
		fmt.Sprintf("%.0f / %.0f msgs/s; nats-server + publisher %.1f / %.1f µs/msg%s", rate(bp.Events, bp.Took), rate(r.publish.Events, r.publish.Took),
			us(perEvent(bp.ServerCPU, bp.Events)), us(perEvent(r.publish.ServerCPU, r.publish.Events)),
			runsString(r.batchPubRuns, func(x ceilingResult) float64 { return rate(x.Events, x.Took) })), "", "")
	add("concurrent ceiling with the batched publisher: pg_recvlogical and the batched publisher at the same time",
		fmt.Sprintf("%.0f events/s (decoding %.0f events/s and publishing %.0f msgs/s, together; with the per-message publisher: %.0f)%s",
			cb.ceiling(), rate(cb.Decode.Events, cb.Decode.Took), rate(cb.Publish.Events, cb.Publish.Took), cc.ceiling(),
			runsString(r.concBatchRuns, concurrentResult.ceiling)), "", "")
	add("  concurrent ceiling with the batched publisher: walsender / nats-server + publisher CPU µs/event",
		fmt.Sprintf("%.1f / %.1f", us(perEvent(cb.Decode.ServerCPU, cb.Decode.Events)), us(perEvent(cb.DriverCPU, cb.Publish.Events))), "", "")
	r.headerCostLines(add)

	// The targets.
	fast, slow := rate(c.Events, c.Took), rate(pm.Events, pm.Took)
	x := ratioOf(fast, cc.ceiling())
	add("target: catch-up events/s ÷ concurrent ceiling (pg_recvlogical + per-message async publisher)",
		fmt.Sprintf("%.2f (was %.2f; per-message path now %.2f)", x, refBatchConc, ratioOf(slow, cc.ceiling())), fmt.Sprintf("≥ %.2f", targetBatchConc), met(x >= targetBatchConc))
	x = ratioOf(fast, cb.ceiling())
	add("target: catch-up events/s ÷ concurrent ceiling with the batched publisher",
		fmt.Sprintf("%.2f (per-message path %.2f)", x, ratioOf(slow, cb.ceiling())), fmt.Sprintf("≥ %.1f", targetBatchConcB), met(x >= targetBatchConcB))
	if cb.Publish.Events > 0 {
		add("  why: all processes' CPU per event (every group above, foreign load left out), relay run / concurrent ceiling with the batched publisher (the relay process "+
			fmt.Sprintf("%.1f µs of the first", us(perEvent(c.CPU, c.Events)))+"); machine busy; the rates' ratio that CPU and busy allow",
			whyRates(allCPU(c.Where), allCPU(cb.Where), c.Events, cb.Publish.Events, c.Busy, cb.Busy), "", "")
	}
	x = ratioOf(float64(c.CPU), float64(c.WalsenderCPU))
	add("target: relay CPU per event ÷ its walsender's, catch-up",
		fmt.Sprintf("%.2f (was %.2f; per-message path now %.2f)", x, refBatchCPU, ratioOf(float64(pm.CPU), float64(pm.WalsenderCPU))),
		fmt.Sprintf("≤ %.1f", targetBatchCPU), met(x <= targetBatchCPU && c.WalsenderCPU > 0))
	if tp := r.tracedProfiles; tp.CatchUpWhere != "" {
		add(fmt.Sprintf("  what the relay's CPU is spent on in a catch-up (the profiled catch-up of section 6, tracing at 1 %%; %d samples)", tp.CatchUpSamples), tp.CatchUpWhere, "", "")
	}
	d := perEvent(c.DriverCPU, c.Events)
	add("target: nats-server CPU per event, catch-up (the in-process server with the bench's driver)",
		fmt.Sprintf("%.1f µs (was %.1f µs; per-message path now %.1f µs)", us(d), refBatchNATS, us(perEvent(pm.DriverCPU, pm.Events))),
		fmt.Sprintf("≤ %.0f µs", us(targetBatchNATS)), met(d <= targetBatchNATS))
	d = perEvent(c.WalsenderCPU, c.Events)
	add("target: walsender CPU per event, catch-up",
		fmt.Sprintf("%.1f µs (was %.1f µs; per-message path now %.1f µs)", us(d), refBatchWS, us(perEvent(pm.WalsenderCPU, pm.Events))),
		fmt.Sprintf("≤ %.0f µs", us(targetBatchWS)), met(d <= targetBatchWS && d > 0))
	if lp := r.livePerMsg; lp.Events > 0 {
		i := slices.IndexFunc(r.live, func(l liveResult) bool { return l.Rate == lp.Rate && l.Events > 0 })
		if i >= 0 {
			l := r.live[i]
			cpu := ratioOf(float64(l.CPU), float64(l.WalsenderCPU))
			okCPU := cpu <= targetBatchLiveCPU && l.WalsenderCPU > 0
			okP99 := l.P99 <= time.Duration(float64(lp.P99)*targetBatchLiveP99)
			add(fmt.Sprintf("target: live %d/s: relay CPU ÷ walsender's / commit → ack p99 (default config, %d events batched)", l.Rate, l.Batch.Batched),
				fmt.Sprintf("%.2f / %s (was %.2f / %.2f ms); per-message path, a fresh relay: %.2f / %s", cpu, ms(l.P99), refBatchLiveCPU, refBatchLiveP99,
					ratioOf(float64(lp.CPU), float64(lp.WalsenderCPU)), ms(lp.P99)),
				fmt.Sprintf("≤ %.1f / no worse than the per-message path (≤ %.1f× its p99)", targetBatchLiveCPU, targetBatchLiveP99), met(okCPU)+" / "+met(okP99))
		}
	}
	if g, gp := r.big, r.bigPerMsg; g.Rows > 0 && gp.Rows > 0 {
		fr, sr := rate(g.Rows, g.Took), rate(gp.Rows, gp.Took)
		x := ratioOf(fr, sr)
		add(fmt.Sprintf("target: %d-row transaction: events/s / peak RSS (%d events batched; per message: %d)", g.Rows, g.Batch.Batched, gp.Batch.Batched),
			fmt.Sprintf("%.0f events/s = %.2f× the per-message path's %.0f / %.1f MB (per message: %.1f MB)", fr, x, sr, mb(g.HWM), mb(gp.HWM)),
			fmt.Sprintf("≥ %.1f× the per-message path / %s", targetBatchBigFaster, targetRSSString), met(x >= targetBatchBigFaster)+" / "+met(g.HWM <= targetRSS && g.HWM > 0))
		if g.RelaySpan > 0 && gp.RelaySpan > 0 {
			add("  why: all processes' CPU per event from the commit to the last ack (foreign load left out), fast batches / per message; machine busy; the rates' ratio that CPU and busy allow",
				whyRates(allCPU(g.RelayWhere), allCPU(gp.RelayWhere), g.Rows, gp.Rows, g.RelayBusy, gp.RelayBusy), "", "")
			add("  CPU by process group from the commit to the last ack, fast batches / per message",
				perEventWhere(g.RelayWhere, g.Rows)+" / "+perEventWhere(gp.RelayWhere, gp.Rows), "", "")
		}
	}
}

// allCPU is the CPU of every process group of a phase but the foreign
// ones ("other: ").
func allCPU(w []cpuShare) time.Duration {
	var t time.Duration
	for _, s := range w {
		if !strings.HasPrefix(s.Label, "other: ") {
			t += s.CPU
		}
	}
	return t
}

// whyRates compares two runs that kept the machine's CPUs busy: a rate is
// the CPUs kept busy over the CPU all processes spend per event, so the
// rates compare as busy ÷ CPU per event do. It gives both runs' CPU per
// event, their busy shares and the ratio of the rates they allow.
func whyRates(aCPU, bCPU time.Duration, aN, bN int, aBusy, bBusy float64) string {
	pa, pb := us(perEvent(aCPU, aN)), us(perEvent(bCPU, bN))
	if pa <= 0 || pb <= 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.1f / %.1f µs; %.0f%% / %.0f%% of %d CPUs; %.2f", pa, pb, aBusy*100, bBusy*100, runtime.NumCPU(), ratioOf(aBusy/pa, bBusy/pb))
}
