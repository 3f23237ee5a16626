package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

// liveResult is one live rate of one system.
type liveResult struct {
	System       string // walbox, polling, watermill
	Rate         int    // asked
	Producers    int
	Events       int
	Achieved     float64       // committed events/s
	P50, P90     time.Duration // commit -> ack (walbox: Walbox-Commit-Time header)
	P99, Max     time.Duration
	StoreP50     time.Duration // insert time in the payload -> JetStream stored, every system
	StoreP90     time.Duration
	StoreP99     time.Duration
	StoreMax     time.Duration
	InsertP50    time.Duration // producer side: INSERT + COMMIT round trip
	InsertP99    time.Duration
	Split        splitLatency  // walbox: commit → ack cut at PostgreSQL's send
	Batch        batchCounts   // walbox: its fast-batch counters' growth over the run
	CPU          time.Duration // relay, over the run
	SysmonCPU    time.Duration // the relay's, part of CPU (see sysmonCPU)
	WalsenderCPU time.Duration
	// Wake-ups of the relay's threads and of its walsender (voluntary
	// context switches), over the run.
	Wakeups, WalsenderWakeups uint64
	Busy                      float64
	Where                     []cpuShare
	Span                      time.Duration

	store []time.Duration // sorted insert -> stored latencies, for the chart
}

// liveTarget is a relay under live load: walbox or a peer.
type liveTarget struct {
	system  string
	stream  string
	subject string // events of rate r go to subject.r<r>
	proc    *relayProc
	wsPID   int    // walbox's walsender (0: none)
	metrics string // walbox's metrics address ("": none)
	header  bool   // messages carry Walbox-Commit-Time
	producers
}

// producers is how a live load writes its events.
type producers struct {
	// produce commits single-event transactions at rate until end.
	produce func(ctx context.Context, subject string, rate int, start, end time.Time) (produced, error)
	// probe, if set, commits one event on subject (the first one is not
	// latency: a fresh walsender re-reads WAL, a poller wakes up).
	probe func(ctx context.Context, subject string) error
}

// produced is what the producers of one live rate did.
type produced struct {
	Events    int
	Achieved  float64
	Producers int
	InsertP50 time.Duration
	InsertP99 time.Duration
	commits   []latSample // each INSERT's start and return, when known
}

// bigResult is the single large transaction.
type bigResult struct {
	Rows         int
	InsertTook   time.Duration // INSERT ... SELECT generate_series, incl. commit
	FirstAck     time.Duration // commit -> first ack
	Took         time.Duration // commit -> last ack
	CPU          time.Duration // relay, from before the INSERT to the last ack
	HWM          int64         // relay VmHWM (a fresh process)
	WalsenderCPU time.Duration
	Batch        batchCounts // the relay's fast-batch counters at the last ack
	Busy         float64
	Where        []cpuShare
	Span         time.Duration
	// The same, from the commit to the last ack only: what relaying the
	// transaction cost every process, without the INSERT.
	RelayBusy  float64
	RelayWhere []cpuShare
	RelaySpan  time.Duration
}

