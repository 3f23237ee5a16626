package sweep

import (
	"bufio"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
)

// Journal states of an archived partition (walbox.archive_partitions.state).
const (
	stateDetaching = "detaching" // DETACH ... CONCURRENTLY started; FINALIZE completes it if it was cut short
	stateDetached  = "detached"  // out of the outbox, not yet in the archive
	stateArchived  = "archived"  // attached to the archive table
	stateMerged    = "merged"    // rows copied into an archive partition of the same range (a straggler)
	stateExported  = "exported"  // in cold storage, dropped from the database
	stateDeleted   = "deleted"   // deleted from cold storage after the retention age
	stateMissing   = "missing"   // the table disappeared behind walbox's back
)

// crashAt, when set (tests), is called between the steps of archival; an
// error stops the run there, as a crash would.
var crashAt func(step string) error

func crash(step string) error {
	if crashAt != nil {
		return crashAt(step)
	}
	return nil
}

// Blocked is a partition old enough to archive that still holds unprocessed rows.
type Blocked struct {
	Partition   string `json:"partition"`
	Unprocessed int64  `json:"unprocessed"`
}

// Export is a partition written to cold storage.
type Export struct {
	Partition string `json:"partition"`
	Object    string `json:"object"`
	Rows      int64  `json:"rows"`
	Bytes     int64  `json:"bytes"`
	Resumed   bool   `json:"resumed"` // the object was already there from an interrupted run
}

// Manifest describes one exported partition; it is written after the data
// object, so its presence means the export is complete.
type Manifest struct {
	Version int `json:"version"`
	// SystemID and Database name the database the rows come from: its
	// cluster's system identifier and its name (version 2 on; version 1
	// manifests, under the keys without them, name only the table).
	SystemID     string     `json:"system_identifier,omitempty"`
	Database     string     `json:"database,omitempty"`
	Table        string     `json:"table"`
	Partition    string     `json:"partition"`
	Object       string     `json:"object"`
	Format       string     `json:"format"`
	Rows         int64      `json:"rows"`
	Bytes        int64      `json:"bytes"`
	SHA256       string     `json:"sha256"` // of the .jsonl.gz object as stored
	RangeFrom    string     `json:"range_from"`
	RangeTo      string     `json:"range_to"`
	MinCreatedAt *time.Time `json:"min_created_at"`
	MaxCreatedAt *time.Time `json:"max_created_at"`
	ExportedAt   time.Time  `json:"exported_at"`
	// ContentSHA256 is the sha256 of the JSON Lines uncompressed (version 2
	// on): a run that finds the manifest before dropping the partition
	// compares it with the partition's rows.
	ContentSHA256 string `json:"content_sha256,omitempty"`
}

// ManifestVersion is the version of the manifests walbox writes: 2 names
// the database (system identifier, database name) in keys and manifest.
const ManifestVersion = 2

// notOf says why m is not the manifest of partition part of table t in
// database id ("" when it is). A manifest without the database's identity
// (version 1) is nobody's in particular: it is not taken as this one's.
func (m *Manifest) notOf(id dbIdentity, t, part cdc.TableName) string {
	switch {
	case m.Version < 2 || m.SystemID == "" || m.Database == "":
		return fmt.Sprintf("it is a version %d manifest that names no database", m.Version)
	case m.SystemID != id.systemID || m.Database != id.database:
		return fmt.Sprintf("it is of system %s database %s, this is %s", m.SystemID, m.Database, id)
	case m.Table != t.String() || m.Partition != part.String():
		return fmt.Sprintf("it is of partition %s of table %s, this is %s of %s", m.Partition, m.Table, part, t)
	}
	return ""
}

// journalEntry is one row of walbox.archive_partitions.
type journalEntry struct {
	name       cdc.TableName
	from, to   string
	start, end time.Time
	state      string
	maxCreated *time.Time
}

func parseName(s string) cdc.TableName {
	t, _ := cdc.ParseTableName(s)
	return t
}

