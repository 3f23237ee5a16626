package main

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// catchupResult is phase 1's relay run.
type catchupResult struct {
	Events       int
	PayloadBytes int // payload::text length as stored
	LoadTook     time.Duration
	Took         time.Duration // relay spawn -> last ack (stored timestamp)
	FirstAck     time.Duration // relay spawn -> first ack
	CPU          time.Duration // relay user+sys, spawn -> last ack
	HWM          int64         // relay VmHWM
	WalsenderCPU time.Duration
	DriverCPU    time.Duration // this process: nats-server + polling
	Busy         float64       // share of all CPUs busy
	Where        []cpuShare    // CPU by process group
	Span         time.Duration // time the CPU figures cover
	MarkedAfter  time.Duration // last ack -> every row marked processed (flag on)
	Batch        batchCounts   // the relay's fast-batch counters at the last ack
	// ServerLoopBusy: the share of the run nats-server's stream loop was
	// busy (-server-profile, atomic.go).
	ServerLoopBusy float64
	endLSN         string
}

// ceilingResult is one of the two ceilings.
type ceilingResult struct {
	Events    int
	Took      time.Duration
	ServerCPU time.Duration // walsender (decoding) or nats-server+publisher (publishing)
	ClientCPU time.Duration // pg_recvlogical (decoding)
	Busy      float64
	Where     []cpuShare
	Span      time.Duration
}

func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// payloadPad is long enough for any payload size asked for.
var payloadPad = strings.Repeat("x", 64<<10)

// payloadFor returns a JSON object of exactly size bytes in jsonb's own text
// form (keys sorted by length, ", " and ": " separators), so the payload
// the relay reads back from the WAL has that size too. ts is the insert time
// (Unix ns) for live events, 0 for the others; every system's live latency
// is measured from it. bench/watermill writes the same bytes.
func payloadFor(i, size int, ts int64) string {
	head := fmt.Sprintf(`{"id": "%09d", "ts": "%019d", "pad": "`, i%1_000_000_000, ts)
	const tail = `", "kind": "bench.event"}`
	n := size - len(head) - len(tail)
	if n < 0 {
		n = 0
	}
	return head + payloadPad[:n] + tail
}

// payloadTime reads the insert time back from a payload made by payloadFor.
func payloadTime(data []byte) (time.Time, bool) {
	const key = `"ts": "`
	i := bytes.Index(data, []byte(key))
	if i < 0 || len(data) < i+len(key)+19 {
		return time.Time{}, false
	}
	ns, err := strconv.ParseInt(string(data[i+len(key):i+len(key)+19]), 10, 64)
	if err != nil || ns == 0 {
		return time.Time{}, false
	}
	return time.Unix(0, ns), true
}

// firstStart starts the relay once to create its slot (and the stream),
// lets its first backfill finish and stops it: every catch-up after it
// reads a backlog from the slot.
func (b *bench) firstStart(ctx context.Context) error {
	b.logf("catch-up: first relay start creates slot %q, then SIGTERM", slotName)
	t0 := time.Now()
	r, _, err := b.startStreaming(ctx, "create-slot")
	if err != nil {
		return err
	}
	// A relay stopped before its first backfill is confirmed redoes it at
	// the next start (dropping and recreating the slot): let it finish.
	if err := b.waitBackfillDone(ctx, r); err != nil {
		return err
	}
	if err := b.stopRelay(r); err != nil {
		return err
	}
	if _, err := b.waitSlot(ctx, slotName, false, nil); err != nil {
		return err
	}
	b.logf("catch-up: slot %q ready in %.1fs (the relay is stopped)", slotName, time.Since(t0).Seconds())
	return nil
}

const insertRows = `INSERT INTO outbox_events (topic, payload) SELECT $1, p::jsonb FROM unnest($2::text[]) WITH ORDINALITY AS t(p, i) ORDER BY i`

