package claimtest

import (
	"bytes"
	"maps"
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

// TestReplayReusesAnIntactObjectAndUploadsOtherwise: walbox replay of a
// large event whose object is intact publishes its reference without
// uploading (the object keeps its NUID and chunks; only its meta message is
// renewed, which the retention sweep reads as the newest attempt); when
// the object was overwritten with other bytes or deleted, replay uploads
// the payload again. The consumer library then verifies every message's
// object against its reference.
func TestReplayReusesAnIntactObjectAndUploadsOtherwise(t *testing.T) {
	e := newEnv(t)
	relaytest.StartRelay(t, e.cfg)
	id := e.insert(3 * MiB / 2)
	e.stored(30 * time.Second)
	obs, err := e.js.ObjectStore(e.ctx, "USERS_CLAIMS")
	if err != nil {
		t.Fatal(err)
	}
	list, err := obs.List(e.ctx)
	if err != nil || len(list) != 1 {
		t.Fatalf("bucket holds %d objects (%v), want 1", len(list), err)
	}
	key := list[0].Name
	bucket, err := e.js.Stream(e.ctx, "OBJ_USERS_CLAIMS")
	if err != nil {
		t.Fatal(err)
	}
	chunks := func() map[string]uint64 {
		info, err := bucket.Info(e.ctx, jetstream.WithSubjectFilter("$O.USERS_CLAIMS.C.>"))
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Subjects
	}
	info := func() *jetstream.ObjectInfo {
		i, err := obs.GetInfo(e.ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return i
	}
	replay := func() {
		t.Helper()
		res, err := ops.Replay(e.ctx, e.cfg, ops.ReplayOptions{IDs: []string{id}, ForceNewID: true})
		if err != nil || res.Published != 1 {
			t.Fatalf("replay: %+v, %v; want 1 published", res, err)
		}
	}
	payload := func() string {
		b, err := obs.GetBytes(e.ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}

	// Intact: no upload.
	before, chunksBefore := info(), chunks()
	replay()
	after := info()
	if after.NUID != before.NUID || !maps.Equal(chunks(), chunksBefore) {
		t.Fatalf("replay of an intact object uploaded it: NUID %s -> %s, chunks %v -> %v", before.NUID, after.NUID, chunksBefore, chunks())
	}
	if !after.ModTime.After(before.ModTime) {
		t.Fatalf("object modified %s before and %s after the replay: want it renewed for the retention sweep", before.ModTime, after.ModTime)
	}

	// Other bytes of the same size under the key: uploaded again.
	if _, err := obs.PutBytes(e.ctx, key, bytes.Repeat([]byte("x"), len(e.payloads[id]))); err != nil {
		t.Fatal(err)
	}
	corrupt := info()
	replay()
	if fixed := info(); fixed.NUID == corrupt.NUID || payload() != e.payloads[id] {
		t.Fatalf("replay over a corrupt object: NUID %s -> %s, want the row's payload uploaded", corrupt.NUID, fixed.NUID)
	}

	// Missing: uploaded again.
	if err := obs.Delete(e.ctx, key); err != nil {
		t.Fatal(err)
	}
	replay()
	if payload() != e.payloads[id] {
		t.Fatal("replay of an event whose object is gone did not upload its payload")
	}

	// The original and three replays, each verified by the consumer.
	data, dead := e.consume(4)
	if len(dead) != 0 || len(data) != 4 {
		t.Fatalf("consumer: %d handled, dead-lettered %v; want 4 handled", len(data), dead)
	}
	for mid, d := range data {
		if d != e.payloads[id] {
			t.Errorf("message %s: the handler got %d bytes, want the row's %d", mid, len(d), len(e.payloads[id]))
		}
	}
}
