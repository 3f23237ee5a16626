package cdc

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/rs/zerolog"
)

var outboxTable = TableName{Schema: "public", Name: "outbox_events"}

// testSource is a Source for the default outbox table that logs to the test.
func testSource(t *testing.T, mod func(*Config)) *Source {
	t.Helper()
	cfg := Config{
		ConnString: "postgres://walbox@127.0.0.1/app", Slot: "walbox", Publication: "walbox_outbox",
		Table: outboxTable, Columns: DefaultColumns(),
		Logger: zerolog.New(zerolog.NewTestWriter(t)),
	}
	if mod != nil {
		mod(&cfg)
	}
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// testStream is a stream whose relay side is a buffered channel and whose
// next status update is due in an hour: it never writes to its (absent)
// connection. Tests that need status updates use dialFake.
func testStream(t *testing.T, src *Source) (*stream, chan []Change) {
	t.Helper()
	out := make(chan []Change, 64)
	return &stream{src: src, out: out, dec: newDecoder(src.cfg.Table, src.cfg.Columns), nextStatus: time.Now().Add(time.Hour)}, out
}

// feed sends each pgoutput message to the stream as one XLogData frame, the
// way the walsender sends them, and fails the test on the first error.
func feed(t *testing.T, st *stream, walEnd LSN, msgs ...[]byte) {
	t.Helper()
	for _, m := range msgs {
		if err := st.handleCopyData(t.Context(), xlogData(walEnd, walEnd, serverClock, m)); err != nil {
			t.Fatalf("message %q: %v", m[0], err)
		}
	}
}

// handedOver returns every batch the stream has handed over so far.
func handedOver(out chan []Change) [][]Change { return pending(out) }

// pending returns what ch holds now, without waiting.
func pending[T any](ch <-chan T) []T {
	var vs []T
	for {
		select {
		case v := <-ch:
			vs = append(vs, v)
		default:
			return vs
		}
	}
}

var (
	serverClock = time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC)
	commitTime  = time.Date(2026, 5, 6, 7, 8, 9, 123456000, time.UTC)
)

// outboxColumns is the Relation of walbox's own outbox table, in its
// column order (not the order of the roles).
var outboxColumns = []relCol{
	{name: "id", oid: oidUUID, key: true},
	{name: "created_at", oid: oidTimestamptz},
	{name: "topic", oid: oidText},
	{name: "payload", oid: oidJSONB},
	{name: "headers", oid: oidJSONB},
	{name: "stream", oid: oidText},
	{name: "event_type", oid: oidText},
	{name: "aggregate_type", oid: oidText},
	{name: "aggregate_id", oid: oidText},
	{name: "partition_key", oid: oidText},
	{name: "processed", oid: oidBool},
	{name: "attempts", oid: 23},
}

// outboxRow is an Insert tuple for outboxColumns.
func outboxRow(id, topic, payload string) []tupleCol {
	return []tupleCol{txt(id), txt("2026-05-06 07:08:09.123456+00"), txt(topic), txt(payload), null,
		null, txt("generated"), txt("payout"), txt("p_001"), null, txt("f"), txt("0")}
}

const outboxRel = 16390

