package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/google/pprof/profile"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

// What walbox's headers cost the publishing side of a fast batch, apart
// from the relay (issue 36's nats-server target): the batched ceiling's
// publisher (orbit's FastPublisher, the same batches and flow) sends the
// same messages twice, once with Nats-Msg-Id only and once with every
// header the relay's router sets, from a ring of messages built before
// the clock starts. A CPU profile of this process splits its CPU between
// the publisher's goroutines (labelled) and the embedded nats-server's.

const (
	hdrCostStream  = "HDRCOST"
	hdrCostSubject = "hdrcost.events"
	hdrCostRing    = 1024
	hdrIDOnly      = "Nats-Msg-Id only"
	hdrWalbox      = "walbox's headers"
	// hdrLabel marks the publisher's goroutines in the profile: nats.go's
	// start inside pprof.Do and inherit it, the server's do not.
	hdrLabel = "walbox-bench-side"
)

type headerCostRun struct {
	Mode        string
	Events      int
	Took        time.Duration
	CPU         time.Duration // this process over the publish: nats-server and the publisher
	HeaderBytes int           // one message's encoded header block
	// CPU-profile samples: all, the publisher's, and nats-server's
	// header look-ups (server.getHeader… and the header parsing under it).
	Samples, Publisher, Lookups int64
}

// serverCPU and publisherCPU split CPU by the profile's samples.
func (h headerCostRun) serverCPU() time.Duration {
	return time.Duration(float64(h.CPU) * float64(h.Samples-h.Publisher) / float64(max(h.Samples, 1)))
}
func (h headerCostRun) publisherCPU() time.Duration { return h.CPU - h.serverCPU() }
func (h headerCostRun) lookupCPU() time.Duration {
	return time.Duration(float64(h.CPU) * float64(h.Lookups) / float64(max(h.Samples, 1)))
}

// headerCost runs each header set twice, in the order A B B A (B A A B
// the next round): the first run after the ceilings paid for what they
// left behind (2.5-4 µs a message more in a first full run, whichever
// set went first), and each run starts after a GC and a pause.
func (b *bench) headerCost(ctx context.Context, round int) error {
	modes := []string{hdrIDOnly, hdrWalbox, hdrWalbox, hdrIDOnly}
	if round%2 == 1 {
		modes = []string{hdrWalbox, hdrIDOnly, hdrIDOnly, hdrWalbox}
	}
	for _, mode := range modes {
		runtime.GC()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
		run, err := b.headerCostRun(ctx, mode)
		if err != nil {
			return fmt.Errorf("header cost, %s: %w", mode, err)
		}
		if b.res.headerCost == nil {
			b.res.headerCost = map[string][]headerCostRun{}
		}
		b.res.headerCost[mode] = append(b.res.headerCost[mode], run)
	}
	return nil
}

