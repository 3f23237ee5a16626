package main

import (
	"io"
	"os"

	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
)

func newDoctorCmd() *cobra.Command {
	var asJSON bool
	var standby string
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check every prerequisite of walbox run and print the fix for each problem",
		Long: `doctor checks, read-only, what walbox run needs: the PostgreSQL version,
wal_level = logical (and settings waiting for a restart), free replication
slots and WAL senders, the role's REPLICATION attribute and a replication
connection (pg_hba.conf), SELECT and UPDATE on the outbox table, the
publication, the slot (plugin, wal_status), failover slots (PostgreSQL 17),
max_slot_wal_keep_size, track_commit_timestamp, walbox's schema; NATS, JetStream,
the configured streams and their subjects, duplicate windows and durability;
with sink: kafka instead: the brokers, every configured topic and the
dead-letter topic (exists, partitions, replication factor) and
min.insync.replicas where the replication factor is 3 or more.

Each check is ok, warn, fail or skip; every warning and failure comes with
the exact fix. Exit code 0 when nothing failed, 1 otherwise.`,
		Example: `  walbox doctor --config walbox.yaml
  walbox doctor --json | jq '.checks[] | select(.status != "ok")'
  walbox doctor --standby 'postgres://walbox@standby:5432/app'`,
		RunE: withConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			rep := ops.Doctor(cmd.Context(), cfg)
			if standby != "" {
				ops.DoctorStandby(cmd.Context(), cfg, standby, rep)
			}
			if err := printStatus(cmd.OutOrStdout(), rep, asJSON); err != nil {
				return err
			}
			if !rep.OK {
				return exitError{code: 1}
			}
			return nil
		}),
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	cmd.Flags().StringVar(&standby, "standby", "", "URL of a standby the slot must survive a promotion to: checks failover-slot settings on both servers, and fails until the standby's copy is synced and persisted (PostgreSQL 17+)")
	return cmd
}

// isTerminal reports whether w is a terminal (for progress bars).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && isatty.IsTerminal(f.Fd())
}
