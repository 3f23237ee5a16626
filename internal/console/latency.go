package console

import (
	"math"

	"github.com/prometheus/client_golang/prometheus"
)

// commitToAckMetric is the relay's commit -> ack histogram.
const commitToAckMetric = "walbox_commit_to_ack_seconds"

// histogram is a cumulative histogram read from the relay's metrics.
type histogram struct {
	count  uint64
	sum    float64
	bounds []float64 // upper bounds, ascending
	counts []uint64  // cumulative, per bound
}

// readHistogram sums name's series in g (one per sink label).
func readHistogram(g prometheus.Gatherer, name string) (histogram, bool) {
	var h histogram
	if g == nil {
		return h, false
	}
	mfs, err := g.Gather()
	if err != nil {
		return h, false
	}
	found := false
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			ph := m.GetHistogram()
			if ph == nil {
				continue
			}
			found = true
			h.count += ph.GetSampleCount()
			h.sum += ph.GetSampleSum()
			for i, b := range ph.GetBucket() {
				if i >= len(h.bounds) {
					h.bounds = append(h.bounds, b.GetUpperBound())
					h.counts = append(h.counts, 0)
				}
				h.counts[i] += b.GetCumulativeCount()
			}
		}
	}
	return h, found
}

// since is what h observed after prev: the mean and the 99th percentile
// (the upper bound of its bucket) of the observations between the two
// reads; ok false when there were none.
func (h histogram) since(prev histogram) (mean, p99 float64, ok bool) {
	n := h.count - prev.count
	if h.count < prev.count || n == 0 {
		return 0, 0, false // none, or the relay restarted its counters
	}
	mean = (h.sum - prev.sum) / float64(n)
	want := uint64(math.Ceil(0.99 * float64(n)))
	p99 = mean
	for i := range h.counts {
		var before uint64
		if i < len(prev.counts) {
			before = prev.counts[i]
		}
		if h.counts[i]-before >= want {
			p99 = h.bounds[i]
			break
		}
	}
	return mean, p99, true
}
