package sweep_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/sweep"
	walboxsql "github.com/walbox/walbox/sql"
)

// statementLog records every statement a sweeper runs, with its arguments.
type statementLog struct {
	mu    sync.Mutex
	stmts []loggedStatement
}

type loggedStatement struct {
	sql  string
	args []any
}

func (l *statementLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.mu.Lock()
	l.stmts = append(l.stmts, loggedStatement{sql: d.SQL, args: d.Args})
	l.mu.Unlock()
	return ctx
}

func (l *statementLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// The marks go as a pgx batch, which pgx traces through these.
func (l *statementLog) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (l *statementLog) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	l.mu.Lock()
	l.stmts = append(l.stmts, loggedStatement{sql: d.SQL, args: d.Args})
	l.mu.Unlock()
}

func (l *statementLog) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (l *statementLog) all() []loggedStatement {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]loggedStatement(nil), l.stmts...)
}

// planNodes are the relations a plan reads by sequential scan, and the
// indexes it reads.
func planNodes(plan any) (seq, indexes []string) {
	var walk func(n any)
	walk = func(n any) {
		switch v := n.(type) {
		case map[string]any:
			if v["Node Type"] == "Seq Scan" {
				seq = append(seq, fmt.Sprint(v["Relation Name"]))
			}
			if name, ok := v["Index Name"]; ok {
				indexes = append(indexes, fmt.Sprint(name))
			}
			for _, c := range v {
				walk(c)
			}
		case []any:
			for _, c := range v {
				walk(c)
			}
		}
	}
	walk(plan)
	return seq, indexes
}

