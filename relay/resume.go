package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/walbox/walbox/cdc"
)

// IdentityKey is an event's identity within its source, as the read-back
// matches it: its outbox table and its id. Two tables may both have a row
// 1; an id alone never says which was stored (issue 33, item 4). A message
// of a relay from before walbox recorded the table has table "": it is
// taken as the first table's.
func IdentityKey(table, id string) string { return table + "\x00" + id }

// IdentityFromHeaders is the identity of a stored message of this source:
// its table header, and its bare event id (Walbox-Event-Id where set, else
// Nats-Msg-Id).
func IdentityFromHeaders(h Header) string { return IdentityKey(h.Get(HeaderTable), IdentityID(h)) }

// IdentityID is a stored message's bare event id: Walbox-Event-Id where
// set (a dead letter, an event under a qualified Nats-Msg-Id), else
// Nats-Msg-Id.
func IdentityID(h Header) string {
	if id := h.Get(HeaderEventID); id != "" {
		return id
	}
	return h.Get(HeaderMsgID)
}

// StoredTail is what the resume check knows about one stream: the
// identities (IdentityKey) of the events this source stored among the
// stream's newest messages, and for each ordered
// unit (the stream, or a Kafka partition) and WAL history they came from,
// the oldest and newest positions among them.
type StoredTail struct {
	IDs    map[string]struct{}
	Ranges map[TailKey]PosRange
	// Positions are every position read, by unit and history: what a
	// restore report counts.
	Positions map[TailKey][]cdc.Position
	Found     bool // at least one message of this source in the tail
	// NewestForeign is the sequence of the newest message in the tail
	// that is not of this source (0: none): strict order's evidence of
	// another writer.
	NewestForeign uint64
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

// TailKey is one ordered unit of a stream and one WAL history: positions
// compare only inside one (a JetStream stream is one unit, partition 0; a
// Kafka topic has a unit per partition).
type TailKey struct {
	StoredOrigin
	Partition int32
}

// PosRange is the oldest and newest position stored from one origin.
type PosRange struct{ Oldest, Newest cdc.Position }

// Add records a message of this source. A backfilled event (commit LSN 0)
// has no WAL position: only its id counts. Taken as a position it would be
// older than every WAL event, so nothing would predate the tail and a relay
// reading the WAL again would store everything before the tail twice.
func (t *StoredTail) Add(id string, o StoredOrigin, pos cdc.Position) {
	t.add(id, TailKey{StoredOrigin: o}, pos)
}

func (t *StoredTail) add(id string, k TailKey, pos cdc.Position) {
	if t.IDs == nil {
		t.IDs = map[string]struct{}{}
	}
	t.IDs[id] = struct{}{}
	t.Found = true
	if pos.CommitLSN == 0 {
		return
	}
	if t.Ranges == nil {
		t.Ranges = map[TailKey]PosRange{}
		t.Positions = map[TailKey][]cdc.Position{}
	}
	r, ok := t.Ranges[k]
	if !ok || pos.Less(r.Oldest) {
		r.Oldest = pos
	}
	if !ok || r.Newest.Less(pos) {
		r.Newest = pos
	}
	t.Ranges[k] = r
	t.Positions[k] = append(t.Positions[k], pos)
}

// PartitionedTail builds the StoredTail of a stream kept in partitions that
// each store their records in publish order (a Kafka topic), read back as
// the newest n records of every partition. Each partition is an ordered
// unit of its own: positions compare only with positions of the same
// partition (issue 33, item 3). Across partitions nothing is proved: one
// partition may refuse writes for minutes while the others store window
// after window of newer events.
type PartitionedTail struct {
	tail StoredTail
}

// NewPartitionedTail starts the tail of a partitioned stream.
func NewPartitionedTail() *PartitionedTail {
	return &PartitionedTail{tail: StoredTail{IDs: map[string]struct{}{}}}
}

// Add records a message of this source read from partition.
func (p *PartitionedTail) Add(partition int32, id string, o StoredOrigin, pos cdc.Position) {
	p.tail.add(id, TailKey{StoredOrigin: o, Partition: partition}, pos)
}

// Tail is the StoredTail: every id read, and for each partition and origin
// its oldest and newest position read.
func (p *PartitionedTail) Tail() StoredTail { return p.tail }

// Partitioner is a Sink whose streams have more than one ordered unit (a
// Kafka topic's partitions): it says which one m goes to, and ok false when
// it cannot tell (then no position says anything about m).
type Partitioner interface {
	PartitionOf(m *Msg) (partition int32, ok bool)
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
	l.dlqTail = StoredTail{}
	l.lastSeq = make(map[string]uint64)
	complete := true
	for _, rt := range l.r.router.routes {
		dlq := l.r.cfg.DLQSubject != "" && slices.Contains(rt.Subjects, l.r.cfg.DLQSubject)
		if slices.Contains(rt.Subjects, l.r.cfg.DLQPrefix+">") && !dlq {
			// JetStream's dead-letter stream drops a resent dead letter by
			// its Nats-Msg-Id, and holds consumer groups' dead letters
			// (copies of stored events) beside the relay's.
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), l.r.cfg.TailTimeout)
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
		if e, ok := l.refusedAt[rt.Stream]; ok && tail.NewestForeign > e && l.r.cfg.StrictOrder && !l.shared[rt.Stream] {
			// A publish expecting the stream to end at e was refused, and
			// the stream now holds a message of another source past e:
			// someone else writes there.
			l.otherWriter(rt.Stream, tail.NewestForeign)
		}
		if dlq {
			// Kafka's dead-letter topic: read back like any topic, so that
			// a resent dead letter whose first publish was stored is not
			// stored again (alreadyStored, by identity alone).
			l.dlqTail = tail
			continue
		}
		if tail.Found {
			l.tails[rt.Stream] = tail
			l.reportOrigins(rt.Stream, tail)
		}
	}
	clear(l.refusedAt)
	return complete
}

