package e2e

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// The Kafka sink's end-to-end tests run against kfake, franz-go's
// in-process implementation of the Kafka protocol (no broker can be
// installed here), and judge what walbox wrote with kcat (librdkafka), a
// client that shares no code with the one that wrote it.

var kafkaTopics = []string{"orders.created", "orders.paid", "payments.settled"}

// kafkaEnv is an env whose relay publishes to a kfake cluster.
type kafkaEnv struct {
	*env
	kafka *kafkatest.Cluster
}

func newKafkaEnv(t *testing.T, mutate ...func(*config.Config)) *kafkaEnv {
	t.Helper()
	k := kafkatest.NewCluster(t)
	var topics []config.KafkaTopic
	for _, name := range kafkaTopics {
		topics = append(topics, config.KafkaTopic{Name: name, Partitions: 4, ReplicationFactor: 3})
	}
	e := newEnv(t, append([]func(*config.Config){k.Sink(topics...)}, mutate...)...)
	return &kafkaEnv{env: e, kafka: k}
}

// newMigratedKafkaEnv is newKafkaEnv with walbox's migrations applied.
func newMigratedKafkaEnv(t *testing.T, mutate ...func(*config.Config)) *kafkaEnv {
	t.Helper()
	e := newKafkaEnv(t, mutate...)
	e.migrate()
	return e
}

// stored is how many records the topics (and the dead-letter topic) hold:
// committed data records, counted by reading them (offsets also count
// transaction markers and aborted records).
func (e *kafkaEnv) stored() int64 {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	counts, err := kafkatest.Counts(ctx, e.cfg.Kafka.Brokers, append(kafkaTopics, e.cfg.Kafka.DLQTopic)...)
	if err != nil {
		return 0
	}
	var n int64
	for _, parts := range counts {
		for _, c := range parts {
			n += c
		}
	}
	return n
}

// waitStored waits until the topics hold at least n records.
func (e *kafkaEnv) waitStored(n int64, timeout time.Duration) {
	e.t.Helper()
	relaytest.Eventually(e.t, timeout, fmt.Sprintf("%d records in Kafka", n), func() bool { return e.stored() >= n })
}

// checkKafka reads the topics back with kcat and fails the test on any
// lost, duplicated, rolled-back or out-of-order event: order is judged per
// partition, the order Kafka keeps (per key; keyless events all go to
// partition 0 and keep commit order).
func (e *kafkaEnv) checkKafka(w *outboxtest.Witness, res *outboxtest.Result) (outboxtest.Report, []outboxtest.KafkaRecord) {
	e.t.Helper()
	return e.checkKafkaMoved(w, res, nil)
}

