package e2e

import (
	"bufio"
	"context"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
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

// TestChaos runs producers, the relay as a real process, and random faults:
// kill -9 and restart of the relay, NATS stop and start, PostgreSQL fast
// restart, and the slot dropped under the relay. At the end the one checker
// must report zero lost, duplicated, out-of-order and rolled-back events.
// WALBOX_CHAOS_DURATION sets how long (default 30s; `make chaos` runs 3m).
func TestChaos(t *testing.T) {
	duration := chaosDuration(t)
	addr := freeAddr(t)
	e := newMigratedEnv(t, func(c *config.Config) { c.Metrics.Listen = addr })
	w := e.witness("outbox_events")
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	// Each relay after the first batches every event, or only once 32 are
	// in flight (the default), or publishes each transaction as one atomic
	// batch (nats.atomic_transactions), drawn at random: batches cut by
	// every fault, and the switch between the paths under them. The counts
	// of the relays killed are read just before each kill.
	var batched, unproven, atomic float64
	spawned := 0
	spawn := func() *proc {
		// The first relay batches every event, so that a short run (make
		// test's) cannot draw only relays that never batch.
		env := [][]string{{"WALBOX_NATS_FAST_BATCH_AFTER=0"}, {"WALBOX_NATS_FAST_BATCH_AFTER=32"},
			{"WALBOX_NATS_ATOMIC_TRANSACTIONS=true"}}[rng.IntN(3)]
		if spawned == 0 {
			env = []string{"WALBOX_NATS_FAST_BATCH_AFTER=0"}
		}
		if v := os.Getenv("CHAOS_NATS_PATH"); v != "" { // one path for every relay, e.g. CHAOS_NATS_PATH=WALBOX_NATS_ATOMIC_TRANSACTIONS=true (no WALBOX_ prefix: the relay refuses unknown WALBOX_ variables)
			env = []string{v}
		}
		spawned++
		t.Logf("relay %d: %v", spawned, env)
		p := e.startProc(env...)
		e.waitSlotActive(p)
		return p
	}
	count := func() {
		batched += sumMetric(addr, "walbox_nats_batched_messages_total")
		unproven += sumMetric(addr, "walbox_nats_batch_unproven_total")
		atomic += sumMetric(addr, "walbox_nats_atomic_messages_total")
	}
	relay := spawn()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 25})

	faults := map[string]int{}
	ctx := context.Background()
	start := time.Now()
	for time.Since(start) < duration {
		time.Sleep(time.Duration(1500+rng.IntN(2500)) * time.Millisecond) // fault timing: random gap between faults
		kind := []string{"relay_kill9", "nats_restart", "postgres_restart", "slot_drop"}[rng.IntN(4)]
		t.Logf("%s fault: %s", time.Now().UTC().Format("15:04:05.000"), kind)
		switch kind {
		case "relay_kill9":
			count()
			relay.signal(t, syscall.SIGKILL)
			relay = spawn()
			faults[kind]++
		case "nats_restart":
			e.nats.Stop()
			time.Sleep(time.Duration(500+rng.IntN(3000)) * time.Millisecond) // fault timing: random outage length
			if err := e.nats.Restart(); err != nil {
				t.Fatal(err)
			}
			faults[kind]++
		case "postgres_restart":
			if err := s.pg.Restart(ctx); err != nil {
				t.Fatal(err)
			}
			faults[kind]++
		case "slot_drop":
			for i := 0; i < 50; i++ {
				_, _ = e.pool.Exec(ctx, "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'walbox' AND active")
				if _, err := e.pool.Exec(ctx, "SELECT pg_drop_replication_slot('walbox')"); err == nil {
					faults[kind]++
					break
				} else if !strings.Contains(err.Error(), "active") && !strings.Contains(err.Error(), "does not exist") {
					t.Fatal(err)
				}
			}
		}
	}
	res := stop()
	select {
	case <-relay.done:
		relay = spawn()
	default:
	}
	rep := e.check(w, res)
	count()
	t.Logf("chaos: %v, events checked %d, rolled-back inserts %d, faults %v; lost=%d duplicated=%d out_of_order=%d from_rolled_back=%d; republished from snapshots %d (%d of them out of commit order); %.0f publishes in fast batches, %.0f of them unproven and resent alone, %.0f in atomic batches",
		duration, rep.Checked, len(res.RolledBack), faults, rep.Lost, rep.Duplicated, rep.OutOfOrder, rep.FromRolledBack, rep.Snapshot, rep.SnapshotOutOfOrder, batched, unproven, atomic)
	if batched == 0 && atomic == 0 {
		t.Fatal("no event went in a fast or atomic batch: the chaos run did not test them")
	}
}

