package config

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// Sinks: where walbox publishes (the sink key).
const (
	SinkNATS  = "nats"
	SinkKafka = "kafka"
)

// Kafka is the Kafka side (sink: kafka). The publish window, its bytes,
// the envelope, partition buckets and the retry back-off are shared with
// the NATS sink and stay under nats.window, nats.window_bytes,
// nats.envelope, nats.partition_buckets and retry.
type Kafka struct {
	Brokers []string `yaml:"brokers" env:"BROKERS"`
	// TopicTemplate builds the topic from {topic}, {partition}, {bucket},
	// {event_type} and {aggregate_type}, like nats.subject_template.
	TopicTemplate string `yaml:"topic_template" env:"TOPIC_TEMPLATE"`
	// Topics are the topics events may land in; an event whose topic is
	// not listed is dead-lettered.
	Topics []KafkaTopic `yaml:"topics"`
	// DLQTopic receives dead letters (walbox creates it, 1 partition per
	// default, so dead letters keep their order).
	DLQTopic string `yaml:"dlq_topic" env:"DLQ_TOPIC"`
	// AckTimeout bounds a record's delivery (delivery.timeout.ms).
	AckTimeout time.Duration `yaml:"ack_timeout" env:"ACK_TIMEOUT"`
	// MaxMessageBytes is the brokers' message.max.bytes: larger events are
	// dead-lettered instead of refused by the broker.
	MaxMessageBytes int    `yaml:"max_message_bytes" env:"MAX_MESSAGE_BYTES"`
	ClientID        string `yaml:"client_id" env:"CLIENT_ID"`
	// Transactions makes the producer transactional (default true): an
	// ack means the record's transaction committed, a failed record aborts
	// its transaction (nothing behind it is stored ahead of it), and every
	// leadership term fences the previous leader. Consumers must read with
	// isolation.level=read_committed.
	Transactions bool `yaml:"transactions" env:"TRANSACTIONS"`
	// TransactionalID is the producer's transactional id; the leader and
	// its standbys share it. Default: walbox:<database>/<slot>.
	TransactionalID string    `yaml:"transactional_id" env:"TRANSACTIONAL_ID"`
	TLS             KafkaTLS  `yaml:"tls" envPrefix:"TLS_"`
	SASL            KafkaSASL `yaml:"sasl" envPrefix:"SASL_"`
}

// KafkaTopic is one topic walbox writes to.
type KafkaTopic struct {
	Name              string `yaml:"name"`
	Partitions        int32  `yaml:"partitions"`
	ReplicationFactor int16  `yaml:"replication_factor"`
	// Manage: create the topic when it is missing (true), or only check it.
	Manage *bool `yaml:"manage"`
}

// KafkaTLS is TLS to the brokers; enabled, or any file set, turns it on.
type KafkaTLS struct {
	Enabled bool   `yaml:"enabled" env:"ENABLED"`
	CA      string `yaml:"ca" env:"CA"`
	Cert    string `yaml:"cert" env:"CERT"`
	Key     string `yaml:"key" env:"KEY"`
}

// KafkaSASL is SASL authentication: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
type KafkaSASL struct {
	Mechanism string `yaml:"mechanism" env:"MECHANISM"`
	User      string `yaml:"user" env:"USER"`
	Password  string `yaml:"password" env:"PASSWORD"`
}

func defaultKafka() Kafka {
	return Kafka{TopicTemplate: relay.DefaultSubjectTemplate, DLQTopic: "walbox.dlq", AckTimeout: 30 * time.Second,
		MaxMessageBytes: kafkasink.DefaultMaxPayload, ClientID: "walbox", Transactions: true}
}

// KafkaTransactionalID is the producer's transactional id for database
// ("" with kafka.transactions off): kafka.transactional_id, or
// walbox:<database>/<slot>, the relay's source, which the read-back already
// takes as unique among the walboxes writing to one Kafka cluster.
func (c *Config) KafkaTransactionalID(database string) string {
	switch {
	case !c.Kafka.Transactions:
		return ""
	case c.Kafka.TransactionalID != "":
		return c.Kafka.TransactionalID
	}
	return "walbox:" + database + "/" + c.Postgres.Slot
}

