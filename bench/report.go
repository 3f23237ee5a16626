package main

import (
	"fmt"
	"math"
	"strings"
	"text/tabwriter"
	"time"
)

// results is everything one run measured.
type results struct {
	params   params
	env      envInfo
	finished time.Time
	took     time.Duration
	catchup  catchupResult
	noflag   catchupResult // catch-up with sweeper.mark_processed=false
	decode   ceilingResult
	publish  ceilingResult
	conc     concurrentResult // the two ceilings at the same time
	// Issue 36 (batch.go): catch-up on the per-message path, the batched
	// publishing ceiling and the concurrent one with it (medians), the
	// first live rate and the large transaction on the per-message path.
	perMsg        catchupResult
	atomic        catchupResult // nats.atomic_transactions on (atomic.go)
	atomicRuns    []catchupResult
	batchPub      ceilingResult
	headerCost    map[string][]headerCostRun // by header set (headercost.go)
	concBatch     concurrentResult
	perMsgRuns    []catchupResult
	batchPubRuns  []ceilingResult
	concBatchRuns []concurrentResult
	livePerMsg    liveResult
	bigPerMsg     bigResult
	pubAlone      []pubFloorResult // publishing alone, in a process of its own
	floor         []floorResult    // each live rate, pg_recvlogical the only reader
	bare          []bareResult     // the bare relay at 1,000 and 2,000/s
	maxAlone      maxResult        // the producers' maximum rate, relay stopped
	maxRelay      liveResult       // that rate offered with the relay running
	maxFloor      floorResult      // that rate offered with pg_recvlogical the only reader
	// Every round's figures; the four above are their medians.
	catchupRuns, noflagRuns []catchupResult
	decodeRuns, publishRuns []ceilingResult
	concRuns                []concurrentResult
	live                    []liveResult
	liveNoFlag              []liveResult // live rates ≤ 2,000/s with sweeper.mark_processed=false
	// Tracing on, by sampled share (tracing.go): catch-up rounds and the
	// first live rate.
	tracedRuns map[string][]catchupResult
	liveTraced map[string]liveResult
	// tracedProfiles: tracing's share of profiled relays (tracing.go)
	tracedProfiles tracedProfiles
	tracePairs     []tracePair // fresh relays at 1,000/s, tracing off and at 1 %
	big            bigResult
	peers          []peerResult

	idleBusy  float64 // machine busy share before the run
	idleWhere []cpuShare

	console consoleResult // issue 38: the web console's cost (console.go)
	claim   claimResult   // issue 39: the claim check beside a raised limit (claim.go)

	relayWarnings []string // what the relay logged, per run
	chart         string   // the PNG's file name, next to the report
}

// Targets from issues 7 and 17.
const (
	targetRatio       = 0.9 // relay / concurrent ceiling
	targetCPUPerEv    = 8 * time.Microsecond
	targetRSS         = 64 << 20
	targetP50At2k     = 1 * time.Millisecond // added over the floor where the floor is above
	targetP99At2k     = 10 * time.Millisecond
	targetP99At5k     = 25 * time.Millisecond
	targetRSSString   = "≤ 64 MB"
	targetCPUCatchup  = 0.5  // relay CPU per event / walsender's, catch-up
	targetCPULive     = 1.0  // the same at 1,000 and 2,000/s
	targetTuned       = 2.0  // catch-up, walbox / polling-tuned
	targetMaxKept     = 0.95 // the producers' maximum rate kept with the relay running
	targetMaxP99      = 25 * time.Millisecond
	targetFlagCost    = 0.10
	targetFlagCostStr = "≤ 10%"
	// targetFlagP99: "no effect on live p99", read as the flag-on p99 at
	// most this many times the flag-off one.
	targetFlagP99 = 1.1
)

// vsFloor checks a latency against its target, or, where the floor itself
// is above the target, what the relay adds over the floor.
func vsFloor(got, floor time.Duration, haveFloor bool, target time.Duration) (string, string) {
	if !haveFloor {
		return ms(got) + " (no floor measured)", verdict(got <= target)
	}
	if floor > target {
		added := got - floor
		if added < 0 {
			// Below the floor: the floor's run was noisier than the
			// relay's, so the difference says nothing either way.
			return fmt.Sprintf("%s; floor %s is above the target and above the relay's figure: runs too noisy to judge", ms(got), ms(floor)), "NOISY"
		}
		return fmt.Sprintf("%s; floor %s is above the target: added over the floor %s", ms(got), ms(floor), ms(added)), verdict(added <= target)
	}
	return fmt.Sprintf("%s (floor %s)", ms(got), ms(floor)), verdict(got <= target)
}

// ratioRow formats a CPU ratio x/y with both per-event figures.
func ratioString(x, y time.Duration, n int) (string, float64) {
	if y <= 0 || n <= 0 {
		return "n/a (no walsender CPU measured)", math.Inf(1)
	}
	r := float64(x) / float64(y)
	return fmt.Sprintf("%.2f× (%.1f / %.1f µs/event)", r, us(perEvent(x, n)), us(perEvent(y, n))), r
}

// perEventWhere is a phase's CPU by process group per event, largest
// first. "bench driver + nats-server" is this process: the embedded
// nats-server and the drivers (producers' client side, consumers, the
// publisher) together; one process cannot be split further from /proc.
func perEventWhere(w []cpuShare, n int) string {
	if n <= 0 {
		return "n/a"
	}
	var parts []string
	var other time.Duration
	for _, s := range w {
		if strings.HasPrefix(s.Label, "other: ") {
			other += s.CPU
			continue
		}
		if s.CPU >= 10*time.Millisecond {
			parts = append(parts, fmt.Sprintf("%s %.1f", s.Label, us(perEvent(s.CPU, n))))
		}
	}
	if other >= 10*time.Millisecond {
		parts = append(parts, fmt.Sprintf("processes not part of the benchmark %.1f", us(perEvent(other, n))))
	}
	if len(parts) == 0 {
		return "nothing measurable"
	}
	return strings.Join(parts, "; ") + " µs/event"
}

// perEventWait is, for each process group that waited 10 ms or more, its
// CPU and its time runnable but waiting for a CPU, per event.
func perEventWait(w []cpuShare, n int) string {
	if n <= 0 {
		return "n/a"
	}
	var parts []string
	for _, s := range w {
		if s.Wait >= 10*time.Millisecond && !strings.HasPrefix(s.Label, "other: ") {
			parts = append(parts, fmt.Sprintf("%s %.1f (ran %.1f)", s.Label, us(perEvent(s.Wait, n)), us(perEvent(s.CPU, n))))
		}
	}
	if len(parts) == 0 {
		return "nothing measurable"
	}
	return strings.Join(parts, "; ") + " µs/event"
}

