package consumerlibtest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/relaytest"
)

// claimRef is a Walbox-Claim-Check value for key with data's size and digest.
func claimRef(key string, data []byte) string {
	sum := sha256.Sum256(data)
	return fmt.Sprintf("store=jetstream&bucket=USERS_CLAIMS&key=%s&size=%d&sha256=%s", key, len(data), hex.EncodeToString(sum[:]))
}

// The handler sees a claimed event's payload, fetched and verified; an
// object whose bytes do not match its reference is dead-lettered with an
// error naming the event and the key; a header that does not parse too.
func TestClaimCheckIsResolvedAndVerified(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	ctx := relaytest.Ctx(t)
	obs, err := e.js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: "USERS_CLAIMS"})
	if err != nil {
		t.Fatal(err)
	}
	payload := []byte(`{"user_id": "u-big"}`)
	if _, err := obs.PutBytes(ctx, "src/public.outbox_events/evt-big", payload); err != nil {
		t.Fatal(err)
	}
	if _, err := obs.PutBytes(ctx, "src/public.outbox_events/evt-bad", []byte(`{"user_id": "other"}`)); err != nil {
		t.Fatal(err)
	}
	e.publish("user.created", "evt-big", "", map[string]string{consumer.HeaderClaimCheck: claimRef("src/public.outbox_events/evt-big", payload)})
	e.publish("user.created", "evt-bad", "", map[string]string{consumer.HeaderClaimCheck: claimRef("src/public.outbox_events/evt-bad", payload)})
	e.publish("user.created", "evt-garbled", "", map[string]string{consumer.HeaderClaimCheck: "store=jetstream&size=x"})

	var mu sync.Mutex
	seen := map[string]consumer.Message{}
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "claims", DB: e.db, OnOutcome: out.record}, func(_ context.Context, _ pgx.Tx, m consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		seen[m.ID] = m
		return nil
	})
	out.waitFor(t, "3 settled", func() bool { return out.total() == 3 })
	mu.Lock()
	got := seen["evt-big"]
	mu.Unlock()
	if string(got.Data) != string(payload) || got.Claim == nil || got.Claim.Key != "src/public.outbox_events/evt-big" {
		t.Fatalf("handler saw %q with reference %+v", got.Data, got.Claim)
	}
	for _, r := range out.snapshot() {
		switch r.msg.ID {
		case "evt-bad":
			if r.outcome != consumer.DeadLettered || !errors.Is(r.err, consumer.ErrClaimCorrupt) ||
				!strings.Contains(r.err.Error(), "evt-bad") || !strings.Contains(r.err.Error(), "src/public.outbox_events/evt-bad") {
				t.Errorf("evt-bad: %v %v, want dead-lettered as corrupt, naming the event and the key", r.outcome, r.err)
			}
		case "evt-garbled":
			if r.outcome != consumer.DeadLettered || !strings.Contains(r.err.Error(), consumer.HeaderClaimCheck) {
				t.Errorf("evt-garbled: %v %v, want dead-lettered for its header", r.outcome, r.err)
			}
		}
	}
}

// ClaimReferenceOnly hands the handler the reference and leaves the fetch to it.
func TestClaimReferenceOnlyLeavesTheFetchToTheHandler(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	e.publish("user.created", "evt-big", "", map[string]string{consumer.HeaderClaimCheck: claimRef("k", []byte("x"))})
	var mu sync.Mutex
	var got consumer.Message
	out := newOutcomes()
	e.start(consumer.Config{Stream: "USERS", Durable: "claims", DB: e.db, OnOutcome: out.record, ClaimReferenceOnly: true},
		func(_ context.Context, _ pgx.Tx, m consumer.Message) error {
			mu.Lock()
			defer mu.Unlock()
			got = m
			return nil
		})
	out.waitFor(t, "processed", func() bool { return out.count(consumer.Processed) == 1 })
	mu.Lock()
	defer mu.Unlock()
	if len(got.Data) != 0 || got.Claim == nil || got.Claim.Key != "k" || got.Claim.Size != 1 {
		t.Fatalf("handler saw %q with reference %+v, want no data and the reference", got.Data, got.Claim)
	}
}

// toClient wraps the pipe of relaytest.Proxy's connections to the server at
// server: pipe runs for the server-to-client direction, io.Copy's for the
// other. forwarded counts the bytes sent to clients.
func toClient(server string, forwarded *atomic.Int64, pipe func(dst io.Writer, src io.Reader)) func(dst io.Writer, src io.Reader) {
	return func(dst io.Writer, src io.Reader) {
		if c, ok := dst.(net.Conn); ok && c.RemoteAddr().String() == server {
			_, _ = io.Copy(dst, src) // client to server
			return
		}
		pipe(countingWriter{dst, forwarded}, src)
	}
}

