package main

import (
	"math"
	"os"
	"testing"
	"time"
)

func TestHistogramQuantileInterpolatesWithinABucket(t *testing.T) {
	// Buckets ≤1 ms: 50, ≤2 ms: 90, ≤4 ms: 100 (cumulative).
	before := histSnapshot{upper: []float64{0.001, 0.002, 0.004}, count: []uint64{10, 10, 10}, total: 10}
	after := histSnapshot{upper: []float64{0.001, 0.002, 0.004}, count: []uint64{60, 100, 110}, total: 110}
	d := after.since(before)
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{
		{0.25, 500 * time.Microsecond}, // rank 25 of 50 in [0, 1 ms]
		{0.50, time.Millisecond},       // the first bucket's bound
		{0.70, 1500 * time.Microsecond},
		{0.99, 3800 * time.Microsecond}, // rank 99: 9 of 10 in [2, 4 ms]
	} {
		if got := d.quantile(c.q); got != c.want {
			t.Errorf("quantile(%v) = %v, want %v", c.q, got, c.want)
		}
	}
	if got := (histSnapshot{}).quantile(0.99); got != 0 {
		t.Errorf("empty histogram: quantile %v, want 0", got)
	}
	// Past the last finite bucket (only +Inf above it): its bound.
	over := histSnapshot{upper: []float64{0.001, math.Inf(1)}, count: []uint64{1, 3}, total: 3}
	if got := over.quantile(0.99); got != time.Millisecond {
		t.Errorf("beyond the last bucket: %v, want 1ms", got)
	}
}

func TestRelayFloorAddsTheCheapestReaderAndAckedPublisher(t *testing.T) {
	decoders := []ceilingResult{{Events: 100, ClientCPU: 500 * time.Microsecond}, {Events: 100, ClientCPU: 200 * time.Microsecond}}
	pubs := []pubFloorResult{
		{Mode: pubWalbox, Msgs: 100, CPU: 600 * time.Microsecond},
		{Mode: pubNATS, Msgs: 100, CPU: 900 * time.Microsecond},
		{Mode: pubNoAck, Msgs: 100, CPU: 250 * time.Microsecond},
		{Mode: pubIDOnly, Msgs: 100, CPU: 400 * time.Microsecond}, // not the relay's headers: never the floor
	}
	got := relayFloorString(pubs, decoders, 800*time.Microsecond, 100)
	want := "2.0 + 6.0 (walbox) = 8.0 µs/event = 1.00× (walsender 8.0 µs/event); with no acks at all: 2.0 + 2.5 = 4.5 µs/event = 0.56×"
	if got != want {
		t.Fatalf("floor\n%s\nwant\n%s", got, want)
	}
	if got := relayFloorString(pubs[2:], decoders, 800*time.Microsecond, 100); got != "n/a" {
		t.Fatalf("without an acked publisher: %s, want n/a", got)
	}
	if got, want := headerCostString(pubs, 800*time.Microsecond, 100), "6.0 − 4.0 = 2.0 µs = 0.25× (walsender 8.0 µs/event)"; got != want {
		t.Fatalf("header cost\n%s\nwant\n%s", got, want)
	}
	if got := headerCostString(pubs[:3], 800*time.Microsecond, 100); got != "n/a" {
		t.Fatalf("without the one-header publisher: %s, want n/a", got)
	}
}

func TestWakeupsPerEventAndCPUPerWakeup(t *testing.T) {
	got := wakeupString(300*time.Microsecond, 200*time.Microsecond, 6, 2, 3)
	if want := "2.00 / 0.67; 50.0 / 100.0 µs"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	if got := wakeupString(time.Millisecond, time.Millisecond, 0, 2, 3); got != "n/a" {
		t.Fatalf("no wake-ups counted: %q, want n/a", got)
	}
	// This process's threads have blocked at least once: the counter reads.
	time.Sleep(time.Millisecond)
	if w, err := procWakeups(os.Getpid()); err != nil || w == 0 {
		t.Fatalf("procWakeups(self) = %d, %v", w, err)
	}
	if w := wakeupsSince(os.Getpid(), 1<<62); w != 0 {
		t.Fatalf("a counter below its start reads %d, want 0", w)
	}
}
