// Package kafkatest drives kfake, franz-go's in-process Kafka, for walbox's
// tests: a cluster with a client on it, the config that points walbox at
// it, and faults on produce requests.
package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay/kafkasink"
)

// Cluster is a kfake cluster of three brokers and a client on it, both
// closed when the test ends.
type Cluster struct {
	*kfake.Cluster
	Client *kgo.Client
	Admin  *kadm.Client
}

// NewCluster starts a kfake cluster of three brokers.
func NewCluster(t testing.TB) *Cluster {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(3))
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...))
	if err != nil {
		t.Fatalf("Kafka client: %v", err)
	}
	t.Cleanup(cl.Close)
	return &Cluster{Cluster: c, Client: cl, Admin: kadm.NewClient(cl)}
}

// Sink is a config change that makes walbox publish to the cluster: sink
// kafka, its brokers, a 10 s ack timeout and topics.
func (c *Cluster) Sink(topics ...config.KafkaTopic) func(*config.Config) {
	return func(cfg *config.Config) {
		cfg.Sink = config.SinkKafka
		cfg.Kafka.Brokers = c.ListenAddrs()
		cfg.Kafka.AckTimeout = 10 * time.Second
		cfg.Kafka.Topics = topics
	}
}

// FailProduces makes the brokers fail produce requests while fail returns
// true: cut the connection (cut), or answer NOT_ENOUGH_REPLICAS for every
// partition, as a partition with too few in-sync replicas does (through
// kfake's faults, which answer as a broker would, topic ids included).
// Once fail returns false the brokers answer normally again. It returns
// the count of requests failed so far.
func FailProduces(c *kfake.Cluster, cut bool, fail func(failed int64) bool) *atomic.Int64 {
	var hits atomic.Int64
	if !cut {
		c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1,
			When: func(kmsg.Request) bool {
				if !fail(hits.Load()) {
					return false
				}
				hits.Add(1)
				return true
			}})
		return &hits
	}
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if !fail(hits.Load()) {
			c.DropControl()
			return nil, nil, false
		}
		c.KeepControl()
		hits.Add(1)
		return nil, errors.New("connection cut by the test"), true
	})
	return &hits
}

// Counts is how many committed data records every partition of topics
// holds (kafkasink.CountRecords): what the topics store. End offsets are no
// count on a topic written in transactions (commit markers and aborted
// records take offsets too).
func Counts(ctx context.Context, brokers []string, topics ...string) (map[string]map[int32]int64, error) {
	out := map[string]map[int32]int64{}
	for _, topic := range topics {
		n, err := kafkasink.CountRecords(ctx, kafkasink.Config{Brokers: brokers}, topic)
		if err != nil {
			return nil, fmt.Errorf("count the records of %s: %w", topic, err)
		}
		out[topic] = n
	}
	return out, nil
}
