package kafkasink

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// kgoLogger hands franz-go's warnings and errors to walbox's log.
type kgoLogger struct{ log zerolog.Logger }

func (l kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelWarn }

func (l kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	ev := l.log.Warn()
	if level == kgo.LogLevelError {
		ev = l.log.Error()
	} else if level > kgo.LogLevelWarn {
		ev = l.log.Debug()
	}
	ev.Str("component", "kafka client").Fields(keyvals).Msg(msg)
}

// onDataLoss is called (on a goroutine of franz-go's) when a broker answers
// a produce with OUT_OF_ORDER_SEQUENCE_NUMBER or UNKNOWN_PRODUCER_ID: it no
// longer holds records of this producer it had acked (an unclean leader
// election, or a leader lost while it alone held them). franz-go resets the
// producer id and goes on; walbox confirmed the slot past those records, so
// it does not send them again by itself.
func onDataLoss(log zerolog.Logger, m *metrics) func(string, int32) {
	return func(topic string, partition int32) {
		m.dataLoss.WithLabelValues(topic).Inc()
		log.Error().Str("topic", topic).Int32("partition", partition).
			Msg("Kafka lost records it had acknowledged (OUT_OF_ORDER_SEQUENCE_NUMBER or UNKNOWN_PRODUCER_ID): events walbox published to this partition may be missing. " +
				"Check the brokers' unclean.leader.election.enable (must be false) and the topic's min.insync.replicas (2 with 3 replicas), " +
				"then compare the partition with the outbox and republish what is missing (walbox replay)")
	}
}

// minISRFix is the command that sets min.insync.replicas=2 on topic.
func minISRFix(topic string, brokers []string) string {
	bootstrap := "<broker>"
	if len(brokers) > 0 {
		bootstrap = brokers[0]
	}
	return fmt.Sprintf("kafka-configs.sh --bootstrap-server %s --alter --entity-type topics --entity-name %s --add-config min.insync.replicas=2", bootstrap, topic)
}

// minISRGuard remembers the topics it warned about, to warn once each.
type minISRGuard struct {
	mu     sync.Mutex
	warned map[string]bool
}

func (g *minISRGuard) first(topic string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.warned[topic] {
		return false
	}
	if g.warned == nil {
		g.warned = map[string]bool{}
	}
	g.warned[topic] = true
	return true
}

// ensureMinISR checks every topic, whatever its replication factor came
// from (the config or the brokers' default): with three replicas or more
// and min.insync.replicas below 2, an acks=all ack may come from the leader
// alone, and losing that broker loses acked records. It sets 2 on the
// topics walbox manages, and warns once, with the fix, about the others
// (and about a managed topic it may not change).
func (s *Sink) ensureMinISR(ctx context.Context, adm *kadm.Client, topics []TopicSpec, details map[string]topicShape, rcs kadm.ResourceConfigs) error {
	for _, t := range topics {
		d, ok := details[t.Name]
		if !ok {
			continue // EnsureTopics reported it
		}
		rf := d.replicas
		cs, err := topicConfigs(rcs, t.Name)
		if err != nil {
			return fmt.Errorf("read min.insync.replicas of topic %s: %w", t.Name, err)
		}
		isr := configInt(cs, "min.insync.replicas")
		if rf < 3 || isr >= 2 || isr == 0 && !t.Manage { // 0: not reported
			continue
		}
		why := fmt.Sprintf("topic %s has %d replicas and min.insync.replicas=%d: an acks=all ack may come from its leader alone, and losing that broker loses acked events", t.Name, rf, isr)
		if t.Manage {
			err := alterTopicConfig(ctx, adm, t.Name, "min.insync.replicas", "2")
			if err == nil {
				s.cfg.Log.Info().Str("topic", t.Name).Int("replicas", rf).Msg("set min.insync.replicas=2 on the topic (it was " + fmt.Sprint(isr) + "), so that an ack needs two replicas")
				continue
			}
			if !notAllowed(err) {
				return fmt.Errorf("set min.insync.replicas=2 on topic %s: %w", t.Name, err)
			}
			why += fmt.Sprintf(" (walbox may not change it: %v)", err)
		}
		if s.isr.first(t.Name) {
			s.cfg.Log.Warn().Str("topic", t.Name).Int("replicas", rf).Int32("min_insync_replicas", isr).
				Str("fix", minISRFix(t.Name, s.cfg.Brokers)).Msg(strings.TrimSpace(why))
		}
	}
	return nil
}

// topicShape is a topic's partition count and replication factor.
type topicShape struct{ partitions, replicas int }

// describeTopics reads the partitions and replicas of topics from the
// brokers. It asks them directly: the client's cached metadata (which
// kadm's ListTopics answers from for a few seconds) still says "unknown
// topic" about a topic just created. A topic the brokers do not know is
// left out.
func describeTopics(ctx context.Context, cl *kgo.Client, topics []string) (map[string]topicShape, error) {
	req := kmsg.NewPtrMetadataRequest()
	for _, t := range topics {
		rt := kmsg.NewMetadataRequestTopic()
		rt.Topic = kmsg.StringPtr(t)
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return nil, fmt.Errorf("describe topics %v: %w", topics, err)
	}
	out := map[string]topicShape{}
	for _, t := range resp.Topics {
		if t.Topic == nil {
			continue
		}
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			if errors.Is(err, kerr.UnknownTopicOrPartition) {
				continue
			}
			return nil, fmt.Errorf("describe topic %s: %w", *t.Topic, err)
		}
		sh := topicShape{partitions: len(t.Partitions)}
		for _, p := range t.Partitions {
			sh.replicas = max(sh.replicas, len(p.Replicas))
		}
		out[*t.Topic] = sh
	}
	return out, nil
}
