package ops

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
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
