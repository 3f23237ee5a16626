package relay

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the relay's Prometheus series. They are registered on the
// registry passed to NewMetrics (no global registry), never carry payloads.
type Metrics struct {
	Published     *prometheus.CounterVec
	PublishErrors *prometheus.CounterVec
	DeadLettered  prometheus.Counter
	InFlight      prometheus.Gauge
	CommitToAck   prometheus.Histogram
	PublishToAck  prometheus.Histogram
	ConfirmedLSN  prometheus.Gauge
	Backoffs      prometheus.Counter
	Skipped       prometheus.Counter
	SlotLost      prometheus.Counter
	Leader        prometheus.Gauge
}

// NewMetrics creates the relay metrics and registers them on reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_published_total", Help: "Events acknowledged by JetStream, by stream.",
		}, []string{"stream"}),
		PublishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_publish_errors_total", Help: "Failed publishes, by class (transient, permanent).",
		}, []string{"class"}),
		DeadLettered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_dead_lettered_total", Help: "Events sent to the dead-letter stream.",
		}),
		InFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_inflight", Help: "Published events waiting for their JetStream ack.",
		}),
		CommitToAck: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "walbox_commit_to_ack_seconds", Help: "Time from the transaction's COMMIT to the JetStream ack.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}),
		PublishToAck: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "walbox_publish_latency_seconds", Help: "Time from publish to JetStream ack.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}),
		ConfirmedLSN: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_confirmed_lsn", Help: "The LSN walbox has confirmed to the slot, as a number.",
		}),
		Backoffs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_publish_backoffs_total", Help: "Times the publisher stopped and backed off after a transient error.",
		}),
		Skipped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_resume_skipped_total", Help: "Events not republished because the stream already held them (resume check).",
		}),
		SlotLost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_slot_lost_total", Help: "Times the replication slot was found dropped or invalidated.",
		}),
		Leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_leader", Help: "1 while this relay holds the leader lock and streams, 0 while standby.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.Published, m.PublishErrors, m.DeadLettered, m.InFlight, m.CommitToAck, m.PublishToAck, m.ConfirmedLSN, m.Backoffs, m.Skipped, m.SlotLost, m.Leader)
	}
	return m
}
