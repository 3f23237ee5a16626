package kafkasink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
)

// The resume check's read-back of a topic (StoredTail) is incremental per
// partition, bounded by bytes, and resumable (issue 35, item 6). What an
// earlier read-back of a partition read is kept, as a contiguous suffix of
// the partition's committed records with only each record's identity and
// position; the next one reads what was added since on top of it, and, when
// the suffix is not yet enough, older chunks below it. A read cut short
// keeps every record any of its fetches brought: what it read on top of a
// suffix joins it at once, and what it read of a chunk below stays pending,
// to be read on from where it stopped, until the chunk reaches the suffix
// and joins it. So every fetch that answers is progress, however short
// each attempt is (a slow broker, a loaded machine). A partition's suffix
// is enough once it holds n records or TailBytes bytes, whichever comes
// first (at most a window, bounded by both, is ever in flight past an
// event not yet stored), and one record of the source at least, or reaches
// the partition's start.
// A read fails only when no fetch answers for tailStall, however long the
// whole read takes.

// tailStall is how long a read-back may go without a fetch answering before
// it gives up (the caller tries again later, from where it stopped).
const tailStall = 10 * time.Second

// A round reads at most a chunk of each partition: tailChunkMin records at
// first, twice as many after each round finished, up to tailChunkMax.
const (
	tailChunkMin = 64
	tailChunkMax = 1024
)

// tailScanFactor bounds how far past n records (or TailBytes) a partition's
// read goes looking for a record of the source.
const tailScanFactor = 10

// tailRec is what the read-back keeps of one record.
type tailRec struct {
	offset int64
	size   int64
	own    bool // of the source, with a position
	id     string
	origin relay.StoredOrigin
	pos    cdc.Position
}

// partTail is a contiguous suffix [from, to) of one partition's offsets,
// read, with its data records oldest first.
type partTail struct {
	from, to int64
	recs     []tailRec
	bytes    int64
	own      int
	// epoch is the leader epoch the brokers gave with the partition's end
	// when the suffix was read: another one means a new leader, which may
	// have truncated the log under the suffix (an unclean election), so
	// the suffix is read again rather than trusted.
	epoch int32
	// pend is the chunk below the suffix being read, if any.
	pend *pendChunk
}

// pendChunk is a chunk [from, to) below a suffix that begins at to, read
// oldest first: [from, next) is read, with its data records in recs. It
// joins the suffix once next reaches to.
type pendChunk struct {
	from, next, to int64
	recs           []tailRec
}

func (pt *partTail) enough(n int, maxBytes int64, start int64) bool {
	if pt.from <= start {
		return true
	}
	sized := len(pt.recs) >= n || (maxBytes > 0 && pt.bytes >= maxBytes)
	scanned := len(pt.recs) >= tailScanFactor*n || (maxBytes > 0 && pt.bytes >= tailScanFactor*maxBytes)
	return sized && (pt.own > 0 || scanned)
}

// below puts recs, the data records of [from, pt.from), under the suffix.
func (pt *partTail) below(from int64, recs []tailRec) {
	pt.recs = append(recs[:len(recs):len(recs)], pt.recs...)
	pt.from = from
	for _, r := range recs {
		pt.add(r)
	}
}

// above puts recs, the data records of [pt.to, to), on top of the suffix.
func (pt *partTail) above(to int64, recs []tailRec) {
	pt.recs = append(pt.recs, recs...)
	pt.to = to
	for _, r := range recs {
		pt.add(r)
	}
}

func (pt *partTail) add(r tailRec) {
	pt.bytes += r.size
	if r.own {
		pt.own++
	}
}

// trim drops the oldest records the suffix does not need to stay enough:
// the kept part is still a contiguous suffix.
func (pt *partTail) trim(n int, maxBytes int64) {
	drop := 0
	bytes, own := pt.bytes, pt.own
	for drop < len(pt.recs)-1 {
		r := pt.recs[drop]
		left, leftBytes, leftOwn := len(pt.recs)-drop-1, bytes-r.size, own
		if r.own {
			leftOwn--
		}
		if !(left >= n || (maxBytes > 0 && leftBytes >= maxBytes)) || leftOwn == 0 {
			break
		}
		drop++
		bytes, own = leftBytes, leftOwn
	}
	if drop > 0 {
		pt.from = pt.recs[drop].offset
		pt.recs = append([]tailRec(nil), pt.recs[drop:]...)
		pt.bytes, pt.own = bytes, own
	}
}

// tailCache keeps each topic's partition suffixes between read-backs.
type tailCache struct {
	mu     sync.Mutex // one read-back at a time
	topics map[string]map[int32]*partTail
	source map[string]string
	chunk  map[string]int64 // each topic's next round's chunk
}

