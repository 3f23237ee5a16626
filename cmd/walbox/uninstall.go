package main

import (
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
)

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
