// Package kafkatest drives kfake, franz-go's in-process Kafka, for walbox's
// tests: a cluster with a client on it, the config that points walbox at
// it, and faults on produce requests.
package kafkatest

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walbox/walbox/internal/config"
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
// partition, as a partition with too few in-sync replicas does. Once fail
// returns false the control is dropped and the brokers answer normally
// again. It returns the count of requests failed so far.
func FailProduces(c *kfake.Cluster, cut bool, fail func(failed int64) bool) *atomic.Int64 {
	var hits atomic.Int64
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if !fail(hits.Load()) {
			c.DropControl()
			return nil, nil, false
		}
		c.KeepControl()
		hits.Add(1)
		if cut {
			return nil, errors.New("connection cut by the test"), true
		}
		pr := req.(*kmsg.ProduceRequest)
		resp := pr.ResponseKind().(*kmsg.ProduceResponse)
		for _, tp := range pr.Topics {
			rt := kmsg.NewProduceResponseTopic()
			rt.Topic = tp.Topic
			for _, p := range tp.Partitions {
				rp := kmsg.NewProduceResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.NotEnoughReplicas.Code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
	return &hits
}
