package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
)

func newDLQCmd() *cobra.Command {
	return newGroupCmd("dlq", "List or retry dead letters (stream nats.dlq.stream, WALBOX_DLQ by default; with sink: kafka, topic kafka.dlq_topic)",
		newDLQListCmd(), newDLQRetryCmd())
}

func newDLQListCmd() *cobra.Command {
	var limit int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List dead letters: seq, time, original subject, event id, reason",
		Long: `list shows the dead letters oldest first: sequence, time, original subject
(topic), event id and reason.

With sink: kafka it reads the topic kafka.dlq_topic with a consumer of its
own; SEQ is the record's offset + 1 (walbox's sequences start at 1, as
JetStream's), and dead letters walbox dlq retry republished are not shown.`,
		RunE: withConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			dls, total, err := ops.DLQList(cmd.Context(), cfg, limit)
			if err != nil {
				return err
			}
			if asJSON {
				if dls == nil {
					dls = []ops.DeadLetter{}
				}
				return writeJSONOut(cmd, map[string]any{"stream": ops.DLQName(cfg), "total": total, "dead_letters": dls})
			}
			ops.PrintDeadLetters(cmd.OutOrStdout(), dls, total, ops.DLQName(cfg))
			return nil
		}),
	}
	cmd.Flags().IntVar(&limit, "limit", 100, "show at most this many, oldest first (0: all)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	return cmd
}

func newDLQRetryCmd() *cobra.Command {
	var opts ops.DLQRetryOptions
	var seqs []uint
	var retryJSON bool
	cmd := &cobra.Command{
		Use:   "retry --seq N ... | --all",
		Short: "Republish dead letters to their original subject and delete them from the DLQ",
		Long: `retry republishes dead letters to their original subject with their original
event id (Nats-Msg-Id), when a stream now captures that subject (e.g. after
you added it to nats.streams), and deletes each from the dead-letter stream
once JetStream acked it. One whose subject no stream captures, whose payload
was dropped or is not JSON, or that has no id, is reported and left in place.
It asks for confirmation unless --yes.

The outbox row keeps its error column; walbox replay --id ID republishes
from the row instead (e.g. after fixing its topic).

With sink: kafka a dead letter goes back to its original topic (which must
be in kafka.topics) under its event id (Walbox-Event-Id), and, as Kafka
cannot delete one record, is marked instead of deleted: a marker record
(header Walbox-Dlq-Retried: <offset>) in the dead-letter topic hides it from
list and retry, and the consumer group walbox-dlq's committed offset moves
past the retried ones that precede the first one left. --seq is offset + 1.`,
		Args: cobra.NoArgs,
		RunE: withConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			for _, s := range seqs {
				opts.Seqs = append(opts.Seqs, uint64(s))
			}
			opts.In, opts.Out, opts.TTY = cmd.InOrStdin(), cmd.OutOrStdout(), isTerminal(cmd.OutOrStdout())
			if retryJSON {
				opts.Out = io.Discard // the lines would mix with the JSON
				if !opts.Yes {
					return fmt.Errorf("--json needs --yes: there is no prompt to answer")
				}
			}
			res, err := ops.DLQRetry(cmd.Context(), cfg, opts)
			if res != nil && err == nil {
				if retryJSON {
					return writeJSONOut(cmd, res)
				}
				if cfg.Sink == config.SinkKafka {
					fmt.Fprintf(cmd.OutOrStdout(), "retried %d, skipped %d\n", res.Retried, res.Skipped)
				} else {
					fmt.Fprintf(cmd.OutOrStdout(), "retried %d, already in their stream %d, skipped %d\n", res.Retried, res.AlreadyStored, res.Skipped)
				}
			}
			return err
		}),
	}
	cmd.Flags().UintSliceVar(&seqs, "seq", nil, "dead letter sequence numbers in the DLQ stream, or offset + 1 in the DLQ topic (repeatable, or comma-separated)")
	cmd.Flags().BoolVar(&opts.All, "all", false, "retry every dead letter")
	cmd.Flags().BoolVar(&retryJSON, "json", false, "print the counts as JSON (needs --yes)")
	cmd.Flags().BoolVar(&opts.Yes, "yes", false, "do not ask for confirmation")
	return cmd
}

func writeJSONOut(cmd *cobra.Command, v any) error {
	return ops.WriteJSON(cmd.OutOrStdout(), v)
}
