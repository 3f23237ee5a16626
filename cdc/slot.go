package cdc

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/walbox/walbox/internal/fault"
)

// query runs a simple-protocol SQL query on conn (which may be a replication
// connection: a walsender in database mode accepts SQL) and returns the rows
// as text.
func query(ctx context.Context, conn *pgconn.PgConn, sql string) ([][]string, error) {
	res := conn.Exec(ctx, sql)
	results, err := res.ReadAll()
	if err != nil {
		return nil, err
	}
	var rows [][]string
	for _, r := range results {
		if r.Err != nil {
			return nil, r.Err
		}
		for _, row := range r.Rows {
			vals := make([]string, len(row))
			for i, v := range row {
				vals[i] = string(v)
			}
			rows = append(rows, vals)
		}
	}
	return rows, nil
}

// checkServer verifies what logical replication needs and explains the fix.
func checkServer(ctx context.Context, conn *pgconn.PgConn) error {
	rows, err := query(ctx, conn, "SHOW wal_level")
	if err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if len(rows) == 1 && rows[0][0] != "logical" {
		return &PreconditionError{
			What: fmt.Sprintf("wal_level is '%s'", rows[0][0]),
			Fix:  "set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL",
		}
	}
	return nil
}

// checkColumns fails fast when the outbox table, as it is now, lacks the
// column of a required role: every new row would be dead-lettered. (Rows
// written under an older definition are judged by their own Relation
// message: see decoder.relation.)
func checkColumns(ctx context.Context, conn *pgconn.PgConn, table TableName, cols Columns) error {
	rows, err := query(ctx, conn, fmt.Sprintf(
		"SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
		QuoteLiteral(table.Quoted())))
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", table, err)
	}
	have := map[string]bool{}
	for _, r := range rows {
		have[r[0]] = true
	}
	for _, role := range []Role{RoleID, RoleTopic, RolePayload} {
		if col := cols[role]; col != "" && !have[col] {
			return &ConfigError{Key: "outbox.columns." + role.String(),
				Msg: fmt.Sprintf("table %s has no column %q; map the %s role to an existing column (after a rename, rows written before it are dead-lettered with the reason)", table, col, role)}
		}
	}
	return nil
}

// serverVersion reads server_version_num on a replication connection.
func serverVersion(ctx context.Context, conn *pgconn.PgConn) (int, error) {
	rows, err := query(ctx, conn, "SHOW server_version_num")
	if err != nil || len(rows) != 1 {
		return 0, fmt.Errorf("read server version: %v", err)
	}
	var v int
	_, err = fmt.Sscan(rows[0][0], &v)
	return v, err
}

