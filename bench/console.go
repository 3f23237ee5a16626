package main

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/pprof/profile"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Issue 38: the web console must cost the relay at most 2 % of its CPU at
// 1,000 events/s with one browser on the live tail. consoleCost runs that
// rate on fresh relays, alternately with the console off
// (WALBOX_CONSOLE_ENABLED=false) and on with one viewer on the live tail,
// and compares the relay's CPU per event. The viewer is a client of the
// bench reading the tail's Server-Sent Events as the page does: the
// browser's own CPU is not the relay's.

// consoleRate is the rate the target names.
const consoleRate = 1000

// targetConsoleCPU: relay CPU per event with the console and one viewer ÷
// without it.
const targetConsoleCPU = 1.02

// consoleResult is the comparison, each side's runs in order: console
// off, on with no viewer (its Overview sampling every 5 s), on with one
// live-tail viewer.
type consoleResult struct {
	Off, Idle, On []liveResult
	// Viewed events the viewer received; Dropped the tail's own count of
	// those it dropped for the viewer (walbox_console_tail_dropped_total).
	Viewed, Dropped int64
	// Shown is, for each event a viewer received in any of the runs,
	// its commit → received.
	Shown []time.Duration
	// Watched and Unwatched are the windows of one relay, console on,
	// with and without a live-tail viewer, alternated (consoleToggle): the
	// comparison without the differences between relay processes.
	Watched, Unwatched []liveResult
	// Profiled is consoleProfile's window: one relay under a CPU profile,
	// watched throughout.
	Profiled *consoleShare
}

// consoleShare is what a CPU profile of a watched relay attributes to the
// console: samples with a frame of internal/console on their stack (the
// tail's hand-off on the publisher goroutine, its filter and budget, the
// viewer's encoding and writes, the Overview's sampling).
type consoleShare struct {
	profileShare
	Window liveResult // the watched window at consoleRate
	Viewed int64      // events the viewer received in it
}

func (b *bench) consoleCost(ctx context.Context, pool *pgxpool.Pool, rounds int) error {
	if err := b.vacuum(ctx, "before the console's cost"); err != nil {
		return err
	}
	res := &b.res.console
	for i := range rounds {
		for _, mode := range []string{"off", "idle", "tail"} {
			on := mode == "tail"
			system, env := "walbox-console-"+mode, []string{"WALBOX_CONSOLE_ENABLED=true"}
			if mode == "off" {
				env = []string{"WALBOX_CONSOLE_ENABLED=false"}
			}
			b.logf("console %d/%d: a fresh relay, %s", i+1, rounds, system)
			t, err := b.walboxLive(ctx, pool, fmt.Sprintf("console-%s-%d", mode, i+1), system, fmt.Sprintf("bench.console.r%d.%s", i, mode), env...)
			if err != nil {
				return err
			}
			var stop func() (tailView, error)
			if on {
				if stop, err = b.tailViewer(ctx, t.metrics); err != nil {
					_ = b.stopRelay(t.proc)
					return err
				}
			}
			r, err := b.liveRate(ctx, t, consoleRate)
			if stop != nil {
				view, verr := stop()
				res.add(view)
				if err == nil {
					err = verr
				}
				if d, derr := relayCounter(ctx, t.metrics, "walbox_console_tail_dropped_total"); derr == nil {
					res.Dropped += int64(d)
				}
			}
			if serr := b.stopRelay(t.proc); err == nil {
				err = serr
			}
			if err != nil {
				return fmt.Errorf("console %s: %w", system, err)
			}
			switch mode {
			case "off":
				res.Off = append(res.Off, r)
			case "idle":
				res.Idle = append(res.Idle, r)
			default:
				res.On = append(res.On, r)
			}
		}
	}
	return nil
}

