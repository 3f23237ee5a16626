package relay

import (
	"context"
	"errors"
	"fmt"
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
// positions among them for each WAL history they came from.
type StoredTail struct {
	IDs    map[string]struct{}
	Ranges map[StoredOrigin]PosRange
	Found  bool // at least one message of this source in the tail
	// LastSeq is the stream's last sequence (any source): the expectation
	// for the next strict-order publish. StateRead: it was read.
	LastSeq   uint64
	StateRead bool
}

// StoredOrigin is the WAL history a stored message's position belongs to;
// zero when its relay did not record one.
type StoredOrigin struct {
	SystemID string
	Timeline int32
}

// PosRange is the oldest and newest position stored from one origin.
type PosRange struct{ Oldest, Newest cdc.Position }

// add records a message of this source.
func (t *StoredTail) add(id string, o StoredOrigin, pos cdc.Position) {
	if t.IDs == nil {
		t.IDs = map[string]struct{}{}
	}
	if t.Ranges == nil {
		t.Ranges = map[StoredOrigin]PosRange{}
	}
	t.IDs[id] = struct{}{}
	r, ok := t.Ranges[o]
	if !ok || pos.Less(r.Oldest) {
		r.Oldest = pos
	}
	if !ok || r.Newest.Less(pos) {
		r.Newest = pos
	}
	t.Ranges[o] = r
	t.Found = true
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
	err = scanHeaders(ctx, st, start, last, func(_ uint64, _ bool, h nats.Header) bool {
		if pos, origin, ok := PositionFromHeaders(h, source); ok {
			tail.add(h.Get(HeaderMsgID), origin, pos)
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
	for {
		batch, err := cons.Fetch(512, jetstream.FetchMaxWait(2*time.Second))
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
		if between != nil {
			if err := between(); err != nil {
				return err
			}
		}
	}
}

// PositionFromHeaders reads the position headers walbox sets, when they were
// set by source, and the WAL history they belong to (zero when not recorded).
func PositionFromHeaders(h nats.Header, source string) (cdc.Position, StoredOrigin, bool) {
	if h == nil || h.Get(HeaderSource) != source {
		return cdc.Position{}, StoredOrigin{}, false
	}
	lsn, err := pglogrepl.ParseLSN(h.Get(HeaderCommitLSN))
	if err != nil {
		return cdc.Position{}, StoredOrigin{}, false
	}
	idx, err := strconv.ParseUint(h.Get(HeaderIndex), 10, 32)
	if err != nil {
		return cdc.Position{}, StoredOrigin{}, false
	}
	var o StoredOrigin
	if sys := h.Get(HeaderSystemID); sys != "" {
		if tl, err := strconv.ParseInt(h.Get(HeaderTimeline), 10, 32); err == nil {
			o = StoredOrigin{SystemID: sys, Timeline: int32(tl)}
		}
	}
	return cdc.Position{CommitLSN: lsn, Index: uint32(idx)}, o, true
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
			l.reportOrigins(rt.Stream, tail)
		}
	}
	return complete
}

// reportOrigins logs, once per stream and system, that the stream holds
// this source's events from another PostgreSQL cluster.
func (l *loop) reportOrigins(stream string, tail StoredTail) {
	if l.origin == nil {
		return
	}
	for o := range tail.Ranges {
		if o.SystemID == "" || o.SystemID == l.origin.SystemID {
			continue
		}
		key := stream + "\x00" + o.SystemID
		if l.reported[key] {
			continue
		}
		if l.reported == nil {
			l.reported = map[string]bool{}
		}
		l.reported[key] = true
		l.r.log.Warn().Str("stream", stream).Str("source", l.r.router.source).Str("stored_system_id", o.SystemID).
			Str("system_id", l.origin.SystemID).
			Msg("the stream holds events of this source from another PostgreSQL cluster (a restore, a new cluster, or one with the same database and slot names): positions are not compared across clusters; event ids alone decide what is already stored")
	}
}

// alreadyStored reports whether the stream holds p's event. Exact for the
// tail read back (by id); before the tail, by position, and only against
// positions of the same WAL history (cdc.Origin.Comparable): another
// cluster's positions, or a timeline's past the point where the current one
// forked from it, say nothing about this one's. Publishing stops at the
// first failure and at most a window of events is in flight, so a gap (an
// event lost while a later one was stored) can only sit inside the tail: an
// event inside the tail's range whose id is not there is published again.
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
	if p.ev.Pos.CommitLSN == 0 {
		return false
	}
	for o, r := range tail.Ranges {
		if p.ev.Pos.Less(r.Oldest) && l.origin.Comparable(o.SystemID, o.Timeline, r.Oldest.CommitLSN) {
			return true
		}
	}
	return false
}

// ReadBack calls fn with the Nats-Msg-Id (and, for a dead letter, the
// reason) of every message of source that stream holds between sequences
// first and last; with first 0, of its newest tail messages. The sweeper
// catches dropped marks up from it: a row is marked only when its id was
// read back.
func (s *JetStreamSink) ReadBack(ctx context.Context, stream, source string, first, last uint64, tail int, fn func(id, reason string)) error {
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
	if first == 0 {
		last = info.State.LastSeq
		first = 1
		if tail > 0 && last >= uint64(tail) {
			first = last - uint64(tail) + 1
		}
	}
	first = max(first, info.State.FirstSeq)
	last = min(last, info.State.LastSeq)
	if first > last {
		return nil
	}
	err = scanHeaders(ctx, st, first, last, func(seq uint64, ok bool, h nats.Header) bool {
		switch {
		case !ok:
			return true
		case seq > last:
			return false
		case h != nil && h.Get(HeaderSource) == source:
			fn(h.Get(HeaderMsgID), h.Get(HeaderDLQReason))
		}
		return true
	}, ctx.Err)
	if err != nil && err != ctx.Err() {
		return fmt.Errorf("read back stream %s: %w", stream, err)
	}
	return err
}