// livePool is a pool for the paced SQL producers of every rate, and at
// least need connections.
func (b *bench) livePool(ctx context.Context, need int) (*pgxpool.Pool, error) {
	maxProducers := need
	for _, r := range b.p.Rates {
		maxProducers = max(maxProducers, producersFor(r))
	}
	cfg, err := pgxpool.ParseConfig(b.env.dbURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = b.p.SyncCommit
	cfg.MaxConns, cfg.MinConns = int32(maxProducers), int32(maxProducers)
	return pgxpool.NewWithConfig(ctx, cfg)
}

func (b *bench) live(ctx context.Context) error {
	pool, err := b.livePool(ctx, b.p.MaxConns)
	if err != nil {
		return err
	}
	defer pool.Close()

	// The catch-up rounds left dead row versions for autovacuum to chew
	// on in the middle of a rate: clean up first, with the relay stopped.
	if err := b.vacuum(ctx, "the catch-up rounds left dead rows"); err != nil {
		return err
	}
	// The floor and the producers' maximum rate, with the relay stopped.
	if err := b.floor(ctx, pool); err != nil {
		return fmt.Errorf("floor: %w", err)
	}
	if err := b.vacuum(ctx, "the floor's events were marked processed"); err != nil {
		return err
	}
	b.logf("live: starting the relay (a fresh process)")
	t, err := b.walboxLive(ctx, pool, "live", "walbox", "bench.live")
	if err != nil {
		return err
	}
	for _, rate := range b.p.Rates {
		res, err := b.liveRate(ctx, t, rate)
		if err != nil {
			return err
		}
		b.res.live = append(b.res.live, res)
	}
	// The producers' maximum rate alone, offered with the relay running.
	// As many producers as reached it (at least), each paced.
	mr := b.res.maxTarget()
	t.produce = b.sqlProducersN(pool, b.p.MaxConns)
	if producersFor(mr) > b.p.MaxConns {
		mp, err := b.livePool(ctx, producersFor(mr))
		if err != nil {
			return err
		}
		defer mp.Close()
		t.produce = b.sqlProducersN(mp, b.p.MaxConns)
	}
	b.logf("live walbox: the producers' maximum rate alone (%.0f/s), offered as %d/s with the relay running", b.res.maxAlone.Achieved, mr)
	t.subject = "bench.live.max" // its own subject, even if the rate is one of the above
	res, err := b.liveRate(ctx, t, mr)
	if err != nil {
		return err
	}
	b.res.maxRelay = res
	if err := b.stopRelay(t.proc); err != nil {
		return err
	}
	if err := b.liveNoFlag(ctx, pool); err != nil {
		return err
	}
	if err := b.livePerMsg(ctx, pool); err != nil {
		return fmt.Errorf("per-message path: %w", err)
	}
	if err := b.liveTraced(ctx, pool); err != nil {
		return err
	}
	// Long enough for a profile's share to rest on over 1,000 samples.
	profiled := 150 * time.Second
	if b.p.Quick {
		profiled = 30 * time.Second
	}
	if err := b.liveTracedProfiled(ctx, pool, profiled); err != nil {
		return err
	}
	rounds, pairs := 2, 5
	if b.p.Quick {
		rounds, pairs = 1, 2
	}
	if err := b.consoleCost(ctx, pool, rounds); err != nil {
		return err
	}
	if err := b.consoleToggle(ctx, pool, pairs); err != nil {
		return err
	}
	return b.consoleProfile(ctx, pool, profiled)
}

// liveNoFlag runs the live rates up to 2,000/s again with a fresh relay
// that marks no rows (WALBOX_SWEEPER_MARK_PROCESSED=false): the processed
// flag's target is no effect on live p99.
func (b *bench) liveNoFlag(ctx context.Context, pool *pgxpool.Pool) error {
	var rates []int
	for _, r := range b.p.Rates {
		if r <= 2000 {
			rates = append(rates, r)
		}
	}
	if len(rates) == 0 {
		return nil
	}
	if err := b.vacuum(ctx, "the relay's live runs marked their rows"); err != nil {
		return err
	}
	b.logf("live: starting the relay with the processed flag off (WALBOX_SWEEPER_MARK_PROCESSED=false)")
	t, err := b.walboxLive(ctx, pool, "live-noflag", "walbox-noflag", "bench.live.noflag", "WALBOX_SWEEPER_MARK_PROCESSED=false")
	if err != nil {
		return err
	}
	for _, rate := range rates {
		res, err := b.liveRate(ctx, t, rate)
		if err != nil {
			return err
		}
		b.res.liveNoFlag = append(b.res.liveNoFlag, res)
	}
	return b.stopRelay(t.proc)
}

// walboxLive starts a fresh walbox relay (env: its extra environment),
// waits until it streams and warms it up: a live target on the bench's
// stream whose producers use pool.
func (b *bench) walboxLive(ctx context.Context, pool *pgxpool.Pool, phase, system, subject string, env ...string) (liveTarget, error) {
	r, wsPID, err := b.startStreaming(ctx, phase, env...)
	if err != nil {
		return liveTarget{}, err
	}
	t := liveTarget{system: system, stream: benchStream, subject: subject, proc: r, wsPID: wsPID, header: true,
		metrics: b.env.metrics, producers: b.sqlLoad(pool)}
	return t, b.warmUp(ctx, t)
}

// vacuum runs VACUUM ANALYZE on the outbox and a CHECKPOINT, with no relay
// running: what a phase left behind is not cleaned up in the next one.
func (b *bench) vacuum(ctx context.Context, why string) error {
	b.logf("live: VACUUM ANALYZE outbox_events and CHECKPOINT first (%s)", why)
	qctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	_, err := b.env.pool.Exec(qctx, "VACUUM ANALYZE outbox_events")
	if err == nil {
		_, err = b.env.pool.Exec(qctx, "CHECKPOINT")
	}
	if err != nil {
		return fmt.Errorf("vacuum before the live phase: %w", err)
	}
	return nil
}

// warmUp runs t's producers at the first rate for 3 s (-quick: 1 s),
// unmeasured, and
// waits until the relay has delivered them: a fresh relay, fresh producer
// connections and cold caches are not what the rates measure.
func (b *bench) warmUp(ctx context.Context, t liveTarget) error {
	rate := b.p.Rates[0]
	subject := t.subject + ".warmup"
	before, err := b.streamMsgs(ctx, t.stream)
	if err != nil {
		return err
	}
	d := 3 * time.Second
	if b.p.Quick {
		d = time.Second
	}
	b.logf("live %s: %v warm-up at %d/s (not measured)", t.system, d, rate)
	start := time.Now().Add(20 * time.Millisecond)
	prod, err := t.produce(ctx, subject, rate, start, start.Add(d))
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	return b.waitStream(ctx, t, before+uint64(prod.Events), fmt.Sprintf("the %d warm-up events", prod.Events), 50*time.Millisecond)
}

// waitStream waits until t's stream holds at least n messages.
func (b *bench) waitStream(ctx context.Context, t liveTarget, n uint64, what string, every time.Duration) error {
	deadline := time.Now().Add(b.p.Stall)
	for {
		got, err := b.streamMsgs(ctx, t.stream)
		if err == nil && got >= n {
			return nil
		}
		if t.proc.exited() {
			return fmt.Errorf("%s relay exited while waiting for %s (%s):\n%s", t.system, what, t.proc.cmd.ProcessState, t.proc.logs)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not in stream %s within %s", what, t.stream, b.p.Stall)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(every):
		}
	}
}

// producersFor is the number of paced producer goroutines for a rate: each
// commits at most 125 events/s, far below what one connection can do.
func producersFor(rate int) int { return max(4, (rate+124)/125) }

// insertOne commits one event into outbox_events.
func (b *bench) insertOne(ctx context.Context, pool *pgxpool.Pool, subject string) error {
	_, err := pool.Exec(ctx, "INSERT INTO outbox_events (topic, payload) VALUES ($1, $2::jsonb)", subject, payloadFor(0, b.p.PayloadBytes, 0))
	return err
}

// sqlLoad is the live load of walbox and the polling baseline: paced
// producers and a probe that insert into outbox_events.
func (b *bench) sqlLoad(pool *pgxpool.Pool) producers {
	return producers{
		produce: b.sqlProducers(pool),
		probe:   func(ctx context.Context, subject string) error { return b.insertOne(ctx, pool, subject) },
	}
}

// sqlProducers returns paced producers that commit single-event
// transactions into outbox_events (walbox and the polling baseline).
func (b *bench) sqlProducers(pool *pgxpool.Pool) produceFunc {
	return b.sqlProducersN(pool, 0)
}

// produceFunc commits single-event transactions at rate from start to end.
type produceFunc = func(ctx context.Context, subject string, rate int, start, end time.Time) (produced, error)

// sqlProducersN is sqlProducers with at least n producers.
func (b *bench) sqlProducersN(pool *pgxpool.Pool, n int) produceFunc {
	return func(ctx context.Context, subject string, rate int, start, end time.Time) (produced, error) {
		g := max(n, producersFor(rate))
		res := produced{Producers: g}
		interval := time.Duration(int64(time.Second) * int64(g) / int64(rate))
		// Warm every connection, so connecting is not measured.
		conns := make([]*pgxpool.Conn, 0, g)
		for range g {
			c, err := pool.Acquire(ctx)
			if err != nil {
				return res, err
			}
			conns = append(conns, c)
		}
		for _, c := range conns {
			if err := c.Ping(ctx); err != nil {
				return res, err
			}
			c.Release()
		}
		var mu sync.Mutex
		var committed, lastCommit atomic.Int64
		var wg sync.WaitGroup
		var errOnce sync.Once
		var prodErr error
		for i := range g {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Spread the producers over the interval, not in bursts.
				select {
				case <-time.After(time.Until(start.Add(interval * time.Duration(i) / time.Duration(g)))):
				case <-ctx.Done():
					return
				}
				tk := time.NewTicker(interval)
				defer tk.Stop()
				var mine []latSample
				defer func() {
					mu.Lock()
					res.commits = append(res.commits, mine...)
					mu.Unlock()
				}()
				for n := 0; time.Now().Before(end); n++ {
					t0 := time.Now()
					payload := payloadFor(i*1_000_000+n, b.p.PayloadBytes, t0.UnixNano())
					if _, err := pool.Exec(ctx, "INSERT INTO outbox_events (topic, payload) VALUES ($1, $2::jsonb)", subject, payload); err != nil {
						errOnce.Do(func() { prodErr = cause(ctx, err) })
						return
					}
					t1 := time.Now()
					mine = append(mine, latSample{t0, t1})
					committed.Add(1)
					lastCommit.Store(t1.UnixNano())
					select {
					case <-tk.C:
					case <-ctx.Done():
						return
					}
				}
			}()
		}
		wg.Wait()
		if prodErr != nil {
			return res, fmt.Errorf("producer: %w", prodErr)
		}
		res.Events = int(committed.Load())
		res.Achieved = rate2(res.Events, time.Unix(0, lastCommit.Load()).Sub(start))
		cl := make([]time.Duration, len(res.commits))
		for i, c := range res.commits {
			cl[i] = c.ack.Sub(c.commit)
		}
		slices.Sort(cl)
		if len(cl) > 0 {
			res.InsertP50, res.InsertP99 = pct(cl, 0.5), pct(cl, 0.99)
		}
		return res, nil
	}
}

