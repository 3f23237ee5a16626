package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
)

func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// metric scrapes one unlabelled value from /metrics.
func metric(addr, name string) (float64, bool) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name+" ") {
			v, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimPrefix(line, name)), 64)
			return v, err == nil
		}
	}
	return 0, false
}

// vmHWM reads a process's peak resident set size in bytes.
func vmHWM(pid int) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "VmHWM:") {
			f := strings.Fields(line)
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb * 1024
		}
	}
	return 0
}

func TestLargeTransactionStreamsWithBoundedHeap(t *testing.T) {
	const rows = 200_000
	addr := freeAddr(t)
	e := newMigratedEnv(t, func(c *config.Config) { c.Metrics.Listen = addr })
	p := e.spawnRelay()

	// Sample the relay's heap while one transaction of 200,000 rows goes
	// through: it must stay bounded by the window, not the transaction.
	stopSampling := samplePeak(addr, "go_memstats_heap_inuse_bytes", 50*time.Millisecond)
	start := time.Now()
	_, err := e.pool.Exec(context.Background(), fmt.Sprintf(`INSERT INTO outbox_events (topic, payload)
		SELECT 'orders.bulk', jsonb_build_object('n', g, 'pad', repeat('x', 200)) FROM generate_series(1, %d) g`, rows))
	if err != nil {
		t.Fatal(err)
	}
	e.waitDelivered(rows, 3*time.Minute)
	elapsed := time.Since(start)
	peakHeap := stopSampling()
	rss := vmHWM(p.cmd.Process.Pid)
	t.Logf("200,000-row transaction: delivered in %v (%.0f events/s incl. commit); relay heap in use peak %.1f MB, peak RSS %.1f MB",
		elapsed.Round(time.Millisecond), rows/elapsed.Seconds(), peakHeap/1e6, float64(rss)/1e6)
	if peakHeap == 0 {
		t.Fatal("could not sample the relay's heap")
	}
	// 200,000 events of ~250 bytes are ~50 MB of payload alone, before any
	// per-event overhead: a relay that buffered the transaction would pass
	// this bound several times over.
	if peakHeap > 48e6 {
		t.Fatalf("relay heap peaked at %.1f MB: not bounded by the window", peakHeap/1e6)
	}
	ids, err := outboxtest.ReadStream(context.Background(), e.js, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, id := range ids {
		if seen[id] {
			t.Fatalf("duplicate %s", id)
		}
		seen[id] = true
	}
	if len(seen) != rows {
		t.Fatalf("stream holds %d distinct events, want %d", len(seen), rows)
	}
}

func TestIdleOutboxInBusyDatabaseDoesNotHoldWAL(t *testing.T) {
	e := newMigratedEnv(t)
	e.startRelay()
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, "CREATE TABLE busy (id bigserial primary key, pad text)"); err != nil {
		t.Fatal(err)
	}
	start := e.slot().Confirmed
	// Writes to another table only, for a while.
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := e.pool.Exec(ctx, "INSERT INTO busy (pad) SELECT repeat('x', 500) FROM generate_series(1, 200)"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // pacing: a steady write load on the other table
	}
	var cur string
	if err := e.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&cur); err != nil {
		t.Fatal(err)
	}
	// Within a few status intervals confirmed_flush_lsn catches up with
	// the WAL written meanwhile: the slot retains (almost) nothing.
	var retained int64
	defer func() {
		if retained > 0 {
			t.Logf("confirmed_flush_lsn still %d bytes behind %s", retained, cur)
		}
	}()
	relaytest.Eventually(t, 15*time.Second, "confirmed_flush_lsn to catch up with the WAL written to another table", func() bool {
		if err := e.pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff($1::pg_lsn, confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $2",
			cur, e.cfg.Postgres.Slot).Scan(&retained); err != nil {
			t.Fatal(err)
		}
		return retained <= 0
	})
	end := e.slot().Confirmed
	t.Logf("confirmed_flush_lsn moved %s -> %s while only another table was written; behind the WAL by %d bytes", start, end, max(retained, 0))
	if end <= start || retained > 0 {
		t.Fatalf("idle outbox holds WAL back: confirmed_flush_lsn %s, %d bytes behind %s", end, retained, cur)
	}
}

