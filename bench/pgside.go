package main

// PostgreSQL's side of catch-up (issue 36, item 3): what the walsender
// spends per event decoding a backlog with pgoutput, for the options walbox
// could ask for. Each variant drains the same backlog from a slot of its
// own with pg_recvlogical (to /dev/null), so the only reader cost is the
// walsender's; its CPU is read from /proc/<pid>/stat.

import (
	"context"
	"fmt"
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
	return float64(r.WalsenderCPU.Microseconds()) / float64(n)
}

// pgsideResult is the phase's figures: runs[variant][round].
type pgsideResult struct {
	Events  int
	Rounds  int
	Skipped map[string]string // variant key -> why it did not run
	Runs    map[string][]pgsideRun
	Busy    float64 // machine busy share over the drains
	Where   []cpuShare
}

// pgSide loads one backlog (slots created before it, one per variant and
// round, plus a warm-up slot) and drains it once per variant per round, the
// variants' order rotating each round so that none always goes first.
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
	slot := func(key string, round int) string { return fmt.Sprintf("%s_%s_%d", pgsideSlotBase, key, round) }
	slots := []string{slot("warm", 0)}
	for r := range p.Rounds {
		for _, v := range variants {
			slots = append(slots, slot(v.Key, r))
		}
	}
	for _, s := range slots {
		if _, err := b.env.pool.Exec(qctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", s); err != nil {
			return nil, fmt.Errorf("create slot %s: %w", s, err)
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
		return nil, fmt.Errorf("load the backlog: %w", err)
	}
	var endLSN string
	qctx, cancel = context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if err := b.env.pool.QueryRow(qctx, "SELECT pg_current_wal_lsn()::text").Scan(&endLSN); err != nil {
		return nil, fmt.Errorf("read the backlog's end LSN: %w", err)
	}
	// Nothing else should work while the walsenders decode: autovacuum
	// would, after 300,000 inserts.
	for _, q := range []string{"VACUUM ANALYZE outbox_events", "CHECKPOINT"} {
		if _, err := b.env.pool.Exec(qctx, q); err != nil {
			return nil, fmt.Errorf("%s: %w", q, err)
		}
	}
	cancel()
	b.logf("pgside: backlog committed in %.1fs, ends at %s; warm-up drain (unmeasured)", took.Seconds(), endLSN)
	if _, err := b.pgsideDrain(ctx, slot("warm", 0), pgsideVariants[0], endLSN); err != nil {
		return nil, err
	}
	meter := b.startPhase(0)
	for r := range p.Rounds {
		for i := range variants {
			v := variants[(i+r)%len(variants)]
			run, err := b.pgsideDrain(ctx, slot(v.Key, r), v, endLSN)
			if err != nil {
				return nil, err
			}
			res.Runs[v.Key] = append(res.Runs[v.Key], run)
			b.logf("pgside: round %d, (%s) %s: walsender %.2fs CPU (%.2fs in the kernel) = %.2f µs/event, %.0f events/s",
				r+1, v.Key, v.Name, run.WalsenderCPU.Seconds(), run.WalsenderSys.Seconds(), run.usPerEvent(p.Events), rate(p.Events, run.Took))
		}
	}
	res.Busy, res.Where, _ = meter.stop()
	// The backlog's rows must not reach a relay that starts later (a
	// first start backfills unprocessed rows).
	qctx, cancel = context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if _, err := b.env.pool.Exec(qctx, "UPDATE outbox_events SET processed = true, processed_at = now() WHERE topic = 'pgside.catchup' AND NOT processed"); err != nil {
		return nil, fmt.Errorf("mark the backlog processed: %w", err)
	}
	return res, nil
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

// median returns the run with the median walsender CPU.
func (r *pgsideResult) median(key string) pgsideRun {
	return medianRun(r.Runs[key], func(x pgsideRun) float64 { return float64(x.WalsenderCPU) })
}

// markdown renders the phase as a section of the results.
func (r *pgsideResult) markdown() string {
	if r == nil {
		return ""
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n## PostgreSQL's side: walsender CPU per event by pgoutput option\n\n")
	fmt.Fprintf(&sb, "pg_recvlogical drains one backlog of %d events (10 per transaction, 200-byte JSON) from a slot of its own per variant and round, "+
		"%d rounds, variants in rotating order after an unmeasured warm-up; walsender CPU from /proc/<pid>/stat; the median run is reported, every run listed. "+
		"Machine busy %.0f %% over the drains; CPU by process group: %s.\n\n", r.Events, r.Rounds, r.Busy*100, whereShort(r.Where))
	base := 0.0
	if runs := r.Runs["a"]; len(runs) > 0 {
		base = r.median("a").usPerEvent(r.Events)
	}
	fmt.Fprintf(&sb, "| variant | walsender µs/event (median) | vs (a) | of it in the kernel | events/s (median run) | each run, µs/event |\n|---|---|---|---|---|---|\n")
	for _, v := range pgsideVariants {
		runs := r.Runs[v.Key]
		if len(runs) == 0 {
			fmt.Fprintf(&sb, "| (%s) %s | skipped: %s | | | | |\n", v.Key, v.Name, r.Skipped[v.Key])
			continue
		}
		m := r.median(v.Key)
		us := m.usPerEvent(r.Events)
		vs := ""
		if base > 0 {
			vs = fmt.Sprintf("%+.1f %%", (us/base-1)*100)
		}
		var each []string
		for _, x := range runs {
			each = append(each, fmt.Sprintf("%.2f", x.usPerEvent(r.Events)))
		}
		kernel := 0.0
		if m.WalsenderCPU > 0 {
			kernel = float64(m.WalsenderSys) / float64(m.WalsenderCPU) * 100
		}
		fmt.Fprintf(&sb, "| (%s) %s | %.2f | %s | %.0f %% | %.0f | %s |\n", v.Key, v.Name, us, vs, kernel, rate(r.Events, m.Took), strings.Join(each, ", "))
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

// runPGSide is `go run . pgside [flags]`: setup, this phase, its table.
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
	fmt.Print(res.markdown())
	return nil
}
