package claim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Store keeps payloads apart from their messages.
type Store interface {
	// Kind and Bucket are the store's names in a Ref.
	Kind() string
	Bucket() string
	// Put stores data as an object of key (an event's identity, Key) and
	// returns, once the store has confirmed it, the object's name in the
	// bucket: the Ref's key, which the store chooses (JetStream: key
	// itself, replacing what it held; S3: a name of the upload's own).
	// meta travels with the object (the stream its message goes to, for
	// the retention sweep). An error wrapping ErrRefused means the store
	// will never take it.
	Put(ctx context.Context, key string, data []byte, meta map[string]string) (string, error)
}

// Object metadata walbox sets (ObjectMeta.Metadata; S3 user metadata).
const (
	MetaStream  = "walbox-stream"
	MetaEventID = "walbox-event-id"
	// MetaWritten is when an older walbox uploaded or renewed an S3
	// object under its event's bare key (RFC 3339, nanoseconds). This
	// version writes none (each of its objects has a name of its own and
	// is never written twice); the sweep reads it to tell an older
	// relay's renewal of a bare-key object from the upload it listed
	// (s3Version), where Last-Modified has only seconds and a copy onto
	// itself keeps the ETag.
	MetaWritten = "walbox-written"
	// MetaSHA256 is the payload's SHA-256 in lower-case hex, as in a Ref.
	MetaSHA256 = "walbox-sha256"
)

// Reuser is a Store that can tell whether it already holds a payload
// intact, so that a replay publishes a reference to it without uploading
// it (Options.ReuseIntact).
type Reuser interface {
	// Reuse reports whether the store holds an object of key that is
	// exactly size bytes with the SHA-256 sum and, renewed, will be kept
	// at least as long as a message published now to meta[MetaStream].
	// When it does, Reuse renews it without sending its bytes, with meta
	// (JetStream: the object itself, with a new modification time; S3: a
	// server-side copy under a name of its own), so that the retention
	// sweep, which reads the modification time as the last attempt to
	// publish the object's message (Sweeper), keeps it for the new
	// message, and returns the renewed object's name for the Ref. false
	// means: upload it.
	Reuse(ctx context.Context, key string, size int64, sum [sha256.Size]byte, meta map[string]string) (name string, reused bool, err error)
}

// reuseMargin is how much longer than a message published now may live an
// object must be kept to be reused: the ack timeout and the clocks.
const reuseMargin = 10 * time.Minute

// BucketSpec is the JetStream Object Store bucket walbox keeps payloads in.
type BucketSpec struct {
	Name     string
	Replicas int
	// TTL is the bucket's max_age: the server deletes objects older than
	// it. It must not be shorter than the streams' max_age (the config
	// checks), or an object could go before its message.
	TTL time.Duration
	// MaxBytes bounds the bucket (0: unlimited); an object larger than it
	// is refused (ErrRefused).
	MaxBytes int64
	Storage  string // file or memory
}

// JetStreamStore is a Store in a JetStream Object Store bucket.
type JetStreamStore struct {
	js   jetstream.JetStream
	spec BucketSpec

	mu  sync.Mutex
	obs jetstream.ObjectStore

	// beforeRenew, when set (tests), runs in Reuse between its read of
	// the object's meta and its renewal.
	beforeRenew func()
}

// NewJetStreamStore returns the store of spec; Ensure creates the bucket.
func NewJetStreamStore(js jetstream.JetStream, spec BucketSpec) *JetStreamStore {
	return &JetStreamStore{js: js, spec: spec}
}

// Kind implements Store.
func (s *JetStreamStore) Kind() string { return StoreJetStream }

// Bucket implements Store.
func (s *JetStreamStore) Bucket() string { return s.spec.Name }

// Ensure creates the bucket, or updates it to spec.
func (s *JetStreamStore) Ensure(ctx context.Context) error {
	c := jetstream.ObjectStoreConfig{
		Bucket:      s.spec.Name,
		Description: "walbox claim check: payloads too large for one message",
		TTL:         s.spec.TTL,
		MaxBytes:    s.spec.MaxBytes,
		Replicas:    max(s.spec.Replicas, 1),
		Storage:     jetstream.FileStorage,
	}
	if s.spec.Storage == "memory" {
		c.Storage = jetstream.MemoryStorage
	}
	obs, err := s.js.CreateOrUpdateObjectStore(ctx, c)
	if err != nil {
		return fmt.Errorf("create or update claim-check bucket %s: %w", s.spec.Name, err)
	}
	s.mu.Lock()
	s.obs = obs
	s.mu.Unlock()
	return nil
}

