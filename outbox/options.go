package outbox

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
)

// Defaults of the options.
const (
	// DefaultTable is the outbox table `walbox migrate` creates.
	DefaultTable = "public.outbox_events"
	// DefaultSlot is the replication slot whose walbox.relay_status row Lag
	// and WithMaxLag read (walbox's postgres.slot default).
	DefaultSlot = "walbox"
)

// Option configures a Writer (New) or Lag, in the style of nats.go's
// jetstream options. Options that do not apply to a call are ignored (Lag
// uses only WithSlot).
type Option func(*options) error

type options struct {
	table      pgx.Identifier
	tableName  string // as given, for messages
	columns    [numRoles]string
	maxLag     time.Duration
	slot       string
	propagator propagation.TextMapPropagator
}

func defaultOptions() options {
	o := options{
		table:      pgx.Identifier{"public", "outbox_events"},
		tableName:  DefaultTable,
		slot:       DefaultSlot,
		propagator: propagation.TraceContext{},
	}
	for r := range numRoles {
		o.columns[r] = r.String()
	}
	return o
}

func buildOptions(opts []Option) (options, error) {
	o := defaultOptions()
	for _, opt := range opts {
		if opt == nil {
			continue
		}
		if err := opt(&o); err != nil {
			return o, fmt.Errorf("outbox: %w", err)
		}
	}
	return o, nil
}

// WithTable sets the outbox table: "schema.table" or "table" (found through
// the search_path); either part may be double-quoted. The default is
// public.outbox_events. It must match walbox's outbox.table.
func WithTable(name string) Option {
	return func(o *options) error {
		id, err := parseTableName(name)
		if err != nil {
			return fmt.Errorf("WithTable(%q): %w", name, err)
		}
		o.table, o.tableName = id, name
		return nil
	}
}

// WithColumns maps roles to column names for an existing table with another
// layout, like walbox's outbox.columns: keys are roles (id, topic, payload,
// stream, event_type, aggregate_type, aggregate_id, partition_key, headers),
// values column names; "" leaves a role out (it is then not written). Roles
// not named keep a column of their own name. id, topic and payload are
// required. Write refuses an event that sets a field whose role is left out,
// except the derived ones (the default partition key, trace headers), which
// are dropped.
func WithColumns(roles map[string]string) Option {
	return func(o *options) error {
		for name, col := range roles {
			r, ok := parseRole(name)
			if !ok {
				return fmt.Errorf("WithColumns: unknown role %q (roles: %s)", name, roleList())
			}
			if col == "" && (r == roleID || r == roleTopic || r == rolePayload) {
				return fmt.Errorf("WithColumns: role %q is required and cannot be left out", name)
			}
			o.columns[r] = col
		}
		return nil
	}
}

// WithMaxLag turns on producer back-pressure: Write first reads the relay's
// lag (see Lag) and returns an error matching ErrBackpressure, writing
// nothing, when it exceeds d. The transaction stays usable: the caller may
// roll back and retry later, or commit its other changes. 0 turns it off
// (the default). While walbox.relay_status has no row for the slot (the
// relay has not reported yet) Write does not hold back. It costs one indexed
// read of walbox.relay_status per Write, in the caller's transaction, so the
// producer's role needs USAGE on schema walbox and SELECT on
// walbox.relay_status.
func WithMaxLag(d time.Duration) Option {
	return func(o *options) error {
		if d < 0 {
			return fmt.Errorf("WithMaxLag(%v): must not be negative", d)
		}
		o.maxLag = d
		return nil
	}
}

// WithSlot names the replication slot whose walbox.relay_status row Lag and
// WithMaxLag read (walbox's postgres.slot; default "walbox").
func WithSlot(slot string) Option {
	return func(o *options) error {
		if slot == "" {
			return errors.New("WithSlot: empty slot name")
		}
		o.slot = slot
		return nil
	}
}

// WithPropagator sets how the trace context of ctx is written into the
// headers column. The default is propagation.TraceContext{} (traceparent,
// tracestate); pass e.g. propagation.NewCompositeTextMapPropagator(
// propagation.TraceContext{}, propagation.Baggage{}) to carry baggage too.
func WithPropagator(p propagation.TextMapPropagator) Option {
	return func(o *options) error {
		if p == nil {
			return errors.New("WithPropagator: nil propagator")
		}
		o.propagator = p
		return nil
	}
}

// role is what a column means to walbox; column names map to roles.
type role int

const (
	roleID role = iota
	roleTopic
	rolePayload
	roleStream
	roleEventType
	roleAggregateType
	roleAggregateID
	rolePartitionKey
	roleHeaders
	numRoles
)

func (r role) String() string {
	switch r {
	case roleID:
		return "id"
	case roleTopic:
		return "topic"
	case rolePayload:
		return "payload"
	case roleStream:
		return "stream"
	case roleEventType:
		return "event_type"
	case roleAggregateType:
		return "aggregate_type"
	case roleAggregateID:
		return "aggregate_id"
	case rolePartitionKey:
		return "partition_key"
	case roleHeaders:
		return "headers"
	}
	return fmt.Sprintf("role(%d)", int(r))
}

func parseRole(s string) (role, bool) {
	for r := range numRoles {
		if r.String() == s {
			return r, true
		}
	}
	return 0, false
}

func roleList() string {
	names := make([]string, 0, numRoles)
	for r := range numRoles {
		names = append(names, r.String())
	}
	return strings.Join(names, ", ")
}

// parseTableName splits "schema.table" or "table"; each part may be
// double-quoted (then it may hold dots, and "" stands for one quote).
func parseTableName(s string) (pgx.Identifier, error) {
	var parts []string
	for rest := strings.TrimSpace(s); ; {
		var part string
		if strings.HasPrefix(rest, `"`) {
			var b strings.Builder
			i := 1
			for {
				j := strings.IndexByte(rest[i:], '"')
				if j < 0 {
					return nil, errors.New("unterminated quoted identifier")
				}
				b.WriteString(rest[i : i+j])
				i += j + 1
				if i < len(rest) && rest[i] == '"' {
					b.WriteByte('"')
					i++
					continue
				}
				break
			}
			part, rest = b.String(), rest[i:]
		} else {
			j := strings.IndexByte(rest, '.')
			if j < 0 {
				j = len(rest)
			}
			part, rest = rest[:j], rest[j:]
			if strings.ContainsAny(part, "\" \t") {
				return nil, errors.New("unquoted identifiers may not hold quotes or spaces")
			}
		}
		if part == "" {
			return nil, errors.New("empty identifier")
		}
		parts = append(parts, part)
		if rest == "" {
			break
		}
		if rest[0] != '.' {
			return nil, fmt.Errorf("unexpected %q after identifier", rest)
		}
		rest = rest[1:]
	}
	if len(parts) > 2 {
		return nil, errors.New("want table or schema.table")
	}
	return pgx.Identifier(parts), nil
}
