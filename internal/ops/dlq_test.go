package ops

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

func TestDLQListAndRetry(t *testing.T) {
	e := newEnv(t)
	e.startRelay()
	good := e.insert("orders.created", `{"ok":1}`)
	later := e.insert("unrouted.thing", `{"u":1}`)
	never := e.insert("nowhere.thing", `{"w":1}`)
	e.waitMsgs("ORDERS", 1)
	e.waitMsgs("WALBOX_DLQ", 2)

	dls, total, err := DLQList(e.ctx, e.cfg, 0)
	if err != nil || total != 2 || len(dls) != 2 {
		t.Fatalf("list: %d %+v %v", total, dls, err)
	}
	if dls[0].ID != later || dls[0].OriginalSubject != "unrouted.thing" || !strings.Contains(dls[0].Reason, "no configured stream captures") || dls[0].Seq == 0 {
		t.Errorf("first dead letter: %+v", dls[0])
	}
	var out bytes.Buffer
	PrintDeadLetters(&out, dls, total, "WALBOX_DLQ")
	mustContain(t, "dlq list", out.String(), "SEQ", "ORIGINAL SUBJECT", "REASON", later, never, "unrouted.thing", "nowhere.thing")
	if strings.Contains(out.String(), good) {
		t.Errorf("dlq list shows a delivered event:\n%s", out.String())
	}
	if dls, total, _ := DLQList(e.ctx, e.cfg, 1); len(dls) != 1 || total != 2 {
		t.Errorf("--limit 1: %d of %d", len(dls), total)
	}
	out.Reset()
	PrintDeadLetters(&out, dls[:1], total, "WALBOX_DLQ")
	mustContain(t, "limited list", out.String(), "1 of 2 shown")
	js, _ := json.Marshal(dls)
	if !strings.Contains(string(js), `"original_subject":"unrouted.thing"`) {
		t.Errorf("JSON: %s", js)
	}

	// Nothing captures either subject yet: retry asks, and "n" changes nothing.
	out.Reset()
	if _, err := DLQRetry(e.ctx, e.cfg, DLQRetryOptions{All: true, In: strings.NewReader("n\n"), Out: &out}); !errors.Is(err, ErrAborted) {
		t.Fatalf("retry answered n: %v", err)
	}
	// A stream for unrouted.> appears (the operator fixed the config).
	if _, err := e.connectJS().CreateStream(e.ctx, jetstream.StreamConfig{Name: "UNROUTED", Subjects: []string{"unrouted.>"}}); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	res, err := DLQRetry(e.ctx, e.cfg, DLQRetryOptions{All: true, In: strings.NewReader("y\n"), Out: &out})
	if err != nil {
		t.Fatal(err)
	}
	if res.Retried != 1 || res.Skipped != 1 || res.AlreadyStored != 0 {
		t.Fatalf("retry: %+v\n%s", res, out.String())
	}
	mustContain(t, "retry output", out.String(), "republished to UNROUTED", "deleted from WALBOX_DLQ", "nowhere.thing: skipped: no stream captures nowhere.thing")
	if ids := e.streamIDs("UNROUTED"); len(ids) != 1 || ids[0] != later {
		t.Fatalf("UNROUTED holds %v, want [%s]", ids, later)
	}
	st, _ := e.connectJS().Stream(e.ctx, "UNROUTED")
	m, err := st.GetLastMsgForSubject(e.ctx, "unrouted.thing")
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get("Walbox-Dlq-Reason") != "" || m.Header.Get(HeaderDLQRetriedFrom) == "" || string(m.Data) != `{"u": 1}` {
		t.Errorf("retried message: %v %s", m.Header, m.Data)
	}
	dls, total, err = DLQList(e.ctx, e.cfg, 0)
	if err != nil || total != 1 || dls[0].ID != never {
		t.Fatalf("DLQ after retry: %d %+v %v", total, dls, err)
	}

	// --seq retries one by sequence number; still nowhere to go.
	out.Reset()
	res, err = DLQRetry(e.ctx, e.cfg, DLQRetryOptions{Seqs: []uint64{dls[0].Seq}, Yes: true, Out: &out})
	if err != nil || res.Skipped != 1 {
		t.Fatalf("retry --seq: %+v %v", res, err)
	}
	if _, err := DLQRetry(e.ctx, e.cfg, DLQRetryOptions{Yes: true}); err == nil {
		t.Fatal("retry without --seq or --all accepted")
	}
}

