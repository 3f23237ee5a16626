package kafkasink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/relay"
)

// Transactions (Config.TransactionalID) give the sink two properties the
// idempotent producer alone does not (issue 35, items 4 and 8):
//
//   - Order after a failed produce. franz-go fails a partition's buffered
//     records together, but a record produced after that failure and before
//     the relay heard of it goes out fresh and can be stored ahead of the
//     failed one ([G E] for one key). In a transaction nothing is visible to
//     read_committed readers until the commit, and walbox commits only a
//     transaction in which every record was acked: a failed record aborts
//     its whole transaction, and the epoch moves at the failure, so a record
//     the relay publishes under the old epoch is refused (ErrEpochMoved)
//     and resent behind the failed one.
//   - A fence. Every leadership term starts with InitProducerID for the
//     transactional id (TakeOver): the broker bumps the id's epoch and aborts
//     the previous holder's open transaction, and refuses its produce and
//     commit requests from then on. A relay paused past its leader lock (GC,
//     SIGSTOP, a VM freeze) that wakes after a standby took over cannot store
//     anything: its records are aborted, and it learns it was fenced
//     (Fenced) and stops.
//
// An ack (a resolved future) means the record's transaction committed.
// Readers of walbox's topics must read with isolation.level=read_committed
// (kcat and librdkafka's default; the Java client's default is
// read_uncommitted), or they also see the records of aborted transactions.

var (
	// ErrFenced: another producer took this sink's transactional id over
	// (another walbox leads the slot now, or two deployments share the id).
	// Nothing more is produced until TakeOver.
	ErrFenced = errors.New("fenced: another walbox producer took over this transactional id (kafka.transactional_id); this relay stops leading")
	// ErrTxnAborted: the record was acked by its partition, but its
	// transaction was aborted because another record of it failed (or the
	// commit did): not stored; resent in order.
	ErrTxnAborted = errors.New("the record's transaction was aborted")
	// ErrEpochMoved: a record published before this one failed since the
	// relay read the epoch: refused unsent, resent in order behind it.
	ErrEpochMoved = errors.New("a record published before this one failed: refused unsent, to be resent in order")
	// errNotLeading: Publish after Close.
	errNotLeading = errors.New("the transactional producer is closed")
)

// maxTxnAge bounds how long a transaction takes new records: then it ends
// when its records are acked, and new ones wait for the next. Under steady
// load a transaction would otherwise take records until the relay's window
// is full, and each ack would wait for that.
const maxTxnAge = 20 * time.Millisecond

// txnRec is one record on its way through a transaction.
type txnRec struct {
	rec     *kgo.Record
	epoch   uint64
	resolve relay.Resolver
	err     error // the produce promise's, refined by decide
}

type txnResult struct {
	tr  *txnRec
	rec *kgo.Record
	err error
}

// txnProducer owns a transactional client; one goroutine (loop) produces,
// ends and begins transactions, so no two of franz-go's transaction calls
// ever overlap.
type txnProducer struct {
	id     string
	opts   []kgo.Opt // client options, TransactionalID included
	log    zerolog.Logger
	decide func(*kgo.Record, error) error // the sink's refinement of a produce error
	maxTxn int                            // records per transaction

	epoch atomic.Uint64
	in    chan *txnRec
	buf   int

	mu       sync.Mutex // guards the fields below
	cl       *kgo.Client
	taken    bool          // TakeOver ran at least once
	fenced   chan struct{} // closed when fenced in the current term
	fenceErr error
	stop     context.CancelFunc
	loopDone chan struct{}
	closed   bool
	// permanent remembers the brokers' permanent verdicts on records of
	// aborted transactions, by identity: the record is refused at its next
	// publish instead of aborting its successors' transaction again.
	permanent map[string]error
}

func newTxnProducer(id string, opts []kgo.Opt, buffered int, log zerolog.Logger, decide func(*kgo.Record, error) error) *txnProducer {
	return &txnProducer{
		id: id, opts: append(opts[:len(opts):len(opts)], kgo.TransactionalID(id)), log: log, decide: decide,
		maxTxn: max(buffered/2, 1),
		in:     make(chan *txnRec, buffered+64),
		buf:    buffered + 64,
		fenced: make(chan struct{}),
	}
}