// floorAt returns the floor measured at a rate.
func (r *results) floorAt(rate int) (floorResult, bool) {
	for _, f := range r.floor {
		if f.Rate == rate {
			return f, true
		}
	}
	return floorResult{}, false
}

type row struct {
	section bool // a heading row: only measure is set
	measure string
	result  string
	target  string
	verdict string // "ok", "MISS" or ""
}

type table []row

func verdict(ok bool) string {
	if ok {
		return "ok"
	}
	return "MISS"
}

// relayFloorString adds the least CPU per event pg_recvlogical spent in
// any of decoders (its own, the reading half of a relay) to the least a
// publisher that waits for acks spent alone per message (the publishing
// half), and compares the sum with the walsender's CPU per event in the
// relay's run; then the same with the publisher that asks for no acks.
func relayFloorString(pubs []pubFloorResult, decoders []ceilingResult, walsender time.Duration, n int) string {
	read := time.Duration(-1)
	for _, d := range decoders {
		if d.Events > 0 && (read < 0 || perEvent(d.ClientCPU, d.Events) < read) {
			read = perEvent(d.ClientCPU, d.Events)
		}
	}
	pub, mode := time.Duration(-1), ""
	for _, p := range pubs {
		if p.Mode != pubNoAck && p.Mode != pubIDOnly && p.Msgs > 0 && (pub < 0 || perEvent(p.CPU, p.Msgs) < pub) {
			pub, mode = perEvent(p.CPU, p.Msgs), p.Mode
		}
	}
	if read < 0 || pub < 0 || walsender <= 0 || n <= 0 {
		return "n/a"
	}
	ws := perEvent(walsender, n)
	out := fmt.Sprintf("%.1f + %.1f (%s) = %.1f µs/event = %.2f× (walsender %.1f µs/event)",
		us(read), us(pub), mode, us(read+pub), float64(read+pub)/float64(ws), us(ws))
	for _, p := range pubs {
		if p.Mode == pubNoAck && p.Msgs > 0 {
			w := perEvent(p.CPU, p.Msgs)
			out += fmt.Sprintf("; with no acks at all: %.1f + %.1f = %.1f µs/event = %.2f×", us(read), us(w), us(read+w), float64(read+w)/float64(ws))
		}
	}
	return out
}

// headerCostString is the publishers' difference in CPU per message
// between walbox's path with the relay's headers and with Nats-Msg-Id
// alone, and that difference over the walsender's CPU per event.
func headerCostString(pubs []pubFloorResult, walsender time.Duration, n int) string {
	var all, one time.Duration = -1, -1
	for _, p := range pubs {
		switch {
		case p.Msgs <= 0:
		case p.Mode == pubWalbox:
			all = perEvent(p.CPU, p.Msgs)
		case p.Mode == pubIDOnly:
			one = perEvent(p.CPU, p.Msgs)
		}
	}
	if all < 0 || one < 0 || walsender <= 0 || n <= 0 {
		return "n/a"
	}
	ws := perEvent(walsender, n)
	return fmt.Sprintf("%.1f − %.1f = %.1f µs = %.2f× (walsender %.1f µs/event)", us(all), us(one), us(all-one), float64(all-one)/float64(ws), us(ws))
}

// wakeupString gives a relay's and its walsender's wake-ups per event and
// the CPU each spent per wake-up.
func wakeupString(cpu, wsCPU time.Duration, wake, wsWake uint64, n int) string {
	if n <= 0 || wake == 0 || wsWake == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2f / %.2f; %.1f / %.1f µs", float64(wake)/float64(n), float64(wsWake)/float64(n),
		us(cpu/time.Duration(wake)), us(wsCPU/time.Duration(wsWake)))
}

func perEvent(cpu time.Duration, n int) time.Duration {
	if n <= 0 {
		return 0
	}
	return cpu / time.Duration(n)
}

func per100k(cpu time.Duration, n int) string {
	if n <= 0 {
		return "n/a"
	}
	d := perEvent(cpu, n)
	return fmt.Sprintf("%.2f s (%.1f µs/event)", d.Seconds()*100_000, float64(d)/float64(time.Microsecond))
}

