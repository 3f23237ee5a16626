package sweep

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
)

// ensurePartitions calls walbox.ensure_partitions (sql/001) so that the
// partitions of the coming days exist before rows arrive.
func (s *Sweeper) ensurePartitions(ctx context.Context, q querier, ti *tableInfo, rep *Report, opts MaintainOptions) error {
	if !ti.partitioned {
		return nil
	}
	var fn bool
	if err := q.QueryRow(ctx, `SELECT to_regprocedure('walbox.ensure_partitions(regclass,integer,text)') IS NOT NULL`).Scan(&fn); err != nil {
		return err
	}
	if !fn {
		s.warn("noensure", "walbox.ensure_partitions is missing (run walbox migrate): partitions are not created ahead")
		return nil
	}
	if opts.DryRun {
		// What the function would create: the same walk, without DDL.
		rows, err := q.Query(ctx, `
			SELECT name FROM (
			  SELECT $3 || '_p' || to_char(d, CASE $1 WHEN 'day' THEN 'YYYYMMDD' ELSE 'YYYYMM' END) AS name
			  FROM generate_series(date_trunc($1, now() - interval '1 day')::date::timestamp,
			                       (now() + make_interval(days => $2))::date::timestamp,
			                       ('1 ' || $1)::interval) d) x
			WHERE to_regclass(format('%I.%I', $4::text, name)) IS NULL`,
			s.cfg.PartitionStep, s.cfg.PartitionsAhead, ti.table.Name, ti.table.Schema)
		if err != nil {
			return err
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		for _, n := range names {
			rep.PartitionsCreated = append(rep.PartitionsCreated, ti.table.Schema+"."+n)
		}
		return nil
	}
	before, err := partitions(ctx, q, ti.table, ti.partType)
	if err != nil {
		return err
	}
	if _, err := q.Exec(ctx, `SELECT walbox.ensure_partitions($1::regclass, $2, $3)`, ti.table.Quoted(), s.cfg.PartitionsAhead, s.cfg.PartitionStep); err != nil {
		return fmt.Errorf("walbox.ensure_partitions: %w", err)
	}
	after, err := partitions(ctx, q, ti.table, ti.partType)
	if err != nil {
		return err
	}
	had := map[cdc.TableName]bool{}
	for _, p := range before {
		had[p.name] = true
	}
	for _, p := range after {
		if !had[p.name] {
			rep.PartitionsCreated = append(rep.PartitionsCreated, p.name.String())
		}
	}
	return nil
}

// RangeMove is a range of rows found in the default partition and moved
// into a partition of their own.
type RangeMove struct {
	Partition string    `json:"partition"`
	From      time.Time `json:"from"`
	To        time.Time `json:"to"`
	Rows      int64     `json:"rows"`
}

// moveDefault moves rows out of the default partition into dated partitions.
//
// walbox no longer creates a default partition (sql/002); an older walbox's
// <table>_default can hold rows whose created_at no partition covered (the
// sweeper was down for longer than partitions_ahead, or a producer wrote a
// far past or future time). While they are there, the partition for their
// range cannot be created. For each such range, in one transaction:
//
//  1. CREATE the dated table as a plain table, not a partition;
//  2. INSERT the range's rows into it and DELETE them from the default;
//  3. ATTACH the dated table for its range.
//
// The rows are only ever inserted into a table that is not part of the
// outbox at that moment, so pgoutput does not publish them: the relay does
// not send them again (TestMoveDefaultRowsIsNotRepublished checks this with
// a pgoutput slot of its own). ATTACH takes SHARE UPDATE EXCLUSIVE on the
// outbox, which INSERTs do not conflict with, and ACCESS EXCLUSIVE on the
// default partition (it checks that none of its rows belong to the range):
// only rows routed to the default wait, never INSERTs into today's
// partition. The default stays attached throughout.
func (s *Sweeper) moveDefault(ctx context.Context, q querier, ti *tableInfo, rep *Report, opts MaintainOptions) error {
	if !ti.partitioned || ti.partCol == "" {
		return nil
	}
	switch ti.partType {
	case "timestamp with time zone", "timestamp without time zone":
	default:
		return nil
	}
	parts, def, err := defaultPartition(ctx, q, ti)
	if err != nil || def == nil {
		return err
	}
	type rng struct {
		from, to, suffix string
		start, end       time.Time
		rows             int64
	}
	fmtStep := "YYYYMMDD"
	if s.cfg.PartitionStep == "month" {
		fmtStep = "YYYYMM"
	}
	col := cdc.QuoteIdent(ti.partCol)
	// date_trunc in the session's time zone, as ensure_partitions does.
	rows, err := q.Query(ctx, fmt.Sprintf(`
		SELECT r.lo::text, (r.lo + ('1 ' || $1)::interval)::text, r.lo::timestamptz, (r.lo + ('1 ' || $1)::interval)::timestamptz,
		       to_char(r.lo, '%s'), count(*)
		FROM (SELECT date_trunc($1, %s) AS lo FROM %s) r
		WHERE r.lo IS NOT NULL GROUP BY r.lo ORDER BY r.lo`, fmtStep, col, def.name.Quoted()), s.cfg.PartitionStep)
	if err != nil {
		return fmt.Errorf("read default partition %s: %w", def.name, err)
	}
	var ranges []rng
	for rows.Next() {
		var r rng
		if err := rows.Scan(&r.from, &r.to, &r.start, &r.end, &r.suffix, &r.rows); err != nil {
			rows.Close()
			return err
		}
		ranges = append(ranges, r)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, r := range ranges {
		overlap := false
		for _, p := range parts {
			if p.bounded && p.start.Before(r.end) && r.start.Before(p.end) {
				overlap = true
			}
		}
		if overlap {
			rep.Errors = append(rep.Errors, fmt.Sprintf("default partition %s holds %d rows in [%s, %s), which overlaps an existing partition with other bounds: move them by hand",
				def.name, r.rows, r.from, r.to))
			continue
		}
		name, err := s.freeName(ctx, q, cdc.TableName{Schema: ti.table.Schema, Name: ti.table.Name + "_p" + r.suffix})
		if err != nil {
			return err
		}
		mv := RangeMove{Partition: name.String(), From: r.start, To: r.end, Rows: r.rows}
		if opts.DryRun {
			rep.Moved = append(rep.Moved, mv)
			continue
		}
		started := time.Now()
		err = s.inTx(ctx, q, func(tx pgx.Tx) error {
			cols := ti.columnList()
			where := fmt.Sprintf("%s >= %s AND %s < %s", col, cdc.QuoteLiteral(r.from), col, cdc.QuoteLiteral(r.to))
			stmts := []string{
				fmt.Sprintf("CREATE TABLE %s (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED INCLUDING STORAGE)", name.Quoted(), ti.table.Quoted()),
				fmt.Sprintf("INSERT INTO %s (%s) SELECT %s FROM %s WHERE %s", name.Quoted(), cols, cols, def.name.Quoted(), where),
				fmt.Sprintf("DELETE FROM %s WHERE %s", def.name.Quoted(), where),
				fmt.Sprintf("ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%s)", ti.table.Quoted(), name.Quoted(), cdc.QuoteLiteral(r.from), cdc.QuoteLiteral(r.to)),
			}
			for _, st := range stmts {
				if _, err := tx.Exec(ctx, st); err != nil {
					return fmt.Errorf("%s: %w", st, err)
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("move %d rows of [%s, %s) out of the default partition %s: %w", r.rows, r.from, r.to, def.name, err)
		}
		rep.Moved = append(rep.Moved, mv)
		s.log.Info().Str("partition", name.String()).Int64("rows", r.rows).Stringer("took", time.Since(started)).
			Msg("moved rows out of the default partition into a partition of their own")
	}
	return nil
}

// removeDefault removes the default partition an older walbox created
// (<table>_default) once it is empty: PostgreSQL refuses DETACH PARTITION
// ... CONCURRENTLY while a default partition exists, and without it archival
// would need ACCESS EXCLUSIVE on the outbox. A default partition of another
// name is the DBA's and stays (archival then detaches under lock_timeout;
// docs/sweeper.md).
//
// Removing it is the one statement that needs ACCESS EXCLUSIVE on the outbox
// (DETACH of a default cannot be concurrent), once. It is not tried while any
// other session has held a lock on the outbox or a partition for more than a
// second (a reader, a dump, a long transaction): the request would queue
// behind it and every INSERT behind the request. Otherwise it waits at most
// lock_timeout, as every maintenance statement does. The emptiness is
// checked again under the lock, so a row that arrived meanwhile stays.
func (s *Sweeper) removeDefault(ctx context.Context, q querier, ti *tableInfo, rep *Report, opts MaintainOptions) error {
	if !ti.partitioned {
		return nil
	}
	_, def, err := defaultPartition(ctx, q, ti)
	if err != nil || def == nil {
		return err
	}
	if def.name.Name != ti.table.Name+"_default" {
		s.warn("dba-default", fmt.Sprintf("%s has a default partition %s that walbox did not create: it stays, and archival detaches partitions under lock_timeout (%s) instead of concurrently (PostgreSQL refuses DETACH ... CONCURRENTLY next to a default partition); see docs/sweeper.md",
			ti.table, def.name, s.cfg.LockTimeout))
		return nil
	}
	var rows bool
	if err := q.QueryRow(ctx, fmt.Sprintf("SELECT EXISTS (SELECT 1 FROM %s)", def.name.Quoted())).Scan(&rows); err != nil {
		return fmt.Errorf("read default partition %s: %w", def.name, err)
	}
	if rows {
		return errPostpone{object: def.name.String(), why: "the default partition still holds rows no partition range takes (see the report's errors)"}
	}
	if opts.DryRun {
		rep.DefaultRemoved = def.name.String()
		return nil
	}
	holder, err := longLockHolder(ctx, q, ti.table)
	if err != nil {
		return err
	}
	if holder != "" {
		return errPostpone{object: def.name.String(), why: "removing the default partition needs a moment with no long transaction on the outbox: " + holder}
	}
	err = s.inTx(ctx, q, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, fmt.Sprintf("ALTER TABLE %s DETACH PARTITION %s", ti.table.Quoted(), def.name.Quoted())); err != nil {
			return err
		}
		var rows bool
		if err := tx.QueryRow(ctx, fmt.Sprintf("SELECT EXISTS (SELECT 1 FROM %s)", def.name.Quoted())).Scan(&rows); err != nil {
			return err
		}
		if rows {
			return errPostpone{object: def.name.String(), why: "a row arrived in the default partition"}
		}
		_, err := tx.Exec(ctx, fmt.Sprintf("DROP TABLE %s", def.name.Quoted()))
		return err
	})
	if err != nil {
		return fmt.Errorf("remove the empty default partition %s: %w", def.name, err)
	}
	rep.DefaultRemoved = def.name.String()
	s.log.Info().Str("partition", def.name.String()).Msg("removed the empty default partition an older walbox created: archival now detaches partitions concurrently")
	return nil
}

// longLockHolder names a session that has held a lock on table or one of
// its partitions for more than a second, or returns "".
func longLockHolder(ctx context.Context, q querier, table cdc.TableName) (string, error) {
	var who string
	err := q.QueryRow(ctx, `
		SELECT format('pid %s (%s, %s, in a transaction for %s)', a.pid, coalesce(nullif(a.application_name, ''), 'no application_name'), l.mode,
		              date_trunc('second', now() - a.xact_start))
		FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid()
		  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND (l.relation = to_regclass($1) OR l.relation IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass($1)))
		  AND a.xact_start < clock_timestamp() - interval '1 second'
		ORDER BY a.xact_start LIMIT 1`, table.Quoted()).Scan(&who)
	if err == pgx.ErrNoRows {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("look for long transactions on %s: %w", table, err)
	}
	return who, nil
}

// defaultPartition lists ti's partitions and picks its default one (nil
// when it has none).
func defaultPartition(ctx context.Context, q querier, ti *tableInfo) ([]partition, *partition, error) {
	parts, err := partitions(ctx, q, ti.table, ti.partType)
	if err != nil {
		return nil, nil, err
	}
	for i := range parts {
		if parts[i].isDefault {
			return parts, &parts[i], nil
		}
	}
	return parts, nil, nil
}

// freeName returns name, or name_2, name_3, ... when a table of that name
// exists or an earlier partition of that name was archived (its export
// would be overwritten).
func (s *Sweeper) freeName(ctx context.Context, q querier, name cdc.TableName) (cdc.TableName, error) {
	var journal bool
	if err := q.QueryRow(ctx, `SELECT to_regclass('walbox.archive_partitions') IS NOT NULL`).Scan(&journal); err != nil {
		return name, err
	}
	base := name.Name
	for i := 2; ; i++ {
		var taken bool
		err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, name.Quoted()).Scan(&taken)
		if err != nil {
			return name, err
		}
		if !taken && journal {
			err = q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM walbox.archive_partitions WHERE partition_name = $1)`, name.String()).Scan(&taken)
			if err != nil {
				return name, err
			}
		}
		if !taken {
			return name, nil
		}
		name.Name = fmt.Sprintf("%s_%d", base, i)
	}
}

// txStarter is a querier that can begin a transaction.
type txStarter interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// inTx runs f in a transaction on q (which must be able to begin one).
func (s *Sweeper) inTx(ctx context.Context, q querier, f func(pgx.Tx) error) error {
	b, ok := q.(txStarter)
	if !ok {
		return fmt.Errorf("internal: %T cannot begin a transaction", q)
	}
	return pgx.BeginFunc(ctx, b, f)
}
