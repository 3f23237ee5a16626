package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/outboxtest"
)

// Issue 33, item 4: the same id in two outbox tables. An event's identity is
// (source, table, id), never the id alone (DESIGN.md, "Evidence"): two
// tables with bigserial ids both have a row 1, two DAARION-style tables with
// `id text` both have a row 'e1'. Neither may be taken for the other in the
// dedupe key (Nats-Msg-Id), in a read-back match, or in a mark.

// sharedIDTables are the two outbox tables of every variant.
var sharedIDTables = []string{"public.outbox_a", "public.outbox_b"}

// sharedIDVariant is one shape of the test.
type sharedIDVariant struct {
	name     string
	textIDs  bool // id text ('e1', 'e2', ...) instead of id bigserial
	separate bool // each table into its own stream, instead of both into one
}

// TestTablesSharingIDs: two outbox tables whose ids repeat each other's
// (1, 2, 3, ... in each), with integer and with text ids, into one stream
// and into a stream each. Producers write to both tables concurrently in
// transactions of a few rows; the relay, a real process, is killed with
// SIGKILL mid-stream and restarted. Every row of each table must be stored
// exactly once, identified by (table, id), in its table's commit order,
// all within a deadline (the relay does not stall), and no row may be
// marked processed before its own event is stored: not at the end, not in
// any sample taken while the test runs, and no processed_at before the
// stored time of the row's message. Table b gets two rows for one of a, so
// b's ids run ahead of a's: a stream's tail then holds ids of a's rows not
// yet published, which a mark by id alone would take for a's.
func TestTablesSharingIDs(t *testing.T) {
	for _, v := range []sharedIDVariant{
		{name: "integer_ids_one_stream"},
		{name: "integer_ids_separate_streams", separate: true},
		{name: "text_ids_one_stream", textIDs: true},
		{name: "text_ids_separate_streams", textIDs: true, separate: true},
	} {
		t.Run(v.name, func(t *testing.T) { runTablesSharingIDs(t, v) })
	}
}

// eventIdentity is what makes an event one event: its table (schema.table)
// and its id in that table. (The source is the same for every event here:
// one database, one relay.)
type eventIdentity struct{ table, id string }

func (i eventIdentity) String() string { return i.table + "/" + i.id }

// storedIdentity is the identity of a stored message: its table from the
// Walbox-Table header, its id from Walbox-Event-Id when set (a message
// republished under a qualified Nats-Msg-Id carries the bare id there),
// else from Nats-Msg-Id. Never Nats-Msg-Id alone. Where the relay sets no
// Walbox-Table header (older walbox), the table comes from the payload,
// which names it ("t"). payload is the identity the payload itself names
// (its table and row id), to check the headers against; ok is false for a
// message that is no row of the test's tables (a settle marker).
func storedIdentity(m *jetstream.RawStreamMsg) (id, payload eventIdentity, ok bool) {
	return identityOf(m.Header, m.Data)
}

// identityOf is storedIdentity of a message's headers and data.
func identityOf(h nats.Header, data []byte) (id, payload eventIdentity, ok bool) {
	var body struct {
		T  string `json:"t"`
		ID string `json:"id"`
	}
	_ = json.Unmarshal(data, &body)
	if body.T != "" {
		payload = eventIdentity{table: "public.outbox_" + body.T, id: body.ID}
	}
	id.table = h.Get("Walbox-Table")
	if id.table == "" {
		id.table = payload.table
	}
	id.id = h.Get("Walbox-Event-Id")
	if id.id == "" {
		id.id = h.Get("Nats-Msg-Id")
	}
	return id, payload, id.table != "" && payload.table != ""
}

// storedEvent is one message of the test's tables, as read from a stream.
type storedEvent struct {
	stream   string
	id       eventIdentity
	payload  eventIdentity
	snapshot bool // published from a snapshot: no WAL position
	msgID    string
	// hasTable: the message carries Walbox-Table; qualified: it carries
	// Walbox-Event-Id beside a Nats-Msg-Id of its own.
	hasTable, qualified bool
	storedAt            time.Time // when JetStream stored it
}