func (b *bench) headerCostRun(ctx context.Context, mode string) (headerCostRun, error) {
	n := b.p.Events
	run := headerCostRun{Mode: mode, Events: n}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err := b.env.js.CreateStream(qctx, jetstream.StreamConfig{Name: hdrCostStream, Subjects: []string{"hdrcost.>"},
		Storage: jetstream.FileStorage, Duplicates: dupWindow, AllowBatchPublish: true})
	cancel()
	if err != nil {
		return run, fmt.Errorf("create stream %s: %w", hdrCostStream, err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = b.env.js.DeleteStream(dctx, hdrCostStream)
	}()

	// The ring, as the relay's router builds the messages (10 events a
	// transaction, as the catch-up's backlog), and every message's id.
	router := relay.NewRouter("", "bench/walbox", []relay.Route{{Stream: hdrCostStream, Subjects: []string{"hdrcost.>"}}})
	router.SetOrigin(&cdc.Origin{SystemID: "7443000000000000000", Timeline: 1})
	commit := time.Now()
	ring := make([]*nats.Msg, hdrCostRing)
	var prefix string
	for i := range ring {
		id := uuid.NewString()
		ev := cdc.Event{ID: id, Topic: hdrCostSubject, Payload: []byte(payloadFor(i, b.p.PayloadBytes, 0)), PayloadIsJSON: true,
			Pos: cdc.Position{CommitLSN: cdc.LSN(0x1000000 + i/10*512), Index: uint32(i % 10)}, CommitTime: commit}
		m, _, err := router.Message(&ev)
		if err != nil {
			return run, fmt.Errorf("build a message: %w", err)
		}
		nm := jssink.NATSMsg(m)
		mid := nm.Header.Get(relay.HeaderMsgID)
		prefix = strings.TrimSuffix(mid, id)
		if mode == hdrIDOnly {
			nm = &nats.Msg{Subject: nm.Subject, Data: nm.Data, Header: nats.Header{relay.HeaderMsgID: {mid}}}
		}
		ring[i] = nm
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = uuid.NewString()
	}
	run.HeaderBytes = len("NATS/1.0\r\n\r\n")
	for k, vs := range ring[0].Header {
		for _, v := range vs {
			run.HeaderBytes += len(k) + len(": \r\n") + len(v)
		}
	}

	f, err := os.CreateTemp("", "walbox-bench-hdrcost-*.pprof")
	if err != nil {
		return run, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	b.logf("header cost: publishing %d messages with %s (%d header bytes each) in fast batches of %d", n, mode, run.HeaderBytes, batchCeilSize)
	if err := pprof.StartCPUProfile(f); err != nil {
		return run, fmt.Errorf("profile the header cost: %w", err)
	}
	var perr error
	cpu0 := selfCPU()
	t0 := time.Now()
	pprof.Do(ctx, pprof.Labels(hdrLabel, "publisher"), func(ctx context.Context) {
		perr = publishRing(ctx, b.env.ns.URL(), ring, ids, prefix)
	})
	run.Took, run.CPU = time.Since(t0), selfCPU()-cpu0
	pprof.StopCPUProfile()
	if perr != nil {
		return run, perr
	}
	got, err := b.streamMsgs(ctx, hdrCostStream)
	if err != nil {
		return run, err
	}
	if got != uint64(n) {
		return run, fmt.Errorf("stream %s holds %d messages, want %d", hdrCostStream, got, n)
	}
	prof, vi, err := readCPUProfile(f.Name())
	if err != nil {
		return run, err
	}
	for _, s := range prof.Sample {
		v := s.Value[vi]
		run.Samples += v
		if slices.Contains(s.Label[hdrLabel], "publisher") {
			run.Publisher += v
			continue
		}
		if stackHas(s, "nats-server/v2/server.getHeader", "nats-server/v2/server.sliceHeader") {
			run.Lookups += v
		}
	}
	b.logf("header cost, %s: %.1f µs/msg (nats-server %.1f, publisher %.1f; %d profile samples), %.0f msgs/s", mode,
		us(perEvent(run.CPU, n)), us(perEvent(run.serverCPU(), n)), us(perEvent(run.publisherCPU(), n)), run.Samples, rate(n, run.Took))
	return run, nil
}

// publishRing sends len(ids) messages from ring, in fast batches as the
// batched ceiling does (fastPublishAll), each with its own Nats-Msg-Id (and
// Walbox-Event-Id where the message has it).
func publishRing(ctx context.Context, url string, ring []*nats.Msg, ids []string, prefix string) error {
	nc, err := nats.Connect(url, nats.Name("walbox-bench-header-cost"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	return fastPublishAll(ctx, js, len(ids), batchCeilSize, func(i int) *nats.Msg {
		m := ring[i%len(ring)]
		m.Header[relay.HeaderMsgID][0] = prefix + ids[i]
		if v := m.Header[relay.HeaderEventID]; len(v) > 0 {
			v[0] = ids[i]
		}
		return m
	}, nil)
}

// stackHas says whether any frame of s is a function whose name holds
// one of fns.
func stackHas(s *profile.Sample, fns ...string) bool {
	for _, loc := range s.Location {
		for _, line := range loc.Line {
			if line.Function == nil {
				continue
			}
			for _, fn := range fns {
				if strings.Contains(line.Function.Name, fn) {
					return true
				}
			}
		}
	}
	return false
}

// headerCostLines reports the medians of the rounds.
func (r *results) headerCostLines(add func(what, value, target, verdict string)) {
	id, wb := r.headerCost[hdrIDOnly], r.headerCost[hdrWalbox]
	if len(id) == 0 || len(wb) == 0 {
		return
	}
	med := func(runs []headerCostRun, f func(headerCostRun) time.Duration) float64 {
		xs := make([]float64, len(runs))
		for i, x := range runs {
			xs[i] = us(perEvent(f(x), x.Events))
		}
		return median(xs)
	}
	srv := func(h headerCostRun) time.Duration { return h.serverCPU() }
	pub := func(h headerCostRun) time.Duration { return h.publisherCPU() }
	look := func(h headerCostRun) time.Duration { return h.lookupCPU() }
	rt := func(runs []headerCostRun) float64 {
		xs := make([]float64, len(runs))
		for i, x := range runs {
			xs[i] = rate(x.Events, x.Took)
		}
		return median(xs)
	}
	add(fmt.Sprintf("what walbox's headers cost a fast batch, apart from the relay: the batched ceiling's publisher sending a ring of %d messages the relay's router built, %s (%d header bytes) / %s (%d header bytes); CPU split by a profile of the process, medians of %d runs each (A B B A, then B A A B)",
		hdrCostRing, hdrIDOnly, id[0].HeaderBytes, hdrWalbox, wb[0].HeaderBytes, len(id)),
		fmt.Sprintf("nats-server %.1f / %.1f µs/msg (of which its header look-ups %.1f / %.1f); publisher %.1f / %.1f µs/msg; %.0f / %.0f msgs/s",
			med(id, srv), med(wb, srv), med(id, look), med(wb, look), med(id, pub), med(wb, pub), rt(id), rt(wb)), "", "")
}
