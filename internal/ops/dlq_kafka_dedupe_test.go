package ops

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// Issue 35, item 3: dead letters stored twice, retried twice.

const dedupeSource = "app/walbox"

// produceDeadLetter stores a relay dead letter of event id (table
// public.outbox_events) in the dead-letter topic, as the relay does for an
// event whose topic was not declared.
func (e *kafkaEnv) produceDeadLetter(id, origTopic string) {
	e.t.Helper()
	h := relay.Header{}
	h.Set(relay.HeaderMsgID, id)
	h.Set(relay.HeaderEventID, id)
	h.Set(relay.HeaderSource, dedupeSource)
	h.Set(relay.HeaderTable, "public.outbox_events")
	h.Set(relay.HeaderCommitLSN, "0/16B3748")
	h.Set(relay.HeaderIndex, "0")
	h.Set(relay.HeaderDLQReason, "no configured stream captures subject "+origTopic)
	h.Set(relay.HeaderDLQOriginalSubject, origTopic)
	rec := &kgo.Record{Topic: e.cfg.Kafka.DLQTopic, Key: []byte(id), Value: []byte(`{"n":1}`), Headers: kafkasink.ToKafkaHeaders(h)}
	if err := e.kafka.Client.ProduceSync(testCtx(e.t), rec).FirstErr(); err != nil {
		e.t.Fatalf("produce dead letter %s: %v", id, err)
	}
}

// produceEvent stores event id of table public.outbox_events in topic as
// the relay does.
func (e *kafkaEnv) produceEvent(topic, id string) {
	e.t.Helper()
	h := relay.Header{}
	h.Set(relay.HeaderMsgID, id)
	h.Set(relay.HeaderSource, dedupeSource)
	h.Set(relay.HeaderTable, "public.outbox_events")
	h.Set(relay.HeaderCommitLSN, "0/16B3748")
	h.Set(relay.HeaderIndex, "0")
	rec := &kgo.Record{Topic: topic, Key: []byte(id), Value: []byte(`{"n":1}`), Headers: kafkasink.ToKafkaHeaders(h)}
	if err := e.kafka.Client.ProduceSync(testCtx(e.t), rec).FirstErr(); err != nil {
		e.t.Fatalf("produce %s to %s: %v", id, topic, err)
	}
}

// countIDs counts, per event id, the records of topic.
func (e *kafkaEnv) countIDs(topic string) map[string]int {
	e.t.Helper()
	ctx := testCtx(e.t)
	bus, err := openBus(ctx, e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	defer bus.Close()
	n := map[string]int{}
	err = bus.Scan(ctx, topic, "", time.Time{}, func(h relay.Header) error {
		n[h.Get(relay.HeaderEventID)]++
		return nil
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return n
}

// (a) Two copies of one dead letter (a resend whose first attempt was
// stored) are listed once and republished once; both are marked.
func TestDLQKafkaTwoCopiesListedAndRetriedOnce(t *testing.T) {
	e := newKafkaEnv(t)
	e.createAll()
	const idA, idB = "dup-a", "once-b"
	e.produceDeadLetter(idA, "orders.created")
	e.produceDeadLetter(idB, "orders.created")
	e.produceDeadLetter(idA, "orders.created") // the resend's copy
	dls, total, err := DLQList(testCtx(t), e.cfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 2 || total != 2 {
		t.Errorf("dlq list shows %d dead letters (total %d), want 2: one per event", len(dls), total)
	}
	var out bytes.Buffer
	res, err := DLQRetry(testCtx(t), e.cfg, DLQRetryOptions{All: true, Yes: true, Out: &out})
	t.Logf("retry:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if got := e.countIDs("orders.created"); got[idA] != 1 || got[idB] != 1 {
		t.Fatalf("orders.created holds %v after the retry, want each event once", got)
	}
	if res.Retried != 2 {
		t.Errorf("retry: %+v, want 2 retried", res)
	}
	if dls, _, err := DLQList(testCtx(t), e.cfg, 0); err != nil || len(dls) != 0 {
		t.Fatalf("after the retry dlq list shows %+v (%v), want nothing: every copy is marked", dls, err)
	}
}

// (b) A dead letter whose event the target topic's tail already holds
// (same source, table and id) is marked, not republished.
func TestDLQKafkaRetrySkipsWhatTheTopicHolds(t *testing.T) {
	e := newKafkaEnv(t)
	e.createAll()
	const id = "stored-already"
	e.produceEvent("orders.created", id)
	e.produceDeadLetter(id, "orders.created")
	var out bytes.Buffer
	res, err := DLQRetry(testCtx(t), e.cfg, DLQRetryOptions{All: true, Yes: true, Out: &out})
	t.Logf("retry:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if got := e.countIDs("orders.created"); got[id] != 1 {
		t.Fatalf("orders.created holds %s %d times after the retry, want once: it was there already", id, got[id])
	}
	if res.Retried != 0 || res.AlreadyStored != 1 {
		t.Errorf("retry: %+v, want 1 already stored", res)
	}
	mustContain(t, "retry output", out.String(), "already holds")
	if dls, _, err := DLQList(testCtx(t), e.cfg, 0); err != nil || len(dls) != 0 {
		t.Fatalf("after the retry dlq list shows %+v (%v), want nothing", dls, err)
	}
}

// (c) Two retries at once republish each dead letter once: a retry holds a
// lease (a PostgreSQL advisory lock on the dead-letter topic's name) from
// before it reads the topic until it has written its markers; the other
// says a retry is running.
func TestDLQKafkaConcurrentRetriesRepublishOnce(t *testing.T) {
	e := newKafkaEnv(t)
	e.createAll()
	ids := []string{"c-1", "c-2", "c-3"}
	for _, id := range ids {
		e.produceDeadLetter(id, "orders.created")
	}
	// Each run, once it has read the dead letters, waits (a while at
	// most) for the other to have read them too: without a lease both
	// then republish everything.
	var arrived sync.WaitGroup
	arrived.Add(2)
	barrier := func() {
		arrived.Done()
		done := make(chan struct{})
		go func() { arrived.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(3 * time.Second):
		}
	}
	type result struct {
		res *DLQRetryResult
		err error
		out string
	}
	results := make(chan result, 2)
	for range 2 {
		go func() {
			var out bytes.Buffer
			ctx, cancel := context.WithTimeout(testCtx(t), time.Minute)
			defer cancel()
			res, err := DLQRetry(ctx, e.cfg, DLQRetryOptions{All: true, Yes: true, Out: &out, afterRead: barrier})
			results <- result{res, err, out.String()}
		}()
	}
	refused := 0
	for range 2 {
		r := <-results
		t.Logf("retry: %+v %v\n%s", r.res, r.err, r.out)
		if r.err != nil {
			if !strings.Contains(r.err.Error(), "another walbox dlq retry") {
				t.Errorf("retry failed: %v", r.err)
			}
			refused++
		}
	}
	got := e.countIDs("orders.created")
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("orders.created holds %s %d times after two concurrent retries, want once", id, got[id])
		}
	}
	if refused != 1 {
		t.Errorf("%d of two concurrent retries were refused, want 1", refused)
	}
}
