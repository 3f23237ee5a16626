package cdc

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// backfill publishes every unprocessed row visible in the snapshot exported
// when the slot was created. Rows committed before the slot existed are in
// the snapshot and not in the slot's stream; rows committed after are in the
// stream and not in the snapshot: no gap, no overlap.
//
// The snapshot stays valid only until the replication connection runs its
// next command, so this must finish before START_REPLICATION.
//
// With several outbox tables, each is read in turn (table order, then each
// table's best commit-order estimate): a lost slot's backfill keeps order
// within a table, not across tables.
func (s *Source) backfill(ctx context.Context, snapshot string, consistent LSN, tables []Table, out chan<- []Change, first []Change) error {
	conn, err := pgx.Connect(ctx, s.cfg.ConnString)
	if err != nil {
		return fmt.Errorf("backfill: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return fmt.Errorf("backfill: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, "SET TRANSACTION SNAPSHOT "+QuoteLiteral(snapshot)); err != nil {
		return fmt.Errorf("backfill: set snapshot %s: %w", snapshot, err)
	}

	var tct string
	commitTimestamps := false
	if err := tx.QueryRow(ctx, "SHOW track_commit_timestamp").Scan(&tct); err == nil && tct == "on" {
		commitTimestamps = true
	}
	bf := &backfillRun{batch: append(first, Change{Kind: KindBegin, LSN: 0}), started: time.Now()}
	for i, t := range tables {
		if err := s.backfillTable(ctx, tx, i, t, commitTimestamps, bf, out); err != nil {
			return err
		}
	}
	return s.endBackfill(ctx, bf, consistent, out)
}

// backfillTable reads one outbox table's unprocessed rows into the backfill.
func (s *Source) backfillTable(ctx context.Context, tx pgx.Tx, idx int, t Table, commitTimestamps bool, bf *backfillRun, out chan<- []Change) error {
	plan, err := readBackfillPlan(ctx, tx, t, commitTimestamps)
	if err != nil {
		return err
	}
	plan.table = idx
	// A cursor per table: pgx caches FETCH's result shape by its text.
	cursor := "walbox_backfill"
	if idx > 0 {
		cursor = fmt.Sprintf("walbox_backfill_%d", idx)
		plan.declare = strings.Replace(plan.declare, "DECLARE walbox_backfill ", "DECLARE "+cursor+" ", 1)
	}
	if _, err := tx.Exec(ctx, plan.declare); err != nil {
		return fmt.Errorf("backfill: %w", err)
	}

	fetch := func(ctx context.Context, each func(vals []*string) error) (int, error) {
		rows, err := tx.Query(ctx, fmt.Sprintf("FETCH %d FROM %s", s.cfg.BatchSize, cursor))
		if err != nil {
			return 0, fmt.Errorf("backfill: fetch: %w", err)
		}
		defer rows.Close()
		got := 0
		for rows.Next() {
			vals := make([]*string, len(plan.roles))
			ptrs := make([]any, len(plan.roles))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			if err := rows.Scan(ptrs...); err != nil {
				return got, fmt.Errorf("backfill: scan: %w", err)
			}
			if err := each(vals); err != nil {
				return got, err
			}
			got++
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return got, fmt.Errorf("backfill: fetch: %w", err)
		}
		return got, nil
	}
	return s.sendBackfill(ctx, plan, bf, out, fetch)
}

// readBackfillPlan reads t's columns from the catalogue and plans its backfill.
func readBackfillPlan(ctx context.Context, q interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, t Table, commitTimestamps bool) (backfillPlan, error) {
	// Which mapped columns exist, and is the payload JSON?
	rows, err := q.Query(ctx, `SELECT a.attname, a.atttypid::int, a.attnotnull FROM pg_attribute a
		WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped`, t.Name.Quoted())
	if err != nil {
		return backfillPlan{}, fmt.Errorf("backfill: read columns of %s: %w", t.Name, err)
	}
	defer rows.Close()
	types := map[string]int{}
	processedNotNull := false
	for rows.Next() {
		var name string
		var typ int
		var notNull bool
		if err := rows.Scan(&name, &typ, &notNull); err != nil {
			return backfillPlan{}, err
		}
		types[name] = typ
		if name == "processed" {
			processedNotNull = notNull
		}
	}
	if err := rows.Err(); err != nil {
		return backfillPlan{}, fmt.Errorf("backfill: read columns: %w", err)
	}
	return planBackfill(t.Name, t.Columns, types, processedNotNull, commitTimestamps), nil
}

// BackfillQuery is the SELECT a backfill of t runs (its cursor's query),
// for EXPLAIN: tests check that an index answers it.
func BackfillQuery(ctx context.Context, q interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, t Table) (string, error) {
	plan, err := readBackfillPlan(ctx, q, t, false)
	if err != nil {
		return "", err
	}
	_, query, _ := strings.Cut(plan.declare, " CURSOR FOR ")
	return query, nil
}

// backfillPlan is what a backfill selects and in which order, worked out
// from the outbox table's columns as the catalogue lists them.
type backfillPlan struct {
	table         int    // index of the table in Config.Tables
	roles         []Role // the mapped roles whose column exists, in select order
	payloadIsJSON bool
	declare       string // DECLARE walbox_backfill ... CURSOR FOR SELECT ...
}

// planBackfill builds the backfill's cursor from the table's columns (name
// to type OID, from pg_attribute), whether its processed column is NOT NULL
// (see Unprocessed) and whether track_commit_timestamp is on.
func planBackfill(table TableName, cols Columns, types map[string]int, processedNotNull, commitTimestamps bool) backfillPlan {
	var p backfillPlan
	var sel []string
	for r, col := range cols {
		if _, ok := types[col]; col != "" && ok {
			sel = append(sel, QuoteIdent(col)+"::text")
			p.roles = append(p.roles, Role(r))
		}
	}
	p.payloadIsJSON = types[cols[RolePayload]] == oidJSON || types[cols[RolePayload]] == oidJSONB
	where := ""
	if types["processed"] == oidBool {
		where = " WHERE " + Unprocessed("", processedNotNull)
	}
	p.declare = fmt.Sprintf("DECLARE walbox_backfill NO SCROLL CURSOR FOR SELECT %s FROM %s%s ORDER BY %s",
		strings.Join(sel, ", "), table.Quoted(), where, strings.Join(backfillOrder(cols, types, commitTimestamps), ", "))
	return p
}

// xidAge is how long ago a row's xmin was assigned, in transactions:
// larger is older. xids are 32-bit and wrap, so xmin itself does not order
// (4294967290 is older than 5 after a wrap); age() compares modulo 2^32,
// which is right for every xid less than 2^31 transactions old, and no
// unfrozen xid is older than that (the server stops assigning xids first).
// Every row in the backfill's snapshot has an age of at least 1: age()
// measures from the next xid at its first call in the transaction, which is
// beyond every xid the snapshot sees. Frozen rows: FrozenTransactionId (2,
// which rows frozen by a server older than 9.4 still show after
// pg_upgrade) and BootstrapTransactionId (1) have age 2147483647, the
// oldest; since 9.4 freezing keeps the row's xid, whose age stays right
// until it is 2^31 transactions old and then turns 0 or negative, which
// only such a frozen row can show: it is the oldest too. Limits: a frozen
// xid 2^32 or more transactions old looks young again, and the rows frozen
// past 2^31 keep no order among themselves but ctid's.
const xidAge = "CASE WHEN age(xmin) > 0 THEN age(xmin) ELSE 2147483647 END"

// xidAgeKey orders rows by their xid, oldest first.
const xidAgeKey = xidAge + " DESC"

// backfillOrder is the backfill's ORDER BY: commit order, and insertion
// order inside a transaction, as far as the catalogue records them (the
// table has no commit LSN). Each key, why it is there and where it fails:
//
//   - pg_xact_commit_timestamp(xmin), with track_commit_timestamp = on:
//     the commit time, recorded for a transaction and all its
//     subtransactions at once, so every row of a transaction has the same
//     one. It is not the commit LSN: two commits in the same microsecond
//     tie, two concurrent commits can take their times in one order and
//     write their commit records in the other, a clock stepped back
//     reorders, and a row applied by a subscription has its origin's commit
//     time. NULL means no time is kept for the xid: it committed before
//     tracking was last turned on (turning it off drops every time kept,
//     turning it on takes effect at a restart and records every commit
//     after it), or its time was dropped with the commit log behind the
//     freeze horizon, or it is FrozenTransactionId. Such a row committed
//     before every row that has a time (bar a long transaction that
//     straddled the freeze horizon), hence NULLS FIRST: ascending order
//     would put these oldest rows last.
//   - created_at, when the table has it: by default now(), the start of
//     the inserting transaction, the same for all its rows. It orders the
//     rows without a commit time (by start, which for concurrent producers
//     is not commit order), and keeps apart transactions whose commit
//     times tie. A created_at the application sets per row reorders the
//     rows of a transaction by those values. Without the column and with
//     rows that have no commit time, the xid's age takes its place
//     (xidAgeKey); it keeps apart transactions but not a subtransaction's
//     rows from their transaction's (see cmin).
//   - cmin, the inserting command's id: command ids are counted per
//     top-level transaction, across its subtransactions, so they give the
//     order of its INSERT statements even where xmin differs (a row
//     inserted inside a savepoint has the subtransaction's xid, larger
//     than the transaction's own, although it came before the rows
//     inserted after RELEASE). That is why xmin comes after it wherever
//     another key keeps a transaction's rows together. A row its own
//     transaction updated has the update's command; one whose update or
//     delete was rolled back to a savepoint shows a combo command id, which
//     orders nothing. Transactions tied on every key above interleave by
//     it, each in its own order.
//   - xidAgeKey, after cmin: rows tied so far whose xmin differs belong
//     to different transactions (one statement runs in one
//     subtransaction); the older xid's row goes first.
//   - ctid: one statement's rows, in the order they were placed in the
//     heap; not when a row took space vacuum freed in an earlier page, nor
//     across partitions (rows of one statement with created_at in two).
//   - the id, random for a uuid: only for a deterministic order.
//
// A row updated since it was inserted carries the updating transaction's
// xmin, commit time and command, and sorts where that update committed.
// The system columns and pg_xact_commit_timestamp work through a partitioned
// table's root (PostgreSQL 14 to 18), so the order spans its partitions.
func backfillOrder(cols Columns, types map[string]int, commitTimestamps bool) []string {
	const commitTime = "pg_xact_commit_timestamp(xmin)"
	var order []string
	if commitTimestamps {
		order = append(order, commitTime+" NULLS FIRST")
	}
	switch c := cols[RoleCreatedAt]; {
	case c != "" && types[c] != 0:
		order = append(order, QuoteIdent(c), "cmin::text::bigint", xidAgeKey)
	case commitTimestamps:
		// Rows that share a commit time are one transaction (bar a tie):
		// cmin alone orders them. Rows without one need the xid's age to
		// keep their transactions apart.
		order = append(order, "CASE WHEN "+commitTime+" IS NULL THEN "+xidAge+" END DESC", "cmin::text::bigint", xidAgeKey)
	default:
		order = append(order, xidAgeKey, "cmin::text::bigint")
	}
	return append(order, "ctid", QuoteIdent(cols[RoleID]))
}

// event is the n-th backfilled event, from one row's values (text; nil for
// NULL) in the order of p.roles.
func (p *backfillPlan) event(n uint32, at time.Time, vals []*string) Event {
	ev := Event{Pos: Position{CommitLSN: 0, Index: n}, CommitTime: at, PayloadIsJSON: p.payloadIsJSON, TopicNull: true, Table: p.table}
	for i, r := range p.roles {
		setRole(&ev, r, vals[i])
	}
	return ev
}

// backfillRun is the synthetic transaction a backfill hands over: it ends
// at the slot's consistent point, so confirming it is what the slot
// already has.
type backfillRun struct {
	batch      []Change
	batchBytes int64
	n          uint32
	started    time.Time
	lastLog    time.Time
}

// sendBackfill hands the rows fetch yields to out, as part of bf's
// transaction. fetch calls each for every row of the next cursor batch and
// returns how many there were (0 at the end).
func (s *Source) sendBackfill(ctx context.Context, plan backfillPlan, bf *backfillRun, out chan<- []Change,
	fetch func(ctx context.Context, each func(vals []*string) error) (int, error)) error {
	now := time.Now()
	for {
		got, err := fetch(ctx, func(vals []*string) error {
			ev := plan.event(bf.n, now, vals)
			bf.batch = append(bf.batch, Change{Kind: KindEvent, Event: ev})
			bf.n++
			bf.batchBytes += int64(len(ev.Payload) + len(ev.Headers))
			if bf.batchBytes >= s.cfg.BatchBytes {
				// Large rows: hand over before the fetch is done.
				if err := send(ctx, out, bf.batch); err != nil {
					return err
				}
				bf.batch, bf.batchBytes = nil, 0
			}
			return nil
		})
		if err != nil {
			return err
		}
		if got == 0 {
			return nil
		}
		if len(bf.batch) > 0 {
			if err := send(ctx, out, bf.batch); err != nil {
				return err
			}
		}
		bf.batch, bf.batchBytes = nil, 0
		if time.Since(bf.lastLog) > 5*time.Second && time.Since(bf.started) > 5*time.Second {
			bf.lastLog = time.Now()
			s.log.Info().Uint32("rows", bf.n).Stringer("elapsed", time.Since(bf.started)).Msg("backfill in progress")
		}
	}
}

// endBackfill closes the synthetic transaction at the consistent point.
func (s *Source) endBackfill(ctx context.Context, bf *backfillRun, consistent LSN, out chan<- []Change) error {
	bf.batch = append(bf.batch, Change{Kind: KindCommit, LSN: consistent})
	if err := send(ctx, out, bf.batch); err != nil {
		return err
	}
	s.log.Info().Uint32("rows", bf.n).Stringer("elapsed", time.Since(bf.started)).Stringer("consistent_point", consistent).Msg("backfill done: unprocessed rows from before the slot existed handed to the relay")
	return nil
}

func setRole(ev *Event, r Role, v *string) {
	if v == nil {
		switch r {
		case RolePayload:
			ev.PayloadNull = true
		}
		return
	}
	switch r {
	case RoleID:
		ev.ID = *v
	case RoleTopic:
		ev.Topic, ev.TopicNull = *v, false
	case RolePayload:
		ev.Payload = []byte(*v)
	case RoleStream:
		ev.Stream = *v
	case RoleEventType:
		ev.EventType = *v
	case RoleAggregateType:
		ev.AggregateType = *v
	case RoleAggregateID:
		ev.AggregateID = *v
	case RolePartitionKey:
		ev.PartitionKey = *v
	case RoleHeaders:
		ev.Headers = []byte(*v)
	case RoleCreatedAt:
		ev.CreatedAt = *v
	}
}

func send(ctx context.Context, out chan<- []Change, b []Change) error {
	select {
	case out <- b:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
