package kafkasink

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/busops"
)

// Kafka cannot delete one record of a topic. A retried dead letter is
// marked instead: `walbox dlq retry` appends a marker record to the
// dead-letter topic, in the dead letter's partition, whose header
// HeaderDLQRetried holds the retried record's offset; `walbox dlq list`
// hides the records a marker names and the markers. Retry then commits,
// for the consumer group GroupDLQ, each partition's offset up to the first
// dead letter still waiting, so that list starts reading there.
const (
	HeaderDLQRetried = "Walbox-Dlq-Retried"
	GroupDLQ         = "walbox-dlq"
)

// ref is a record of the dead-letter topic.
type ref struct {
	partition int32
	offset    int64
}

// dlqTopic is the dead-letter topic as list and retry see it, read from
// the offsets group GroupDLQ committed (or its start) to its end, once.
type dlqTopic struct {
	o       *Ops
	topic   string
	read    bool
	pending []busops.DeadLetter // waiting, one per event, by partition and offset
	// copies are the other records of an event pending holds (a resend
	// stored twice), by the pending one's record: retried with it.
	copies map[ref][]ref
	// committed and end are each partition's offsets read from and to;
	// waiting, the records of dead letters not retried.
	committed, end map[int32]int64
	waiting        map[ref]bool
	marker         *kgo.Client // produces the markers
}

// DeadLetters implements busops.Bus.
func (o *Ops) DeadLetters(context.Context) (busops.DLQ, error) {
	return &dlqTopic{o: o, topic: o.DLQ}, nil
}

// committedSpans are the dead-letter topic's partitions from the offsets
// group GroupDLQ committed to their ends.
func (d *dlqTopic) committedSpans(ctx context.Context) (map[int32]span, error) {
	spans, exists, err := d.o.topicSpans(ctx, d.topic, time.Time{})
	if err != nil {
		return nil, err
	}
	if !exists {
		return nil, fmt.Errorf("dead-letter topic %s does not exist (walbox run creates it; kafka.dlq_topic names it)", d.topic)
	}
	committed, err := d.o.adm.FetchOffsets(ctx, GroupDLQ)
	if err != nil && !errors.Is(err, kerr.GroupIDNotFound) { // not found: nothing retried yet
		return nil, fmt.Errorf("read the offsets group %s committed on %s: %w", GroupDLQ, d.topic, err)
	}
	for p, s := range spans {
		if c, ok := committed.Lookup(d.topic, p); ok && c.Err == nil && c.At > s.from {
			s.from = min(c.At, s.to)
			spans[p] = s
		}
	}
	return spans, nil
}

// load reads the topic: markers hide the records they name, and of the
// records of one event (DeadLetterIdentity) the oldest stands for the
// others; an event one copy of which was retried is retried.
func (d *dlqTopic) load(ctx context.Context) error {
	if d.read {
		return nil
	}
	spans, err := d.committedSpans(ctx)
	if err != nil {
		return err
	}
	d.committed, d.end = map[int32]int64{}, map[int32]int64{}
	for p, s := range spans {
		d.committed[p], d.end[p] = s.from, s.to
	}
	handled := map[ref]bool{}
	var all []busops.DeadLetter
	err = d.o.read(ctx, d.topic, spans, func(r *kgo.Record) error {
		h := FromKafkaHeaders(r.Headers)
		if v := h.Get(HeaderDLQRetried); v != "" {
			if off, err := strconv.ParseInt(v, 10, 64); err == nil {
				handled[ref{r.Partition, off}] = true
			}
			return nil
		}
		dl := busops.NewDeadLetter(uint64(r.Offset)+1, r.Timestamp, d.topic, h)
		dl.Partition, dl.Data = r.Partition, r.Value
		all = append(all, dl)
		return nil
	})
	if err != nil {
		return err
	}
	slices.SortStableFunc(all, func(a, b busops.DeadLetter) int {
		return cmp.Or(cmp.Compare(a.Partition, b.Partition), cmp.Compare(a.Seq, b.Seq))
	})
	retried := map[string]bool{}
	for _, dl := range all {
		if k := DeadLetterIdentity(dl); k != "" && handled[refOf(dl)] {
			retried[k] = true
		}
	}
	d.copies, d.waiting = map[ref][]ref{}, map[ref]bool{}
	first := map[string]ref{}
	for _, dl := range all {
		at := refOf(dl)
		k := DeadLetterIdentity(dl)
		f, seen := first[k]
		switch {
		case handled[at], retried[k]:
			continue
		case k != "" && seen:
			d.copies[f] = append(d.copies[f], at)
		case k != "":
			first[k] = at
			fallthrough
		default:
			d.pending = append(d.pending, dl)
		}
		d.waiting[at] = true
	}
	d.read = true
	return nil
}

func refOf(dl busops.DeadLetter) ref { return ref{dl.Partition, int64(dl.Seq) - 1} }

