package claimtest

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/minio/minio-go/v7"
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
	endpoint, _ := countingS3(t, nil)
	return endpoint
}

// countingS3 is fakeS3 that also counts the uploads of each event: the
// requests that send an object's bytes (PUT or POST without
// X-Amz-Copy-Source; a server-side copy sends none) to the event's bare
// key (/claims/<key>, as older walbox versions named its object) or to a
// name under it (/claims/<key>/..., as walbox names each upload). hook,
// when set, sees every request before the server does.
func countingS3(t *testing.T, hook func(*http.Request)) (endpoint string, uploads func(key string) int) {
	t.Helper()
	backend := s3mem.New()
	var mu sync.Mutex
	count := map[string]int{}
	fake := gofakes3.New(backend).Server()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if (r.Method == http.MethodPut || r.Method == http.MethodPost) && r.Header.Get("X-Amz-Copy-Source") == "" {
			mu.Lock()
			count[r.URL.Path]++
			mu.Unlock()
		}
		if hook != nil {
			hook(r)
		}
		if r.URL.Query().Has("partNumber") && strings.HasPrefix(r.Header.Get("X-Amz-Content-Sha256"), "STREAMING-") {
			// gofakes3 (v1.2.0) decodes aws-chunked bodies of PutObject
			// only, and would store a part's chunk framing as its
			// bytes: decode it here, as S3 does.
			n, err := strconv.ParseInt(r.Header.Get("X-Amz-Decoded-Content-Length"), 10, 64)
			if err != nil {
				http.Error(w, "bad X-Amz-Decoded-Content-Length", http.StatusBadRequest)
				return
			}
			r.Body = awsChunked(bufio.NewReader(r.Body))
			r.ContentLength = n
			r.Header.Set("Content-Length", strconv.FormatInt(n, 10))
			r.Header.Set("X-Amz-Content-Sha256", "UNSIGNED-PAYLOAD")
		}
		fake.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	if err := backend.CreateBucket("claims"); err != nil {
		t.Fatal(err)
	}
	return strings.TrimPrefix(srv.URL, "http://"), func(key string) int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for path, c := range count {
			if path == "/claims/"+key || strings.HasPrefix(path, "/claims/"+key+"/") {
				n += c
			}
		}
		return n
	}
}

// kafkaReader reads topic from its start, read_committed, as a consumer of
// walbox's topics must.
type kafkaReader struct {
	t  *testing.T
	e  *env
	cl *kgo.Client
}

func newKafkaReader(e *env, topics ...string) *kafkaReader {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.cfg.Kafka.Brokers...), kgo.ConsumeTopics(topics...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(cl.Close)
	return &kafkaReader{t: e.t, e: e, cl: cl}
}

// next returns the next n records, failing the test after timeout.
func (r *kafkaReader) next(n int, timeout time.Duration) []*kgo.Record {
	r.t.Helper()
	var got []*kgo.Record
	deadline := time.Now().Add(timeout)
	for len(got) < n && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(r.e.ctx, 2*time.Second)
		r.cl.PollRecords(ctx, n-len(got)).EachRecord(func(rec *kgo.Record) { got = append(got, rec) })
		cancel()
	}
	if len(got) < n {
		r.t.Fatalf("read %d records in %s, want %d", len(got), timeout, n)
	}
	return got
}

