package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"
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
	conn, st, _, err := connectSlot(ctx, cfg)
	if err != nil {
		return SlotReport{Slot: cfg.Postgres.Slot}, err
	}
	closePG(ctx, conn)
	return slotReport(st), nil
}

// connectSlot connects to PostgreSQL and reads the configured slot's
// status; exists is false when there is no such slot, which is no error.
// On an error conn is nil (and closed); otherwise close it with closePG.
func connectSlot(ctx context.Context, cfg config.Config) (conn *pgx.Conn, st cdc.SlotStatus, exists bool, err error) {
	conn, err = connectPG(ctx, cfg)
	if err != nil {
		return nil, st, false, err
	}
	st, err = cdc.ReadSlotStatus(ctx, conn, cfg.Postgres.Slot)
	if errors.Is(err, cdc.ErrNoSlot) {
		return conn, st, false, nil
	}
	if err != nil {
		closePG(ctx, conn)
		return nil, st, false, err
	}
	return conn, st, true, nil
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
	conn, info, exists, err := connectSlot(ctx, cfg)
	if err != nil {
		return false, err
	}
	defer closePG(ctx, conn)
	slot := cfg.Postgres.Slot
	if exists {
		if info.Plugin != "pgoutput" {
			return false, fmt.Errorf("slot %s exists with plugin %s, not pgoutput: choose another postgres.slot, or drop it if nothing else uses it", slot, info.Plugin)
		}
		return false, nil
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
	opts.Out = orDiscard(opts.Out)
	conn, st, exists, err := connectSlot(ctx, cfg)
	if err != nil {
		return false, err
	}
	defer closePG(ctx, conn)
	if !exists {
		return false, nil
	}
	slot := cfg.Postgres.Slot
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

// SlotAdoptOptions adjust AdoptSlot.
type SlotAdoptOptions struct {
	// Slot is the slot to take over (Debezium's slot.name).
	Slot string
	// Publication is the publication its client streamed with (Debezium's
	// publication.name). postgres.publication must name it.
	Publication string
	// DropSource drops Slot once walbox's copy exists.
	DropSource bool
	// Yes skips the confirmation.
	Yes bool
	// In and Out carry the confirmation dialogue.
	In  io.Reader
	Out io.Writer
}

// AdoptResult is what AdoptSlot did.
type AdoptResult struct {
	Source      string // the adopted slot
	Slot        string // walbox's slot (postgres.slot)
	Publication string
	// Copied: Slot was created as a copy of Source. False when postgres.slot
	// names Source itself: walbox then streams from it as it is.
	Copied bool
	// ConfirmedFlushLSN is where walbox continues: the first transaction
	// it publishes is the first one committed after it.
	ConfirmedFlushLSN string
	// CheckedLSN is the source's confirmed position when it was checked.
	// The copy starting later means its client ran in between and took
	// the transactions from CheckedLSN to ConfirmedFlushLSN for itself.
	CheckedLSN string
	// SourceMoved: the source's confirmed position moved after the copy
	// (its client ran meanwhile); SourceLSN is where it ended up.
	SourceMoved bool
	SourceLSN   string
	// SourceDropped: --drop-source dropped the source slot.
	SourceDropped bool
	// MarkerCleared: a stale backfill marker of postgres.slot was deleted.
	MarkerCleared bool
	// FailoverNote: postgres.failover_slot is set, but a copy is never a
	// failover slot.
	FailoverNote bool
}

// Print writes what was done and what is left to do.
func (r AdoptResult) Print(w io.Writer) {
	if r.Copied {
		fmt.Fprintf(w, "copied slot %s to %s at confirmed_flush_lsn %s: walbox run continues from there with publication %s (no snapshot, no backfill)\n",
			r.Source, r.Slot, r.ConfirmedFlushLSN, r.Publication)
	} else {
		fmt.Fprintf(w, "postgres.slot is %s itself: walbox run streams from it as it is, from confirmed_flush_lsn %s, with publication %s (no snapshot, no backfill)\n",
			r.Slot, r.ConfirmedFlushLSN, r.Publication)
	}
	if r.MarkerCleared {
		fmt.Fprintf(w, "deleted the stale backfill marker of slot %s (walbox.slot_backfill): it belonged to an earlier slot of that name\n", r.Slot)
	}
	if r.Copied && r.CheckedLSN != "" && r.CheckedLSN != r.ConfirmedFlushLSN {
		fmt.Fprintf(w, "warning: slot %s moved from %s to %s between the check and the copy (its client is running?): the transactions in between went to that client only; walbox replay publishes those rows still in the table\n",
			r.Source, r.CheckedLSN, r.ConfirmedFlushLSN)
	}
	if r.SourceMoved {
		fmt.Fprintf(w, "warning: slot %s moved on to %s while it was copied (its client is running?): transactions up to there are published again (JetStream drops the duplicates by event id)\n", r.Source, r.SourceLSN)
	}
	if r.FailoverNote {
		fmt.Fprintf(w, "note: postgres.failover_slot is set, but PostgreSQL does not copy the failover property: %s is not synchronized to standbys until, on a replication connection: ALTER_REPLICATION_SLOT %s (FAILOVER true)\n", r.Slot, cdc.QuoteIdent(r.Slot))
	}
	switch {
	case !r.Copied:
	case r.SourceDropped:
		fmt.Fprintf(w, "dropped slot %s\n", r.Source)
	default:
		fmt.Fprintf(w, "warning: slot %s still exists and retains WAL from %s on for as long as it exists; once walbox runs, drop it:\n  SELECT pg_drop_replication_slot(%s);\n",
			r.Source, r.ConfirmedFlushLSN, cdc.QuoteLiteral(r.Source))
	}
}

// adoptSlotRow is one slot's row of pg_replication_slots, as adopt needs it.
type adoptSlotRow struct {
	Type, Plugin, Database  string
	Active                  bool
	ActivePID               int
	Temporary               bool
	RestartLSN, Confirmed   string // "" when NULL
	WALStatus, Invalidation string
}

func readAdoptSlot(ctx context.Context, conn *pgx.Conn, slot string) (adoptSlotRow, bool, error) {
	var r adoptSlotRow
	err := conn.QueryRow(ctx, `
SELECT slot_type, coalesce(plugin, ''), coalesce(database, ''), active, coalesce(active_pid, 0), temporary,
       coalesce(restart_lsn::text, ''), coalesce(confirmed_flush_lsn::text, ''),
       coalesce(wal_status, ''), coalesce(to_jsonb(s)->>'invalidation_reason', '')
  FROM pg_replication_slots s WHERE slot_name = $1`, slot).Scan(
		&r.Type, &r.Plugin, &r.Database, &r.Active, &r.ActivePID, &r.Temporary, &r.RestartLSN, &r.Confirmed, &r.WALStatus, &r.Invalidation)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false, nil
	}
	if err != nil {
		return r, false, fmt.Errorf("look up slot %s: %w", slot, err)
	}
	return r, true, nil
}

// AdoptSlot makes walbox continue from another pgoutput client's slot
// (Debezium's, with plugin.name=pgoutput) exactly where that client's
// confirmed position is: no snapshot, no gap. It checks that the slot and
// the publication fit (it must publish the inserts of every configured
// outbox table), then copies the slot to postgres.slot with
// pg_copy_logical_replication_slot (restart_lsn, confirmed_flush_lsn and
// catalog_xmin as they are), or, when postgres.slot names the slot itself,
// copies nothing. walbox run finds its slot existing and streams from its
// confirmed position, as after any restart.
//
// The publication must be the one the slot was read with: pgoutput reads
// publications with the catalogue as it was at each decoded transaction, so
// a publication created now would not exist for the transactions waiting
// in the slot. Hence postgres.publication must name it.
func AdoptSlot(ctx context.Context, cfg config.Config, opts SlotAdoptOptions) (AdoptResult, error) {
	opts.Out = orDiscard(opts.Out)
	src, dst := opts.Slot, cfg.Postgres.Slot
	res := AdoptResult{Source: src, Slot: dst, Publication: opts.Publication}
	if src == "" {
		return res, errors.New("--slot is required: the slot to take over (Debezium's slot.name, by default debezium)")
	}
	if opts.Publication == "" {
		return res, errors.New("--publication is required: the publication the slot was read with (Debezium's publication.name, by default dbz_publication)")
	}
	if cfg.Postgres.Publication != opts.Publication {
		return res, &config.Error{Key: "postgres.publication",
			Msg: fmt.Sprintf("is %q, but the adopted slot must be read with publication %q: set `postgres.publication: %s` in the config (or WALBOX_POSTGRES_PUBLICATION=%s) and run slot adopt again. "+
				"A publication created now would not exist for the transactions the slot still holds, so walbox must keep using %s",
				cfg.Postgres.Publication, opts.Publication, opts.Publication, opts.Publication, opts.Publication)}
	}
	tables, err := cfg.Tables()
	if err != nil {
		return res, err
	}
	same := src == dst
	if same && opts.DropSource {
		return res, fmt.Errorf("--drop-source with postgres.slot %s, the adopted slot itself, would drop walbox's own slot: leave --drop-source out", dst)
	}

	conn, err := connectPG(ctx, cfg)
	if err != nil {
		return res, err
	}
	defer closePG(ctx, conn)

	var db string
	if err := conn.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		return res, fmt.Errorf("read the current database: %w", err)
	}
	s, ok, err := readAdoptSlot(ctx, conn, src)
	if err != nil {
		return res, err
	}
	if err := checkAdoptSource(src, db, s, ok); err != nil {
		return res, err
	}
	res.ConfirmedFlushLSN, res.CheckedLSN = s.Confirmed, s.Confirmed
	for _, t := range tables {
		if err := checkAdoptPublication(ctx, conn, opts.Publication, t.Name, t.Key); err != nil {
			return res, err
		}
	}
	if !same {
		w, exists, err := readAdoptSlot(ctx, conn, dst)
		if err != nil {
			return res, err
		}
		if exists {
			return res, &fault.PreconditionError{What: fmt.Sprintf("walbox's slot %q (postgres.slot) already exists (plugin %s, confirmed_flush_lsn %s): walbox would continue from it, not from %s", dst, orDash(w.Plugin), orDash(w.Confirmed), src),
				Fix: fmt.Sprintf("if walbox has not published from it, drop it (`walbox slot drop`) and run slot adopt again; or set postgres.slot to %s to stream from that slot itself, or to an unused name", src)}
		}
	}
	marker, err := hasBackfillMarker(ctx, conn, dst)
	if err != nil {
		return res, err
	}

	if !opts.Yes {
		var q string
		if same {
			q = fmt.Sprintf("Let walbox stream from slot %s of database %s as it is, from confirmed_flush_lsn %s, with publication %s?", src, db, s.Confirmed, opts.Publication)
		} else {
			q = fmt.Sprintf("Copy slot %s of database %s (confirmed_flush_lsn %s) to walbox's slot %s", src, db, s.Confirmed, dst)
			if opts.DropSource {
				q += fmt.Sprintf(" and then drop %s", src)
			}
			q += fmt.Sprintf("? walbox run then publishes every event committed after %s, read with publication %s.", s.Confirmed, opts.Publication)
		}
		if !confirm(opts.In, opts.Out, q) {
			return res, ErrAborted
		}
	}
	if marker {
		// walbox would take a slot that exists while its marker is there
		// for one a backfill left unfinished, drop it and backfill.
		if _, err := conn.Exec(ctx, `DELETE FROM walbox.slot_backfill WHERE slot_name = $1`, dst); err != nil {
			return res, fmt.Errorf("delete the stale backfill marker of slot %s: %w", dst, err)
		}
		res.MarkerCleared = true
	}
	res.FailoverNote = cfg.Postgres.FailoverSlot && !same
	if same {
		return res, nil
	}

	var copied *string
	if err := conn.QueryRow(ctx, `SELECT lsn::text FROM pg_copy_logical_replication_slot($1, $2, false)`, src, dst).Scan(&copied); err != nil {
		return res, fmt.Errorf("copy slot %s to %s: %w%s", src, dst, err, slotErrorHint(err))
	}
	res.Copied = true
	if copied != nil {
		res.ConfirmedFlushLSN = *copied
	}
	after, ok, err := readAdoptSlot(ctx, conn, src)
	if err == nil && ok && after.Confirmed != res.ConfirmedFlushLSN {
		res.SourceMoved, res.SourceLSN = true, after.Confirmed
	}
	if opts.DropSource {
		if _, err := conn.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, src); err != nil {
			return res, fmt.Errorf("slot %s was copied to %s, but dropping it failed (stop its client, then SELECT pg_drop_replication_slot(%s)): %w",
				src, dst, cdc.QuoteLiteral(src), err)
		}
		res.SourceDropped = true
	}
	return res, nil
}

