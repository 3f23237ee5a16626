package ops

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/kafkatest"
)

// The Kafka side of the operations commands runs against kfake, franz-go's
// in-process implementation of the Kafka protocol.

// kafkaEnv is an env whose config says sink: kafka, with a kfake cluster
// of 3 brokers.
type kafkaEnv struct {
	*env
	kafka *kafkatest.Cluster
}

func newKafkaEnv(t *testing.T, mutate ...func(*config.Config)) *kafkaEnv {
	t.Helper()
	k := kafkatest.NewCluster(t)
	e := newEnv(t, append([]func(*config.Config){k.Sink(
		config.KafkaTopic{Name: "orders.created", Partitions: 4, ReplicationFactor: 3},
		config.KafkaTopic{Name: "payments.settled", Partitions: 2, ReplicationFactor: 3},
	)}, mutate...)...)
	return &kafkaEnv{env: e, kafka: k}
}

// createTopic creates a topic with min.insync.replicas minISR (0: the
// broker's default).
func (e *kafkaEnv) createTopic(name string, parts int32, rf int16, minISR string) {
	e.t.Helper()
	var cfgs map[string]*string
	if minISR != "" {
		cfgs = map[string]*string{"min.insync.replicas": &minISR}
	}
	resp, err := e.kafka.Admin.CreateTopics(testCtx(e.t), parts, rf, cfgs, name)
	if err == nil {
		err = resp.Error()
	}
	if err != nil {
		e.t.Fatalf("create topic %s: %v", name, err)
	}
}

// createAll creates the configured topics and the dead-letter topic, with
// min.insync.replicas = 2.
func (e *kafkaEnv) createAll() {
	e.t.Helper()
	for _, tp := range e.cfg.Kafka.Topics {
		e.createTopic(tp.Name, tp.Partitions, tp.ReplicationFactor, "2")
	}
	e.createTopic(e.cfg.Kafka.DLQTopic, 1, 3, "2")
}

// kafkaDoctorText is the report as doctor prints it.
func kafkaDoctorText(t *testing.T, rep *DoctorReport) string {
	t.Helper()
	var out bytes.Buffer
	rep.Print(&out)
	return out.String()
}

func TestDoctorKafkaGoodSetup(t *testing.T) {
	e := newKafkaEnv(t)
	e.createAll()
	rep := Doctor(testCtx(t), e.cfg)
	out := kafkaDoctorText(t, rep)
	if !rep.OK {
		t.Fatalf("doctor failed on a good Kafka setup:\n%s", out)
	}
	for _, name := range []string{"kafka.connect", "kafka.producer", "kafka.topic.orders.created", "kafka.topic.payments.settled",
		"kafka.topic.walbox.dlq", "kafka.topic.orders.created.min_insync_replicas", "kafka.topic.payments.settled.min_insync_replicas",
		"kafka.topic.walbox.dlq.min_insync_replicas"} {
		wantCheck(t, rep, name, OK, "")
	}
	for _, c := range rep.Checks {
		if strings.HasPrefix(c.Name, "nats.") {
			t.Errorf("sink: kafka, but doctor checked NATS: %+v", c)
		}
	}
	mustContain(t, "doctor output", out, "3 broker(s)", "4 partition(s), replication factor 3", "acks=all")
}

func TestDoctorKafkaTopicProblems(t *testing.T) {
	f := false
	e := newKafkaEnv(t, func(cfg *config.Config) {
		cfg.Kafka.Topics = append(cfg.Kafka.Topics,
			config.KafkaTopic{Name: "owned.elsewhere", Partitions: 3, ReplicationFactor: 3, Manage: &f},
			config.KafkaTopic{Name: "created.at.start", Partitions: 3, ReplicationFactor: 3},
			config.KafkaTopic{Name: "broker.defaults"})
	})
	e.createTopic("orders.created", 2, 3, "2")     // 2 partitions, config says 4
	e.createTopic("payments.settled", 2, 1, "1")   // RF 1, config says 3
	e.createTopic("broker.defaults", 5, 3, "1")    // config: broker default; RF 3 with min.insync.replicas 1
	e.createTopic(e.cfg.Kafka.DLQTopic, 3, 3, "2") // walbox would create 1 partition
	rep := Doctor(testCtx(t), e.cfg)
	out := kafkaDoctorText(t, rep)
	t.Logf("\n%s", out)
	if rep.OK {
		t.Fatalf("doctor passed with a missing unmanaged topic:\n%s", out)
	}
	want := []struct {
		name string
		st   CheckStatus
		has  []string
	}{
		{"kafka.topic.owned.elsewhere", Fail, []string{"does not exist and kafka.topics[2].manage is false", "kafka-topics.sh --bootstrap-server", "--create --topic owned.elsewhere --partitions 3 --replication-factor 3"}},
		{"kafka.topic.created.at.start", Warn, []string{"walbox creates it at start"}},
		{"kafka.topic.orders.created", Warn, []string{"2 partition(s)", "kafka.topics[0].partitions is 4", "--alter --topic orders.created --partitions 4"}},
		{"kafka.topic.payments.settled", Fail, []string{"replication factor 1", "kafka.topics[1].replication_factor is 3"}},
		{"kafka.topic.broker.defaults", OK, []string{"5 partition(s)"}},
		{"kafka.topic.broker.defaults.min_insync_replicas", Warn, []string{"min.insync.replicas = 1 with replication factor 3",
			"kafka-configs.sh --bootstrap-server " + e.cfg.Kafka.Brokers[0] + " --alter --entity-type topics --entity-name broker.defaults --add-config min.insync.replicas=2"}},
		{"kafka.topic.payments.settled.min_insync_replicas", OK, []string{"replication factor 1"}},
		{"kafka.topic.walbox.dlq", OK, []string{"3 partition(s)", "walbox creates it with 1"}},
		{"kafka.topic.orders.created.min_insync_replicas", OK, []string{"min.insync.replicas = 2"}},
	}
	for _, w := range want {
		c := checkOf(t, rep, w.name)
		if c.Status != w.st {
			t.Errorf("%s: %s, want %s: %s", w.name, c.Status, w.st, c.Detail)
		}
		for _, s := range w.has {
			if !strings.Contains(c.Detail+" fix: "+c.Fix, s) {
				t.Errorf("%s: %q lacks %q", w.name, c.Detail+" fix: "+c.Fix, s)
			}
		}
	}
}

func TestDoctorKafkaUnreachableBrokers(t *testing.T) {
	e := newKafkaEnv(t)
	brokers := e.cfg.Kafka.Brokers
	e.kafka.Close()
	ctx, cancel := context.WithTimeout(testCtx(t), 6*time.Second)
	defer cancel()
	rep := Doctor(ctx, e.cfg)
	c := checkOf(t, rep, "kafka.connect")
	t.Logf("%s: %s", c.Status, c.Detail)
	if c.Status != Fail || rep.OK {
		t.Fatalf("kafka.connect with the brokers down: %+v", c)
	}
	for _, b := range brokers {
		if !strings.Contains(c.Detail, b) {
			t.Errorf("the failure does not name broker %s: %s", b, c.Detail)
		}
	}
	if !strings.Contains(c.Fix, "kafka.brokers") {
		t.Errorf("fix: %s", c.Fix)
	}
	wantCheck(t, rep, "kafka.topics", Skip, "")
	// PostgreSQL was still checked.
	wantCheck(t, rep, "postgres.connect", OK, "")
}
