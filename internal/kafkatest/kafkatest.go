// Package kafkatest drives kfake, franz-go's in-process Kafka, for walbox's
// tests: faults on produce requests.
package kafkatest

import (
	"errors"
	"sync/atomic"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

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
