package cdc

import (
	"testing"
)

// Rows of several outbox tables carry their table's index and are read
// with that table's column names; a published table that is not configured
// is asked about at its first row (not at its Relation, which pgoutput also
// sends for a partition beside its root), once.
func TestDecodeSeveralTables(t *testing.T) {
	billing := Columns{}
	billing[RoleID], billing[RoleTopic], billing[RolePayload] = "event_id", "subject", "body"
	d := newTablesDecoder([]Table{{Name: outboxTable, Columns: DefaultColumns()}, {Name: TableName{Schema: "billing", Name: "outbox"}, Columns: billing}})
	var asked []TableName
	d.unknown = func(n TableName) (int, Columns, bool) {
		asked = append(asked, n)
		if n.Schema == "shipping" && n.Name == "outbox" {
			return 2, DefaultColumns(), true
		}
		return -1, Columns{}, false
	}
	d.commitLSN, d.commitTime = 0x100, commitTime
	rels := [][]byte{
		relationMsg(1, "public", "outbox_events", outboxColumns...),
		relationMsg(2, "billing", "outbox", relCol{name: "body", oid: oidJSONB}, relCol{name: "event_id", oid: oidUUID, key: true}, relCol{name: "subject", oid: oidText}),
		relationMsg(3, "shipping", "outbox", relCol{name: "id", oid: oidUUID, key: true}, relCol{name: "topic", oid: oidText}, relCol{name: "payload", oid: oidJSONB}),
		relationMsg(4, "shipping", "outbox_p20261202", relCol{name: "id", oid: oidUUID, key: true}),
		relationMsg(5, "public", "audit", relCol{name: "id", oid: oidUUID, key: true}),
	}
	for _, r := range rels {
		if err := d.relation(parseRelation(t, r)); err != nil {
			t.Fatal(err)
		}
	}
	if len(asked) != 0 {
		t.Fatalf("asked about %v at Relation messages", asked)
	}
	insert := func(rel uint32, row ...tupleCol) (Event, bool) {
		t.Helper()
		var ev Event
		ok, err := d.insert(insertMsg(rel, row...), &ev)
		if err != nil {
			t.Fatal(err)
		}
		return ev, ok
	}
	if ev, ok := insert(2, txt(`{"b":1}`), txt("b-1"), txt("invoice.paid")); !ok || ev.Table != 1 || ev.ID != "b-1" || ev.Topic != "invoice.paid" || string(ev.Payload) != `{"b":1}` {
		t.Fatalf("billing row: %+v %v", ev, ok)
	}
	if ev, ok := insert(1, outboxRow("p-1", "orders.created", `{}`)...); !ok || ev.Table != 0 || ev.ID != "p-1" {
		t.Fatalf("public row: %+v %v", ev, ok)
	}
	if ev, ok := insert(3, txt("s-1"), txt("parcel.sent"), txt(`{}`)); !ok || ev.Table != 2 || ev.ID != "s-1" || ev.Topic != "parcel.sent" {
		t.Fatalf("a table configured while running: %+v %v", ev, ok)
	}
	if _, ok := insert(5, txt("a-1")); ok {
		t.Fatal("a row of a table that is not configured was decoded")
	}
	insert(5, txt("a-2"))
	insert(3, txt("s-2"), txt("parcel.sent"), txt(`{}`))
	if len(asked) != 2 || asked[0].Name != "outbox" || asked[1].Name != "audit" {
		t.Fatalf("asked about %v; want shipping.outbox, then public.audit, once each", asked)
	}
}

// A logical message names its table, or takes the default one; a table
// walbox does not know makes it a dead letter that says so.
func TestMessageNamesItsTable(t *testing.T) {
	d := newTablesDecoder([]Table{{Name: outboxTable, Columns: DefaultColumns()}, {Name: TableName{Schema: "billing", Name: "outbox"}, Columns: DefaultColumns()}})
	d.defaultTable = 1
	for _, c := range []struct {
		body   string
		table  int
		poison bool
	}{
		{`{"id":"1","topic":"t","payload":{}}`, 1, false},
		{`{"id":"2","topic":"t","payload":{},"table":null}`, 1, false},
		{`{"id":"3","topic":"t","payload":{},"table":"outbox_events"}`, 0, false},
		{`{"id":"4","topic":"t","payload":{},"table":"billing.outbox"}`, 1, false},
		{`{"id":"5","topic":"t","payload":{},"table":"nope.outbox"}`, 1, true},
	} {
		var ev Event
		if err := d.message([]byte(c.body), &ev); err != nil {
			t.Fatal(err)
		}
		if ev.Table != c.table || (ev.Poison != "") != c.poison {
			t.Errorf("%s: table %d, poison %q", c.body, ev.Table, ev.Poison)
		}
	}
}