// Every query that looks for unprocessed rows (the sweeper's gauges, its
// maintenance and Status, a backfill) is answered by the partial index on a
// 1,000,000-row outbox with 100 unprocessed rows, for a NOT NULL processed
// column (walbox's table) and a nullable one (an existing table): no
// populated partition is read by sequential scan. Before, every query said
// `processed IS NOT TRUE`, which the planner cannot match to the index's
// `NOT processed`: each read every partition in full. And a mark never
// reads the partial index: it looks its row up by primary key (in the
// index's form it joined each batch to every unprocessed row).
func TestUnprocessedQueriesUseTheIndex(t *testing.T) {
	for _, c := range []struct {
		name    string
		table   string
		notNull bool
	}{
		{"not null", "outbox_events", true},
		{"nullable", "legacy_outbox", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newDB(t, false)
			ctx := context.Background()
			if !c.notNull {
				// An existing table whose processed column allows NULL
				// (NULL: not processed), migrated afterwards.
				d.exec(`CREATE TABLE legacy_outbox (
					id uuid NOT NULL DEFAULT gen_random_uuid(), created_at timestamptz NOT NULL DEFAULT now(),
					topic text NOT NULL, payload jsonb NOT NULL, processed boolean, processed_at timestamptz,
					PRIMARY KEY (id, created_at)) PARTITION BY RANGE (created_at)`)
			}
			relaytest.Migrate(t, d.url, walboxsql.Params{Table: c.table})
			table := cdc.TableName{Schema: "public", Name: c.table}
			// Old partitions (archival counts them), today and the days
			// ahead: 1,000,000 rows, 100 of them unprocessed (NULL in the
			// nullable table), spread over 6 days.
			for days := 5; days >= 2; days-- {
				d.exec(fmt.Sprintf(`CREATE TABLE %[1]s_old%[2]d PARTITION OF %[1]s
					FOR VALUES FROM (date_trunc('day', now()) - make_interval(days => %[2]d)) TO (date_trunc('day', now()) - make_interval(days => %[2]d - 1))`, c.table, days))
			}
			unprocessedValue := "false"
			if !c.notNull {
				unprocessedValue = "NULL"
			}
			d.exec(fmt.Sprintf(`INSERT INTO %s (created_at, topic, payload, processed)
				SELECT date_trunc('day', now()) - interval '5 days' + g * interval '518 ms', 'orders.x', '{}',
				       CASE WHEN g %% 10000 = 0 THEN %s ELSE true END
				FROM generate_series(0, 999999) g`, c.table, unprocessedValue))
			d.exec(`ANALYZE ` + c.table)
			populated := map[string]bool{}
			rows, err := d.pool.Query(ctx, `SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
				WHERE i.inhparent = $1::regclass AND c.reltuples > 1000`, table.Quoted())
			if err != nil {
				t.Fatal(err)
			}
			names, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			for _, n := range names {
				populated[n] = true
			}
			if len(populated) < 5 {
				t.Fatalf("populated partitions %v: the test's data did not spread", names)
			}

			log := &statementLog{}
			sw := d.sweeper(func(cfg *sweep.Config) {
				cfg.Table = table
				cfg.Tracer = log
				cfg.Archive.After = 24 * time.Hour
			})
			if n, err := sw.RefreshGauges(ctx); err != nil || n != 100 {
				t.Fatalf("gauges: %d unprocessed, %v; want 100", n, err)
			}
			if _, err := sw.Maintain(ctx, sweep.MaintainOptions{DryRun: true}); err != nil {
				t.Fatal(err)
			}
			if _, err := sw.Status(ctx); err != nil {
				t.Fatal(err)
			}
			// Marks: by id and created_at (acks, read-backs of messages
			// that carry it) and by id alone (older messages).
			marks, err := d.pool.Query(ctx, fmt.Sprintf(`SELECT id::text, created_at::text FROM %s WHERE %s LIMIT 20`, table.Quoted(), cdc.Unprocessed("", c.notNull)))
			if err != nil {
				t.Fatal(err)
			}
			type idAt struct{ id, at string }
			toMark, err := pgx.CollectRows(marks, func(r pgx.CollectableRow) (idAt, error) {
				var v idAt
				return v, r.Scan(&v.id, &v.at)
			})
			if err != nil {
				t.Fatal(err)
			}
			for i, m := range toMark {
				at := m.at
				if i%2 == 1 {
					at = ""
				}
				sw.OnDelivered(relay.Delivered{ID: m.id, CreatedAt: at, AckedAt: time.Now(), Stream: "ORDERS", Seq: uint64(i + 1)})
			}
			stop := sw.Start(ctx)
			relaytest.Eventually(t, 30*time.Second, "the marks written", func() bool {
				return d.int(fmt.Sprintf(`SELECT count(*) FROM %s WHERE %s`, table.Quoted(), cdc.Unprocessed("", c.notNull))) == 80
			})
			stop()
			stmts := log.all()
			conn, err := d.pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Release()
			backfill, err := cdc.BackfillQuery(ctx, conn, cdc.Table{Name: table, Columns: cdc.DefaultColumns()})
			if err != nil {
				t.Fatal(err)
			}
			stmts = append(stmts, loggedStatement{sql: backfill})

			checked, markStmts := 0, 0
			prows, err := d.pool.Query(ctx, `SELECT indexrelid::regclass::text FROM pg_index WHERE indpred IS NOT NULL`)
			if err != nil {
				t.Fatal(err)
			}
			pnames, err := pgx.CollectRows(prows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			partial := map[string]bool{}
			for _, n := range pnames {
				partial[n] = true
			}
			for _, st := range stmts {
				head := strings.ToUpper(strings.Fields(st.sql)[0])
				if head != "SELECT" && head != "WITH" && head != "UPDATE" && head != "DELETE" {
					continue
				}
				if !strings.Contains(st.sql, "processed") {
					continue
				}
				var raw []byte
				if err := conn.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+st.sql, st.args...).Scan(&raw); err != nil {
					t.Fatalf("EXPLAIN %s: %v", st.sql, err)
				}
				var plan any
				if err := json.Unmarshal(raw, &plan); err != nil {
					t.Fatal(err)
				}
				checked++
				seq, indexes := planNodes(plan)
				for _, rel := range seq {
					if populated[rel] {
						t.Errorf("sequential scan of %s (%d rows) for:\n%s", rel, 1_000_000/len(populated), st.sql)
					}
				}
				if head == "UPDATE" && strings.Contains(st.sql, "processed = true") {
					// A mark is a primary-key lookup: through the partial
					// index it reads every unprocessed row for each batch.
					markStmts++
					for _, ix := range indexes {
						if partial[ix] {
							t.Errorf("a mark reads the partial index %s (every unprocessed row) for:\n%s", ix, st.sql)
						}
					}
				}
			}
			if markStmts < 2 {
				t.Fatalf("%d mark statements checked, want both kinds (by id and created_at, by id alone)", markStmts)
			}
			if checked < 4 {
				t.Fatalf("only %d statements about unprocessed rows were checked: %v", checked, stmts)
			}
		})
	}
}
