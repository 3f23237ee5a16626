package e2e

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/outboxtest"
)

func TestR3StreamLeaderLossMidLoadLosesNothing(t *testing.T) {
	// Now and then (about 1 run in 7 on a loaded 2-core machine) the two
	// remaining nodes elect no new ORDERS leader at all, for minutes: a
	// NATS raft stall that no client can end, and nothing to judge the
	// relay by. Such a run is reported and the scenario run again on a
	// fresh cluster; two stalls in a row fail the test.
	for attempt := 1; attempt <= 2; attempt++ {
		if !leaderLossScenario(t) {
			return
		}
		t.Logf("attempt %d: the ORDERS stream had no leader 30 s after the loss (NATS raft stall); running the scenario again on a fresh cluster", attempt)
	}
	t.Fatal("the ORDERS stream elected no leader after the loss, twice in a row (NATS raft stall)")
}

// leaderLossScenario stops the ORDERS leader mid-load and checks every
// event arrives once, in order. It reports stalled (and checks nothing)
// when the cluster elects no new leader within 30 s.
func leaderLossScenario(t *testing.T) (stalled bool) {
	cl := natstest.NewCluster(t, 3)
	e := newEnv(t, func(c *config.Config) {
		c.NATS.URL = cl.URLs()
		for i := range c.NATS.Streams {
			c.NATS.Streams[i].Replicas = 3
		}
	})
	nc, err := nats.Connect(cl.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if e.js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	e.migrate()
	w := e.witness("outbox_events")
	relay := e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 3, MaxRows: 10, Rollback: 0.1, Rate: 30})
	time.Sleep(2 * time.Second)
	leader := cl.StreamLeader("", "ORDERS")
	if leader < 0 {
		t.Fatal("no leader for ORDERS")
	}
	cl.Servers[leader].Stop()
	t.Logf("stopped node %d, the ORDERS stream leader, mid-load", leader)
	time.Sleep(4 * time.Second)
	start := time.Now()
	for cl.StreamLeader("", "ORDERS") < 0 && time.Since(start) < 30*time.Second {
		time.Sleep(100 * time.Millisecond)
	}
	if cl.StreamLeader("", "ORDERS") < 0 {
		stop()
		relay.stop(t)
		return true
	}
	t.Logf("new ORDERS leader: node %d", cl.StreamLeader("", "ORDERS"))
	if err := cl.Servers[leader].Restart(); err != nil {
		t.Fatal(err)
	}
	res := stop()
	e.check(w, res)
	return false
}