// journalExists: the journal is created by migration 005 or the first
// maintenance run; a dry run before either finds none.
func journalExists(ctx context.Context, q querier) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT to_regclass('walbox.archive_partitions') IS NOT NULL`).Scan(&ok)
	return ok, err
}

func (s *Sweeper) journal(ctx context.Context, q querier, where string, args ...any) ([]journalEntry, error) {
	if ok, err := journalExists(ctx, q); err != nil || !ok {
		return nil, err
	}
	rows, err := q.Query(ctx, `SELECT partition_name, range_from, range_to, coalesce(range_start, 'epoch'), coalesce(range_end, 'epoch'), state, max_created_at
		FROM walbox.archive_partitions WHERE source = $1 AND `+where+` ORDER BY range_start, partition_name`,
		append([]any{s.cfg.Table.String()}, args...)...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []journalEntry
	for rows.Next() {
		var e journalEntry
		var name string
		if err := rows.Scan(&name, &e.from, &e.to, &e.start, &e.end, &e.state, &e.maxCreated); err != nil {
			return nil, err
		}
		e.name = parseName(name)
		out = append(out, e)
	}
	return out, rows.Err()
}

// archivePartitioned moves whole partitions out of the outbox into the
// archive: DETACH, then ATTACH to the archive table (journal: detaching,
// detached, archived). No row is copied. A partition with unprocessed rows
// stays and is reported.
//
// Without a default partition (walbox creates none) the DETACH is
// CONCURRENTLY: its first transaction takes SHARE UPDATE EXCLUSIVE, which
// INSERTs and readers do not conflict with, then it waits for the
// transactions that may still see the partition. That wait is bounded by
// lock_timeout like every maintenance statement: cut short, the partition
// stays "detach pending" (no new query sees it), the step is postponed,
// and the next run completes it with DETACH ... FINALIZE. Unprocessed rows
// are counted before (through the partial index) and again once the
// partition is out: a row that arrived in between (a producer writing an
// old created_at) puts the partition back into the outbox, so its row is
// marked and found by a backfill as before.
//
// Next to a default partition a DBA keeps, PostgreSQL refuses a concurrent
// detach: the plain DETACH takes ACCESS EXCLUSIVE on the outbox for a
// catalog change, waits at most lock_timeout for it, and recounts under it.
func (s *Sweeper) archivePartitioned(ctx context.Context, q querier, ti *tableInfo, rep *Report, opts MaintainOptions) error {
	arch := ti.table.Archive()
	parts, def, err := defaultPartition(ctx, q, ti)
	if err != nil {
		return err
	}
	if !opts.DryRun {
		// Resume: partitions a stopped run left detaching or detached.
		pending, err := s.journal(ctx, q, "state IN ($2, $3)", stateDetaching, stateDetached)
		if err != nil {
			return err
		}
		for _, e := range pending {
			if e.state == stateDetaching {
				done, err := s.finishDetach(ctx, q, ti, e, parts, rep)
				if err != nil {
					return err
				}
				if !done {
					continue
				}
			}
			if err := s.attach(ctx, q, ti, arch, e, rep); err != nil {
				return err
			}
			rep.Resumed = append(rep.Resumed, e.name.String())
		}
		if parts, err = partitions(ctx, q, ti.table, ti.partType); err != nil {
			return err
		}
	}
	var now time.Time
	if err := q.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return err
	}
	cutoff := now.Add(-s.cfg.Archive.After)
	blocked := 0
	for _, p := range parts {
		if !p.bounded || p.isDefault || p.detachPending || p.end.After(cutoff) {
			continue
		}
		n, err := countUnprocessed(ctx, q, ti, p.name)
		if err != nil {
			return err
		}
		if n > 0 {
			rep.Blocked = append(rep.Blocked, Blocked{Partition: p.name.String(), Unprocessed: n})
			blocked++
			continue
		}
		if opts.DryRun {
			rep.Archived = append(rep.Archived, p.name.String())
			continue
		}
		e := journalEntry{name: p.name, from: p.from, to: p.to, start: p.start, end: p.end}
		if def != nil {
			err = s.detachLocked(ctx, q, ti, e)
		} else {
			err = s.detachConcurrently(ctx, q, ti, e)
		}
		var eb errBlocked
		if errors.As(err, &eb) {
			rep.Blocked = append(rep.Blocked, Blocked{Partition: p.name.String(), Unprocessed: eb.n})
			blocked++
			continue
		}
		if pp, ok := postponed("archive", err); ok {
			// The next partition would wait for the same transaction:
			// leave the rest for the run that finishes this one.
			pp.Object = p.name.String()
			s.postpone(rep, pp)
			break
		}
		if err != nil {
			return fmt.Errorf("detach %s from %s: %w", p.name, ti.table, err)
		}
		if err := crash("detached"); err != nil {
			return err
		}
		if err := s.attach(ctx, q, ti, arch, e, rep); err != nil {
			return err
		}
		rep.Archived = append(rep.Archived, p.name.String())
	}
	s.m.Blocked.Set(float64(blocked))
	return nil
}

// countUnprocessed counts part's rows not marked processed (the partial
// index answers it).
func countUnprocessed(ctx context.Context, q querier, ti *tableInfo, part cdc.TableName) (int64, error) {
	var n int64
	if err := q.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s WHERE %s`, part.Quoted(), ti.unprocessed(""))).Scan(&n); err != nil {
		return 0, fmt.Errorf("count unprocessed rows of %s: %w", part, err)
	}
	return n, nil
}