func (b *bench) catchUp(ctx context.Context) error {
	p := b.p
	if err := b.firstStart(ctx); err != nil {
		return err
	}
	rounds := max(1, p.Rounds)
	for i := range rounds {
		b.logf("catch-up round %d of %d", i+1, rounds)
		var c, nf, pm catchupResult
		var dec, pub, bpub ceilingResult
		var conc, cbatch concurrentResult
		if err := b.catchUpRound(ctx, &c); err != nil {
			return err
		}
		if err := b.decodeCeiling(ctx, ceilingSlot, c.endLSN, &dec, nil); err != nil {
			return fmt.Errorf("decoding ceiling: %w", err)
		}
		if err := b.publishCeiling(ctx, &pub, nil); err != nil {
			return fmt.Errorf("publishing ceiling: %w", err)
		}
		if err := b.concurrentCeiling(ctx, c.endLSN, concSlot, "the async publisher", b.publishCeiling, &conc); err != nil {
			return fmt.Errorf("concurrent ceiling: %w", err)
		}
		b.res.concRuns = append(b.res.concRuns, conc)
		if err := b.batchPublishCeiling(ctx, &bpub, nil); err != nil {
			return fmt.Errorf("batched publishing ceiling: %w", err)
		}
		if err := b.concurrentCeiling(ctx, c.endLSN, concBatchSlot, "the batched publisher", b.batchPublishCeiling, &cbatch); err != nil {
			return fmt.Errorf("concurrent ceiling with the batched publisher: %w", err)
		}
		b.res.batchPubRuns, b.res.concBatchRuns = append(b.res.batchPubRuns, bpub), append(b.res.concBatchRuns, cbatch)
		if err := b.headerCost(ctx, i); err != nil {
			return err
		}
		if err := b.catchUpPerMsg(ctx, &pm); err != nil {
			return fmt.Errorf("per-message path: %w", err)
		}
		b.res.perMsgRuns = append(b.res.perMsgRuns, pm)
		var at catchupResult
		if err := b.catchUpAtomic(ctx, &at); err != nil {
			return fmt.Errorf("atomic transactions: %w", err)
		}
		b.res.atomicRuns = append(b.res.atomicRuns, at)
		if err := b.catchUpNoFlag(ctx, &nf); err != nil {
			return fmt.Errorf("without the processed flag: %w", err)
		}
		for _, ratio := range traceRatios {
			var tr catchupResult
			if err := b.catchUpTraced(ctx, ratio, &tr); err != nil {
				return fmt.Errorf("with tracing sampled at %s: %w", ratio, err)
			}
			if b.res.tracedRuns == nil {
				b.res.tracedRuns = map[string][]catchupResult{}
			}
			b.res.tracedRuns[ratio] = append(b.res.tracedRuns[ratio], tr)
		}
		b.res.catchupRuns, b.res.decodeRuns = append(b.res.catchupRuns, c), append(b.res.decodeRuns, dec)
		b.res.publishRuns, b.res.noflagRuns = append(b.res.publishRuns, pub), append(b.res.noflagRuns, nf)
	}
	if err := b.catchUpTracedProfiled(ctx); err != nil {
		return fmt.Errorf("with tracing sampled at 0.01, profiled: %w", err)
	}
	pubs, err := b.publishFloor(ctx)
	if err != nil {
		return fmt.Errorf("publishing alone: %w", err)
	}
	b.res.pubAlone = pubs
	// Each figure is the median of its runs.
	b.res.catchup = medianRun(b.res.catchupRuns, func(c catchupResult) float64 { return rate(c.Events, c.Took) })
	b.res.noflag = medianRun(b.res.noflagRuns, func(c catchupResult) float64 { return rate(c.Events, c.Took) })
	b.res.decode = medianRun(b.res.decodeRuns, func(c ceilingResult) float64 { return rate(c.Events, c.Took) })
	b.res.publish = medianRun(b.res.publishRuns, func(c ceilingResult) float64 { return rate(c.Events, c.Took) })
	b.res.conc = medianRun(b.res.concRuns, concurrentResult.ceiling)
	b.res.perMsg = medianRun(b.res.perMsgRuns, func(c catchupResult) float64 { return rate(c.Events, c.Took) })
	b.res.atomic = medianRun(b.res.atomicRuns, func(c catchupResult) float64 { return rate(c.Events, c.Took) })
	b.res.batchPub = medianRun(b.res.batchPubRuns, func(c ceilingResult) float64 { return rate(c.Events, c.Took) })
	b.res.concBatch = medianRun(b.res.concBatchRuns, concurrentResult.ceiling)
	return nil
}

