package kafkasink_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// BenchmarkPublish publishes 256-byte events over 12 keys with up to 1,024
// in flight, as the relay's window does, through the idempotent producer
// and through transactions (each ack waits for its transaction's commit),
// against kfake (`go test -run - -bench Publish ./relay/kafkasink`).
func BenchmarkPublish(b *testing.B) {
	for _, txn := range []bool{false, true} {
		name := "idempotent"
		if txn {
			name = "transactional"
		}
		b.Run(name, func(b *testing.B) {
			c := newCluster(b)
			cfg := kafkasink.Config{Brokers: c.ListenAddrs(), AckTimeout: 10 * time.Second, MaxBuffered: 4096}
			if txn {
				cfg.TransactionalID = "walbox:bench/slot"
			}
			s, err := kafkasink.New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			ctx := context.Background()
			if _, err := kafkasink.EnsureTopics(ctx, s.Client(), []kafkasink.TopicSpec{{Name: "orders", Partitions: 12, ReplicationFactor: 1, Manage: true}}); err != nil {
				b.Fatal(err)
			}
			data := make([]byte, 256)
			var window []relay.Future
			b.ResetTimer()
			start := time.Now()
			for i := 0; i < b.N; i++ {
				if len(window) >= 1024 {
					if _, err := relay.Await(ctx, window[0]); err != nil {
						b.Fatal(err)
					}
					window = window[1:]
				}
				f, err := s.Publish(&relay.Msg{Subject: "orders", Key: fmt.Sprintf("k%d", i%12), Data: data, Epoch: s.Epoch(),
					Header: relay.Header{relay.HeaderMsgID: {fmt.Sprint(i)}}})
				if err != nil {
					b.Fatal(err)
				}
				window = append(window, f)
			}
			for _, f := range window {
				if _, err := relay.Await(ctx, f); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "events/s")
		})
	}
}