// handle is the bucket's handle, looked up once.
func (s *JetStreamStore) handle(ctx context.Context) (jetstream.ObjectStore, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.obs != nil {
		return s.obs, nil
	}
	obs, err := s.js.ObjectStore(ctx, s.spec.Name)
	if err != nil {
		return nil, fmt.Errorf("open claim-check bucket %s: %w", s.spec.Name, err)
	}
	s.obs = obs
	return obs, nil
}

// Put implements Store: the object's name is key itself (the event's
// identity), and a resend replaces it. That is safe here where it is not
// in S3: the sweep's delete is conditional on the meta message it listed
// (remove), so an upload since then keeps its object. nats.go's
// ObjectStore.Put publishes the chunks and the object's meta message and
// returns only when JetStream has acked every one of them (or fails): that
// is the confirmation.
func (s *JetStreamStore) Put(ctx context.Context, key string, data []byte, meta map[string]string) (string, error) {
	if s.spec.MaxBytes > 0 && int64(len(data)) > s.spec.MaxBytes {
		return "", fmt.Errorf("%w: the payload of %d bytes is larger than bucket %s's max_bytes of %d (claim_check.max_bytes)",
			ErrRefused, len(data), s.spec.Name, s.spec.MaxBytes)
	}
	obs, err := s.handle(ctx)
	if err != nil {
		return "", err
	}
	info, err := obs.Put(ctx, jetstream.ObjectMeta{Name: key, Metadata: meta}, bytes.NewReader(data))
	if err != nil {
		return "", fmt.Errorf("put object %s in bucket %s: %w", key, s.spec.Name, err)
	}
	if info.Size != uint64(len(data)) {
		return "", fmt.Errorf("put object %s in bucket %s: stored %d bytes of %d", key, s.spec.Name, info.Size, len(data))
	}
	return key, nil
}

// Get reads the object under key (for tests and tools; consumers use the
// consumer library).
func (s *JetStreamStore) Get(ctx context.Context, key string) ([]byte, error) {
	obs, err := s.handle(ctx)
	if err != nil {
		return nil, err
	}
	b, err := obs.GetBytes(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("get object %s from bucket %s: %w", key, s.spec.Name, err)
	}
	return b, nil
}

// Objects lists the bucket's objects (none: an empty list).
func (s *JetStreamStore) Objects(ctx context.Context) ([]*jetstream.ObjectInfo, error) {
	obs, err := s.handle(ctx)
	if err != nil {
		return nil, err
	}
	list, err := obs.List(ctx)
	if errors.Is(err, jetstream.ErrNoObjectsFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list claim-check bucket %s: %w", s.spec.Name, err)
	}
	return list, nil
}

// PurgePartials purges the chunks of uploads that never completed (the
// relay killed mid-upload, or between an overwrite and its purge of the
// old chunks): chunk subjects that no object in live (NUIDs of the
// bucket's objects) names and whose newest chunk is older than before. An
// upload in progress publishes chunks continuously and names them in its
// meta message at its end, so before must lie an upload's timeout in the
// past. It returns how many uploads it purged.
func (s *JetStreamStore) PurgePartials(ctx context.Context, live map[string]bool, before time.Time) (int, error) {
	st, err := s.bucketStream(ctx)
	if err != nil {
		return 0, err
	}
	prefix := s.chunkSubject("")
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(prefix+">"))
	if err != nil {
		return 0, fmt.Errorf("list the chunks of claim-check bucket %s: %w", s.spec.Name, err)
	}
	n := 0
	for subj := range info.State.Subjects {
		if live[strings.TrimPrefix(subj, prefix)] {
			continue
		}
		last, err := st.GetLastMsgForSubject(ctx, subj)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return n, fmt.Errorf("read the newest chunk of %s: %w", subj, err)
		}
		if !last.Time.Before(before) {
			continue
		}
		if err := st.Purge(ctx, jetstream.WithPurgeSubject(subj)); err != nil {
			return n, fmt.Errorf("purge the partial upload %s: %w", subj, err)
		}
		n++
	}
	return n, nil
}