// medianRun returns the run with the median value (the lower middle one of
// an even count).
func medianRun[T any](runs []T, value func(T) float64) T {
	s := slices.Clone(runs)
	slices.SortFunc(s, func(a, b T) int { return cmp.Compare(value(a), value(b)) })
	return s[(len(s)-1)/2]
}

// catchUpRound loads a backlog while the relay is stopped (with a fresh
// slot for the decoding ceiling, created before it so that it decodes
// exactly the same WAL) and times the relay draining it.
func (b *bench) catchUpRound(ctx context.Context, res *catchupResult) error {
	p := b.p
	// Three slots for pg_recvlogical, created before the backlog so that
	// each decodes exactly its WAL: one for the decoding ceiling alone, one
	// for each concurrent ceiling (with the per-message and the batched
	// publisher).
	for _, slot := range []string{ceilingSlot, concSlot, concBatchSlot} {
		var out tailBuffer
		cmd := b.recvlogical(ctx, &out, "--slot", slot, "--create-slot", "--plugin", "pgoutput")
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("pg_recvlogical --create-slot %s: %w\n%s", slot, err, out.String())
		}
	}
	b.logf("catch-up: slots %q, %q and %q (pg_recvlogical) created; loading %d events (%d per transaction, %d connections)",
		ceilingSlot, concSlot, concBatchSlot, p.Events, p.TxnRows, p.Loaders)
	var err error
	res.Events = p.Events
	res.LoadTook, err = b.loadBacklog(ctx, "bench.catchup", p.Events)
	if err != nil {
		return err
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err = b.env.pool.QueryRow(qctx, "SELECT pg_current_wal_lsn()::text").Scan(&res.endLSN)
	if err == nil {
		err = b.env.pool.QueryRow(qctx, "SELECT octet_length(payload::text) FROM outbox_events LIMIT 1").Scan(&res.PayloadBytes)
	}
	cancel()
	if err != nil {
		return err
	}
	b.logf("catch-up: backlog committed in %.1fs (%.0f events/s, payload %d bytes); starting the relay",
		res.LoadTook.Seconds(), rate(p.Events, res.LoadTook), res.PayloadBytes)

	return b.relayCatchup(ctx, "catch-up", res)
}

// catchUpNoFlag is phase 1 again with the processed flag off
// (sweeper.mark_processed=false): what the sweeper costs.
func (b *bench) catchUpNoFlag(ctx context.Context, res *catchupResult) error {
	p := b.p
	res.Events = p.Events
	b.logf("catch-up without the processed flag: loading %d events while the relay is stopped", p.Events)
	var err error
	if res.LoadTook, err = b.loadBacklog(ctx, "bench.catchup.noflag", p.Events); err != nil {
		return err
	}
	b.logf("catch-up without the processed flag: starting the relay with WALBOX_SWEEPER_MARK_PROCESSED=false")
	return b.relayCatchup(ctx, "catch-up-noflag", res, "WALBOX_SWEEPER_MARK_PROCESSED=false")
}

