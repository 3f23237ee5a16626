package main

// The claim check (issue 39, "Measure"): a backlog in which every 20th
// event (5 %) carries a 4 MiB payload and the rest the usual 200 bytes,
// relayed by walbox with claim_check on (the large payloads go to the
// JetStream Object Store, the messages carry references) and by walbox with
// the claim check off and nats-server's max_payload raised instead; then the
// relay's peak RSS while one 64 MiB payload passes with the claim check on.
//
// Each side has a nats-server of its own (embedded, file store) and a slot
// of its own, created before the first backlog: every backlog is committed
// once, with both relays stopped, and both slots decode exactly that WAL,
// so the two sides relay the same load. The side that goes first alternates
// round by round (the machine's load moves between runs). The claim-check
// side's server keeps nats-server's default max_payload (1 MiB), so the
// relay derives its default threshold from it (1 MiB less 64 KiB); the
// other side's server takes 8 MiB, so a 4 MiB payload and its headers fit
// in one message (its stream has no max_msg_size: walbox sets none).
//
// `go run . claim` runs only this phase and writes bench/results/claim.md;
// `make bench` runs it after the peers (its rows are in latest.md).

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/relay"
)

const (
	claimArg   = "claim" // `go run . claim`: only this phase
	claimTopic = "bench.claim"
	// claimEvery: every claimEvery-th event of a backlog is large (5 %).
	claimEvery = 20
	claimLarge = 4 << 20
	claimHuge  = 64 << 20
	// claimRaisedMaxPayload is the raised side's max_payload: above one
	// 4 MiB payload plus its headers.
	claimRaisedMaxPayload = 8 << 20
	// claimDefaultThreshold is the threshold the relay derives from a
	// server with the default max_payload (1 MiB less 64 KiB for headers).
	claimDefaultThreshold = 1<<20 - 64<<10
	claimSlotOn           = "walbox_claim_on"
	claimSlotRaised       = "walbox_claim_raised"
	metricClaimUploads    = "walbox_claim_uploads_total"
	// claimHugeSmall small events are committed before and after the
	// 64 MiB one (a transaction of their own each side).
	claimHugeSmall = 10
	// claimStatusInterval: both sides' relays send the server their
	// position this often (postgres.status_interval, default 10 s), so that
	// the settle after each run, which waits for the slot to confirm a
	// checkpoint twice, takes seconds rather than 20 s per run.
	claimStatusInterval = "WALBOX_POSTGRES_STATUS_INTERVAL=1s"
	// claimIdle is how long the relay of the 64 MiB run streams, idle,
	// before its baseline RSS is read.
	claimIdle = 3 * time.Second
)

// claimEvents is the backlog of one round.
func (p params) claimEvents() int {
	if p.Quick {
		return 1_000
	}
	return 4_000
}

// claimRounds is an even count, so that each side goes first as often as
// the other: 4 with -quick, else 6 (or -rounds, rounded up to even).
func (p params) claimRounds() int {
	if p.Quick {
		return 4
	}
	n := max(6, p.Rounds)
	return n + n%2
}

// claimHugeRuns is how many fresh relays each relay one 64 MiB payload:
// 2 with -quick, else 3.
func (p params) claimHugeRuns() int {
	if p.Quick {
		return 2
	}
	return 3
}

// claimSide is one configuration: its nats-server, slot and relay
// environment (real walbox config keys only).
type claimSide struct {
	label      string
	slot       string
	maxPayload int32
	ns         *natstest.Server
	nc         *nats.Conn
	js         jetstream.JetStream
	env        []string
}

// claimRun is one relay draining one backlog.
type claimRun struct {
	Events, Large int
	Took          time.Duration // relay spawn -> last message stored
	CPU           time.Duration // relay user+sys
	DriverCPU     time.Duration // this process: the nats-servers and the polling
	HWM           int64         // relay VmHWM
	StreamBytes   uint64        // bytes the stream grew by
	ObjectBytes   uint64        // bytes the claim bucket grew by (its stream's)
	Uploads       float64       // the relay's walbox_claim_uploads_total
	First         bool          // this side went first in its round
	Where         []cpuShare    // CPU by process group, spawn -> last message stored
	Span          time.Duration // the time Where covers
}