// ensurePublication creates the publication for the outbox tables when it
// is missing, and checks an existing one covers each of them.
func ensurePublication(ctx context.Context, conn *pgconn.PgConn, name string, tables []Table, create bool) error {
	var quoted, names []string
	for _, t := range tables {
		quoted = append(quoted, t.Name.Quoted())
		names = append(names, t.Name.String())
	}
	all := strings.Join(quoted, ", ")
	for _, t := range tables {
		table := t.Name
		rows, err := query(ctx, conn, fmt.Sprintf(
			"SELECT pubinsert, pubviaroot, EXISTS (SELECT 1 FROM pg_publication_tables t WHERE t.pubname = p.pubname AND t.schemaname = %s AND t.tablename = %s) FROM pg_publication p WHERE pubname = %s",
			QuoteLiteral(table.Schema), QuoteLiteral(table.Name), QuoteLiteral(name)))
		if err != nil {
			return fmt.Errorf("look up publication %s: %w", name, err)
		}
		if len(rows) == 0 {
			return createPublication(ctx, conn, name, all, strings.Join(names, ", "), create)
		}
		if rows[0][0] != "t" {
			return &PreconditionError{What: fmt.Sprintf("publication %q does not publish inserts", name),
				Fix: fmt.Sprintf("ALTER PUBLICATION %s SET (publish = 'insert', publish_via_partition_root = true)", QuoteIdent(name))}
		}
		if rows[0][2] != "t" {
			exists, err := query(ctx, conn, fmt.Sprintf("SELECT to_regclass(%s) IS NOT NULL", QuoteLiteral(table.Quoted())))
			if err == nil && len(exists) == 1 && exists[0][0] != "t" {
				return &PreconditionError{What: fmt.Sprintf("outbox table %s does not exist", table),
					Fix: "run `walbox migrate` (it creates the table and adds it to the publication), or set outbox.table to your existing outbox table"}
			}
			return &PreconditionError{What: fmt.Sprintf("publication %q does not include %s", name, table),
				Fix: fmt.Sprintf("run `walbox migrate`, or as the table owner: ALTER PUBLICATION %s ADD TABLE %s", QuoteIdent(name), table.Quoted())}
		}
		if rows[0][1] != "t" {
			// publish_via_partition_root matters only for a partitioned
			// outbox; a publication made by another tool (Debezium's,
			// adopted with `walbox slot adopt`) usually has it off.
			kind, err := query(ctx, conn, fmt.Sprintf("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", QuoteLiteral(table.Quoted())))
			if err != nil {
				return fmt.Errorf("look up the kind of %s: %w", table, err)
			}
			if len(kind) == 1 && kind[0][0] != "p" {
				continue
			}
			return &PreconditionError{What: fmt.Sprintf("publication %q has publish_via_partition_root off, so rows of a partitioned outbox arrive under partition names", name),
				Fix: fmt.Sprintf("ALTER PUBLICATION %s SET (publish_via_partition_root = true)", QuoteIdent(name))}
		}
	}
	return nil
}

// createPublication creates the missing publication for the tables (all,
// quoted and comma-separated; names unquoted), if create allows it.
func createPublication(ctx context.Context, conn *pgconn.PgConn, name, all, names string, create bool) error {
	if !create {
		return &PreconditionError{What: fmt.Sprintf("publication %q does not exist", name),
			Fix: fmt.Sprintf("run `walbox migrate`, or as the table owner: CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert', publish_via_partition_root = true)", QuoteIdent(name), all)}
	}
	_, err := query(ctx, conn, fmt.Sprintf(
		"CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert', publish_via_partition_root = true)",
		QuoteIdent(name), all))
	if err != nil {
		switch sqlState(err) {
		case fault.UndefinedTable:
			return &PreconditionError{What: fmt.Sprintf("outbox table %s does not exist", names),
				Fix: "run `walbox migrate` to create it, or set outbox.table to your existing outbox table", Err: err}
		case stateInsufficientPrivilege:
			return &PreconditionError{What: fmt.Sprintf("cannot create publication %q", name),
				Fix: "run `walbox migrate` as the table owner, or ask a DBA to create the publication (`walbox migrate --print`)", Err: err}
		}
		return fmt.Errorf("create publication %s: %w", name, err)
	}
	return nil
}

// SlotInfo is what pg_replication_slots says about walbox's slot.
type SlotInfo struct {
	Exists            bool
	Plugin            string
	Database          string
	Active            bool
	ActivePID         int
	RestartLSN        LSN
	ConfirmedFlushLSN LSN
	WALStatus         string
	// InvalidationReason (PostgreSQL 17+): why the server invalidated the
	// slot: wal_removed, rows_removed, wal_level_insufficient, idle_timeout
	// (18+). Empty when valid or unknown.
	InvalidationReason string
}