type countingWriter struct {
	w io.Writer
	n *atomic.Int64
}

func (c countingWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n.Add(int64(n))
	return n, err
}

// claimedEvent stores data as a claim-check object and publishes an event
// that refers to it.
func (e *env) claimedEvent(t *testing.T, id string, data []byte) {
	t.Helper()
	ctx := relaytest.Ctx(t)
	obs, err := e.js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: "USERS_CLAIMS"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := obs.PutBytes(ctx, "src/public.outbox_events/"+id, data); err != nil {
		t.Fatal(err)
	}
	e.publish("user.created", id, "", map[string]string{consumer.HeaderClaimCheck: claimRef("src/public.outbox_events/"+id, data)})
}

// claimThrough stores data as the claim-check object of event id and
// returns a JetStream connected to the server through a proxy that runs
// pipe for what the server sends, counting what it forwards.
func (e *env) claimThrough(t *testing.T, id string, data []byte, pipe func(dst io.Writer, src io.Reader)) (jetstream.JetStream, *atomic.Int64) {
	t.Helper()
	e.claimedEvent(t, id, data)
	server := strings.TrimPrefix(e.nc.ConnectedUrl(), "nats://")
	forwarded := new(atomic.Int64)
	_, js := relaytest.JetStream(t, "nats://"+relaytest.Proxy(t, server, toClient(server, forwarded, pipe)))
	return js, forwarded
}

// A claim-check object that takes longer to arrive than nats.go's default
// JetStream timeout (5 s: 12 MiB through a link of 1.5 MiB/s takes 8 s) is
// read whole and handed to the handler, though Run's context has no
// deadline: the fetch is given time for the object's size. (Before, every
// delivery failed with an i/o timeout after 5 s and was retried.)
func TestALargeClaimOnASlowLinkIsReadWhole(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	data := bytes.Repeat([]byte("0123456789abcdef"), 12<<20/16)
	js, forwarded := e.claimThrough(t, "evt-slow", data, relaytest.Throttled(3<<19)) // 1.5 MiB/s
	var mu sync.Mutex
	var got []byte
	out := newOutcomes()
	e.startWith(js, consumer.Config{Stream: "USERS", Durable: "claims", DB: e.db, OnOutcome: out.record}, func(_ context.Context, _ pgx.Tx, m consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		got = m.Data
		return nil
	})
	took := relaytest.WhileProgressing(t, 30*time.Second, "the slow event settled", func() bool { return out.total() >= 1 },
		func() string { return fmt.Sprintf("%d bytes forwarded", forwarded.Load()) })
	r := out.snapshot()[0]
	if r.outcome != consumer.Processed {
		t.Fatalf("first delivery: %v (%v), want processed", r.outcome, r.err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !bytes.Equal(got, data) {
		t.Fatalf("the handler got %d bytes, want the object's %d byte for byte", len(got), len(data))
	}
	t.Logf("12 MiB read through 1.5 MiB/s in %v", took.Round(time.Millisecond))
}

// A fetch whose object stops arriving fails once it has taken 10 s plus the
// object's size at Config.ClaimMinRate (8 MiB at 8 MiB/s: 11 s), naming the
// object, how much of it came and the setting; the delivery is retried, not
// waited on for ever.
func TestAStalledClaimFetchIsRetried(t *testing.T) {
	e := newEnv(t, jetstream.StreamConfig{})
	data := bytes.Repeat([]byte("0123456789abcdef"), 8<<20/16)
	ctx := t.Context()
	js, _ := e.claimThrough(t, "evt-stalled", data, func(dst io.Writer, src io.Reader) {
		// 2 MiB, then nothing until the test ends.
		_, _ = io.CopyN(dst, src, 2<<20)
		<-ctx.Done()
	})
	out := newOutcomes()
	e.startWith(js, consumer.Config{Stream: "USERS", Durable: "claims", DB: e.db, OnOutcome: out.record, ClaimMinRate: 8 << 20},
		func(context.Context, pgx.Tx, consumer.Message) error { return nil })
	out.waitFor(t, "the stalled event settled", func() bool { return out.total() >= 1 })
	r := out.snapshot()[0]
	if r.outcome != consumer.Retrying || r.err == nil || !strings.Contains(r.err.Error(), "of 8388608 bytes arrived in 11s") ||
		!strings.Contains(r.err.Error(), "evt-stalled") || !strings.Contains(r.err.Error(), "ClaimMinRate") {
		t.Fatalf("first delivery: %v (%v), want retrying after 11 s, naming the event and the setting", r.outcome, r.err)
	}
	t.Logf("%v", r.err)
}
