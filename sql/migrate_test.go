package sql_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	walboxsql "github.com/walbox/walbox/sql"
)

var pg *pgtest.Cluster

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, &pg)) }

// Names with a quote and a percent sign: dynamic SQL in the migrations takes
// identifiers only through format's %I, so they neither break a string
// literal nor a format() pattern. Twice, to show the migrations stay
// idempotent with such names.
func TestMigrationsTakeNamesWithQuotesAndPercentSigns(t *testing.T) {
	ctx := relaytest.Ctx(t)
	conn := relaytest.Conn(t, pg.NewDB(t))
	p := walboxsql.Params{Schema: `o'k%s`, Table: `out'box%d "x"`, Publication: `pub'%1$s`}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA "o'k%s"`); err != nil {
		t.Fatal(err)
	}
	for round := range 2 {
		if _, err := walboxsql.Apply(ctx, conn, p); err != nil {
			t.Fatalf("round %d: %v", round+1, err)
		}
	}
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3`,
		p.Publication, p.Schema, p.Table).Scan(&n); err != nil || n != 1 {
		t.Fatalf("publication %q does not cover %q.%q: %d, %v", p.Publication, p.Schema, p.Table, n, err)
	}
	for _, rel := range []string{`"o'k%s"."out'box%d ""x""_p` + time.Now().Format("20060102") + `"`, `walbox."o'k%s_out'box%d ""x""_archive"`} {
		var oid *uint32
		if err := conn.QueryRow(ctx, `SELECT to_regclass($1)::oid`, rel).Scan(&oid); err != nil || oid == nil {
			t.Fatalf("%s was not created: %v", rel, err)
		}
	}
	if _, err := conn.Exec(ctx, `INSERT INTO "o'k%s"."out'box%d ""x""" (topic, payload) VALUES ('orders.created', '{}')`); err != nil {
		t.Fatalf("insert into the migrated table: %v", err)
	}
}

// After outbox.table changes, migrate brings the publication to the new
// table, and it does so on every run, not only the first (someone may have
// taken the table out of it since).
func TestMigrateBringsThePublicationToTheConfiguredTable(t *testing.T) {
	ctx := relaytest.Ctx(t)
	conn := relaytest.Conn(t, pg.NewDB(t))
	covers := func(table string) bool { return publicationCovers(ctx, t, conn, "walbox_outbox", table) }
	if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{}); err != nil {
		t.Fatal(err)
	}
	if _, err := walboxsql.Apply(ctx, conn, walboxsql.Params{Table: "events_v2"}); err != nil {
		t.Fatal(err)
	}
	if !covers("events_v2") {
		t.Fatal("after outbox.table changed to events_v2, migrate left the publication without it")
	}
	if _, err := conn.Exec(ctx, `ALTER PUBLICATION walbox_outbox DROP TABLE events_v2`); err != nil {
		t.Fatal(err)
	}
	applied, err := walboxsql.Apply(ctx, conn, walboxsql.Params{Table: "events_v2"})
	if err != nil {
		t.Fatal(err)
	}
	if len(applied) != 0 {
		t.Fatalf("a third run applied %v; every migration was recorded already", applied)
	}
	if !covers("events_v2") {
		t.Fatal("migrate did not put the table back into the publication")
	}
}

// A FOR ALL TABLES publication (a Debezium connector's, adopted) lists every
// table and has none to take out: pruning leaves it, where ALTER
// PUBLICATION ... DROP TABLE would fail. A publication with a table list
// loses the tables no longer configured.
func TestPruneLeavesAnAllTablesPublication(t *testing.T) {
	ctx := relaytest.Ctx(t)
	conn := relaytest.Conn(t, pg.NewDB(t))
	if _, err := conn.Exec(ctx, `CREATE TABLE outbox (id uuid PRIMARY KEY, payload jsonb); CREATE TABLE other (id int);
		CREATE PUBLICATION dbz_all FOR ALL TABLES; CREATE PUBLICATION dbz_filtered FOR TABLE outbox, other`); err != nil {
		t.Fatal(err)
	}
	keep := []cdc.TableName{{Schema: "public", Name: "outbox"}}
	if dropped, err := walboxsql.PruneTables(ctx, conn, "dbz_all", keep, false); err != nil || len(dropped) != 0 {
		t.Fatalf("prune of a FOR ALL TABLES publication: took out %v, %v", dropped, err)
	}
	dropped, err := walboxsql.PruneTables(ctx, conn, "dbz_filtered", keep, false)
	if err != nil || len(dropped) != 1 || dropped[0] != (cdc.TableName{Schema: "public", Name: "other"}) {
		t.Fatalf("prune of a table list: took out %v, %v; want public.other", dropped, err)
	}
}