// journalSet records part's archival state.
func (s *Sweeper) journalSet(ctx context.Context, q querier, e journalEntry, state string) error {
	_, err := q.Exec(ctx, `INSERT INTO walbox.archive_partitions (source, partition_name, range_from, range_to, range_start, range_end, state)
		VALUES ($1, $2, $3, $4, $5, $6, $7)
		ON CONFLICT (source, partition_name) DO UPDATE SET range_from = EXCLUDED.range_from, range_to = EXCLUDED.range_to,
		  range_start = EXCLUDED.range_start, range_end = EXCLUDED.range_end, state = EXCLUDED.state, updated_at = now()`,
		s.cfg.Table.String(), e.name.String(), e.from, e.to, e.start, e.end, state)
	if err != nil {
		return fmt.Errorf("journal %s as %s: %w", e.name, state, err)
	}
	return nil
}

// detachConcurrently takes partition e out of the outbox without a lock
// that INSERTs wait for (see archivePartitioned), journalled as detaching
// first, detached once it is out and holds no unprocessed row.
func (s *Sweeper) detachConcurrently(ctx context.Context, q querier, ti *tableInfo, e journalEntry) error {
	if err := s.journalSet(ctx, q, e, stateDetaching); err != nil {
		return err
	}
	if err := crash("detaching"); err != nil {
		return err
	}
	// Not in a transaction block: PostgreSQL runs it as two transactions.
	if _, err := q.Exec(ctx, fmt.Sprintf("ALTER TABLE %s DETACH PARTITION %s CONCURRENTLY", ti.table.Quoted(), e.name.Quoted())); err != nil {
		return err
	}
	return s.detached(ctx, q, ti, e)
}

// detached checks a partition just taken out of the outbox: no unprocessed
// row (else it goes back, and errBlocked says how many), journal detached.
func (s *Sweeper) detached(ctx context.Context, q querier, ti *tableInfo, e journalEntry) error {
	n, err := countUnprocessed(ctx, q, ti, e.name)
	if err != nil {
		return err
	}
	if n > 0 {
		// ATTACH takes SHARE UPDATE EXCLUSIVE on the outbox and scans the
		// partition to validate its bounds, under its own lock only.
		if _, err := q.Exec(ctx, fmt.Sprintf("ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%s)",
			ti.table.Quoted(), e.name.Quoted(), cdc.QuoteLiteral(e.from), cdc.QuoteLiteral(e.to))); err != nil {
			return fmt.Errorf("put %s back into %s (%d unprocessed rows arrived while it was detached): %w", e.name, ti.table, n, err)
		}
		if _, err := q.Exec(ctx, `DELETE FROM walbox.archive_partitions WHERE source = $1 AND partition_name = $2`, s.cfg.Table.String(), e.name.String()); err != nil {
			return fmt.Errorf("journal %s back in the outbox: %w", e.name, err)
		}
		s.log.Warn().Str("partition", e.name.String()).Int64("unprocessed", n).Msg("unprocessed rows arrived while the partition was detached: it is back in the outbox")
		return errBlocked{n}
	}
	return s.journalSet(ctx, q, e, stateDetached)
}

