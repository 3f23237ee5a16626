package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

// Headers of dead letters besides relay's.
const (
	headerEventID        = "Walbox-Event-Id"
	headerPayloadDropped = "Walbox-Dlq-Payload-Dropped"
	// HeaderDLQRetriedFrom is set on a retried dead letter: <dlq stream>/<seq>.
	HeaderDLQRetriedFrom = "Walbox-Dlq-Retried-From"
)

// DeadLetter is one message of the dead-letter stream.
type DeadLetter struct {
	Seq             uint64    `json:"seq"`
	Time            time.Time `json:"time"`
	Subject         string    `json:"subject"`
	OriginalSubject string    `json:"original_subject"`
	ID              string    `json:"id"`
	Reason          string    `json:"reason"`
	// Group is the consumer group that dead-lettered it; empty for the
	// relay's dead letters (events no stream stored).
	Group string `json:"group,omitempty"`
	// Partition of the dead-letter topic (sink: kafka; Seq is the
	// record's offset + 1 there).
	Partition int32       `json:"partition,omitempty"`
	msg       *nats.Msg   // with payload, for retry
	rec       *kgo.Record // sink: kafka
	// copies are the other records of the dead-letter topic that hold the
	// same event (sink: kafka; a resend stored twice): retried with it.
	copies []kafkaRef
}

// DLQList reads up to limit dead letters (oldest first; limit <= 0: all)
// and the stream's total count.
func DLQList(ctx context.Context, cfg config.Config, limit int) ([]DeadLetter, uint64, error) {
	if cfg.Sink == config.SinkKafka {
		return dlqListKafka(ctx, cfg, limit)
	}
	nc, js, err := connectNATS(ctx, cfg)
	if err != nil {
		return nil, 0, err
	}
	defer nc.Close()
	return readDLQ(ctx, js, cfg.NATS.DLQ.Stream, limit, true)
}

func readDLQ(ctx context.Context, js jetstream.JetStream, name string, limit int, headersOnly bool) ([]DeadLetter, uint64, error) {
	st, err := js.Stream(ctx, name)
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, 0, fmt.Errorf("dead-letter stream %s does not exist (walbox run creates it; nats.dlq.stream names it)", name)
		}
		return nil, 0, fmt.Errorf("stream %s: %w", name, err)
	}
	total := st.CachedInfo().State.Msgs
	if total == 0 {
		return nil, 0, nil
	}
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy, HeadersOnly: headersOnly})
	if err != nil {
		return nil, total, fmt.Errorf("read %s: %w", name, err)
	}
	var out []DeadLetter
	for limit <= 0 || len(out) < limit {
		want := 500
		if limit > 0 {
			want = min(want, limit-len(out))
		}
		batch, err := cons.Fetch(want, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return out, total, fmt.Errorf("read %s: %w", name, err)
		}
		got, pending := 0, uint64(1)
		for m := range batch.Messages() {
			got++
			dl := DeadLetter{Subject: m.Subject()}
			if md, err := m.Metadata(); err == nil {
				dl.Seq, dl.Time, pending = md.Sequence.Stream, md.Timestamp, md.NumPending
			}
			fillDeadLetter(&dl, m.Headers())
			if !headersOnly {
				dl.msg = &nats.Msg{Subject: m.Subject(), Header: m.Headers(), Data: m.Data()}
			}
			out = append(out, dl)
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
			return out, total, fmt.Errorf("read %s: %w", name, err)
		}
		if got == 0 || pending == 0 {
			break
		}
	}
	return out, total, nil
}

func fillDeadLetter(dl *DeadLetter, h nats.Header) {
	dl.OriginalSubject = h.Get(relay.HeaderDLQOriginalSubject)
	dl.Reason = h.Get(relay.HeaderDLQReason)
	// The event's id: a consumer's dead letter has its own Nats-Msg-Id.
	dl.ID = h.Get(headerEventID)
	if dl.ID == "" {
		dl.ID = h.Get(relay.HeaderMsgID)
	}
	dl.Group = h.Get(consumer.HeaderGroup)
}

