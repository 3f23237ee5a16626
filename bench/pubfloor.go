package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

// publisherArg, as the first argument, makes this binary a publisher in a
// process of its own, so that its CPU is told apart from nats-server's
// (which runs inside the benchmark): what publishing alone costs a relay.
const publisherArg = "__publisher"

// The publishers the floor runs: walbox's own path (the relay's router and
// JetStream sink, as the relay publishes an event), nats.go's
// jetstream.PublishMsgAsync with the same messages, and the same messages
// written with nats.go and no reply asked for (stored, never acked: what
// writing them costs at all). Last walbox's path again with one header,
// Nats-Msg-Id, in place of the relay's eleven: what the headers walbox
// adds for resume and for consumers (position, origin, event) cost.
const (
	pubWalbox = "walbox"
	pubNATS   = "nats.go"
	pubNoAck  = "nats.go without acks"
	pubIDOnly = "walbox, Nats-Msg-Id only"
)

const (
	pubFloorStream  = "PUBFLOOR"
	pubFloorSubject = "pubfloor.events"
)

// pubFloorResult is one publisher's run: its own CPU (user+sys, from
// getrusage in its process) over the publishing loop alone.
type pubFloorResult struct {
	Mode      string
	Msgs      int
	Stored    uint64 // what the stream held afterwards
	CPU, Took time.Duration
	Runs      int // this is the median of Runs runs (by CPU)
}

// publishFloor runs each publisher in a child process against the
// benchmark's nats-server: N messages with the headers the relay puts on
// a catch-up event (the bench's rows have a topic and a payload), window
// as the relay's. The publishers take turns, once per catch-up round, and
// each one's run with the median CPU is kept: one run of each, one after
// the other, differed by more than the headers cost.
func (b *bench) publishFloor(ctx context.Context) ([]pubFloorResult, error) {
	modes := []string{pubWalbox, pubNATS, pubNoAck, pubIDOnly}
	runs := make([][]pubFloorResult, len(modes))
	for round := range max(b.p.Rounds, 1) {
		for i, mode := range modes {
			res, err := b.publishAlone(ctx, mode, round)
			if err != nil {
				return nil, err
			}
			runs[i] = append(runs[i], res)
		}
	}
	out := make([]pubFloorResult, len(modes))
	for i, rs := range runs {
		slices.SortFunc(rs, func(a, b pubFloorResult) int { return cmp.Compare(a.CPU, b.CPU) })
		out[i] = rs[len(rs)/2]
		out[i].Runs = len(rs)
	}
	return out, nil
}

