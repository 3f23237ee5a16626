package cdc

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// SlotStatus is what a DBA asks about walbox's slot, read from
// pg_replication_slots and pg_stat_replication on a regular connection.
type SlotStatus struct {
	Slot              string
	Exists            bool
	Plugin            string
	Database          string
	Active            bool
	ActivePID         int
	RestartLSN        string
	ConfirmedFlushLSN string
	CurrentLSN        string
	// RetainedBytes is the WAL the slot keeps on disk (current - restart_lsn).
	RetainedBytes int64
	// LagBytes is the WAL not yet confirmed (current - confirmed_flush_lsn).
	LagBytes int64
	// LagSeconds is the walsender's reported replay lag, when active.
	LagSeconds float64
	// WALStatus is reserved, extended, unreserved or lost.
	WALStatus string
	// SafeWALSize is how much more WAL may be written before the slot is in
	// danger of invalidation (NULL, reported as -1, when unlimited).
	SafeWALSize int64
	// PostgreSQL 17+: the slot was created for failover (and, on a standby,
	// synced from the primary); why it was invalidated; since when it has
	// had no consumer. Zero values on older servers.
	Failover           bool
	Synced             bool
	Temporary          bool
	InvalidationReason string
	InactiveSince      time.Time
	CheckedAt          time.Time
}

// ErrNoSlot means the slot does not exist.
var ErrNoSlot = errors.New("replication slot does not exist")

// ReadSlotStatus reads the slot's status. It returns ErrNoSlot (with a
// zero-valued Exists) when there is no such slot.
func ReadSlotStatus(ctx context.Context, conn *pgx.Conn, slot string) (SlotStatus, error) {
	st := SlotStatus{Slot: slot, CheckedAt: time.Now()}
	var inactive *time.Time
	err := conn.QueryRow(ctx, `
SELECT s.plugin, coalesce(s.database, ''), s.active, coalesce(s.active_pid, 0),
       coalesce(s.restart_lsn::text, ''), coalesce(s.confirmed_flush_lsn::text, ''), pg_current_wal_lsn()::text,
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn), 0)::bigint,
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn), 0)::bigint,
       coalesce(extract(epoch FROM r.replay_lag), 0)::float8,
       coalesce(s.wal_status, ''), coalesce(s.safe_wal_size, -1)::bigint,
       coalesce((to_jsonb(s)->>'failover')::bool, false), coalesce((to_jsonb(s)->>'synced')::bool, false), s.temporary,
       coalesce(to_jsonb(s)->>'invalidation_reason', ''), (to_jsonb(s)->>'inactive_since')::timestamptz
  FROM pg_replication_slots s
  LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
 WHERE s.slot_name = $1`, slot).Scan(
		&st.Plugin, &st.Database, &st.Active, &st.ActivePID, &st.RestartLSN, &st.ConfirmedFlushLSN, &st.CurrentLSN,
		&st.RetainedBytes, &st.LagBytes, &st.LagSeconds, &st.WALStatus, &st.SafeWALSize,
		&st.Failover, &st.Synced, &st.Temporary, &st.InvalidationReason, &inactive)
	if errors.Is(err, pgx.ErrNoRows) {
		return st, ErrNoSlot
	}
	if err != nil {
		return st, fmt.Errorf("read status of slot %s: %w", slot, err)
	}
	st.Exists = true
	if inactive != nil {
		st.InactiveSince = *inactive
	}
	return st, nil
}
