package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/fault"
	"github.com/walbox/walbox/internal/relaytest"
)

// pgReader is another pgoutput client of a slot, as Debezium's connector
// with plugin.name=pgoutput is one: it streams with protocol version 1 and
// publication_names, and confirms what it chooses to.
type pgReader struct {
	t    *testing.T
	conn *pgconn.PgConn
	rels map[uint32]*pglogrepl.RelationMessage
}

// readTxn is one transaction a pgReader received: the ids of its outbox
// inserts and the end of its commit record (what a client confirms).
type readTxn struct {
	ids []string
	end pglogrepl.LSN
}

func createPgoutputSlot(t *testing.T, dbURL, slot string) {
	t.Helper()
	conn := replConn(t, dbURL)
	defer conn.Close(context.Background())
	if _, err := pglogrepl.CreateReplicationSlot(testCtx(t), conn, slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication}); err != nil {
		t.Fatalf("create slot %s: %v", slot, err)
	}
}

func replConn(t *testing.T, dbURL string) *pgconn.PgConn {
	t.Helper()
	pc, err := pgconn.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	pc.RuntimeParams["replication"] = "database"
	pc.RuntimeParams["application_name"] = "debezium-like-test-reader"
	conn, err := pgconn.ConnectConfig(testCtx(t), pc)
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

func startReader(t *testing.T, dbURL, slot, publication string) *pgReader {
	t.Helper()
	conn := replConn(t, dbURL)
	t.Cleanup(func() { conn.Close(context.Background()) })
	err := pglogrepl.StartReplication(testCtx(t), conn, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names " + cdc.QuoteLiteral(publication)}})
	if err != nil {
		t.Fatalf("start replication on %s: %v", slot, err)
	}
	return &pgReader{t: t, conn: conn, rels: map[uint32]*pglogrepl.RelationMessage{}}
}

// read returns the next n committed transactions that carry outbox inserts.
func (r *pgReader) read(n int) []readTxn {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(testCtx(r.t), 60*time.Second)
	defer cancel()
	var out []readTxn
	var cur *readTxn
	for len(out) < n {
		msg, err := r.conn.ReceiveMessage(ctx)
		if err != nil {
			r.t.Fatalf("reader: receive after %d transactions: %v", len(out), err)
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok {
			if e, ok := msg.(*pgproto3.ErrorResponse); ok {
				r.t.Fatalf("reader: %s", e.Message)
			}
			continue
		}
		if cd.Data[0] != pglogrepl.XLogDataByteID {
			continue // keepalive: no reply needed, the status below is explicit
		}
		xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
		if err != nil {
			r.t.Fatal(err)
		}
		m, err := pglogrepl.Parse(xld.WALData)
		if err != nil {
			r.t.Fatal(err)
		}
		switch m := m.(type) {
		case *pglogrepl.RelationMessage:
			r.rels[m.RelationID] = m
		case *pglogrepl.BeginMessage:
			cur = &readTxn{}
		case *pglogrepl.InsertMessage:
			rel := r.rels[m.RelationID]
			if rel.RelationName != "outbox" {
				continue
			}
			for i, c := range rel.Columns {
				if c.Name == "id" {
					cur.ids = append(cur.ids, string(m.Tuple.Columns[i].Data))
				}
			}
		case *pglogrepl.CommitMessage:
			cur.end = m.TransactionEndLSN
			if len(cur.ids) > 0 {
				out = append(out, *cur)
			}
			cur = nil
		}
	}
	return out
}

// confirm reports lsn as flushed, as a client does once it has stored
// everything up to it.
func (r *pgReader) confirm(lsn pglogrepl.LSN) {
	r.t.Helper()
	err := pglogrepl.SendStandbyStatusUpdate(testCtx(r.t), r.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: lsn, WALFlushPosition: lsn, WALApplyPosition: lsn, ClientTime: time.Now()})
	if err != nil {
		r.t.Fatal(err)
	}
}

func (r *pgReader) close() { r.conn.Close(context.Background()) }

// slotRow reads a slot's activity and confirmed position ("" when gone).
func slotRow(t *testing.T, dbURL, slot string) (exists, active bool, confirmed string) {
	t.Helper()
	relaytest.WithConn(t, dbURL, func(ctx context.Context, conn *pgx.Conn) error {
		err := conn.QueryRow(ctx, `SELECT active, coalesce(confirmed_flush_lsn::text, '') FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&active, &confirmed)
		exists = !errors.Is(err, pgx.ErrNoRows)
		if !exists {
			return nil
		}
		return err
	})
	return exists, active, confirmed
}

// debeziumEnv is newEnv with Debezium's default outbox table (not
// partitioned) read with outbox.layout: debezium, its subjects in stream
// OUTBOX, and the publication as the connector's
// publication.autocreate.mode=filtered makes it (all operations,
// publish_via_partition_root off).
func debeziumEnv(t *testing.T) *env {
	t.Helper()
	e := newEnv(t, func(c *config.Config) {
		c.Outbox.Table = "public.outbox"
		c.Outbox.Layout = config.LayoutDebezium
		c.NATS.Streams = append(c.NATS.Streams, config.Stream{Name: "OUTBOX", Subjects: []string{"outbox.event.>"}})
	})
	e.exec(`CREATE TABLE public.outbox (
		id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
		aggregatetype varchar(255) NOT NULL,
		aggregateid varchar(255) NOT NULL,
		type varchar(255) NOT NULL,
		payload jsonb)`)
	e.exec(`CREATE PUBLICATION dbz_publication FOR TABLE public.outbox`)
	return e
}

// dbzInsert commits one row to Debezium's outbox table and returns its id.
func dbzInsert(e *env, payload string) string {
	e.t.Helper()
	return e.insertID(`INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) VALUES ('order', '42', 'OrderCreated', $1) RETURNING id::text`, payload)
}

// dbzInsertDeleted inserts a row and deletes it in the same transaction, as
// Debezium advises producers to keep the outbox table empty, and returns its
// id: the insert is in the WAL all the same. other also writes to table
// orders in that transaction.
func dbzInsertDeleted(e *env, payload string, other bool) string {
	e.t.Helper()
	var id string
	relaytest.WithConn(e.t, e.dbURL, func(ctx context.Context, conn *pgx.Conn) error {
		return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if err := tx.QueryRow(ctx, `INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) VALUES ('order', '42', 'OrderCreated', $1) RETURNING id::text`, payload).Scan(&id); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `DELETE FROM public.outbox WHERE id = $1`, id); err != nil {
				return err
			}
			if !other {
				return nil
			}
			// A business table's insert and update in the same transaction.
			_, err := tx.Exec(ctx, `INSERT INTO orders VALUES (hashtext($1), 'new') ON CONFLICT (id) DO UPDATE SET status = 'paid'`, id)
			return err
		})
	})
	return id
}

// TestSlotAdoptContinuesAnotherClientsSlot: a pgoutput slot and publication
// made the way Debezium's connector makes them, read by another client that
// confirmed only part of what it received, is adopted by walbox. Every event
// after the confirmed position reaches JetStream exactly once, none before
// it, and walbox neither backfills nor takes the slot for a lost one.
func TestSlotAdoptContinuesAnotherClientsSlot(t *testing.T) {
	t.Run("publication of the outbox table", func(t *testing.T) { testAdopt(t, false) })
	// Debezium's default publication.autocreate.mode=all_tables, with
	// another table written in the same transactions.
	t.Run("publication of all tables", func(t *testing.T) { testAdopt(t, true) })
}

func testAdopt(t *testing.T, allTables bool) {
	e := debeziumEnv(t)
	ctx := testCtx(t)
	const src, pub = "debezium", "dbz_publication"
	if allTables {
		e.exec(`DROP PUBLICATION dbz_publication`)
		e.exec(`CREATE PUBLICATION dbz_publication FOR ALL TABLES`)
		e.exec(`CREATE TABLE orders (id int PRIMARY KEY, status text)`)
	}
	createPgoutputSlot(t, e.dbURL, src)

	const n, k, m = 10, 4, 5
	var ids []string
	for i := range n {
		ids = append(ids, dbzInsert(e, fmt.Sprintf(`{"n":%d}`, i)))
	}
	reader := startReader(t, e.dbURL, src, pub)
	txns := reader.read(n)
	for i, tx := range txns {
		if !slices.Equal(tx.ids, ids[i:i+1]) {
			t.Fatalf("reader's transaction %d holds %v, want [%s]", i, tx.ids, ids[i])
		}
	}
	// Stored the first k, received all n.
	confirmed := txns[k-1].end
	reader.confirm(confirmed)
	relaytest.Eventually(t, 30*time.Second, "the reader's confirmation to reach the slot", func() bool {
		_, _, c := slotRow(t, e.dbURL, src)
		return c == confirmed.String()
	})

	e.cfg.Postgres.Publication = pub
	// While the reader streams, the slot is not to be taken.
	_, err := AdoptSlot(ctx, e.cfg, SlotAdoptOptions{Slot: src, Publication: pub, Yes: true})
	var pe *fault.PreconditionError
	if !errors.As(err, &pe) || !strings.Contains(pe.What, "is in use") || !strings.Contains(pe.Fix, "stop the connector") {
		t.Fatalf("adopt of an active slot: %v", err)
	}
	reader.close()
	relaytest.Eventually(t, 30*time.Second, "the reader's walsender to release the slot", func() bool {
		_, active, _ := slotRow(t, e.dbURL, src)
		return !active
	})
	// Written while nobody reads the slot; these ones deleted at once.
	for i := range m {
		ids = append(ids, dbzInsertDeleted(e, fmt.Sprintf(`{"n":%d}`, n+i), allTables))
	}

	// Asked, and answered no: nothing changes.
	var out strings.Builder
	if _, err := AdoptSlot(ctx, e.cfg, SlotAdoptOptions{Slot: src, Publication: pub, In: strings.NewReader("n\n"), Out: &out}); !errors.Is(err, ErrAborted) {
		t.Fatalf("adopt answered n: %v", err)
	}
	mustContain(t, "adopt prompt", out.String(), "Copy slot debezium", confirmed.String(), "[y/N]")
	if exists, _, _ := slotRow(t, e.dbURL, e.cfg.Postgres.Slot); exists {
		t.Fatal("walbox's slot created although the answer was n")
	}

	out.Reset()
	res, err := AdoptSlot(ctx, e.cfg, SlotAdoptOptions{Slot: src, Publication: pub, DropSource: true, In: strings.NewReader("y\n"), Out: &out})
	if err != nil {
		t.Fatalf("adopt: %v\n%s", err, out.String())
	}
	if !res.Copied || !res.SourceDropped || res.SourceMoved || res.ConfirmedFlushLSN != confirmed.String() {
		t.Fatalf("adopt result %+v, want copied at %s and the source dropped", res, confirmed)
	}
	res.Print(&out)
	mustContain(t, "adopt output", out.String(), "copied slot debezium to walbox at confirmed_flush_lsn "+confirmed.String(), "dropped slot debezium")
	if exists, _, _ := slotRow(t, e.dbURL, src); exists {
		t.Fatal("--drop-source left the source slot")
	}
	if exists, _, c := slotRow(t, e.dbURL, e.cfg.Postgres.Slot); !exists || c != confirmed.String() {
		t.Fatalf("walbox's slot: exists %v at %s, want %s", exists, c, confirmed)
	}

	r := e.startRelay()
	// Commit order: once this one is stored, so is everything before it.
	sentinel := dbzInsert(e, `{"sentinel":true}`)
	want := append(slices.Clone(ids[k:]), sentinel)
	e.waitMsgs("OUTBOX", uint64(len(want)))
	relaytest.Eventually(t, 60*time.Second, "the sentinel event to be stored", func() bool {
		got := e.streamIDs("OUTBOX")
		return len(got) > 0 && got[len(got)-1] == sentinel
	})
	if got := e.streamIDs("OUTBOX"); !slices.Equal(got, want) {
		t.Fatalf("stream OUTBOX holds (Nats-Msg-Id)\n%v\nwant events %d..%d and the sentinel, each once\n%v", got, k+1, n+m, want)
	}
	// Where Debezium's router put them: subject outbox.event.<aggregatetype>,
	// the event id in header id.
	st, err := e.connectJS().Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	first, err := st.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if first.Subject != "outbox.event.order" || first.Header.Get("id") != ids[k] {
		t.Fatalf("first message: subject %s, header id %q; want outbox.event.order, %s", first.Subject, first.Header.Get("id"), ids[k])
	}
	log := r.log.String()
	for _, bad := range []string{"backfill", "lost", "disappeared", "invalidated"} {
		if strings.Contains(log, bad) {
			t.Errorf("the relay's log mentions %q on an adopted slot:\n%s", bad, log)
		}
	}
	var markers int
	if err := relaytest.Conn(t, e.dbURL).QueryRow(ctx, `SELECT count(*) FROM walbox.slot_backfill`).Scan(&markers); err != nil || markers != 0 {
		t.Fatalf("backfill markers: %d %v", markers, err)
	}
	// The relay confirms on the adopted slot.
	relaytest.Eventually(t, 30*time.Second, "walbox to confirm past the adopted position", func() bool {
		_, _, c := slotRow(t, e.dbURL, e.cfg.Postgres.Slot)
		lsn, err := pglogrepl.ParseLSN(c)
		return err == nil && lsn > confirmed
	})
	r.stop(t)
}

// TestSlotAdoptRefuses: each reason adopt refuses names its fix, and
// nothing is created.
func TestSlotAdoptRefuses(t *testing.T) {
	e := debeziumEnv(t)
	ctx := testCtx(t)
	// walbox's own outbox table is partitioned.
	e.exec(`CREATE PUBLICATION dbz_partitioned FOR TABLE public.outbox_events`)
	e.exec(`CREATE TABLE other (id int PRIMARY KEY)`)
	e.exec(`CREATE PUBLICATION other_pub FOR TABLE other`)
	createPgoutputSlot(t, e.dbURL, "debezium")
	e.exec(`SELECT pg_create_logical_replication_slot('dbz_decoderbufs', 'test_decoding')`)
	// A physical slot belongs to no database: the test drops it itself.
	physical := uniqueName(t, "standby")
	e.exec(`SELECT pg_create_physical_replication_slot($1, true)`, physical)
	t.Cleanup(func() { e.exec(`SELECT pg_drop_replication_slot($1)`, physical) })
	cfg := e.cfg
	cfg.Postgres.Publication = "dbz_publication"

	for _, c := range []struct {
		name         string
		slot, pub    string
		cfgPub       string // "" keeps dbz_publication
		walboxSlot   string // "" keeps walbox
		drop         bool
		wantWhat     string
		wantFix      string
		wantCfgKey   string
		table        string               // "" keeps public.outbox
		outboxes     []config.OutboxEntry // nil keeps outbox alone
		prepare      func(t *testing.T)
		wantOtherErr string
	}{
		{name: "no such slot", slot: "nope", pub: "dbz_publication",
			wantWhat: `replication slot "nope" does not exist`, wantFix: "pass the connector's slot.name"},
		{name: "plugin test_decoding", slot: "dbz_decoderbufs", pub: "dbz_publication",
			wantWhat: `replication slot "dbz_decoderbufs" uses plugin test_decoding; walbox reads pgoutput only`, wantFix: "let walbox create its own slot"},
		{name: "physical slot", slot: physical, pub: "dbz_publication",
			wantWhat: fmt.Sprintf("replication slot %q is a physical slot, not a logical one", physical)},
		{name: "no such publication", slot: "debezium", pub: "nope", cfgPub: "nope",
			wantWhat: `publication "nope" does not exist`, wantFix: "pass the connector's publication.name"},
		{name: "publication without the outbox table", slot: "debezium", pub: "other_pub", cfgPub: "other_pub",
			wantWhat: `publication "other_pub" does not include the outbox table public.outbox`, wantFix: "check outbox.table"},
		{name: "partitioned outbox, not published via its root", slot: "debezium", pub: "dbz_partitioned", cfgPub: "dbz_partitioned", table: "outbox_events",
			wantWhat: "the outbox table public.outbox_events is partitioned and publication \"dbz_partitioned\" has publish_via_partition_root off", wantFix: "cannot be continued"},
		{name: "a second outbox table the publication lacks", slot: "debezium", pub: "dbz_publication",
			outboxes: []config.OutboxEntry{{Outbox: config.Outbox{Table: "public.outbox", Layout: config.LayoutDebezium}}, {Outbox: config.Outbox{Table: "public.outbox_events"}}},
			wantWhat: `publication "dbz_publication" does not include the outbox table public.outbox_events`, wantFix: "check outboxes[1].table"},
		{name: "postgres.publication is another", slot: "debezium", pub: "dbz_publication", cfgPub: "walbox_outbox",
			wantCfgKey: "postgres.publication"},
		{name: "walbox's slot exists", slot: "debezium", pub: "dbz_publication",
			prepare: func(t *testing.T) {
				e.exec(`SELECT pg_create_logical_replication_slot('walbox_taken', 'pgoutput')`)
			}, walboxSlot: "walbox_taken",
			wantWhat: `walbox's slot "walbox_taken" (postgres.slot) already exists`, wantFix: "drop it (`walbox slot drop`)"},
		{name: "drop-source of walbox's own slot", slot: "debezium", pub: "dbz_publication", walboxSlot: "debezium", drop: true,
			wantOtherErr: "would drop walbox's own slot"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := cfg
			if c.cfgPub != "" {
				cfg.Postgres.Publication = c.cfgPub
			}
			if c.walboxSlot != "" {
				cfg.Postgres.Slot = c.walboxSlot
			}
			if c.outboxes != nil {
				cfg.Outbox, cfg.Outboxes = config.Default().Outbox, c.outboxes
			}
			if c.table != "" {
				cfg.Outbox.Table, cfg.Outbox.Layout = c.table, config.LayoutWalbox
			}
			if c.prepare != nil {
				c.prepare(t)
			}
			_, err := AdoptSlot(ctx, cfg, SlotAdoptOptions{Slot: c.slot, Publication: c.pub, DropSource: c.drop, Yes: true})
			var pe *fault.PreconditionError
			var ce *config.Error
			switch {
			case c.wantCfgKey != "":
				if !errors.As(err, &ce) || ce.Key != c.wantCfgKey || !strings.Contains(ce.Msg, "postgres.publication: "+c.pub) {
					t.Fatalf("err %v, want config error on %s naming the value to set", err, c.wantCfgKey)
				}
			case c.wantOtherErr != "":
				if err == nil || !strings.Contains(err.Error(), c.wantOtherErr) {
					t.Fatalf("err %v, want %q", err, c.wantOtherErr)
				}
			default:
				if !errors.As(err, &pe) || !strings.HasPrefix(pe.What, c.wantWhat) || !strings.Contains(pe.Fix, c.wantFix) {
					t.Fatalf("err %v\nwant %s; ...%s...", err, c.wantWhat, c.wantFix)
				}
			}
			if c.walboxSlot == "" {
				if exists, _, _ := slotRow(t, e.dbURL, cfg.Postgres.Slot); exists {
					t.Fatal("a refused adopt created walbox's slot")
				}
			}
			if exists, _, _ := slotRow(t, e.dbURL, "debezium"); !exists {
				t.Fatal("a refused adopt dropped the source slot")
			}
		})
	}

	// postgres.slot naming the slot itself: nothing is copied, walbox
	// streams from it as it is.
	same := cfg
	same.Postgres.Slot = "debezium"
	res, err := AdoptSlot(ctx, same, SlotAdoptOptions{Slot: "debezium", Publication: "dbz_publication", Yes: true})
	if err != nil || res.Copied || res.ConfirmedFlushLSN == "" {
		t.Fatalf("adopt of postgres.slot itself: %+v %v", res, err)
	}
	var out strings.Builder
	res.Print(&out)
	mustContain(t, "adopt output", out.String(), "postgres.slot is debezium itself")

	// A stale backfill marker of walbox's slot would make walbox drop the
	// copy and backfill: adopt deletes it.
	e.exec(`INSERT INTO walbox.slot_backfill (slot_name) VALUES ('walbox')`)
	res, err = AdoptSlot(ctx, cfg, SlotAdoptOptions{Slot: "debezium", Publication: "dbz_publication", Yes: true})
	if err != nil || !res.Copied || !res.MarkerCleared || res.SourceDropped {
		t.Fatalf("adopt: %+v %v", res, err)
	}
	out.Reset()
	res.Print(&out)
	mustContain(t, "adopt output without --drop-source", out.String(), "stale backfill marker", "still exists and retains WAL", "SELECT pg_drop_replication_slot('debezium');")
}

// TestAdoptResultPrintsRaces: a client that ran during the adopt is named
// either way (transactions it took, or ones published again), and so is
// the failover property a copy lacks.
func TestAdoptResultPrintsRaces(t *testing.T) {
	var out strings.Builder
	AdoptResult{Source: "debezium", Slot: "walbox", Publication: "dbz_publication", Copied: true,
		CheckedLSN: "0/10", ConfirmedFlushLSN: "0/20", SourceMoved: true, SourceLSN: "0/30", FailoverNote: true}.Print(&out)
	mustContain(t, "adopt output", out.String(),
		"copied slot debezium to walbox at confirmed_flush_lsn 0/20",
		"moved from 0/10 to 0/20 between the check and the copy", "went to that client only",
		"moved on to 0/30 while it was copied", "published again",
		`ALTER_REPLICATION_SLOT "walbox" (FAILOVER true)`,
		"still exists and retains WAL from 0/20", "SELECT pg_drop_replication_slot('debezium');")
	out.Reset()
	AdoptResult{Source: "debezium", Slot: "walbox", Copied: true, CheckedLSN: "0/20", ConfirmedFlushLSN: "0/20", SourceDropped: true}.Print(&out)
	if s := out.String(); strings.Contains(s, "warning") || !strings.Contains(s, "dropped slot debezium") {
		t.Fatalf("a quiet adopt with --drop-source prints\n%s", s)
	}
}