// claimHugeResult is the 64 MiB run.
type claimHugeResult struct {
	Payload     int
	WindowBytes int64
	BaseHWM     int64 // VmHWM of the streaming relay before the insert
	BaseRSS     int64 // VmRSS at the same moment
	Peak        int64 // VmHWM once every event of the run is stored
	Took        time.Duration
	Uploads     float64
}

// claimResult is the phase.
type claimResult struct {
	Events, Small int
	On, Raised    []claimRun // round by round
	LoadTook      []time.Duration
	Huge          []claimHugeResult
	Took          time.Duration
}

// claimPad is incompressible JSON-safe text (PostgreSQL's TOAST compression
// would shrink repeated bytes to nothing, and the WAL with them), long
// enough for the 64 MiB payload.
type claimPad string

func newClaimPad() claimPad {
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	r := rand.New(rand.NewPCG(39, 39))
	b := make([]byte, claimHuge)
	for i := range b {
		b[i] = alphabet[r.IntN(len(alphabet))]
	}
	return claimPad(b)
}

// payload is a JSON object of exactly size bytes in jsonb's text form, as
// payloadFor's (whose padding is one repeated byte).
func (pad claimPad) payload(i, size int) string {
	if size < claimDefaultThreshold {
		return payloadFor(i, size, 0)
	}
	head := fmt.Sprintf(`{"id": "%09d", "ts": "%019d", "pad": "`, i%1_000_000_000, 0)
	const tail = `", "kind": "bench.event"}`
	return head + string(pad[:size-len(head)-len(tail)]) + tail
}

// claimSize is the payload size of event i of a backlog.
func (b *bench) claimSize(i int) int {
	if i%claimEvery == claimEvery-1 {
		return claimLarge
	}
	return b.p.PayloadBytes
}

// claimSides starts the two nats-servers and connects to them.
func (b *bench) claimSides() ([]*claimSide, error) {
	sides := []*claimSide{
		{label: "claim check on", slot: claimSlotOn, env: []string{"WALBOX_CLAIM_CHECK_ENABLED=true"}},
		{label: "limit raised", slot: claimSlotRaised, maxPayload: claimRaisedMaxPayload, env: []string{"WALBOX_CLAIM_CHECK_ENABLED=false"}},
	}
	for _, s := range sides {
		var opts []natstest.Option
		if s.maxPayload > 0 {
			mp := s.maxPayload
			opts = append(opts, func(o *server.Options) { o.MaxPayload = mp })
		}
		ns, err := natstest.Start(opts...)
		if err != nil {
			return nil, fmt.Errorf("start the nats-server of %s: %w", s.label, err)
		}
		b.onCleanup(ns.Close)
		nc, err := nats.Connect(ns.URL(), nats.Name("walbox-bench-claim"))
		if err != nil {
			return nil, fmt.Errorf("connect to the nats-server of %s: %w", s.label, err)
		}
		b.onCleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			return nil, fmt.Errorf("jetstream on the nats-server of %s: %w", s.label, err)
		}
		s.ns, s.nc, s.js = ns, nc, js
		s.maxPayload = int32(nc.MaxPayload())
		s.env = append(s.env, "WALBOX_NATS_URL="+ns.URL(), "WALBOX_POSTGRES_SLOT="+s.slot, claimStatusInterval)
	}
	return sides, nil
}

// claimCheck runs the phase into b.res.claim.
func (b *bench) claimCheck(ctx context.Context) error {
	t0 := time.Now()
	res := &b.res.claim
	res.Events = b.p.claimEvents()
	res.Small = b.p.PayloadBytes
	rounds := b.p.claimRounds()
	b.logf("claim check: %d rounds of %d events (every %dth %d MiB, the rest %d bytes): claim check on beside max_payload raised, then one %d MiB payload",
		rounds, res.Events, claimEvery, claimLarge>>20, res.Small, claimHuge>>20)
	sides, err := b.claimSides()
	if err != nil {
		return err
	}
	for _, s := range sides {
		if err := b.claimFirstStart(ctx, s); err != nil {
			return fmt.Errorf("%s: first start: %w", s.label, err)
		}
	}
	defer b.claimDropSlots(sides)
	pad := newClaimPad()
	for round := range rounds {
		b.logf("claim check: round %d of %d: loading %d events while both relays are stopped", round+1, rounds, res.Events)
		took, err := b.claimLoad(ctx, pad, fmt.Sprintf("%s.r%d", claimTopic, round), res.Events)
		if err != nil {
			return fmt.Errorf("round %d: load: %w", round+1, err)
		}
		res.LoadTook = append(res.LoadTook, took)
		order := []int{0, 1}
		if round%2 == 1 {
			order = []int{1, 0}
		}
		for k, i := range order {
			s := sides[i]
			run, err := b.claimDrain(ctx, s, fmt.Sprintf("claim-%d-%s", round+1, strings.ReplaceAll(s.label, " ", "-")), res.Events)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round+1, s.label, err)
			}
			run.First = k == 0
			if i == 0 {
				res.On = append(res.On, run)
			} else {
				res.Raised = append(res.Raised, run)
			}
		}
	}
	for i := range b.p.claimHugeRuns() {
		h, err := b.claimHugeRun(ctx, sides[0], pad, i)
		if err != nil {
			return fmt.Errorf("one %d MiB payload, run %d: %w", claimHuge>>20, i+1, err)
		}
		res.Huge = append(res.Huge, h)
	}
	res.Took = time.Since(t0)
	b.logf("claim check: done in %s", res.Took.Round(time.Second))
	return nil
}

