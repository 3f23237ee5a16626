package kafkasink_test

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/relay/kafkasink"
)

// TestHorizonOfAPartitionHoldingOnlyATransactionMarker: after retention
// (here DeleteRecords) a partition of a transactional topic can hold
// nothing but a commit marker, which read_committed consumers never see.
// Cutoff still answers, from the marker, which is no older than the data
// record before it; it does not wait for a record that never comes.
func TestHorizonOfAPartitionHoldingOnlyATransactionMarker(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	k := kafkatest.NewCluster(t)
	if _, err := k.Admin.CreateTopic(ctx, 1, 1, nil, "t"); err != nil {
		t.Fatal(err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.ListenAddrs()...), kgo.TransactionalID("horizon-test"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	old := time.Now().Add(-time.Hour)
	if err := cl.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "t", Timestamp: old, Value: []byte("v")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if err := cl.EndTransaction(ctx, kgo.TryCommit); err != nil {
		t.Fatal(err)
	}
	ends, err := k.Admin.ListEndOffsets(ctx, "t")
	if err != nil {
		t.Fatal(err)
	}
	end, _ := ends.Lookup("t", 0)
	if end.Offset != 2 {
		t.Fatalf("end offset %d, want 2 (the record and its commit marker)", end.Offset)
	}
	res, err := k.Admin.DeleteRecords(ctx, kadm.Offsets{"t": {0: {Topic: "t", Partition: 0, At: 1}}})
	if err != nil || res.Error() != nil {
		t.Fatalf("delete records: %v, %v", err, res.Error())
	}
	now := time.Now()
	cutoff, err := kafkasink.NewHorizon(kafkasink.Config{Brokers: k.ListenAddrs()}, time.Minute).Cutoff(ctx, "t", now)
	if err != nil {
		t.Fatal(err)
	}
	if !cutoff.After(old) || cutoff.After(now) {
		t.Fatalf("cutoff %s, want the marker's time: after the deleted record's %s, not after now %s", cutoff, old, now)
	}
}
