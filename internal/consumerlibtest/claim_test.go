package consumerlibtest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/relaytest"
)

// claimRef is a Walbox-Claim-Check value for key with data's size and digest.
func claimRef(key string, data []byte) string {
	sum := sha256.Sum256(data)
	return fmt.Sprintf("store=jetstream&bucket=USERS_CLAIMS&key=%s&size=%d&sha256=%s", key, len(data), hex.EncodeToString(sum[:]))
}

// The handler sees a claimed event's payload, fetched and verified; an
// object whose bytes do not match its reference is dead-lettered with an
// error naming the event and the key; a header that does not parse too.
func TestClaimCheckIsResolvedAndVerified(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	ctx := relaytest.Ctx(t)
	obs, err := e.js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: "USERS_CLAIMS"})
	if err != nil {
		t.Fatal(err)
	}
	payload := []byte(`{"user_id": "u-big"}`)
	if _, err := obs.PutBytes(ctx, "src/public.outbox_events/evt-big", payload); err != nil {
		t.Fatal(err)
	}
	if _, err := obs.PutBytes(ctx, "src/public.outbox_events/evt-bad", []byte(`{"user_id": "other"}`)); err != nil {
		t.Fatal(err)
	}
	e.publish("user.created", "evt-big", "", map[string]string{consumer.HeaderClaimCheck: claimRef("src/public.outbox_events/evt-big", payload)})
	e.publish("user.created", "evt-bad", "", map[string]string{consumer.HeaderClaimCheck: claimRef("src/public.outbox_events/evt-bad", payload)})
	e.publish("user.created", "evt-garbled", "", map[string]string{consumer.HeaderClaimCheck: "store=jetstream&size=x"})

	var mu sync.Mutex
	seen := map[string]consumer.Message{}
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "claims", DB: e.db, OnOutcome: out.record}, func(_ context.Context, _ pgx.Tx, m consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		seen[m.ID] = m
		return nil
	})
	out.waitFor(t, "3 settled", func() bool { return out.total() == 3 })
	mu.Lock()
	got := seen["evt-big"]
	mu.Unlock()
	if string(got.Data) != string(payload) || got.Claim == nil || got.Claim.Key != "src/public.outbox_events/evt-big" {
		t.Fatalf("handler saw %q with reference %+v", got.Data, got.Claim)
	}
	for _, r := range out.snapshot() {
		switch r.msg.ID {
		case "evt-bad":
			if r.outcome != consumer.DeadLettered || !errors.Is(r.err, consumer.ErrClaimCorrupt) ||
				!strings.Contains(r.err.Error(), "evt-bad") || !strings.Contains(r.err.Error(), "src/public.outbox_events/evt-bad") {
				t.Errorf("evt-bad: %v %v, want dead-lettered as corrupt, naming the event and the key", r.outcome, r.err)
			}
		case "evt-garbled":
			if r.outcome != consumer.DeadLettered || !strings.Contains(r.err.Error(), consumer.HeaderClaimCheck) {
				t.Errorf("evt-garbled: %v %v, want dead-lettered for its header", r.outcome, r.err)
			}
		}
	}
}

// ClaimReferenceOnly hands the handler the reference and leaves the fetch to it.
func TestClaimReferenceOnlyLeavesTheFetchToTheHandler(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	e.publish("user.created", "evt-big", "", map[string]string{consumer.HeaderClaimCheck: claimRef("k", []byte("x"))})
	var mu sync.Mutex
	var got consumer.Message
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "claims", DB: e.db, OnOutcome: out.record, ClaimReferenceOnly: true},
		func(_ context.Context, _ pgx.Tx, m consumer.Message) error {
			mu.Lock()
			defer mu.Unlock()
			got = m
			return nil
		})
	out.waitFor(t, "processed", func() bool { return out.count(consumer.Processed) == 1 })
	mu.Lock()
	defer mu.Unlock()
	if len(got.Data) != 0 || got.Claim == nil || got.Claim.Key != "k" || got.Claim.Size != 1 {
		t.Fatalf("handler saw %q with reference %+v, want no data and the reference", got.Data, got.Claim)
	}
}
