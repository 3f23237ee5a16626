package relay

import (
	"errors"
	"sync"
	"testing"

	"github.com/walbox/walbox/cdc"
)

// Each outbox table's events take that table's subject template, envelope,
// rules and id header; an index no table was set for takes table 0's. Every
// message names its table, and every table but the first qualifies its
// Nats-Msg-Id with its name (the bare id in Walbox-Event-Id).
func TestRouterShapesEventsByTheirTable(t *testing.T) {
	routes := []Route{{Stream: "SVC", Subjects: []string{"svc.>"}}, {Stream: "OUTBOX", Subjects: []string{"outbox.event.>"}}}
	r, err := NewRouterWithOptions("", "db/walbox", routes, RouterOptions{SubjectTemplate: "svc.billing.{topic}", Table: "billing.outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.SetTable(2, RouterOptions{SubjectTemplate: "outbox.event.{topic}", IDHeader: "id", Envelope: EnvelopeCloudEvents, Table: "legacy.outbox"}); err != nil {
		t.Fatal(err)
	}
	ev := func(table int) *cdc.Event {
		return &cdc.Event{Table: table, ID: "e1", Topic: "Order", AggregateID: "o-7", Payload: []byte(`{}`), PayloadIsJSON: true}
	}
	m, stream, err := r.Message(ev(0))
	if err != nil || stream != "SVC" || m.Subject != "svc.billing.Order" || m.Header.Get("id") != "" || m.Header.Get(HeaderCESpecVersion) != "" ||
		m.Header.Get(HeaderMsgID) != "e1" || m.Header.Get(HeaderEventID) != "" || m.Header.Get(HeaderTable) != "billing.outbox" {
		t.Fatalf("table 0: %+v %s %v", m, stream, err)
	}
	m, stream, err = r.Message(ev(2))
	if err != nil || stream != "OUTBOX" || m.Subject != "outbox.event.Order" || m.Header.Get("id") != "e1" || m.Key != "o-7" ||
		m.Header.Get(HeaderCESpecVersion) != "1.0" || m.Header.Get(HeaderMsgID) != "legacy.outbox:e1" || m.Header.Get(HeaderEventID) != "e1" ||
		m.Header.Get(HeaderTable) != "legacy.outbox" {
		t.Fatalf("table 2 (debezium's shape; every table but the first qualifies Nats-Msg-Id): %+v %s %v", m, stream, err)
	}
	// Table 1 was never set: it falls back to table 0's shape.
	if m, _, err := r.Message(ev(1)); err != nil || m.Subject != "svc.billing.Order" {
		t.Fatalf("table 1: %+v %v", m, err)
	}
	if r.TableName(0) != "billing.outbox" || r.TableName(2) != "legacy.outbox" || r.TableName(1) != "billing.outbox" {
		t.Errorf("table names %q %q %q", r.TableName(0), r.TableName(1), r.TableName(2))
	}
	if err := r.SetTable(3, RouterOptions{Envelope: "xml"}); err == nil {
		t.Error("SetTable took an unknown envelope")
	}
}

// A table is added while the relay's goroutine routes events (the race
// detector watches the shapes).
func TestRouterSetTableWhileRouting(t *testing.T) {
	r, err := NewRouterWithOptions("", "db/walbox", []Route{{Stream: "ALL", Subjects: []string{">"}}}, RouterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 1; i < 50; i++ {
			if err := r.SetTable(i, RouterOptions{SubjectTemplate: "t.{topic}"}); err != nil {
				t.Error(err)
			}
		}
	}()
	for i := range 2000 {
		m, _, err := r.Message(&cdc.Event{Table: i % 50, ID: "x", Topic: "a", Payload: []byte(`1`), PayloadIsJSON: true})
		if err != nil {
			t.Fatal(err)
		}
		r.Recycle(m)
	}
	wg.Wait()
	if m, _, _ := r.Message(&cdc.Event{Table: 49, ID: "x", Topic: "a", Payload: []byte(`1`), PayloadIsJSON: true}); m.Subject != "t.a" {
		t.Fatalf("subject %q after SetTable", m.Subject)
	}
}

// An undeliverable event is permanent on every bus: the relay, not each
// sink, says so.
func TestRelayClassifiesPoisonItself(t *testing.T) {
	r := &Relay{sink: &fakeSink{}}
	if got := r.classify(&PoisonError{Reason: "topic is NULL"}); got != Permanent {
		t.Errorf("poison: %v", got)
	}
	if got := r.classify(errors.New("connection reset")); got != Transient {
		t.Errorf("other: %v", got)
	}
}

// The slots Msg.Qualify rewrites are the headers it means.
func TestQualifySlots(t *testing.T) {
	if slotKeys[slotMsgID] != HeaderMsgID || slotKeys[slotEventID] != HeaderEventID {
		t.Fatalf("slot %d is %s, slot %d is %s", slotMsgID, slotKeys[slotMsgID], slotEventID, slotKeys[slotEventID])
	}
}

// A table-less event (walbox.emit_message) takes its table's routing but
// names no table: it has no row, and the read-back and the sweeper must not
// take it for a row of that table (a uuid id marked into a bigint table
// failed the whole batch of marks).
func TestTableLessEventNamesNoTable(t *testing.T) {
	r, err := NewRouterWithOptions("", "db/walbox", []Route{{Stream: "ALL", Subjects: []string{">"}}}, RouterOptions{Table: "public.outbox_events"})
	if err != nil {
		t.Fatal(err)
	}
	ev := &cdc.Event{ID: "0b9c", Topic: "a", Payload: []byte(`1`), PayloadIsJSON: true, TableLess: true}
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Header.Get(HeaderTable); got != TableLessTable {
		t.Fatalf("Walbox-Table %q, want %q", got, TableLessTable)
	}
	if IdentityFromHeaders(m.Header) != r.IdentityOf(ev) || r.IdentityOf(ev) == IdentityKey("public.outbox_events", ev.ID) {
		t.Fatalf("identity %q read back as %q", r.IdentityOf(ev), IdentityFromHeaders(m.Header))
	}
	if dl := r.DeadLetter(ev, "walbox.dlq.", "x"); dl.Header.Get(HeaderTable) != TableLessTable {
		t.Fatalf("dead letter's Walbox-Table %q", dl.Header.Get(HeaderTable))
	}
}
