package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/redact"
	walboxsql "github.com/walbox/walbox/sql"
)

func newMigrateCmd() *cobra.Command {
	var printOnly, printGrants, force bool
	var role string
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create the outbox table, its partitions, the walbox schema and the publication",
		Long: `migrate applies walbox's numbered SQL migrations (idempotent: applied ones
are skipped). With --print it prints the SQL instead, for a DBA who applies DDL by hand.
With --print-grants it prints a least-privilege role recipe for walbox run
(--role names the role): migrate runs as the table owner, walbox run as that
role with postgres.create_publication: false.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadPostgresConfig(cmd)
			if printGrants {
				fmt.Fprint(cmd.OutOrStdout(), ops.Grants(cfg, role))
				return nil
			}
			params, perr := migrateParams(cfg)
			if perr != nil {
				return perr
			}
			if printOnly {
				for _, p := range params {
					s, perr := walboxsql.Print(p)
					if perr != nil {
						return perr
					}
					fmt.Fprint(cmd.OutOrStdout(), s)
				}
				return nil
			}
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 5*time.Minute)
			defer cancel()
			conn, err := pgx.Connect(ctx, cfg.Postgres.URL)
			if err != nil {
				return fmt.Errorf("connect to %s: %w", redact.URL(cfg.Postgres.URL), err)
			}
			defer conn.Close(context.WithoutCancel(ctx))
			var applied []string
			var keep []cdc.TableName
			for _, p := range params {
				names, err := walboxsql.Apply(ctx, conn, p)
				if err != nil {
					return err
				}
				for _, n := range names {
					applied = append(applied, fmt.Sprintf("%s (%s.%s)", n, p.Schema, p.Table))
				}
				keep = append(keep, cdc.TableName{Schema: p.Schema, Name: p.Table})
			}
			// A table taken out of the configuration leaves the
			// publication, unless it still holds unpublished rows.
			dropped, err := walboxsql.PruneTables(ctx, conn, cfg.Postgres.Publication, keep, force)
			for _, t := range dropped {
				fmt.Fprintf(cmd.OutOrStdout(), "walbox migrate: took %s out of publication %s (no longer configured)\n", t, cfg.Postgres.Publication)
			}
			if err != nil {
				return err
			}
			if len(applied) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "walbox migrate: already up to date")
			}
			for _, name := range applied {
				fmt.Fprintln(cmd.OutOrStdout(), "walbox migrate: applied", name)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "take a table that is no longer configured out of the publication even while it holds unprocessed rows (they are then never published)")
	cmd.Flags().BoolVar(&printOnly, "print", false, "print the SQL instead of applying it")
	cmd.Flags().BoolVar(&printGrants, "print-grants", false, "print a least-privilege role recipe (CREATE ROLE, GRANTs) for walbox run")
	cmd.Flags().StringVar(&role, "role", "walbox", "role name for --print-grants")
	return cmd
}

// migrateParams are the migrations' parameters for each configured outbox
// table; walbox.emit knows them all, the default first.
func migrateParams(cfg config.Config) ([]walboxsql.Params, error) {
	tables, err := cfg.Tables()
	if err != nil {
		return nil, err
	}
	var emit []walboxsql.EmitTable
	for _, t := range tables {
		e := walboxsql.EmitTable{Table: t.Name, Columns: t.Columns}
		if t.Default {
			emit = append([]walboxsql.EmitTable{e}, emit...)
		} else {
			emit = append(emit, e)
		}
	}
	var out []walboxsql.Params
	for _, t := range tables {
		out = append(out, walboxsql.Params{Schema: t.Name.Schema, Table: t.Name.Name, Publication: cfg.Postgres.Publication, Emit: emit})
	}
	return out, nil
}

func newUninstallCmd() *cobra.Command {
	var opts ops.UninstallOptions
	cmd := &cobra.Command{
		Use:   "uninstall",
		Short: "Remove walbox from the database: its slot, the publication and schema walbox (the outbox table stays)",
		Long: `uninstall drops what walbox made in the database: the replication slot (so it
retains no more WAL), the publication, and schema walbox (relay status,
backfill marker, archive, producer functions, processed_events, the
migrations record). The outbox table stays unless --drop-table: it holds the
service's events. Stop every walbox first: a slot in use is refused.

--dry-run prints the statements and changes nothing. Streams in NATS are not
touched (nats stream rm, if you want them gone).`,
		Example: `  walbox uninstall --dry-run --postgres-url postgres://dba@db/app
  walbox uninstall --yes --postgres-url postgres://dba@db/app`,
		RunE: withPostgresConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			opts.In, opts.Out = cmd.InOrStdin(), cmd.OutOrStdout()
			_, err := ops.Uninstall(cmd.Context(), cfg, opts)
			return err
		}),
	}
	cmd.Flags().BoolVar(&opts.DryRun, "dry-run", false, "print the statements, change nothing")
	cmd.Flags().BoolVar(&opts.Yes, "yes", false, "do not ask for confirmation")
	cmd.Flags().BoolVar(&opts.DropTable, "drop-table", false, "drop the outbox table too")
	return cmd
}