// relayCatchup starts the relay on a committed backlog of res.Events and
// measures it until the last one is acked, then stops it.
func (b *bench) relayCatchup(ctx context.Context, phase string, res *catchupResult, env ...string) error {
	p := b.p
	base, err := b.streamMsgs(ctx, benchStream)
	if err != nil {
		return err
	}
	target := base + uint64(p.Events)
	{
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var restart, confirmed string
		var behind int64
		if err := b.env.pool.QueryRow(qctx, `SELECT restart_lsn::text, confirmed_flush_lsn::text, pg_current_wal_lsn() - restart_lsn
			FROM pg_replication_slots WHERE slot_name = $1`, slotName).Scan(&restart, &confirmed, &behind); err == nil {
			b.logf("%s: slot restart_lsn %s, confirmed_flush_lsn %s: %.1f MB of WAL to read", phase, restart, confirmed, float64(behind)/(1<<20))
		}
		cancel()
	}
	meter, self0 := b.startPhase(0), selfCPU()
	r, err := b.startRelay(phase, env...)
	if err != nil {
		return err
	}
	meter.relay = r.pid()
	var acked atomic.Int64
	wctx, done := b.watch(ctx, phase, acked.Load, func(v int64) string { return fmt.Sprintf("%d/%d acked", v, p.Events) })
	defer done()
	wsPID := 0
	for {
		if wsPID == 0 {
			if active, pid, err := b.slotState(wctx, slotName); err == nil && active {
				wsPID = pid
			}
		}
		reached, err := b.pollAcked(wctx, benchStream, base, target, acked.Store, r, "relay exited during "+phase)
		if err != nil {
			return err
		}
		if reached {
			break
		}
	}
	res.CPU, err = r.cpu()
	if err != nil {
		return err
	}
	res.HWM, err = r.hwm()
	if err != nil {
		return err
	}
	firstWS := wsPID
	// The walsender serving the relay now (it may have reconnected).
	if active, pid, err := b.slotState(ctx, slotName); err == nil && active {
		wsPID = pid
	}
	if wsPID != 0 {
		res.WalsenderCPU, _ = procCPU(wsPID)
	}
	if firstWS != wsPID {
		b.logf("  the relay's walsender changed during catch-up (pid %d, then %d): the relay reconnected", firstWS, wsPID)
	}
	if err := b.endCatchup(ctx, res, meter, self0, done, benchStream, base, target, r.started); err != nil {
		return err
	}
	// Which path the relay took: its fast-batch counters (a fresh process,
	// so they count this run only).
	if res.Batch, err = relayBatchCounts(ctx, b.env.metrics); err != nil {
		return err
	}
	marks := !markOff(env, b.p.Sets)
	if err := b.settle(ctx, r, res, marks); err != nil {
		return err
	}
	if err := b.stopRelay(r); err != nil {
		return err
	}
	b.logf("%s: %d events relayed in %.2fs: %.0f events/s; relay CPU %.2fs, peak RSS %.1f MB; %s",
		phase, p.Events, res.Took.Seconds(), rate(p.Events, res.Took), res.CPU.Seconds(), mb(res.HWM), res.Batch)
	return nil
}

// endCatchup ends a catch-up phase: the driver's CPU since self0, the
// meter's shares, the progress watch stopped (done), and the first and last
// acks of messages base+1..target of stream, timed from started.
func (b *bench) endCatchup(ctx context.Context, res *catchupResult, meter *phaseMeter, self0 time.Duration, done func(), stream string, base, target uint64, started time.Time) error {
	res.DriverCPU = selfCPU() - self0
	res.Busy, res.Where, res.Span = meter.stop()
	done()
	first, last, err := b.firstLast(ctx, stream, base+1, target)
	if err != nil {
		return err
	}
	res.FirstAck, res.Took = first.Time.Sub(started), last.Time.Sub(started)
	return nil
}