func TestBeginRelationInsertCommit(t *testing.T) {
	src := testSource(t, nil)
	st, out := testStream(t, src)
	const final, end = LSN(0x16B3748), LSN(0x16B3778)
	id1, id2 := "0190a1b2-0000-7000-8000-000000000001", "0190a1b2-0000-7000-8000-000000000002"

	feed(t, st, 0x16B3700,
		beginMsg(final, commitTime, 731),
		relationMsg(outboxRel, "public", "outbox_events", outboxColumns...),
		insertMsg(outboxRel, outboxRow(id1, "payout.generated", `{"payout_id": "p_001"}`)...),
		insertMsg(outboxRel, outboxRow(id2, "payout.sent", `{"payout_id": "p_001"}`)...),
	)
	if bs := handedOver(out); len(bs) != 0 {
		t.Fatalf("handed over before the commit: %+v", bs)
	}
	if !st.dec.inTxn || src.Received() != 0 {
		t.Fatalf("in transaction %v, received %s", st.dec.inTxn, src.Received())
	}
	feed(t, st, 0x16B3800, commitMsg(final, end, commitTime))

	bs := handedOver(out)
	if len(bs) != 1 {
		t.Fatalf("%d batches, want one at the commit", len(bs))
	}
	want := []Change{
		{Kind: KindBegin, LSN: final},
		{Kind: KindEvent, Event: Event{Pos: Position{CommitLSN: final, Index: 0}, CommitTime: commitTime.Local(), ID: id1,
			Topic: "payout.generated", EventType: "generated", AggregateType: "payout", AggregateID: "p_001",
			CreatedAt: "2026-05-06 07:08:09.123456+00", Payload: []byte(`{"payout_id": "p_001"}`), PayloadIsJSON: true}},
		{Kind: KindEvent, Event: Event{Pos: Position{CommitLSN: final, Index: 1}, CommitTime: commitTime.Local(), ID: id2,
			Topic: "payout.sent", EventType: "generated", AggregateType: "payout", AggregateID: "p_001",
			CreatedAt: "2026-05-06 07:08:09.123456+00", Payload: []byte(`{"payout_id": "p_001"}`), PayloadIsJSON: true}},
		{Kind: KindCommit, LSN: end}, // the end LSN, never the commit record's start
	}
	if !reflect.DeepEqual(bs[0], want) {
		t.Fatalf("batch\n got %+v\nwant %+v", bs[0], want)
	}
	if !bs[0][1].Event.CommitTime.Equal(commitTime) {
		t.Errorf("commit time %v", bs[0][1].Event.CommitTime)
	}
	if st.dec.inTxn || !st.streamed || src.Received() != 0x16B3800 {
		t.Errorf("after commit: in transaction %v, streamed %v, received %s", st.dec.inTxn, st.streamed, src.Received())
	}

	// The next transaction numbers its events from 0 again and needs no
	// second Relation message.
	const final2, end2 = LSN(0x16B3900), LSN(0x16B3930)
	feed(t, st, 0x16B3700, // an older WAL end does not move Received back
		beginMsg(final2, commitTime, 732),
		insertMsg(outboxRel, outboxRow("id-3", "payout.sent", `{}`)...),
		commitMsg(final2, end2, commitTime))
	bs = handedOver(out)
	if len(bs) != 1 || len(bs[0]) != 3 || bs[0][1].Event.Pos != (Position{CommitLSN: final2, Index: 0}) || bs[0][2].LSN != end2 {
		t.Fatalf("second transaction %+v", bs)
	}
	if src.Received() != 0x16B3800 {
		t.Errorf("received moved back to %s", src.Received())
	}
}

