package config

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
)

// Layouts of an outbox table: walbox's own (the default) and the table of
// Debezium's outbox event router.
const (
	LayoutWalbox   = "walbox"
	LayoutDebezium = "debezium"
)

// DebeziumSubjectTemplate is where Debezium's outbox event router sends an
// event by default (route.topic.replacement outbox.event.${routedByValue},
// routed by aggregatetype, which the debezium layout maps to the topic).
const DebeziumSubjectTemplate = "outbox.event.{topic}"

// DebeziumIDHeader is the header in which Debezium's router puts the event
// id (table.field.event.id); walbox sets it beside Nats-Msg-Id.
const DebeziumIDHeader = "id"

// debeziumColumns is Debezium's outbox table: id, aggregatetype,
// aggregateid, type, payload. aggregatetype routes (the topic role) and is
// the aggregate type; aggregateid is the key.
var debeziumColumns = map[string]string{"id": "id", "topic": "aggregatetype", "aggregate_type": "aggregatetype",
	"aggregate_id": "aggregateid", "event_type": "type", "payload": "payload"}

// TableSweeper overrides, for one table of outboxes, the sweeper keys;
// unset keys keep the sweeper section's values.
type TableSweeper struct {
	MarkProcessed   *bool         `yaml:"mark_processed"`
	BatchSize       int           `yaml:"batch_size"`
	Interval        time.Duration `yaml:"interval"`
	PartitionStep   string        `yaml:"partition_step"`
	PartitionsAhead int           `yaml:"partitions_ahead"`
	Maintain        *bool         `yaml:"maintain"`
}

// Table is one outbox table as walbox runs it: outbox, or one entry of
// outboxes, with every default and preset resolved.
type Table struct {
	Name    cdc.TableName
	Columns cdc.Columns
	Layout  string
	// Default: walbox.emit and walbox.emit_message write here when they
	// name no table.
	Default bool
	// Router is the routing and envelope of this table's events (the
	// subject template empty unless the table sets one: the sink's then).
	Router  relay.RouterOptions
	Sweeper Sweeper
	// Key is the config key the table came from (outbox, outboxes[1]).
	Key string
}

// RouterOptions are the table's routing and envelope for a sink whose own
// subject (topic) template is template: the table's template wins when set.
func (t Table) RouterOptions(template string) relay.RouterOptions {
	o := t.Router
	if o.SubjectTemplate == "" {
		o.SubjectTemplate = template
	}
	o.Table = t.Name.String()
	return o
}

// SinkTemplate is the subject template of the configured sink:
// nats.subject_template, or kafka.topic_template.
func (c *Config) SinkTemplate() string {
	if c.Sink == SinkKafka {
		return c.Kafka.TopicTemplate
	}
	return c.NATS.SubjectTemplate
}

// TableNamed is the configured outbox table called name (schema.table;
// public when no schema), or the default table when name is "".
func (c *Config) TableNamed(name string) (Table, error) {
	if name == "" {
		return c.DefaultTable()
	}
	want, err := cdc.ParseTableName(name)
	if err != nil {
		return Table{}, err
	}
	ts, err := c.Tables()
	if err != nil {
		return Table{}, err
	}
	for _, t := range ts {
		if t.Name == want {
			return t, nil
		}
	}
	return Table{}, fmt.Errorf("%s is not a configured outbox table (outbox.table, outboxes[].table)", want)
}

// entries is the outbox tables as written: outboxes, or outbox alone.
func (c *Config) entries() ([]OutboxEntry, []string) {
	if len(c.Outboxes) == 0 {
		return []OutboxEntry{{Outbox: c.Outbox}}, []string{"outbox"}
	}
	keys := make([]string, len(c.Outboxes))
	for i := range c.Outboxes {
		keys[i] = fmt.Sprintf("outboxes[%d]", i)
	}
	return c.Outboxes, keys
}

