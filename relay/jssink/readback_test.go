package jssink_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/walbox/walbox/relay"
)

// The read-back of a stream's newest messages goes on to older ones until
// the caller has counted as many as it wants: in a stream shared with
// another table and another database, the newest messages can all be
// theirs (issue 34, item 6). It stops at the stream's start, or after
// ScanMax messages.
func TestReadBackGoesBackUntilItCountedItsOwn(t *testing.T) {
	sink := startSink(t, 5*time.Second, "ORDERS", "orders.>")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	publish := func(n int, source, table string) {
		for i := range n {
			m := &relay.Msg{Subject: "orders.x", Data: []byte(`{}`), Header: relay.Header{
				relay.HeaderMsgID: {fmt.Sprintf("%s/%s/%d", source, table, i)}, relay.HeaderEventID: {fmt.Sprint(i)},
				relay.HeaderSource: {source}, relay.HeaderTable: {table}, relay.HeaderCreatedAt: {"2026-12-03 08:00:00+00"},
			}}
			f, err := sink.Publish(m)
			if err != nil {
				t.Fatal(err)
			}
			if r, err := relay.Await(ctx, f); err != nil || r.Duplicate {
				t.Fatalf("publish: %+v %v", r, err)
			}
		}
	}
	publish(30, "db/walbox", "public.a")  // sequences 1-30
	publish(200, "db/walbox", "public.b") // 31-230
	publish(100, "other/walbox", "public.a")

	type read struct{ mine, theirs int }
	readBack := func(rr relay.ReadBackRange) read {
		t.Helper()
		var r read
		err := sink.ReadBack(ctx, "ORDERS", "db/walbox", rr, func(ev relay.StoredEvent) bool {
			if ev.CreatedAt != "2026-12-03 08:00:00+00" || ev.ID == "" {
				t.Fatalf("read back %+v", ev)
			}
			if ev.Table != "public.a" {
				r.theirs++
				return false
			}
			r.mine++
			return true
		})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	// 10 wanted: past the other database's 100 and the other table's 200,
	// in chunks of 10, 20, 40, 80 and 160 messages, the last (21-180)
	// with 10 of this table's.
	if got := readBack(relay.ReadBackRange{Want: 10}); got.mine != 10 || got.theirs != 200 {
		t.Errorf("want 10: read back %d of this table's and %d of the other's, want 10 and 200", got.mine, got.theirs)
	}
	// More than the stream holds: up to its start.
	if got := readBack(relay.ReadBackRange{Want: 1000}); got.mine != 30 || got.theirs != 200 {
		t.Errorf("want 1000: read back %d of this table's and %d of the other's, want 30 and 200", got.mine, got.theirs)
	}
	// ScanMax 250 messages: the newest 250 hold 150 of this source's, none
	// of this table's.
	if got := readBack(relay.ReadBackRange{Want: 10, ScanMax: 250}); got.mine != 0 || got.theirs != 150 {
		t.Errorf("scan max 250: read back %d of this table's and %d of the other's, want 0 and 150", got.mine, got.theirs)
	}
	// A span of sequences is read as it is, whatever fn counts.
	if got := readBack(relay.ReadBackRange{First: 21, Last: 40}); got.mine != 10 || got.theirs != 10 {
		t.Errorf("sequences 21-40: read back %d of this table's and %d of the other's, want 10 and 10", got.mine, got.theirs)
	}
}