// consoleToggle runs one relay with the console on at consoleRate for
// 2 × pairs windows, a live-tail viewer attached in every other one (the
// order flips each pair, so that a drift over the run does not favour
// either side), and keeps each window's relay CPU. Fresh relays differ
// among themselves by more than the 2 % the target allows (process start,
// memory layout, when GC runs); windows of one process do not.
func (b *bench) consoleToggle(ctx context.Context, pool *pgxpool.Pool, pairs int) error {
	if err := b.vacuum(ctx, "before the console's cost, one relay"); err != nil {
		return err
	}
	res := &b.res.console
	t, err := b.walboxLive(ctx, pool, "console-toggle", "walbox-console-toggle", "bench.console.toggle", "WALBOX_CONSOLE_ENABLED=true")
	if err != nil {
		return err
	}
	defer func() { _ = b.stopRelay(t.proc) }()
	for i := range pairs {
		for k, watched := range []bool{i%2 == 0, i%2 != 0} {
			w := t
			w.subject = fmt.Sprintf("bench.console.toggle.p%d.w%d", i, k)
			var stop func() (tailView, error)
			if watched {
				if stop, err = b.tailViewer(ctx, t.metrics); err != nil {
					return err
				}
			}
			b.logf("console, one relay: pair %d/%d, viewer %v", i+1, pairs, watched)
			r, err := b.liveRate(ctx, w, consoleRate)
			if stop != nil {
				view, verr := stop()
				res.add(view)
				if err == nil {
					err = verr
				}
			}
			if err != nil {
				return fmt.Errorf("console, one relay, pair %d: %w", i+1, err)
			}
			if watched {
				res.Watched = append(res.Watched, r)
			} else {
				res.Unwatched = append(res.Unwatched, r)
			}
		}
	}
	return nil
}

// consoleProfile runs one relay with the console on under a CPU profile
// (this binary running app.Run, as -cpuprofile does), one live-tail viewer
// attached before its warm-up and for the whole window at consoleRate, and
// attributes the profile's samples to the console or not. The windows of
// a relay differ by more than the 2 % the target allows (consoleToggle);
// a profile compares the console's samples with the others of the same
// seconds, so the machine's other load moves both alike.
func (b *bench) consoleProfile(ctx context.Context, pool *pgxpool.Pool, window time.Duration) error {
	if err := b.vacuum(ctx, "before the console's profile"); err != nil {
		return err
	}
	dir, restore, err := b.profileDir()
	if err != nil {
		return err
	}
	defer restore()
	savedFor := b.p.LiveFor
	b.p.LiveFor = window
	defer func() { b.p.LiveFor = savedFor }()
	r, wsPID, err := b.startStreaming(ctx, "console-profile", "WALBOX_CONSOLE_ENABLED=true")
	if err != nil {
		return err
	}
	t := liveTarget{system: "walbox-console-profiled", stream: benchStream, subject: "bench.console.profile", proc: r, wsPID: wsPID,
		header: true, metrics: b.env.metrics, producers: b.sqlLoad(pool)}
	stop, err := b.tailViewer(ctx, t.metrics)
	if err != nil {
		_ = b.stopRelay(t.proc)
		return err
	}
	b.logf("console: one relay under a CPU profile, watched, %d/s for %v", consoleRate, window)
	err = b.warmUp(ctx, t)
	var lr liveResult
	if err == nil {
		lr, err = b.liveRate(ctx, t, consoleRate)
	}
	view, verr := stop()
	procCPU, cerr := t.proc.cpu()
	if serr := b.stopRelay(t.proc); err == nil {
		err = serr
	}
	if err == nil {
		err = cmp.Or(verr, cerr)
	}
	if err != nil {
		return fmt.Errorf("console under a profile: %w", err)
	}
	share, err := readProfileShare(filepath.Join(dir, "relay-console-profile.pprof"), procCPU,
		func(fn string) bool { return strings.HasPrefix(fn, consolePkg) })
	if err != nil {
		return err
	}
	b.res.console.Shown = append(b.res.console.Shown, view.Shown...)
	b.res.console.Profiled = &consoleShare{profileShare: share, Window: lr, Viewed: view.Received}
	return nil
}

// consolePkg is the console's package path in a profile's function names.
const consolePkg = "github.com/walbox/walbox/internal/console."

// profileShare is the part of a relay's CPU profile whose samples have a
// frame that mine matches anywhere on their stack (each sample counted
// once), and the process's CPU from /proc at the profile's end.
type profileShare struct {
	Matched, Samples int64         // samples
	ProcCPU          time.Duration // the relay's user+sys CPU over its life
	Top              []string      // the matched functions with the most samples of their own
}

// Share is Matched ÷ Samples: a share of the relay's CPU over its life.
func (p profileShare) Share() float64 {
	if p.Samples == 0 {
		return 0
	}
	return float64(p.Matched) / float64(p.Samples)
}

// Upper is share's upper bound at 95 % confidence, given that the profile
// drew Samples samples: share + 2 standard errors of a proportion (at
// least 3 samples' worth when few matched).
func (p profileShare) Upper(share float64) float64 {
	if p.Samples == 0 {
		return 1
	}
	n := float64(p.Samples)
	return share + max(2*math.Sqrt(share*(1-share)/n), 3/n)
}

