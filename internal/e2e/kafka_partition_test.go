package e2e

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// Issue 33, item 3: one Kafka partition refusing writes for a while must not
// lose its events.
//
// Three kfake brokers, topic orders.created of 4 partitions, four producers
// each writing its own key, the four keys in four different partitions.
// Partition 1 answers every produce with NOT_ENOUGH_REPLICAS (as a partition
// with too few in-sync replicas does) for longer than four ack rounds, while
// the other three store. The relay runs with a window of 64 events, a 1 s
// ack timeout and a 100..500 ms back-off, so each round (ack timeout, back-off,
// resend; about 5 s with franz-go's retries) fills the window behind the
// resend with newer events that the other partitions store: after three or
// four rounds more than 2 × window events newer than the refused key's first
// unstored one are stored elsewhere.
//
// The refused key is the quiet one (a third of the others' rate). With four
// equally busy keys the refused key's resends take a quarter of each new
// window, the window fills up with them within a few rounds, and what the
// other partitions store converges to about 2.25 × window: just past the
// 2 × window the read-back trusts, so whether anything is lost is left to
// timing (measured at window 32: 84 to 89 records stored elsewhere in 30 s,
// 9 lost in one run). With a tenth of the traffic on the refused partition
// the others store 240 to 300 records (3.7 to 4.7 × window) in five or six
// rounds.
//
// Nothing about those other partitions is evidence that the refused
// partition stored anything (DESIGN.md, "Evidence": per ordered unit, never
// across units; never for an event this process tried and did not see
// acked). The test wants: every committed row's record read back once, per
// key in commit order, and no row marked processed whose record is not in
// the topic; with the relay up through the outage, and with a kill -9
// during it and a restart after the partition recovers.

const (
	refusingTopic      = "orders.created"
	refusingPartitions = 4
	refusedPartition   = int32(1)
	refusingWindow     = 64
	// Transactions per second of each producer; the refused key's producer
	// writes a third as often (not every key is hot). See partitionRefusal.
	busyRate  = 10.0
	quietRate = busyRate / 3
)

func TestKafkaPartitionRefusingWrites(t *testing.T) {
	// The variants run side by side: each has its own brokers, database
	// and relay, and most of their time is the outage's rounds, spent
	// waiting. The first two are of the idempotent producer
	// (kafka.transactions: false), where the other partitions store while
	// one refuses: the read-back's proof is what is at stake. With
	// transactions a refused record aborts its transaction, so the others
	// store at most what was committed as the outage began.
	t.Run("relay_up", func(t *testing.T) { t.Parallel(); partitionRefusal(t, false, false) })
	t.Run("relay_killed_during_outage", func(t *testing.T) { t.Parallel(); partitionRefusal(t, true, false) })
	t.Run("transactions", func(t *testing.T) { t.Parallel(); partitionRefusal(t, false, true) })
}

