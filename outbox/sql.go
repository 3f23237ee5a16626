package outbox

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// SQLExecer is the part of database/sql that Write and Lag use: *sql.Tx,
// *sql.Conn and *sql.DB have it.
type SQLExecer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// FromSQL adapts a database/sql transaction (or *sql.Conn, *sql.DB) for
// Write and Lag. The driver must take PostgreSQL's $1 placeholders (pgx's
// stdlib driver and lib/pq do). Several events go as multi-row INSERTs
// (COPY needs pgx's own interface).
//
//	tx, _ := db.BeginTx(ctx, nil) // db opened with sql.Open("pgx", url)
//	err := outbox.Write(ctx, outbox.FromSQL(tx), ev)
func FromSQL(tx SQLExecer) Execer {
	if tx == nil {
		return nil
	}
	return sqlExecer{tx}
}

type sqlExecer struct{ tx SQLExecer }

func (s sqlExecer) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	res, err := s.tx.ExecContext(ctx, query, args...)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return pgconn.CommandTag{}, nil
	}
	return pgconn.NewCommandTag(fmt.Sprintf("INSERT 0 %d", n)), nil
}

func (s sqlExecer) QueryRow(ctx context.Context, query string, args ...any) pgx.Row {
	return s.tx.QueryRowContext(ctx, query, args...)
}
