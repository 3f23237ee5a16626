package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
)

// serviceTables are three outbox tables, each in its own schema with its
// own column names, as a database shared by three services has them.
var serviceTables = []struct {
	schema, table string
	cols          map[string]string // role -> column
	ddl           string
}{
	{"billing", "outbox", map[string]string{"id": "event_id", "topic": "subject", "payload": "body", "created_at": "written_at"},
		`CREATE TABLE billing.outbox (event_id uuid PRIMARY KEY, subject text NOT NULL, body jsonb NOT NULL,
			written_at timestamptz NOT NULL DEFAULT now(), processed boolean NOT NULL DEFAULT false, processed_at timestamptz)`},
	{"shipping", "outbox_events", nil, ""}, // walbox's own layout, made by walbox migrate
	{"legacy", "events_out", map[string]string{"id": "uid", "topic": "kind", "payload": "data", "created_at": "at"},
		`CREATE TABLE legacy.events_out (uid text PRIMARY KEY, kind text NOT NULL, data text NOT NULL,
			at timestamptz NOT NULL DEFAULT now(), processed boolean NOT NULL DEFAULT false, processed_at timestamptz)`},
}

// insertInto writes one event into service table i with its column names.
func insertInto(ctx context.Context, tx pgx.Tx, i int, id, topic, payload string) error {
	var sql string
	switch i {
	case 0:
		sql = "INSERT INTO billing.outbox (event_id, subject, body) VALUES ($1::uuid, $2, $3::jsonb)"
	case 1:
		sql = "INSERT INTO shipping.outbox_events (id, topic, payload) VALUES ($1::uuid, $2, $3::jsonb)"
	default:
		sql = "INSERT INTO legacy.events_out (uid, kind, data) VALUES ($1, $2, $3)"
	}
	_, err := tx.Exec(ctx, sql, id, topic, payload)
	return err
}

// multiEnv is an env whose config lists the three service tables in
// outboxes, each with its own subject template, all captured by one stream
// so that commit order across tables is visible in one sequence. The
// database is migrated with walbox migrate, as a user does it.
func multiEnv(t *testing.T, tables int) *env {
	e := newEnv(t, func(c *config.Config) {
		c.NATS.Streams = []config.Stream{{Name: "SVC", Subjects: []string{"svc.>"}, DuplicateWindow: 2 * time.Minute}}
		c.Outboxes = nil
		for i, st := range serviceTables[:tables] {
			c.Outboxes = append(c.Outboxes, config.OutboxEntry{
				Outbox:          config.Outbox{Table: st.schema + "." + st.table, Columns: st.cols},
				Default:         i == 1,
				SubjectTemplate: "svc." + st.schema + ".{topic}",
			})
		}
		// The legacy service reads CloudEvents (binary mode: the data is
		// the payload, the attributes are headers).
		if tables > 2 {
			c.Outboxes[2].Envelope = "cloudevents"
		}
	})
	ctx := relaytest.Ctx(t)
	for _, st := range serviceTables {
		if _, err := e.pool.Exec(ctx, "CREATE SCHEMA "+st.schema); err != nil {
			t.Fatal(err)
		}
		if st.ddl != "" {
			if _, err := e.pool.Exec(ctx, st.ddl); err != nil {
				t.Fatal(err)
			}
		}
	}
	if out, err := e.cli("migrate"); err != nil {
		t.Fatalf("walbox migrate: %v\n%s", err, out)
	}
	return e
}

// slotEstablished waits until the relay's new slot needs no backfill any
// more (walbox.slot_backfill no longer names it): a kill after that point
// resumes from the slot, not from a fresh snapshot.
func slotEstablished(t *testing.T, e *env) {
	t.Helper()
	ctx := relaytest.Ctx(t)
	relaytest.Eventually(t, 60*time.Second, "the slot's first backfill acked", func() bool {
		var n int
		return e.pool.QueryRow(ctx, "SELECT count(*) FROM walbox.slot_backfill WHERE slot_name = $1", e.cfg.Postgres.Slot).Scan(&n) == nil && n == 0
	})
}

