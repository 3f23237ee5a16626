package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/propagation"
)

// Event is one event to write. Topic and Payload are required; the rest is
// optional.
type Event struct {
	// ID is the event id, which becomes the message's Nats-Msg-Id (JetStream
	// drops a second message with the same id within the stream's duplicate
	// window) and the consumer's idempotency key. Empty: Write generates a
	// UUIDv7. Set it (e.g. with NewID) to know the id before Write, or to
	// make a retried business operation produce the same event.
	ID string
	// Topic is the NATS subject (walbox adds its nats.subject_prefix); a
	// stream in walbox's config must capture it.
	Topic string
	// Stream, if set, is the JetStream stream the event must land in; walbox
	// dead-letters it when the subject is captured by another stream.
	Stream string
	// EventType, AggregateType and AggregateID describe the event; walbox
	// puts them in the Walbox-Event-Type, Walbox-Aggregate-Type and
	// Walbox-Aggregate-Id headers.
	EventType     string
	AggregateType string
	AggregateID   string
	// PartitionKey orders events for consumers that partition
	// (Walbox-Partition-Key header). Empty: AggregateID.
	PartitionKey string
	// Payload is the message body. json.RawMessage and []byte are taken as
	// JSON text as they are (and must be valid JSON); any other value is
	// encoded with encoding/json (a Go string becomes a JSON string).
	Payload any
	// Headers become message headers, one per key (walbox never lets them
	// override its own). Keys must be printable ASCII without
	// `"()/,:;<=>?@[\]{}` and values must not hold line breaks. Write adds the
	// trace context of ctx (traceparent, tracestate) unless set here.
	Headers map[string]string
}

// Execer is what Write needs of the caller's transaction. pgx.Tx has it (so
// do *pgx.Conn, *pgxpool.Conn and *pgxpool.Pool, but then each statement
// commits on its own). For database/sql wrap the *sql.Tx with FromSQL.
// When the value also has pgx's CopyFrom method (pgx.Tx does), Write sends
// more than one event with COPY.
type Execer interface {
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Querier is what Lag needs: a pgx pool, connection or transaction, or
// FromSQL of a *sql.DB, *sql.Conn or *sql.Tx.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

type copier interface {
	CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error)
}

// insertChunk bounds the rows of one multi-row INSERT (9 columns: far below
// PostgreSQL's 65535 parameters).
const insertChunk = 1000

// Writer writes events with fixed options. It is safe for concurrent use.
type Writer struct {
	opts    options
	cols    []string // mapped column names, in role order
	roles   []role   // their roles
	colList string   // quoted, comma-separated
}

// New returns a Writer with the given options (see WithTable, WithColumns,
// WithMaxLag, WithSlot, WithPropagator).
func New(opts ...Option) (*Writer, error) {
	o, err := buildOptions(opts)
	if err != nil {
		return nil, err
	}
	w := &Writer{opts: o}
	quoted := make([]string, 0, numRoles)
	for r := range numRoles {
		if c := o.columns[r]; c != "" {
			w.cols = append(w.cols, c)
			w.roles = append(w.roles, r)
			quoted = append(quoted, pgx.Identifier{c}.Sanitize())
		}
	}
	w.colList = strings.Join(quoted, ", ")
	return w, nil
}

// Write writes events into the outbox table with the default options (see
// New): inside tx, so they are published if and only if tx commits.
func Write(ctx context.Context, tx Execer, events ...Event) error {
	w, err := New()
	if err != nil {
		return err
	}
	return w.Write(ctx, tx, events...)
}

// Write writes events into the outbox table inside tx: one with INSERT,
// several with COPY when tx supports it (pgx), else with multi-row INSERTs.
// Nothing is written when an event is invalid or, with WithMaxLag, when the
// relay is too far behind (an error matching ErrBackpressure). The events
// passed in are not modified; set Event.ID beforehand (NewID) to learn the
// ids.
func (w *Writer) Write(ctx context.Context, tx Execer, events ...Event) error {
	if len(events) == 0 {
		return nil
	}
	if tx == nil {
		return errors.New("outbox: write: nil transaction")
	}
	trace := w.traceHeaders(ctx)
	rows := make([][]any, len(events))
	for i := range events {
		row, err := w.row(&events[i], trace)
		if err != nil {
			return fmt.Errorf("outbox: event %d of %d (topic %q): %w", i+1, len(events), events[i].Topic, err)
		}
		rows[i] = row
	}
	if w.opts.maxLag > 0 {
		if err := w.checkLag(ctx, tx); err != nil {
			return err
		}
	}
	if c, ok := tx.(copier); ok && len(rows) > 1 {
		n, err := c.CopyFrom(ctx, w.opts.table, w.cols, pgx.CopyFromRows(rows))
		if err != nil {
			return fmt.Errorf("outbox: copy %d events into %s: %w", len(rows), w.opts.tableName, err)
		}
		if n != int64(len(rows)) {
			return fmt.Errorf("outbox: copy into %s: %d of %d events written", w.opts.tableName, n, len(rows))
		}
		return nil
	}
	for start := 0; start < len(rows); start += insertChunk {
		chunk := rows[start:min(start+insertChunk, len(rows))]
		query, args := w.insert(chunk)
		if _, err := tx.Exec(ctx, query, args...); err != nil {
			if len(rows) == 1 {
				return fmt.Errorf("outbox: insert event into %s: %w", w.opts.tableName, err)
			}
			return fmt.Errorf("outbox: insert events %d-%d of %d into %s: %w", start+1, start+len(chunk), len(rows), w.opts.tableName, err)
		}
	}
	return nil
}