func TestDAARIONLayoutWorksThroughColumnMappingAlone(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.Outbox.Table = "public.daarion_outbox"
		c.Outbox.Columns = map[string]string{"id": "id", "topic": "topic", "payload": "payload", "stream": "stream",
			"event_type": "", "aggregate_type": "", "aggregate_id": "", "partition_key": "", "headers": "", "created_at": "created_at"}
		c.NATS.Streams = []config.Stream{{Name: "STREAM_PAYOUT", Subjects: []string{"payout.>"}}, {Name: "STREAM_RWA", Subjects: []string{"rwa.>"}}}
	})
	ctx := context.Background()
	// The table exactly as the DAARION outbox design defines it, with
	// snowflake-like text ids; columns in another order than walbox's own.
	if _, err := e.pool.Exec(ctx, `create table daarion_outbox (
		id text primary key, stream text not null, topic text not null, payload jsonb not null,
		created_at timestamptz default now(), processed bool default false, processed_at timestamptz, error text)`); err != nil {
		t.Fatal(err)
	}
	e.startRelay()
	for i := 0; i < 50; i++ {
		stream, topic := "STREAM_PAYOUT", "payout.generated"
		if i%2 == 1 {
			stream, topic = "STREAM_RWA", "rwa.inventory.updated"
		}
		if _, err := e.pool.Exec(ctx, "INSERT INTO daarion_outbox (id, stream, topic, payload) VALUES ($1, $2, $3, $4)",
			fmt.Sprintf("%d", 1790000000000000000+i), stream, topic, fmt.Sprintf(`{"payout_id":"p_%03d"}`, i)); err != nil {
			t.Fatal(err)
		}
	}
	e.waitDelivered(50, 30*time.Second)
	msg := e.firstMsg(ctx, "STREAM_PAYOUT")
	if got := msg.Header.Get("Nats-Msg-Id"); got != "1790000000000000000" {
		t.Fatalf("Nats-Msg-Id = %q, want the text id", got)
	}
	if string(msg.Data) != `{"payout_id": "p_000"}` {
		t.Fatalf("data = %s, want the payload as Postgres outputs it", msg.Data)
	}
	for _, name := range []string{"STREAM_PAYOUT", "STREAM_RWA"} {
		st, _ := e.js.Stream(ctx, name)
		info, _ := st.Info(ctx)
		if info.State.Msgs != 25 {
			t.Fatalf("%s holds %d, want 25", name, info.State.Msgs)
		}
	}
	_ = jetstream.ErrMsgNotFound
}

// runSourceOnce runs a cdc source for the default outbox table on the
// database at url and returns why it stopped (30 s at most).
func runSourceOnce(ctx context.Context, t *testing.T, url string) error {
	t.Helper()
	src, err := cdc.NewSource(cdc.Config{ConnString: url, Slot: "walbox", Publication: "walbox_outbox",
		Table: cdc.TableName{Schema: "public", Name: "outbox_events"}, Columns: cdc.DefaultColumns()})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return src.Run(runCtx, make(chan []cdc.Change, 1))
}

func TestWrongWALLevelNamesTheFix(t *testing.T) {
	ctx := context.Background()
	cl := pgtest.StartOwn(ctx, t, pgtest.WithSetting("wal_level", "replica"))
	err := runSourceOnce(ctx, t, cl.URL("postgres"))
	if err == nil || !strings.Contains(err.Error(), "wal_level = logical") || !strings.Contains(err.Error(), "restart") {
		t.Fatalf("error %v does not name the fix (set wal_level = logical and restart)", err)
	}
	if !cdc.IsPermanent(err) {
		t.Fatalf("wrong wal_level should stop the relay, not be retried: %v", err)
	}
}

func TestMissingReplicationPrivilegeNamesTheFix(t *testing.T) {
	e := newMigratedEnv(t)
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, "DROP ROLE IF EXISTS app_noreplication; CREATE ROLE app_noreplication LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.pool.Exec(context.Background(), "DROP ROLE IF EXISTS app_noreplication") })
	cfg, _ := pgx.ParseConfig(e.dbURL)
	url := fmt.Sprintf("postgres://app_noreplication@127.0.0.1:%d/%s?sslmode=disable", cfg.Port, cfg.Database)
	err := runSourceOnce(ctx, t, url)
	if err == nil || !strings.Contains(err.Error(), "REPLICATION") {
		t.Fatalf("error %v does not name the fix (ALTER ROLE ... WITH REPLICATION)", err)
	}
}

