package claim_test

import (
	"context"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/minio/minio-go/v7"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay/claim"
	"github.com/walbox/walbox/relay/kafkasink"
	"github.com/walbox/walbox/relay/sweep"
)

// s3Clock is the in-process S3 server's clock, which a test sets, so that
// an object's Last-Modified is what the test says.
type s3Clock struct {
	mu sync.Mutex
	at time.Time
}

func (c *s3Clock) set(at time.Time) { c.mu.Lock(); c.at = at; c.mu.Unlock() }
func (c *s3Clock) Now() time.Time   { c.mu.Lock(); defer c.mu.Unlock(); return c.at }
func (c *s3Clock) Since(t time.Time) time.Duration {
	return c.Now().Sub(t)
}

// s3Env is the in-process S3 server the archival tests use, with bucket
// "claims", its clock, and a store on it under prefix "walbox".
func s3Env(t *testing.T) (*claim.S3Store, *minio.Client, *s3Clock) {
	t.Helper()
	clock := &s3Clock{at: time.Now()}
	backend := s3mem.New(s3mem.WithTimeSource(clock))
	srv := httptest.NewServer(gofakes3.New(backend, gofakes3.WithTimeSource(clock), gofakes3.WithTimeSkewLimit(0)).Server())
	t.Cleanup(srv.Close)
	if err := backend.CreateBucket("claims"); err != nil {
		t.Fatal(err)
	}
	c, err := sweep.NewS3Client(sweep.S3Config{Endpoint: strings.TrimPrefix(srv.URL, "http://"), Bucket: "claims", AccessKey: "walbox", SecretKey: "secret"})
	if err != nil {
		t.Fatal(err)
	}
	return claim.NewS3Store(c, "claims", "walbox", 0), c, clock
}

