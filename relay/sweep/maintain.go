package sweep

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/fault"
)

// Report says what one maintenance run did (or, in a dry run, would do).
type Report struct {
	DryRun bool   `json:"dry_run"`
	Table  string `json:"table"`
	// Skipped is set when another walbox was maintaining the table.
	Skipped string `json:"skipped"`
	// PartitionsCreated are the partitions created ahead.
	PartitionsCreated []string `json:"partitions_created"`
	// Moved are the ranges moved out of the default partition.
	Moved []RangeMove `json:"moved"`
	// DefaultRemoved is the empty default partition an older walbox created,
	// removed (docs/sweeper.md, The default partition).
	DefaultRemoved string `json:"default_removed,omitempty"`
	// Resumed are partitions a stopped run had detached, attached now.
	Resumed []string `json:"resumed"`
	// Archived are the partitions moved into the archive table.
	Archived []string `json:"archived"`
	// RowsArchived counts rows moved (unpartitioned tables).
	RowsArchived int64 `json:"rows_archived"`
	// Blocked are partitions old enough that still hold unprocessed rows.
	Blocked []Blocked `json:"blocked"`
	// Exported are partitions written to cold storage and dropped.
	Exported []Export `json:"exported"`
	// Deleted are cold-storage objects deleted after the retention age.
	Deleted []string `json:"deleted"`
	// Postponed are the steps that needed a lock another session held (a
	// long reader, a pg_dump): not done now, retried within a minute, and
	// never waited for while producers queue behind the wait.
	Postponed []Postponed `json:"postponed"`
	// Errors are the steps that failed; the others still ran.
	Errors []string `json:"errors"`
}

// Postponed is a maintenance step left for a later run.
type Postponed struct {
	Step   string `json:"step"`
	Object string `json:"object"`
	Why    string `json:"why"`
}

// Empty reports whether the run found nothing to do.
func (r *Report) Empty() bool {
	return len(r.PartitionsCreated) == 0 && len(r.Moved) == 0 && len(r.Resumed) == 0 && len(r.Archived) == 0 &&
		r.RowsArchived == 0 && len(r.Blocked) == 0 && len(r.Exported) == 0 && len(r.Deleted) == 0 && len(r.Errors) == 0 &&
		len(r.Postponed) == 0 && r.DefaultRemoved == ""
}

func (r *Report) log(l zerolog.Logger) {
	if r.Skipped != "" {
		l.Debug().Str("why", r.Skipped).Msg("maintenance skipped")
		return
	}
	for _, b := range r.Blocked {
		l.Warn().Str("partition", b.Partition).Int64("unprocessed", b.Unprocessed).
			Msg("not archived: rows not marked processed (walbox_archive_blocked_partitions)")
	}
	for _, p := range r.Postponed {
		l.Debug().Str("step", p.Step).Str("object", p.Object).Str("why", p.Why).Msg("maintenance step postponed")
	}
	if len(r.PartitionsCreated)+len(r.Moved)+len(r.Archived)+len(r.Exported)+len(r.Deleted)+len(r.Resumed) > 0 || r.RowsArchived > 0 {
		l.Info().Int("partitions_created", len(r.PartitionsCreated)).Int("default_ranges_moved", len(r.Moved)).
			Int("archived", len(r.Archived)+len(r.Resumed)).Int64("rows_archived", r.RowsArchived).Int("exported", len(r.Exported)).
			Int("deleted", len(r.Deleted)).Msg("maintenance done")
	}
}

// lockKey is the advisory lock that serializes maintenance of one table
// across processes (relays and `walbox archive`).
func lockKey(table string) int64 {
	h := fnv.New64a()
	h.Write([]byte("walbox.sweep/" + table))
	return int64(h.Sum64() >> 1)
}

