package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/ops"
)

func newSlotCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "slot",
		Short: "Show, create or drop walbox's logical replication slot",
	}
	cmd.AddCommand(newSlotStatusCmd(), newSlotCreateCmd(), newSlotDropCmd())
	return cmd
}

func newSlotStatusCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the slot: active pid, LSNs, retained WAL, lag, wal_status, safe_wal_size",
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadPostgresConfig(cmd)
			if err != nil {
				return err
			}
			rep, err := ops.SlotStatus(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			if asJSON {
				return rep.PrintJSON(cmd.OutOrStdout())
			}
			rep.Print(cmd.OutOrStdout())
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status as JSON")
	return cmd
}

func newSlotCreateCmd() *cobra.Command {
	var opts ops.SlotCreateOptions
	cmd := &cobra.Command{
		Use:   "create",
		Short: "Create the pgoutput slot if it is missing (without a snapshot)",
		Long: `create creates postgres.slot with plugin pgoutput when it does not exist, and
does nothing when it does.

You do not need it: walbox run creates the slot itself, together with an
exported snapshot from which it publishes the rows that were waiting before
the slot existed. slot create takes no snapshot; it is for DBAs who
pre-create slots (e.g. as a superuser, or with --failover on PostgreSQL 17).
walbox run then starts from the slot's position: rows committed before it
was created are not published (use walbox replay for them).`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadPostgresConfig(cmd)
			if err != nil {
				return err
			}
			created, err := ops.CreateSlot(cmd.Context(), cfg, opts)
			if err != nil {
				return err
			}
			if created {
				fmt.Fprintf(cmd.OutOrStdout(), "created slot %s (plugin pgoutput)\n", cfg.Postgres.Slot)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "slot %s already exists\n", cfg.Postgres.Slot)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&opts.Failover, "failover", false, "create a failover slot, synchronized to standbys (PostgreSQL 17+)")
	return cmd
}

func newSlotDropCmd() *cobra.Command {
	var opts ops.SlotDropOptions
	cmd := &cobra.Command{
		Use:   "drop",
		Short: "Drop the slot (asks first; refuses while it is in use unless --force)",
		Long: `drop drops postgres.slot, which releases the WAL it retains. It asks for
confirmation on stdin unless --yes, and refuses while the slot is active
(a walbox is streaming from it) unless --force, which terminates that
walsender first.

Stop walbox before dropping: the next walbox run recreates the slot and
republishes every unprocessed row (duplicates are dropped by JetStream's
duplicate window and the relay's resume check).`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadPostgresConfig(cmd)
			if err != nil {
				return err
			}
			opts.In, opts.Out = cmd.InOrStdin(), cmd.OutOrStdout()
			existed, err := ops.DropSlot(cmd.Context(), cfg, opts)
			if err != nil {
				return err
			}
			if existed {
				fmt.Fprintf(cmd.OutOrStdout(), "dropped slot %s\n", cfg.Postgres.Slot)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "slot %s does not exist: nothing to drop\n", cfg.Postgres.Slot)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&opts.Yes, "yes", false, "do not ask for confirmation")
	cmd.Flags().BoolVar(&opts.Force, "force", false, "terminate the walsender using the slot first")
	return cmd
}