// finishDetach resumes a partition journalled as detaching: FINALIZE when
// its concurrent detach was cut short, the checks when it completed, and
// nothing when it never started (it is archived like any other). It
// reports whether the partition is out of the outbox now.
func (s *Sweeper) finishDetach(ctx context.Context, q querier, ti *tableInfo, e journalEntry, parts []partition, rep *Report) (bool, error) {
	for _, p := range parts {
		if p.name != e.name {
			continue
		}
		if !p.detachPending {
			// Still a partition: the detach never took effect.
			return false, nil
		}
		_, err := q.Exec(ctx, fmt.Sprintf("ALTER TABLE %s DETACH PARTITION %s FINALIZE", ti.table.Quoted(), e.name.Quoted()))
		if pp, ok := postponed("archive", err); ok {
			pp.Object = e.name.String()
			s.postpone(rep, pp)
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("finish detaching %s from %s: %w", e.name, ti.table, err)
		}
	}
	err := s.detached(ctx, q, ti, e)
	var eb errBlocked
	if errors.As(err, &eb) {
		rep.Blocked = append(rep.Blocked, Blocked{Partition: e.name.String(), Unprocessed: eb.n})
		return false, nil
	}
	return err == nil, err
}

// detachLocked is the detach next to a default partition: ACCESS EXCLUSIVE
// on the outbox for a catalog change (waited for at most lock_timeout), the
// recount under it served by the partial index, journal detached.
func (s *Sweeper) detachLocked(ctx context.Context, q querier, ti *tableInfo, e journalEntry) error {
	return s.inTx(ctx, q, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, fmt.Sprintf("ALTER TABLE %s DETACH PARTITION %s", ti.table.Quoted(), e.name.Quoted())); err != nil {
			return err
		}
		// Under the lock DETACH holds: nothing can have changed since.
		n, err := countUnprocessed(ctx, tx, ti, e.name)
		if err != nil {
			return err
		}
		if n > 0 {
			return errBlocked{n}
		}
		return s.journalSet(ctx, tx, e, stateDetached)
	})
}

type errBlocked struct{ n int64 }

func (e errBlocked) Error() string { return fmt.Sprintf("%d unprocessed rows", e.n) }

// attach puts a detached partition into the archive table. If the archive
// already has a partition overlapping its range (rows of an archived day
// that arrived late), the rows are copied into it instead and the table
// dropped: the archive is not in the publication, so nothing is published.
func (s *Sweeper) attach(ctx context.Context, q querier, ti *tableInfo, arch cdc.TableName, e journalEntry, rep *Report) error {
	var exists bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, e.name.Quoted()).Scan(&exists); err != nil {
		return err
	}
	if !exists {
		rep.Errors = append(rep.Errors, fmt.Sprintf("partition %s was detached for archival but no longer exists", e.name))
		_, err := q.Exec(ctx, `UPDATE walbox.archive_partitions SET state = $3, updated_at = now() WHERE source = $1 AND partition_name = $2`,
			s.cfg.Table.String(), e.name.String(), stateMissing)
		return err
	}
	aparts, err := partitions(ctx, q, arch, ti.partType)
	if err != nil {
		return err
	}
	overlap := false
	for _, p := range aparts {
		if p.bounded && p.name != e.name && p.start.Before(e.end) && e.start.Before(p.end) {
			overlap = true
		}
	}
	state := stateArchived
	err = s.inTx(ctx, q, func(tx pgx.Tx) error {
		if overlap {
			state = stateMerged
			cols := ti.columnList()
			if _, err := tx.Exec(ctx, fmt.Sprintf("INSERT INTO %s (%s) SELECT %s FROM %s", arch.Quoted(), cols, cols, e.name.Quoted())); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, fmt.Sprintf("DROP TABLE %s", e.name.Quoted())); err != nil {
				return err
			}
		} else if _, err := tx.Exec(ctx, fmt.Sprintf("ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%s)",
			arch.Quoted(), e.name.Quoted(), cdc.QuoteLiteral(e.from), cdc.QuoteLiteral(e.to))); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `UPDATE walbox.archive_partitions SET state = $3, updated_at = now() WHERE source = $1 AND partition_name = $2`,
			s.cfg.Table.String(), e.name.String(), state)
		return err
	})
	if err != nil {
		return fmt.Errorf("attach %s to %s: %w", e.name, arch, err)
	}
	s.m.Archived.Inc()
	s.log.Info().Str("partition", e.name.String()).Str("archive", arch.String()).Str("how", state).Msg("partition archived")
	return nil
}