// cli runs the walbox binary with the env's config file.
func (e *env) cli(args ...string) (string, error) {
	e.t.Helper()
	cmd := exec.Command(s.binary, append(args, "--config", e.writeConfig())...)
	cmd.Env = os.Environ()
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// rewriteConfig writes the env's (changed) config to its file again.
func (e *env) rewriteConfig() {
	e.t.Helper()
	data, err := yaml.Marshal(e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := os.WriteFile(e.writeConfig(), data, 0o600); err != nil {
		e.t.Fatal(err)
	}
}

// mixedLoad runs producers that each write transactions of one to four
// events, every event into a table picked at random, with the producer and
// its running number in the payload. It returns the ids committed, by
// table. progress counts committed transactions.
func mixedLoad(ctx context.Context, t *testing.T, e *env, producers, txns, tables int, progress *atomic.Int64) [][]string {
	var mu sync.Mutex
	ids := make([][]string, tables)
	var wg sync.WaitGroup
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(p), 7))
			n := 0
			for range txns {
				tx, err := e.pool.Begin(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				var mine [][2]any
				for range 1 + rng.IntN(4) {
					i := rng.IntN(tables)
					var id string
					if err := tx.QueryRow(ctx, "SELECT gen_random_uuid()::text").Scan(&id); err != nil {
						t.Error(err)
						return
					}
					if err := insertInto(ctx, tx, i, id, "ev", fmt.Sprintf(`{"p":%d,"n":%d}`, p, n)); err != nil {
						t.Error(err)
						return
					}
					n++
					mine = append(mine, [2]any{i, id})
				}
				if err := tx.Commit(ctx); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				for _, m := range mine {
					ids[m[0].(int)] = append(ids[m[0].(int)], m[1].(string))
				}
				mu.Unlock()
				progress.Add(1)
			}
		}()
	}
	wg.Wait()
	return ids
}

// svcMsg is one message of stream SVC.
type svcMsg struct {
	id, subject string
	p, n        int
	header      jetstream.RawStreamMsg
}

// readSVC reads every message of stream SVC in stream order.
func readSVC(t *testing.T, e *env) []svcMsg {
	t.Helper()
	ctx := relaytest.Ctx(t)
	st, info := e.stream(ctx, "SVC")
	var out []svcMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("read SVC seq %d: %v", seq, err)
		}
		var body struct{ P, N int }
		_ = json.Unmarshal(m.Data, &body)
		out = append(out, svcMsg{id: eventIDOf(m.Header), subject: m.Subject, p: body.P, n: body.N, header: *m})
	}
	return out
}

// waitSVC waits until stream SVC holds at least n messages.
func waitSVC(t *testing.T, e *env, n int) {
	t.Helper()
	ctx := relaytest.Ctx(t)
	relaytest.Eventually(t, 60*time.Second, fmt.Sprintf("%d events in SVC", n), func() bool {
		st, err := e.js.Stream(ctx, "SVC")
		if err != nil {
			return false
		}
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs >= uint64(n)
	})
}

// settleSVC waits for a positive sign that the relay is past everything
// committed so far: a table-less event emitted now (it takes the default
// table's subject template) arrives. A late duplicate of an earlier event
// would have been stored before it.
func settleSVC(t *testing.T, e *env, defaultSchema string) {
	t.Helper()
	ctx := relaytest.Ctx(t)
	var id string
	if err := e.pool.QueryRow(ctx, "SELECT walbox.emit_message('settle', '{}')::text").Scan(&id); err != nil {
		t.Fatal(err)
	}
	relaytest.Eventually(t, 60*time.Second, "the settle marker in SVC", func() bool {
		st, err := e.js.Stream(ctx, "SVC")
		if err != nil {
			return false
		}
		m, err := st.GetLastMsgForSubject(ctx, "svc."+defaultSchema+".settle")
		return err == nil && eventIDOf(m.Header) == id
	})
}

