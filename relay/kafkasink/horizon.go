package kafkasink

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Horizon tells where the records of Kafka topics begin, for the claim
// check's retention sweep (it implements claim.Horizon).
//
// Proof of its cutoff. Kafka removes records from the front of a
// partition only (retention by time or size deletes whole old segments,
// DeleteRecords moves the log start offset); compaction may remove records
// anywhere, but never adds old ones. So the records a partition still
// holds are those at offsets from its log start offset L on, and they were
// appended in offset order. Let F be the first record (data, aborted or a
// transaction marker: read_uncommitted with the markers kept) at an offset
// at or after L, with timestamp T_F. T_F is its producer's clock when it
// produced F (CreateTime), before F was appended, or the broker's clock at
// the append (LogAppendTime); either way T_F <= append(F) + the clocks'
// difference. A record m of walbox still held in the partition is at an
// offset at or after F's, so append(m) >= append(F) >= T_F - the clocks'
// difference. The claim check's upload of m's object began at the
// object's modification time M, and m was appended within the upload
// timeout plus the ack timeout after M (claim.Sweeper). So if M + slack <
// min over the partitions of T_F, with slack = upload timeout + ack timeout
// + a margin for the clocks, no record of the object is held in any
// partition of the topic: its message is gone. A partition that holds
// nothing (L = high watermark) contributes now; a topic that is gone, now.
//
// What the proof assumes: every producer of the topic stamps its records
// with a clock within the margin of walbox's (walbox is the producer of
// its topics; a topic others write with timestamps of their own should use
// message.timestamp.type=LogAppendTime). A first record stamped more than
// the margin after now shows a clock that cannot be trusted: Cutoff then
// fails, and the sweep keeps the topic's objects.
//
// Why not now - retention.ms: it is no evidence. Kafka deletes a segment
// only when its newest record is older than retention.ms, and the active
// segment only after it rolls (segment.ms, a week by default), so records
// older than retention.ms are commonly still there to read.
type Horizon struct {
	cfg Config
	// clockMargin: how far in the future a first record may be stamped
	// before Cutoff distrusts the topic's timestamps.
	clockMargin time.Duration
}

// cutoffTimeout bounds one topic's Cutoff.
const cutoffTimeout = 30 * time.Second

// NewHorizon reads topics with cfg's connection options (brokers, TLS,
// SASL); clockMargin is the margin for clocks the sweep's slack includes.
func NewHorizon(cfg Config, clockMargin time.Duration) *Horizon {
	return &Horizon{cfg: cfg, clockMargin: clockMargin}
}

// Cutoff implements claim.Horizon: the oldest timestamp of the first
// record each partition of topic holds (now for an empty partition, or a
// topic that is gone), never after now.
func (h *Horizon) Cutoff(ctx context.Context, topic string, now time.Time) (time.Time, error) {
	// One topic that does not answer must not hold the whole sweep.
	ctx, cancel := context.WithTimeout(ctx, cutoffTimeout)
	defer cancel()
	cl, err := NewClient(h.cfg)
	if err != nil {
		return time.Time{}, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return time.Time{}, fmt.Errorf("list start offsets of %s: %w", topic, err)
	}
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		return time.Time{}, fmt.Errorf("list end offsets of %s: %w", topic, err)
	}
	from := map[int32]kgo.Offset{}
	gone := false
	var lerr error
	starts.Each(func(s kadm.ListedOffset) {
		if errors.Is(s.Err, kerr.UnknownTopicOrPartition) && s.Partition == -1 {
			gone = true
			return
		}
		if s.Err != nil {
			lerr = fmt.Errorf("start offset of %s/%d: %w", topic, s.Partition, s.Err)
			return
		}
		e, ok := ends.Lookup(topic, s.Partition)
		if !ok || e.Err != nil {
			lerr = fmt.Errorf("end offset of %s/%d: %v", topic, s.Partition, e.Err)
			return
		}
		if s.Offset < e.Offset {
			from[s.Partition] = kgo.NewOffset().At(s.Offset)
		}
	})
	if gone {
		return now, nil
	}
	if lerr != nil {
		return time.Time{}, lerr
	}
	cutoff := now
	if len(from) == 0 {
		return cutoff, nil
	}
	// A consumer of its own, read_uncommitted with the markers kept, so
	// that the first record of each partition comes back whatever it is;
	// when retention moved the log start meanwhile, it resets to the new
	// start (a later first record: still the first held).
	rc, err := NewClient(h.cfg, kgo.FetchIsolationLevel(kgo.ReadUncommitted()), kgo.KeepControlRecords(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxPartitionBytes(1),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: from}))
	if err != nil {
		return time.Time{}, err
	}
	defer rc.Close()
	seen := map[int32]bool{}
	for len(seen) < len(from) {
		fs := rc.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return time.Time{}, fmt.Errorf("read the first record of each partition of %s: %w", topic, err)
		}
		if err := FetchErr(fs, "read the first record of"); err != nil {
			return time.Time{}, err
		}
		for it := fs.RecordIter(); !it.Done(); {
			r := it.Next()
			if seen[r.Partition] {
				continue
			}
			seen[r.Partition] = true
			if r.Timestamp.After(now.Add(h.clockMargin)) {
				return time.Time{}, fmt.Errorf("the first record held in %s/%d (offset %d) is stamped %s, later than now (%s): its producer's clock cannot be trusted to tell which records are gone",
					topic, r.Partition, r.Offset, r.Timestamp.UTC().Format(time.RFC3339Nano), now.UTC().Format(time.RFC3339Nano))
			}
			if r.Timestamp.Before(cutoff) {
				cutoff = r.Timestamp
			}
		}
	}
	return cutoff, nil
}
