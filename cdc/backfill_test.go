package cdc

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"
)

// outboxTypes is pg_attribute of walbox's own outbox table: column name to
// type OID.
func outboxTypes() map[string]int {
	return map[string]int{
		"id": oidUUID, "topic": oidText, "payload": oidJSONB, "stream": oidText,
		"event_type": oidText, "aggregate_type": oidText, "aggregate_id": oidText,
		"partition_key": oidText, "headers": oidJSONB, "created_at": oidTimestamptz,
		"processed": oidBool, "processed_at": oidTimestamptz, "error": oidText, "attempts": 23,
	}
}

func TestPlanBackfill(t *testing.T) {
	table := TableName{Schema: "public", Name: "outbox_events"}
	all := []Role{RoleID, RoleTopic, RolePayload, RoleStream, RoleEventType, RoleAggregateType, RoleAggregateID, RolePartitionKey, RoleHeaders, RoleCreatedAt}
	// The xid's age, oldest first, with frozen rows whose age wrapped
	// taken as the oldest (see xidAge).
	const age = `CASE WHEN age(xmin) > 0 THEN age(xmin) ELSE 2147483647 END`
	const allSel = `"id"::text, "topic"::text, "payload"::text, "stream"::text, "event_type"::text, "aggregate_type"::text, "aggregate_id"::text, "partition_key"::text, "headers"::text, "created_at"::text`
	custom := DefaultColumns()
	custom[RoleID], custom[RoleTopic], custom[RolePayload] = "event_id", "subject", "body"
	custom[RoleStream], custom[RoleHeaders], custom[RoleCreatedAt] = "", "", "occurred_at"

	for _, c := range []struct {
		name       string
		table      TableName
		cols       Columns
		types      map[string]int
		commitTS   bool
		wantRoles  []Role
		wantJSON   bool
		wantDeclar string
	}{
		{
			name: "walbox's own table", table: table, cols: DefaultColumns(), types: outboxTypes(),
			wantRoles: all, wantJSON: true,
			wantDeclar: `DECLARE walbox_backfill NO SCROLL CURSOR FOR SELECT ` + allSel + ` FROM "public"."outbox_events" WHERE NOT processed ORDER BY "created_at", cmin::text::bigint, ` + age + ` DESC, ctid, "id"`,
		},
		{
			name: "track_commit_timestamp on orders by commit time first", table: table, cols: DefaultColumns(), types: outboxTypes(), commitTS: true,
			wantRoles: all, wantJSON: true,
			wantDeclar: `DECLARE walbox_backfill NO SCROLL CURSOR FOR SELECT ` + allSel + ` FROM "public"."outbox_events" WHERE NOT processed ORDER BY pg_xact_commit_timestamp(xmin) NULLS FIRST, "created_at", cmin::text::bigint, ` + age + ` DESC, ctid, "id"`,
		},
		{
			name:  "an existing table with only the required columns, text payload, no processed flag",
			table: TableName{Schema: "billing", Name: `we"ird`}, cols: DefaultColumns(),
			types:     map[string]int{"id": oidInt8, "topic": oidVarchar, "payload": oidText},
			wantRoles: []Role{RoleID, RoleTopic, RolePayload}, wantJSON: false,
			wantDeclar: `DECLARE walbox_backfill NO SCROLL CURSOR FOR SELECT "id"::text, "topic"::text, "payload"::text FROM "billing"."we""ird" ORDER BY ` + age + ` DESC, cmin::text::bigint, ctid, "id"`,
		},
		{
			name:  "no created_at, track_commit_timestamp on: the xid's age groups only the rows without a commit time",
			table: TableName{Schema: "billing", Name: "outbox"}, cols: DefaultColumns(), commitTS: true,
			types:     map[string]int{"id": oidInt8, "topic": oidVarchar, "payload": oidText},
			wantRoles: []Role{RoleID, RoleTopic, RolePayload}, wantJSON: false,
			wantDeclar: `DECLARE walbox_backfill NO SCROLL CURSOR FOR SELECT "id"::text, "topic"::text, "payload"::text FROM "billing"."outbox" ORDER BY pg_xact_commit_timestamp(xmin) NULLS FIRST, ` +
				`CASE WHEN pg_xact_commit_timestamp(xmin) IS NULL THEN ` + age + ` END DESC, cmin::text::bigint, ` + age + ` DESC, ctid, "id"`,
		},
		{
			name: "renamed and unmapped roles, json payload", table: table, cols: custom,
			types: map[string]int{"event_id": oidUUID, "subject": oidText, "body": oidJSON, "stream": oidText,
				"headers": oidJSONB, "occurred_at": oidTimestamptz, "event_type": oidText},
			wantRoles: []Role{RoleID, RoleTopic, RolePayload, RoleEventType, RoleCreatedAt}, wantJSON: true,
			wantDeclar: `DECLARE walbox_backfill NO SCROLL CURSOR FOR SELECT "event_id"::text, "subject"::text, "body"::text, "event_type"::text, "occurred_at"::text FROM "public"."outbox_events" ORDER BY "occurred_at", cmin::text::bigint, ` + age + ` DESC, ctid, "event_id"`,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := planBackfill(c.table, c.cols, c.types, true, c.commitTS)
			if !reflect.DeepEqual(p.roles, c.wantRoles) {
				t.Errorf("roles %v, want %v", p.roles, c.wantRoles)
			}
			if p.payloadIsJSON != c.wantJSON {
				t.Errorf("payloadIsJSON %v, want %v", p.payloadIsJSON, c.wantJSON)
			}
			if p.declare != c.wantDeclar {
				t.Errorf("declare\n got %s\nwant %s", p.declare, c.wantDeclar)
			}
		})
	}
}

