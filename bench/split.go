package main

import (
	"context"
	"fmt"
	"math"
	"net"
	"net/http"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// The relay splits commit → ack at PostgreSQL's send time (the XLogData
// send timestamp): these two histograms, read from its /metrics before and
// after a live rate, say which side a slow event was slow on.
const (
	histCommitToSent = "walbox_commit_to_sent_seconds"
	histSentToAck    = "walbox_sent_to_ack_seconds"
)

// splitLatency is commit → ack cut at the server's send time, over one
// live rate, from the relay's histograms (quantiles interpolated within a
// bucket, as Prometheus' histogram_quantile does).
type splitLatency struct {
	Events             uint64
	SentP50, SentP99   time.Duration // commit → PostgreSQL sent it
	AfterP50, AfterP99 time.Duration // sent → JetStream ack
}

// histSnapshot is a histogram's cumulative bucket counts.
type histSnapshot struct {
	upper []float64
	count []uint64
	total uint64
}

// freeLocalAddr returns a loopback address nothing listens on now.
func freeLocalAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port for the relay's metrics: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// relayHistograms reads the split histograms from the relay's /metrics.
func relayHistograms(ctx context.Context, addr string) (map[string]histSnapshot, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("read the relay's metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("read the relay's metrics: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("parse the relay's metrics: %w", err)
	}
	out := map[string]histSnapshot{}
	for _, name := range []string{histCommitToSent, histSentToAck} {
		f := fams[name]
		if f == nil || len(f.GetMetric()) != 1 || f.GetMetric()[0].GetHistogram() == nil {
			return nil, fmt.Errorf("the relay's metrics have no histogram %s", name)
		}
		out[name] = snapshotOf(f.GetMetric()[0].GetHistogram())
	}
	return out, nil
}

func snapshotOf(h *dto.Histogram) histSnapshot {
	s := histSnapshot{total: h.GetSampleCount()}
	for _, b := range h.GetBucket() {
		s.upper = append(s.upper, b.GetUpperBound())
		s.count = append(s.count, b.GetCumulativeCount())
	}
	return s
}

// since is the histogram of the observations made after before.
func (s histSnapshot) since(before histSnapshot) histSnapshot {
	d := histSnapshot{upper: s.upper, total: s.total - before.total, count: make([]uint64, len(s.count))}
	for i := range s.count {
		d.count[i] = s.count[i]
		if i < len(before.count) {
			d.count[i] -= before.count[i]
		}
	}
	return d
}

// quantile interpolates linearly within the bucket that holds rank q, from
// 0 for the first bucket; past the last bucket it is that bucket's bound.
func (s histSnapshot) quantile(q float64) time.Duration {
	if s.total == 0 {
		return 0
	}
	rank := q * float64(s.total)
	lower, below := 0.0, uint64(0)
	for i, c := range s.count {
		if float64(c) >= rank {
			if math.IsInf(s.upper[i], 1) {
				break
			}
			in := float64(c - below)
			frac := 1.0
			if in > 0 {
				frac = (rank - float64(below)) / in
			}
			return time.Duration((lower + (s.upper[i]-lower)*frac) * float64(time.Second))
		}
		lower, below = s.upper[i], c
	}
	return time.Duration(lower * float64(time.Second))
}

// split reads the two halves of commit → ack between two scrapes.
func split(before, after map[string]histSnapshot) splitLatency {
	sent := after[histCommitToSent].since(before[histCommitToSent])
	rest := after[histSentToAck].since(before[histSentToAck])
	return splitLatency{
		Events:  sent.total,
		SentP50: sent.quantile(0.50), SentP99: sent.quantile(0.99),
		AfterP50: rest.quantile(0.50), AfterP99: rest.quantile(0.99),
	}
}

// msRound formats a bucket-interpolated latency: it is no finer than that.
func msRound(d time.Duration) string {
	v := float64(d) / float64(time.Millisecond)
	if v >= 10 {
		return fmt.Sprintf("%.0f ms", math.Round(v))
	}
	return fmt.Sprintf("%.1f ms", v)
}
