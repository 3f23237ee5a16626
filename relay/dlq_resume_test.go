package relay

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/walbox/walbox/cdc"
)

// TestDeadLetterReadBackByIdentity: on Kafka (one dead-letter topic, no
// Nats-Msg-Id) a dead letter whose first publish was stored but whose ack
// was lost is not stored a second time by the resend: the resume check
// reads the dead-letter topic's tail back like any topic's and finds the
// dead letter's identity there (issue 35, item 3).
func TestDeadLetterReadBackByIdentity(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st, dlq := newFakeStream(), newFakeStream()
		st.kafka, dlq.kafka = true, true
		dlq.lose[1], dlq.storeLose[1] = true, true // stored; its ack never comes
		src, ids := newScript(4, 2)
		for i := range src.changes {
			if c := &src.changes[i]; c.Kind == cdc.KindEvent && c.Event.ID == ids[3] {
				c.Event.TopicNull = true // poison: dead-lettered at once
			}
		}
		const dlqTopic = "walbox.dlq.all"
		sink := &fakeSink{st: st, dlq: dlq, ackTimeout: 5 * time.Second}
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}, {Stream: fakeDLQStream, Subjects: []string{dlqTopic}}})
		r := New(Config{Window: 16, DLQSubject: dlqTopic, RequireTail: true, BackoffInitial: 100 * time.Millisecond, BackoffMax: time.Second}, sink, router)
		serveUntilReached(t, r, src)
		if len(dlq.ids) != 1 || dlq.ids[0] != ids[3] {
			t.Fatalf("dead-letter topic holds %v, want [%s] once: the resend stored a second copy of a dead letter it could read back", dlq.ids, ids[3])
		}
		wantStoredOnce(t, st, append(append([]string{}, ids[:3]...), ids[4:]...))
	})
}