func (r *results) render() table {
	var t table
	add := func(measure, result, target, v string) {
		t = append(t, row{measure: measure, result: result, target: target, verdict: v})
	}
	head := func(s string) { t = append(t, row{section: true, measure: s}) }
	c, d, p := r.catchup, r.decode, r.publish
	n := c.Events
	cores := float64(r.env.CPUs)

	head(fmt.Sprintf("1. Catch-up: %d events, %d-byte JSON payloads, %d rows per transaction", n, c.PayloadBytes, r.params.TxnRows))
	relayRate, decRate, pubRate := rate(n, c.Took), rate(d.Events, d.Took), rate(p.Events, p.Took)
	add("relay: spawn → last ack", fmt.Sprintf("%.0f events/s (%.2f s; first ack %.0f ms after spawn)%s", relayRate, c.Took.Seconds(), float64(c.FirstAck)/1e6,
		runsString(r.catchupRuns, func(x catchupResult) float64 { return rate(x.Events, x.Took) })), "", "")
	add("decoding ceiling: pg_recvlogical, pgoutput → /dev/null", fmt.Sprintf("%.0f events/s (%.2f s)%s", decRate, d.Took.Seconds(),
		runsString(r.decodeRuns, func(x ceilingResult) float64 { return rate(x.Events, x.Took) })), "", "")
	add(fmt.Sprintf("publishing ceiling: async JetStream, window %d", r.params.Window), fmt.Sprintf("%.0f msgs/s (%.2f s)%s", pubRate, p.Took.Seconds(),
		runsString(r.publishRuns, func(x ceilingResult) float64 { return rate(x.Events, x.Took) })), "", "")
	cc := r.conc
	ccDec, ccPub := rate(cc.Decode.Events, cc.Decode.Took), rate(cc.Publish.Events, cc.Publish.Took)
	add("concurrent ceiling: pg_recvlogical and the async publisher at the same time, same backlog size",
		fmt.Sprintf("%.0f events/s (decoding %.0f events/s in %.2f s and publishing %.0f msgs/s in %.2f s, together)%s",
			cc.ceiling(), ccDec, cc.Decode.Took.Seconds(), ccPub, cc.Publish.Took.Seconds(),
			runsString(r.concRuns, concurrentResult.ceiling)), "", "")
	ceil := min(decRate, pubRate)
	ratio := 0.0
	if ceil > 0 {
		ratio = relayRate / ceil
	}
	which := "decoding"
	if pubRate < decRate {
		which = "publishing"
	}
	add("relay / min(ceilings measured alone)", fmt.Sprintf("%.2f (of the %s ceiling)", ratio, which), "", "")
	cratio := 0.0
	if cc.ceiling() > 0 {
		cratio = relayRate / cc.ceiling()
	}
	add("relay / concurrent ceiling", fmt.Sprintf("%.2f", cratio), fmt.Sprintf("≥ %.1f", targetRatio), verdict(cratio >= targetRatio))
	add("relay CPU (user+sys) per 100,000 events", per100k(c.CPU, n), "≤ 0.80 s (8 µs/event)", verdict(perEvent(c.CPU, n) <= targetCPUPerEv))
	{
		s, x := ratioString(c.CPU, c.WalsenderCPU, n)
		add("relay CPU per event / its walsender's, same run", s, fmt.Sprintf("≤ %.1f×", targetCPUCatchup), verdict(x <= targetCPUCatchup))
	}
	add("relay peak RSS (VmHWM)", fmt.Sprintf("%.1f MB", mb(c.HWM)), targetRSSString, verdict(c.HWM <= targetRSS))
	add("  walsender CPU per 100,000: relay run / pg_recvlogical run", per100k(c.WalsenderCPU, n)+" / "+per100k(d.ServerCPU, d.Events), "", "")
	add("  nats-server (in-process) + driver CPU per 100,000: relay run / publisher", per100k(c.DriverCPU, n)+" / "+per100k(p.ServerCPU, p.Events), "", "")
	add("  pg_recvlogical's own CPU per 100,000", per100k(d.ClientCPU, d.Events), "", "")
	if len(r.pubAlone) > 0 {
		var parts []string
		for _, pa := range r.pubAlone {
			part := fmt.Sprintf("%s %.1f µs (%.0f msgs/s)", pa.Mode, us(perEvent(pa.CPU, pa.Msgs)), rate(pa.Msgs, pa.Took))
			if pa.Stored != uint64(pa.Msgs) {
				part += fmt.Sprintf(", %d of %d stored", pa.Stored, pa.Msgs)
			}
			parts = append(parts, part)
		}
		label := "  publishing alone in a process of its own, the relay's headers, window as the relay's: own CPU per message"
		if n := r.pubAlone[0].Runs; n > 1 {
			label += fmt.Sprintf(" (each the median of %d runs, the publishers taking turns)", n)
		}
		add(label, strings.Join(parts, "; "), "", "")
		add("  floor of a relay that reads pgoutput and publishes with nats.go: pg_recvlogical's own + the cheaper acked publisher's own, per event / its walsender's (relay run)",
			relayFloorString(r.pubAlone, []ceilingResult{d, cc.Decode}, c.WalsenderCPU, n), fmt.Sprintf("(target ≤ %.1f×)", targetCPUCatchup), "")
		add("  what walbox's headers beyond Nats-Msg-Id cost a publish: walbox's path with them − with Nats-Msg-Id only, per message / the walsender's per event (relay run)",
			headerCostString(r.pubAlone, c.WalsenderCPU, n), "", "")
	}
	add("  concurrent ceiling: walsender / pg_recvlogical / nats-server + publisher CPU per 100,000",
		per100k(cc.Decode.ServerCPU, cc.Decode.Events)+" / "+per100k(cc.Decode.ClientCPU, cc.Decode.Events)+" / "+per100k(cc.DriverCPU, cc.Publish.Events), "", "")
	add("  machine CPU busy: relay run / decoding / publishing / concurrent",
		fmt.Sprintf("%.0f%% / %.0f%% / %.0f%% / %.0f%% of %d CPUs", c.Busy*100, d.Busy*100, p.Busy*100, cc.Busy*100, int(cores)), "", "")
	add("  CPU by process group, relay run", perEventWhere(c.Where, n), "", "")
	add("  CPU by process group, decoding ceiling", perEventWhere(d.Where, d.Events), "", "")
	add("  CPU by process group, publishing ceiling", perEventWhere(p.Where, p.Events), "", "")
	add("  CPU by process group, concurrent ceiling", perEventWhere(cc.Where, cc.Publish.Events), "", "")
	add("  backlog load (4 connections, not a target)", fmt.Sprintf("%.0f events/s", rate(n, c.LoadTook)), "", "")

	head(fmt.Sprintf("2. Live: single-event transactions at a fixed rate, %v each, producer synchronous_commit=%s", r.params.LiveFor, r.params.SyncCommit))
	for _, l := range r.live {
		fl, haveFloor := r.floorAt(l.Rate)
		if haveFloor {
			add(fmt.Sprintf("%d/s floor: pg_recvlogical the only reader, commit → received p50 / p99", l.Rate),
				fmt.Sprintf("%.2f / %.2f ms (%.0f events/s achieved)", msf(fl.P50), msf(fl.P99), fl.Achieved), "", "")
			add(fmt.Sprintf("  %d/s floor: insert (time in payload) → received p50 / p99", l.Rate),
				fmt.Sprintf("%.2f / %.2f ms", msf(fl.StoreP50), msf(fl.StoreP99)), "", "")
			add(fmt.Sprintf("  %d/s floor: CPU by process group", l.Rate), perEventWhere(fl.Where, fl.Events), "", "")
			add(fmt.Sprintf("  %d/s floor: runnable but waiting for a CPU, by process group", l.Rate), perEventWait(fl.Where, fl.Events), "", "")
		}
		add(fmt.Sprintf("%d/s: achieved rate (%d producers)", l.Rate, l.Producers), fmt.Sprintf("%.0f events/s (%d events)", l.Achieved, l.Events), "", "")
		add(fmt.Sprintf("%d/s: commit → ack p50 / p90 / p99 / max", l.Rate),
			fmt.Sprintf("%.2f / %.2f / %.2f / %.2f ms", msf(l.P50), msf(l.P90), msf(l.P99), msf(l.Max)), "", "")
		add(fmt.Sprintf("%d/s: insert (time in payload) → stored p50 / p90 / p99 / max", l.Rate),
			fmt.Sprintf("%.2f / %.2f / %.2f / %.2f ms", msf(l.StoreP50), msf(l.StoreP90), msf(l.StoreP99), msf(l.StoreMax)), "", "")
		add(fmt.Sprintf("  %d/s: producer INSERT+COMMIT round trip p50 / p99", l.Rate), fmt.Sprintf("%.2f / %.2f ms", msf(l.InsertP50), msf(l.InsertP99)), "", "")
		if haveFloor {
			add(fmt.Sprintf("%d/s: commit → ack added over the floor p50 / p99", l.Rate),
				fmt.Sprintf("%.2f / %.2f ms", msf(l.P50-fl.P50), msf(l.P99-fl.P99)), "", "")
		}
		if sp := l.Split; sp.Events > 0 {
			add(fmt.Sprintf("%d/s: commit → ack cut at PostgreSQL's send: commit → sent (PostgreSQL) p50 / p99; sent → ack (walbox + JetStream) p50 / p99", l.Rate),
				fmt.Sprintf("%s / %s; %s / %s (%d events, relay histograms)", msRound(sp.SentP50), msRound(sp.SentP99), msRound(sp.AfterP50), msRound(sp.AfterP99), sp.Events), "", "")
		}
		switch l.Rate {
		case 2000:
			res, v := vsFloor(l.P50, fl.P50, haveFloor, targetP50At2k)
			add("2000/s: commit → ack p50", res, "≤ 1 ms (over the floor where the floor is above)", v)
			res, v = vsFloor(l.P99, fl.P99, haveFloor, targetP99At2k)
			add("2000/s: commit → ack p99", res, "≤ 10 ms (over the floor where the floor is above)", v)
			if sp := l.Split; sp.Events > 0 {
				add("2000/s: walbox's part of commit → ack (PostgreSQL's send → ack) p99", msRound(sp.AfterP99), "(≤ 10 ms: the p99 target, applied to what comes after PostgreSQL)", verdict(sp.AfterP99 <= targetP99At2k))
			}
		case 5000:
			add("5000/s: p99", ms(l.P99), "≤ 25 ms", verdict(l.P99 <= targetP99At5k))
		}
		add(fmt.Sprintf("  %d/s: relay / walsender CPU per event; machine busy", l.Rate),
			fmt.Sprintf("%.1f / %.1f µs; %.0f%% of %d CPUs", us(perEvent(l.CPU, l.Events)), us(perEvent(l.WalsenderCPU, l.Events)), l.Busy*100, int(cores)), "", "")
		if l.Wakeups > 0 && l.WalsenderWakeups > 0 {
			add(fmt.Sprintf("  %d/s: wake-ups per event (voluntary context switches, all threads) relay / walsender; CPU per wake-up", l.Rate),
				wakeupString(l.CPU, l.WalsenderCPU, l.Wakeups, l.WalsenderWakeups, l.Events), "", "")
		}
		if l.Rate == 1000 || l.Rate == 2000 {
			s, x := ratioString(l.CPU, l.WalsenderCPU, l.Events)
			add(fmt.Sprintf("%d/s: relay CPU per event / its walsender's", l.Rate), s, fmt.Sprintf("≤ %.1f×", targetCPULive), verdict(x <= targetCPULive))
			for _, br := range r.bare {
				if br.Rate == l.Rate {
					s, _ := ratioString(br.CPU, br.WalsenderCPU, br.Events)
					add(fmt.Sprintf("  %d/s: the bare relay's CPU per event / its walsender's (pglogrepl + nats.go, one header, acks awaited, nothing else; see below)", l.Rate), s, "", "")
					if br.Wakeups > 0 && br.WalsenderWakeups > 0 {
						add(fmt.Sprintf("  %d/s: the bare relay's wake-ups per event / its walsender's; CPU per wake-up", l.Rate),
							wakeupString(br.CPU, br.WalsenderCPU, br.Wakeups, br.WalsenderWakeups, br.Events), "", "")
					}
					add(fmt.Sprintf("  %d/s: the bare relay's run, CPU by process group", l.Rate), perEventWhere(br.Where, br.Events), "", "")
				}
			}
		}
		if l.SysmonCPU > 0 && l.CPU > 0 {
			add(fmt.Sprintf("  %d/s: of the relay's CPU, the Go runtime's sysmon thread (woken by every wake-up of an idle process)", l.Rate),
				fmt.Sprintf("%.1f µs/event (%.0f%%)", us(perEvent(l.SysmonCPU, l.Events)), 100*float64(l.SysmonCPU)/float64(l.CPU)), "", "")
		}
		add(fmt.Sprintf("  %d/s: CPU by process group", l.Rate), perEventWhere(l.Where, l.Events), "", "")
		add(fmt.Sprintf("  %d/s: runnable but waiting for a CPU, by process group", l.Rate), perEventWait(l.Where, l.Events), "", "")
	}
	if ma := r.maxAlone; ma.Events > 0 {
		add(fmt.Sprintf("producers alone, relay stopped: highest single-row-transaction rate (%d connections back to back)", ma.Conns),
			fmt.Sprintf("%.0f events/s; INSERT+COMMIT p50 / p99 %.2f / %.2f ms", ma.Achieved, msf(ma.InsertP50), msf(ma.InsertP99)), "", "")
		add("  producers alone: CPU by process group", perEventWhere(ma.Where, ma.Events), "", "")
		mr := r.maxRelay
		kept := 0.0
		if ma.Achieved > 0 {
			kept = mr.Achieved / ma.Achieved
		}
		add(fmt.Sprintf("the same, offered at %d/s with the relay running: achieved / alone", mr.Rate),
			fmt.Sprintf("%.2f× (%.0f events/s, %d producers; INSERT+COMMIT p99 %.2f ms)", kept, mr.Achieved, mr.Producers, msf(mr.InsertP99)),
			fmt.Sprintf("≥ %.2f×", targetMaxKept), verdict(kept >= targetMaxKept))
		add(fmt.Sprintf("%d/s with the relay: commit → ack p50 / p99", mr.Rate), fmt.Sprintf("%.2f / %.2f ms", msf(mr.P50), msf(mr.P99)),
			"p99 ≤ 25 ms", verdict(mr.P99 <= targetMaxP99 && mr.Events > 0))
		add(fmt.Sprintf("  %d/s with the relay: relay / walsender CPU per event; CPU by process group", mr.Rate),
			fmt.Sprintf("%.1f / %.1f µs; %s", us(perEvent(mr.CPU, mr.Events)), us(perEvent(mr.WalsenderCPU, mr.Events)), perEventWhere(mr.Where, mr.Events)), "", "")
		if mf := r.maxFloor; mf.Events > 0 && ma.Achieved > 0 {
			add(fmt.Sprintf("  the same, offered at %d/s with pg_recvlogical the only reader (no relay, no JetStream): achieved / alone", mf.Rate),
				fmt.Sprintf("%.2f× (%.0f events/s, %d producers; INSERT+COMMIT p99 %.2f ms; commit → received p50 / p99 %.2f / %.2f ms)",
					mf.Achieved/ma.Achieved, mf.Achieved, mf.Producers, msf(mf.InsertP99), msf(mf.P50), msf(mf.P99)), "", "")
			add(fmt.Sprintf("  %d/s with pg_recvlogical only: CPU by process group", mf.Rate), perEventWhere(mf.Where, mf.Events), "", "")
		}
	}

	g := r.big
	head(fmt.Sprintf("3. One transaction of %d rows (INSERT ... SELECT generate_series)", g.Rows))
	add("insert + commit (not a target)", fmt.Sprintf("%.2f s", g.InsertTook.Seconds()), "", "")
	add("commit → first ack / last ack", fmt.Sprintf("%.2f s / %.2f s (%.0f events/s)", g.FirstAck.Seconds(), g.Took.Seconds(), rate(g.Rows, g.Took)), "", "")
	add("relay CPU (user+sys) per 100,000 events", per100k(g.CPU, g.Rows), "(catch-up target: 0.80 s)", "")
	add("relay peak RSS (VmHWM, fresh process)", fmt.Sprintf("%.1f MB", mb(g.HWM)), targetRSSString, verdict(g.HWM <= targetRSS))
	add("  walsender CPU per 100,000; machine busy", fmt.Sprintf("%s; %.0f%% of %d CPUs", per100k(g.WalsenderCPU, g.Rows), g.Busy*100, int(cores)), "", "")
	add("  CPU by process group (insert + relay)", perEventWhere(g.Where, g.Rows), "", "")

	if len(r.peers) > 0 {
		head("4. Peers: the same backlog and live producers, the same PostgreSQL and nats-server")
		systems := []string{"walbox"}
		for _, pr := range r.peers {
			systems = append(systems, pr.System)
			add(pr.System, pr.Title, "", "")
		}
		names := strings.Join(systems, " / ")
		cu := []catchupResult{c}
		for _, pr := range r.peers {
			cu = append(cu, pr.Catchup)
		}
		var rates, cpus, rss []string
		for _, x := range cu {
			rates = append(rates, fmt.Sprintf("%.0f", rate(x.Events, x.Took)))
			cpus = append(cpus, fmt.Sprintf("%.1f", us(perEvent(x.CPU, x.Events))))
			rss = append(rss, fmt.Sprintf("%.1f", mb(x.HWM)))
		}
		add(fmt.Sprintf("catch-up events/s (walbox %d events, peers %d): %s", n, r.params.PeerEvents, names), strings.Join(rates, " / "), "", "")
		add("catch-up relay CPU µs/event: "+names, strings.Join(cpus, " / "), "", "")
		add("catch-up relay peak RSS MB: "+names, strings.Join(rss, " / "), "", "")
		for _, pr := range r.peers {
			x := rate(pr.Catchup.Events, pr.Catchup.Took)
			ratio := 0.0
			if x > 0 {
				ratio = relayRate / x
			}
			tgt, v := "", ""
			switch pr.System {
			case "polling":
				tgt, v = "≥ 5×", verdict(ratio >= 5)
			case "polling-tuned":
				tgt, v = fmt.Sprintf("≥ %.0f×", targetTuned), verdict(ratio >= targetTuned)
			}
			add(fmt.Sprintf("catch-up throughput, walbox / %s", pr.System), fmt.Sprintf("%.1f×", ratio), tgt, v)
		}
		liveNames := []string{"walbox"}
		for _, pr := range r.peers {
			if len(pr.Live) > 0 {
				liveNames = append(liveNames, pr.System)
			}
		}
		names = strings.Join(liveNames, " / ")
		for i, l := range r.live {
			ps := []string{fmt.Sprintf("%.2f / %.2f", msf(l.StoreP50), msf(l.StoreP99))}
			ach := []string{fmt.Sprintf("%.0f", l.Achieved)}
			for _, pr := range r.peers {
				if i < len(pr.Live) {
					ps = append(ps, fmt.Sprintf("%.2f / %.2f", msf(pr.Live[i].StoreP50), msf(pr.Live[i].StoreP99)))
					ach = append(ach, fmt.Sprintf("%.0f", pr.Live[i].Achieved))
				}
			}
			add(fmt.Sprintf("%d/s: insert → stored p50 / p99 ms: %s", l.Rate, names), strings.Join(ps, "; "), "", "")
			add(fmt.Sprintf("  %d/s: achieved events/s: %s", l.Rate, names), strings.Join(ach, " / "), "", "")
			for _, pr := range r.peers {
				if i >= len(pr.Live) || l.StoreP50 <= 0 {
					continue
				}
				ratio := float64(pr.Live[i].StoreP50) / float64(l.StoreP50)
				tgt, v := "", ""
				if pr.System == "polling" && l.Rate == 2000 {
					tgt, v = "≥ 20×", verdict(ratio >= 20)
				}
				add(fmt.Sprintf("%d/s: p50 latency, %s / walbox", l.Rate, pr.System), fmt.Sprintf("%.1f×", ratio), tgt, v)
			}
		}
		for _, pr := range r.peers {
			var cpu []string
			for _, l := range pr.Live {
				cpu = append(cpu, fmt.Sprintf("%d/s %.1f µs", l.Rate, us(perEvent(l.CPU, l.Events))))
			}
			if len(cpu) > 0 {
				add(fmt.Sprintf("  %s relay CPU per event, live", pr.System), strings.Join(cpu, "; "), "", "")
			}
		}
	}

	if nf := r.noflag; nf.Events > 0 || len(r.liveNoFlag) > 0 {
		head("5. Sweeper: catch-up and live with the processed flag on and off")
	}
	if nf := r.noflag; nf.Events > 0 {
		off := rate(nf.Events, nf.Took)
		add("catch-up, sweeper.mark_processed=false", fmt.Sprintf("%.0f events/s (%.2f s); relay CPU %s%s", off, nf.Took.Seconds(), per100k(nf.CPU, nf.Events),
			runsString(r.noflagRuns, func(x catchupResult) float64 { return rate(x.Events, x.Took) })), "", "")
		add("catch-up, processed flag on (default; phase 1)", fmt.Sprintf("%.0f events/s; every row marked processed %.2f s after the last ack", relayRate, c.MarkedAfter.Seconds()), "", "")
		cost := 0.0
		if off > 0 {
			cost = 1 - relayRate/off
		}
		add("throughput the processed flag costs", costString(cost), targetFlagCostStr, verdict(cost <= targetFlagCost))
		add("  catch-up, flag off: CPU by process group", perEventWhere(nf.Where, nf.Events), "", "")
	}
	for _, off := range r.liveNoFlag {
		for _, on := range r.live {
			if on.Rate != off.Rate || on.Events == 0 || off.Events == 0 {
				continue
			}
			add(fmt.Sprintf("%d/s: commit → ack p99, processed flag on (phase 2) / off (a fresh relay after phase 2)", on.Rate),
				fmt.Sprintf("%s / %s; p50 %s / %s; relay CPU per event %.1f / %.1f µs", ms(on.P99), ms(off.P99), ms(on.P50), ms(off.P50),
					us(perEvent(on.CPU, on.Events)), us(perEvent(off.CPU, off.Events))),
				fmt.Sprintf("no effect (on ≤ %.1f× off)", targetFlagP99), verdict(on.P99 <= time.Duration(float64(off.P99)*targetFlagP99)))
		}
	}

	r.tracingReport(head, add)
	r.batchReport(head, add)
	r.consoleReport(head, add)
	r.claimReport(head, add)

	name, f := r.worstForeign()
	head("Machine")
	v := "ok"
	if f > 0.10 {
		v = "NOISY"
	}
	add("foreign load (processes not part of the benchmark), worst phase",
		fmt.Sprintf("%.0f%% of %d CPUs (%s); %.0f%% busy before the start", f*100, int(cores), name, r.idleBusy*100), "< 10%", v)
	return t
}

