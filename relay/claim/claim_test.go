package claim_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/claim"
)

// fakeSink records what reaches it; every publish is acked at once.
type fakeSink struct {
	log  *[]string
	msgs []*relay.Msg
}

func (f *fakeSink) Publish(m *relay.Msg) (relay.Future, error) {
	*f.log = append(*f.log, "publish "+m.Header.Get(relay.HeaderMsgID))
	f.msgs = append(f.msgs, m)
	fut, res := relay.NewFuture()
	res.Resolve(&relay.Ack{Stream: "S", Sequence: uint64(len(f.msgs))}, nil)
	return fut, nil
}
func (f *fakeSink) Classify(error) relay.ErrorClass { return relay.Permanent }
func (f *fakeSink) MaxPayload() int                 { return 1 << 20 }
func (f *fakeSink) Epoch() uint64                   { return 0 }
func (f *fakeSink) StoredTail(context.Context, string, string, int) (relay.StoredTail, error) {
	return relay.StoredTail{}, nil
}

// fakeStore records puts; err, when set, is every put's answer.
type fakeStore struct {
	log  *[]string
	objs map[string][]byte
	err  error
}

func (s *fakeStore) Kind() string   { return "fake" }
func (s *fakeStore) Bucket() string { return "B" }

// Put stores data under key/<n>, n counting the puts: a store that names
// each object (as S3Store does).
func (s *fakeStore) Put(_ context.Context, key string, data []byte, meta map[string]string) (string, error) {
	*s.log = append(*s.log, "put "+key+" "+meta[claim.MetaStream])
	if s.err != nil {
		return "", s.err
	}
	name := fmt.Sprintf("%s/%d", key, len(*s.log))
	s.objs[name] = bytes.Clone(data)
	return name, nil
}

func newMsg(id string, size int) *relay.Msg {
	h := relay.Header{}
	h.Set(relay.HeaderMsgID, id)
	h.Set(relay.HeaderSource, "app/walbox")
	h.Set(relay.HeaderTable, "public.outbox_events")
	return &relay.Msg{Subject: "orders.created", Stream: "ORDERS", Header: h, Data: bytes.Repeat([]byte("x"), size)}
}

func newFakes(threshold int) (*claim.Sink, *fakeSink, *fakeStore, *[]string) {
	var log []string
	inner := &fakeSink{log: &log}
	store := &fakeStore{log: &log, objs: map[string][]byte{}}
	return claim.New(inner, store, claim.Options{Threshold: threshold, Logger: zerolog.Nop()}), inner, store, &log
}

func TestLargePayloadIsStoredAndConfirmedBeforeItsMessageIsPublished(t *testing.T) {
	s, inner, store, log := newFakes(100)
	small, large := newMsg("small", 100), newMsg("large", 101)
	for _, m := range []*relay.Msg{small, large} {
		if _, err := s.Publish(m); err != nil {
			t.Fatal(err)
		}
	}
	key := "app/walbox/public.outbox_events/large"
	name := key + "/2" // the store's name for it, which the reference must carry
	if got, want := strings.Join(*log, "; "), "publish small; put "+key+" ORDERS; publish large"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	if inner.msgs[0] != small || inner.msgs[0].Header.Get(claim.Header) != "" {
		t.Fatal("a payload at the threshold must pass unchanged")
	}
	sent := inner.msgs[1]
	if len(sent.Data) != 0 {
		t.Fatalf("the claimed message carries %d bytes, want an empty body", len(sent.Data))
	}
	ref, err := claim.ParseRef(sent.Header.Get(claim.Header))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(large.Data)
	if ref != (claim.Ref{Store: "fake", Bucket: "B", Key: name, Size: 101, SHA256: hex.EncodeToString(sum[:])}) {
		t.Fatalf("reference %+v", ref)
	}
	if !bytes.Equal(store.objs[name], large.Data) {
		t.Fatal("the store does not hold the payload")
	}
	// The relay's message is untouched: a resend starts from the payload.
	if len(large.Data) != 101 || large.Header.Get(claim.Header) != "" {
		t.Fatal("Publish changed the relay's message")
	}
}

// TestResendUploadsAgain: every publish attempt uploads the payload of
// the event's key, and each message names the object its own upload
// stored.
func TestResendUploadsAgain(t *testing.T) {
	s, inner, store, log := newFakes(10)
	m := newMsg("e1", 50)
	for range 2 {
		if _, err := s.Publish(m); err != nil {
			t.Fatal(err)
		}
	}
	key := "app/walbox/public.outbox_events/e1"
	if got, want := strings.Join(*log, "; "), "put "+key+" ORDERS; publish e1; put "+key+" ORDERS; publish e1"; got != want {
		t.Fatalf("calls %q, want %q", got, want)
	}
	for i, sent := range inner.msgs {
		ref, err := claim.ParseRef(sent.Header.Get(claim.Header))
		if err != nil {
			t.Fatal(err)
		}
		if want := fmt.Sprintf("%s/%d", key, 2*i+1); ref.Key != want || !bytes.Equal(store.objs[ref.Key], m.Data) {
			t.Fatalf("attempt %d names %s, want %s, the object its upload stored", i+1, ref.Key, want)
		}
	}
}