// claimFirstStart starts a side's relay once to create its slot (and the
// stream, and with the claim check the bucket), lets its first backfill
// finish and stops it.
func (b *bench) claimFirstStart(ctx context.Context, s *claimSide) error {
	b.logf("claim check: %s: first relay start creates slot %q (nats-server max_payload %d)", s.label, s.slot, s.maxPayload)
	r, err := b.startRelay("claim-create-slot", s.env...)
	if err != nil {
		return err
	}
	if _, err := b.waitSlot(ctx, s.slot, true, r); err != nil {
		return err
	}
	if err := b.claimBackfillDone(ctx, r, s.slot); err != nil {
		return err
	}
	if err := b.stopRelay(r); err != nil {
		return err
	}
	_, err = b.waitSlot(ctx, s.slot, false, nil)
	return err
}

// claimBackfillDone waits until the relay has cleared its backfill marker
// for slot (waitBackfillDone is the main slot's).
func (b *bench) claimBackfillDone(ctx context.Context, r *relayProc, slot string) error {
	deadline := time.Now().Add(b.p.Stall)
	for {
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		var pending bool
		err := b.env.pool.QueryRow(qctx, `SELECT to_regclass('walbox.slot_backfill') IS NOT NULL
			AND EXISTS (SELECT 1 FROM walbox.slot_backfill WHERE slot_name = $1)`, slot).Scan(&pending)
		cancel()
		if err == nil && !pending {
			return nil
		}
		if r.exited() {
			return fmt.Errorf("relay exited (%s):\n%s", r.cmd.ProcessState, r.logs)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the relay's first backfill on slot %s was not confirmed within %s (last error: %v)", slot, b.p.Stall, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// claimDropSlots drops the phase's slots, so that they hold no WAL for the
// phases after it (the relays are stopped).
func (b *bench) claimDropSlots(sides []*claimSide) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, s := range sides {
		if _, err := b.env.pool.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", s.slot); err != nil {
			b.logf("claim check: dropping slot %s: %v", s.slot, err)
		}
	}
}

// claimLoad commits n events of topic, every claimEvery-th one large, in
// transactions of TxnRows rows over Loaders connections.
func (b *bench) claimLoad(ctx context.Context, pad claimPad, topic string, n int) (time.Duration, error) {
	p := b.p
	txns := (n + p.TxnRows - 1) / p.TxnRows
	var next, loaded atomic.Int64
	wctx, done := b.watch(ctx, "claim-check backlog load", loaded.Load, func(v int64) string { return fmt.Sprintf("%d/%d committed", v, n) })
	defer done()
	var wg sync.WaitGroup
	var errOnce sync.Once
	var firstErr error
	t0 := time.Now()
	for range p.Loaders {
		wg.Go(func() {
			fail := func(err error) { errOnce.Do(func() { firstErr = cause(wctx, err) }) }
			conn, err := pgx.Connect(wctx, b.env.dbURL)
			if err != nil {
				fail(fmt.Errorf("connect: %w", err))
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
					i := t*p.TxnRows + j
					rows[j] = pad.payload(i, b.claimSize(i))
				}
				if _, err := conn.Exec(wctx, insertRows, topic, rows[:k]); err != nil {
					fail(fmt.Errorf("insert transaction %d: %w", t, err))
					return
				}
				loaded.Add(int64(k))
			}
		})
	}
	wg.Wait()
	return time.Since(t0), firstErr
}

