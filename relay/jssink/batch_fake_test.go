package jssink_test

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

// A fake stream: a plain subscriber on a real nats-server takes the sink's
// batched messages and answers them as the test scripts, so that each
// reply the server may send (and lose) can be given in any order. The real
// server's answers are tested in batch_test.go; these test what the sink
// concludes from each.

type fakeMsg struct {
	subject, reply string
	seq            uint64
	op             int
	id             string // the event's Nats-Msg-Id
}

type fakeStream struct {
	t    *testing.T
	sink *jssink.Sink
	nc   *nats.Conn // the fake's own connection
	in   chan fakeMsg
	said chan jssink.PublishPath
}

func newFakeStream(t *testing.T, window int) *fakeStream {
	t.Helper()
	srv := natstest.New(t)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	sink, err := jssink.New(nc, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	fs := &fakeStream{t: t, sink: sink, in: make(chan fakeMsg, 4096), said: make(chan jssink.PublishPath, 4)}
	sink.SetBatching(jssink.Batching{Paths: []jssink.PublishPath{{Stream: "FAKE", Batch: true}}, Window: window,
		OnFallBack: func(p jssink.PublishPath) { fs.said <- p }})
	sink.BatchAtOnce()
	fs.nc, err = nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.nc.Close)
	if _, err := fs.nc.Subscribe("fake.>", func(m *nats.Msg) {
		fm := fakeMsg{subject: m.Subject, reply: m.Reply, id: m.Header.Get(relay.HeaderMsgID)}
		if t := strings.Split(m.Reply, "."); len(t) >= 3 && t[len(t)-1] == "$FI" {
			fm.seq, _ = strconv.ParseUint(t[len(t)-3], 10, 64)
			fm.op, _ = strconv.Atoi(t[len(t)-2])
		}
		fs.in <- fm
	}); err != nil {
		t.Fatal(err)
	}
	if err := fs.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return fs
}

// publish sends n strict messages, expectations 100, 101, ...
func (fs *fakeStream) publish(n int) []relay.Future {
	fs.t.Helper()
	var futs []relay.Future
	for i := range n {
		m := &relay.Msg{Subject: "fake.x", Stream: "FAKE", Header: relay.Header{}, Data: []byte("{}")}
		m.Header.Set(relay.HeaderMsgID, fmt.Sprintf("e%d", i))
		m.Expect, m.ExpectSet = uint64(100+i), true
		f, err := fs.sink.Publish(m)
		if err != nil {
			fs.t.Fatalf("publish %d: %v", i, err)
		}
		futs = append(futs, f)
	}
	return futs
}

// take waits for the next message the sink sent.
func (fs *fakeStream) take() fakeMsg {
	fs.t.Helper()
	select {
	case m := <-fs.in:
		return m
	case <-time.After(10 * time.Second):
		fs.t.Fatal("the sink sent nothing")
	}
	return fakeMsg{}
}

// takeN takes n messages and returns them by batch sequence.
func (fs *fakeStream) takeN(n int) map[uint64]fakeMsg {
	out := map[uint64]fakeMsg{}
	for range n {
		m := fs.take()
		out[m.seq] = m
	}
	return out
}

func (fs *fakeStream) answer(reply, body string) {
	fs.t.Helper()
	if err := fs.nc.Publish(reply, []byte(body)); err != nil {
		fs.t.Fatal(err)
	}
}

// results waits for every future.
func results(t *testing.T, futs []relay.Future) []relay.Result {
	t.Helper()
	out := make([]relay.Result, len(futs))
	for i, f := range futs {
		select {
		case out[i] = <-f:
		case <-time.After(10 * time.Second):
			t.Fatalf("future %d did not resolve", i)
		}
	}
	return out
}

// wantStored checks results[i] for i < n: acked at sequence 101+i.
func wantStored(t *testing.T, res []relay.Result, n int) {
	t.Helper()
	for i := range n {
		r := res[i]
		if r.Err != nil || r.Ack == nil || r.Ack.Sequence != uint64(101+i) || r.Ack.Stream != "FAKE" {
			t.Fatalf("message %d: %+v, want stored at %d", i+1, r, 101+i)
		}
	}
}

func wantErr(t *testing.T, r relay.Result, i int, want error) {
	t.Helper()
	if r.Ack != nil || !errors.Is(r.Err, want) {
		t.Fatalf("message %d: ack %+v err %v, want error %v", i, r.Ack, r.Err, want)
	}
}

