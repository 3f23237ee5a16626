package claim_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/claim"
)

// isNoSuchKey reports whether err is S3's answer for an object that is
// not there.
func isNoSuchKey(err error) bool {
	var er minio.ErrorResponse
	return errors.As(err, &er) && er.Code == "NoSuchKey"
}

// putBare writes data under name as walbox did before every upload had a
// name of its own: the event's bare key, with the metadata it set.
func putBare(ctx context.Context, t *testing.T, c *minio.Client, name string, data []byte, stream string) {
	t.Helper()
	sum := sha256.Sum256(data)
	meta := map[string]string{claim.MetaStream: stream, claim.MetaEventID: name[strings.LastIndexByte(name, '/')+1:],
		claim.MetaSHA256: hex.EncodeToString(sum[:]), claim.MetaWritten: time.Now().UTC().Format(time.RFC3339Nano)}
	if _, err := c.PutObject(ctx, "claims", name, bytes.NewReader(data), int64(len(data)),
		minio.PutObjectOptions{ContentType: "application/json", UserMetadata: meta}); err != nil {
		t.Fatal(err)
	}
}

// renewBare renews the object name in place as an older walbox's replay
// did: a server-side copy onto itself with new metadata.
func renewBare(ctx context.Context, t *testing.T, c *minio.Client, name, stream string) {
	t.Helper()
	meta := map[string]string{claim.MetaStream: stream, claim.MetaWritten: time.Now().UTC().Format(time.RFC3339Nano)}
	if _, err := c.CopyObject(ctx, minio.CopyDestOptions{Bucket: "claims", Object: name, ReplaceMetadata: true, UserMetadata: meta, ContentType: "application/json"},
		minio.CopySrcOptions{Bucket: "claims", Object: name}); err != nil {
		t.Fatal(err)
	}
}

// resolve reads the object ref names, as a consumer does, and checks it
// against the reference.
func resolve(ctx context.Context, t *testing.T, store *claim.S3Store, header string) (claim.Ref, []byte) {
	t.Helper()
	ref, err := claim.ParseRef(header)
	if err != nil {
		t.Fatal(err)
	}
	data, err := store.Get(ctx, ref.Key)
	if err != nil {
		t.Fatalf("the reference names %s: %v", ref.Key, err)
	}
	sum := sha256.Sum256(data)
	if ref.Store != claim.StoreS3 || ref.Bucket != "claims" || int64(len(data)) != ref.Size || hex.EncodeToString(sum[:]) != ref.SHA256 {
		t.Fatalf("object %s: %d bytes with sha256 %x; the reference %+v", ref.Key, len(data), sum, ref)
	}
	return ref, data
}

// TestS3UploadsOfOneEventGetNamesOfTheirOwn: two publish attempts of one
// event upload it twice, each to a name of its own under the event's key,
// and each message's reference names its own upload, which resolves.
func TestS3UploadsOfOneEventGetNamesOfTheirOwn(t *testing.T) {
	ctx, _ := streamWithAMessage(t)
	store, _, _ := s3Env(t)
	var log []string
	inner := &fakeSink{log: &log}
	s := claim.New(inner, store, claim.Options{Threshold: 10, Logger: zerolog.Nop()})
	m := newMsg("42", 50)
	for range 2 {
		if _, err := s.Publish(m); err != nil {
			t.Fatal(err)
		}
	}
	if len(inner.msgs) != 2 {
		t.Fatalf("%d messages published, want 2", len(inner.msgs))
	}
	var names []string
	for _, sent := range inner.msgs {
		ref, data := resolve(ctx, t, store, sent.Header.Get(claim.Header))
		if !bytes.Equal(data, m.Data) {
			t.Fatalf("object %s differs from the payload", ref.Key)
		}
		rest, ok := strings.CutPrefix(ref.Key, "walbox/app/walbox/public.outbox_events/42/")
		if !ok || !claim.UniqueName(ref.Key, "42") {
			t.Fatalf("object %s: want walbox/<event key>/<UUIDv7>, %q after the event's key", ref.Key, rest)
		}
		names = append(names, ref.Key)
	}
	if names[0] == names[1] {
		t.Fatalf("both uploads went to %s", names[0])
	}
}

