package cdc

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

// answers is a fake server's catalogue: the answer to each query by its
// first words; any other query fails the test.
func answers(t *testing.T, byPrefix map[string]fakeResult) func(string) fakeResult {
	return func(sql string) fakeResult {
		for p, r := range byPrefix {
			if strings.HasPrefix(sql, p) {
				return r
			}
		}
		t.Errorf("unexpected query %q", sql)
		return sqlError("42601", "unexpected query")
	}
}

const (
	pubLookup  = "SELECT pubinsert, pubviaroot, EXISTS (SELECT 1 FROM pg_publication_tables t WHERE t.pubname = p.pubname AND t.schemaname = 'public' AND t.tablename = 'outbox_events') FROM pg_publication p WHERE pubname = 'walbox_outbox'"
	pubCreate  = `CREATE PUBLICATION "walbox_outbox" FOR TABLE "public"."outbox_events" WITH (publish = 'insert', publish_via_partition_root = true)`
	tableThere = `SELECT to_regclass('"public"."outbox_events"') IS NOT NULL`
	relKind    = `SELECT relkind FROM pg_class WHERE oid = to_regclass('"public"."outbox_events"')`
)

func TestEnsurePublication(t *testing.T) {
	for _, c := range []struct {
		name     string
		create   bool
		answers  map[string]fakeResult
		wantSQL  []string
		wantWhat string // PreconditionError.What; "" for success
		wantFix  string
		wantErr  string // a transient error
	}{
		{name: "present and right", answers: map[string]fakeResult{"SELECT pubinsert": rows([]string{"t", "t", "t"})},
			wantSQL: []string{pubLookup}},
		{name: "missing, created", create: true,
			answers: map[string]fakeResult{"SELECT pubinsert": rows(), "CREATE PUBLICATION": {tag: "CREATE PUBLICATION"}},
			wantSQL: []string{pubLookup, pubCreate}},
		{name: "missing, not to be created", answers: map[string]fakeResult{"SELECT pubinsert": rows()},
			wantWhat: `publication "walbox_outbox" does not exist`,
			wantFix:  "run `walbox migrate`, or as the table owner: " + pubCreate},
		{name: "missing, and so is the table", create: true,
			answers:  map[string]fakeResult{"SELECT pubinsert": rows(), "CREATE PUBLICATION": sqlError("42P01", `relation "public.outbox_events" does not exist`)},
			wantWhat: "outbox table public.outbox_events does not exist", wantFix: "run `walbox migrate` to create it"},
		{name: "missing, and walbox may not create it", create: true,
			answers:  map[string]fakeResult{"SELECT pubinsert": rows(), "CREATE PUBLICATION": sqlError("42501", "must be owner of table outbox_events")},
			wantWhat: `cannot create publication "walbox_outbox"`, wantFix: "run `walbox migrate` as the table owner"},
		{name: "missing, creation fails otherwise", create: true,
			answers: map[string]fakeResult{"SELECT pubinsert": rows(), "CREATE PUBLICATION": sqlError("53200", "out of memory")},
			wantErr: "create publication walbox_outbox: ERROR: out of memory (SQLSTATE 53200)"},
		{name: "no inserts published", answers: map[string]fakeResult{"SELECT pubinsert": rows([]string{"f", "t", "t"})},
			wantWhat: `publication "walbox_outbox" does not publish inserts`,
			wantFix:  `ALTER PUBLICATION "walbox_outbox" SET (publish = 'insert', publish_via_partition_root = true)`},
		{name: "without the outbox table, which exists",
			answers:  map[string]fakeResult{"SELECT pubinsert": rows([]string{"t", "t", "f"}), "SELECT to_regclass": rows([]string{"t"})},
			wantSQL:  []string{pubLookup, tableThere},
			wantWhat: `publication "walbox_outbox" does not include public.outbox_events`,
			wantFix:  `run ` + "`walbox migrate`" + `, or as the table owner: ALTER PUBLICATION "walbox_outbox" ADD TABLE "public"."outbox_events"`},
		{name: "without the outbox table, which does not exist",
			answers:  map[string]fakeResult{"SELECT pubinsert": rows([]string{"t", "t", "f"}), "SELECT to_regclass": rows([]string{"f"})},
			wantWhat: "outbox table public.outbox_events does not exist", wantFix: "run `walbox migrate` (it creates the table"},
		{name: "via partition root off, for a table that is not partitioned",
			answers: map[string]fakeResult{"SELECT pubinsert": rows([]string{"t", "f", "t"}), "SELECT relkind": rows([]string{"r"})},
			wantSQL: []string{pubLookup, relKind}},
		{name: "rows would arrive under partition names",
			answers:  map[string]fakeResult{"SELECT pubinsert": rows([]string{"t", "f", "t"}), "SELECT relkind": rows([]string{"p"})},
			wantSQL:  []string{pubLookup, relKind},
			wantWhat: `publication "walbox_outbox" has publish_via_partition_root off, so rows of a partitioned outbox arrive under partition names`,
			wantFix:  `ALTER PUBLICATION "walbox_outbox" SET (publish_via_partition_root = true)`},
		{name: "the lookup fails", answers: map[string]fakeResult{"SELECT pubinsert": sqlError("57014", "canceling statement due to statement timeout")},
			wantErr: "look up publication walbox_outbox: ERROR: canceling statement due to statement timeout (SQLSTATE 57014)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, ws := dialFake(t, answers(t, c.answers))
			err := ensurePublication(t.Context(), conn, "walbox_outbox", []Table{{Name: outboxTable, Columns: DefaultColumns()}}, c.create)
			var pe *PreconditionError
			switch {
			case c.wantWhat != "":
				if !errors.As(err, &pe) || pe.What != c.wantWhat || !strings.HasPrefix(pe.Fix, c.wantFix) {
					t.Fatalf("err %v\nwant %s; %s", err, c.wantWhat, c.wantFix)
				}
			case c.wantErr != "":
				if err == nil || err.Error() != c.wantErr || IsPermanent(err) {
					t.Fatalf("err %v, want the transient %q", err, c.wantErr)
				}
			case err != nil:
				t.Fatal(err)
			}
			if c.wantSQL != nil {
				if got := ws.ran(); !reflect.DeepEqual(got, c.wantSQL) {
					t.Errorf("ran\n%q\nwant\n%q", got, c.wantSQL)
				}
			}
		})
	}
}

