package main

import (
	"fmt"
	"time"

	"context"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/redact"
	walboxsql "github.com/walbox/walbox/sql"
)

func newMigrateCmd() *cobra.Command {
	var printOnly, printGrants bool
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
			t := tableOf(cfg)
			params := walboxsql.Params{Schema: t.Schema, Table: t.Name, Publication: cfg.Postgres.Publication}
			if printGrants {
				fmt.Fprint(cmd.OutOrStdout(), ops.Grants(cfg, role))
				return nil
			}
			if printOnly {
				s, perr := walboxsql.Print(params)
				if perr != nil {
					return perr
				}
				fmt.Fprint(cmd.OutOrStdout(), s)
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
			applied, err := walboxsql.Apply(ctx, conn, params)
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
	cmd.Flags().BoolVar(&printOnly, "print", false, "print the SQL instead of applying it")
	cmd.Flags().BoolVar(&printGrants, "print-grants", false, "print a least-privilege role recipe (CREATE ROLE, GRANTs) for walbox run")
	cmd.Flags().StringVar(&role, "role", "walbox", "role name for --print-grants")
	return cmd
}
