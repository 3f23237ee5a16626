package ops

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// kafkaGroupDLQ is the consumer group whose committed offsets on the
// dead-letter topic mark where `walbox dlq list` starts: every record
// before them was retried (or is a retry marker).
const kafkaGroupDLQ = "walbox-dlq"

// kafkaClient opens a client with the configured brokers, TLS and SASL
// (sink: kafka) and opts. It does not contact the brokers yet.
func kafkaClient(cfg config.Config, opts ...kgo.Opt) (*kgo.Client, kafkasink.Config, error) {
	sc, err := cfg.KafkaSinkConfig(replayWindow)
	if err != nil {
		return nil, sc, err
	}
	cl, err := kafkasink.NewClient(sc, append([]kgo.Opt{kgo.ClientID(orDefault(cfg.Kafka.ClientID, "walbox") + "-cli")}, opts...)...)
	return cl, sc, err
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// kafkaBrokers names the configured brokers for messages.
func kafkaBrokers(cfg config.Config) string { return strings.Join(cfg.Kafka.Brokers, ", ") }

// kafkaRoutes lists the configured topics (kafka.topics) that exist on the
// brokers, each its own route, as the relay's router sees them.
func kafkaRoutes(ctx context.Context, adm *kadm.Client, cfg config.Config) ([]relay.Route, error) {
	var names []string
	for _, t := range cfg.Kafka.Topics {
		names = append(names, t.Name)
	}
	details, err := adm.ListTopics(ctx, names...)
	if err != nil {
		return nil, fmt.Errorf("list the topics on %s: %w", kafkaBrokers(cfg), err)
	}
	var out []relay.Route
	for _, n := range names {
		d, ok := details[n]
		if !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition) {
			continue
		}
		if d.Err != nil {
			return nil, fmt.Errorf("topic %s: %w", n, d.Err)
		}
		out = append(out, relay.Route{Stream: n, Subjects: []string{n}})
	}
	return out, nil
}

// kafkaRouter is the relay's router for sink: kafka: no prefix, the topic
// template, routes of the topics that exist.
func kafkaRouter(cfg config.Config, src string, routes []relay.Route) (*relay.Router, error) {
	ro := cfg.RouterOptions()
	ro.SubjectTemplate = cfg.Kafka.TopicTemplate
	rt, err := relay.NewRouterWithOptions("", src, routes, ro)
	if err != nil {
		return nil, err
	}
	rt.SetMaxPayload(cfg.Kafka.MaxMessageBytes)
	return rt, nil
}

// offsetSpan is the offsets [from, to) of one partition.
type offsetSpan struct{ from, to int64 }

// readKafka calls fn with every record of topic in the given spans,
// partition by partition in offset order, with a consumer of its own (no
// group: nothing is committed).
func readKafka(ctx context.Context, cfg config.Config, topic string, spans map[int32]offsetSpan, fn func(*kgo.Record) error) error {
	parts := map[int32]kgo.Offset{}
	for p, s := range spans {
		if s.from < s.to {
			parts[p] = kgo.NewOffset().At(s.from)
		}
	}
	if len(parts) == 0 {
		return nil
	}
	cl, _, err := kafkaClient(cfg, kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: parts}))
	if err != nil {
		return err
	}
	defer cl.Close()
	left := len(parts)
	for left > 0 {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("read %s: %w", topic, err)
		}
		if err := kafkasink.FetchErr(fs, "read"); err != nil {
			return err
		}
		for it := fs.RecordIter(); !it.Done(); {
			r := it.Next()
			s, ok := spans[r.Partition]
			if !ok || r.Offset < s.from || r.Offset >= s.to {
				continue
			}
			if err := fn(r); err != nil {
				return err
			}
			if r.Offset == s.to-1 {
				left--
			}
		}
	}
	return nil
}

// topicSpans lists, per partition of topic, the offsets from the first
// one at or after since (zero: the start) to the end. exists is false
// when the topic does not exist.
func topicSpans(ctx context.Context, adm *kadm.Client, topic string, since time.Time) (map[int32]offsetSpan, bool, error) {
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		return nil, false, fmt.Errorf("list the end offsets of %s: %w", topic, err)
	}
	var starts kadm.ListedOffsets
	if since.IsZero() {
		starts, err = adm.ListStartOffsets(ctx, topic)
	} else {
		starts, err = adm.ListOffsetsAfterMilli(ctx, since.UnixMilli(), topic)
	}
	if err != nil {
		return nil, false, fmt.Errorf("list the offsets of %s: %w", topic, err)
	}
	out := map[int32]offsetSpan{}
	exists := true
	var lerr error
	ends.Each(func(e kadm.ListedOffset) {
		if errors.Is(e.Err, kerr.UnknownTopicOrPartition) {
			exists = false
			return
		}
		if e.Err != nil {
			lerr = fmt.Errorf("end offset of %s/%d: %w", topic, e.Partition, e.Err)
			return
		}
		s, ok := starts.Lookup(topic, e.Partition)
		if ok && s.Err != nil {
			lerr = fmt.Errorf("offset of %s/%d: %w", topic, e.Partition, s.Err)
			return
		}
		from := int64(0)
		if ok && s.Offset >= 0 {
			from = s.Offset
		}
		out[e.Partition] = offsetSpan{from: min(from, e.Offset), to: e.Offset}
	})
	if !exists || (len(out) == 0 && lerr == nil) {
		return nil, false, nil
	}
	return out, true, lerr
}