// liveRate runs one rate against t: paced producers for LiveFor, then
// waits until every event is in the stream.
func (b *bench) liveRate(ctx context.Context, t liveTarget, rate int) (liveResult, error) {
	res := liveResult{System: t.system, Rate: rate, Producers: producersFor(rate)}
	subject := fmt.Sprintf("%s.r%d", t.subject, rate)
	b.logf("live %s %d/s: single-event transactions for %v (producer synchronous_commit=%s)", t.system, rate, b.p.LiveFor, b.p.SyncCommit)

	// The ack time of each event is its JetStream stored timestamp, read
	// from an ordered consumer's metadata; the commit time is walbox's
	// Walbox-Commit-Time header (the transaction's commit timestamp), the
	// insert time is in the payload.
	var mu sync.Mutex
	capHint := rate * int(b.p.LiveFor/time.Second+1)
	lats := make([]time.Duration, 0, capHint)
	store := make([]time.Duration, 0, capHint)
	var samples []latSample // for -latency-csv
	var received, bad atomic.Int64
	cons, err := b.env.js.OrderedConsumer(ctx, t.stream, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}})
	if err != nil {
		return res, err
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		md, err := m.Metadata()
		ts, ok := payloadTime(m.Data())
		var ct time.Time
		var err2 error
		if t.header {
			ct, err2 = time.Parse(time.RFC3339Nano, m.Headers().Get("Walbox-Commit-Time"))
		}
		if err != nil || err2 != nil || !ok {
			bad.Add(1)
		} else {
			mu.Lock()
			store = append(store, md.Timestamp.Sub(ts))
			if t.header {
				lats = append(lats, md.Timestamp.Sub(ct))
				if b.p.LatencyCSV != "" {
					samples = append(samples, latSample{ct, md.Timestamp})
				}
			}
			mu.Unlock()
		}
		received.Add(1)
	})
	if err != nil {
		return res, err
	}
	defer cc.Stop()

	if t.probe != nil {
		if err := b.probe(ctx, t, subject+".probe"); err != nil {
			return res, err
		}
	}
	cpu0, err := t.proc.cpu()
	if err != nil {
		return res, err
	}
	sysmon0, sysmonErr := sysmonCPU(t.proc.pid())
	ws0, _ := procCPU(t.wsPID)
	wake0, _ := procWakeups(t.proc.pid())
	wsWake0, _ := procWakeups(t.wsPID)
	var hist0 map[string]histSnapshot
	var batch0 batchCounts
	if t.metrics != "" {
		if hist0, err = relayHistograms(ctx, t.metrics); err != nil {
			return res, err
		}
		if batch0, err = relayBatchCounts(ctx, t.metrics); err != nil {
			return res, err
		}
	}
	meter := b.startPhase(t.proc.pid())
	var producing atomic.Bool
	producing.Store(true)
	wctx, done := b.watch(ctx, fmt.Sprintf("live %s %d/s", t.system, rate), func() int64 {
		if producing.Load() {
			return time.Now().UnixNano() // the producers have their own deadline
		}
		return received.Load()
	}, nil)
	defer done()
	start := time.Now().Add(20 * time.Millisecond)
	prod, err := t.produce(wctx, subject, rate, start, start.Add(b.p.LiveFor))
	producing.Store(false)
	if err != nil {
		return res, cause(wctx, err)
	}
	res.Events, res.Achieved, res.Producers = prod.Events, prod.Achieved, prod.Producers
	res.InsertP50, res.InsertP99 = prod.InsertP50, prod.InsertP99
	for received.Load() < int64(res.Events) {
		if t.proc.exited() {
			return res, fmt.Errorf("%s relay exited (%s):\n%s", t.system, t.proc.cmd.ProcessState, t.proc.logs)
		}
		select {
		case <-wctx.Done():
			return res, fmt.Errorf("%w (received %d of %d)", cause(wctx, wctx.Err()), received.Load(), res.Events)
		case <-time.After(20 * time.Millisecond):
		}
	}
	cpu1, err := t.proc.cpu()
	if err != nil {
		return res, err
	}
	res.CPU = cpu1 - cpu0
	res.Wakeups = wakeupsSince(t.proc.pid(), wake0)
	if sysmon1, err := sysmonCPU(t.proc.pid()); err == nil && sysmonErr == nil {
		res.SysmonCPU = sysmon1 - sysmon0
	}
	if t.wsPID != 0 {
		res.WalsenderCPU = b.walsenderSince(ctx, t.wsPID, ws0)
		res.WalsenderWakeups = wakeupsSince(t.wsPID, wsWake0)
	}
	res.Busy, res.Where, res.Span = meter.stop()
	if t.metrics != "" {
		hist1, err := relayHistograms(ctx, t.metrics)
		if err != nil {
			return res, err
		}
		res.Split = split(hist0, hist1)
		batch1, err := relayBatchCounts(ctx, t.metrics)
		if err != nil {
			return res, err
		}
		res.Batch = batch1.since(batch0)
	}
	if n := received.Load(); n > int64(res.Events) {
		return res, fmt.Errorf("%d messages received for %d events committed: duplicates", n, res.Events)
	}
	if bad.Load() > 0 {
		return res, fmt.Errorf("%d messages without a readable insert time, Walbox-Commit-Time header or metadata", bad.Load())
	}
	mu.Lock()
	defer mu.Unlock()
	if len(store) == 0 {
		return res, errors.New("no events received")
	}
	if b.p.LatencyCSV != "" {
		if err := writeLatencyCSV(b.p.LatencyCSV, fmt.Sprintf("live-%s-%d.csv", t.system, rate), start, samples); err != nil {
			return res, err
		}
		if err := writeLatencyCSV(b.p.LatencyCSV, fmt.Sprintf("live-%s-%d-insert.csv", t.system, rate), start, prod.commits); err != nil {
			return res, err
		}
	}
	slices.Sort(store)
	res.store = store
	res.StoreP50, res.StoreP90, res.StoreP99, res.StoreMax = pct(store, 0.50), pct(store, 0.90), pct(store, 0.99), store[len(store)-1]
	if len(lats) > 0 {
		slices.Sort(lats)
		res.P50, res.P90, res.P99, res.Max = pct(lats, 0.50), pct(lats, 0.90), pct(lats, 0.99), lats[len(lats)-1]
		b.logf("live %s %d/s: %d events at %.0f/s: commit-to-ack p50 %s p90 %s p99 %s max %s; insert-to-stored p50 %s p99 %s",
			t.system, rate, res.Events, res.Achieved, ms(res.P50), ms(res.P90), ms(res.P99), ms(res.Max), ms(res.StoreP50), ms(res.StoreP99))
	} else {
		b.logf("live %s %d/s: %d events at %.0f/s: insert-to-stored p50 %s p90 %s p99 %s max %s",
			t.system, rate, res.Events, res.Achieved, ms(res.StoreP50), ms(res.StoreP90), ms(res.StoreP99), ms(res.StoreMax))
	}
	return res, nil
}

