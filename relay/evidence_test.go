package relay

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/walbox/walbox/cdc"
)

// An event this process published and whose ack never came may be missing
// while later ones were stored: only its own ack or its id read back says
// it is stored, never its position before the tail's (issue 33, "never for
// an event this process already tried to publish"). Here the first publish
// is lost (a stream leader stops under it) and the three behind it are
// stored; the read-back before the resend holds those three, and the lost
// one's position is before all of them. Before the fix the resume check
// took it for stored and skipped it: lost, its transaction confirmed.
func TestResumeNeverInfersATriedEventStored(t *testing.T) {
	for _, kafka := range []bool{false, true} {
		name := "jetstream"
		if kafka {
			name = "kafka"
		}
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				st := newFakeStream()
				st.kafka = kafka
				st.lose[1] = true
				src, ids := newScript(4, 1)
				origin := &cdc.Origin{SystemID: "7300000000000000001", Timeline: 1, WALPos: 0x100}
				src.changes = append([]cdc.Change{{Kind: cdc.KindOrigin, Origin: origin}}, src.changes...)
				router := NewRouter("", "app/walbox", []Route{{Stream: "ORDERS", Subjects: []string{"orders.>"}}})
				sink := &fakeSink{st: st, dlq: newFakeStream(), ackTimeout: 5 * time.Second}
				r := New(Config{Window: 4, RequireTail: kafka, BackoffInitial: 100 * time.Millisecond}, sink, router)
				serveUntilReached(t, r, src)
				seen := map[string]int{}
				for _, id := range st.ids {
					seen[id]++
				}
				if seen[ids[0]] != 1 {
					t.Fatalf("%s stored %d times (stream %v): the lost publish was skipped by its position", ids[0], seen[ids[0]], st.ids)
				}
				for _, id := range ids[1:] {
					if seen[id] != 1 {
						t.Fatalf("%s stored %d times (stream %v)", id, seen[id], st.ids)
					}
				}
			})
		})
	}
}
