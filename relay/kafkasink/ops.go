package kafkasink

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/busops"
)

// OpsConfig is what the operations commands' bus (OpenOps) needs of the
// configuration.
type OpsConfig struct {
	// Topics are the configured topics, the dead-letter topic last
	// (kafka.topics, then kafka.dlq_topic).
	Topics []TopicSpec
	// Router has the topic template.
	Router relay.RouterOptions
	// Claim, when set, wraps the sink the commands publish through (the
	// claim check, relay/claim) and returns the size above which it moves
	// a payload, for the router's size check.
	Claim func(relay.Sink) (relay.Sink, int)
}

// Ops is Kafka as walbox's operations commands see it: a busops.Bus over
// the relay's own Sink, an admin client, and consumers of their own that
// read committed records only.
type Ops struct {
	busops.Names
	sc     Config
	cfg    OpsConfig
	cl     *kgo.Client // admin requests
	adm    *kadm.Client
	sink   *Sink
	routes []relay.Route // Destination's, read once
	// pub is what Publish goes through: sink, or the claim check around it.
	pub        relay.Sink
	claimAbove int
}

// OpenOps opens the clients; it does not contact the brokers yet.
func OpenOps(sc Config, cfg OpsConfig) (*Ops, error) {
	cl, err := NewClient(sc)
	if err != nil {
		return nil, err
	}
	sink, err := New(sc)
	if err != nil {
		cl.Close()
		return nil, err
	}
	names := make([]string, len(cfg.Topics))
	for i, t := range cfg.Topics {
		names[i] = t.Name
	}
	o := &Ops{Names: busops.NamesOf(names), sc: sc, cfg: cfg, cl: cl, adm: kadm.NewClient(cl), sink: sink, pub: sink}
	if cfg.Claim != nil {
		o.pub, o.claimAbove = cfg.Claim(sink)
	}
	return o, nil
}

var _ busops.Bus = (*Ops)(nil)

// Terms implements busops.Bus.
func (o *Ops) Terms() busops.Terms {
	return busops.Terms{Stream: "topic", Subject: "topic", Partitioned: true,
		NoCheck: "--no-check skips that, but Kafka keeps every duplicate",
		Remove:  "mark them retried in", Removed: "marked retried in"}
}

// StoredTail implements busops.Bus.
func (o *Ops) StoredTail(ctx context.Context, stream, source string, n int) (relay.StoredTail, error) {
	return o.sink.StoredTail(ctx, stream, source, n)
}

// Close implements busops.Bus.
func (o *Ops) Close() { o.sink.Close(); o.cl.Close() }

func (o *Ops) brokers() string { return strings.Join(o.sc.Brokers, ", ") }

// Routes implements busops.Bus: the configured topics (not the dead-letter
// topic) that exist on the brokers, each its own route.
func (o *Ops) Routes(ctx context.Context) ([]relay.Route, error) {
	names := o.Events
	details, err := o.adm.ListTopics(ctx, names...)
	if err != nil {
		return nil, fmt.Errorf("list the topics on %s: %w", o.brokers(), err)
	}
	var out []relay.Route
	for _, n := range names {
		d, ok := details[n]
		if !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition) {
			continue
		}
		if d.Err != nil {
			return nil, fmt.Errorf("topic %s: %w", n, d.Err)
		}
		out = append(out, relay.Route{Stream: n, Subjects: []string{n}})
	}
	return out, nil
}

// Router implements busops.Bus: no prefix, the topic template.
func (o *Ops) Router(source string, routes []relay.Route) (*relay.Router, error) {
	rt, err := relay.NewRouterWithOptions("", source, routes, o.cfg.Router)
	if err != nil {
		return nil, err
	}
	rt.SetMaxPayload(o.sc.MaxPayload)
	rt.SetClaimThreshold(o.claimAbove)
	return rt, nil
}