func msf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
func us(d time.Duration) float64  { return float64(d) / float64(time.Microsecond) }

// markdownTable renders the table as Markdown (the results files).
func (t table) markdownTable() string {
	var sb strings.Builder
	sb.WriteString("| Measure | Result | Target | |\n|---|---|---|---|\n")
	for _, row := range t {
		if row.section {
			fmt.Fprintf(&sb, "| **%s** | | | |\n", row.measure)
			continue
		}
		fmt.Fprintf(&sb, "| %s | %s | %s | %s |\n", strings.TrimSpace(row.measure), row.result, row.target, row.verdict)
	}
	return sb.String()
}

// text renders the table for the terminal.
func (t table) text() string {
	var sb strings.Builder
	w := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "MEASURE\tRESULT\tTARGET\t")
	for _, r := range t {
		if r.section {
			fmt.Fprintf(w, "\t\t\t\n%s\t\t\t\n", r.measure)
			continue
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\n", r.measure, r.result, r.target, r.verdict)
	}
	w.Flush()
	return sb.String()
}

func (r *results) text(t table) string {
	var sb strings.Builder
	e := r.env
	mode := "full"
	if r.params.Quick {
		mode = "quick"
	}
	if r.params.CPUProfile != "" {
		mode += ", relay profiled"
	}
	if !r.params.Fsync {
		mode += ", PostgreSQL fsync=off variant (-fsync=off)"
	}
	if len(r.params.Sets) > 0 {
		mode += ", relay config: " + strings.Join(r.params.Sets, ", ")
	}
	fmt.Fprintf(&sb, "walbox bench (%s), %s: walbox %s; %d CPUs (%s), %s, Linux %s; %s, PostgreSQL %s (%s), nats-server %s\n\n",
		mode, r.finished.UTC().Format("2006-01-02 15:04 MST"), e.Walbox, e.CPUs, e.CPUModel, e.MemTotal, e.Kernel, e.GoVersion, e.PGVersion, e.PGSet, e.NATS)
	sb.WriteString(t.text())
	sb.WriteString("\nWhere the CPU went (user+sys by process group):\n")
	for _, l := range r.whereLines() {
		sb.WriteString("  " + l + "\n")
	}
	return sb.String()
}

