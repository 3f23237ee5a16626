package ops

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/claim"
	"github.com/walbox/walbox/relay/kafkasink"
)

func TestTailSinceAndLimit(t *testing.T) {
	e := newEnv(t)
	e.startRelay()
	long := `{"text":"` + strings.Repeat("x", 200) + `"}`
	ids := []string{e.insert("orders.created", `{"n":1}`), e.insert("payments.settled", `{"n":2}`), e.insert("orders.shipped", long)}
	e.waitMsgs("ORDERS", 2)

	var out bytes.Buffer
	n, err := Tail(e.ctx, e.cfg, TailOptions{Subject: "orders.>", Since: time.Hour, Limit: 2}, &out)
	if err != nil || n != 2 {
		t.Fatalf("tail: %d %v\n%s", n, err, out.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("want a header and 2 lines:\n%s", out.String())
	}
	mustContain(t, "tail header", lines[0], "STORED", "SUBJECT", "COMMIT->ACK", "PAYLOAD")
	mustContain(t, "first line", lines[1], "orders.created", ids[0], `{"n": 1}`)
	mustContain(t, "second line", lines[2], "orders.shipped", ids[2], "…")
	if strings.Contains(out.String(), "payments.settled") {
		t.Errorf("tail orders.> printed a payments event:\n%s", out.String())
	}
	if len(lines[2]) > 250 {
		t.Errorf("payload not cut at 80 characters: %s", lines[2])
	}
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		if len(f) < 6 || f[4] == "-" {
			t.Errorf("no commit-to-ack latency in %q", l)
		}
	}

	// --full prints the whole payload; --stream names the stream.
	out.Reset()
	if _, err := Tail(e.ctx, e.cfg, TailOptions{Subject: "orders.shipped", Stream: "ORDERS", Since: time.Hour, Full: true, Limit: 1}, &out); err != nil {
		t.Fatal(err)
	}
	mustContain(t, "tail --full", out.String(), strings.Repeat("x", 200))

	// Without --since only new events: keep committing until one shows.
	out.Reset()
	done := make(chan error, 1)
	tctx, cancel := context.WithCancel(e.ctx)
	defer cancel()
	go func() {
		_, err := Tail(tctx, e.cfg, TailOptions{Subject: "payments.*", Limit: 1}, &out)
		done <- err
	}()
	var newID string
wait:
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			break wait
		case <-time.After(300 * time.Millisecond):
			newID = e.insert("payments.refunded", `{"n":9}`)
		case <-e.ctx.Done():
			t.Fatal("tail of new events never returned")
		}
	}
	if strings.Contains(out.String(), ids[1]) || !strings.Contains(out.String(), "payments.refunded") {
		t.Errorf("tail without --since showed old events or no new one (last new id %s):\n%s", newID, out.String())
	}

	// Ctrl-C: a cancelled context ends it without an error.
	cctx, ccancel := context.WithCancel(e.ctx)
	go func() { time.Sleep(300 * time.Millisecond); ccancel() }() // pacing: Ctrl-C while tail waits for messages
	if _, err := Tail(cctx, e.cfg, TailOptions{Subject: "nothing.here", Stream: "ORDERS"}, &out); err != nil {
		t.Fatalf("tail ended by e.ctx: %v", err)
	}
	if _, err := Tail(e.ctx, e.cfg, TailOptions{Subject: "nothing.here"}, &out); err == nil || !strings.Contains(err.Error(), "--stream") {
		t.Fatalf("tail of a subject no stream captures: %v", err)
	}
}

// produce stores an event in topic as the relay would: its id in
// Walbox-Event-Id, committed commitAgo before now, stored at ts (zero:
// now).
func (e *kafkaEnv) produce(topic, id, key, payload string, commitAgo time.Duration, ts time.Time) {
	e.t.Helper()
	h := relay.Header{}
	h.Set(relay.HeaderMsgID, id)
	h.Set(relay.HeaderCommitTime, time.Now().Add(-commitAgo).UTC().Format(time.RFC3339Nano))
	rec := &kgo.Record{Topic: topic, Key: []byte(key), Value: []byte(payload), Headers: kafkasink.ToKafkaHeaders(h), Timestamp: ts}
	if err := e.kafka.Client.ProduceSync(testCtx(e.t), rec).FirstErr(); err != nil {
		e.t.Fatalf("produce %s to %s: %v", id, topic, err)
	}
}

