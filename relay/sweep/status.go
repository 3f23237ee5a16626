package sweep

import (
	"context"
	"fmt"
	"time"

	"github.com/walbox/walbox/cdc"
)

// Status is the outbox table's state as the sweeper sees it, for
// `walbox status` and humans.
type Status struct {
	Table       string `json:"table"`
	Partitioned bool   `json:"partitioned"`
	// HasProcessed is false when the table has no processed column; the
	// counts below are then zero.
	HasProcessed bool `json:"has_processed"`
	// Unprocessed rows and the age of the oldest one (0 when none).
	Unprocessed       int64         `json:"unprocessed"`
	OldestUnprocessed time.Duration `json:"oldest_unprocessed_ns"`
	// DeadLettered counts rows whose error column is set (-1: no such column).
	DeadLettered int64 `json:"dead_lettered"`
	// Partitions of the outbox table in range order, the default partition last.
	Partitions []PartitionStatus `json:"partitions"`
	// DefaultRows are the rows waiting in the default partition to be moved.
	DefaultRows int64         `json:"default_rows"`
	Archive     ArchiveStatus `json:"archive"`
	// This process's marking: queued, marked and dropped since start.
	Queue   int    `json:"queue"`
	Marked  uint64 `json:"marked"`
	Dropped uint64 `json:"dropped"`
}

// PartitionStatus is one partition.
type PartitionStatus struct {
	Name          string    `json:"name"`
	From          time.Time `json:"from"`
	To            time.Time `json:"to"`
	Default       bool      `json:"default"`
	EstimatedRows int64     `json:"estimated_rows"` // from pg_class.reltuples (-1 or 0 until analyzed)
}

// ArchiveStatus is the archive's side.
type ArchiveStatus struct {
	// Table is the archive table; Exists is false until the first archival.
	Table  string `json:"table"`
	Exists bool   `json:"exists"`
	// Partitions attached to the archive (partitioned outbox).
	Partitions []PartitionStatus `json:"partitions"`
	// EstimatedRows in the archive table (unpartitioned outbox).
	EstimatedRows int64 `json:"estimated_rows"`
	// Blocked are partitions past archive.after that hold unprocessed rows.
	Blocked []Blocked `json:"blocked"`
	// Pending are partitions detached from the outbox and not yet attached
	// to the archive (finished by the next run).
	Pending []string `json:"pending"`
	// Exported partitions now only in cold storage, their rows, and the
	// ones deleted after the retention age.
	Exported     int   `json:"exported"`
	ExportedRows int64 `json:"exported_rows"`
	Deleted      int   `json:"deleted"`
	// Store names the cold storage ("" when export is off).
	Store string `json:"store"`
}

// Status reads the table's state. It needs no running sweeper: `walbox
// status` builds one from the config and calls it.
func (s *Sweeper) Status(ctx context.Context) (*Status, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	ti, err := inspect(ctx, conn, s.cfg.Table, s.cfg.Columns)
	if err != nil {
		return nil, err
	}
	st := &Status{Table: ti.table.String(), Partitioned: ti.partitioned, HasProcessed: ti.processed, DeadLettered: -1,
		Queue: s.Pending(), Marked: s.Marked(), Dropped: s.Dropped()}
	if ti.processed {
		if st.Unprocessed, st.OldestUnprocessed, err = unprocessed(ctx, conn, ti); err != nil {
			return nil, err
		}
	}
	if ti.errorCol {
		if err := conn.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FROM %s WHERE error IS NOT NULL", ti.table.Quoted())).Scan(&st.DeadLettered); err != nil {
			return nil, err
		}
	}
	var now time.Time
	if err := conn.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
		return nil, err
	}
	cutoff := now.Add(-s.cfg.Archive.After)
	arch := ti.table.Archive()
	st.Archive.Table = arch.String()
	if s.cfg.Archive.Store != nil && s.cfg.Archive.ExportAfter > 0 {
		st.Archive.Store = s.cfg.Archive.Store.String()
	}
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", arch.Quoted()).Scan(&st.Archive.Exists); err != nil {
		return nil, err
	}
	if ti.partitioned {
		parts, err := partitions(ctx, conn, ti.table, ti.partType)
		if err != nil {
			return nil, err
		}
		for _, p := range parts {
			ps := PartitionStatus{Name: p.name.String(), From: p.start, To: p.end, Default: p.isDefault, EstimatedRows: p.estRows}
			st.Partitions = append(st.Partitions, ps)
			if p.isDefault {
				if err := conn.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FROM %s", p.name.Quoted())).Scan(&st.DefaultRows); err != nil {
					return nil, err
				}
				continue
			}
			if ti.processed && s.cfg.Archive.After > 0 && p.bounded && !p.end.After(cutoff) {
				n, err := countUnprocessed(ctx, conn, ti, p.name)
				if err != nil {
					return nil, err
				}
				if n > 0 {
					st.Archive.Blocked = append(st.Archive.Blocked, Blocked{Partition: p.name.String(), Unprocessed: n})
				}
			}
		}
		if st.Archive.Exists {
			aparts, err := partitions(ctx, conn, arch, ti.partType)
			if err != nil {
				return nil, err
			}
			for _, p := range aparts {
				st.Archive.Partitions = append(st.Archive.Partitions, PartitionStatus{Name: p.name.String(), From: p.start, To: p.end, EstimatedRows: p.estRows})
			}
		}
	} else {
		if ti.processed && ti.createdCol != "" && s.cfg.Archive.After > 0 {
			var n int64
			if err := conn.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FROM %s WHERE %s AND %s < $1", ti.table.Quoted(), ti.unprocessed(""), cdc.QuoteIdent(ti.createdCol)), cutoff).Scan(&n); err != nil {
				return nil, err
			}
			if n > 0 {
				st.Archive.Blocked = append(st.Archive.Blocked, Blocked{Partition: ti.table.String(), Unprocessed: n})
			}
		}
		if st.Archive.Exists {
			if err := conn.QueryRow(ctx, "SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($1)", arch.Quoted()).Scan(&st.Archive.EstimatedRows); err != nil {
				return nil, err
			}
		}
	}
	if ok, err := journalExists(ctx, conn); err != nil {
		return nil, err
	} else if ok {
		rows, err := conn.Query(ctx, `SELECT partition_name, state, coalesce(rows, 0) FROM walbox.archive_partitions WHERE source = $1`, ti.table.String())
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		for rows.Next() {
			var name, state string
			var n int64
			if err := rows.Scan(&name, &state, &n); err != nil {
				return nil, err
			}
			switch state {
			case stateDetached:
				st.Archive.Pending = append(st.Archive.Pending, name)
			case stateExported:
				st.Archive.Exported++
				st.Archive.ExportedRows += n
			case stateDeleted:
				st.Archive.Deleted++
			}
		}
		if err := rows.Err(); err != nil {
			return nil, err
		}
	}
	return st, nil
}
