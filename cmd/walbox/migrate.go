package main

import (
	"fmt"
	"time"

	"context"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	walboxsql "github.com/walbox/walbox/sql"
)

func newMigrateCmd() *cobra.Command {
	var printOnly bool
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create the outbox table, its partitions, the walbox schema and the publication",
		Long: `migrate applies walbox's numbered SQL migrations (idempotent: applied ones
are skipped). With --print it prints the SQL instead, for a DBA who applies DDL by hand.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadConfig(cmd)
			t := tableOf(cfg)
			params := walboxsql.Params{Schema: t.Schema, Table: t.Name, Publication: cfg.Postgres.Publication}
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
				return fmt.Errorf("connect to %s: %w", redactURL(cfg.Postgres.URL), err)
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
	return cmd
}