// A table taken out of the configuration leaves the publication only once
// nothing in it waits to be published: with unprocessed rows (or rows and no
// processed column to tell) migrate refuses and names --force; --force takes
// it out anyway; once its rows are processed it goes without --force.
func TestPruneRefusesATableWithUnprocessedRowsUnlessForced(t *testing.T) {
	ctx := relaytest.Ctx(t)
	conn := relaytest.Conn(t, pg.NewDB(t))
	if _, err := conn.Exec(ctx, `
		CREATE TABLE keep (id int PRIMARY KEY, processed boolean NOT NULL DEFAULT false);
		CREATE TABLE gone (id int PRIMARY KEY, processed boolean NOT NULL DEFAULT false);
		CREATE TABLE flagless (id int PRIMARY KEY);
		INSERT INTO gone VALUES (1, true), (2, false), (3, false);
		INSERT INTO flagless VALUES (1);
		CREATE PUBLICATION p1 FOR TABLE keep, gone; CREATE PUBLICATION p2 FOR TABLE keep, gone;
		CREATE PUBLICATION p3 FOR TABLE keep, flagless`); err != nil {
		t.Fatal(err)
	}
	keep := []cdc.TableName{{Schema: "public", Name: "keep"}}
	gone := cdc.TableName{Schema: "public", Name: "gone"}
	covers := func(pub, table string) bool { return publicationCovers(ctx, t, conn, pub, table) }

	dropped, err := walboxsql.PruneTables(ctx, conn, "p1", keep, false)
	var stale *walboxsql.StaleTableError
	if !errors.As(err, &stale) || stale.Table != gone || stale.Unprocessed != 2 || len(dropped) != 0 {
		t.Fatalf("prune of a table with 2 unprocessed rows: took out %v, %v; want a StaleTableError for 2 rows", dropped, err)
	}
	if !strings.Contains(err.Error(), "--force") || !strings.Contains(err.Error(), "2 rows not marked processed") {
		t.Errorf("the refusal does not name the rows and the fix: %v", err)
	}
	if !covers("p1", "gone") {
		t.Fatal("the refused table left the publication")
	}
	_, err = walboxsql.PruneTables(ctx, conn, "p3", keep, false)
	if !errors.As(err, &stale) || stale.Unprocessed != -1 || !strings.Contains(err.Error(), "no processed column") {
		t.Fatalf("prune of a table with rows and no processed column: %v; want a refusal that says it cannot tell", err)
	}

	if dropped, err := walboxsql.PruneTables(ctx, conn, "p1", keep, true); err != nil || len(dropped) != 1 || dropped[0] != gone {
		t.Fatalf("prune --force: took out %v, %v; want public.gone", dropped, err)
	}
	if covers("p1", "gone") || !covers("p1", "keep") {
		t.Fatal("prune --force left the table in, or took the kept one out")
	}

	if _, err := conn.Exec(ctx, `UPDATE gone SET processed = true`); err != nil {
		t.Fatal(err)
	}
	if dropped, err := walboxsql.PruneTables(ctx, conn, "p2", keep, false); err != nil || len(dropped) != 1 || dropped[0] != gone {
		t.Fatalf("prune once every row is processed: took out %v, %v; want public.gone", dropped, err)
	}
}

// publicationCovers says whether publication pub lists table.
func publicationCovers(ctx context.Context, t *testing.T, conn *pgx.Conn, pub, table string) bool {
	t.Helper()
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_publication_tables WHERE pubname = $1 AND tablename = $2`, pub, table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}
