package main

// PostgreSQL's side of catch-up (issue 36, item 3): what the walsender
// spends per event decoding a backlog with pgoutput, for the options walbox
// could ask for. Each variant drains the same backlog from a slot of its
// own with pg_recvlogical (to /dev/null), so the only reader cost is the
// walsender's; its CPU is read from /proc/<pid>/stat.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

const (
	pgsideArg = "pgside" // `go run . pgside`: only this phase
	// pgsideColsPub is the publication of the column-list variants: the
	// outbox table without the bookkeeping columns no event needs.
	pgsideColsPub  = "bench_pgside_cols"
	pgsideCols     = "id, created_at, topic, stream, aggregate_type, aggregate_id, event_type, partition_key, payload, headers"
	pgsideSlotBase = "bench_pgside"
)

// pgsideVariant is one set of pgoutput options.
type pgsideVariant struct {
	Key, Name  string
	Binary     bool
	ColumnList bool
	MinVersion int // server_version_num it needs
}

var pgsideVariants = []pgsideVariant{
	{Key: "a", Name: "today: proto_version 1, text, whole row"},
	{Key: "b", Name: "binary 'true'", Binary: true, MinVersion: 140000},
	{Key: "c", Name: "column list (no processed, processed_at, attempts, error)", ColumnList: true, MinVersion: 150000},
	{Key: "d", Name: "binary + column list", Binary: true, ColumnList: true, MinVersion: 150000},
}

// pgsideRun is one drain of the backlog by one variant.
type pgsideRun struct {
	WalsenderCPU time.Duration
	WalsenderSys time.Duration // of it in the kernel (stime)
	Took         time.Duration
}

func (r pgsideRun) usPerEvent(n int) float64 {
	return float64(r.WalsenderCPU.Nanoseconds()) / 1e3 / float64(n)
}

// pgsideResult is the phase's figures: runs[variant][round].
type pgsideResult struct {
	Events  int
	Rounds  int
	Skipped map[string]string // variant key -> why it did not run
	Runs    map[string][]pgsideRun
	Busy    float64 // machine busy share over the drains
	Where   []cpuShare
	span    time.Duration // time the drains took
}

// pgSide loads a backlog (slots created before it, one per variant and
// round, plus a warm-up slot) and drains it once per variant per round, the
// variants' order rotating each round so that none always goes first.
// Rounds beyond what the free replication slots allow get a backlog of
// their own.
func (b *bench) pgSide(ctx context.Context) (*pgsideResult, error) {
	p := b.p
	res := &pgsideResult{Events: p.Events, Rounds: p.Rounds, Skipped: map[string]string{}, Runs: map[string][]pgsideRun{}}
	qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var version int
	if err := b.env.pool.QueryRow(qctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return nil, fmt.Errorf("read server version: %w", err)
	}
	var variants []pgsideVariant
	for _, v := range pgsideVariants {
		if version < v.MinVersion {
			res.Skipped[v.Key] = fmt.Sprintf("needs PostgreSQL %d+", v.MinVersion/10000)
			continue
		}
		variants = append(variants, v)
	}
	if version >= 150000 {
		if _, err := b.env.pool.Exec(qctx, fmt.Sprintf(
			"CREATE PUBLICATION %s FOR TABLE outbox_events (%s) WITH (publish = 'insert', publish_via_partition_root = true)",
			pgsideColsPub, pgsideCols)); err != nil {
			return nil, fmt.Errorf("create the column-list publication: %w", err)
		}
		b.onCleanup(func() {
			dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, _ = b.env.pool.Exec(dctx, "DROP PUBLICATION IF EXISTS "+pgsideColsPub)
		})
	}
	cancel()
	// Every slot must exist before its backlog is written, and a cluster
	// has max_replication_slots: rounds that do not fit get a backlog of
	// their own.
	for done := 0; done < p.Rounds; {
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var free int
		err := b.env.pool.QueryRow(qctx, "SELECT current_setting('max_replication_slots')::int - (SELECT count(*) FROM pg_replication_slots)").Scan(&free)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("count free replication slots: %w", err)
		}
		k := min(p.Rounds-done, (free-1)/len(variants))
		if k < 1 {
			return nil, fmt.Errorf("only %d replication slots free: the phase needs %d (max_replication_slots)", free, len(variants)+1)
		}
		if err := b.pgsideBatch(ctx, res, variants, done, k); err != nil {
			return nil, err
		}
		done += k
	}
	if res.span > 0 {
		res.Busy /= res.span.Seconds()
	}
	slices.SortFunc(res.Where, func(x, y cpuShare) int { return int(y.CPU - x.CPU) })
	return res, nil
}

