package jssink_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

// batchSink is a sink on an embedded nats-server whose stream takes fast
// batches, with the connection for the test's own reads and writes.
type batchSink struct {
	*jssink.Sink
	nc     *nats.Conn
	js     jetstream.JetStream
	stream string
	paths  []jssink.PublishPath
}

func startBatchSink(tb testing.TB, ackTimeout time.Duration, window int, sp jssink.StreamSpec) *batchSink {
	tb.Helper()
	srv := natstest.New(tb)
	return batchSinkOn(tb, srv.URL(), ackTimeout, window, sp)
}

func batchSinkOn(tb testing.TB, url string, ackTimeout time.Duration, window int, sp jssink.StreamSpec) *batchSink {
	tb.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(nc.Close)
	sink, err := jssink.New(nc, ackTimeout)
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, paths, err := jssink.EnsureStreams(ctx, sink.JetStream(), []jssink.StreamSpec{sp})
	if err != nil {
		tb.Fatal(err)
	}
	sink.SetBatching(jssink.Batching{Paths: paths, Window: window})
	return &batchSink{Sink: sink, nc: nc, js: sink.JetStream(), stream: sp.Name, paths: paths}
}

func ordersSpec() jssink.StreamSpec {
	return jssink.StreamSpec{Name: "ORDERS", Subjects: []string{"orders.>"}, Storage: "file", Manage: true,
		DuplicateWindow: 2 * time.Minute, FastBatch: true}
}

// strictMsg is event i of a run, expected after sequence expect.
func strictMsg(i int, expect uint64) *relay.Msg {
	m := &relay.Msg{Subject: "orders.created", Stream: "ORDERS", Header: relay.Header{}, Data: fmt.Appendf(nil, `{"n":%d}`, i)}
	m.Header.Set(relay.HeaderMsgID, fmt.Sprintf("e%d", i))
	m.Expect, m.ExpectSet = expect, true
	return m
}

type published struct {
	i   int
	fut relay.Future
}

// publishRun publishes events from..to-1 with a window, as the relay does:
// never more than window in flight, each expecting the one before it
// stored. It returns each event's result in order.
func publishRun(tb testing.TB, s *batchSink, from, to int, expect uint64, window int) []relay.Result {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var q []published
	var out []relay.Result
	take := func() {
		select {
		case r := <-q[0].fut:
			out = append(out, r)
			q = q[1:]
		case <-ctx.Done():
			tb.Fatalf("event %d: no result", q[0].i)
		}
	}
	for i := from; i < to; i++ {
		for len(q) >= window {
			take()
		}
		f, err := s.Publish(strictMsg(i, expect))
		if err != nil {
			tb.Fatalf("publish %d: %v", i, err)
		}
		expect++
		q = append(q, published{i, f})
	}
	for len(q) > 0 {
		take()
	}
	return out
}

// storedIDs reads the stream's messages' ids in sequence order, through
// an ordered consumer: one request a message (GetMsg) for 20,000 messages
// took over 30 s on a loaded 2-core machine. Each message must come within
// 10 s of the one before: a stall fails, a slow machine does not.
func storedIDs(tb testing.TB, s *batchSink) []string {
	tb.Helper()
	ctx := tb.Context()
	st, err := s.js.Stream(ctx, s.stream)
	if err != nil {
		tb.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	var ids []string
	if info.State.Msgs == 0 {
		return ids
	}
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		tb.Fatal(err)
	}
	it, err := cons.Messages()
	if err != nil {
		tb.Fatal(err)
	}
	defer it.Stop()
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := it.Next(jetstream.NextMaxWait(10 * time.Second))
		if err != nil {
			tb.Fatalf("read seq %d (of %d to %d): %v", seq, info.State.FirstSeq, info.State.LastSeq, err)
		}
		md, err := m.Metadata()
		if err != nil {
			tb.Fatal(err)
		}
		if md.Sequence.Stream != seq {
			tb.Fatalf("read seq %d where %d was next: the stream has a gap", md.Sequence.Stream, seq)
		}
		ids = append(ids, m.Headers().Get(relay.HeaderMsgID))
	}
	return ids
}