// A consumer group's dead letter goes back to that group alone: the event
// is in the stream, and every other group handled it already. Retried
// under the event's id on the original subject it was dropped as a
// duplicate (and the dead letter deleted); under the dead letter's id every
// other group got it again.
func TestDLQRetryOfAConsumerDeadLetterReachesThatGroupAlone(t *testing.T) {
	e := newEnv(t)
	e.startRelay()
	pool, err := pgxpool.New(e.ctx, e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	js := e.connectJS()
	var failA atomic.Bool
	failA.Store(true)
	var handledA, handledB atomic.Int32
	run := func(group string, count *atomic.Int32, fail *atomic.Bool) {
		cctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- consumer.Run(cctx, js, consumer.Config{Stream: "ORDERS", Durable: group, DB: pool, MaxDeliver: 1, AckWait: 5 * time.Second},
				func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
					if fail != nil && fail.Load() {
						return consumer.Permanent(errors.New("bug in the handler"))
					}
					count.Add(1)
					return nil
				})
		}()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("consumer %s: %v", group, err)
			}
		})
	}
	run("a", &handledA, &failA)
	run("b", &handledB, nil)
	id := e.insert("orders.created", `{"n":1}`)
	e.waitMsgs("WALBOX_DLQ", 1)
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		relaytest.Eventually(t, 30*time.Second, what, cond)
	}
	waitFor("group b to handle the event", func() bool { return handledB.Load() == 1 })
	dls, _, err := DLQList(e.ctx, e.cfg, 0)
	if err != nil || len(dls) != 1 || dls[0].ID != id || dls[0].Group != "a" {
		t.Fatalf("dead letters: %+v %v; want group a's of %s", dls, err, id)
	}

	failA.Store(false) // the handler is fixed
	var out bytes.Buffer
	res, err := DLQRetry(e.ctx, e.cfg, DLQRetryOptions{All: true, Yes: true, Out: &out})
	if err != nil || res.Retried != 1 {
		t.Fatalf("retry: %+v %v\n%s", res, err, out.String())
	}
	waitFor("group a to handle the retried event", func() bool { return handledA.Load() == 1 })
	// Group b cannot see it again: ORDERS holds no new message, and b
	// acked the one it has.
	if n := handledB.Load(); n != 1 {
		t.Fatalf("group b handled the event %d times after a's dead letter was retried", n)
	}
	if ids := e.streamIDs("ORDERS"); len(ids) != 1 {
		t.Fatalf("ORDERS holds %d messages after the retry, want the 1 original", len(ids))
	}
}

// A relay dead letter comes back under its own event id and in the envelope
// the relay gives events (it came back raw).
func TestDLQRetryRebuildsTheEnvelope(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.NATS.Envelope = "envelope"
		c.NATS.Streams = c.NATS.Streams[:1] // ORDERS only: payments.* has no stream yet
	})
	ctx := testCtx(t)
	e.startRelay()
	id := e.insert("payments.settled", `{"amount":5}`)
	e.waitMsgs("WALBOX_DLQ", 1)
	// The operator adds the stream to the config and to the server.
	e.cfg.NATS.Streams = append(e.cfg.NATS.Streams, config.Stream{Name: "PAYMENTS", Subjects: []string{"payments.>"}})
	if _, err := e.connectJS().CreateStream(ctx, jetstream.StreamConfig{Name: "PAYMENTS", Subjects: []string{"payments.>"}}); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if res, err := DLQRetry(ctx, e.cfg, DLQRetryOptions{All: true, Yes: true, Out: &out}); err != nil || res.Retried != 1 {
		t.Fatalf("retry: %+v %v\n%s", res, err, out.String())
	}
	st, _ := e.connectJS().Stream(ctx, "PAYMENTS")
	m, err := st.GetLastMsgForSubject(ctx, "payments.settled")
	if err != nil {
		t.Fatal(err)
	}
	var env struct {
		EventID string          `json:"event_id"`
		Payload json.RawMessage `json:"payload"`
	}
	if err := json.Unmarshal(m.Data, &env); err != nil || env.EventID != id || !strings.Contains(string(env.Payload), `"amount"`) {
		t.Fatalf("retried message data %s: want walbox's JSON envelope of event %s (%v)", m.Data, id, err)
	}
	if m.Header.Get("Nats-Msg-Id") != id {
		t.Fatalf("retried under id %q, want the event's %s", m.Header.Get("Nats-Msg-Id"), id)
	}
}

