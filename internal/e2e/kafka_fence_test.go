package e2e

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// Issue 35, item 4: a record produced after its partition failed must not
// overtake the failed one.
//
// Topic orders.created of 2 partitions, partition 0 led by broker 0 and
// partition 1 by broker 1; one key per partition, written alternately, one
// row per transaction. Each round holds broker 1's produce requests for
// 400 ms, so the relay's oldest unacked event (key 1's) is not answered
// while it goes on publishing key 0's, and then broker 0 answers one
// produce with UNKNOWN_SERVER_ERROR. franz-go fails what partition 0
// buffered; the relay hears of it only when the held head of its window is
// answered, and every key-0 record it produced in between goes out fresh
// and can be stored ahead of the failed one ([G E] for one key). Judged
// with kcat (read_committed): 0 lost, 0 duplicated, 0 out of order per key.
func TestKafkaFailedProduceKeepsKeyOrder(t *testing.T) {
	const topic = "orders.created"
	e := newMigratedKafkaEnv(t, func(cfg *config.Config) {
		cfg.NATS.Window = 64
		cfg.Kafka.AckTimeout = 5 * time.Second
		cfg.Retry.Initial, cfg.Retry.Max = 50*time.Millisecond, 200*time.Millisecond
		for i := range cfg.Kafka.Topics {
			if cfg.Kafka.Topics[i].Name == topic {
				cfg.Kafka.Topics[i].Partitions = 2
			}
		}
	})
	w := e.witness("outbox_events")
	keys := keysPerPartition(t, topic, 2)
	e.startRelay()
	e.waitStored(0, 30*time.Second)
	for p := range int32(2) {
		if err := e.kafka.MoveTopicPartition(topic, p, p); err != nil {
			t.Fatalf("move partition %d to broker %d: %v", p, p, err)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 0; ctx.Err() == nil; n++ {
			_ = e.insertRows(ctx, keys[1-n%2], n, 1)
			time.Sleep(2 * time.Millisecond) // pacing: a steady stream of both keys
		}
	}()
	stopLoad := func() { cancel(); wg.Wait() }
	defer stopLoad()
	e.waitStored(100, 60*time.Second)

	const rounds = 6
	slow := e.kafka.LeaderFor(topic, 1)
	t.Logf("partition 0 led by broker %d, partition 1 by broker %d", e.kafka.LeaderFor(topic, 0), slow)
	var held atomic.Int64
	for round := range rounds {
		release := e.holdProduces(slow, &held)
		time.Sleep(100 * time.Millisecond) // fault timing: the head of the window is held
		fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic,
			Partitions: []int32{0}, Err: kerr.UnknownServerError, Count: 1})
		time.Sleep(300 * time.Millisecond) // fault timing: key 0 goes on behind the failure
		release()
		// The next produce to partition 0 fails: during the hold where the
		// relay goes on producing, else right after it.
		relaytest.Eventually(t, 10*time.Second, fmt.Sprintf("round %d: a produce to partition 0 refused", round), func() bool { return fault.Hits() == 1 })
		fault.Remove()
		t.Logf("round %d: %d produce requests to broker %d held so far", round, held.Load(), slow)
		time.Sleep(500 * time.Millisecond) // pacing: the relay resends and settles
	}
	stopLoad()
	e.checkKafka(w, nil)
}

// Issue 35, item 8: a leader paused past its leader lock must not store
// anything once a standby took over.
//
// Leader A and standby B as processes. Under load, broker answers to
// produce requests are held for 300 ms, so A has records in flight and
// more buffered behind them; A is stopped (SIGSTOP) in that state, the
// brokers answer the held requests, and A's PostgreSQL sessions (its
// leader lock and its walsender) are terminated, as their timeouts would.
// B takes over and publishes; then A is continued (SIGCONT): the records it
// buffered reach the brokers after B's newer events of the same keys. They
// must not be stored: 0 lost, 0 duplicated, 0 out of order per key (kcat,
// read_committed).
func TestKafkaPausedLeaderIsFenced(t *testing.T) {
	e := newMigratedKafkaEnv(t, func(cfg *config.Config) {
		cfg.Kafka.AckTimeout = 5 * time.Second
	})
	w := e.witness("outbox_events")
	a, b, _, addrB := e.startLeaderAndStandby(30 * time.Second)
	defer func() {
		_ = a.cmd.Process.Signal(syscall.SIGCONT)
		if t.Failed() {
			t.Logf("A's output:\n%s\nB's output:\n%s", a.output(), b.output())
		}
	}()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 5, Rate: 60, Keys: 8})
	e.waitStored(200, 60*time.Second)

	var held atomic.Int64
	release := e.holdProduces(-1, &held)
	time.Sleep(300 * time.Millisecond) // fault timing: A's records pile up behind held requests
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	release()
	t.Logf("A stopped with %d produce requests held; terminating its PostgreSQL sessions", held.Load())
	e.endLeaderSessions(relaytest.Ctx(t))
	took := relaytest.Eventually(t, 30*time.Second, "B leading", func() bool { return leading(addrB) })
	t.Logf("B took over %v after A was stopped", took.Round(10*time.Millisecond))
	e.waitStored(e.stored()+150, 60*time.Second) // B publishes newer events of the same keys
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // pacing: A wakes and sends what it buffered
	res := stop()
	select {
	case <-b.done:
		t.Fatalf("B exited:\n%s", b.output())
	default:
	}
	rep, _ := e.checkKafka(w, res)
	t.Logf("after A woke: %s", fmt.Sprint(rep))
}

// holdProduces holds every produce request that reaches broker node (-1:
// any) in the broker, counting them in held, until release is called;
// then they are answered as usual.
func (e *kafkaEnv) holdProduces(node int32, held *atomic.Int64) (release func()) {
	ch := make(chan struct{})
	e.kafka.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.KeepControl()
		select {
		case <-ch:
			e.kafka.DropControl()
			return nil, nil, false
		default:
		}
		if node < 0 || e.kafka.CurrentNode() == node {
			held.Add(1)
			e.kafka.SleepControl(func() { <-ch })
		}
		return nil, nil, false
	})
	return func() { close(ch) }
}

// endLeaderSessions terminates the leader relay's PostgreSQL sessions, as
// their timeouts would for a paused process: the one holding the slot's
// leader lock (an advisory lock) and the walsender holding the slot.
func (e *env) endLeaderSessions(ctx context.Context) {
	e.t.Helper()
	if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()`); err != nil {
		e.t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE active`); err != nil {
		e.t.Fatal(err)
	}
}
