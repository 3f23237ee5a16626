package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

func TestR3StreamLeaderLossMidLoadLosesNothing(t *testing.T) {
	cl := natstest.NewCluster(t, 3)
	e := r3Env(t, cl.URLs())
	w := e.witness("outbox_events")
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 3, MaxRows: 10, Rollback: 0.1, Rate: 30})
	time.Sleep(2 * time.Second) // pacing: the fault lands mid-load
	leader := cl.StreamLeader("", "ORDERS")
	if leader < 0 {
		t.Fatal("no leader for ORDERS")
	}
	cl.Servers[leader].Stop()
	t.Logf("stopped node %d, the ORDERS stream leader, mid-load", leader)
	time.Sleep(4 * time.Second) // fault timing: the outage lasts while the load goes on
	if err := cl.Servers[leader].Restart(); err != nil {
		t.Fatal(err)
	}
	res := stop()
	e.check(w, res)
}

// TestR3NATSProcessesLeaderKillAndRollingRestart runs the fault as users meet
// it, with three nats-server processes: the stream leader is killed mid-load
// and started again, then every node is restarted in turn while the load
// goes on. Nothing may be lost, duplicated or reordered, the stream must be
// healthy afterwards, and the whole load delivered within 30 s of the last
// node's return. The relay batches once 4 publishes are in flight
// (nats.fast_batch_after: 4), so that the load's multi-row transactions
// go in fast batches and the rest per message: batches cut by a killed
// leader, a gap, a batch the new leader does not know, pings, the unproven
// resent alone, and the switch between the two paths, in one run.
func TestR3NATSProcessesLeaderKillAndRollingRestart(t *testing.T) {
	testR3ProcessFaults(t, func(c *config.Config) { c.NATS.FastBatch, c.NATS.FastBatchAfter = true, 4 }, func(e *env, committed int) {
		batches := e.counter("walbox_nats_batches_total", nil)
		batched := e.counter("walbox_nats_batched_messages_total", nil)
		t.Logf("fast batches: %.0f, %.0f messages batched, %.0f unproven and resent alone", batches, batched,
			e.counter("walbox_nats_batch_unproven_total", nil))
		if batched == 0 || batched >= float64(committed) {
			t.Fatalf("%.0f of %d events went in fast batches: want both paths used", batched, committed)
		}
	})
}

// TestR3NATSProcessesAtomicTransactionsThroughLeaderKillAndRollingRestart:
// the same faults with every transaction published as one atomic batch
// (nats.atomic_transactions): batches staged on a leader that is killed
// before their commit, commits refused by a new leader, and the per-message
// resend of refused ones.
func TestR3NATSProcessesAtomicTransactionsThroughLeaderKillAndRollingRestart(t *testing.T) {
	testR3ProcessFaults(t, func(c *config.Config) { c.NATS.AtomicTransactions = true }, func(e *env, committed int) {
		atomic := e.counter("walbox_nats_atomic_messages_total", nil)
		t.Logf("atomic batches: %.0f, %.0f messages in them, %.0f refused, %.0f split", e.counter("walbox_nats_atomic_batches_total", nil),
			atomic, e.counter("walbox_nats_atomic_refused_total", nil), e.counter("walbox_nats_atomic_splits_total", nil))
		if atomic == 0 {
			t.Fatalf("no event of %d went in an atomic batch", committed)
		}
	})
}

// testR3ProcessFaults runs the faults with the config mutated, then paths
// checks which publish paths the relay took.
func testR3ProcessFaults(t *testing.T, mutate func(*config.Config), paths func(e *env, committed int)) {
	cl := natstest.NewProcCluster(t, 3)
	e := r3Env(t, cl.URLs(), func(c *config.Config) { c.NATS.AckTimeout = 2 * time.Second }, mutate)
	w := e.witness("outbox_events")
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 10, Rollback: 0.1, Rate: 50})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	time.Sleep(2 * time.Second) // pacing: the fault lands mid-load
	leader := streamLeader(ctx, t, e.js, "ORDERS")
	node := cl.Node(leader)
	node.Kill()
	t.Logf("killed %s, the ORDERS stream leader, mid-load", leader)
	time.Sleep(4 * time.Second) // fault timing: the node stays dead while the load goes on
	if err := node.Start(); err != nil {
		t.Fatal(err)
	}
	if err := node.WaitHealthy(ctx); err != nil {
		t.Fatal(err)
	}
	for _, n := range cl.Nodes {
		n.Stop()
		t.Logf("rolling restart: %s stopped", n.Name)
		time.Sleep(time.Second) // fault timing: each node stays down a second
		if err := n.Start(); err != nil {
			t.Fatal(err)
		}
		if err := n.WaitHealthy(ctx); err != nil {
			t.Fatal(err)
		}
		t.Logf("rolling restart: %s back and current", n.Name)
	}
	lastBack := time.Now()
	time.Sleep(time.Second) // the load goes on past the last return
	res := stop()

	conn := e.conn()
	committed, err := w.Committed(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	e.waitDelivered(len(committed), time.Until(lastBack.Add(30*time.Second)))
	t.Logf("%d events delivered %.1f s after the last node's return", len(committed), time.Since(lastBack).Seconds())
	e.check(w, res)

	// Healthy afterwards: every replica current, and the stream stores.
	_, info := e.stream(ctx, "ORDERS")
	for _, r := range info.Cluster.Replicas {
		if !r.Current || r.Offline {
			t.Fatalf("replica %s of ORDERS not current after the restarts: %+v", r.Name, r)
		}
	}
	if _, err := e.js.Publish(ctx, "orders.probe", []byte(`{}`)); err != nil {
		t.Fatalf("ORDERS does not store after the restarts: %v", err)
	}
	paths(e, len(committed))
}

func streamLeader(ctx context.Context, t *testing.T, js jetstream.JetStream, stream string) string {
	t.Helper()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		t.Fatalf("no leader for %s", stream)
	}
	return info.Cluster.Leader
}

// r3Env is a migrated env whose streams are R3 on the cluster at urls, with
// the test's own JetStream client on that cluster.
func r3Env(t *testing.T, urls string, mutate ...func(*config.Config)) *env {
	t.Helper()
	e := newEnv(t, append([]func(*config.Config){func(c *config.Config) {
		c.NATS.URL = urls
		for i := range c.NATS.Streams {
			c.NATS.Streams[i].Replicas = 3
		}
	}}, mutate...)...)
	_, e.js = relaytest.JetStream(t, urls, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	e.migrate()
	return e
}