// TestDecodeColumns decodes one Insert against one Relation and compares
// the event: column kinds, NULLs, types, roles mapped to other names or to
// nothing.
func TestDecodeColumns(t *testing.T) {
	type rel = []relCol
	basic := rel{{"id", oidUUID, true}, {"topic", oidText, false}, {"payload", oidJSONB, false}}
	for _, c := range []struct {
		name string
		cols Columns // zero: DefaultColumns
		rel  rel
		row  []tupleCol
		want Event // Pos and CommitTime are filled in
	}{
		{
			name: "jsonb payload", rel: basic,
			row:  []tupleCol{txt("0190a1b2-0000-7000-8000-000000000001"), txt("t.x"), txt(`{"a": 1}`)},
			want: Event{ID: "0190a1b2-0000-7000-8000-000000000001", Topic: "t.x", Payload: []byte(`{"a": 1}`), PayloadIsJSON: true},
		},
		{
			name: "json payload", rel: rel{{"id", oidUUID, true}, {"topic", oidText, false}, {"payload", oidJSON, false}},
			row:  []tupleCol{txt("i"), txt("t"), txt(`[1, 2]`)},
			want: Event{ID: "i", Topic: "t", Payload: []byte(`[1, 2]`), PayloadIsJSON: true},
		},
		{
			name: "text payload is not known to be JSON", rel: rel{{"id", oidInt8, true}, {"topic", oidVarchar, false}, {"payload", oidText, false}},
			row:  []tupleCol{txt("42"), txt("t"), txt("plain text")},
			want: Event{ID: "42", Topic: "t", Payload: []byte("plain text")},
		},
		{
			name: "bytea payload arrives in its text form", rel: rel{{"id", oidUUID, true}, {"topic", oidText, false}, {"payload", oidBytea, false}},
			row:  []tupleCol{txt("i"), txt("t"), txt(`\x7b7d`)},
			want: Event{ID: "i", Topic: "t", Payload: []byte(`\x7b7d`)},
		},
		{
			name: "binary column data is taken as sent", rel: basic,
			row:  []tupleCol{txt("i"), {kind: 'b', val: "t"}, {kind: 'b', val: "\x01{}"}},
			want: Event{ID: "i", Topic: "t", Payload: []byte("\x01{}"), PayloadIsJSON: true},
		},
		{
			name: "empty text values are not NULL", rel: basic,
			row:  []tupleCol{txt(""), txt(""), txt("")},
			want: Event{PayloadIsJSON: true}, // an empty payload is copied as nil, not NULL
		},
		{
			name: "NULL topic and payload", rel: basic,
			row:  []tupleCol{txt("i"), null, null},
			want: Event{ID: "i", TopicNull: true, PayloadNull: true, PayloadIsJSON: true},
		},
		{
			name: "an unchanged TOAST value reads as NULL", rel: basic,
			row:  []tupleCol{txt("i"), txt("t"), unchanged},
			want: Event{ID: "i", Topic: "t", PayloadNull: true, PayloadIsJSON: true},
		},
		{
			name: "every optional role, headers copied, timestamptz as text", rel: outboxColumns,
			row: []tupleCol{txt("i"), txt("2026-05-06 07:08:09+02"), txt("t"), txt(`{}`), txt(`{"h": "v"}`),
				txt("PAYOUTS"), txt("et"), txt("at"), txt("aid"), txt("pk"), txt("f"), txt("0")},
			want: Event{ID: "i", Topic: "t", Payload: []byte(`{}`), PayloadIsJSON: true, Headers: []byte(`{"h": "v"}`),
				Stream: "PAYOUTS", EventType: "et", AggregateType: "at", AggregateID: "aid", PartitionKey: "pk",
				CreatedAt: "2026-05-06 07:08:09+02"},
		},
		{
			name: "NULL headers stay nil", rel: outboxColumns,
			row:  []tupleCol{txt("i"), null, txt("t"), txt(`{}`), null, null, null, null, null, null, null, null},
			want: Event{ID: "i", Topic: "t", Payload: []byte(`{}`), PayloadIsJSON: true},
		},
		{
			name: "roles mapped to other column names; unmapped roles ignored",
			cols: func() Columns {
				c := Columns{}
				c[RoleID], c[RoleTopic], c[RolePayload], c[RoleAggregateID] = "event_id", "subject", "body", "payout_id"
				return c
			}(),
			rel: rel{{"seq", oidInt8, true}, {"body", oidJSONB, false}, {"payout_id", oidText, false}, {"subject", oidText, false},
				{"event_id", oidUUID, false}, {"stream", oidText, false}},
			row:  []tupleCol{txt("1"), txt(`{}`), txt("p_9"), txt("t"), txt("e"), txt("NOT-MAPPED")},
			want: Event{ID: "e", Topic: "t", Payload: []byte(`{}`), PayloadIsJSON: true, AggregateID: "p_9"},
		},
		{
			name: "two roles on one column",
			cols: func() Columns {
				c := DefaultColumns()
				c[RolePartitionKey] = "aggregate_id"
				return c
			}(),
			rel:  rel{{"id", oidUUID, true}, {"topic", oidText, false}, {"payload", oidJSONB, false}, {"aggregate_id", oidText, false}},
			row:  []tupleCol{txt("i"), txt("t"), txt(`{}`), txt("agg-1")},
			want: Event{ID: "i", Topic: "t", Payload: []byte(`{}`), PayloadIsJSON: true, AggregateID: "agg-1", PartitionKey: "agg-1"},
		},
		{
			name: "the topic role mapped to nothing reads as a NULL topic",
			cols: func() Columns {
				c := DefaultColumns()
				c[RoleTopic] = ""
				return c
			}(),
			rel:  basic,
			row:  []tupleCol{txt("i"), txt("t"), txt(`{}`)},
			want: Event{ID: "i", TopicNull: true, Payload: []byte(`{}`), PayloadIsJSON: true},
		},
		{
			name: "a definition without the payload column: dead-lettered with the reason", rel: rel{{"id", oidUUID, true}, {"topic", oidText, false}, {"body", oidJSONB, false}},
			row: []tupleCol{txt("i"), txt("t"), txt(`{}`)},
			want: Event{ID: "i", Topic: "t", PayloadIsJSON: false,
				Poison: `row of table public.outbox_events written when it had no column "payload" (renamed or dropped?): outbox.columns.payload maps the payload role to it`},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			cols := c.cols
			if cols == (Columns{}) {
				cols = DefaultColumns()
			}
			d := newDecoder(outboxTable, cols)
			d.commitLSN, d.commitTime, d.index = 0x3000060, commitTime, 5
			if err := d.relation(parseRelation(t, relationMsg(7, "public", "outbox_events", c.rel...))); err != nil {
				t.Fatal(err)
			}
			msg := insertMsg(7, c.row...)
			var ev Event
			ok, err := d.insert(msg, &ev)
			if err != nil || !ok {
				t.Fatalf("insert: ok %v, err %v", ok, err)
			}
			wantDecoded(t, d, &ev, c.want, msg, 5)
		})
	}
}