// TakeOver starts a leadership term: a new client whose InitProducerID
// fences the id's previous holder (its open transaction is aborted, its
// requests refused from now on). It retries while the brokers cannot be
// reached, until ctx ends; a missing ACL is returned with its fix.
func (p *txnProducer) TakeOver(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errNotLeading
	}
	p.stopLoopLocked()
	wait := 100 * time.Millisecond
	for {
		cl, err := kgo.NewClient(p.opts...)
		if err != nil {
			return fmt.Errorf("kafka transactional client: %w", err)
		}
		// InitProducerID: the fence. It returns once the brokers bumped
		// the id's epoch, which aborts whatever the previous holder left
		// open; CONCURRENT_TRANSACTIONS while that abort completes is
		// retried by franz-go.
		_, _, err = cl.ProducerID(ctx)
		if err == nil {
			p.cl = cl
			break
		}
		cl.Close()
		if errors.Is(err, kerr.TransactionalIDAuthorizationFailed) || errors.Is(err, kerr.ClusterAuthorizationFailed) {
			return fmt.Errorf("take Kafka transactional id %q: %w (grant walbox's principal WRITE and DESCRIBE on TransactionalId %q, or set kafka.transactions: false to publish unfenced)", p.id, err, p.id)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("take Kafka transactional id %q: %w", p.id, ctx.Err())
		}
		p.log.Warn().Err(err).Str("transactional_id", p.id).Msg("cannot take the Kafka transactional id yet; retrying")
		select {
		case <-ctx.Done():
			return fmt.Errorf("take Kafka transactional id %q: %w", p.id, ctx.Err())
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
	p.taken = true
	p.fenced = make(chan struct{})
	p.fenceErr = nil
	p.epoch.Add(1) // a new session: nothing of the last one's window goes on
	lctx, cancel := context.WithCancel(context.Background())
	p.stop, p.loopDone = cancel, make(chan struct{})
	// Each term has its own promise channel: the last term's client
	// answers its records into its own, which nobody reads any more.
	go p.loop(lctx, p.cl, make(chan txnResult, p.buf), p.loopDone)
	return nil
}

// stopLoopLocked ends the current term's loop and client: what it had not
// committed fails (the relay sends it again).
func (p *txnProducer) stopLoopLocked() {
	if p.stop != nil {
		p.stop()
		<-p.loopDone
		p.stop = nil
	}
	if p.cl != nil {
		p.cl.Close()
		p.cl = nil
	}
}

// Fenced is closed when another producer took the id over during the
// current term.
func (p *txnProducer) Fenced() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.fenced
}

func (p *txnProducer) markFenced(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fenceErr != nil {
		return
	}
	p.fenceErr = err
	close(p.fenced)
	p.log.Error().Err(err).Str("transactional_id", p.id).
		Msg("Kafka fenced walbox's producer: another walbox took over this slot's transactional id (a standby took over while this relay was paused, or two deployments share kafka.transactional_id); nothing it had not committed is stored; this relay stops leading")
}

// Close ends the loop and the client.
func (p *txnProducer) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	p.stopLoopLocked()
}

// Epoch is the sink's epoch: it moves on every failed record, every
// aborted transaction and every term.
func (p *txnProducer) Epoch() uint64 { return p.epoch.Load() }

// publish hands rec to the loop, published under epoch. A record over its
// topic's limit alone, or refused for good before, never enters a
// transaction: it would abort its successors' with it.
func (p *txnProducer) publish(rec *kgo.Record, epoch uint64, id string, resolve relay.Resolver) {
	p.mu.Lock()
	if !p.taken && !p.closed {
		// A sink used without a leadership term (tests, tools) takes the
		// id at its first publish. Once fenced it never does by itself:
		// only the next term's TakeOver may fence the other holder back.
		p.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := p.TakeOver(ctx)
		cancel()
		if err != nil {
			resolve.Resolve(nil, err)
			return
		}
		epoch = p.Epoch()
		p.mu.Lock()
	}
	if p.closed {
		p.mu.Unlock()
		resolve.Resolve(nil, errNotLeading)
		return
	}
	if err, ok := p.permanent[rec.Topic+"\x00"+id]; ok && id != "" {
		delete(p.permanent, rec.Topic+"\x00"+id)
		p.mu.Unlock()
		resolve.Resolve(nil, err)
		return
	}
	p.mu.Unlock()
	p.in <- &txnRec{rec: rec, epoch: epoch, resolve: resolve}
}

// txnState is the loop's open transaction.
type txnState struct {
	open        bool
	started     time.Time
	recs        []*txnRec
	outstanding int   // produced, promise not yet called
	failed      error // the first record's failure
	aborting    bool  // AbortBufferedRecords ran
}

