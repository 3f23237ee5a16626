package kafkasink_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// TestAddedPartitionsStopPublishingToTheTopic: partitions added while walbox
// runs would move keys to other partitions, and a key's events would be
// split between two partitions out of order (issue 35, item 5). The sink
// keeps the partition count it recorded at start: no record goes to a new
// partition, and once the client sees the new count, publishing to the
// topic fails with an error the relay waits on (a configuration error, not
// a dead letter) that names the fix, counted once.
func TestAddedPartitionsStopPublishingToTheTopic(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	s, reg, logs := newObservedSink(t, c.ListenAddrs())
	adm := kadm.NewClient(s.Client())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := s.EnsureTopics(ctx, []kafkasink.TopicSpec{{Name: "orders", Partitions: 4, ReplicationFactor: 1, Manage: true}}); err != nil {
		t.Fatal(err)
	}
	const keys = 16
	home := map[string]int32{}
	publish := func(key string) (*relay.Ack, error) {
		f, err := s.Publish(&relay.Msg{Subject: "orders", Key: key, Data: []byte(`{}`), Header: relay.Header{relay.HeaderMsgID: {key}}})
		if err != nil {
			return nil, err
		}
		return wait(t, ctx, f)
	}
	for i := range keys {
		k := "k" + strconv.Itoa(i)
		ack, err := publish(k)
		if err != nil {
			t.Fatal(err)
		}
		home[k] = ack.Partition
	}
	if _, err := adm.CreatePartitions(ctx, 4, "orders"); err != nil {
		t.Fatal(err)
	}
	var held error
	deadline := time.Now().Add(30 * time.Second)
	for held == nil && time.Now().Before(deadline) {
		s.Client().ForceMetadataRefresh()
		for i := range keys {
			k := "k" + strconv.Itoa(i)
			ack, err := publish(k)
			if err != nil {
				held = err
				break
			}
			if ack.Partition != home[k] {
				t.Fatalf("key %s went to partition %d after partitions were added, its earlier events are in %d: the key is split", k, ack.Partition, home[k])
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	if held == nil {
		t.Fatal("still publishing to orders 30 s after its partitions went from 4 to 8")
	}
	if kind := kafkasink.ErrKind(held); kind != kafkasink.KindConfig || kafkasink.Classify(held) != relay.Transient {
		t.Fatalf("error %q is %v, want a configuration error the relay waits on", held, kind)
	}
	if !strings.Contains(held.Error(), "restart walbox") {
		t.Fatalf("error %q does not name the fix", held)
	}
	// It stays so until walbox restarts, and is counted once.
	if _, err := publish("k0"); err == nil {
		t.Fatal("publishing resumed by itself")
	}
	if got := counter(t, reg, "walbox_kafka_partition_count_changed_total", "orders"); got != 1 {
		t.Fatalf("walbox_kafka_partition_count_changed_total{topic=orders} = %v, want 1", got)
	}
	if !strings.Contains(logs.String(), `"level":"error"`) {
		t.Fatalf("no error logged:\n%s", logs.String())
	}
	ends, err := adm.ListEndOffsets(ctx, "orders")
	if err != nil {
		t.Fatal(err)
	}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Partition >= 4 && o.Offset != 0 {
			t.Errorf("new partition %d holds %d records", o.Partition, o.Offset)
		}
	})
}
