package retry

import (
	"testing"
	"time"
)

func TestBackoffDoublesWithJitterUpToMaxAndNeverStops(t *testing.T) {
	bo := Backoff(100*time.Millisecond, time.Second)
	want := []time.Duration{100, 200, 400, 800, 1000, 1000, 1000}
	for i, w := range want {
		w *= time.Millisecond
		got := bo.NextBackOff()
		lo, hi := time.Duration(float64(w)*(1-Jitter)), time.Duration(float64(w)*(1+Jitter))
		if got < lo || got > hi {
			t.Fatalf("attempt %d: %v, want %v ± 20%%", i+1, got, w)
		}
	}
	bo.Reset()
	if got := bo.NextBackOff(); got > 120*time.Millisecond {
		t.Fatalf("after Reset: %v, want about 100ms", got)
	}
}

func TestDefaultsFillInOneRuleEverywhere(t *testing.T) {
	for _, c := range []struct{ in, max, wantIn, wantMax time.Duration }{
		{0, 0, DefaultInitial, DefaultMax},
		{100 * time.Millisecond, 0, 100 * time.Millisecond, DefaultMax},
		{0, 5 * time.Second, DefaultInitial, 5 * time.Second},
		{2 * time.Minute, 0, 2 * time.Minute, 2 * time.Minute},
		{time.Second, 500 * time.Millisecond, time.Second, time.Second},
	} {
		if in, max := Defaults(c.in, c.max); in != c.wantIn || max != c.wantMax {
			t.Errorf("Defaults(%v, %v) = %v, %v; want %v, %v", c.in, c.max, in, max, c.wantIn, c.wantMax)
		}
	}
}
