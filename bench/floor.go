package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// floorResult is one live rate with pg_recvlogical as the only reader of a
// slot: the latency walbox cannot go below on this machine.
type floorResult struct {
	Rate      int
	Events    int
	Achieved  float64
	Producers int
	P50, P99  time.Duration // commit (the transaction's commit timestamp, from pgoutput's Begin) -> received
	StoreP50  time.Duration // insert time in the payload -> received
	StoreP99  time.Duration
	InsertP50 time.Duration
	InsertP99 time.Duration
	Busy      float64
	Where     []cpuShare
	Span      time.Duration
}

// maxResult is the highest single-row-transaction rate the producers reach
// with closed-loop connections and no reader at all (the relay stopped).
type maxResult struct {
	Conns     int
	Events    int
	Achieved  float64
	InsertP50 time.Duration
	InsertP99 time.Duration
	Busy      float64
	Where     []cpuShare
	Span      time.Duration
}

// floorSample is one event as pg_recvlogical wrote it out.
type floorSample struct {
	commit, insert, received time.Time
}

// floorReader is pg_recvlogical streaming pgoutput to a pipe this process
// reads, noting when each transaction arrives.
type floorReader struct {
	mu      sync.Mutex
	samples []floorSample
	count   atomic.Int64
	err     error
}

// pgEpoch is PostgreSQL's timestamp origin.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// read parses pg_recvlogical's output: each pgoutput message followed by a
// newline. Every Insert's time of receipt is the time the read returning its
// bytes returned.
func (f *floorReader) read(r io.Reader) {
	br := bufio.NewReaderSize(r, 1<<16)
	var commit time.Time
	fail := func(err error) {
		f.mu.Lock()
		f.err = err
		f.mu.Unlock()
		_, _ = io.Copy(io.Discard, br)
	}
	need := func(n int) ([]byte, error) { return br.Peek(n) }
	for {
		kind, err := br.ReadByte()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				fail(err)
			}
			return
		}
		now := time.Now()
		var n int // bytes of the message after its type byte
		switch kind {
		case 'B': // final LSN, commit timestamp, xid
			b, err := need(20)
			if err != nil {
				fail(err)
				return
			}
			commit = pgEpoch.Add(time.Duration(int64(binary.BigEndian.Uint64(b[8:16]))) * time.Microsecond)
			n = 20
		case 'C': // flags, commit LSN, end LSN, commit timestamp
			n = 25
		case 'R':
			n, err = relationLen(br)
		case 'I':
			// relid, 'N', tuple
			var tl int
			tl, err = tupleLen(br, 5)
			if err == nil {
				var b []byte
				b, err = need(5 + tl)
				if err == nil {
					if ts, ok := payloadTime(b); ok {
						f.mu.Lock()
						f.samples = append(f.samples, floorSample{commit: commit, insert: ts, received: now})
						f.mu.Unlock()
						f.count.Add(1)
					}
				}
			}
			n = 5 + tl
		default:
			err = fmt.Errorf("pgoutput message %q not expected in the floor's workload", kind)
		}
		if err != nil {
			fail(fmt.Errorf("parsing pg_recvlogical's output: %w", err))
			return
		}
		if _, err := br.Discard(n); err != nil {
			fail(err)
			return
		}
		if nl, err := br.ReadByte(); err != nil || nl != '\n' {
			fail(fmt.Errorf("parsing pg_recvlogical's output: no newline after a %q message", kind))
			return
		}
	}
}

// relationLen is the length of a Relation message (proto_version 1) after
// its type byte.
func relationLen(br *bufio.Reader) (int, error) {
	off := 4 // relid
	cstring := func() error {
		for {
			b, err := br.Peek(off + 1)
			if err != nil {
				return err
			}
			off++
			if b[off-1] == 0 {
				return nil
			}
		}
	}
	if err := cstring(); err != nil { // namespace
		return 0, err
	}
	if err := cstring(); err != nil { // name
		return 0, err
	}
	b, err := br.Peek(off + 3) // replica identity, column count
	if err != nil {
		return 0, err
	}
	cols := int(binary.BigEndian.Uint16(b[off+1 : off+3]))
	off += 3
	for range cols {
		off++ // flags
		if err := cstring(); err != nil {
			return 0, err
		}
		off += 8 // type oid, typmod
	}
	return off, nil
}