// readProfileShare reads the CPU profile at path.
func readProfileShare(path string, procCPU time.Duration, mine func(function string) bool) (profileShare, error) {
	prof, n, err := readCPUProfile(path)
	if err != nil {
		return profileShare{}, err
	}
	share := profileShare{ProcCPU: procCPU}
	flat := map[string]int64{}
	for _, smp := range prof.Sample {
		v := smp.Value[n]
		share.Samples += v
		in := false
		for li, loc := range smp.Location {
			for _, line := range loc.Line {
				if line.Function != nil && mine(line.Function.Name) {
					in = true
					if li == 0 {
						flat[line.Function.Name] += v
					}
				}
			}
		}
		if in {
			share.Matched += v
		}
	}
	names := slices.Collect(maps.Keys(flat))
	slices.SortFunc(names, func(a, b string) int { return cmp.Compare(flat[b], flat[a]) })
	for _, fn := range names[:min(3, len(names))] {
		short := fn[strings.LastIndex(fn, "/")+1:]
		share.Top = append(share.Top, fmt.Sprintf("%s %.1f %%", short, 100*float64(flat[fn])/float64(max(share.Samples, 1))))
	}
	return share, nil
}

// tailView is what a live-tail viewer received: the events, and each
// one's commit → received.
type tailView struct {
	Received int64
	Shown    []time.Duration
}

// add counts view's events in the runs' totals.
func (c *consoleResult) add(view tailView) {
	c.Viewed += view.Received
	c.Shown = append(c.Shown, view.Shown...)
}

// shownAfterCommit is an event's commit → received at at, from the live
// tail's JSON for it: acked_at_ms less commit_to_ack_ms is its commit
// time, to the millisecond (PostgreSQL's commit timestamp and this
// process's clock are the same machine's). False for an event with no
// commit time (one re-read from a snapshot).
func shownAfterCommit(data []byte, at time.Time) (time.Duration, bool) {
	var ev struct {
		AckedAtMS     int64    `json:"acked_at_ms"`
		CommitToAckMS *float64 `json:"commit_to_ack_ms"`
	}
	if err := json.Unmarshal(data, &ev); err != nil || ev.CommitToAckMS == nil || ev.AckedAtMS == 0 {
		return 0, false
	}
	commit := time.UnixMilli(ev.AckedAtMS).Add(-time.Duration(*ev.CommitToAckMS * float64(time.Millisecond)))
	return at.Sub(commit), true
}

// tailViewer reads the console's live tail at addr as a browser does
// until stop, which returns what it received.
func (b *bench) tailViewer(ctx context.Context, addr string) (stop func() (tailView, error), err error) {
	vctx, cancel := context.WithCancel(ctx)
	req, err := http.NewRequestWithContext(vctx, http.MethodGet, "http://"+addr+"/ui/api/tail", nil)
	if err != nil {
		cancel()
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("open the console's live tail: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		cancel()
		return nil, fmt.Errorf("open the console's live tail: %s", resp.Status)
	}
	var mu sync.Mutex
	var view tailView
	done := make(chan error, 1)
	go func() {
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		event := false
		for sc.Scan() {
			line := sc.Bytes()
			switch {
			case bytes.HasPrefix(line, []byte("event: ")):
				event = bytes.Equal(line, []byte("event: event"))
			case event && bytes.HasPrefix(line, []byte("data: ")):
				event = false
				d, ok := shownAfterCommit(line[len("data: "):], time.Now())
				mu.Lock()
				view.Received++
				if ok {
					view.Shown = append(view.Shown, d)
				}
				mu.Unlock()
			}
		}
		if vctx.Err() != nil {
			done <- nil
			return
		}
		done <- fmt.Errorf("the console's live tail ended: %v", sc.Err())
	}()
	return func() (tailView, error) {
		cancel()
		var err error
		select {
		case err = <-done:
		case <-time.After(5 * time.Second):
		}
		mu.Lock()
		defer mu.Unlock()
		return tailView{Received: view.Received, Shown: slices.Clone(view.Shown)}, err
	}, nil
}

// relayCounter sums the series of counter name at the relay's /metrics.
func relayCounter(ctx context.Context, addr, name string) (float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) || strings.HasPrefix(line, "#") {
			continue
		}
		var v float64
		if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err == nil {
			sum += v
		}
	}
	return sum, sc.Err()
}