func runTablesSharingIDs(t *testing.T, v sharedIDVariant) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), 150*time.Second)
	defer cancel()

	// Streams and subjects: one stream whose subjects both tables share,
	// or a stream per table.
	subjectOf := map[string]string{} // table -> subject template
	var streams []config.Stream
	if v.separate {
		streams = []config.Stream{
			{Name: "IDA", Subjects: []string{"ida.>"}, DuplicateWindow: 2 * time.Minute},
			{Name: "IDB", Subjects: []string{"idb.>"}, DuplicateWindow: 2 * time.Minute},
		}
		subjectOf[sharedIDTables[0]] = "ida.{topic}"
		subjectOf[sharedIDTables[1]] = "idb.{topic}"
	} else {
		streams = []config.Stream{{Name: "IDS", Subjects: []string{"ids.>"}, DuplicateWindow: 2 * time.Minute}}
		subjectOf[sharedIDTables[0]] = "ids.{topic}"
		subjectOf[sharedIDTables[1]] = "ids.{topic}"
	}
	e := newEnv(t, func(c *config.Config) {
		c.NATS.Streams = streams
		c.Outboxes = nil
		for _, tbl := range sharedIDTables {
			c.Outboxes = append(c.Outboxes, config.OutboxEntry{
				Outbox: config.Outbox{Table: tbl, Columns: map[string]string{
					"id": "id", "topic": "topic", "payload": "payload", "created_at": "created_at",
					"stream": "", "event_type": "", "aggregate_type": "", "aggregate_id": "", "partition_key": "", "headers": ""}},
				SubjectTemplate: subjectOf[tbl],
			})
		}
		// The settle markers go through a table of their own (walbox's
		// layout, uuid ids): a table-less event routed through an outbox
		// table with integer ids makes that table's sweeper fail its whole
		// batch (its uuid is no bigint), which is not what this test is
		// about.
		c.Outboxes = append(c.Outboxes, config.OutboxEntry{Outbox: config.Outbox{Table: settleTableName}, SubjectTemplate: "{topic}"})
	})
	idType := "bigint"
	for _, tbl := range sharedIDTables {
		ddl := fmt.Sprintf(`CREATE TABLE %s (id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
			processed boolean NOT NULL DEFAULT false, processed_at timestamptz, created_at timestamptz NOT NULL DEFAULT now(),
			attempts int NOT NULL DEFAULT 0, error text)`, tbl)
		if v.textIDs {
			// The DAARION layout: id text, here 'e1', 'e2', ... from a
			// sequence per table, so both tables have every id.
			ddl = fmt.Sprintf(`CREATE SEQUENCE %[1]s_seq; CREATE TABLE %[1]s (id text PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
				processed boolean NOT NULL DEFAULT false, processed_at timestamptz, created_at timestamptz NOT NULL DEFAULT now(),
				attempts int NOT NULL DEFAULT 0, error text)`, tbl)
			idType = "text"
		}
		if _, err := e.pool.Exec(ctx, ddl); err != nil {
			t.Fatalf("create %s: %v", tbl, err)
		}
	}
	if out, err := e.cli("migrate"); err != nil {
		t.Fatalf("walbox migrate: %v\n%s", err, out)
	}

	procs := []*proc{e.spawnRelay()}
	slotEstablished(t, e)
	// From here to the verdict, a watcher compares the rows marked
	// processed with what the streams hold, every 100 ms: a mark that
	// comes before its own event is stored is caught even when the event
	// is stored later.
	watch := watchMarks(ctx, t, e, e.streamNames())
	defer watch.stop()
	// The witness of commit order: a test_decoding slot of its own,
	// created before the load.
	const witnessSlot = "identity_witness"
	if _, err := e.pool.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'test_decoding')", witnessSlot); err != nil {
		t.Fatalf("create the witness slot: %v", err)
	}

	// The load: producers write transactions of one to four rows, each
	// into a table picked at random; ids come from each table's own
	// sequence, so both tables hold 1, 2, 3, ... (or e1, e2, e3, ...).
	const producers, txns = 4, 120
	var progress atomic.Int64
	var wg sync.WaitGroup
	var loadErr atomic.Value
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(p), 33))
			n := 0
			for range txns {
				err := func() error {
					tx, err := e.pool.Begin(ctx)
					if err != nil {
						return err
					}
					defer tx.Rollback(ctx)
					for range 1 + rng.IntN(4) {
						// Two rows of b for one of a: b's ids run ahead
						// of a's, so a stream's tail holds b's ids of
						// a's rows not yet published.
						tbl := sharedIDTables[min(rng.IntN(3), 1)]
						idq := fmt.Sprintf("SELECT nextval(pg_get_serial_sequence('%s', 'id'))::text", tbl)
						if v.textIDs {
							idq = fmt.Sprintf("SELECT 'e' || nextval('%s_seq')", tbl)
						}
						var id string
						if err := tx.QueryRow(ctx, idq).Scan(&id); err != nil {
							return err
						}
						short := strings.TrimPrefix(tbl, "public.outbox_")
						payload := fmt.Sprintf(`{"t":%q,"id":%q,"p":%d,"n":%d}`, short, id, p, n)
						if _, err := tx.Exec(ctx, fmt.Sprintf("INSERT INTO %s (id, topic, payload) VALUES ($1::%s, 'ev', $2::jsonb)", tbl, idType), id, payload); err != nil {
							return err
						}
						n++
					}
					return tx.Commit(ctx)
				}()
				if err != nil {
					loadErr.CompareAndSwap(nil, err)
					return
				}
				progress.Add(1)
			}
		}()
	}
	loadDone := make(chan struct{})
	go func() { wg.Wait(); close(loadDone) }()

	// kill -9 mid-stream, once, and restart.
	if !waitFor(ctx, 30*time.Second, func() bool { return progress.Load() >= producers*txns/3 }) {
		t.Fatalf("the producers committed only %d of %d transactions in 30 s", progress.Load(), producers*txns)
	}
	procs[0].signal(t, syscall.SIGKILL)
	t.Logf("killed the relay (SIGKILL) with %d of %d transactions committed and %d messages stored",
		progress.Load(), producers*txns, streamMsgs(ctx, e, e.streamNames()))
	procs = append(procs, e.spawnRelay())
	select {
	case <-loadDone:
	case <-time.After(60 * time.Second):
		t.Fatalf("the producers did not finish in 60 s (%d of %d transactions)", progress.Load(), producers*txns)
	}
	if err, _ := loadErr.Load().(error); err != nil {
		t.Fatalf("producer: %v", err)
	}

	// What committed, by table, in commit order (the witness).
	committed, order := readWitness(ctx, t, e, witnessSlot)
	total := 0
	for _, tbl := range sharedIDTables {
		if len(committed[tbl]) == 0 {
			t.Fatalf("the witness saw no row of %s: the test produced nothing", tbl)
		}
		total += len(committed[tbl])
	}

	// The relay is not stalled: a table-less marker emitted through each
	// table now, after every row committed, is stored within the deadline
	// (the relay publishes in WAL order, so it is then past every row and a
	// row still missing is lost, not late). Then wait for the rows, 5 s
	// more at most once nothing new arrives.
	names := e.streamNames()
	storedCount := func() uint64 { return streamMsgs(ctx, e, names) }
	markers := make([]settleMarker, 0, len(sharedIDTables))
	for _, tbl := range sharedIDTables {
		markers = append(markers, emitSettleMarker(ctx, e, tbl, subjectOf[tbl]))
	}
	const deliverWithin = 30 * time.Second
	deliverStart := time.Now()
	var last uint64
	lastChange, settledAt := time.Now(), time.Duration(0)
	var timeline []string // messages stored, when the count changed
	for {
		n := storedCount()
		if n != last {
			last, lastChange = n, time.Now()
			timeline = append(timeline, fmt.Sprintf("%d@%.1fs", n, time.Since(deliverStart).Seconds()))
		}
		if settledAt == 0 && !slices.ContainsFunc(markers, func(m settleMarker) bool { return !m.stored(ctx, e) }) {
			settledAt = time.Since(deliverStart)
		}
		if settledAt > 0 && (n >= uint64(total+len(markers)) || time.Since(lastChange) > 5*time.Second) {
			break
		}
		if time.Since(deliverStart) > deliverWithin || ctx.Err() != nil {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	deliverTook := time.Since(deliverStart)
	settledOK := settledAt > 0
	if len(timeline) > 12 {
		timeline = append(append(timeline[:6:6], "..."), timeline[len(timeline)-6:]...)
	}
	t.Logf("messages in the stream(s) after the load ended: %s", strings.Join(timeline, " "))

	// Let the sweeper mark what it will: wait until every stored row of
	// this run is marked, or 20 s.
	msgs := readSharedIDStreams(ctx, t, e, names)
	storedSet := map[eventIdentity]bool{}
	withTable, qualified := 0, 0
	for _, m := range msgs {
		storedSet[m.id] = true
		if m.hasTable {
			withTable++
		}
		if m.qualified {
			qualified++
		}
	}
	processedRows := func() map[string][]string {
		out := map[string][]string{}
		for _, tbl := range sharedIDTables {
			out[tbl] = queryStrings(ctx, t, e.pool, fmt.Sprintf("SELECT id::text FROM %s WHERE processed", tbl))
		}
		return out
	}
	var processed map[string][]string
	markStart := time.Now()
	markedAll := waitFor(ctx, 20*time.Second, func() bool {
		processed = processedRows()
		marked := map[eventIdentity]bool{}
		for tbl, ids := range processed {
			for _, id := range ids {
				marked[eventIdentity{tbl, id}] = true
			}
		}
		for id := range storedSet {
			if !marked[id] {
				return false
			}
		}
		return true
	})
	markTook := time.Since(markStart)
	processed = processedRows()

	early := watch.stop()

	// The verdict, table by table.
	var failures []string
	for _, tbl := range sharedIDTables {
		var keys []string
		for _, id := range committed[tbl] {
			keys = append(keys, eventIdentity{tbl, id}.String())
		}
		byStream := map[string][]string{}
		snapshot := map[string]bool{}
		for _, m := range msgs {
			if m.id.table != tbl {
				continue
			}
			byStream[m.stream] = append(byStream[m.stream], m.id.String())
			if m.snapshot {
				snapshot[m.id.String()] = true
			}
		}
		rep := outboxtest.CheckStreamed(keys, nil, byStream, snapshot)
		storedN := 0
		for _, id := range committed[tbl] {
			if storedSet[eventIdentity{tbl, id}] {
				storedN++
			}
		}
		var wrongMarks []string
		for _, id := range processed[tbl] {
			if !storedSet[eventIdentity{tbl, id}] {
				wrongMarks = append(wrongMarks, id)
			}
		}
		slices.SortFunc(wrongMarks, compareIDs)
		marked := map[string]bool{}
		for _, id := range processed[tbl] {
			marked[id] = true
		}
		unmarked := 0
		for _, id := range committed[tbl] {
			if storedSet[eventIdentity{tbl, id}] && !marked[id] {
				unmarked++
			}
		}
		t.Logf("%s: %d rows committed, %d stored (%d missing), %d duplicated, %d out of commit order; %d marked processed, %d of them not stored%s; %d stored rows not (yet) marked",
			tbl, len(keys), storedN, rep.Lost, rep.Duplicated, rep.OutOfOrder, len(processed[tbl]), len(wrongMarks), examples(wrongMarks), unmarked)
		if !rep.OK() {
			failures = append(failures, fmt.Sprintf("%s: %d of %d rows missing from the stream(s), %d duplicated, %d out of commit order\n  %s",
				tbl, rep.Lost, len(keys), rep.Duplicated, rep.OutOfOrder, strings.Join(rep.Examples, "\n  ")))
		}
		if len(wrongMarks) > 0 {
			failures = append(failures, fmt.Sprintf("%s: %d rows marked processed whose event (table, id) is not stored%s",
				tbl, len(wrongMarks), examples(wrongMarks)))
		}
		// A mark's processed_at is when the sweeper marked the row: before
		// the row's own event was stored (same host, same clock), the mark
		// came from another event's evidence.
		storedAt := map[string]time.Time{}
		for _, m := range msgs {
			if m.id.table == tbl {
				storedAt[m.id.id] = m.storedAt
			}
		}
		sampled, byTime := len(early[tbl]), 0
		for _, r := range markTimes(ctx, t, e, tbl) {
			if at, ok := storedAt[r.id]; ok && r.at.Before(at.Add(-time.Millisecond)) {
				byTime++
				if early[tbl] == nil {
					early[tbl] = map[string]bool{}
				}
				early[tbl][r.id] = true
			}
		}
		var before []string
		for id := range early[tbl] {
			before = append(before, id)
		}
		slices.SortFunc(before, compareIDs)
		t.Logf("%s: %d rows were marked processed while their event was not stored yet (%d seen so by the watcher in %d samples, %d with processed_at before their message's stored time)%s",
			tbl, len(before), sampled, watch.samples.Load(), byTime, examples(before))
		if len(before) > 0 {
			failures = append(failures, fmt.Sprintf("%s: %d rows were marked processed while their event (table, id) was not stored%s",
				tbl, len(before), examples(before)))
		}
	}
	// A message stored under one identity whose payload is another row.
	misattributed := 0
	var misEx []string
	for _, m := range msgs {
		if m.payload.id != "" && m.payload != m.id {
			misattributed++
			if len(misEx) < 5 {
				misEx = append(misEx, fmt.Sprintf("stored as %s (Nats-Msg-Id %s) but it is row %s", m.id, m.msgID, m.payload))
			}
		}
	}
	if misattributed > 0 {
		failures = append(failures, fmt.Sprintf("%d messages stored under another row's identity:\n  %s", misattributed, strings.Join(misEx, "\n  ")))
	}
	// Across tables, in the one stream: reported, not judged (the issue
	// asks for each table's order).
	if !v.separate {
		var all []string
		for _, k := range order {
			all = append(all, k.String())
		}
		byStream := map[string][]string{}
		snapshot := map[string]bool{}
		for _, m := range msgs {
			byStream[m.stream] = append(byStream[m.stream], m.id.String())
			if m.snapshot {
				snapshot[m.id.String()] = true
			}
		}
		rep := outboxtest.CheckStreamed(all, nil, byStream, snapshot)
		t.Logf("across both tables in stream %s: %d events out of commit order", names[0], rep.OutOfOrder)
	}
	arrived := 0
	for _, tbl := range sharedIDTables {
		for _, id := range committed[tbl] {
			if storedSet[eventIdentity{tbl, id}] {
				arrived++
			}
		}
	}
	t.Logf("%d of %d rows arrived; settle markers %s; waited %v for delivery (deadline %v), %v for marks (all stored rows marked: %v); %d of %d messages carry Walbox-Table, %d under a qualified Nats-Msg-Id; relay restarts: %d; variant took %v",
		arrived, total, map[bool]string{true: fmt.Sprintf("stored after %v (the relay is past every row)", settledAt.Round(time.Millisecond)), false: "NOT stored"}[settledOK],
		deliverTook.Round(time.Millisecond), deliverWithin, markTook.Round(time.Millisecond), markedAll,
		withTable, len(msgs), qualified, len(procs)-1, time.Since(start).Round(time.Millisecond))
	if !settledOK {
		failures = append(failures, fmt.Sprintf("the relay stalled: its settle markers were not stored within %v; %d of %d rows arrived", deliverWithin, arrived, total))
	} else if arrived < total {
		failures = append(failures, fmt.Sprintf("the relay went past %d rows without storing them: %d of %d rows arrived", total-arrived, arrived, total))
	}
	if !markedAll {
		failures = append(failures, fmt.Sprintf("the sweeper left stored rows unmarked for %v (a mark taken by the other table's row would leave its own row unmarked)", markTook.Round(time.Second)))
	}
	if len(failures) > 0 {
		for _, p := range procs {
			if lines := relayComplaints(p.output()); lines != "" {
				t.Logf("relay (pid %d) warnings and errors:\n%s", p.cmd.Process.Pid, lines)
			}
		}
		t.Errorf("the same id in two outbox tables (%s):\n%s", v.name, strings.Join(failures, "\n"))
	}
}

// waitFor polls cond every 100 ms until it holds (true) or timeout passes
// (false).
func waitFor(ctx context.Context, timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
	return true
}

// witnessLine matches an insert into one of the test's tables as
// test_decoding prints it: id[bigint]:17 or id[text]:'e17'.
var witnessLine = regexp.MustCompile(`^table (public\.outbox_[ab]): INSERT: id\[[^\]]+\]:'?([^' ]+)'?`)

// readWitness reads the witness slot: the ids committed into each table in
// commit order (insert order within a transaction), and every identity in
// that order across tables.
func readWitness(ctx context.Context, t *testing.T, e *env, slot string) (map[string][]string, []eventIdentity) {
	t.Helper()
	lines := queryStrings(ctx, t, e.pool, "SELECT data FROM pg_logical_slot_peek_changes($1, NULL, NULL, 'include-xids', '0')", slot)
	byTable := map[string][]string{}
	var order []eventIdentity
	for _, l := range lines {
		if m := witnessLine.FindStringSubmatch(l); m != nil {
			byTable[m[1]] = append(byTable[m[1]], m[2])
			order = append(order, eventIdentity{m[1], m[2]})
		}
	}
	return byTable, order
}

// settleMarker is a table-less event emitted through one table's routing,
// on a subject of its own.
type settleMarker struct{ id, stream, subject string }

// settleTableName is the outbox table the settle markers are routed
// through: its subject template is the topic itself.
const settleTableName = "public.outbox_settle"

// emitSettleMarker emits a table-less marker into the stream of table,
// whose subject template is template, on topic walbox_settled_<table>.
func emitSettleMarker(ctx context.Context, e *env, table, template string) settleMarker {
	e.t.Helper()
	m := settleMarker{subject: strings.Replace(template, "{topic}", "walbox_settled_"+strings.TrimPrefix(table, "public."), 1)}
	if err := e.pool.QueryRow(ctx, "SELECT walbox.emit_message($1, '{}', outbox => $2)::text", m.subject, settleTableName).Scan(&m.id); err != nil {
		e.t.Fatalf("emit the settle marker for %s: %v", table, err)
	}
	for _, st := range e.cfg.NATS.Streams {
		if strings.HasPrefix(m.subject, strings.TrimSuffix(st.Subjects[0], ">")) {
			m.stream = st.Name
		}
	}
	return m
}

// stored reports whether the marker is in its stream (under its bare id
// or, published under a qualified Nats-Msg-Id, in Walbox-Event-Id).
func (m settleMarker) stored(ctx context.Context, e *env) bool {
	st, err := e.js.Stream(ctx, m.stream)
	if err != nil {
		return false
	}
	msg, err := st.GetLastMsgForSubject(ctx, m.subject)
	return err == nil && (msg.Header.Get("Nats-Msg-Id") == m.id || msg.Header.Get("Walbox-Event-Id") == m.id)
}

// readSharedIDStreams reads every message of the streams, in stream order,
// and keeps the rows of the test's tables.
func readSharedIDStreams(ctx context.Context, t *testing.T, e *env, names []string) []storedEvent {
	t.Helper()
	var out []storedEvent
	for _, name := range names {
		st, info := e.stream(ctx, name)
		if info.State.Msgs == 0 {
			continue
		}
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
			m, err := st.GetMsg(ctx, seq)
			if err != nil {
				t.Fatalf("read %s seq %d: %v", name, seq, err)
			}
			id, payload, ok := storedIdentity(m)
			if !ok {
				continue
			}
			out = append(out, storedEvent{stream: name, id: id, payload: payload,
				snapshot: m.Header.Get("Walbox-Commit-Lsn") == "0/0", msgID: m.Header.Get("Nats-Msg-Id"),
				hasTable:  m.Header.Get("Walbox-Table") != "",
				qualified: m.Header.Get("Walbox-Event-Id") != "" && m.Header.Get("Walbox-Event-Id") != m.Header.Get("Nats-Msg-Id"),
				storedAt:  m.Time})
		}
	}
	return out
}

