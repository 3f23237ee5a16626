package kafkasink_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// TestStoredTailOfALargeTopicKeepsEveryFetch (issue 35, item 6): 8
// partitions of 400 records of 16 KB (51 MB), and the resume check asking
// for the newest 800 records of every partition, where every attempt is cut
// short as soon as its second fetch reaches the broker, so each attempt
// gets one fetch's answer (about one 1 MiB batch a partition) and no more.
// A read-back that keeps only whole chunks never finishes (no chunk fits in
// one fetch, so nothing would ever be published); one that keeps every
// fetch's records finishes, with every record's identity. The attempts are
// counted in fetches, not in seconds: a loaded machine changes how long a
// fetch takes, never how many there are.
func TestStoredTailOfALargeTopicKeepsEveryFetch(t *testing.T) {
	const (
		partitions = 8
		perPart    = 400
		size       = 16 << 10
		// 400 records in batches of about 63 are 7 fetches; each round
		// of chunks may split a batch and read it twice.
		maxAttempts = 24
	)
	c := newCluster(t)
	s := newSink(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if _, err := kafkasink.EnsureTopics(ctx, s.Client(), []kafkasink.TopicSpec{{Name: "big", Partitions: partitions, ReplicationFactor: 1, Manage: true}}); err != nil {
		t.Fatal(err)
	}
	fillTopic(ctx, t, c.ListenAddrs(), "big", partitions, perPart, size, 0)
	type attempt struct {
		fetches atomic.Int64
		cancel  context.CancelFunc
	}
	var current atomic.Pointer[attempt]
	var fetches atomic.Int64
	c.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		fetches.Add(1)
		if a := current.Load(); a != nil && a.fetches.Add(1) > 1 {
			a.cancel() // the attempt's second fetch: it has had its one answer
		}
		return nil, nil, false
	})
	var tail relay.StoredTail
	var err error
	attempts := 0
	for {
		attempts++
		actx, acancel := context.WithCancel(ctx)
		current.Store(&attempt{cancel: acancel})
		tail, err = s.StoredTail(actx, "big", "db/slot", 2*perPart)
		current.Store(nil)
		acancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("attempt %d: %v", attempts, err)
		}
		if attempts == maxAttempts {
			t.Fatalf("the read-back did not finish in %d attempts of one fetch each (last: %v): publishing would wait for ever", attempts, err)
		}
	}
	if len(tail.IDs) != partitions*perPart {
		t.Fatalf("read back %d identities, want %d", len(tail.IDs), partitions*perPart)
	}
	t.Logf("read back %d records (%d MB) in %d attempts, %d fetches", partitions*perPart, partitions*perPart*size>>20, attempts, fetches.Load())
}

