package console_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/kafkatest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// The four pages with sink: kafka (kfake, franz-go's in-process Kafka).
func TestConsoleWithKafkaTailsRetriesAndReports(t *testing.T) {
	t.Parallel()
	k := kafkatest.NewCluster(t)
	w := newWorld(t, k.Sink(
		config.KafkaTopic{Name: "orders.created", Partitions: 2, ReplicationFactor: 3},
		config.KafkaTopic{Name: "payments.settled", Partitions: 1, ReplicationFactor: 3},
	))
	r := w.startRelay()
	ctx := tab(t)

	// Overview: the slot streams, the brokers answer.
	run(t, ctx, navigate(w.base+"#overview"))
	waitJS(t, ctx, 15*time.Second, "the slot shown streaming", `document.getElementById("slot-state").innerText === "streaming"`)
	waitJS(t, ctx, 15*time.Second, "the sink ready", `document.getElementById("sink-health").innerText === "ready"`)

	// Live tail: topic [partition] and offset.
	run(t, ctx, navigate(w.base+"#tail"))
	waitJS(t, ctx, 10*time.Second, "the live feed", `document.getElementById("tail-status").innerText === "live"`)
	start := time.Now()
	id := w.insert("orders.created", `{"order": "kafka-1"}`)
	sel := fmt.Sprintf(`#tail-rows tr[data-id=%q]`, id)
	waitJS(t, ctx, 5*time.Second, "the event in the live tail", fmt.Sprintf(`document.querySelector(%q) !== null`, sel))
	// Logged, not asserted (a speed target; see the NATS tail's test).
	t.Logf("the event showed %v after its commit", time.Since(start).Round(time.Millisecond))
	if got := text(t, ctx, sel); !strings.Contains(got, "orders.created [") || !strings.Contains(got, "kafka-1") {
		t.Errorf("tail row %q lacks its topic [partition] or payload", got)
	}
	// Open it: the record read back from its partition and offset.
	run(t, ctx, js(fmt.Sprintf(`document.querySelector(%q).click()`, sel)))
	waitJS(t, ctx, 10*time.Second, "the stored record", `(document.getElementById("tail-payload") || {innerText: ""}).innerText.includes("kafka-1")`)
	screenshot(t, ctx, "kafka-tail")

	// Dead letters: an undeclared topic; retried once it exists.
	poison := w.insert("unrouted.thing", `{"u": 1}`)
	run(t, ctx, navigate(w.base+"#dlq"))
	row := `#dlq-rows tr[data-seq]`
	waitJS(t, ctx, 20*time.Second, "the poison row under Dead letters", fmt.Sprintf(`(() => {
		document.getElementById("dlq-refresh").click();
		const r = document.querySelector(%q);
		return r !== null && r.innerText.includes(%q);
	})()`, row, poison))
	// What the page says to do: add the topic to kafka.topics and restart.
	r.stop()
	w.cfg.Kafka.Topics = append(w.cfg.Kafka.Topics, config.KafkaTopic{Name: "unrouted.thing", Partitions: 1, ReplicationFactor: 3})
	w.startRelay()
	run(t, ctx, click("#dlq-refresh"))
	waitJS(t, ctx, 10*time.Second, "the destination", fmt.Sprintf(`(document.querySelector(%q) || {innerText: ""}).innerText.includes("unrouted.thing (unrouted.thing)")`, row))
	run(t, ctx, typeInto("#token", testToken), click(row+` input[type=checkbox]`), click("#dlq-retry"))
	waitJS(t, ctx, 2*time.Second, "the confirmation", `!document.getElementById("dlq-confirm").hidden`)
	if c := text(t, ctx, "#dlq-confirm"); !strings.Contains(c, "unrouted.thing") || !strings.Contains(c, "walbox.dlq") {
		t.Errorf("the confirmation does not say where it goes: %q", c)
	}
	run(t, ctx, click("#dlq-confirm-yes"))
	waitJS(t, ctx, 30*time.Second, "the retry's result", `document.getElementById("dlq-result").innerText.startsWith("retried 1")`)
	waitJS(t, ctx, 10*time.Second, "the list empty", `document.querySelectorAll("#dlq-rows tr").length === 0`)
	// Read back with a client of the test's own.
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.ListenAddrs()...), kgo.ConsumeTopics("unrouted.thing"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	fctx, cancel := contextWithTimeout(t, 10*time.Second)
	defer cancel()
	fs := cl.PollFetches(fctx)
	var ids []string
	fs.EachRecord(func(r *kgo.Record) { ids = append(ids, kafkasink.FromKafkaHeaders(r.Headers).Get(relay.HeaderMsgID)) })
	if len(ids) != 1 || ids[0] != poison {
		t.Errorf("unrouted.thing holds %v, want [%s]", ids, poison)
	}

	// Doctor: the Kafka checks.
	run(t, ctx, navigate(w.base+"#doctor"))
	waitJS(t, ctx, 30*time.Second, "the doctor's Kafka checks", `document.getElementById("doctor-rows").innerText.includes("kafka.connect")`)
}
