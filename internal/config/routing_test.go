package config

import (
	"reflect"
	"testing"

	"github.com/walbox/walbox/relay"
)

func TestRoutingAndEnvelopeValuesAreNamed(t *testing.T) {
	streams := "  streams:\n    - {name: ORDERS, subjects: [orders.>]}\n"
	base := "postgres:\n  url: postgres://x\nnats:\n"
	tests := []namedCase{
		{"unknown placeholder", base + "  subject_template: \"{topic}.{shard}\"\n" + streams, "nats.subject_template", []string{"{shard}"}},
		{"unclosed brace", base + "  subject_template: \"{topic\"\n" + streams, "nats.subject_template", nil},
		{"empty template", base + "  subject_template: \"\"\n" + streams, "nats.subject_template", nil},
		{"template with a wildcard", base + "  subject_template: \"{topic}.*\"\n" + streams, "nats.subject_template", nil},
		{"template with an empty token", base + "  subject_template: \"{topic}..{bucket}\"\n" + streams, "nats.subject_template", nil},
		{"buckets 0", base + "  partition_buckets: 0\n" + streams, "nats.partition_buckets", nil},
		{"buckets too many", base + "  partition_buckets: 70000\n" + streams, "nats.partition_buckets", nil},
		{"unknown envelope", base + "  envelope: avro\n" + streams, "nats.envelope", []string{"avro", "cloudevents-structured"}},
		{"route without prefix", base + streams + "  routes:\n    - {stream: ORDERS}\n", "nats.routes[0].topic_prefix", nil},
		{"route without stream", base + streams + "  routes:\n    - {topic_prefix: orders.}\n", "nats.routes[0].stream", nil},
		{"route to an undeclared stream", base + streams + "  routes:\n    - {topic_prefix: orders., stream: ORDERS}\n    - {topic_prefix: agent.run., stream: AGENT_RUN}\n",
			"nats.routes[1].stream", []string{"AGENT_RUN", "nats.streams"}},
		{"route to the DLQ stream", base + streams + "  routes:\n    - {topic_prefix: x., stream: WALBOX_DLQ}\n", "nats.routes[0].stream", []string{"dead-letter"}},
		{"prefix listed twice", base + streams + "  routes:\n    - {topic_prefix: o., stream: ORDERS}\n    - {topic_prefix: o., stream: ORDERS}\n",
			"nats.routes[1].topic_prefix", []string{"twice"}},
	}
	for i := range tests {
		tests[i].key += ":"
	}
	wantNamed(t, tests)
}

func TestRoutingAndEnvelopeEnvironment(t *testing.T) {
	cfg, err := load(t, validYAML, "WALBOX_NATS_SUBJECT_TEMPLATE={topic}.{bucket}", "WALBOX_NATS_PARTITION_BUCKETS=4",
		"WALBOX_NATS_ENVELOPE=cloudevents", "WALBOX_NATS_CLOUDEVENTS_SOURCE=urn:x")
	if err != nil {
		t.Fatal(err)
	}
	if n := cfg.NATS; n.SubjectTemplate != "{topic}.{bucket}" || n.PartitionBuckets != 4 || n.Envelope != "cloudevents" || n.CloudEventsSource != "urn:x" {
		t.Fatalf("nats = %+v", n)
	}
	if _, err := load(t, validYAML, "WALBOX_NATS_ENVELOPE=xml"); err == nil {
		t.Fatal("WALBOX_NATS_ENVELOPE=xml accepted")
	}
}

func TestRouterOptions(t *testing.T) {
	cfg, err := load(t, `
postgres:
  url: postgres://x
nats:
  subject_template: "{topic}.{partition}"
  partition_buckets: 32
  envelope: envelope
  cloudevents_source: urn:app
  streams:
    - {name: AGENT_RUN, subjects: [agent.run.>]}
    - {name: AGENT, subjects: [agent.tool.>]}
  routes:
    - {topic_prefix: agent.run., stream: AGENT_RUN}
`)
	if err != nil {
		t.Fatal(err)
	}
	want := relay.RouterOptions{SubjectTemplate: "{topic}.{partition}", PartitionBuckets: 32, Envelope: "envelope",
		CloudEventsSource: "urn:app", Rules: []relay.RoutingRule{{TopicPrefix: "agent.run.", Stream: "AGENT_RUN"}}}
	if got := cfg.RouterOptions(); !reflect.DeepEqual(got, want) {
		t.Fatalf("RouterOptions = %+v, want %+v", got, want)
	}
	if _, err := relay.NewRouterWithOptions("", "db/slot", nil, cfg.RouterOptions()); err != nil {
		t.Fatalf("a valid config gives options the router refuses: %v", err)
	}
	// Defaults give the router's defaults.
	d := Default()
	if o := d.RouterOptions(); o.SubjectTemplate != relay.DefaultSubjectTemplate || o.PartitionBuckets != relay.DefaultPartitionBuckets ||
		o.Envelope != relay.EnvelopeRaw || o.CloudEventsSource != "" || o.Rules != nil {
		t.Fatalf("default RouterOptions = %+v", o)
	}
}
