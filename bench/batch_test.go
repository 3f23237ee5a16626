package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natstest"
)

// The batched ceiling's loop stores every message once, over batches of
// which the last is short, on the nats-server the benchmark embeds.
func TestFastPublishAllStoresEveryMessage(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ns := natstest.New(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "B", Subjects: []string{"b.>"},
		Storage: jetstream.FileStorage, Duplicates: time.Minute, AllowBatchPublish: true})
	if err != nil {
		t.Fatal(err)
	}
	const n = 2_500
	msgs := make([]*nats.Msg, n)
	for i := range msgs {
		msgs[i] = &nats.Msg{Subject: "b.x", Data: []byte(payloadFor(i, 200, 0)),
			Header: nats.Header{"Nats-Msg-Id": []string{uuid.NewString()}}}
	}
	var last int64
	if err := fastPublishAll(ctx, js, n, 1_000, func(i int) *nats.Msg { return msgs[i] }, func(v int64) { last = v }); err != nil {
		t.Fatal(err)
	}
	if last != n {
		t.Errorf("progress ended at %d, want %d", last, n)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != n {
		t.Errorf("stream holds %d messages, want %d", info.State.Msgs, n)
	}
}

func TestRelayBatchCounts(t *testing.T) {
	body := strings.Join([]string{
		"# HELP walbox_nats_batches_total Fast batches opened (nats.fast_batch).",
		"# TYPE walbox_nats_batches_total counter",
		"walbox_nats_batches_total 4",
		"# HELP walbox_nats_batched_messages_total Messages published in fast batches.",
		"# TYPE walbox_nats_batched_messages_total counter",
		"walbox_nats_batched_messages_total 49968",
		"# HELP walbox_nats_batch_unproven_total Unproven.",
		"# TYPE walbox_nats_batch_unproven_total counter",
		"walbox_nats_batch_unproven_total 1",
		"",
	}, "\n")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		fmt.Fprint(w, body)
	}))
	defer srv.Close()
	got, err := relayBatchCounts(context.Background(), strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (batchCounts{Batches: 4, Batched: 49968, Unproven: 1}); got != want {
		t.Errorf("got %+v, want %+v", got, want)
	}
	if d := (batchCounts{Batches: 5, Batched: 50000, Unproven: 1}).since(got); d != (batchCounts{Batches: 1, Batched: 32}) {
		t.Errorf("since: %+v", d)
	}

	missing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "# TYPE other_total counter\nother_total 1\n")
	}))
	defer missing.Close()
	if _, err := relayBatchCounts(context.Background(), strings.TrimPrefix(missing.URL, "http://")); err == nil {
		t.Error("no error for metrics without the fast-batch counters")
	}
}
