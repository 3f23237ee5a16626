// Package kafkasink is the relay's Kafka sink, on franz-go: an idempotent
// producer with acks=all, the event's partition key as the record key, and
// the read-back of what a topic holds for the resume check and the sweeper.
//
// Ordering and duplicates: the idempotent producer keeps each partition's
// records in order through its own retries, and when a record fails it fails
// every record buffered behind it in that partition, so a partition never
// stores a later record without an earlier one. Across producer sessions (a
// relay restart, a standby's takeover) Kafka has no Nats-Msg-Id; the relay's
// resume check reads back the tail of every partition of every topic and
// skips the ids stored there.
package kafkasink

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"

	promf "github.com/walbox/walbox/internal/metrics"
	"github.com/walbox/walbox/relay"
)

// Kafka header names that differ from walbox's NATS ones.
const (
	// HeaderEventID carries the event id (Nats-Msg-Id on JetStream).
	HeaderEventID = "Walbox-Event-Id"
	// ceKafkaPrefix is CloudEvents' Kafka binding's attribute prefix.
	ceKafkaPrefix = "ce_"
)

// DefaultMaxPayload is Kafka's default message.max.bytes (1 MiB).
const DefaultMaxPayload = 1 << 20

// Config is how the sink reaches Kafka.
type Config struct {
	Brokers  []string
	ClientID string
	TLS      *tls.Config    // nil: plaintext
	SASL     sasl.Mechanism // nil: none
	// AckTimeout bounds a record's delivery (delivery.timeout.ms); a record
	// that times out fails with every record buffered behind it in its
	// partition, and the relay resends them in order.
	AckTimeout time.Duration
	// MaxBuffered must exceed the relay's window, so Produce never blocks.
	MaxBuffered int
	// MaxPayload is the largest record the brokers take (message.max.bytes).
	MaxPayload int
	// Log receives the sink's errors and the client's warnings (the zero
	// Logger discards them).
	Log zerolog.Logger
	// Registerer is where the sink's metrics are registered (nil:
	// unregistered).
	Registerer prometheus.Registerer
	// TailBytes bounds, with the record count the relay asks, how much of
	// each partition the resume check's read-back needs: twice the relay's
	// window in bytes (0: the count alone).
	TailBytes int64
	// TransactionalID, when set, makes the producer transactional (see
	// txn.go): an ack means the record's transaction committed, a failed
	// record aborts its transaction, and each leadership term fences the
	// id's previous holder (TakeOver). Empty: idempotent only, unfenced.
	TransactionalID string
}

// metrics are the sink's own series, next to the relay's.
type metrics struct {
	dataLoss     *prometheus.CounterVec
	partsChanged *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	f := promf.On(reg)
	return &metrics{
		dataLoss: f.CounterVec("walbox_kafka_data_loss_total",
			"Times a broker answered a produce with OUT_OF_ORDER_SEQUENCE_NUMBER or UNKNOWN_PRODUCER_ID, i.e. lost records it had acked, by topic.", "topic"),
		partsChanged: f.CounterVec("walbox_kafka_partition_count_changed_total",
			"Times a topic's partition count was found changed since walbox recorded it; publishing to the topic stops until walbox restarts, by topic.", "topic"),
	}
}

// Sink produces to Kafka. It implements relay.Sink and sweep.StreamReader.
type Sink struct {
	cfg Config
	cl  *kgo.Client
	lim *limits
	m   *metrics
	isr minISRGuard
	// counts: each topic's partition count as recorded at start; the
	// producer hashes keys over it only.
	counts *partCounts

	// txn produces in transactions when Config.TransactionalID is set;
	// cl then only reads and administers.
	txn *txnProducer
	// tails are the resume check's read-backs so far (tail.go).
	tails tailCache

	mu    sync.Mutex
	parts map[string]int // partitions of each topic at its last read-back
}

// clientOpts are the connection options shared by the producer, the admin
// client and the read-back consumers.
func (c Config) clientOpts() []kgo.Opt {
	opts := []kgo.Opt{kgo.SeedBrokers(c.Brokers...)}
	if c.ClientID != "" {
		opts = append(opts, kgo.ClientID(c.ClientID))
	}
	if c.TLS != nil {
		opts = append(opts, kgo.DialTLSConfig(c.TLS))
	}
	if c.SASL != nil {
		opts = append(opts, kgo.SASL(c.SASL))
	}
	return opts
}