func TestStoreUnreachableIsTransientAndPublishesNothing(t *testing.T) {
	s, inner, store, _ := newFakes(10)
	store.err = errors.New("nats: timeout")
	_, err := s.Publish(newMsg("e1", 50))
	var ue *claim.UploadError
	if !errors.As(err, &ue) || s.Classify(err) != relay.Transient {
		t.Fatalf("error %v (class %v), want a transient UploadError", err, s.Classify(err))
	}
	if len(inner.msgs) != 0 {
		t.Fatal("a message was published without its object")
	}
}

func TestStoreRefusalIsPoison(t *testing.T) {
	s, inner, store, _ := newFakes(10)
	store.err = fmt.Errorf("%w: larger than the bucket", claim.ErrRefused)
	_, err := s.Publish(newMsg("e1", 50))
	var pe *relay.PoisonError
	if !errors.As(err, &pe) || !strings.Contains(pe.Reason, "larger than the bucket") {
		t.Fatalf("error %v, want a PoisonError with the store's reason", err)
	}
	if len(inner.msgs) != 0 {
		t.Fatal("a message was published without its object")
	}
}

func TestDeadLettersPassWithTheirPayload(t *testing.T) {
	s, inner, _, log := newFakes(10)
	m := newMsg("e1", 50)
	m.Header.Set(relay.HeaderDLQReason, "bad")
	if _, err := s.Publish(m); err != nil {
		t.Fatal(err)
	}
	if len(*log) != 1 || inner.msgs[0] != m {
		t.Fatalf("calls %q", *log)
	}
}

func TestRefRoundTripsKeysWithAnyCharacter(t *testing.T) {
	r := claim.Ref{Store: "jetstream", Bucket: "ORDERS_CLAIMS", Key: "db/slot/public.t/a b&c=d%", Size: 7, SHA256: strings.Repeat("ab", 32)}
	got, err := claim.ParseRef(r.String())
	if err != nil || got != r {
		t.Fatalf("%q parsed as %+v, %v", r.String(), got, err)
	}
	if _, err := claim.ParseRef("store=jetstream&bucket=B&size=1&sha256=00"); err == nil {
		t.Fatal("a reference without key and digest parsed")
	}
}

func jsEnv(t *testing.T) (context.Context, *nats.Conn, jetstream.JetStream) {
	t.Helper()
	ctx := relaytest.Ctx(t)
	nc, js := relaytest.JetStream(t, natstest.New(t).URL())
	return ctx, nc, js
}

func TestJetStreamStoreRefusesAnObjectLargerThanTheBucket(t *testing.T) {
	ctx, _, js := jsEnv(t)
	st := claim.NewJetStreamStore(js, claim.BucketSpec{Name: "C", MaxBytes: 1 << 20, Storage: "memory"})
	if err := st.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Put(ctx, "k", make([]byte, 2<<20), nil); !errors.Is(err, claim.ErrRefused) || !strings.Contains(err.Error(), "max_bytes") {
		t.Fatalf("put of 2 MiB in a 1 MiB bucket: %v, want ErrRefused naming max_bytes", err)
	}
	data := bytes.Repeat([]byte("y"), 300<<10)
	if name, err := st.Put(ctx, "k", data, nil); err != nil || name != "k" {
		t.Fatalf("put: %q, %v; want the object named by its key", name, err)
	}
	got, err := st.Get(ctx, "k")
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back %d bytes, %v", len(got), err)
	}
}

