package relay

import (
	"context"
	"errors"
)

// ErrorClass says what the publisher does with a failed publish.
type ErrorClass int

const (
	// Transient errors (disconnect, timeout, no leader for the stream or
	// partition) stop reading, let the window settle, back off and resend
	// in order.
	Transient ErrorClass = iota
	// Permanent errors are the event's own fault (too large, a name the
	// broker refuses): it is dead-lettered. Nothing else is.
	Permanent
)

// ErrOrderRefused wraps a broker's refusal of a publish whose expected
// predecessor it does not hold (strict order found a gap, or another
// writer): the relay resends in order and watches for another writer.
var ErrOrderRefused = errors.New("refused: the stream's last sequence is not the expected one")

// Header is a message's headers, in the order-free form both buses carry.
// Keys are case-sensitive, as on the wire.
type Header map[string][]string

// Get returns the first value of key, or "".
func (h Header) Get(key string) string {
	if vs := h[key]; len(vs) > 0 {
		return vs[0]
	}
	return ""
}

// Values returns all values of key.
func (h Header) Values(key string) []string { return h[key] }

// Set replaces key's values with v.
func (h Header) Set(key, v string) { h[key] = []string{v} }

// Msg is one message as the relay builds it, for any sink: Subject is the
// NATS subject or the Kafka topic, Key the event's partition key (Kafka's
// record key), Header walbox's headers, Data the payload.
type Msg struct {
	Subject string
	Key     string
	Header  Header
	Data    []byte
	// Expect, when ExpectSet, is the stream's last sequence this message
	// must follow (strict order); a sink that cannot check it ignores it.
	Expect    uint64
	ExpectSet bool
	// Epoch is the sink's Epoch as the relay read it before publishing: a
	// sink whose epoch has moved since refuses the message unsent (a
	// failed publish it has not heard of must be resent first).
	Epoch uint64
	// Stream is the JetStream stream the router sends Subject to ("" for
	// a dead letter and for Kafka): a sink that batches per stream needs it.
	Stream string
	// MayBeStored: the broker may hold this event already (a resend, or one
	// the resume check could not rule out). A sink publishes it on its own,
	// so that its ack says whether it was stored or dropped as a duplicate
	// and where: a batch's acks prove only what a batch stored (see
	// relay/jssink/batch.go).
	MayBeStored bool
	// Txn, when not 0, names the PostgreSQL transaction m belongs to: a
	// sink that publishes a transaction's messages together (TxnSink)
	// groups consecutive messages of one Txn. 0: publish it on its own.
	Txn uint64

	slots *headerSlots // Router.Message's, for Recycle
}

// Size is what m holds in memory: data, subject, key and headers. The
// relay's byte budget (Config.WindowBytes) counts it.
func (m *Msg) Size() int64 {
	return int64(len(m.Data) + len(m.Subject) + len(m.Key) + m.headerSize())
}

// TxnSink is a Sink that publishes each transaction's messages (those with
// one Msg.Txn) in a unit that a consumer sees whole or not at all
// (JetStream atomic batches, relay/jssink/atomic.go). Consecutive
// transactions may share a unit; a sink may end one inside a transaction
// only at a limit (a broker's size limit, the relay's window), and says so
// in its docs. The relay tells it when a unit may end (EndTxn).
type TxnSink interface {
	// EndTxn: every message published so far belongs to a transaction
	// read to its commit (TxnCommit, TxnMayCommit), or the relay stopped
	// publishing inside one (TxnAbandon).
	EndTxn(end TxnEnd)
	// TxnOpen reports whether messages wait in an open unit.
	TxnOpen() bool
}

// TxnEnd is what EndTxn asks of a TxnSink's open unit.
type TxnEnd int

