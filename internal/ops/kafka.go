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

// kafkaConfig is the sink's connection config of the commands: their
// own client id (client.id plus -cli).
func kafkaConfig(cfg config.Config) (kafkasink.Config, error) {
	sc, err := cfg.KafkaSinkConfig(replayWindow)
	sc.ClientID = orDefault(cfg.Kafka.ClientID, "walbox") + "-cli"
	return sc, err
}

// kafkaClient opens a client with the configured brokers, TLS and SASL
// (sink: kafka) and opts. It does not contact the brokers yet.
func kafkaClient(cfg config.Config, opts ...kgo.Opt) (*kgo.Client, error) {
	sc, err := kafkaConfig(cfg)
	if err != nil {
		return nil, err
	}
	return kafkasink.NewClient(sc, opts...)
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// kafkaBrokers names the configured brokers for messages.
func kafkaBrokers(cfg config.Config) string { return strings.Join(cfg.Kafka.Brokers, ", ") }

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
	cl, err := kafkaClient(cfg)
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
	cons, err := kafkaClient(cfg, kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: parts}))
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
	case h.Get(kafkasink.HeaderDLQRetried) != "":
		payload = "RETRIED: the dead letter at offset " + h.Get(kafkasink.HeaderDLQRetried) + " was republished (" + h.Get(HeaderDLQRetriedFrom) + ")"
	}
	return fmt.Sprintf("%-23s  %-24s  %-36s  %14s  %s", stored, r.Topic, id, lat, payload)
}
