package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/busops"
	"github.com/walbox/walbox/relay/kafkasink"
)

// The web console (internal/console) shows what these commands compute,
// through the functions of this file: it keeps no figures of its own.

// Overview is walbox status without the read-back of the streams' tails
// (the lost-history count): cheap enough to sample every few seconds.
func Overview(ctx context.Context, cfg config.Config) (*StatusReport, error) {
	return status(ctx, cfg, false)
}

// ConsoleDeadLetter is a dead letter as the console lists it: with where
// dlq retry would send it now (or why it cannot), its row's attempts and
// its payload.
type ConsoleDeadLetter struct {
	DeadLetter
	// RetrySubject is what a retry publishes it to; Destination the stream
	// (topic) that stores that now, "" when none does, and Why says why.
	RetrySubject string `json:"retry_subject"`
	Destination  string `json:"destination"`
	Why          string `json:"why,omitempty"`
	// Attempts is the outbox row's attempts column; -1 when unknown (no
	// such column, the row archived, a table-less event).
	Attempts int64               `json:"attempts"`
	Headers  map[string][]string `json:"headers"`
	Payload  string              `json:"payload"`
}

// DLQView is what the console's Dead letters page shows: up to limit dead
// letters (oldest first), how many wait, the bus's words and the
// dead-letter stream's (topic's) name.
func DLQView(ctx context.Context, cfg config.Config, limit int) ([]ConsoleDeadLetter, uint64, busops.Terms, string, error) {
	bus, err := openBus(ctx, cfg)
	if err != nil {
		return nil, 0, busops.Terms{}, "", err
	}
	defer bus.Close()
	dlq, err := bus.DeadLetters(ctx)
	if err != nil {
		return nil, 0, busops.Terms{}, "", err
	}
	dls, total, err := dlq.List(ctx, limit, true)
	if err != nil {
		return nil, 0, busops.Terms{}, "", err
	}
	r := &retry{cfg: cfg, bus: bus, dlq: dlq, terms: bus.Terms(), name: bus.DLQName(),
		routers: map[string]*relay.Router{}, stored: map[string]map[string]bool{}}
	rows := rowReader{cfg: cfg}
	defer rows.close(ctx)
	out := make([]ConsoleDeadLetter, 0, len(dls))
	for _, dl := range dls {
		c := ConsoleDeadLetter{DeadLetter: dl, Attempts: -1, Headers: dl.Header, Payload: string(dl.Data)}
		m, dest, why, err := r.message(ctx, dl, r.router(ctx, dl.Header.Get(relay.HeaderSource)))
		switch {
		case err != nil:
			c.Why = err.Error()
		case m != nil:
			c.RetrySubject, c.Destination, c.Why = m.Subject, dest, why
		default:
			c.Why = why
		}
		if row, err := rows.row(ctx, dl.Header.Get(relay.HeaderTable), dl.ID); err == nil && row != nil {
			if a, ok := row["attempts"].(float64); ok {
				c.Attempts = int64(a)
			}
		}
		out = append(out, c)
	}
	return out, total, r.terms, r.name, nil
}

// EventRow is the outbox row of event id in table ("" or unknown: the
// default table), as JSON; nil when the table holds no such row (archived,
// or a table-less event).
func EventRow(ctx context.Context, cfg config.Config, table, id string) (map[string]any, error) {
	rows := rowReader{cfg: cfg}
	defer rows.close(ctx)
	return rows.row(ctx, table, id)
}

// rowReader reads outbox rows by id on one connection, opened on first use.
type rowReader struct {
	cfg  config.Config
	conn *pgx.Conn
	err  error
}

func (r *rowReader) row(ctx context.Context, table, id string) (map[string]any, error) {
	if id == "" {
		return nil, nil
	}
	tables, err := r.cfg.Tables()
	if err != nil {
		return nil, err
	}
	var t *config.Table
	for i := range tables {
		if tables[i].Name.String() == table || (t == nil && tables[i].Default) {
			t = &tables[i]
		}
	}
	if t == nil {
		return nil, fmt.Errorf("no configured outbox table %q", table)
	}
	if r.conn == nil && r.err == nil {
		r.conn, r.err = connectPG(ctx, r.cfg)
	}
	if r.err != nil {
		return nil, r.err
	}
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var raw []byte
	// By the id column as it is (no cast): the primary key serves it.
	q := fmt.Sprintf(`SELECT to_jsonb(t) FROM %s t WHERE %s = $1 LIMIT 1`, t.Name.Quoted(), cdc.QuoteIdent(t.Columns[cdc.RoleID]))
	if err := r.conn.QueryRow(qctx, q, id).Scan(&raw); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, nil
		}
		return nil, fmt.Errorf("read the row of %s from %s: %w", id, t.Name, err)
	}
	var row map[string]any
	if err := json.Unmarshal(raw, &row); err != nil {
		return nil, fmt.Errorf("decode the row of %s: %w", id, err)
	}
	return row, nil
}

func (r *rowReader) close(ctx context.Context) {
	if r.conn != nil {
		closePG(ctx, r.conn)
	}
}

// StoredMessage is one message as its stream (topic) stores it.
type StoredMessage struct {
	Stream    string              `json:"stream"`
	Partition int32               `json:"partition"`
	Seq       uint64              `json:"seq"` // Kafka: offset + 1, as in acks
	Subject   string              `json:"subject"`
	Time      time.Time           `json:"time"`
	Headers   map[string][]string `json:"headers"`
	Payload   string              `json:"payload"`
}

// ReadStored reads the message stream (topic) stores at seq (Kafka: in
// partition, at offset seq - 1), as walbox tail would have shown it.
func ReadStored(ctx context.Context, cfg config.Config, stream string, partition int32, seq uint64) (*StoredMessage, error) {
	if seq == 0 {
		return nil, errors.New("no position: sequences start at 1")
	}
	if cfg.Sink == config.SinkKafka {
		return readStoredKafka(ctx, cfg, stream, partition, seq)
	}
	nc, js, err := connectNATS(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	m, err := st.GetMsg(ctx, seq)
	if err != nil {
		return nil, fmt.Errorf("read %s seq %d: %w", stream, seq, err)
	}
	return &StoredMessage{Stream: stream, Seq: seq, Subject: m.Subject, Time: m.Time, Headers: m.Header, Payload: string(m.Data)}, nil
}

func readStoredKafka(ctx context.Context, cfg config.Config, topic string, partition int32, seq uint64) (*StoredMessage, error) {
	cl, err := kafkaClient(cfg, kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: {partition: kgo.NewOffset().At(int64(seq - 1))}}))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		fs := cl.PollFetches(ctx)
		if err := kafkasink.FetchErr(fs, "read"); err != nil && ctx.Err() == nil {
			return nil, err
		}
		for it := fs.RecordIter(); !it.Done(); {
			r := it.Next()
			if r.Offset != int64(seq-1) {
				continue
			}
			h := kafkasink.FromKafkaHeaders(r.Headers)
			return &StoredMessage{Stream: topic, Partition: partition, Seq: seq, Subject: r.Topic, Time: r.Timestamp, Headers: h, Payload: string(r.Value)}, nil
		}
	}
	return nil, fmt.Errorf("read %s partition %d offset %d: not found within 10 s (deleted by retention, or in an aborted transaction)", topic, partition, seq-1)
}
