// Package sql holds walbox's DDL: numbered migration files embedded in the
// binary. `walbox migrate` applies them; `walbox migrate --print` prints them
// for a DBA who applies DDL by hand.
package sql

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
)

//go:embed *.sql
var files embed.FS

// Params names the objects the migrations create.
type Params struct {
	Schema      string // schema of the outbox table (default public)
	Table       string // outbox table name (default outbox_events)
	Publication string // publication name (default walbox_outbox)
	// Emit are the outbox tables walbox.emit can write to, the first the
	// default; empty: the table above, with walbox's column names.
	Emit []EmitTable
}

// EmitTable is an outbox table walbox.emit writes to: its name and, by
// role (id, topic, payload, event_type, aggregate_type, aggregate_id,
// partition_key, headers), its column names; an unmapped role is left out.
type EmitTable struct {
	Table   cdc.TableName
	Columns cdc.Columns
}

// emitValues is what walbox.emit inserts for each role.
var emitValues = map[cdc.Role]string{
	cdc.RoleID: "new_id", cdc.RoleTopic: "emit.topic", cdc.RolePayload: "emit.payload", cdc.RoleEventType: "emit.event_type",
	cdc.RoleAggregateType: "emit.aggregate_type", cdc.RoleAggregateID: "emit.aggregate_id",
	cdc.RolePartitionKey: "coalesce(emit.partition_key, emit.aggregate_id)", cdc.RoleHeaders: "emit.headers",
}

// emitColumnsThatExist leaves out of each existing table's roles those
// whose column the table does not have (a role keeps its default name
// unless mapped, and an existing table need not have them all). A table
// that does not exist yet is created by migration 002 with every column.
func emitColumnsThatExist(ctx context.Context, conn *pgx.Conn, tables []EmitTable) ([]EmitTable, error) {
	out := slices.Clone(tables)
	for i, t := range out {
		rows, err := conn.Query(ctx, `SELECT attname::text FROM pg_attribute
			WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped`, t.Table.Quoted())
		if err != nil {
			return nil, fmt.Errorf("read columns of %s: %w", t.Table, err)
		}
		have, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("read columns of %s: %w", t.Table, err)
		}
		if len(have) == 0 {
			continue
		}
		for r, col := range t.Columns {
			if col != "" && !slices.Contains(have, col) {
				out[i].Columns[r] = ""
			}
		}
	}
	return out, nil
}

// emitInserts renders walbox.emit's dispatch: one INSERT per table, picked
// by the name in target.
func emitInserts(tables []EmitTable) string {
	var b strings.Builder
	for i, t := range tables {
		kw := "ELSIF"
		if i == 0 {
			kw = "IF"
		}
		var cols, vals []string
		for _, r := range []cdc.Role{cdc.RoleID, cdc.RoleTopic, cdc.RolePayload, cdc.RoleEventType, cdc.RoleAggregateType,
			cdc.RoleAggregateID, cdc.RolePartitionKey, cdc.RoleHeaders} {
			col := t.Columns[r]
			if col == "" || slices.Contains(cols, quoteIdent(col)) {
				continue // unmapped, or a column that already takes another role
			}
			cols = append(cols, quoteIdent(col))
			vals = append(vals, emitValues[r])
		}
		fmt.Fprintf(&b, "    %s target = %s THEN\n        INSERT INTO %s (%s)\n        VALUES (%s);\n",
			kw, quoteLiteral(t.Table.String()), t.Table.Quoted(), strings.Join(cols, ", "), strings.Join(vals, ", "))
	}
	b.WriteString("    ELSE\n        RAISE EXCEPTION 'walbox.emit: % is not a configured outbox table (list it in outboxes, then run walbox migrate)', target\n" +
		"            USING ERRCODE = 'invalid_parameter_value';\n    END IF;")
	return b.String()
}

func (p Params) withDefaults() Params {
	if p.Schema == "" {
		p.Schema = "public"
	}
	if p.Table == "" {
		p.Table = "outbox_events"
	}
	if p.Publication == "" {
		p.Publication = "walbox_outbox"
	}
	return p
}

// Migration is one numbered, rendered SQL file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

func quoteIdent(s string) string   { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
func quoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }

// Render returns the migrations in order with the names filled in.
func Render(p Params) ([]Migration, error) {
	p = p.withDefaults()
	table := quoteIdent(p.Schema) + "." + quoteIdent(p.Table)
	// The archive table, named as cdc.TableName.Archive names it.
	arch := cdc.TableName{Schema: p.Schema, Name: p.Table}.Archive()
	archive := quoteIdent(arch.Schema) + "." + quoteIdent(arch.Name)
	emit := p.Emit
	if len(emit) == 0 {
		emit = []EmitTable{{Table: cdc.TableName{Schema: p.Schema, Name: p.Table}, Columns: cdc.DefaultColumns()}}
	}
	vars := map[string]string{
		"EmitInserts":                 emitInserts(emit),
		"EmitDefaultLiteral":          quoteLiteral(emit[0].Table.String()),
		"Table":                       table,
		"TableLiteral":                quoteLiteral(table),
		"UnprocessedIndex":            quoteIdent(p.Table + "_unprocessed_idx"),
		"UnprocessedIndexNameLiteral": quoteLiteral(p.Table + "_unprocessed_idx"),
		"Publication":                 quoteIdent(p.Publication),
		"PublicationLiteral":          quoteLiteral(p.Publication),
		"ArchiveTable":                archive,
		// Names for format('%I'): dynamic SQL gets identifiers only through
		// %I, never inside a string literal, so a name with ' or % is safe.
		"SchemaLiteral":      quoteLiteral(p.Schema),
		"TableNameLiteral":   quoteLiteral(p.Table),
		"ArchiveNameLiteral": quoteLiteral(arch.Name),
		"ArchiveIndex":       quoteIdent(arch.Name + "_created_idx"),
	}
	names, err := fs.Glob(files, "*.sql")
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	var out []Migration
	for _, name := range names {
		num, _, ok := strings.Cut(name, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration file %s: name must start with a number and _", name)
		}
		raw, err := files.ReadFile(name)
		if err != nil {
			return nil, err
		}
		tmpl, err := template.New(name).Option("missingkey=error").Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("parse migration %s: %w", name, err)
		}
		var buf bytes.Buffer
		if err := tmpl.Execute(&buf, vars); err != nil {
			return nil, fmt.Errorf("render migration %s: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: name, SQL: buf.String()})
	}
	return out, nil
}

// ArchiveDDL is migration 005 (the archive journal and table) rendered for
// p: the sweeper runs it when the objects are missing, so the DDL exists
// once.
func ArchiveDDL(p Params) (string, error) {
	ms, err := Render(p)
	if err != nil {
		return "", err
	}
	for _, m := range ms {
		if m.Version == 5 {
			return m.SQL, nil
		}
	}
	return "", fmt.Errorf("migration 005 (archive) not found")
}

// Print renders every migration as one script, in order.
func Print(p Params) (string, error) {
	ms, err := Render(p)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, m := range ms {
		fmt.Fprintf(&b, "-- walbox migration %s\n%s\n", m.Name, m.SQL)
	}
	return b.String(), nil
}

// everyTime starts a migration that runs on every `walbox migrate`, applied
// or not: it brings something to the configuration (idempotent).
const everyTime = "-- walbox: every time"

// lockKey serializes concurrent `walbox migrate` runs.
const lockKey = 0x77616c626f78 // "walbox"

// Apply runs the migrations not yet recorded in walbox.schema_migrations,
// each in its own transaction, and returns the names it applied. Safe to run
// again: applied versions are skipped, and every statement is idempotent.
func Apply(ctx context.Context, conn *pgx.Conn, p Params) ([]string, error) {
	emit, err := emitColumnsThatExist(ctx, conn, p.Emit)
	if err != nil {
		return nil, err
	}
	p.Emit = emit
	ms, err := Render(p)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", lockKey); err != nil {
		return nil, fmt.Errorf("take migration lock: %w", err)
	}
	defer conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", lockKey)
	if _, err := conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS walbox;
CREATE TABLE IF NOT EXISTS walbox.schema_migrations (
    target text NOT NULL, version int NOT NULL, name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (target, version))`); err != nil {
		return nil, fmt.Errorf("create walbox.schema_migrations: %w", err)
	}
	// Migrations are recorded per target table and publication: one database
	// may hold more than one outbox.
	p = p.withDefaults()
	target := p.Schema + "." + p.Table + "/" + p.Publication
	var applied []string
	for _, m := range ms {
		var done bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM walbox.schema_migrations WHERE target = $1 AND version = $2)", target, m.Version).Scan(&done); err != nil {
			return applied, fmt.Errorf("read walbox.schema_migrations: %w", err)
		}
		if done && !strings.HasPrefix(m.SQL, everyTime) {
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			if done {
				return nil
			}
			_, err := tx.Exec(ctx, "INSERT INTO walbox.schema_migrations (target, version, name) VALUES ($1, $2, $3)", target, m.Version, m.Name)
			return err
		})
		if err != nil {
			return applied, fmt.Errorf("apply migration %s: %w", m.Name, err)
		}
		if !done {
			applied = append(applied, m.Name)
		}
	}
	return applied, nil
}

// StaleTableError refuses to take a table out of the publication while it
// still holds rows not marked processed: they were never published, and
// would not be once the table is out.
type StaleTableError struct {
	Table       cdc.TableName
	Publication string
	Unprocessed int64 // -1: the table has no processed column to tell
}

func (e *StaleTableError) Error() string {
	held := fmt.Sprintf("%d rows not marked processed", e.Unprocessed)
	if e.Unprocessed < 0 {
		held = "rows, and no processed column to tell whether they were published"
	}
	return fmt.Sprintf("publication %s covers %s, which is no longer configured, and it still holds %s: "+
		"put it back in outboxes until the relay has published them, or run walbox migrate --force to take it out anyway (those rows are then never published)",
		e.Publication, e.Table, held)
}

// PruneTables takes out of the publication the tables it covers that keep
// does not list (a table removed from the configuration). A table with rows
// not marked processed is refused with a *StaleTableError, unless force.
// It returns the tables taken out.
//
// A FOR ALL TABLES publication (e.g. a Debezium connector's, adopted with
// walbox slot adopt) has no table list to take tables out of: it is left
// as it is.
func PruneTables(ctx context.Context, conn *pgx.Conn, publication string, keep []cdc.TableName, force bool) ([]cdc.TableName, error) {
	var allTables bool
	err := conn.QueryRow(ctx, "SELECT puballtables FROM pg_publication WHERE pubname = $1", publication).Scan(&allTables)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("look up publication %s: %w", publication, err)
	}
	if allTables {
		return nil, nil
	}
	rows, err := conn.Query(ctx, "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1, 2", publication)
	if err != nil {
		return nil, fmt.Errorf("list the tables of publication %s: %w", publication, err)
	}
	var stale []cdc.TableName
	for rows.Next() {
		var t cdc.TableName
		if err := rows.Scan(&t.Schema, &t.Name); err != nil {
			return nil, fmt.Errorf("list the tables of publication %s: %w", publication, err)
		}
		if !slices.Contains(keep, t) {
			stale = append(stale, t)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list the tables of publication %s: %w", publication, err)
	}
	var dropped []cdc.TableName
	for _, t := range stale {
		if !force {
			n, err := unprocessedRows(ctx, conn, t)
			if err != nil {
				return dropped, err
			}
			if n != 0 {
				return dropped, &StaleTableError{Table: t, Publication: publication, Unprocessed: n}
			}
		}
		if _, err := conn.Exec(ctx, fmt.Sprintf("ALTER PUBLICATION %s DROP TABLE %s", quoteIdent(publication), t.Quoted())); err != nil {
			return dropped, fmt.Errorf("take %s out of publication %s: %w", t, publication, err)
		}
		dropped = append(dropped, t)
	}
	return dropped, nil
}

// unprocessedRows counts t's rows not marked processed; -1 when t has rows
// and no processed column.
func unprocessedRows(ctx context.Context, conn *pgx.Conn, t cdc.TableName) (int64, error) {
	hasFlag, notNull, err := cdc.ProcessedFlag(ctx, conn, t)
	if err != nil {
		return 0, err
	}
	var n int64
	if hasFlag {
		if err := conn.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FROM %s WHERE %s", t.Quoted(), cdc.Unprocessed("", notNull))).Scan(&n); err != nil {
			return 0, fmt.Errorf("count unprocessed rows of %s: %w", t, err)
		}
		return n, nil
	}
	var any bool
	if err := conn.QueryRow(ctx, fmt.Sprintf("SELECT EXISTS (SELECT 1 FROM %s)", t.Quoted())).Scan(&any); err != nil {
		return 0, fmt.Errorf("read %s: %w", t, err)
	}
	if any {
		return -1, nil
	}
	return 0, nil
}