// compareIDs orders ids numerically where they are (1, 2, 10; e1, e2, e10).
func compareIDs(a, b string) int {
	if len(a) != len(b) {
		return len(a) - len(b)
	}
	return strings.Compare(a, b)
}

// examples lists the first few ids.
func examples(ids []string) string {
	if len(ids) == 0 {
		return ""
	}
	if len(ids) > 8 {
		return " (e.g. " + strings.Join(ids[:8], ", ") + ", ...)"
	}
	return " (" + strings.Join(ids, ", ") + ")"
}

// relayComplaints are the relay's log lines at warn level and above (at
// most 40 of them).
func relayComplaints(out string) string {
	var keep []string
	for l := range strings.SplitSeq(out, "\n") {
		if strings.Contains(l, `"level":"warn"`) || strings.Contains(l, `"level":"error"`) || strings.Contains(l, `"level":"fatal"`) {
			if len(keep) < 40 {
				keep = append(keep, l)
			}
		}
	}
	return strings.Join(keep, "\n")
}

// markWatch follows the streams with ordered consumers and samples the
// rows marked processed: a row marked while its event is not in the
// stream is recorded. Each sample reads the marks first, then waits until
// the consumers have read every message stored by then: a mark made on
// evidence has its message among those.
type markWatch struct {
	mu      sync.Mutex
	seen    map[eventIdentity]bool
	lastSeq map[string]uint64
	early   map[string]map[string]bool // table -> ids marked before stored
	samples atomic.Int64
	done    chan struct{}
	once    sync.Once
	wg      sync.WaitGroup
}

