package relay

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/cdc"
)

// StoredTail is what the resume check knows about one stream: the ids this
// source stored among the stream's newest messages, and the oldest and newest
// positions among them.
type StoredTail struct {
	IDs    map[string]struct{}
	Oldest cdc.Position
	Newest cdc.Position
	Found  bool // at least one message of this source in the tail
	// LastSeq is the stream's last sequence (any source): the expectation
	// for the next strict-order publish. StateRead: it was read.
	LastSeq   uint64
	StateRead bool
}

// TailReader reads back the newest messages of a stream. The relay uses it
// for the resume check: JetStream drops a resent duplicate only inside the
// stream's duplicate window, so after a longer outage the relay itself skips
// what the stream already holds.
type TailReader interface {
	StoredTail(ctx context.Context, stream, source string, n int) (StoredTail, error)
}

// StoredTail implements TailReader: the headers of the last n messages of
// stream, read with a headers-only ordered consumer.
func (s *JetStreamSink) StoredTail(ctx context.Context, stream, source string, n int) (StoredTail, error) {
	tail := StoredTail{IDs: map[string]struct{}{}}
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
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: start, HeadersOnly: true,
	})
	if err != nil {
		return tail, err
	}
	for {
		batch, err := cons.Fetch(512, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return tail, err
		}
		var seq uint64
		got := 0
		for m := range batch.Messages() {
			got++
			if md, err := m.Metadata(); err == nil {
				seq = md.Sequence.Stream
			}
			pos, ok := PositionFromHeaders(m.Headers(), source)
			if !ok {
				continue
			}
			tail.IDs[m.Headers().Get(HeaderMsgID)] = struct{}{}
			if !tail.Found || pos.Less(tail.Oldest) {
				tail.Oldest = pos
			}
			if !tail.Found || tail.Newest.Less(pos) {
				tail.Newest = pos
			}
			tail.Found = true
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
			return tail, err
		}
		if seq >= last || got == 0 {
			return tail, nil
		}
	}
}

// PositionFromHeaders reads the position headers walbox sets, when they were
// set by source.
func PositionFromHeaders(h nats.Header, source string) (cdc.Position, bool) {
	if h == nil || h.Get(HeaderSource) != source {
		return cdc.Position{}, false
	}
	lsn, err := pglogrepl.ParseLSN(h.Get(HeaderCommitLSN))
	if err != nil {
		return cdc.Position{}, false
	}
	idx, err := strconv.ParseUint(h.Get(HeaderIndex), 10, 32)
	if err != nil {
		return cdc.Position{}, false
	}
	return cdc.Position{CommitLSN: lsn, Index: uint32(idx)}, true
}

// refreshResume reads back the tail of every routed stream. A stream whose
// tail cannot be read is left unchecked: Nats-Msg-Id still deduplicates
// inside the duplicate window. It reports false when strict order is on and
// the last sequence of some stream could not be read: publishing to it then
// would go unguarded, so the caller backs off and tries again.
func (l *loop) refreshResume() bool {
	rd, ok := l.r.sink.(TailReader)
	if !ok {
		return true
	}
	l.tails = make(map[string]StoredTail)
	l.lastSeq = make(map[string]uint64)
	complete := true
	for _, rt := range l.r.router.routes {
		if slices.Contains(rt.Subjects, l.r.cfg.DLQPrefix+">") {
			continue // dead letters are never skipped
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		tail, err := rd.StoredTail(ctx, rt.Stream, l.r.router.source, 2*l.r.cfg.Window)
		cancel()
		if tail.StateRead {
			l.lastSeq[rt.Stream] = tail.LastSeq
		} else if l.r.cfg.StrictOrder && !l.shared[rt.Stream] {
			complete = false
		}
		if err != nil {
			l.r.log.Warn().Err(err).Str("stream", rt.Stream).Msg("resume check: cannot read the stream's last messages; relying on the duplicate window")
			continue
		}
		if tail.Found {
			l.tails[rt.Stream] = tail
		}
	}
	return complete
}

// alreadyStored reports whether the stream holds p's event. Exact for the
// tail read back (by id); before the tail, by position. Publishing stops at
// the first failure and at most a window of events is in flight, so a gap
// (an event lost while a later one was stored) can only sit inside the tail:
// an event inside the tail's range whose id is not there is published again.
func (l *loop) alreadyStored(p *pending) bool {
	if p.dlq || p.stream == "" {
		return false
	}
	tail, ok := l.tails[p.stream]
	if !ok {
		return false
	}
	if _, stored := tail.IDs[p.ev.ID]; stored {
		return true
	}
	// Backfilled events (commit LSN 0) have no WAL position to compare.
	return p.ev.Pos.CommitLSN > 0 && p.ev.Pos.Less(tail.Oldest)
}