// PrintDeadLetters writes the list as a table.
func PrintDeadLetters(w io.Writer, dls []DeadLetter, total uint64, stream string) {
	if len(dls) == 0 {
		fmt.Fprintf(w, "%s is empty: no dead letters\n", stream)
		return
	}
	fmt.Fprintf(w, "%-8s  %-23s  %-28s  %-36s  %s\n", "SEQ", "TIME", "ORIGINAL SUBJECT", "EVENT ID", "REASON")
	for _, d := range dls {
		fmt.Fprintf(w, "%-8d  %-23s  %-28s  %-36s  %s\n", d.Seq, d.Time.Local().Format("2006-01-02 15:04:05.000"), orDash(d.OriginalSubject), orDash(d.ID), d.Reason)
	}
	if uint64(len(dls)) < total {
		fmt.Fprintf(w, "(%d of %d shown; --limit N shows more)\n", len(dls), total)
	}
}

// DLQRetryOptions select the dead letters to retry.
type DLQRetryOptions struct {
	Seqs []uint64
	All  bool
	// Yes skips the confirmation read from In.
	Yes bool
	In  io.Reader
	// Out receives one line per dead letter (and the question).
	Out io.Writer
	TTY bool
	// afterRead, set by tests, runs once the dead letters to retry are
	// read, before the first is republished.
	afterRead func()
}

// DLQRetryResult counts a retry.
type DLQRetryResult struct {
	Retried       int `json:"retried"`        // published and deleted from the DLQ
	AlreadyStored int `json:"already_stored"` // the stream had the id (duplicate): deleted from the DLQ
	Skipped       int `json:"skipped"`        // left in the DLQ
}

// ErrDLQRetryRunning: another `walbox dlq retry` of the same dead-letter
// stream or topic holds the lease.
var ErrDLQRetryRunning = errors.New("another walbox dlq retry is running")

// dlqRetryLease takes the lease a retry holds from before it reads the
// dead letters until it has deleted or marked the last one it republished:
// a session advisory lock in PostgreSQL whose key is derived from the
// dead-letter stream's (topic's) name, on a connection of its own. Two
// retries that both read the dead letters before either marked them would
// both republish them: Kafka keeps both copies, and JetStream drops the
// second only inside its duplicate window. A second retry does not wait:
// it fails with ErrDLQRetryRunning, and run again once the first is done
// finds what that one retried gone. The lock ends with the session, so a
// retry that dies holds nothing.
func dlqRetryLease(ctx context.Context, cfg config.Config) (release func(), err error) {
	name := DLQName(cfg)
	conn, err := connectPG(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("take the lease of dlq retry on %s: %w", name, err)
	}
	var got bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock("+dlqRetryLockKeySQL+")", name).Scan(&got); err != nil {
		closePG(ctx, conn)
		return nil, fmt.Errorf("take the lease of dlq retry on %s (a PostgreSQL advisory lock): %w", name, err)
	}
	if !got {
		closePG(ctx, conn)
		return nil, fmt.Errorf("%w on %s (it holds the PostgreSQL advisory lock %s for %q): run this one again once it is done", ErrDLQRetryRunning, name, dlqRetryLockKeySQL, name)
	}
	return func() {
		// Closing the session releases the lock; unlock first so that a
		// slow close does not hold it.
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = conn.Exec(uctx, "SELECT pg_advisory_unlock("+dlqRetryLockKeySQL+")", name)
		closePG(ctx, conn)
	}, nil
}

// dlqRetryLockKeySQL is the advisory lock key of dlq retry on $1 (the
// dead-letter stream or topic). Leadership's keys are 'walbox:' || slot,
// and a slot name has no ':' or '-'.
const dlqRetryLockKeySQL = "hashtextextended('walbox:dlq-retry:' || $1, 0)"

// retryConfirmed says whether a retry of n dead letters goes on: not when
// there are none (it prints empty), and otherwise only with --yes or the
// user's yes to question (ErrAborted).
func retryConfirmed(opts DLQRetryOptions, n int, empty, question string) (bool, error) {
	if n == 0 {
		fmt.Fprintln(opts.Out, empty)
		return false, nil
	}
	if !opts.Yes && !confirm(opts.In, opts.Out, question) {
		return false, ErrAborted
	}
	return true, nil
}