// consoleReport adds the console's rows.
func (r *results) consoleReport(head func(string), add func(what, value, target, verdict string)) {
	c := r.console
	if len(c.Off) == 0 || len(c.On) == 0 {
		return
	}
	head("Web console (issue 38)")
	perEv := func(rs []liveResult) (cpu time.Duration, events int, parts []string) {
		for _, x := range rs {
			cpu += x.CPU
			events += x.Events
			parts = append(parts, fmt.Sprintf("%.1f", us(perEvent(x.CPU, x.Events))))
		}
		return
	}
	offCPU, offN, offParts := perEv(c.Off)
	idleCPU, idleN, idleParts := perEv(c.Idle)
	onCPU, onN, onParts := perEv(c.On)
	off, idle, on := us(perEvent(offCPU, offN)), us(perEvent(idleCPU, idleN)), us(perEvent(onCPU, onN))
	add(fmt.Sprintf("%d/s: relay CPU per event, console off / on, no viewer / on, one live-tail viewer (runs alternated)", consoleRate),
		fmt.Sprintf("%.1f / %.1f / %.1f µs (runs: %s / %s / %s)", off, idle, on,
			strings.Join(offParts, ", "), strings.Join(idleParts, ", "), strings.Join(onParts, ", ")), "", "")
	add("  commit → ack p99, console off / one live-tail viewer", fmt.Sprintf("%s / %s", p99s(c.Off), p99s(c.On)), "", "")
	add("  live-tail viewer: events received / not sent to it (over its 200 a second, or behind)",
		fmt.Sprintf("%d / %d (of %d published in its runs)", c.Viewed, c.Dropped, onN), "", "")
	c.shownRow(add)
	ratio := ratioOf(on, off)
	// The runs of one relay, console off, differ among themselves: when by
	// more than the target's margin, the comparison cannot tell.
	spread := spreadOf(c.Off)
	v := met(ratio <= targetConsoleCPU && off > 0)
	if spread > (targetConsoleCPU-1)*2 {
		v = fmt.Sprintf("noisy: console-off runs differ by %.0f %%", spread*100)
	}
	if len(c.Watched) > 0 {
		v = "see the one-relay row"
	}
	if c.Profiled != nil {
		v = "see the profile's row"
	}
	add("fresh relays: relay CPU with the console and one live-tail viewer ÷ without it",
		fmt.Sprintf("%.3f (%+.1f %%)", ratio, (ratio-1)*100), "", v)
	defer c.consoleProfileLines(add)
	if len(c.Watched) == 0 || len(c.Watched) != len(c.Unwatched) {
		return
	}
	// One relay, console on: each pair's windows compared, the median of
	// the pairs' ratios the verdict (a pair disturbed by other load on the
	// machine moves one ratio, not the median).
	var ratios []float64
	var parts []string
	for i := range c.Watched {
		w, u := us(perEvent(c.Watched[i].CPU, c.Watched[i].Events)), us(perEvent(c.Unwatched[i].CPU, c.Unwatched[i].Events))
		ratios = append(ratios, ratioOf(w, u))
		parts = append(parts, fmt.Sprintf("%.1f/%.1f", w, u))
	}
	lo, hi := slices.Min(ratios), slices.Max(ratios)
	med := median(ratios)
	add(fmt.Sprintf("one relay, console on, %d/s: relay CPU per event with / without a live-tail viewer, windows alternated (µs, per pair)", consoleRate),
		strings.Join(parts, ", "), "", "")
	// Windows of one relay differ too (two runs of this phase gave medians
	// of +9.3 % and -4.4 %): when the pairs' ratios spread over more than
	// twice the target's margin, the median cannot tell either.
	v = met(med <= targetConsoleCPU)
	if hi-lo > (targetConsoleCPU-1)*2 {
		v = fmt.Sprintf("noisy: the pairs' ratios span %.0f %%", (hi-lo)*100)
	}
	if c.Profiled != nil {
		v = "see the profile's row"
	}
	add("one relay: relay CPU with one live-tail viewer ÷ without it (median of the pairs)",
		fmt.Sprintf("%.3f (%+.1f %%)", med, (med-1)*100), "", v)
}

// shownRow: how soon after its commit the live-tail viewer received an
// event, over every run with a viewer (the page shows it as it arrives;
// the console's target is within a second).
func (c *consoleResult) shownRow(add func(what, value, target, verdict string)) {
	if len(c.Shown) == 0 {
		return
	}
	s := slices.Clone(c.Shown)
	slices.Sort(s)
	p99 := pct(s, 0.99)
	add("live-tail viewer: commit → event received, p50 / p99 / max",
		fmt.Sprintf("%s / %s / %s (%d events)", ms(pct(s, 0.50)), ms(p99), ms(s[len(s)-1]), len(s)), "p99 ≤ 1 s", met(p99 <= time.Second))
}

