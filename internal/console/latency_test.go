package console

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestCommitToAckSampleIsTheIntervalsMeanAndP99(t *testing.T) {
	reg := prometheus.NewRegistry()
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: commitToAckMetric, Buckets: []float64{0.001, 0.01, 0.1, 1}})
	reg.MustRegister(h)
	h.Observe(0.5) // before the interval
	before, ok := readHistogram(reg, commitToAckMetric)
	if !ok {
		t.Fatal("histogram not found")
	}
	if _, _, ok := before.since(before); ok {
		t.Error("an interval without events has a figure")
	}
	for range 99 {
		h.Observe(0.0005)
	}
	h.Observe(0.05)
	after, _ := readHistogram(reg, commitToAckMetric)
	mean, p99, ok := after.since(before)
	if !ok || p99 != 0.001 || mean < 0.0009 || mean > 0.0011 {
		t.Errorf("mean %v p99 %v ok %v; want about 1 ms, p99 bucket 1 ms", mean, p99, ok)
	}
	if _, ok := readHistogram(prometheus.NewRegistry(), commitToAckMetric); ok {
		t.Error("found a histogram in an empty registry")
	}
}
