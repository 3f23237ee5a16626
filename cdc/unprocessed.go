package cdc

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Unprocessed is the condition "this row is not marked processed" on the
// boolean column processed, written so that the partial index walbox
// creates for it (sql/002) answers it. The planner uses a partial index only
// when it can prove the query's condition implies the index predicate, and
// it proves that by matching expressions: `processed IS NOT TRUE` does not
// imply `NOT processed` (a NULL satisfies the first only), so a query of the
// one form on an index of the other scans every partition in full.
//
//   - NOT NULL column: `NOT processed`, the predicate of the index walbox
//     has always created; the two forms mean the same on such a column.
//   - nullable column: `processed IS NOT TRUE` (a NULL is not processed),
//     and sql/002 creates that column's index with this same predicate.
//
// prefix qualifies the column ("t." or "").
func Unprocessed(prefix string, notNull bool) string {
	if notNull {
		return "NOT " + prefix + "processed"
	}
	return prefix + "processed IS NOT TRUE"
}

// ProcessedFlag reports whether table has a boolean column processed and
// whether that column is NOT NULL.
func ProcessedFlag(ctx context.Context, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, table TableName) (exists, notNull bool, err error) {
	err = q.QueryRow(ctx, `SELECT attnotnull FROM pg_attribute
		WHERE attrelid = $1::regclass AND attname = 'processed' AND atttypid = 'boolean'::regtype AND NOT attisdropped`,
		table.Quoted()).Scan(&notNull)
	if err == pgx.ErrNoRows {
		return false, false, nil
	}
	if err != nil {
		return false, false, fmt.Errorf("read column processed of %s: %w", table, err)
	}
	return true, notNull, nil
}