// reportOrigins logs, once per stream and system, that the stream holds
// this source's events from another PostgreSQL cluster, and once per
// stream and rewind, that it holds events from positions this server's WAL
// has not reached: a restore from a snapshot, whose lost history walbox
// published. The count of those events in the tail is a gauge per stream.
func (l *loop) reportOrigins(stream string, tail StoredTail) {
	if l.origin == nil {
		return
	}
	lost := 0
	for k, r := range tail.Ranges {
		if k.SystemID == "" {
			continue
		}
		if k.SystemID != l.origin.SystemID {
			l.reportOnce(stream+"\x00"+k.SystemID, func() {
				l.r.log.Warn().Str("stream", stream).Str("source", l.r.router.source).Str("stored_system_id", k.SystemID).
					Str("system_id", l.origin.SystemID).
					Msg("the stream holds events of this source from another PostgreSQL cluster (a restore, a new cluster, or one with the same database and slot names): positions are not compared across clusters; event ids alone decide what is already stored")
			})
			continue
		}
		if k.Timeline != l.origin.Timeline || r.Newest.CommitLSN < l.walSeen {
			continue
		}
		n := countFrom(tail.Positions[k], l.walSeen)
		lost += n
		l.reportOnce(fmt.Sprintf("%s\x00rewind\x00%d\x00%s", stream, k.Timeline, r.Newest.CommitLSN), func() {
			l.r.log.Error().Str("stream", stream).Str("source", l.r.router.source).Str("system_id", k.SystemID).
				Int32("timeline", k.Timeline).Stringer("stored_newest", r.Newest.CommitLSN).Stringer("server_wal", l.walSeen).
				Int("events_past_server_wal", n).
				Msg("the stream holds events of this source from WAL positions this server has not reached: the database was restored (a snapshot, or a backup without archive recovery) and lost the history those events came from; positions are not compared with them, event ids alone decide what is already stored, and every event of the restored database is published")
		})
	}
	l.r.m.LostHistory.WithLabelValues(stream).Set(float64(lost))
}

// LostHistoryEvents counts the events of tail whose positions are of o's
// system and timeline and at or past how far o's WAL had reached: events of
// a history the server no longer has.
func LostHistoryEvents(tail StoredTail, o *cdc.Origin) int {
	if o == nil {
		return 0
	}
	n := 0
	for k, all := range tail.Positions {
		if k.SystemID == o.SystemID && k.Timeline == o.Timeline {
			n += countFrom(all, o.WALPos)
		}
	}
	return n
}

// countFrom counts the positions at or past wal.
func countFrom(all []cdc.Position, wal cdc.LSN) int {
	n := 0
	for _, pos := range all {
		if pos.CommitLSN >= wal {
			n++
		}
	}
	return n
}

