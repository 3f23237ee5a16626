package relay

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the relay's Prometheus series. They are registered on the
// registry passed to NewMetrics (no global registry), never carry payloads.
type Metrics struct {
	Published     *prometheus.CounterVec
	PublishErrors *prometheus.CounterVec
	DeadLettered  *prometheus.CounterVec
	InFlight      prometheus.Gauge
	CommitToAck   prometheus.Histogram
	PublishToAck  prometheus.Histogram
	ConfirmedLSN  prometheus.Gauge
	Backoffs      prometheus.Counter
	Skipped       prometheus.Counter
	OtherWriters  *prometheus.CounterVec
	SlotLost      *prometheus.CounterVec
	Leader        prometheus.Gauge

	SlotLagBytes    prometheus.Gauge
	SlotLagSeconds  prometheus.Gauge
	SlotRetainedWAL prometheus.Gauge
	SlotSafeWALSize prometheus.Gauge
	SlotWALStatus   *prometheus.GaugeVec
	SlotActive      prometheus.Gauge
	ReplicationLagS prometheus.Gauge
	Reconnects      *prometheus.CounterVec
}

// NewMetrics creates the relay metrics and registers them on reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_published_total", Help: "Events acknowledged by the sink, by stream (topic) and outbox table.",
		}, []string{"stream", "table"}),
		PublishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_publish_errors_total", Help: "Failed publishes, by class (transient, permanent).",
		}, []string{"class"}),
		DeadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_dead_lettered_total", Help: "Events sent to the dead-letter stream, by outbox table.",
		}, []string{"table"}),
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
		OtherWriters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_strict_order_other_writer_total",
			Help: "Times strict order found another writer in a stream and stopped guarding its order, by stream.",
		}, []string{"stream"}),
		SlotLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_slot_lost_total", Help: "Times the replication slot was found lost, by reason: missing (dropped) or invalidated (wal_status lost).",
		}, []string{"reason"}),
		Leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_leader", Help: "1 while this relay holds the leader lock and streams, 0 while standby.",
		}),
		SlotLagBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_slot_lag_bytes", Help: "WAL not yet confirmed by walbox (current LSN - confirmed_flush_lsn).",
		}),
		SlotLagSeconds: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_slot_lag_seconds", Help: "Age of the oldest committed event not yet acked by JetStream (0 when caught up).",
		}),
		SlotRetainedWAL: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_slot_retained_wal_bytes", Help: "WAL the slot keeps on disk (current LSN - restart_lsn).",
		}),
		SlotSafeWALSize: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_slot_safe_wal_size_bytes", Help: "WAL that may still be written before the slot risks invalidation (-1: unlimited).",
		}),
		SlotWALStatus: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "walbox_slot_wal_status", Help: "1 for the slot's current wal_status (reserved, extended, unreserved, lost, missing).",
		}, []string{"status"}),
		SlotActive: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_slot_active", Help: "1 while a walsender streams from the slot.",
		}),
		ReplicationLagS: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_replication_lag_seconds", Help: "The walsender's replay lag for walbox's connection.",
		}),
		Reconnects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_reconnects_total", Help: "Reconnections, by side (postgres, nats).",
		}, []string{"side"}),
	}
	if reg != nil {
		reg.MustRegister(m.Published, m.PublishErrors, m.DeadLettered, m.InFlight, m.CommitToAck, m.PublishToAck, m.ConfirmedLSN, m.Backoffs, m.Skipped, m.OtherWriters, m.SlotLost, m.Leader,
			m.SlotLagBytes, m.SlotLagSeconds, m.SlotRetainedWAL, m.SlotSafeWALSize, m.SlotWALStatus, m.SlotActive, m.ReplicationLagS, m.Reconnects)
	}
	return m
}