// tupleLen is the length of TupleData starting at offset off of the
// message (after its type byte).
func tupleLen(br *bufio.Reader, off int) (int, error) {
	b, err := br.Peek(off + 2)
	if err != nil {
		return 0, err
	}
	cols := int(binary.BigEndian.Uint16(b[off : off+2]))
	p := off + 2
	for range cols {
		b, err := br.Peek(p + 1)
		if err != nil {
			return 0, err
		}
		switch b[p] {
		case 'n', 'u':
			p++
		case 't', 'b':
			b, err := br.Peek(p + 5)
			if err != nil {
				return 0, err
			}
			p += 5 + int(binary.BigEndian.Uint32(b[p+1:p+5]))
		default:
			return 0, fmt.Errorf("tuple column kind %q", b[p])
		}
	}
	return p - off, nil
}

func (f *floorReader) error() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// since returns the samples from index i on.
func (f *floorReader) since(i int) []floorSample {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.samples[i:])
}

// floor runs every live rate with pg_recvlogical as the only reader of a
// slot of its own (walbox's slot exists, its relay is stopped), then the
// producers' maximum rate with no reader at all. walbox's slot is then
// moved past these events: its relay never sees them.
func (b *bench) floor(ctx context.Context, pool *pgxpool.Pool) error {
	// First the producers' maximum with no reader at all: the floor then
	// offers that rate too.
	if err := b.maxRate(ctx, pool); err != nil {
		return err
	}
	var out tailBuffer
	create := b.recvlogical(ctx, &out, "--slot", floorSlot, "--create-slot", "--plugin", "pgoutput")
	if err := create.Run(); err != nil {
		return fmt.Errorf("pg_recvlogical --create-slot %s: %w\n%s", floorSlot, err, out.String())
	}
	b.logf("floor: pg_recvlogical (pgoutput, proto_version=1) as the only reader, output read through a pipe")
	rctx, stopReader := context.WithCancel(ctx)
	defer stopReader()
	cmd := b.recvlogical(rctx, &out, "--slot", floorSlot, "--start", "-f", "-", "-F", "0",
		"-o", "proto_version=1", "-o", "publication_names="+publication)
	cmd.Stdout = nil
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pg_recvlogical: %w", err)
	}
	fr := &floorReader{}
	readDone := make(chan struct{})
	go func() { fr.read(pipe); close(readDone) }()
	exited := make(chan error, 1)
	go func() { <-readDone; exited <- cmd.Wait() }()
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		stopReader()
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			return errors.New("pg_recvlogical did not exit within 30s of SIGTERM")
		}
		return nil
	}
	defer func() { _ = stop() }()
	if _, err := b.waitSlot(ctx, floorSlot, true, nil); err != nil {
		return err
	}
	waitFor := func(n int64, what string) error {
		deadline := time.Now().Add(b.p.Stall)
		for fr.count.Load() < n {
			if err := fr.error(); err != nil {
				return err
			}
			select {
			case err := <-exited:
				return fmt.Errorf("pg_recvlogical exited while waiting for %s: %v\n%s", what, err, out.String())
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s not received by pg_recvlogical within %s (%d of %d)", what, b.p.Stall, fr.count.Load(), n)
			}
		}
		return nil
	}
	produce := b.sqlProducers(pool)
	// The same unmeasured warm-up as the relay's.
	d := 3 * time.Second
	if b.p.Quick {
		d = time.Second
	}
	start := time.Now().Add(20 * time.Millisecond)
	prod, err := produce(ctx, "bench.floor.warmup", b.p.Rates[0], start, start.Add(d))
	if err != nil {
		return fmt.Errorf("floor warm-up: %w", err)
	}
	if err := waitFor(int64(prod.Events), "the warm-up events"); err != nil {
		return err
	}
	rateRun := func(produce produceFunc, r int, subject string) (floorResult, error) {
		b.logf("floor %d/s: single-event transactions for %v, pg_recvlogical reading", r, b.p.LiveFor)
		base := int(fr.count.Load())
		meter := b.startPhase(0)
		start := time.Now().Add(20 * time.Millisecond)
		prod, err := produce(ctx, subject, r, start, start.Add(b.p.LiveFor))
		if err != nil {
			return floorResult{}, fmt.Errorf("floor %d/s: %w", r, err)
		}
		if err := waitFor(int64(base+prod.Events), fmt.Sprintf("the %d events at %d/s", prod.Events, r)); err != nil {
			return floorResult{}, err
		}
		res := floorResult{Rate: r, Events: prod.Events, Achieved: prod.Achieved, Producers: prod.Producers, InsertP50: prod.InsertP50, InsertP99: prod.InsertP99}
		res.Busy, res.Where, res.Span = meter.stop()
		s := fr.since(base)
		if len(s) != prod.Events {
			return res, fmt.Errorf("floor %d/s: %d events received for %d committed", r, len(s), prod.Events)
		}
		commit, insert := make([]time.Duration, len(s)), make([]time.Duration, len(s))
		for i, x := range s {
			commit[i], insert[i] = x.received.Sub(x.commit), x.received.Sub(x.insert)
		}
		slices.Sort(commit)
		slices.Sort(insert)
		res.P50, res.P99 = pct(commit, 0.5), pct(commit, 0.99)
		res.StoreP50, res.StoreP99 = pct(insert, 0.5), pct(insert, 0.99)
		b.logf("floor %d/s: %d events at %.0f/s: commit-to-received p50 %s p99 %s; insert-to-received p50 %s p99 %s",
			r, res.Events, res.Achieved, ms(res.P50), ms(res.P99), ms(res.StoreP50), ms(res.StoreP99))
		return res, nil
	}
	for _, r := range b.p.Rates {
		res, err := rateRun(produce, r, fmt.Sprintf("bench.floor.r%d", r))
		if err != nil {
			return err
		}
		b.res.floor = append(b.res.floor, res)
	}
	// The producers' maximum rate, offered paced as it is to the relay
	// later, with pg_recvlogical as the only reader: what a reader that
	// costs nothing but its walsender leaves the producers.
	mr := b.res.maxTarget()
	mp, err := b.livePool(ctx, max(b.p.MaxConns, producersFor(mr)))
	if err != nil {
		return err
	}
	defer mp.Close()
	if b.res.maxFloor, err = rateRun(b.sqlProducersN(mp, b.p.MaxConns), mr, "bench.floor.max"); err != nil {
		return err
	}
	if err := stop(); err != nil {
		return err
	}
	if err := fr.error(); err != nil {
		return err
	}
	if _, err := b.waitSlot(ctx, floorSlot, false, nil); err != nil {
		return err
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = b.env.pool.Exec(qctx, "SELECT pg_drop_replication_slot($1)", floorSlot)
	cancel()
	if err != nil {
		return fmt.Errorf("drop slot %s: %w", floorSlot, err)
	}

	// The bare relay at the same rates, on a slot of its own.
	if err := b.bareRelay(ctx, produce); err != nil {
		return err
	}

	// walbox's relay must not relay the floor's, the bare relay's and the
	// maximum rate's events: mark them processed, then move its slot past
	// them.
	qctx, cancel = context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if _, err := b.env.pool.Exec(qctx, "UPDATE outbox_events SET processed = true, processed_at = now() WHERE NOT processed AND topic LIKE 'bench.floor.%'"); err != nil {
		return fmt.Errorf("marking the floor's events processed: %w", err)
	}
	if _, err := b.env.pool.Exec(qctx, "SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())", slotName); err != nil {
		return fmt.Errorf("moving walbox's slot past the floor's events: %w", err)
	}
	return nil
}

