package kafkasink_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/internal/syncbuf"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// counter is the value of the counter name{topic=topic} on reg, 0 when absent.
func counter(t *testing.T, reg *prometheus.Registry, name, topic string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "topic" && l.GetValue() == topic {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func newObservedSink(t *testing.T, brokers []string) (*kafkasink.Sink, *prometheus.Registry, *syncbuf.Buffer) {
	t.Helper()
	reg := prometheus.NewRegistry()
	logs := &syncbuf.Buffer{}
	s, err := kafkasink.New(kafkasink.Config{Brokers: brokers, AckTimeout: 10 * time.Second,
		Registerer: reg, Log: zerolog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s, reg, logs
}

// TestDataLossIsCountedAndLogged: a broker that answers a produce with
// OUT_OF_ORDER_SEQUENCE_NUMBER has lost records of this producer it had
// acked (issue 35, item 7). franz-go resets the producer id and carries on,
// and the record is acked; the sink logs an error naming the topic and
// partition and counts walbox_kafka_data_loss_total{topic}.
func TestDataLossIsCountedAndLogged(t *testing.T) {
	c := newCluster(t)
	s, reg, logs := newObservedSink(t, c.ListenAddrs())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := s.EnsureTopics(ctx, []kafkasink.TopicSpec{{Name: "orders", Partitions: 1, ReplicationFactor: 1, Manage: true}}); err != nil {
		t.Fatal(err)
	}
	pub := func(id string) relay.Future {
		f, err := s.Publish(&relay.Msg{Subject: "orders", Key: "k", Data: []byte(`{}`), Header: relay.Header{relay.HeaderMsgID: {id}}})
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	if _, err := wait(t, ctx, pub("a")); err != nil {
		t.Fatal(err)
	}
	// The next produce request only: OUT_OF_ORDER_SEQUENCE_NUMBER for every
	// partition (the control is dropped once it has answered).
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		pr := req.(*kmsg.ProduceRequest)
		resp := pr.ResponseKind().(*kmsg.ProduceResponse)
		for _, tp := range pr.Topics {
			rt := kmsg.NewProduceResponseTopic()
			rt.Topic = tp.Topic
			for _, p := range tp.Partitions {
				rp := kmsg.NewProduceResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.OutOfOrderSequenceNumber.Code
				rp.LogStartOffset = 0
				rt.TopicID = tp.TopicID
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
	if _, err := wait(t, ctx, pub("b")); err != nil {
		t.Fatalf("franz-go resends under a new producer id; the record failed: %v", err)
	}
	// franz-go calls back on a goroutine of its own: wait for it.
	deadline := time.Now().Add(10 * time.Second)
	for counter(t, reg, "walbox_kafka_data_loss_total", "orders") < 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if got := counter(t, reg, "walbox_kafka_data_loss_total", "orders"); got != 1 {
		t.Fatalf("walbox_kafka_data_loss_total{topic=orders} = %v, want 1\n%s", got, logs.String())
	}
	l := logs.String()
	if !strings.Contains(l, `"level":"error"`) || !strings.Contains(l, `"topic":"orders"`) || !strings.Contains(l, `"partition":0`) {
		t.Fatalf("no error log naming topic orders and partition 0:\n%s", l)
	}
}

// minISR is topic's min.insync.replicas as the brokers report it.
func minISR(t *testing.T, ctx context.Context, adm *kadm.Client, topic string) string {
	t.Helper()
	rcs, err := adm.DescribeTopicConfigs(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	rc, err := rcs.On(topic, nil)
	if err != nil || rc.Err != nil {
		t.Fatalf("describe %s: %v %v", topic, err, rc.Err)
	}
	for _, c := range rc.Configs {
		if c.Key == "min.insync.replicas" && c.Value != nil {
			return *c.Value
		}
	}
	return ""
}

// TestEnsureTopicsAsksTwoInSyncReplicas: with three replicas or more, an
// acks=all write is only as durable as min.insync.replicas brokers. Whatever
// the replication factor came from (the config, or the brokers' default),
// walbox sets min.insync.replicas=2 on every topic it manages, the
// dead-letter topic included, and warns once, with the fix, about a topic it
// does not manage (issue 35, item 7).
func TestEnsureTopicsAsksTwoInSyncReplicas(t *testing.T) {
	kc := kafkatest.NewCluster(t) // three brokers: the default replication factor is 3
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, name := range []string{"existing", "owned"} {
		if _, err := kc.Admin.CreateTopics(ctx, 2, 3, nil, name); err != nil {
			t.Fatal(err)
		}
	}
	s, _, logs := newObservedSink(t, kc.ListenAddrs())
	specs := []kafkasink.TopicSpec{
		{Name: "fresh", Manage: true},    // created by walbox with the brokers' default replication factor
		{Name: "existing", Manage: true}, // walbox's, already there
		{Name: "owned"},                  // the platform team's
		{Name: "dlq", Partitions: 1, Manage: true, MaxMessageBytes: 2 << 20},
	}
	for range 2 {
		if _, err := s.EnsureTopics(ctx, specs); err != nil {
			t.Fatal(err)
		}
	}
	for topic, want := range map[string]string{"fresh": "2", "existing": "2", "dlq": "2", "owned": "1"} {
		if got := minISR(t, ctx, kc.Admin, topic); got != want {
			t.Errorf("topic %s: min.insync.replicas = %q, want %q\n%s", topic, got, want, logs.String())
		}
	}
	var warned []string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, `"level":"warn"`) && strings.Contains(line, "min.insync.replicas=2") {
			warned = append(warned, line)
		}
	}
	if len(warned) != 1 || !strings.Contains(warned[0], `"topic":"owned"`) {
		t.Errorf("want one warning with the fix, for topic owned; got %d:\n%s", len(warned), logs.String())
	}
}
