package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/relay/sweep"
)

func newArchiveCmd() *cobra.Command {
	var dryRun, now, asJSON bool
	var waitPostponed time.Duration
	cmd := &cobra.Command{
		Use:   "archive",
		Short: "Show (--dry-run) or do (--now) partition upkeep, archival, export and deletion",
		Long: `archive runs the sweeper's maintenance once, as the relay does every 10 minutes:
partitions created ahead, rows moved out of the default partition, partitions
older than archive.after with every row processed moved into the archive table
(unprocessed ones are reported), archived partitions older than
archive.export_after exported to archive.dir or archive.s3 and dropped, exports
older than archive.delete_after deleted.

It maintains every configured table (outbox.table, or each of outboxes) with
that table's own settings (sweeper.partitions_ahead, partition_step, ...),
also those with sweeper.maintain: false (the relay leaves them to this
command), one report per table; a table of layout debezium is skipped. A
table that fails does not stop the others; the exit code is 1 if any failed.
--json prints a JSON array of the reports.

--dry-run shows what would be done and changes nothing; --now does it, waiting
for a running relay's maintenance of the same table to finish first.

A step that needs a lock another session holds (a pg_dump, a long report) is
postponed rather than queued ahead of the producers' INSERTs; --now runs the
maintenance again every 5 s until nothing is postponed, for at most
--wait-postponed (default 2m; 0: report it and return), printing each run.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dryRun == now {
				return errors.New("say --dry-run (show what would be done) or --now (do it)")
			}
			cfg, err := loadPostgresConfig(cmd)
			if err != nil {
				return err
			}
			tables, err := cfg.Tables()
			if err != nil {
				return err
			}
			log := newLogger(cfg.Log, os.Stderr)
			out := cmd.OutOrStdout()
			progress := out
			if asJSON {
				progress = io.Discard
			}
			// Every configured table, each with its own settings: with
			// sweeper.maintain: false this is all the upkeep they get. A
			// failing table does not stop the others.
			var reps []*sweep.Report
			var errs []error
			for i, t := range tables {
				if !asJSON && i > 0 {
					fmt.Fprintln(out)
				}
				if t.Layout == config.LayoutDebezium {
					rep := &sweep.Report{DryRun: dryRun, Table: t.Name.String(),
						Skipped: "layout debezium: walbox does not partition or archive Debezium's outbox table (its rows are deleted by the producer or a job)"}
					reps = append(reps, rep)
					if !asJSON {
						fmt.Fprintf(out, "walbox archive: %s\n", t.Name)
						printReport(out, rep, 0)
					}
					continue
				}
				deadline := time.Now().Add(waitPostponed)
				for {
					rep, err := archiveTable(cmd.Context(), cfg, t, log, sweep.MaintainOptions{DryRun: dryRun, Wait: true, Progress: progress}, out, asJSON)
					if rep != nil {
						reps = append(reps, rep)
					}
					if err != nil {
						errs = append(errs, fmt.Errorf("%s: %w", t.Name, err))
						break
					}
					if dryRun || rep == nil || len(rep.Postponed) == 0 || time.Now().Add(postponedPause).After(deadline) {
						break
					}
					if !asJSON {
						fmt.Fprintf(out, "waiting %s for the postponed steps (at most %s more)\n", postponedPause, time.Until(deadline).Round(time.Second))
					}
					select {
					case <-cmd.Context().Done():
						return cmd.Context().Err()
					case <-time.After(postponedPause):
					}
				}
			}
			err = errors.Join(errs...)
			if asJSON {
				if jerr := ops.WriteJSON(out, reps); jerr != nil && err == nil {
					err = jerr
				}
			}
			return err
		},
	}
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "show what would be done, change nothing")
	cmd.Flags().BoolVar(&now, "now", false, "do it now")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON (one report per table and run)")
	cmd.Flags().DurationVar(&waitPostponed, "wait-postponed", 2*time.Minute, "with --now: run again every 5 s while steps are postponed for a lock another session holds, at most this long (0: do not wait)")
	return cmd
}

// postponedPause is how long --now waits before running a table's
// maintenance again while some step is postponed.
const postponedPause = 5 * time.Second

// archiveTable runs the maintenance of table t once and, unless asJSON,
// prints its report.
func archiveTable(ctx context.Context, cfg config.Config, t config.Table, log zerolog.Logger, opts sweep.MaintainOptions, out io.Writer, asJSON bool) (*sweep.Report, error) {
	sw, err := app.NewTableSweeper(cfg, t, log, nil)
	if err != nil {
		return nil, fmt.Errorf("set up the sweeper: %w", err)
	}
	defer sw.Close()
	started := time.Now()
	if !asJSON {
		if opts.DryRun {
			fmt.Fprintf(out, "walbox archive: %s (dry run)\n", t.Name)
		} else {
			fmt.Fprintf(out, "walbox archive: maintaining %s\n", t.Name)
		}
	}
	rep, err := sw.Maintain(ctx, opts)
	if !asJSON {
		printReport(out, rep, time.Since(started))
	}
	return rep, err
}

func printReport(w io.Writer, r *sweep.Report, took time.Duration) {
	if r == nil {
		return
	}
	verb := func(done, would string) string {
		if r.DryRun {
			return would
		}
		return done
	}
	if r.Skipped != "" {
		fmt.Fprintf(w, "skipped: %s\n", r.Skipped)
		return
	}
	for _, p := range r.PartitionsCreated {
		fmt.Fprintf(w, "%s partition %s\n", verb("created", "would create"), p)
	}
	for _, m := range r.Moved {
		fmt.Fprintf(w, "%s %d rows of [%s, %s) from the default partition into %s\n", verb("moved", "would move"),
			m.Rows, m.From.Format(time.RFC3339), m.To.Format(time.RFC3339), m.Partition)
	}
	if r.DefaultRemoved != "" {
		fmt.Fprintf(w, "%s the empty default partition %s (an older walbox's: archival then detaches concurrently)\n",
			verb("removed", "would remove"), r.DefaultRemoved)
	}
	for _, p := range r.Resumed {
		fmt.Fprintf(w, "archived %s (detached by an interrupted run)\n", p)
	}
	for _, p := range r.Archived {
		fmt.Fprintf(w, "%s %s\n", verb("archived", "would archive"), p)
	}
	if r.RowsArchived > 0 {
		fmt.Fprintf(w, "%s %d rows\n", verb("archived", "would archive"), r.RowsArchived)
	}
	for _, b := range r.Blocked {
		fmt.Fprintf(w, "NOT archived: %s has %d unprocessed rows (old enough, but not all acked and marked)\n", b.Partition, b.Unprocessed)
	}
	for _, e := range r.Exported {
		if r.DryRun {
			fmt.Fprintf(w, "would export %s to %s and drop it\n", e.Partition, e.Object)
			continue
		}
		note := ""
		if e.Resumed {
			note = " (already uploaded by an interrupted run)"
		}
		fmt.Fprintf(w, "exported %s: %d rows, %.1f MB -> %s, dropped%s\n", e.Partition, e.Rows, float64(e.Bytes)/1e6, e.Object, note)
	}
	for _, d := range r.Deleted {
		fmt.Fprintf(w, "%s %s (past archive.delete_after)\n", verb("deleted", "would delete"), d)
	}
	for _, p := range r.Postponed {
		obj := ""
		if p.Object != "" {
			obj = " " + p.Object
		}
		fmt.Fprintf(w, "postponed: %s%s (%s); a later run does it, producers never wait for it\n", p.Step, obj, p.Why)
	}
	for _, e := range r.Errors {
		fmt.Fprintf(w, "FAILED: %s\n", e)
	}
	if r.Empty() {
		fmt.Fprintln(w, "nothing to do")
	}
	if !r.DryRun {
		fmt.Fprintf(w, "took %s\n", took.Round(time.Millisecond))
	}
}
