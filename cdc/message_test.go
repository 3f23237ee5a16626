package cdc

import (
	"reflect"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/syncbuf"
)

// TestDecodeMessageBody: the JSON body walbox.emit_message writes, decoded
// into an event the way an outbox row would be.
func TestDecodeMessageBody(t *testing.T) {
	for _, c := range []struct {
		name    string
		body    string
		want    Event // Pos and CommitTime are filled in
		wantErr string
	}{
		{
			name: "every field",
			body: `{"id": "e1", "topic": "payout.sent", "payload": {"a": [1, 2]}, "event_type": "sent", "aggregate_type": "payout",
				"aggregate_id": "p_1", "partition_key": "m_9", "headers": {"trace": "t"}, "created_at": "2026-05-06T07:08:09Z"}`,
			want: Event{ID: "e1", Topic: "payout.sent", Payload: []byte(`{"a": [1, 2]}`), PayloadIsJSON: true, EventType: "sent",
				AggregateType: "payout", AggregateID: "p_1", PartitionKey: "m_9", Headers: []byte(`{"trace": "t"}`),
				CreatedAt: "2026-05-06T07:08:09Z"},
		},
		{
			name: "only the required fields",
			body: `{"id": "e2", "topic": "t", "payload": "a string is JSON too"}`,
			want: Event{ID: "e2", Topic: "t", Payload: []byte(`"a string is JSON too"`), PayloadIsJSON: true},
		},
		{
			name: "no topic is a NULL topic; an empty one is not",
			body: `{"id": "e3", "payload": 1}`,
			want: Event{ID: "e3", TopicNull: true, Payload: []byte(`1`), PayloadIsJSON: true},
		},
		{
			name: "an empty topic",
			body: `{"id": "e4", "topic": "", "payload": 1}`,
			want: Event{ID: "e4", Payload: []byte(`1`), PayloadIsJSON: true},
		},
		{
			name: "a JSON null topic, payload and headers",
			body: `{"id": "e5", "topic": null, "payload": null, "headers": null}`,
			want: Event{ID: "e5", TopicNull: true, PayloadNull: true, PayloadIsJSON: true},
		},
		{
			name: "a body of JSON null",
			body: `null`,
			want: Event{TopicNull: true, PayloadNull: true, PayloadIsJSON: true},
		},
		{
			name:    "not JSON: the raw body as a non-JSON payload with a NULL topic",
			body:    `{"id": "e6", "topic": "t", "payload": `,
			want:    Event{TopicNull: true, Payload: []byte(`{"id": "e6", "topic": "t", "payload": `)},
			wantErr: "decode walbox message: unexpected end of JSON input",
		},
		{
			name:    "a field of the wrong type",
			body:    `{"id": 7, "topic": "t", "payload": {}}`,
			want:    Event{TopicNull: true, Payload: []byte(`{"id": 7, "topic": "t", "payload": {}}`)},
			wantErr: "decode walbox message: json: cannot unmarshal number into Go struct field messageBody.id of type string",
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newDecoder(outboxTable, DefaultColumns())
			d.commitLSN, d.commitTime, d.index = 0x5000028, commitTime, 3
			content := []byte(c.body)
			var ev Event
			err := d.message(content, &ev)
			if (err == nil) != (c.wantErr == "") || (err != nil && err.Error() != c.wantErr) {
				t.Fatalf("err %v, want %q", err, c.wantErr)
			}
			// A malformed message still takes its place; every one is
			// table-less (no row to mark).
			c.want.TableLess = true
			wantDecoded(t, d, &ev, c.want, content, 3)
		})
	}
}

