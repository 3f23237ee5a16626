package ops

import (
	"context"
	"errors"
	"fmt"
	"strings"

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

// waitFuture waits for one publish of a kafkasink.Sink.
func waitFuture(ctx context.Context, f relay.Future) (*relay.Ack, error) {
	select {
	case a := <-f.Ok():
		return a, nil
	case err := <-f.Err():
		return nil, err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