// settle lets the relay finish what the catch-up left behind before it is
// stopped, so that the next phase does not pay for it: with the processed
// flag on, the sweeper marking the last rows (timed: MarkedAfter); then
// checkpoints (each logs the running transactions the slot's restart point
// advances by) until the slot has confirmed the WAL written so far and its
// restart point has passed it.
func (b *bench) settle(ctx context.Context, r *relayProc, res *catchupResult, marks bool) error {
	if marks {
		err := b.pollRelay(ctx, r, "waiting for the sweeper to mark every row processed", func(ctx context.Context) (bool, error) {
			var left int64
			err := b.env.pool.QueryRow(ctx, "SELECT count(*) FROM outbox_events WHERE NOT processed").Scan(&left)
			return left == 0, err
		})
		if err != nil {
			return err
		}
		res.MarkedAfter = time.Since(r.started) - res.Took
	} else {
		// The flag-on relay of the next round would mark these rows at
		// start (its sweeper's catch-up): do it now, while this relay
		// runs, so its walsender also decodes the UPDATEs now.
		qctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		_, err := b.env.pool.Exec(qctx, "UPDATE outbox_events SET processed = true, processed_at = now() WHERE NOT processed")
		cancel()
		if err != nil {
			return fmt.Errorf("marking the flag-off run's rows: %w", err)
		}
	}
	return b.settleSlot(ctx, r, slotName)
}

// pollRelay polls done every 50 ms until it holds, failing when the relay
// exits or after the stall limit. Each wait has a stall limit of its own:
// a large backlog's UPDATE (flag off) comes before the slot's waits, and
// is not one of them.
func (b *bench) pollRelay(ctx context.Context, r *relayProc, what string, done func(context.Context) (bool, error)) error {
	deadline := time.Now().Add(b.p.Stall)
	for {
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		ok, err := done(qctx)
		cancel()
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		if ok {
			return nil
		}
		if r.exited() {
			return fmt.Errorf("relay exited while %s (%s):\n%s", what, r.cmd.ProcessState, r.logs)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not done within %s", what, b.p.Stall)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// settleSlot checkpoints until slot has confirmed the WAL written so far
// and its restart point has passed it (at most 5 checkpoints). The slot's
// restart point moves to the snapshot the walsender saved at the
// running-transactions record before the last one it decoded: one
// checkpoint leaves restart_lsn behind a phase's WAL, and the next relay
// start decodes all of it again (280 MB more than its own backlog, seen in
// the flag-on rounds that followed a flag-off one).
func (b *bench) settleSlot(ctx context.Context, r *relayProc, slot string) error {
	// slotPast: the slot's col (confirmed_flush_lsn or restart_lsn) is at or past lsn.
	slotPast := func(ctx context.Context, col, lsn string) (bool, error) {
		var ok bool
		err := b.env.pool.QueryRow(ctx, "SELECT coalesce(bool_and("+col+" >= $2::pg_lsn), false) FROM pg_replication_slots WHERE slot_name = $1",
			slot, lsn).Scan(&ok)
		return ok, err
	}
	var first string
	for i := range 5 {
		var lsn string
		qctx, cancel := context.WithTimeout(ctx, time.Minute)
		_, err := b.env.pool.Exec(qctx, "CHECKPOINT")
		if err == nil {
			err = b.env.pool.QueryRow(qctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn)
		}
		cancel()
		if err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
		if first == "" {
			first = lsn
		}
		if err := b.pollRelay(ctx, r, "waiting for slot "+slot+" to confirm the WAL written", func(ctx context.Context) (bool, error) {
			return slotPast(ctx, "confirmed_flush_lsn", lsn)
		}); err != nil {
			return err
		}
		qctx, cancel = context.WithTimeout(ctx, 10*time.Second)
		restarted, err := slotPast(qctx, "restart_lsn", first)
		cancel()
		if err != nil {
			return fmt.Errorf("slot %s restart_lsn: %w", slot, err)
		}
		if restarted {
			return nil
		}
		if i < 4 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond): // the walsender saves the restart point at the next status update
			}
		}
	}
	b.logf("  slot %s: restart_lsn still before %s after 5 checkpoints: the next start decodes that WAL again", slot, first)
	return nil
}