// TestS3ReuseOfAnObjectSweptMeanwhileUploads: the sweep deletes the intact
// object a replay found, between Reuse's check and its copy. The copy
// fails with NoSuchKey and Reuse says false, without an error; a replay
// through the sink then uploads the payload afresh and names that upload.
func TestS3ReuseOfAnObjectSweptMeanwhileUploads(t *testing.T) {
	ctx, js := streamWithAMessage(t)
	store, c, clock := s3Env(t)
	data := []byte(replayed)
	sw := claim.NewS3Sweeper(store, claim.JetStreamHorizon{JS: js}, time.Minute, zerolog.Nop(), nil)
	now := time.Now()
	const key = "app/walbox/public.outbox_events/k" // event k's, as newMsgOf's
	old := func() string {                          // an object of k whose message is gone from S
		t.Helper()
		clock.set(now.Add(-2 * time.Minute))
		defer clock.set(now)
		name, err := store.Put(ctx, key, data, meta())
		if err != nil {
			t.Fatal(err)
		}
		return name
	}
	sweepOnRenew := func() *claim.SweepStats {
		var stats claim.SweepStats
		store.BeforeRenew(func() {
			store.BeforeRenew(nil)
			var err error
			if stats, err = sw.Sweep(ctx); err != nil {
				t.Error(err)
			}
		})
		return &stats
	}

	first := old()
	stats := sweepOnRenew()
	name, ok, err := store.Reuse(ctx, key, int64(len(data)), sha256.Sum256(data), meta())
	if err != nil || ok || name != "" {
		t.Fatalf("Reuse of an object swept before its copy: %q, %v, %v; want false and no error", name, ok, err)
	}
	if stats.Deleted != 1 {
		t.Fatalf("sweep %+v, want %s deleted", *stats, first)
	}
	if n := countObjects(ctx, t, c); n != 0 {
		t.Fatalf("the bucket holds %d objects, want none (a failed copy leaves nothing)", n)
	}

	second := old()
	stats = sweepOnRenew()
	var log []string
	inner := &fakeSink{log: &log}
	s := claim.New(inner, store, claim.Options{Threshold: 10, ReuseIntact: true, Logger: zerolog.Nop()})
	if _, err := s.Publish(newMsgOf("k", data)); err != nil {
		t.Fatal(err)
	}
	if stats.Deleted != 1 {
		t.Fatalf("sweep %+v, want %s deleted", *stats, second)
	}
	ref, _ := resolve(ctx, t, store, inner.msgs[0].Header.Get(claim.Header))
	if ref.Key == second {
		t.Fatalf("the replay names %s, which the sweep deleted", second)
	}
	if n := countObjects(ctx, t, c); n != 1 {
		t.Fatalf("the bucket holds %d objects, want the fresh upload only", n)
	}
}