// checkMixed fails on a committed event missing from SVC, an event stored
// twice, an event under another table's subject, or a producer's events
// out of commit order (across tables: one stream holds them all).
func checkMixed(t *testing.T, msgs []svcMsg, committed [][]string, schemas []string) {
	t.Helper()
	seen := map[string]svcMsg{}
	dups := 0
	for _, m := range msgs {
		if _, ok := seen[m.id]; ok {
			dups++
		}
		seen[m.id] = m
	}
	lost, misrouted, total := 0, 0, 0
	for i, ids := range committed {
		for _, id := range ids {
			total++
			m, ok := seen[id]
			if !ok {
				lost++
				continue
			}
			if !strings.HasPrefix(m.subject, "svc."+schemas[i]+".") {
				misrouted++
			}
		}
	}
	// Order is judged on the events streamed from the WAL: events a slot
	// recreation republished from its snapshot (commit LSN 0/0) have no
	// WAL position, as README's guarantees say, and are counted apart.
	last := map[int]int{}
	outOfOrder, fromSnapshot := 0, 0
	for _, m := range msgs {
		if strings.HasSuffix(m.subject, ".settle") {
			continue
		}
		if m.header.Header.Get("Walbox-Commit-Lsn") == "0/0" {
			fromSnapshot++
			continue
		}
		if prev, ok := last[m.p]; ok && m.n <= prev {
			outOfOrder++
		}
		last[m.p] = m.n
	}
	t.Logf("%d committed events in %d tables; SVC holds %d messages: %d lost, %d duplicated, %d out of producer order, %d misrouted; %d republished from a snapshot",
		total, len(committed), len(msgs), lost, dups, outOfOrder, misrouted, fromSnapshot)
	if lost+dups+outOfOrder+misrouted > 0 || total == 0 {
		t.Fatalf("guarantees broken across outbox tables")
	}
}

// TestThreeOutboxTablesSurviveKill9 runs three outbox tables, each in its
// own schema with its own column names, on one slot: 8 producers write to
// all three in mixed transactions while the relay is killed with SIGKILL
// and restarted. Nothing is lost or duplicated, each producer's events keep
// commit order across tables, and each table's sweeper marks its own rows.
func TestThreeOutboxTablesSurviveKill9(t *testing.T) {
	e := multiEnv(t, 3)
	ctx := relaytest.Ctx(t)
	p := e.spawnRelay()
	// Kill mid-stream, not mid-way through the new slot's first backfill
	// (that case republishes from a snapshot; TestChaos covers it).
	slotEstablished(t, e)
	var progress atomic.Int64
	const producers, txns = 8, 120
	done := make(chan [][]string)
	go func() { done <- mixedLoad(ctx, t, e, producers, txns, 3, &progress) }()
	relaytest.Eventually(t, 60*time.Second, "a third of the load committed", func() bool { return progress.Load() >= producers*txns/3 })
	p.signal(t, syscall.SIGKILL)
	e.spawnRelay()
	committed := <-done

	// walbox.emit names its table, or writes to the default one (shipping).
	var emitted [3]string
	for i, st := range serviceTables {
		arg := fmt.Sprintf(", outbox => '%s.%s'", st.schema, st.table)
		if i == 1 {
			arg = ""
		}
		if err := e.pool.QueryRow(ctx, fmt.Sprintf(`SELECT walbox.emit('emitted', '{"p": 99, "n": %d}'%s)::text`, i, arg)).Scan(&emitted[i]); err != nil {
			t.Fatalf("walbox.emit into %s: %v", st.schema, err)
		}
		committed[i] = append(committed[i], emitted[i])
	}
	// So does walbox.emit_message: the table's routing and envelope apply.
	var msgID string
	if err := e.pool.QueryRow(ctx, `SELECT walbox.emit_message('emitted', '{"p": 99, "n": 3}', outbox => 'legacy.events_out')::text`).Scan(&msgID); err != nil {
		t.Fatalf("walbox.emit_message into legacy: %v", err)
	}
	committed[2] = append(committed[2], msgID)
	n := 0
	for _, c := range committed {
		n += len(c)
	}
	waitSVC(t, e, n)
	settleSVC(t, e, "shipping")
	msgs := readSVC(t, e)
	checkMixed(t, msgs, committed, []string{"billing", "shipping", "legacy"})

	// The legacy table's events are CloudEvents; the others are raw.
	for _, m := range msgs {
		ce := m.header.Header.Get("ce-specversion")
		if strings.HasPrefix(m.subject, "svc.legacy.") != (ce == "1.0") {
			t.Fatalf("message %s on %s: ce-specversion %q", m.id, m.subject, ce)
		}
	}
	// Each table's sweeper marks its own rows processed.
	for _, q := range []string{"SELECT count(*) FROM billing.outbox WHERE NOT processed",
		"SELECT count(*) FROM shipping.outbox_events WHERE NOT processed", "SELECT count(*) FROM legacy.events_out WHERE NOT processed"} {
		relaytest.Eventually(t, 60*time.Second, q+" = 0", func() bool {
			var left int
			return e.pool.QueryRow(ctx, q).Scan(&left) == nil && left == 0
		})
	}
}