// TestLogicalMessagesInTheStream: pg_logical_emit_message frames. A
// transactional 'walbox' message inside a transaction is an event in its
// place among the rows; a non-transactional message between transactions
// (walbox's heartbeat) is a WAL position the relay may confirm; the rest is
// not walbox's.
func TestLogicalMessagesInTheStream(t *testing.T) {
	const body = `{"id": "m1", "topic": "payout.sent", "payload": {"p": 1}}`
	t.Run("table-less events among outbox rows", func(t *testing.T) {
		st, out := testStream(t, testSource(t, nil))
		feed(t, st, 0x100,
			beginMsg(0x200, commitTime, 1),
			relationMsg(outboxRel, "public", "outbox_events", outboxColumns...),
			insertMsg(outboxRel, outboxRow("r1", "t", `{}`)...),
			logicalMsg(true, 0x1F0, MessagePrefix, body),
			insertMsg(outboxRel, outboxRow("r2", "t", `{}`)...),
			commitMsg(0x200, 0x230, commitTime))
		bs := handedOver(out)
		if len(bs) != 1 || !reflect.DeepEqual(kinds(bs[0]), []ChangeKind{KindBegin, KindEvent, KindEvent, KindEvent, KindCommit}) {
			t.Fatalf("batches %+v", bs)
		}
		want := Event{Pos: Position{CommitLSN: 0x200, Index: 1}, CommitTime: commitTime.Local(), ID: "m1", Topic: "payout.sent",
			Payload: []byte(`{"p": 1}`), PayloadIsJSON: true, TableLess: true}
		if !reflect.DeepEqual(bs[0][2].Event, want) {
			t.Fatalf("message event\n got %+v\nwant %+v", bs[0][2].Event, want)
		}
		if ids := []string{bs[0][1].Event.ID, bs[0][3].Event.ID}; ids[0] != "r1" || ids[1] != "r2" || bs[0][3].Event.Pos.Index != 2 {
			t.Errorf("rows around the message %+v", bs[0])
		}
	})

	t.Run("a malformed body is an event all the same, and logged", func(t *testing.T) {
		var logs syncbuf.Buffer
		src := testSource(t, func(c *Config) { c.Logger = zerolog.New(&logs) })
		st, out := testStream(t, src)
		feed(t, st, 0x100, beginMsg(0x200, commitTime, 1), logicalMsg(true, 0x1F0, MessagePrefix, `not json`), commitMsg(0x200, 0x230, commitTime))
		bs := handedOver(out)
		if len(bs) != 1 || len(bs[0]) != 3 {
			t.Fatalf("batches %+v", bs)
		}
		if ev := bs[0][1].Event; !ev.TopicNull || ev.PayloadIsJSON || string(ev.Payload) != "not json" {
			t.Errorf("event %+v", ev)
		}
		if l := logs.String(); !strings.Contains(l, "table-less event with a malformed body") || !strings.Contains(l, `"lsn":"0/1F0"`) {
			t.Errorf("log %q", l)
		}
	})

	t.Run("table-less events count toward the batch limits", func(t *testing.T) {
		st, out := testStream(t, testSource(t, func(c *Config) { c.BatchSize = 2 }))
		feed(t, st, 0x100, beginMsg(0x200, commitTime, 1), logicalMsg(true, 0x1F0, MessagePrefix, body))
		if bs := handedOver(out); len(bs) != 1 || !reflect.DeepEqual(kinds(bs[0]), []ChangeKind{KindBegin, KindEvent}) {
			t.Fatalf("batches %+v", bs)
		}
		st2, out2 := testStream(t, testSource(t, func(c *Config) { c.BatchBytes = 5 }))
		feed(t, st2, 0x100, beginMsg(0x200, commitTime, 1), logicalMsg(true, 0x1F0, MessagePrefix, body))
		if bs := handedOver(out2); len(bs) != 1 || len(bs[0]) != 2 {
			t.Fatalf("batches %+v", bs)
		}
	})

	for _, c := range []struct {
		name  string
		inTxn bool
		msg   []byte
		want  []Change // handed over (after Begin and before Commit when inTxn)
	}{
		{"a heartbeat between transactions", false, logicalMsg(false, 0x4000, "walbox.heartbeat", "2026-05-06 07:08:09+00"),
			[]Change{{Kind: KindWALEnd, LSN: 0x4000}}},
		{"any non-transactional message between transactions", false, logicalMsg(false, 0x4100, "other.app", "x"),
			[]Change{{Kind: KindWALEnd, LSN: 0x4100}}},
		{"a non-transactional 'walbox' message is no event", false, logicalMsg(false, 0x4200, MessagePrefix, body),
			[]Change{{Kind: KindWALEnd, LSN: 0x4200}}},
		{"a transactional message of another prefix", true, logicalMsg(true, 0x1F0, "other.app", body), nil},
		{"a prefix that only starts with walbox", true, logicalMsg(true, 0x1F0, "walbox.heartbeat", body), nil},
		{"a non-transactional message inside a transaction", true, logicalMsg(false, 0x1F0, "walbox.heartbeat", "x"), nil},
		{"a transactional 'walbox' message outside a transaction", false, logicalMsg(true, 0x1F0, MessagePrefix, body), nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			st, out := testStream(t, testSource(t, nil))
			if c.inTxn {
				feed(t, st, 0x100, beginMsg(0x200, commitTime, 1))
			}
			feed(t, st, 0x100, c.msg)
			if c.inTxn {
				feed(t, st, 0x100, commitMsg(0x200, 0x230, commitTime))
				c.want = append(append([]Change{{Kind: KindBegin, LSN: 0x200}}, c.want...), Change{Kind: KindCommit, LSN: 0x230})
			}
			var got []Change
			for _, b := range handedOver(out) {
				got = append(got, b...)
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Fatalf("handed over\n got %+v\nwant %+v", got, c.want)
			}
			if st.dec.index != 0 {
				t.Errorf("index %d: the message took a place", st.dec.index)
			}
		})
	}
}