// StoredTail implements relay.Sink: at least the newest n records (or
// Config.TailBytes bytes) of every partition of topic, with the range
// relay.PartitionedTail sets for partitions that each keep publish order.
// Kafka has no expected-last-sequence check, so LastSeq is unused.
func (s *Sink) StoredTail(ctx context.Context, topic, source string, n int) (relay.StoredTail, error) {
	s.tails.mu.Lock()
	defer s.tails.mu.Unlock()
	parts, err := s.readTail(ctx, topic, source, max(n, 1))
	pt := relay.NewPartitionedTail()
	for p, t := range parts {
		for _, r := range t.recs {
			if r.own {
				pt.Add(p, r.id, r.origin, r.pos)
			}
		}
	}
	tail := pt.Tail()
	tail.StateRead = true
	return tail, err
}

// readTail brings topic's suffixes up to date and returns them; on an
// error, what it finished is kept for the next call.
func (s *Sink) readTail(ctx context.Context, topic, source string, n int) (map[int32]*partTail, error) {
	c := &s.tails
	if c.topics == nil {
		c.topics, c.source, c.chunk = map[string]map[int32]*partTail{}, map[string]string{}, map[string]int64{}
	}
	if src, ok := c.source[topic]; !ok || src != source {
		c.topics[topic], c.source[topic] = map[int32]*partTail{}, source
	}
	parts := c.topics[topic]
	adm := kadm.NewClient(s.cl)
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return parts, fmt.Errorf("list start offsets of %s: %w", topic, err)
	}
	// The last stable offset: past it are records of transactions not yet
	// ended, which read_committed does not return.
	ends, err := adm.ListCommittedOffsets(ctx, topic)
	if err != nil {
		return parts, fmt.Errorf("list end offsets of %s: %w", topic, err)
	}
	startOf := map[int32]int64{}
	count := 0
	var lerr error
	ends.Each(func(e kadm.ListedOffset) {
		count++
		if e.Err != nil {
			lerr = fmt.Errorf("end offset of %s/%d: %w", topic, e.Partition, e.Err)
			return
		}
		start := int64(0)
		if o, ok := starts.Lookup(topic, e.Partition); ok && o.Err == nil {
			start = o.Offset
		}
		startOf[e.Partition] = start
		pt := parts[e.Partition]
		if pt == nil || pt.to > e.Offset || pt.to < start || pt.epoch != e.LeaderEpoch {
			// New, or the partition was truncated or recreated under the
			// suffix, or has had a new leader since, or retention passed
			// all of it: start again at its end.
			pt = &partTail{from: e.Offset, to: e.Offset, epoch: e.LeaderEpoch}
			parts[e.Partition] = pt
		}
		if pd := pt.pend; pd != nil && (pd.to != pt.from || pd.from < start) {
			// The suffix moved, or retention deleted the chunk's
			// oldest records: read it again, if still needed.
			pt.pend = nil
		}
		if pt.from < start { // retention deleted the oldest part
			i := 0
			for i < len(pt.recs) && pt.recs[i].offset < start {
				pt.bytes -= pt.recs[i].size
				if pt.recs[i].own {
					pt.own--
				}
				i++
			}
			pt.recs, pt.from = pt.recs[i:], start
		}
	})
	if lerr != nil {
		return parts, lerr
	}
	s.mu.Lock()
	if s.parts == nil {
		s.parts = map[string]int{}
	}
	s.parts[topic] = count
	s.mu.Unlock()

	r := &tailReader{cfg: s.cfg, topic: topic, source: source}
	// First what was added on top since the last read-back (for a new
	// partition, or one that grew by n offsets or more since, its newest
	// chunk), then older chunks below the suffixes that are not enough
	// yet, read side by side; a chunk a read cut short is resumed first.
	chunk := c.chunk[topic]
	if chunk == 0 {
		chunk = tailChunkMin
	}
	first := min(int64(n), chunk)
	top := map[int32]span{}
	for p, pt := range parts {
		end := int64(0)
		if o, ok := ends.Lookup(topic, p); ok {
			end = o.Offset
		}
		if end-pt.to >= int64(n) {
			pt = &partTail{from: end, to: end, epoch: pt.epoch}
			parts[p] = pt
		}
		switch {
		case len(pt.recs) == 0 && pt.from == pt.to && pt.to < end:
			// Nothing read yet: the newest chunk, below an empty suffix
			// at the end.
			pt.from, pt.to = end, end
			from := max(startOf[p], end-first)
			pt.pend = &pendChunk{from: from, next: from, to: end}
			top[p] = span{from: from, to: end}
		case pt.to < end:
			top[p] = span{from: pt.to, to: end}
		}
	}
	for round := 0; ; round++ {
		want := top
		if round > 0 {
			want = map[int32]span{}
			for p, pt := range parts {
				if pt.enough(n, s.cfg.TailBytes, startOf[p]) {
					continue
				}
				if pt.pend == nil {
					from := max(startOf[p], pt.from-chunk)
					pt.pend = &pendChunk{from: from, next: from, to: pt.from}
				}
				want[p] = span{from: pt.pend.next, to: pt.from}
			}
			if len(want) == 0 {
				break
			}
		}
		err := r.read(ctx, want, func(p int32, piece span, recs []tailRec) {
			pt := parts[p]
			if pd := pt.pend; pd != nil && piece.from == pd.next && piece.to <= pd.to {
				pd.recs = append(pd.recs, recs...)
				pd.next = piece.to
				if pd.next == pd.to {
					pt.below(pd.from, pd.recs)
					pt.pend = nil
				}
				return
			}
			if piece.from == pt.to {
				pt.above(piece.to, recs)
			}
		})
		if err != nil {
			return parts, err
		}
		chunk = min(2*chunk, tailChunkMax)
		c.chunk[topic] = chunk
	}
	for p, pt := range parts {
		if pt.enough(n, s.cfg.TailBytes, startOf[p]) {
			pt.trim(n, s.cfg.TailBytes)
		}
	}
	return parts, nil
}