func ptr(s string) *string { return &s }

func TestBackfillEventFromRow(t *testing.T) {
	at := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
	all := planBackfill(TableName{Schema: "public", Name: "outbox_events"}, DefaultColumns(), outboxTypes(), true, false)
	textPayload := planBackfill(TableName{Schema: "public", Name: "outbox_events"}, DefaultColumns(),
		map[string]int{"id": oidUUID, "topic": oidText, "payload": oidText}, true, false)
	for _, c := range []struct {
		name string
		plan backfillPlan
		n    uint32
		vals []*string
		want Event
	}{
		{
			name: "every role", plan: all, n: 7,
			vals: []*string{ptr("0190a1b2-0000-7000-8000-000000000001"), ptr("payout.generated"), ptr(`{"payout_id": "p_001"}`),
				ptr("PAYOUTS"), ptr("generated"), ptr("payout"), ptr("p_001"), ptr("merchant-9"), ptr(`{"trace": "x"}`),
				ptr("2026-03-04 05:06:07.123456+00")},
			want: Event{Pos: Position{Index: 7}, CommitTime: at, ID: "0190a1b2-0000-7000-8000-000000000001",
				Topic: "payout.generated", Stream: "PAYOUTS", EventType: "generated", AggregateType: "payout",
				AggregateID: "p_001", PartitionKey: "merchant-9", CreatedAt: "2026-03-04 05:06:07.123456+00",
				Payload: []byte(`{"payout_id": "p_001"}`), PayloadIsJSON: true, Headers: []byte(`{"trace": "x"}`)},
		},
		{
			name: "NULLs: topic stays NULL, payload NULL, optional roles empty", plan: all,
			vals: []*string{ptr("id-1"), nil, nil, nil, nil, nil, nil, nil, nil, nil},
			want: Event{CommitTime: at, ID: "id-1", TopicNull: true, PayloadNull: true, PayloadIsJSON: true},
		},
		{
			name: "a text payload is not known to be JSON", plan: textPayload, n: 1,
			vals: []*string{ptr("id-2"), ptr("t"), ptr("not json")},
			want: Event{Pos: Position{Index: 1}, CommitTime: at, ID: "id-2", Topic: "t", Payload: []byte("not json")},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := c.plan.event(c.n, at, c.vals)
			if !reflect.DeepEqual(got, c.want) {
				t.Errorf("event\n got %+v\nwant %+v", got, c.want)
			}
		})
	}
}

// rowsFetcher serves a backfill cursor from memory: each FETCH returns the
// next page.
func rowsFetcher(pages ...[][]*string) func(context.Context, func([]*string) error) (int, error) {
	return func(_ context.Context, each func([]*string) error) (int, error) {
		if len(pages) == 0 {
			return 0, nil
		}
		page := pages[0]
		pages = pages[1:]
		for i, row := range page {
			if err := each(row); err != nil {
				return i, err
			}
		}
		return len(page), nil
	}
}

func row(id, payload string) []*string { return []*string{ptr(id), ptr("t"), ptr(payload)} }

// drain returns the batches received on out until it is closed, and their
// changes in order.
func drain(out chan []Change) (batches [][]Change, all []Change) {
	for b := range out {
		batches = append(batches, b)
		all = append(all, b...)
	}
	return batches, all
}