func TestEnvelopesAsAConsumerReceivesThem(t *testing.T) {
	for _, mode := range []string{"cloudevents", "envelope"} {
		t.Run(mode, func(t *testing.T) {
			e := newMigratedEnv(t, func(c *config.Config) {
				c.NATS.Envelope = mode
				c.NATS.SubjectTemplate = "{topic}.{bucket}"
			})
			e.startRelay()
			ctx := context.Background()
			if _, err := e.pool.Exec(ctx, `INSERT INTO outbox_events (id, topic, event_type, aggregate_type, aggregate_id, payload, headers)
				VALUES ('00000000-0000-0000-0000-0000000000aa', 'orders.created', 'OrderCreated', 'order', 'o-1', '{"amount": 5}',
				        '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "correlation_id": "c-9"}')`); err != nil {
				t.Fatal(err)
			}
			e.waitDelivered(1, 30*time.Second)
			m := e.firstMsg(ctx, "ORDERS")
			if !strings.HasPrefix(m.Subject, "orders.created.") {
				t.Fatalf("subject %q, want orders.created.<bucket>", m.Subject)
			}
			switch mode {
			case "cloudevents":
				for k, want := range map[string]string{"ce-id": "00000000-0000-0000-0000-0000000000aa", "ce-type": "OrderCreated", "ce-subject": "o-1", "ce-specversion": "1.0"} {
					if got := m.Header.Get(k); got != want {
						t.Errorf("%s = %q, want %q", k, got, want)
					}
				}
				if string(m.Data) != `{"amount": 5}` {
					t.Errorf("data %s", m.Data)
				}
			case "envelope":
				var env struct {
					EventID  string          `json:"event_id"`
					Type     string          `json:"event_type"`
					AggID    string          `json:"aggregate_id"`
					Payload  json.RawMessage `json:"payload"`
					Metadata map[string]string
				}
				if err := json.Unmarshal(m.Data, &env); err != nil {
					t.Fatalf("envelope does not decode: %v: %s", err, m.Data)
				}
				if env.EventID != "00000000-0000-0000-0000-0000000000aa" || env.Type != "OrderCreated" || env.AggID != "o-1" ||
					string(env.Payload) != `{"amount": 5}` || env.Metadata["trace_id"] != "4bf92f3577b34da6a3ce929d0e0e4736" || env.Metadata["correlation_id"] != "c-9" {
					t.Fatalf("envelope %s", m.Data)
				}
			}
			if m.Header.Get("Nats-Msg-Id") != "00000000-0000-0000-0000-0000000000aa" {
				t.Fatal("Nats-Msg-Id missing under an envelope")
			}
		})
	}
}

func TestDebeziumLayoutRoutedByAggregateType(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.Outbox.Table = "public.outboxevent"
		// Debezium's outbox table has no topic column: the aggregate type
		// is the topic, and the subject template routes by it.
		c.Outbox.Columns = map[string]string{"id": "id", "topic": "aggregatetype", "payload": "payload", "aggregate_type": "aggregatetype",
			"aggregate_id": "aggregateid", "event_type": "type", "stream": "", "partition_key": "", "headers": "", "created_at": ""}
		c.NATS.SubjectTemplate = "outbox.{aggregate_type}"
		c.NATS.Streams = []config.Stream{{Name: "ORDER_EVENTS", Subjects: []string{"outbox.order"}}, {Name: "CUSTOMER_EVENTS", Subjects: []string{"outbox.customer"}}}
	})
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, `CREATE TABLE outboxevent (id uuid primary key, aggregatetype varchar(255) not null,
		aggregateid varchar(255) not null, type varchar(255) not null, payload jsonb)`); err != nil {
		t.Fatal(err)
	}
	e.startRelay()
	for i, agg := range []string{"order", "customer", "order"} {
		if _, err := e.pool.Exec(ctx, "INSERT INTO outboxevent VALUES (gen_random_uuid(), $1, $2, $3, $4)",
			agg, fmt.Sprintf("%s-%d", agg, i), agg+"Created", fmt.Sprintf(`{"i": %d}`, i)); err != nil {
			t.Fatal(err)
		}
	}
	e.waitDelivered(3, 30*time.Second)
	for name, want := range map[string]uint64{"ORDER_EVENTS": 2, "CUSTOMER_EVENTS": 1} {
		st, _ := e.js.Stream(ctx, name)
		info, _ := st.Info(ctx)
		if info.State.Msgs != want {
			t.Fatalf("%s holds %d, want %d", name, info.State.Msgs, want)
		}
		m, _ := st.GetMsg(ctx, 1)
		if m.Header.Get("Walbox-Event-Type") == "" || m.Header.Get("Walbox-Aggregate-Id") == "" {
			t.Fatalf("%s: event type / aggregate id headers missing: %v", name, m.Header)
		}
	}
}