// publishAlone runs one publisher once, on a fresh stream.
func (b *bench) publishAlone(ctx context.Context, mode string, round int) (pubFloorResult, error) {
	self, err := os.Executable()
	if err != nil {
		return pubFloorResult{}, err
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = b.env.js.CreateStream(qctx, jetstream.StreamConfig{Name: pubFloorStream, Subjects: []string{"pubfloor.>"},
		Storage: jetstream.FileStorage, Duplicates: dupWindow})
	cancel()
	if err != nil {
		return pubFloorResult{}, fmt.Errorf("create stream %s: %w", pubFloorStream, err)
	}
	b.logf("publishing alone (%s, run %d): %d messages from a process of its own", mode, round+1, b.p.Events)
	p, err := b.startProc("publisher-"+mode, self, []string{publisherArg, b.env.ns.URL(), mode,
		strconv.Itoa(b.p.Events), strconv.Itoa(b.p.PayloadBytes), strconv.Itoa(b.p.Window)},
		"GOMAXPROCS=1", "GODEBUG="+walboxGODEBUG) // as the relay runs
	if err != nil {
		return pubFloorResult{}, err
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		p.kill()
		return pubFloorResult{}, ctx.Err()
	}
	res := pubFloorResult{Mode: mode, Msgs: b.p.Events}
	if !p.cmd.ProcessState.Success() {
		return res, fmt.Errorf("publisher %s exited with %s:\n%s", mode, p.cmd.ProcessState, p.logs)
	}
	if _, err := fmt.Sscanf(strings.TrimSpace(p.logs.String()), "cpu_ns=%d took_ns=%d", &res.CPU, &res.Took); err != nil {
		return res, fmt.Errorf("publisher %s: read its report %q: %w", mode, p.logs, err)
	}
	// Messages sent without a reply are stored after the publisher's
	// flush returned: wait for them (they could also be dropped).
	var got uint64
	for deadline := time.Now().Add(30 * time.Second); ; {
		if got, err = b.streamMsgs(ctx, pubFloorStream); err != nil || got >= uint64(res.Msgs) || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_ = b.env.js.DeleteStream(dctx, pubFloorStream)
	cancel()
	if err != nil {
		return res, err
	}
	res.Stored = got
	if got != uint64(res.Msgs) && mode != pubNoAck {
		return res, fmt.Errorf("publisher %s: stream %s holds %d messages, want %d", mode, pubFloorStream, got, res.Msgs)
	}
	b.logf("publishing alone (%s, run %d): %.2f µs of its own CPU per message, %.0f msgs/s", mode, round+1, us(perEvent(res.CPU, res.Msgs)), rate(res.Msgs, res.Took))
	return res, nil
}

// runPublisher is the child: it builds the messages first, then times the
// publishing loop and prints "cpu_ns=N took_ns=N".
func runPublisher(url, mode, nArg, sizeArg, windowArg string) int {
	if err := publisher(url, mode, nArg, sizeArg, windowArg); err != nil {
		fmt.Fprintln(os.Stderr, "publisher:", err)
		return 1
	}
	return 0
}

func publisher(url, mode, nArg, sizeArg, windowArg string) error {
	n, err1 := strconv.Atoi(nArg)
	size, err2 := strconv.Atoi(sizeArg)
	window, err3 := strconv.Atoi(windowArg)
	if err := errors.Join(err1, err2, err3); err != nil || window <= 0 {
		return fmt.Errorf("arguments %q %q %q: %v", nArg, sizeArg, windowArg, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	nc, err := nats.Connect(url, nats.Name("walbox-bench-publisher-"+mode))
	if err != nil {
		return err
	}
	defer nc.Close()
	router := relay.NewRouter("", "bench/walbox", []relay.Route{{Stream: pubFloorStream, Subjects: []string{"pubfloor.>"}}})
	router.SetOrigin(&cdc.Origin{SystemID: "7443000000000000000", Timeline: 1})
	router.SetMaxPayload(int(nc.MaxPayload()))
	commit := time.Now()
	events := make([]cdc.Event, n)
	for i := range events {
		events[i] = cdc.Event{ID: uuid.NewString(), Topic: pubFloorSubject, Payload: []byte(payloadFor(i, size, 0)), PayloadIsJSON: true,
			Pos: cdc.Position{CommitLSN: cdc.LSN(0x1000000 + i/10*512), Index: uint32(i % 10)}, CommitTime: commit}
	}

	// Each publisher's ring of futures: wait for the oldest when full.
	type waiter func() error
	ring := make([]waiter, window)
	head, inflight := 0, 0
	waitOldest := func() error {
		if err := ring[head](); err != nil {
			return err
		}
		ring[head], head, inflight = nil, (head+1)%window, inflight-1
		return nil
	}
	// send publishes m and returns what waits for its ack (nil: none).
	var send func(m *relay.Msg) (waiter, error)
	switch mode {
	case pubWalbox, pubIDOnly:
		sink, err := jssink.New(nc, 30*time.Second)
		if err != nil {
			return err
		}
		send = func(m *relay.Msg) (waiter, error) {
			f, err := sink.Publish(m)
			if err != nil {
				return nil, err
			}
			return func() error {
				if _, err := relay.Await(ctx, f); err != nil {
					return fmt.Errorf("publish: %w", err)
				}
				return nil
			}, nil
		}
	case pubNATS:
		js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4*window), jetstream.WithPublishAsyncTimeout(30*time.Second))
		if err != nil {
			return err
		}
		send = func(m *relay.Msg) (waiter, error) {
			f, err := js.PublishMsgAsync(jssink.NATSMsg(m), jetstream.WithRetryAttempts(0))
			if err != nil {
				return nil, err
			}
			return func() error { return waitFuture(ctx, f.Ok(), f.Err()) }, nil
		}
	case pubNoAck:
		send = func(m *relay.Msg) (waiter, error) { return nil, nc.PublishMsg(jssink.NATSMsg(m)) }
	default:
		return fmt.Errorf("unknown publisher %q", mode)
	}
	// publish builds ev's message as the relay does and hands it back to
	// the router once it is acked (or sent, without acks).
	publish := func(ev *cdc.Event) (waiter, error) {
		m, _, err := router.Message(ev)
		if err != nil {
			return nil, err
		}
		if mode == pubIDOnly {
			// The router's message is built (the relay pays for that too),
			// then only its id is sent. A new map per message, where the
			// router recycles its own: this mode pays a little more than
			// the one header alone costs.
			id := &relay.Msg{Subject: m.Subject, Header: relay.Header{relay.HeaderMsgID: {m.Header.Get(relay.HeaderMsgID)}}, Data: m.Data}
			router.Recycle(m)
			m = id
		}
		w, err := send(m)
		if err != nil {
			return nil, err
		}
		if w == nil {
			router.Recycle(m)
			return func() error { return nil }, nil
		}
		return func() error {
			if err := w(); err != nil {
				return err
			}
			router.Recycle(m)
			return nil
		}, nil
	}

	cpu0, t0 := selfCPU(), time.Now()
	for i := range events {
		if inflight == window {
			if err := waitOldest(); err != nil {
				return err
			}
		}
		w, err := publish(&events[i])
		if err != nil {
			return fmt.Errorf("publish %d: %w", i, err)
		}
		ring[(head+inflight)%window] = w
		inflight++
	}
	for inflight > 0 {
		if err := waitOldest(); err != nil {
			return err
		}
	}
	if err := nc.FlushWithContext(ctx); err != nil {
		return fmt.Errorf("flush: %w", err)
	}
	took, cpu := time.Since(t0), selfCPU()-cpu0
	fmt.Printf("cpu_ns=%d took_ns=%d\n", cpu.Nanoseconds(), took.Nanoseconds())
	return nil
}

// waitFuture waits for one publish's ack or error.
func waitFuture[A any](ctx context.Context, ok <-chan A, errc <-chan error) error {
	select {
	case <-ok:
		return nil
	case err := <-errc:
		return fmt.Errorf("publish: %w", err)
	case <-ctx.Done():
		return fmt.Errorf("publish: no ack: %w", ctx.Err())
	}
}