// New starts the producer. It does not contact the brokers yet.
func New(cfg Config) (*Sink, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("kafka: no brokers configured (kafka.brokers)")
	}
	if cfg.AckTimeout <= 0 {
		cfg.AckTimeout = 30 * time.Second
	}
	if cfg.MaxBuffered <= 0 {
		cfg.MaxBuffered = 10000
	}
	if cfg.MaxPayload <= 0 {
		cfg.MaxPayload = DefaultMaxPayload
	}
	lim := &limits{max: int32(min(cfg.MaxPayload, 1<<30))}
	m := newMetrics(cfg.Registerer)
	counts := &partCounts{onChange: func(topic string, was, now int) {
		m.partsChanged.WithLabelValues(topic).Inc()
		cfg.Log.Error().Str("topic", topic).Int("partitions_recorded", was).Int("partitions_now", now).
			Msg("Kafka topic's partition count changed while walbox runs: publishing to it stops, as keys would move to other partitions and their order break. " +
				"Let the topic's consumers read everything up to now, then restart walbox, which records the new count (README, Kafka: adding partitions)")
	}}
	opts := append(cfg.clientOpts(),
		kgo.WithLogger(kgoLogger{cfg.Log}),
		kgo.ProducerOnDataLossDetected(onDataLoss(cfg.Log, m)),
		kgo.RequiredAcks(kgo.AllISRAcks()), // idempotent writes need it, and a leader alone is not durable
		kgo.RecordDeliveryTimeout(cfg.AckTimeout),
		kgo.MaxBufferedRecords(cfg.MaxBuffered),
		kgo.ProducerBatchMaxBytesFn(lim.batchMax),
		kgo.RecordPartitioner(newKeyPartitioner(counts)),
		kgo.ProducerLinger(0),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("kafka client: %w", err)
	}
	s := &Sink{cfg: cfg, cl: cl, lim: lim, m: m, counts: counts}
	if cfg.TransactionalID != "" {
		// A transaction left open by a paused holder blocks read_committed
		// readers of its partitions until the brokers abort it: twice the
		// ack timeout, or a standby's takeover, whichever comes first.
		topts := append(opts[:len(opts):len(opts)], kgo.TransactionTimeout(max(2*cfg.AckTimeout, 10*time.Second)))
		s.txn = newTxnProducer(cfg.TransactionalID, topts, cfg.MaxBuffered, cfg.Log, s.decide)
	}
	return s, nil
}

// TakeOver starts a leadership term of a transactional sink: it fences the
// transactional id's previous holder, whose open transaction the brokers
// abort, before this relay reads anything back or publishes. A no-op for an
// idempotent sink.
func (s *Sink) TakeOver(ctx context.Context) error {
	if s.txn == nil {
		return nil
	}
	return s.txn.TakeOver(ctx)
}

// Fenced is closed when another producer took the transactional id over
// during the current term (never for an idempotent sink): the relay must
// stop leading.
func (s *Sink) Fenced() <-chan struct{} {
	if s.txn == nil {
		return nil
	}
	return s.txn.Fenced()
}

// Transactional reports whether the sink produces in transactions.
func (s *Sink) Transactional() bool { return s.txn != nil }

// decide refines a produce error: the partition count changed (the
// partitioner refused the record), or a MESSAGE_TOO_LARGE decided per
// record.
func (s *Sink) decide(r *kgo.Record, err error) error {
	if cerr := s.counts.err(r.Topic); cerr != nil {
		// The partitioner refused it: the count changed.
		err = cerr
	}
	return fmt.Errorf("produce to %s: %w", r.Topic, s.lim.decideTooLarge(r, err))
}

// Client returns the producer's client (for admin requests).
func (s *Sink) Client() *kgo.Client { return s.cl }

// Close flushes nothing: records not yet acked fail, and the relay, which
// confirms only acked ones, sends them again on its next start.
func (s *Sink) Close() {
	if s.txn != nil {
		s.txn.Close()
	}
	s.cl.Close()
}

// keyPartitioner is Kafka's own key hashing (murmur2, as the Java client),
// and partition 0 for records without a key, so that they keep their order
// too instead of being spread at random. With counts, it hashes over a
// topic's recorded partition count only: when the client sees another
// count, it fails the record (an invalid choice, -1) instead of moving its
// key to another partition, and Publish says why.
type keyPartitioner struct {
	keyed  kgo.Partitioner
	counts *partCounts // nil: hash over the count given
}

// newKeyPartitioner is the partitioner the producer uses, and PartitionOf
// asks: one definition, so the two never disagree.
func newKeyPartitioner(counts *partCounts) keyPartitioner {
	return keyPartitioner{keyed: kgo.StickyKeyPartitioner(nil), counts: counts}
}

func (p keyPartitioner) ForTopic(topic string) kgo.TopicPartitioner {
	return keyTopicPartitioner{keyed: p.keyed.ForTopic(topic), topic: topic, counts: p.counts}
}

type keyTopicPartitioner struct {
	keyed  kgo.TopicPartitioner
	topic  string
	counts *partCounts
}

func (p keyTopicPartitioner) RequiresConsistency(*kgo.Record) bool { return true }

func (p keyTopicPartitioner) Partition(r *kgo.Record, n int) int {
	if p.counts != nil && !p.counts.see(p.topic, n) {
		return -1
	}
	if len(r.Key) == 0 {
		return 0
	}
	return p.keyed.Partition(r, n)
}

