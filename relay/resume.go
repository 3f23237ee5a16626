package relay

import (
	"context"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"

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

// Add records a message of this source. A backfilled event (commit LSN 0)
// has no WAL position: only its id counts. Taken as a position it would be
// older than every WAL event, so nothing would predate the tail and a relay
// reading the WAL again would store everything before the tail twice.
func (t *StoredTail) Add(id string, o StoredOrigin, pos cdc.Position) {
	if t.IDs == nil {
		t.IDs = map[string]struct{}{}
	}
	t.IDs[id] = struct{}{}
	t.Found = true
	if pos.CommitLSN == 0 {
		return
	}
	if t.Ranges == nil {
		t.Ranges = map[StoredOrigin]PosRange{}
	}
	r, ok := t.Ranges[o]
	if !ok || pos.Less(r.Oldest) {
		r.Oldest = pos
	}
	if !ok || r.Newest.Less(pos) {
		r.Newest = pos
	}
	t.Ranges[o] = r
}

// PartitionedTail builds the StoredTail of a stream kept in partitions that
// each store their records in publish order (a Kafka topic), read back as
// the newest n records of every partition.
//
// A position before the tail's start is taken as stored (alreadyStored).
// Two facts prove that here. The topic's n newest positions: n is at least
// twice the relay's window, and at most a window of events is ever in
// flight past one not yet stored, so whatever precedes n stored events was
// stored. And each partition's oldest: a partition never stores a record
// without the ones before it, so when every partition holds some, what
// precedes the oldest of all of them was stored. The start is the newer of
// the two. The oldest of all partitions alone is too cautious: a quiet
// partition's n records reach far back, and the events of a busier one
// between the two starts would be stored again.
type PartitionedTail struct {
	n, partitions int
	tail          StoredTail
	pos           map[StoredOrigin][]cdc.Position
	oldest        map[StoredOrigin]map[int32]cdc.Position
}

// NewPartitionedTail starts the tail of a stream of the given number of
// partitions, n records read back from each.
func NewPartitionedTail(n, partitions int) *PartitionedTail {
	return &PartitionedTail{n: n, partitions: partitions, tail: StoredTail{IDs: map[string]struct{}{}},
		pos: map[StoredOrigin][]cdc.Position{}, oldest: map[StoredOrigin]map[int32]cdc.Position{}}
}

// Add records a message of this source read from partition.
func (p *PartitionedTail) Add(partition int32, id string, o StoredOrigin, pos cdc.Position) {
	p.tail.IDs[id] = struct{}{}
	p.tail.Found = true
	if pos.CommitLSN == 0 {
		return // backfilled: no WAL position (see StoredTail.Add)
	}
	p.pos[o] = append(p.pos[o], pos)
	parts := p.oldest[o]
	if parts == nil {
		parts = map[int32]cdc.Position{}
		p.oldest[o] = parts
	}
	if old, ok := parts[partition]; !ok || pos.Less(old) {
		parts[partition] = pos
	}
}

// Tail is the StoredTail: every id read, and for each origin the range from
// the start proved stored to the newest position.
func (p *PartitionedTail) Tail() StoredTail {
	t := p.tail
	t.Ranges = map[StoredOrigin]PosRange{}
	for o, all := range p.pos {
		slices.SortFunc(all, func(a, b cdc.Position) int { // newest first
			switch {
			case b.Less(a):
				return -1
			case a.Less(b):
				return 1
			}
			return 0
		})
		var start cdc.Position
		proved := false
		if len(all) >= p.n {
			start, proved = all[p.n-1], true
		}
		if parts := p.oldest[o]; len(parts) >= p.partitions {
			var low cdc.Position
			first := true
			for _, pos := range parts {
				if first || pos.Less(low) {
					low, first = pos, false
				}
			}
			if !proved || start.Less(low) {
				start, proved = low, true
			}
		}
		if proved {
			t.Ranges[o] = PosRange{Oldest: start, Newest: all[0]}
		}
	}
	return t
}

// PositionFromHeaders reads the position headers walbox sets, when they were
// set by source, and the WAL history they belong to (zero when not recorded).
func PositionFromHeaders(h Header, source string) (cdc.Position, StoredOrigin, bool) {
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
// the last sequence of some stream could not be read, or when RequireTail is
// set and some tail could not be read: publishing then would go unguarded,
// so the caller backs off and tries again.
func (l *loop) refreshResume() bool {
	l.tails = make(map[string]StoredTail)
	l.lastSeq = make(map[string]uint64)
	complete := true
	for _, rt := range l.r.router.routes {
		if slices.Contains(rt.Subjects, l.r.cfg.DLQPrefix+">") || (l.r.cfg.DLQSubject != "" && slices.Contains(rt.Subjects, l.r.cfg.DLQSubject)) {
			continue // dead letters are never skipped
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		tail, err := l.r.sink.StoredTail(ctx, rt.Stream, l.r.router.source, 2*l.r.cfg.Window)
		cancel()
		if tail.StateRead {
			l.lastSeq[rt.Stream] = tail.LastSeq
		} else if l.r.cfg.StrictOrder && !l.shared[rt.Stream] {
			complete = false
		}
		if err != nil && l.r.cfg.RequireTail {
			l.r.log.Warn().Err(err).Str("stream", rt.Stream).Msg("resume check: cannot read the stream's last messages; publishing waits for them (the bus does not drop a resent duplicate)")
			complete = false
			continue
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