func TestTailKafka(t *testing.T) {
	e := newKafkaEnv(t)
	e.createAll()
	e.produce("orders.created", "old-1", "k1", `{"old":true}`, 0, time.Now().Add(-2*time.Hour))
	for i := range 3 {
		e.produce("orders.created", fmt.Sprintf("before-%d", i), fmt.Sprintf("k%d", i), `{"n":1}`, 250*time.Millisecond, time.Time{})
	}
	e.produce("payments.settled", "other-topic", "k1", `{}`, 0, time.Time{})

	// --since 1h: the three stored in the last hour, then new ones.
	out := &relaytest.Buffer{}
	done := make(chan error, 1)
	ctx, cancel := context.WithTimeout(testCtx(t), 30*time.Second)
	defer cancel()
	go func() {
		n, err := Tail(ctx, e.cfg, TailOptions{Subject: "orders.created", Since: time.Hour, Limit: 5}, out)
		if err == nil && n != 5 {
			err = fmt.Errorf("tail showed %d records, want 5", n)
		}
		done <- err
	}()
	waitTailOutput(t, out, "before-0", "before-1", "before-2")
	e.produce("orders.created", "after-1", "k9", `{"n":2}`, 0, time.Time{})
	e.produce("orders.created", "after-2", "k9", `{"n":3}`, 0, time.Time{})
	if err := <-done; err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	text := out.String()
	t.Logf("\n%s", text)
	mustContain(t, "tail --since 1h", text, "COMMIT->STORED", "EVENT ID (Walbox-Event-Id)", "after-1", "after-2", `{"n":3}`)
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, "before-") && !(strings.Contains(l, "orders.created") && strings.Contains(l, "ms") && !strings.Contains(l, " - ")) {
			t.Errorf("line without topic or commit->stored latency: %q", l)
		}
	}
	if strings.Contains(text, "old-1") || strings.Contains(text, "other-topic") {
		t.Errorf("tail --since 1h showed a record stored 2h ago or another topic's:\n%s", text)
	}

	// Without --since: only what is stored after the start.
	out = &relaytest.Buffer{}
	go func() {
		_, err := Tail(ctx, e.cfg, TailOptions{Subject: "orders.created", Limit: 1}, out)
		done <- err
	}()
	waitTailOutput(t, out, "PAYLOAD")
	e.produce("orders.created", "new-only", "k1", `{}`, 0, time.Time{})
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if text := out.String(); !strings.Contains(text, "new-only") || strings.Contains(text, "before-") || strings.Contains(text, "after-") {
		t.Errorf("tail without --since:\n%s", text)
	}

	if _, err := Tail(ctx, e.cfg, TailOptions{Subject: "orders.>"}, out); err == nil || !strings.Contains(err.Error(), "name one topic exactly") {
		t.Errorf("a wildcard: %v", err)
	}
	if _, err := Tail(ctx, e.cfg, TailOptions{Subject: "no.such.topic", Limit: 1}, out); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("an unknown topic: %v", err)
	}
}

// waitTailOutput waits until out holds every one of wants.
func waitTailOutput(t *testing.T, out *relaytest.Buffer, wants ...string) {
	t.Helper()
	relaytest.Eventually(t, 20*time.Second, fmt.Sprintf("tail output holding %q", wants), func() bool {
		for _, w := range wants {
			if !strings.Contains(out.String(), w) {
				return false
			}
		}
		return true
	})
}

func TestTailShowsAClaimCheckReferenceInThePayloadsPlace(t *testing.T) {
	v := claim.Ref{Store: claim.StoreJetStream, Bucket: "ORDERS_CLAIMS", Key: "app/walbox/public.outbox_events/42", Size: 3 << 20 / 2, SHA256: strings.Repeat("0", 64)}.String()
	if got, want := claimLine(v), "CLAIM CHECK: 1.5 MiB in jetstream bucket ORDERS_CLAIMS, key app/walbox/public.outbox_events/42"; got != want {
		t.Fatalf("%q, want %q", got, want)
	}
}