func partitionRefusal(t *testing.T, kill, txn bool) {
	started := time.Now()
	// Slots are the cluster's, not the database's: the variants, which
	// run side by side on the package's cluster, name theirs apart.
	suffix := "up"
	if kill {
		suffix = "killed"
	}
	if txn {
		suffix = "txn"
	}
	e := newMigratedKafkaEnv(t, func(cfg *config.Config) {
		cfg.NATS.Window = refusingWindow // the relay's window, shared by the Kafka sink
		cfg.Kafka.AckTimeout = time.Second
		cfg.Kafka.Transactions = txn
		cfg.Retry.Initial, cfg.Retry.Max = 100*time.Millisecond, 500*time.Millisecond
		cfg.Postgres.Slot = "walbox_" + suffix
	})
	w, err := outboxtest.CreateWitness(context.Background(), e.conn(), "witness_"+suffix, "outbox_events")
	if err != nil {
		t.Fatal(err)
	}
	keys := keysPerPartition(t, refusingTopic, refusingPartitions)
	refusedKey := keys[refusedPartition]
	t.Logf("keys by partition of %s: %v; partition %d (key %s) will refuse writes", refusingTopic, keys, refusedPartition, refusedKey)

	var relayProc *proc
	var relayIn *inproc
	if kill {
		relayProc = e.spawnRelay()
	} else {
		relayIn = e.startRelay()
	}
	rates := make([]float64, len(keys))
	for i := range rates {
		rates[i] = busyRate
	}
	rates[refusedPartition] = quietRate
	stopLoad := e.writeKeys(keys, rates)
	loadStopped := false
	defer func() {
		if !loadStopped {
			stopLoad()
		}
	}()
	e.waitStored(200, 60*time.Second) // healthy first: every partition stores

	// The outage: partition 1 of the topic refuses every produce.
	backoffsBefore, skippedBefore := 0.0, 0.0
	if relayIn != nil {
		backoffsBefore = e.counter("walbox_publish_backoffs_total", nil)
		skippedBefore = e.counter("walbox_resume_skipped_total", nil)
	}
	fault := e.kafka.Fault(kfake.Fault{
		Keys:       []kmsg.Key{kmsg.Produce},
		Topic:      refusingTopic,
		Partitions: []int32{refusedPartition},
		Err:        kerr.NotEnoughReplicas,
		Count:      -1,
	})
	faultOn := true
	defer func() {
		if faultOn {
			fault.Remove()
		}
	}()
	// Counted from the first refusal: what partition 1 stored before it
	// (produce requests the brokers handled before the fault, and with
	// transactions the last transaction committed before the one refused)
	// is not of the outage. Counting reads the records, which takes a
	// moment: a count taken before the fault would miss some of those.
	relaytest.Eventually(t, 30*time.Second, "partition 1's first refusal", func() bool { return fault.Hits() > 0 })
	before := e.partitionEnds(refusingTopic)
	outageStart := time.Now()
	// rounds is how many times the relay backed off and resent since the
	// outage began: its metric in process, its log as a process.
	rounds := func() int {
		if relayIn != nil {
			return int(e.counter("walbox_publish_backoffs_total", nil) - backoffsBefore)
		}
		return strings.Count(relayProc.output(), "publisher backing off")
	}
	progress := func(what string) {
		ends := e.partitionEnds(refusingTopic)
		msg := fmt.Sprintf("%s (%v into the outage): refused produce requests %d; stored since the outage began, by partition: %v; relay back-offs %d",
			what, time.Since(outageStart).Round(time.Second), fault.Hits(), diffEnds(ends, before), rounds())
		if relayIn != nil {
			msg += fmt.Sprintf(", skipped by the resume check %v", e.counter("walbox_resume_skipped_total", nil)-skippedBefore)
		}
		t.Log(msg)
	}
	// waitRounds lets the outage last until the relay has backed off and
	// resent n times (about 5 s a round here), logging every 5 s.
	waitRounds := func(n int) {
		t.Helper()
		deadline := outageStart.Add(75 * time.Second)
		next := time.Now().Add(5 * time.Second)
		for rounds() < n {
			if time.Now().After(deadline) {
				progress("deadline")
				t.Fatalf("scenario not reached: %d resend rounds in %v of outage, want %d", rounds(), time.Since(outageStart).Round(time.Second), n)
			}
			if time.Now().After(next) {
				progress("outage")
				next = next.Add(5 * time.Second)
			}
			time.Sleep(100 * time.Millisecond) // polling: the relay's rounds
		}
	}
	if kill {
		// Kill -9 after the fifth back-off (past four resends), keep the
		// partition refusing and the producers writing with no relay, then
		// let it recover and start the relay again.
		waitRounds(5)
		progress("before kill -9")
		relayProc.signal(t, syscall.SIGKILL)
		t.Logf("relay killed with SIGKILL %v into the outage", time.Since(outageStart).Round(time.Second))
		time.Sleep(3 * time.Second) // fault timing: the outage goes on with no relay
	} else {
		waitRounds(6) // six back-offs: the fifth resend is under way
	}
	progress("outage ends")
	outage := time.Since(outageStart)
	during := diffEnds(e.partitionEnds(refusingTopic), before)
	fault.Remove()
	faultOn = false

	// The scenario of the issue was reached: the refused partition stored
	// nothing and the others stored more than 2 × window.
	others := int64(0)
	for p, n := range during {
		if p != refusedPartition {
			others += n
		}
	}
	if during[refusedPartition] != 0 {
		t.Fatalf("scenario not reached: partition %d stored %d records while refusing writes", refusedPartition, during[refusedPartition])
	}
	switch {
	case txn && others > refusingWindow:
		t.Fatalf("the other partitions stored %d records during the %v outage: more than one transaction of at most a window (%d) in which partition %d's record was refused", others, outage.Round(time.Second), refusingWindow, refusedPartition)
	case !txn && others <= 2*refusingWindow:
		t.Fatalf("scenario not reached: the other partitions stored only %d records during the %v outage, want more than 2 × window = %d", others, outage.Round(time.Second), 2*refusingWindow)
	}
	t.Logf("outage of partition %d lasted %v; the other partitions stored %d records meanwhile", refusedPartition, outage.Round(time.Second), others)

	if kill {
		relayProc = e.spawnRelay()
		t.Log("relay restarted after the partition recovered")
	}
	time.Sleep(time.Second) // pacing: the load goes on after the recovery
	stopLoad()
	loadStopped = true

	// A positive sign that the relay is past every committed row: one last
	// row per key, written now, stored and marked. A partition keeps publish
	// order, so an earlier row of the key not stored by then never will be.
	markers := e.writeMarkers(keys)
	ctx := relaytest.Ctx(t)
	relaytest.Eventually(t, 60*time.Second, "the last row of every key marked processed (the relay past the outage)", func() bool {
		var n int
		_ = e.pool.QueryRow(ctx, "SELECT count(*) FROM outbox_events WHERE id = ANY($1::uuid[]) AND processed", markers).Scan(&n)
		return n == len(markers)
	})
	// The sweeper marks in delivery order and the markers were delivered
	// last; a moment more for a batch still being written.
	time.Sleep(time.Second) // pacing: a last sweeper batch

	e.judgePartitionRefusal(w, keys, outage, time.Since(started))
}

