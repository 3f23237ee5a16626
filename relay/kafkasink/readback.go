package kafkasink

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/relay"
)

// TopicSpec is a topic as the config declares it.
type TopicSpec struct {
	Name              string
	Partitions        int32 // 0: the broker's default
	ReplicationFactor int16 // 0: the broker's default
	// Manage: create the topic when it is missing (true), or only check it
	// exists where the platform team owns topics (false).
	Manage bool
	// MaxMessageBytes, when set, is the least max.message.bytes the topic
	// needs: a managed topic is created with it, and raised to it when it
	// has less (the dead-letter topic, whose dead letters keep payloads up
	// to kafka.max_message_bytes).
	MaxMessageBytes int32
}

// EnsureTopics is EnsureTopics with the sink's client, and then reads the
// brokers' message.max.bytes and each topic's max.message.bytes, which cap
// the producer's batches from then on (franz-go takes a partition's cap when
// it first produces to it), and sees that every topic replicated three
// times or more needs two in-sync replicas for an ack (ensureMinISR).
func (s *Sink) EnsureTopics(ctx context.Context, topics []TopicSpec) ([]relay.Route, error) {
	routes, err := EnsureTopics(ctx, s.cl, topics)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(topics))
	for _, t := range topics {
		names = append(names, t.Name)
	}
	adm := kadm.NewClient(s.cl)
	// One read of the topics' configs serves the size limits and the
	// in-sync replicas.
	tcs, err := adm.DescribeTopicConfigs(ctx, names...)
	if err != nil {
		return nil, fmt.Errorf("read the topics' configs: %w", err)
	}
	if err := s.lim.read(ctx, adm, tcs); err != nil {
		return nil, err
	}
	shapes, err := describeTopics(ctx, s.cl, names)
	if err != nil {
		return nil, err
	}
	for t, sh := range shapes {
		s.counts.see(t, sh.partitions) // recorded: keys are hashed over it from now on
	}
	if err := s.ensureMinISR(ctx, adm, topics, shapes, tcs); err != nil {
		return nil, err
	}
	return routes, nil
}

// raiseLimit raises a managed topic's max.message.bytes to t.MaxMessageBytes
// when it is lower.
func raiseLimit(ctx context.Context, adm *kadm.Client, t TopicSpec) error {
	rcs, err := adm.DescribeTopicConfigs(ctx, t.Name)
	if err != nil {
		return fmt.Errorf("read max.message.bytes of topic %s: %w", t.Name, err)
	}
	cs, err := topicConfigs(rcs, t.Name)
	if err != nil {
		return fmt.Errorf("read max.message.bytes of topic %s: %w", t.Name, err)
	}
	if v := configInt(cs, "max.message.bytes"); v >= t.MaxMessageBytes {
		return nil
	}
	err = alterTopicConfig(ctx, adm, t.Name, "max.message.bytes", strconv.Itoa(int(t.MaxMessageBytes)))
	if notAllowed(err) {
		// Not walbox's to change here: the topic keeps its limit, and
		// what it refuses as too large goes without its payload.
		return nil
	}
	if err != nil {
		return fmt.Errorf("raise max.message.bytes of topic %s to %d: %w", t.Name, t.MaxMessageBytes, err)
	}
	return nil
}

// topicConfigs are topic's configs in rcs, or the error the brokers
// answered for it.
func topicConfigs(rcs kadm.ResourceConfigs, topic string) ([]kadm.Config, error) {
	rc, err := rcs.On(topic, nil)
	if err == nil {
		err = rc.Err
	}
	return rc.Configs, err
}

// alterTopicConfig sets one config of topic, with the brokers' answer for
// it as the error.
func alterTopicConfig(ctx context.Context, adm *kadm.Client, topic, key, value string) error {
	resp, err := adm.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: key, Value: kadm.StringPtr(value)}}, topic)
	if err == nil {
		for _, r := range resp {
			if r.Err != nil {
				err = fmt.Errorf("%w %s", r.Err, r.ErrMessage)
			}
		}
	}
	return err
}

// notAllowed reports whether the brokers refused a change as walbox's role
// may not make it (authorization, or a policy).
func notAllowed(err error) bool {
	return errors.Is(err, kerr.TopicAuthorizationFailed) || errors.Is(err, kerr.ClusterAuthorizationFailed) || errors.Is(err, kerr.PolicyViolation)
}