// claimStream reads the BENCH stream's message count and bytes on a side's
// server, and the bytes of the claim-check bucket's stream (0 without one).
func claimStream(ctx context.Context, s *claimSide) (msgs, bytes, objBytes uint64, err error) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := s.js.Stream(qctx, benchStream)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("stream %s on the nats-server of %s: %w", benchStream, s.label, err)
	}
	info, err := st.Info(qctx)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("stream %s info on the nats-server of %s: %w", benchStream, s.label, err)
	}
	// An Object Store bucket is the stream OBJ_<bucket>.
	if ob, err := s.js.Stream(qctx, "OBJ_"+benchStream+"_CLAIMS"); err == nil {
		if oi, err := ob.Info(qctx); err == nil {
			objBytes = oi.State.Bytes
		}
	}
	return info.State.Msgs, info.State.Bytes, objBytes, nil
}

// claimWait polls until the side's stream holds target messages; the relay
// exiting is an error.
func (b *bench) claimWait(ctx context.Context, s *claimSide, r *relayProc, what string, base, target uint64) error {
	var stored atomic.Int64
	wctx, done := b.watch(ctx, what, stored.Load, func(v int64) string { return fmt.Sprintf("%d/%d stored", v, target-base) })
	defer done()
	for {
		n, _, _, err := claimStream(wctx, s)
		if err == nil {
			stored.Store(int64(n - base))
			if n >= target {
				return nil
			}
		}
		if r.exited() {
			return fmt.Errorf("relay exited during %s (%s):\n%s", what, r.cmd.ProcessState, r.logs)
		}
		select {
		case <-wctx.Done():
			return cause(wctx, wctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// claimMsg reads one stored message of the side's stream.
func claimMsg(ctx context.Context, s *claimSide, seq uint64) (*jetstream.RawStreamMsg, error) {
	qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := s.js.Stream(qctx, benchStream)
	if err != nil {
		return nil, err
	}
	m, err := st.GetMsg(qctx, seq)
	if err != nil {
		return nil, fmt.Errorf("read message %d of %s on the nats-server of %s: %w", seq, benchStream, s.label, err)
	}
	return m, nil
}

// claimDrain starts a side's relay on the committed backlog of n events,
// times it until the last one is stored, checks how the large ones went,
// lets the relay settle and stops it.
func (b *bench) claimDrain(ctx context.Context, s *claimSide, phase string, n int) (claimRun, error) {
	run := claimRun{Events: n, Large: n / claimEvery}
	base, bytes0, obj0, err := claimStream(ctx, s)
	if err != nil {
		return run, err
	}
	target := base + uint64(n)
	meter, self0 := b.startPhase(0), selfCPU()
	r, err := b.startRelay(phase, s.env...)
	if err != nil {
		return run, err
	}
	meter.relay = r.pid()
	if err := b.claimWait(ctx, s, r, phase, base, target); err != nil {
		return run, err
	}
	_, run.Where, run.Span = meter.stop()
	if run.CPU, err = r.cpu(); err != nil {
		return run, fmt.Errorf("relay CPU: %w", err)
	}
	if run.HWM, err = r.hwm(); err != nil {
		return run, fmt.Errorf("relay peak RSS: %w", err)
	}
	run.DriverCPU = selfCPU() - self0
	if run.Uploads, err = relayCounter(ctx, b.env.metrics, metricClaimUploads); err != nil {
		return run, fmt.Errorf("read %s: %w", metricClaimUploads, err)
	}
	_, bytes1, obj1, err := claimStream(ctx, s)
	if err != nil {
		return run, err
	}
	run.StreamBytes, run.ObjectBytes = bytes1-bytes0, obj1-obj0
	last, err := claimMsg(ctx, s, target)
	if err != nil {
		return run, err
	}
	run.Took = last.Time.Sub(r.started)
	// The large events went as this side says: uploads and references
	// with the claim check, whole messages without it.
	large := uint64(run.Large) * claimLarge
	switch {
	case s.slot == claimSlotOn && (run.Uploads < float64(run.Large) || run.ObjectBytes < large || run.StreamBytes >= large):
		return run, fmt.Errorf("claim check on: %.0f uploads for %d large events, the bucket grew by %d bytes and the stream by %d", run.Uploads, run.Large, run.ObjectBytes, run.StreamBytes)
	case s.slot != claimSlotOn && (run.Uploads != 0 || run.StreamBytes < large):
		return run, fmt.Errorf("limit raised: %.0f uploads; the stream grew by %d bytes for %d large events", run.Uploads, run.StreamBytes, run.Large)
	}
	if err := b.claimSettle(ctx, r, s.slot); err != nil {
		return run, err
	}
	if err := b.stopRelay(r); err != nil {
		return run, err
	}
	b.logf("%s: %d events (%d large) in %.2fs: %.0f events/s; relay CPU %.2fs, peak RSS %.1f MB; %.0f uploads; stream +%.1f MB, bucket +%.1f MB",
		phase, n, run.Large, run.Took.Seconds(), rate(n, run.Took), run.CPU.Seconds(), mb(run.HWM), run.Uploads, mb(int64(run.StreamBytes)), mb(int64(run.ObjectBytes)))
	return run, nil
}

// claimSettle lets the relay finish what its run left behind before it
// stops (settle's work, for a slot of this phase): every row of the phase
// marked processed, the slot confirmed past a checkpoint and its restart
// point moved past the WAL written so far, so that the next relay on the
// slot does not decode this backlog again.
func (b *bench) claimSettle(ctx context.Context, r *relayProc, slot string) error {
	if !markOff(r.cmd.Env, b.p.Sets) {
		err := b.pollRelay(ctx, r, "waiting for the sweeper to mark the phase's rows processed", func(ctx context.Context) (bool, error) {
			var left bool
			err := b.env.pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM outbox_events WHERE topic LIKE $1 AND NOT processed)", claimTopic+".%").Scan(&left)
			return !left, err
		})
		if err != nil {
			return err
		}
	}
	return b.settleSlot(ctx, r, slot)
}

// markOff says whether a relay runs with the processed flag off.
func markOff(env, sets []string) bool {
	for _, kv := range env {
		if kv == "WALBOX_SWEEPER_MARK_PROCESSED=false" {
			return true
		}
	}
	for _, s := range sets {
		if s == "sweeper.mark_processed=false" {
			return true
		}
	}
	return false
}

// procStatusBytes reads a size field of /proc/<pid>/status (e.g. "VmRSS:").
func procStatusBytes(pid int, field string) (int64, error) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, field); ok {
			f := strings.Fields(v)
			if len(f) == 0 {
				break
			}
			kb, err := strconv.ParseInt(f[0], 10, 64)
			return kb * 1024, err
		}
	}
	return 0, fmt.Errorf("/proc/%d/status: no %s", pid, field)
}