// Maintain runs the maintenance steps once: partitions ahead, rows out of
// the default partition, archival, export and deletion. A step that fails
// is reported and the later ones still run (an export does not wait for a
// partition DDL problem); the error joins the failures.
func (s *Sweeper) Maintain(ctx context.Context, opts MaintainOptions) (*Report, error) {
	s.maint.Lock()
	defer s.maint.Unlock()
	rep := &Report{DryRun: opts.DryRun, Table: s.cfg.Table.String()}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return rep, err
	}
	defer conn.Release()
	if !opts.DryRun {
		key := lockKey(s.cfg.Table.String())
		if opts.Wait {
			if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", key); err != nil {
				return rep, err
			}
		} else {
			var ok bool
			if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", key).Scan(&ok); err != nil {
				return rep, err
			}
			if !ok {
				rep.Skipped = "another walbox is maintaining " + s.cfg.Table.String()
				return rep, nil
			}
		}
		defer func() {
			uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if _, err := conn.Exec(uctx, "SELECT pg_advisory_unlock($1)", key); err != nil {
				conn.Conn().Close(uctx) // the session (and its lock) ends with the connection
			}
		}()
	}
	// No maintenance statement waits long for a lock: a waiting lock
	// request queues every later conflicting one (a producer's INSERT behind
	// an ACCESS EXCLUSIVE request), so each gives up after LockTimeout and
	// the step is retried later. StatementTimeout bounds the rest (the
	// export, which reads a whole partition, lifts it for its read).
	if _, err := conn.Exec(ctx, fmt.Sprintf("SET lock_timeout = %d; SET statement_timeout = %d",
		s.cfg.LockTimeout.Milliseconds(), s.cfg.StatementTimeout.Milliseconds())); err != nil {
		return rep, fmt.Errorf("set the maintenance session's timeouts: %w", err)
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, err := conn.Exec(uctx, "RESET lock_timeout; RESET statement_timeout"); err != nil {
			conn.Conn().Close(uctx) // never hand a pooled session with these settings to the marks
		}
	}()
	ti, err := inspect(ctx, conn, s.cfg.Table, s.cfg.Columns)
	if err != nil {
		return rep, err
	}
	s.info.Store(ti)

	var errs []error
	step := func(name string, f func() error) {
		if ctx.Err() != nil {
			return
		}
		if err := f(); err != nil {
			if p, ok := postponed(name, err); ok {
				s.postpone(rep, p)
				return
			}
			rep.Errors = append(rep.Errors, name+": "+err.Error())
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		}
	}
	archiving := s.cfg.Archive.After > 0
	exporting := archiving && s.cfg.Archive.ExportAfter > 0 && s.cfg.Archive.Store != nil
	if !opts.DryRun && archiving {
		step("archive table", func() error { _, err := ensureArchive(ctx, conn, ti); return err })
	}
	step("partitions", func() error { return s.ensurePartitions(ctx, conn, ti, rep, opts) })
	step("default partition", func() error {
		n := len(rep.Moved)
		if err := s.moveDefault(ctx, conn, ti, rep, opts); err != nil {
			return err
		}
		if len(rep.Moved) > n && !opts.DryRun {
			// Ranges ensure_partitions skipped for the rows in default.
			if err := s.ensurePartitions(ctx, conn, ti, rep, opts); err != nil {
				return err
			}
		}
		return s.removeDefault(ctx, conn, ti, rep, opts)
	})
	if archiving {
		if !ti.processed {
			s.warn("noarchive", "outbox table has no boolean processed column: nothing is archived (archival moves only processed rows)")
		} else if ti.partitioned {
			step("archive", func() error { return s.archivePartitioned(ctx, conn, ti, rep, opts) })
		} else {
			step("archive", func() error { return s.archiveRows(ctx, conn, ti, rep, opts) })
		}
	}
	if exporting && ti.partitioned {
		step("export", func() error { return s.exportArchived(ctx, conn, ti, rep, opts) })
	}
	if exporting && s.cfg.Archive.DeleteAfter > 0 {
		step("delete", func() error { return s.deleteExpired(ctx, conn, ti, rep, opts) })
	}
	if err := ctx.Err(); err != nil {
		errs = append(errs, err)
	}
	return rep, errors.Join(errs...)
}

// progress prints a line now and then during a long step.
type progress struct {
	w       io.Writer
	what    string
	started time.Time
	last    time.Time
}

func newProgress(w io.Writer, what string) *progress {
	now := time.Now()
	return &progress{w: w, what: what, started: now, last: now}
}

func (p *progress) update(rows, bytes int64) {
	if p.w == nil || time.Since(p.last) < 2*time.Second {
		return
	}
	p.last = time.Now()
	p.line(rows, bytes, "…")
}

func (p *progress) done(rows, bytes int64) {
	if p.w == nil || time.Since(p.started) < 2*time.Second {
		return
	}
	p.line(rows, bytes, "done")
}

func (p *progress) line(rows, bytes int64, state string) {
	el := time.Since(p.started)
	var b strings.Builder
	fmt.Fprintf(&b, "  %s: %d rows", p.what, rows)
	if bytes > 0 {
		fmt.Fprintf(&b, ", %.1f MB", float64(bytes)/1e6)
	}
	fmt.Fprintf(&b, ", %s (%.0f rows/s) %s\n", el.Round(100*time.Millisecond), float64(rows)/el.Seconds(), state)
	io.WriteString(p.w, b.String())
}

func bytesReader(b []byte) io.Reader { return bytes.NewReader(b) }

// errPostpone is a step's own decision to wait for a better moment.
type errPostpone struct{ object, why string }

func (e errPostpone) Error() string { return e.object + ": " + e.why }

// postponed reports whether err means the step could not take a lock in
// time (lock_timeout), ran past statement_timeout waiting for one (DETACH
// ... CONCURRENTLY waits for older transactions), or decided to wait
// itself: nothing is wrong, a later run does it.
func postponed(step string, err error) (Postponed, bool) {
	var ep errPostpone
	if errors.As(err, &ep) {
		return Postponed{Step: step, Object: ep.object, Why: ep.why}, true
	}
	switch fault.SQLState(err) {
	case fault.LockNotAvailable:
		return Postponed{Step: step, Why: "another session holds a lock it needs (lock_timeout): " + err.Error()}, true
	case fault.QueryCanceled:
		return Postponed{Step: step, Why: "waited past statement_timeout: " + err.Error()}, true
	}
	return Postponed{}, false
}

// postpone records a postponed step: in the report, counted, and logged
// once per step and object in this process (it is retried every
// PostponedRetry until it is done).
func (s *Sweeper) postpone(rep *Report, p Postponed) {
	rep.Postponed = append(rep.Postponed, p)
	s.m.Postponed.WithLabelValues(p.Step).Inc()
	s.warn("postponed/"+p.Step+"/"+p.Object, fmt.Sprintf("maintenance step %q of %s postponed (retried every %s; producers never wait for it): %s",
		p.Step, s.cfg.Table, s.cfg.PostponedRetry, p.Why))
}