// DLQRetry republishes dead letters to their original subject, with their
// original event id, when a stream now captures that subject, and deletes
// each from the dead-letter stream after JetStream acked it. Dead letters
// that still cannot be delivered are reported and left where they are.
func DLQRetry(ctx context.Context, cfg config.Config, opts DLQRetryOptions) (*DLQRetryResult, error) {
	opts.Out = orDiscard(opts.Out)
	if opts.All == (len(opts.Seqs) > 0) {
		return nil, errors.New("say which dead letters to retry: --seq N (repeatable) or --all")
	}
	release, err := dlqRetryLease(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer release()
	if cfg.Sink == config.SinkKafka {
		return dlqRetryKafka(ctx, cfg, opts)
	}
	nc, js, err := connectNATS(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	name := cfg.NATS.DLQ.Stream
	st, err := js.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("dead-letter stream %s: %w", name, err)
	}
	var dls []DeadLetter
	if opts.All {
		if dls, _, err = readDLQ(ctx, js, name, 0, false); err != nil {
			return nil, err
		}
	} else {
		for _, seq := range opts.Seqs {
			raw, err := st.GetMsg(ctx, seq)
			if err != nil {
				return nil, fmt.Errorf("dead letter %d of %s: %w", seq, name, err)
			}
			dl := DeadLetter{Seq: raw.Sequence, Time: raw.Time, Subject: raw.Subject,
				msg: &nats.Msg{Subject: raw.Subject, Header: raw.Header, Data: raw.Data}}
			fillDeadLetter(&dl, raw.Header)
			dls = append(dls, dl)
		}
	}
	if opts.afterRead != nil {
		opts.afterRead()
	}
	res := &DLQRetryResult{}
	if ok, err := retryConfirmed(opts, len(dls), name+" is empty: nothing to retry",
		fmt.Sprintf("Republish %d dead letter(s) to their original subjects and delete them from %s?", len(dls), name)); !ok {
		return res, err
	}
	bar := newProgress(nil, false, "", 0, nil)
	if len(dls) > 100 {
		bar = newProgress(opts.Out, opts.TTY, "dlq retry", int64(len(dls)), func() string {
			return fmt.Sprintf("retried %d, skipped %d", res.Retried+res.AlreadyStored, res.Skipped)
		})
	}
	defer bar.finish()
	routers := &retryRouters{js: js, cfg: cfg}
	for _, dl := range dls {
		bar.add(1)
		target, why := retryTarget(ctx, js, cfg, dl)
		if why != "" {
			res.Skipped++
			fmt.Fprintf(opts.Out, "seq %d %s: skipped: %s\n", dl.Seq, orDash(dl.OriginalSubject), why)
			continue
		}
		m := retryMessage(dl, name, routers.get(ctx, dl.msg.Header.Get(relay.HeaderSource)))
		ack, err := js.PublishMsg(ctx, m, jetstream.WithExpectStream(target))
		if err != nil {
			return res, fmt.Errorf("republish dead letter %d to %s: %w (it stays in %s)", dl.Seq, dl.OriginalSubject, err, name)
		}
		if err := st.DeleteMsg(ctx, dl.Seq); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
			return res, fmt.Errorf("dead letter %d was republished (%s seq %d) but not deleted from %s: %w", dl.Seq, ack.Stream, ack.Sequence, name, err)
		}
		if ack.Duplicate {
			res.AlreadyStored++
			fmt.Fprintf(opts.Out, "seq %d %s: %s already holds id %s; deleted from %s\n", dl.Seq, dl.OriginalSubject, ack.Stream, dl.ID, name)
			continue
		}
		res.Retried++
		fmt.Fprintf(opts.Out, "seq %d %s: republished to %s (seq %d, id %s); deleted from %s\n", dl.Seq, dl.OriginalSubject, ack.Stream, ack.Sequence, dl.ID, name)
	}
	return res, nil
}

// retryRouters builds, per source, the router that gives a retried relay
// dead letter the envelope and subject the relay gives events now.
type retryRouters struct {
	js     jetstream.JetStream
	cfg    config.Config
	routes []relay.Route
	read   bool
	by     map[string]*relay.Router
}

func (r *retryRouters) get(ctx context.Context, source string) *relay.Router {
	if !r.read {
		r.read = true
		for _, sp := range r.cfg.StreamSpecs() {
			if sp.Name == r.cfg.NATS.DLQ.Stream {
				continue
			}
			st, err := r.js.Stream(ctx, sp.Name)
			if err != nil {
				continue
			}
			r.routes = append(r.routes, relay.Route{Stream: sp.Name, Subjects: st.CachedInfo().Config.Subjects})
		}
		r.by = map[string]*relay.Router{}
	}
	if rt, ok := r.by[source]; ok {
		return rt
	}
	rt, err := relay.NewRouterWithOptions(r.cfg.NATS.SubjectPrefix, source, r.routes, r.cfg.RouterOptions())
	if err != nil {
		rt = nil
	}
	r.by[source] = rt
	return rt
}