// claimHugeRun starts a fresh claim-check relay, reads its peak RSS while it
// streams idle (the baseline), commits small events, one 64 MiB payload and
// small events again, each a transaction, and reads its peak RSS once all
// are stored.
func (b *bench) claimHugeRun(ctx context.Context, s *claimSide, pad claimPad, run int) (claimHugeResult, error) {
	res := claimHugeResult{Payload: claimHuge}
	cfg, err := config.Load(b.env.cfgFile, s.env)
	if err != nil {
		return res, fmt.Errorf("read the relay's config for nats.window_bytes: %w", err)
	}
	res.WindowBytes = cfg.NATS.WindowBytes
	b.logf("claim check: one %d MiB payload, run %d of %d: a fresh relay with the claim check on (nats.window_bytes %d MiB)",
		claimHuge>>20, run+1, b.p.claimHugeRuns(), res.WindowBytes>>20)
	r, err := b.startRelay(fmt.Sprintf("claim-64mib-%d", run+1), s.env...)
	if err != nil {
		return res, err
	}
	if _, err := b.waitSlot(ctx, s.slot, true, r); err != nil {
		return res, err
	}
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(claimIdle):
	}
	if res.BaseHWM, err = r.hwm(); err != nil {
		return res, fmt.Errorf("relay baseline VmHWM: %w", err)
	}
	if res.BaseRSS, err = procStatusBytes(r.pid(), "VmRSS:"); err != nil {
		return res, fmt.Errorf("relay baseline VmRSS: %w", err)
	}
	base, _, _, err := claimStream(ctx, s)
	if err != nil {
		return res, err
	}
	topic := fmt.Sprintf("%s.huge%d", claimTopic, run+1)
	small := make([]string, claimHugeSmall)
	for i := range small {
		small[i] = payloadFor(i, b.p.PayloadBytes, 0)
	}
	huge := pad.payload(claimHugeSmall, claimHuge)
	ictx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	for i, rows := range [][]string{small, {huge}, small} {
		if _, err := b.env.pool.Exec(ictx, insertRows, topic, rows); err != nil {
			cancel()
			return res, fmt.Errorf("insert transaction %d of 3: %w", i+1, err)
		}
	}
	cancel()
	target := base + 2*claimHugeSmall + 1
	if err := b.claimWait(ctx, s, r, "the 64 MiB payload", base, target); err != nil {
		return res, err
	}
	if res.Peak, err = r.hwm(); err != nil {
		return res, fmt.Errorf("relay peak RSS: %w", err)
	}
	if res.Uploads, err = relayCounter(ctx, b.env.metrics, metricClaimUploads); err != nil {
		return res, fmt.Errorf("read %s: %w", metricClaimUploads, err)
	}
	m, err := claimMsg(ctx, s, base+claimHugeSmall+1)
	if err != nil {
		return res, err
	}
	q, err := url.ParseQuery(m.Header.Get(relay.HeaderClaimCheck))
	if err != nil || q.Get("size") != strconv.Itoa(claimHuge) {
		return res, fmt.Errorf("the 64 MiB event was stored with %s %q and %d bytes (%v)", relay.HeaderClaimCheck, m.Header.Get(relay.HeaderClaimCheck), len(m.Data), err)
	}
	commit, err := time.Parse(time.RFC3339Nano, m.Header.Get(relay.HeaderCommitTime))
	if err != nil {
		return res, fmt.Errorf("the 64 MiB event's %s: %w", relay.HeaderCommitTime, err)
	}
	res.Took = m.Time.Sub(commit)
	if err := b.claimSettle(ctx, r, s.slot); err != nil {
		return res, err
	}
	if err := b.stopRelay(r); err != nil {
		return res, err
	}
	b.logf("claim check: one %d MiB payload stored %.2fs after its commit; relay VmHWM %.1f MB before (VmRSS %.1f MB), %.1f MB after",
		claimHuge>>20, res.Took.Seconds(), mb(res.BaseHWM), mb(res.BaseRSS), mb(res.Peak))
	return res, nil
}

