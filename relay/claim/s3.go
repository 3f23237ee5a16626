package claim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/minio/minio-go/v7"
)

// StoreS3 names an S3-compatible bucket in a Ref.
const StoreS3 = "s3"

// S3Store is a Store in an S3-compatible bucket, through minio-go: the
// Kafka sink's (Kafka has no object store of its own). The bucket must
// exist. The Sweeper (NewS3Sweeper) deletes the objects whose message
// is gone.
//
// Every upload (Put) and every renewal (Reuse) writes an object under a
// name of its own, the event's key, "/" and a UUIDv7 (uniqueName), which
// no other upload or renewal ever writes, and the message's Ref names
// that object. S3 has no delete on a condition: with one name per event,
// a renewal or a resend landing between the sweep's last read of an
// object and its DELETE would lose the object the new message names. With
// a name per upload, an object's only message is the one published right
// after its own upload or copy, so the sweep's rule holds for it with no
// race. The cost: each upload attempt, and each replay, leaves one object
// more until the sweep deletes the older ones with their messages.
type S3Store struct {
	c        *minio.Client
	bucket   string
	prefix   string
	maxBytes int64

	// beforeDelete, when set (tests), runs in remove right before the
	// DELETE of the object named; beforeRenew in Reuse between its check
	// of an intact object and the copy.
	beforeDelete func(name string)
	beforeRenew  func()
}

// NewS3Store stores objects in bucket under prefix ("" for none); an
// object larger than maxBytes (0: no limit) is refused. minio-go uploads
// a large one in parts, and the object appears only once every part is
// stored: a confirmed Put is a whole object.
func NewS3Store(c *minio.Client, bucket, prefix string, maxBytes int64) *S3Store {
	return &S3Store{c: c, bucket: bucket, prefix: strings.Trim(prefix, "/"), maxBytes: maxBytes}
}

// Kind implements Store.
func (s *S3Store) Kind() string { return StoreS3 }

// Bucket implements Store.
func (s *S3Store) Bucket() string { return s.bucket }

// eventName is key (an event's identity, Key) under the prefix: the name
// older walbox versions stored the event's object under, and the folder
// of the names this one stores it under (fresh).
func (s *S3Store) eventName(key string) string {
	if s.prefix == "" {
		return key
	}
	return s.prefix + "/" + key
}

// listPrefix is what every name in the store begins with: the prefix and
// "/", or "" without a prefix.
func (s *S3Store) listPrefix() string {
	if s.prefix == "" {
		return ""
	}
	return s.prefix + "/"
}

// fresh is a name for a new object of key: eventName(key), "/", and a
// UUIDv7. A UUIDv7 is 48 bits of milliseconds and 74 random bits: unique
// across relays, CLI runs and restarts without any coordination or state
// (a counter or a nuid's sequence would restart with the process, or need
// one per writer), and its text sorts by time, so that the names of an
// event's objects list oldest first.
func (s *S3Store) fresh(key string) (string, error) {
	u, err := uuid.NewV7()
	if err != nil {
		return "", fmt.Errorf("name a new object of %s: %w", key, err)
	}
	return s.eventName(key) + "/" + u.String(), nil
}

// uniqueName reports whether name is one that fresh made for the event
// eventID (an object's MetaEventID), rather than the event's bare key
// (eventName) that an older walbox stored, and may still store again or
// renew in place. An event whose id is itself a UUIDv7 has the bare name
// <...>/<id>, which the id tells apart from <...>/<id>/<UUIDv7>.
func uniqueName(name, eventID string) bool {
	base, suffix, ok := cutLast(name)
	if !ok || eventID == "" || (base != eventID && !strings.HasSuffix(base, "/"+eventID)) {
		return false
	}
	return isUUIDv7(suffix)
}

// cutLast splits name at its last "/".
func cutLast(name string) (before, after string, ok bool) {
	i := strings.LastIndexByte(name, '/')
	if i < 0 {
		return "", name, false
	}
	return name[:i], name[i+1:], true
}

// isUUIDv7 reports whether s is a UUIDv7 as fresh writes it.
func isUUIDv7(s string) bool {
	u, err := uuid.Parse(s)
	return err == nil && u.Version() == 7 && u.String() == s
}

// Put implements Store: the payload goes to a fresh name, which Put
// returns. S3 refuses an object above its own limit (5 TiB) with
// EntityTooLarge: refused for itself too.
func (s *S3Store) Put(ctx context.Context, key string, data []byte, meta map[string]string) (string, error) {
	if s.maxBytes > 0 && int64(len(data)) > s.maxBytes {
		return "", fmt.Errorf("%w: the payload of %d bytes is larger than claim_check.max_bytes of %d", ErrRefused, len(data), s.maxBytes)
	}
	name, err := s.fresh(key)
	if err != nil {
		return "", err
	}
	_, err = s.c.PutObject(ctx, s.bucket, name, bytes.NewReader(data), int64(len(data)),
		minio.PutObjectOptions{ContentType: "application/json", UserMetadata: meta})
	if minio.ToErrorResponse(err).Code == "EntityTooLarge" {
		return "", fmt.Errorf("%w: s3://%s/%s: %v", ErrRefused, s.bucket, name, err)
	}
	if err != nil {
		return "", fmt.Errorf("put s3://%s/%s: %w", s.bucket, name, err)
	}
	return name, nil
}