// markdown renders the whole report for bench/results.
func (r *results) markdown(t table) string {
	var sb strings.Builder
	mode := "full (`make bench`)"
	if r.params.Quick {
		mode = "quick (`make bench-quick`)"
	}
	e := r.env
	fmt.Fprintf(&sb, "# walbox benchmark\n\n")
	fmt.Fprintf(&sb, "- Date: %s (run took %s)\n", r.finished.UTC().Format("2006-01-02 15:04 MST"), r.took.Round(time.Second))
	if r.params.CPUProfile != "" {
		mode += ", relay run with a CPU profile (figures include the profiling overhead)"
	}
	if len(r.params.Sets) > 0 {
		mode += fmt.Sprintf(", relay config overrides: %s", strings.Join(r.params.Sets, ", "))
	}
	if !r.params.Fsync {
		mode += ", **PostgreSQL fsync=off variant** (`-fsync=off`: not how users run it)"
	}
	fmt.Fprintf(&sb, "- Mode: %s\n", mode)
	fmt.Fprintf(&sb, "- Machine: %d CPUs (%s), %s memory, Linux %s\n", e.CPUs, e.CPUModel, e.MemTotal, e.Kernel)
	fmt.Fprintf(&sb, "- Versions: walbox %s, %s, PostgreSQL %s, nats-server %s (embedded)\n", e.Walbox, e.GoVersion, e.PGVersion, e.NATS)
	fmt.Fprintf(&sb, "- PostgreSQL: throwaway cluster from internal/pgtest (%s, wal_level=logical); "+
		"live producers use synchronous_commit=%s per session\n", e.PGSet, r.params.SyncCommit)
	fmt.Fprintf(&sb, "- JetStream: one file-storage stream, duplicate window %s, default sync (an ack is not an fsync)\n", dupWindow)
	relayEnv := ""
	if r.params.RelayEnv != "" {
		relayEnv = ", environment " + r.params.RelayEnv
	}
	fmt.Fprintf(&sb, "- Relay: `walbox run` as a subprocess, default config (window %d, runtime.gomaxprocs 1)%s; CPU from /proc/<pid>/stat, peak RSS = VmHWM\n", r.params.Window, relayEnv)
	if len(r.peers) > 0 {
		fmt.Fprintf(&sb, "- Peers: the same PostgreSQL cluster, nats-server and producers; catch-up backlog %d events; live rates as walbox's\n", r.params.PeerEvents)
	}
	sb.WriteString("\n")
	sb.WriteString(t.markdownTable())
	if r.chart != "" {
		fmt.Fprintf(&sb, "\n![insert-to-stored latency CDF and catch-up throughput](%s)\n", r.chart)
	}
	sb.WriteString("\nWhere the CPU went (user+sys by process group, from /proc):\n\n")
	for _, l := range r.whereLines() {
		sb.WriteString("- " + l + "\n")
	}
	if len(r.relayWarnings) > 0 {
		sb.WriteString("\nThe relay logged (warn level and up):\n\n")
		for _, w := range r.relayWarnings {
			sb.WriteString("- " + w + "\n")
		}
	}
	sb.WriteString(`
How it is measured:

- Catch-up: the relay is started once to create its slot, stopped with SIGTERM, and the backlog is
  committed while it is stopped (parallel connections, 10-row transactions). The time runs from
  spawning the relay to the JetStream stored timestamp of the last message, so it includes process
  start, connecting and stream set-up. The decoding ceiling is pg_recvlogical (pgoutput,
  proto_version=1, the same publication) draining an identical backlog from a slot created just
  before it; the publishing ceiling is one async publisher with Nats-Msg-Id headers and at most
  1,024 messages in flight, into a file stream like the relay's. The concurrent ceiling runs
  both at the same moment (pg_recvlogical on a second slot created before the same backlog, the
  publisher writing as many messages): each one's rate is its count over its own time, and the
  lower one, the count over the time until both were done, is the concurrent ceiling: what a
  relay that costs nothing could reach on these cores. The catch-up target is relative to it.
- Floor: before the relay's live phase, with the relay stopped (its slot exists, inactive), the
  same paced producers at every live rate, with pg_recvlogical (pgoutput, proto_version=1, the
  same publication) as the only reader of a slot of its own, writing to a pipe the benchmark
  reads and parses. Commit → received = the time the benchmark parses an Insert minus the commit
  timestamp in its transaction's Begin message (the same commit timestamp walbox puts in
  Walbox-Commit-Time); insert → received uses the payload's time. The relay's slot is then
  moved past these events (pg_replication_slot_advance) and they are marked processed, so the
  relay never sees them. Where the floor is above a latency target, the target applies to what
  walbox adds over it.
- The bare relay: after the floor, with walbox's relay still stopped, a child process of the
  benchmark (GOMAXPROCS=1 and walbox's GODEBUG, as the relay runs) reads pgoutput from a slot of
  its own with pglogrepl and publishes each inserted row with nats.go's PublishMsgAsync and one
  header (Nats-Msg-Id), confirming a transaction's end once its acks are in; the same paced
  producers at 1,000 and 2,000/s. No order guard, position headers, routing, dead letters,
  marking or metrics: what a Go relay on walbox's libraries pays per event on this machine at
  least, beside walbox's relay at the same rate.
- Producers' maximum rate: with the relay stopped and no reader at all, 40 connections commit
  single-event transactions back to back; that rate (rounded down to 100/s) is then offered,
  paced, with pg_recvlogical as the only reader (the floor's set-up) and, later, with the relay
  running: it should keep 95% of it, commit → ack p99 ≤ 25 ms.
- CPU by process group: every phase reads /proc for every process; the rows give each group's
  CPU per event of that phase. "bench driver + nats-server" is the benchmark process: the
  embedded nats-server together with the drivers (producers' client side, consumers, the
  publisher), which one process's counters cannot split; "postgres backends" are mostly the
  producers' (and the sweeper's) sessions.
- Live: after VACUUM ANALYZE and a CHECKPOINT (the catch-up rounds leave dead rows for
  autovacuum) and a 3 s unmeasured warm-up at the first rate, paced producers (one ticker each,
  spread over the interval) commit single-event transactions; latency = JetStream stored timestamp (ordered consumer's metadata) minus the
  relay's Walbox-Commit-Time header (the transaction's commit timestamp). Same host, same clock.
- Commit → ack cut at PostgreSQL's send: the relay observes, per event, commit → the walsender's
  send timestamp (XLogData; both on the server's clock) and that send → the JetStream ack, in
  ` + "`walbox_commit_to_sent_seconds`" + ` and ` + "`walbox_sent_to_ack_seconds`" + ` (buckets a factor of 1.5 apart); the
  benchmark reads them from the relay's /metrics before and after each rate and interpolates
  the quantiles as Prometheus' histogram_quantile does. "Runnable but waiting for a CPU" is the
  second field of /proc/<pid>/task/*/schedstat summed by process group (processes alive at the
  end of the phase): time a process was ready to run and no CPU was free.
- Every live payload carries its insert time (` + "`\"ts\"`" + `), so insert → stored (what a
  consumer sees) is measured the same way for walbox and the peers; the chart plots it.
- Fast batches (issue 36): the relay's default publishes a busy stream's messages in fast
  batches (nats-server 2.14+, one flow ack per up to 256 messages); the catch-up, the first live
  rate and the large transaction are run again each with a fresh relay on the per-message path
  (` + "`WALBOX_NATS_FAST_BATCH=false`" + `), and each run reads the relay's
  ` + "`walbox_nats_batched_messages_total`" + ` at its end, so the report says which path ran. The
  batched publishing ceiling is orbit's jetstreamext FastPublisher (flow 256, two flow acks
  outstanding, batches of 10,000 closed one after the other) writing the same messages into a
  stream with allow_batched; the concurrent ceiling with it runs pg_recvlogical on a third slot
  created before the same backlog. The reference figures ("was") are the last full run before
  fast batches. What walbox's headers cost the server: the same publisher, each round, sends
  the backlog's count of messages twice from a ring of 1,024 that the relay's router built,
  with Nats-Msg-Id only and with every header the router sets, each twice in the order A B B A
  (B A A B the next round), each after a GC and a pause; a CPU profile of the bench process, the publisher's goroutines labelled, splits
  its CPU between the publisher and the embedded nats-server. Where the relay's CPU goes is
  the profiled catch-up of the tracing section (sampled at 1 %), each sample given to the
  first of bench/breakdown.go's groups its stack touches. The "why" rows compare two runs that
  kept the CPUs busy: a rate is the CPUs kept busy over what every process spends per event,
  so the ratio of two rates is set by those two figures; the large transaction's are measured
  from its commit to its last ack.
- Processed flag: the catch-up is run twice, with the sweeper marking rows (default) and with
  ` + "`WALBOX_SWEEPER_MARK_PROCESSED=false`" + `; after each run the relay is left to finish (every
  row marked, slot confirmed past a checkpoint) before it stops, so the next run does not
  decode the previous one's leftovers.
- Peers: the polling baseline is bench/poll.go run as a child process (the design documents'
  worker: every 100 ms, 200 rows FOR UPDATE SKIP LOCKED, publish each and await its ack, mark
  the batch); polling-tuned publishes the batch asynchronously and polls again at once after a
  full batch; watermill is Watermill's SQL forwarder to watermill-nats (bench/watermill, its
  own module). Their catch-up backlog is smaller than walbox's (pollers drain at a steady
  rate); the table compares rates.
- Everything (PostgreSQL, nats-server, relay, producers) shares this machine's CPUs, as the
  "machine busy" rows show; a relay on its own host would have more room.
`)
	return sb.String()
}