// TestMigrateAddsATableWhileTheRelayRuns: a table added to outboxes and to
// the publication by walbox migrate, while the relay runs, is published
// without a restart, and the first table loses and repeats nothing
// meanwhile. Taking a table out of the config again is refused while it
// holds unprocessed rows, unless --force.
func TestMigrateAddsATableWhileTheRelayRuns(t *testing.T) {
	e := multiEnv(t, 1)
	ctx := relaytest.Ctx(t)
	p := e.spawnRelay()
	var progress atomic.Int64
	done := make(chan [][]string)
	go func() { done <- mixedLoad(ctx, t, e, 4, 150, 1, &progress) }()
	relaytest.Eventually(t, 60*time.Second, "some of the load committed", func() bool { return progress.Load() >= 100 })

	// Add shipping.outbox_events: to the config file, then walbox migrate
	// creates it and adds it to the publication.
	st := serviceTables[1]
	e.cfg.Outboxes = append(e.cfg.Outboxes, config.OutboxEntry{Outbox: config.Outbox{Table: st.schema + "." + st.table},
		SubjectTemplate: "svc.shipping.{topic}"})
	e.rewriteConfig()
	if out, err := e.cli("migrate"); err != nil {
		t.Fatalf("walbox migrate with the new table: %v\n%s", err, out)
	}
	var added []string
	for i := range 20 {
		var id string
		if err := e.pool.QueryRow(ctx, fmt.Sprintf(`SELECT walbox.emit('added', '{"p": 50, "n": %d}', outbox => 'shipping.outbox_events')::text`, i)).Scan(&id); err != nil {
			t.Fatal(err)
		}
		added = append(added, id)
	}
	first := <-done
	committed := [][]string{first[0], added}
	waitSVC(t, e, len(first[0])+len(added))
	if !p.running() {
		t.Fatal("the relay restarted or exited")
	}
	settleSVC(t, e, "billing")
	checkMixed(t, readSVC(t, e), committed, []string{"billing", "shipping"})
	if !strings.Contains(p.output(), "outbox table added to the configuration while running") {
		t.Errorf("the relay did not say it picked the table up:\n%s", p.output())
	}

	// Stop the relay, leave a row unprocessed in shipping, and take the
	// table out of the config: migrate refuses, then --force does it.
	p.signal(t, syscall.SIGTERM)
	if _, err := e.pool.Exec(ctx, "INSERT INTO shipping.outbox_events (topic, payload) VALUES ('late', '{}')"); err != nil {
		t.Fatal(err)
	}
	e.cfg.Outboxes = e.cfg.Outboxes[:1]
	e.rewriteConfig()
	out, err := e.cli("migrate")
	if err == nil || !strings.Contains(out, "shipping.outbox_events") || !strings.Contains(out, "--force") || !strings.Contains(out, "not marked processed") {
		t.Fatalf("migrate without the table, while it holds an unprocessed row: %v\n%s", err, out)
	}
	if out, err := e.cli("migrate", "--force"); err != nil || !strings.Contains(out, "took shipping.outbox_events out of publication") {
		t.Fatalf("migrate --force: %v\n%s", err, out)
	}
	var n int
	if err := e.pool.QueryRow(ctx, "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1", e.cfg.Postgres.Publication).Scan(&n); err != nil || n != 1 {
		t.Fatalf("publication covers %d tables (%v), want 1", n, err)
	}
}

// eventIDOf is a message's event id: Walbox-Event-Id where set (every table
// but the first publishes under a Nats-Msg-Id qualified with its name),
// else Nats-Msg-Id.
func eventIDOf(h nats.Header) string {
	if id := h.Get("Walbox-Event-Id"); id != "" {
		return id
	}
	return h.Get("Nats-Msg-Id")
}