// hugeBound is what the 64 MiB run's peak is held to: the baseline plus
// nats.window_bytes plus the payload.
func (h claimHugeResult) bound() int64 { return h.BaseHWM + h.WindowBytes + int64(h.Payload) }

// claimReport adds the phase's rows.
func (r *results) claimReport(head func(string), add func(what, value, target, verdict string)) {
	c := r.claim
	if len(c.On) == 0 {
		return
	}
	head(fmt.Sprintf("Claim check (issue 39): %d events per round, every %dth a %d MiB payload (5 %%), the rest %d bytes; "+
		"claim check on (Object Store; nats-server max_payload 1 MiB, threshold %d KiB) beside the limit raised (claim check off, max_payload %d MiB); %d rounds, sides alternating",
		c.Events, claimEvery, claimLarge>>20, c.Small, claimDefaultThreshold>>10, claimRaisedMaxPayload>>20, len(c.On)))
	evs := func(x claimRun) float64 { return rate(x.Events, x.Took) }
	on, raised := medianRun(c.On, evs), medianRun(c.Raised, evs)
	payloadMB := func(x claimRun) float64 {
		return rate(x.Events, x.Took) * (float64(x.Large)*claimLarge + float64(x.Events-x.Large)*float64(c.Small)) / float64(x.Events) / (1 << 20)
	}
	rounds := func(runs []claimRun, f func(claimRun) string) string {
		vs := make([]string, len(runs))
		for i, x := range runs {
			vs[i] = f(x)
			if x.First {
				vs[i] += "*"
			}
		}
		return strings.Join(vs, ", ")
	}
	add("events/s, relay spawn → last message stored, median of the rounds (the lower middle one): claim check on (limit raised)",
		fmt.Sprintf("%.0f (limit raised: %.0f); payload %.0f MB/s (%.0f); rounds, * = went first: on %s / raised %s",
			evs(on), evs(raised), payloadMB(on), payloadMB(raised),
			rounds(c.On, func(x claimRun) string { return fmt.Sprintf("%.0f", evs(x)) }),
			rounds(c.Raised, func(x claimRun) string { return fmt.Sprintf("%.0f", evs(x)) })), "none set", "")
	ratios := make([]string, len(c.On))
	for i := range c.On {
		ratios[i] = fmt.Sprintf("%.2f", ratioOf(evs(c.On[i]), evs(c.Raised[i])))
	}
	add("  claim check on ÷ limit raised, events/s", fmt.Sprintf("%.2f (medians); round by round %s", ratioOf(evs(on), evs(raised)), strings.Join(ratios, " ")), "", "")
	hwm := func(x claimRun) float64 { return float64(x.HWM) }
	hOn, hRaised := medianRun(c.On, hwm), medianRun(c.Raised, hwm)
	add("relay peak RSS (VmHWM), median of the rounds: claim check on (limit raised)",
		fmt.Sprintf("%.1f MB (limit raised: %.1f MB); rounds: on %s / raised %s", mb(hOn.HWM), mb(hRaised.HWM),
			rounds(c.On, func(x claimRun) string { return fmt.Sprintf("%.1f", mb(x.HWM)) }),
			rounds(c.Raised, func(x claimRun) string { return fmt.Sprintf("%.1f", mb(x.HWM)) })), "none set", "")
	add("  relay CPU µs/event; bench process (the nats-servers, polling) CPU µs/event: claim check on (limit raised), medians",
		fmt.Sprintf("%.0f; %.0f (limit raised: %.0f; %.0f)",
			us(perEvent(medianRun(c.On, func(x claimRun) float64 { return float64(x.CPU) }).CPU, c.Events)),
			us(perEvent(medianRun(c.On, func(x claimRun) float64 { return float64(x.DriverCPU) }).DriverCPU, c.Events)),
			us(perEvent(medianRun(c.Raised, func(x claimRun) float64 { return float64(x.CPU) }).CPU, c.Events)),
			us(perEvent(medianRun(c.Raised, func(x claimRun) float64 { return float64(x.DriverCPU) }).DriverCPU, c.Events))), "", "")
	add("  foreign load (processes not part of the benchmark) while each run relayed, share of all CPUs: claim check on / limit raised",
		rounds(c.On, func(x claimRun) string { return fmt.Sprintf("%.0f%%", r.foreign(x.Where, x.Span)*100) })+" / "+
			rounds(c.Raised, func(x claimRun) string { return fmt.Sprintf("%.0f%%", r.foreign(x.Where, x.Span)*100) }), "", "")
	add("  stored per round: claim check on, uploads / stream / bucket; limit raised, stream",
		fmt.Sprintf("%.0f uploads for %d large events / %.1f MB / %.1f MB; %.1f MB", on.Uploads, on.Large, mb(int64(on.StreamBytes)), mb(int64(on.ObjectBytes)), mb(int64(raised.StreamBytes))), "", "")
	if len(c.Huge) == 0 {
		return
	}
	// The target holds for every run: the verdict is the worst one's.
	worst := c.Huge[0]
	runs := make([]string, len(c.Huge))
	for i, h := range c.Huge {
		runs[i] = fmt.Sprintf("%.1f (%.1f) → %.1f MB, +%.1f MB = %.2f × the payload, %.2f s",
			mb(h.BaseHWM), mb(h.BaseRSS), mb(h.Peak), mb(h.Peak-h.BaseHWM), float64(h.Peak-h.BaseHWM)/float64(h.Payload), h.Took.Seconds())
		if h.Peak-h.bound() > worst.Peak-worst.bound() {
			worst = h
		}
	}
	add(fmt.Sprintf("one %d MiB payload, claim check on, %d fresh relays: VmHWM streaming idle before it (baseline; VmRSS then) → VmHWM once it and %d small events are stored; commit → stored",
		worst.Payload>>20, len(c.Huge), 2*claimHugeSmall), strings.Join(runs, "; "), "", "")
	add("target: that VmHWM ≤ baseline VmHWM + nats.window_bytes + the payload (the run closest to its bound)",
		fmt.Sprintf("%.1f MB against %.1f + %.1f + %.1f = %.1f MB (%+.1f MB)", mb(worst.Peak), mb(worst.BaseHWM), mb(worst.WindowBytes), mb(int64(worst.Payload)),
			mb(worst.bound()), mb(worst.Peak-worst.bound())),
		fmt.Sprintf("≤ window_bytes (%d MiB) + %d MiB over the baseline", worst.WindowBytes>>20, worst.Payload>>20), verdict(worst.Peak <= worst.bound()))
}