// streamAndBucket is a server with memory stream S (subjects s.>) and
// claim-check bucket C.
func streamAndBucket(t *testing.T) (context.Context, jetstream.JetStream, *claim.JetStreamStore) {
	t.Helper()
	ctx, _, js := jsEnv(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	st := claim.NewJetStreamStore(js, claim.BucketSpec{Name: "C", Storage: "memory"})
	if err := st.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	return ctx, js, st
}

// The sweep deletes an orphan older than the stream's first message and the
// objects of a stream that is gone, and keeps an object whose message the
// stream holds.
func TestSweepDeletesObjectsWhoseMessageIsGone(t *testing.T) {
	ctx, js, st := streamAndBucket(t)
	put := func(key, stream string) {
		if _, err := st.Put(ctx, key, []byte(key), map[string]string{claim.MetaStream: stream}); err != nil {
			t.Fatal(err)
		}
	}
	put("orphan", "S")
	put("gone", "NO_SUCH_STREAM")
	time.Sleep(100 * time.Millisecond)
	if _, err := js.Publish(ctx, "s.x", nil); err != nil {
		t.Fatal(err)
	}
	put("held", "S") // not older than the stream's first message
	sw := claim.NewSweeper(st, js, 10*time.Millisecond, zerolog.Nop(), nil)
	stats, err := sw.Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Deleted != 2 || stats.Objects != 1 || stats.Bytes != int64(len("held")) {
		t.Fatalf("sweep %+v, want 2 deleted and held kept", stats)
	}
	if _, err := st.Get(ctx, "held"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Get(ctx, "orphan"); !errors.Is(err, jetstream.ErrObjectNotFound) {
		t.Fatalf("orphan: %v, want not found", err)
	}
}

// The chunks of an upload killed before its end belong to no object: the
// sweep purges them once they are older than the slack, and leaves a
// complete object's chunks alone.
func TestSweepPurgesTheChunksOfAnUploadThatNeverCompleted(t *testing.T) {
	ctx, _, js := jsEnv(t)
	st := claim.NewJetStreamStore(js, claim.BucketSpec{Name: "C", Storage: "memory"})
	if err := st.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Put(ctx, "whole", []byte("whole"), map[string]string{claim.MetaStream: "S"}); err != nil {
		t.Fatal(err)
	}
	// What Put leaves when it dies after two chunks: chunks, no meta.
	for range 2 {
		if _, err := js.Publish(ctx, "$O.C.C.partialnuid", []byte("chunk")); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.x", nil); err != nil { // the whole object's message
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	stats, err := claim.NewSweeper(st, js, 50*time.Millisecond, zerolog.Nop(), nil).Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Partials != 1 || stats.Objects != 1 {
		t.Fatalf("sweep %+v, want the partial upload purged and the whole object kept", stats)
	}
	info, err := js.Stream(ctx, "OBJ_C")
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != 2 { // whole's chunk and meta
		t.Fatalf("bucket stream holds %d messages, want 2", n)
	}
	if got, err := st.Get(ctx, "whole"); err != nil || string(got) != "whole" {
		t.Fatalf("whole: %q, %v", got, err)
	}
}

func TestThresholdIsAtMostWhatAMessageTakes(t *testing.T) {
	for _, tt := range []struct{ set, want int }{
		{0, 1<<20 - claim.DefaultHeaderMargin},
		{1000, 1000},
		{2 << 20, 1<<20 - claim.DefaultHeaderMargin},
	} {
		s, _, _, _ := newFakes(tt.set)
		if got := s.Threshold(); got != tt.want {
			t.Errorf("threshold %d: %d, want %d", tt.set, got, tt.want)
		}
	}
}

// fullSink has every optional interface the relay looks for on its sink.
type fullSink struct{ fakeSink }

func (fullSink) ErrorCode(error) string               { return "" }
func (fullSink) PartitionOf(*relay.Msg) (int32, bool) { return 0, false }
func (fullSink) EndTxn(relay.TxnEnd)                  {}
func (fullSink) TxnOpen() bool                        { return false }
func (fullSink) StoredIdentity(context.Context, string, uint64) (string, string, error) {
	return "", "", nil
}

// TestAsSinkKeepsEveryOptionalInterface: the relay acts on which optional
// interfaces its sink has (resume checks, error codes, where transactions
// end), so the claim check's wrap must keep each one the wrapped sink has.
// Hiding relay.TxnSink once held every event of an atomic batch forever.
func TestAsSinkKeepsEveryOptionalInterface(t *testing.T) {
	var log []string
	s := claim.New(&fullSink{fakeSink{log: &log}}, &fakeStore{log: &log, objs: map[string][]byte{}},
		claim.Options{Threshold: 1 << 10, Logger: zerolog.Nop()}).AsSink()
	if _, ok := s.(relay.ErrorCoder); !ok {
		t.Error("relay.ErrorCoder lost")
	}
	if _, ok := s.(relay.Partitioner); !ok {
		t.Error("relay.Partitioner lost")
	}
	if _, ok := s.(relay.DuplicateChecker); !ok {
		t.Error("relay.DuplicateChecker lost")
	}
	if _, ok := s.(relay.TxnSink); !ok {
		t.Error("relay.TxnSink lost")
	}
}

func jetstreamConfig(name string) jetstream.StreamConfig {
	return jetstream.StreamConfig{Name: name, Subjects: []string{strings.ToLower(name) + ".>"}, Storage: jetstream.MemoryStorage}
}
