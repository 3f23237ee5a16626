package ops

import (
	"bytes"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/relaytest"
)

// TestReplayKafkaFillsTheGap: of five rows, four are in their topic; the
// replay reads the topic's event ids back, publishes the missing one
// through the router (key, headers as the relay's), dead-letters a row
// whose topic is not declared, and a second replay publishes nothing.
func TestReplayKafkaFillsTheGap(t *testing.T) {
	e := newKafkaEnv(t)
	e.createAll()
	ctx := testCtx(t)
	conn := relaytest.Conn(t, e.dbURL)
	var ids []string
	for i := range 5 {
		var id string
		if err := conn.QueryRow(ctx, `INSERT INTO outbox_events (topic, payload, aggregate_id) VALUES ('orders.created', $1, $2) RETURNING id::text`,
			`{"n":`+strconv.Itoa(i)+`}`, "agg-"+strconv.Itoa(i)).Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	var stray string
	if err := conn.QueryRow(ctx, `INSERT INTO outbox_events (topic, payload) VALUES ('nowhere.created', '{}') RETURNING id::text`).Scan(&stray); err != nil {
		t.Fatal(err)
	}
	missing := ids[2]
	for i, id := range ids {
		if id != missing {
			e.produce("orders.created", id, "agg-"+strconv.Itoa(i), `{}`, 0, time.Time{})
		}
	}
	// Another topic's record with the missing id does not count.
	e.produce("payments.settled", missing, "x", `{}`, 0, time.Time{})

	res, err := Replay(ctx, e.cfg, ReplayOptions{From: time.Now().Add(-time.Hour), To: time.Now().Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	res.Print(&out)
	t.Logf("\n%s", out.String())
	if res.Rows != 6 || res.Published != 1 || res.AlreadyStored != 4 || res.DeadLettered != 1 || res.ByStream["orders.created"] != 1 || res.ByStream["walbox.dlq"] != 1 {
		t.Fatalf("replay: %+v", res)
	}
	mustContain(t, "replay summary", out.String(), "already in the topic (skipped) 4")
	if strings.Contains(out.String(), "JetStream") {
		t.Errorf("the Kafka summary speaks of JetStream:\n%s", out.String())
	}
	recs := e.kcat("orders.created")
	seen := map[string]int{}
	for _, r := range recs {
		id := r.Header("Walbox-Event-Id")
		seen[id]++
		if id == missing && (r.Key == nil || *r.Key != "agg-2" || r.Header("Walbox-Source") == "" || r.Header("Walbox-Commit-Time") == "") {
			t.Errorf("the replayed event lacks the key or the relay's headers: %+v", r)
		}
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Errorf("orders.created holds event %s %d times, want once", id, seen[id])
		}
	}
	if len(recs) != 5 {
		t.Errorf("orders.created holds %d records, want 5", len(recs))
	}
	dead := e.kcat("walbox.dlq")
	if len(dead) != 1 || dead[0].Header("Walbox-Event-Id") != stray || !strings.Contains(dead[0].Header("Walbox-Dlq-Reason"), "nowhere.created") {
		t.Errorf("dead letters: %+v", dead)
	}

	// Again, for the topics orders.*: everything is there.
	res, err = Replay(ctx, e.cfg, ReplayOptions{From: time.Now().Add(-time.Hour), To: time.Now().Add(time.Minute), Topic: "orders.*"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Published != 0 || res.AlreadyStored != 5 || res.Events != 5 {
		t.Fatalf("second replay: %+v", res)
	}
	// --force-new-id delivers again, under a new id.
	res, err = Replay(ctx, e.cfg, ReplayOptions{IDs: []string{ids[0]}, ForceNewID: true})
	if err != nil || res.Published != 1 {
		t.Fatalf("--force-new-id: %+v %v", res, err)
	}
	recs = e.kcat("orders.created")
	last := recs[len(recs)-1]
	for _, r := range recs {
		if r.Header("Walbox-Replay-Of") != "" {
			last = r
		}
	}
	if len(recs) != 6 || last.Header("Walbox-Replay-Of") != ids[0] || last.Header("Walbox-Event-Id") != ids[0]+res.NewIDSuffix {
		t.Fatalf("after --force-new-id: %d records, the new one %+v", len(recs), last)
	}
}
