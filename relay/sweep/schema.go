package sweep

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walbox/walbox/cdc"
	walboxsql "github.com/walbox/walbox/sql"
)

// querier is what the sweeper needs of a connection, a pool or a transaction.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// tableInfo is what the sweeper learns about the outbox table from the
// catalog at start (and again before every maintenance run): which optional
// columns exist, their types, and how the table is partitioned.
type tableInfo struct {
	table       cdc.TableName
	partitioned bool
	partCol     string // the range partition key column ("" when not partitioned by one column range)
	partType    string // its type, e.g. "timestamp with time zone"
	cols        []column

	idCol, idType         string
	createdCol, createdTy string // "" when the created_at role is unmapped or the column is missing

	processed, processedAt, errorCol, attempts bool
	processedNotNull                           bool
}

// unprocessed is the condition on a row not marked processed that the
// table's partial index answers (cdc.Unprocessed); prefix qualifies the
// column ("t." or "").
func (ti *tableInfo) unprocessed(prefix string) string {
	return cdc.Unprocessed(prefix, ti.processedNotNull)
}

type column struct {
	name      string
	typ       string
	generated bool
	notNull   bool
}

// col is the column called name (the zero column when there is none).
func (ti *tableInfo) col(name string) column {
	for _, c := range ti.cols {
		if c.name == name {
			return c
		}
	}
	return column{}
}

func (ti *tableInfo) has(name string) bool { return ti.col(name).name != "" }

func (ti *tableInfo) typeOf(name string) string { return ti.col(name).typ }

// columnList is the quoted, comma-separated list of the stored (not
// generated) columns, for INSERT ... SELECT between tables of the same shape.
func (ti *tableInfo) columnList() string {
	var names []string
	for _, c := range ti.cols {
		if !c.generated {
			names = append(names, cdc.QuoteIdent(c.name))
		}
	}
	return strings.Join(names, ", ")
}

// inspect reads the outbox table's shape from pg_attribute and pg_class.
func inspect(ctx context.Context, q querier, table cdc.TableName, roles cdc.Columns) (*tableInfo, error) {
	ti := &tableInfo{table: table}
	var relkind string
	err := q.QueryRow(ctx, `SELECT c.relkind::text FROM pg_class c WHERE c.oid = to_regclass($1)`, table.Quoted()).Scan(&relkind)
	if err == pgx.ErrNoRows {
		return nil, fmt.Errorf("outbox table %s does not exist (run walbox migrate, or fix outbox.table)", table)
	}
	if err != nil {
		return nil, fmt.Errorf("inspect %s: %w", table, err)
	}
	ti.partitioned = relkind == "p"
	rows, err := q.Query(ctx, `SELECT attname::text, format_type(atttypid, atttypmod), attgenerated <> '', attnotnull
		FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped ORDER BY attnum`, table.Quoted())
	if err != nil {
		return nil, fmt.Errorf("inspect columns of %s: %w", table, err)
	}
	for rows.Next() {
		var c column
		if err := rows.Scan(&c.name, &c.typ, &c.generated, &c.notNull); err != nil {
			rows.Close()
			return nil, err
		}
		ti.cols = append(ti.cols, c)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("inspect columns of %s: %w", table, err)
	}
	if ti.partitioned {
		err := q.QueryRow(ctx, `SELECT a.attname::text, format_type(a.atttypid, a.atttypmod)
			FROM pg_partitioned_table p JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0]
			WHERE p.partrelid = to_regclass($1) AND p.partstrat = 'r' AND p.partnatts = 1`, table.Quoted()).Scan(&ti.partCol, &ti.partType)
		if err != nil && err != pgx.ErrNoRows {
			return nil, fmt.Errorf("inspect partition key of %s: %w", table, err)
		}
	}
	ti.idCol = roles[cdc.RoleID]
	ti.idType = ti.typeOf(ti.idCol)
	if ti.idType == "" {
		return nil, fmt.Errorf("outbox table %s has no column %q (outbox.columns.id)", table, ti.idCol)
	}
	if c := roles[cdc.RoleCreatedAt]; c != "" && ti.has(c) {
		ti.createdCol, ti.createdTy = c, ti.typeOf(c)
	}
	ti.processed = ti.typeOf("processed") == "boolean"
	ti.processedNotNull = ti.col("processed").notNull
	ti.processedAt = ti.has("processed_at")
	ti.errorCol = ti.has("error")
	ti.attempts = ti.has("attempts")
	return ti, nil
}

// dbIdentity names the database whose exports these are: its cluster's
// system identifier and its name. Export keys and manifests carry it, so
// two deployments sharing a store and prefix never take each other's
// exports for their own.
type dbIdentity struct{ systemID, database string }

func (id dbIdentity) String() string { return "system " + id.systemID + " database " + id.database }

