package natstest

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// These tests pin down the server behaviour walbox's ordering relies on.
//
// The reproduction (for an upstream report): on a replicated stream
// nats-server 2.15 checks Nats-Expected-Last-Msg-Id only when a replica
// applies the entry, not before the leader proposes it. A mismatch there is
// an apply error that no replica can get past: every replica logs
// "Error applying stream entries ... last msgid mismatch" and "critical write
// error", and the stream stops storing for good (the entry fails again on
// every restart). On a single server the same header is a plain rejection.
// Nats-Expected-Last-Sequence is checked by the leader before it proposes,
// so a mismatch is a rejection on R1 and R3 alike.

func r3Stream(t *testing.T, name string) (*Cluster, jetstream.JetStream) {
	t.Helper()
	cl := NewCluster(t, 3)
	_, js, _ := connect(t, cl.URLs())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	createStream(ctx, t, js, name, name+".>", 3)
	WaitStreamReady(t, cl, js, name, name+".a")
	return cl, js
}

func publishWith(ctx context.Context, js jetstream.JetStream, subject, id string, hdr map[string]string) (*jetstream.PubAck, error) {
	m := nats.NewMsg(subject)
	m.Data = []byte(id)
	m.Header.Set(jetstream.MsgIDHeader, id)
	for k, v := range hdr {
		m.Header.Set(k, v)
	}
	return js.PublishMsg(ctx, m, jetstream.WithRetryAttempts(0))
}

func TestServerWedgesR3StreamOnExpectedLastMsgIDMismatch(t *testing.T) {
	_, js := r3Stream(t, "WEDGE")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := publishWith(ctx, js, "WEDGE.a", "id-1", nil); err != nil {
		t.Fatalf("first publish: %v", err)
	}
	// The expectation does not hold: a single server refuses the message.
	// A replicated stream proposes it and then fails to apply it.
	short, cancelShort := context.WithTimeout(ctx, 3*time.Second)
	_, err := publishWith(short, js, "WEDGE.a", "id-2", map[string]string{"Nats-Expected-Last-Msg-Id": "not-id-1"})
	cancelShort()
	t.Logf("publish with a wrong Nats-Expected-Last-Msg-Id: %v", err)
	// From here on the stream stores nothing: every later publish times out.
	short, cancelShort = context.WithTimeout(ctx, 3*time.Second)
	_, err = publishWith(short, js, "WEDGE.a", "id-3", nil)
	cancelShort()
	if err == nil {
		t.Fatal("the R3 stream still stores after an Expected-Last-Msg-Id mismatch: the server no longer wedges " +
			"(upstream fixed it?); walbox's choice of Nats-Expected-Last-Sequence still holds, but update this reproduction")
	}
	t.Logf("plain publish after the mismatch: %v (the stream is wedged)", err)
}

func TestExpectedLastSequenceMismatchIsARejection(t *testing.T) {
	for _, replicas := range []int{1, 3} {
		t.Run("R"+strconv.Itoa(replicas), func(t *testing.T) {
			var js jetstream.JetStream
			if replicas == 3 {
				_, js = r3Stream(t, "SEQ")
			} else {
				s := New(t)
				_, js, _ = connect(t, s.URL())
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "SEQ", Subjects: []string{"SEQ.>"}}); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			// Pipelined: three in flight, each expecting its predecessor's sequence.
			var futs []jetstream.PubAckFuture
			for i := range 3 {
				m := nats.NewMsg("SEQ.a")
				m.Header.Set(jetstream.MsgIDHeader, "id-"+strconv.Itoa(i+1))
				m.Header.Set("Nats-Expected-Last-Sequence", strconv.Itoa(i))
				f, err := js.PublishMsgAsync(m, jetstream.WithRetryAttempts(0))
				if err != nil {
					t.Fatal(err)
				}
				futs = append(futs, f)
			}
			for i, f := range futs {
				select {
				case ack := <-f.Ok():
					if ack.Sequence != uint64(i+1) {
						t.Fatalf("message %d stored at %d", i+1, ack.Sequence)
					}
				case err := <-f.Err():
					t.Fatalf("pipelined publish %d: %v", i+1, err)
				case <-ctx.Done():
					t.Fatal("no ack")
				}
			}
			_, err := publishWith(ctx, js, "SEQ.a", "id-x", map[string]string{"Nats-Expected-Last-Sequence": "7"})
			var apiErr *jetstream.APIError
			if !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequence {
				t.Fatalf("wrong expected sequence: got %v, want a wrong-last-sequence rejection", err)
			}
			ack, err := publishWith(ctx, js, "SEQ.a", "id-4", map[string]string{"Nats-Expected-Last-Sequence": "3"})
			if err != nil || ack.Sequence != 4 {
				t.Fatalf("the stream must go on storing after a rejection: ack %+v, err %v", ack, err)
			}
		})
	}
}
