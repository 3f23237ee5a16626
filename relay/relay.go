package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/rs/zerolog"
	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/retry"
	"go.opentelemetry.io/otel/trace"
)

// Confirmer receives the LSN that is safe to confirm to the slot. cdc.Source
// implements it; the relay never reaches into cdc's connection.
type Confirmer interface {
	Confirm(lsn cdc.LSN)
}

// Source is the producer side of the pipeline (cdc.Source).
type Source interface {
	Confirmer
	Run(ctx context.Context, out chan<- []cdc.Change) error
}

// ResetTaker is a Source that wants to know when the relay has handled a
// KindReset: confirmations after it belong to the new session's slot.
type ResetTaker interface {
	ResetTaken()
}

// Recycler is a Source that takes back the batches the relay is done with.
type Recycler interface {
	Recycle(b []cdc.Change)
}

// Delivered describes one event that left the window: acked by the sink
// (Stream, Seq) or dead-lettered (Reason). The sweeper marks rows from it.
type Delivered struct {
	ID        string
	CreatedAt string
	Pos       cdc.Position
	Table     int // the event's outbox table (cdc.Event.Table)
	// TableLess: a table-less event (walbox.emit_message); no row to mark.
	TableLess bool
	Stream    string
	Seq       uint64
	AckedAt   time.Time
	// SentAfter is cdc.Event.SentAfter: how far behind its commit the relay
	// read the event (the sweeper yields while it is large).
	SentAfter  time.Duration
	DeadLetter bool
	Reason     string
	// CommitTime is the event's commit time (cdc.Event.CommitTime);
	// Partition the ack's (Kafka).
	CommitTime time.Time
	Partition  int32
	// Msg is the message as it was published (the dead letter's, for one).
	// It is valid only during OnDelivered: the relay recycles it after.
	// A hook that keeps any of it copies it (the console's live tail).
	Msg *Msg
}

// DefaultDrainTimeout is how long Serve waits at shutdown for the acks of
// what is in flight.
const DefaultDrainTimeout = 10 * time.Second

// Config configures the relay's publisher.
type Config struct {
	// Window bounds the events published and not yet acked (default 1024).
	// Memory is bounded by it, not by transaction size.
	Window int
	// WindowBytes bounds the bytes (data and headers) of the events held
	// for publishing, in flight or waiting to be resent (default 16 MiB);
	// one event larger than it still goes out alone.
	WindowBytes int64
	// DLQPrefix is the subject prefix of dead letters (default "walbox.dlq.").
	DLQPrefix string
	// RequireTail: the bus drops no resent duplicate by itself (Kafka has
	// no Nats-Msg-Id), so the resume check is the only guard against
	// storing an event twice: publishing waits, backing off, until the tail
	// of every stream was read back.
	RequireTail bool
	// TailTimeout bounds one read-back of a stream's tail by the resume
	// check (default 10 s). A sink that reads large tails incrementally
	// and gives up by itself when it stops making progress (Kafka) is
	// given longer: what it read is kept for the next attempt either way.
	TailTimeout time.Duration
	// DLQSubject, when set, is where every dead letter goes instead (Kafka's
	// one dead-letter topic); the original subject is in its headers.
	DLQSubject string
	// StrictOrder sets Nats-Expected-Last-Sequence on every publish to the
	// sequence its predecessor in the same stream is stored at (the stream's
	// last sequence read back at start, plus one per publish since). A
	// stream then refuses a message whose predecessor it lost (an R3 leader
	// change mid-window), instead of storing it first and the predecessor
	// after the resend. It assumes walbox is the stream's only writer.
	StrictOrder bool
	// BackoffInitial and BackoffMax bound the pause after a transient publish
	// error: 1 s doubling to 60 s with jitter by default.
	BackoffInitial time.Duration
	BackoffMax     time.Duration
	// DrainTimeout bounds how long a shutdown waits for in-flight acks (default 10 s).
	DrainTimeout time.Duration
	// OnDelivered, if set, is called from the publisher goroutine for every
	// event that left the window. It must not block.
	OnDelivered func(Delivered)
	// Alive, if set, is called once a second from the publisher goroutine
	// while its loop turns, and once as it starts: the heartbeat a liveness
	// probe watches. A loop blocked anywhere (a sink call, OnDelivered)
	// stops calling it. It must not block.
	Alive   func()
	Metrics *Metrics
	Logger  zerolog.Logger
	// Tracer, when set, gives each published event a span (trace.go);
	// TraceSystem is OpenTelemetry's messaging.system: "nats" or "kafka";
	// TraceRatio the share of events without a producer's context that
	// get one (0: all; below 0: none).
	Tracer      trace.Tracer
	TraceSystem string
	TraceRatio  float64
}

// Relay publishes the changes of a Source to a Sink, in order, and confirms
// LSNs through the Checkpoint. One goroutine (run) owns the window.
type Relay struct {
	cfg    Config
	sink   Sink
	txn    TxnSink // sink as a TxnSink; nil when it is not one
	router *Router
	log    zerolog.Logger
	m      *Metrics
	tr     *tracing // nil: tracing off

	// Read by the status writer from another goroutine.
	oldestUnacked atomic.Int64  // commit time (unix ns) of the oldest event not yet acked; 0 when none
	delivered     atomic.Uint64 // events that left the window
}

