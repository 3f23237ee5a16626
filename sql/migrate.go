// Package sql holds walbox's DDL: numbered migration files embedded in the
// binary. `walbox migrate` applies them; `walbox migrate --print` prints them
// for a DBA who applies DDL by hand.
package sql

import (
	"bytes"
	"context"
	"embed"
	"fmt"
	"io/fs"
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
	def := quoteIdent(p.Schema) + "." + quoteIdent(p.Table+"_default")
	// The archive table, named as cdc.TableName.Archive names it.
	arch := cdc.TableName{Schema: p.Schema, Name: p.Table}.Archive()
	archive := quoteIdent(arch.Schema) + "." + quoteIdent(arch.Name)
	vars := map[string]string{
		"Table":                   table,
		"TableLiteral":            quoteLiteral(table),
		"DefaultPartition":        def,
		"DefaultPartitionLiteral": quoteLiteral(def),
		"UnprocessedIndex":        quoteIdent(p.Table + "_unprocessed_idx"),
		"Publication":             quoteIdent(p.Publication),
		"PublicationLiteral":      quoteLiteral(p.Publication),
		"ArchiveTable":            archive,
		// Names for format('%I'): dynamic SQL gets identifiers only through
		// %I, never inside a string literal, so a name with ' or % is safe.
		"SchemaLiteral":               quoteLiteral(p.Schema),
		"TableNameLiteral":            quoteLiteral(p.Table),
		"DefaultPartitionNameLiteral": quoteLiteral(p.Table + "_default"),
		"ArchiveNameLiteral":          quoteLiteral(arch.Name),
		"ArchiveIndex":                quoteIdent(arch.Name + "_created_idx"),
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
