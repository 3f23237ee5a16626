package console

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
)

// historySpan is how far back the Overview's chart reaches.
const historySpan = time.Hour

// Sampling costs the relay's process a status read (connections to the
// database and the bus), so it samples every interval only while someone
// looks at the Overview (watchedFor after its last read), else every
// idleEvery: the chart still covers the last hour, more coarsely.
const (
	watchedFor = 30 * time.Second
	idleEvery  = time.Minute
)

// Sample is one point of the Overview's chart: what walbox status showed
// at T (the relay's own figures, from walbox.relay_status, and the slot's).
type Sample struct {
	T               time.Time `json:"t"`
	LagSeconds      float64   `json:"lag_seconds"` // commit -> ack of the oldest unacked event
	EventsPerSecond float64   `json:"events_per_second"`
	RetainedBytes   int64     `json:"retained_bytes"`
	Unprocessed     int64     `json:"unprocessed"`
	// CommitToAck is the mean and the 99th percentile (a bucket's bound) of
	// walbox_commit_to_ack_seconds over the events acked since the sample
	// before; -1 when none was, or no relay runs in this process.
	CommitToAckMean float64 `json:"commit_to_ack_mean_seconds"`
	CommitToAckP99  float64 `json:"commit_to_ack_p99_seconds"`
}

// sampler reads the Overview (walbox status without the read-back of the
// streams) every interval and keeps the last hour of it in a ring: the
// console computes no figure of its own.
type sampler struct {
	cfg    config.Config
	every  time.Duration
	relay  prometheus.Gatherer // the relay's metrics; nil without one
	before histogram

	mu      sync.Mutex
	ring    []Sample // oldest at next once full
	next    int
	full    bool
	last    *ops.StatusReport
	lastErr string
	lastAt  time.Time
	kick    chan struct{}
	// watched is when the Overview was last read (unix ns).
	watched atomic.Int64
}

func newSampler(cfg config.Config, every time.Duration, relay prometheus.Gatherer) *sampler {
	n := max(int(historySpan/every), 2)
	return &sampler{cfg: cfg, every: every, relay: relay, ring: make([]Sample, n), kick: make(chan struct{}, 1)}
}

// run samples until ctx ends.
func (s *sampler) run(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-s.kick:
		}
		s.sample(ctx)
		wait := s.every
		if time.Since(time.Unix(0, s.watched.Load())) > watchedFor {
			wait = max(s.every, idleEvery)
		}
		t.Reset(wait)
	}
}

// look records a read of the Overview; when the last sample is older than
// the interval (the sampler was idle), it samples now.
func (s *sampler) look() {
	s.watched.Store(time.Now().UnixNano())
	s.mu.Lock()
	stale := time.Since(s.lastAt) > s.every
	s.mu.Unlock()
	if stale {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

func (s *sampler) sample(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, max(s.every, 5*time.Second))
	defer cancel()
	rep, err := ops.Overview(ctx, s.cfg)
	now := time.Now()
	mean, p99 := -1.0, -1.0
	if h, ok := readHistogram(s.relay, commitToAckMetric); ok {
		if m, p, ok := h.since(s.before); ok {
			mean, p99 = m, p
		}
		s.before = h
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastAt = now
	if err != nil {
		s.lastErr = "read the status: " + err.Error()
		return
	}
	s.last, s.lastErr = rep, ""
	pt := Sample{T: now, LagSeconds: rep.Relay.LagSeconds, EventsPerSecond: rep.Relay.EventsPerSecond,
		RetainedBytes: rep.SlotStatus.RetainedBytes, Unprocessed: rep.Outbox.Unprocessed,
		CommitToAckMean: mean, CommitToAckP99: p99}
	if rep.Relay.State != "running" {
		// No relay writes its figures: none is delivering.
		pt.LagSeconds, pt.EventsPerSecond = 0, 0
	}
	s.ring[s.next] = pt
	s.next = (s.next + 1) % len(s.ring)
	if s.next == 0 {
		s.full = true
	}
}

// snapshot is the last report, its error and the samples, oldest first.
func (s *sampler) snapshot() (*ops.StatusReport, string, time.Time, []Sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var pts []Sample
	if s.full {
		pts = append(pts, s.ring[s.next:]...)
	}
	pts = append(pts, s.ring[:s.next]...)
	// Idle sampling is slower: the ring may reach back further.
	from := time.Now().Add(-historySpan)
	for len(pts) > 0 && pts[0].T.Before(from) {
		pts = pts[1:]
	}
	return s.last, s.lastErr, s.lastAt, pts
}