// loadBacklog commits n events in transactions of TxnRows rows over Loaders
// connections.
func (b *bench) loadBacklog(ctx context.Context, topic string, n int) (time.Duration, error) {
	p := b.p
	txns := (n + p.TxnRows - 1) / p.TxnRows
	var next, loaded atomic.Int64
	wctx, done := b.watch(ctx, "backlog load", loaded.Load, func(v int64) string { return fmt.Sprintf("%d/%d committed", v, n) })
	defer done()
	var wg sync.WaitGroup
	var errOnce sync.Once
	var firstErr error
	t0 := time.Now()
	for range p.Loaders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fail := func(err error) { errOnce.Do(func() { firstErr = cause(wctx, err) }) }
			conn, err := pgx.Connect(wctx, b.env.dbURL)
			if err != nil {
				fail(err)
				return
			}
			defer conn.Close(context.Background())
			rows := make([]string, p.TxnRows)
			for {
				t := int(next.Add(1) - 1)
				if t >= txns {
					return
				}
				k := min(p.TxnRows, n-t*p.TxnRows)
				for j := range k {
					rows[j] = payloadFor(t*p.TxnRows+j, p.PayloadBytes, 0)
				}
				if _, err := conn.Exec(wctx, insertRows, topic, rows[:k]); err != nil {
					fail(err)
					return
				}
				loaded.Add(int64(k))
			}
		}()
	}
	wg.Wait()
	return time.Since(t0), firstErr
}

