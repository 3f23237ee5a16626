package jssink

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/relay"
)

// StoredTail implements relay.Sink: the headers of the last n messages of
// stream, read with a headers-only ordered consumer.
func (s *Sink) StoredTail(ctx context.Context, stream, source string, n int) (relay.StoredTail, error) {
	tail := relay.StoredTail{IDs: map[string]struct{}{}}
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		return tail, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return tail, err
	}
	tail.LastSeq, tail.StateRead = info.State.LastSeq, true
	if info.State.Msgs == 0 {
		return tail, nil
	}
	last := info.State.LastSeq
	start := info.State.FirstSeq
	if last >= uint64(n) && last-uint64(n)+1 > start {
		start = last - uint64(n) + 1
	}
	err = scanHeaders(ctx, st, start, last, func(seq uint64, seqOK bool, h nats.Header) bool {
		if pos, origin, ok := relay.PositionFromHeaders(relay.Header(h), source); ok {
			tail.Add(relay.IdentityFromHeaders(relay.Header(h)), origin, pos)
		} else if seqOK && h.Get(relay.HeaderSource) != source {
			tail.NewestForeign = max(tail.NewestForeign, seq)
		}
		return true
	}, nil)
	return tail, err
}

// scanHeaders reads the headers of st's messages from sequence first on,
// with a headers-only ordered consumer in batches of 512, until a batch
// reaches sequence last or comes back empty. fn gets each message's
// sequence (ok false when its metadata could not be read) and headers, and
// returns false to stop. between, if set, runs after each batch that did
// not end the scan; its error ends it.
func scanHeaders(ctx context.Context, st jetstream.Stream, first, last uint64, fn func(seq uint64, ok bool, h nats.Header) bool, between func() error) error {
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: first, HeadersOnly: true,
	})
	if err != nil {
		return err
	}
	next := first
	for {
		// Ask for no more than is left up to last: a fetch waits its whole
		// FetchMaxWait for a batch it cannot fill (2 s per read-back of a
		// short tail, several per reconnect). Messages deleted inside the
		// range still make a fetch wait; the scan then ends on its own.
		want := 512
		if last >= next && last-next+1 < uint64(want) {
			want = int(last - next + 1)
		}
		batch, err := cons.Fetch(want, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return err
		}
		var seq uint64
		got := 0
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			if err == nil {
				seq = md.Sequence.Stream
			}
			if !fn(seq, err == nil, m.Headers()) {
				break
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		if seq >= last || got == 0 {
			return nil
		}
		next = seq + 1
		if between != nil {
			if err := between(); err != nil {
				return err
			}
		}
	}
}

// ReadBack implements sweep.StreamReader: it calls fn with what every
// message of source in rr (relay.ReadBackRange) says of its event
// (relay.StoredEventFromHeaders). The sweeper catches dropped marks up from
// it: a row is marked only when its identity was read back.
func (s *Sink) ReadBack(ctx context.Context, stream, source string, rr relay.ReadBackRange, fn func(relay.StoredEvent) bool) error {
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return fmt.Errorf("stream %s info: %w", stream, err)
	}
	if info.State.Msgs == 0 {
		return nil
	}
	oldest, newest := info.State.FirstSeq, info.State.LastSeq
	if rr.First > 0 {
		_, err := readBack(ctx, st, stream, source, max(rr.First, oldest), min(rr.Last, newest), fn)
		return err
	}
	// The newest messages, then older ones in chunks twice as large each
	// time (each read forward: an ordered consumer cannot go backwards),
	// until fn has counted rr.Want, the stream's start, or rr.ScanMax read.
	want := max(rr.Want, 1)
	chunk := uint64(want)
	counted, read := 0, uint64(0)
	for last := newest; counted < want; {
		first := oldest
		if last-oldest+1 > chunk {
			first = last - chunk + 1
		}
		if rr.ScanMax > 0 && last-first+1 > uint64(rr.ScanMax)-read {
			first = last - (uint64(rr.ScanMax) - read) + 1
		}
		n, err := readBack(ctx, st, stream, source, first, last, fn)
		if err != nil {
			return err
		}
		counted += n
		read += last - first + 1
		if first == oldest || (rr.ScanMax > 0 && read >= uint64(rr.ScanMax)) {
			return nil
		}
		last = first - 1
		chunk = min(2*chunk, maxReadBackChunk)
	}
	return nil
}

// maxReadBackChunk bounds the messages one step of a read-back of the
// newest messages reads with one consumer.
const maxReadBackChunk = 1 << 20

// readBack calls fn with the event of every message of source that st
// (stream) holds between sequences first and last, and returns how many fn
// counted.
func readBack(ctx context.Context, st jetstream.Stream, stream, source string, first, last uint64, fn func(relay.StoredEvent) bool) (int, error) {
	if first > last {
		return 0, nil
	}
	counted := 0
	err := scanHeaders(ctx, st, first, last, func(seq uint64, ok bool, h nats.Header) bool {
		switch {
		case !ok:
			return true
		case seq > last:
			return false
		case h != nil && h.Get(relay.HeaderSource) == source:
			if fn(relay.StoredEventFromHeaders(relay.Header(h))) {
				counted++
			}
		}
		return true
	}, ctx.Err)
	if err != nil && err != ctx.Err() {
		return counted, fmt.Errorf("read back stream %s: %w", stream, err)
	}
	return counted, err
}

// StoredIdentity implements relay.DuplicateChecker: the source and identity
// (relay.IdentityFromHeaders) of the message stored at seq, the one a
// duplicate ack points at.
//
// The stream's handle is kept: getting one is a stream info request, and a
// run of duplicates asks once per duplicate. A failed get drops it (the
// stream may have been recreated with other settings).
func (s *Sink) StoredIdentity(ctx context.Context, stream string, seq uint64) (source, identity string, err error) {
	s.streamsMu.Lock()
	st := s.streams[stream]
	s.streamsMu.Unlock()
	if st == nil {
		if st, err = s.js.Stream(ctx, stream); err != nil {
			return "", "", fmt.Errorf("stream %s: %w", stream, err)
		}
		s.streamsMu.Lock()
		if s.streams == nil {
			s.streams = map[string]jetstream.Stream{}
		}
		s.streams[stream] = st
		s.streamsMu.Unlock()
	}
	m, err := st.GetMsg(ctx, seq)
	if err != nil {
		s.streamsMu.Lock()
		delete(s.streams, stream)
		s.streamsMu.Unlock()
		return "", "", fmt.Errorf("get message %d of stream %s: %w", seq, stream, err)
	}
	h := relay.Header(m.Header)
	return h.Get(relay.HeaderSource), relay.IdentityFromHeaders(h), nil
}