// reportOnce runs log the first time key is seen.
func (l *loop) reportOnce(key string, log func()) {
	if l.reported[key] {
		return
	}
	if l.reported == nil {
		l.reported = map[string]bool{}
	}
	l.reported[key] = true
	log()
}

// alreadyStored reports whether the stream holds p's event. Exact for the
// tail read back (by id). Before the tail, by position, only where a proof
// holds (DESIGN.md, "Evidence"):
//   - the position and the tail's are of one WAL history, not rewound
//     (loop.comparable);
//   - the tail is of p's own ordered unit: the stream, or p's Kafka
//     partition;
//   - p was never published by this process: an event that was, and whose
//     ack did not come, may be missing while later ones were stored (its
//     id read back is the only evidence).
//
// Then the proof: the unit stores this source's events in publish order
// (one connection per window, resends in order, a Kafka partition's
// idempotent producer) and publishing goes in position order, so an event
// before the oldest one read back was published before it, and stored
// before it, or publishing would have stopped there. An event inside the
// tail's range whose id is not there is published again: a gap can only
// sit inside the tail.
//
// A dead letter is stored when its identity was read back from the
// dead-letter topic (Kafka; loop.dlqTail). Never by position: only some
// events go to the dead-letter topic, so one older than its tail may never
// have been sent there.
func (l *loop) alreadyStored(p *pending) bool {
	if p.dlq {
		if l.dlqTail.Found && l.identityRead(l.dlqTail, p) {
			l.skipped("dead letter id read back", p)
			return true
		}
		return false
	}
	if p.stream == "" {
		return false
	}
	tail, ok := l.tails[p.stream]
	if !ok {
		return false
	}
	if l.identityRead(tail, p) {
		l.skipped("id read back", p)
		return true
	}
	// Backfilled events (commit LSN 0) have no WAL position to compare.
	if p.ev.Pos.CommitLSN == 0 || p.tried {
		return false
	}
	// p's unit is asked for only once a range p predates is found: most
	// events are newer than every range (asking a Kafka sink hashes the key).
	part, known := int32(0), false
	for k, r := range tail.Ranges {
		if !p.ev.Pos.Less(r.Oldest) || !l.comparable(k, r) {
			continue
		}
		if !known {
			var ok bool
			if part, ok = l.partitionOf(p); !ok {
				return false
			}
			known = true
		}
		if k.Partition == part {
			l.skipped("position before the tail of its unit", p)
			return true
		}
	}
	return false
}

// identityRead reports whether tail holds p's identity: its table and id
// (or, for the first table, its id on a message that names no table: a
// relay from before walbox recorded it).
func (l *loop) identityRead(tail StoredTail, p *pending) bool {
	if _, ok := tail.IDs[l.r.router.IdentityOf(&p.ev)]; ok {
		return true
	}
	if unlabelledOwner(p) {
		_, ok := tail.IDs[IdentityKey("", p.ev.ID)]
		return ok
	}
	return false
}

// unlabelledOwner reports whether a stored message that names no table (a
// relay from before walbox recorded it) with p's id is p's event: only for
// the first table's rows.
func unlabelledOwner(p *pending) bool { return p.ev.Table == 0 && !p.ev.TableLess }

// partitionOf is p's ordered unit in its stream: 0 for a sink with one per
// stream; a Partitioner's answer otherwise.
func (l *loop) partitionOf(p *pending) (int32, bool) {
	pt, ok := l.r.sink.(Partitioner)
	if !ok {
		return 0, true
	}
	if p.msg == nil {
		return 0, false
	}
	return pt.PartitionOf(p.msg)
}

// comparable reports whether the positions of range r, recorded under k's
// WAL history, compare with the positions being read now:
//   - the same system, and the same timeline or an ancestor below the point
//     where the current one left it (cdc.Origin.Comparable);
//   - on the same timeline, not rewound: the range's newest position is
//     below what this server's WAL has reached (IDENTIFY_SYSTEM's position
//     at the session's start, or a commit read since). A database restored
//     from a crash-consistent snapshot keeps its system id and timeline but
//     its WAL is back at the snapshot's position, and the positions past it
//     are written again by other transactions (issue 33, item 1).
//
// The limit: once the restored server has written past the stream's newest
// position before walbox reads the tail, the rewind no longer shows.
func (l *loop) comparable(k TailKey, r PosRange) bool {
	if !l.origin.Comparable(k.SystemID, k.Timeline, r.Oldest.CommitLSN) {
		return false
	}
	return k.Timeline != l.origin.Timeline || r.Newest.CommitLSN < l.walSeen
}