// recvlogical prepares a pg_recvlogical command against the bench database.
func (b *bench) recvlogical(ctx context.Context, out *tailBuffer, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(b.env.pg.BinDir(), "pg_recvlogical"), append([]string{"-d", b.env.dbURL}, args...)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// gate lines up the two halves of the concurrent ceiling: each says when it
// is ready, then waits for go. A nil gate (the ceilings alone) does nothing.
type gate struct {
	ready chan struct{}
	start chan struct{}
}

func (g *gate) wait(ctx context.Context) error {
	if g == nil {
		return nil
	}
	g.ready <- struct{}{}
	select {
	case <-g.start:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// decodeCeiling times pg_recvlogical draining the backlog with pgoutput
// from slot, which it drops at the end. With a gate (the concurrent
// ceiling) it starts on the gate's signal and the caller measures the CPU.
func (b *bench) decodeCeiling(ctx context.Context, slot, endLSN string, res *ceilingResult, g *gate) error {
	b.logf("decoding ceiling: pg_recvlogical --start on slot %q to %s (pgoutput, proto_version=1, -f /dev/null)", slot, endLSN)
	var wsCPU atomic.Int64
	wctx, done := b.watch(ctx, "pg_recvlogical", wsCPU.Load, nil)
	defer done()
	var out tailBuffer
	cmd := b.recvlogical(wctx, &out, "--slot", slot, "--start", "-f", "/dev/null", "-F", "0", "--no-loop",
		"--endpos", endLSN, "-o", "proto_version=1", "-o", "publication_names="+publication)
	if err := g.wait(wctx); err != nil {
		return err
	}
	var meter *phaseMeter
	if g == nil {
		meter = b.startPhase(0)
	}
	t0 := time.Now()
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	wsPID := 0
	tk := time.NewTicker(5 * time.Millisecond)
	defer tk.Stop()
	var err error
wait:
	for {
		select {
		case err = <-exited:
			break wait
		case <-tk.C:
		}
		if wsPID == 0 {
			if active, pid, err := b.slotState(wctx, slot); err == nil && active {
				wsPID = pid
			}
		}
		if wsPID != 0 {
			if c, err := procCPU(wsPID); err == nil {
				wsCPU.Store(int64(c))
			}
		}
	}
	took := time.Since(t0)
	if err != nil {
		return fmt.Errorf("pg_recvlogical: %w\n%s", cause(wctx, err), out.String())
	}
	res.Events, res.Took = b.p.Events, took
	res.ServerCPU = time.Duration(wsCPU.Load())
	// Let the walsender exit and the postmaster reap it, so that its CPU is
	// in the postmaster's reaped CPU when the phase's CPU is read.
	if _, err := b.waitSlot(ctx, slot, false, nil); err != nil {
		return err
	}
	time.Sleep(200 * time.Millisecond)
	if meter != nil {
		res.Busy, res.Where, res.Span = meter.stop()
	}
	if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
		res.ClientCPU = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	done()
	// Drop the slot so it holds no WAL back during the later phases.
	if _, err := b.waitSlot(ctx, slot, false, nil); err != nil {
		return err
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := b.env.pool.Exec(qctx, "SELECT pg_drop_replication_slot($1)", slot); err != nil {
		return fmt.Errorf("drop slot %s: %w", slot, err)
	}
	b.logf("decoding ceiling: %d events decoded in %.2fs: %.0f events/s (walsender CPU %.2fs)",
		res.Events, took.Seconds(), rate(res.Events, took), res.ServerCPU.Seconds())
	return nil
}

// publishCeiling times an async JetStream publisher with a bounded window
// writing N pre-built messages into a file stream. With a gate (the
// concurrent ceiling) it starts on the gate's signal and the caller
// measures the CPU.
func (b *bench) publishCeiling(ctx context.Context, res *ceilingResult, g *gate) error {
	p := b.p
	n := p.Events
	b.logf("publishing ceiling: building %d messages of %d bytes with Nats-Msg-Id", n, p.PayloadBytes)
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err := b.env.js.CreateStream(qctx, jetstream.StreamConfig{Name: ceilStream, Subjects: []string{"ceil.>"},
		Storage: jetstream.FileStorage, Duplicates: dupWindow})
	cancel()
	if err != nil {
		return err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = b.env.js.DeleteStream(dctx, ceilStream)
	}()
	msgs := make([]*nats.Msg, n)
	for i := range msgs {
		msgs[i] = &nats.Msg{Subject: "ceil.events", Data: []byte(payloadFor(i, p.PayloadBytes, 0)),
			Header: nats.Header{"Nats-Msg-Id": []string{uuid.NewString()}}}
	}
	nc, err := nats.Connect(b.env.ns.URL(), nats.Name("walbox-bench-publisher"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4*p.Window), jetstream.WithPublishAsyncTimeout(30*time.Second))
	if err != nil {
		return err
	}
	b.logf("publishing ceiling: publishing %d messages, window %d in flight", n, p.Window)
	var acked atomic.Int64
	wctx, done := b.watch(ctx, "publishing ceiling", acked.Load, nil)
	defer done()
	ring := make([]jetstream.PubAckFuture, p.Window)
	head, inflight := 0, 0
	waitOldest := func() error {
		f := ring[head]
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return fmt.Errorf("publish: %w", err)
		case <-wctx.Done():
			return cause(wctx, wctx.Err())
		}
		ring[head] = nil
		head = (head + 1) % len(ring)
		inflight--
		acked.Add(1)
		return nil
	}
	if err := g.wait(wctx); err != nil {
		return err
	}
	var meter *phaseMeter
	if g == nil {
		meter = b.startPhase(0)
	}
	self0 := selfCPU()
	t0 := time.Now()
	for _, m := range msgs {
		if inflight == len(ring) {
			if err := waitOldest(); err != nil {
				return err
			}
		}
		f, err := js.PublishMsgAsync(m, jetstream.WithRetryAttempts(0))
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		ring[(head+inflight)%len(ring)] = f
		inflight++
	}
	for inflight > 0 {
		if err := waitOldest(); err != nil {
			return err
		}
	}
	took := time.Since(t0)
	res.Events, res.Took, res.ServerCPU = n, took, selfCPU()-self0
	if meter != nil {
		res.Busy, res.Where, res.Span = meter.stop()
	}
	done()
	got, err := b.streamMsgs(ctx, ceilStream)
	if err != nil {
		return err
	}
	if got != uint64(n) {
		return fmt.Errorf("stream %s holds %d messages, want %d", ceilStream, got, n)
	}
	b.logf("publishing ceiling: %d messages acked in %.2fs: %.0f msgs/s", n, took.Seconds(), rate(n, took))
	return nil
}

func mb(bytes int64) float64 { return float64(bytes) / (1 << 20) }

// waitBackfillDone waits until the relay has cleared its backfill marker
// (walbox.slot_backfill), if this version of walbox keeps one.
func (b *bench) waitBackfillDone(ctx context.Context, r *relayProc) error {
	deadline := time.Now().Add(b.p.Stall)
	for {
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		var hasTable, pending bool
		err := b.env.pool.QueryRow(qctx, "SELECT to_regclass('walbox.slot_backfill') IS NOT NULL").Scan(&hasTable)
		if err == nil && hasTable {
			err = b.env.pool.QueryRow(qctx, "SELECT EXISTS (SELECT 1 FROM walbox.slot_backfill WHERE slot_name = $1)", slotName).Scan(&pending)
		}
		cancel()
		if err == nil && !pending {
			return nil
		}
		if r.exited() {
			return fmt.Errorf("relay exited (%s):\n%s", r.cmd.ProcessState, r.logs)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the relay's first backfill was not confirmed within %s (last error: %v)", b.p.Stall, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// concurrentResult is the concurrent ceiling: pg_recvlogical draining the
// backlog while the async publisher writes as many messages, both started
// at the same moment on the same cores.
type concurrentResult struct {
	Decode, Publish ceilingResult
	DriverCPU       time.Duration // this process (nats-server, publisher, the bench's polling) over the phase
	Busy            float64
	Where           []cpuShare
	Span            time.Duration
}

// ceiling is the lower of the two rates reached together: the rate of a
// relay that had to do both jobs, costing nothing itself.
func (c concurrentResult) ceiling() float64 {
	return min(rate(c.Decode.Events, c.Decode.Took), rate(c.Publish.Events, c.Publish.Took))
}

// concurrentCeiling runs the decoding ceiling and a publishing one (publish:
// the per-message or the batched publisher, named who) at the same time,
// the decoder on slot, which holds the same backlog.
func (b *bench) concurrentCeiling(ctx context.Context, endLSN, slot, who string, publish func(context.Context, *ceilingResult, *gate) error, res *concurrentResult) error {
	b.logf("concurrent ceiling: pg_recvlogical and %s together", who)
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g := &gate{ready: make(chan struct{}, 2), start: make(chan struct{})}
	errs := make(chan error, 2)
	go func() {
		err := b.decodeCeiling(cctx, slot, endLSN, &res.Decode, g)
		if err != nil {
			err = fmt.Errorf("decoding: %w", err)
		}
		errs <- err
	}()
	go func() {
		err := publish(cctx, &res.Publish, g)
		if err != nil {
			err = fmt.Errorf("publishing: %w", err)
		}
		errs <- err
	}()
	var firstErr error
	pending := 2
	for ready := 0; ready < 2 && firstErr == nil; {
		select {
		case <-g.ready:
			ready++
		case err := <-errs:
			pending--
			if err == nil {
				err = errors.New("a half ended before the start")
			}
			firstErr = err
		}
	}
	if firstErr != nil {
		cancel() // the other half may wait at the gate
	}
	var meter *phaseMeter
	var self0 time.Duration
	if firstErr == nil {
		meter, self0 = b.startPhase(0), selfCPU()
		close(g.start)
	}
	for ; pending > 0; pending-- {
		if err := <-errs; err != nil && firstErr == nil {
			firstErr = err
			cancel()
		}
	}
	if firstErr != nil {
		cancel()
		return firstErr
	}
	res.DriverCPU = selfCPU() - self0
	res.Busy, res.Where, res.Span = meter.stop()
	b.logf("concurrent ceiling with %s: decoding %.0f events/s and publishing %.0f msgs/s together: %.0f events/s",
		who, rate(res.Decode.Events, res.Decode.Took), rate(res.Publish.Events, res.Publish.Took), res.ceiling())
	return nil
}