// EnsureTopics creates the missing topics that walbox manages (with
// min.insync.replicas=2 where the replication factor is 3 or more) and
// checks the others exist. Each topic is its own route: the topic template renders the
// topic name, and an event whose topic is not declared is dead-lettered.
func EnsureTopics(ctx context.Context, cl *kgo.Client, topics []TopicSpec) ([]relay.Route, error) {
	adm := kadm.NewClient(cl)
	var names []string
	for _, t := range topics {
		names = append(names, t.Name)
	}
	details, err := adm.ListTopics(ctx, names...)
	if err != nil {
		return nil, fmt.Errorf("list topics: %w", err)
	}
	var routes []relay.Route
	for _, t := range topics {
		d, ok := details[t.Name]
		if !ok || d.Err != nil {
			if d.Err != nil && !errors.Is(d.Err, kerr.UnknownTopicOrPartition) {
				return nil, fmt.Errorf("topic %s: %w", t.Name, d.Err)
			}
			if !t.Manage {
				return nil, fmt.Errorf("topic %s does not exist (kafka.topics[].manage is false, so walbox only checks it): create it, or set manage: true", t.Name)
			}
			parts, rf := t.Partitions, t.ReplicationFactor
			if parts == 0 {
				parts = -1
			}
			if rf == 0 {
				rf = -1
			}
			// With three or more replicas, acks=all is only worth it when
			// a write needs two of them in sync.
			configs := map[string]*string{}
			if t.ReplicationFactor >= 3 {
				configs["min.insync.replicas"] = kadm.StringPtr("2")
			}
			if t.MaxMessageBytes > 0 {
				configs["max.message.bytes"] = kadm.StringPtr(strconv.Itoa(int(t.MaxMessageBytes)))
			}
			resp, err := adm.CreateTopics(ctx, parts, rf, configs, t.Name)
			if err != nil {
				return nil, fmt.Errorf("create topic %s: %w", t.Name, err)
			}
			for _, r := range resp {
				if r.Err != nil && !errors.Is(r.Err, kerr.TopicAlreadyExists) {
					return nil, fmt.Errorf("create topic %s: %w %s", t.Name, r.Err, r.ErrMessage)
				}
			}
		}
		if ok && d.Err == nil && t.Manage && t.MaxMessageBytes > 0 {
			if err := raiseLimit(ctx, adm, t); err != nil {
				return nil, err
			}
		}
		routes = append(routes, relay.Route{Stream: t.Name, Subjects: []string{t.Name}})
	}
	return routes, nil
}

// span is the offsets [from, to) of one partition to read.
type span struct{ from, to int64 }

// spans lists, per partition of topic, the offsets to read: the newest n
// (n > 0), or [first, last] clipped to what the partition holds; and how
// many partitions the topic has (empty ones included).
func spans(ctx context.Context, adm *kadm.Client, topic string, n int, first, last int64) (map[int32]span, int, error) {
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return nil, 0, fmt.Errorf("list start offsets of %s: %w", topic, err)
	}
	// The last stable offset, not the high watermark: past it are records
	// of transactions not yet ended, which read_committed does not return
	// (and which are not stored until they commit).
	ends, err := adm.ListCommittedOffsets(ctx, topic)
	if err != nil {
		return nil, 0, fmt.Errorf("list end offsets of %s: %w", topic, err)
	}
	out := map[int32]span{}
	var lerr error
	parts := 0
	ends.Each(func(e kadm.ListedOffset) {
		parts++
		if e.Err != nil {
			lerr = fmt.Errorf("end offset of %s/%d: %w", topic, e.Partition, e.Err)
			return
		}
		s, ok := starts.Lookup(topic, e.Partition)
		if ok && s.Err != nil {
			lerr = fmt.Errorf("start offset of %s/%d: %w", topic, e.Partition, s.Err)
			return
		}
		if !ok {
			// A partition just created may be missing from the first
			// listing: read from 0, which the fetch clips to its start.
			s.Offset = 0
		}
		sp := span{from: s.Offset, to: e.Offset}
		if n > 0 {
			sp.from = max(sp.from, e.Offset-int64(n))
		} else {
			sp.from = max(sp.from, first)
			sp.to = min(sp.to, last+1)
		}
		if sp.from < sp.to {
			out[e.Partition] = sp
		}
	})
	return out, parts, lerr
}

// FetchErr is the first error of fs, as "what topic/partition: error".
func FetchErr(fs kgo.Fetches, what string) error {
	var ferr error
	fs.EachError(func(topic string, p int32, err error) {
		if ferr == nil {
			ferr = fmt.Errorf("%s %s/%d: %w", what, topic, p, err)
		}
	})
	return ferr
}

// ReadOpts are the consumer options of every read-back: only committed
// records (an aborted transaction's records were never stored), and the
// transactions' control records kept, so that a reader knows it reached an
// offset whose record is a commit or abort marker (offsets of a
// transactional topic are not contiguous in data records).
func ReadOpts() []kgo.Opt {
	return []kgo.Opt{kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords()}
}