// Get reads the object named name in the bucket, as a Ref's Key names it
// (tests and tools).
func (s *S3Store) Get(ctx context.Context, name string) ([]byte, error) {
	obj, err := s.c.GetObject(ctx, s.bucket, name, minio.GetObjectOptions{})
	if err != nil {
		return nil, fmt.Errorf("get s3://%s/%s: %w", s.bucket, name, err)
	}
	defer obj.Close()
	var b bytes.Buffer
	if _, err := b.ReadFrom(obj); err != nil {
		return nil, fmt.Errorf("get s3://%s/%s: %w", s.bucket, name, err)
	}
	return b.Bytes(), nil
}

// list implements sweepable: every object under the prefix. A listing
// carries no user metadata: streamOf reads it for the objects old enough
// to matter.
func (s *S3Store) list(ctx context.Context) ([]storedObject, error) {
	prefix := s.listPrefix()
	var out []storedObject
	for o := range s.c.ListObjects(ctx, s.bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
		if o.Err != nil {
			return nil, fmt.Errorf("list s3://%s/%s: %w", s.bucket, prefix, o.Err)
		}
		out = append(out, storedObject{name: o.Key, size: o.Size, modTime: o.LastModified})
	}
	return out, nil
}

// streamOf implements sweepable: the object's MetaStream metadata ("" for
// an object walbox did not write, which is kept), and its Last-Modified as
// of now. An object gone since the listing is kept (nothing to delete).
// An object under an event's bare key (not uniqueName) also gets its
// version, which remove checks (see there).
func (s *S3Store) streamOf(ctx context.Context, o storedObject) (storedObject, error) {
	info, err := s.c.StatObject(ctx, s.bucket, o.name, minio.StatObjectOptions{})
	if minio.ToErrorResponse(err).Code == "NoSuchKey" {
		o.stream = ""
		return o, nil
	}
	if err != nil {
		return o, fmt.Errorf("stat s3://%s/%s: %w", s.bucket, o.name, err)
	}
	o.stream, o.modTime, o.version = userMeta(info, MetaStream), info.LastModified, ""
	if !uniqueName(o.name, userMeta(info, MetaEventID)) {
		o.version = s3Version(info)
	}
	return o, nil
}

// s3Version tells one upload or renewal of an object under an event's
// bare key from another: an older walbox copies such an object onto
// itself to renew it, which keeps its ETag and may keep its Last-Modified
// second, but sets MetaWritten.
func s3Version(info minio.ObjectInfo) string {
	return info.ETag + "/" + userMeta(info, MetaWritten) + "/" + info.LastModified.String()
}

// userMeta is the user metadata key of info (minio-go canonicalizes the
// keys' case).
func userMeta(info minio.ObjectInfo, key string) string {
	for k, v := range info.UserMetadata {
		if strings.EqualFold(k, key) {
			return v
		}
	}
	return ""
}

// remove implements sweepable. An object under a name of its own
// (uniqueName) is deleted at once: no upload or renewal ever writes its
// name again, so the only message that can name it is the one the sweep
// found gone. TestS3SweepKeepsWhatARenewalOrUploadInItsLastMomentNames.
//
// An object under an event's bare key was written by an older walbox, and
// during a rolling upgrade (or from an older walbox binary's replay or
// dlq retry, which may outlive it) such a relay can still upload or renew
// it in place and publish a message naming it. For those objects the
// check of the older versions stays: the object is read again right
// before its delete and kept when its version changed since streamOf read
// it; one request's round trip, between this HEAD and the DELETE, is left
// for such an old writer to slip in. It costs one HEAD per deleted
// bare-key object, of which there are fewer every sweep.
// TestS3SweepKeepsAnObjectRenewedSinceItsListing.
func (s *S3Store) remove(ctx context.Context, o storedObject) (bool, error) {
	if o.version != "" {
		info, err := s.c.StatObject(ctx, s.bucket, o.name, minio.StatObjectOptions{})
		if minio.ToErrorResponse(err).Code == "NoSuchKey" {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("stat s3://%s/%s: %w", s.bucket, o.name, err)
		}
		if s3Version(info) != o.version {
			return false, nil
		}
	}
	if s.beforeDelete != nil {
		s.beforeDelete(o.name)
	}
	if err := s.c.RemoveObject(ctx, s.bucket, o.name, minio.RemoveObjectOptions{}); err != nil {
		return false, fmt.Errorf("delete s3://%s/%s: %w", s.bucket, o.name, err)
	}
	return true, nil
}

// resolution implements sweepable: S3 lists Last-Modified to the second.
func (s *S3Store) resolution() time.Duration { return time.Second }

