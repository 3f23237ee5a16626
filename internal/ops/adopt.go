package ops

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/fault"
)

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
	if opts.Out == nil {
		opts.Out = io.Discard
	}
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
