package sweep

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/walbox/walbox/internal/metrics"
)

// Metrics are the sweeper's Prometheus series, registered on the registry
// passed to New (none when it is nil).
type Metrics struct {
	Unprocessed       prometheus.Gauge
	OldestUnprocessed prometheus.Gauge
	Marked            prometheus.Counter
	Dropped           prometheus.Counter
	Deferred          prometheus.Counter
	Unseen            prometheus.Counter
	Queue             prometheus.Gauge
	Archived          prometheus.Counter
	Exported          prometheus.Counter
	RowsExported      prometheus.Counter
	Blocked           prometheus.Gauge
	MaintainFailures  *prometheus.CounterVec
	Postponed         *prometheus.CounterVec
	PartitionsAhead   prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) *Metrics {
	f := metrics.On(reg)
	return &Metrics{
		Unprocessed:       f.Gauge("walbox_outbox_unprocessed", "Outbox rows not yet marked processed (computed every 30 s)."),
		OldestUnprocessed: f.Gauge("walbox_outbox_oldest_unprocessed_seconds", "Age of the oldest outbox row not yet marked processed; 0 when there is none (computed every 30 s)."),
		Marked:            f.Counter("walbox_sweeper_marked_total", "Outbox rows the sweeper marked processed after their JetStream ack."),
		Dropped:           f.Counter("walbox_sweeper_dropped_total", "Marks dropped because the sweeper's queue was full, the update failed for good, or the row stayed out of sight; those rows stay unprocessed until the catch-up reads them back."),
		Deferred:          f.Counter("walbox_sweeper_marks_deferred_total", "Marks left to the read-back from the stream because the relay was catching up (the sweeper yields to it; see sweeper.yield_after)."),
		Unseen:            f.Counter("walbox_sweeper_marks_unseen_total", "Marks whose row the sweeper could not see yet (the commit was decoded before it became visible); tried again for up to 10 s."),
		Queue:             f.Gauge("walbox_sweeper_queue", "Marks waiting to be written to the outbox table."),
		Archived:          f.Counter("walbox_archive_partitions_archived_total", "Outbox partitions moved into the archive table."),
		Exported:          f.Counter("walbox_archive_partitions_exported_total", "Archive partitions exported to cold storage and dropped."),
		RowsExported:      f.Counter("walbox_archive_rows_exported_total", "Rows written to cold storage."),
		Blocked:           f.Gauge("walbox_archive_blocked_partitions", "Partitions old enough to archive that still hold unprocessed rows."),
		MaintainFailures:  f.CounterVec("walbox_sweeper_maintenance_failures_total", "Partition upkeep and archival runs that failed, by reason: privilege (the role does not own the table) or error.", "reason"),
		PartitionsAhead:   f.Gauge("walbox_outbox_partitions_ahead_seconds", "Seconds until the end of the outbox's newest partition: an INSERT with a created_at past it fails (walbox keeps no default partition; computed every 30 s)."),
		Postponed:         f.CounterVec("walbox_sweeper_maintenance_postponed_total", "Maintenance steps postponed because a lock they need was held by another session (a long reader, a dump): retried within sweeper.postponed_retry, never waited for while producers queue, by step.", "step"),
	}
}