func TestSendBackfill(t *testing.T) {
	plan := planBackfill(TableName{Schema: "public", Name: "outbox_events"}, DefaultColumns(),
		map[string]int{"id": oidUUID, "topic": oidText, "payload": oidJSONB}, true, false)
	origin := &Origin{SystemID: "7300", Timeline: 1}
	first := []Change{{Kind: KindReset}, {Kind: KindOrigin, Origin: origin}}
	const consistent = LSN(0x16B3748)

	t.Run("one synthetic transaction ending at the consistent point", func(t *testing.T) {
		src := testSource(t, nil)
		out := make(chan []Change, 16)
		err := backfillOne(src, t.Context(), plan, consistent, out, append([]Change(nil), first...),
			rowsFetcher([][]*string{row("a", `{}`), row("b", `{}`)}, [][]*string{row("c", `{}`)}))
		if err != nil {
			t.Fatal(err)
		}
		close(out)
		batches, all := drain(out)
		// One batch per FETCH, then the commit on its own.
		if len(batches) != 3 {
			t.Fatalf("%d batches, want 3: %+v", len(batches), batches)
		}
		wantKinds := []ChangeKind{KindReset, KindOrigin, KindBegin, KindEvent, KindEvent, KindEvent, KindCommit}
		if got := kinds(all); !reflect.DeepEqual(got, wantKinds) {
			t.Fatalf("kinds %v, want %v", got, wantKinds)
		}
		if all[1].Origin != origin || all[2].LSN != 0 || all[6].LSN != consistent {
			t.Errorf("origin %v, begin LSN %s, commit LSN %s", all[1].Origin, all[2].LSN, all[6].LSN)
		}
		for i, id := range []string{"a", "b", "c"} {
			ev := all[3+i].Event
			if ev.ID != id || ev.Pos != (Position{CommitLSN: 0, Index: uint32(i)}) || !ev.PayloadIsJSON {
				t.Errorf("event %d: %+v", i, ev)
			}
		}
	})

	t.Run("an empty table still commits at the consistent point", func(t *testing.T) {
		src := testSource(t, nil)
		out := make(chan []Change, 4)
		if err := backfillOne(src, t.Context(), plan, consistent, out, nil, rowsFetcher()); err != nil {
			t.Fatal(err)
		}
		close(out)
		batches, all := drain(out)
		if len(batches) != 1 || !reflect.DeepEqual(kinds(all), []ChangeKind{KindBegin, KindCommit}) || all[1].LSN != consistent {
			t.Fatalf("batches %+v", batches)
		}
	})

	t.Run("large rows are handed over before the fetch is done", func(t *testing.T) {
		src := testSource(t, func(c *Config) { c.BatchBytes = 10 })
		out := make(chan []Change, 16)
		big := `{"k": "0123456789"}`
		err := backfillOne(src, t.Context(), plan, consistent, out, nil,
			rowsFetcher([][]*string{row("a", `{}`), row("b", big), row("c", `{}`)}))
		if err != nil {
			t.Fatal(err)
		}
		close(out)
		batches, all := drain(out)
		if got := kinds(batches[0]); !reflect.DeepEqual(got, []ChangeKind{KindBegin, KindEvent, KindEvent}) {
			t.Errorf("first batch %v: want it handed over at the row that reached BatchBytes", got)
		}
		wantKinds := []ChangeKind{KindBegin, KindEvent, KindEvent, KindEvent, KindCommit}
		if got := kinds(all); !reflect.DeepEqual(got, wantKinds) {
			t.Fatalf("kinds %v, want %v", got, wantKinds)
		}
	})

	t.Run("a fetch error ends it", func(t *testing.T) {
		src := testSource(t, nil)
		out := make(chan []Change, 4)
		boom := errors.New("backfill: fetch: connection reset")
		err := backfillOne(src, t.Context(), plan, consistent, out, nil,
			func(context.Context, func([]*string) error) (int, error) { return 0, boom })
		if !errors.Is(err, boom) {
			t.Fatalf("err %v, want %v", err, boom)
		}
		if len(out) != 0 {
			t.Fatalf("%d batches handed over after a failed fetch", len(out))
		}
	})

	t.Run("cancelled while the relay takes nothing", func(t *testing.T) {
		src := testSource(t, nil)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		err := backfillOne(src, ctx, plan, consistent, make(chan []Change), nil, rowsFetcher([][]*string{row("a", `{}`)}))
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err %v, want context.Canceled", err)
		}
	})
}

func kinds(cs []Change) []ChangeKind {
	var k []ChangeKind
	for _, c := range cs {
		k = append(k, c.Kind)
	}
	return k
}

// backfillOne runs a one-table backfill's hand-over: the rows fetch yields
// in one synthetic transaction that ends at consistent.
func backfillOne(src *Source, ctx context.Context, plan backfillPlan, consistent LSN, out chan<- []Change, first []Change,
	fetch func(ctx context.Context, each func(vals []*string) error) (int, error)) error {
	bf := &backfillRun{batch: append(first, Change{Kind: KindBegin, LSN: 0}), started: time.Now()}
	if err := src.sendBackfill(ctx, plan, bf, out, fetch); err != nil {
		return err
	}
	return src.endBackfill(ctx, bf, consistent, out)
}
