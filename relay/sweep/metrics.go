package sweep

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the sweeper's Prometheus series, registered on the registry
// passed to New (none when it is nil).
type Metrics struct {
	Unprocessed       prometheus.Gauge
	OldestUnprocessed prometheus.Gauge
	Marked            prometheus.Counter
	Dropped           prometheus.Counter
	Queue             prometheus.Gauge
	Archived          prometheus.Counter
	Exported          prometheus.Counter
	RowsExported      prometheus.Counter
	Blocked           prometheus.Gauge
	MaintainFailures  *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Unprocessed: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_outbox_unprocessed", Help: "Outbox rows not yet marked processed (computed every 30 s).",
		}),
		OldestUnprocessed: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_outbox_oldest_unprocessed_seconds", Help: "Age of the oldest outbox row not yet marked processed; 0 when there is none (computed every 30 s).",
		}),
		Marked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_sweeper_marked_total", Help: "Outbox rows the sweeper marked processed after their JetStream ack.",
		}),
		Dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_sweeper_dropped_total", Help: "Marks dropped because the sweeper's queue was full or the update failed for good; those rows stay unprocessed.",
		}),
		Queue: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_sweeper_queue", Help: "Marks waiting to be written to the outbox table.",
		}),
		Archived: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_archive_partitions_archived_total", Help: "Outbox partitions moved into the archive table.",
		}),
		Exported: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_archive_partitions_exported_total", Help: "Archive partitions exported to cold storage and dropped.",
		}),
		RowsExported: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "walbox_archive_rows_exported_total", Help: "Rows written to cold storage.",
		}),
		Blocked: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walbox_archive_blocked_partitions", Help: "Partitions old enough to archive that still hold unprocessed rows.",
		}),
		MaintainFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "walbox_sweeper_maintenance_failures_total", Help: "Partition upkeep and archival runs that failed, by reason: privilege (the role does not own the table) or error.",
		}, []string{"reason"}),
	}
	if reg != nil {
		reg.MustRegister(m.Unprocessed, m.OldestUnprocessed, m.Marked, m.Dropped, m.Queue, m.Archived, m.Exported, m.RowsExported, m.Blocked, m.MaintainFailures)
	}
	return m
}