// wantDecoded checks that ev, the event decoder d decoded from msg, is want
// at d's commit and index, that it took that one index, and that ev owns
// its bytes: the receive buffer is reused.
func wantDecoded(t *testing.T, d *decoder, ev *Event, want Event, msg []byte, index uint32) {
	t.Helper()
	want.Pos, want.CommitTime = Position{CommitLSN: d.commitLSN, Index: index}, d.commitTime
	if !reflect.DeepEqual(*ev, want) {
		t.Fatalf("event\n got %+v\nwant %+v", *ev, want)
	}
	if d.index != index+1 {
		t.Errorf("index %d after the event, want %d", d.index, index+1)
	}
	for i := range msg {
		msg[i] ^= 0xff
	}
	if !reflect.DeepEqual(*ev, want) {
		t.Errorf("the event shares the message's buffer")
	}
}

// BenchmarkDecodeInsert decodes an insert into walbox's own outbox table
// (a uuid, a timestamp, a topic, a 200-byte payload, three text columns).
func BenchmarkDecodeInsert(b *testing.B) {
	d := newDecoder(outboxTable, DefaultColumns())
	if err := d.relation(parseRelation(b, relationMsg(outboxRel, "public", "outbox_events", outboxColumns...))); err != nil {
		b.Fatal(err)
	}
	msg := insertMsg(outboxRel, outboxRow("0193a4b2-7c1d-7e3f-9a8b-1c2d3e4f5a6b", "orders.created", `{"order":4711,"note":"`+strings.Repeat("x", 170)+`"}`)...)
	var ev Event
	b.ReportAllocs()
	for range b.N {
		if ok, err := d.insert(msg, &ev); !ok || err != nil {
			b.Fatal(ok, err)
		}
	}
}

func parseRelation(t testing.TB, b []byte) *pglogrepl.RelationMessage {
	t.Helper()
	m, err := pglogrepl.Parse(b)
	if err != nil {
		t.Fatalf("parse relation: %v", err)
	}
	return m.(*pglogrepl.RelationMessage)
}

// TestDecodeInsertErrors: a frame the decoder cannot read is an error that
// says what was wrong, never a panic.
func TestDecodeInsertErrors(t *testing.T) {
	rel := relationMsg(7, "public", "outbox_events", relCol{"id", oidUUID, true}, relCol{"topic", oidText, false}, relCol{"payload", oidJSONB, false})
	good := insertMsg(7, txt("i"), txt("t"), txt(`{}`))
	for _, c := range []struct {
		name string
		msg  []byte
		want string
	}{
		{"empty after the type byte", []byte{'I'}, "decode insert: short message (1 bytes)"},
		{"no column count", good[:7], "decode insert: short message (7 bytes)"},
		{"a relation never described", insertMsg(8, txt("i")), "decode insert: relation 8 arrived before its Relation message"},
		{"an old tuple instead of a new one", append(frame{'I'}.u32(7).u8('K').u16(0), good[8:]...), `decode insert: unexpected tuple type 'K'`},
		{"fewer columns than announced", good[:len(good)-7], "decode insert: tuple truncated at column 2"},
		{"a length cut short", good[:len(good)-5], "decode insert: tuple truncated at column 2"},
		{"a value cut short", good[:len(good)-1], "decode insert: tuple truncated at column 2"},
		{"an unknown column kind", frame{'I'}.u32(7).u8('N').u16(1).u8('x'), `decode insert: unknown tuple data kind 'x'`},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newDecoder(outboxTable, DefaultColumns())
			if err := d.relation(parseRelation(t, rel)); err != nil {
				t.Fatal(err)
			}
			var ev Event
			ok, err := d.insert(c.msg, &ev)
			if err == nil || err.Error() != c.want || ok {
				t.Fatalf("ok %v, err %v, want %q", ok, err, c.want)
			}
			if d.index != 0 {
				t.Errorf("index moved to %d", d.index)
			}
		})
	}
}