// checkAdoptSource says why the slot as pg_replication_slots shows it (s;
// ok false: no such slot) cannot be adopted into database db, naming the
// fix, or nil.
func checkAdoptSource(slot, db string, s adoptSlotRow, ok bool) error {
	fresh := "stop the connector and let walbox create its own slot instead (walbox run publishes the rows still in the outbox table from a snapshot)"
	switch {
	case !ok:
		return &fault.PreconditionError{What: fmt.Sprintf("replication slot %q does not exist", slot),
			Fix: "pass the connector's slot.name (SELECT slot_name, plugin, database FROM pg_replication_slots lists the slots)"}
	case s.Type != "logical":
		return &fault.PreconditionError{What: fmt.Sprintf("replication slot %q is a %s slot, not a logical one", slot, s.Type),
			Fix: "pass the logical slot of the connector (its slot.name)"}
	case s.Plugin != "pgoutput":
		return &fault.PreconditionError{What: fmt.Sprintf("replication slot %q uses plugin %s; walbox reads pgoutput only", slot, s.Plugin),
			Fix: "a slot of plugin.name=" + s.Plugin + " cannot be continued with pgoutput: " + fresh}
	case s.Database != db:
		return &fault.PreconditionError{What: fmt.Sprintf("replication slot %q belongs to database %s, but postgres.url connects to %s", slot, s.Database, db),
			Fix: fmt.Sprintf("point postgres.url at database %s (where the outbox table is) and run slot adopt again", s.Database)}
	case s.WALStatus == "lost" || s.Invalidation != "":
		why := s.Invalidation
		if why == "" {
			why = "wal_status lost"
		}
		return &fault.PreconditionError{What: fmt.Sprintf("replication slot %q was invalidated (%s): the WAL after its position is gone", slot, why),
			Fix: "nothing can continue from it; " + fresh}
	case s.Active:
		return &fault.PreconditionError{What: fmt.Sprintf("replication slot %q is in use (walsender pid %d): its client, the Debezium connector, is still streaming", slot, s.ActivePID),
			Fix: "stop the connector first (Kafka Connect: PUT /connectors/<name>/stop, or delete it; a paused connector keeps its connection), then run slot adopt again"}
	case s.Temporary:
		return &fault.PreconditionError{What: fmt.Sprintf("replication slot %q is temporary: it ends with its session", slot),
			Fix: "adopt a permanent slot (the connector's slot.name)"}
	case s.Confirmed == "":
		return &fault.PreconditionError{What: fmt.Sprintf("replication slot %q has no confirmed position yet (it never finished starting)", slot),
			Fix: fresh}
	}
	return nil
}

