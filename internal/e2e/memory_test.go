package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
)

// slowProxy forwards TCP connections from a loopback port to target,
// passing at most rate bytes per second in each direction: a slow NATS.
// It stops with the test.
func slowProxy(t *testing.T, target string, rate int) string {
	t.Helper()
	return "nats://" + relaytest.Proxy(t, target, relaytest.Throttled(rate))
}

// samplePeak reads gauge name from the metrics at addr every interval until
// the returned func is called; that returns the highest value read (0: none).
func samplePeak(addr, name string, every time.Duration) (stop func() float64) {
	var peak float64
	done, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if v, ok := metric(addr, name); ok && v > peak {
				peak = v
			}
			select {
			case <-done:
				return
			case <-time.After(every):
			}
		}
	}()
	return func() float64 {
		close(done)
		<-sampled
		return peak
	}
}

// TestLargeRowsWithSlowNATSStayWithinTheByteBudget: 80 rows of 512 KiB
// (40 MiB) wait, and NATS takes 8 MiB/s. The relay's heap must stay within
// nats.window_bytes (8 MiB here) plus a constant; with the window bounded
// by count alone (1,024 events) it held the whole backlog.
func TestLargeRowsWithSlowNATSStayWithinTheByteBudget(t *testing.T) {
	const rows, budget = 80, 8 << 20
	addr := freeAddr(t)
	e := newEnv(t, func(c *config.Config) {
		c.Metrics.Listen = addr
		c.NATS.WindowBytes = budget
	})
	e.cfg.NATS.URL = slowProxy(t, e.nats.URL()[len("nats://"):], 8<<20)
	e.migrate()
	p := e.spawnRelay()
	peakHeap := samplePeak(addr, "go_memstats_heap_inuse_bytes", 20*time.Millisecond)
	if _, err := e.pool.Exec(context.Background(), fmt.Sprintf(`INSERT INTO outbox_events (topic, payload)
		SELECT 'orders.big', jsonb_build_object('n', g, 'pad', repeat('x', 512 * 1024)) FROM generate_series(1, %d) g`, rows)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	e.waitDelivered(rows, 2*time.Minute)
	peak := peakHeap()
	t.Logf("%d rows of 512 KiB through an 8 MiB/s link in %v; relay heap in use peaked at %.1f MB with window_bytes %d MiB; peak RSS %.1f MB",
		rows, time.Since(start).Round(time.Millisecond), peak/1e6, budget>>20, float64(vmHWM(p.cmd.Process.Pid))/1e6)
	if peak == 0 {
		t.Fatal("could not sample the relay's heap")
	}
	// The budget, plus one row over each of its three stages, plus the
	// relay's own ~15 MB: far below the 40 MiB backlog plus that.
	if limit := float64(budget + 3*(512<<10) + 20e6); peak > limit {
		t.Fatalf("relay heap peaked at %.1f MB, over the budget's bound of %.1f MB", peak/1e6, limit/1e6)
	}
}