// maxRate measures the highest single-row-transaction rate MaxConns
// closed-loop producers sustain with no reader (the relay stopped): each
// commits its next event as soon as the last one returned.
func (b *bench) maxRate(ctx context.Context, pool *pgxpool.Pool) error {
	g := b.p.MaxConns
	b.logf("maximum rate: %d producers committing single-event transactions back to back for %v, no reader", g, b.p.LiveFor)
	conns := make([]*pgxpool.Conn, 0, g)
	for range g {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return err
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	meter := b.startPhase(0)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var all []time.Duration
	var errOnce sync.Once
	var prodErr error
	start := time.Now()
	end := start.Add(b.p.LiveFor)
	for i := range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			for n := 0; time.Now().Before(end); n++ {
				t0 := time.Now()
				if _, err := pool.Exec(ctx, "INSERT INTO outbox_events (topic, payload) VALUES ($1, $2::jsonb)",
					"bench.floor.max", payloadFor(i*1_000_000+n, b.p.PayloadBytes, t0.UnixNano())); err != nil {
					errOnce.Do(func() { prodErr = err })
					return
				}
				mine = append(mine, time.Since(t0))
			}
			mu.Lock()
			all = append(all, mine...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	took := time.Since(start)
	if prodErr != nil {
		return fmt.Errorf("maximum rate: %w", prodErr)
	}
	res := &b.res.maxAlone
	res.Conns, res.Events, res.Achieved = g, len(all), rate(len(all), took)
	res.Busy, res.Where, res.Span = meter.stop()
	if len(all) == 0 {
		return errors.New("maximum rate: nothing committed")
	}
	slices.Sort(all)
	res.InsertP50, res.InsertP99 = pct(all, 0.5), pct(all, 0.99)
	b.logf("maximum rate: %.0f events/s (INSERT+COMMIT p50 %s p99 %s)", res.Achieved, ms(res.InsertP50), ms(res.InsertP99))
	return nil
}

// maxTarget is the rate offered to the relay for the maximum-rate check:
// the producers' maximum alone, rounded down to 100/s.
func (r *results) maxTarget() int {
	return max(100, int(r.maxAlone.Achieved)/100*100)
}
