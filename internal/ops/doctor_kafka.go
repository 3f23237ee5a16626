package ops

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay/kafkasink"
)

// doctorKafka checks the Kafka side (sink: kafka), read-only: the brokers
// answer, every configured topic (and the dead-letter topic) exists with
// the partitions and replication factor the config asks for, and topics
// replicated 3 times or more need 2 in-sync replicas for an ack.
func doctorKafka(ctx context.Context, cfg config.Config, r *DoctorReport) {
	brokers := kafkaBrokers(cfg)
	connectFix := "check kafka.brokers (or WALBOX_KAFKA_BROKERS), kafka.tls and kafka.sasl; are the brokers running and reachable from here (host:port of each broker's advertised listener)?"
	cl, _, err := kafkaClient(cfg)
	if err != nil {
		r.add("kafka.connect", Fail, fmt.Sprintf("brokers %s: %v", brokers, err), connectFix)
		r.add("kafka.topics", Skip, "no connection to Kafka", "")
		return
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	md, err := adm.BrokerMetadata(cctx)
	if err != nil {
		r.add("kafka.connect", Fail, fmt.Sprintf("cannot reach the Kafka brokers %s: %v", brokers, err), connectFix)
		r.add("kafka.topics", Skip, "no connection to Kafka", "")
		return
	}
	cluster := md.Cluster
	if cluster == "" {
		cluster = "-"
	}
	r.add("kafka.connect", OK, fmt.Sprintf("connected to %s: cluster %s, %d broker(s), controller %d", brokers, cluster, len(md.Brokers), md.Controller), "")
	r.add("kafka.producer", OK, "acks=all and the idempotent producer (always: walbox confirms the slot only past events all in-sync replicas stored)", "")

	specs := cfg.TopicSpecs()
	names := make([]string, 0, len(specs))
	for _, sp := range specs {
		names = append(names, sp.Name)
	}
	details, err := adm.ListTopics(cctx, names...)
	if err != nil {
		r.add("kafka.topics", Fail, fmt.Sprintf("cannot list the topics on %s: %v", brokers, err), "check that walbox's principal may describe the topics (ACL DESCRIBE on TOPIC)")
		return
	}
	bootstrap := "<broker>"
	if len(cfg.Kafka.Brokers) > 0 {
		bootstrap = cfg.Kafka.Brokers[0]
	}
	var existing []string
	rfs := map[string]int{}
	managed := map[string]bool{}
	for i, sp := range specs {
		key := fmt.Sprintf("kafka.topics[%d]", i)
		if i == len(specs)-1 {
			key = "kafka.dlq_topic"
		}
		if rf, ok := checkKafkaTopic(sp, key, bootstrap, details, r); ok {
			existing = append(existing, sp.Name)
			rfs[sp.Name] = rf
			managed[sp.Name] = sp.Manage
		}
	}
	checkMinISR(cctx, adm, existing, rfs, managed, bootstrap, r)
}

// checkKafkaTopic reports one topic and returns its replication factor and
// whether it exists.
func checkKafkaTopic(sp kafkasink.TopicSpec, key, bootstrap string, details kadm.TopicDetails, r *DoctorReport) (int, bool) {
	name := "kafka.topic." + sp.Name
	want := func() string {
		var s []string
		if sp.Partitions > 0 {
			s = append(s, fmt.Sprintf("--partitions %d", sp.Partitions))
		}
		if sp.ReplicationFactor > 0 {
			s = append(s, fmt.Sprintf("--replication-factor %d", sp.ReplicationFactor))
		}
		return strings.Join(s, " ")
	}
	d, ok := details[sp.Name]
	if !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition) {
		if sp.Manage {
			r.add(name, Warn, fmt.Sprintf("topic %s does not exist: walbox creates it at start (%s)", sp.Name, orDefault(want(), "the broker's default partitions and replication factor")),
				fmt.Sprintf("nothing to do if walbox may create topics; or create it: kafka-topics.sh --bootstrap-server %s --create --topic %s %s", bootstrap, sp.Name, want()))
			return 0, false
		}
		r.add(name, Fail, fmt.Sprintf("topic %s does not exist and %s.manage is false (walbox only checks it): walbox run refuses to start", sp.Name, key),
			fmt.Sprintf("kafka-topics.sh --bootstrap-server %s --create --topic %s %s; or set %s.manage: true", bootstrap, sp.Name, want(), key))
		return 0, false
	}
	if d.Err != nil {
		fix := ""
		if errors.Is(d.Err, kerr.TopicAuthorizationFailed) {
			fix = fmt.Sprintf("grant walbox's principal DESCRIBE and WRITE on topic %s", sp.Name)
		}
		r.add(name, Fail, fmt.Sprintf("cannot describe topic %s: %v", sp.Name, d.Err), fix)
		return 0, false
	}
	parts, rf := len(d.Partitions), d.Partitions.NumReplicas()
	detail := fmt.Sprintf("topic %s: %d partition(s), replication factor %d", sp.Name, parts, rf)
	switch {
	case sp.ReplicationFactor > 0 && rf < int(sp.ReplicationFactor):
		r.add(name, Fail, fmt.Sprintf("%s, but %s.replication_factor is %d: an ack is less durable than configured", detail, key, sp.ReplicationFactor),
			fmt.Sprintf("raise it with kafka-reassign-partitions.sh (a reassignment listing %d replicas per partition of %s), or set %s.replication_factor: %d", sp.ReplicationFactor, sp.Name, key, rf))
	case key == "kafka.dlq_topic" && parts != 1:
		r.add(name, OK, fmt.Sprintf("%s (walbox creates it with 1, so that dead letters keep their order; with more, `walbox dlq retry --seq N` may need --all, as N is per partition)", detail), "")
	case sp.Partitions > 0 && parts != int(sp.Partitions):
		fix := fmt.Sprintf("set %s.partitions: %d", key, parts)
		if parts < int(sp.Partitions) {
			fix = fmt.Sprintf("kafka-topics.sh --bootstrap-server %s --alter --topic %s --partitions %d with walbox stopped and the topic's consumers caught up (keys then map to other partitions; README, Kafka: adding partitions), or %s", bootstrap, sp.Name, sp.Partitions, fix)
		}
		r.add(name, Warn, fmt.Sprintf("%s, but %s.partitions is %d", detail, key, sp.Partitions), fix)
	case sp.ReplicationFactor > 0 && rf > int(sp.ReplicationFactor):
		r.add(name, Warn, fmt.Sprintf("%s, more than %s.replication_factor %d", detail, key, sp.ReplicationFactor),
			fmt.Sprintf("set %s.replication_factor: %d", key, rf))
	default:
		r.add(name, OK, detail, "")
	}
	return rf, true
}

