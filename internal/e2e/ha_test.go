package e2e

import (
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

func ready(addr string) bool {
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// startLeaderAndStandby starts relay A, waits until it streams from the
// slot, then starts relay B, each with a metrics address of its own, and
// waits until exactly one is ready: A, the leader; B says standby.
func (e *env) startLeaderAndStandby(readyWithin time.Duration) (a, b *proc, addrA, addrB string) {
	e.t.Helper()
	addrA, addrB = freeAddr(e.t), freeAddr(e.t)
	a = e.startProc("WALBOX_METRICS_LISTEN=" + addrA)
	e.waitSlotActive(a)
	b = e.startProc("WALBOX_METRICS_LISTEN=" + addrB)
	relaytest.Eventually(e.t, readyWithin, "A ready (leader) and B not (standby)", func() bool {
		return ready(addrA) && !ready(addrB)
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
	relaytest.Eventually(t, 30*time.Second, "the standby to take over", func() bool { return ready(addrB) })
	t.Logf("standby took over %v after the leader was killed", time.Since(killed).Round(10*time.Millisecond))
	time.Sleep(time.Second) // pacing: load goes on against the new leader
	res := stop()
	e.check(w, res)
}