const (
	// TxnAbandon: the relay stopped publishing after a failure, or shuts
	// down inside a transaction. The unit's futures fail, and nothing of
	// it is stored.
	TxnAbandon TxnEnd = iota
	// TxnMayCommit: nothing more is at hand. The sink commits the unit, or
	// holds it while an earlier unit of its stream waits for its ack (the
	// broker would take the commit only after that one): the relay calls
	// again whenever the head of its window resolves, and an earlier
	// unit's messages are ahead of this one's in the window.
	TxnMayCommit
	// TxnCommit: commit the unit now (the relay needs its window empty).
	TxnCommit
)

// ErrTxnRefused wraps a broker's refusal of a whole transaction's unit (a
// JetStream atomic batch) for its content: a duplicate inside, a message
// the stream refuses, a limit. It is no evidence about any one message, so
// the relay resends each of that transaction's messages on its own (Txn 0),
// where its own ack or error decides, the dead-letter rules included.
var ErrTxnRefused = errors.New("the broker refused the transaction's batch; resending its events one at a time")

// Replaced returns a copy of m whose payload is data and whose header key
// is v, in a header map of its own: what a decorator of the sink (the claim
// check, relay/claim) hands to the sink in m's place, leaving m as the relay
// holds it, so that a resend of m starts again from the event's payload.
func (m *Msg) Replaced(data []byte, key, v string) *Msg {
	c := *m
	c.slots = nil // the copy's headers are plain map entries
	c.Header = make(Header, len(m.Header)+1)
	for k, vs := range m.Header {
		c.Header[k] = vs
	}
	c.Header[key] = []string{v}
	c.Data = data
	return &c
}

// Ack is a broker's acknowledgement: the stream (or topic) and the
// sequence the message is stored at, 1-based (Kafka: the partition, and
// its offset + 1). Duplicate: the broker already held it and dropped this
// copy.
type Ack struct {
	Stream    string
	Partition int32
	Sequence  uint64
	Duplicate bool
}

// Result is how one publish ended: the broker's ack, or an error.
type Result struct {
	Ack *Ack
	Err error
}

// Future delivers the Result of one publish, once.
type Future <-chan Result

// Resolver resolves the Future NewFuture made with it.
type Resolver chan<- Result

// Await waits for f to resolve, or for ctx to end.
func Await(ctx context.Context, f Future) (*Ack, error) {
	select {
	case r := <-f:
		return r.Ack, r.Err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Sink is the bus behind the publisher: publish in order with a future per
// message, classify errors, and read back what a source already stored.
// The router, the window, the checkpoint and the dead-letter rules are the
// relay's; a sink knows only its bus.
type Sink interface {
	// Publish sends m. Once its future has resolved with an ack, the relay
	// reuses m for a later event: a Sink must not keep it past that. A
	// header the sink adds to m goes in with m.SetHeader.
	Publish(m *Msg) (Future, error)
	Classify(err error) ErrorClass
	// MaxPayload is the largest message the server takes (0 when unknown).
	MaxPayload() int
	// Epoch changes whenever the connection is re-established, or a
	// publish fails, in a way that can lose a message while a later one is
	// stored. Messages of one window must travel in one epoch: only then
	// does the server store a prefix of them when it fails, never a later
	// one without an earlier one. A sink that can refuse a message whose
	// Msg.Epoch is no longer its own does so atomically (Kafka's
	// transactional producer); the relay also checks before and after.
	Epoch() uint64
	// StoredTail reads back the newest messages of a stream (or topic):
	// the resume check skips what it already holds. JetStream drops a
	// resent duplicate only inside its duplicate window, Kafka not at all,
	// so after a restart the relay itself skips what is stored.
	StoredTail(ctx context.Context, stream, source string, n int) (StoredTail, error)
}

// NewFuture returns a Future and its Resolver for a sink to resolve from a
// callback. They are one buffered channel: one allocation per publish.
func NewFuture() (Future, Resolver) {
	ch := make(chan Result, 1)
	return ch, ch
}

// Resolve resolves the future with an ack (err nil) or with err. Call it
// once: it never blocks then.
func (r Resolver) Resolve(a *Ack, err error) {
	if err != nil {
		a = nil
	}
	r <- Result{Ack: a, Err: err}
}
