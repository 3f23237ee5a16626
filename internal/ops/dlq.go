package ops

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/busops"
)

// Headers of dead letters besides relay's.
const (
	headerPayloadDropped = "Walbox-Dlq-Payload-Dropped"
	// HeaderDLQRetriedFrom is set on a retried dead letter: <dlq stream>/<seq>.
	HeaderDLQRetriedFrom = busops.HeaderRetriedFrom
)

// DeadLetter is one message of the dead-letter stream (topic).
type DeadLetter = busops.DeadLetter

// DLQList reads up to limit dead letters (oldest first; limit <= 0: all)
// and the stream's total count.
func DLQList(ctx context.Context, cfg config.Config, limit int) ([]DeadLetter, uint64, error) {
	bus, err := openBus(ctx, cfg)
	if err != nil {
		return nil, 0, err
	}
	defer bus.Close()
	dlq, err := bus.DeadLetters(ctx)
	if err != nil {
		return nil, 0, err
	}
	return dlq.List(ctx, limit, false)
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

// DLQRetry republishes dead letters to their original subject (topic),
// with their original event id, when a stream (topic) now stores it, and
// takes each out of the dead-letter stream (topic) after the bus acked it:
// JetStream deletes it, Kafka marks it. A dead letter whose event the
// destination's newest messages of its source hold already is taken out
// unpublished. Dead letters that still cannot be delivered are reported
// and left where they are.
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
	bus, err := openBus(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer bus.Close()
	dlq, err := bus.DeadLetters(ctx)
	if err != nil {
		return nil, err
	}
	var dls []DeadLetter
	if opts.All {
		dls, _, err = dlq.List(ctx, 0, true)
	} else {
		dls, err = dlq.Pick(ctx, opts.Seqs)
	}
	if err != nil {
		return nil, err
	}
	if opts.afterRead != nil {
		opts.afterRead()
	}
	terms, name := bus.Terms(), bus.DLQName()
	res := &DLQRetryResult{}
	if len(dls) == 0 {
		fmt.Fprintln(opts.Out, name+" holds no dead letter to retry")
		return res, nil
	}
	if !opts.Yes && !confirm(opts.In, opts.Out, fmt.Sprintf("Republish %d dead letter(s) to their original %ss and %s %s?", len(dls), terms.Subject, terms.Remove, name)) {
		return res, ErrAborted
	}
	bar := newProgress(nil, false, "", 0, nil)
	if len(dls) > 100 {
		bar = newProgress(opts.Out, opts.TTY, "dlq retry", int64(len(dls)), func() string {
			return fmt.Sprintf("retried %d, skipped %d", res.Retried+res.AlreadyStored, res.Skipped)
		})
	}
	defer bar.finish()
	r := &retry{cfg: cfg, bus: bus, dlq: dlq, terms: terms, name: name, res: res, out: opts.Out,
		routers: map[string]*relay.Router{}, stored: map[string]map[string]bool{}}
	for _, dl := range dls {
		if err = r.one(ctx, dl); err != nil {
			break
		}
		bar.add(1)
	}
	bar.finish()
	// Also after a failure: what was taken out so far stays out, Close
	// only saves reading it again.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), connectTimeout)
	defer cancel()
	if cerr := dlq.Close(cctx); cerr != nil {
		fmt.Fprintf(opts.Out, "note: %v (the retried dead letters stay hidden by their markers)\n", cerr)
	}
	return res, err
}

// retry is one run of dlq retry.
type retry struct {
	cfg        config.Config
	bus        busops.Bus
	dlq        busops.DLQ
	terms      busops.Terms
	name       string // of the dead-letter stream (topic)
	routes     []relay.Route
	routesRead bool
	routers    map[string]*relay.Router // by source
	// stored: per destination and source, the identities
	// (relay.IdentityKey) read back from its newest messages.
	stored map[string]map[string]bool
	res    *DLQRetryResult
	out    io.Writer
}

// retryTailMessages is how many of a source's newest messages of a stream
// (of each partition of a topic) dlq retry reads back before it
// republishes there (at least; twice the relay's window where that is
// more).
const retryTailMessages = 1000

// storedIn reads back, once per destination and source, the identities
// its newest messages of source hold.
func (r *retry) storedIn(ctx context.Context, dest, source string) (map[string]bool, error) {
	k := dest + "\x00" + source
	if ids, ok := r.stored[k]; ok {
		return ids, nil
	}
	ids := map[string]bool{}
	want := max(retryTailMessages, 2*r.cfg.NATS.Window)
	err := r.bus.ReadBack(ctx, dest, source, relay.ReadBackRange{Want: want, ScanMax: 10 * want}, func(ev relay.StoredEvent) bool {
		ids[relay.IdentityKey(ev.Table, ev.ID)] = true
		return true
	})
	if err != nil {
		return nil, fmt.Errorf("read back the newest messages of %s: %w", dest, err)
	}
	r.stored[k] = ids
	return ids, nil
}

// router is the relay's router for events of source, over the routes the
// bus has now; nil when it cannot be built.
func (r *retry) router(ctx context.Context, source string) *relay.Router {
	if rt, ok := r.routers[source]; ok {
		return rt
	}
	if !r.routesRead {
		r.routes, _ = r.bus.Routes(ctx)
		r.routesRead = true
	}
	rt, err := r.bus.Router(source, r.routes)
	if err != nil {
		rt = nil
	}
	r.routers[source] = rt
	return rt
}

// one republishes one dead letter, unless its destination's newest
// messages hold its event already, and takes it out of the DLQ.
func (r *retry) one(ctx context.Context, dl DeadLetter) error {
	src := dl.Header.Get(relay.HeaderSource)
	m, dest, why, err := r.message(ctx, dl, r.router(ctx, src))
	if err != nil {
		return fmt.Errorf("dead letter %d: %w (it stays in %s)", dl.Seq, err, r.name)
	}
	if why != "" {
		r.res.Skipped++
		fmt.Fprintf(r.out, "seq %d %s: skipped: %s\n", dl.Seq, orDash(dl.OriginalSubject), why)
		return nil
	}
	// The same evidence as the relay's: the event's identity read back
	// from the destination (a retry that died before taking it out, a
	// replay, a relay that stored it after all). A consumer group's dead
	// letter goes to that group alone, under an id of its own.
	ident := relay.IdentityKey(dl.Header.Get(relay.HeaderTable), dl.ID)
	var ids map[string]bool
	if dl.Group == "" {
		if ids, err = r.storedIn(ctx, dest, src); err != nil {
			return fmt.Errorf("dead letter %d: %w (it stays in %s)", dl.Seq, err, r.name)
		}
	}
	if ids[ident] {
		return r.takeOut(ctx, dl, dest, "")
	}
	f, err := r.bus.Publish(m, dest)
	var ack *relay.Ack
	if err == nil {
		ack, err = relay.Await(ctx, f)
	}
	if err != nil {
		return fmt.Errorf("republish dead letter %d to %s: %w (it stays in %s)", dl.Seq, m.Subject, err, r.name)
	}
	if ack.Duplicate {
		return r.takeOut(ctx, dl, ack.Stream, "")
	}
	if ids != nil {
		ids[ident] = true
	}
	at := ack.Stream + "/" + strconv.FormatUint(ack.Sequence, 10)
	where := fmt.Sprintf("seq %d", ack.Sequence)
	if r.terms.Partitioned {
		where = fmt.Sprintf("partition %d, seq %d", ack.Partition, ack.Sequence)
	}
	if err := r.dlq.Retried(ctx, dl, at); err != nil {
		return fmt.Errorf("dead letter %d was republished (%s %s) but not %s %s: %w; a retry reads %s back and does not store it again while it is among the newest %d messages of its source there",
			dl.Seq, ack.Stream, where, r.terms.Removed, r.name, err, ack.Stream, max(retryTailMessages, 2*r.cfg.NATS.Window))
	}
	r.res.Retried++
	fmt.Fprintf(r.out, "seq %d %s: republished to %s (%s, id %s); %s %s\n", dl.Seq, dl.OriginalSubject, ack.Stream, where, dl.ID, r.terms.Removed, r.name)
	return nil
}

// takeOut takes dl, whose event dest holds, out of the DLQ.
func (r *retry) takeOut(ctx context.Context, dl DeadLetter, dest, at string) error {
	if err := r.dlq.Retried(ctx, dl, at); err != nil {
		return fmt.Errorf("dead letter %d is stored in %s already but was not %s %s: %w", dl.Seq, dest, r.terms.Removed, r.name, err)
	}
	r.res.AlreadyStored++
	fmt.Fprintf(r.out, "seq %d %s: %s already holds id %s; %s %s\n", dl.Seq, dl.OriginalSubject, dest, dl.ID, r.terms.Removed, r.name)
	return nil
}

// message rebuilds the event's message and finds the stream (topic) that
// stores it now, or says why it cannot be retried.
//
// A relay dead letter (an event no stream stored) goes back to its original
// subject under its own event id, in the envelope the relay gives events now
// (router, from the dead letter's topic header), so consumers see it as they
// would have. A consumer group's dead letter (an event the stream holds and
// the other groups handled) goes to that group's retry subject alone, with
// its event id in Walbox-Event-Id and a Nats-Msg-Id of its own: under the
// event id it would be a duplicate, and every other group would get it
// again under any other id on the original subject.
func (r *retry) message(ctx context.Context, dl DeadLetter, router *relay.Router) (*relay.Msg, string, string, error) {
	h := dl.Header
	switch {
	case dl.OriginalSubject == "" || relay.ValidSubject(dl.OriginalSubject) != nil:
		return nil, "", fmt.Sprintf("the original %s %q is not a valid %s (fix the row's topic and replay it: walbox replay --id %s)", r.terms.Subject, dl.OriginalSubject, r.terms.Subject, orDash(dl.ID)), nil
	case dl.ID == "":
		return nil, "", "no event id (the row's id was NULL or empty)", nil
	case h.Get(headerPayloadDropped) != "":
		return nil, "", fmt.Sprintf("its payload (%s bytes) was too large and was dropped; replay it from the outbox: walbox replay --id %s", h.Get(headerPayloadDropped), dl.ID), nil
	case !json.Valid(dl.Data):
		return nil, "", "the payload is not valid JSON", nil
	}
	from := r.name + "/" + strconv.FormatUint(dl.Seq, 10)
	out := relay.Header{}
	for k, v := range h {
		switch {
		case strings.HasPrefix(k, "Walbox-Dlq-"), k == relay.HeaderEventID, strings.HasPrefix(k, "Nats-"),
			k == consumer.HeaderError, k == consumer.HeaderAttempts, k == consumer.HeaderGroup:
			continue
		}
		out[k] = v
	}
	out.Set(HeaderDLQRetriedFrom, from)
	m := &relay.Msg{Subject: dl.OriginalSubject, Data: dl.Data, Header: out}
	if dl.Group != "" {
		m.Subject = consumer.DefaultRetryPrefix + dl.Group
		out.Set(consumer.HeaderEventID, dl.ID)
		out.Set(consumer.HeaderRetrySubject, dl.OriginalSubject)
		out.Set(relay.HeaderMsgID, "retry."+dl.Group+"."+from)
		dest, why, err := r.bus.Destination(ctx, m.Subject)
		if why != "" {
			why = fmt.Sprintf("consumer group %s takes its retried dead letters on %s: %s", dl.Group, m.Subject, why)
		}
		return m, dest, why, err
	}
	if topic := h.Get(relay.HeaderDLQOriginalTopic); topic != "" && router != nil {
		ev := relay.EventFromHeaders(h, topic, dl.ID, dl.Data)
		ev.Table = router.TableIndex(h.Get(relay.HeaderTable))
		rm, _, err := router.Message(&ev)
		var pe *relay.PoisonError
		switch {
		case err == nil:
			rm.Header.Set(HeaderDLQRetriedFrom, from)
			m = rm
		case !errors.As(err, &pe) || !strings.Contains(pe.Reason, "no configured stream"):
			return nil, "", fmt.Sprintf("the router refuses it: %v", err), nil
		}
	}
	if m.Header.Get(relay.HeaderMsgID) == "" {
		// The dead letter's Nats-Msg-Id is the event's dedupe key
		// (qualified with its table for every table but the first).
		msgID := h.Get(relay.HeaderMsgID)
		if msgID == "" {
			msgID = dl.ID
		}
		out.Set(relay.HeaderMsgID, msgID)
		if msgID != dl.ID {
			out.Set(relay.HeaderEventID, dl.ID)
		}
		m.Key = cmp.Or(h.Get(relay.HeaderPartitionKey), h.Get(relay.HeaderAggregateID))
	}
	dest, why, err := r.bus.Destination(ctx, m.Subject)
	return m, dest, why, err
}

// DLQName is where dead letters go: the stream nats.dlq.stream, or with
// sink: kafka the topic kafka.dlq_topic.
func DLQName(cfg config.Config) string {
	if cfg.Sink == config.SinkKafka {
		return cfg.Kafka.DLQTopic
	}
	return cfg.NATS.DLQ.Stream
}