// Destination implements busops.Bus: the topic itself, when it is
// configured and exists.
func (o *Ops) Destination(ctx context.Context, topic string) (string, string, error) {
	if o.routes == nil {
		routes, err := o.Routes(ctx)
		if err != nil {
			return "", "", err
		}
		o.routes = append(routes, relay.Route{}) // read: not nil
	}
	if slices.ContainsFunc(o.routes, func(r relay.Route) bool { return r.Stream == topic }) {
		return topic, "", nil
	}
	return "", fmt.Sprintf("topic %s is not in kafka.topics, or does not exist on the brokers (add it to kafka.topics and restart walbox, which creates it)", topic), nil
}

// DeadLetter implements busops.Bus: every dead letter goes to the
// dead-letter topic.
func (o *Ops) DeadLetter(rt *relay.Router, ev *cdc.Event, reason string) *relay.Msg {
	m := rt.DeadLetter(ev, "", reason)
	m.Subject = o.DLQ
	return m
}

// Publish implements busops.Bus (the topic is m.Subject).
func (o *Ops) Publish(m *relay.Msg, _ string) (relay.Future, error) { return o.pub.Publish(m) }

// ReadBack implements busops.Bus.
func (o *Ops) ReadBack(ctx context.Context, dest, source string, rr relay.ReadBackRange, fn func(relay.StoredEvent) bool) error {
	return o.sink.ReadBack(ctx, dest, source, rr, fn)
}

// Scan implements busops.Bus: a topic's subject is its name.
func (o *Ops) Scan(ctx context.Context, topic, filter string, since time.Time, fn func(relay.Header) error) error {
	if filter != "" && !relay.SubjectMatches(filter, topic) {
		return nil
	}
	spans, _, err := o.topicSpans(ctx, topic, since)
	if err != nil {
		return err
	}
	return o.read(ctx, topic, spans, func(r *kgo.Record) error { return fn(FromKafkaHeaders(r.Headers)) })
}

// topicSpans lists, per partition of topic, the offsets from the first
// one at or after since (zero: the start) to the end. exists is false
// when the topic does not exist.
func (o *Ops) topicSpans(ctx context.Context, topic string, since time.Time) (map[int32]span, bool, error) {
	// Committed ends (the last stable offset): past them are records of
	// transactions not ended, which read_committed does not return.
	ends, err := o.adm.ListCommittedOffsets(ctx, topic)
	if err != nil {
		return nil, false, fmt.Errorf("list the end offsets of %s: %w", topic, err)
	}
	var starts kadm.ListedOffsets
	if since.IsZero() {
		starts, err = o.adm.ListStartOffsets(ctx, topic)
	} else {
		starts, err = o.adm.ListOffsetsAfterMilli(ctx, since.UnixMilli(), topic)
	}
	if err != nil {
		return nil, false, fmt.Errorf("list the offsets of %s: %w", topic, err)
	}
	out := map[int32]span{}
	exists := true
	var lerr error
	ends.Each(func(e kadm.ListedOffset) {
		if errors.Is(e.Err, kerr.UnknownTopicOrPartition) {
			exists = false
			return
		}
		if e.Err != nil {
			lerr = fmt.Errorf("end offset of %s/%d: %w", topic, e.Partition, e.Err)
			return
		}
		s, ok := starts.Lookup(topic, e.Partition)
		if ok && s.Err != nil {
			lerr = fmt.Errorf("offset of %s/%d: %w", topic, e.Partition, s.Err)
			return
		}
		from := int64(0)
		if ok && s.Offset >= 0 {
			from = s.Offset
		}
		out[e.Partition] = span{from: min(from, e.Offset), to: e.Offset}
	})
	if !exists || (len(out) == 0 && lerr == nil) {
		return nil, false, nil
	}
	return out, true, lerr
}

// read calls fn with every committed record of topic in the given spans
// (readSpans), with a consumer of its own.
func (o *Ops) read(ctx context.Context, topic string, spans map[int32]span, fn func(*kgo.Record) error) error {
	return readSpans(ctx, o.sc, topic, spans, fn)
}