// checkMinISR: with acks=all an ack means every in-sync replica stored
// the record, and min.insync.replicas is how few that may be. Every topic
// is checked by its actual replication factor, the brokers' default
// included; walbox run sets 2 itself on the topics it manages.
func checkMinISR(ctx context.Context, adm *kadm.Client, topics []string, rfs map[string]int, managed map[string]bool, bootstrap string, r *DoctorReport) {
	if len(topics) == 0 {
		return
	}
	rcs, err := adm.DescribeTopicConfigs(ctx, topics...)
	if err != nil {
		r.add("kafka.min_insync_replicas", Skip, fmt.Sprintf("cannot read the topics' configs: %v", err), "grant walbox's principal DESCRIBE_CONFIGS on the topics")
		return
	}
	for _, t := range topics {
		name := "kafka.topic." + t + ".min_insync_replicas"
		rc, err := rcs.On(t, nil)
		if err == nil {
			err = rc.Err
		}
		if err != nil {
			r.add(name, Skip, fmt.Sprintf("cannot read the config of %s: %v", t, err), "")
			continue
		}
		minISR := -1
		for _, c := range rc.Configs {
			if c.Key == "min.insync.replicas" && c.Value != nil {
				minISR, _ = strconv.Atoi(*c.Value)
			}
		}
		rf := rfs[t]
		switch {
		case minISR < 0:
			r.add(name, Skip, fmt.Sprintf("the brokers did not report min.insync.replicas of %s", t), "")
		case rf >= 3 && minISR < 2:
			detail := fmt.Sprintf("min.insync.replicas = %d with replication factor %d: acks=all is then as durable as one broker (an ack may come from a leader alone)", minISR, rf)
			if managed[t] {
				detail += "; walbox run sets 2 at start, as it manages the topic (where the brokers let it)"
			}
			r.add(name, Warn, detail,
				fmt.Sprintf("kafka-configs.sh --bootstrap-server %s --alter --entity-type topics --entity-name %s --add-config min.insync.replicas=2", bootstrap, t))
		default:
			r.add(name, OK, fmt.Sprintf("min.insync.replicas = %d, replication factor %d", minISR, rf), "")
		}
	}
}
