package ops

import (
	"context"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
)

// UninstallOptions choose what walbox uninstall removes.
type UninstallOptions struct {
	// DryRun prints the statements and changes nothing.
	DryRun bool
	// Yes skips the confirmation read from In.
	Yes bool
	// DropTable also drops the outbox table (kept by default: it holds the
	// service's events).
	DropTable bool
	In        io.Reader
	Out       io.Writer
}

// Uninstall removes what walbox made in the database: its replication slot,
// the publication, and schema walbox (relay status, backfill marker,
// archive, producer functions, processed_events, migrations record). The
// outbox table stays unless DropTable. A slot in use is refused: stop walbox
// first. It returns the statements, run or (DryRun) to run.
func Uninstall(ctx context.Context, cfg config.Config, opts UninstallOptions) ([]string, error) {
	opts.Out = orDiscard(opts.Out)
	table, err := tableOf(cfg)
	if err != nil {
		return nil, err
	}
	conn, st, exists, err := connectSlot(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer closePG(ctx, conn)
	var stmts []string
	switch {
	case !exists:
	case st.Active:
		return nil, fmt.Errorf("slot %s is in use (walsender pid %d): stop walbox first", cfg.Postgres.Slot, st.ActivePID)
	default:
		stmts = append(stmts, fmt.Sprintf("SELECT pg_drop_replication_slot(%s)", cdc.QuoteLiteral(cfg.Postgres.Slot)))
	}
	var pub bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`, cfg.Postgres.Publication).Scan(&pub); err != nil {
		return nil, fmt.Errorf("look up publication %s: %w", cfg.Postgres.Publication, err)
	}
	if pub {
		stmts = append(stmts, "DROP PUBLICATION "+cdc.QuoteIdent(cfg.Postgres.Publication))
	}
	var schema bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'walbox')`).Scan(&schema); err != nil {
		return nil, fmt.Errorf("look up schema walbox: %w", err)
	}
	if schema {
		stmts = append(stmts, "DROP SCHEMA walbox CASCADE")
	}
	if opts.DropTable {
		stmts = append(stmts, "DROP TABLE IF EXISTS "+table.Quoted()+" CASCADE")
	}
	for _, s := range stmts {
		fmt.Fprintln(opts.Out, s+";")
	}
	if len(stmts) == 0 {
		fmt.Fprintln(opts.Out, "nothing of walbox's is left in this database")
		return nil, nil
	}
	if !opts.DropTable {
		fmt.Fprintf(opts.Out, "-- the outbox table %s stays (--drop-table drops it too)\n", table)
	}
	if opts.DryRun {
		return stmts, nil
	}
	if !opts.Yes && !confirm(opts.In, opts.Out, "Run these statements?") {
		return stmts, ErrAborted
	}
	// The slot first and on its own: dropping a slot cannot share a
	// transaction with the DDL.
	rest := stmts
	if st.Exists {
		if _, err := conn.Exec(ctx, stmts[0]); err != nil {
			return stmts, fmt.Errorf("%s: %w", stmts[0], err)
		}
		rest = stmts[1:]
	}
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		for _, s := range rest {
			if _, err := tx.Exec(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", s, err)
			}
		}
		return nil
	})
	return stmts, err
}
