package consumer

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Beginner is what Migrate needs: *pgxpool.Pool, *pgx.Conn or pgx.Tx.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// migrationLock is the advisory lock `walbox migrate` takes too, so the two
// never create the same objects at once.
const migrationLock = 0x77616c626f78 // "walbox"

// schemaSQL is the consumer part of walbox's sql/001_walbox_schema.sql
// (walbox.processed_events), kept identical (a test compares them).
const schemaSQL = `CREATE SCHEMA IF NOT EXISTS walbox;
CREATE TABLE IF NOT EXISTS walbox.processed_events (
    consumer_group text NOT NULL,
    event_id       text NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_id)
)`

// Migrate creates schema walbox and the idempotency table
// walbox.processed_events in the consumer's database, if missing. It is
// idempotent and safe to run from many instances at once. `walbox migrate`
// creates the same table in the outbox's database, so a consumer sharing
// that database does not need it. The role needs CREATE on the database (or
// have a DBA run it once); at run time it needs INSERT and SELECT on
// walbox.processed_events.
func Migrate(ctx context.Context, db Beginner) error {
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", int64(migrationLock)); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		_, err := tx.Exec(ctx, schemaSQL)
		return err
	})
	if err != nil {
		return fmt.Errorf("consumer: create walbox.processed_events: %w", err)
	}
	return nil
}
