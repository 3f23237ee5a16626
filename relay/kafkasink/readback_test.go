package kafkasink_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// The read-back of a topic's newest records goes on, in each partition, to
// older ones until the caller has counted as many as it wants there: in a
// topic shared with another table and another database, the newest records
// can all be theirs (issue 34, item 6). It stops at a partition's start, or
// after ScanMax records of it.
func TestReadBackGoesBackInEachPartitionUntilItCountedItsOwn(t *testing.T) {
	c := newCluster(t)
	s := newSink(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := kafkasink.EnsureTopics(ctx, s.Client(), []kafkasink.TopicSpec{{Name: "orders", Partitions: 3, ReplicationFactor: 1, Manage: true}}); err != nil {
		t.Fatal(err)
	}
	partOf := map[string]int32{} // event id -> partition
	mineIn := map[int32]int{}    // partition -> records of this table
	publish := func(n int, source, table string) {
		for i := range n {
			id := fmt.Sprintf("%s/%s/%d", source, table, i)
			m := &relay.Msg{Subject: "orders", Key: "k" + strconv.Itoa(i%7), Data: []byte(`{}`), Header: relay.Header{
				relay.HeaderMsgID: {id}, relay.HeaderSource: {source}, relay.HeaderTable: {table}}}
			f, err := s.Publish(m)
			if err != nil {
				t.Fatal(err)
			}
			a, err := wait(t, ctx, f)
			if err != nil {
				t.Fatal(err)
			}
			partOf[id] = a.Partition
			if source == "db/walbox" && table == "public.a" {
				mineIn[a.Partition]++
			}
		}
	}
	publish(60, "db/walbox", "public.a")
	publish(600, "db/walbox", "public.b")
	publish(100, "other/walbox", "public.a")
	if len(mineIn) < 2 {
		t.Fatalf("7 keys landed in %d partition(s) of 3", len(mineIn))
	}

	readBack := func(rr relay.ReadBackRange) (mine map[int32]int, theirs int) {
		t.Helper()
		mine = map[int32]int{}
		err := s.ReadBack(ctx, "orders", "db/walbox", rr, func(ev relay.StoredEvent) bool {
			if ev.Table != "public.a" {
				theirs++
				return false
			}
			mine[partOf[ev.ID]]++
			return true
		})
		if err != nil {
			t.Fatal(err)
		}
		return mine, theirs
	}
	total := func(m map[int32]int) (n int) {
		for _, v := range m {
			n += v
		}
		return n
	}
	// More than the topic holds: every partition up to its start.
	if mine, theirs := readBack(relay.ReadBackRange{Want: 1000}); total(mine) != 60 || theirs != 600 {
		t.Errorf("want 1000: read back %d of this table's and %d of the other's, want 60 and 600", total(mine), theirs)
	}
	// 5 wanted in each partition: past the newer records of the other
	// table and database in each.
	mine, _ := readBack(relay.ReadBackRange{Want: 5})
	for p, n := range mineIn {
		if mine[p] < min(5, n) {
			t.Errorf("want 5: partition %d: read back %d of this table's %d, want at least %d", p, mine[p], n, min(5, n))
		}
	}
	// ScanMax 50 records of each partition: each holds more than 50 newer
	// records of the others.
	if mine, theirs := readBack(relay.ReadBackRange{Want: 5, ScanMax: 50}); total(mine) != 0 || theirs > 3*50 {
		t.Errorf("scan max 50: read back %d of this table's and %d of the other's, want 0 and at most 150", total(mine), theirs)
	}
}
