package relay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrorClass says what the publisher does with a failed publish.
type ErrorClass int

const (
	// Transient errors (disconnect, timeout, stream leader unavailable) stop
	// reading, let the window settle, back off and resend in order.
	Transient ErrorClass = iota
	// Permanent errors are the event's own fault: it is dead-lettered.
	Permanent
)

// Sink is the bus behind the publisher: publish tagged messages, hand back
// their outcomes on one channel, and classify errors. JetStream is the
// product; another bus fits behind the same methods without touching cdc or
// the checkpoint.
type Sink interface {
	// Publish sends m and returns the token its outcome will carry: a reply
	// on Replies(), which Resolve turns into the token and the ack or error.
	// Tokens are never reused by a Sink (a late reply cannot be taken for
	// another publish's). Once the outcome is an ack, the relay reuses m for
	// a later event: a Sink must not keep it past that.
	Publish(m *nats.Msg) (token uint64, err error)
	// Replies delivers the replies to publishes, in arrival order. The
	// channel must have room for every publish in flight: a Sink may drop
	// a reply it has no room for (the publish then times out and is resent).
	Replies() <-chan *nats.Msg
	// Resolve reads a reply; ok is false for a message that answers no
	// publish of this Sink.
	Resolve(reply *nats.Msg) (o Outcome, ok bool)
	// AckTimeout is how long a publish may wait for its reply; then it
	// counts as failed (transient) and is resent.
	AckTimeout() time.Duration
	Classify(err error) ErrorClass
	// MaxPayload is the largest message the server takes (0 when unknown).
	MaxPayload() int
	// Epoch changes whenever the connection is re-established. Messages of
	// one window must travel on one connection: only then does the server
	// store a prefix of them when it fails, never a later one without an
	// earlier one.
	Epoch() uint64
}

// Outcome is what became of one publish, or (All) of every publish in
// flight: the connection was lost, their replies will never come.
type Outcome struct {
	Token uint64
	Ack   jetstream.PubAck
	Err   error
	All   bool
}

// lostToken ends the subject of the reply a JetStreamSink makes up when its
// connection is lost (not a base-36 number: no publish has it).
const lostToken = "_"

// JetStreamSink publishes to JetStream the way a JetStream publish works on
// the wire: a core NATS message with a reply subject of its own (one inbox
// subscription, the token as the last token of the subject), answered by
// the stream with a PubAck. The replies come in on one channel that the
// relay's loop reads itself. (jetstream.PublishMsgAsync does the same with a
// future, two channels and a timer per message, a goroutine hop and
// encoding/json per ack: about a third of the relay's CPU in catch-up.)
type JetStreamSink struct {
	nc      *nats.Conn
	js      jetstream.JetStream // for reading back (StoredTail)
	sub     *nats.Subscription
	replies chan *nats.Msg
	prefix  string // "<inbox>."
	timeout time.Duration
	subj    []byte            // reply subject being built
	token   uint64            // of the last publish
	streams map[string]string // stream names seen in acks, to not allocate them per ack
	status  chan nats.Status  // connection lost or closed
}

// NewJetStreamSink subscribes to a reply inbox on nc. ackTimeout bounds how
// long an ack may take; without it a lost ack would hold the window forever.
// maxPending is the most publishes the relay keeps in flight: the reply
// channel holds twice that, so that late replies of resent messages never
// crowd out current ones.
func NewJetStreamSink(nc *nats.Conn, ackTimeout time.Duration, maxPending int) (*JetStreamSink, error) {
	if ackTimeout <= 0 {
		return nil, errors.New("jetstream sink: ack timeout must be positive")
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream context: %w", err)
	}
	s := &JetStreamSink{
		nc: nc, js: js, timeout: ackTimeout,
		replies: make(chan *nats.Msg, 2*maxPending+64),
		prefix:  nc.NewInbox() + ".",
		streams: make(map[string]string),
	}
	sub, err := nc.ChanSubscribe(s.prefix+"*", s.replies)
	if err != nil {
		return nil, fmt.Errorf("subscribe to the JetStream reply inbox: %w", err)
	}
	s.sub = sub
	s.status = nc.StatusChanged(nats.RECONNECTING, nats.CLOSED)
	go s.watchConnection()
	return s, nil
}

// watchConnection tells the relay when the connection is lost: the replies
// to what is in flight are lost with it, so those publishes fail at once
// (as jetstream.PublishMsgAsync's futures do) instead of at the ack timeout.
func (s *JetStreamSink) watchConnection() {
	for st := range s.status {
		select {
		case s.replies <- &nats.Msg{Subject: s.prefix + lostToken}:
		default: // full: the ack timeout fails them instead
		}
		if st == nats.CLOSED {
			return
		}
	}
}