// checkKafkaMoved is checkKafka where the topics of moved had partitions
// added: a key of theirs may be in two partitions, each holding a span of
// its events that follows the other's in commit order, never interleaved.
// It also fails on any row marked processed whose record is not in its
// topic.
func (e *kafkaEnv) checkKafkaMoved(w *outboxtest.Witness, res *outboxtest.Result, moved map[string]bool) (outboxtest.Report, []outboxtest.KafkaRecord) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn := e.conn()
	committed, err := w.Committed(ctx, conn)
	if err != nil {
		e.t.Fatal(err)
	}
	e.waitStored(int64(len(committed)), 60*time.Second)
	recs, err := outboxtest.ReadKafkaWithKcat(ctx, strings.Join(e.cfg.Kafka.Brokers, ","), kafkaTopics...)
	if err != nil {
		e.t.Fatal(err)
	}
	var rolledBack []string
	if res != nil {
		rolledBack = res.RolledBack
	}
	rep := outboxtest.CheckStreamed(committed, rolledBack, outboxtest.KafkaStreams(recs), outboxtest.KafkaSnapshot(recs))
	e.t.Logf("checker (kcat): %s", rep.String())
	if !rep.OK() {
		e.t.Fatalf("guarantees broken: %s", rep)
	}
	if rep.Checked == 0 {
		e.t.Fatal("checker saw no committed events: the test produced nothing")
	}
	// One key, one partition (or, on a topic that got partitions, spans
	// in commit order); every record says where it came from.
	type span struct{ first, last cdc.Position }
	spans := map[string]map[int32]*span{}
	for _, r := range recs {
		if r.Header("Walbox-Source") == "" || r.Header("Walbox-Commit-Lsn") == "" {
			e.t.Fatalf("record %s/%d@%d lacks the position headers: %v", r.Topic, r.Partition, r.Offset, r.Headers)
		}
		if r.Key == nil {
			continue
		}
		k := r.Topic + "\x00" + *r.Key
		if spans[k] == nil {
			spans[k] = map[int32]*span{}
		}
		if len(spans[k]) > 0 && spans[k][r.Partition] == nil && !moved[r.Topic] {
			e.t.Fatalf("key %s of %s is in partitions %v and %d", *r.Key, r.Topic, slices.Collect(maps.Keys(spans[k])), r.Partition)
		}
		lsn, err := pglogrepl.ParseLSN(r.Header("Walbox-Commit-Lsn"))
		idx, _ := strconv.ParseUint(r.Header("Walbox-Txn-Index"), 10, 32)
		if err != nil || lsn == 0 {
			continue // a backfilled event has no WAL position
		}
		pos := cdc.Position{CommitLSN: lsn, Index: uint32(idx)}
		sp := spans[k][r.Partition]
		if sp == nil {
			spans[k][r.Partition] = &span{pos, pos}
			continue
		}
		sp.first, sp.last = minPos(sp.first, pos), maxPos(sp.last, pos)
	}
	for k, byPart := range spans {
		if len(byPart) < 2 {
			continue
		}
		ss := slices.SortedFunc(maps.Values(byPart), func(a, b *span) int {
			switch {
			case a.first.Less(b.first):
				return -1
			case b.first.Less(a.first):
				return 1
			}
			return 0
		})
		for i := 1; i < len(ss); i++ {
			if !ss[i-1].last.Less(ss[i].first) {
				e.t.Fatalf("key %q: its events in two partitions interleave in commit order (%v..%v and %v..%v)", k, ss[i-1].first, ss[i-1].last, ss[i].first, ss[i].last)
			}
		}
	}
	// Marked processed only when stored (what the sweeper marks is
	// evidence read back, DESIGN.md "Evidence").
	stored := map[string]bool{}
	for _, r := range recs {
		stored[r.Header("Walbox-Event-Id")] = true
	}
	marked := queryStrings(ctx, e.t, e.pool, "SELECT id::text FROM outbox_events WHERE processed")
	for _, id := range marked {
		if !stored[id] {
			e.t.Fatalf("row %s is marked processed but its record is not in the topics", id)
		}
	}
	return rep, recs
}

func minPos(a, b cdc.Position) cdc.Position {
	if b.Less(a) {
		return b
	}
	return a
}

func maxPos(a, b cdc.Position) cdc.Position {
	if a.Less(b) {
		return b
	}
	return a
}

func TestKafkaEventsArriveExactlyOnceInKeyOrder(t *testing.T) {
	e := newMigratedKafkaEnv(t)
	w := e.witness("outbox_events")
	e.startRelay()
	res := outboxtest.Load{Producers: 8, MaxRows: 20, Txns: 25, Keys: 16}.Run(context.Background(), e.pool)
	_, recs := e.checkKafka(w, res)
	keyed := 0
	for _, r := range recs {
		if r.Key != nil && strings.HasPrefix(*r.Key, "k") {
			keyed++
		}
	}
	if keyed != len(recs) {
		t.Fatalf("%d of %d records carry the aggregate id as key", keyed, len(recs))
	}
	// The relay's metrics keep their names, with a sink label.
	var published float64
	for _, topic := range kafkaTopics {
		published += e.counter("walbox_published_total", map[string]string{"sink": "kafka", "stream": topic})
	}
	if int(published) != len(recs) {
		t.Fatalf("walbox_published_total{sink=\"kafka\"} = %v, want %d", published, len(recs))
	}
}

func TestKafkaKeylessEventsKeepCommitOrder(t *testing.T) {
	e := newMigratedKafkaEnv(t)
	w := e.witness("outbox_events")
	e.startRelay()
	res := outboxtest.Load{Producers: 4, MaxRows: 10, Txns: 20}.Run(context.Background(), e.pool)
	_, recs := e.checkKafka(w, res)
	for _, r := range recs {
		if r.Partition != 0 {
			t.Fatalf("keyless record in %s/%d: keyless events go to partition 0", r.Topic, r.Partition)
		}
	}
}

