package e2e

import (
	"context"
	"math/rand/v2"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/outboxtest"
)

// TestChaos runs producers, the relay as a real process, and random faults:
// kill -9 and restart of the relay, NATS stop and start, PostgreSQL fast
// restart, and the slot dropped under the relay. At the end the one checker
// must report zero lost, duplicated, out-of-order and rolled-back events.
// WALBOX_CHAOS_DURATION sets how long (default 30s; `make chaos` runs 3m).
func TestChaos(t *testing.T) {
	duration := chaosDuration(t)
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	relay := e.spawnRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 25})

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	faults := map[string]int{}
	ctx := context.Background()
	start := time.Now()
	for time.Since(start) < duration {
		time.Sleep(time.Duration(1500+rng.IntN(2500)) * time.Millisecond) // fault timing: random gap between faults
		kind := []string{"relay_kill9", "nats_restart", "postgres_restart", "slot_drop"}[rng.IntN(4)]
		t.Logf("%s fault: %s", time.Now().UTC().Format("15:04:05.000"), kind)
		switch kind {
		case "relay_kill9":
			relay.signal(t, syscall.SIGKILL)
			relay = e.spawnRelay()
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
		relay = e.spawnRelay()
	default:
	}
	rep := e.check(w, res)
	t.Logf("chaos: %v, events checked %d, rolled-back inserts %d, faults %v; lost=%d duplicated=%d out_of_order=%d from_rolled_back=%d; republished from snapshots %d (%d of them out of commit order)",
		duration, rep.Checked, len(res.RolledBack), faults, rep.Lost, rep.Duplicated, rep.OutOfOrder, rep.FromRolledBack, rep.Snapshot, rep.SnapshotOutOfOrder)
}

// TestChaosKafka is TestChaos against the Kafka sink (kfake): kill -9 and
// restart of the relay, produce connections cut, produces refused
// (NOT_ENOUGH_REPLICAS), partition leaders moved to other brokers,
// PostgreSQL fast restart, and the slot dropped under the relay. kcat reads
// the topics back; zero lost, duplicated (Kafka has no Nats-Msg-Id: the
// resume check alone keeps them out), out of order per partition.
func TestChaosKafka(t *testing.T) {
	duration := chaosDuration(t)
	e := newMigratedKafkaEnv(t)
	w := e.witness("outbox_events")
	relay := e.spawnRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 25, Keys: 16})

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	faults := map[string]int{}
	ctx := context.Background()
	start := time.Now()
	for time.Since(start) < duration {
		// Faults are paced, not waited for: the pause between them is the
		// chaos's own randomness.
		time.Sleep(time.Duration(1500+rng.IntN(2500)) * time.Millisecond)
		kind := []string{"relay_kill9", "produce_cut", "produce_refused", "leader_move", "postgres_restart", "slot_drop"}[rng.IntN(6)]
		t.Logf("%s fault: %s", time.Now().UTC().Format("15:04:05.000"), kind)
		switch kind {
		case "relay_kill9":
			relay.signal(t, syscall.SIGKILL)
			relay = e.spawnRelay()
		case "produce_cut", "produce_refused":
			e.faultProduces(t, kind == "produce_cut", int64(1+rng.IntN(8)))
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
		}
		faults[kind]++
	}
	res := stop()
	select {
	case <-relay.done:
		relay = e.spawnRelay()
	default:
	}
	rep, _ := e.checkKafka(w, res)
	t.Logf("kafka chaos: %v, events checked %d, rolled-back inserts %d, faults %v; lost=%d duplicated=%d out_of_order=%d from_rolled_back=%d; republished from snapshots %d (%d of them out of commit order)",
		duration, rep.Checked, len(res.RolledBack), faults, rep.Lost, rep.Duplicated, rep.OutOfOrder, rep.FromRolledBack, rep.Snapshot, rep.SnapshotOutOfOrder)
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
