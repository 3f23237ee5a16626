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
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 3, MaxRows: 10, Rollback: 0.1, Rate: 30})
	time.Sleep(2 * time.Second)
	leader := cl.StreamLeader("", "ORDERS")
	if leader < 0 {
		t.Fatal("no leader for ORDERS")
	}
	cl.Servers[leader].Stop()
	t.Logf("stopped node %d, the ORDERS stream leader, mid-load", leader)
	time.Sleep(4 * time.Second)
	if err := cl.Servers[leader].Restart(); err != nil {
		t.Fatal(err)
	}
	res := stop()
	e.check(w, res)
}