// Check implements busops.Bus: the brokers answer, every configured topic
// (and the dead-letter topic) exists with the partitions and replication
// factor the config asks for, and topics replicated 3 times or more need 2
// in-sync replicas for an ack.
func (o *Ops) Check(ctx context.Context, report busops.Report) {
	md, err := o.adm.BrokerMetadata(ctx)
	if err != nil {
		report("kafka.connect", busops.Fail, fmt.Sprintf("cannot reach the Kafka brokers %s: %v", o.brokers(), err), ConnectFix)
		report("kafka.topics", busops.Skip, "no connection to Kafka", "")
		return
	}
	cluster := md.Cluster
	if cluster == "" {
		cluster = "-"
	}
	report("kafka.connect", busops.OK, fmt.Sprintf("connected to %s: cluster %s, %d broker(s), controller %d", o.brokers(), cluster, len(md.Brokers), md.Controller), "")
	report("kafka.producer", busops.OK, "acks=all and the idempotent producer (always: walbox confirms the slot only past events all in-sync replicas stored)", "")
	details, err := o.adm.ListTopics(ctx, append(o.Events, o.DLQ)...)
	if err != nil {
		report("kafka.topics", busops.Fail, fmt.Sprintf("cannot list the topics on %s: %v", o.brokers(), err), "check that walbox's principal may describe the topics (ACL DESCRIBE on TOPIC)")
		return
	}
	var existing []string
	rfs := map[string]int{}
	managed := map[string]bool{}
	for i, sp := range o.cfg.Topics {
		key := fmt.Sprintf("kafka.topics[%d]", i)
		if i == len(o.cfg.Topics)-1 {
			key = "kafka.dlq_topic"
		}
		if rf, ok := o.checkTopic(sp, key, details, report); ok {
			existing = append(existing, sp.Name)
			rfs[sp.Name] = rf
			managed[sp.Name] = sp.Manage
		}
	}
	o.checkMinISR(ctx, existing, rfs, managed, report)
}

// ConnectFix is the fix of brokers that cannot be reached.
const ConnectFix = "check kafka.brokers (or WALBOX_KAFKA_BROKERS), kafka.tls and kafka.sasl; are the brokers running and reachable from here (host:port of each broker's advertised listener)?"

func (o *Ops) bootstrap() string {
	if len(o.sc.Brokers) > 0 {
		return o.sc.Brokers[0]
	}
	return "<broker>"
}