// rate2 is rate, counting the first event at time 0.
func rate2(n int, d time.Duration) float64 {
	if n <= 1 || d <= 0 {
		return 0
	}
	return float64(n-1) / d.Seconds()
}

// pct is the nearest-rank percentile of sorted values.
func pct(sorted []time.Duration, q float64) time.Duration {
	i := int(float64(len(sorted))*q+0.999999) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond)) }

// bigTxn is phase 3: the large transaction with the default relay (fast
// batches), then again with a relay on the per-message path.
func (b *bench) bigTxn(ctx context.Context) error {
	if err := b.bigTxnRun(ctx, "large transaction", "large-txn", &b.res.big, true); err != nil {
		return err
	}
	// The last relay of walbox's phases: the peers empty the outbox and
	// read no slot, so this one need not settle.
	if err := b.bigTxnRun(ctx, "large transaction, per message", "large-txn-permsg", &b.res.bigPerMsg, false, perMsgEnv); err != nil {
		return err
	}
	if n := b.res.bigPerMsg.Batch.Batched; n != 0 {
		return fmt.Errorf("the relay with %s published %d events in fast batches", perMsgEnv, n)
	}
	return nil
}

// bigTxnRun commits one transaction of BigRows rows and times a fresh relay
// (env: its extra environment) relaying it; with settle, another relay
// follows on the same slot.
func (b *bench) bigTxnRun(ctx context.Context, what, phase string, res *bigResult, settle bool, env ...string) error {
	rows := b.p.BigRows
	b.logf("%s: starting the relay (a fresh process, so its peak RSS is this phase's)", what)
	r, wsPID, err := b.startStreaming(ctx, phase, env...)
	if err != nil {
		return err
	}
	base, err := b.streamMsgs(ctx, benchStream)
	if err != nil {
		return err
	}
	res.Rows = rows
	cpu0, err := r.cpu()
	if err != nil {
		return err
	}
	ws0, _ := procCPU(wsPID)
	meter := b.startPhase(r.pid())
	b.logf("%s: INSERT ... SELECT generate_series(1, %d) in one transaction", what, rows)
	wctx, done := b.watch(ctx, "large INSERT", func() int64 { return b.walLSN(ctx) }, nil)
	t0 := time.Now()
	_, err = b.env.pool.Exec(wctx, `INSERT INTO outbox_events (topic, payload) SELECT 'bench.big', $1::jsonb FROM generate_series(1, $2::int)`,
		payloadFor(0, b.p.PayloadBytes, 0), rows)
	res.InsertTook = time.Since(t0)
	done()
	if err != nil {
		return fmt.Errorf("insert: %w", cause(wctx, err))
	}
	b.logf("%s: committed in %.1fs; relaying", what, res.InsertTook.Seconds())
	insBusy, insWhere, insSpan := meter.stop()
	meter = b.startPhase(r.pid())
	target := base + uint64(rows)
	var acked, wsCPU atomic.Int64
	wctx, done = b.watch(ctx, "large transaction relay", func() int64 { return acked.Load() + wsCPU.Load() },
		func(v int64) string { return fmt.Sprintf("%d/%d acked", acked.Load(), rows) })
	defer done()
	for {
		if c, err := procCPU(wsPID); err == nil {
			wsCPU.Store(int64(c))
		}
		reached, err := b.pollAcked(wctx, benchStream, base, target, acked.Store, r, "relay exited")
		if err != nil {
			return err
		}
		if reached {
			break
		}
	}
	cpu1, err := r.cpu()
	if err != nil {
		return err
	}
	res.CPU = cpu1 - cpu0
	if res.HWM, err = r.hwm(); err != nil {
		return err
	}
	res.WalsenderCPU = b.walsenderSince(ctx, wsPID, ws0)
	res.RelayBusy, res.RelayWhere, res.RelaySpan = meter.stop()
	res.Span = insSpan + res.RelaySpan
	res.Busy = (insBusy*float64(insSpan) + res.RelayBusy*float64(res.RelaySpan)) / float64(max(res.Span, 1))
	res.Where = mergeWhere(insWhere, res.RelayWhere)
	done()
	if res.Batch, err = relayBatchCounts(ctx, b.env.metrics); err != nil {
		return err
	}
	first, last, err := b.firstLast(ctx, benchStream, base+1, target)
	if err != nil {
		return err
	}
	commit, err := time.Parse(time.RFC3339Nano, first.Header.Get("Walbox-Commit-Time"))
	if err != nil {
		return fmt.Errorf("first message's Walbox-Commit-Time: %w", err)
	}
	res.FirstAck, res.Took = first.Time.Sub(commit), last.Time.Sub(commit)
	// The next relay (the per-message run) would otherwise decode this
	// transaction again from the slot's restart point, and its sweeper
	// would mark these rows meanwhile: mark them now (the sweeper took
	// 40 s for 300,000 in catch-up) and move the restart point past
	// them, while this relay runs. Not timed.
	if settle {
		var settled catchupResult
		if err := b.settle(ctx, r, &settled, false); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
	}
	if err := b.stopRelay(r); err != nil {
		return err
	}
	b.logf("%s: %d rows relayed in %.2fs after commit: %.0f events/s; relay CPU %.2fs, peak RSS %.1f MB; %s",
		what, rows, res.Took.Seconds(), rate(rows, res.Took), res.CPU.Seconds(), mb(res.HWM), res.Batch)
	return nil
}

