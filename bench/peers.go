package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// peerStream holds what the peers publish (subjects peer.<system>.*).
const peerStream = "PEERS"

// peer is another relay doing walbox's job, run on the same workloads.
type peer struct {
	system string // short name: polling, polling-tuned, watermill
	title  string // for the report
	live   bool   // also run the live rates
	// start spawns the relay; ready returns once it serves.
	start func(phase string) (*relayProc, error)
	ready func(ctx context.Context, p *relayProc) error
	// load commits a backlog of n events for subject.
	load func(ctx context.Context, subject string, n int) (time.Duration, error)
	// live producers and probe, as in liveTarget.
	producers
}

// peerResult is one peer's catch-up and live rates.
type peerResult struct {
	System  string
	Title   string
	Catchup catchupResult
	Live    []liveResult
}

// peers runs the polling baseline and the Watermill forwarder on the
// catch-up and live workloads.
func (b *bench) peers(ctx context.Context) error {
	b.logf("peers: emptying outbox_events (walbox's runs left rows the pollers would pick up); walbox is stopped")
	qctx, cancel := context.WithTimeout(ctx, time.Minute)
	_, err := b.env.pool.Exec(qctx, "TRUNCATE outbox_events")
	if err == nil {
		_, err = b.env.pool.Exec(qctx, "VACUUM ANALYZE outbox_events")
	}
	if err == nil {
		_, err = b.env.js.CreateStream(qctx, jetstream.StreamConfig{Name: peerStream, Subjects: []string{"peer.>"},
			Storage: jetstream.FileStorage, Duplicates: dupWindow})
	}
	cancel()
	if err != nil {
		return err
	}
	pool, err := b.livePool(ctx, 0)
	if err != nil {
		return err
	}
	defer pool.Close()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	polling := func(mode string) peer {
		pr := peer{
			system: "polling",
			title:  "polling relay as the outbox design describes it (bench/poll.go): every 100 ms SELECT ... ORDER BY created_at LIMIT 200 FOR UPDATE SKIP LOCKED, publish each and await its ack, mark the batch processed",
			live:   true,
			start: func(phase string) (*relayProc, error) {
				return b.startProc("polling-"+mode+"-"+phase, self, []string{pollRelayArg, mode, b.env.dbURL, b.env.ns.URL()})
			},
			load: func(ctx context.Context, subject string, n int) (time.Duration, error) {
				return b.loadBacklog(ctx, subject, n)
			},
			producers: b.sqlLoad(pool),
		}
		if mode == pollTuned {
			pr.system, pr.live = "polling-tuned", false
			pr.title = "the same poller tuned (catch-up only): the batch of 200 published asynchronously, the next poll at once after a full batch"
		}
		return pr
	}
	wm, err := b.watermillPeer(ctx)
	if err != nil {
		return err
	}
	for _, pr := range []peer{polling(pollDesign), polling(pollTuned), wm} {
		res := peerResult{System: pr.system, Title: pr.title}
		if err := b.peerCatchup(ctx, pr, &res.Catchup); err != nil {
			return fmt.Errorf("%s catch-up: %w", pr.system, err)
		}
		if !pr.live {
			b.res.peers = append(b.res.peers, res)
			continue
		}
		b.logf("live %s: starting a fresh relay process", pr.system)
		proc, err := pr.start("live")
		if err != nil {
			return err
		}
		if pr.ready != nil {
			if err := pr.ready(ctx, proc); err != nil {
				return err
			}
		}
		t := liveTarget{system: pr.system, stream: peerStream, subject: "peer." + pr.system + ".live", proc: proc,
			producers: pr.producers}
		if err := b.warmUp(ctx, t); err != nil {
			return fmt.Errorf("%s: %w", pr.system, err)
		}
		for _, rate := range b.p.Rates {
			lr, err := b.liveRate(ctx, t, rate)
			if err != nil {
				return fmt.Errorf("%s: %w", pr.system, err)
			}
			res.Live = append(res.Live, lr)
		}
		if err := proc.stop(); err != nil {
			return err
		}
		b.res.peers = append(b.res.peers, res)
	}
	return nil
}

// peerCatchup loads the catch-up backlog while the peer is stopped, then
// times it from spawn to the last message stored.
func (b *bench) peerCatchup(ctx context.Context, pr peer, res *catchupResult) error {
	n := b.p.PeerEvents
	subject := "peer." + pr.system + ".catchup"
	b.logf("%s catch-up: loading %d events while it is stopped", pr.system, n)
	res.Events = n
	var err error
	if res.LoadTook, err = pr.load(ctx, subject, n); err != nil {
		return fmt.Errorf("load: %w", err)
	}
	base, err := b.streamMsgs(ctx, peerStream)
	if err != nil {
		return err
	}
	target := base + uint64(n)
	b.logf("%s catch-up: backlog committed in %.1fs; starting it", pr.system, res.LoadTook.Seconds())
	meter, self0 := b.startPhase(0), selfCPU()
	proc, err := pr.start("catch-up")
	if err != nil {
		return err
	}
	meter.relay = proc.pid()
	var acked atomic.Int64
	wctx, done := b.watch(ctx, pr.system+" catch-up", acked.Load, func(v int64) string { return fmt.Sprintf("%d/%d acked", v, n) })
	defer done()
	for {
		reached, err := b.pollAcked(wctx, peerStream, base, target, acked.Store, proc, pr.system+" exited")
		if err != nil {
			return err
		}
		if reached {
			break
		}
	}
	if res.CPU, err = proc.cpu(); err != nil {
		return err
	}
	if res.HWM, err = proc.hwm(); err != nil {
		return err
	}
	if err := b.endCatchup(ctx, res, meter, self0, done, peerStream, base, target, proc.started); err != nil {
		return err
	}
	if err := proc.stop(); err != nil {
		return err
	}
	got, err := b.streamMsgs(ctx, peerStream)
	if err != nil {
		return err
	}
	if got != target {
		return fmt.Errorf("stream %s holds %d messages after %s's catch-up, want %d", peerStream, got, pr.system, target)
	}
	b.logf("%s catch-up: %d events in %.2fs: %.0f events/s; CPU %.2fs, peak RSS %.1f MB",
		pr.system, n, res.Took.Seconds(), rate(n, res.Took), res.CPU.Seconds(), mb(res.HWM))
	return nil
}

