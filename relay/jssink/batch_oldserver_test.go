package jssink_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/relay/jssink"
)

// oldServer is a nats-server from before fast batches (2.14).
const oldServer = "v2.11.9"

// TestBatchOldServerPerMessage: on a real nats-server 2.11 walbox creates
// its stream without allow_batched, says why it publishes per message, and
// a backlog is stored once, in order.
func TestBatchOldServerPerMessage(t *testing.T) {
	p := natstest.NewProcServer(t, oldServer)
	s := batchSinkOn(t, p.URL(), 5*time.Second, 1024, ordersSpec())
	if s.paths[0].Batch || !strings.Contains(s.paths[0].Why, "2.14") {
		t.Fatalf("path on %s: %+v, want per message because of the version", oldServer, s.paths[0])
	}
	checkRun(t, s, 3000)
	if st := s.BatchStats(); st.Batches != 0 {
		t.Fatalf("batches on an old server: %+v", st)
	}
}

// TestBatchOldServerFallsBackMidStream: a batch reaching a server that
// does not know fast batches (a mixed cluster's leader moved to an old
// node) is taken as ordinary publishes: each message's own pub ack
// resolves it, the stream falls back to per-message publishes, and no
// end-of-batch marker or ping is stored as a message.
func TestBatchOldServerFallsBackMidStream(t *testing.T) {
	p := natstest.NewProcServer(t, oldServer)
	s := batchSinkOn(t, p.URL(), 5*time.Second, 1024, ordersSpec())
	said := make(chan jssink.PublishPath, 1)
	s.SetBatching(jssink.Batching{Paths: []jssink.PublishPath{{Stream: "ORDERS", Batch: true}}, Window: 1024,
		OnFallBack: func(p jssink.PublishPath) { said <- p }})
	s.BatchAtOnce()
	checkRun(t, s, 3000)
	select {
	case p := <-said:
		if !strings.Contains(p.Why, "2.14") {
			t.Fatalf("fall-back said %+v", p)
		}
	default:
		t.Fatal("the fall-back was not said")
	}
	if s.Paths()[0].Batch {
		t.Fatal("still batching after the fall-back")
	}
	// Idle well past the linger and a third of the ack timeout: nothing
	// more may be stored.
	time.Sleep(2 * time.Second)
	if ids := storedIDs(t, s); len(ids) != 3000 {
		t.Fatalf("stream holds %d messages after idling, want 3000", len(ids))
	}
}

// checkRun publishes n events and checks every ack and the stream.
func checkRun(t *testing.T, s *batchSink, n int) {
	t.Helper()
	for i, r := range publishRun(t, s, 0, n, 0, 1024) {
		if r.Err != nil || r.Ack.Sequence != uint64(i+1) {
			t.Fatalf("event %d: %+v", i, r)
		}
	}
	ids := storedIDs(t, s)
	if len(ids) != n {
		t.Fatalf("stream holds %d messages, want %d", len(ids), n)
	}
	for i, id := range ids {
		if want := fmt.Sprintf("e%d", i); id != want {
			t.Fatalf("seq %d holds %s, want %s", i+1, id, want)
		}
	}
}
