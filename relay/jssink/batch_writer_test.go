package jssink_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/relay"
)

// TestBatchAnotherWriterMidBatchClaimsNothingWrongly: the fast-batch proof
// (batch.go) rests on walbox being the stream's only writer, and the relay
// learns of another writer only from a refusal. This is the window before
// it does: on a real server, another client stores a message in the
// stream while walbox's batch is in flight, and walbox goes on publishing
// with expectations that do not count it. Every event whose future says
// "stored at sequence S" must be the message at S (its id read back), and
// some event must be refused.
func TestBatchAnotherWriterMidBatchClaimsNothingWrongly(t *testing.T) {
	s := startBatchSink(t, 5*time.Second, 1024, ordersSpec())
	s.BatchAtOnce()
	other, err := nats.Connect(s.nc.ConnectedUrl())
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	ojs, err := jetstream.New(other)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	const half, n = 500, 1000
	futs := make([]relay.Future, 0, n)
	publish := func(from, to int) {
		for i := from; i < to; i++ {
			f, err := s.Publish(strictMsg(i, uint64(i))) // walbox's view: it alone writes
			if err != nil {
				t.Fatalf("publish %d: %v", i, err)
			}
			futs = append(futs, f)
		}
	}
	publish(0, half)
	// Another writer, on its own connection, while walbox's first half is
	// in flight; it returns once its message is stored, so event `half`
	// is published after it, expecting a last sequence that is no longer
	// the stream's.
	foreign, err := ojs.Publish(ctx, "orders.created", []byte(`{"foreign":true}`), jetstream.WithMsgID("foreign-1"))
	if err != nil {
		t.Fatalf("the other writer's publish: %v", err)
	}
	publish(half, n)

	js, err := s.js.Stream(ctx, s.stream)
	if err != nil {
		t.Fatal(err)
	}
	claimed, refused := 0, 0
	for i, f := range futs {
		r, err := awaitResult(ctx, f)
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if r.Err != nil {
			refused++
			if refused == 1 {
				t.Logf("event %d, the first refused (the foreign message is at seq %d): %v", i, foreign.Sequence, r.Err)
			}
			continue
		}
		m, err := js.GetMsg(ctx, r.Ack.Sequence)
		if err != nil {
			t.Fatalf("event %d claimed at seq %d, which cannot be read: %v", i, r.Ack.Sequence, err)
		}
		if got := m.Header.Get(relay.HeaderMsgID); got != fmt.Sprintf("e%d", i) {
			t.Fatalf("event %d claimed at seq %d, which holds %q", i, r.Ack.Sequence, got)
		}
		claimed++
	}
	t.Logf("foreign message at seq %d; %d events claimed (each read back at its sequence), %d refused; batch stats %+v",
		foreign.Sequence, claimed, refused, s.BatchStats())
	// Some event must have been refused: each expects its own index as the
	// stream's last sequence, so all 1,000 stored would put them at 1..1000
	// and the foreign message after them; but it was stored before event
	// `half` was published.
	if refused == 0 {
		t.Fatal("no event was refused after another writer stored a message mid-batch")
	}
}