// archiveRows moves processed rows older than the cutoff of an unpartitioned
// table (the DAARION layout) into the archive table, RowBatch rows per
// transaction: DELETE ... RETURNING feeds the INSERT.
func (s *Sweeper) archiveRows(ctx context.Context, q querier, ti *tableInfo, rep *Report, opts MaintainOptions) error {
	if ti.createdCol == "" {
		s.warn("nocreated", "outbox table has no created_at column: rows are not archived")
		return nil
	}
	arch := ti.table.Archive()
	col := cdc.QuoteIdent(ti.createdCol)
	age := fmt.Sprintf("now() - make_interval(secs => %f)", s.cfg.Archive.After.Seconds())
	var blocked int64
	if err := q.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s WHERE %s AND %s < %s`, ti.table.Quoted(), ti.unprocessed(""), col, age)).Scan(&blocked); err != nil {
		return err
	}
	if blocked > 0 {
		rep.Blocked = append(rep.Blocked, Blocked{Partition: ti.table.String(), Unprocessed: blocked})
		s.m.Blocked.Set(1)
	} else {
		s.m.Blocked.Set(0)
	}
	if opts.DryRun {
		return q.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s WHERE processed AND %s < %s`, ti.table.Quoted(), col, age)).Scan(&rep.RowsArchived)
	}
	cols := ti.columnList()
	stmt := fmt.Sprintf(`WITH moved AS (
		DELETE FROM %[1]s WHERE ctid = ANY (ARRAY(
		  SELECT ctid FROM %[1]s WHERE processed AND %[2]s < %[3]s LIMIT %[4]d FOR UPDATE SKIP LOCKED))
		RETURNING %[5]s)
		INSERT INTO %[6]s (%[5]s) SELECT %[5]s FROM moved`, ti.table.Quoted(), col, age, s.cfg.Archive.RowBatch, cols, arch.Quoted())
	pr := newProgress(opts.Progress, "archive rows of "+ti.table.String())
	for {
		tag, err := q.Exec(ctx, stmt)
		if err != nil {
			return fmt.Errorf("archive rows of %s: %w", ti.table, err)
		}
		n := tag.RowsAffected()
		rep.RowsArchived += n
		pr.update(rep.RowsArchived, 0)
		if n < int64(s.cfg.Archive.RowBatch) {
			break
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	pr.done(rep.RowsArchived, 0)
	if rep.RowsArchived > 0 {
		s.log.Info().Int64("rows", rep.RowsArchived).Str("archive", arch.String()).Msg("rows archived")
	}
	return nil
}

// exportKeys are the keys of an exported partition in cold storage:
// <system identifier>/<database>/<table>/<partition>.jsonl.gz and its
// .manifest.json.
func exportKeys(id dbIdentity, t cdc.TableName, part cdc.TableName) (data, manifest string) {
	data = objectDir(id, t) + "/" + part.Name + ".jsonl.gz"
	return data, manifestKey(data)
}

// legacyExportKeys are the keys walbox exported to before the keys named the
// database (manifest version 1): <table>/<partition>.jsonl.gz.
func legacyExportKeys(t cdc.TableName, part cdc.TableName) (data, manifest string) {
	data = legacyObjectDir(t) + "/" + part.Name + ".jsonl.gz"
	return data, manifestKey(data)
}

// manifestKey is the manifest's key beside data object key.
func manifestKey(data string) string { return strings.TrimSuffix(data, ".jsonl.gz") + ".manifest.json" }

// exportArchived exports archived partitions older than ExportAfter and
// drops them. Each partition: write the data object, then the manifest
// (its presence means complete), then DROP TABLE with the journal update in
// one transaction. A run that stopped after the upload finds the manifest
// and only drops, once the manifest names this database, table and
// partition, and its row count and content hash are the partition's: a
// manifest that is not this partition's own never makes it drop (another
// deployment sharing the store and prefix). Such a partition is refused
// with an error and the others go on.
func (s *Sweeper) exportArchived(ctx context.Context, q querier, ti *tableInfo, rep *Report, opts MaintainOptions) error {
	due, err := s.journal(ctx, q, "state = $2 AND range_end <= now() - make_interval(secs => $3)", stateArchived, s.cfg.Archive.ExportAfter.Seconds())
	if err != nil || len(due) == 0 {
		return err
	}
	id, err := readIdentity(ctx, q)
	if err != nil {
		return err
	}
	store := s.cfg.Archive.Store
	var refused []error
	for _, e := range due {
		dataKey, manKey := exportKeys(id, ti.table, e.name)
		if opts.DryRun {
			rep.Exported = append(rep.Exported, Export{Partition: e.name.String(), Object: dataKey})
			continue
		}
		var count int64
		if err := q.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FROM %s", e.name.Quoted())).Scan(&count); err != nil {
			return fmt.Errorf("count rows of %s: %w", e.name, err)
		}
		ex := Export{Partition: e.name.String(), Object: dataKey}
		var man Manifest
		raw, err := store.Get(ctx, manKey)
		switch {
		case err == nil:
			if err := json.Unmarshal(raw, &man); err != nil {
				return fmt.Errorf("manifest %s in %s is unreadable: %w (remove it to export again)", manKey, store, err)
			}
			if why := man.notOf(id, ti.table, e.name); why != "" {
				refused = append(refused, fmt.Errorf("manifest %s in %s is not this partition's (%s): not dropping %s, not overwriting; give each deployment its own archive prefix",
					manKey, store, why, e.name))
				continue
			}
			if man.Rows != count {
				refused = append(refused, fmt.Errorf("manifest %s in %s says %d rows of %s, the partition has %d: not overwriting; check and remove it to export again",
					manKey, store, man.Rows, man.Partition, count))
				continue
			}
			// The manifest is of this partition's name: that its object
			// holds these rows, only their hash says.
			sum, err := s.contentHash(ctx, q, ti, e)
			if err != nil {
				return err
			}
			if sum != man.ContentSHA256 {
				refused = append(refused, fmt.Errorf("manifest %s in %s names %s, but the rows it describes are not the partition's (content sha256 %s, the partition's %s): not dropping, not overwriting; a copy of this database (same system identifier and name) may share the archive prefix: give it its own",
					manKey, store, e.name, man.ContentSHA256, sum))
				continue
			}
			ex.Resumed = true
		case errors.Is(err, ErrNotExist):
			if _, lman := legacyExportKeys(ti.table, e.name); objectExists(ctx, store, lman) {
				s.log.Warn().Str("partition", e.name.String()).Str("legacy_manifest", lman).Str("object", dataKey).
					Msg("an export of this partition's name exists under the keys without the database's identity: it is not taken as this database's, the partition is exported again under its own keys; remove the old object once you know whose it is")
			}
			man, err = s.export(ctx, q, ti, e, id, dataKey, opts)
			if err != nil {
				return err
			}
			if man.Rows != count {
				return fmt.Errorf("exported %d rows of %s, but it holds %d", man.Rows, e.name, count)
			}
			if err := crash("uploaded-data"); err != nil {
				return err
			}
			mb, _ := json.MarshalIndent(man, "", "  ")
			if err := store.Put(ctx, manKey, bytesReader(mb), int64(len(mb))); err != nil {
				return fmt.Errorf("write manifest: %w", err)
			}
			s.m.RowsExported.Add(float64(man.Rows))
		default:
			return err
		}
		ex.Rows, ex.Bytes = man.Rows, man.Bytes
		if err := crash("exported"); err != nil {
			return err
		}
		maxCreated := man.MaxCreatedAt
		if maxCreated == nil {
			maxCreated = &e.end
		}
		err = s.inTx(ctx, q, func(tx pgx.Tx) error {
			// DROP takes ACCESS EXCLUSIVE on the archive table (never on the
			// outbox), waited for at most the session's lock_timeout.
			if _, err := tx.Exec(ctx, fmt.Sprintf("DROP TABLE %s", e.name.Quoted())); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE walbox.archive_partitions SET state = $3, rows = $4, bytes = $5, sha256 = $6, object = $7,
				min_created_at = $8, max_created_at = $9, updated_at = now() WHERE source = $1 AND partition_name = $2`,
				s.cfg.Table.String(), e.name.String(), stateExported, man.Rows, man.Bytes, man.SHA256, dataKey, man.MinCreatedAt, maxCreated)
			return err
		})
		if err != nil {
			return fmt.Errorf("drop exported partition %s: %w", e.name, err)
		}
		s.m.Exported.Inc()
		rep.Exported = append(rep.Exported, ex)
		s.log.Info().Str("partition", e.name.String()).Str("object", dataKey).Str("store", store.String()).Int64("rows", man.Rows).
			Int64("bytes", man.Bytes).Bool("resumed", ex.Resumed).Msg("partition exported to cold storage and dropped")
	}
	return errors.Join(refused...)
}

// objectExists reports whether store holds key (an error reading it: no).
func objectExists(ctx context.Context, store ColdStore, key string) bool {
	_, err := store.Get(ctx, key)
	return err == nil
}

// export streams a partition as gzip-compressed JSON Lines (one object per
// row, row_to_json) into a temporary file, hashing it on the way (the
// object as stored, and its content uncompressed), then uploads the file.
func (s *Sweeper) export(ctx context.Context, q querier, ti *tableInfo, e journalEntry, id dbIdentity, dataKey string, opts MaintainOptions) (Manifest, error) {
	man := Manifest{Version: ManifestVersion, SystemID: id.systemID, Database: id.database, Table: ti.table.String(), Partition: e.name.String(),
		Object: dataKey, Format: "jsonl.gz", RangeFrom: e.from, RangeTo: e.to}
	tmp, err := os.CreateTemp("", "walbox-export-*.jsonl.gz")
	if err != nil {
		return man, err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	h, ch := sha256.New(), sha256.New()
	cw := &countWriter{w: io.MultiWriter(tmp, h)}
	zw, _ := gzip.NewWriterLevel(cw, gzip.DefaultCompression)
	bw := bufio.NewWriterSize(io.MultiWriter(zw, ch), 256<<10)
	pr := newProgress(opts.Progress, "export "+e.name.String())
	if err := s.dumpPartition(ctx, q, ti, e, bw, &man, func(rows int64) { pr.update(rows, cw.n) }); err != nil {
		return man, err
	}
	if err := bw.Flush(); err != nil {
		return man, err
	}
	if err := zw.Close(); err != nil {
		return man, err
	}
	pr.done(man.Rows, cw.n)
	man.Bytes = cw.n
	man.SHA256 = hex.EncodeToString(h.Sum(nil))
	man.ContentSHA256 = hex.EncodeToString(ch.Sum(nil))
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return man, err
	}
	if err := s.cfg.Archive.Store.Put(ctx, dataKey, tmp, man.Bytes); err != nil {
		return man, fmt.Errorf("upload %s: %w", dataKey, err)
	}
	man.ExportedAt = time.Now().UTC()
	return man, nil
}

// contentHash is the sha256 of partition e's rows as export writes them,
// uncompressed (Manifest.ContentSHA256).
func (s *Sweeper) contentHash(ctx context.Context, q querier, ti *tableInfo, e journalEntry) (string, error) {
	h := sha256.New()
	bw := bufio.NewWriterSize(h, 256<<10)
	var man Manifest
	if err := s.dumpPartition(ctx, q, ti, e, bw, &man, func(int64) {}); err != nil {
		return "", err
	}
	if err := bw.Flush(); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// dumpPartition writes partition e's rows to w as JSON Lines and sets man's
// rows and min/max created_at. It reads in one REPEATABLE READ transaction,
// so the count, the bounds and the rows agree, with synchronized scans off:
// a scan then starts at the table's first page, and two reads of unchanged
// rows give the same bytes (contentHash compares them). progress is called
// now and then with the rows written so far.
func (s *Sweeper) dumpPartition(ctx context.Context, q querier, ti *tableInfo, e journalEntry, w io.Writer, man *Manifest, progress func(rows int64)) error {
	b, ok := q.(txStarter)
	if !ok {
		return errors.New("internal: export needs a connection")
	}
	tx, err := b.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "SET LOCAL synchronize_seqscans = off"); err != nil {
		return err
	}
	// The read of a whole partition may take longer than the maintenance
	// session's statement_timeout; it holds ACCESS SHARE on the archived
	// partition only.
	if _, err := tx.Exec(ctx, "SET LOCAL statement_timeout = 0"); err != nil {
		return err
	}
	col := ti.partCol
	if col == "" {
		col = ti.createdCol
	}
	var minC, maxC *time.Time
	if err := tx.QueryRow(ctx, fmt.Sprintf("SELECT min(%[1]s)::timestamptz, max(%[1]s)::timestamptz FROM %[2]s", cdc.QuoteIdent(col), e.name.Quoted())).Scan(&minC, &maxC); err != nil {
		return fmt.Errorf("export %s: %w", e.name, err)
	}
	man.MinCreatedAt, man.MaxCreatedAt = minC, maxC
	rows, err := tx.Query(ctx, fmt.Sprintf("SELECT row_to_json(t)::text FROM %s t", e.name.Quoted()), pgx.QueryResultFormats{pgx.TextFormatCode})
	if err != nil {
		return fmt.Errorf("export %s: %w", e.name, err)
	}
	nl := []byte{'\n'}
	for rows.Next() {
		raw := rows.RawValues()
		if len(raw) != 1 {
			rows.Close()
			return errors.New("export: unexpected row shape")
		}
		if _, err := w.Write(raw[0]); err != nil {
			rows.Close()
			return fmt.Errorf("export %s: %w", e.name, err)
		}
		if _, err := w.Write(nl); err != nil {
			rows.Close()
			return fmt.Errorf("export %s: %w", e.name, err)
		}
		man.Rows++
		if man.Rows&0x3fff == 0 {
			progress(man.Rows)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("export %s: %w", e.name, err)
	}
	return tx.Commit(ctx)
}

// deleteExpired deletes exports whose newest row is older than DeleteAfter,
// judged by the manifest: the data object first, then the manifest, so a
// crash in between is finished by the next run. An export is found at the
// key the journal recorded (one written before the keys named the database
// is under the old key) and deleted only when its manifest is this
// database's: a version 2 manifest names this system, database, table and
// partition, and every manifest's sha256 and rows are those the journal
// recorded when this database exported it. Any other is refused with an
// error, and the others go on.
func (s *Sweeper) deleteExpired(ctx context.Context, q querier, ti *tableInfo, rep *Report, opts MaintainOptions) error {
	due, err := s.journal(ctx, q, "state = $2 AND coalesce(max_created_at, range_end) < now() - make_interval(secs => $3)",
		stateExported, s.cfg.Archive.DeleteAfter.Seconds())
	if err != nil || len(due) == 0 {
		return err
	}
	id, err := readIdentity(ctx, q)
	if err != nil {
		return err
	}
	var now time.Time
	if err := q.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return err
	}
	store := s.cfg.Archive.Store
	var refused []error
	for _, e := range due {
		var object, sum string
		var rows int64
		if err := q.QueryRow(ctx, `SELECT coalesce(object, ''), coalesce(sha256, ''), coalesce(rows, -1) FROM walbox.archive_partitions WHERE source = $1 AND partition_name = $2`,
			s.cfg.Table.String(), e.name.String()).Scan(&object, &sum, &rows); err != nil {
			return fmt.Errorf("read the journal's export of %s: %w", e.name, err)
		}
		dataKey, manKey := exportKeys(id, ti.table, e.name)
		if object != "" {
			dataKey, manKey = object, manifestKey(object)
		}
		raw, err := store.Get(ctx, manKey)
		switch {
		case errors.Is(err, ErrNotExist):
			// Deleted already (the manifest goes last).
		case err != nil:
			return err
		default:
			var man Manifest
			if err := json.Unmarshal(raw, &man); err != nil {
				return fmt.Errorf("manifest %s in %s is unreadable: %w", manKey, store, err)
			}
			why := ""
			if man.Version >= 2 {
				why = man.notOf(id, ti.table, e.name)
			}
			if why == "" && (sum == "" || man.SHA256 != sum || man.Rows != rows) {
				why = fmt.Sprintf("its sha256 %s and %d rows are not those this database exported (%s, %d rows)", man.SHA256, man.Rows, sum, rows)
			}
			if why != "" {
				refused = append(refused, fmt.Errorf("manifest %s in %s is not this database's export of %s (%s): not deleting it", manKey, store, e.name, why))
				continue
			}
			newest := e.end
			if man.MaxCreatedAt != nil {
				newest = *man.MaxCreatedAt
			}
			if !newest.Before(now.Add(-s.cfg.Archive.DeleteAfter)) {
				continue // the manifest disagrees with the journal: keep it
			}
			if opts.DryRun {
				rep.Deleted = append(rep.Deleted, dataKey)
				continue
			}
			if err := store.Delete(ctx, dataKey); err != nil {
				return err
			}
			if err := store.Delete(ctx, manKey); err != nil {
				return err
			}
		}
		if opts.DryRun {
			continue
		}
		if _, err := q.Exec(ctx, `UPDATE walbox.archive_partitions SET state = $3, updated_at = now() WHERE source = $1 AND partition_name = $2`,
			s.cfg.Table.String(), e.name.String(), stateDeleted); err != nil {
			return err
		}
		rep.Deleted = append(rep.Deleted, dataKey)
		s.log.Info().Str("object", dataKey).Str("store", store.String()).Msg("export past the retention age deleted")
	}
	return errors.Join(refused...)
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