func TestCheckColumnsAndServer(t *testing.T) {
	cols := rows([]string{"id"}, []string{"topic"}, []string{"payload"}, []string{"created_at"})
	t.Run("the required columns exist", func(t *testing.T) {
		conn, ws := dialFake(t, answers(t, map[string]fakeResult{"SELECT attname": cols}))
		if err := checkColumns(t.Context(), conn, outboxTable, DefaultColumns()); err != nil {
			t.Fatal(err)
		}
		want := []string{`SELECT attname FROM pg_attribute WHERE attrelid = '"public"."outbox_events"'::regclass AND attnum > 0 AND NOT attisdropped`}
		if got := ws.ran(); !reflect.DeepEqual(got, want) {
			t.Errorf("ran %q", got)
		}
	})
	t.Run("a required role's column is gone", func(t *testing.T) {
		conn, _ := dialFake(t, answers(t, map[string]fakeResult{"SELECT attname": cols}))
		c := DefaultColumns()
		c[RolePayload] = "body"
		err := checkColumns(t.Context(), conn, outboxTable, c)
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Key != "outbox.columns.payload" || !strings.HasPrefix(ce.Msg, `table public.outbox_events has no column "body"`) {
			t.Fatalf("err %v", err)
		}
	})
	t.Run("an optional role's column may be missing", func(t *testing.T) {
		conn, _ := dialFake(t, answers(t, map[string]fakeResult{"SELECT attname": rows([]string{"id"}, []string{"topic"}, []string{"payload"})}))
		if err := checkColumns(t.Context(), conn, outboxTable, DefaultColumns()); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("no such table", func(t *testing.T) {
		conn, _ := dialFake(t, answers(t, map[string]fakeResult{"SELECT attname": sqlError("42P01", `relation "public.outbox_events" does not exist`)}))
		err := checkColumns(t.Context(), conn, outboxTable, DefaultColumns())
		if err == nil || !strings.HasPrefix(err.Error(), "read columns of public.outbox_events: ") || sqlState(err) != "42P01" {
			t.Fatalf("err %v", err)
		}
	})

	for _, c := range []struct {
		level    fakeResult
		wantWhat string
		wantErr  string
	}{
		{level: rows([]string{"logical"})},
		{level: rows([]string{"replica"}), wantWhat: "wal_level is 'replica'"},
		{level: sqlError("XX000", "boom"), wantErr: "read wal_level: ERROR: boom (SQLSTATE XX000)"},
	} {
		t.Run("wal_level", func(t *testing.T) {
			conn, _ := dialFake(t, answers(t, map[string]fakeResult{"SHOW wal_level": c.level}))
			err := checkServer(t.Context(), conn)
			var pe *PreconditionError
			switch {
			case c.wantWhat != "":
				if !errors.As(err, &pe) || pe.What != c.wantWhat || !strings.Contains(pe.Fix, "wal_level = logical") {
					t.Fatalf("err %v", err)
				}
			case c.wantErr != "":
				if err == nil || err.Error() != c.wantErr {
					t.Fatalf("err %v", err)
				}
			case err != nil:
				t.Fatal(err)
			}
		})
	}

	t.Run("server version", func(t *testing.T) {
		conn, _ := dialFake(t, answers(t, map[string]fakeResult{"SHOW server_version_num": rows([]string{"170002"})}))
		if v, err := serverVersion(t.Context(), conn); err != nil || v != 170002 {
			t.Fatalf("version %d, %v", v, err)
		}
		conn, _ = dialFake(t, answers(t, map[string]fakeResult{"SHOW server_version_num": rows()}))
		if _, err := serverVersion(t.Context(), conn); err == nil {
			t.Fatal("no row read as a version")
		}
	})
}

func TestLookupSlot(t *testing.T) {
	const lookup = `SELECT plugin, database, active, coalesce(active_pid, 0), coalesce(restart_lsn, '0/0'), coalesce(confirmed_flush_lsn, '0/0'), coalesce(wal_status, ''), coalesce(to_jsonb(s)->>'invalidation_reason', '') FROM pg_replication_slots s WHERE slot_name = 'wal''box'`
	for _, c := range []struct {
		name    string
		answer  fakeResult
		want    SlotInfo
		wantErr string
	}{
		{name: "no such slot", answer: rows()},
		{name: "active", answer: rows([]string{"pgoutput", "app", "t", "4242", "0/16B3748", "0/16B3780", "reserved", ""}),
			want: SlotInfo{Exists: true, Plugin: "pgoutput", Database: "app", Active: true, ActivePID: 4242,
				RestartLSN: 0x16B3748, ConfirmedFlushLSN: 0x16B3780, WALStatus: "reserved"}},
		{name: "invalidated", answer: rows([]string{"pgoutput", "app", "f", "0", "0/0", "0/5000000", "lost", "wal_removed"}),
			want: SlotInfo{Exists: true, Plugin: "pgoutput", Database: "app", ConfirmedFlushLSN: 0x5000000, WALStatus: "lost", InvalidationReason: "wal_removed"}},
		{name: "an error", answer: sqlError("XX000", "boom"), wantErr: "look up slot wal'box: ERROR: boom (SQLSTATE XX000)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, ws := dialFake(t, answers(t, map[string]fakeResult{"SELECT plugin": c.answer}))
			got, err := LookupSlot(t.Context(), conn, "wal'box")
			if c.wantErr != "" {
				if err == nil || err.Error() != c.wantErr {
					t.Fatalf("err %v", err)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("got %+v, %v\nwant %+v", got, err, c.want)
			}
			if q := ws.ran(); len(q) != 1 || q[0] != lookup {
				t.Errorf("ran %q", q)
			}
		})
	}
}

// TestIdentify: the session's origin, from IDENTIFY_SYSTEM and, past the
// first timeline, TIMELINE_HISTORY.
func TestIdentify(t *testing.T) {
	history := "1\t0/3000158\tno recovery target specified\n2\t0/5000000\tpromoted\n"
	for _, c := range []struct {
		name    string
		answers map[string]fakeResult
		want    *Origin
		wantErr string
	}{
		{name: "the first timeline", answers: map[string]fakeResult{"IDENTIFY_SYSTEM": rows([]string{"7300", "1", "0/16B3748", "app"})},
			want: &Origin{SystemID: "7300", Timeline: 1, Left: map[int32]LSN{}, WALPos: 0x16B3748}},
		{name: "a promoted standby", answers: map[string]fakeResult{
			"IDENTIFY_SYSTEM":    rows([]string{"7300", "3", "0/9000000", "app"}),
			"TIMELINE_HISTORY 3": rows([]string{"00000003.history", history})},
			want: &Origin{SystemID: "7300", Timeline: 3, Left: map[int32]LSN{1: 0x3000158, 2: 0x5000000}, WALPos: 0x9000000}},
		{name: "IDENTIFY_SYSTEM fails", answers: map[string]fakeResult{"IDENTIFY_SYSTEM": sqlError("42501", "permission denied")},
			wantErr: "identify system: ERROR: permission denied (SQLSTATE 42501)"},
		{name: "no history", answers: map[string]fakeResult{
			"IDENTIFY_SYSTEM":    rows([]string{"7300", "2", "0/9000000", "app"}),
			"TIMELINE_HISTORY 2": sqlError("58P01", `could not open file "pg_wal/00000002.history"`)},
			wantErr: `read timeline history of timeline 2: ERROR: could not open file "pg_wal/00000002.history" (SQLSTATE 58P01)`},
		{name: "a malformed history", answers: map[string]fakeResult{
			"IDENTIFY_SYSTEM":    rows([]string{"7300", "2", "0/9000000", "app"}),
			"TIMELINE_HISTORY 2": rows([]string{"00000002.history", "1\tnot-an-lsn\n"})},
			wantErr: `timeline history 00000002.history: malformed switch point in "1\tnot-an-lsn"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, _ := dialFake(t, answers(t, c.answers))
			got, err := identify(t.Context(), conn)
			if c.wantErr != "" {
				if err == nil || err.Error() != c.wantErr {
					t.Fatalf("err %v, want %q", err, c.wantErr)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, c.want) {
				t.Fatalf("got %+v, %v; want %+v", got, err, c.want)
			}
		})
	}
}

// TestSlotLost: when the slot as pg_replication_slots shows it counts as
// lost, the reason (walbox_slot_lost_total{reason}) and what is logged.
func TestSlotLost(t *testing.T) {
	const base = `replication slot "walbox" was invalidated (wal_status 'lost'): the WAL it needed was removed, probably because max_slot_wal_keep_size was exceeded while walbox was behind or away`
	for _, c := range []struct {
		name       string
		info       SlotInfo
		hadSlot    bool
		wantReason string
		wantMsg    string
	}{
		{name: "a healthy slot", info: SlotInfo{Exists: true, Plugin: "pgoutput", WALStatus: "reserved"}, hadSlot: true},
		{name: "an unreserved slot is not lost yet", info: SlotInfo{Exists: true, WALStatus: "unreserved"}, hadSlot: true},
		{name: "never created", info: SlotInfo{}},
		{name: "dropped while walbox used it", info: SlotInfo{}, hadSlot: true, wantReason: SlotMissing,
			wantMsg: `replication slot "walbox" disappeared while walbox was using it (dropped by someone)`},
		{name: "lost, before PostgreSQL 17", info: SlotInfo{Exists: true, WALStatus: "lost"}, wantReason: SlotInvalidated, wantMsg: base},
		{name: "WAL removed", info: SlotInfo{Exists: true, WALStatus: "lost", InvalidationReason: "wal_removed"}, hadSlot: true,
			wantReason: SlotInvalidated, wantMsg: base + " (invalidation_reason 'wal_removed')"},
		{name: "idle too long", info: SlotInfo{Exists: true, WALStatus: "lost", InvalidationReason: "idle_timeout"},
			wantReason: SlotInvalidated,
			wantMsg:    `replication slot "walbox" was invalidated (invalidation_reason 'idle_timeout'): it was inactive longer than idle_replication_slot_timeout while walbox was away; raise that setting or set it to 0`},
		{name: "rows removed, WAL kept", info: SlotInfo{Exists: true, WALStatus: "reserved", InvalidationReason: "rows_removed"},
			wantReason: SlotInvalidated, wantMsg: `replication slot "walbox" was invalidated (invalidation_reason 'rows_removed')`},
		{name: "wal_level lowered", info: SlotInfo{Exists: true, InvalidationReason: "wal_level_insufficient"},
			wantReason: SlotInvalidated, wantMsg: `replication slot "walbox" was invalidated (invalidation_reason 'wal_level_insufficient')`},
		{name: "a reason this walbox does not know", info: SlotInfo{Exists: true, InvalidationReason: "something_new"},
			wantReason: SlotInvalidated, wantMsg: base},
	} {
		t.Run(c.name, func(t *testing.T) {
			reason, msg := slotLost("walbox", c.info, c.hadSlot)
			if reason != c.wantReason || msg != c.wantMsg {
				t.Fatalf("slotLost = %q, %q\nwant %q, %q", reason, msg, c.wantReason, c.wantMsg)
			}
		})
	}
}