// judgePartitionRefusal reads every record back with kcat and fails on any
// committed row lost or duplicated, any key out of commit order, and any row
// marked processed whose record is not in the topic, with counts per key.
func (e *kafkaEnv) judgePartitionRefusal(w *outboxtest.Witness, keys []string, outage, took time.Duration) {
	t := e.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn := e.conn()
	committed, err := w.Committed(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := outboxtest.ReadKafkaWithKcat(ctx, strings.Join(e.cfg.Kafka.Brokers, ","), append(kafkaTopics, e.cfg.Kafka.DLQTopic)...)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		key       string
		processed bool
	}
	rows := map[string]row{}
	rs, err := e.pool.Query(ctx, "SELECT id::text, coalesce(aggregate_id, ''), processed FROM outbox_events")
	if err != nil {
		t.Fatal(err)
	}
	for rs.Next() {
		var id string
		var r row
		if err := rs.Scan(&id, &r.key, &r.processed); err != nil {
			t.Fatal(err)
		}
		rows[id] = r
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}

	// Where each record is, and each key's records in offset order.
	copies := map[string]int{}
	keyParts := map[string]map[int32]bool{}
	byPart := map[int32][]outboxtest.KafkaRecord{}
	for _, r := range recs {
		id := r.Header("Walbox-Event-Id")
		copies[id]++
		if r.Topic != refusingTopic {
			t.Errorf("record %s in %s/%d: every row was written to %s", id, r.Topic, r.Partition, refusingTopic)
			continue
		}
		byPart[r.Partition] = append(byPart[r.Partition], r)
		if r.Key != nil {
			if keyParts[*r.Key] == nil {
				keyParts[*r.Key] = map[int32]bool{}
			}
			keyParts[*r.Key][r.Partition] = true
		}
	}
	for p := range byPart {
		sort.Slice(byPart[p], func(i, j int) bool { return byPart[p][i].Offset < byPart[p][j].Offset })
	}
	for i, k := range keys {
		if parts := keyParts[k]; len(parts) != 1 || !parts[int32(i)] {
			t.Errorf("key %s is in partitions %v, want only partition %d (Kafka's murmur2 key hashing)", k, parts, i)
		}
	}

	// Per key: committed in commit order, lost, lost but marked, duplicated,
	// out of order.
	order := map[string]int{}
	perKey := map[string][]string{}
	for i, id := range committed {
		order[id] = i
		k := rows[id].key
		perKey[k] = append(perKey[k], id)
	}
	failed := false
	var verdict []string
	for i, k := range keys {
		var lost, lostMarked, dup int
		var firstLost, lastLost = -1, -1
		for n, id := range perKey[k] {
			switch c := copies[id]; {
			case c == 0:
				lost++
				if rows[id].processed {
					lostMarked++
				}
				if firstLost < 0 {
					firstLost = n
				}
				lastLost = n
			case c > 1:
				dup++
			}
		}
		ooo, last := 0, -1
		for _, r := range byPart[int32(i)] {
			pos, ok := order[r.Header("Walbox-Event-Id")]
			if !ok {
				continue
			}
			if pos < last {
				ooo++
			} else {
				last = pos
			}
		}
		line := fmt.Sprintf("key %s (partition %d%s): committed %d, stored %d records, lost %d (%d of them marked processed), duplicated %d, out of order %d",
			k, i, map[bool]string{true: ", refused writes", false: ""}[int32(i) == refusedPartition],
			len(perKey[k]), len(byPart[int32(i)]), lost, lostMarked, dup, ooo)
		if lost > 0 {
			line += fmt.Sprintf("; lost rows are the key's #%d..#%d in commit order", firstLost+1, lastLost+1)
		}
		verdict = append(verdict, line)
		if lost+dup+ooo > 0 {
			failed = true
		}
	}
	var markedNotStored []string
	for id, r := range rows {
		if r.processed && copies[id] == 0 {
			markedNotStored = append(markedNotStored, id)
		}
	}
	slices.Sort(markedNotStored)
	if len(markedNotStored) > 0 {
		failed = true
		ex := markedNotStored[:min(3, len(markedNotStored))]
		verdict = append(verdict, fmt.Sprintf("%d rows marked processed whose record is not in the topic (e.g. %v)", len(markedNotStored), ex))
	}
	rep := outboxtest.CheckStreamed(committed, nil, outboxtest.KafkaStreams(recs), outboxtest.KafkaSnapshot(recs))
	verdict = append(verdict, "checker (kcat): "+rep.String())
	if !rep.OK() {
		failed = true
	}
	if rep.Checked == 0 {
		t.Fatal("the witness saw no committed rows: the test produced nothing")
	}
	summary := fmt.Sprintf("partition %d of %s refused writes for %v (ack timeout 1s, window %d); run took %v:\n  %s",
		refusedPartition, refusingTopic, outage.Round(time.Second), refusingWindow, took.Round(time.Second), strings.Join(verdict, "\n  "))
	if failed {
		t.Fatalf("events lost, duplicated or out of order, or marked without being stored: %s", summary)
	}
	t.Log(summary)
}