// TestS3ObjectUnderABareKeyIsReadReusedAndSwept: objects an older walbox
// wrote under the event's bare key (no name of their own) are still read
// by the key their references carry, reused by a replay (copied to a name
// of its own), and swept by the same rule.
func TestS3ObjectUnderABareKeyIsReadReusedAndSwept(t *testing.T) {
	ctx, js := streamWithAMessage(t)
	store, c, clock := s3Env(t)
	data := []byte(replayed)
	sum := sha256.Sum256(data)
	now := time.Now()
	// 42's message is gone from S; 43's may be S's first (within the slack).
	gone, held := "walbox/app/walbox/public.outbox_events/42", "walbox/app/walbox/public.outbox_events/43"
	clock.set(now.Add(-2 * time.Minute))
	putBare(ctx, t, c, gone, data, "S")
	clock.set(now.Add(-30 * time.Second))
	putBare(ctx, t, c, held, data, "S")
	clock.set(now)

	for _, name := range []string{gone, held} {
		old := claim.Ref{Store: claim.StoreS3, Bucket: "claims", Key: name, Size: int64(len(data)), SHA256: hex.EncodeToString(sum[:])}
		if ref, got := resolve(ctx, t, store, old.String()); ref != old || !bytes.Equal(got, data) {
			t.Fatalf("an older walbox's reference %+v reads %+v, %q", old, ref, got)
		}
	}

	copied, ok, err := store.Reuse(ctx, "app/walbox/public.outbox_events/42", int64(len(data)), sum,
		map[string]string{claim.MetaStream: "S", claim.MetaEventID: "42"})
	if err != nil || !ok || !claim.UniqueName(copied, "42") || !strings.HasPrefix(copied, gone+"/") {
		t.Fatalf("Reuse of %s: %q, %v, %v; want a copy under a name of its own", gone, copied, ok, err)
	}

	stats, err := claim.NewS3Sweeper(store, claim.JetStreamHorizon{JS: js}, time.Minute, zerolog.Nop(), nil).Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Deleted != 1 || stats.Objects != 2 {
		t.Fatalf("sweep %+v, want %s deleted, %s and the copy kept", stats, gone, held)
	}
	if _, err := store.Get(ctx, gone); !isNoSuchKey(err) {
		t.Fatalf("%s: %v, want it deleted", gone, err)
	}
	for _, name := range []string{held, copied} {
		if got, err := store.Get(ctx, name); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s reads %q, %v", name, got, err)
		}
	}
}

// TestUniqueNameTellsAnUploadsNameFromABareKey: a name of an upload's own
// is the event's key, "/" and a UUIDv7; an event's bare key is not one,
// even when the event's id is itself a UUIDv7.
func TestUniqueNameTellsAnUploadsNameFromABareKey(t *testing.T) {
	const v7, v4 = "01936f4e-7b1c-7cc3-a5d4-1f2e3d4c5b6a", "9b2f6f3e-2c4d-4e5f-8a9b-0c1d2e3f4a5b"
	for _, tt := range []struct {
		name, id string
		want     bool
	}{
		{"walbox/app/walbox/public.t/42/" + v7, "42", true},
		{"app/walbox/public.t/42/" + v7, "42", true},
		{"walbox/app/walbox/public.t/42", "42", false},                      // bare
		{"walbox/app/walbox/public.t/" + v7, v7, false},                     // bare, a UUIDv7 id
		{"walbox/app/walbox/public.t/" + v7 + "/" + v7, v7, true},           // that event's own
		{"walbox/app/walbox/public.t/x/" + v7, "x/" + v7 + "/" + v7, false}, // another event's
		{"walbox/app/walbox/public.t/42/" + v4, "42", false},                // not a UUIDv7
		{"walbox/app/walbox/public.t/42/" + strings.ToUpper(v7), "42", false},
		{"walbox/app/walbox/public.t/42/" + v7, "", false}, // no event id: not walbox's
		{"walbox/app/walbox/public.t/142/" + v7, "42", false},
	} {
		if got := claim.UniqueName(tt.name, tt.id); got != tt.want {
			t.Errorf("uniqueName(%q, %q) = %v, want %v", tt.name, tt.id, got, tt.want)
		}
	}
}

// countObjects is how many objects bucket "claims" holds.
func countObjects(ctx context.Context, t *testing.T, c *minio.Client) int {
	t.Helper()
	n := 0
	for o := range c.ListObjects(ctx, "claims", minio.ListObjectsOptions{Recursive: true}) {
		if o.Err != nil {
			t.Fatal(o.Err)
		}
		n++
	}
	return n
}

// newMsgOf is event id of table public.outbox_events in stream S with
// payload data.
func newMsgOf(id string, data []byte) *relay.Msg {
	m := newMsg(id, 0)
	m.Stream, m.Data = "S", bytes.Clone(data)
	return m
}