// tailReader reads rounds of chunks of one topic's partitions, handing
// over what each fetch read of each partition's chunk. Each round has a
// client of its own, consuming its chunks from their first offsets: a
// client made to consume a partition again from an earlier offset can take
// it for truncation (KIP-320) after a leader change, and stop.
type tailReader struct {
	cfg    Config
	topic  string
	source string
}

// errTailStalled: no fetch answered for tailStall.
var errTailStalled = errors.New("no fetch answered")

// read reads spans and calls got, after each fetch, for each partition it
// brought records of: piece is the part of the partition's span read since
// the last call (from the span's first offset on, contiguous), recs its
// data records in offset order. A fetch's records are handed over even when
// ctx ends right after it.
func (r *tailReader) read(ctx context.Context, spans map[int32]span, got func(p int32, piece span, recs []tailRec)) error {
	add := map[int32]kgo.Offset{}
	at := map[int32]int64{} // each partition's next offset to read
	for p, sp := range spans {
		if sp.from < sp.to {
			add[p] = kgo.NewOffset().At(sp.from)
			at[p] = sp.from
		}
	}
	if len(add) == 0 {
		return nil
	}
	cl, err := NewClient(r.cfg, append(ReadOpts(),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{r.topic: add}),
		// Memory: one fetch holds at most 1 MiB of a partition and 16 MiB
		// in all, whatever the records' sizes and the chunks' lengths.
		kgo.FetchMaxPartitionBytes(1<<20), kgo.FetchMaxBytes(16<<20))...)
	if err != nil {
		return fmt.Errorf("read back %s: %w", r.topic, err)
	}
	defer cl.Close()
	for len(at) > 0 {
		pctx, cancel := context.WithTimeout(ctx, tailStall)
		fs := cl.PollFetches(pctx)
		stalled := pctx.Err() != nil
		cancel()
		read := map[int32][]tailRec{}
		upTo := map[int32]int64{}
		for it := fs.RecordIter(); !it.Done(); {
			rec := it.Next()
			next, reading := at[rec.Partition]
			if !reading || rec.Offset < next {
				continue
			}
			// Records come in offset order, from the span's first offset
			// on; the offsets between two of them hold none a
			// read_committed consumer gets (aborted, or compacted away).
			sp := spans[rec.Partition]
			if rec.Offset < sp.to && !rec.Attrs.IsControl() {
				read[rec.Partition] = append(read[rec.Partition], r.keep(rec))
			}
			upTo[rec.Partition] = min(rec.Offset+1, sp.to)
		}
		for p, to := range upTo {
			got(p, span{from: at[p], to: to}, read[p])
			at[p] = to
			if to == spans[p].to {
				delete(at, p)
			}
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("read back %s: %w", r.topic, err)
		}
		if stalled && len(upTo) == 0 {
			return fmt.Errorf("read back %s: %w for %v (%d partitions left)", r.topic, errTailStalled, tailStall, len(at))
		}
		if err := FetchErr(fs, "read back"); err != nil {
			return err
		}
	}
	return nil
}

// keep is what the read-back keeps of rec.
func (r *tailReader) keep(rec *kgo.Record) tailRec {
	size := int64(len(rec.Key) + len(rec.Value))
	for _, h := range rec.Headers {
		size += int64(len(h.Key) + len(h.Value))
	}
	t := tailRec{offset: rec.Offset, size: size}
	h := FromKafkaHeaders(rec.Headers)
	if pos, origin, ok := relay.PositionFromHeaders(h, r.source); ok {
		t.own, t.id, t.origin, t.pos = true, relay.IdentityFromHeaders(h), origin, pos
	}
	return t
}
