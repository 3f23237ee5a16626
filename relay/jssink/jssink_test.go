package jssink_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

func TestClassify(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want relay.ErrorClass
	}{
		{"max payload", nats.ErrMaxPayload, relay.Permanent},
		{"bad subject", fmt.Errorf("publish: %w", nats.ErrBadSubject), relay.Permanent},
		{"no responders", nats.ErrNoResponders, relay.Transient},
		{"timeout", nats.ErrTimeout, relay.Transient},
		{"stream not found", &jetstream.APIError{Code: 404, ErrorCode: jetstream.JSErrCodeStreamNotFound}, relay.Transient},
		{"wrong last sequence", &jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequence}, relay.Transient},
		{"message too large", &jetstream.APIError{Code: 400, ErrorCode: 10054}, relay.Permanent},
		{"server error", &jetstream.APIError{Code: 503}, relay.Transient},
		{"other 4xx", &jetstream.APIError{Code: 400, ErrorCode: 10999}, relay.Permanent},
	}
	for _, tt := range tests {
		if got := jssink.Classify(tt.err); got != tt.want {
			t.Errorf("%s: Classify(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}

// TestPublishResolvesInOrderAndRefusesAWrongExpectation publishes through
// the sink to a real JetStream: the futures resolve with the stream and
// sequence, a duplicate id is reported as one, and a publish whose expected
// last sequence is wrong fails with relay.ErrOrderRefused.
func TestPublishResolvesInOrderAndRefusesAWrongExpectation(t *testing.T) {
	srv := natstest.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	sink, err := jssink.New(nc, 5*time.Second, 256)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := jssink.EnsureStreams(ctx, sink.JetStream(), []jssink.StreamSpec{{Name: "ORDERS", Subjects: []string{"orders.>"}, Storage: "memory", Manage: true}}); err != nil {
		t.Fatal(err)
	}
	var futs []relay.Future
	for i := range 100 {
		m := &relay.Msg{Subject: "orders.created", Header: relay.Header{}, Data: []byte(`{}`)}
		m.Header.Set(relay.HeaderMsgID, fmt.Sprintf("e%d", i%90)) // the last 10 repeat ids
		m.Expect, m.ExpectSet = uint64(i), i < 90
		f, err := sink.Publish(m)
		if err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
		futs = append(futs, f)
	}
	for i, f := range futs {
		select {
		case a := <-f.Ok():
			switch {
			case a.Stream != "ORDERS":
				t.Fatalf("ack %d: stream %q", i, a.Stream)
			case i < 90 && (a.Sequence != uint64(i+1) || a.Duplicate):
				t.Fatalf("ack %d: sequence %d duplicate %v, want %d and new", i, a.Sequence, a.Duplicate, i+1)
			case i >= 90 && !a.Duplicate:
				t.Fatalf("ack %d: a repeated id was stored again (sequence %d)", i, a.Sequence)
			}
		case err := <-f.Err():
			t.Fatalf("publish %d failed: %v", i, err)
		case <-ctx.Done():
			t.Fatalf("publish %d: no ack", i)
		}
	}

	m := &relay.Msg{Subject: "orders.created", Header: relay.Header{relay.HeaderMsgID: {"late"}}, Data: []byte(`{}`), Expect: 3, ExpectSet: true}
	f, err := sink.Publish(m)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case a := <-f.Ok():
		t.Fatalf("stored at %d despite expecting last sequence 3", a.Sequence)
	case err := <-f.Err():
		if !errors.Is(err, relay.ErrOrderRefused) {
			t.Fatalf("err = %v, want relay.ErrOrderRefused", err)
		}
		if jssink.Classify(err) != relay.Transient {
			t.Fatalf("a refused expectation must be transient (resent in order)")
		}
	case <-ctx.Done():
		t.Fatal("no answer")
	}

	tail, err := sink.StoredTail(ctx, "ORDERS", "none", 10)
	if err != nil {
		t.Fatal(err)
	}
	if !tail.StateRead || tail.LastSeq != 90 || tail.Found {
		t.Fatalf("tail = %+v, want last sequence 90 and nothing of source none", tail)
	}
}
