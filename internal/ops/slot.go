package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/fault"
)

// SlotReport is `walbox slot status`.
type SlotReport struct {
	Slot              string  `json:"slot"`
	Exists            bool    `json:"exists"`
	Plugin            string  `json:"plugin,omitempty"`
	Database          string  `json:"database,omitempty"`
	Active            bool    `json:"active"`
	ActivePID         int     `json:"active_pid,omitempty"`
	RestartLSN        string  `json:"restart_lsn,omitempty"`
	ConfirmedFlushLSN string  `json:"confirmed_flush_lsn,omitempty"`
	CurrentLSN        string  `json:"current_lsn,omitempty"`
	RetainedBytes     int64   `json:"retained_bytes"`
	LagBytes          int64   `json:"lag_bytes"`
	LagSeconds        float64 `json:"lag_seconds"`
	WALStatus         string  `json:"wal_status,omitempty"`
	SafeWALSize       int64   `json:"safe_wal_size"` // -1: unlimited
	// PostgreSQL 17+.
	Failover           bool       `json:"failover"`
	Synced             bool       `json:"synced"`
	Temporary          bool       `json:"temporary"`
	InvalidationReason string     `json:"invalidation_reason,omitempty"`
	InactiveSince      *time.Time `json:"inactive_since,omitempty"`
	CheckedAt          time.Time  `json:"checked_at"`
}

func slotReport(st cdc.SlotStatus) SlotReport {
	r := SlotReport{Slot: st.Slot, Exists: st.Exists, Plugin: st.Plugin, Database: st.Database, Active: st.Active, ActivePID: st.ActivePID,
		RestartLSN: st.RestartLSN, ConfirmedFlushLSN: st.ConfirmedFlushLSN, CurrentLSN: st.CurrentLSN, RetainedBytes: st.RetainedBytes,
		LagBytes: st.LagBytes, LagSeconds: st.LagSeconds, WALStatus: st.WALStatus, SafeWALSize: st.SafeWALSize, CheckedAt: st.CheckedAt,
		Failover: st.Failover, Synced: st.Synced, Temporary: st.Temporary, InvalidationReason: st.InvalidationReason}
	if !st.InactiveSince.IsZero() {
		t := st.InactiveSince
		r.InactiveSince = &t
	}
	return r
}

// SlotStatus reads the configured slot's status. A missing slot is not an
// error: the report says Exists false.
func SlotStatus(ctx context.Context, cfg config.Config) (SlotReport, error) {
	conn, err := connectPG(ctx, cfg)
	if err != nil {
		return SlotReport{Slot: cfg.Postgres.Slot}, err
	}
	defer closePG(ctx, conn)
	st, err := cdc.ReadSlotStatus(ctx, conn, cfg.Postgres.Slot)
	if err != nil && !errors.Is(err, cdc.ErrNoSlot) {
		return SlotReport{Slot: cfg.Postgres.Slot}, err
	}
	return slotReport(st), nil
}

// Print writes the report for people.
func (s SlotReport) Print(w io.Writer) {
	if !s.Exists {
		fmt.Fprintf(w, "slot %s does not exist (walbox run creates it; walbox slot create pre-creates it)\n", s.Slot)
		return
	}
	active := "no"
	if s.Active {
		active = fmt.Sprintf("yes (walsender pid %d)", s.ActivePID)
	}
	safe := "unlimited (max_slot_wal_keep_size = -1)"
	if s.SafeWALSize >= 0 {
		safe = fmt.Sprintf("%s (%d bytes) more WAL before the slot is in danger", HumanBytes(s.SafeWALSize), s.SafeWALSize)
	}
	rows := [][2]string{
		{"slot", fmt.Sprintf("%s (plugin %s, database %s)", s.Slot, s.Plugin, s.Database)},
		{"active", active},
		{"restart_lsn", orDash(s.RestartLSN)},
		{"confirmed_flush_lsn", orDash(s.ConfirmedFlushLSN)},
		{"current WAL", s.CurrentLSN},
		{"retained WAL", fmt.Sprintf("%s (%d bytes)", HumanBytes(s.RetainedBytes), s.RetainedBytes)},
		{"lag", fmt.Sprintf("%s (%d bytes) not yet confirmed, %.1f s replay lag", HumanBytes(s.LagBytes), s.LagBytes, s.LagSeconds)},
		{"wal_status", walStatusText(s.WALStatus)},
		{"safe_wal_size", safe},
	}
	if s.Failover || s.Synced {
		rows = append(rows, [2]string{"failover", fmt.Sprintf("yes (synced %v, temporary %v)", s.Synced, s.Temporary)})
	}
	if s.InvalidationReason != "" {
		rows = append(rows, [2]string{"invalidation_reason", s.InvalidationReason})
	}
	if s.InactiveSince != nil {
		rows = append(rows, [2]string{"inactive since", fmt.Sprintf("%s (%s ago)", s.InactiveSince.UTC().Format(time.RFC3339), time.Since(*s.InactiveSince).Round(time.Second))})
	}
	for _, r := range rows {
		fmt.Fprintf(w, "%-20s %s\n", r[0], r[1])
	}
}

