package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walbox/walbox/internal/outboxtest"
)

// TestKafkaDeadLetterOverTheDLQTopicsLimit (issue 35, item 2): the
// dead-letter topic exists already with max.message.bytes 2,048, and the
// brokers refuse to raise it (a policy). A row with an undeclared topic and
// a payload of 6,400 bytes (far below kafka.max_message_bytes) is
// dead-lettered: the dead letter is too large for the topic. It is stored
// without its payload, saying so in its headers (the row keeps the
// payload), the row is marked processed, and the row behind it is
// published: the relay does not stall.
func TestKafkaDeadLetterOverTheDLQTopicsLimit(t *testing.T) {
	e := newKafkaEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := e.kafka.Admin.CreateTopic(ctx, 1, 3, map[string]*string{"max.message.bytes": kadm.StringPtr("2048")}, e.cfg.Kafka.DLQTopic); err != nil {
		t.Fatal(err)
	}
	e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.IncrementalAlterConfigs, kmsg.AlterConfigs}, Err: kerr.PolicyViolation, Count: -1})
	e.migrate()
	e.startRelay()
	conn := e.conn()
	if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (id, topic, payload) VALUES
		('00000000-0000-7000-8000-000000000001', 'nowhere.created',
		 jsonb_build_object('pad', (SELECT string_agg(md5(i::text), '') FROM generate_series(1, 200) i)))`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox_events (id, topic, payload) VALUES ('00000000-0000-7000-8000-000000000002', 'orders.created', '{}')`); err != nil {
		t.Fatal(err)
	}
	e.waitStored(2, 20*time.Second)
	recs, err := outboxtest.ReadKafkaWithKcat(ctx, strings.Join(e.cfg.Kafka.Brokers, ","), e.cfg.Kafka.DLQTopic)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 {
		t.Fatalf("the dead-letter topic holds %d records, want 1", len(recs))
	}
	r := recs[0]
	if r.Header("Walbox-Event-Id") != "00000000-0000-7000-8000-000000000001" || r.Header("Walbox-Dlq-Payload-Dropped") == "" || (r.Payload != nil && *r.Payload != "") ||
		!strings.Contains(r.Header("Walbox-Dlq-Payload-Dropped-Reason"), "MESSAGE_TOO_LARGE") {
		t.Fatalf("the dead letter: %+v", r)
	}
	e.waitProcessed(t, "00000000-0000-7000-8000-000000000001")
	e.waitProcessed(t, "00000000-0000-7000-8000-000000000002")
}