// TestKafkaRelayKilledMidStreamLosesNothing kills the relay process twice
// with SIGKILL and once with SIGTERM while producers write: the broker
// keeps what was acked before the kill, the slot was confirmed only up to
// acked events, and the restarted relay's resume check skips what the
// partitions already hold, so nothing is stored twice without Nats-Msg-Id.
func TestKafkaRelayKilledMidStreamLosesNothing(t *testing.T) {
	e := newMigratedKafkaEnv(t)
	w := e.witness("outbox_events")
	stop := e.killMidStream(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 40, Keys: 8}, 0, func() func() {
		before := e.stored()
		// Kill mid-stream: once this relay has stored a few hundred records.
		return func() { e.waitStored(before+300, 60*time.Second) }
	})
	res := stop()
	e.spawnRelay()
	rep, _ := e.checkKafka(w, res)
	t.Logf("events checked after 2x kill -9 and 1x SIGTERM: %d", rep.Checked)
}

// TestKafkaBrokerConnectionLossAndRefusedProducesLoseNothing cuts every
// produce connection (kfake closes it on the request) and then refuses
// produces with NOT_ENOUGH_REPLICAS, each for a stretch of produce
// requests, while producers write.
func TestKafkaBrokerConnectionLossAndRefusedProducesLoseNothing(t *testing.T) {
	e := newMigratedKafkaEnv(t)
	w := e.witness("outbox_events")
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 40, Keys: 8})
	for _, fault := range []string{"connection", "refuse", "connection"} {
		e.waitStored(e.stored()+200, 60*time.Second)
		e.faultProduces(t, fault == "connection", 5)
	}
	e.waitStored(e.stored()+200, 60*time.Second) // publishing resumed
	res := stop()
	e.checkKafka(w, res)
}

// TestKafkaPoisonRowsGoToTheDeadLetterTopic: a row whose topic is not a
// declared topic goes to the dead-letter topic with the reason, and is
// marked processed once stored there, as does a row larger than
// kafka.max_message_bytes (without its payload); the rows around them are
// published in order.
func TestKafkaPoisonRowsGoToTheDeadLetterTopic(t *testing.T) {
	e := newMigratedKafkaEnv(t, func(cfg *config.Config) { cfg.Kafka.MaxMessageBytes = 4096 })
	e.startRelay()
	ctx := context.Background()
	conn := e.conn()
	_, err := conn.Exec(ctx, `INSERT INTO outbox_events (id, topic, payload) VALUES
		('00000000-0000-7000-8000-000000000001', 'orders.created', '{}'),
		('00000000-0000-7000-8000-000000000002', 'nowhere.created', '{}'),
		('00000000-0000-7000-8000-000000000003', 'orders.created', '{}')`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (id, topic, payload) VALUES ('00000000-0000-7000-8000-000000000004', 'orders.created', to_jsonb('not json'::text))`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (id, topic, payload) VALUES ('00000000-0000-7000-8000-000000000005', 'orders.created', jsonb_build_object('pad', repeat('x', 10000)))`); err != nil {
		t.Fatal(err)
	}
	e.waitStored(5, 60*time.Second)
	recs, err := outboxtest.ReadKafkaWithKcat(ctx, strings.Join(e.cfg.Kafka.Brokers, ","), e.cfg.Kafka.DLQTopic, "orders.created")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]outboxtest.KafkaRecord{}
	for _, r := range recs {
		got[r.Header("Walbox-Event-Id")] = r
	}
	if r := got["00000000-0000-7000-8000-000000000002"]; r.Topic != e.cfg.Kafka.DLQTopic || !strings.Contains(r.Header("Walbox-Dlq-Reason"), "nowhere.created") {
		t.Fatalf("the row with an undeclared topic: %+v", r)
	}
	if got["00000000-0000-7000-8000-000000000001"].Topic != "orders.created" || got["00000000-0000-7000-8000-000000000003"].Topic != "orders.created" {
		t.Fatalf("good rows: %+v %+v", got["00000000-0000-7000-8000-000000000001"], got["00000000-0000-7000-8000-000000000003"])
	}
	if got["00000000-0000-7000-8000-000000000003"].Offset <= got["00000000-0000-7000-8000-000000000001"].Offset {
		t.Fatal("good-2 stored before good-1")
	}
	if r := got["00000000-0000-7000-8000-000000000004"]; r.Topic != "orders.created" {
		// jsonb holds a JSON string: valid JSON, published as is.
		t.Fatalf("a JSON string payload: %+v", r)
	}
	if r := got["00000000-0000-7000-8000-000000000005"]; r.Topic != e.cfg.Kafka.DLQTopic || !strings.Contains(r.Header("Walbox-Dlq-Reason"), "exceeds") ||
		r.Header("Walbox-Dlq-Payload-Dropped") == "" {
		t.Fatalf("the row larger than kafka.max_message_bytes: %+v", r)
	}
	e.waitProcessed(t, "00000000-0000-7000-8000-000000000002")
	e.waitProcessed(t, "00000000-0000-7000-8000-000000000005")
	// walbox status counts the dead-letter topic.
	rep, err := ops.Status(ctx, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if rep.DLQ == nil || rep.DLQ.Stream != e.cfg.Kafka.DLQTopic || rep.DLQ.Messages != 2 || rep.DLQ.Error != "" {
		t.Fatalf("status dead letters = %+v, want 2 in %s", rep.DLQ, e.cfg.Kafka.DLQTopic)
	}
}

