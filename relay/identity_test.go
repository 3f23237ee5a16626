package relay

import (
	"fmt"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/walbox/walbox/cdc"
)

// twoTablesScript is n transactions, each inserting row i into table a
// (index 0) and row i into table b (index 1): the same ids in both, as two
// bigserial tables have.
func twoTablesScript(n int) *scriptSource {
	s := &scriptSource{reached: make(chan struct{})}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range n {
		commit := cdc.LSN(0x1000 + 0x100*i)
		s.changes = append(s.changes, cdc.Change{Kind: cdc.KindBegin, LSN: commit})
		for tbl := range 2 {
			s.changes = append(s.changes, cdc.Change{Kind: cdc.KindEvent, Event: cdc.Event{
				Pos: cdc.Position{CommitLSN: commit, Index: uint32(tbl)}, CommitTime: t0, Table: tbl,
				ID: strconv.Itoa(i + 1), Topic: "orders.created", Payload: []byte(`{}`), PayloadIsJSON: true,
			}})
		}
		s.target = commit + 0x10
		s.changes = append(s.changes, cdc.Change{Kind: cdc.KindCommit, LSN: s.target})
	}
	return s
}

// Issue 33, item 4: two outbox tables with the same ids into one stream.
// Every table but the first qualifies its Nats-Msg-Id with its name, so
// JetStream never takes table b's row 1 for table a's. Before the fix every
// event of table b was dropped as a duplicate (20 of 20 lost) and, under
// strict order, the duplicates' acks put the expectations out of step.
func TestTwoTablesWithTheSameIDsAreBothStored(t *testing.T) {
	for _, strict := range []bool{false, true} {
		t.Run("strict="+strconv.FormatBool(strict), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				st := newFakeStream()
				src := twoTablesScript(20)
				m := NewMetrics(nil)
				sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
				router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
				for i, name := range []string{"public.a", "public.b"} {
					if err := router.SetTable(i, RouterOptions{Table: name}); err != nil {
						t.Fatal(err)
					}
				}
				var delivered []Delivered
				r := New(Config{Window: 16, StrictOrder: strict, Metrics: m, BackoffInitial: time.Second,
					OnDelivered: func(d Delivered) { delivered = append(delivered, d) }}, sink, router)
				serveUntilReached(t, r, src)

				// The stream, by identity (table, id), in order.
				var got []string
				seen := map[string]int{}
				for i, h := range st.hdrs {
					id := h.Get(HeaderEventID)
					if id == "" {
						id = st.ids[i]
					}
					k := h.Get(HeaderTable) + "/" + id
					got = append(got, k)
					seen[k]++
				}
				var want []string
				for i := range 20 {
					want = append(want, fmt.Sprintf("public.a/%d", i+1), fmt.Sprintf("public.b/%d", i+1))
				}
				for _, k := range want {
					if seen[k] != 1 {
						t.Fatalf("%s stored %d times; stream %v", k, seen[k], got)
					}
				}
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("stream order %v, want %v", got, want)
				}
				if c := testutil.ToFloat64(m.IDCollisions.WithLabelValues("ORDERS")); c != 0 {
					t.Fatalf("walbox_id_collisions_total = %v, want 0", c)
				}
				// Every delivery the sweeper gets is of a stored event.
				for _, d := range delivered {
					if d.Seq == 0 || d.Seq > uint64(len(st.hdrs)) {
						t.Fatalf("delivered %+v without a stored message", d)
					}
					h := st.hdrs[d.Seq-1]
					if name := router.TableName(d.Table); h.Get(HeaderTable) != name {
						t.Fatalf("row %s of %s marked from the message of %s", d.ID, name, h.Get(HeaderTable))
					}
				}
			})
		})
	}
}

// Another database's walbox writes the same ids into the stream (both
// tables bigserial). JetStream acks this relay's row 1 as a duplicate of the
// other's: an ack, but not about this event. The relay reads the message
// the ack points at, finds another source's event, and publishes its own
// again under a Nats-Msg-Id qualified with source and table. Strict order
// keeps the order (without it, the resend lands behind what the window
// stored meanwhile, as after any lost publish). Before the fix all 20 were
// dropped.
func TestAnotherDatabasesSameIDsDoNotHideEvents(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		for i := range 20 {
			id := strconv.Itoa(i + 1)
			st.store(id, Header{HeaderMsgID: {id}, HeaderSource: {"other/walbox"}, HeaderTable: {"public.outbox_events"}})
		}
		src, ids := newScript(10, 2)
		for i := range src.changes {
			if c := &src.changes[i]; c.Kind == cdc.KindEvent {
				n := c.Event.Pos.CommitLSN/0x100 - 0x10
				c.Event.ID = strconv.Itoa(int(n)*2 + int(c.Event.Pos.Index) + 1)
			}
		}
		ids = ids[:0]
		for i := range 20 {
			ids = append(ids, strconv.Itoa(i+1))
		}
		m := NewMetrics(nil)
		sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
		if err := router.SetTable(0, RouterOptions{Table: "public.outbox_events"}); err != nil {
			t.Fatal(err)
		}
		r := New(Config{Window: 16, StrictOrder: true, Metrics: m, BackoffInitial: time.Second}, sink, router)
		serveUntilReached(t, r, src)
		var ours []string
		for i, h := range st.hdrs {
			if h.Get(HeaderSource) != "app/walbox" {
				continue
			}
			if h.Get(HeaderEventID) != st.ids[i][len(st.ids[i])-len(h.Get(HeaderEventID)):] {
				t.Fatalf("message %s: Walbox-Event-Id %q", st.ids[i], h.Get(HeaderEventID))
			}
			ours = append(ours, h.Get(HeaderEventID))
		}
		if fmt.Sprint(ours) != fmt.Sprint(ids) {
			t.Fatalf("this database's events in the stream: %v, want %v", ours, ids)
		}
		if c := testutil.ToFloat64(m.IDCollisions.WithLabelValues("ORDERS")); c != 20 {
			t.Fatalf("walbox_id_collisions_total = %v, want 20", c)
		}
	})
}
