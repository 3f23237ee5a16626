// Package jssink is the relay's JetStream sink: asynchronous publishes with
// a future per message, JetStream's error classes, the streams walbox
// declares, and the read-back of what a stream holds (the resume check's
// tail and the sweeper's catch-up).
package jssink

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/relay"
)

// Sink publishes to JetStream with PublishMsgAsync. It implements
// relay.Sink and sweep.StreamReader.
type Sink struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	opts []jetstream.PublishOpt

	// JetStream's futures resolve on their own channels; a forwarder
	// resolves the relay's in publish order. It runs while futures wait.
	mu      sync.Mutex
	queue   []forward
	running bool
}

type forward struct {
	fut     jetstream.PubAckFuture
	resolve func(*relay.Ack, error)
}

// New wraps a connection. ackTimeout bounds how long an ack may take;
// without it a lost ack would hold the window forever. maxPending must
// exceed the relay's window so the library never stalls on its own (it
// fails with ErrTooManyStalledMsgs after 200 ms instead of waiting).
func New(nc *nats.Conn, ackTimeout time.Duration, maxPending int) (*Sink, error) {
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncTimeout(ackTimeout),
		jetstream.WithPublishAsyncMaxPending(maxPending))
	if err != nil {
		return nil, fmt.Errorf("jetstream context: %w", err)
	}
	return &Sink{
		nc: nc, js: js,
		// The library's own retry on "no responders" resends out of order;
		// walbox resends in order itself.
		opts: []jetstream.PublishOpt{jetstream.WithRetryAttempts(0)},
	}, nil
}

// Conn returns the NATS connection.
func (s *Sink) Conn() *nats.Conn { return s.nc }

// JetStream returns the underlying JetStream context.
func (s *Sink) JetStream() jetstream.JetStream { return s.js }

// Publish implements relay.Sink. m.Expect becomes the expected-last-sequence
// header; a refusal for it comes back wrapping relay.ErrOrderRefused.
func (s *Sink) Publish(m *relay.Msg) (relay.Future, error) {
	h := nats.Header(m.Header)
	if m.ExpectSet {
		h[relay.HeaderExpectedLastSeq] = []string{strconv.FormatUint(m.Expect, 10)}
	} else {
		delete(h, relay.HeaderExpectedLastSeq)
	}
	jf, err := s.js.PublishMsgAsync(&nats.Msg{Subject: m.Subject, Header: h, Data: m.Data}, s.opts...)
	if err != nil {
		return nil, wrapOrder(err)
	}
	fut, resolve := relay.NewFuture()
	s.mu.Lock()
	s.queue = append(s.queue, forward{fut: jf, resolve: resolve})
	start := !s.running
	s.running = true
	s.mu.Unlock()
	if start {
		go s.forward()
	}
	return fut, nil
}

// forward resolves the queued futures in order and exits when none waits.
// Every JetStream future resolves (ack, error or the ack timeout), so it
// never waits forever.
func (s *Sink) forward() {
	for {
		s.mu.Lock()
		if len(s.queue) == 0 {
			s.running = false
			s.queue = nil
			s.mu.Unlock()
			return
		}
		f := s.queue[0]
		s.queue[0] = forward{}
		s.queue = s.queue[1:]
		s.mu.Unlock()
		select {
		case a := <-f.fut.Ok():
			f.resolve(&relay.Ack{Stream: a.Stream, Sequence: a.Sequence, Duplicate: a.Duplicate}, nil)
		case err := <-f.fut.Err():
			f.resolve(nil, wrapOrder(err))
		}
	}
}

// wrapOrder marks JetStream's wrong-last-sequence refusal as
// relay.ErrOrderRefused.
func wrapOrder(err error) error {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence {
		return fmt.Errorf("%w: %w", relay.ErrOrderRefused, err)
	}
	return err
}

// Epoch implements relay.Sink: the client's reconnect count.
func (s *Sink) Epoch() uint64 { return s.nc.Stats().Reconnects }

// MaxPayload implements relay.Sink.
func (s *Sink) MaxPayload() int { return int(s.nc.MaxPayload()) }

// Classify implements relay.Sink.
func (s *Sink) Classify(err error) relay.ErrorClass { return Classify(err) }

// Classify sorts JetStream publish errors.
func Classify(err error) relay.ErrorClass {
	switch {
	case errors.Is(err, nats.ErrMaxPayload), errors.Is(err, nats.ErrBadSubject),
		errors.Is(err, nats.ErrHeadersNotSupported), errors.Is(err, nats.ErrBadHeaderMsg):
		return relay.Permanent
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case jetstream.JSErrCodeStreamNotFound:
			return relay.Transient
		case jetstream.JSErrCodeStreamWrongLastSequence, // strict order found a gap (or another writer); resend in order
			10070: // wrong last msg id, from a relay of an earlier version
			return relay.Transient
		case 10054, // message size exceeds maximum allowed
			10060: // expected stream does not match
			return relay.Permanent
		}
		if apiErr.Code >= 500 || apiErr.Code == 0 {
			return relay.Transient
		}
		if apiErr.Code >= 400 {
			return relay.Permanent
		}
	}
	return relay.Transient
}

// EnsureStreams creates or updates the configured streams (manage = true)
// or checks they exist. It returns the routes for the router, taken from the
// server's view of each stream.
func EnsureStreams(ctx context.Context, js jetstream.JetStream, streams []StreamSpec) ([]relay.Route, error) {
	var routes []relay.Route
	for _, sp := range streams {
		var info *jetstream.StreamInfo
		if sp.Manage {
			st, err := js.CreateOrUpdateStream(ctx, sp.Config())
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
		routes = append(routes, relay.Route{Stream: sp.Name, Subjects: info.Config.Subjects})
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

// Config is the JetStream stream configuration sp declares.
func (sp StreamSpec) Config() jetstream.StreamConfig {
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

// NATSMsg is m as a NATS message, for the tools that publish with their own
// connection (replay, dead-letter retry). It shares m's header map.
func NATSMsg(m *relay.Msg) *nats.Msg {
	h := nats.Header(m.Header)
	if m.ExpectSet {
		h[relay.HeaderExpectedLastSeq] = []string{strconv.FormatUint(m.Expect, 10)}
	}
	return &nats.Msg{Subject: m.Subject, Header: h, Data: m.Data}
}