// watermillPeer builds bench/watermill (its own module) and returns the
// Watermill forwarder peer.
func (b *bench) watermillPeer(ctx context.Context) (peer, error) {
	dir := filepath.Join(b.env.moduleDir, "bench", "watermill")
	bin := filepath.Join(b.env.tmp, "walbox-bench-watermill")
	gobin, err := goTool()
	if err != nil {
		return peer{}, err
	}
	b.logf("peers: building the Watermill forwarder (bench/watermill, its own module)")
	bctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	build := exec.CommandContext(bctx, gobin, "build", "-o", bin, ".")
	build.Dir = dir
	out, err := build.CombinedOutput()
	cancel()
	if err != nil {
		return peer{}, fmt.Errorf("go build bench/watermill: %w\n%s", cause(bctx, err), out)
	}
	size := strconv.Itoa(b.p.PayloadBytes)
	run := func(ctx context.Context, args ...string) ([]byte, error) {
		cmd := exec.CommandContext(ctx, bin, args...)
		var stderr tailBuffer
		cmd.Stderr = &stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		cmd.WaitDelay = 5 * time.Second
		out, err := cmd.Output()
		if err != nil {
			return nil, fmt.Errorf("%s %s: %w\n%s", filepath.Base(bin), args[0], err, stderr.String())
		}
		return out, nil
	}
	return peer{
		system: "watermill",
		live:   true,
		title:  "Watermill forwarder (watermill-sql → watermill-nats JetStream, bench/watermill)",
		start: func(phase string) (*relayProc, error) {
			return b.startProc("watermill-"+phase, bin, []string{"forward", "-pg", b.env.dbURL, "-nats", b.env.ns.URL()})
		},
		ready: func(ctx context.Context, p *relayProc) error {
			deadline := time.Now().Add(b.p.Stall)
			for !strings.Contains(p.logs.String(), "ready") {
				if p.exited() {
					return fmt.Errorf("watermill forwarder exited (%s):\n%s", p.cmd.ProcessState, p.logs)
				}
				if time.Now().After(deadline) {
					return fmt.Errorf("watermill forwarder not ready within %s:\n%s", b.p.Stall, p.logs)
				}
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(20 * time.Millisecond):
				}
			}
			return nil
		},
		load: func(ctx context.Context, subject string, n int) (time.Duration, error) {
			out, err := run(ctx, "load", "-pg", b.env.dbURL, "-subject", subject, "-n", strconv.Itoa(n),
				"-txn", strconv.Itoa(b.p.TxnRows), "-conns", strconv.Itoa(b.p.Loaders), "-payload-bytes", size)
			if err != nil {
				return 0, err
			}
			var r struct {
				Events  int     `json:"events"`
				Seconds float64 `json:"seconds"`
			}
			if err := json.Unmarshal(lastLine(out), &r); err != nil || r.Events != n {
				return 0, fmt.Errorf("watermill load printed %q (%v), want %d events", out, err, n)
			}
			return time.Duration(r.Seconds * float64(time.Second)), nil
		},
		producers: producers{produce: func(ctx context.Context, subject string, rate int, start, end time.Time) (produced, error) {
			select {
			case <-time.After(time.Until(start)):
			case <-ctx.Done():
				return produced{}, ctx.Err()
			}
			out, err := run(ctx, "produce", "-pg", b.env.dbURL, "-sync-commit", b.p.SyncCommit, "-subject", subject, "-rate", strconv.Itoa(rate),
				"-for", time.Until(end).Round(time.Millisecond).String(), "-payload-bytes", size)
			if err != nil {
				return produced{}, err
			}
			var r struct {
				Events    int     `json:"events"`
				Achieved  float64 `json:"achieved"`
				InsertP50 float64 `json:"insert_p50_ms"`
				InsertP99 float64 `json:"insert_p99_ms"`
			}
			if err := json.Unmarshal(lastLine(out), &r); err != nil {
				return produced{}, fmt.Errorf("watermill produce printed %q: %w", out, err)
			}
			msd := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
			return produced{Events: r.Events, Achieved: r.Achieved, Producers: producersFor(rate),
				InsertP50: msd(r.InsertP50), InsertP99: msd(r.InsertP99)}, nil
		}},
	}, nil
}

// lastLine is the last non-empty line of out.
func lastLine(out []byte) []byte {
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return []byte(strings.TrimSpace(lines[len(lines)-1]))
}