// keysPerPartition finds, for each partition of topic, a key that Kafka's
// key hashing (murmur2, as walbox's sink and the Java client) puts there.
func keysPerPartition(t *testing.T, topic string, partitions int) []string {
	t.Helper()
	part := kgo.StickyKeyPartitioner(nil).ForTopic(topic)
	keys := make([]string, partitions)
	found := 0
	for i := 0; found < partitions && i < 10000; i++ {
		k := fmt.Sprintf("acct-%d", i)
		if p := part.Partition(&kgo.Record{Key: []byte(k)}, partitions); keys[p] == "" {
			keys[p] = k
			found++
		}
	}
	if found < partitions {
		t.Fatalf("no key for every one of %d partitions: %v", partitions, keys)
	}
	return keys
}

// writeKeys runs one producer per key, each writing transactions of one to
// three rows of its key to refusingTopic at rates[i] transactions per
// second, until the returned stop is called. The witness slot is the judge
// of what committed.
func (e *kafkaEnv) writeKeys(keys []string, rates []float64) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(time.Duration(float64(time.Second) / rates[i]))
			defer tick.Stop()
			for n := 0; ; n++ {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				_ = e.insertRows(ctx, k, n, 1+n%3)
			}
		}()
	}
	return func() { cancel(); wg.Wait() }
}

// insertRows commits rows rows of key in one transaction and returns their ids.
func (e *kafkaEnv) insertRows(ctx context.Context, key string, n, rows int) []string {
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	tx, err := e.pool.Begin(tctx)
	if err != nil {
		return nil
	}
	defer tx.Rollback(tctx)
	var ids []string
	for i := range rows {
		id, _ := uuid.NewV7()
		if _, err := tx.Exec(tctx, "INSERT INTO outbox_events (id, topic, payload, aggregate_id) VALUES ($1, $2, $3, $4)",
			id.String(), refusingTopic, fmt.Sprintf(`{"key":%q,"txn":%d,"row":%d}`, key, n, i), key); err != nil {
			return nil
		}
		ids = append(ids, id.String())
	}
	if tx.Commit(tctx) != nil {
		return nil
	}
	return ids
}

// writeMarkers commits one last row per key and returns their ids.
func (e *kafkaEnv) writeMarkers(keys []string) []string {
	e.t.Helper()
	var ids []string
	for _, k := range keys {
		got := e.insertRows(context.Background(), k, -1, 1)
		if len(got) != 1 {
			e.t.Fatalf("write the last row of key %s", k)
		}
		ids = append(ids, got...)
	}
	return ids
}

// partitionEnds is how many committed records every partition of topic
// holds (none for a partition that cannot be read now).
func (e *kafkaEnv) partitionEnds(topic string) map[int32]int64 {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	counts, err := kafkatest.Counts(ctx, e.cfg.Kafka.Brokers, topic)
	if err != nil || counts[topic] == nil {
		return map[int32]int64{}
	}
	return counts[topic]
}

func diffEnds(now, before map[int32]int64) map[int32]int64 {
	out := map[int32]int64{}
	for p, n := range now {
		out[p] = n - before[p]
	}
	return out
}