// DeadLetterIdentity is a relay dead letter's event: its source, table and
// id (DESIGN.md, "Evidence"); "" when it has no id, or is a consumer
// group's.
func DeadLetterIdentity(dl busops.DeadLetter) string {
	if dl.ID == "" || dl.Group != "" {
		return ""
	}
	return dl.Header.Get(relay.HeaderSource) + "\x00" + relay.IdentityKey(dl.Header.Get(relay.HeaderTable), dl.ID)
}

// List implements busops.DLQ: with the payloads always.
func (d *dlqTopic) List(ctx context.Context, limit int, _ bool) ([]busops.DeadLetter, uint64, error) {
	if err := d.load(ctx); err != nil {
		return nil, 0, err
	}
	dls := d.pending
	if limit > 0 && len(dls) > limit {
		dls = dls[:limit]
	}
	return dls, uint64(len(d.pending)), nil
}

// Pick implements busops.DLQ: a seq names the dead letter or one of its
// copies, in one partition.
func (d *dlqTopic) Pick(ctx context.Context, seqs []uint64) ([]busops.DeadLetter, error) {
	if err := d.load(ctx); err != nil {
		return nil, err
	}
	var out []busops.DeadLetter
	for _, seq := range seqs {
		var found []busops.DeadLetter
		for _, dl := range d.pending {
			match := dl.Seq == seq
			for _, c := range d.copies[refOf(dl)] {
				match = match || uint64(c.offset)+1 == seq
			}
			if match {
				found = append(found, dl)
			}
		}
		switch len(found) {
		case 0:
			return nil, fmt.Errorf("no dead letter with seq %d waits in %s (walbox dlq list shows those that do; a retried one is not shown)", seq, d.topic)
		case 1:
			out = append(out, found[0])
		default:
			return nil, fmt.Errorf("seq %d is in %d partitions of %s: retry with --all, or give %s one partition", seq, len(found), d.topic, d.topic)
		}
	}
	return out, nil
}

// Retried implements busops.DLQ: a marker for dl and for each of its
// copies, in the partition of the record it names.
func (d *dlqTopic) Retried(ctx context.Context, dl busops.DeadLetter, at string) error {
	if d.marker == nil {
		cl, err := NewClient(d.o.sc, kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.RequiredAcks(kgo.AllISRAcks()))
		if err != nil {
			return err
		}
		d.marker = cl
	}
	for _, r := range append([]ref{refOf(dl)}, d.copies[refOf(dl)]...) {
		marker := &kgo.Record{Topic: d.topic, Partition: r.partition, Headers: []kgo.RecordHeader{
			{Key: HeaderDLQRetried, Value: []byte(strconv.FormatInt(r.offset, 10))},
			{Key: HeaderEventID, Value: []byte(dl.ID)},
		}}
		if at != "" {
			marker.Headers = append(marker.Headers, kgo.RecordHeader{Key: busops.HeaderRetriedFrom, Value: []byte(at)})
		}
		pctx, cancel := context.WithTimeout(ctx, d.o.sc.AckTimeout+10*time.Second)
		err := d.marker.ProduceSync(pctx, marker).FirstErr()
		cancel()
		if err != nil {
			return fmt.Errorf("mark record %d/%d: %w", r.partition, r.offset, err)
		}
		delete(d.waiting, r)
	}
	return nil
}

// Count implements busops.DLQ: as List counts when the topic holds at
// most 10000 records past the offsets group GroupDLQ committed; past that,
// the count of those records, which includes dead letters retried (and
// their markers) behind the first one still waiting.
func (d *dlqTopic) Count(ctx context.Context) (uint64, error) {
	spans, err := d.committedSpans(ctx)
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, s := range spans {
		n += uint64(s.to - s.from)
	}
	if n == 0 || n > 10000 {
		return n, nil
	}
	_, total, err := d.List(ctx, 0, false)
	return total, err
}

// Close implements busops.DLQ: it commits, per partition, the offset of
// the first dead letter still waiting (or the end read): the records
// before it are retried dead letters, markers and transaction markers.
func (d *dlqTopic) Close(ctx context.Context) error {
	if d.marker != nil {
		d.marker.Close()
	}
	if !d.read {
		return nil
	}
	offs := kadm.Offsets{}
	for p, next := range d.end {
		for r := range d.waiting {
			if r.partition == p {
				next = min(next, r.offset)
			}
		}
		if next > d.committed[p] {
			offs.AddOffset(d.topic, p, next, -1)
		}
	}
	if len(offs) == 0 {
		return nil
	}
	resp, err := d.o.adm.CommitOffsets(ctx, GroupDLQ, offs)
	if err == nil {
		err = resp.Error()
	}
	if err != nil {
		return fmt.Errorf("commit the offsets of group %s on %s: %w", GroupDLQ, d.topic, err)
	}
	return nil
}