// list implements sweepable: the bucket's objects, their stream from
// their metadata.
func (s *JetStreamStore) list(ctx context.Context) ([]storedObject, error) {
	infos, err := s.Objects(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]storedObject, 0, len(infos))
	for _, o := range infos {
		if o.Deleted {
			continue
		}
		out = append(out, storedObject{name: o.Name, size: int64(o.Size), modTime: o.ModTime,
			stream: o.Metadata[MetaStream], streamKnown: true, nuid: o.NUID})
	}
	return out, nil
}

// streamOf implements sweepable (list knows every stream).
func (s *JetStreamStore) streamOf(_ context.Context, o storedObject) (storedObject, error) {
	return o, nil
}

// remove implements sweepable: it deletes o only while its meta message
// is the one the listing read, which a replay's renewal (Reuse) or a new
// upload (Put) replaces. The delete marker is published with
// Nats-Expected-Last-Subject-Sequence on the meta subject, so the server
// refuses it (10071) once the meta changed, and o's chunks are purged only
// after the marker is stored: a renewal or an upload between the listing
// and the delete keeps its object. (nats.go's ObjectStore.Delete reads the
// meta and publishes the marker unconditionally: a renewal between the two
// would lose its object's chunks.) Reuse renews under the same condition,
// so of a renewal and a delete racing, exactly one is stored.
// TestSweepKeepsAnObjectRenewedBeforeItsDelete.
func (s *JetStreamStore) remove(ctx context.Context, o storedObject) (bool, error) {
	st, err := s.bucketStream(ctx)
	if err != nil {
		return false, err
	}
	m, err := s.meta(ctx, st, o.name)
	if err != nil || m == nil {
		return false, err
	}
	if m.info.Deleted || m.info.NUID != o.nuid || !m.at.Equal(o.modTime) {
		return false, nil // deleted, replaced or renewed since the listing
	}
	marker := m.info
	marker.Deleted = true
	marker.Size, marker.Chunks, marker.Digest = 0, 0, ""
	stored, err := s.publishMeta(ctx, &marker, m.seq)
	if err != nil || !stored {
		return false, err
	}
	if err := st.Purge(ctx, jetstream.WithPurgeSubject(s.chunkSubject(o.nuid))); err != nil {
		// The object is deleted; its chunks are an upload no object names,
		// which the next sweep purges (PurgePartials).
		return true, fmt.Errorf("purge the chunks of deleted object %s in bucket %s: %w", o.name, s.spec.Name, err)
	}
	return true, nil
}

// objMeta is an object's meta message: its info, its stream sequence and
// its time (the object's modification time).
type objMeta struct {
	info jetstream.ObjectInfo
	seq  uint64
	at   time.Time
}

// meta reads name's meta message from the bucket's stream st, nil when
// there is none.
func (s *JetStreamStore) meta(ctx context.Context, st jetstream.Stream, name string) (*objMeta, error) {
	raw, err := st.GetLastMsgForSubject(ctx, s.metaSubject(name))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read object %s's meta in bucket %s: %w", name, s.spec.Name, err)
	}
	m := &objMeta{seq: raw.Sequence, at: raw.Time}
	if err := json.Unmarshal(raw.Data, &m.info); err != nil {
		return nil, fmt.Errorf("object %s's meta in bucket %s: %w", name, s.spec.Name, err)
	}
	m.info.ModTime = raw.Time
	return m, nil
}

// bucketStream is the stream holding the bucket's chunks and meta messages.
func (s *JetStreamStore) bucketStream(ctx context.Context) (jetstream.Stream, error) {
	st, err := s.js.Stream(ctx, "OBJ_"+s.spec.Name)
	if err != nil {
		return nil, fmt.Errorf("claim-check bucket %s's stream: %w", s.spec.Name, err)
	}
	return st, nil
}

// chunkSubject is the subject of the chunks of the upload nuid ("" for all:
// the prefix).
func (s *JetStreamStore) chunkSubject(nuid string) string { return "$O." + s.spec.Name + ".C." + nuid }

// metaSubject is the subject of name's meta message (nats.go's object
// store layout: the name in URL-safe base64).
func (s *JetStreamStore) metaSubject(name string) string {
	return "$O." + s.spec.Name + ".M." + base64.URLEncoding.EncodeToString([]byte(name))
}