// LookupSlot reads the slot's row from pg_replication_slots.
func LookupSlot(ctx context.Context, conn *pgconn.PgConn, slot string) (SlotInfo, error) {
	rows, err := query(ctx, conn, fmt.Sprintf(
		// to_jsonb reads columns newer servers have and older ones lack.
		"SELECT plugin, database, active, coalesce(active_pid, 0), coalesce(restart_lsn, '0/0'), coalesce(confirmed_flush_lsn, '0/0'), coalesce(wal_status, ''), coalesce(to_jsonb(s)->>'invalidation_reason', '') FROM pg_replication_slots s WHERE slot_name = %s",
		QuoteLiteral(slot)))
	if err != nil {
		return SlotInfo{}, fmt.Errorf("look up slot %s: %w", slot, err)
	}
	if len(rows) == 0 {
		return SlotInfo{}, nil
	}
	r := rows[0]
	info := SlotInfo{Exists: true, Plugin: r[0], Database: r[1], Active: r[2] == "t", WALStatus: r[6], InvalidationReason: r[7]}
	fmt.Sscan(r[3], &info.ActivePID)
	info.RestartLSN, _ = pglogrepl.ParseLSN(r[4])
	info.ConfirmedFlushLSN, _ = pglogrepl.ParseLSN(r[5])
	return info, nil
}

// ensureSlot creates the logical slot with pgoutput when it does not exist and
// verifies an existing one. When it creates the slot it exports a snapshot
// (valid until the connection's next command) for the backfill. A slot that
// was lost (dropped while walbox used it, or invalidated with wal_status
// 'lost') is reported loudly and, unless FailOnSlotLost, recreated.
// Why a slot was found lost (walbox_slot_lost_total{reason}).
const (
	SlotMissing     = "missing"     // dropped while walbox used it
	SlotInvalidated = "invalidated" // wal_status 'lost': its WAL was removed
)

func (s *Source) ensureSlot(ctx context.Context, conn *pgconn.PgConn) (*pglogrepl.CreateReplicationSlotResult, error) {
	slot := s.cfg.Slot
	info, err := LookupSlot(ctx, conn, slot)
	if err != nil {
		return nil, err
	}
	if info.Exists && info.Plugin != "pgoutput" {
		return nil, &PreconditionError{What: fmt.Sprintf("replication slot %q uses plugin %q, not pgoutput", slot, info.Plugin),
			Fix: fmt.Sprintf("choose another postgres.slot, or drop it (SELECT pg_drop_replication_slot('%s')) if nothing else uses it", slot)}
	}
	pending, err := s.backfillPending(ctx)
	if err != nil {
		return nil, err
	}
	lost, reason := "", ""
	if info.Exists && pending {
		// Not a loss: walbox's own unfinished work. Always redone.
		s.log.Warn().Str("slot", slot).Msg("the slot was created by a backfill that did not finish (walbox.slot_backfill still names it); recreating it and backfilling again")
		if err := pglogrepl.DropReplicationSlot(ctx, conn, slot, pglogrepl.DropReplicationSlotOptions{}); err != nil {
			return nil, fmt.Errorf("drop slot %s of an unfinished backfill: %w", slot, err)
		}
		info.Exists = false
	} else {
		reason, lost = slotLost(slot, info, s.hadSlot.Load())
	}
	if lost != "" {
		s.log.Error().Str("slot", slot).Str("reason", reason).Msg(lost)
		if s.cfg.OnSlotLost != nil {
			s.cfg.OnSlotLost(reason, lost)
		}
		if s.cfg.FailOnSlotLost {
			return nil, &PreconditionError{What: lost, Fix: "postgres.on_slot_lost is fail: drop the slot and restart walbox to republish unprocessed rows, or set on_slot_lost: recreate"}
		}
		if info.Exists {
			if err := pglogrepl.DropReplicationSlot(ctx, conn, slot, pglogrepl.DropReplicationSlotOptions{}); err != nil {
				return nil, fmt.Errorf("drop lost replication slot %s: %w", slot, err)
			}
		}
		s.log.Warn().Str("slot", slot).Msg("recreating the slot and republishing every unprocessed row (duplicates inside the duplicate window are dropped by JetStream, older ones by the resume check)")
	} else if info.Exists {
		s.hadSlot.Store(true)
		return nil, nil
	}
	if err := s.markBackfillStarted(ctx); err != nil {
		return nil, err
	}
	var res pglogrepl.CreateReplicationSlotResult
	if s.cfg.FailoverSlot {
		if v, verr := serverVersion(ctx, conn); verr == nil && v < 170000 {
			return nil, &PreconditionError{What: fmt.Sprintf("postgres.failover_slot needs PostgreSQL 17 or newer; this server is %d", v/10000),
				Fix: "set postgres.failover_slot: false (before 17 walbox recreates the slot on a promoted standby and republishes unprocessed rows)"}
		}
		// PostgreSQL 17's option list: a failover slot with an exported
		// snapshot, so the first start backfills as usual.
		res, err = pglogrepl.ParseCreateReplicationSlot(conn.Exec(ctx,
			fmt.Sprintf("CREATE_REPLICATION_SLOT %s LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)", QuoteIdent(slot))))
	} else {
		res, err = pglogrepl.CreateReplicationSlot(ctx, conn, slot, "pgoutput",
			pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: "EXPORT_SNAPSHOT"})
	}
	if err != nil {
		if sqlState(err) == "42710" { // created concurrently by another relay
			return nil, nil
		}
		return nil, classifyConnectError(fmt.Errorf("create replication slot %s: %w", slot, err))
	}
	s.hadSlot.Store(true)
	return &res, nil
}

