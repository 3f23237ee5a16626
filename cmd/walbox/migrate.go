package main

import (
	"fmt"
	"time"

	"context"

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
