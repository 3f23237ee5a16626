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

// meta is the metadata of event "k"'s objects, for stream S.
func meta() map[string]string {
	return map[string]string{claim.MetaStream: "S", claim.MetaEventID: "k"}
}

// reuse is a replay's Reuse of "k" holding data, for stream S: the name of
// the object it renewed, or false.
func reuse(ctx context.Context, r claim.Reuser, data []byte) (string, bool, error) {
	return r.Reuse(ctx, "k", int64(len(data)), sha256.Sum256(data), meta())
}

// sweepRenewing sweeps with sw while renew runs between the sweep's
// decision to delete an object and its delete.
func sweepRenewing(ctx context.Context, t *testing.T, sw *claim.Sweeper, renew func()) claim.SweepStats {
	t.Helper()
	claim.BeforeRemove(sw, func(string) { renew() })
	stats, err := sw.Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return stats
}

// sweepCandidate stores object "k" in a fresh bucket, then a message in
// stream S after it, so that the sweep (slack 10 ms) finds "k"'s message
// gone: the state a replay of an event whose message aged out meets.
func sweepCandidate(t *testing.T) (*claim.JetStreamStore, *claim.Sweeper, []byte) {
	t.Helper()
	ctx, js, st := streamAndBucket(t)
	data := []byte(replayed)
	if _, err := st.Put(ctx, "k", data, meta()); err != nil {
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
	var renewed string
	stats := sweepRenewing(ctx, t, sw, func() {
		name, ok, err := reuse(ctx, st, data)
		if err != nil || !ok {
			t.Errorf("renewal: %v, %v", ok, err)
		}
		renewed = name
	})
	if renewed != "k" {
		t.Fatalf("the replay renewed %q, want the intact object k", renewed)
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
	_, ok, err := reuse(ctx, st, data)
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
	if _, err := st.Put(ctx, "k", data, meta()); err != nil {
		t.Fatal(err)
	}
	if stats, err = sw.Sweep(ctx); err != nil || stats.Deleted != 0 {
		t.Fatalf("sweep after the fresh upload: %+v, %v", stats, err)
	}
	if got, err := st.Get(ctx, "k"); err != nil || string(got) != string(data) {
		t.Fatalf("the fresh upload reads %q, %v", got, err)
	}
}

// TestS3SweepKeepsAnObjectRenewedSinceItsListing: an object under an
// event's bare key, as older walbox versions wrote it, which an older
// relay or CLI (a rolling upgrade) renews in place after the sweep listed
// it: the sweep reads such an object again right before its delete and
// keeps it when its version changed since the listing.
func TestS3SweepKeepsAnObjectRenewedSinceItsListing(t *testing.T) {
	ctx, js := streamWithAMessage(t)
	store, c, clock := s3Env(t)
	data := []byte(replayed)
	now := time.Now()
	clock.set(now.Add(-2 * time.Minute)) // its message is gone from S
	putBare(ctx, t, c, "walbox/k", data, "S")
	clock.set(now)
	sw := claim.NewS3Sweeper(store, claim.JetStreamHorizon{JS: js}, time.Minute, zerolog.Nop(), nil)
	stats := sweepRenewing(ctx, t, sw, func() {
		clock.set(now.Add(2 * time.Second))
		renewBare(ctx, t, c, "walbox/k", "S")
	})
	if stats.Deleted != 0 {
		t.Fatalf("sweep %+v: want the renewed object kept", stats)
	}
	if got, err := store.Get(ctx, "walbox/k"); err != nil || string(got) != string(data) {
		t.Fatalf("the renewed object reads %q, %v", got, err)
	}
}

// TestS3SweepKeepsWhatARenewalOrUploadInItsLastMomentNames: a replay's
// renewal (Reuse), or a fresh upload of the same event, lands after the
// sweep's last read of the object it decided to delete and right before
// its DELETE. The reference the renewal or upload returned must still
// resolve to the intact payload after the sweep. (When every upload and
// renewal wrote the event's one key, the DELETE removed the object the new
// reference named.)
func TestS3SweepKeepsWhatARenewalOrUploadInItsLastMomentNames(t *testing.T) {
	for _, how := range []string{"renewal", "upload"} {
		t.Run(how, func(t *testing.T) {
			ctx, js := streamWithAMessage(t)
			store, _, clock := s3Env(t)
			data := []byte(replayed)
			now := time.Now()
			clock.set(now.Add(-2 * time.Minute)) // its message is gone from S
			old, err := store.Put(ctx, "k", data, meta())
			if err != nil {
				t.Fatal(err)
			}
			clock.set(now)
			sw := claim.NewS3Sweeper(store, claim.JetStreamHorizon{JS: js}, time.Minute, zerolog.Nop(), nil)
			var named string
			store.BeforeDelete(func(string) {
				store.BeforeDelete(nil)
				clock.set(now.Add(2 * time.Second))
				var err error
				if how == "renewal" {
					var ok bool
					if named, ok, err = reuse(ctx, store, data); !ok {
						t.Errorf("renewal: %v, %v; want the intact object renewed", ok, err)
					}
				} else {
					named, err = store.Put(ctx, "k", data, meta())
				}
				if err != nil {
					t.Error(err)
				}
			})
			stats, err := sw.Sweep(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if named == "" || stats.Deleted != 1 {
				t.Fatalf("sweep %+v, named %q: the test did not run its race", stats, named)
			}
			if got, err := store.Get(ctx, named); err != nil || string(got) != string(data) {
				t.Fatalf("the %s's reference names %s, which reads %q, %v after the sweep", how, named, got, err)
			}
			if _, err := store.Get(ctx, old); !isNoSuchKey(err) {
				t.Fatalf("the object the sweep decided to delete, %s: %v, want it deleted", old, err)
			}
		})
	}
}