// pgsideBatch runs rounds first..first+n-1 on one backlog.
func (b *bench) pgsideBatch(ctx context.Context, res *pgsideResult, variants []pgsideVariant, first, n int) error {
	p := b.p
	slot := func(key string, round int) string { return fmt.Sprintf("%s_%s_%d", pgsideSlotBase, key, round) }
	slots := []string{slot("warm", first)}
	for r := first; r < first+n; r++ {
		for _, v := range variants {
			slots = append(slots, slot(v.Key, r))
		}
	}
	qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for _, s := range slots {
		if _, err := b.env.pool.Exec(qctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", s); err != nil {
			return fmt.Errorf("create slot %s: %w", s, err)
		}
		b.onCleanup(func() {
			dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, _ = b.env.pool.Exec(dctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", s)
		})
	}
	cancel()
	b.logf("pgside: %d slots created; loading %d events (%d per transaction, %d connections)", len(slots), p.Events, p.TxnRows, p.Loaders)
	took, err := b.loadBacklog(ctx, "pgside.catchup", p.Events)
	if err != nil {
		return fmt.Errorf("load the backlog: %w", err)
	}
	var endLSN string
	qctx, cancel = context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if err := b.env.pool.QueryRow(qctx, "SELECT pg_current_wal_lsn()::text").Scan(&endLSN); err != nil {
		return fmt.Errorf("read the backlog's end LSN: %w", err)
	}
	// Nothing else should work while the walsenders decode: autovacuum
	// would, after 300,000 inserts.
	for _, q := range []string{"VACUUM ANALYZE outbox_events", "CHECKPOINT"} {
		if _, err := b.env.pool.Exec(qctx, q); err != nil {
			return fmt.Errorf("%s: %w", q, err)
		}
	}
	cancel()
	b.logf("pgside: backlog committed in %.1fs, ends at %s; warm-up drain (unmeasured)", took.Seconds(), endLSN)
	if _, err := b.pgsideDrain(ctx, slot("warm", first), pgsideVariants[0], endLSN); err != nil {
		return err
	}
	meter := b.startPhase(0)
	for r := first; r < first+n; r++ {
		for i := range variants {
			v := variants[(i+r)%len(variants)]
			run, err := b.pgsideDrain(ctx, slot(v.Key, r), v, endLSN)
			if err != nil {
				return err
			}
			res.Runs[v.Key] = append(res.Runs[v.Key], run)
			b.logf("pgside: round %d, (%s) %s: walsender %.2fs CPU (%.2fs in the kernel) = %.2f µs/event, %.0f events/s",
				r+1, v.Key, v.Name, run.WalsenderCPU.Seconds(), run.WalsenderSys.Seconds(), run.usPerEvent(p.Events), rate(p.Events, run.Took))
		}
	}
	busy, where, span := meter.stop()
	res.Busy += busy * span.Seconds()
	res.span += span
	for _, w := range where {
		i := slices.IndexFunc(res.Where, func(x cpuShare) bool { return x.Label == w.Label })
		if i < 0 {
			res.Where = append(res.Where, cpuShare{Label: w.Label})
			i = len(res.Where) - 1
		}
		res.Where[i].CPU += w.CPU
	}
	// The backlog's rows must not reach a relay that starts later (a
	// first start backfills unprocessed rows).
	qctx, cancel = context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if _, err := b.env.pool.Exec(qctx, "UPDATE outbox_events SET processed = true, processed_at = now() WHERE topic = 'pgside.catchup' AND NOT processed"); err != nil {
		return fmt.Errorf("mark the backlog processed: %w", err)
	}
	return nil
}

// pgsideDrain runs pg_recvlogical on slot with v's options to endLSN and
// returns its walsender's CPU; it drops the slot at the end.
func (b *bench) pgsideDrain(ctx context.Context, slot string, v pgsideVariant, endLSN string) (pgsideRun, error) {
	pub := publication
	if v.ColumnList {
		pub = pgsideColsPub
	}
	args := []string{"--slot", slot, "--start", "-f", "/dev/null", "-F", "0", "--no-loop", "--endpos", endLSN,
		"-o", "proto_version=1", "-o", "publication_names=" + pub}
	if v.Binary {
		args = append(args, "-o", "binary=true")
	}
	var wsCPU, wsSys atomic.Int64
	wctx, done := b.watch(ctx, "pg_recvlogical ("+v.Key+")", wsCPU.Load, nil)
	defer done()
	var out tailBuffer
	cmd := b.recvlogical(wctx, &out, args...)
	t0 := time.Now()
	if err := cmd.Start(); err != nil {
		return pgsideRun{}, fmt.Errorf("start pg_recvlogical on %s: %w", slot, err)
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
			if c, sys, err := procCPUSys(wsPID); err == nil {
				wsCPU.Store(int64(c))
				wsSys.Store(int64(sys))
			}
		}
	}
	took := time.Since(t0)
	if err != nil {
		return pgsideRun{}, fmt.Errorf("pg_recvlogical on %s: %w\n%s", slot, cause(wctx, err), out.String())
	}
	if wsPID == 0 {
		return pgsideRun{}, fmt.Errorf("pg_recvlogical on %s: its walsender was never seen (ended in %s)", slot, took)
	}
	// The walsender may outlive its client by a moment: its last figure.
	if c, sys, err := procCPUSys(wsPID); err == nil {
		wsCPU.Store(int64(c))
		wsSys.Store(int64(sys))
	}
	done()
	if _, err := b.waitSlot(ctx, slot, false, nil); err != nil {
		return pgsideRun{}, err
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := b.env.pool.Exec(qctx, "SELECT pg_drop_replication_slot($1)", slot); err != nil {
		return pgsideRun{}, fmt.Errorf("drop slot %s: %w", slot, err)
	}
	return pgsideRun{WalsenderCPU: time.Duration(wsCPU.Load()), WalsenderSys: time.Duration(wsSys.Load()), Took: took}, nil
}

// procCPUSys returns pid's user+sys CPU and the sys part of it.
func procCPUSys(pid int) (total, sys time.Duration, err error) {
	total, err = procCPU(pid)
	if err == nil {
		sys, err = procStatTicks(pid, 12, 12) // stime, counted twice
		sys /= 2
	}
	return total, sys, err
}

// perEvent is the median over key's runs of what f takes from a run, in
// µs per event.
func (r *pgsideResult) perEvent(key string, f func(pgsideRun) time.Duration) float64 {
	m := medianRun(r.Runs[key], func(x pgsideRun) float64 { return float64(f(x)) })
	return float64(f(m).Nanoseconds()) / 1e3 / float64(r.Events)
}

func wsTotal(x pgsideRun) time.Duration  { return x.WalsenderCPU }
func wsUser(x pgsideRun) time.Duration   { return x.WalsenderCPU - x.WalsenderSys }
func wsKernel(x pgsideRun) time.Duration { return x.WalsenderSys }

// markdown renders the phase as a section of the results.
func (r *pgsideResult) markdown() string {
	if r == nil {
		return ""
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n## PostgreSQL's side: walsender CPU per event by pgoutput option\n\n")
	fmt.Fprintf(&sb, "pg_recvlogical drains one backlog of %d events (10 per transaction, 200-byte JSON) to /dev/null from a slot of its own per variant and round, "+
		"%d rounds, the variants' order rotating each round, after an unmeasured warm-up drain; the walsender's user and system CPU from /proc/<pid>/stat. "+
		"Each column is the median of the rounds; every run's total is listed. The kernel part (sending each pgoutput message, waking the reader) "+
		"varies most between drains and no option changes it much: compare the user-space column. "+
		"Machine busy %.0f %% over the drains; CPU by process group: %s.\n\n", r.Events, r.Rounds, r.Busy*100, whereShort(r.Where))
	var base [3]float64
	if len(r.Runs["a"]) > 0 {
		base = [3]float64{r.perEvent("a", wsTotal), r.perEvent("a", wsUser), r.perEvent("a", wsKernel)}
	}
	vs := func(x, b float64) string {
		if b <= 0 {
			return ""
		}
		return fmt.Sprintf(" (%+.0f %%)", (x/b-1)*100)
	}
	fmt.Fprintf(&sb, "| variant | walsender µs/event (vs a) | user space | kernel | events/s (median) | each run, µs/event |\n|---|---|---|---|---|---|\n")
	for _, v := range pgsideVariants {
		runs := r.Runs[v.Key]
		if len(runs) == 0 {
			fmt.Fprintf(&sb, "| (%s) %s | skipped: %s | | | | |\n", v.Key, v.Name, r.Skipped[v.Key])
			continue
		}
		t, u, k := r.perEvent(v.Key, wsTotal), r.perEvent(v.Key, wsUser), r.perEvent(v.Key, wsKernel)
		m := medianRun(runs, func(x pgsideRun) float64 { return rate(r.Events, x.Took) })
		var each []string
		for _, x := range runs {
			each = append(each, fmt.Sprintf("%.2f", x.usPerEvent(r.Events)))
		}
		fmt.Fprintf(&sb, "| (%s) %s | %.2f%s | %.2f%s | %.2f%s | %.0f | %s |\n", v.Key, v.Name,
			t, vs(t, base[0]), u, vs(u, base[1]), k, vs(k, base[2]), rate(r.Events, m.Took), strings.Join(each, ", "))
	}
	return sb.String()
}

// whereShort lists the three process groups that spent the most CPU
// (cpuDelta sorts them).
func whereShort(w []cpuShare) string {
	s := slices.Clone(w)
	if len(s) > 3 {
		s = s[:3]
	}
	var parts []string
	for _, c := range s {
		parts = append(parts, fmt.Sprintf("%s %.1f s", c.Label, c.CPU.Seconds()))
	}
	return strings.Join(parts, ", ")
}

// runPGSide is `go run . pgside [flags]`: setup, this phase, its table,
// also written to bench/results/pgside.md (or -out).
func runPGSide(ctx context.Context, b *bench) error {
	env, err := b.setup(ctx)
	if err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	b.env = env
	res, err := b.pgSide(ctx)
	if err != nil {
		return fmt.Errorf("pgside: %w", err)
	}
	e := env.info
	text := fmt.Sprintf("# walbox benchmark: PostgreSQL's side only (`go run . pgside`)\n\n"+
		"- Date: %s (run took %s)\n- Machine: %d CPUs (%s), %s memory, Linux %s\n"+
		"- Versions: walbox %s, %s, PostgreSQL %s (%s)\n",
		time.Now().UTC().Format("2006-01-02 15:04 MST"), time.Since(b.start).Round(time.Second),
		e.CPUs, e.CPUModel, e.MemTotal, e.Kernel, e.Walbox, e.GoVersion, e.PGVersion, e.PGSet) + res.markdown()
	fmt.Print(text)
	out := b.p.Out
	if out == "" {
		out = filepath.Join(env.moduleDir, "bench", "results", "pgside.md")
	}
	if err := os.WriteFile(out, []byte(text), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", out, err)
	}
	b.logf("done: results written to %s", out)
	return nil
}
