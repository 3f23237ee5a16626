package e2e

import (
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// ready reports whether the relay at addr answers /readyz with 200: the
// leader streaming, or a healthy standby.
func ready(addr string) bool { return probe(addr, "/readyz") }

// leading reports whether the relay at addr answers /leader with 200: it
// holds the leader lock, streams and reaches the sink.
func leading(addr string) bool { return probe(addr, "/leader") }

func probe(addr, path string) bool {
	resp, err := http.Get("http://" + addr + path)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// startLeaderAndStandby starts relay A, waits until it streams from the
// slot, then starts relay B, each with a metrics address of its own, and
// waits until exactly one leads: A; B is ready as a healthy standby.
func (e *env) startLeaderAndStandby(readyWithin time.Duration) (a, b *proc, addrA, addrB string) {
	e.t.Helper()
	addrA, addrB = freeAddr(e.t), freeAddr(e.t)
	a = e.startProc("WALBOX_METRICS_LISTEN=" + addrA)
	e.waitSlotActive(a)
	b = e.startProc("WALBOX_METRICS_LISTEN=" + addrB)
	relaytest.Eventually(e.t, readyWithin, "A leading, B a ready standby", func() bool {
		return leading(addrA) && ready(addrA) && !leading(addrB) && ready(addrB)
	})
	return a, b, addrA, addrB
}

func TestStandbyTakesOverWhenLeaderIsKilled(t *testing.T) {
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	a, b, _, addrB := e.startLeaderAndStandby(20 * time.Second)
	stop := e.loadInBackground(outboxtest.Load{Producers: 3, MaxRows: 10, Rollback: 0.1, Rate: 30})
	time.Sleep(1500 * time.Millisecond) // pacing: the leader dies mid-load
	a.signal(t, syscall.SIGKILL)
	killed := time.Now()
	defer func() {
		if t.Failed() {
			t.Logf("standby output:\n%s", b.output())
		}
	}()
	relaytest.Eventually(t, 30*time.Second, "the standby to take over", func() bool { return leading(addrB) })
	t.Logf("standby took over %v after the leader was killed", time.Since(killed).Round(10*time.Millisecond))
	time.Sleep(time.Second) // pacing: load goes on against the new leader
	res := stop()
	e.check(w, res)
}
