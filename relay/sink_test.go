package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natstest"
)

// next waits for the sink's next reply and resolves it.
func next(t *testing.T, s *JetStreamSink) Outcome {
	t.Helper()
	select {
	case m := <-s.Replies():
		o, ok := s.Resolve(m)
		if !ok {
			t.Fatalf("reply %q answers no publish of this sink", m.Subject)
		}
		return o
	case <-time.After(10 * time.Second):
		t.Fatal("no reply within 10s")
		return Outcome{}
	}
}

// Against a real nats-server: acks come back with their tokens, a
// duplicate is reported as one, a server-side refusal is an API error the
// relay classifies as before, a subject no stream captures is a 503, and a
// lost connection fails everything in flight at once.
func TestJetStreamSinkRepliesCarryTokensAcksAndErrors(t *testing.T) {
	srv := natstest.New(t)
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	s, err := NewJetStreamSink(nc, 5*time.Second, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	msg := func(id string) *nats.Msg {
		return &nats.Msg{Subject: "orders.created", Data: []byte(`{}`), Header: nats.Header{HeaderMsgID: {id}}}
	}
	seen := map[uint64]bool{}
	tokens := make([]uint64, 0, 3)
	for _, id := range []string{"a", "b", "a"} {
		tok, err := s.Publish(msg(id))
		if err != nil {
			t.Fatal(err)
		}
		if seen[tok] {
			t.Fatalf("token %d reused", tok)
		}
		seen[tok] = true
		tokens = append(tokens, tok)
	}
	for i, want := range []jetstream.PubAck{{Stream: "ORDERS", Sequence: 1}, {Stream: "ORDERS", Sequence: 2}, {Stream: "ORDERS", Sequence: 1, Duplicate: true}} {
		o := next(t, s)
		if o.Err != nil || o.Token != tokens[i] || o.Ack != want {
			t.Fatalf("reply %d = %+v, want token %d and %+v", i, o, tokens[i], want)
		}
	}

	// Strict order refused by the server: an API error, transient.
	m := msg("c")
	m.Header.Set(HeaderExpectedLastMsgID, "not-the-last")
	tok, err := s.Publish(m)
	if err != nil {
		t.Fatal(err)
	}
	o := next(t, s)
	var apiErr *jetstream.APIError
	if o.Token != tok || !errors.As(o.Err, &apiErr) || s.Classify(o.Err) != Transient {
		t.Fatalf("wrong-last-msg-id reply = %+v (class %v), want a transient API error for token %d", o, s.Classify(o.Err), tok)
	}

	// No stream captures the subject.
	tok, err = s.Publish(&nats.Msg{Subject: "nowhere.x", Data: []byte(`{}`), Header: nats.Header{HeaderMsgID: {"d"}}})
	if err != nil {
		t.Fatal(err)
	}
	if o := next(t, s); o.Token != tok || !errors.Is(o.Err, jetstream.ErrNoStreamResponse) {
		t.Fatalf("reply for an uncaptured subject = %+v, want ErrNoStreamResponse", o)
	}

	// The connection drops: one outcome fails everything in flight.
	srv.Stop()
	o = next(t, s)
	if !o.All || !errors.Is(o.Err, nats.ErrDisconnected) {
		t.Fatalf("after the server stopped: %+v, want All with ErrDisconnected", o)
	}
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for !nc.IsConnected() {
		if time.Now().After(deadline) {
			t.Fatal("client did not reconnect")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The inbox subscription came back with the connection.
	var last Outcome
	for time.Now().Before(deadline) {
		tok, err = s.Publish(msg("e"))
		if err != nil {
			t.Fatal(err)
		}
		last = next(t, s)
		if last.Err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond) // the stream may still be recovering
	}
	if last.Err != nil || last.Token != tok || last.Ack.Stream != "ORDERS" {
		t.Fatalf("after reconnecting: %+v, want an ack for token %d", last, tok)
	}
}