// publishMeta stores info as its object's meta message (a rollup of the
// subject, as nats.go writes it) if the subject's last message is still
// seq; stored is false when it is not (10071: another meta came between).
func (s *JetStreamStore) publishMeta(ctx context.Context, info *jetstream.ObjectInfo, seq uint64) (stored bool, err error) {
	c := *info
	c.ModTime = time.Time{} // nats.go stores no time: the message's is the object's
	data, err := json.Marshal(&c)
	if err != nil {
		return false, fmt.Errorf("encode object %s's meta: %w", info.Name, err)
	}
	msg := nats.NewMsg(s.metaSubject(info.Name))
	msg.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupSubject)
	msg.Data = data
	_, err = s.js.PublishMsg(ctx, msg, jetstream.WithExpectLastSequencePerSubject(seq))
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("write object %s's meta in bucket %s: %w", info.Name, s.spec.Name, err)
	}
	return true, nil
}

// resolution implements sweepable: a meta message's timestamp is exact.
func (s *JetStreamStore) resolution() time.Duration { return 0 }

// Reuse implements Reuser. The object is intact when its meta message
// names size bytes with sum's digest (nats.go computed it from the bytes
// it stored, and checks it on every read) and the bucket holds all of its
// chunks. A bucket with a TTL drops the chunks by their own age, which a
// new meta message does not renew: the object is reused only when its
// first chunk, TTL later, outlives a message published now to its stream
// (that stream's max_age, plus reuseMargin); else it is uploaded afresh.
// The renewal is a new meta message, stored only while the one read is
// the last (publishMeta; see remove). The object keeps its name, key.
func (s *JetStreamStore) Reuse(ctx context.Context, key string, size int64, sum [sha256.Size]byte, meta map[string]string) (string, bool, error) {
	ok, err := s.renew(ctx, key, size, sum, meta)
	if err != nil || !ok {
		return "", false, err
	}
	return key, true, nil
}

// renew is Reuse's check and renewal of key's object.
func (s *JetStreamStore) renew(ctx context.Context, key string, size int64, sum [sha256.Size]byte, meta map[string]string) (bool, error) {
	st, err := s.bucketStream(ctx)
	if err != nil {
		return false, err
	}
	m, err := s.meta(ctx, st, key)
	if err != nil || m == nil || m.info.Deleted {
		return false, err
	}
	info := &m.info
	if int64(info.Size) != size || info.Digest != "SHA-256="+base64.URLEncoding.EncodeToString(sum[:]) {
		return false, nil
	}
	chunks := s.chunkSubject(info.NUID)
	si, err := st.Info(ctx, jetstream.WithSubjectFilter(chunks))
	if err != nil {
		return false, fmt.Errorf("count the chunks of object %s in bucket %s: %w", key, s.spec.Name, err)
	}
	if n := si.State.Subjects[chunks]; n != uint64(info.Chunks) {
		return false, nil
	}
	if ttl := si.Config.MaxAge; ttl > 0 && info.Chunks > 0 {
		first, err := st.GetMsg(ctx, 1, jetstream.WithGetMsgSubject(chunks))
		if err != nil {
			return false, fmt.Errorf("read object %s's first chunk in bucket %s: %w", key, s.spec.Name, err)
		}
		stream, err := s.js.Stream(ctx, meta[MetaStream])
		if err != nil {
			return false, fmt.Errorf("stream %s of object %s: %w", meta[MetaStream], key, err)
		}
		age := stream.CachedInfo().Config.MaxAge
		if age == 0 || !first.Time.Add(ttl).After(time.Now().Add(age+reuseMargin)) {
			return false, nil
		}
	}
	// The renewal stands only on the meta message read above: a sweep's
	// delete marker stored since then refuses it, and the payload is
	// uploaded afresh (see remove).
	renewed := *info
	renewed.Metadata = meta
	if s.beforeRenew != nil {
		s.beforeRenew()
	}
	return s.publishMeta(ctx, &renewed, m.seq)
}

// purgePartials implements partialPurger.
func (s *JetStreamStore) purgePartials(ctx context.Context, live map[string]bool, before time.Time) (int, error) {
	return s.PurgePartials(ctx, live, before)
}
