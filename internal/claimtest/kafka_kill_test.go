package claimtest

import (
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay/claim"
	"github.com/walbox/walbox/relay/kafkasink"
	"github.com/walbox/walbox/relay/sweep"
)

// TestKafkaRelayKilledMidUploadDeliversOnceAndLeavesNoOrphan is the Kafka
// and S3 counterpart of TestRelayKilledMidUploadDeliversOnceAndLeavesNoOrphan:
// kill -9 of the relay while it uploads a 32 MiB payload (held inside its
// first part, so the kill is provably mid-upload); the next relay delivers
// every event once, in insert order within its partition, each large
// payload byte for byte as its object; and the retention sweep aborts the
// unfinished multipart upload the kill left, keeps every object whose
// record is held, and leaves no object that no record names.
func TestKafkaRelayKilledMidUploadDeliversOnceAndLeavesNoOrphan(t *testing.T) {
	k := kafkatest.NewCluster(t)
	var once sync.Once
	blocked, release := make(chan struct{}), make(chan struct{})
	endpoint, _ := countingS3(t, func(r *http.Request) {
		if r.Method == http.MethodPut && r.URL.Query().Has("partNumber") {
			first := false
			once.Do(func() { first = true })
			if first {
				close(blocked)
				<-release
			}
		}
	})
	var released sync.Once
	free := func() { released.Do(func() { close(release) }) }
	t.Cleanup(free) // before the server's Close, which waits for the handler
	s3cfg := config.S3{Endpoint: endpoint, Bucket: "claims", Prefix: "walbox", AccessKey: "walbox", SecretKey: "secret"}
	e := newEnv(t, k.Sink(config.KafkaTopic{Name: "user.created", Partitions: 2, ReplicationFactor: 3}), func(c *config.Config) {
		c.ClaimCheck.S3 = s3cfg
	})
	cmd, done := e.spawnRelay()
	e.insertKeyed(100, "a")
	e.insertKeyed(100, "b")
	e.insertKeyed(32*MiB, "a")
	e.insertKeyed(100, "b")
	e.insertKeyed(2*MiB, "b")
	e.insertKeyed(100, "a")
	select {
	case <-blocked:
	case <-time.After(60 * time.Second):
		t.Fatal("the relay did not start uploading the 32 MiB payload's parts")
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-done
	free()

	c, err := sweep.NewS3Client(sweep.S3Config{Endpoint: endpoint, Bucket: "claims", AccessKey: "walbox", SecretKey: "secret"})
	if err != nil {
		t.Fatal(err)
	}
	var partial []minio.ObjectMultipartInfo
	for u := range c.ListIncompleteUploads(e.ctx, "claims", "walbox/", true) {
		if u.Err != nil {
			t.Fatal(u.Err)
		}
		partial = append(partial, u)
	}
	if len(partial) != 1 {
		t.Fatalf("%d unfinished uploads after the kill, want the 32 MiB payload's", len(partial))
	}

	e.insertKeyed(3*MiB/2, "a")
	e.insertKeyed(100, "b")
	relaytest.StartRelay(t, e.cfg)
	recs := newKafkaReader(e, "user.created").next(len(e.ids), 120*time.Second)
	counts, err := kafkatest.Counts(e.ctx, e.cfg.Kafka.Brokers, "user.created")
	if err != nil {
		t.Fatal(err)
	}
	total := int64(0)
	for _, n := range counts["user.created"] {
		total += n
	}
	if total != int64(len(e.ids)) {
		t.Fatalf("the topic holds %d records, want %d (each event once)", total, len(e.ids))
	}

	store := claim.NewS3Store(c, "claims", "", 0)
	byPart := map[int32][]string{}
	named := map[string]bool{}
	for _, r := range recs {
		id := kafkaHeader(r, "Walbox-Event-Id")
		byPart[r.Partition] = append(byPart[r.Partition], id)
		if kafkaHeader(r, claim.Header) == "" {
			if string(r.Value) != e.payloads[id] {
				t.Errorf("event %s: value differs from its row", id)
			}
			continue
		}
		named[verifyClaim(t, e.ctx, store, r, e.payloads[id]).Key] = true
	}
	seen := 0
	for p, ids := range byPart {
		want := slices.DeleteFunc(slices.Clone(e.ids), func(id string) bool { return !slices.Contains(ids, id) })
		if strings.Join(ids, ",") != strings.Join(want, ",") {
			t.Errorf("partition %d holds %v, want once each in insert order %v", p, ids, want)
		}
		seen += len(ids)
	}
	if seen != len(e.ids) || len(named) != 3 {
		t.Fatalf("read %d events, %d by reference; want %d, 3 (32, 2 and 1.5 MiB)", seen, len(named), len(e.ids))
	}

	// The sweep, with a slack this test can wait out: past the
	// unfinished upload's start by the slack and S3's one-second
	// resolution.
	const slack = 200 * time.Millisecond
	time.Sleep(time.Until(partial[0].Initiated.Add(time.Second + slack + 10*time.Millisecond)))
	h := kafkasink.NewHorizon(kafkasink.Config{Brokers: e.cfg.Kafka.Brokers}, time.Minute)
	stats, err := claim.NewS3Sweeper(claim.NewS3Store(c, "claims", "walbox", 0), h, slack, zerolog.Nop(), nil).Sweep(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("sweep: %+v", stats)
	if stats.Partials != 1 || stats.Deleted != 0 || stats.Objects != 3 {
		t.Fatalf("sweep %+v, want the unfinished upload aborted and the 3 objects kept", stats)
	}
	for u := range c.ListIncompleteUploads(e.ctx, "claims", "walbox/", true) {
		t.Errorf("unfinished upload %s of %s left after the sweep (%v)", u.UploadID, u.Key, u.Err)
	}
	for o := range c.ListObjects(e.ctx, "claims", minio.ListObjectsOptions{Prefix: "walbox/", Recursive: true}) {
		if o.Err != nil {
			t.Fatal(o.Err)
		}
		if !named[o.Key] {
			t.Errorf("object %s is named by no record: an orphan", o.Key)
		}
	}
}
