package claim_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay/claim"
)

// replayed is the payload of the event the tests replay.
const replayed = `{"payload":"of the event being replayed"}`

// reuse is a replay's Reuse of "k" holding data, for stream S: whether
// it renewed the object (named "k" in both stores' buckets, under the S3
// store's prefix).
func reuse(ctx context.Context, r claim.Reuser, data []byte) (bool, error) {
	_, ok, err := r.Reuse(ctx, "k", int64(len(data)), sha256.Sum256(data), map[string]string{claim.MetaStream: "S"})
	return ok, err
}

// sweepRenewing sweeps with sw while a replay renews "k" (after first)
// between the sweep's decision to delete it and its delete, and says
// whether the renewal went through.
func sweepRenewing(ctx context.Context, t *testing.T, sw *claim.Sweeper, r claim.Reuser, data []byte, first func()) (bool, claim.SweepStats) {
	t.Helper()
	renewed := false
	claim.BeforeRemove(sw, func(string) {
		first()
		ok, err := reuse(ctx, r, data)
		if err != nil {
			t.Error(err)
		}
		renewed = ok
	})
	stats, err := sw.Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return renewed, stats
}

// sweepCandidate stores object "k" in a fresh bucket, then a message in
// stream S after it, so that the sweep (slack 10 ms) finds "k"'s message
// gone: the state a replay of an event whose message aged out meets.
func sweepCandidate(t *testing.T) (*claim.JetStreamStore, *claim.Sweeper, []byte) {
	t.Helper()
	ctx, js, st := streamAndBucket(t)
	data := []byte(replayed)
	if _, err := st.Put(ctx, "k", data, map[string]string{claim.MetaStream: "S"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if _, err := js.Publish(ctx, "s.x", nil); err != nil {
		t.Fatal(err)
	}
	return st, claim.NewSweeper(st, js, 10*time.Millisecond, zerolog.Nop(), nil), data
}

// TestSweepKeepsAnObjectRenewedBeforeItsDelete: a replay renews object "k"
// (Reuse) after the sweep listed it as deletable and before its delete. The
// replayed message will name "k", so the sweep must keep it: its delete is
// conditional on the meta message it listed. (Before, the sweep deleted by
// name with nats.go's ObjectStore.Delete, which reads the meta again and
// deletes whatever it finds: the renewed object and its chunks went, and
// the replayed message named nothing.)
func TestSweepKeepsAnObjectRenewedBeforeItsDelete(t *testing.T) {
	ctx := relaytest.Ctx(t)
	st, sw, data := sweepCandidate(t)
	renewed, stats := sweepRenewing(ctx, t, sw, st, data, func() {})
	if !renewed {
		t.Fatal("the replay did not renew the intact object")
	}
	if stats.Deleted != 0 || stats.Objects != 1 {
		t.Fatalf("sweep %+v, want the renewed object kept", stats)
	}
	got, err := st.Get(ctx, "k")
	if err != nil || string(got) != string(data) {
		t.Fatalf("the renewed object reads %q, %v", got, err)
	}
}

// TestRenewalAfterTheSweepsDeleteIsRefused: the other order. The sweep's
// delete lands between the replay's read of the object and its renewal;
// the renewal must not bring back an object whose chunks the sweep
// purges: Reuse reports false (the payload is uploaded afresh), and the
// fresh upload stands.
func TestRenewalAfterTheSweepsDeleteIsRefused(t *testing.T) {
	ctx := relaytest.Ctx(t)
	st, sw, data := sweepCandidate(t)
	var stats claim.SweepStats
	st.BeforeRenew(func() {
		var err error
		if stats, err = sw.Sweep(ctx); err != nil {
			t.Error(err)
		}
	})
	ok, err := reuse(ctx, st, data)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Deleted != 1 {
		t.Fatalf("sweep %+v, want k deleted", stats)
	}
	if ok {
		t.Fatal("Reuse renewed an object the sweep deleted: its message would name purged chunks")
	}
	if _, err := st.Get(ctx, "k"); !errors.Is(err, jetstream.ErrObjectNotFound) {
		t.Fatalf("k after the refused renewal: %v, want not found", err)
	}
	st.BeforeRenew(nil)
	if _, err := st.Put(ctx, "k", data, map[string]string{claim.MetaStream: "S"}); err != nil {
		t.Fatal(err)
	}
	if stats, err = sw.Sweep(ctx); err != nil || stats.Deleted != 0 {
		t.Fatalf("sweep after the fresh upload: %+v, %v", stats, err)
	}
	if got, err := st.Get(ctx, "k"); err != nil || string(got) != string(data) {
		t.Fatalf("the fresh upload reads %q, %v", got, err)
	}
}

// TestS3SweepKeepsAnObjectRenewedSinceItsListing: S3 has no conditional
// delete; the sweep reads the object again right before its delete and
// keeps it when a replay renewed it since the listing.
func TestS3SweepKeepsAnObjectRenewedSinceItsListing(t *testing.T) {
	ctx, js := streamWithAMessage(t)
	store, _, clock := s3Env(t)
	data := []byte(replayed)
	now := time.Now()
	clock.set(now.Add(-2 * time.Minute)) // its message is gone from S
	if _, err := store.Put(ctx, "k", data, map[string]string{claim.MetaStream: "S"}); err != nil {
		t.Fatal(err)
	}
	clock.set(now)
	sw := claim.NewS3Sweeper(store, claim.JetStreamHorizon{JS: js}, time.Minute, zerolog.Nop(), nil)
	renewed, stats := sweepRenewing(ctx, t, sw, store, data, func() { clock.set(now.Add(2 * time.Second)) })
	if !renewed || stats.Deleted != 0 {
		t.Fatalf("renewed %v, sweep %+v: want the renewed object kept", renewed, stats)
	}
	if got, err := store.Get(ctx, "k"); err != nil || string(got) != string(data) {
		t.Fatalf("the renewed object reads %q, %v", got, err)
	}
}