// waitDeadLetters waits until walbox dlq list shows n dead letters.
func (e *kafkaEnv) waitDeadLetters(n int) []DeadLetter {
	e.t.Helper()
	var (
		dls   []DeadLetter
		total uint64
		err   error
	)
	e.t.Cleanup(func() {
		if e.t.Failed() {
			e.t.Logf("the last dlq list: %d of %d, err %v: %+v", len(dls), total, err, dls)
			e.t.Logf("%s as stored:\n%s", e.cfg.Kafka.DLQTopic, e.topicLayout(e.cfg.Kafka.DLQTopic))
		}
	})
	relaytest.Eventually(e.t, 60*time.Second, fmt.Sprintf("walbox dlq list to show %d dead letters", n), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		dls, total, err = DLQList(ctx, e.cfg, 0)
		return err == nil && len(dls) == n && total == uint64(n)
	})
	return dls
}

// topicLayout describes, for a failure, every record of topic as the
// brokers store it: each partition's start, last stable offset and high
// watermark, the group GroupDLQ's offset, then each record read uncommitted
// with the control records (offset, data or commit or abort marker,
// producer id and epoch, transactional, event id, retried marker). It tells a relay that did not store a
// dead letter (or left a transaction open) from a list that could not read
// what was stored.
func (e *kafkaEnv) topicLayout(topic string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var b strings.Builder
	starts, serr := e.kafka.Admin.ListStartOffsets(ctx, topic)
	lsos, lerr := e.kafka.Admin.ListCommittedOffsets(ctx, topic)
	hwms, herr := e.kafka.Admin.ListEndOffsets(ctx, topic)
	if err := errors.Join(serr, lerr, herr); err != nil {
		fmt.Fprintf(&b, "list offsets: %v\n", err)
	}
	groups, gerr := e.kafka.Admin.FetchOffsets(ctx, kafkasink.GroupDLQ)
	parts := map[int32]kgo.Offset{}
	hwm := map[int32]int64{}
	hwms.Each(func(o kadm.ListedOffset) {
		s, _ := starts.Lookup(topic, o.Partition)
		l, _ := lsos.Lookup(topic, o.Partition)
		g, _ := groups.Lookup(topic, o.Partition)
		fmt.Fprintf(&b, "partition %d: start %d, last stable offset %d, high watermark %d, group %s at %d (%v)\n",
			o.Partition, s.Offset, l.Offset, o.Offset, kafkasink.GroupDLQ, g.At, gerr)
		if o.Err == nil && o.Offset > 0 {
			parts[o.Partition], hwm[o.Partition] = kgo.NewOffset().AtStart(), o.Offset
		}
	})
	if len(parts) == 0 {
		return b.String()
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.cfg.Kafka.Brokers...), kgo.FetchIsolationLevel(kgo.ReadUncommitted()),
		kgo.KeepControlRecords(), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: parts}))
	if err != nil {
		return b.String() + err.Error()
	}
	defer cl.Close()
	for len(hwm) > 0 && ctx.Err() == nil {
		fs := cl.PollFetches(ctx)
		fs.EachError(func(_ string, p int32, err error) { fmt.Fprintf(&b, "fetch %d: %v\n", p, err) })
		for it := fs.RecordIter(); !it.Done(); {
			r := it.Next()
			h := kafkasink.FromKafkaHeaders(r.Headers)
			kind := "data"
			if r.Attrs.IsControl() { // key: int16 version, int16 type (0 abort, 1 commit)
				kind = "commit marker"
				if len(r.Key) >= 4 && r.Key[2] == 0 && r.Key[3] == 0 {
					kind = "abort marker"
				}
			}
			fmt.Fprintf(&b, "  %d/%d: %s, producer %d epoch %d, transactional %t, event %q, retried %q\n", r.Partition, r.Offset, kind,
				r.ProducerID, r.ProducerEpoch, r.Attrs.IsTransactional(), h.Get(relay.HeaderEventID), h.Get(kafkasink.HeaderDLQRetried))
			if end, ok := hwm[r.Partition]; ok && r.Offset >= end-1 {
				delete(hwm, r.Partition)
			}
		}
	}
	return b.String()
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
	// Sequences are offsets + 1, growing; with walbox's transactions the
	// commit markers take offsets too, so they need not be 1, 2, 3.
	seq := func(i int) uint64 { return dls[i].Seq }
	for i, want := range []struct{ id, subject, reason string }{
		{idA, "refunds.created", "refunds.created"}, {idB, "orders.created", "exceeds"}, {idC, "refunds.created", "refunds.created"},
	} {
		d := dls[i]
		if d.ID != want.id || d.OriginalSubject != want.subject || !strings.Contains(d.Reason, want.reason) || d.Seq < uint64(i+1) || (i > 0 && d.Seq <= dls[i-1].Seq) ||
			d.Partition != 0 || d.Subject != e.cfg.Kafka.DLQTopic || d.Time.IsZero() {
			t.Errorf("dead letter %d: %+v, want id %s, subject %s, reason with %q, seq at least %d (offset + 1) and past the last", i, d, want.id, want.subject, want.reason, i+1)
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
	mustContain(t, "retry output", out.String(), fmt.Sprintf("seq %d orders.created: skipped: its payload (", seq(1)), "replay --id "+idB,
		fmt.Sprintf("seq %d refunds.created: republished to refunds.created", seq(0)), "marked retried in walbox.dlq")
	recs := e.kcat("refunds.created")
	got := map[string]outboxtest.KafkaRecord{}
	for _, r := range recs {
		got[r.Header("Walbox-Event-Id")] = r
	}
	if len(recs) != 2 || got[idA].Header("Walbox-Dlq-Retried-From") != fmt.Sprintf("walbox.dlq/%d", seq(0)) || got[idC].Header("Walbox-Dlq-Retried-From") != fmt.Sprintf("walbox.dlq/%d", seq(2)) {
		t.Fatalf("refunds.created holds %+v", recs)
	}
	if r := got[idA]; r.Key == nil || *r.Key != "r-1" || r.Payload == nil || *r.Payload != `{"n": 1}` || r.Header("Walbox-Commit-Lsn") == "" {
		t.Fatalf("the retried event as the relay would publish it: key r-1, payload, position headers: %+v", r)
	}

	// list shows only the one left; the group's offset stops before it.
	left := e.waitDeadLetters(1)
	if left[0].ID != idB || left[0].Seq != seq(1) {
		t.Fatalf("left in the DLQ: %+v", left[0])
	}
	offs, err := e.kafka.Admin.FetchOffsets(testCtx(t), kafkasink.GroupDLQ)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := offs.Lookup(e.cfg.Kafka.DLQTopic, 0); !ok || o.At != int64(seq(1))-1 {
		t.Fatalf("group %s committed %+v on %s, want offset %d (up to the dead letter left)", kafkasink.GroupDLQ, o, e.cfg.Kafka.DLQTopic, seq(1)-1)
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
	if _, err := DLQRetry(testCtx(t), e.cfg, DLQRetryOptions{Seqs: []uint64{seq(0)}, Yes: true, Out: &out}); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("no dead letter with seq %d", seq(0))) {
		t.Fatalf("retry of a retried seq: %v", err)
	}
	if n := len(e.kcat("refunds.created")); n != 2 {
		t.Fatalf("refunds.created holds %d records after a second retry, want 2", n)
	}
}