// runClaim is `go run . claim`: the phase alone, into
// bench/results/claim.md.
func runClaim(ctx context.Context, b *bench) error {
	env, err := b.setup(ctx)
	if err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	b.env = env
	b.res.env = env.info
	if err := b.claimCheck(ctx); err != nil {
		return fmt.Errorf("claim check: %w", err)
	}
	var t table
	b.res.claimReport(func(s string) { t = append(t, row{section: true, measure: s}) },
		func(what, value, target, v string) {
			t = append(t, row{measure: what, result: value, target: target, verdict: v})
		})
	mode := "full"
	if b.p.Quick {
		mode = "quick (`-quick`)"
	}
	e, c := env.info, b.res.claim
	var sb strings.Builder
	fmt.Fprintf(&sb, "# walbox benchmark: the claim check beside a raised limit (`go run . claim`)\n\n")
	fmt.Fprintf(&sb, "- Date: %s (run took %s; the phase %s)\n- Mode: %s\n", time.Now().UTC().Format("2006-01-02 15:04 MST"),
		time.Since(b.start).Round(time.Second), c.Took.Round(time.Second), mode)
	fmt.Fprintf(&sb, "- Machine: %d CPUs (%s), %s memory, Linux %s\n", e.CPUs, e.CPUModel, e.MemTotal, e.Kernel)
	fmt.Fprintf(&sb, "- Versions: walbox %s, %s, PostgreSQL %s (%s), nats-server %s (embedded)\n", e.Walbox, e.GoVersion, e.PGVersion, e.PGSet, e.NATS)
	loads := make([]string, len(c.LoadTook))
	for i, d := range c.LoadTook {
		loads[i] = fmt.Sprintf("%.1f s", d.Seconds())
	}
	fmt.Fprintf(&sb, "- Backlog: %d events per round, %d per transaction over %d connections, committed once per round with both relays stopped (%s)\n\n",
		c.Events, b.p.TxnRows, b.p.Loaders, strings.Join(loads, ", "))
	sb.WriteString(t.markdownTable())
	if len(b.res.relayWarnings) > 0 {
		sb.WriteString("\nThe relay logged (warn level and up):\n\n")
		for _, w := range b.res.relayWarnings {
			sb.WriteString("- " + w + "\n")
		}
	}
	sb.WriteString(claimHow)
	fmt.Print(sb.String())
	out := b.p.Out
	if out == "" {
		out = filepath.Join(env.moduleDir, "bench", "results", "claim.md")
	}
	if err := os.WriteFile(out, []byte(sb.String()), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", out, err)
	}
	b.logf("done: results written to %s", out)
	return nil
}