// tailKafka prints the records of one topic (sink: kafka) as they are
// stored, read by a consumer of its own (no group: nothing is committed).
// The start offsets are fixed before the header line is printed: every
// record stored after it is shown.
func tailKafka(ctx context.Context, cfg config.Config, opts TailOptions, w io.Writer) (int, error) {
	topic := opts.Subject
	if strings.ContainsAny(topic, "*>") {
		return 0, fmt.Errorf("with sink: kafka, name one topic exactly (%q has a NATS wildcard), e.g. walbox tail orders.created", topic)
	}
	if opts.Stream != "" && opts.Stream != topic {
		return 0, fmt.Errorf("with sink: kafka, --stream is the topic itself: tail %s, or leave --stream out", opts.Stream)
	}
	cl, _, err := kafkaClient(cfg)
	if err != nil {
		return 0, err
	}
	adm := kadm.NewClient(cl)
	var starts kadm.ListedOffsets
	if opts.Since > 0 {
		starts, err = adm.ListOffsetsAfterMilli(ctx, time.Now().Add(-opts.Since).UnixMilli(), topic)
	} else {
		starts, err = adm.ListEndOffsets(ctx, topic)
	}
	cl.Close()
	if err != nil {
		return 0, fmt.Errorf("list the offsets of %s on %s: %w", topic, kafkaBrokers(cfg), err)
	}
	parts := map[int32]kgo.Offset{}
	var lerr error
	starts.Each(func(o kadm.ListedOffset) {
		switch {
		case errors.Is(o.Err, kerr.UnknownTopicOrPartition):
			lerr = fmt.Errorf("topic %s does not exist on %s (walbox tail takes a topic name, e.g. one of kafka.topics or kafka.dlq_topic)", topic, kafkaBrokers(cfg))
		case o.Err != nil && lerr == nil:
			lerr = fmt.Errorf("offset of %s/%d: %w", topic, o.Partition, o.Err)
		case o.Err == nil && o.Offset < 0:
			parts[o.Partition] = kgo.NewOffset().AtEnd()
		case o.Err == nil:
			parts[o.Partition] = kgo.NewOffset().At(o.Offset)
		}
	})
	if lerr == nil && len(parts) == 0 {
		lerr = fmt.Errorf("topic %s does not exist on %s", topic, kafkaBrokers(cfg))
	}
	if lerr != nil {
		return 0, lerr
	}
	cons, _, err := kafkaClient(cfg, kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: parts}))
	if err != nil {
		return 0, err
	}
	defer cons.Close()
	width := tailHeader(w, opts.Full, "TOPIC", "EVENT ID (Walbox-Event-Id)", "COMMIT->STORED")
	n := 0
	for opts.Limit <= 0 || n < opts.Limit {
		fs := cons.PollFetches(ctx)
		if ctx.Err() != nil {
			return n, nil
		}
		if err := kafkasink.FetchErr(fs, "read"); err != nil {
			return n, err
		}
		for it := fs.RecordIter(); !it.Done() && (opts.Limit <= 0 || n < opts.Limit); {
			fmt.Fprintln(w, tailKafkaLine(it.Next(), width))
			n++
		}
	}
	return n, nil
}

// tailKafkaLine is tailLine for a record: its timestamp is when it was
// stored (the producer's send time with the topics' default CreateTime).
func tailKafkaLine(r *kgo.Record, width int) string {
	h := kafkasink.FromKafkaHeaders(r.Headers)
	stored := r.Timestamp.Local().Format("2006-01-02 15:04:05.000")
	lat := "-"
	if ct, err := time.Parse(time.RFC3339Nano, h.Get(relay.HeaderCommitTime)); err == nil {
		lat = humanDuration(max(r.Timestamp.Sub(ct), 0))
	}
	id := orDash(h.Get(relay.HeaderMsgID))
	payload := oneLine(r.Value, width)
	switch {
	case h.Get(relay.HeaderDLQReason) != "":
		payload = "DEAD LETTER: " + h.Get(relay.HeaderDLQReason) + ": " + payload
	case h.Get(headerDLQRetried) != "":
		payload = "RETRIED: the dead letter at offset " + h.Get(headerDLQRetried) + " was republished (" + h.Get(HeaderDLQRetriedFrom) + ")"
	}
	return fmt.Sprintf("%-23s  %-24s  %-36s  %14s  %s", stored, r.Topic, id, lat, payload)
}