// TestBatchCatchUpStoresEverythingOnceInOrder: a backlog published with
// the relay's window goes out in fast batches (the server's batch count
// shows it), every future resolves with the sequence its event is stored
// at, and the stream holds each event once, in order.
func TestBatchCatchUpStoresEverythingOnceInOrder(t *testing.T) {
	for _, window := range []int{1024, 64} {
		t.Run(fmt.Sprintf("window %d", window), func(t *testing.T) {
			s := startBatchSink(t, 5*time.Second, window, ordersSpec())
			if !s.paths[0].Batch {
				t.Fatalf("path %+v: want fast batches", s.paths[0])
			}
			const n = 20000
			res := publishRun(t, s, 0, n, 0, window)
			for i, r := range res {
				if r.Err != nil {
					t.Fatalf("event %d: %v", i, r.Err)
				}
				if r.Ack.Stream != "ORDERS" || r.Ack.Sequence != uint64(i+1) || r.Ack.Duplicate {
					t.Fatalf("event %d: ack %+v, want ORDERS seq %d", i, *r.Ack, i+1)
				}
			}
			ids := storedIDs(t, s)
			if len(ids) != n {
				t.Fatalf("stream holds %d messages, want %d", len(ids), n)
			}
			for i, id := range ids {
				if id != fmt.Sprintf("e%d", i) {
					t.Fatalf("seq %d holds %s, want e%d", i+1, id, i)
				}
			}
			st := s.BatchStats()
			if st.Batches == 0 || st.Batched < n/2 {
				t.Fatalf("batch stats %+v: want most of %d events batched", st, n)
			}
			t.Logf("window %d: %+v", window, st)
		})
	}
}

// TestBatchRealDuplicateInside: on a real server, an event whose id the
// stream already holds, in the middle of a batch, is dropped as a
// duplicate; the batch's acks then prove everything before it and nothing
// from it on. The duplicate is failed as unproven (the relay resends it on
// its own, and its own ack says duplicate), the next gets the order
// refusal, and the stream holds each stored event at the sequence its ack
// named.
func TestBatchRealDuplicateInside(t *testing.T) {
	s := startBatchSink(t, 5*time.Second, 1024, ordersSpec())
	s.BatchAtOnce()
	res := publishRun(t, s, 0, 100, 0, 1024)
	for i, r := range res {
		if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
			t.Fatalf("event %d: %+v", i, r)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var futs []relay.Future
	for i := 100; i < 1100; i++ {
		m := strictMsg(i, uint64(i))
		if i == 150 {
			m.Header.Set(relay.HeaderMsgID, "e50") // stored at 51 already
		}
		f, err := s.Publish(m)
		if err != nil {
			t.Fatal(err)
		}
		futs = append(futs, f)
	}
	for k, f := range futs {
		i := 100 + k
		r, err := awaitResult(ctx, f)
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		switch {
		case i < 150:
			if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
				t.Fatalf("event %d: %+v, want stored at %d", i, r, i+1)
			}
		case i == 150:
			if !errors.Is(r.Err, jssink.ErrBatchUnproven) {
				t.Fatalf("the duplicate: %+v, want unproven", r)
			}
		case i == 151:
			if !errors.Is(r.Err, relay.ErrOrderRefused) {
				t.Fatalf("after the duplicate: %+v, want the order refusal", r)
			}
		default:
			if r.Err == nil {
				t.Fatalf("event %d acked (%+v) after the batch ended", i, r.Ack)
			}
		}
	}
	if ids := storedIDs(t, s); len(ids) != 150 || ids[149] != "e149" {
		t.Fatalf("stream holds %d messages, last %q; want 150 ending with e149", len(ids), ids[len(ids)-1])
	}
	// The resend on its own says what the batch could not.
	m := strictMsg(150, 150)
	m.Header.Set(relay.HeaderMsgID, "e50")
	m.MayBeStored = true
	f, err := s.Publish(m)
	if err != nil {
		t.Fatal(err)
	}
	r, err := awaitResult(ctx, f)
	if err != nil || r.Err != nil || !r.Ack.Duplicate || r.Ack.Sequence != 51 {
		t.Fatalf("resent alone: %+v %v, want a duplicate of seq 51", r, err)
	}
}

func awaitResult(ctx context.Context, f relay.Future) (relay.Result, error) {
	select {
	case r := <-f:
		return r, nil
	case <-ctx.Done():
		return relay.Result{}, ctx.Err()
	}
}

// The publish path's cost per message with strict order (an expected last
// sequence on each), per message and in fast batches, against the same
// embedded server (cpu-µs/op counts the server too):
//
//	go test ./relay/jssink -run '^$' -bench 'Strict' -benchtime 100000x -count 3
func BenchmarkPublishStrictPerMessage(b *testing.B) { benchStrict(b, false) }
func BenchmarkPublishStrictFastBatch(b *testing.B)  { benchStrict(b, true) }

func benchStrict(b *testing.B, batch bool) {
	sp := jssink.StreamSpec{Name: "BENCH", Subjects: []string{"bench.>"}, Storage: "file", Manage: true,
		DuplicateWindow: 2 * time.Minute, FastBatch: batch}
	s := startBatchSink(b, 10*time.Second, benchWindow, sp)
	s.BatchAtOnce()
	expect := uint64(0)
	windowed(b, func(i int) func() error {
		m := benchMsg(i)
		m.Stream, m.Expect, m.ExpectSet = "BENCH", expect, true
		expect++
		f, err := s.Publish(m)
		if err != nil {
			b.Fatal(err)
		}
		return func() error { return (<-f).Err }
	})
	if st := s.BatchStats(); batch != (st.Batched > 0) {
		b.Fatalf("batch %v: stats %+v", batch, st)
	}
}
