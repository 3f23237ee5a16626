package consumer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// HeaderClaimCheck marks an event whose payload walbox stored apart
// (claim_check in walbox's config): the message's body is empty and the
// header's value, a URL query, says where the payload is:
//
//	store=jetstream&bucket=ORDERS_CLAIMS&key=<source>%2F<table>%2F<id>&size=8388608&sha256=<hex>
//
// Read the object the key names: in S3 (store=s3) each upload has a name
// of its own, <prefix>/<source>/<table>/<id>/<UUIDv7>, which only the
// reference tells.
const HeaderClaimCheck = "Walbox-Claim-Check"

// ClaimCheck is a claim-check reference: the payload is the object Key in
// the JetStream Object Store bucket Bucket, Size bytes with this SHA-256.
type ClaimCheck struct {
	Store  string // "jetstream"
	Bucket string
	Key    string
	Size   int64
	SHA256 string // lower-case hex
}

// Errors of FetchClaim about the object itself: no retry cures them, Run
// dead-letters the event.
var (
	ErrClaimMissing = errors.New("claim-check object missing")
	ErrClaimCorrupt = errors.New("claim-check object corrupt")
)

// ParseClaimCheck reads h's claim-check reference: nil when h has none.
func ParseClaimCheck(h nats.Header) (*ClaimCheck, error) {
	v := h.Get(HeaderClaimCheck)
	if v == "" {
		return nil, nil
	}
	q, err := url.ParseQuery(v)
	if err != nil {
		return nil, fmt.Errorf("parse %s header %q: %w", HeaderClaimCheck, v, err)
	}
	c := &ClaimCheck{Store: q.Get("store"), Bucket: q.Get("bucket"), Key: q.Get("key"), SHA256: q.Get("sha256")}
	if c.Size, err = strconv.ParseInt(q.Get("size"), 10, 64); err != nil || c.Size < 0 {
		return nil, fmt.Errorf("parse %s header %q: bad size", HeaderClaimCheck, v)
	}
	if c.Bucket == "" || c.Key == "" || len(c.SHA256) != 64 {
		return nil, fmt.Errorf("parse %s header %q: bucket, key and a 64-digit sha256 are required", HeaderClaimCheck, v)
	}
	return c, nil
}

// A claim-check object's fetch may take claimFetchBase plus its size at
// the minimum rate (DefaultClaimMinRate, or WithMinRate): 74 s for 64 MiB.
// nats.go bounds a whole object's read by the JetStream default timeout (5
// s) when the context has no deadline, so an object that takes longer to
// arrive (64 MiB below 13 MB/s) would fail on every delivery; and a read
// blocked on a stalled object wakes only at its deadline (nats.go's reader
// holds its lock while it waits, so it cannot be cancelled sooner). So the
// deadline grows with the object.
const (
	claimFetchBase      = 10 * time.Second
	DefaultClaimMinRate = 1 << 20 // bytes a second
)

// FetchOpt is an option of FetchClaim.
type FetchOpt func(*fetchOpts)

type fetchOpts struct{ minRate int64 }

// WithMinRate sets the slowest transfer, in bytes a second, a fetch is
// given time for (default DefaultClaimMinRate; 0 keeps it).
func WithMinRate(bytesPerSecond int64) FetchOpt {
	return func(o *fetchOpts) {
		if bytesPerSecond > 0 {
			o.minRate = bytesPerSecond
		}
	}
}

// claimFetchTimeout is how long the fetch of an object of size bytes may
// take at minRate.
func claimFetchTimeout(size, minRate int64) time.Duration {
	return claimFetchBase + time.Duration(float64(max(size, 0))/float64(minRate)*float64(time.Second))
}

// FetchClaim reads the payload c names from js's Object Store and checks
// its size and SHA-256. eventID names the event in the errors. An object
// that is gone wraps ErrClaimMissing, one whose bytes do not match wraps
// ErrClaimCorrupt; any other error is the store's of the moment. The read
// ends with ctx, or once it has taken 10 s plus the object's size at the
// minimum rate (WithMinRate).
func FetchClaim(ctx context.Context, js jetstream.JetStream, eventID string, c *ClaimCheck, opts ...FetchOpt) ([]byte, error) {
	if c.Store != "" && c.Store != "jetstream" {
		return nil, fmt.Errorf("event %s: claim-check store %q is not the JetStream Object Store: fetch object %s of bucket %s yourself", eventID, c.Store, c.Key, c.Bucket)
	}
	o := fetchOpts{minRate: DefaultClaimMinRate}
	for _, opt := range opts {
		opt(&o)
	}
	limit := claimFetchTimeout(c.Size, o.minRate)
	fctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	obs, err := js.ObjectStore(fctx, c.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("event %s: %w: bucket %s does not exist (object %s)", eventID, ErrClaimMissing, c.Bucket, c.Key)
	}
	if err != nil {
		return nil, fmt.Errorf("event %s: open claim-check bucket %s: %w", eventID, c.Bucket, err)
	}
	var read int64
	data, err := readObject(fctx, obs, c, &read)
	switch {
	case errors.Is(err, jetstream.ErrObjectNotFound):
		return nil, fmt.Errorf("event %s: %w: no object %s in bucket %s (deleted, or expired with the bucket's TTL)", eventID, ErrClaimMissing, c.Key, c.Bucket)
	case errors.Is(err, jetstream.ErrDigestMismatch):
		return nil, fmt.Errorf("event %s: %w: object %s in bucket %s: %v", eventID, ErrClaimCorrupt, c.Key, c.Bucket, err)
	case err != nil && ctx.Err() == nil && (fctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, nats.ErrTimeout)):
		// The limit passed: nats.go's reader waits on its pipe until
		// fctx's deadline and, when the pipe's timer fires before the
		// context's, returns the pipe's "i/o timeout" with fctx not yet
		// done; both deadlines are this fetch's limit.
		return nil, fmt.Errorf("event %s: read claim-check object %s from bucket %s: %d of %d bytes arrived in %v (10 s plus its size at %d bytes/s; consumer.Config.ClaimMinRate sets the rate): %w",
			eventID, c.Key, c.Bucket, read, c.Size, limit, o.minRate, err)
	case err != nil:
		return nil, fmt.Errorf("event %s: read claim-check object %s from bucket %s: %w", eventID, c.Key, c.Bucket, err)
	}
	sum := sha256.Sum256(data)
	if int64(len(data)) != c.Size || hex.EncodeToString(sum[:]) != c.SHA256 {
		return nil, fmt.Errorf("event %s: %w: object %s in bucket %s has %d bytes with sha256 %x; the reference says %d bytes, sha256 %s (overwritten by another event with the same identity?)",
			eventID, ErrClaimCorrupt, c.Key, c.Bucket, len(data), sum, c.Size, c.SHA256)
	}
	return data, nil
}

// readObject reads c's object from obs into a buffer of the reference's
// size (at most 256 MiB ahead: the size is the header's word), counting
// the bytes read in *read.
func readObject(ctx context.Context, obs jetstream.ObjectStore, c *ClaimCheck, read *int64) ([]byte, error) {
	res, err := obs.Get(ctx, c.Key)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	buf := bytes.NewBuffer(make([]byte, 0, min(max(c.Size, 0), 256<<20)+bytes.MinRead))
	n, err := buf.ReadFrom(res)
	*read = n
	if err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