// insert builds one multi-row INSERT for rows.
func (w *Writer) insert(rows [][]any) (string, []any) {
	var b strings.Builder
	b.WriteString("INSERT INTO ")
	b.WriteString(w.opts.table.Sanitize())
	b.WriteString(" (")
	b.WriteString(w.colList)
	b.WriteString(") VALUES ")
	args := make([]any, 0, len(rows)*len(w.cols))
	for i, row := range rows {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteByte('(')
		for j, v := range row {
			if j > 0 {
				b.WriteString(", ")
			}
			args = append(args, v)
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(len(args)))
		}
		b.WriteByte(')')
	}
	return b.String(), args
}

// row validates ev and returns its column values in w.cols order. Optional
// strings that are empty are written as NULL.
func (w *Writer) row(ev *Event, trace map[string]string) ([]any, error) {
	if strings.TrimSpace(ev.Topic) == "" {
		return nil, errors.New("topic is empty")
	}
	payload, err := encodePayload(ev.Payload)
	if err != nil {
		return nil, err
	}
	headers, err := encodeHeaders(ev.Headers, trace)
	if err != nil {
		return nil, err
	}
	id := ev.ID
	if id == "" {
		id = NewID()
	}
	pk := ev.PartitionKey
	if pk == "" {
		pk = ev.AggregateID
	}
	// A field the caller set explicitly must have a column to go to.
	explicit := [numRoles]bool{
		roleStream:        ev.Stream != "",
		roleEventType:     ev.EventType != "",
		roleAggregateType: ev.AggregateType != "",
		roleAggregateID:   ev.AggregateID != "",
		rolePartitionKey:  ev.PartitionKey != "",
		roleHeaders:       len(ev.Headers) > 0,
	}
	for r, set := range explicit {
		if set && w.opts.columns[r] == "" {
			return nil, fmt.Errorf("%s is set but WithColumns left that role out", role(r))
		}
	}
	row := make([]any, len(w.roles))
	for i, r := range w.roles {
		switch r {
		case roleID:
			row[i] = id
		case roleTopic:
			row[i] = ev.Topic
		case rolePayload:
			row[i] = payload
		case roleStream:
			row[i] = nullable(ev.Stream)
		case roleEventType:
			row[i] = nullable(ev.EventType)
		case roleAggregateType:
			row[i] = nullable(ev.AggregateType)
		case roleAggregateID:
			row[i] = nullable(ev.AggregateID)
		case rolePartitionKey:
			row[i] = nullable(pk)
		case roleHeaders:
			row[i] = headers
		}
	}
	return row, nil
}

func nullable(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// NewID returns a new UUIDv7 as text: 48 bits of Unix milliseconds, then
// random bits, so ids sort (roughly) by creation time and index well.
func NewID() string {
	return uuid.Must(uuid.NewV7()).String()
}

// encodePayload returns the payload as JSON text. Text (not []byte) is what
// both pgx and database/sql drivers send unchanged to json, jsonb and text
// columns alike.
func encodePayload(p any) (string, error) {
	var raw []byte
	switch v := p.(type) {
	case nil:
		return "", errors.New("payload is nil (use json.RawMessage(`{}`) for an empty one)")
	case json.RawMessage:
		raw = v
	case []byte:
		raw = v
	default:
		b, err := json.Marshal(v)
		if err != nil {
			return "", fmt.Errorf("encode payload as JSON: %w", err)
		}
		return string(b), nil
	}
	if len(raw) == 0 {
		return "", errors.New("payload is empty (use json.RawMessage(`{}`) for an empty object)")
	}
	if !json.Valid(raw) {
		return "", errors.New("payload is not valid JSON")
	}
	return string(raw), nil
}

// encodeHeaders returns the headers column: the caller's headers plus the
// trace headers the caller did not set, as a JSON object, or nil (NULL).
func encodeHeaders(h, trace map[string]string) (any, error) {
	if len(h) == 0 && len(trace) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(h)+len(trace))
	for k, v := range h {
		if err := checkHeader(k, v); err != nil {
			return nil, err
		}
		out[k] = v
	}
	for k, v := range trace {
		if hasKeyFold(h, k) || checkHeader(k, v) != nil {
			continue
		}
		out[k] = v
	}
	b, err := json.Marshal(out)
	if err != nil {
		return nil, fmt.Errorf("encode headers: %w", err)
	}
	return string(b), nil
}

// checkHeader refuses what NATS would refuse or walbox would drop.
func checkHeader(k, v string) error {
	if k == "" {
		return errors.New("header with an empty name")
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c < 33 || c > 126 || strings.IndexByte(`"()/,:;<=>?@[\]{}`, c) >= 0 {
			return fmt.Errorf("header name %q: NATS allows only printable ASCII without spaces or %s", k, `"()/,:;<=>?@[\]{}`)
		}
	}
	if strings.EqualFold(k, "Nats-Msg-Id") {
		return errors.New("header Nats-Msg-Id: the event id is the message id; set Event.ID instead")
	}
	if strings.ContainsAny(v, "\r\n") {
		return fmt.Errorf("header %q: value holds a line break", k)
	}
	return nil
}

func hasKeyFold(m map[string]string, key string) bool {
	if _, ok := m[key]; ok {
		return true
	}
	for k := range m {
		if strings.EqualFold(k, key) {
			return true
		}
	}
	return false
}

// traceHeaders returns the trace context of ctx as headers (empty when ctx
// carries no span).
func (w *Writer) traceHeaders(ctx context.Context) map[string]string {
	c := propagation.MapCarrier{}
	w.opts.propagator.Inject(ctx, c)
	return c
}