func TestTableLessEventsFromEmitMessage(t *testing.T) {
	e := newMigratedEnv(t)
	e.startRelay()
	ctx := context.Background()
	// Committed: published. Rolled back: never.
	if _, err := e.pool.Exec(ctx, `SELECT walbox.emit_message('orders.created', '{"n": 1}', event_type => 'OrderCreated', aggregate_id => 'o-1')`); err != nil {
		t.Fatal(err)
	}
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT walbox.emit_message('orders.created', '{"n": 2}')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `SELECT walbox.emit_message('orders.created', '{"n": 3}')`); err != nil {
		t.Fatal(err)
	}
	// The third message, committed after the rollback, arriving is the
	// sign that the relay is past the rolled-back one.
	st, err := e.js.Stream(ctx, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 30*time.Second, `the message {"n": 3}`, func() bool {
		m, err := st.GetLastMsgForSubject(ctx, "orders.created")
		return err == nil && string(m.Data) == `{"n": 3}`
	})
	info, _ := st.Info(ctx)
	if info.State.Msgs != 2 {
		t.Fatalf("ORDERS holds %d, want 2 (the rolled-back message must not appear)", info.State.Msgs)
	}
	m1, _ := st.GetMsg(ctx, 1)
	m2, _ := st.GetMsg(ctx, 2)
	if string(m1.Data) != `{"n": 1}` || string(m2.Data) != `{"n": 3}` || m1.Header.Get("Walbox-Event-Type") != "OrderCreated" || m1.Header.Get("Nats-Msg-Id") == "" {
		t.Fatalf("got %s %v / %s", m1.Data, m1.Header, m2.Data)
	}
	var rows int
	_ = e.pool.QueryRow(ctx, "SELECT count(*) FROM outbox_events").Scan(&rows)
	if rows != 0 {
		t.Fatalf("table-less mode stored %d rows", rows)
	}
}

// TestDebeziumLayoutPublishesDebeziumsOutboxTable runs walbox on Debezium's
// outbox table as Debezium users write it: insert the event and delete it
// in the same transaction (the row never stays; only the WAL has it). With
// outbox.layout: debezium the events go to outbox.event.<aggregatetype>,
// with the event id in Nats-Msg-Id and in header id, the type and the
// aggregate id in walbox's headers, and no row is ever updated.
func TestDebeziumLayoutPublishesDebeziumsOutboxTable(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.Outbox = config.Outbox{Table: "public.outboxevent", Layout: config.LayoutDebezium}
		c.NATS.Streams = []config.Stream{{Name: "OUTBOX", Subjects: []string{"outbox.event.>"}, DuplicateWindow: 2 * time.Minute}}
	})
	ctx := relaytest.Ctx(t)
	if _, err := e.pool.Exec(ctx, `CREATE TABLE outboxevent (id uuid NOT NULL PRIMARY KEY, aggregatetype varchar(255) NOT NULL,
		aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)`); err != nil {
		t.Fatal(err)
	}
	e.startRelay()
	type row struct{ id, aggType, aggID, typ string }
	rows := []row{
		{"0f9b2a86-6f6c-4a55-9d8c-6a1e0b1c0001", "Order", "o-1", "OrderCreated"},
		{"0f9b2a86-6f6c-4a55-9d8c-6a1e0b1c0002", "Customer", "c-9", "CustomerMoved"},
		{"0f9b2a86-6f6c-4a55-9d8c-6a1e0b1c0003", "Order", "o-1", "OrderPaid"},
	}
	for _, r := range rows {
		tx, err := e.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) VALUES ($1, $2, $3, $4, '{\"v\": 1}')",
			r.id, r.aggType, r.aggID, r.typ); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "DELETE FROM outboxevent WHERE id = $1", r.id); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	e.waitDelivered(len(rows), 30*time.Second)
	st, err := e.js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range rows {
		m, err := st.GetMsg(ctx, uint64(i+1))
		if err != nil {
			t.Fatal(err)
		}
		h := m.Header
		if m.Subject != "outbox.event."+r.aggType || h.Get("Nats-Msg-Id") != r.id || h.Get("id") != r.id ||
			h.Get("Walbox-Event-Type") != r.typ || h.Get("Walbox-Aggregate-Type") != r.aggType || h.Get("Walbox-Aggregate-Id") != r.aggID ||
			string(m.Data) != `{"v": 1}` {
			t.Fatalf("message %d: %s %v %s", i+1, m.Subject, h, m.Data)
		}
	}
	// Nothing to mark: the table has no processed flag, and the rows are gone.
	if got := e.counter("walbox_sweeper_marked_total", nil); got != 0 {
		t.Errorf("walbox_sweeper_marked_total = %v", got)
	}
}
