package kafkasink_test

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

func newCluster(t testing.TB) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func newSink(t *testing.T, c *kfake.Cluster) *kafkasink.Sink {
	t.Helper()
	s, err := kafkasink.New(kafkasink.Config{Brokers: c.ListenAddrs(), AckTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func wait(t *testing.T, ctx context.Context, f relay.Future) (*relay.Ack, error) {
	t.Helper()
	a, err := relay.Await(ctx, f)
	if err != nil && ctx.Err() != nil {
		t.Fatal("no answer from the broker")
	}
	return a, err
}

func TestClassify(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want relay.ErrorClass
	}{
		{fmt.Errorf("produce: %w", kerr.MessageTooLarge), relay.Permanent},
		{kerr.InvalidTopicException, relay.Permanent},
		{kerr.UnknownTopicOrPartition, relay.Transient},
		{kerr.NotLeaderForPartition, relay.Transient},
		{kerr.TopicAuthorizationFailed, relay.Transient},
		{context.DeadlineExceeded, relay.Transient},
	} {
		if got := kafkasink.Classify(tt.err); got != tt.want {
			t.Errorf("Classify(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

func TestHeadersRoundTrip(t *testing.T) {
	h := relay.Header{relay.HeaderMsgID: {"ev-1"}, relay.HeaderSource: {"db/slot"}, "ce-id": {"ev-1"}, "ce-type": {"t"},
		relay.HeaderContentType: {"application/json"}, relay.HeaderExpectedLastSeq: {"4"}, "traceparent": {"00-abc-def-01"}}
	kh := kafkasink.ToKafkaHeaders(h)
	keys := map[string]string{}
	for _, x := range kh {
		keys[x.Key] = string(x.Value)
	}
	for k, v := range map[string]string{kafkasink.HeaderEventID: "ev-1", "ce_id": "ev-1", "ce_type": "t", "content-type": "application/json", "traceparent": "00-abc-def-01", relay.HeaderSource: "db/slot"} {
		if keys[k] != v {
			t.Errorf("record header %s = %q, want %q (all: %v)", k, keys[k], v, keys)
		}
	}
	for _, k := range []string{relay.HeaderMsgID, relay.HeaderExpectedLastSeq, "ce-id"} {
		if _, ok := keys[k]; ok {
			t.Errorf("record carries %s", k)
		}
	}
	back := kafkasink.FromKafkaHeaders(kh)
	if back.Get(relay.HeaderMsgID) != "ev-1" || back.Get("ce-type") != "t" || back.Get(relay.HeaderContentType) != "application/json" {
		t.Errorf("round trip = %v", back)
	}
}

// TestPublishKeepsKeyOrderAndReadsTheTailBack produces keyed records to a
// topic of 4 partitions: every record is acked with its partition and
// offset, records of one key share a partition in publish order, and the
// tail read-back finds the ids of this source with their positions.
func TestPublishKeepsKeyOrderAndReadsTheTailBack(t *testing.T) {
	c := newCluster(t)
	s := newSink(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	routes, err := kafkasink.EnsureTopics(ctx, s.Client(), []kafkasink.TopicSpec{{Name: "orders", Partitions: 4, ReplicationFactor: 1, Manage: true}})
	if err != nil {
		t.Fatal(err)
	}
	if len(routes) != 1 || routes[0].Stream != "orders" {
		t.Fatalf("routes = %+v", routes)
	}
	const n = 400
	var futs []relay.Future
	for i := range n {
		m := &relay.Msg{Subject: "orders", Key: "k" + strconv.Itoa(i%7), Data: []byte(`{}`), Header: relay.Header{
			relay.HeaderMsgID: {fmt.Sprintf("e%04d", i)}, relay.HeaderSource: {"db/slot"},
			relay.HeaderCommitLSN: {"0/" + strconv.FormatInt(int64(0x1000+i), 16)}, relay.HeaderIndex: {"0"},
		}}
		f, err := s.Publish(m)
		if err != nil {
			t.Fatal(err)
		}
		futs = append(futs, f)
	}
	partOf := map[string]int32{}
	lastOff := map[int32]uint64{}
	for i, f := range futs {
		a, err := wait(t, ctx, f)
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		key := "k" + strconv.Itoa(i%7)
		if p, ok := partOf[key]; ok && p != a.Partition {
			t.Fatalf("key %s went to partitions %d and %d", key, p, a.Partition)
		}
		partOf[key] = a.Partition
		if off, ok := lastOff[a.Partition]; ok && a.Sequence <= off {
			t.Fatalf("partition %d: offset %d after %d", a.Partition, a.Sequence, off)
		}
		lastOff[a.Partition] = a.Sequence
	}
	if len(lastOff) < 2 {
		t.Fatalf("7 keys landed in %d partition(s) of 4", len(lastOff))
	}
	tail, err := s.StoredTail(ctx, "orders", "db/slot", 1000)
	if err != nil {
		t.Fatal(err)
	}
	if len(tail.IDs) != n || !tail.Found {
		t.Fatalf("tail holds %d ids, want %d", len(tail.IDs), n)
	}
	other, err := s.StoredTail(ctx, "orders", "other/slot", 1000)
	if err != nil || other.Found {
		t.Fatalf("another source's tail: %+v %v", other, err)
	}
	small, err := s.StoredTail(ctx, "orders", "db/slot", 5)
	if err != nil {
		t.Fatal(err)
	}
	if want := 5 * len(lastOff); len(small.IDs) != want {
		t.Fatalf("tail of 5 per partition holds %d ids, want %d", len(small.IDs), want)
	}
	var read int
	if err := s.ReadBack(ctx, "orders", "db/slot", relay.ReadBackRange{Want: 3}, func(relay.StoredEvent) bool { read++; return true }); err != nil {
		t.Fatal(err)
	}
	if read != 3*len(lastOff) {
		t.Fatalf("read back %d, want %d", read, 3*len(lastOff))
	}
}

// TestRefusedProducesWaitAndLandInOrder: while the partition leader refuses
// produces (kfake's request control answers NOT_ENOUGH_REPLICAS, as a
// broker with too few in-sync replicas does), the idempotent producer keeps
// the records and retries them; none resolves. Once the broker accepts,
// they are stored once each, in publish order, right after the last record
// stored before: no gap, no duplicate, no reorder.
func TestRefusedProducesWaitAndLandInOrder(t *testing.T) {
	c := newCluster(t)
	s, err := kafkasink.New(kafkasink.Config{Brokers: c.ListenAddrs(), AckTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := kafkasink.EnsureTopics(ctx, s.Client(), []kafkasink.TopicSpec{{Name: "orders", Partitions: 1, Manage: true}}); err != nil {
		t.Fatal(err)
	}
	pub := func(id string) relay.Future {
		f, err := s.Publish(&relay.Msg{Subject: "orders", Key: "k", Data: []byte(`{}`), Header: relay.Header{relay.HeaderMsgID: {id}}})
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	if _, err := wait(t, ctx, pub("a")); err != nil {
		t.Fatal(err)
	}
	var refusing atomic.Bool
	refusing.Store(true)
	refused := kafkatest.FailProduces(c, false, func(int64) bool { return refusing.Load() })
	futs := []relay.Future{pub("b"), pub("c"), pub("d")}
	for refused.Load() < 1 {
		select {
		case <-ctx.Done():
			t.Fatal("no produce reached the broker")
		case <-time.After(10 * time.Millisecond):
		}
	}
	for i, f := range futs {
		select {
		case r := <-f:
			if r.Err != nil {
				t.Fatalf("record %d failed while the broker refuses (the producer retries): %v", i, r.Err)
			}
			t.Fatalf("record %d acked at %d while the broker refuses", i, r.Ack.Sequence)
		default:
		}
	}
	refusing.Store(false)
	// Once the partition takes writes again, each record is acked in
	// order, or fails as transient (franz-go 1.22.3 leaves a batch retried
	// after NOT_ENOUGH_REPLICAS waiting until its delivery timeout), and
	// the relay resends it and those behind it in order, as here.
	ids := []string{"b", "c", "d"}
	var resend []string
	for i, f := range futs {
		ack, err := wait(t, ctx, f)
		switch {
		case err != nil && kafkasink.Classify(err) != relay.Transient:
			t.Fatalf("record %s failed as permanent: %v", ids[i], err)
		case err != nil || len(resend) > 0:
			resend = append(resend, ids[i])
		case ack.Sequence != uint64(i+2): // sequence = offset + 1, after a at offset 0
			t.Fatalf("record %s stored at sequence %d, want %d", ids[i], ack.Sequence, i+2)
		}
	}
	for _, id := range resend {
		if _, err := wait(t, ctx, pub(id)); err != nil {
			t.Fatalf("resend %s: %v", id, err)
		}
	}
	t.Logf("resent after the refusal: %v", resend)
	got := readAll(ctx, t, c.ListenAddrs(), "orders")
	if want := "abcd"; got != want {
		t.Fatalf("the partition holds %q, want %q (each record once, in order)", got, want)
	}
}

// readAll is the event ids topic's partition 0 holds, in order, read back
// committed.
func readAll(ctx context.Context, t *testing.T, brokers []string, topic string) string {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}, kafkasink.ReadOpts()...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListCommittedOffsets(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	end, _ := ends.Lookup(topic, 0)
	var out strings.Builder
	for off := int64(-1); off < end.Offset-1; {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatal(ctx.Err())
		}
		fs.EachRecord(func(r *kgo.Record) {
			off = r.Offset
			if !r.Attrs.IsControl() {
				out.WriteString(kafkasink.FromKafkaHeaders(r.Headers).Get(relay.HeaderMsgID))
			}
		})
	}
	return out.String()
}

// TestTailRangeIsPerPartition: the tail read-back takes the newest n
// records of each partition, and each partition gets a range of its own:
// positions prove nothing across partitions, since one partition may refuse
// writes for minutes while the others store newer events (issue 33, item
// 3). A quiet partition's range reaches back much further than a busy
// one's.
func TestTailRangeIsPerPartition(t *testing.T) {
	c := newCluster(t)
	s := newSink(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := kafkasink.EnsureTopics(ctx, s.Client(), []kafkasink.TopicSpec{{Name: "orders", Partitions: 2, ReplicationFactor: 1, Manage: true}}); err != nil {
		t.Fatal(err)
	}
	lsn := int64(0x1000)
	var lsns []int64  // of every record, in publish order
	var parts []int32 // and its partition
	partOf := map[string]int32{}
	pub := func(key string) int32 {
		t.Helper()
		lsn += 0x10
		m := &relay.Msg{Subject: "orders", Key: key, Data: []byte(`{}`), Header: relay.Header{
			relay.HeaderMsgID: {fmt.Sprintf("e%x", lsn)}, relay.HeaderSource: {"db/slot"},
			relay.HeaderCommitLSN: {"0/" + strconv.FormatInt(lsn, 16)}, relay.HeaderIndex: {"0"},
		}}
		f, err := s.Publish(m)
		if err != nil {
			t.Fatal(err)
		}
		a, err := wait(t, ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		lsns = append(lsns, lsn)
		parts = append(parts, a.Partition)
		partOf[key] = a.Partition
		return a.Partition
	}
	quiet := pub("quiet")
	pub("quiet")
	busy := ""
	for i := 0; busy == ""; i++ {
		if k := "busy" + strconv.Itoa(i); pub(k) != quiet {
			busy = k
		}
	}
	for range 20 {
		pub(busy)
	}
	const n = 8
	tail, err := s.StoredTail(ctx, "orders", "db/slot", n)
	if err != nil {
		t.Fatal(err)
	}
	busyPart := partOf[busy]
	var busyLSNs, quietLSNs []int64
	for i, l := range lsns {
		if parts[i] == busyPart {
			busyLSNs = append(busyLSNs, l)
		} else {
			quietLSNs = append(quietLSNs, l)
		}
	}
	for _, c := range []struct {
		part int32
		lsns []int64
	}{{busyPart, busyLSNs[len(busyLSNs)-n:]}, {quiet, quietLSNs}} {
		r := tail.Ranges[relay.TailKey{Partition: c.part}]
		if uint64(r.Oldest.CommitLSN) != uint64(c.lsns[0]) || uint64(r.Newest.CommitLSN) != uint64(c.lsns[len(c.lsns)-1]) {
			t.Fatalf("partition %d: range %s..%s, want 0/%X..0/%X", c.part, r.Oldest.CommitLSN, r.Newest.CommitLSN, c.lsns[0], c.lsns[len(c.lsns)-1])
		}
	}
}

// holdFirstProduce holds the first produce request in the broker until
// release is closed, so that the records produced meanwhile queue up in
// the client behind it; held is closed once the request is held.
func holdFirstProduce(c *kfake.Cluster) (held, release chan struct{}) {
	held, release = make(chan struct{}), make(chan struct{})
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		close(held)
		c.SleepControl(func() { <-release })
		c.DropControl()
		return nil, nil, false
	})
	return held, release
}

// incompressible is n bytes, of their own for each seed, that compression does not shrink, so that a
// batch's size on the wire is its records'.
func incompressible(seed string, n int) []byte {
	b := make([]byte, n)
	h := fnv.New64a()
	h.Write([]byte(seed))
	r := rand.New(rand.NewPCG(h.Sum64(), 35))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestBatchOverTheTopicLimitFailsNoRecord (issue 35, item 1): a topic whose
// max.message.bytes (4,096) is far below kafka.max_message_bytes, and 20
// records of 520 B queued behind one held produce. Each record alone fits
// the topic; together they do not. The sink reads the topic's limit and
// batches within it: every record is stored, none fails, let alone as
// permanent.
func TestBatchOverTheTopicLimitFailsNoRecord(t *testing.T) {
	c := newCluster(t)
	s := newSink(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	adm := kadm.NewClient(s.Client())
	if _, err := adm.CreateTopic(ctx, 1, 1, map[string]*string{"max.message.bytes": kadm.StringPtr("4096")}, "orders"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.EnsureTopics(ctx, []kafkasink.TopicSpec{{Name: "orders", Manage: true}}); err != nil {
		t.Fatal(err)
	}
	held, release := holdFirstProduce(c)
	pub := func(id string, size int) relay.Future {
		f, err := s.Publish(&relay.Msg{Subject: "orders", Key: "k", Data: incompressible(id, size), Header: relay.Header{relay.HeaderMsgID: {id}}})
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	first := pub("first", 10)
	select {
	case <-held:
	case <-ctx.Done():
		t.Fatal("no produce reached the broker")
	}
	var futs []relay.Future
	for i := range 20 {
		futs = append(futs, pub(fmt.Sprintf("e%02d", i), 520))
	}
	close(release)
	if _, err := wait(t, ctx, first); err != nil {
		t.Fatalf("the held record: %v", err)
	}
	failed, permanent := 0, 0
	var firstErr error
	for _, f := range futs {
		if _, err := wait(t, ctx, f); err != nil {
			failed++
			if kafkasink.Classify(err) == relay.Permanent {
				permanent++
			}
			if firstErr == nil {
				firstErr = err
			}
		}
	}
	if failed > 0 {
		t.Fatalf("%d of 20 records failed, %d of them as permanent (first: %v)", failed, permanent, firstErr)
	}
}

// TestTooLargeIsDecidedPerRecord (issue 35, item 1): MESSAGE_TOO_LARGE is
// permanent only for a record that alone is over its topic's limit. The
// topic takes 4,096 bytes: a record of 5,000 B fails alone, permanent. Then
// the topic's limit is lowered to 2,048 behind walbox's back (walbox still
// batches up to 4,096): the broker refuses a batch of records that each fit
// the limit walbox read, and each is transient, resent. The case where the
// proof fails: a record of 3,000 B, over the new limit but under the one
// read, is transient too (it waits; it is not dead-lettered on a guess).
func TestTooLargeIsDecidedPerRecord(t *testing.T) {
	c := newCluster(t)
	s := newSink(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	adm := kadm.NewClient(s.Client())
	if _, err := adm.CreateTopic(ctx, 1, 1, map[string]*string{"max.message.bytes": kadm.StringPtr("4096")}, "orders"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.EnsureTopics(ctx, []kafkasink.TopicSpec{{Name: "orders", Manage: true}}); err != nil {
		t.Fatal(err)
	}
	pub := func(id string, size int) relay.Future {
		f, err := s.Publish(&relay.Msg{Subject: "orders", Key: "k", Data: incompressible(id, size), Header: relay.Header{relay.HeaderMsgID: {id}}})
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	if _, err := wait(t, ctx, pub("small", 10)); err != nil {
		t.Fatal(err)
	}
	_, err := wait(t, ctx, pub("huge", 5000))
	if !errors.Is(err, kafkasink.ErrRecordTooLarge) || kafkasink.Classify(err) != relay.Permanent {
		t.Fatalf("a record alone over the topic's limit: %v (class %v), want ErrRecordTooLarge, permanent", err, kafkasink.Classify(err))
	}
	if _, err := adm.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "max.message.bytes", Value: kadm.StringPtr("2048")}}, "orders"); err != nil {
		t.Fatal(err)
	}
	// The broker now refuses what it is sent as too large. With up to five
	// produce requests in flight a record can go out alone, and a 520 B one
	// alone fits even the lowered limit: which records share a batch is
	// franz-go's timing, so the broker's answer is made certain here, the
	// same for every batch, and each record is judged by itself.
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		pr := req.(*kmsg.ProduceRequest)
		resp := pr.ResponseKind().(*kmsg.ProduceResponse)
		for _, tp := range pr.Topics {
			rt := kmsg.NewProduceResponseTopic()
			rt.Topic, rt.TopicID = tp.Topic, tp.TopicID
			for _, p := range tp.Partitions {
				rp := kmsg.NewProduceResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.MessageTooLarge.Code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
	var futs []relay.Future
	for i := range 4 {
		futs = append(futs, pub(fmt.Sprintf("e%02d", i), 520))
	}
	futs = append(futs, pub("between", 3000))
	for i, f := range futs {
		_, err := wait(t, ctx, f)
		if err == nil {
			t.Fatalf("record %d stored in a batch over the topic's limit", i)
		}
		if !errors.Is(err, kafkasink.ErrBatchTooLarge) || kafkasink.Classify(err) != relay.Transient {
			t.Errorf("record %d: %v (class %v), want ErrBatchTooLarge, transient", i, err, kafkasink.Classify(err))
		}
	}
}
