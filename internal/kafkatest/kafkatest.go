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

// Counts reads topics to their last stable offsets with a read_committed
// consumer of its own and counts the data records of every partition: what
// the topics store. End offsets are no count on a topic written in
// transactions (commit markers and aborted records take offsets too).
func Counts(ctx context.Context, brokers []string, topics ...string) (map[string]map[int32]int64, error) {
	adm, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return nil, err
	}
	defer adm.Close()
	ends, err := kadm.NewClient(adm).ListCommittedOffsets(ctx, topics...)
	if err != nil {
		return nil, fmt.Errorf("list end offsets: %w", err)
	}
	out := map[string]map[int32]int64{}
	want := map[string]map[int32]kgo.Offset{}
	to := map[string]map[int32]int64{}
	left := 0
	var lerr error
	ends.Each(func(o kadm.ListedOffset) {
		if o.Err != nil {
			lerr = fmt.Errorf("end offset of %s/%d: %w", o.Topic, o.Partition, o.Err)
			return
		}
		if out[o.Topic] == nil {
			out[o.Topic], want[o.Topic], to[o.Topic] = map[int32]int64{}, map[int32]kgo.Offset{}, map[int32]int64{}
		}
		out[o.Topic][o.Partition] = 0
		if o.Offset > 0 {
			want[o.Topic][o.Partition] = kgo.NewOffset().AtStart()
			to[o.Topic][o.Partition] = o.Offset
			left++
		}
	})
	if lerr != nil || left == 0 {
		return out, lerr
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumePartitions(want),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords())
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	for left > 0 {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			return nil, fmt.Errorf("count records: %w", ctx.Err())
		}
		var ferr error
		fs.EachError(func(t string, p int32, err error) { ferr = fmt.Errorf("fetch %s/%d: %w", t, p, err) })
		if ferr != nil {
			return nil, ferr
		}
		fs.EachRecord(func(r *kgo.Record) {
			end, ok := to[r.Topic][r.Partition]
			if !ok || r.Offset >= end {
				return
			}
			if !r.Attrs.IsControl() {
				out[r.Topic][r.Partition]++
			}
			if r.Offset == end-1 {
				left--
			}
		})
	}
	return out, nil
}