// latSample is one event's commit and ack (stored) time.
type latSample struct{ commit, ack time.Time }

// writeLatencyCSV writes one line per event: commit time since the start of
// the rate, and commit-to-ack latency, both in ms, in commit order.
func writeLatencyCSV(dir, name string, start time.Time, s []latSample) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	slices.SortFunc(s, func(a, b latSample) int { return a.commit.Compare(b.commit) })
	var sb strings.Builder
	sb.WriteString("commit_ms,latency_ms\n")
	for _, x := range s {
		fmt.Fprintf(&sb, "%.3f,%.3f\n", msf(x.commit.Sub(start)), msf(x.ack.Sub(x.commit)))
	}
	return os.WriteFile(filepath.Join(dir, name), []byte(sb.String()), 0o644)
}

// probe commits one event on subject through t and waits until it is in
// t's stream.
func (b *bench) probe(ctx context.Context, t liveTarget, subject string) error {
	before, err := b.streamMsgs(ctx, t.stream)
	if err != nil {
		return err
	}
	if err := t.probe(ctx, subject); err != nil {
		return fmt.Errorf("probe event: %w", err)
	}
	return b.waitStream(ctx, t, before+1, "the probe event", 10*time.Millisecond)
}

// walsenderSince returns the CPU the relay's walsender used since it was
// pid with CPU cpu0; if the relay reconnected meanwhile, the new walsender's
// whole CPU (the old one's is lost).
func (b *bench) walsenderSince(ctx context.Context, pid int, cpu0 time.Duration) time.Duration {
	if active, now, err := b.slotState(ctx, slotName); err == nil && active && now != pid {
		c, _ := procCPU(now)
		return c
	}
	c, err := procCPU(pid)
	if err != nil {
		return 0
	}
	return c - cpu0
}

// mergeWhere adds two consecutive phases' CPU by process group, largest
// first.
func mergeWhere(a, b []cpuShare) []cpuShare {
	var out []cpuShare
	at := map[string]int{}
	for _, s := range slices.Concat(a, b) {
		i, ok := at[s.Label]
		if !ok {
			at[s.Label], out = len(out), append(out, cpuShare{Label: s.Label})
			i = len(out) - 1
		}
		out[i].CPU += s.CPU
		out[i].Wait += s.Wait
	}
	slices.SortStableFunc(out, func(x, y cpuShare) int { return cmp.Compare(y.CPU, x.CPU) })
	return out
}
