package ops

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// waitDeadLetters waits until walbox dlq list shows n dead letters.
func (e *kafkaEnv) waitDeadLetters(n int) []DeadLetter {
	e.t.Helper()
	var dls []DeadLetter
	relaytest.Eventually(e.t, 60*time.Second, fmt.Sprintf("walbox dlq list to show %d dead letters", n), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		got, total, err := DLQList(ctx, e.cfg, 0)
		dls = got
		return err == nil && len(got) == n && total == uint64(n)
	})
	return dls
}

func (e *kafkaEnv) kcat(topic string) []outboxtest.KafkaRecord {
	e.t.Helper()
	recs, err := outboxtest.ReadKafkaWithKcat(testCtx(e.t), strings.Join(e.cfg.Kafka.Brokers, ","), topic)
	if err != nil {
		e.t.Fatal(err)
	}
	return recs
}

// TestDLQKafkaListAndRetry: rows a real relay dead-lettered (a topic not
// in kafka.topics, twice, and a payload over kafka.max_message_bytes) are
// listed with their reason; once the topic is declared, retry republishes
// the two to it under their event ids, marks them retried, and list shows
// only the one it could not retry. A second retry stores nothing twice.
func TestDLQKafkaListAndRetry(t *testing.T) {
	e := newKafkaEnv(t, func(cfg *config.Config) { cfg.Kafka.MaxMessageBytes = 4096 })
	run := e.startRelay()
	const idA, idB, idC = "00000000-0000-7000-8000-00000000000a", "00000000-0000-7000-8000-00000000000b", "00000000-0000-7000-8000-00000000000c"
	e.exec(`INSERT INTO outbox_events (id, topic, payload, aggregate_id) VALUES ($1, 'refunds.created', '{"n":1}', 'r-1')`, idA)
	e.exec(`INSERT INTO outbox_events (id, topic, payload) VALUES ($1, 'orders.created', jsonb_build_object('pad', repeat('x', 10000)))`, idB)
	e.exec(`INSERT INTO outbox_events (id, topic, payload, aggregate_id) VALUES ($1, 'refunds.created', '{"n":3}', 'r-3')`, idC)
	dls := e.waitDeadLetters(3)
	for i, want := range []struct{ id, subject, reason string }{
		{idA, "refunds.created", "refunds.created"}, {idB, "orders.created", "exceeds"}, {idC, "refunds.created", "refunds.created"},
	} {
		d := dls[i]
		if d.ID != want.id || d.OriginalSubject != want.subject || !strings.Contains(d.Reason, want.reason) || d.Seq != uint64(i+1) ||
			d.Partition != 0 || d.Subject != e.cfg.Kafka.DLQTopic || d.Time.IsZero() {
			t.Errorf("dead letter %d: %+v, want id %s, subject %s, reason with %q, seq %d (offset + 1)", i, d, want.id, want.subject, want.reason, i+1)
		}
	}
	var out bytes.Buffer
	PrintDeadLetters(&out, dls, 3, e.cfg.Kafka.DLQTopic)
	mustContain(t, "dlq list", out.String(), idA, "refunds.created", "no configured stream captures subject")

	// The cause fixed: the topic declared, and created by walbox at start.
	run.stop(t)
	e.cfg.Kafka.Topics = append(e.cfg.Kafka.Topics, config.KafkaTopic{Name: "refunds.created", Partitions: 2, ReplicationFactor: 3})
	e.startRelay()

	out.Reset()
	res, err := DLQRetry(testCtx(t), e.cfg, DLQRetryOptions{All: true, Yes: true, Out: &out})
	t.Logf("retry:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if res.Retried != 2 || res.Skipped != 1 {
		t.Fatalf("retry: %+v, want 2 retried, 1 skipped", res)
	}
	mustContain(t, "retry output", out.String(), "seq 2 orders.created: skipped: its payload (", "replay --id "+idB,
		"seq 1 refunds.created: republished to refunds.created", "marked retried in walbox.dlq")
	recs := e.kcat("refunds.created")
	got := map[string]outboxtest.KafkaRecord{}
	for _, r := range recs {
		got[r.Header("Walbox-Event-Id")] = r
	}
	if len(recs) != 2 || got[idA].Header("Walbox-Dlq-Retried-From") != "walbox.dlq/1" || got[idC].Header("Walbox-Dlq-Retried-From") != "walbox.dlq/3" {
		t.Fatalf("refunds.created holds %+v", recs)
	}
	if r := got[idA]; r.Key == nil || *r.Key != "r-1" || r.Payload == nil || *r.Payload != `{"n": 1}` || r.Header("Walbox-Commit-Lsn") == "" {
		t.Fatalf("the retried event as the relay would publish it: key r-1, payload, position headers: %+v", r)
	}

	// list shows only the one left; the group's offset stops before it.
	left := e.waitDeadLetters(1)
	if left[0].ID != idB || left[0].Seq != 2 {
		t.Fatalf("left in the DLQ: %+v", left[0])
	}
	offs, err := e.kafka.Admin.FetchOffsets(testCtx(t), kafkaGroupDLQ)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := offs.Lookup(e.cfg.Kafka.DLQTopic, 0); !ok || o.At != 1 {
		t.Fatalf("group %s committed %+v on %s, want offset 1 (past the first retried dead letter)", kafkaGroupDLQ, o, e.cfg.Kafka.DLQTopic)
	}

	rep, err := Status(testCtx(t), e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if rep.DLQ == nil || rep.DLQ.Messages != 1 || rep.DLQ.Error != "" {
		t.Fatalf("status dead letters after the retry: %+v, want 1", rep.DLQ)
	}

	// Nothing is retried twice.
	out.Reset()
	res, err = DLQRetry(testCtx(t), e.cfg, DLQRetryOptions{All: true, Yes: true, Out: &out})
	if err != nil || res.Retried != 0 || res.Skipped != 1 {
		t.Fatalf("second retry: %+v %v\n%s", res, err, out.String())
	}
	if _, err := DLQRetry(testCtx(t), e.cfg, DLQRetryOptions{Seqs: []uint64{1}, Yes: true, Out: &out}); err == nil || !strings.Contains(err.Error(), "no dead letter with seq 1") {
		t.Fatalf("retry of a retried seq: %v", err)
	}
	if n := len(e.kcat("refunds.created")); n != 2 {
		t.Fatalf("refunds.created holds %d records after a second retry, want 2", n)
	}
}