// TestInsertOfUndescribedRelation: through the stream, an Insert whose
// Relation never came ends the session with that error (the reconnect
// starts over with fresh Relation messages).
func TestInsertOfUndescribedRelation(t *testing.T) {
	st, out := testStream(t, testSource(t, nil))
	feed(t, st, 0x100, beginMsg(0x200, commitTime, 1))
	err := st.handleCopyData(t.Context(), xlogData(0x100, 0x100, serverClock, insertMsg(99, txt("i"), txt("t"), txt("{}"))))
	if err == nil || !strings.Contains(err.Error(), "relation 99 arrived before its Relation message") {
		t.Fatalf("err %v", err)
	}
	if bs := handedOver(out); len(bs) != 0 {
		t.Fatalf("handed over %+v", bs)
	}
}

// TestRowsOfOtherTables: rows of tables that are not the outbox (another
// table in the publication, a partition published under its own name) are
// skipped; the transaction still begins and commits, and the outbox rows
// around them are numbered without gaps.
func TestRowsOfOtherTables(t *testing.T) {
	for _, other := range []TableName{
		{Schema: "public", Name: "payouts"},
		{Schema: "public", Name: "outbox_events_p20260506"},
		{Schema: "audit", Name: "outbox_events"},
	} {
		t.Run(other.String(), func(t *testing.T) {
			st, out := testStream(t, testSource(t, nil))
			feed(t, st, 0x100,
				beginMsg(0x200, commitTime, 1),
				relationMsg(16400, other.Schema, other.Name, relCol{"id", oidText, true}, relCol{"topic", oidText, false}, relCol{"payload", oidJSONB, false}),
				relationMsg(outboxRel, "public", "outbox_events", outboxColumns...),
				insertMsg(16400, txt("x"), txt("not.an.event"), txt(`{}`)),
				insertMsg(outboxRel, outboxRow("a", "t", `{}`)...),
				insertMsg(16400, txt("y"), txt("not.an.event"), txt(`{}`)),
				insertMsg(outboxRel, outboxRow("b", "t", `{}`)...),
				commitMsg(0x200, 0x230, commitTime))
			bs := handedOver(out)
			if len(bs) != 1 {
				t.Fatalf("batches %+v", bs)
			}
			if got := kinds(bs[0]); !reflect.DeepEqual(got, []ChangeKind{KindBegin, KindEvent, KindEvent, KindCommit}) {
				t.Fatalf("kinds %v", got)
			}
			if a, b := bs[0][1].Event, bs[0][2].Event; a.ID != "a" || a.Pos.Index != 0 || b.ID != "b" || b.Pos.Index != 1 {
				t.Fatalf("events %+v %+v", a, b)
			}
		})
	}

	t.Run("a transaction of other tables only", func(t *testing.T) {
		st, out := testStream(t, testSource(t, nil))
		feed(t, st, 0x100,
			beginMsg(0x200, commitTime, 1),
			relationMsg(16400, "public", "payouts", relCol{"id", oidText, true}),
			insertMsg(16400, txt("x")),
			// A row of another table is skipped before its tuple is read.
			frame{'I'}.u32(16400).u8('?').u16(0),
			commitMsg(0x200, 0x230, commitTime))
		bs := handedOver(out)
		if len(bs) != 1 || !reflect.DeepEqual(bs[0], []Change{{Kind: KindBegin, LSN: 0x200}, {Kind: KindCommit, LSN: 0x230}}) {
			t.Fatalf("batches %+v", bs)
		}
	})
}