// produceAt writes one record stamped at to topic's partition p.
func produceAt(t *testing.T, ctx context.Context, cl *kgo.Client, topic string, p int32, at time.Time) {
	t.Helper()
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: p, Timestamp: at, Value: []byte("v")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// TestS3SweepDeletesOnlyObjectsWhoseKafkaRecordIsGone: with Kafka, an
// object is deleted when it was modified more than the slack before the
// oldest record any partition of its topic holds, or before now for an
// empty or missing topic. The case the proof is for: an object whose
// record is the first one partition 0 still holds stays, although
// partition 1's oldest record, and the record retention deleted before it,
// would each have allowed its deletion.
func TestS3SweepDeletesOnlyObjectsWhoseKafkaRecordIsGone(t *testing.T) {
	ctx := relaytest.Ctx(t)
	k := kafkatest.NewCluster(t)
	for topic, parts := range map[string]int32{"orders": 2, "quiet": 1, "future": 1} {
		if _, err := k.Admin.CreateTopic(ctx, parts, 1, nil, topic); err != nil {
			t.Fatal(err)
		}
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.ListenAddrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	now := time.Now()
	const slack = time.Minute
	produceAt(t, ctx, cl, "orders", 0, now.Add(-3*time.Hour))    // offset 0: deleted below
	produceAt(t, ctx, cl, "orders", 0, now.Add(-time.Hour))      // the first record held in partition 0
	produceAt(t, ctx, cl, "orders", 1, now.Add(-30*time.Minute)) // partition 1's first
	produceAt(t, ctx, cl, "future", 0, now.Add(time.Hour))       // a producer's clock an hour ahead
	res, err := k.Admin.DeleteRecords(ctx, kadm.Offsets{"orders": {0: {Topic: "orders", Partition: 0, At: 1}}})
	if err != nil || res.Error() != nil {
		t.Fatalf("delete records: %v, %v", err, res.Error())
	}

	store, c, clock := s3Env(t)
	keyOf := map[string]string{} // the object's name: the key it was put as
	put := func(key, stream string, modified time.Time) {
		t.Helper()
		clock.set(modified)
		meta := map[string]string{claim.MetaEventID: key}
		if stream != "" {
			meta[claim.MetaStream] = stream
		}
		name, err := store.Put(ctx, key, []byte(key), meta)
		if err != nil {
			t.Fatal(err)
		}
		keyOf[name] = key
	}
	put("gone", "orders", now.Add(-3*time.Hour-2*time.Minute)) // its record was offset 0
	put("held", "orders", now.Add(-time.Hour-30*time.Second))  // its record is partition 0's first
	put("quiet-old", "quiet", now.Add(-2*time.Minute))         // empty topic: an orphan
	put("quiet-young", "quiet", now.Add(-30*time.Second))      // maybe not yet published
	put("no-topic", "deleted-topic", now.Add(-2*time.Minute))  // topic gone
	put("not-walbox", "", now.Add(-5*time.Hour))               // no stream: kept
	put("future-old", "future", now.Add(-2*time.Hour))         // untrusted clock: kept
	clock.set(time.Now())

	reg := prometheus.NewRegistry()
	h := kafkasink.NewHorizon(kafkasink.Config{Brokers: k.ListenAddrs()}, time.Minute)
	stats, err := claim.NewS3Sweeper(store, h, slack, zerolog.Nop(), reg).Sweep(ctx)
	if err == nil || !strings.Contains(err.Error(), "future/0") {
		t.Errorf("sweep error %v, want the future topic's untrusted clock named", err)
	}
	want := map[string]bool{"held": true, "quiet-young": true, "not-walbox": true, "future-old": true}
	var left []string
	for o := range c.ListObjects(ctx, "claims", minio.ListObjectsOptions{Prefix: "walbox/", Recursive: true}) {
		if o.Err != nil {
			t.Fatal(o.Err)
		}
		left = append(left, keyOf[o.Key])
	}
	if len(left) != len(want) {
		t.Errorf("bucket holds %v after the sweep, want %v", left, want)
	}
	for _, k := range left {
		if !want[k] {
			t.Errorf("bucket holds %v after the sweep, want %v", left, want)
		}
	}
	if stats.Deleted != 3 || stats.Objects != 4 {
		t.Errorf("sweep %+v, want 3 deleted, 4 kept", stats)
	}
	wantBytes := int64(len("held") + len("quiet-young") + len("not-walbox") + len("future-old"))
	if n := relaytest.Metric(t, reg, "walbox_claim_objects", nil); n != 4 {
		t.Errorf("walbox_claim_objects = %v, want 4", n)
	}
	if n := relaytest.Metric(t, reg, "walbox_claim_bytes", nil); n != float64(wantBytes) {
		t.Errorf("walbox_claim_bytes = %v, want %d", n, wantBytes)
	}
}

// streamWithAMessage is a server with stream S holding one message,
// stored now: S's cutoff for the sweep.
func streamWithAMessage(t *testing.T) (context.Context, jetstream.JetStream) {
	t.Helper()
	ctx := relaytest.Ctx(t)
	_, js := relaytest.JetStream(t, natstest.New(t).URL())
	if _, err := js.CreateStream(ctx, jetstreamConfig("S")); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.x", nil); err != nil {
		t.Fatal(err)
	}
	return ctx, js
}

// TestS3SweepWithNATSUsesTheStreamsCutoff: S3 beside NATS sweeps by the
// JetStream streams' cutoff, as the Object Store's sweep does.
func TestS3SweepWithNATSUsesTheStreamsCutoff(t *testing.T) {
	ctx, js := streamWithAMessage(t)
	first := time.Now()
	store, _, clock := s3Env(t)
	names := map[string]string{}
	for key, at := range map[string]time.Time{
		"gone": first.Add(-2 * time.Minute),  // before the first message held, by more than the slack
		"held": first.Add(-30 * time.Second), // within the slack: its message may be the first
	} {
		clock.set(at)
		name, err := store.Put(ctx, key, []byte(key), map[string]string{claim.MetaStream: "S", claim.MetaEventID: key})
		if err != nil {
			t.Fatal(err)
		}
		names[key] = name
	}
	clock.set(time.Now())
	stats, err := claim.NewS3Sweeper(store, claim.JetStreamHorizon{JS: js}, time.Minute, zerolog.Nop(), nil).Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Deleted != 1 || stats.Objects != 1 {
		t.Fatalf("sweep %+v, want gone deleted and held kept", stats)
	}
	if _, err := store.Get(ctx, names["held"]); err != nil {
		t.Fatal(err)
	}
	if _, err := store.Get(ctx, names["gone"]); !isNoSuchKey(err) {
		t.Fatalf("gone: %v, want NoSuchKey", err)
	}
}