// The batch protocol on the wire: the first message starts the batch, the
// rest append, an idle batch is committed with an end-of-batch marker one
// past its last message, and every reply subject names the flow asked for
// and gap mode "fail".
func TestBatchWireFormat(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(5)
	msgs := fs.takeN(5)
	// The server's first flow ack; the batch is idle: committed.
	fs.answer(msgs[1].reply, `{"type":"ack","seq":0,"msgs":32}`)
	msgs[6] = fs.take()
	for seq := uint64(1); seq <= 6; seq++ {
		m, ok := msgs[seq]
		if !ok {
			t.Fatalf("no message with batch sequence %d: %+v", seq, msgs)
		}
		wantOp := map[uint64]int{1: 0, 6: 3}[seq]
		if seq > 1 && seq < 6 {
			wantOp = 1
		}
		if m.op != wantOp || !strings.Contains(m.reply, ".32.fail.") {
			t.Fatalf("message %d: reply %s, want op %d with flow 32 and gap fail", seq, m.reply, wantOp)
		}
	}
	if msgs[6].subject != "fake.x" {
		t.Fatalf("commit sent to %s", msgs[6].subject)
	}
	fs.answer(msgs[6].reply, `{"stream":"FAKE","seq":105,"batch":"x","count":5}`)
	wantStored(t, results(t, futs), 5)
}

// A flow ack for N proves 1..N-1 only; N waits for the next ack or the
// final pub ack. A final pub ack whose stream sequence is not the last
// message's own (expect+1) says the last was dropped as a duplicate: it is
// failed as unproven, never acked (the proof's failure case).
func TestBatchFinalDuplicateNotProven(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(10)
	msgs := fs.takeN(10)
	fs.answer(msgs[1].reply, `{"type":"ack","seq":0,"msgs":4}`)
	fs.answer(msgs[4].reply, `{"type":"ack","seq":4,"msgs":4}`)
	fs.answer(msgs[8].reply, `{"type":"ack","seq":8,"msgs":4}`)
	// Two after the last ack, fewer than its interval: the idle batch is
	// committed.
	c := fs.take()
	if c.op != 3 || c.seq != 11 {
		t.Fatalf("after the acks the sink sent %+v, want the commit at 11", c)
	}
	msgs[11] = c
	// The first seven resolve on the acks alone.
	first := results(t, futs[:7])
	wantStored(t, first, 7)
	select {
	case r := <-futs[7]:
		t.Fatalf("message 8 resolved on its own flow ack (%+v): it may be a duplicate", r)
	case <-time.After(50 * time.Millisecond):
	}
	// Message 10 was a duplicate: the stream's last is message 9's.
	fs.answer(msgs[11].reply, `{"stream":"FAKE","seq":109,"batch":"x","count":10}`)
	res := append(first, results(t, futs[7:])...)
	wantStored(t, res, 9)
	wantErr(t, res[9], 10, jssink.ErrBatchUnproven)
}

// A duplicate inside a batch ends it: the next message's expectation fails
// (BatchFlowErr), and the pub ack counts the duplicate. The duplicate is
// not proven, the refused message gets the order refusal, the rest fail as
// unproven.
func TestBatchDuplicateInsideIsNotProven(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(10)
	msgs := fs.takeN(10)
	fs.answer(msgs[1].reply, `{"type":"ack","seq":0,"msgs":4}`)
	fs.answer(msgs[4].reply, `{"type":"ack","seq":4,"msgs":4}`)
	// Message 6 is a duplicate (skipped), 7 expects 106 stored: refused.
	fs.answer(msgs[7].reply, `{"type":"err","seq":7,"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 105"}}`)
	fs.answer(msgs[7].reply, `{"stream":"FAKE","seq":105,"batch":"x","count":6}`)
	res := results(t, futs)
	wantStored(t, res, 5)
	wantErr(t, res[5], 6, jssink.ErrBatchUnproven)
	wantErr(t, res[6], 7, relay.ErrOrderRefused)
	for i := 7; i < 10; i++ {
		wantErr(t, res[i], i+1, jssink.ErrBatchUnproven)
	}
}

// An error pub ack on one message (a check failed when it was stored, or
// the server lost the batch) ends the sink's trust in the batch: a flow
// ack that follows it and covers it proves nothing.
func TestBatchErrorEndsTrust(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(10)
	msgs := fs.takeN(10)
	fs.answer(msgs[1].reply, `{"type":"ack","seq":0,"msgs":4}`)
	fs.answer(msgs[4].reply, `{"type":"ack","seq":4,"msgs":4}`)
	fs.answer(msgs[6].reply, `{"error":{"code":503,"err_code":10077,"description":"resource limits exceeded for server"},"stream":"FAKE","seq":0}`)
	fs.answer(msgs[8].reply, `{"type":"ack","seq":8,"msgs":4}`)
	res := results(t, futs)
	wantStored(t, res, 3)
	wantErr(t, res[3], 4, jssink.ErrBatchUnproven)
	wantErr(t, res[4], 5, jssink.ErrBatchUnproven)
	if res[5].Err == nil || res[5].Ack != nil || !strings.Contains(res[5].Err.Error(), "resource limits") {
		t.Fatalf("message 6: %+v, want its own error", res[5])
	}
	for i := 6; i < 10; i++ {
		wantErr(t, res[i], i+1, jssink.ErrBatchUnproven)
	}
}