// readSpans calls fn with every committed data record of topic in spans,
// partition by partition in offset order, with a consumer of its own (no
// group: nothing is committed). Offsets are not contiguous: transaction
// markers take some, and aborted records are never delivered; the
// consumer keeps the markers (ReadOpts) to see where a span ends (its last
// offset may be one), and passes fn data records only.
func readSpans(ctx context.Context, cfg Config, topic string, spans map[int32]span, fn func(*kgo.Record) error) error {
	parts := map[int32]kgo.Offset{}
	for p, s := range spans {
		if s.from < s.to {
			parts[p] = kgo.NewOffset().At(s.from)
		}
	}
	if len(parts) == 0 {
		return nil
	}
	cl, err := NewClient(cfg, append(ReadOpts(), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: parts}))...)
	if err != nil {
		return fmt.Errorf("read %s: %w", topic, err)
	}
	defer cl.Close()
	done := map[int32]bool{}
	for left := len(parts); left > 0; {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("read %s: %w", topic, err)
		}
		if err := FetchErr(fs, "read"); err != nil {
			return err
		}
		for it := fs.RecordIter(); !it.Done(); {
			r := it.Next()
			s, ok := spans[r.Partition]
			if !ok || done[r.Partition] || r.Offset < s.from || s.from >= s.to {
				continue
			}
			if r.Offset < s.to && !r.Attrs.IsControl() {
				if err := fn(r); err != nil {
					return err
				}
			}
			if r.Offset >= s.to-1 {
				done[r.Partition] = true
				left--
			}
		}
	}
	return nil
}

// ReadBack implements sweep.StreamReader: what every record of source in
// rr (relay.ReadBackRange) says of its event (relay.StoredEventFromHeaders).
// Sequences are offsets + 1 (see Publish), per partition: a range covers
// each partition's records at those offsets, and the newest records are
// read partition by partition, until fn has counted rr.Want in each. The
// sweeper marks only ids it read back.
func (s *Sink) ReadBack(ctx context.Context, topic, source string, rr relay.ReadBackRange, fn func(relay.StoredEvent) bool) error {
	adm := kadm.NewClient(s.cl)
	counted := map[int32]int{}
	read := func(sp map[int32]span) error {
		return readSpans(ctx, s.cfg, topic, sp, func(r *kgo.Record) error {
			h := FromKafkaHeaders(r.Headers)
			if h.Get(relay.HeaderSource) == source && fn(relay.StoredEventFromHeaders(h)) {
				counted[r.Partition]++
			}
			return nil
		})
	}
	if rr.First > 0 {
		sp, _, err := spans(ctx, adm, topic, 0, int64(rr.First)-1, int64(rr.Last)-1)
		if err != nil {
			return err
		}
		return read(sp)
	}
	want := max(rr.Want, 1)
	sp, _, err := spans(ctx, adm, topic, want, 0, 0)
	if err != nil {
		return err
	}
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return fmt.Errorf("list start offsets of %s: %w", topic, err)
	}
	// Then older records of each partition that has not shown want of
	// them, in chunks twice as large each time, until its start or
	// rr.ScanMax records read in it.
	chunk := int64(want)
	scanned := map[int32]int64{}
	for len(sp) > 0 {
		if err := read(sp); err != nil {
			return err
		}
		chunk = min(2*chunk, maxReadBackChunk)
		older := map[int32]span{}
		for p, r := range sp {
			scanned[p] += r.to - r.from
			start := int64(0)
			if o, ok := starts.Lookup(topic, p); ok && o.Err == nil {
				start = o.Offset
			}
			left := int64(rr.ScanMax) - scanned[p]
			if counted[p] >= want || r.from <= start || (rr.ScanMax > 0 && left <= 0) {
				continue
			}
			from := max(start, r.from-chunk)
			if rr.ScanMax > 0 {
				from = max(from, r.from-left)
			}
			older[p] = span{from: from, to: r.from}
		}
		sp = older
	}
	return nil
}

// maxReadBackChunk bounds the records of one partition that one step of a
// read-back of the newest records reads.
const maxReadBackChunk = 1 << 20

// CountRecords is how many committed data records each partition of topic
// holds, read with a client of its own (end minus start offsets would also
// count transaction markers and aborted records). Empty partitions are
// left out.
func CountRecords(ctx context.Context, cfg Config, topic string) (map[int32]int64, error) {
	cl, err := NewClient(cfg)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	sp, _, err := spans(ctx, kadm.NewClient(cl), topic, 0, 0, 1<<62)
	if err != nil {
		return nil, err
	}
	out := map[int32]int64{}
	err = readSpans(ctx, cfg, topic, sp, func(r *kgo.Record) error {
		out[r.Partition]++
		return nil
	})
	return out, err
}

// NewClient is a client with the sink's connection options (brokers, TLS,
// SASL, client id) and opts: for the tools' admin requests, consumers and
// producers of their own.
func NewClient(cfg Config, opts ...kgo.Opt) (*kgo.Client, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("kafka: no brokers configured (kafka.brokers)")
	}
	cl, err := kgo.NewClient(append(cfg.clientOpts(), opts...)...)
	if err != nil {
		return nil, fmt.Errorf("kafka client: %w", err)
	}
	return cl, nil
}