// waitProcessed waits until the sweeper marked the row (a dead letter is
// marked with its error once the dead-letter topic stored it).
func (e *kafkaEnv) waitProcessed(t *testing.T, id string) {
	t.Helper()
	relaytest.Eventually(t, 30*time.Second, "row "+id+" marked processed", func() bool {
		var processed bool
		err := e.pool.QueryRow(context.Background(), "SELECT processed FROM outbox_events WHERE id = $1", id).Scan(&processed)
		return err == nil && processed
	})
}

func TestKafkaStandbyTakesOverWhenLeaderIsKilled(t *testing.T) {
	e := newMigratedKafkaEnv(t)
	w := e.witness("outbox_events")
	a, b, _, addrB := e.startLeaderAndStandby(30 * time.Second)
	stop := e.loadInBackground(outboxtest.Load{Producers: 3, MaxRows: 10, Rollback: 0.1, Rate: 30, Keys: 8})
	e.waitStored(200, 60*time.Second)
	a.signal(t, syscall.SIGKILL)
	took := relaytest.Eventually(t, 30*time.Second, "the standby leading", func() bool { return leading(addrB) })
	t.Logf("standby took over %v after the leader was killed", took.Round(10*time.Millisecond))
	select {
	case <-b.done:
		t.Fatalf("the standby exited:\n%s", b.output())
	default:
	}
	e.waitStored(e.stored()+100, 60*time.Second) // the standby publishes
	res := stop()
	e.checkKafka(w, res)
}

// faultProduces makes the brokers fail the next n produce requests: cut
// the connection (cut) or answer NOT_ENOUGH_REPLICAS, as a partition with
// too few in-sync replicas does. It returns once n requests were failed.
func (e *kafkaEnv) faultProduces(t *testing.T, cut bool, n int64) {
	t.Helper()
	hits := kafkatest.FailProduces(e.kafka.Cluster, cut, func(failed int64) bool { return failed < n })
	relaytest.Eventually(t, 60*time.Second, fmt.Sprintf("%d produce requests failed by the brokers", n), func() bool { return hits.Load() >= n })
}

// TestRelayProcessRidesOutBrokenBrokerConnections: a broker closing the
// produce connection under walbox makes its next write fail with EPIPE,
// and the kernel raises SIGPIPE. walbox asks for SIGPIPE (to clean up when
// `walbox dev | head` ends), so it gets those too; it must not take them
// for its own output closing and stop. Six rounds of cut produce
// connections (and leader moves) later, the same relay process still
// streams.
func TestRelayProcessRidesOutBrokenBrokerConnections(t *testing.T) {
	e := newMigratedKafkaEnv(t)
	p := e.spawnRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 25, Keys: 16})
	defer stop()
	for i := range 6 {
		e.waitStored(e.stored()+50, 60*time.Second)
		if i%3 == 0 {
			e.kafka.ShufflePartitionLeaders()
		}
		e.faultProduces(t, true, int64(1+i%3))
		select {
		case <-p.done:
			t.Fatalf("the relay process exited after %d connection cuts:\n%s", i+1, p.output())
		default:
		}
	}
	e.waitStored(e.stored()+200, 60*time.Second)
	select {
	case <-p.done:
		t.Fatalf("the relay process exited:\n%s", p.output())
	default:
	}
}