// consoleProfileLines: the verdict. The console's samples over all of the
// relay's (its life: the viewer watched from its start-up's end) are
// taken as a share of the relay's CPU in the watched window: slightly
// conservative, since the start-up's samples were the console's least.
func (c *consoleResult) consoleProfileLines(add func(what, value, target, verdict string)) {
	p := c.Profiled
	if p == nil || p.Samples == 0 {
		return
	}
	share := p.Share() * float64(p.ProcCPU) / float64(max(p.Window.CPU, 1))
	share = max(share, p.Share())
	add(fmt.Sprintf("one relay under a CPU profile, %d/s, one live-tail viewer throughout: relay CPU over its life / in the window; profile samples in the console's code / all", consoleRate),
		fmt.Sprintf("%.2f s / %.2f s (%.1f µs/event, %d events, %d sent to the viewer); %d / %d samples; the console's heaviest: %s",
			p.ProcCPU.Seconds(), p.Window.CPU.Seconds(), us(perEvent(p.Window.CPU, p.Window.Events)), p.Window.Events, p.Viewed,
			p.Matched, p.Samples, strings.Join(p.Top, ", ")), "", "")
	hi := p.Upper(share)
	add("target: the console's share of the watched relay's CPU (the profile's console samples ÷ all, over the relay's life ÷ the window's; its 95 % upper bound)",
		fmt.Sprintf("%.2f %% (≤ %.2f %%)", share*100, hi*100), fmt.Sprintf("≤ %.0f %%", (targetConsoleCPU-1)*100), met(hi <= targetConsoleCPU-1))
}

// median of xs (xs is reordered).
func median(xs []float64) float64 {
	slices.Sort(xs)
	n := len(xs)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return xs[n/2]
	}
	return (xs[n/2-1] + xs[n/2]) / 2
}

// consoleOnly is -console-only: the console's cost alone, its rows printed
// and written to bench/results/console.md.
func (b *bench) consoleOnly(ctx context.Context) error {
	pool, err := b.livePool(ctx, b.p.MaxConns)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := b.consoleCost(ctx, pool, 3); err != nil {
		return err
	}
	if err := b.consoleToggle(ctx, pool, 5); err != nil {
		return err
	}
	if err := b.consoleProfile(ctx, pool, 150*time.Second); err != nil {
		return err
	}
	var t table
	b.res.params = b.p
	b.res.finished = time.Now()
	b.res.took = time.Since(b.start)
	b.res.consoleReport(func(s string) { t = append(t, row{section: true, measure: s}) },
		func(measure, result, target, v string) {
			t = append(t, row{measure: measure, result: result, target: target, verdict: v})
		})
	fmt.Println()
	fmt.Print(t.text())
	out := b.p.Out
	if out == "" {
		out = filepath.Join(b.env.moduleDir, "bench", "results", "console.md")
	}
	md := b.res.markdown(t)
	md = strings.Replace(md, "# walbox benchmark", "# walbox benchmark: the web console's cost (-console-only)", 1)
	if err := os.WriteFile(out, []byte(md), 0o644); err != nil {
		return err
	}
	b.logf("done: results written to %s", out)
	return nil
}

// p99s lists the runs' commit → ack p99s.
func p99s(rs []liveResult) string {
	var parts []string
	for _, r := range rs {
		parts = append(parts, ms(r.P99))
	}
	return strings.Join(parts, ", ")
}

// spreadOf is (max - min) / min of the runs' relay CPU per event.
func spreadOf(rs []liveResult) float64 {
	lo, hi := 0.0, 0.0
	for i, r := range rs {
		x := us(perEvent(r.CPU, r.Events))
		if i == 0 || x < lo {
			lo = x
		}
		if x > hi {
			hi = x
		}
	}
	if lo == 0 {
		return 0
	}
	return (hi - lo) / lo
}

// readCPUProfile parses the CPU profile at path and returns it with the
// index of its sample counts among a sample's values.
func readCPUProfile(path string) (*profile.Profile, int, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, fmt.Errorf("the CPU profile: %w", err)
	}
	defer f.Close()
	prof, err := profile.Parse(f)
	if err != nil {
		return nil, 0, fmt.Errorf("parse the CPU profile %s: %w", path, err)
	}
	for i, st := range prof.SampleType {
		if st.Type == "samples" {
			return prof, i, nil
		}
	}
	return nil, 0, fmt.Errorf("the CPU profile %s has no sample counts", path)
}
