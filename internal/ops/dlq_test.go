package ops

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

func TestDLQListAndRetry(t *testing.T) {
	e := newEnv(t)
	ctx := testCtx(t)
	e.startRelay()
	good := e.insert("orders.created", `{"ok":1}`)
	later := e.insert("unrouted.thing", `{"u":1}`)
	never := e.insert("nowhere.thing", `{"w":1}`)
	e.waitMsgs("ORDERS", 1)
	e.waitMsgs("WALBOX_DLQ", 2)

	dls, total, err := DLQList(ctx, e.cfg, 0)
	if err != nil || total != 2 || len(dls) != 2 {
		t.Fatalf("list: %d %+v %v", total, dls, err)
	}
	if dls[0].ID != later || dls[0].OriginalSubject != "unrouted.thing" || !strings.Contains(dls[0].Reason, "no configured stream captures") || dls[0].Seq == 0 {
		t.Errorf("first dead letter: %+v", dls[0])
	}
	var out bytes.Buffer
	PrintDeadLetters(&out, dls, total, "WALBOX_DLQ")
	mustContain(t, "dlq list", out.String(), "SEQ", "ORIGINAL SUBJECT", "REASON", later, never, "unrouted.thing", "nowhere.thing")
	if strings.Contains(out.String(), good) {
		t.Errorf("dlq list shows a delivered event:\n%s", out.String())
	}
	if dls, total, _ := DLQList(ctx, e.cfg, 1); len(dls) != 1 || total != 2 {
		t.Errorf("--limit 1: %d of %d", len(dls), total)
	}
	out.Reset()
	PrintDeadLetters(&out, dls[:1], total, "WALBOX_DLQ")
	mustContain(t, "limited list", out.String(), "1 of 2 shown")
	js, _ := json.Marshal(dls)
	if !strings.Contains(string(js), `"original_subject":"unrouted.thing"`) {
		t.Errorf("JSON: %s", js)
	}

	// Nothing captures either subject yet: retry asks, and "n" changes nothing.
	out.Reset()
	if _, err := DLQRetry(ctx, e.cfg, DLQRetryOptions{All: true, In: strings.NewReader("n\n"), Out: &out}); !errors.Is(err, ErrAborted) {
		t.Fatalf("retry answered n: %v", err)
	}
	// A stream for unrouted.> appears (the operator fixed the config).
	if _, err := e.connectJS().CreateStream(ctx, jetstream.StreamConfig{Name: "UNROUTED", Subjects: []string{"unrouted.>"}}); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	res, err := DLQRetry(ctx, e.cfg, DLQRetryOptions{All: true, In: strings.NewReader("y\n"), Out: &out})
	if err != nil {
		t.Fatal(err)
	}
	if res.Retried != 1 || res.Skipped != 1 || res.AlreadyStored != 0 {
		t.Fatalf("retry: %+v\n%s", res, out.String())
	}
	mustContain(t, "retry output", out.String(), "republished to UNROUTED", "deleted from WALBOX_DLQ", "nowhere.thing: skipped: no stream captures nowhere.thing")
	if ids := e.streamIDs("UNROUTED"); len(ids) != 1 || ids[0] != later {
		t.Fatalf("UNROUTED holds %v, want [%s]", ids, later)
	}
	st, _ := e.connectJS().Stream(ctx, "UNROUTED")
	m, err := st.GetLastMsgForSubject(ctx, "unrouted.thing")
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get("Walbox-Dlq-Reason") != "" || m.Header.Get(HeaderDLQRetriedFrom) == "" || string(m.Data) != `{"u": 1}` {
		t.Errorf("retried message: %v %s", m.Header, m.Data)
	}
	dls, total, err = DLQList(ctx, e.cfg, 0)
	if err != nil || total != 1 || dls[0].ID != never {
		t.Fatalf("DLQ after retry: %d %+v %v", total, dls, err)
	}

	// --seq retries one by sequence number; still nowhere to go.
	out.Reset()
	res, err = DLQRetry(ctx, e.cfg, DLQRetryOptions{Seqs: []uint64{dls[0].Seq}, Yes: true, Out: &out})
	if err != nil || res.Skipped != 1 {
		t.Fatalf("retry --seq: %+v %v", res, err)
	}
	if _, err := DLQRetry(ctx, e.cfg, DLQRetryOptions{Yes: true}); err == nil {
		t.Fatal("retry without --seq or --all accepted")
	}
}