// Tables resolves the outbox tables: outboxes, or the one of outbox. The
// first error names its key.
func (c *Config) Tables() ([]Table, error) {
	entries, keys := c.entries()
	out := make([]Table, 0, len(entries))
	for i, o := range entries {
		t, err := c.resolveTable(o, keys[i])
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	if !slices.ContainsFunc(out, func(t Table) bool { return t.Default }) {
		out[0].Default = true
	}
	return out, nil
}

// DefaultTable is the table walbox.emit writes to when it names none: the
// one marked default, else the first.
func (c *Config) DefaultTable() (Table, error) {
	ts, err := c.Tables()
	if err != nil {
		return Table{}, err
	}
	for _, t := range ts {
		if t.Default {
			return t, nil
		}
	}
	return ts[0], nil
}

func (c *Config) resolveTable(o OutboxEntry, key string) (Table, error) {
	name, err := cdc.ParseTableName(o.Table)
	if err != nil {
		return Table{}, &Error{Key: key + ".table", Msg: err.Error()}
	}
	t := Table{Name: name, Layout: o.Layout, Default: o.Default, Key: key, Router: c.RouterOptions(), Sweeper: c.Sweeper}
	t.Router.SubjectTemplate = "" // the sink's template, unless this table sets one
	if t.Layout == "" {
		t.Layout = LayoutWalbox
	}
	switch t.Layout {
	case LayoutWalbox:
		if t.Columns, err = cdc.ColumnsFromMap(o.Columns, true); err != nil {
			return Table{}, &Error{Key: key + ".columns", Msg: err.Error()}
		}
	case LayoutDebezium:
		m := maps.Clone(debeziumColumns)
		maps.Copy(m, o.Columns)
		if t.Columns, err = cdc.ColumnsFromMap(m, false); err != nil {
			return Table{}, &Error{Key: key + ".columns", Msg: err.Error()}
		}
		t.Router.SubjectTemplate = DebeziumSubjectTemplate
		t.Router.IDHeader = DebeziumIDHeader
		// Debezium's table has no processed flag and is not partitioned
		// by walbox: its rows are deleted by the producer or a job.
		t.Sweeper.MarkProcessed, t.Sweeper.Maintain = false, false
	default:
		return Table{}, &Error{Key: key + ".layout", Msg: fmt.Sprintf("%q: use %s or %s", o.Layout, LayoutWalbox, LayoutDebezium)}
	}
	if o.SubjectTemplate != "" {
		t.Router.SubjectTemplate = o.SubjectTemplate
	}
	if o.Envelope != "" {
		t.Router.Envelope = o.Envelope
	}
	if len(o.Routes) > 0 {
		t.Router.Rules = nil
		for _, r := range o.Routes {
			t.Router.Rules = append(t.Router.Rules, relay.RoutingRule{TopicPrefix: r.TopicPrefix, Stream: r.Stream})
		}
	}
	if s := o.Sweeper; s != nil {
		if s.MarkProcessed != nil {
			t.Sweeper.MarkProcessed = *s.MarkProcessed
		}
		if s.Maintain != nil {
			t.Sweeper.Maintain = *s.Maintain
		}
		if s.BatchSize != 0 {
			t.Sweeper.BatchSize = s.BatchSize
		}
		if s.Interval != 0 {
			t.Sweeper.Interval = s.Interval
		}
		if s.PartitionStep != "" {
			t.Sweeper.PartitionStep = s.PartitionStep
		}
		if s.PartitionsAhead != 0 {
			t.Sweeper.PartitionsAhead = s.PartitionsAhead
		}
	}
	return t, nil
}

// validateOutboxes checks outbox or outboxes: each table, its layout,
// columns, routing and sweeper overrides, and that names and the default
// are unambiguous. streams holds the declared stream names.
func (c *Config) validateOutboxes(bad func(key, format string, args ...any), streams map[string]bool) {
	if len(c.Outboxes) > 0 && (c.Outbox.Table != Default().Outbox.Table || len(c.Outbox.Columns) > 0 || c.Outbox.Layout != LayoutWalbox) {
		bad("outbox", "is the one-table shorthand of outboxes: list that table in outboxes too, and remove outbox")
	}
	entries, keys := c.entries()
	seen := map[cdc.TableName]string{}
	defaults := 0
	for i, o := range entries {
		key := keys[i]
		t, err := c.resolveTable(o, key)
		if err != nil {
			if ce, ok := err.(*Error); ok {
				bad(ce.Key, "%s", ce.Msg)
			} else {
				bad(key, "%v", err)
			}
			continue
		}
		if prev, ok := seen[t.Name]; ok {
			bad(key+".table", "%s is listed twice (also %s)", t.Name, prev)
		}
		seen[t.Name] = key
		if o.Default {
			defaults++
		}
		if o.SubjectTemplate != "" {
			if err := relay.ValidateSubjectTemplate(o.SubjectTemplate); err != nil {
				bad(key+".subject_template", "%v", err)
			}
		}
		if o.Envelope != "" && !slices.Contains(relay.Envelopes, o.Envelope) {
			bad(key+".envelope", "%q: use %s", o.Envelope, strings.Join(relay.Envelopes, ", "))
		}
		for j, r := range o.Routes {
			rk := fmt.Sprintf("%s.routes[%d]", key, j)
			if r.TopicPrefix == "" {
				bad(rk+".topic_prefix", "is required, e.g. \"billing.\"")
			}
			if c.Sink == SinkNATS && !streams[r.Stream] {
				bad(rk+".stream", "%q is not declared in nats.streams", r.Stream)
			}
		}
		if s := o.Sweeper; s != nil {
			sub := Config{Sweeper: t.Sweeper, Archive: c.Archive}
			sub.validateSweeper(func(k, format string, args ...any) {
				if strings.HasPrefix(k, "sweeper.") {
					bad(key+"."+k, format, args...)
				}
			})
		}
	}
	if defaults > 1 {
		bad("outboxes", "%d tables say default: true; mark one (walbox.emit writes there when it names no table)", defaults)
	}
}