// Close unsubscribes the reply inbox and stops watching the connection.
func (s *JetStreamSink) Close() error {
	s.nc.RemoveStatusListener(s.status)
	return s.sub.Unsubscribe()
}

// Publish implements Sink. It is called from one goroutine at a time.
func (s *JetStreamSink) Publish(m *nats.Msg) (uint64, error) {
	s.token++
	s.subj = strconv.AppendUint(append(s.subj[:0], s.prefix...), s.token, 36)
	m.Reply = string(s.subj)
	return s.token, s.nc.PublishMsg(m)
}

// JetStream is the JetStream context on the sink's connection.
func (s *JetStreamSink) JetStream() jetstream.JetStream { return s.js }

// Replies implements Sink.
func (s *JetStreamSink) Replies() <-chan *nats.Msg { return s.replies }

// AckTimeout implements Sink.
func (s *JetStreamSink) AckTimeout() time.Duration { return s.timeout }

// Resolve implements Sink.
func (s *JetStreamSink) Resolve(reply *nats.Msg) (Outcome, bool) {
	tok, ok := strings.CutPrefix(reply.Subject, s.prefix)
	if !ok {
		return Outcome{}, false
	}
	if tok == lostToken {
		return Outcome{All: true, Err: nats.ErrDisconnected}, true
	}
	token, err := strconv.ParseUint(tok, 36, 64)
	if err != nil {
		return Outcome{}, false
	}
	ack, err := parsePubAck(reply, s.streams)
	return Outcome{Token: token, Ack: ack, Err: err}, true
}

// Epoch implements Sink: the client's reconnect count.
func (s *JetStreamSink) Epoch() uint64 { return s.nc.Stats().Reconnects }

// MaxPayload implements Sink.
func (s *JetStreamSink) MaxPayload() int { return int(s.nc.MaxPayload()) }

// Classify implements Sink.
func (s *JetStreamSink) Classify(err error) ErrorClass { return ClassifyJetStream(err) }

// ClassifyJetStream sorts JetStream publish errors.
func ClassifyJetStream(err error) ErrorClass {
	var pe *PoisonError
	if errors.As(err, &pe) {
		return Permanent
	}
	switch {
	case errors.Is(err, nats.ErrMaxPayload), errors.Is(err, nats.ErrBadSubject),
		errors.Is(err, nats.ErrHeadersNotSupported), errors.Is(err, nats.ErrBadHeaderMsg):
		return Permanent
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case jetstream.JSErrCodeStreamNotFound:
			return Transient
		case 10070: // wrong last msg id: strict order found a gap (or another writer); resend in order
			return Transient
		case 10054, // message size exceeds maximum allowed
			10060: // expected stream does not match
			return Permanent
		}
		if apiErr.Code >= 500 || apiErr.Code == 0 {
			return Transient
		}
		if apiErr.Code >= 400 {
			return Permanent
		}
	}
	return Transient
}

// EnsureStreams creates or updates the configured streams (manage = true)
// or checks they exist. It returns the routes for the router, taken from the
// server's view of each stream.
func EnsureStreams(ctx context.Context, js jetstream.JetStream, streams []StreamSpec) ([]Route, error) {
	var routes []Route
	for _, sp := range streams {
		var info *jetstream.StreamInfo
		if sp.Manage {
			st, err := js.CreateOrUpdateStream(ctx, sp.config())
			if err != nil {
				return nil, fmt.Errorf("create or update stream %s: %w", sp.Name, err)
			}
			info = st.CachedInfo()
		} else {
			st, err := js.Stream(ctx, sp.Name)
			if err != nil {
				return nil, fmt.Errorf("stream %s (nats.streams[].manage is false, so walbox only checks it): %w", sp.Name, err)
			}
			info = st.CachedInfo()
		}
		routes = append(routes, Route{Stream: sp.Name, Subjects: info.Config.Subjects})
	}
	return routes, nil
}

// StreamSpec is a stream as the config declares it.
type StreamSpec struct {
	Name            string
	Subjects        []string
	Storage         string // file or memory
	Replicas        int
	DuplicateWindow time.Duration
	MaxAge          time.Duration
	MaxMsgSize      int32
	Manage          bool
}

func (sp StreamSpec) config() jetstream.StreamConfig {
	c := jetstream.StreamConfig{
		Name:       sp.Name,
		Subjects:   sp.Subjects,
		Replicas:   sp.Replicas,
		Duplicates: sp.DuplicateWindow,
		MaxAge:     sp.MaxAge,
		MaxMsgSize: sp.MaxMsgSize,
	}
	if sp.Storage == "memory" {
		c.Storage = jetstream.MemoryStorage
	} else {
		c.Storage = jetstream.FileStorage
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	return c
}