// TestRelationChangesMidStream: pgoutput sends a table's Relation again
// after its definition changed; rows decode with the definition they were
// written under.
func TestRelationChangesMidStream(t *testing.T) {
	st, out := testStream(t, testSource(t, nil))
	v1 := []relCol{{"id", oidUUID, true}, {"topic", oidText, false}, {"payload", oidText, false}}
	// payload renamed to body: rows can no longer be mapped.
	v2 := []relCol{{"id", oidUUID, true}, {"topic", oidText, false}, {"body", oidText, false}}
	// renamed back, as jsonb, with a column added in front.
	v3 := []relCol{{"tenant", oidText, false}, {"id", oidUUID, true}, {"topic", oidText, false}, {"payload", oidJSONB, false}}

	feed(t, st, 0x100,
		beginMsg(0x200, commitTime, 1),
		relationMsg(outboxRel, "public", "outbox_events", v1...),
		insertMsg(outboxRel, txt("a"), txt("t"), txt(`{"v": 1}`)),
		relationMsg(outboxRel, "public", "outbox_events", v2...),
		insertMsg(outboxRel, txt("b"), txt("t"), txt(`{"v": 2}`)),
		commitMsg(0x200, 0x230, commitTime),
		beginMsg(0x300, commitTime, 2),
		relationMsg(outboxRel, "public", "outbox_events", v3...),
		insertMsg(outboxRel, txt("acme"), txt("c"), txt("t"), txt(`{"v": 3}`)),
		commitMsg(0x300, 0x330, commitTime))

	var evs []Event
	for _, b := range handedOver(out) {
		for _, c := range b {
			if c.Kind == KindEvent {
				evs = append(evs, c.Event)
			}
		}
	}
	if len(evs) != 3 {
		t.Fatalf("%d events: %+v", len(evs), evs)
	}
	if e := evs[0]; e.ID != "a" || string(e.Payload) != `{"v": 1}` || e.PayloadIsJSON || e.Poison != "" {
		t.Errorf("row under v1: %+v", e)
	}
	if e := evs[1]; e.ID != "b" || e.Payload != nil || !strings.Contains(e.Poison, `no column "payload"`) || e.Pos.Index != 1 {
		t.Errorf("row under v2: %+v", e)
	}
	if e := evs[2]; e.ID != "c" || string(e.Payload) != `{"v": 3}` || !e.PayloadIsJSON || e.Poison != "" || e.Pos != (Position{CommitLSN: 0x300}) {
		t.Errorf("row under v3: %+v", e)
	}
}

// TestRelationMessageErrors: a Relation frame pglogrepl cannot parse ends
// the session with an error.
func TestRelationMessageErrors(t *testing.T) {
	st, _ := testStream(t, testSource(t, nil))
	err := st.handleCopyData(t.Context(), xlogData(0x100, 0x100, serverClock, []byte{'R', 0, 0, 1}))
	if err == nil || !strings.HasPrefix(err.Error(), "decode relation: ") {
		t.Fatalf("err %v", err)
	}
}

// TestFramesWithoutOutboxRows: Type, Origin, Truncate and unknown messages
// carry no outbox rows; they change nothing.
func TestFramesWithoutOutboxRows(t *testing.T) {
	st, out := testStream(t, testSource(t, nil))
	feed(t, st, 0x100,
		beginMsg(0x200, commitTime, 1),
		originMsg(0x1234, "pg_16385"),
		typeMsg(16500, "public", "mood"),
		relationMsg(outboxRel, "public", "outbox_events", outboxColumns...),
		truncateMsg(16400),
		[]byte{'Z', 1, 2, 3},
		insertMsg(outboxRel, outboxRow("a", "t", `{}`)...),
		commitMsg(0x200, 0x230, commitTime))
	bs := handedOver(out)
	if len(bs) != 1 || !reflect.DeepEqual(kinds(bs[0]), []ChangeKind{KindBegin, KindEvent, KindCommit}) || bs[0][1].Event.Pos.Index != 0 {
		t.Fatalf("batches %+v", bs)
	}
	// An XLogData frame with no message in it is data all the same.
	st2, out2 := testStream(t, testSource(t, nil))
	if err := st2.handleCopyData(t.Context(), xlogData(1, 1, serverClock, nil)); err != nil || !st2.streamed || len(handedOver(out2)) != 0 {
		t.Fatalf("empty XLogData: err %v, streamed %v", err, st2.streamed)
	}
}