func watchMarks(ctx context.Context, t *testing.T, e *env, names []string) *markWatch {
	t.Helper()
	w := &markWatch{seen: map[eventIdentity]bool{}, lastSeq: map[string]uint64{}, early: map[string]map[string]bool{}, done: make(chan struct{})}
	for _, name := range names {
		cons, err := e.js.OrderedConsumer(ctx, name, jetstream.OrderedConsumerConfig{})
		if err != nil {
			t.Fatalf("ordered consumer on %s: %v", name, err)
		}
		it, err := cons.Messages()
		if err != nil {
			t.Fatalf("consume %s: %v", name, err)
		}
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			go func() { <-w.done; it.Stop() }()
			for {
				msg, err := it.Next()
				if err != nil {
					return
				}
				md, err := msg.Metadata()
				if err != nil {
					continue
				}
				id, _, ok := identityOf(msg.Headers(), msg.Data())
				w.mu.Lock()
				if ok {
					w.seen[id] = true
				}
				w.lastSeq[name] = md.Sequence.Stream
				w.mu.Unlock()
			}
		}()
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-w.done:
				return
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			w.sample(ctx, e, names)
		}
	}()
	return w
}

// sample compares the marks with the streams once.
func (w *markWatch) sample(ctx context.Context, e *env, names []string) {
	marked := map[string][]string{}
	for _, tbl := range sharedIDTables {
		rows, err := e.pool.Query(ctx, fmt.Sprintf("SELECT id::text FROM %s WHERE processed", tbl))
		if err != nil {
			return
		}
		for rows.Next() {
			var id string
			if rows.Scan(&id) == nil {
				marked[tbl] = append(marked[tbl], id)
			}
		}
		rows.Close()
		if rows.Err() != nil {
			return
		}
	}
	want := map[string]uint64{}
	for _, name := range names {
		st, err := e.js.Stream(ctx, name)
		if err != nil {
			return
		}
		info, err := st.Info(ctx)
		if err != nil {
			return
		}
		want[name] = info.State.LastSeq
	}
	caughtUp := waitFor(ctx, 5*time.Second, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		for name, seq := range want {
			if w.lastSeq[name] < seq {
				return false
			}
		}
		return true
	})
	if !caughtUp {
		return
	}
	w.samples.Add(1)
	w.mu.Lock()
	defer w.mu.Unlock()
	for tbl, ids := range marked {
		for _, id := range ids {
			if !w.seen[eventIdentity{tbl, id}] {
				if w.early[tbl] == nil {
					w.early[tbl] = map[string]bool{}
				}
				w.early[tbl][id] = true
			}
		}
	}
}