// Progress reports the commit time of the oldest event in flight (zero when
// caught up) and how many events have been delivered so far.
func (r *Relay) Progress() (oldestUnacked time.Time, delivered uint64) {
	if ns := r.oldestUnacked.Load(); ns != 0 {
		oldestUnacked = time.Unix(0, ns)
	}
	return oldestUnacked, r.delivered.Load()
}

// New returns a relay.
func New(cfg Config, sink Sink, router *Router) *Relay {
	if cfg.Window <= 0 {
		cfg.Window = 1024
	}
	if cfg.TailTimeout <= 0 {
		cfg.TailTimeout = 10 * time.Second
	}
	if cfg.WindowBytes <= 0 {
		cfg.WindowBytes = 16 << 20
	}
	if cfg.DLQPrefix == "" {
		cfg.DLQPrefix = "walbox.dlq."
	}
	cfg.BackoffInitial, cfg.BackoffMax = retry.Defaults(cfg.BackoffInitial, cfg.BackoffMax)
	if cfg.DrainTimeout <= 0 {
		cfg.DrainTimeout = DefaultDrainTimeout
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	router.SetMaxPayload(sink.MaxPayload())
	txn, _ := sink.(TxnSink)
	return &Relay{cfg: cfg, sink: sink, txn: txn, router: router, log: cfg.Logger.With().Str("component", "relay").Logger(), m: cfg.Metrics,
		tr: newTracing(cfg.Tracer, cfg.TraceSystem, cfg.TraceRatio)}
}

// Serve runs src and the relay until ctx is cancelled or src fails for good.
// On cancellation it stops reading, drains the in-flight acks, confirms what
// was acked, and only then lets the source send its final status update.
func (r *Relay) Serve(ctx context.Context, src Source) error {
	srcCtx, cancelSrc := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelSrc()
	changes := make(chan []cdc.Change, 4)
	srcDone := make(chan error, 1)
	go func() { srcDone <- src.Run(srcCtx, changes) }()

	relayCtx, cancelRelay := context.WithCancel(ctx)
	defer cancelRelay()
	var srcErr error
	srcExited := make(chan struct{})
	go func() {
		select {
		case srcErr = <-srcDone:
			close(srcExited)
			cancelRelay()
		case <-relayCtx.Done():
		}
	}()

	err := r.run(relayCtx, changes, src)
	cancelSrc()
	select {
	case <-srcExited:
	default:
		srcErr = <-srcDone
	}
	if srcErr != nil {
		return fmt.Errorf("replication source: %w", srcErr)
	}
	return err
}

// pending is one published message waiting for its ack.
type pending struct {
	seq    uint64
	ev     cdc.Event
	msg    *Msg
	stream string
	dlq    bool
	reason string
	sentAt time.Time
	fut    Future
	epoch  uint64 // the connection it was published on
	size   int64  // bytes held for it (counted in loop.held until done)
	// tried: this process published it at least once. Its own ack, or its
	// id read back, is then the only evidence that it is stored: a position
	// says nothing of an event whose publish may have failed while later
	// ones were stored (issue 33, item 3).
	tried bool
	// strict: published with an expected last sequence (loop.lastSeq moved
	// for it).
	strict bool
	// span is its trace span while it is in flight (trace.go), resends
	// how many times it was published again.
	span     trace.Span
	resends  int
	untraced bool // the sampler said no: no span, whatever happens to it
	// txn is the transaction it was read in (loop.txns, 0: none);
	// txnRefused: a sink refused that transaction's unit (ErrTxnRefused),
	// so it is resent on its own.
	txn        uint64
	txnRefused bool
}

// errConnectionChanged stops publishing when the connection was replaced
// under in-flight messages: the old connection may have lost some of them
// while the new one stores the next, which would leave a gap (and, after the
// resend, an order inversion) in the stream.
var errConnectionChanged = errors.New("connection to the bus was re-established under in-flight publishes")

// loop is the state of the publisher goroutine.
type loop struct {
	r       *Relay
	conf    Confirmer
	ckpt    *Checkpoint
	window  []*pending // in publish order
	retry   []*pending // to resend after a transient failure, sorted by seq
	failing bool       // a transient error happened: publish nothing until the window settles
	resume  time.Time  // when failing ended: resend at this time
	backing bool       // backed off; the next ack resets the back-off
	bo      *backoff.ExponentialBackOff

	cur    []cdc.Change
	curPos int
	held   int64 // bytes of the events published and not done (window and resend list)

	tails map[string]StoredTail // what each stream holds of this source, for the resume check
	// dlqTail is what the dead-letter topic holds of this source (Kafka,
	// where nothing drops a resent dead letter); identities only.
	dlqTail StoredTail
	origin  *cdc.Origin // WAL history of the changes being read (KindOrigin)
	// walSeen is how far this server's WAL has been seen to reach in this
	// session: IDENTIFY_SYSTEM's position at its start, or the end of a
	// transaction read since. A stored position at or past it is not of
	// this server's history (loop.comparable).
	walSeen  cdc.LSN
	reported map[string]bool // stream and foreign system already logged
	// Strict order: the sequence the stream's newest message will have once
	// everything published to it so far is stored. Absent: unknown (the
	// stream could not be read back), publish without an expectation.
	lastSeq map[string]uint64
	// Streams in which a publish was refused for a wrong last sequence in
	// the current failing episode: a later publish of the same window
	// stored there means another writer filled the gap.
	seqRefused map[string]bool
	// Streams found to have another writer: strict order is off for them.
	shared map[string]bool
	// refusedAt: per stream, the lowest expectation refused since the last
	// read-back. A message of another source newer than it in the next
	// tail read proves another writer even when nothing of this relay's
	// was stored behind the refusal (a quiet relay beside a busy writer).
	refusedAt map[string]uint64

	// A publish that may be a duplicate of a stored message (maybeStored)
	// goes out alone under strict order: a duplicate does not grow the
	// stream, so every publish behind it would carry an expectation one too
	// high and be refused. solo waits for the window to empty; alone is the
	// one in flight, with nothing behind it.
	solo  *pending
	alone *pending
	// aloneLeft, per strict stream: how many more publishes that may be
	// duplicates go out alone. A duplicate ack sets it to aloneRun; each
	// such publish stored anew counts it down. Duplicates come in runs (the
	// rows of a backfill that were stored but not marked are its oldest),
	// so the rest of a large backfill goes pipelined, and a run of
	// duplicates costs one window of refusals, not one per duplicate.
	aloneLeft map[string]int
	// The failing episode's outcomes are all known (refusals that a
	// duplicate ack in the same stream explains, duplicates): lastSeq is
	// exact and nothing needs reading back, so the resend goes at once.
	// unexplained: some failure left an outcome unknown (a timeout, a
	// refusal no duplicate explains, a stored message behind a failure).
	unexplained bool
	dupAcks     map[string]int // strict streams: duplicate acks since the last settle

	// judged are events refused with a code the sink calls permanent, all
	// with heldCode, whose verdict waits for the rest of their window: a
	// later publish stored means the refusals were the events' own (they
	// are dead-lettered); every publish failing with the code means it is
	// the server's condition (nothing is dead-lettered, the window backs
	// off and is resent).
	judged   []*pending
	heldCode string

	// txns counts the transactions read (KindBegin); reading is the one
	// whose events are being read, 0 between a commit and the next begin.
	// A TxnSink hears where each ends (endTxn).
	txns    uint64
	reading uint64
}

// aloneRun is how many possible duplicates go out alone after a duplicate.
const aloneRun = 64

// ErrorCoder is a Sink that names the code of an error (the server's error
// code, a client error's name): the relay compares codes across a window.
type ErrorCoder interface {
	ErrorCode(err error) string
}

func (r *Relay) run(ctx context.Context, in <-chan []cdc.Change, conf Confirmer) error {
	bo := retry.Backoff(r.cfg.BackoffInitial, r.cfg.BackoffMax)
	l := &loop{r: r, conf: conf, ckpt: NewCheckpoint(), bo: bo}
	defer func() { r.m.InFlight.Set(0) }()
	if !l.refreshResume() {
		l.notRead()
	}

	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	// A progress line every minute, and every 5 s while work waits and
	// nothing moves, tells an operator (and a failing fault test) what the
	// publisher is doing.
	progress := time.NewTicker(5 * time.Second)
	defer progress.Stop()
	var lastDelivered uint64
	ticks := 0
	var aliveCh <-chan time.Time
	if r.cfg.Alive != nil {
		r.cfg.Alive()
		alive := time.NewTicker(time.Second)
		defer alive.Stop()
		aliveCh = alive.C
	}
	for {
		if ctx.Err() != nil {
			return l.drain(in)
		}
		l.fill()
		if l.unitOpen() {
			// A TxnSink holds a unit open. More changes at hand go in it
			// (consecutive transactions share a unit); only when none is
			// does it go, before the loop waits.
			if l.canRead() && l.reading == 0 {
				select {
				case b := <-in:
					l.cur, l.curPos = b, 0
					continue
				default:
				}
			}
			if l.reading == 0 && l.canPublish() {
				// Every transaction published so far was read to its
				// commit (a resent one too: resends are of transactions
				// read before).
				l.endTxn(TxnMayCommit)
			}
		}

		var head Future
		if len(l.window) > 0 {
			head = l.window[0].fut
		}
		var inCh <-chan []cdc.Change
		if l.canRead() {
			inCh = in
		}
		var timerCh <-chan time.Time
		if !l.failing && !l.resume.IsZero() {
			timer.Reset(time.Until(l.resume))
			timerCh = timer.C
		}
		select {
		case <-ctx.Done():
			return l.drain(in)
		case res := <-head:
			l.acked(res.Ack, res.Err)
			l.drainResolved()
		case b := <-inCh:
			l.cur, l.curPos = b, 0
		case <-aliveCh:
			r.cfg.Alive()
		case <-progress.C:
			ticks++
			_, delivered := r.Progress()
			waiting := len(l.window) > 0 || len(l.retry) > 0 || l.curPos < len(l.cur)
			stuck := waiting && delivered == lastDelivered
			lastDelivered = delivered
			if !stuck && ticks%12 != 0 {
				break
			}
			r.log.Info().Uint64("delivered", delivered).Int("inflight", len(l.window)).Int("to_resend", len(l.retry)).
				Bool("failing", l.failing).Bool("backing_off", !l.resume.IsZero()).Int("batch_left", len(l.cur)-l.curPos).
				Stringer("confirmed", l.ckpt.Confirmed()).Bool("stuck", stuck).Msg("publisher progress")
		case <-timerCh:
			l.resume = time.Time{}
			// Acks lost in the outage may hide stored events; after an
			// outage longer than the duplicate window only the read-back
			// keeps them from being stored twice.
			if !l.refreshResume() {
				l.notRead()
			}
		}
		l.publishProgress()
		if timerCh != nil && !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// publishProgress records the oldest commit time still in flight, for lag.
func (l *loop) publishProgress() {
	var oldest time.Time
	switch {
	case len(l.retry) > 0:
		oldest = l.retry[0].ev.CommitTime
	case len(l.window) > 0:
		oldest = l.window[0].ev.CommitTime
	case l.curPos < len(l.cur):
		for i := l.curPos; i < len(l.cur); i++ {
			if l.cur[i].Kind == cdc.KindEvent {
				oldest = l.cur[i].Event.CommitTime
				break
			}
		}
	}
	if oldest.IsZero() {
		l.r.oldestUnacked.Store(0)
	} else {
		l.r.oldestUnacked.Store(oldest.UnixNano())
	}
}

// canPublish: not failing and not backing off.
func (l *loop) canPublish() bool { return !l.failing && l.resume.IsZero() }

// canRead: a new batch is taken only when the current one is done, nothing
// waits to be resent, and the publisher is not failing.
func (l *loop) canRead() bool {
	return l.curPos >= len(l.cur) && len(l.retry) == 0 && !l.failing && l.resume.IsZero() && l.hasRoom()
}

// hasRoom: the window takes another new event, by count and by bytes (an
// empty window always takes one, however large), and no publish that must
// go alone is waiting or in flight.
func (l *loop) hasRoom() bool {
	return len(l.window) < l.r.cfg.Window && (l.held < l.r.cfg.WindowBytes || len(l.window) == 0) &&
		l.solo == nil && l.alone == nil
}

// fill publishes resends first, then the current batch, while the window has room.
func (l *loop) fill() {
	if l.solo != nil {
		if len(l.window) > 0 || !l.canPublish() {
			return
		}
		p := l.solo
		l.solo = nil
		l.publish(p, true)
	}
	// Every send may fail and start a back-off: check before each one, or
	// a dead connection turns this into a hot loop over the resend list.
	for len(l.retry) > 0 && len(l.window) < l.r.cfg.Window && l.solo == nil && l.alone == nil && l.canPublish() {
		p := l.retry[0]
		l.retry = l.retry[1:]
		l.send(p)
	}
	for len(l.retry) == 0 && l.curPos < len(l.cur) && l.hasRoom() && l.canPublish() {
		c := &l.cur[l.curPos]
		if c.Kind == cdc.KindReset && len(l.window) > 0 {
			return // the window must settle before the stream starts over
		}
		l.curPos++
		l.change(c)
	}
	if l.curPos >= len(l.cur) {
		if rc, ok := l.conf.(Recycler); ok && l.cur != nil {
			rc.Recycle(l.cur) // every change in it was copied or finished
		}
		l.cur, l.curPos = nil, 0
	}
}

func (l *loop) change(c *cdc.Change) {
	switch c.Kind {
	case cdc.KindBegin:
		l.ckpt.Begin()
		l.txns++
		l.reading = l.txns
	case cdc.KindEvent:
		p := &pending{seq: l.ckpt.NextSeq(), ev: c.Event, txn: l.reading}
		msg, stream, err := l.r.router.Message(&p.ev)
		if err != nil {
			l.deadLetter(p, err.Error())
		} else {
			p.msg, p.stream = msg, stream
		}
		l.send(p)
	case cdc.KindCommit:
		l.walSeen = max(l.walSeen, c.LSN)
		l.reading = 0 // a TxnSink's unit may end here (run)
		l.confirm(l.ckpt.Commit(c.LSN))
	case cdc.KindWALEnd:
		l.walSeen = max(l.walSeen, c.LSN)
		l.confirm(l.ckpt.WALEnd(c.LSN))
	case cdc.KindOrigin:
		l.origin = c.Origin
		l.walSeen = 0
		if c.Origin != nil {
			l.walSeen = c.Origin.WALPos
		}
		l.r.router.SetOrigin(c.Origin)
		for stream, tail := range l.tails {
			l.reportOrigins(stream, tail)
		}
	case cdc.KindReset:
		l.ckpt.Reset()
		l.reading = 0
		l.retry = l.retry[:0]
		l.solo, l.alone = nil, nil
		l.judged = l.judged[:0] // the old session's: the server sends them again
		if rt, ok := l.conf.(ResetTaker); ok {
			rt.ResetTaken()
		}
		if !l.refreshResume() {
			l.notRead()
		}
	}
}

func (l *loop) deadLetter(p *pending, reason string) {
	p.dlq = true
	p.reason = reason
	p.msg = l.r.router.DeadLetter(&p.ev, l.r.cfg.DLQPrefix, reason)
	if l.r.cfg.DLQSubject != "" {
		p.msg.Subject = l.r.cfg.DLQSubject
	}
	p.stream = ""
	l.r.log.Error().Str("id", p.ev.ID).Str("topic", p.ev.Topic).Stringer("pos", p.ev.Pos).Str("reason", reason).Msg("dead-lettering event")
}

// send publishes p and appends it to the window, unless the resume check
// finds it stored, or it must go alone and waits for the window to empty.
func (l *loop) send(p *pending) {
	if l.alreadyStored(p) {
		l.r.m.Skipped.Inc()
		l.done(p, &Ack{Stream: p.stream, Duplicate: true})
		return
	}
	alone := l.strictFor(p) && l.aloneLeft[p.stream] > 0 && l.maybeStored(p)
	if alone && len(l.window) > 0 {
		l.solo = p
		// It waits for the window to empty: a TxnSink's open unit goes
		// now, ending there (this event may be stored already, so its
		// transaction is not whole in the stream's eyes anyway).
		l.endTxn(TxnCommit)
		return
	}
	l.publish(p, alone)
}

// strictFor reports whether p goes out with an expected last sequence.
func (l *loop) strictFor(p *pending) bool {
	if !l.r.cfg.StrictOrder || p.dlq || p.stream == "" || l.shared[p.stream] {
		return false
	}
	_, ok := l.lastSeq[p.stream]
	return ok
}

// publish sends p; alone: nothing goes out behind it until it resolves.
func (l *loop) publish(p *pending, alone bool) {
	p.sentAt = time.Now()
	expect, strict := uint64(0), l.strictFor(p)
	if strict {
		expect = l.lastSeq[p.stream]
	}
	p.msg.Expect, p.msg.ExpectSet = expect, strict
	p.msg.Stream = p.stream
	p.msg.MayBeStored = p.tried || alone || l.maybeStored(p)
	// Alone: nothing goes out behind it until its ack, so it cannot wait
	// in a unit for its transaction's end.
	p.msg.Txn = p.txn
	if alone || p.txnRefused || p.dlq {
		p.msg.Txn = 0
	}
	p.strict = false
	epoch := l.r.sink.Epoch()
	if len(l.window) > 0 && l.window[len(l.window)-1].epoch != epoch {
		l.publishFailed(p, errConnectionChanged)
		return
	}
	p.msg.Epoch = epoch
	if l.r.tr != nil {
		l.r.tr.published(p)
	}
	fut, err := l.r.sink.Publish(p.msg)
	if err != nil {
		l.publishFailed(p, err)
		return
	}
	p.epoch = epoch
	p.tried = true
	if strict {
		l.lastSeq[p.stream] = expect + 1
		p.strict = true
	}
	if alone {
		l.alone = p
	}
	if l.r.sink.Epoch() != epoch {
		p.epoch = ^uint64(0) // reconnected during the call: which connection is unknown
	}
	p.fut = fut
	if p.size == 0 {
		p.size = msgSize(p.msg)
		l.held += p.size
	}
	l.window = append(l.window, p)
	l.r.m.InFlight.Set(float64(len(l.window)))
}

// classify sorts an error: an undeliverable event (the router's
// PoisonError) is permanent whatever the bus; the sink sorts the rest.
func (r *Relay) classify(err error) ErrorClass {
	var pe *PoisonError
	if errors.As(err, &pe) {
		return Permanent
	}
	if errors.Is(err, ErrTxnRefused) {
		return Transient // no evidence about this event: resent on its own
	}
	return r.sink.Classify(err)
}

// publishFailed handles an error for p, either from PublishAsync or its ack.
func (l *loop) publishFailed(p *pending, err error) {
	l.failed(p, err, false)
}

// failed handles an error for p; known: p's outcome is known (it was
// stored, or dropped as a duplicate) and needs no read-back.
func (l *loop) failed(p *pending, err error, known bool) {
	if l.alone == p {
		l.alone = nil
	}
	class := l.r.classify(err)
	if errors.Is(err, ErrTxnRefused) {
		p.txnRefused = true
	}
	refused := !p.dlq && errors.Is(err, ErrOrderRefused)
	if refused {
		if l.seqRefused == nil {
			l.seqRefused = make(map[string]bool)
		}
		l.seqRefused[p.stream] = true
	}
	if p.strict && refused {
		if l.refusedAt == nil {
			l.refusedAt = make(map[string]uint64)
		}
		if e, ok := l.refusedAt[p.stream]; !ok || p.msg.Expect < e {
			l.refusedAt[p.stream] = p.msg.Expect
		}
		l.notGrown(p)
	}
	// A refusal is explained when a duplicate ack in the same stream came
	// before it since the last settle: the duplicate did not grow the
	// stream, so every strict publish behind it expected one message too
	// many (a replica-1 stream checks the expectation before the duplicate,
	// a replicated one after; both refuse what follows). Its outcome is
	// known: not stored.
	explained := refused && l.dupAcks[p.stream] > 0
	if !known && !explained && !l.unexplained {
		l.unexplained = true
		l.r.m.Backoffs.Inc() // this episode ends in a back-off (settle)
	}
	if p.dlq && class == Permanent {
		// A dead letter is confirmed only once the dead-letter stream has
		// stored it: for a table-less event it is the only record. Wait and
		// resend like any transient failure, and say why it waits. Refused
		// for itself with its payload (a dead-letter stream or topic that
		// takes less than the events' limit), it is resent without the
		// payload, which its row keeps (issue 35, item 2).
		if len(p.msg.Data) > 0 && p.msg.Header.Get(HeaderDLQPayloadDropped) == "" {
			l.r.log.Error().Err(err).Str("id", p.ev.ID).Int("payload_bytes", len(p.msg.Data)).
				Msg("the dead-letter stream refused a dead letter; resending it without its payload (the row keeps it)")
			dropPayload(p.msg, err.Error())
		} else {
			l.r.log.Error().Err(err).Str("id", p.ev.ID).Str("reason", p.reason).
				Msg("the dead-letter stream refused a dead letter; publishing waits and resends it (check nats.dlq.stream or kafka.dlq_topic)")
		}
		class = Transient
	}
	if l.failing {
		class = Transient // everything after the first failure is resent in order
	}
	switch {
	case class == Permanent && !p.dlq:
		l.r.m.PublishErrors.WithLabelValues("permanent").Inc()
		var pe *PoisonError
		if errors.As(err, &pe) {
			l.deadLetter(p, err.Error())
			l.send(p) // lands behind its successors; the checkpoint takes the late ack
			break
		}
		l.hold(p, err)
	default:
		l.r.m.PublishErrors.WithLabelValues("transient").Inc()
		if !l.failing {
			ev := l.r.log.Warn()
			if known || explained {
				ev = l.r.log.Debug()
			}
			ev.Err(err).Int("inflight", len(l.window)).Msg("publish failed; waiting for in-flight acks, then resending in order")
			// Nothing is committed behind a failure: a transaction's
			// open unit is abandoned, and resent whole.
			l.endTxn(TxnAbandon)
		}
		l.failing = true
		l.toRetry(p)
		if !known && !explained {
			// An outcome is unknown: the judged events are resent with the
			// rest, their verdict waits for the next round. (A refusal
			// their own refusal explains leaves them judged.)
			for _, h := range l.judged {
				l.toRetry(h)
			}
			l.judged = l.judged[:0]
		}
		if l.solo != nil { // it goes after what is resent
			l.toRetry(l.solo)
			l.solo = nil
		}
	}
	l.settle()
}

// hold keeps p, refused with a permanent code, until its window says whose
// fault it was (loop.judged). A refusal did not grow the stream: under strict
// order the publishes behind it expect one message too many, and their
// refusals are explained as a duplicate's are.
func (l *loop) hold(p *pending, err error) {
	code := err.Error()
	if c, ok := l.r.sink.(ErrorCoder); ok {
		code = c.ErrorCode(err)
	}
	if p.strict {
		l.notGrown(p)
		l.explains(p.stream)
	}
	if len(l.judged) > 0 && code != l.heldCode {
		l.condemn() // two codes: not one condition of the server's
	}
	p.reason = err.Error()
	l.judged = append(l.judged, p)
	l.heldCode = code
	l.judge()
}

// condemn dead-letters the held events: the refusals were their own.
func (l *loop) condemn() {
	for _, h := range l.judged {
		l.deadLetter(h, h.reason)
		l.send(h) // lands behind its successors; the checkpoint takes the late ack
	}
	l.judged = l.judged[:0]
}

// judge decides the held events once nothing is in flight behind them:
// one alone is its own fault (nothing says otherwise); several, every
// publish since the first of them, with one code, are the server's
// condition: they are resent after a back-off, and nothing is
// dead-lettered.
func (l *loop) judge() {
	if len(l.judged) == 0 || len(l.window) > 0 || l.failing {
		return
	}
	if len(l.judged) == 1 {
		l.condemn()
		return
	}
	l.r.log.Error().Str("code", l.heldCode).Int("events", len(l.judged)).Str("first", l.judged[0].ev.ID).
		Msg("every publish of the window failed with the same code: the server's condition, not the events'; nothing is dead-lettered, publishing backs off and resends (fix the stream or the server if it lasts)")
	held := l.judged
	l.judged = nil
	l.unexplained = true
	l.r.m.Backoffs.Inc()
	l.endTxn(TxnAbandon)
	l.failing = true
	for _, h := range held {
		l.toRetry(h)
	}
	if l.solo != nil {
		l.toRetry(l.solo)
		l.solo = nil
	}
	l.settle()
}

// notGrown takes back the expectation a strict publish of p counted: the
// stream did not grow for it (refused, or dropped as a duplicate).
func (l *loop) notGrown(p *pending) {
	l.lastSeq[p.stream]--
	p.strict = false
}

// explains records, for stream, a publish that did not grow it although the
// strict publishes behind it expected so: their refusals until the next
// settle are explained by it (known outcomes, resent at once).
func (l *loop) explains(stream string) {
	if l.dupAcks == nil {
		l.dupAcks = make(map[string]int)
	}
	l.dupAcks[stream]++
}

// toRetry puts p in the resend list, in sequence order.
func (l *loop) toRetry(p *pending) {
	i, _ := slices.BinarySearchFunc(l.retry, p.seq, func(a *pending, s uint64) int { return cmpU64(a.seq, s) })
	l.retry = slices.Insert(l.retry, i, p)
}

// msgSize is what a message holds in memory: data and headers.
func msgSize(m *Msg) int64 { return m.Size() }

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// notRead backs off when a stream's last sequence (strict order) or its
// tail (RequireTail) could not be read back: publishes to it would go
// unguarded until it is.
func (l *loop) notRead() {
	wait := l.bo.NextBackOff()
	l.resume = time.Now().Add(wait)
	l.backing = true
	l.r.log.Warn().Stringer("retry_in", wait).Msg("resume check: a stream's tail (with strict order, its last sequence) could not be read; publishing waits for it")
}

// settle ends the failing state once the window is empty and schedules the
// resend after the back-off; when every outcome of the episode is known
// (duplicates and the refusals they explain), the resend goes at once.
func (l *loop) settle() {
	if l.failing && len(l.window) == 0 {
		l.failing = false
		clear(l.seqRefused)
		clear(l.dupAcks)
		if !l.unexplained {
			l.r.log.Debug().Int("to_resend", len(l.retry)).Msg("duplicates refused what followed them; resending at once")
			l.judge()
			return
		}
		l.unexplained = false
		wait := l.bo.NextBackOff()
		l.resume = time.Now().Add(wait)
		l.backing = true
		l.r.log.Warn().Stringer("retry_in", wait).Int("to_resend", len(l.retry)).Msg("publisher backing off")
	}
}

// acked handles the head of the window resolving.
func (l *loop) acked(ack *Ack, err error) {
	p := l.window[0]
	l.window[0] = nil
	l.window = l.window[1:]
	l.r.m.InFlight.Set(float64(len(l.window)))
	if err != nil {
		l.publishFailed(p, err)
		return
	}
	wasAlone := l.alone == p
	if wasAlone {
		l.alone = nil
	}
	if ack.Duplicate && p.strict {
		// Dropped as a duplicate: the stream did not grow for it, and a
		// strict publish behind it (if any) will be refused for expecting
		// one message too many.
		l.notGrown(p)
		l.explains(p.stream)
		if l.aloneLeft == nil {
			l.aloneLeft = make(map[string]int)
		}
		l.aloneLeft[p.stream] = aloneRun
	} else if !ack.Duplicate && wasAlone && l.aloneLeft[p.stream] > 0 {
		l.aloneLeft[p.stream]--
	}
	if len(l.judged) > 0 && !l.failing {
		// Stored behind them in the same window: their refusals were
		// their own.
		l.condemn()
	}
	if ack.Duplicate {
		if err := l.checkDuplicate(p, ack); err != nil {
			// Not stored after all (another event's id), or unknown.
			l.failed(p, err, errors.Is(err, errIDCollision))
			return
		}
	}
	if l.failing {
		if !ack.Duplicate && l.seqRefused[p.stream] && !l.shared[p.stream] {
			l.otherWriter(p.stream, ack.Sequence)
		}
		// Stored, but an earlier event failed: resend it too so the
		// checkpoint only ever sees acks in order (JetStream drops the
		// duplicate by Nats-Msg-Id). A duplicate's outcome is known; a
		// stored message must be read back before the resend, or the
		// resend would store it again past the duplicate window.
		l.failed(p, errors.New("resent after an earlier failure"), ack.Duplicate)
		return
	}
	l.done(p, ack)
	l.judge()
}

// otherWriter turns strict order off for a stream that another writer
// shares. With a single writer, nothing published behind a message refused
// for a wrong last sequence can match its expectation: the stream is one
// short of what every later publish expects. One that was stored all the same
// found a message of someone else in the place of its refused predecessor,
// and is stored out of order.
func (l *loop) otherWriter(stream string, seq uint64) {
	if l.shared == nil {
		l.shared = make(map[string]bool)
	}
	l.shared[stream] = true
	l.r.m.OtherWriters.WithLabelValues(stream).Inc()
	l.r.log.Error().Str("stream", stream).Uint64("seq", seq).
		Msg("another writer shares this stream: strict order cannot guard it, and the event stored at seq may be out of order; " +
			"set nats.strict_order: false, or give walbox a stream of its own (strict order stays off for this stream until restart)")
}

// done records a finished event.
func (l *loop) done(p *pending, ack *Ack) {
	now := time.Now()
	l.held -= p.size
	p.size = 0
	if ack != nil && !p.sentAt.IsZero() { // zero: skipped by the resume check
		if l.backing {
			l.bo.Reset()
			l.backing = false
		}
		if p.dlq {
			l.r.m.DeadLettered.WithLabelValues(l.r.router.TableName(p.ev.Table)).Inc()
		} else {
			l.r.m.Published.WithLabelValues(ack.Stream, l.r.router.TableName(p.ev.Table)).Inc()
			commitToAck := now.Sub(p.ev.CommitTime)
			l.r.m.CommitToAck.Observe(commitToAck.Seconds())
			l.r.m.PublishToAck.Observe(now.Sub(p.sentAt).Seconds())
			if p.ev.SentAfter > 0 { // 0: backfilled, or no send time
				l.r.m.CommitToSent.Observe(p.ev.SentAfter.Seconds())
				l.r.m.SentToAck.Observe((commitToAck - p.ev.SentAfter).Seconds())
			}
		}
	}
	if l.r.tr != nil && ack != nil && p.span != nil {
		l.r.tr.acked(p, ack, now, l.r.router.TableName(p.ev.Table))
	}
	if l.r.cfg.OnDelivered != nil {
		d := Delivered{ID: p.ev.ID, CreatedAt: p.ev.CreatedAt, Pos: p.ev.Pos, Table: p.ev.Table, TableLess: p.ev.TableLess, AckedAt: now, SentAfter: p.ev.SentAfter, DeadLetter: p.dlq, Reason: p.reason,
			CommitTime: p.ev.CommitTime, Msg: p.msg}
		if ack != nil {
			d.Stream, d.Seq, d.Partition = ack.Stream, ack.Sequence, ack.Partition
		}
		l.r.cfg.OnDelivered(d)
	}
	l.r.delivered.Add(1)
	l.confirm(l.ckpt.Ack(p.seq))
	if !p.dlq {
		// Resolved: the sink is done with it (see Sink), and so is the loop.
		l.r.router.Recycle(p.msg)
		p.msg = nil
	}
}

// settleBookkeeping takes, on shutdown, the changes already handed over that
// need no publish (a commit whose events are all acked, an empty backfill, a
// keepalive), up to the first event: confirming them costs nothing and saves
// the next start from redoing them.
func (l *loop) settleBookkeeping(in <-chan []cdc.Change) {
	for {
		if l.curPos >= len(l.cur) {
			select {
			case b := <-in:
				l.cur, l.curPos = b, 0
			default:
				return
			}
		}
		for l.curPos < len(l.cur) {
			c := &l.cur[l.curPos]
			if c.Kind == cdc.KindEvent || c.Kind == cdc.KindReset {
				return
			}
			l.curPos++
			l.change(c)
		}
	}
}

// drainResolved takes every already-resolved ack at the head without going
// back through the select: acks come in bursts.
func (l *loop) drainResolved() {
	for len(l.window) > 0 {
		select {
		case res := <-l.window[0].fut:
			l.acked(res.Ack, res.Err)
		default:
			return
		}
	}
}

// unitOpen reports whether a TxnSink holds messages in an open unit.
func (l *loop) unitOpen() bool {
	return l.r.txn != nil && l.r.txn.TxnOpen()
}

// endTxn tells a TxnSink what to do with its open unit.
func (l *loop) endTxn(end TxnEnd) {
	if l.r.txn != nil {
		l.r.txn.EndTxn(end)
	}
}

func (l *loop) confirm(lsn cdc.LSN, moved bool) {
	if moved {
		l.conf.Confirm(lsn)
		l.r.m.ConfirmedLSN.Set(float64(lsn))
	}
}

// drain waits for the in-flight acks on shutdown so that what JetStream
// stored gets confirmed, then returns.
func (l *loop) drain(in <-chan []cdc.Change) error {
	deadline := time.NewTimer(l.r.cfg.DrainTimeout)
	defer deadline.Stop()
	l.settleBookkeeping(in)
	// A transaction not read to its commit is not committed: abandoned
	// (with any read before it in its unit), it is resent whole on the
	// next start.
	if l.reading == 0 {
		l.endTxn(TxnCommit)
	} else {
		l.endTxn(TxnAbandon)
	}
	// Nothing new is published. Once one ack fails, later ones cannot be
	// confirmed (acks count only in order); they are resent on next start.
	for len(l.window) > 0 {
		select {
		case res := <-l.window[0].fut:
			p := l.window[0]
			l.window = l.window[1:]
			switch {
			case res.Err != nil:
				l.retry = append(l.retry, p)
			case len(l.retry) == 0:
				l.done(p, res.Ack)
			}
		case <-deadline.C:
			l.r.log.Warn().Int("inflight", len(l.window)).Msg("shutdown: acks still outstanding; they will be resent on next start")
			return nil
		}
	}
	l.r.log.Info().Stringer("confirmed", l.ckpt.Confirmed()).Msg("publisher drained")
	return nil
}
