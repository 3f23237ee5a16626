package relay

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/walbox/walbox/internal/metrics"
)

// Metrics are the relay's Prometheus series. They are registered on the
// registry passed to NewMetrics (no global registry), never carry payloads.
type Metrics struct {
	Published     *prometheus.CounterVec
	PublishErrors *prometheus.CounterVec
	DeadLettered  *prometheus.CounterVec
	InFlight      prometheus.Gauge
	CommitToAck   prometheus.Histogram
	PublishToAck  prometheus.Histogram
	CommitToSent  prometheus.Histogram
	SentToAck     prometheus.Histogram
	ConfirmedLSN  prometheus.Gauge
	Backoffs      prometheus.Counter
	Skipped       prometheus.Counter
	SkippedBy     *prometheus.CounterVec
	LostHistory   *prometheus.GaugeVec
	IDCollisions  *prometheus.CounterVec
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

// splitBuckets are finer than the other latency histograms' (a factor of
// 1.5 from 0.2 ms to 38 s) so that a quantile read from them places a tail
// within a quarter of its value.
func splitBuckets() []float64 { return prometheus.ExponentialBuckets(0.0002, 1.5, 30) }

// NewMetrics creates the relay metrics and registers them on reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	f := metrics.On(reg)
	return &Metrics{
		Published:     f.CounterVec("walbox_published_total", "Events acknowledged by the sink, by stream (topic) and outbox table.", "stream", "table"),
		PublishErrors: f.CounterVec("walbox_publish_errors_total", "Failed publishes, by class (transient, permanent).", "class"),
		DeadLettered:  f.CounterVec("walbox_dead_lettered_total", "Events sent to the dead-letter stream, by outbox table.", "table"),
		InFlight:      f.Gauge("walbox_inflight", "Published events waiting for their JetStream ack."),
		CommitToAck:   f.Histogram("walbox_commit_to_ack_seconds", "Time from the transaction's COMMIT to the JetStream ack.", prometheus.ExponentialBuckets(0.0005, 2, 18)),
		PublishToAck:  f.Histogram("walbox_publish_latency_seconds", "Time from publish to JetStream ack.", prometheus.ExponentialBuckets(0.0001, 2, 18)),
		// The two halves of commit → ack, so that a slow event can be
		// placed: before PostgreSQL sent it (its walsender, WAL flush, the
		// server's CPU) or after (walbox, the network, JetStream).
		CommitToSent:    f.Histogram("walbox_commit_to_sent_seconds", "Time from the transaction's COMMIT to PostgreSQL sending the event to walbox (both on the server's clock): PostgreSQL's part of commit to ack.", splitBuckets()),
		SentToAck:       f.Histogram("walbox_sent_to_ack_seconds", "Time from PostgreSQL sending the event (server clock) to its JetStream ack (walbox's clock): walbox's and JetStream's part of commit to ack.", splitBuckets()),
		ConfirmedLSN:    f.Gauge("walbox_confirmed_lsn", "The LSN walbox has confirmed to the slot, as a number."),
		Backoffs:        f.Counter("walbox_publish_backoffs_total", "Times the publisher stopped and backed off after a transient error."),
		Skipped:         f.Counter("walbox_resume_skipped_total", "Events not republished because the stream already held them (resume check)."),
		SkippedBy:       f.CounterVec("walbox_resume_skipped_by_proof_total", "Events the resume check did not republish, by the evidence used: the event's id read back from its stream or partition, or its position before the read-back tail of its own ordered unit in the same, not rewound, WAL history.", "proof"),
		IDCollisions:    f.CounterVec("walbox_id_collisions_total", "Events the stream dropped as duplicates of another event with the same id (another outbox table or database), published again under a qualified Nats-Msg-Id, by stream.", "stream"),
		LostHistory:     f.GaugeVec("walbox_resume_lost_history_events", "Events of this source in a stream's read-back tail whose WAL positions the database has not reached: published from a history the database no longer has (a restore from a snapshot). Non-zero after a restore until newer events push them out of the tail.", "stream"),
		OtherWriters:    f.CounterVec("walbox_strict_order_other_writer_total", "Times strict order found another writer in a stream and stopped guarding its order, by stream.", "stream"),
		SlotLost:        f.CounterVec("walbox_slot_lost_total", "Times the replication slot was found lost, by reason: missing (dropped) or invalidated (wal_status lost).", "reason"),
		Leader:          f.Gauge("walbox_leader", "1 while this relay holds the leader lock and streams, 0 while standby."),
		SlotLagBytes:    f.Gauge("walbox_slot_lag_bytes", "WAL not yet confirmed by walbox (current LSN - confirmed_flush_lsn)."),
		SlotLagSeconds:  f.Gauge("walbox_slot_lag_seconds", "Age of the oldest committed event not yet acked by JetStream (0 when caught up)."),
		SlotRetainedWAL: f.Gauge("walbox_slot_retained_wal_bytes", "WAL the slot keeps on disk (current LSN - restart_lsn)."),
		SlotSafeWALSize: f.Gauge("walbox_slot_safe_wal_size_bytes", "WAL that may still be written before the slot risks invalidation (-1: unlimited)."),
		SlotWALStatus:   f.GaugeVec("walbox_slot_wal_status", "1 for the slot's current wal_status (reserved, extended, unreserved, lost, missing).", "status"),
		SlotActive:      f.Gauge("walbox_slot_active", "1 while a walsender streams from the slot."),
		ReplicationLagS: f.Gauge("walbox_replication_lag_seconds", "The walsender's replay lag for walbox's connection."),
		Reconnects:      f.CounterVec("walbox_reconnects_total", "Reconnections, by side (postgres, nats).", "side"),
	}
}
