package e2e

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
)

// probeBody is a probe's status code and first line (0 when unreachable).
func probeBody(addr, path string) (int, string) {
	resp, err := http.Get("http://" + addr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// healthy reports whether /healthz answers 200.
func healthy(addr string) bool { return probe(addr, "/healthz") }

// probedRelay is app.Run in process with a metrics address, started
// without waiting for it to stream (a standby never does).
type probedRelay struct {
	addr   string
	cancel context.CancelFunc
	done   chan error
}

func startProbed(t *testing.T, cfg config.Config, addr string, onDelivered func(relay.Delivered)) *probedRelay {
	t.Helper()
	cfg.Metrics.Listen = addr
	ctx, cancel := context.WithCancel(context.Background())
	p := &probedRelay{addr: addr, cancel: cancel, done: make(chan error, 1)}
	log := zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel).With().Str("relay", addr).Logger()
	go func() { p.done <- app.Run(ctx, cfg, log, app.Options{OnDelivered: onDelivered}) }()
	t.Cleanup(func() { p.stop(t) })
	return p
}

func (p *probedRelay) stop(t *testing.T) {
	t.Helper()
	if p.cancel == nil {
		return
	}
	p.cancel()
	p.cancel = nil
	select {
	case err := <-p.done:
		if err != nil {
			t.Errorf("relay %s: %v", p.addr, err)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("relay %s did not stop within 30s", p.addr)
	}
}

// holdSlotAsAnother streams from walbox's slot on a replication connection
// of the test's, as another process that took the slot would; closing it
// frees the slot.
func holdSlotAsAnother(t *testing.T, ctx context.Context, cfg config.Config) *pgconn.PgConn {
	t.Helper()
	pc, err := pgconn.ParseConfig(cfg.Postgres.URL)
	if err != nil {
		t.Fatal(err)
	}
	pc.RuntimeParams["replication"] = "database"
	var conn *pgconn.PgConn
	// The relay that held the slot a moment ago may not have let go of it.
	relaytest.Eventually(t, 30*time.Second, "the test to hold the slot", func() bool {
		c, err := pgconn.ConnectConfig(ctx, pc)
		if err != nil {
			return false
		}
		if err := pglogrepl.StartReplication(ctx, c, cfg.Postgres.Slot, 0, pglogrepl.StartReplicationOptions{
			PluginArgs: []string{"proto_version '1'", "publication_names '" + cfg.Postgres.Publication + "'"}}); err != nil {
			c.Close(ctx)
			return false
		}
		conn = c
		return true
	})
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// TestProbesFollowReplicationAndLivenessOnlyAWedge: what the probes say
// (docs/kubernetes.md, Probes) through what a cluster does to a pair of
// relays. /readyz: ready on the streaming leader and on a healthy standby
// (/leader tells them apart), not ready on either while PostgreSQL is down,
// ready again after it is back; not ready while another process holds the
// slot, ready once it lets go. /healthz: 200 through all of that, however
// long each outage lasts; 503 only while the main loop is stuck (blocked
// in the OnDelivered hook, which must not block), 200 again after.
func TestProbesFollowReplicationAndLivenessOnlyAWedge(t *testing.T) {
	ctx := relaytest.Ctx(t)
	cl := pgtest.StartOwn(ctx, t)
	const liveness = 4 * time.Second
	e := envOn(t, cl, "probes", func(c *config.Config) {
		c.Metrics.LivenessTimeout = liveness
		c.Retry.Max = time.Second
	})
	addrs := []string{freeAddr(t), freeAddr(t)}

	// The stall: OnDelivered blocks while stall holds a channel.
	var stall atomic.Pointer[chan struct{}]
	onDelivered := func(relay.Delivered) {
		if ch := stall.Load(); ch != nil {
			<-*ch
		}
	}

	// /healthz is watched every 100 ms from start to the stall: any answer
	// but 200 is a liveness probe that would have restarted a pod that was
	// not wedged.
	var watching atomic.Bool
	watching.Store(true)
	var mu sync.Mutex
	var unhealthy []string
	watchDone := make(chan struct{})
	go func() {
		defer close(watchDone)
		for watching.Load() {
			for _, a := range addrs {
				code, body := probeBody(a, "/healthz")
				// 0: the relay is between a stop and a start, no listener.
				if code != 0 && code != http.StatusOK && watching.Load() {
					mu.Lock()
					unhealthy = append(unhealthy, a+": "+body)
					mu.Unlock()
				}
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	stopWatching := func() {
		watching.Store(false)
		<-watchDone
		mu.Lock()
		defer mu.Unlock()
		if len(unhealthy) > 0 {
			t.Errorf("/healthz failed %d times without a wedge, first: %s", len(unhealthy), unhealthy[0])
		}
	}
	defer func() {
		if watching.Load() {
			stopWatching()
		}
	}()

	a := startProbed(t, e.cfg, addrs[0], onDelivered)
	relaytest.Eventually(t, 30*time.Second, "A leading", func() bool { return leading(addrs[0]) })
	b := startProbed(t, e.cfg, addrs[1], onDelivered)
	relaytest.Eventually(t, 30*time.Second, "B a ready standby", func() bool {
		code, body := probeBody(addrs[1], "/readyz")
		return code == http.StatusOK && strings.HasPrefix(body, "standby") && !leading(addrs[1])
	})
	if !ready(addrs[0]) || !leading(addrs[0]) {
		t.Fatal("A stopped leading when B started")
	}

	// PostgreSQL down, for longer than the liveness timeout.
	if err := cl.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 20*time.Second, "neither ready while PostgreSQL is down", func() bool {
		return !ready(addrs[0]) && !ready(addrs[1])
	})
	for end := time.Now().Add(2 * liveness); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if ready(addrs[0]) || ready(addrs[1]) {
			t.Fatal("a relay ready while PostgreSQL is down")
		}
	}
	code, body := probeBody(addrs[0], "/readyz")
	t.Logf("while PostgreSQL is down, A's /readyz: %d %s", code, body)
	if err := cl.StartAgain(ctx); err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 60*time.Second, "one leading and the other a ready standby after PostgreSQL is back", func() bool {
		la, lb := leading(addrs[0]), leading(addrs[1])
		return la != lb && ready(addrs[0]) && ready(addrs[1])
	})

	// The slot held by another process: the relay takes the leader lock
	// but cannot stream.
	a.stop(t)
	b.stop(t)
	held := holdSlotAsAnother(t, ctx, e.cfg)
	a = startProbed(t, e.cfg, addrs[0], onDelivered)
	relaytest.Eventually(t, 30*time.Second, "A not ready: the slot is held by another", func() bool {
		code, body := probeBody(addrs[0], "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "no replication connection")
	})
	for end := time.Now().Add(2 * liveness); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if ready(addrs[0]) {
			t.Fatal("A ready while another process holds the slot")
		}
	}
	held.Close(ctx)
	relaytest.Eventually(t, 60*time.Second, "A leading once the slot is free", func() bool { return leading(addrs[0]) })
	stopWatching()

	// The wedge: the publisher loop blocks in OnDelivered.
	gate := make(chan struct{})
	stall.Store(&gate)
	relaytest.Exec(t, e.dbURL, "INSERT INTO outbox_events (topic, payload) VALUES ('orders.created', '{}')")
	took := relaytest.Eventually(t, liveness+10*time.Second, "/healthz failing while the main loop is stuck", func() bool {
		code, body := probeBody(addrs[0], "/healthz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "wedged")
	})
	t.Logf("/healthz failed %v after the stall began (liveness timeout %v)", took.Round(100*time.Millisecond), liveness)
	if took < liveness-time.Second {
		t.Fatalf("/healthz failed %v into the stall, before the liveness timeout %v", took, liveness)
	}
	stall.Store(nil)
	close(gate)
	relaytest.Eventually(t, 10*time.Second, "/healthz healthy again once the loop turns", func() bool {
		return healthy(addrs[0]) && leading(addrs[0])
	})
}
