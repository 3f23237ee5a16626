package main

import (
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
)

func newTailCmd() *cobra.Command {
	var opts ops.TailOptions
	cmd := &cobra.Command{
		Use:   "tail SUBJECT",
		Short: "Show events as JetStream stores them, with their commit-to-ack latency",
		Long: `tail prints every message stored under SUBJECT (wildcards * and > allowed;
with nats.subject_prefix when one is configured) as JetStream stores it:
stored time, subject, event id, commit-to-ack latency (stored time minus the
Walbox-Commit-Time header) and the payload, cut at 80 characters unless
--full. It reads through an ephemeral ordered consumer and changes nothing.

Only new messages by default; --since 5m starts with those stored in the last
5 minutes. Ctrl-C stops it; --limit N stops after N messages.

With sink: kafka, SUBJECT is a topic name, exactly (no wildcards): tail reads
every partition of it with a consumer of its own (no group, nothing
committed); the stored time is the record's timestamp, the latency that
minus Walbox-Commit-Time, and --since starts at the first offsets stored
that long ago.`,
		Example: `  walbox tail 'orders.>'
  walbox tail payments.settled --since 1h --full
  walbox tail walbox.dlq --since 24h     # sink: kafka: a topic name`,
		Args: cobra.ExactArgs(1),
		RunE: withConfig(func(cmd *cobra.Command, args []string, cfg config.Config) error {
			opts.Subject = args[0]
			_, err := ops.Tail(cmd.Context(), cfg, opts, cmd.OutOrStdout())
			return err
		}),
	}
	f := cmd.Flags()
	f.DurationVar(&opts.Since, "since", 0, "start with the messages stored this long ago (default: only new ones)")
	f.BoolVar(&opts.Full, "full", false, "print whole payloads")
	f.StringVar(&opts.Stream, "stream", "", "stream to read (default: the one capturing SUBJECT; not with sink: kafka)")
	f.IntVar(&opts.Limit, "limit", 0, "exit after this many messages (0: until Ctrl-C)")
	return cmd
}
