package relay

import (
	"testing"

	"github.com/walbox/walbox/cdc"
)

// A message and a dead letter carry the row's created_at as decoded, and a
// read-back gets it with the table, the id and the reason: the sweeper's
// mark then finds the row's partition. A value a header would alter is
// left out (the mark matches by id alone).
func TestMessagesCarryTheirRowsCreatedAt(t *testing.T) {
	r, err := NewRouterWithOptions("", "db/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}}, RouterOptions{Table: "public.outbox_events"})
	if err != nil {
		t.Fatal(err)
	}
	const at = "2026-12-03 08:00:00.123456+00"
	ev := &cdc.Event{ID: "e1", Topic: "orders.x", CreatedAt: at, Payload: []byte(`{}`), PayloadIsJSON: true}
	m, _, err := r.Message(ev)
	if err != nil {
		t.Fatal(err)
	}
	if got := StoredEventFromHeaders(m.Header); got != (StoredEvent{Table: "public.outbox_events", ID: "e1", CreatedAt: at}) {
		t.Errorf("message read back as %+v", got)
	}
	r.Recycle(m)
	dl := r.DeadLetter(ev, "walbox.dlq.", "too large")
	if got := StoredEventFromHeaders(dl.Header); got != (StoredEvent{Table: "public.outbox_events", ID: "e1", CreatedAt: at, Reason: "too large"}) {
		t.Errorf("dead letter read back as %+v", got)
	}
	if back := EventFromHeaders(dl.Header, "orders.x", "e1", dl.Data); back.CreatedAt != at {
		t.Errorf("the retried event's created_at is %q, want %q", back.CreatedAt, at)
	}
	// A recycled message drops the header when the next event has none.
	for _, v := range []string{"", " 2026-12-03", "2026-12-03\n08:00"} {
		ev := &cdc.Event{ID: "e2", Topic: "orders.x", CreatedAt: v, Payload: []byte(`{}`), PayloadIsJSON: true}
		m, _, err := r.Message(ev)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := m.Header[HeaderCreatedAt]; ok {
			t.Errorf("created_at %q: header %q set", v, m.Header.Get(HeaderCreatedAt))
		}
		if _, ok := r.DeadLetter(ev, "walbox.dlq.", "x").Header[HeaderCreatedAt]; ok {
			t.Errorf("created_at %q: dead letter's header set", v)
		}
		r.Recycle(m)
	}
}