func TestMalformedFrames(t *testing.T) {
	for _, c := range []struct {
		name string
		data []byte
		want string // "" for no error
	}{
		{"empty CopyData", nil, ""},
		{"an unknown CopyData type", []byte{'x', 1, 2}, ""},
		{"a short keepalive", keepaliveMsg(1, serverClock, false)[:10], "parse keepalive: "},
		{"a short XLogData", xlogData(1, 1, serverClock, nil)[:20], "parse XLogData: "},
		{"a short Begin", xlogData(1, 1, serverClock, beginMsg(1, commitTime, 1)[:12]), "decode begin: "},
		{"a short Commit", xlogData(1, 1, serverClock, commitMsg(1, 2, commitTime)[:12]), "decode commit: "},
		{"a short logical message", xlogData(1, 1, serverClock, []byte{'M', 1, 0}), "decode logical message: "},
	} {
		t.Run(c.name, func(t *testing.T) {
			st, out := testStream(t, testSource(t, nil))
			err := st.handleCopyData(t.Context(), c.data)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("err %v", err)
			case c.want != "" && (err == nil || !strings.HasPrefix(err.Error(), c.want)):
				t.Fatalf("err %v, want %q...", err, c.want)
			}
			if bs := handedOver(out); len(bs) != 0 {
				t.Fatalf("handed over %+v", bs)
			}
		})
	}
}

// TestBatchLimits: inside a large transaction the stream hands over every
// BatchSize changes, or once payloads and headers reach BatchBytes; the
// commit hands over the rest.
func TestBatchLimits(t *testing.T) {
	for _, c := range []struct {
		name      string
		size      int
		bytes     int64
		payloads  []string
		wantSizes []int
	}{
		{"by count", 3, 0, []string{`{}`, `{}`, `{}`, `{}`, `{}`}, []int{3, 3, 1}},
		{"by bytes", 0, 20, []string{`{"k": "0123456789"}`, `{"k": "0123456789"}`, `{}`}, []int{3, 2}},
		{"one row over the byte limit alone", 0, 4, []string{`{"big": true}`, `{"big": true}`}, []int{2, 1, 1}},
		{"a small transaction in one batch", 0, 0, []string{`{}`, `{}`}, []int{4}},
	} {
		t.Run(c.name, func(t *testing.T) {
			st, out := testStream(t, testSource(t, func(cfg *Config) { cfg.BatchSize, cfg.BatchBytes = c.size, c.bytes }))
			feed(t, st, 0x100, beginMsg(0x200, commitTime, 1), relationMsg(outboxRel, "public", "outbox_events", outboxColumns...))
			for i, p := range c.payloads {
				feed(t, st, 0x100, insertMsg(outboxRel, outboxRow(string(rune('a'+i)), "t", p)...))
			}
			feed(t, st, 0x100, commitMsg(0x200, 0x230, commitTime))
			var sizes []int
			var all []Change
			for _, b := range handedOver(out) {
				sizes = append(sizes, len(b))
				all = append(all, b...)
			}
			if !reflect.DeepEqual(sizes, c.wantSizes) {
				t.Errorf("batch sizes %v, want %v", sizes, c.wantSizes)
			}
			if n := len(all); n != len(c.payloads)+2 || all[0].Kind != KindBegin || all[n-1].Kind != KindCommit {
				t.Fatalf("changes %v", kinds(all))
			}
			for i := range c.payloads {
				if ev := all[1+i].Event; ev.Pos.Index != uint32(i) || ev.ID != string(rune('a'+i)) {
					t.Errorf("event %d: %+v", i, ev)
				}
			}
			if st.batchBytes != 0 {
				t.Errorf("batchBytes %d after the commit", st.batchBytes)
			}
		})
	}
}

// TestRecycledBatches: a batch given back is reused, emptied, for the next
// hand-over; one too large is left to the GC.
func TestRecycledBatches(t *testing.T) {
	src := testSource(t, func(c *Config) { c.BatchSize = 4 })
	st, out := testStream(t, src)
	feed(t, st, 0x100, beginMsg(0x200, commitTime, 1), relationMsg(outboxRel, "public", "outbox_events", outboxColumns...),
		insertMsg(outboxRel, outboxRow("a", "t", `{}`)...), commitMsg(0x200, 0x230, commitTime))
	b := (<-out)
	src.Recycle(b)
	if got := src.newBatch(); len(got) != 0 || cap(got) != cap(b) || &got[:1][0] != &b[0] {
		t.Fatalf("recycled batch not reused: len %d cap %d", len(got), cap(got))
	}
	if b[1].Event.ID != "" {
		t.Errorf("a recycled batch still holds its events")
	}
	src.Recycle(make([]Change, 0, 17))
	src.Recycle(nil)
	if got := src.newBatch(); cap(got) != 32 {
		t.Errorf("a batch over 4×BatchSize or empty was kept: cap %d", cap(got))
	}
}

