package relay

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/walbox/walbox/cdc"
)

// TestResumeSkipsWhatTheTailPredatesWithABackfillInIt: a stream whose tail
// holds a backfilled event (no WAL position: commit LSN 0) beside WAL
// events. A relay that receives the WAL again from an older position (a
// slot whose confirmed position went back, as PostgreSQL before 17 does
// after a restart) must skip what the stream holds from before the tail by
// position, and what is in it by id. A backfilled record once made the
// tail's oldest position 0, so nothing predated it and every event before
// the tail was stored again: duplicates on Kafka, which has no Nats-Msg-Id.
func TestResumeSkipsWhatTheTailPredatesWithABackfillInIt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := newFakeStream()
		st.kafka = true
		src, ids := newScript(10, 2)
		origin := &cdc.Origin{SystemID: "7300000000000000001", Timeline: 1, WALPos: 0x10000}
		src.changes = append([]cdc.Change{{Kind: cdc.KindOrigin, Origin: origin}}, src.changes...)
		router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
		router.SetOrigin(origin)
		first := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
		publish := func(ev *cdc.Event) {
			t.Helper()
			m, _, err := router.Message(ev)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := first.Publish(m); err != nil {
				t.Fatal(err)
			}
		}
		// A first relay stored every event; a backfill (after a lost slot)
		// stored one more row between the 8th and the 9th transaction.
		want := []string{}
		for _, ch := range src.changes {
			if ch.Kind != cdc.KindEvent {
				continue
			}
			ev := ch.Event
			publish(&ev)
			want = append(want, ev.ID)
			if ev.ID == ids[15] {
				bf := cdc.Event{Pos: cdc.Position{Index: 1}, CommitTime: ev.CommitTime, ID: "backfilled", Topic: "orders.created", Payload: []byte(`{}`), PayloadIsJSON: true}
				publish(&bf)
				want = append(want, bf.ID)
			}
		}
		// The next relay reads the whole WAL again; its tail read-back
		// (2 × window = 8 messages) holds the backfilled record.
		sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
		r := New(Config{Window: 4, RequireTail: true, BackoffInitial: 100 * time.Millisecond}, sink, router)
		serveUntilReached(t, r, src)
		if err := checkStream(st, want); err != nil {
			t.Fatal(err)
		}
	})
}

// TestPartitionedTailKeepsARangePerPartition: each partition is an ordered
// unit of its own, with its own oldest and newest position; nothing is
// proved across partitions (issue 33, item 3).
func TestPartitionedTailKeepsARangePerPartition(t *testing.T) {
	o := StoredOrigin{SystemID: "7300000000000000001", Timeline: 1}
	at := func(lsn int) cdc.Position { return cdc.Position{CommitLSN: cdc.LSN(lsn)} }
	p := NewPartitionedTail()
	for i, r := range [][2]int{{0, 10}, {1, 20}, {1, 30}, {0, 40}, {1, 0}, {0, 50}} {
		p.Add(int32(r[0]), string(rune('a'+i)), o, at(r[1]))
	}
	tail := p.Tail()
	if len(tail.IDs) != 6 || !tail.Found {
		t.Fatalf("ids %v", tail.IDs)
	}
	want := map[TailKey]PosRange{
		{StoredOrigin: o, Partition: 0}: {at(10), at(50)},
		{StoredOrigin: o, Partition: 1}: {at(20), at(30)},
	}
	if len(tail.Ranges) != len(want) {
		t.Fatalf("ranges %+v, want %+v", tail.Ranges, want)
	}
	for k, r := range want {
		if tail.Ranges[k] != r {
			t.Fatalf("partition %d: range %+v, want %+v", k.Partition, tail.Ranges[k], r)
		}
	}
}
