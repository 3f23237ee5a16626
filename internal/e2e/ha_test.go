package e2e

import (
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/outboxtest"
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
	e := newEnv(t)
	e.migrate()
	w := e.witness("outbox_events")
	addrA, addrB := freeAddr(t), freeAddr(t)
	a := e.startProc("WALBOX_METRICS_LISTEN=" + addrA)
	e.waitSlotActive(a)
	b := e.startProc("WALBOX_METRICS_LISTEN=" + addrB)
	// Exactly one is ready: the leader. The other says standby.
	deadline := time.Now().Add(20 * time.Second)
	for !(ready(addrA) && !ready(addrB)) {
		if time.Now().After(deadline) {
			t.Fatalf("want A ready (leader) and B not (standby): A=%v B=%v", ready(addrA), ready(addrB))
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop := e.loadInBackground(outboxtest.Load{Producers: 3, MaxRows: 10, Rollback: 0.1, Rate: 30})
	time.Sleep(1500 * time.Millisecond)
	a.signal(t, syscall.SIGKILL)
	killed := time.Now()
	for !ready(addrB) {
		if time.Since(killed) > 30*time.Second {
			t.Fatalf("standby did not take over within 30s\n%s", b.output())
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("standby took over %v after the leader was killed", time.Since(killed).Round(10*time.Millisecond))
	time.Sleep(time.Second)
	res := stop()
	e.check(w, res)
}