// sumMetric sums every series of a metric on /metrics at addr (0 when it
// cannot be read).
func sumMetric(addr, name string) float64 {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+" ") && !strings.HasPrefix(line, name+"{") {
			continue
		}
		if i := strings.LastIndexByte(line, ' '); i > 0 {
			if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
				sum += v
			}
		}
	}
	return sum
}

// TestChaosKafka is TestChaos against the Kafka sink (kfake, three brokers,
// each topic's 12 partitions spread over them, keys over all 12), with a
// leader and a standby relay as processes and faults drawn at random: kill
// -9 of the leader, the leader paused (SIGSTOP) until the standby took over
// and then continued (SIGCONT), produce connections cut, produces refused
// broker-wide (NOT_ENOUGH_REPLICAS), one partition refusing writes for more
// than three ack timeouts while the others store, a batch refused as too
// large, partition leaders moved to other brokers mid-batch, PostgreSQL
// fast restart, the slot dropped under the relay, and once a topic's
// partition count raised (walbox then publishes nothing to the new count
// and both relays are restarted, as README's procedure says). kcat reads
// the topics back: zero lost, duplicated, out of order per key (across the
// raised topic's partitions too), and no row marked processed whose record
// is not stored.
func TestChaosKafka(t *testing.T) {
	duration := chaosDuration(t)
	const ackTimeout = 2 * time.Second
	e := newMigratedKafkaEnv(t, func(cfg *config.Config) {
		cfg.Kafka.AckTimeout = ackTimeout
		cfg.Retry.Initial, cfg.Retry.Max = 100*time.Millisecond, time.Second
		for i := range cfg.Kafka.Topics {
			cfg.Kafka.Topics[i].Partitions = 12
		}
	})
	w := e.witness("outbox_events")
	rp := startRelayPair(e)
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 25, Keys: 48})

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	faults := map[string]int{}
	moved := map[string]bool{}
	ctx := context.Background()
	start := time.Now()
	kinds := []string{"relay_kill9", "leader_paused", "produce_cut", "produce_refused", "partition_refused", "batch_too_large",
		"leader_move", "postgres_restart", "slot_drop", "partitions_raised"}
	for time.Since(start) < duration {
		// Faults are paced, not waited for: the pause between them is the
		// chaos's own randomness.
		time.Sleep(time.Duration(1500+rng.IntN(2500)) * time.Millisecond)
		kind := kinds[rng.IntN(len(kinds))]
		if kind == "partitions_raised" && len(moved) > 0 {
			kind = "leader_move" // once a run
		}
		t.Logf("%s fault: %s", time.Now().UTC().Format("15:04:05.000"), kind)
		switch kind {
		case "relay_kill9":
			rp.killLeader(t)
		case "leader_paused":
			rp.pauseLeader(t, ctx)
		case "produce_cut", "produce_refused":
			e.faultProduces(t, kind == "produce_cut", int64(1+rng.IntN(8)))
		case "partition_refused":
			// Longer than three ack timeouts, one partition of one topic,
			// while the other partitions store.
			topic, part := kafkaTopics[rng.IntN(len(kafkaTopics))], int32(rng.IntN(12))
			f := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{part},
				Err: kerr.NotEnoughReplicas, Count: -1})
			time.Sleep(3*ackTimeout + 500*time.Millisecond) // fault timing: the outage's length
			f.Remove()
			t.Logf("partition %s/%d refused %d produce requests", topic, part, f.Hits())
		case "batch_too_large":
			f := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaTopics[rng.IntN(len(kafkaTopics))],
				Err: kerr.MessageTooLarge, Count: 1})
			relaytest.Eventually(t, 30*time.Second, "a batch refused as too large", func() bool { return f.Hits() == 1 })
		case "leader_move":
			e.kafka.ShufflePartitionLeaders()
		case "postgres_restart":
			if err := s.pg.Restart(ctx); err != nil {
				t.Fatal(err)
			}
		case "slot_drop":
			for i := 0; i < 50; i++ {
				_, _ = e.pool.Exec(ctx, "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'walbox' AND active")
				if _, err := e.pool.Exec(ctx, "SELECT pg_drop_replication_slot('walbox')"); err == nil {
					break
				} else if !strings.Contains(err.Error(), "active") && !strings.Contains(err.Error(), "does not exist") {
					t.Fatal(err)
				}
			}
		case "partitions_raised":
			topic := kafkaTopics[rng.IntN(len(kafkaTopics))]
			if _, err := e.kafka.Admin.CreatePartitions(ctx, 4, topic); err != nil {
				t.Fatal(err)
			}
			moved[topic] = true
			// Until the relays restart, they hash keys over the count they
			// recorded (or, once their client sees the new one, publish
			// nothing to the topic): README's procedure restarts them.
			time.Sleep(time.Second) // fault timing: the relays run on with the old count
			rp.restartBoth(t)
		}
		faults[kind]++
	}
	res := stop()
	rp.ensureLeader(t)
	rep, _ := e.checkKafkaMoved(w, res, moved)
	t.Logf("kafka chaos: %v, events checked %d, rolled-back inserts %d, faults %v; lost=%d duplicated=%d out_of_order=%d from_rolled_back=%d; republished from snapshots %d (%d of them out of commit order)",
		duration, rep.Checked, len(res.RolledBack), faults, rep.Lost, rep.Duplicated, rep.OutOfOrder, rep.FromRolledBack, rep.Snapshot, rep.SnapshotOutOfOrder)
}