// Reuse implements Reuser. It looks for an intact object of the event key:
// among the names fresh made for it, newest first (the least likely to be
// swept meanwhile), then under its bare key (an older walbox's). An object
// is intact when it has size bytes and its MetaSHA256 metadata (written in
// the same request as its bytes) is sum, or, without that metadata, when
// its bytes hash to sum. The renewal is a server-side copy of the intact
// object to a fresh name with meta: a new object, which S3 dates from now
// (and lifecycle rules count from), without the bytes passing through
// walbox, and the name Reuse returns for the Ref. A copy is whole or
// absent: when the sweep deleted the source meanwhile, the copy fails with
// NoSuchKey and Reuse returns false (the caller uploads afresh).
func (s *S3Store) Reuse(ctx context.Context, key string, size int64, sum [sha256.Size]byte, meta map[string]string) (string, bool, error) {
	want := hex.EncodeToString(sum[:])
	src, err := s.intactObject(ctx, key, size, want)
	if err != nil || src == "" {
		return "", false, err
	}
	name, err := s.fresh(key)
	if err != nil {
		return "", false, err
	}
	if s.beforeRenew != nil {
		s.beforeRenew()
	}
	_, err = s.c.CopyObject(ctx, minio.CopyDestOptions{Bucket: s.bucket, Object: name, ReplaceMetadata: true, UserMetadata: meta, ContentType: "application/json"},
		minio.CopySrcOptions{Bucket: s.bucket, Object: src})
	if minio.ToErrorResponse(err).Code == "NoSuchKey" {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("renew s3://%s/%s (copy to s3://%s/%s): %w", s.bucket, src, s.bucket, name, err)
	}
	return name, true, nil
}

// intactObject is the name of an intact object of key (see Reuse), ""
// when there is none.
func (s *S3Store) intactObject(ctx context.Context, key string, size int64, want string) (string, error) {
	base := s.eventName(key)
	var names []string
	for o := range s.c.ListObjects(ctx, s.bucket, minio.ListObjectsOptions{Prefix: base + "/"}) {
		if o.Err != nil {
			return "", fmt.Errorf("list s3://%s/%s/: %w", s.bucket, base, o.Err)
		}
		if isUUIDv7(strings.TrimPrefix(o.Key, base+"/")) && o.Size == size {
			names = append(names, o.Key)
		}
	}
	slices.Reverse(names) // a listing is in name order: UUIDv7s oldest first
	names = append(names, base)
	for _, name := range names {
		ok, err := s.intact(ctx, name, size, want)
		if err != nil {
			return "", err
		}
		if ok {
			return name, nil
		}
	}
	return "", nil
}

// intact reports whether the object name has size bytes with the SHA-256
// want (hex), by its MetaSHA256 metadata or else by its bytes; false when
// it is gone.
func (s *S3Store) intact(ctx context.Context, name string, size int64, want string) (bool, error) {
	info, err := s.c.StatObject(ctx, s.bucket, name, minio.StatObjectOptions{})
	if minio.ToErrorResponse(err).Code == "NoSuchKey" {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat s3://%s/%s: %w", s.bucket, name, err)
	}
	if info.Size != size {
		return false, nil
	}
	if got := userMeta(info, MetaSHA256); got != "" {
		return got == want, nil
	}
	obj, err := s.c.GetObject(ctx, s.bucket, name, minio.GetObjectOptions{})
	if err != nil {
		return false, fmt.Errorf("read s3://%s/%s: %w", s.bucket, name, err)
	}
	defer obj.Close()
	h := sha256.New()
	if _, err := io.Copy(h, obj); err != nil {
		if minio.ToErrorResponse(err).Code == "NoSuchKey" {
			return false, nil
		}
		return false, fmt.Errorf("read s3://%s/%s: %w", s.bucket, name, err)
	}
	return hex.EncodeToString(h.Sum(nil)) == want, nil
}

// purgePartials implements partialPurger: it aborts the multipart uploads
// under the prefix begun before before. Such an upload never became an
// object (S3 shows an object only once its upload completes), but its
// parts are stored, and billed, until it is aborted; an upload in
// progress is younger than the upload timeout, which before must lie in
// the past. minio-go aborts a failed upload's parts itself when it still
// can; a relay killed mid-upload leaves them.
func (s *S3Store) purgePartials(ctx context.Context, _ map[string]bool, before time.Time) (int, error) {
	prefix := s.listPrefix()
	core := minio.Core{Client: s.c}
	n := 0
	for u := range s.c.ListIncompleteUploads(ctx, s.bucket, prefix, true) {
		if minio.ToErrorResponse(u.Err).Code == "NoSuchUpload" {
			// Some S3-compatible servers answer a listing so when the
			// bucket never had a multipart upload: none to abort.
			break
		}
		if u.Err != nil {
			return n, fmt.Errorf("list the unfinished uploads of s3://%s/%s: %w", s.bucket, prefix, u.Err)
		}
		if !u.Initiated.Add(s.resolution()).Before(before) {
			continue
		}
		if err := core.AbortMultipartUpload(ctx, s.bucket, u.Key, u.UploadID); err != nil {
			return n, fmt.Errorf("abort the unfinished upload %s of s3://%s/%s: %w", u.UploadID, s.bucket, u.Key, err)
		}
		n++
	}
	return n, nil
}
