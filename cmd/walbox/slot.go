package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
)

func newSlotCmd() *cobra.Command {
	return newGroupCmd("slot", "Show, create, drop or adopt walbox's logical replication slot",
		newSlotStatusCmd(), newSlotCreateCmd(), newSlotDropCmd(), newSlotAdoptCmd())
}

func newSlotStatusCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the slot: active pid, LSNs, retained WAL, lag, wal_status, safe_wal_size",
		RunE: withPostgresConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			rep, err := ops.SlotStatus(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			return printStatus(cmd.OutOrStdout(), rep, asJSON)
		}),
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
		RunE: withPostgresConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			created, err := ops.CreateSlot(cmd.Context(), cfg, opts)
			return printSlotOutcome(cmd, cfg, created, err, "created slot %s (plugin pgoutput)\n", "slot %s already exists\n")
		}),
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
		RunE: withPostgresConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			opts.In, opts.Out = cmd.InOrStdin(), cmd.OutOrStdout()
			existed, err := ops.DropSlot(cmd.Context(), cfg, opts)
			return printSlotOutcome(cmd, cfg, existed, err, "dropped slot %s\n", "slot %s does not exist: nothing to drop\n")
		}),
	}
	cmd.Flags().BoolVar(&opts.Yes, "yes", false, "do not ask for confirmation")
	cmd.Flags().BoolVar(&opts.Force, "force", false, "terminate the walsender using the slot first")
	return cmd
}

func newSlotAdoptCmd() *cobra.Command {
	var opts ops.SlotAdoptOptions
	cmd := &cobra.Command{
		Use:   "adopt --slot <slot> --publication <publication>",
		Short: "Take over another pgoutput client's slot (Debezium's): continue from its confirmed position",
		Long: `adopt makes walbox continue from the slot of another pgoutput client, such
as a Debezium PostgreSQL connector with plugin.name=pgoutput, exactly where
that client's confirmed position is: no snapshot, no gap. Only what the
client had received but not yet confirmed is published again (JetStream
drops those by event id within its duplicate window).

It checks that the slot exists in this database, is a logical pgoutput slot
and is not in use (stop the connector first), that the publication exists
and publishes the inserts of outbox.table, and that postgres.slot does not
exist yet. Then it copies the slot to postgres.slot with
pg_copy_logical_replication_slot; walbox run streams from the copy.

postgres.publication must name --publication: pgoutput reads a publication
as the catalogue was when each transaction was written, so a publication
created now would not exist for the transactions the slot still holds.

The source slot retains WAL for as long as it exists: --drop-source drops it
after the copy; otherwise adopt prints the statement to drop it. When
postgres.slot is the source slot itself, nothing is copied and walbox
streams from that slot.

It asks for confirmation on stdin unless --yes.`,
		RunE: withPostgresConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			opts.In, opts.Out = cmd.InOrStdin(), cmd.OutOrStdout()
			res, err := ops.AdoptSlot(cmd.Context(), cfg, opts)
			if err == nil || res.Copied {
				// After a copy, even when dropping the source failed.
				res.Print(cmd.OutOrStdout())
			}
			return err
		}),
	}
	cmd.Flags().StringVar(&opts.Slot, "slot", "", "the slot to take over (Debezium's slot.name)")
	cmd.Flags().StringVar(&opts.Publication, "publication", "", "the publication it was read with (Debezium's publication.name); postgres.publication must name it")
	cmd.Flags().BoolVar(&opts.DropSource, "drop-source", false, "drop the source slot once it is copied (it retains WAL otherwise)")
	cmd.Flags().BoolVar(&opts.Yes, "yes", false, "do not ask for confirmation")
	_ = cmd.MarkFlagRequired("slot")
	_ = cmd.MarkFlagRequired("publication")
	return cmd
}

// printSlotOutcome prints ifDone or ifNot (formats of the slot's name),
// as done says, once a slot command succeeded.
func printSlotOutcome(cmd *cobra.Command, cfg config.Config, done bool, err error, ifDone, ifNot string) error {
	if err != nil {
		return err
	}
	format := ifNot
	if done {
		format = ifDone
	}
	fmt.Fprintf(cmd.OutOrStdout(), format, cfg.Postgres.Slot)
	return nil
}