// whereLines says where the CPU went in each phase, by process group.
func (r *results) whereLines() []string {
	line := func(name string, wall time.Duration, busy float64, w []cpuShare) string {
		return fmt.Sprintf("%s (%.2f s wall, %.0f%% of %d CPUs busy, foreign load %.0f%%): %s",
			name, wall.Seconds(), busy*100, r.env.CPUs, r.foreign(w, wall)*100, r.whereString(w))
	}
	out := []string{
		line("before the start, idle", time.Second, r.idleBusy, r.idleWhere),
		line("catch-up, relay", r.catchup.Span, r.catchup.Busy, r.catchup.Where),
		line("decoding ceiling", r.decode.Span, r.decode.Busy, r.decode.Where),
		line("publishing ceiling", r.publish.Span, r.publish.Busy, r.publish.Where),
		line("concurrent ceiling", r.conc.Span, r.conc.Busy, r.conc.Where),
	}
	for _, f := range r.floor {
		out = append(out, line(fmt.Sprintf("floor %d/s (pg_recvlogical)", f.Rate), f.Span, f.Busy, f.Where))
	}
	if r.maxAlone.Events > 0 {
		out = append(out, line("producers alone, maximum rate", r.maxAlone.Span, r.maxAlone.Busy, r.maxAlone.Where))
	}
	if r.maxFloor.Events > 0 {
		out = append(out, line(fmt.Sprintf("floor %d/s (the producers' maximum, pg_recvlogical)", r.maxFloor.Rate), r.maxFloor.Span, r.maxFloor.Busy, r.maxFloor.Where))
	}
	for _, l := range r.live {
		out = append(out, line(fmt.Sprintf("live %d/s", l.Rate), l.Span, l.Busy, l.Where))
	}
	if r.maxRelay.Events > 0 {
		out = append(out, line(fmt.Sprintf("live %d/s (the producers' maximum, relay running)", r.maxRelay.Rate), r.maxRelay.Span, r.maxRelay.Busy, r.maxRelay.Where))
	}
	out = append(out, line("large transaction (insert + relay)", r.big.Span, r.big.Busy, r.big.Where))
	if r.noflag.Events > 0 {
		out = append(out, line("catch-up, processed flag off", r.noflag.Span, r.noflag.Busy, r.noflag.Where))
	}
	if r.perMsg.Events > 0 {
		out = append(out, line("catch-up, per-message path", r.perMsg.Span, r.perMsg.Busy, r.perMsg.Where),
			line("batched publishing ceiling", r.batchPub.Span, r.batchPub.Busy, r.batchPub.Where),
			line("concurrent ceiling, batched publisher", r.concBatch.Span, r.concBatch.Busy, r.concBatch.Where))
	}
	if l := r.livePerMsg; l.Events > 0 {
		out = append(out, line(fmt.Sprintf("live %d/s, per-message path", l.Rate), l.Span, l.Busy, l.Where))
	}
	if r.bigPerMsg.Rows > 0 {
		out = append(out, line("large transaction, per-message path", r.bigPerMsg.Span, r.bigPerMsg.Busy, r.bigPerMsg.Where))
	}
	for _, pr := range r.peers {
		out = append(out, line(pr.System+" catch-up", pr.Catchup.Span, pr.Catchup.Busy, pr.Catchup.Where))
		for _, l := range pr.Live {
			out = append(out, line(fmt.Sprintf("%s live %d/s", pr.System, l.Rate), l.Span, l.Busy, l.Where))
		}
	}
	return out
}