// PartitionOf implements relay.Partitioner: the partition Kafka's key
// hashing (keyPartitioner) puts m in, for the partition count of m's topic
// walbox recorded (at start, see partCounts), or else the one of its last
// read-back (StoredTail). Unknown before either. The sink publishes to no
// other count: when partitions are added, publishing to the topic waits
// (ErrPartitionCountChanged).
func (s *Sink) PartitionOf(m *relay.Msg) (int32, bool) {
	n, ok := s.counts.count(m.Subject)
	if !ok {
		s.mu.Lock()
		n, ok = s.parts[m.Subject]
		s.mu.Unlock()
	}
	if !ok || n <= 0 {
		return 0, false
	}
	rec := &kgo.Record{Topic: m.Subject}
	if m.Key != "" {
		rec.Key = []byte(m.Key)
	}
	p := newKeyPartitioner(nil).ForTopic(m.Subject).Partition(rec, n)
	return int32(p), true
}

// Publish implements relay.Sink. The future resolves from the produce
// promise: per partition in order, and for every record.
func (s *Sink) Publish(m *relay.Msg) (relay.Future, error) {
	if err := s.counts.err(m.Subject); err != nil {
		return nil, err
	}
	rec := &kgo.Record{Topic: m.Subject, Value: m.Data, Headers: ToKafkaHeaders(m.Header)}
	if m.Key != "" {
		rec.Key = []byte(m.Key)
	}
	fut, resolve := relay.NewFuture()
	if s.txn != nil {
		if aloneSize(rec) > int(s.lim.batchMax(rec.Topic)) {
			// franz-go would refuse it before sending, inside a
			// transaction it would then abort for its successors.
			resolve.Resolve(nil, s.decide(rec, kerr.MessageTooLarge))
			return fut, nil
		}
		s.txn.publish(rec, m.Epoch, recordID(rec), resolve)
		return fut, nil
	}
	s.cl.Produce(context.Background(), rec, func(r *kgo.Record, err error) {
		if err != nil {
			resolve.Resolve(nil, s.decide(r, err))
			return
		}
		// Sequence is 1-based, as JetStream's: offset 0 is sequence 1
		// (the relay and the sweeper take sequence 0 for "not stored").
		resolve.Resolve(&relay.Ack{Stream: r.Topic, Partition: r.Partition, Sequence: uint64(r.Offset) + 1}, nil)
	})
	return fut, nil
}

// Epoch implements relay.Sink. Transactional: it moves on every failed
// record and every term, and a record published under an older one is
// refused unsent (txn.go). Idempotent: constant; the client fails a
// partition's buffered records together, but a record produced after that
// and before the relay heard of it can be stored ahead of the failed one
// (issue 35, item 4: what transactions fix).
func (s *Sink) Epoch() uint64 {
	if s.txn != nil {
		return s.txn.Epoch()
	}
	return 0
}

// recordID is the event id a record carries (Walbox-Event-Id), or "".
func recordID(r *kgo.Record) string {
	for _, h := range r.Headers {
		if h.Key == HeaderEventID {
			return string(h.Value)
		}
	}
	return ""
}

// MaxPayload implements relay.Sink.
func (s *Sink) MaxPayload() int { return s.cfg.MaxPayload }

// Classify implements relay.Sink.
func (s *Sink) Classify(err error) relay.ErrorClass { return Classify(err) }

// ToKafkaHeaders turns walbox's headers into record headers: the event id
// as Walbox-Event-Id, CloudEvents attributes with the Kafka binding's ce_
// prefix and content-type in lower case; JetStream's own headers are
// dropped.
func ToKafkaHeaders(h relay.Header) []kgo.RecordHeader {
	out := make([]kgo.RecordHeader, 0, len(h))
	_, hasID := h[HeaderEventID]
	for k, vs := range h {
		switch {
		case k == relay.HeaderMsgID:
			if hasID {
				continue
			}
			k = HeaderEventID
		case strings.HasPrefix(k, "Nats-"):
			continue
		case strings.HasPrefix(strings.ToLower(k), "ce-"):
			k = ceKafkaPrefix + strings.ToLower(k[3:])
		case strings.EqualFold(k, relay.HeaderContentType):
			k = "content-type"
		}
		for _, v := range vs {
			out = append(out, kgo.RecordHeader{Key: k, Value: []byte(v)})
		}
	}
	return out
}

// FromKafkaHeaders is the inverse of ToKafkaHeaders, for the read-back and
// the tools: the event id is also under relay.HeaderMsgID.
func FromKafkaHeaders(hs []kgo.RecordHeader) relay.Header {
	h := make(relay.Header, len(hs)+1)
	for _, rh := range hs {
		k := rh.Key
		switch {
		case strings.HasPrefix(k, ceKafkaPrefix):
			k = "ce-" + k[len(ceKafkaPrefix):]
		case k == "content-type":
			k = relay.HeaderContentType
		}
		h[k] = append(h[k], string(rh.Value))
	}
	if id := h.Get(HeaderEventID); id != "" {
		h.Set(relay.HeaderMsgID, id)
	}
	return h
}
