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

func TestStandbyTakesOverWhenLeaderIsKilled(t *testing.T) {
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	addrA, addrB := freeAddr(t), freeAddr(t)
	a := e.startProc("WALBOX_METRICS_LISTEN=" + addrA)
	e.waitSlotActive(a)
	b := e.startProc("WALBOX_METRICS_LISTEN=" + addrB)
	// Exactly one is ready: the leader. The other says standby.
	relaytest.Eventually(t, 20*time.Second, "A ready (leader) and B not (standby)", func() bool {
		return ready(addrA) && !ready(addrB)
	})
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
