package main

import (
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
)

func newStatusCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "One screen: relay state, leader, events/s, lag, retained WAL, unprocessed, dead letters, partitions",
		Long: `status reads what the running relay writes to walbox.relay_status (leader,
events/s, commit-to-ack lag, confirmed LSN) and whether a session holds the
slot's leader lock, the slot (lag, retained WAL, wal_status), the outbox
table as the sweeper sees it (unprocessed rows and the oldest one's age,
dead-lettered rows, partitions, archive) and the dead-letter stream's size.

The relay is "running" when it wrote its status in the last 10 s, "stale"
when longer ago, "unknown" when it never did. Latency percentiles are not
stored anywhere status can read: see walbox_commit_to_ack_seconds.

Exit code, for scripts and probes: 0 when a relay is running and holds the
leader lock, 3 when the relay is stale, unknown or not leading (the report
is printed all the same), 1 on errors.`,
		RunE: withPostgresConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			rep, err := ops.Status(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			if err := printStatus(cmd.OutOrStdout(), rep, asJSON); err != nil {
				return err
			}
			if rep.Relay.State != "running" || !rep.Relay.LockHeld {
				return exitError{code: 3}
			}
			return nil
		}),
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status as JSON")
	return cmd
}
