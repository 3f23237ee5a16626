package config

import (
	"strings"
	"testing"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
)

func TestOutboxesResolveEachTable(t *testing.T) {
	cfg, err := load(t, validYAML+`
  envelope: envelope
  routes: [{topic_prefix: "orders.", stream: ORDERS}]
sweeper:
  batch_size: 500
outboxes:
  - table: billing.outbox
    columns: {id: event_id, topic: subject, payload: body}
  - table: shipping.outbox_events
    default: true
    subject_template: "orders.ship.{topic}"
    envelope: cloudevents
    routes: [{topic_prefix: "x.", stream: ORDERS}]
    sweeper: {mark_processed: false, batch_size: 50}
  - table: legacy.outbox
    layout: debezium
`)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := cfg.Tables()
	if err != nil {
		t.Fatal(err)
	}
	if len(ts) != 3 {
		t.Fatalf("%d tables", len(ts))
	}
	billing, shipping, legacy := ts[0], ts[1], ts[2]
	if billing.Name != (cdc.TableName{Schema: "billing", Name: "outbox"}) || billing.Columns[cdc.RoleID] != "event_id" ||
		billing.Columns[cdc.RoleEventType] != "event_type" || billing.Default || billing.Key != "outboxes[0]" {
		t.Errorf("billing: %+v", billing)
	}
	// Unset keys take the global sections' values; set ones override them.
	if billing.Router.Envelope != relay.EnvelopeWalbox || billing.Router.SubjectTemplate != "" || len(billing.Router.Rules) != 1 ||
		billing.Router.Rules[0].TopicPrefix != "orders." || !billing.Sweeper.MarkProcessed || billing.Sweeper.BatchSize != 500 {
		t.Errorf("billing takes the global routing and sweeper: %+v %+v", billing.Router, billing.Sweeper)
	}
	if !shipping.Default || shipping.Router.Envelope != relay.EnvelopeCloudEvents || shipping.Router.SubjectTemplate != "orders.ship.{topic}" ||
		shipping.Router.Rules[0].TopicPrefix != "x." || shipping.Sweeper.MarkProcessed || shipping.Sweeper.BatchSize != 50 ||
		shipping.Sweeper.Interval != cfg.Sweeper.Interval {
		t.Errorf("shipping's own settings: %+v %+v", shipping.Router, shipping.Sweeper)
	}
	// The debezium preset: Debezium's columns and router defaults.
	want := cdc.Columns{}
	want[cdc.RoleID], want[cdc.RoleTopic], want[cdc.RoleAggregateType] = "id", "aggregatetype", "aggregatetype"
	want[cdc.RoleAggregateID], want[cdc.RoleEventType], want[cdc.RolePayload] = "aggregateid", "type", "payload"
	if legacy.Columns != want || legacy.Router.SubjectTemplate != DebeziumSubjectTemplate || legacy.Router.IDHeader != "id" ||
		legacy.Sweeper.MarkProcessed || legacy.Sweeper.Maintain {
		t.Errorf("debezium preset: %+v %+v %+v", legacy.Columns, legacy.Router, legacy.Sweeper)
	}
	if d, _ := cfg.OutboxTable(); d != shipping.Name {
		t.Errorf("default table %s, want %s", d, shipping.Name)
	}
}

func TestOutboxShorthandIsOneTable(t *testing.T) {
	cfg, err := load(t, validYAML+`
outbox:
  table: app.events
  layout: debezium
  columns: {payload: body}
`)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := cfg.Tables()
	if err != nil || len(ts) != 1 || !ts[0].Default || ts[0].Key != "outbox" || ts[0].Columns[cdc.RolePayload] != "body" ||
		ts[0].Columns[cdc.RoleID] != "id" {
		t.Fatalf("tables %+v, %v", ts, err)
	}
}

func TestOutboxesRefuseWhatIsAmbiguous(t *testing.T) {
	for _, c := range []struct{ name, yaml, want string }{
		{"outbox and outboxes", "outbox: {table: a.b}\noutboxes: [{table: c.d}]\n", "outbox: is the one-table shorthand of outboxes"},
		{"a table twice", "outboxes: [{table: a.b}, {table: a.b}]\n", "outboxes[1].table: a.b is listed twice (also outboxes[0])"},
		{"two defaults", "outboxes: [{table: a.b, default: true}, {table: c.d, default: true}]\n", "outboxes: 2 tables say default: true"},
		{"a bad layout", "outboxes: [{table: a.b, layout: kafka-connect}]\n", `outboxes[0].layout: "kafka-connect": use walbox or debezium`},
		{"a bad template", "outboxes: [{table: a.b, subject_template: \"{nope}\"}]\n", "outboxes[0].subject_template:"},
		{"an unknown stream", "outboxes: [{table: a.b, routes: [{topic_prefix: x., stream: NOPE}]}]\n", `outboxes[0].routes[0].stream: "NOPE" is not declared`},
		{"a bad sweeper key", "outboxes: [{table: a.b, sweeper: {batch_size: -3}}]\n", "outboxes[0].sweeper.batch_size"},
		{"a required role unmapped", "outboxes: [{table: a.b, columns: {topic: \"\"}}]\n", `outboxes[0].columns: column role "topic" must be mapped`},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := load(t, validYAML+c.yaml)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v\nwant it to contain %q", err, c.want)
			}
		})
	}
}