// relayPair is a leader and a standby relay process, each with a metrics
// address of its own (its /leader says which leads).
type relayPair struct {
	e     *kafkaEnv
	procs [2]*proc
	addrs [2]string
}

func startRelayPair(e *kafkaEnv) *relayPair {
	rp := &relayPair{e: e}
	rp.procs[0], rp.procs[1], rp.addrs[0], rp.addrs[1] = e.startLeaderAndStandby(30 * time.Second)
	return rp
}

// leader is the index of the relay that leads, waiting for one to.
func (rp *relayPair) leader(t *testing.T) int {
	t.Helper()
	i := -1
	relaytest.Eventually(t, 60*time.Second, "a relay leading", func() bool {
		for j, a := range rp.addrs {
			if rp.procs[j].running() && leading(a) {
				i = j
				return true
			}
		}
		return false
	})
	return i
}

func (rp *relayPair) start(j int) {
	rp.procs[j] = rp.e.startProc("WALBOX_METRICS_LISTEN=" + rp.addrs[j])
}

// killLeader kills the leader with SIGKILL and starts it again: it waits
// as the standby while the other takes over.
func (rp *relayPair) killLeader(t *testing.T) {
	j := rp.leader(t)
	rp.procs[j].signal(t, syscall.SIGKILL)
	rp.start(j)
}

// pauseLeader stops the leader (SIGSTOP) and ends its PostgreSQL sessions,
// as their timeouts would, waits for the standby to lead, and continues the
// old one (SIGCONT): whatever it had buffered reaches the brokers after
// the new leader's records, and must be fenced.
func (rp *relayPair) pauseLeader(t *testing.T, ctx context.Context) {
	j := rp.leader(t)
	p := rp.procs[j]
	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = p.cmd.Process.Signal(syscall.SIGCONT) }()
	rp.e.endLeaderSessions(ctx)
	other := 1 - j
	if !rp.procs[other].running() {
		rp.start(other)
	}
	relaytest.Eventually(t, 60*time.Second, "the standby to take over from the paused leader", func() bool { return leading(rp.addrs[other]) })
	time.Sleep(time.Second) // fault timing: the new leader publishes before the old one wakes
}

// restartBoth stops both relays cleanly and starts them again: they record
// the topics' partition counts anew.
func (rp *relayPair) restartBoth(t *testing.T) {
	for j := range rp.procs {
		if rp.procs[j].running() {
			rp.procs[j].signal(t, syscall.SIGTERM)
		}
	}
	rp.start(0)
	rp.e.waitSlotActive(rp.procs[0])
	rp.start(1)
}

// ensureLeader makes sure a relay leads (a standby takes over when needed).
func (rp *relayPair) ensureLeader(t *testing.T) {
	for j := range rp.procs {
		if !rp.procs[j].running() {
			rp.start(j)
		}
	}
	rp.leader(t)
}

// chaosDuration is WALBOX_CHAOS_DURATION, 30 s by default (make chaos: 3m).
func chaosDuration(t *testing.T) time.Duration {
	v := os.Getenv("WALBOX_CHAOS_DURATION")
	if v == "" {
		return 30 * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("WALBOX_CHAOS_DURATION: %v", err)
	}
	return d
}
