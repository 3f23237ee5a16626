package devenv

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/relay/kafkasink"
)

// kafkaTopics are the topics the sample producer writes to.
var kafkaTopics = []string{"orders.created", "payments.settled", "orders.shipped"}

// startKafka starts kfake, franz-go's in-process Kafka (the test server of
// walbox's Kafka sink), unless a broker was given.
func (r *run) startKafka() error {
	if len(r.cfg.KafkaBrokers) > 0 {
		r.brokers = r.cfg.KafkaBrokers
		return nil
	}
	t0 := time.Now()
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		return fmt.Errorf("start the in-process Kafka (kfake): %w", err)
	}
	r.kafka = c
	r.brokers = c.ListenAddrs()
	r.onCleanup(func() error { c.Close(); return nil })
	r.con.progress("in-process Kafka (kfake) ready in %s", time.Since(t0).Round(time.Millisecond))
	return nil
}

// kafkaWatcher prints every record of the topics, read with a direct
// consumer from the start of each partition.
type kafkaWatcher struct {
	cl   *kgo.Client
	done chan struct{}
	once sync.Once
}

func watchKafka(ctx context.Context, brokers, topics []string, con *console) (*kafkaWatcher, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topics...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(kgo.ReadCommitted())) // walbox's transactions: committed records only
	if err != nil {
		return nil, fmt.Errorf("event console: kafka client: %w", err)
	}
	w := &kafkaWatcher{cl: cl, done: make(chan struct{})}
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer close(w.done)
		defer cancel()
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			if fs.IsClientClosed() {
				return
			}
			fs.EachRecord(func(rec *kgo.Record) {
				con.show(rec.Timestamp, fmt.Sprintf("%s/%d", rec.Topic, rec.Partition), uint64(rec.Offset), rec.Topic,
					kafkasink.FromKafkaHeaders(rec.Headers), rec.Value)
			})
		}
	}()
	return w, nil
}

func (w *kafkaWatcher) stop() {
	w.once.Do(func() {
		w.cl.Close()
		<-w.done
	})
}
