package claimtest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay/claim"
	"github.com/walbox/walbox/relay/sweep"
)

// fakeS3 runs an S3-protocol server in memory with bucket "claims" and
// returns its endpoint.
func fakeS3(t *testing.T) string {
	t.Helper()
	backend := s3mem.New()
	srv := httptest.NewServer(gofakes3.New(backend).Server())
	t.Cleanup(srv.Close)
	if err := backend.CreateBucket("claims"); err != nil {
		t.Fatal(err)
	}
	return strings.TrimPrefix(srv.URL, "http://")
}

// TestKafkaLargeEventsGoThroughS3: with sink: kafka the payloads above
// Kafka's limit go to an S3-compatible bucket; the topic holds every event
// once, in order, the large ones as a reference whose object is byte for
// byte the row's payload; one larger than claim_check.max_bytes is
// dead-lettered.
func TestKafkaLargeEventsGoThroughS3(t *testing.T) {
	k := kafkatest.NewCluster(t)
	endpoint := fakeS3(t)
	e := newEnv(t, k.Sink(config.KafkaTopic{Name: "user.created", Partitions: 1, ReplicationFactor: 3}), func(c *config.Config) {
		c.ClaimCheck.S3 = config.S3{Endpoint: endpoint, Bucket: "claims", Prefix: "walbox", AccessKey: "walbox", SecretKey: "secret"}
		c.ClaimCheck.MaxBytes = 4 * MiB
	})
	relaytest.StartRelay(t, e.cfg)
	for _, size := range []int{100, MiB / 2, 3 * MiB / 2, 100} {
		e.insert(size)
	}
	tooLarge := e.insert(8 * MiB)
	want := e.ids[:4]
	e.insert(100)
	want = append(want, e.ids[5])

	cl, err := kgo.NewClient(kgo.SeedBrokers(e.cfg.Kafka.Brokers...), kgo.ConsumeTopics("user.created", e.cfg.Kafka.DLQTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var got []*kgo.Record
	var dead *kgo.Record
	deadline := time.Now().Add(60 * time.Second)
	for (len(got) < len(want) || dead == nil) && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(e.ctx, 2*time.Second)
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
			if r.Topic == "user.created" {
				got = append(got, r)
			} else {
				dead = r
			}
		})
		cancel()
	}
	header := func(r *kgo.Record, k string) string {
		for _, h := range r.Headers {
			if h.Key == k {
				return string(h.Value)
			}
		}
		return ""
	}
	var ids []string
	for _, r := range got {
		ids = append(ids, header(r, "Walbox-Event-Id"))
	}
	if strings.Join(ids, ",") != strings.Join(want, ",") {
		t.Fatalf("topic holds %v, want once each in order %v", ids, want)
	}
	if dead == nil || header(dead, "Walbox-Event-Id") != tooLarge || !strings.Contains(header(dead, "Walbox-Dlq-Reason"), "max_bytes") {
		t.Fatalf("dead letter %v, want %s refused for claim_check.max_bytes", dead, tooLarge)
	}

	c, err := sweep.NewS3Client(sweep.S3Config{Endpoint: endpoint, Bucket: "claims", AccessKey: "walbox", SecretKey: "secret"})
	if err != nil {
		t.Fatal(err)
	}
	objects := claim.NewS3Store(c, "claims", "", 0)
	claimed := 0
	for _, r := range got {
		id, v := header(r, "Walbox-Event-Id"), header(r, claim.Header)
		if v == "" {
			if string(r.Value) != e.payloads[id] {
				t.Errorf("event %s: value differs from its row", id)
			}
			continue
		}
		claimed++
		ref, err := claim.ParseRef(v)
		if err != nil || ref.Store != claim.StoreS3 || ref.Bucket != "claims" || len(r.Value) != 0 {
			t.Fatalf("event %s: reference %+v (%v), %d bytes of value", id, ref, err, len(r.Value))
		}
		data, err := objects.Get(e.ctx, ref.Key)
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(data)
		if string(data) != e.payloads[id] || hex.EncodeToString(sum[:]) != ref.SHA256 || ref.Size != int64(len(data)) {
			t.Errorf("event %s: object %s differs from its row or its reference", id, ref.Key)
		}
	}
	if claimed != 1 {
		t.Fatalf("%d events went by reference, want 1 (the 1.5 MiB one)", claimed)
	}

	// walbox replay publishes it by reference too.
	res, err := ops.Replay(e.ctx, e.cfg, ops.ReplayOptions{IDs: []string{e.ids[2]}, ForceNewID: true})
	if err != nil || res.Published != 1 {
		t.Fatalf("replay: %+v, %v; want 1 published", res, err)
	}
	var again *kgo.Record
	for again == nil && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(e.ctx, 2*time.Second)
		cl.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
			if r.Topic == "user.created" {
				again = r
			}
		})
		cancel()
	}
	if again == nil || header(again, claim.Header) == "" || len(again.Value) != 0 {
		t.Fatalf("replayed record %v, want a reference and an empty value", again)
	}
}