// TestHandOverCancelled: every frame that hands a batch over gives up when
// the context ends while the relay takes nothing.
func TestHandOverCancelled(t *testing.T) {
	body := `{"id": "m1", "topic": "t", "payload": {}}`
	for _, c := range []struct {
		name  string
		inTxn bool
		frame []byte
	}{
		{"a commit", true, xlogData(0x100, 0x100, serverClock, commitMsg(0x200, 0x230, commitTime))},
		{"a full batch of rows", true, xlogData(0x100, 0x100, serverClock, insertMsg(outboxRel, outboxRow("a", "t", `{}`)...))},
		{"a full batch with a table-less event", true, xlogData(0x100, 0x100, serverClock, logicalMsg(true, 0x1F0, MessagePrefix, body))},
		{"a heartbeat", false, xlogData(0x100, 0x100, serverClock, logicalMsg(false, 0x300, "walbox.heartbeat", "x"))},
		{"a keepalive", false, keepaliveMsg(0x300, serverClock, false)},
	} {
		t.Run(c.name, func(t *testing.T) {
			src := testSource(t, func(cfg *Config) { cfg.BatchSize = 1 })
			st := &stream{src: src, out: make(chan []Change), dec: newDecoder(outboxTable, DefaultColumns()), nextStatus: time.Now().Add(time.Hour)}
			if err := st.dec.relation(parseRelation(t, relationMsg(outboxRel, "public", "outbox_events", outboxColumns...))); err != nil {
				t.Fatal(err)
			}
			if c.inTxn {
				st.dec.inTxn, st.dec.commitLSN = true, 0x200
			}
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			if err := st.handleCopyData(ctx, c.frame); !errors.Is(err, context.Canceled) {
				t.Fatalf("err %v, want context.Canceled", err)
			}
		})
	}
}

// Each event carries how long after its commit the server sent it, read from
// the server's clock alone (XLogData's send time minus the commit time): the
// sweeper yields while it is large. A send time before the commit (the
// server's clock stepped back) gives 0, never a negative delay.
func TestSentAfterIsTheServersSendDelay(t *testing.T) {
	src := testSource(t, nil)
	st, out := testStream(t, src)
	const final, end = LSN(0x2000), LSN(0x2030)
	send := func(at time.Time, msg []byte) {
		t.Helper()
		if err := st.handleCopyData(t.Context(), xlogData(0x1F00, 0x1F00, at, msg)); err != nil {
			t.Fatal(err)
		}
	}
	send(commitTime, beginMsg(final, commitTime, 900))
	send(commitTime, relationMsg(outboxRel, "public", "outbox_events", outboxColumns...))
	send(commitTime.Add(3*time.Second), insertMsg(outboxRel, outboxRow("id-late", "payout.sent", `{}`)...))
	send(commitTime.Add(2*time.Millisecond), insertMsg(outboxRel, outboxRow("id-soon", "payout.sent", `{}`)...))
	send(commitTime.Add(-time.Second), insertMsg(outboxRel, outboxRow("id-clock-back", "payout.sent", `{}`)...))
	send(commitTime.Add(4*time.Second), logicalMsg(true, 0x1F80, MessagePrefix, `{"id": "id-msg", "topic": "payout.sent", "payload": {}}`))
	send(commitTime.Add(4*time.Second), commitMsg(final, end, commitTime))
	var got []string
	for _, b := range handedOver(out) {
		for _, c := range b {
			if c.Kind == KindEvent {
				got = append(got, c.Event.ID+" "+c.Event.SentAfter.String())
			}
		}
	}
	want := []string{"id-late 3s", "id-soon 2ms", "id-clock-back 0s", "id-msg 4s"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("events (id, sent after) = %q, want %q", got, want)
	}
}
