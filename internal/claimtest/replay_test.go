package claimtest

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestReplayOfALargeEventPublishesAReference: walbox replay publishes an
// event above max_payload as the relay does, by reference, instead of
// refusing it as too large.
func TestReplayOfALargeEventPublishesAReference(t *testing.T) {
	e := newEnv(t)
	relaytest.StartRelay(t, e.cfg)
	id := e.insert(3 * MiB / 2)
	e.stored(30 * time.Second)

	res, err := ops.Replay(e.ctx, e.cfg, ops.ReplayOptions{IDs: []string{id}, ForceNewID: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Published != 1 || res.DeadLettered != 0 {
		t.Fatalf("replay %+v, want 1 published", res)
	}
	msgs := relaytest.CollectN(t, e.js, "USERS", jetstream.OrderedConsumerConfig{}, 10*time.Second, 2)
	again := msgs[1]
	ref, err := consumer.ParseClaimCheck(again.Headers())
	if err != nil || ref == nil || len(again.Data()) != 0 {
		t.Fatalf("replayed message: reference %+v (%v), %d bytes of body; want a reference and an empty body", ref, err, len(again.Data()))
	}
	data, err := consumer.FetchClaim(e.ctx, e.js, again.Headers().Get("Nats-Msg-Id"), ref)
	if err != nil {
		t.Fatal(err)
	}
	if string(data) != e.payloads[id] {
		t.Fatal("the replayed event's payload differs from its row")
	}
}
