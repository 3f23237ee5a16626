// Package claim is walbox's claim check: an event whose payload is larger
// than the broker takes in one message is stored in an object store first,
// as an object of the event's identity (Key), and its message carries a
// reference (the Walbox-Claim-Check header) with an empty body, naming the
// object the store wrote.
//
// Invariants:
//   - The object is written and confirmed by the store before the message is
//     published (Sink.Publish uploads, then hands the message on), so a
//     message never names an object that was not stored; the relay confirms
//     the event's LSN only on the message's ack, so after both.
//   - The store chooses the object's name, and the Ref carries it: readers
//     use Ref.Key, never a key rebuilt from the event's identity. In the
//     JetStream Object Store the name is the identity (source/table/id), and
//     a resend after a crash or a failure overwrites the same object with
//     the same bytes (its sweep's delete and a renewal are conditional, so
//     they cannot both win). In S3 every upload and every renewal writes a
//     name of its own, the identity, "/" and a UUIDv7, that nothing writes
//     again (S3 has no conditional delete; see S3Store); a resend leaves the
//     earlier attempt's object to the sweep.
//   - Every publish attempt uploads again (or, for a replay, renews an
//     intact object: Reuser), so an object is never older than the last
//     attempt to publish a message naming it: the retention sweep (Sweeper)
//     relies on it to delete only objects whose message the stream no
//     longer holds, or never got.
package claim

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"

	"github.com/walbox/walbox/relay"
)

// Header is the message header that carries a Ref.
const Header = relay.HeaderClaimCheck

// StoreJetStream names the JetStream Object Store in a Ref.
const StoreJetStream = "jetstream"

// Ref is a claim-check reference: where the payload is and how to check it.
// On the wire it is a URL query, e.g.
//
//	store=jetstream&bucket=ORDERS_CLAIMS&key=app%2Fwalbox%2Fpublic.outbox_events%2F42&size=8388608&sha256=9f86...
//
// (keys in this order; a reader ignores keys it does not know).
type Ref struct {
	Store  string // StoreJetStream or StoreS3
	Bucket string
	Key    string // the object's name in the bucket, as the store wrote it
	Size   int64
	SHA256 string // lower-case hex
}

// String is r as the header's value.
func (r Ref) String() string {
	return "store=" + url.QueryEscape(r.Store) + "&bucket=" + url.QueryEscape(r.Bucket) + "&key=" + url.QueryEscape(r.Key) +
		"&size=" + strconv.FormatInt(r.Size, 10) + "&sha256=" + r.SHA256
}

// ParseRef reads a Walbox-Claim-Check header value.
func ParseRef(v string) (Ref, error) {
	q, err := url.ParseQuery(v)
	if err != nil {
		return Ref{}, fmt.Errorf("parse %s header %q: %w", Header, v, err)
	}
	r := Ref{Store: q.Get("store"), Bucket: q.Get("bucket"), Key: q.Get("key"), SHA256: q.Get("sha256")}
	if r.Size, err = strconv.ParseInt(q.Get("size"), 10, 64); err != nil || r.Size < 0 {
		return Ref{}, fmt.Errorf("parse %s header %q: bad size", Header, v)
	}
	if r.Store == "" || r.Bucket == "" || r.Key == "" || len(r.SHA256) != 64 {
		return Ref{}, fmt.Errorf("parse %s header %q: store, bucket, key and a 64-digit sha256 are required", Header, v)
	}
	return r, nil
}

// Key is an event's identity (source, table, id) as walbox's headers carry
// it, source/table/id: what a store names the event's objects by (Store.Put).
func Key(source, table, id string) string { return source + "/" + table + "/" + id }

// ErrRefused marks a store's refusal of an object for itself (larger than
// the bucket can ever hold): the event is dead-lettered with the reason.
// Any other store error is transient: the event waits, in order.
var ErrRefused = errors.New("the claim-check store refuses the object")
