package ops

import (
	"bytes"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

func TestReplayFillsAGap(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		// A short window, so the deleted message's id leaves JetStream's
		// duplicate tracking quickly.
		c.NATS.Streams[0].DuplicateWindow = time.Second
	})
	ctx := testCtx(t)
	r := e.startRelay()
	var ids []string
	for i := range 5 {
		ids = append(ids, e.insert("orders.created", `{"n":`+string(rune('0'+i))+`}`))
	}
	e.insert("payments.settled", `{"p":1}`)
	e.waitMsgs("ORDERS", 5)
	e.waitMsgs("PAYMENTS", 1)
	r.stop(t)

	js := e.connectJS()
	st, err := js.Stream(ctx, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	first := st.CachedInfo().State.FirstSeq
	if err := st.DeleteMsg(ctx, first+2); err != nil {
		t.Fatal(err)
	}
	if got := e.streamIDs("ORDERS"); len(got) != 4 || slices.Contains(got, ids[2]) {
		t.Fatalf("after the delete: %v", got)
	}
	time.Sleep(2500 * time.Millisecond) // past the 1s duplicate window

	from, to := time.Now().Add(-time.Hour), time.Now().Add(time.Minute)
	dry, err := Replay(ctx, e.cfg, ReplayOptions{From: from, To: to, Topic: "orders.*", DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if dry.Events != 5 || dry.Published != 1 || dry.AlreadyStored != 4 || !dry.DryRun {
		t.Fatalf("dry run: %+v", dry)
	}
	if got := e.streamIDs("ORDERS"); len(got) != 4 {
		t.Fatalf("dry run published: %v", got)
	}

	var progress bytes.Buffer
	res, err := Replay(ctx, e.cfg, ReplayOptions{From: from, To: to, Progress: &progress})
	if err != nil {
		t.Fatal(err)
	}
	if res.Rows != 6 || res.Published != 1 || res.AlreadyStored != 5 || res.Duplicates != 0 || res.DeadLettered != 0 {
		t.Fatalf("replay: %+v", res)
	}
	got := e.streamIDs("ORDERS")
	if len(got) != 5 || got[4] != ids[2] {
		t.Fatalf("stream after the replay: %v (want the missing %s appended)", got, ids[2])
	}
	var sum bytes.Buffer
	res.Print(&sum)
	mustContain(t, "summary", sum.String(), "published 1", "already in the stream (skipped) 5", "duplicates dropped by JetStream 0", "dead-lettered 0")

	// The replayed message carries the live headers.
	m, err := st.GetLastMsgForSubject(ctx, "orders.created")
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"Walbox-Commit-Lsn", "Walbox-Txn-Index", "Walbox-Commit-Time", "Walbox-Source"} {
		if m.Header.Get(h) == "" {
			t.Errorf("replayed message lacks %s: %v", h, m.Header)
		}
	}
	if m.Header.Get("Walbox-Source") != source(e.cfg) {
		t.Errorf("Walbox-Source %q, want %q", m.Header.Get("Walbox-Source"), source(e.cfg))
	}
}

func TestReplayForceNewIDDuplicatesAndDeadLetters(t *testing.T) {
	e := newEnv(t)
	e.startRelay()
	a := e.insert("payments.settled", `{"p":1}`)
	b := e.insert("payments.settled", `{"p":2}`)
	e.waitMsgs("PAYMENTS", 2)

	// Inside the duplicate window, without the read-back: JetStream drops
	// both and says so.
	res, err := Replay(e.ctx, e.cfg, ReplayOptions{IDs: []string{a, b}, NoCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Duplicates != 2 || res.Published != 0 {
		t.Fatalf("replay --no-check inside the window: %+v", res)
	}

	res, err = Replay(e.ctx, e.cfg, ReplayOptions{IDs: []string{a}, ForceNewID: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Published != 1 || res.Duplicates != 0 || !strings.HasPrefix(res.NewIDSuffix, ".replay.") {
		t.Fatalf("replay --force-new-id: %+v", res)
	}
	got := e.streamIDs("PAYMENTS")
	if len(got) != 3 || got[2] != a+res.NewIDSuffix {
		t.Fatalf("stream after --force-new-id: %v", got)
	}
	st, err := e.connectJS().Stream(e.ctx, "PAYMENTS")
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetMsg(e.ctx, st.CachedInfo().State.LastSeq)
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get(HeaderReplayOf) != a {
		t.Errorf("Walbox-Replay-Of = %q, want %s", m.Header.Get(HeaderReplayOf), a)
	}

	// A row no stream captures is dead-lettered, as live.
	poison := e.insert("unrouted.thing", `{"x":1}`)
	e.waitMsgs("WALBOX_DLQ", 1)
	res, err = Replay(e.ctx, e.cfg, ReplayOptions{IDs: []string{poison}, ForceNewID: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.DeadLettered != 1 || res.Published != 0 {
		t.Fatalf("replay of a poison row: %+v", res)
	}

	// Selecting nothing is an error; an empty selection is not.
	if _, err := Replay(e.ctx, e.cfg, ReplayOptions{}); err == nil {
		t.Fatal("replay without a selection")
	}
	res, err = Replay(e.ctx, e.cfg, ReplayOptions{IDs: []string{"00000000-0000-0000-0000-000000000000"}})
	if err != nil || res.Rows != 0 {
		t.Fatalf("replay of no rows: %+v %v", res, err)
	}
}

func TestReplayFromArchive(t *testing.T) {
	e := newEnv(t)
	e.exec(`CREATE TABLE walbox.outbox_events_archive_old PARTITION OF walbox.outbox_events_archive DEFAULT`)
	e.exec(`INSERT INTO walbox.outbox_events_archive (topic, payload, created_at, processed) VALUES
		('orders.archived', '{"old":1}', now() - interval '100 days', true),
		('payments.archived', '{"old":2}', now() - interval '100 days', true)`)
	// Streams exist once a relay ran (replay never creates them).
	e.startRelay().stop(t)
	var progress bytes.Buffer
	res, err := Replay(e.ctx, e.cfg, ReplayOptions{Archive: true, From: time.Now().AddDate(0, 0, -101), To: time.Now().AddDate(0, 0, -99),
		Topic: "orders.>", Progress: &progress})
	if err != nil {
		t.Fatal(err)
	}
	if res.Table != "walbox.outbox_events_archive" || res.Rows != 2 || res.Events != 1 || res.Published != 1 {
		t.Fatalf("replay --archive: %+v", res)
	}
	e.waitMsgs("ORDERS", 1)
	if _, err := Replay(e.ctx, e.cfg, ReplayOptions{From: time.Now().Add(-time.Hour), To: time.Now().Add(-2 * time.Hour)}); err == nil {
		t.Fatal("--from after --to accepted")
	}
}

func TestParseTime(t *testing.T) {
	now := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Time{
		"2024-04-30T10:00:00Z": time.Date(2024, 4, 30, 10, 0, 0, 0, time.UTC),
		"90m":                  now.Add(-90 * time.Minute),
		"now":                  now,
		"2024-04-30":           time.Date(2024, 4, 30, 0, 0, 0, 0, time.Local),
		"2024-04-30 10:30":     time.Date(2024, 4, 30, 10, 30, 0, 0, time.Local),
	} {
		got, err := ParseTime(in, now)
		if err != nil || !got.Equal(want) {
			t.Errorf("ParseTime(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	if _, err := ParseTime("yesterday", now); err == nil {
		t.Error("ParseTime(yesterday) accepted")
	}
}

// The stored ids go through batched COPYs into a temporary table, not into
// a map as large as the stream.
func TestReplayCopiesStoredIDsInBatches(t *testing.T) {
	e := newEnv(t)
	js := e.connectJS()
	if _, err := js.CreateStream(e.ctx, jetstream.StreamConfig{Name: "MANY", Subjects: []string{"many.>"}}); err != nil {
		t.Fatal(err)
	}
	const n = 25_000
	for i := range n {
		m := nats.NewMsg("many.x")
		m.Header.Set("Nats-Msg-Id", fmt.Sprintf("id-%d", i))
		if _, err := js.PublishMsgAsync(m); err != nil {
			t.Fatal(err)
		}
		if i%1000 == 999 || i == n-1 {
			// Let the acks catch up: the client refuses more than a few
			// thousand outstanding publishes.
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(60 * time.Second):
				t.Fatal("publishing timed out")
			}
		}
	}
	conn := relaytest.Conn(t, e.dbURL)
	if _, err := conn.Exec(e.ctx, storedTableDDL); err != nil {
		t.Fatal(err)
	}
	bus, err := openBus(e.ctx, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer bus.Close()
	if err := storeIDs(e.ctx, conn, bus, "MANY", "", time.Time{}); err != nil {
		t.Fatal(err)
	}
	var got, distinct int
	if err := conn.QueryRow(e.ctx, `SELECT count(*), count(DISTINCT id) FROM walbox_replay_stored WHERE stream = 'MANY'`).Scan(&got, &distinct); err != nil {
		t.Fatal(err)
	}
	if got != n || distinct != n {
		t.Fatalf("copied %d ids (%d distinct), want %d", got, distinct, n)
	}
}

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

// replay reads the table --table names (the default one without it), with
// that table's columns, or its archive.
func TestReplayTableFollowsTheConfig(t *testing.T) {
	cfg := config.Default()
	cfg.Outboxes = []config.OutboxEntry{{Outbox: config.Outbox{Table: "public.outbox_events"}},
		{Outbox: config.Outbox{Table: "billing.outbox", Columns: map[string]string{"id": "event_id"}}, Default: true}}
	from := ReplayOptions{From: time.Unix(0, 0), To: time.Now()}
	for _, c := range []struct {
		table   string
		archive bool
		want    string
		idCol   string
		idx     int // the relay's index of the table: the config's order
	}{
		{"", false, "billing.outbox", "event_id", 1},
		{"outbox_events", false, "public.outbox_events", "id", 0},
		{"billing.outbox", true, "walbox.billing_outbox_archive", "event_id", 1},
	} {
		o := from
		o.Table, o.Archive = c.table, c.archive
		tb, idx, name, err := replayTable(cfg, o)
		if err != nil || name.String() != c.want || tb.Columns[0] != c.idCol || idx != c.idx {
			t.Errorf("--table %q archive %v: %s (id column %q, index %d), %v", c.table, c.archive, name, tb.Columns[0], idx, err)
		}
	}
	o := from
	o.Table = "shipping.outbox"
	if _, _, _, err := replayTable(cfg, o); err == nil || !strings.Contains(err.Error(), "shipping.outbox is not a configured outbox table") {
		t.Errorf("unknown table: %v", err)
	}
	if _, _, _, err := replayTable(cfg, ReplayOptions{}); err == nil || !strings.Contains(err.Error(), "select the events") {
		t.Errorf("no selection: %v", err)
	}
}

// Issue 34, item 8, on Kafka: a table with its own topic template
// (subject_template) is read back in the topics its template gives
// --topic, not in those the sink's template would, and a record counts as
// the row's only when it names the row's table: of three rows, two are in
// their topic and the third's id is there only as another table's event.
// Before the fix the read-back skipped billing.invoices (the sink's
// template made --topic "invoices" match no topic) and all three were
// published again.
func TestReplayKafkaTableWithItsOwnTopicTemplate(t *testing.T) {
	e := newKafkaEnv(t, func(c *config.Config) {
		c.Kafka.Topics = append(c.Kafka.Topics, config.KafkaTopic{Name: "billing.invoices", Partitions: 2, ReplicationFactor: 3})
		c.Outboxes = []config.OutboxEntry{{Outbox: config.Outbox{Table: "public.outbox_events"}},
			{Outbox: config.Outbox{Table: "public.billing_outbox"}, SubjectTemplate: "billing.{topic}"}}
	})
	e.createAll()
	ctx := testCtx(t)
	e.exec(`CREATE TABLE billing_outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), created_at timestamptz NOT NULL DEFAULT now(),
		topic text NOT NULL, payload jsonb NOT NULL, aggregate_id text)`)
	var ids []string
	for i := range 3 {
		ids = append(ids, e.insertID(`INSERT INTO billing_outbox (topic, payload, aggregate_id) VALUES ('invoices', '{}', $1) RETURNING id::text`, "inv-"+strconv.Itoa(i)))
	}
	produce := func(id, table string) {
		h := relay.Header{}
		h.Set(relay.HeaderMsgID, id)
		h.Set(relay.HeaderSource, source(e.cfg))
		h.Set(relay.HeaderTable, table)
		rec := &kgo.Record{Topic: "billing.invoices", Key: []byte(id), Value: []byte(`{}`), Headers: kafkasink.ToKafkaHeaders(h)}
		if err := e.kafka.Client.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	produce(ids[0], "public.billing_outbox")
	produce(ids[1], "public.billing_outbox")
	produce(ids[2], "public.outbox_events") // the other table's event with this id

	res, err := Replay(ctx, e.cfg, ReplayOptions{Table: "public.billing_outbox", From: time.Now().Add(-time.Hour), To: time.Now().Add(time.Minute), Topic: "invoices"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Events != 3 || res.AlreadyStored != 2 || res.Published != 1 || res.ByStream["billing.invoices"] != 1 {
		t.Fatalf("replay: matched %d, already stored %d, published %d (%v); want 3, 2 and the missing one to billing.invoices",
			res.Events, res.AlreadyStored, res.Published, res.ByStream)
	}
	var replayed []outboxtest.KafkaRecord
	for _, r := range e.kcat("billing.invoices") {
		if r.Header("Walbox-Table") == "public.billing_outbox" && r.Header("Walbox-Event-Id") == ids[2] {
			replayed = append(replayed, r)
		}
	}
	if len(replayed) != 1 {
		t.Fatalf("billing.invoices holds %d records of billing_outbox's event %s, want the replayed one", len(replayed), ids[2])
	}
}