// readIdentity reads the identity of the database q is connected to.
func readIdentity(ctx context.Context, q querier) (dbIdentity, error) {
	var id dbIdentity
	if err := q.QueryRow(ctx, `SELECT system_identifier::text, current_database()::text FROM pg_control_system()`).Scan(&id.systemID, &id.database); err != nil {
		return id, fmt.Errorf("read the system identifier and database name that name the exports (pg_control_system()): %w", err)
	}
	return id, nil
}

// objectDir is the folder (key prefix) of a table's exports in cold storage:
// <system identifier>/<database>/<table>.
func objectDir(id dbIdentity, t cdc.TableName) string {
	return id.systemID + "/" + keyToken(id.database) + "/" + legacyObjectDir(t)
}

// legacyObjectDir is the folder of a table's exports before they named
// their database (manifest version 1): <table>.
func legacyObjectDir(t cdc.TableName) string {
	if t.Schema == "public" {
		return t.Name
	}
	return t.Schema + "." + t.Name
}

// keyToken makes s one segment of an object key: every byte but
// [A-Za-z0-9_-] as %XX, so a database name never adds a folder or a "..".
func keyToken(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// ensureArchive creates the journal (walbox.archive_partitions: one row per
// partition the archiver has taken out of the outbox, with the step it has
// reached; every step updates it in the same transaction as its DDL) and
// the archive table: partitioned like the outbox when the outbox is
// partitioned (partitions move by DETACH and ATTACH, which needs identical
// columns), a plain table with an index on created_at otherwise (rows move
// in batches). The DDL is sql/005_archive.sql's, rendered for this table:
// one text for walbox migrate, a DBA reviewing it, and the sweeper.
func ensureArchive(ctx context.Context, q querier, ti *tableInfo) (cdc.TableName, error) {
	arch := ti.table.Archive()
	if ti.partitioned && ti.partCol == "" {
		return arch, fmt.Errorf("%s is not partitioned by a range of one column: archival needs RANGE (created_at)", ti.table)
	}
	ddl, err := walboxsql.ArchiveDDL(walboxsql.Params{Schema: ti.table.Schema, Table: ti.table.Name})
	if err != nil {
		return arch, err
	}
	if _, err := q.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS walbox;\n"+ddl); err != nil {
		return arch, fmt.Errorf("create the archive journal and table %s: %w", arch, err)
	}
	if !ti.partitioned && ti.createdCol != "" && ti.createdCol != "created_at" {
		// The migration indexes a column named created_at; this table's
		// created_at role has another name.
		if _, err := q.Exec(ctx, fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %s ON %s (%s)`,
			cdc.QuoteIdent(arch.Name+"_created_idx"), arch.Quoted(), cdc.QuoteIdent(ti.createdCol))); err != nil {
			return arch, fmt.Errorf("index archive table %s: %w", arch, err)
		}
	}
	return arch, nil
}

// partition is one range partition with its bounds: the literals as the
// catalog prints them (reused verbatim in DDL) and as times.
type partition struct {
	name       cdc.TableName
	isDefault  bool
	from, to   string
	start, end time.Time
	bounded    bool // false for MINVALUE/MAXVALUE bounds and the default
	estRows    int64
	// detachPending: a DETACH PARTITION ... CONCURRENTLY was interrupted
	// after its first transaction; FINALIZE completes it.
	detachPending bool
}

// partitions lists the partitions of a partitioned table.
func partitions(ctx context.Context, q querier, parent cdc.TableName, keyType string) ([]partition, error) {
	if keyType == "" {
		keyType = "timestamptz"
	}
	// The bound literals are cast through the key's type, so a timestamp
	// (without time zone) key is read in the session's time zone, as the
	// partition routing does.
	rows, err := q.Query(ctx, fmt.Sprintf(`
		SELECT n.nspname::text, c.relname::text, pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT',
		       coalesce(b[1], ''), coalesce(b[2], ''),
		       (b[1])::%[1]s::timestamptz, (b[2])::%[1]s::timestamptz, greatest(c.reltuples, 0)::bigint,
		       i.inhdetachpending
		FROM pg_inherits i
		JOIN pg_class c ON c.oid = i.inhrelid
		JOIN pg_namespace n ON n.oid = c.relnamespace
		LEFT JOIN LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']*)''\) TO \(''([^'']*)''\)') b ON true
		WHERE i.inhparent = to_regclass($1)
		ORDER BY 6 NULLS LAST, 2`, keyType), parent.Quoted())
	if err != nil {
		return nil, fmt.Errorf("list partitions of %s: %w", parent, err)
	}
	defer rows.Close()
	var out []partition
	for rows.Next() {
		var p partition
		var start, end *time.Time
		if err := rows.Scan(&p.name.Schema, &p.name.Name, &p.isDefault, &p.from, &p.to, &start, &end, &p.estRows, &p.detachPending); err != nil {
			return nil, err
		}
		if start != nil && end != nil {
			p.start, p.end, p.bounded = *start, *end, true
		}
		out = append(out, p)
	}
	return out, rows.Err()
}