// PrintJSON writes the report as JSON.
func (s SlotReport) PrintJSON(w io.Writer) error { return WriteJSON(w, s) }

// WriteJSON writes v as indented JSON.
func WriteJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func walStatusText(s string) string {
	switch s {
	case "reserved":
		return "reserved (the WAL it needs is within max_wal_size)"
	case "extended":
		return "extended (retains more than max_wal_size, within max_slot_wal_keep_size)"
	case "unreserved":
		return "unreserved (DANGER: will be invalidated at the next checkpoint unless it catches up)"
	case "lost":
		return "lost (invalidated: walbox run recreates it and republishes unprocessed rows)"
	}
	return orDash(s)
}

// SlotCreateOptions adjust CreateSlot.
type SlotCreateOptions struct {
	// Failover creates the slot with failover = true (PostgreSQL 17+), so
	// it is synchronized to standbys and survives a failover.
	Failover bool
}

// CreateSlot creates the configured slot with plugin pgoutput when it is
// missing, without a snapshot. It reports whether it created it.
func CreateSlot(ctx context.Context, cfg config.Config, opts SlotCreateOptions) (bool, error) {
	conn, err := connectPG(ctx, cfg)
	if err != nil {
		return false, err
	}
	defer closePG(ctx, conn)
	slot := cfg.Postgres.Slot
	info, err := cdc.ReadSlotStatus(ctx, conn, slot)
	if err == nil {
		if info.Plugin != "pgoutput" {
			return false, fmt.Errorf("slot %s exists with plugin %s, not pgoutput: choose another postgres.slot, or drop it if nothing else uses it", slot, info.Plugin)
		}
		return false, nil
	}
	if !errors.Is(err, cdc.ErrNoSlot) {
		return false, err
	}
	var version int
	if err := conn.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version); err != nil {
		return false, fmt.Errorf("read server version: %w", err)
	}
	q := `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`
	args := []any{slot}
	if opts.Failover {
		if version < 170000 {
			return false, errors.New("--failover needs PostgreSQL 17 or newer (failover slots); before 17 a slot does not follow a failover: walbox recreates it on the new primary")
		}
		q = `SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)`
	}
	if _, err := conn.Exec(ctx, q, args...); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42710" {
			return false, nil // created concurrently (walbox run)
		}
		return false, fmt.Errorf("create slot %s: %w%s", slot, err, slotErrorHint(err))
	}
	return true, nil
}

func slotErrorHint(err error) string {
	switch fault.SQLState(err) {
	case fault.InsufficientPrivilege:
		return " (the role needs REPLICATION: ALTER ROLE <role> WITH REPLICATION)"
	case fault.ObjectNotInPrereqState:
		return " (logical decoding needs wal_level = logical and a restart)"
	case "53400":
		return " (raise max_replication_slots and restart, or drop unused slots)"
	}
	return ""
}

// SlotDropOptions adjust DropSlot.
type SlotDropOptions struct {
	// Yes skips the confirmation.
	Yes bool
	// Force terminates the walsender using the slot first.
	Force bool
	// In and Out carry the confirmation dialogue.
	In  io.Reader
	Out io.Writer
}

// ErrAborted is returned when the user did not confirm.
var ErrAborted = errors.New("aborted: nothing changed")

// DropSlot drops the configured slot. It refuses while the slot is active
// unless opts.Force, which terminates the walsender first, and asks for
// confirmation unless opts.Yes. It reports whether the slot existed.
func DropSlot(ctx context.Context, cfg config.Config, opts SlotDropOptions) (bool, error) {
	if opts.Out == nil {
		opts.Out = io.Discard
	}
	conn, err := connectPG(ctx, cfg)
	if err != nil {
		return false, err
	}
	defer closePG(ctx, conn)
	slot := cfg.Postgres.Slot
	st, err := cdc.ReadSlotStatus(ctx, conn, slot)
	if errors.Is(err, cdc.ErrNoSlot) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if st.Active && !opts.Force {
		return true, fmt.Errorf("slot %s is active (walsender pid %d): stop walbox first, or pass --force to terminate the walsender (a running walbox then recreates the slot and republishes unprocessed rows)", slot, st.ActivePID)
	}
	if !opts.Yes {
		q := fmt.Sprintf("Drop replication slot %s of database %s (retaining %s of WAL)? The next walbox run recreates it and republishes every unprocessed row.", slot, st.Database, HumanBytes(st.RetainedBytes))
		if !confirm(opts.In, opts.Out, q) {
			return true, ErrAborted
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if opts.Force {
			if _, err := conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL`, slot); err != nil {
				return true, fmt.Errorf("terminate the walsender of slot %s: %w", slot, err)
			}
		}
		_, err := conn.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot)
		if err == nil {
			return true, nil
		}
		var pgErr *pgconn.PgError
		// 55006: still active (a terminated walsender releases its slot a
		// moment later, or a relay reconnected): try again.
		if !opts.Force || !errors.As(err, &pgErr) || pgErr.Code != "55006" || time.Now().After(deadline) {
			return true, fmt.Errorf("drop slot %s: %w%s", slot, err, slotErrorHint(err))
		}
		select {
		case <-ctx.Done():
			return true, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
