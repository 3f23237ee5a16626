package claim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"maps"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
)

// StoreS3 names an S3-compatible bucket in a Ref.
const StoreS3 = "s3"

// S3Store is a Store in an S3-compatible bucket, through minio-go: the
// Kafka sink's (Kafka has no object store of its own). The bucket must
// exist. The Sweeper (NewS3Sweeper) deletes the objects whose message
// is gone.
type S3Store struct {
	c        *minio.Client
	bucket   string
	prefix   string
	maxBytes int64
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

// ObjectKey is where key's object is in the bucket: under the prefix.
func (s *S3Store) ObjectKey(key string) string {
	if s.prefix == "" {
		return key
	}
	return s.prefix + "/" + key
}

// Put implements Store: the object's name is ObjectKey(key). S3 refuses
// an object above its own limit (5 TiB) with EntityTooLarge: refused for
// itself too.
func (s *S3Store) Put(ctx context.Context, key string, data []byte, meta map[string]string) (string, error) {
	if s.maxBytes > 0 && int64(len(data)) > s.maxBytes {
		return "", fmt.Errorf("%w: the payload of %d bytes is larger than claim_check.max_bytes of %d", ErrRefused, len(data), s.maxBytes)
	}
	_, err := s.c.PutObject(ctx, s.bucket, s.ObjectKey(key), bytes.NewReader(data), int64(len(data)),
		minio.PutObjectOptions{ContentType: "application/json", UserMetadata: written(meta)})
	if minio.ToErrorResponse(err).Code == "EntityTooLarge" {
		return "", fmt.Errorf("%w: s3://%s/%s: %v", ErrRefused, s.bucket, s.ObjectKey(key), err)
	}
	if err != nil {
		return "", fmt.Errorf("put s3://%s/%s: %w", s.bucket, s.ObjectKey(key), err)
	}
	return s.ObjectKey(key), nil
}

// Get reads the object under key (tests and tools).
func (s *S3Store) Get(ctx context.Context, key string) ([]byte, error) {
	obj, err := s.c.GetObject(ctx, s.bucket, s.ObjectKey(key), minio.GetObjectOptions{})
	if err != nil {
		return nil, fmt.Errorf("get s3://%s/%s: %w", s.bucket, s.ObjectKey(key), err)
	}
	defer obj.Close()
	var b bytes.Buffer
	if _, err := b.ReadFrom(obj); err != nil {
		return nil, fmt.Errorf("get s3://%s/%s: %w", s.bucket, s.ObjectKey(key), err)
	}
	return b.Bytes(), nil
}

// list implements sweepable: every object under the prefix. A listing
// carries no user metadata: streamOf reads it for the objects old enough
// to matter.
func (s *S3Store) list(ctx context.Context) ([]storedObject, error) {
	prefix := ""
	if s.prefix != "" {
		prefix = s.prefix + "/"
	}
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
// of now: an upload (or a replay's renewal) since the listing counts, and
// only the moment between this HEAD and the delete is left for one to
// slip in. An object gone since the listing is kept (nothing to delete).
func (s *S3Store) streamOf(ctx context.Context, o storedObject) (storedObject, error) {
	info, err := s.c.StatObject(ctx, s.bucket, o.name, minio.StatObjectOptions{})
	if minio.ToErrorResponse(err).Code == "NoSuchKey" {
		o.stream = ""
		return o, nil
	}
	if err != nil {
		return o, fmt.Errorf("stat s3://%s/%s: %w", s.bucket, o.name, err)
	}
	o.stream, o.modTime, o.version = userMeta(info, MetaStream), info.LastModified, s3Version(info)
	return o, nil
}

// s3Version tells one upload or renewal of an object from another.
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

// remove implements sweepable. S3 (and minio-go) has no delete on a
// condition, so the object is read again right before its delete, and
// kept when an upload or a replay's renewal (Reuse) replaced the version
// streamOf read: that leaves one request's round trip, between this HEAD
// and the DELETE, for a renewal to slip in and lose its object (the
// JetStream store has no such window: its delete is conditional).
// TestS3SweepKeepsAnObjectRenewedSinceItsListing.
func (s *S3Store) remove(ctx context.Context, o storedObject) (bool, error) {
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
	if err := s.c.RemoveObject(ctx, s.bucket, o.name, minio.RemoveObjectOptions{}); err != nil {
		return false, fmt.Errorf("delete s3://%s/%s: %w", s.bucket, o.name, err)
	}
	return true, nil
}

// written is meta with MetaWritten set to now.
func written(meta map[string]string) map[string]string {
	out := make(map[string]string, len(meta)+1)
	maps.Copy(out, meta)
	out[MetaWritten] = time.Now().UTC().Format(time.RFC3339Nano)
	return out
}

// resolution implements sweepable: S3 lists Last-Modified to the second.
func (s *S3Store) resolution() time.Duration { return time.Second }

// Reuse implements Reuser. The object is intact when it has size bytes
// and its MetaSHA256 metadata (written in the same PutObject as its
// bytes) is sum, or, without that metadata, when its bytes hash to sum.
// The renewal is a server-side copy of the object onto itself with its
// metadata replaced: S3 gives the copy a new Last-Modified (and lifecycle
// rules count from it) without the bytes passing through walbox.
func (s *S3Store) Reuse(ctx context.Context, key string, size int64, sum [sha256.Size]byte, meta map[string]string) (string, bool, error) {
	ok, err := s.renew(ctx, key, size, sum, meta)
	if err != nil || !ok {
		return "", false, err
	}
	return s.ObjectKey(key), true, nil
}

// renew is Reuse's check and renewal of key's object.
func (s *S3Store) renew(ctx context.Context, key string, size int64, sum [sha256.Size]byte, meta map[string]string) (bool, error) {
	name := s.ObjectKey(key)
	info, err := s.c.StatObject(ctx, s.bucket, name, minio.StatObjectOptions{})
	if minio.ToErrorResponse(err).Code == "NoSuchKey" {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat s3://%s/%s: %w", s.bucket, name, err)
	}
	want := hex.EncodeToString(sum[:])
	if info.Size != size {
		return false, nil
	}
	if got := userMeta(info, MetaSHA256); got != "" && got != want {
		return false, nil
	} else if got == "" {
		obj, err := s.c.GetObject(ctx, s.bucket, name, minio.GetObjectOptions{})
		if err != nil {
			return false, fmt.Errorf("read s3://%s/%s: %w", s.bucket, name, err)
		}
		h := sha256.New()
		_, err = io.Copy(h, obj)
		obj.Close()
		if err != nil {
			return false, fmt.Errorf("read s3://%s/%s: %w", s.bucket, name, err)
		}
		if hex.EncodeToString(h.Sum(nil)) != want {
			return false, nil
		}
	}
	_, err = s.c.CopyObject(ctx, minio.CopyDestOptions{Bucket: s.bucket, Object: name, ReplaceMetadata: true, UserMetadata: written(meta), ContentType: "application/json"},
		minio.CopySrcOptions{Bucket: s.bucket, Object: name})
	if err != nil {
		return false, fmt.Errorf("renew s3://%s/%s (copy onto itself): %w", s.bucket, name, err)
	}
	return true, nil
}

// purgePartials implements partialPurger: it aborts the multipart uploads
// under the prefix begun before before. Such an upload never became an
// object (S3 shows an object only once its upload completes), but its
// parts are stored, and billed, until it is aborted; an upload in
// progress is younger than the upload timeout, which before must lie in
// the past. minio-go aborts a failed upload's parts itself when it still
// can; a relay killed mid-upload leaves them.
func (s *S3Store) purgePartials(ctx context.Context, _ map[string]bool, before time.Time) (int, error) {
	prefix := ""
	if s.prefix != "" {
		prefix = s.prefix + "/"
	}
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