// checkTopic reports one topic and returns its replication factor and
// whether it exists.
func (o *Ops) checkTopic(sp TopicSpec, key string, details kadm.TopicDetails, report busops.Report) (int, bool) {
	name, bootstrap := "kafka.topic."+sp.Name, o.bootstrap()
	var want []string
	if sp.Partitions > 0 {
		want = append(want, fmt.Sprintf("--partitions %d", sp.Partitions))
	}
	if sp.ReplicationFactor > 0 {
		want = append(want, fmt.Sprintf("--replication-factor %d", sp.ReplicationFactor))
	}
	d, ok := details[sp.Name]
	if !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition) {
		create := fmt.Sprintf("kafka-topics.sh --bootstrap-server %s --create --topic %s %s", bootstrap, sp.Name, strings.Join(want, " "))
		if sp.Manage {
			shape := strings.Join(want, " ")
			if shape == "" {
				shape = "the broker's default partitions and replication factor"
			}
			report(name, busops.Warn, fmt.Sprintf("topic %s does not exist: walbox creates it at start (%s)", sp.Name, shape),
				"nothing to do if walbox may create topics; or create it: "+create)
			return 0, false
		}
		report(name, busops.Fail, fmt.Sprintf("topic %s does not exist and %s.manage is false (walbox only checks it): walbox run refuses to start", sp.Name, key),
			fmt.Sprintf("%s; or set %s.manage: true", create, key))
		return 0, false
	}
	if d.Err != nil {
		fix := ""
		if errors.Is(d.Err, kerr.TopicAuthorizationFailed) {
			fix = fmt.Sprintf("grant walbox's principal DESCRIBE and WRITE on topic %s", sp.Name)
		}
		report(name, busops.Fail, fmt.Sprintf("cannot describe topic %s: %v", sp.Name, d.Err), fix)
		return 0, false
	}
	parts, rf := len(d.Partitions), d.Partitions.NumReplicas()
	detail := fmt.Sprintf("topic %s: %d partition(s), replication factor %d", sp.Name, parts, rf)
	switch {
	case sp.ReplicationFactor > 0 && rf < int(sp.ReplicationFactor):
		report(name, busops.Fail, fmt.Sprintf("%s, but %s.replication_factor is %d: an ack is less durable than configured", detail, key, sp.ReplicationFactor),
			fmt.Sprintf("raise it with kafka-reassign-partitions.sh (a reassignment listing %d replicas per partition of %s), or set %s.replication_factor: %d", sp.ReplicationFactor, sp.Name, key, rf))
	case key == "kafka.dlq_topic" && parts != 1:
		report(name, busops.OK, fmt.Sprintf("%s (walbox creates it with 1, so that dead letters keep their order; with more, `walbox dlq retry --seq N` may need --all, as N is per partition)", detail), "")
	case sp.Partitions > 0 && parts != int(sp.Partitions):
		fix := fmt.Sprintf("set %s.partitions: %d", key, parts)
		if parts < int(sp.Partitions) {
			fix = fmt.Sprintf("kafka-topics.sh --bootstrap-server %s --alter --topic %s --partitions %d with walbox stopped and the topic's consumers caught up (keys then map to other partitions; README, Kafka: adding partitions), or %s", bootstrap, sp.Name, sp.Partitions, fix)
		}
		report(name, busops.Warn, fmt.Sprintf("%s, but %s.partitions is %d", detail, key, sp.Partitions), fix)
	case sp.ReplicationFactor > 0 && rf > int(sp.ReplicationFactor):
		report(name, busops.Warn, fmt.Sprintf("%s, more than %s.replication_factor %d", detail, key, sp.ReplicationFactor),
			fmt.Sprintf("set %s.replication_factor: %d", key, rf))
	default:
		report(name, busops.OK, detail, "")
	}
	return rf, true
}

// checkMinISR: with acks=all an ack means every in-sync replica stored
// the record, and min.insync.replicas is how few that may be. Every topic
// is checked by its actual replication factor, the brokers' default
// included; walbox run sets 2 itself on the topics it manages.
func (o *Ops) checkMinISR(ctx context.Context, topics []string, rfs map[string]int, managed map[string]bool, report busops.Report) {
	if len(topics) == 0 {
		return
	}
	rcs, err := o.adm.DescribeTopicConfigs(ctx, topics...)
	if err != nil {
		report("kafka.min_insync_replicas", busops.Skip, fmt.Sprintf("cannot read the topics' configs: %v", err), "grant walbox's principal DESCRIBE_CONFIGS on the topics")
		return
	}
	for _, t := range topics {
		name := "kafka.topic." + t + ".min_insync_replicas"
		cs, err := topicConfigs(rcs, t)
		if err != nil {
			report(name, busops.Skip, fmt.Sprintf("cannot read the config of %s: %v", t, err), "")
			continue
		}
		minISR := -1
		for _, c := range cs {
			if c.Key == "min.insync.replicas" && c.Value != nil {
				minISR, _ = strconv.Atoi(*c.Value)
			}
		}
		rf := rfs[t]
		switch {
		case minISR < 0:
			report(name, busops.Skip, fmt.Sprintf("the brokers did not report min.insync.replicas of %s", t), "")
		case rf >= 3 && minISR < 2:
			detail := fmt.Sprintf("min.insync.replicas = %d with replication factor %d: acks=all is then as durable as one broker (an ack may come from a leader alone)", minISR, rf)
			if managed[t] {
				detail += "; walbox run sets 2 at start, as it manages the topic (where the brokers let it)"
			}
			report(name, busops.Warn, detail, minISRFix(t, o.sc.Brokers))
		default:
			report(name, busops.OK, fmt.Sprintf("min.insync.replicas = %d, replication factor %d", minISR, rf), "")
		}
	}
}