// validateKafka checks the kafka.* keys when sink is kafka.
func (c *Config) validateKafka(bad func(key, format string, args ...any)) {
	k := c.Kafka
	if len(k.Brokers) == 0 {
		bad("kafka.brokers", "is required with sink: kafka, e.g. [\"localhost:9092\"] (or set WALBOX_KAFKA_BROKERS)")
	}
	if len(k.Topics) == 0 {
		bad("kafka.topics", "declare at least one topic, e.g. [{name: orders, partitions: 6, replication_factor: 3}]")
	}
	seen := map[string]bool{}
	for i, t := range k.Topics {
		key := fmt.Sprintf("kafka.topics[%d]", i)
		if !validTopic(t.Name) {
			bad(key+".name", "%q is not a valid Kafka topic name (letters, digits, '.', '_', '-'; at most 249)", t.Name)
		}
		if seen[t.Name] {
			bad(key+".name", "topic %q is declared twice", t.Name)
		}
		if t.Name == k.DLQTopic {
			bad(key+".name", "%q is the dead-letter topic (kafka.dlq_topic)", t.Name)
		}
		seen[t.Name] = true
		if t.Partitions < 0 || t.ReplicationFactor < 0 {
			bad(key, "partitions and replication_factor must not be negative (0: the broker's default)")
		}
	}
	if !validTopic(k.DLQTopic) {
		bad("kafka.dlq_topic", "%q is not a valid Kafka topic name", k.DLQTopic)
	}
	if err := relay.ValidateSubjectTemplate(k.TopicTemplate); err != nil {
		bad("kafka.topic_template", "%v", err)
	}
	if k.AckTimeout <= 0 {
		bad("kafka.ack_timeout", "must be positive")
	}
	if k.MaxMessageBytes < 1024 {
		bad("kafka.max_message_bytes", "%d: must be at least 1024", k.MaxMessageBytes)
	}
	if (k.TLS.Cert == "") != (k.TLS.Key == "") {
		bad("kafka.tls", "set both cert and key (the client certificate and its private key), or neither")
	}
	for _, f := range []struct{ key, path string }{{"kafka.tls.ca", k.TLS.CA}, {"kafka.tls.cert", k.TLS.Cert}, {"kafka.tls.key", k.TLS.Key}} {
		if f.path != "" {
			if _, err := os.Stat(f.path); err != nil {
				bad(f.key, "cannot read %s: %v", f.path, err)
			}
		}
	}
	switch strings.ToUpper(k.SASL.Mechanism) {
	case "":
	case "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512":
		if k.SASL.User == "" || k.SASL.Password == "" {
			bad("kafka.sasl", "mechanism %s needs user and password (or WALBOX_KAFKA_SASL_PASSWORD)", k.SASL.Mechanism)
		}
	default:
		bad("kafka.sasl.mechanism", "%q: use PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", k.SASL.Mechanism)
	}
}

func validTopic(s string) bool {
	if s == "" || len(s) > 249 || s == "." || s == ".." {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}

// dlqBatchOverhead is room for a record batch's header around a dead letter.
const dlqBatchOverhead = 1024

// TopicSpecs converts kafka.topics, and the dead-letter topic, for the sink.
func (c *Config) TopicSpecs() []kafkasink.TopicSpec {
	var out []kafkasink.TopicSpec
	for _, t := range c.Kafka.Topics {
		out = append(out, kafkasink.TopicSpec{Name: t.Name, Partitions: t.Partitions, ReplicationFactor: t.ReplicationFactor,
			Manage: t.Manage == nil || *t.Manage})
	}
	// A dead letter keeps its payload up to kafka.max_message_bytes
	// (relay.Router.DeadLetter), in a batch of one: the batch's own bytes
	// on top.
	return append(out, kafkasink.TopicSpec{Name: c.Kafka.DLQTopic, Partitions: 1, Manage: true,
		MaxMessageBytes: int32(min(c.Kafka.MaxMessageBytes, 1<<30-dlqBatchOverhead) + dlqBatchOverhead)})
}

// KafkaSinkConfig is the sink's connection config: brokers, TLS, SASL and
// the producer's limits for a relay window of window events.
func (c *Config) KafkaSinkConfig(window int) (kafkasink.Config, error) {
	k := c.Kafka
	// The relay's window is nats.window events and nats.window_bytes / 4
	// bytes (internal/app): the read-back covers twice that.
	sc := kafkasink.Config{Brokers: k.Brokers, ClientID: k.ClientID, AckTimeout: k.AckTimeout,
		MaxBuffered: 2*window + 64, MaxPayload: k.MaxMessageBytes, TailBytes: int64(c.NATS.WindowBytes) / 2}
	if k.TLS.Enabled || k.TLS.CA != "" || k.TLS.Cert != "" {
		tc := &tls.Config{MinVersion: tls.VersionTLS12}
		if k.TLS.CA != "" {
			pem, err := os.ReadFile(k.TLS.CA)
			if err != nil {
				return sc, fmt.Errorf("kafka.tls.ca: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return sc, fmt.Errorf("kafka.tls.ca: %s holds no PEM certificate", k.TLS.CA)
			}
			tc.RootCAs = pool
		}
		if k.TLS.Cert != "" {
			cert, err := tls.LoadX509KeyPair(k.TLS.Cert, k.TLS.Key)
			if err != nil {
				return sc, fmt.Errorf("kafka.tls.cert/key: %w", err)
			}
			tc.Certificates = []tls.Certificate{cert}
		}
		sc.TLS = tc
	}
	var m sasl.Mechanism
	switch strings.ToUpper(k.SASL.Mechanism) {
	case "PLAIN":
		m = plain.Auth{User: k.SASL.User, Pass: k.SASL.Password}.AsMechanism()
	case "SCRAM-SHA-256":
		m = scram.Auth{User: k.SASL.User, Pass: k.SASL.Password}.AsSha256Mechanism()
	case "SCRAM-SHA-512":
		m = scram.Auth{User: k.SASL.User, Pass: k.SASL.Password}.AsSha512Mechanism()
	}
	sc.SASL = m
	return sc, nil
}