// fillTopic writes perPart records of size bytes to each partition of
// topic, with the headers the relay writes for source db/slot, ids
// p<partition>-<i> from first on, and LSNs growing with them.
func fillTopic(ctx context.Context, t *testing.T, brokers []string, topic string, partitions, perPart, size, first int) {
	t.Helper()
	prod, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ProducerBatchMaxBytes(1<<20), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	for p := range int32(partitions) {
		recs := make([]*kgo.Record, 0, perPart)
		for i := first; i < first+perPart; i++ {
			id := fmt.Sprintf("p%d-%d", p, i)
			lsn := 0x1000 + int64(i)*0x100 + int64(p)
			recs = append(recs, &kgo.Record{Topic: topic, Partition: p, Value: incompressible(id, size), Headers: kafkasink.ToKafkaHeaders(relay.Header{
				relay.HeaderMsgID: {id}, relay.HeaderSource: {"db/slot"},
				relay.HeaderCommitLSN: {"0/" + strconv.FormatInt(lsn, 16)}, relay.HeaderIndex: {"0"},
			})})
		}
		if err := prod.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestStoredTailStopsAtTheByteBound: with TailBytes of 1 MiB and records of
// 16 KB, a partition's read-back needs 64 records, not the 800 the relay
// asks: it reads about that, keeps every partition's newest records, and
// the next read-back adds only what was written since.
func TestStoredTailStopsAtTheByteBound(t *testing.T) {
	const partitions, size = 4, 16 << 10
	c := newCluster(t)
	s, err := kafkasink.New(kafkasink.Config{Brokers: c.ListenAddrs(), AckTimeout: 10 * time.Second, TailBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := kafkasink.EnsureTopics(ctx, s.Client(), []kafkasink.TopicSpec{{Name: "big", Partitions: partitions, ReplicationFactor: 1, Manage: true}}); err != nil {
		t.Fatal(err)
	}
	fillTopic(ctx, t, c.ListenAddrs(), "big", partitions, 400, size, 0)
	tail, err := s.StoredTail(ctx, "big", "db/slot", 800)
	if err != nil {
		t.Fatal(err)
	}
	// 1 MiB of 16 KB records (and their headers) is 63 or 64 of them.
	if n := len(tail.IDs); n < partitions*63 || n > partitions*64 {
		t.Fatalf("read back %d identities, want %d to %d (1 MiB a partition)", n, partitions*63, partitions*64)
	}
	for p := range partitions {
		if _, ok := tail.IDs[relay.IdentityKey("", fmt.Sprintf("p%d-399", p))]; !ok {
			t.Fatalf("partition %d's newest record not read back", p)
		}
	}
	fillTopic(ctx, t, c.ListenAddrs(), "big", partitions, 10, size, 400)
	fetched := fetchesBelow(c, 400)
	tail, err = s.StoredTail(ctx, "big", "db/slot", 800)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(tail.IDs); n < partitions*63 || n > partitions*64 {
		t.Fatalf("second read-back: %d identities, want %d to %d", n, partitions*63, partitions*64)
	}
	for p := range partitions {
		if _, ok := tail.IDs[relay.IdentityKey("", fmt.Sprintf("p%d-409", p))]; !ok {
			t.Fatalf("partition %d's record written since not read back", p)
		}
	}
	if n := fetched.Load(); n != 0 {
		t.Fatalf("the second read-back fetched below offset 400 %d times: it read again what it had", n)
	}
}

// TestStoredTailReadsAgainAfterALeaderChange: a suffix read under one
// leader is not trusted under the next (an unclean election may have
// truncated the log under it): after the partition moves to another
// broker, the read-back reads the partition again, and still finishes.
func TestStoredTailReadsAgainAfterALeaderChange(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(3))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := kafkasink.New(kafkasink.Config{Brokers: c.ListenAddrs(), AckTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := kafkasink.EnsureTopics(ctx, s.Client(), []kafkasink.TopicSpec{{Name: "moved", Partitions: 1, ReplicationFactor: 3, Manage: true}}); err != nil {
		t.Fatal(err)
	}
	fillTopic(ctx, t, c.ListenAddrs(), "moved", 1, 300, 64, 0)
	if _, err := s.StoredTail(ctx, "moved", "db/slot", 200); err != nil {
		t.Fatal(err)
	}
	below := fetchesBelow(c, 300)
	if err := c.MoveTopicPartition("moved", 0, (c.LeaderFor("moved", 0)+1)%3); err != nil {
		t.Fatal(err)
	}
	fillTopic(ctx, t, c.ListenAddrs(), "moved", 1, 10, 64, 300)
	tail, err := s.StoredTail(ctx, "moved", "db/slot", 200)
	if err != nil {
		t.Fatal(err)
	}
	if below.Load() == 0 {
		t.Fatal("after the leader change the read-back trusted the suffix it read before")
	}
	if _, ok := tail.IDs[relay.IdentityKey("", "p0-309")]; !ok || len(tail.IDs) < 200 {
		t.Fatalf("read back %d identities (p0-309 among them: %v), want at least 200 with the newest", len(tail.IDs), ok)
	}
}

// fetchesBelow counts, from now on, the partitions fetched from an offset
// below offset.
func fetchesBelow(c *kfake.Cluster, offset int64) *atomic.Int64 {
	var n atomic.Int64
	c.ControlKey(int16(kmsg.Fetch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		for _, tp := range req.(*kmsg.FetchRequest).Topics {
			for _, p := range tp.Partitions {
				if p.FetchOffset < offset {
					n.Add(1)
				}
			}
		}
		return nil, nil, false
	})
	return &n
}