// skipped counts and logs (at debug) a skip of the resume check.
func (l *loop) skipped(proof string, p *pending) {
	l.r.m.SkippedBy.WithLabelValues(proof).Inc()
	l.r.log.Debug().Str("id", p.ev.ID).Stringer("pos", p.ev.Pos).Str("stream", p.stream).Str("proof", proof).
		Msg("resume check: the stream holds the event already; not published again")
}

// maybeStored reports whether p's publish may come back as a duplicate of a
// message the stream holds: the stream holds events of this source and p's
// position does not prove it newer than all of them (a backfilled event has
// no position; one from another history proves nothing). Only a cost: under
// strict order, while a run of duplicates goes on (loop.aloneLeft), such a
// publish goes out alone (loop.send), so that a duplicate, which does not
// grow the stream, puts no expectation behind it out of step. An event this
// process tried already was read back by id (refreshResume) before its
// resend.
func (l *loop) maybeStored(p *pending) bool {
	tail, ok := l.tails[p.stream]
	if !ok || !tail.Found || p.tried {
		return false
	}
	if p.ev.Pos.CommitLSN == 0 || len(tail.Ranges) == 0 {
		return true
	}
	for k, r := range tail.Ranges {
		if !l.comparable(k, r) || !r.Newest.Less(p.ev.Pos) {
			return true
		}
	}
	return false
}

// DuplicateChecker is a Sink whose broker drops a message as a duplicate of
// a stored one by its dedupe key (JetStream's Nats-Msg-Id) and can say which
// message that is: a duplicate ack is evidence that the event is stored only
// when the message it points at is that event (its source, table and id).
type DuplicateChecker interface {
	StoredIdentity(ctx context.Context, stream string, seq uint64) (source, identity string, err error)
}

// errIDCollision: the broker dropped an event as a duplicate of another
// event's message (the same id, another table or source).
var errIDCollision = errors.New("dropped as a duplicate of another event with the same id (another outbox table or database): published again under an id qualified with its source and table")

// checkDuplicate decides whether a duplicate ack for p is evidence that p's
// event is stored. It returns nil when it is (its identity was read back,
// or the message the ack points at is this event), errIDCollision when the
// message is another event's (p is then published again under a qualified
// id), or the error that kept it from knowing.
func (l *loop) checkDuplicate(p *pending, ack *Ack) error {
	dc, ok := l.r.sink.(DuplicateChecker)
	if !ok || p.dlq {
		return nil
	}
	if tail, ok := l.tails[p.stream]; ok && l.identityRead(tail, p) {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	src, ident, err := dc.StoredIdentity(ctx, ack.Stream, ack.Sequence)
	cancel()
	if err != nil {
		return fmt.Errorf("read the message a duplicate ack points at (%s seq %d): %w", ack.Stream, ack.Sequence, err)
	}
	table := l.r.router.tableOf(&p.ev)
	switch {
	case src == "":
		// Not written by a walbox (no source header): a publisher that
		// used the event's id as its Nats-Msg-Id, such as the relay walbox
		// replaced. Nothing says it is another event; its dedupe key says
		// it is this one. The limit: a foreign writer that reuses ids.
		return nil
	case src == l.r.router.source && (ident == IdentityKey(table, p.ev.ID) || (unlabelledOwner(p) && ident == IdentityKey("", p.ev.ID))):
		return nil
	}
	l.r.m.IDCollisions.WithLabelValues(ack.Stream).Inc()
	l.reportOnce("collision\x00"+ack.Stream+"\x00"+table, func() {
		l.r.log.Warn().Str("stream", ack.Stream).Str("table", table).Str("id", p.ev.ID).Uint64("seq", ack.Sequence).Str("stored_source", src).
			Msg("the stream dropped an event as a duplicate of another event with the same id (another outbox table or database): walbox publishes such events under a Nats-Msg-Id qualified with source and table (Walbox-Event-Id keeps the id); give events ids unique across tables and databases for consumers that deduplicate by Nats-Msg-Id")
	})
	p.msg.Qualify(l.r.router.source+":"+table+":"+p.ev.ID, p.ev.ID)
	return errIDCollision
}