// stop ends the watch and returns, by table, the ids seen marked while not
// stored.
func (w *markWatch) stop() map[string]map[string]bool {
	w.once.Do(func() { close(w.done) })
	w.wg.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.early
}

// markTime is a row's id and processed_at.
type markTime struct {
	id string
	at time.Time
}

// markTimes reads the processed_at of the rows of table marked processed.
func markTimes(ctx context.Context, t *testing.T, e *env, table string) []markTime {
	t.Helper()
	rows, err := e.pool.Query(ctx, fmt.Sprintf("SELECT id::text, processed_at FROM %s WHERE processed AND processed_at IS NOT NULL", table))
	if err != nil {
		t.Fatalf("read the marks of %s: %v", table, err)
	}
	defer rows.Close()
	var out []markTime
	for rows.Next() {
		var r markTime
		if err := rows.Scan(&r.id, &r.at); err != nil {
			t.Fatalf("read the marks of %s: %v", table, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("read the marks of %s: %v", table, err)
	}
	return out
}

// streamMsgs is how many messages the streams hold now.
func streamMsgs(ctx context.Context, e *env, names []string) uint64 {
	var n uint64
	for _, name := range names {
		st, err := e.js.Stream(ctx, name)
		if err != nil {
			continue
		}
		if info, err := st.Info(ctx); err == nil {
			n += info.State.Msgs
		}
	}
	return n
}