const claimHow = `
How it is measured:

- Two embedded nats-servers (file store), one per side: the claim-check side's keeps
  nats-server's default max_payload (1 MiB), so the relay derives its default threshold
  (1 MiB less 64 KiB) and creates the Object Store bucket BENCH_CLAIMS; the other side's
  max_payload is 8 MiB, its relay runs with the claim check off (its stream has no
  max_msg_size). Each side's relay has a slot of its own, created before the first backlog,
  and is pointed at its server and slot through WALBOX_NATS_URL and WALBOX_POSTGRES_SLOT;
  both run with WALBOX_POSTGRES_STATUS_INTERVAL=1s (default 10 s), so that the settle after
  each run (below) takes seconds; otherwise the relays run walbox's default config.
- Each round commits one backlog with both relays stopped (every 20th event a 4 MiB payload of
  incompressible text, so that TOAST does not shrink it; the rest payloadFor's 200 bytes); then
  each side's relay, a fresh process, drains it from its slot: the same WAL for both. Which side
  goes first alternates round by round. events/s = events ÷ (relay spawn → the JetStream stored
  timestamp of the last message); payload MB/s counts the payloads' bytes. Peak RSS = the
  relay's VmHWM at that moment; CPU from /proc/<pid>/stat. Each run checks that the large events
  went as its side says (uploads and a reference, or the whole payload in the message) and
  lets the relay settle (rows marked, slot confirmed past a checkpoint) before it stops.
- One 64 MiB payload, three times (-quick: twice), each with a fresh claim-check relay: it streams idle for
  3 s; its VmHWM then is the baseline. Ten small events, the 64 MiB one and ten small events are
  committed, each group one transaction; once all 21 are stored the relay's VmHWM is the peak.
  The target (issue 39) holds the peak to the baseline plus nats.window_bytes plus the one
  payload, in every run: the verdict is the run closest to (or furthest over) its bound.
`