// slotLost says whether, and why, the slot as pg_replication_slots shows it
// (info) was lost: invalidated, or gone while walbox used it (hadSlot).
// reason is SlotInvalidated or SlotMissing, msg the explanation to log; both
// are empty for a slot that is fine or was never there.
func slotLost(slot string, info SlotInfo, hadSlot bool) (reason, msg string) {
	switch {
	case info.Exists && (info.WALStatus == "lost" || info.InvalidationReason != ""):
		reason = SlotInvalidated
		msg = fmt.Sprintf("replication slot %q was invalidated (wal_status 'lost'): the WAL it needed was removed, probably because max_slot_wal_keep_size was exceeded while walbox was behind or away", slot)
		switch info.InvalidationReason {
		case "idle_timeout":
			msg = fmt.Sprintf("replication slot %q was invalidated (invalidation_reason 'idle_timeout'): it was inactive longer than idle_replication_slot_timeout while walbox was away; raise that setting or set it to 0", slot)
		case "rows_removed", "wal_level_insufficient":
			msg = fmt.Sprintf("replication slot %q was invalidated (invalidation_reason '%s')", slot, info.InvalidationReason)
		case "wal_removed":
			msg += " (invalidation_reason 'wal_removed')"
		}
	case !info.Exists && hadSlot:
		reason = SlotMissing
		msg = fmt.Sprintf("replication slot %q disappeared while walbox was using it (dropped by someone)", slot)
	}
	return reason, msg
}

// classifyConnectError turns the server errors people hit on first start
// into errors that name the fix.
func classifyConnectError(err error) error {
	switch sqlState(err) {
	case stateInsufficientPrivilege, stateInvalidAuthorization:
		msg := err.Error()
		if strings.Contains(msg, "pg_hba.conf") {
			return &PreconditionError{What: "the server refuses replication connections from walbox",
				Fix: "add a pg_hba.conf line for the outbox database, e.g. `host <database> <role> <walbox address>/32 scram-sha-256`, and reload PostgreSQL (a logical replication connection is matched by database name; the keyword `replication` matches physical replication only)", Err: err}
		}
		return &PreconditionError{What: "walbox's role may not use replication",
			Fix: "ALTER ROLE <role> WITH REPLICATION (see `walbox migrate --print-grants`)", Err: err}
	case stateInvalidPassword:
		return &PreconditionError{What: "password authentication failed", Fix: "check the user and password in postgres.url (or WALBOX_POSTGRES_URL)", Err: err}
	case stateObjectNotInPrereqState:
		if strings.Contains(err.Error(), "wal_level") {
			return &PreconditionError{What: "logical decoding needs wal_level = logical",
				Fix: "set wal_level = logical in postgresql.conf and restart PostgreSQL", Err: err}
		}
	case "53400":
		return &PreconditionError{What: "all replication slots are in use",
			Fix: "raise max_replication_slots in postgresql.conf and restart, or drop unused slots", Err: err}
	}
	return err
}
