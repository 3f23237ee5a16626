package jssink_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

func TestClassify(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want relay.ErrorClass
	}{
		{"max payload", nats.ErrMaxPayload, relay.Permanent},
		{"bad subject", fmt.Errorf("publish: %w", nats.ErrBadSubject), relay.Permanent},
		{"no responders", nats.ErrNoResponders, relay.Transient},
		{"timeout", nats.ErrTimeout, relay.Transient},
		{"stream not found", &jetstream.APIError{Code: 404, ErrorCode: jetstream.JSErrCodeStreamNotFound}, relay.Transient},
		{"wrong last sequence", &jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequence}, relay.Transient},
		{"message too large", &jetstream.APIError{Code: 400, ErrorCode: 10054}, relay.Permanent},
		{"server error", &jetstream.APIError{Code: 503}, relay.Transient},
		{"an unknown 4xx waits: dead-lettering a healthy event is not safe", &jetstream.APIError{Code: 400, ErrorCode: 10999}, relay.Transient},
	}
	for _, tt := range tests {
		if got := jssink.Classify(tt.err); got != tt.want {
			t.Errorf("%s: Classify(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}

// TestPublishResolvesInOrderAndRefusesAWrongExpectation publishes through
// the sink to a real JetStream: the futures resolve with the stream and
// sequence, a duplicate id is reported as one, and a publish whose expected
// last sequence is wrong fails with relay.ErrOrderRefused.
func TestPublishResolvesInOrderAndRefusesAWrongExpectation(t *testing.T) {
	sink := startSink(t, 5*time.Second, "ORDERS", "orders.>")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var futs []relay.Future
	for i := range 100 {
		m := &relay.Msg{Subject: "orders.created", Header: relay.Header{}, Data: []byte(`{}`)}
		m.Header.Set(relay.HeaderMsgID, fmt.Sprintf("e%d", i%90)) // the last 10 repeat ids
		m.Expect, m.ExpectSet = uint64(i), i < 90
		f, err := sink.Publish(m)
		if err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
		futs = append(futs, f)
	}
	for i, f := range futs {
		select {
		case r := <-f:
			a := r.Ack
			switch {
			case r.Err != nil:
				t.Fatalf("publish %d failed: %v", i, r.Err)
			case a.Stream != "ORDERS":
				t.Fatalf("ack %d: stream %q", i, a.Stream)
			case i < 90 && (a.Sequence != uint64(i+1) || a.Duplicate):
				t.Fatalf("ack %d: sequence %d duplicate %v, want %d and new", i, a.Sequence, a.Duplicate, i+1)
			case i >= 90 && !a.Duplicate:
				t.Fatalf("ack %d: a repeated id was stored again (sequence %d)", i, a.Sequence)
			}
		case <-ctx.Done():
			t.Fatalf("publish %d: no ack", i)
		}
	}

	m := &relay.Msg{Subject: "orders.created", Header: relay.Header{relay.HeaderMsgID: {"late"}}, Data: []byte(`{}`), Expect: 3, ExpectSet: true}
	f, err := sink.Publish(m)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-f:
		err := r.Err
		if err == nil {
			t.Fatalf("stored at %d despite expecting last sequence 3", r.Ack.Sequence)
		}
		if !errors.Is(err, relay.ErrOrderRefused) {
			t.Fatalf("err = %v, want relay.ErrOrderRefused", err)
		}
		if jssink.Classify(err) != relay.Transient {
			t.Fatalf("a refused expectation must be transient (resent in order)")
		}
	case <-ctx.Done():
		t.Fatal("no answer")
	}

	tail, err := sink.StoredTail(ctx, "ORDERS", "none", 10)
	if err != nil {
		t.Fatal(err)
	}
	if !tail.StateRead || tail.LastSeq != 90 || tail.Found {
		t.Fatalf("tail = %+v, want last sequence 90 and nothing of source none", tail)
	}
}

// TestPublishTimesOutLostAcksAndDropsLateOnes: a subject some plain
// subscriber takes (not a stream) answers nothing, so the future fails with
// the ack timeout; an answer that comes after the timeout is dropped; a
// subject nobody takes fails at once as "no response from stream"; and the
// sink goes on publishing to its stream after all of them.
func TestPublishTimesOutLostAcksAndDropsLateOnes(t *testing.T) {
	const ackTimeout = 300 * time.Millisecond
	sink := startSink(t, ackTimeout, "ORDERS", "orders.>")
	nc := sink.Conn()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// "silent" never answers; "late" answers with a valid ack after the timeout.
	lateSent := make(chan struct{})
	silent, err := nc.Subscribe("silent", func(*nats.Msg) {})
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Unsubscribe()
	late, err := nc.Subscribe("late", func(m *nats.Msg) {
		time.AfterFunc(2*ackTimeout, func() {
			_ = m.Respond([]byte(`{"stream":"ORDERS","seq":99}`))
			close(lateSent)
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer late.Unsubscribe()
	if err := nc.FlushWithContext(ctx); err != nil {
		t.Fatal(err)
	}

	publish := func(subject, id string) relay.Future {
		t.Helper()
		f, err := sink.Publish(&relay.Msg{Subject: subject, Header: relay.Header{relay.HeaderMsgID: {id}}, Data: []byte(`{}`)})
		if err != nil {
			t.Fatalf("publish %s: %v", subject, err)
		}
		return f
	}
	wantErr := func(f relay.Future, want error, within time.Duration) {
		t.Helper()
		select {
		case r := <-f:
			err := r.Err
			if err == nil {
				t.Fatalf("acked %+v, want %v", r.Ack, want)
			}
			if !errors.Is(err, want) {
				t.Fatalf("err = %v, want %v", err, want)
			}
			if jssink.Classify(err) != relay.Transient {
				t.Fatalf("%v must be transient", err)
			}
		case <-time.After(within):
			t.Fatalf("no answer within %s, want %v", within, want)
		}
	}
	wantAck := func(f relay.Future, seq uint64) {
		t.Helper()
		select {
		case r := <-f:
			if r.Err != nil {
				t.Fatalf("publish failed: %v", r.Err)
			}
			if a := r.Ack; a.Stream != "ORDERS" || a.Sequence != seq {
				t.Fatalf("ack %+v, want ORDERS %d", a, seq)
			}
		case <-ctx.Done():
			t.Fatal("no ack")
		}
	}

	start := time.Now()
	fSilent := publish("silent", "a")
	fLate := publish("late", "b")
	fStored := publish("orders.created", "c")
	fNobody := publish("nobody.listens", "d")
	wantAck(fStored, 1)
	wantErr(fNobody, jetstream.ErrNoStreamResponse, ackTimeout/2)
	wantErr(fSilent, jetstream.ErrAsyncPublishTimeout, 10*ackTimeout)
	wantErr(fLate, jetstream.ErrAsyncPublishTimeout, 10*ackTimeout)
	if d := time.Since(start); d < ackTimeout {
		t.Fatalf("timed out after %s, before the ack timeout %s", d, ackTimeout)
	}
	select {
	case <-lateSent:
	case <-ctx.Done():
		t.Fatal("the late answer was never sent")
	}
	// The late answer's token is gone: it resolves nothing, and nothing else.
	fAfter := publish("orders.created", "e")
	wantAck(fAfter, 2)
	select {
	case r := <-fLate:
		t.Fatalf("a future resolved twice: %+v", r)
	default:
	}
	// The timer re-arms for a new lost ack after the queue ran empty.
	wantErr(publish("silent", "f"), jetstream.ErrAsyncPublishTimeout, 10*ackTimeout)
}

// startSink starts a JetStream server and a Sink on it with one memory
// stream of name capturing subjects.
func startSink(tb testing.TB, ackTimeout time.Duration, name, subjects string) *jssink.Sink {
	tb.Helper()
	srv := natstest.New(tb)
	nc, err := nats.Connect(srv.URL())
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
	if _, _, err := jssink.EnsureStreams(ctx, sink.JetStream(), []jssink.StreamSpec{{Name: name, Subjects: []string{subjects}, Storage: "memory", Manage: true}}); err != nil {
		tb.Fatal(err)
	}
	return sink
}

// The publish path's cost per message: through the Sink, through nats.go's
// PublishMsgAsync (what the Sink was built on before), and with no reply asked for
// (the floor: the same messages encoded, sent and stored, no acks). Each
// publishes the relay's headers with a window of 1024 to one embedded
// server, which runs in this process: cpu-µs/op counts the server too, so
// only differences between the three are the client's.
//
//	go test ./relay/jssink -run '^$' -bench Publish -benchtime 50000x -count 6

const benchWindow = 1024

func benchMsg(i int) *relay.Msg {
	return &relay.Msg{
		Subject: "bench.orders",
		Header: relay.Header{
			relay.HeaderMsgID:         {"evt-" + strconv.Itoa(i)},
			relay.HeaderCommitLSN:     {"0/16B3748"},
			relay.HeaderIndex:         {strconv.Itoa(i % 10)},
			relay.HeaderSource:        {"bench"},
			relay.HeaderSystemID:      {"7301234567890123456"},
			relay.HeaderTimeline:      {"1"},
			relay.HeaderCommitTime:    {"2026-12-03T11:00:00.000000Z"},
			relay.HeaderEventType:     {"order.created"},
			relay.HeaderAggregateType: {"order"},
			relay.HeaderAggregateID:   {"order-" + strconv.Itoa(i%1000)},
		},
		Data:   []byte(`{"order_id":"8a1f6c2e-3b7d-4e59-9c1a-2f0d7b6e5a43","customer":"c-1042","total_cents":129900,"currency":"EUR","items":[{"sku":"sku-17","qty":2},{"sku":"sku-42","qty":1}]}`),
		Expect: uint64(i), ExpectSet: true,
	}
}

// windowed publishes b.N messages with at most benchWindow waiting for
// their acks, and reports the process's CPU per message.
func windowed(b *testing.B, publish func(i int) (wait func() error)) {
	windowedN(b, benchWindow, publish)
}

// windowedN is windowed with a window of n messages.
func windowedN(b *testing.B, n int, publish func(i int) (wait func() error)) {
	ring := make([]func() error, n)
	waitSlot := func(slot int) {
		if ring[slot] != nil {
			if err := ring[slot](); err != nil {
				b.Fatal(err)
			}
			ring[slot] = nil
		}
	}
	b.ReportAllocs()
	cpu0 := cpuNow()
	b.ResetTimer()
	for i := range b.N {
		waitSlot(i % n)
		ring[i%n] = publish(i)
	}
	for slot := range ring {
		waitSlot(slot)
	}
	b.StopTimer()
	b.ReportMetric(float64((cpuNow()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
}

func cpuNow() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func BenchmarkPublishSink(b *testing.B) {
	sink := startSink(b, 10*time.Second, "BENCH", "bench.>")
	windowed(b, func(i int) func() error {
		f, err := sink.Publish(benchMsg(i))
		if err != nil {
			b.Fatal(err)
		}
		return func() error { return (<-f).Err }
	})
}

func BenchmarkPublishJetStreamAsync(b *testing.B) {
	// As the Sink used it before: an ack timeout (a timer per message) and
	// room for the window; without the Sink's old forwarder goroutine.
	js, err := jetstream.New(startSink(b, 10*time.Second, "BENCH", "bench.>").Conn(),
		jetstream.WithPublishAsyncTimeout(10*time.Second), jetstream.WithPublishAsyncMaxPending(4*benchWindow))
	if err != nil {
		b.Fatal(err)
	}
	windowed(b, func(i int) func() error {
		f, err := js.PublishMsgAsync(jssink.NATSMsg(benchMsg(i)), jetstream.WithRetryAttempts(0))
		if err != nil {
			b.Fatal(err)
		}
		return waitEither(f.Ok(), f.Err())
	})
}

func BenchmarkPublishNoReply(b *testing.B) {
	nc := startSink(b, 10*time.Second, "BENCH", "bench.>").Conn()
	windowed(b, func(i int) func() error {
		if err := nc.PublishMsg(jssink.NATSMsg(benchMsg(i))); err != nil {
			b.Fatal(err)
		}
		if i%benchWindow != benchWindow-1 {
			return nil
		}
		return nc.Flush
	})
}

// waitEither waits for an ack or an error of one future.
func waitEither[A any](ok <-chan A, errc <-chan error) func() error {
	return func() error {
		select {
		case <-ok:
			return nil
		case err := <-errc:
			return err
		}
	}
}

// TestServerAcksAreReadWithoutEncodingJSON: the acks a real server sends,
// for a new message and for a duplicate, are in the shapes scanAck reads
// (a server that changed them would send every reply through encoding/json
// again: slower, still right).
func TestServerAcksAreReadWithoutEncodingJSON(t *testing.T) {
	nc := startSink(t, 5*time.Second, "ACKS", "acks.>").Conn()
	for i, want := range []bool{false, true} {
		msg := nats.NewMsg("acks.x")
		msg.Header.Set(relay.HeaderMsgID, "same")
		reply, err := nc.RequestMsg(msg, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		stream, seq, dup, ok := jssink.ScanAck(reply.Data)
		if !ok || string(stream) != "ACKS" || seq != 1 || dup != want {
			t.Fatalf("publish %d: ack %s read as %q %d %v %v", i, reply.Data, stream, seq, dup, ok)
		}
	}
}

// StoredIdentity names the message a duplicate ack points at: its source
// and identity (table and bare event id), from the stored headers; asked
// again (a run of duplicates), and for a sequence the stream does not hold.
func TestStoredIdentityReadsTheMessageAnAckPointsAt(t *testing.T) {
	sink := startSink(t, 5*time.Second, "ORDERS", "orders.>")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := &relay.Msg{Subject: "orders.created", Data: []byte(`{}`), Header: relay.Header{
		relay.HeaderMsgID: {"public.b:7"}, relay.HeaderEventID: {"7"}, relay.HeaderTable: {"public.b"}, relay.HeaderSource: {"app/walbox"}}}
	f, err := sink.Publish(m)
	if err != nil {
		t.Fatal(err)
	}
	ack, err := relay.Await(ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		src, ident, err := sink.StoredIdentity(ctx, "ORDERS", ack.Sequence)
		if err != nil || src != "app/walbox" || ident != relay.IdentityKey("public.b", "7") {
			t.Fatalf("StoredIdentity: %q %q %v", src, ident, err)
		}
	}
	if _, _, err := sink.StoredIdentity(ctx, "ORDERS", ack.Sequence+100); err == nil {
		t.Fatal("a sequence the stream does not hold: no error")
	}
	if _, _, err := sink.StoredIdentity(ctx, "ORDERS", ack.Sequence); err != nil {
		t.Fatalf("after a failed get: %v", err)
	}
}
