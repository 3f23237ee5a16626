package cdc

import (
	"encoding/json"
	"fmt"
)

// MessagePrefix is the logical-message prefix of table-less events:
// walbox.emit_message(...) calls pg_logical_emit_message(true, 'walbox', body)
// inside the caller's transaction. Nothing is stored, so nothing is swept;
// the trade-off is that a lost slot cannot be backfilled for these events.
const MessagePrefix = "walbox"

// messageBody is the JSON walbox.emit_message writes.
type messageBody struct {
	ID            string          `json:"id"`
	Topic         *string         `json:"topic"`
	Payload       json.RawMessage `json:"payload"`
	EventType     string          `json:"event_type"`
	AggregateType string          `json:"aggregate_type"`
	AggregateID   string          `json:"aggregate_id"`
	PartitionKey  string          `json:"partition_key"`
	Headers       json.RawMessage `json:"headers"`
	CreatedAt     string          `json:"created_at"`
	// Table names the outbox table whose routing and envelope apply
	// (schema.table); absent or null: the default table.
	Table string `json:"table"`
}

// message decodes a table-less event. On error ev still carries what could be
// read, with a NULL topic, so the relay dead-letters it rather than stalls.
func (d *decoder) message(content []byte, ev *Event) error {
	*ev = Event{Pos: Position{CommitLSN: d.commitLSN, Index: d.index}, CommitTime: d.commitTime, TopicNull: true, PayloadIsJSON: true,
		Table: d.defaultTable, TableLess: true}
	d.index++
	var b messageBody
	if err := json.Unmarshal(content, &b); err != nil {
		ev.Payload = append([]byte(nil), content...)
		ev.PayloadIsJSON = false
		return fmt.Errorf("decode walbox message: %w", err)
	}
	ev.ID = b.ID
	if b.Topic != nil {
		ev.Topic, ev.TopicNull = *b.Topic, false
	}
	if len(b.Payload) == 0 || string(b.Payload) == "null" {
		ev.PayloadNull = true
	} else {
		ev.Payload = b.Payload
	}
	ev.EventType, ev.AggregateType, ev.AggregateID = b.EventType, b.AggregateType, b.AggregateID
	ev.PartitionKey = b.PartitionKey
	if len(b.Headers) > 0 && string(b.Headers) != "null" {
		ev.Headers = b.Headers
	}
	ev.CreatedAt = b.CreatedAt
	if b.Table != "" {
		name, err := ParseTableName(b.Table)
		i, ok := d.tableIndex(name)
		if err != nil || !ok {
			ev.Poison = fmt.Sprintf("names outbox table %q, which walbox is not configured for (add it to outboxes, or call emit_message without it)", b.Table)
			return nil
		}
		ev.Table = i
	}
	return nil
}