// checkAdoptPublication checks that publication pub exists and publishes
// the inserts of the outbox table (of config key key: outbox, outboxes[i]).
func checkAdoptPublication(ctx context.Context, conn *pgx.Conn, pub string, table cdc.TableName, key string) error {
	var ins, viaRoot bool
	err := conn.QueryRow(ctx, `SELECT pubinsert, pubviaroot FROM pg_publication WHERE pubname = $1`, pub).Scan(&ins, &viaRoot)
	if errors.Is(err, pgx.ErrNoRows) {
		return &fault.PreconditionError{What: fmt.Sprintf("publication %q does not exist", pub),
			Fix: "pass the connector's publication.name (SELECT pubname FROM pg_publication lists them)"}
	}
	if err != nil {
		return fmt.Errorf("look up publication %s: %w", pub, err)
	}
	// Whether the table is published: pg_publication_tables lists a
	// partitioned table under its own name with publish_via_partition_root,
	// else under its partitions' names.
	var exists, partitioned, member bool
	if err := conn.QueryRow(ctx, `SELECT c.oid IS NOT NULL, coalesce(c.relkind = 'p', false),
		EXISTS (SELECT 1 FROM pg_publication_tables t
		         WHERE t.pubname = $2 AND format('%I.%I', t.schemaname, t.tablename)::regclass IN (SELECT r.oid UNION SELECT relid FROM pg_partition_tree(r.oid)))
		FROM (SELECT to_regclass($1) AS oid) r LEFT JOIN pg_class c ON c.oid = r.oid`, table.Quoted(), pub).Scan(&exists, &partitioned, &member); err != nil {
		return fmt.Errorf("look up table %s in publication %s: %w", table, pub, err)
	}
	switch {
	case !exists:
		return &fault.PreconditionError{What: fmt.Sprintf("outbox table %s does not exist", table),
			Fix: fmt.Sprintf("set %s.table to the table the connector's outbox event router reads (its table.include.list)", key)}
	case !member:
		return &fault.PreconditionError{What: fmt.Sprintf("publication %q does not include the outbox table %s, so the slot never carried its events", pub, table),
			Fix: fmt.Sprintf("check %s.table (the connector's table.include.list) and --publication (its publication.name); adding the table now would not bring back the inserts the slot holds", key)}
	case !ins:
		return &fault.PreconditionError{What: fmt.Sprintf("publication %q does not publish inserts, so the slot never carried the outbox events", pub),
			Fix: "check --publication (the connector's publication.name); changing publish now would not bring back the inserts the slot holds"}
	case partitioned && !viaRoot:
		return &fault.PreconditionError{What: fmt.Sprintf("the outbox table %s is partitioned and publication %q has publish_via_partition_root off: the slot's inserts arrive under the partitions' names, which walbox does not map", table, pub),
			Fix: "such a slot cannot be continued; stop the connector and let walbox create its own slot (walbox run publishes the rows still in the outbox table)"}
	}
	return nil
}

// hasBackfillMarker reports whether walbox.slot_backfill names slot. A
// missing or unreadable table (walbox migrate not run, grants missing) reads
// as no, as walbox run reads it.
func hasBackfillMarker(ctx context.Context, conn *pgx.Conn, slot string) (bool, error) {
	var n int
	err := conn.QueryRow(ctx, `SELECT count(*) FROM walbox.slot_backfill WHERE slot_name = $1`, slot).Scan(&n)
	if fault.MissingRelation(err) || fault.SQLState(err) == fault.InsufficientPrivilege {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read the backfill marker of slot %s: %w", slot, err)
	}
	return n > 0, nil
}
