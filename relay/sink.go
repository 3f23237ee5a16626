package relay

import (
	"context"
	"errors"
	"fmt"
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

// Sink is the bus behind the publisher: publish in order with a future per
// message, and classify errors. JetStream is the product; another bus fits
// behind the same three methods without touching cdc or the checkpoint.
type Sink interface {
	// PublishAsync sends m. Once its future has resolved with an ack, the
	// relay reuses m for a later event: a Sink must not keep it past that.
	PublishAsync(m *nats.Msg) (jetstream.PubAckFuture, error)
	Classify(err error) ErrorClass
	// MaxPayload is the largest message the server takes (0 when unknown).
	MaxPayload() int
	// Epoch changes whenever the connection is re-established. Messages of
	// one window must travel on one connection: only then does the server
	// store a prefix of them when it fails, never a later one without an
	// earlier one.
	Epoch() uint64
}

// JetStreamSink publishes to JetStream with PublishMsgAsync.
type JetStreamSink struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	opts []jetstream.PublishOpt
}

// NewJetStreamSink wraps a connection. ackTimeout bounds how long an ack may
// take; without it a lost ack would hold the window forever. maxPending must
// exceed the relay's window so the library never stalls on its own (it fails
// with ErrTooManyStalledMsgs after 200 ms instead of waiting).
func NewJetStreamSink(nc *nats.Conn, ackTimeout time.Duration, maxPending int) (*JetStreamSink, error) {
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncTimeout(ackTimeout),
		jetstream.WithPublishAsyncMaxPending(maxPending))
	if err != nil {
		return nil, fmt.Errorf("jetstream context: %w", err)
	}
	return &JetStreamSink{
		nc: nc, js: js,
		// The library's own retry on "no responders" resends out of order;
		// walbox resends in order itself.
		opts: []jetstream.PublishOpt{jetstream.WithRetryAttempts(0)},
	}, nil
}

// Conn returns the NATS connection.
func (s *JetStreamSink) Conn() *nats.Conn { return s.nc }

// JetStream returns the underlying JetStream context.
func (s *JetStreamSink) JetStream() jetstream.JetStream { return s.js }

// PublishAsync implements Sink.
func (s *JetStreamSink) PublishAsync(m *nats.Msg) (jetstream.PubAckFuture, error) {
	return s.js.PublishMsgAsync(m, s.opts...)
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
		case jetstream.JSErrCodeStreamWrongLastSequence, // strict order found a gap (or another writer); resend in order
			10070: // wrong last msg id, from a relay of an earlier version
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