// retryTarget finds the stream that now captures the dead letter's original
// subject, or says why it cannot be retried.
func retryTarget(ctx context.Context, js jetstream.JetStream, cfg config.Config, dl DeadLetter) (string, string) {
	h := dl.msg.Header
	switch {
	case dl.OriginalSubject == "" || relay.ValidSubject(dl.OriginalSubject) != nil:
		return "", fmt.Sprintf("the original subject %q is not a valid subject (fix the row's topic and replay it: walbox replay --id %s)", dl.OriginalSubject, orDash(dl.ID))
	case dl.ID == "":
		return "", "no event id (the row's id was NULL or empty)"
	case h.Get(headerPayloadDropped) != "":
		return "", fmt.Sprintf("its payload (%s bytes) was too large and was dropped; replay it from the outbox: walbox replay --id %s", h.Get(headerPayloadDropped), dl.ID)
	case !json.Valid(dl.msg.Data):
		return "", "the payload is not valid JSON"
	}
	if dl.Group != "" {
		subj := consumer.DefaultRetryPrefix + dl.Group
		stream, err := js.StreamNameBySubject(ctx, subj)
		if err != nil {
			return "", fmt.Sprintf("no stream captures %s, where consumer group %s takes its retried dead letters (WALBOX_DLQ does with the default nats.dlq.subject_prefix)", subj, dl.Group)
		}
		return stream, ""
	}
	stream, err := js.StreamNameBySubject(ctx, dl.OriginalSubject)
	if err != nil || stream == cfg.NATS.DLQ.Stream {
		if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return "", fmt.Sprintf("cannot look up the stream of %s: %v", dl.OriginalSubject, err)
		}
		return "", fmt.Sprintf("no stream captures %s yet (add it to nats.streams and restart walbox, or create the stream)", dl.OriginalSubject)
	}
	return stream, ""
}

// retryMessage rebuilds the event's message.
//
// A relay dead letter (an event no stream stored) goes back to its original
// subject under its own event id, in the envelope the relay gives events now
// (router, from the dead letter's topic header), so consumers see it as they
// would have. A consumer group's dead letter (an event the stream holds and
// the other groups handled) goes to that group's retry subject alone, with
// its event id in Walbox-Event-Id and a Nats-Msg-Id of its own: under the
// event id it would be a duplicate, and every other group would get it
// again under any other id on the original subject.
func retryMessage(dl DeadLetter, dlqStream string, router *relay.Router) *nats.Msg {
	from := dlqStream + "/" + strconv.FormatUint(dl.Seq, 10)
	h := nats.Header{}
	for k, v := range dl.msg.Header {
		switch {
		case strings.HasPrefix(k, "Walbox-Dlq-"), k == headerEventID, strings.HasPrefix(k, "Nats-"),
			k == consumer.HeaderError, k == consumer.HeaderAttempts, k == consumer.HeaderGroup:
			continue
		}
		h[k] = v
	}
	if dl.Group != "" {
		h.Set(consumer.HeaderEventID, dl.ID)
		h.Set(consumer.HeaderRetrySubject, dl.OriginalSubject)
		h.Set(relay.HeaderMsgID, "retry."+dl.Group+"."+from)
		h.Set(HeaderDLQRetriedFrom, from)
		return &nats.Msg{Subject: consumer.DefaultRetryPrefix + dl.Group, Data: dl.msg.Data, Header: h}
	}
	if topic := dl.msg.Header.Get(relay.HeaderDLQOriginalTopic); topic != "" && router != nil {
		ev := relay.EventFromHeaders(relay.Header(dl.msg.Header), topic, dl.ID, dl.msg.Data)
		ev.Table = router.TableIndex(dl.msg.Header.Get(relay.HeaderTable))
		if m, _, err := router.Message(&ev); err == nil {
			m.Header.Set(HeaderDLQRetriedFrom, from)
			return jssink.NATSMsg(m)
		}
	}
	// The dead letter's Nats-Msg-Id is the event's dedupe key (qualified
	// with its table for every table but the first).
	msgID := dl.msg.Header.Get(relay.HeaderMsgID)
	if msgID == "" {
		msgID = dl.ID
	}
	h.Set(relay.HeaderMsgID, msgID)
	if msgID != dl.ID {
		h.Set(headerEventID, dl.ID)
	}
	h.Set(HeaderDLQRetriedFrom, from)
	return &nats.Msg{Subject: dl.OriginalSubject, Data: dl.msg.Data, Header: h}
}
