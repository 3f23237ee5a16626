package main

import (
	"time"

	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/ops"
)

func newReplayCmd() *cobra.Command {
	var opts ops.ReplayOptions
	var from, to string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "replay --from T --to T [--topic PATTERN] [--id ID ...]",
		Short: "Republish outbox (or archived) events by time range, topic and id",
		Long: `replay republishes rows of the outbox table (--archive: of the archive table
walbox.<table>_archive) with created_at in [--from, --to), whose topic matches
--topic (a NATS-style pattern: * one token, > the rest) and, with --id, only
those ids, in created_at, id order. They go through the relay's router: the
same subjects, headers, subject prefix and stream checks as live publishing;
an event the router rejects is dead-lettered, as the relay would.

By default every event keeps its id (Nats-Msg-Id), so replay only fills gaps:
it first reads back which ids the streams hold (--no-check skips that) and
skips those, and JetStream drops the rest of the copies inside its duplicate
window. The read-back takes the subjects the table's own subject_template
(or layout) gives --topic, and matches this database's source, the table and
the id. --force-new-id delivers events again on purpose: Nats-Msg-Id becomes
<id>.replay.<unix-nanos> and the header Walbox-Replay-Of carries the id.

With sink: kafka, events go to their topics through the relay's producer
(idempotent, acks=all, the same keys), and the check reads the topics'
Walbox-Event-Id headers from the first records stored since the oldest
selected row's created_at (less a minute). Kafka drops no duplicate itself:
--no-check then publishes every selected event again.

Times: RFC 3339 (2024-05-01T12:00:00Z), 2024-05-01 12:00, 2024-05-01 (local
time), now, or a duration ago (90m). --to defaults to now.`,
		Example: `  walbox replay --from 2024-05-01 --to 2024-05-02 --dry-run
  walbox replay --from 2h --topic 'orders.>'
  walbox replay --id 0190f1c2-... --id 0190f1c3-... --force-new-id
  walbox replay --archive --from 2024-01-01 --to 2024-02-01 --topic 'payments.*'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := loadConfig(cmd)
			if err != nil {
				return err
			}
			now := time.Now()
			if opts.From, err = ops.ParseTime(from, now); err != nil {
				return err
			}
			if to == "" && from != "" {
				to = "now"
			}
			if opts.To, err = ops.ParseTime(to, now); err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			opts.Progress, opts.TTY = cmd.ErrOrStderr(), isTerminal(cmd.ErrOrStderr())
			res, err := ops.Replay(cmd.Context(), cfg, opts)
			if res != nil {
				if asJSON {
					if jerr := ops.WriteJSON(out, res); jerr != nil && err == nil {
						err = jerr
					}
				} else {
					res.Print(out)
				}
			}
			return err
		},
	}
	f := cmd.Flags()
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.StringVar(&from, "from", "", "created_at from (inclusive)")
	f.StringVar(&to, "to", "", "created_at to (exclusive; default now)")
	f.StringVar(&opts.Topic, "topic", "", "only topics matching this NATS-style pattern (orders.*, payments.>)")
	f.StringSliceVar(&opts.IDs, "id", nil, "only these event ids (repeatable, or comma-separated)")
	f.StringVar(&opts.Table, "table", "", "the outbox table to replay from, schema.table (with several in outboxes; default: the default one)")
	f.BoolVar(&opts.Archive, "archive", false, "read the archive table walbox.<table>_archive instead of the outbox")
	f.BoolVar(&opts.ForceNewID, "force-new-id", false, "publish under new ids (<id>.replay.<nanos>, header Walbox-Replay-Of) to deliver again")
	f.BoolVar(&opts.NoCheck, "no-check", false, "do not read back the streams' (topics') ids first (only the duplicate window then stops copies; Kafka has none)")
	f.BoolVar(&opts.DryRun, "dry-run", false, "count what would be published; publish nothing")
	return cmd
}