// loop runs one term: it takes records into the open transaction (beginning
// one when none is), and once every record of it is answered it commits, or
// aborts when one failed; only then are the records' futures resolved.
func (p *txnProducer) loop(ctx context.Context, cl *kgo.Client, results chan txnResult, done chan struct{}) {
	defer close(done)
	var st txnState
	fenced := false
	for {
		if st.open && st.outstanding == 0 && (len(st.recs) > 0 || st.failed != nil) {
			fenced = p.end(ctx, cl, &st) || fenced
			continue
		}
		if st.failed != nil && st.outstanding > 0 && !st.aborting {
			// Doomed: fail what franz-go still buffers instead of waiting
			// for its retries (up to kafka.ack_timeout).
			st.aborting = true
			_ = cl.AbortBufferedRecords(ctx)
			continue
		}
		in := p.in
		if st.failed != nil || (st.open && (time.Since(st.started) >= maxTxnAge || len(st.recs) >= p.maxTxn)) {
			in = nil // the transaction takes no more records
		}
		var tick <-chan time.Time
		if in != nil && st.open {
			tick = time.After(maxTxnAge - time.Since(st.started))
		}
		select {
		case <-ctx.Done():
			p.failAll(&st, fmt.Errorf("%w (walbox is stopping or its term ended)", kgo.ErrClientClosed))
			return
		case r := <-results:
			st.outstanding--
			if r.err != nil {
				r.tr.err = p.decide(r.rec, r.err)
				if st.failed == nil {
					st.failed = r.tr.err
					p.epoch.Add(1) // records published from now on are refused unsent
				}
			}
		case tr := <-in:
			switch {
			case fenced:
				tr.resolve.Resolve(nil, ErrFenced)
				continue
			case tr.epoch != p.epoch.Load():
				tr.resolve.Resolve(nil, ErrEpochMoved)
				continue
			}
			if !st.open {
				if err := cl.BeginTransaction(); err != nil {
					p.epoch.Add(1)
					if isFenced(err) {
						fenced = true
						p.markFenced(err)
						err = fmt.Errorf("%w: %w", ErrFenced, err)
					}
					tr.resolve.Resolve(nil, fmt.Errorf("begin a Kafka transaction: %w", err))
					continue
				}
				st = txnState{open: true, started: time.Now()}
			}
			st.recs = append(st.recs, tr)
			st.outstanding++
			cl.Produce(ctx, tr.rec, func(r *kgo.Record, err error) {
				results <- txnResult{tr: tr, rec: r, err: err}
			})
		case <-tick:
		}
	}
}

// end commits st when no record of it failed, else aborts it, and resolves
// its records' futures; it reports whether the producer was fenced.
func (p *txnProducer) end(ctx context.Context, cl *kgo.Client, st *txnState) (fenced bool) {
	cause := st.failed
	if cause == nil {
		err := cl.EndTransaction(ctx, kgo.TryCommit)
		if err == nil {
			for _, tr := range st.recs {
				// Sequence is 1-based, as JetStream's: offset 0 is
				// sequence 1 (the relay and the sweeper take sequence 0
				// for "not stored").
				tr.resolve.Resolve(&relay.Ack{Stream: tr.rec.Topic, Partition: tr.rec.Partition, Sequence: uint64(tr.rec.Offset) + 1}, nil)
			}
			*st = txnState{}
			return false
		}
		// Refused, or an outcome unknown (the connection dropped): the
		// abort below settles it, either way, before anything is resent,
		// and the relay's read-back (read_committed) sees what stayed.
		cause = fmt.Errorf("commit the Kafka transaction: %w", err)
		p.epoch.Add(1)
	}
	if err := cl.EndTransaction(ctx, kgo.TryAbort); err != nil {
		if isFenced(err) {
			cause = fmt.Errorf("%v; abort: %w", cause, err)
		} else {
			// The next BeginTransaction reloads the producer id, which
			// bumps its epoch and aborts what is still open broker-side.
			p.log.Warn().Err(err).Str("transactional_id", p.id).Msg("abort of a failed Kafka transaction unconfirmed; the next transaction's InitProducerID aborts it")
		}
	}
	fenced = isFenced(cause)
	if fenced {
		p.markFenced(cause)
	}
	for _, tr := range st.recs {
		switch {
		case fenced:
			tr.resolve.Resolve(nil, fmt.Errorf("%w (%v)", ErrFenced, cause))
		case tr.err != nil:
			if Classify(tr.err) == relay.Permanent {
				p.rememberPermanent(tr)
			}
			tr.resolve.Resolve(nil, tr.err)
		default:
			// The cause is text: its kind is the failed record's, not
			// this one's (a record too large does not make its
			// neighbours permanent).
			tr.resolve.Resolve(nil, fmt.Errorf("%w (%v)", ErrTxnAborted, cause))
		}
	}
	*st = txnState{}
	return fenced
}

func (p *txnProducer) rememberPermanent(tr *txnRec) {
	id := recordID(tr.rec)
	if id == "" {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.permanent == nil || len(p.permanent) > 1024 {
		p.permanent = map[string]error{}
	}
	p.permanent[tr.rec.Topic+"\x00"+id] = tr.err
}

// failAll resolves every record of st, and every record waiting, with err.
func (p *txnProducer) failAll(st *txnState, err error) {
	for _, tr := range st.recs {
		tr.resolve.Resolve(nil, err)
	}
	*st = txnState{}
	for {
		select {
		case tr := <-p.in:
			tr.resolve.Resolve(nil, err)
		default:
			return
		}
	}
}

// isFenced: the brokers refused the producer because another took its
// transactional id (PRODUCER_FENCED; INVALID_PRODUCER_EPOCH, which older
// brokers answer instead, and which a transactional producer meets only
// when another InitProducerID bumped the epoch).
func isFenced(err error) bool {
	return errors.Is(err, kerr.ProducerFenced) || errors.Is(err, kerr.InvalidProducerEpoch) || errors.Is(err, ErrFenced)
}
