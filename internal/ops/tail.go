package ops

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/claim"
)

// TailOptions adjust Tail.
type TailOptions struct {
	// Subject is the subject filter (wildcards allowed), as stored: with
	// nats.subject_prefix when one is configured.
	Subject string
	// Stream to read; "" finds the stream capturing Subject.
	Stream string
	// Since > 0 starts with the messages stored in the last Since;
	// otherwise only new messages are shown.
	Since time.Duration
	// Full prints whole payloads (otherwise cut at 80 characters).
	Full bool
	// Limit > 0 stops after that many messages.
	Limit int
}

// Tail prints the messages JetStream stores under opts.Subject (with sink:
// kafka, the records of the topic opts.Subject), as they
// are stored, with their commit-to-ack latency (stored time minus the
// Walbox-Commit-Time header), until ctx ends or opts.Limit messages were
// shown. It reads through an ephemeral ordered consumer: nothing is acked
// or changed on the server.
func Tail(ctx context.Context, cfg config.Config, opts TailOptions, w io.Writer) (int, error) {
	if opts.Subject == "" {
		return 0, errors.New("say which subject to tail, e.g. walbox tail 'orders.>'")
	}
	if cfg.Sink == config.SinkKafka {
		return tailKafka(ctx, cfg, opts, w)
	}
	nc, js, err := connectNATS(ctx, cfg)
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	name := opts.Stream
	if name == "" {
		if name, err = js.StreamNameBySubject(ctx, opts.Subject); err != nil {
			if errors.Is(err, jetstream.ErrStreamNotFound) {
				return 0, fmt.Errorf("no stream captures %s (name one with --stream)", opts.Subject)
			}
			return 0, fmt.Errorf("find the stream of %s: %w", opts.Subject, err)
		}
	}
	st, err := js.Stream(ctx, name)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", name, err)
	}
	cc := jetstream.OrderedConsumerConfig{FilterSubjects: []string{opts.Subject}, DeliverPolicy: jetstream.DeliverNewPolicy,
		InactiveThreshold: 30 * time.Second}
	if opts.Since > 0 {
		start := time.Now().Add(-opts.Since)
		cc.DeliverPolicy, cc.OptStartTime = jetstream.DeliverByStartTimePolicy, &start
	}
	cons, err := st.OrderedConsumer(ctx, cc)
	if err != nil {
		return 0, fmt.Errorf("create a consumer on %s: %w", name, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", name, err)
	}
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	defer it.Stop()
	width := tailHeader(w, opts.Full, "SUBJECT", "EVENT ID (Nats-Msg-Id)", "COMMIT->ACK")
	n := 0
	for opts.Limit <= 0 || n < opts.Limit {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return n, nil
			}
			return n, fmt.Errorf("read %s: %w", name, err)
		}
		fmt.Fprintln(w, tailLine(m, width))
		n++
	}
	return n, nil
}

// tailHeader prints the column titles and returns the payload's width: 80
// characters, or all of it with --full.
func tailHeader(w io.Writer, full bool, where, id, latency string) int {
	fmt.Fprintf(w, "%-23s  %-24s  %-36s  %*s  %s\n", "STORED", where, id, len(latency), latency, "PAYLOAD")
	if full {
		return 0
	}
	return 80
}

func tailLine(m jetstream.Msg, width int) string {
	h := m.Headers()
	stored, lat := "-", "-"
	if md, err := m.Metadata(); err == nil {
		stored = md.Timestamp.Local().Format("2006-01-02 15:04:05.000")
		if ct, err := time.Parse(time.RFC3339Nano, h.Get(relay.HeaderCommitTime)); err == nil {
			lat = humanDuration(max(md.Timestamp.Sub(ct), 0))
		}
	}
	id := h.Get(relay.HeaderMsgID)
	if id == "" {
		id = "-"
	}
	payload := oneLine(m.Data(), width)
	if v := h.Get(claim.Header); v != "" {
		payload = claimLine(v)
	}
	if reason := h.Get(relay.HeaderDLQReason); reason != "" {
		payload = "DEAD LETTER: " + reason + ": " + payload
	}
	return fmt.Sprintf("%-23s  %-24s  %-36s  %11s  %s", stored, m.Subject(), id, lat, payload)
}

// claimLine is what tail shows of a claim-check reference (header value v)
// in the payload's place: the payload's size and where it is.
func claimLine(v string) string {
	ref, err := claim.ParseRef(v)
	if err != nil {
		return "CLAIM CHECK (unreadable reference): " + v
	}
	return fmt.Sprintf("CLAIM CHECK: %s in %s bucket %s, key %s", mib(ref.Size), ref.Store, ref.Bucket, ref.Key)
}

// mib is n bytes in KiB or MiB, one decimal.
func mib(n int64) string {
	if n < 1<<20 {
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}
