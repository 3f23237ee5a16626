package kafkasink

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kbin"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// The sink's verdicts on a MESSAGE_TOO_LARGE (see decideTooLarge).
var (
	// ErrRecordTooLarge: the record alone, as a batch of one, is over its
	// topic's limit.
	ErrRecordTooLarge = errors.New("record alone over its topic's limit")
	// ErrBatchTooLarge: the record was refused with its batch, and alone
	// fits the topic's limit.
	ErrBatchTooLarge = errors.New("batch over its topic's limit")
)

// minBatchBytes is the smallest batch cap franz-go takes.
const minBatchBytes = 512

// limits is the largest batch each topic takes: the topic's
// max.message.bytes (which defaults to the brokers' message.max.bytes), as
// read from the brokers at start and whenever the topics are ensured, and
// never more than kafka.max_message_bytes.
type limits struct {
	max int32 // kafka.max_message_bytes

	mu     sync.Mutex
	broker int32            // the brokers' message.max.bytes, 0 unread
	topics map[string]int32 // each topic's max.message.bytes
}

// batchMax is the batch cap for topic (kgo.ProducerBatchMaxBytesFn). franz-go
// asks it once per partition, when it first produces to the partition.
func (l *limits) batchMax(topic string) int32 {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.max
	if v, ok := l.topics[topic]; ok && v > 0 {
		m = min(m, v)
	} else if l.broker > 0 {
		m = min(m, l.broker)
	}
	return max(m, minBatchBytes)
}

// configInt is the integer value of key among cs, 0 when absent.
func configInt(cs []kadm.Config, key string) int32 {
	for _, c := range cs {
		if c.Key == key && c.Value != nil {
			n, err := strconv.ParseInt(*c.Value, 10, 32)
			if err == nil && n > 0 {
				return int32(n)
			}
		}
	}
	return 0
}

// read reads the brokers' message.max.bytes and takes each topic's
// max.message.bytes from its configs tcs.
func (l *limits) read(ctx context.Context, adm *kadm.Client, tcs kadm.ResourceConfigs) error {
	bcs, err := adm.DescribeBrokerConfigs(ctx)
	if err != nil {
		return fmt.Errorf("read the brokers' message.max.bytes: %w", err)
	}
	var broker int32
	for _, rc := range bcs {
		if rc.Err == nil {
			broker = max(broker, configInt(rc.Configs, "message.max.bytes"))
		}
	}
	got := map[string]int32{}
	for _, rc := range tcs {
		if rc.Err != nil {
			return fmt.Errorf("read max.message.bytes of topic %s: %w", rc.Name, rc.Err)
		}
		if v := configInt(rc.Configs, "max.message.bytes"); v > 0 {
			got[rc.Name] = v
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if broker > 0 {
		l.broker = broker
	}
	if l.topics == nil {
		l.topics = map[string]int32{}
	}
	for t, v := range got {
		l.topics[t] = v
	}
	return nil
}

// aloneSize is the size of r as a batch of one record, uncompressed, as
// franz-go counts it against the batch cap (kgo's recordBatchOverhead, 65
// bytes, and the record's encoding): an upper bound of what the broker
// counts against max.message.bytes.
func aloneSize(r *kgo.Record) int {
	const batchOverhead = 65
	l := 1 + // attributes
		kbin.VarlongLen(0) + // timestamp delta
		kbin.VarintLen(0) + // offset delta
		kbin.VarintLen(int32(len(r.Key))) + len(r.Key) +
		kbin.VarintLen(int32(len(r.Value))) + len(r.Value) +
		kbin.VarintLen(int32(len(r.Headers)))
	for _, h := range r.Headers {
		l += kbin.VarintLen(int32(len(h.Key))) + len(h.Key) + kbin.VarintLen(int32(len(h.Value))) + len(h.Value)
	}
	return batchOverhead + kbin.VarintLen(int32(l)) + l
}

// decideTooLarge turns a MESSAGE_TOO_LARGE of record r into a verdict about
// r. A batch refused as too large says nothing about each of its records
// (issue 35): only a record that alone is over its topic's limit fails the
// same way every time, and it is permanent (ErrRecordTooLarge); any other
// is resent (ErrBatchTooLarge, transient).
//
// Proof of the permanent verdict: r alone, uncompressed, is larger than
// batchMax(topic), the cap franz-go builds batches with (kafka.max_message_bytes,
// or the topic's max.message.bytes read from the brokers if lower). franz-go
// refuses such a record before sending it, every time: a batch holding it
// would be over the cap. Where the proof fails: when the topic's limit was
// raised since it was read, the record would fit now, and is dead-lettered
// all the same (read again at the next start); when it was lowered since,
// batches of records that each fit the limit read are refused, and they
// are resent (transient) rather than dead-lettered: waiting is safe.
func (l *limits) decideTooLarge(r *kgo.Record, err error) error {
	if !errors.Is(err, kerr.MessageTooLarge) {
		return err
	}
	size, limit := aloneSize(r), l.batchMax(r.Topic)
	if size > int(limit) {
		return fmt.Errorf("%w (%d bytes, limit %d): %w", ErrRecordTooLarge, size, limit, err)
	}
	return fmt.Errorf("%w (the record alone is %d bytes, limit %d; resent): %w", ErrBatchTooLarge, size, limit, err)
}