// kafkaHeader is the value of r's header k ("" when absent).
func kafkaHeader(r *kgo.Record, k string) string {
	for _, h := range r.Headers {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}

// verifyClaim fetches the object r's reference names, as a consumer
// without the consumer library does, and checks it against the reference
// and against want; it returns the reference.
func verifyClaim(t *testing.T, ctx context.Context, store *claim.S3Store, r *kgo.Record, want string) claim.Ref {
	t.Helper()
	ref, err := claim.ParseRef(kafkaHeader(r, claim.Header))
	if err != nil || ref.Store != claim.StoreS3 || len(r.Value) != 0 {
		t.Fatalf("record at offset %d: reference %+v (%v), %d bytes of value; want an S3 reference and no value", r.Offset, ref, err, len(r.Value))
	}
	data, err := store.Get(ctx, ref.Key)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if hex.EncodeToString(sum[:]) != ref.SHA256 || int64(len(data)) != ref.Size {
		t.Fatalf("object %s: %d bytes, sha256 %x; its reference says %d, %s", ref.Key, len(data), sum, ref.Size, ref.SHA256)
	}
	if string(data) != want {
		t.Fatalf("object %s differs from its row", ref.Key)
	}
	return ref
}

// TestKafkaReplayReusesAnIntactS3Object: walbox replay of a large event
// whose S3 object is intact (by its walbox-sha256 metadata, or without it
// by its bytes, as under the bare key an older walbox wrote) publishes a
// reference without uploading the payload: a server-side copy of the
// intact object to a name of its own, which the retention sweep counts
// from the replay; an object overwritten with other bytes, or deleted, is
// uploaded again. Each replayed record names an object no record named
// before, which matches its reference and its row.
func TestKafkaReplayReusesAnIntactS3Object(t *testing.T) {
	k := kafkatest.NewCluster(t)
	endpoint, uploads := countingS3(t, nil)
	e := newEnv(t, k.Sink(config.KafkaTopic{Name: "user.created", Partitions: 1, ReplicationFactor: 3}), func(c *config.Config) {
		c.ClaimCheck.S3 = config.S3{Endpoint: endpoint, Bucket: "claims", Prefix: "walbox", AccessKey: "walbox", SecretKey: "secret"}
	})
	relaytest.StartRelay(t, e.cfg)
	id := e.insert(3 * MiB / 2)
	payload := e.payloads[id]
	rd := newKafkaReader(e, "user.created")
	c, err := sweep.NewS3Client(sweep.S3Config{Endpoint: endpoint, Bucket: "claims", AccessKey: "walbox", SecretKey: "secret"})
	if err != nil {
		t.Fatal(err)
	}
	store := claim.NewS3Store(c, "claims", "", 0)
	first := verifyClaim(t, e.ctx, store, rd.next(1, 60*time.Second)[0], payload).Key
	// The event's bare key: the folder of its objects' names.
	event := first[:strings.LastIndexByte(first, '/')]
	if n := uploads(event); n != 1 {
		t.Fatalf("%d uploads of %s, want 1", n, event)
	}
	named := map[string]bool{first: true}
	replay := func(wantUploads int, what string) {
		t.Helper()
		res, err := ops.Replay(e.ctx, e.cfg, ops.ReplayOptions{IDs: []string{id}, ForceNewID: true})
		if err != nil || res.Published != 1 {
			t.Fatalf("replay: %+v, %v; want 1 published", res, err)
		}
		if n := uploads(event); n != wantUploads {
			t.Fatalf("%s: %d uploads of %s, want %d", what, n, event, wantUploads)
		}
		got := verifyClaim(t, e.ctx, store, rd.next(1, 30*time.Second)[0], payload).Key
		if !strings.HasPrefix(got, event+"/") || named[got] {
			t.Fatalf("%s: the replayed record names %s, want a new object under the event's key %s", what, got, event)
		}
		named[got] = true
	}
	// removeAll deletes every object of the event.
	removeAll := func() {
		t.Helper()
		for o := range c.ListObjects(e.ctx, "claims", minio.ListObjectsOptions{Prefix: event + "/", Recursive: true}) {
			if o.Err != nil {
				t.Fatal(o.Err)
			}
			if err := c.RemoveObject(e.ctx, "claims", o.Key, minio.RemoveObjectOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.RemoveObject(e.ctx, "claims", event, minio.RemoveObjectOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// put leaves data as the event's only object, under its bare key and
	// without walbox's metadata.
	put := func(data string) {
		t.Helper()
		removeAll()
		if _, err := c.PutObject(e.ctx, "claims", event, strings.NewReader(data), int64(len(data)), minio.PutObjectOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	replay(1, "intact, by its metadata")
	put(payload) // the same bytes without walbox's metadata: 2 uploads so far
	replay(2, "intact, by its bytes")
	put(strings.Repeat("x", len(payload))) // other bytes of the same size
	replay(4, "corrupt")
	removeAll()
	replay(5, "missing")
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

// awsChunked reads the payload of an aws-chunked body: chunks of
// "<hex size>[;extensions]\r\n<data>\r\n" up to one of size 0.
func awsChunked(br *bufio.Reader) io.ReadCloser {
	pr, pw := io.Pipe()
	go func() {
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				pw.CloseWithError(err)
				return
			}
			size, err := strconv.ParseInt(strings.TrimSpace(strings.SplitN(line, ";", 2)[0]), 16, 64)
			if err != nil {
				pw.CloseWithError(fmt.Errorf("aws-chunked header %q: %w", line, err))
				return
			}
			if size == 0 {
				pw.Close()
				return
			}
			if _, err := io.CopyN(pw, br, size); err != nil {
				pw.CloseWithError(err)
				return
			}
			if _, err := br.Discard(2); err != nil { // \r\n
				pw.CloseWithError(err)
				return
			}
		}
	}()
	return pr
}