func (r *results) whereString(w []cpuShare) string {
	var parts []string
	for i, s := range w {
		if i == 7 || s.CPU < 10*time.Millisecond {
			break
		}
		parts = append(parts, fmt.Sprintf("%s %.2f s", s.Label, s.CPU.Seconds()))
	}
	if len(parts) == 0 {
		return "nothing measurable"
	}
	return strings.Join(parts, ", ")
}

// foreign is the share of the machine's CPUs used during a phase by
// processes that are not part of the benchmark (other users of the machine,
// and processes that exited before the end of the phase).
func (r *results) foreign(w []cpuShare, wall time.Duration) float64 {
	var d time.Duration
	for _, s := range w {
		if strings.HasPrefix(s.Label, "other: ") || strings.HasPrefix(s.Label, "unattributed") {
			d += s.CPU
		}
	}
	if wall <= 0 || r.env.CPUs == 0 {
		return 0
	}
	return d.Seconds() / (wall.Seconds() * float64(r.env.CPUs))
}

// worstForeign returns the phase with the most foreign load.
func (r *results) worstForeign() (string, float64) {
	name, worst := "", 0.0
	check := func(n string, w []cpuShare, wall time.Duration) {
		if f := r.foreign(w, wall); f > worst {
			name, worst = n, f
		}
	}
	check("catch-up", r.catchup.Where, r.catchup.Span)
	check("decoding ceiling", r.decode.Where, r.decode.Span)
	check("publishing ceiling", r.publish.Where, r.publish.Span)
	check("concurrent ceiling", r.conc.Where, r.conc.Span)
	for _, f := range r.floor {
		check(fmt.Sprintf("floor %d/s", f.Rate), f.Where, f.Span)
	}
	check("producers alone", r.maxAlone.Where, r.maxAlone.Span)
	if r.maxFloor.Events > 0 {
		check("floor, producers' maximum", r.maxFloor.Where, r.maxFloor.Span)
	}
	check("live, producers' maximum", r.maxRelay.Where, r.maxRelay.Span)
	for _, l := range r.live {
		check(fmt.Sprintf("live %d/s", l.Rate), l.Where, l.Span)
	}
	check("large transaction", r.big.Where, r.big.Span)
	check("catch-up, flag off", r.noflag.Where, r.noflag.Span)
	check("catch-up, per-message path", r.perMsg.Where, r.perMsg.Span)
	check("batched publishing ceiling", r.batchPub.Where, r.batchPub.Span)
	check("concurrent ceiling, batched publisher", r.concBatch.Where, r.concBatch.Span)
	check("live, per-message path", r.livePerMsg.Where, r.livePerMsg.Span)
	check("large transaction, per-message path", r.bigPerMsg.Where, r.bigPerMsg.Span)
	for _, pr := range r.peers {
		check(pr.System+" catch-up", pr.Catchup.Where, pr.Catchup.Span)
		for _, l := range pr.Live {
			check(fmt.Sprintf("%s live %d/s", pr.System, l.Rate), l.Where, l.Span)
		}
	}
	return name, worst
}

// costString shows a share of throughput lost; a negative one (the run with
// the cost was faster) is noise between two runs.
func costString(cost float64) string {
	pc := math.Round(cost * 100)
	if pc <= 0 {
		return fmt.Sprintf("%.0f%% (the flag-on run was not slower: within run-to-run noise)", math.Abs(pc))
	}
	return fmt.Sprintf("%.0f%%", pc)
}

// runsString lists every round's value when there was more than one.
func runsString[T any](runs []T, value func(T) float64) string {
	if len(runs) < 2 {
		return ""
	}
	vs := make([]string, len(runs))
	for i, x := range runs {
		vs[i] = fmt.Sprintf("%.0f", value(x))
	}
	return fmt.Sprintf("; median of %d rounds: %s", len(runs), strings.Join(vs, ", "))
}