// A gap (a message lost on the way) ends the batch at the last message
// before it; the message after the proven prefix says why.
func TestBatchGap(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(6)
	msgs := fs.takeN(6)
	fs.answer(msgs[1].reply, `{"type":"ack","seq":0,"msgs":4}`)
	fs.answer(msgs[5].reply, `{"type":"gap","last_seq":4,"seq":5}`)
	fs.answer(msgs[5].reply, `{"stream":"FAKE","seq":103,"batch":"x","count":3}`)
	res := results(t, futs)
	wantStored(t, res, 3)
	if res[3].Err == nil || !strings.Contains(res[3].Err.Error(), "gap") {
		t.Fatalf("message 4: %+v, want the gap", res[3])
	}
	for i := 4; i < 6; i++ {
		wantErr(t, res[i], i+1, jssink.ErrBatchUnproven)
	}
}

// A lost flow ack: the stalled batch pings (op 4, the last sequence sent)
// after a third of the ack timeout, and the server's resent ack resolves
// the messages.
func TestBatchLostFlowAckPings(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(40) // more than the flow (32): no idle commit
	msgs := fs.takeN(40)
	fs.answer(msgs[1].reply, `{"type":"ack","seq":0,"msgs":32}`)
	// The flow ack for 32 is "lost": nothing is answered until the ping.
	var ping fakeMsg
	for ping.op != 4 {
		ping = fs.take()
	}
	if ping.seq != 40 {
		t.Fatalf("ping for sequence %d, want 40", ping.seq)
	}
	fs.answer(ping.reply, `{"type":"ack","seq":32,"msgs":32}`)
	wantStored(t, results(t, futs[:31]), 31)
}

// No answer at all: no commit and no ping is sent (an unknown server would
// store them), and after the ack timeout every message fails as a timeout
// or unproven, none as stored.
func TestBatchAckTimeout(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(3)
	fs.takeN(3)
	res := results(t, futs)
	select {
	case m := <-fs.in:
		t.Fatalf("unanswered, the sink sent %+v", m)
	default:
	}
	wantErr(t, res[0], 1, jetstream.ErrAsyncPublishTimeout)
	for i := 1; i < 3; i++ {
		wantErr(t, res[i], i+1, jssink.ErrBatchUnproven)
	}
}

// A server before 2.14 takes a batched message as an ordinary publish and
// answers each with its own pub ack: that ack is the message's evidence,
// and the stream falls back to per-message publishes, said once.
func TestBatchOldServerFallsBack(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(3)
	msgs := fs.takeN(3)
	for seq := uint64(1); seq <= 3; seq++ {
		dup := ""
		if seq == 2 {
			dup = `,"duplicate":true`
		}
		fs.answer(msgs[seq].reply, fmt.Sprintf(`{"stream":"FAKE","seq":%d%s}`, 100+seq, dup))
	}
	res := results(t, futs)
	for i, r := range res {
		if r.Err != nil || r.Ack.Sequence != uint64(101+i) || r.Ack.Duplicate != (i == 1) {
			t.Fatalf("message %d: %+v", i+1, r)
		}
	}
	select {
	case p := <-fs.said:
		if p.Stream != "FAKE" || !strings.Contains(p.Why, "2.14") {
			t.Fatalf("fall-back said %+v", p)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the fall-back was not said")
	}
	if p := fs.sink.Paths(); p[0].Batch {
		t.Fatalf("paths after the fall-back: %+v", p)
	}
	// The next message goes on its own: a plain reply subject.
	fs.publish(1)
	if m := fs.take(); strings.HasSuffix(m.reply, "$FI") {
		t.Fatalf("after the fall-back a message went in a batch: %s", m.reply)
	}
}

// 10205: the stream does not allow fast batches. The first message's
// error fails it (transient: the relay resends), and the stream falls
// back.
func TestBatchDisabledFallsBack(t *testing.T) {
	fs := newFakeStream(t, 64)
	futs := fs.publish(2)
	msgs := fs.takeN(2)
	fs.answer(msgs[1].reply, `{"error":{"code":400,"err_code":10205,"description":"batch publish is disabled"},"stream":"FAKE","seq":0}`)
	res := results(t, futs)
	if res[0].Err == nil || jssink.Classify(res[0].Err) != relay.Transient {
		t.Fatalf("message 1: %+v, want a transient error", res[0])
	}
	wantErr(t, res[1], 2, jssink.ErrBatchUnproven)
	select {
	case p := <-fs.said:
		if !strings.Contains(p.Why, "allow_batched") {
			t.Fatalf("fall-back said %+v", p)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the fall-back was not said")
	}
}
