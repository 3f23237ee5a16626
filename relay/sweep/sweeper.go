// Package sweep is walbox's sweeper: it marks outbox rows processed after
// JetStream has acknowledged them (and records dead letters on their rows),
// keeps the outbox's partitions created ahead, moves rows that landed in the
// default partition into a dated one, and archives old partitions: into the
// archive table, then to cold storage (a directory or an S3-compatible
// bucket), then deletes them after the retention age.
//
// It runs beside the relay and never slows it down: the relay hands every
// delivered event to OnDelivered, which only appends to a bounded queue; a
// goroutine writes the marks in batches on its own connections. When the
// queue is full marks are dropped and counted; the flag is an index (the
// stream is the truth), and marking a row again later is harmless.
//
// The sweeper never inserts into a table that is in walbox's publication,
// so nothing it does is published again: see docs/sweeper.md.
package sweep

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/fault"
	"github.com/walbox/walbox/internal/retry"
	"github.com/walbox/walbox/relay"
)

// ApplicationName is the application_name of the sweeper's connections
// (pg_stat_activity shows it).
const ApplicationName = "walbox-sweeper"

// Config configures a Sweeper. Zero values take the defaults noted.
type Config struct {
	// ConnString is the database URL (a normal, not a replication, connection).
	ConnString string
	Table      cdc.TableName
	// Unlabelled: the catch-up takes stored messages that name no table
	// (relays from before walbox recorded it) as this table's. Set for the
	// first table only: an id alone never says which table's row it is.
	Unlabelled bool
	Columns    cdc.Columns
	// MarkProcessed: write processed/processed_at after the ack, and
	// error/attempts for dead letters. false: the sweeper never updates rows.
	MarkProcessed bool
	// BatchSize is the most marks one UPDATE carries (default 1000).
	BatchSize int
	// Interval is how long a partial batch waits before it is written (default 200 ms).
	Interval time.Duration
	// QueueSize bounds the marks waiting to be written (default 10 × BatchSize,
	// about 1.6 MB). Marks beyond it are dropped and caught up later.
	QueueSize int
	// PartitionStep is "day" (default) or "month"; PartitionsAhead how many
	// days ahead partitions exist (default 7).
	PartitionStep   string
	PartitionsAhead int
	// NoMaintenance leaves partition upkeep and archival to the DBA (they
	// need table ownership): only rows are marked.
	NoMaintenance bool
	// MaintenanceInterval: partitions and archival run at start and then this
	// often (default 10 min). StatsInterval: the unprocessed gauges (default 30 s).
	MaintenanceInterval time.Duration
	StatsInterval       time.Duration
	Archive             ArchiveConfig
	// BackoffInitial and BackoffMax bound the pause after a database error
	// (default 1 s doubling to 60 s).
	BackoffInitial time.Duration
	BackoffMax     time.Duration
	// LockTimeout bounds every maintenance statement's wait for a lock
	// (default 100 ms): a step that cannot have its lock now is postponed,
	// never queued ahead of producers. StatementTimeout bounds each
	// maintenance statement (default 1 min; the export's read is exempt).
	// PostponedRetry is how soon a run with postponed steps is repeated
	// (default 15 s, at most MaintenanceInterval).
	LockTimeout      time.Duration
	StatementTimeout time.Duration
	PostponedRetry   time.Duration
	// StopTimeout bounds the final flush of the queue at Stop (default 5 s).
	StopTimeout time.Duration
	// YieldAfter: while the relay delivers events the server sent this long
	// or longer after their commit (relay.Delivered.SentAfter: it is
	// catching up on a backlog), the sweeper writes nothing and leaves the
	// CPU and the database to the relay. Marks beyond the queue are kept as
	// stream ranges and read back from the stream once it has caught up
	// (the same path as dropped marks). 0: never yield.
	YieldAfter time.Duration
	Logger     zerolog.Logger
	// Registry receives the metrics; nil leaves them unregistered.
	Registry prometheus.Registerer
	// Tracer, when set, sees every statement the sweeper runs (pgx's
	// QueryTracer: OpenTelemetry's pgx tracers plug in here; the plan tests
	// EXPLAIN each statement it records).
	Tracer pgx.QueryTracer
}

// ArchiveConfig is the archival part of the sweeper's config.
type ArchiveConfig struct {
	// After: partitions (or, unpartitioned, rows) whose every row is older
	// than this and processed move to the archive table. 0 turns archival off.
	After time.Duration
	// ExportAfter: archived partitions older than this are exported to Store
	// and dropped. 0 turns export off.
	ExportAfter time.Duration
	// DeleteAfter: exports whose newest row is older than this are deleted
	// from Store. 0 keeps them forever.
	DeleteAfter time.Duration
	// Store is the cold storage; nil turns export off.
	Store ColdStore
	// RowBatch is the rows one batch moves for an unpartitioned table (default 10,000).
	RowBatch int
}

func (c *Config) defaults() {
	orDefault(&c.BatchSize, 1000)
	orDefault(&c.Interval, 200*time.Millisecond)
	orDefault(&c.QueueSize, 10*c.BatchSize)
	if c.PartitionStep == "" {
		c.PartitionStep = "day"
	}
	orDefault(&c.PartitionsAhead, 7)
	orDefault(&c.MaintenanceInterval, 10*time.Minute)
	orDefault(&c.StatsInterval, 30*time.Second)
	c.BackoffInitial, c.BackoffMax = retry.Defaults(c.BackoffInitial, c.BackoffMax)
	orDefault(&c.StopTimeout, 5*time.Second)
	orDefault(&c.Archive.RowBatch, 10000)
	orDefault(&c.LockTimeout, 100*time.Millisecond)
	orDefault(&c.StatementTimeout, time.Minute)
	orDefault(&c.PostponedRetry, 15*time.Second)
	c.PostponedRetry = min(c.PostponedRetry, c.MaintenanceInterval)
}

// orDefault sets *v to def when it is not positive.
func orDefault[T int | time.Duration](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

// unseenFor is how long a mark whose row is not visible is tried again.
// PostgreSQL sends a commit to the walsender once its WAL is flushed, a
// moment before the committing backend leaves the proc array; until then
// other sessions do not see the rows, and a mark's UPDATE matches nothing.
// That moment is short (microseconds; more on a busy machine). A row still
// unseen after unseenFor was deleted (or never matched its mark's created_at):
// its mark is dropped as evidence for the catch-up.
const unseenFor = 10 * time.Second

// mark is one delivered event waiting to be written to its row.
type mark struct {
	id, createdAt string
	at            time.Time
	dlq           bool
	stored        bool // acked by JetStream (for a dead letter: the DLQ stream stored it)
	reason        string
	stream        string // where it was stored, at seq (0: not known)
	seq           uint64
	unseenSince   time.Time // first write that found no visible row (zero: none yet)
	errorDone     bool      // the dead letter's error and attempts are written (retried for processed alone)
}

// Sweeper marks delivered rows and maintains the outbox table.
type Sweeper struct {
	cfg  Config
	log  zerolog.Logger
	m    *Metrics
	pool *pgxpool.Pool

	mu    sync.Mutex
	queue []mark
	head  int
	later []mark // marks whose rows were not visible yet, tried again each round
	wake  chan struct{}

	dropped  atomic.Uint64
	deferred atomic.Uint64
	marked   atomic.Uint64

	// yieldUntil (under mu): the sweeper writes nothing before it (see
	// Config.YieldAfter); each mark sent late pushes it on by yieldHold, a
	// mark sent on time clears it.
	yieldUntil time.Time
	catchUpNow chan struct{} // the yield ended: read the deferred ranges back now
	info       atomic.Pointer[tableInfo]

	maint    sync.Mutex // one maintenance run at a time in this process
	warnOnce sync.Map
	// schedule is the maintenance loop's last run and next one, for the
	// web console (Schedule).
	schedule atomic.Pointer[MaintenanceSchedule]

	// Catch-up of dropped marks. A row is marked only from evidence that
	// it was delivered: its ack, or its id read back from the stream. A
	// dropped mark leaves its stream sequence behind in evidence (under
	// mu); the catch-up reads those ranges back and marks what it finds.
	evidence map[string]seqRange
	reader   atomic.Pointer[readBack]
	// tailOnStart: the first catch-up reads back each stream's newest
	// messages, for the marks a crash or a shutdown left unwritten.
	tailOnStart atomic.Bool
}

// seqRange is a span of stream sequences, both ends included.
type seqRange struct{ first, last uint64 }

func (r seqRange) with(seq uint64) seqRange {
	if r.first == 0 || seq < r.first {
		r.first = seq
	}
	if seq > r.last {
		r.last = seq
	}
	return r
}

// StreamReader reads back what a stream stored: for every message of source
// in rr (relay.ReadBackRange: a span of sequences, or the newest messages
// until fn has counted rr.Want), what it says of its event (relay.StoredEvent:
// its table, id, created_at and, for a dead letter, the reason); fn returns
// whether the message counts towards rr.Want. jssink.Sink and kafkasink.Sink
// implement it.
type StreamReader interface {
	ReadBack(ctx context.Context, stream, source string, rr relay.ReadBackRange, fn func(relay.StoredEvent) bool) error
}

type readBack struct {
	r       StreamReader
	source  string
	streams []string // for the read-back at start
	window  int
}

// SetReader lets the sweeper catch dropped marks up from the stream itself.
// streams are read back at start, for marks that a crash or a shutdown left
// unwritten: their newest messages, back until as many of this table's as
// the sweeper's mark queue holds plus window (the relay's publish window:
// acks whose marks were not queued yet), or as many as the table has
// unprocessed rows when that is more. Without a reader, dropped marks are
// not caught up: those rows stay unprocessed (safe, never wrong).
func (s *Sweeper) SetReader(r StreamReader, source string, streams []string, window int) {
	s.reader.Store(&readBack{r: r, source: source, streams: streams, window: window})
	s.tailOnStart.Store(true)
}

// lose records a dropped mark as evidence to read back; the caller counts it.
// A mark with no stream sequence (skipped by the resume check, or a dead
// letter the DLQ refused) leaves nothing: its row stays unprocessed.
func (s *Sweeper) lose(mks ...mark) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.loseLocked(mks...)
}

func (s *Sweeper) loseLocked(mks ...mark) {
	for _, mk := range mks {
		if mk.seq == 0 || mk.stream == "" {
			continue
		}
		if s.evidence == nil {
			s.evidence = map[string]seqRange{}
		}
		s.evidence[mk.stream] = s.evidence[mk.stream].with(mk.seq)
	}
}

// New returns a sweeper. It does not connect: Start and the other methods
// do, and retry while the database is away.
func New(cfg Config) (*Sweeper, error) {
	cfg.defaults()
	switch cfg.PartitionStep {
	case "day", "month":
	default:
		return nil, fmt.Errorf("partition step %q: use day or month", cfg.PartitionStep)
	}
	pcfg, err := pgxpool.ParseConfig(cfg.ConnString)
	if err != nil {
		return nil, err
	}
	pcfg.MaxConns = 4
	pcfg.MinConns = 0
	pcfg.ConnConfig.RuntimeParams["application_name"] = ApplicationName
	if cfg.Tracer != nil {
		pcfg.ConnConfig.Tracer = cfg.Tracer
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		return nil, err
	}
	s := &Sweeper{
		cfg:  cfg,
		log:  cfg.Logger.With().Str("component", "sweeper").Logger(),
		m:    newMetrics(cfg.Registry),
		pool: pool,
		wake: make(chan struct{}, 1),

		catchUpNow: make(chan struct{}, 1),
	}
	return s, nil
}

// Metrics returns the sweeper's metrics.
func (s *Sweeper) Metrics() *Metrics { return s.m }

// Close releases the sweeper's connections. Start's stop function calls it.
func (s *Sweeper) Close() { s.pool.Close() }

// OnDelivered queues the row of a delivered event to be marked. It is called
// from the relay's publisher goroutine and never blocks: when the queue is
// full the mark is dropped and counted.
func (s *Sweeper) OnDelivered(d relay.Delivered) {
	if !s.cfg.MarkProcessed || d.ID == "" || d.TableLess {
		return // a table-less event has no row
	}
	mk := mark{id: d.ID, createdAt: d.CreatedAt, at: d.AckedAt, dlq: d.DeadLetter, stored: d.Seq > 0, reason: d.Reason, stream: d.Stream, seq: d.Seq}
	yielding := false
	s.mu.Lock()
	if s.cfg.YieldAfter > 0 {
		now := time.Now()
		if d.SentAfter >= s.cfg.YieldAfter {
			s.yieldUntil = now.Add(s.yieldHold())
		} else {
			s.yieldUntil = time.Time{}
		}
		yielding = now.Before(s.yieldUntil)
	}
	if len(s.queue)-s.head >= s.cfg.QueueSize {
		s.loseLocked(mk)
		s.mu.Unlock()
		if yielding {
			s.deferred.Add(1)
			s.m.Deferred.Inc()
		} else {
			s.dropped.Add(1)
			s.m.Dropped.Inc()
		}
		return
	}
	s.queue = append(s.queue, mk)
	n := len(s.queue) - s.head
	s.mu.Unlock()
	if n >= s.cfg.BatchSize && !yielding {
		select {
		case s.wake <- struct{}{}:
		default:
		}
	}
}

// yieldHold is how long one mark sent late keeps the sweeper yielding: a
// catch-up delivers marks far more often than that; once they stop (caught
// up, or the relay stalled) the sweeper writes again.
func (s *Sweeper) yieldHold() time.Duration { return max(2*s.cfg.Interval, 500*time.Millisecond) }

// yielding reports whether the relay is catching up (see Config.YieldAfter).
func (s *Sweeper) yielding() bool {
	if s.cfg.YieldAfter <= 0 {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return time.Now().Before(s.yieldUntil)
}

// Hook returns the function to pass as relay.Config.OnDelivered: it queues
// the mark, then calls next (may be nil).
func (s *Sweeper) Hook(next func(relay.Delivered)) func(relay.Delivered) {
	return func(d relay.Delivered) {
		s.OnDelivered(d)
		if next != nil {
			next(d)
		}
	}
}

// take removes up to n marks from the head of the queue.
func (s *Sweeper) take(n int, into []mark) []mark {
	s.mu.Lock()
	defer s.mu.Unlock()
	avail := len(s.queue) - s.head
	if n > avail {
		n = avail
	}
	into = append(into[:0], s.queue[s.head:s.head+n]...)
	clear(s.queue[s.head : s.head+n])
	s.head += n
	if s.head == len(s.queue) {
		s.queue, s.head = s.queue[:0], 0
	} else if s.head > 4096 && s.head > len(s.queue)/2 {
		k := copy(s.queue, s.queue[s.head:])
		clear(s.queue[k:])
		s.queue, s.head = s.queue[:k], 0
	}
	s.m.Queue.Set(float64(len(s.queue) - s.head))
	return into
}

// Pending is the number of marks waiting in the queue, or waiting for their
// rows to become visible.
func (s *Sweeper) Pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue) - s.head + len(s.later)
}

// takeLater removes the marks waiting for their rows to become visible.
func (s *Sweeper) takeLater() []mark {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.later
	s.later = nil
	return l
}

// retryLater keeps marks whose rows were not visible for the next round, or,
// once unseen for unseenFor, drops them as evidence for the catch-up.
func (s *Sweeper) retryLater(unseen []mark) {
	if len(unseen) == 0 {
		return
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	gone := 0
	for _, mk := range unseen {
		if mk.unseenSince.IsZero() {
			mk.unseenSince = now
			s.m.Unseen.Inc()
		}
		if now.Sub(mk.unseenSince) < unseenFor {
			s.later = append(s.later, mk)
			continue
		}
		s.loseLocked(mk)
		gone++
	}
	if gone > 0 {
		s.dropped.Add(uint64(gone))
		s.m.Dropped.Add(float64(gone))
		s.log.Warn().Int("marks", gone).Stringer("after", unseenFor).
			Msg("delivered rows not found in the outbox table (deleted, or created_at differs from the decoded value); their marks are dropped")
	}
}

// Start runs the sweeper's goroutines (marks, gauges, maintenance) until the
// returned stop function is called. stop writes what is still queued (for
// at most Config.StopTimeout), then returns; ctx cancellation alone does not
// stop the sweeper, so the relay's final acks can still be marked.
func (s *Sweeper) Start(ctx context.Context) (stop func()) {
	base, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stopping := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(3)
	go func() { defer wg.Done(); s.markLoop(base, stopping) }()
	go func() { defer wg.Done(); s.statsLoop(base, stopping) }()
	go func() { defer wg.Done(); s.maintenanceLoop(base, stopping) }()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(stopping)
			timer := time.AfterFunc(s.cfg.StopTimeout, cancel)
			wg.Wait()
			timer.Stop()
			cancel()
			if n := s.Pending(); n > 0 {
				s.dropped.Add(uint64(n))
				s.m.Dropped.Add(float64(n))
				s.log.Warn().Int("marks", n).Msg("stopping with marks not written; those rows stay unprocessed until the next start reads the streams' newest messages back (harmless: the stream has them)")
			}
			s.Close()
		})
	}
}

func (s *Sweeper) markLoop(ctx context.Context, stopping <-chan struct{}) {
	ticker := time.NewTicker(s.cfg.Interval)
	defer ticker.Stop()
	var batch []mark
	lastDropped := uint64(0)
	yieldedAt, deferredAt := time.Time{}, uint64(0)
	for {
		final := false
		select {
		case <-ctx.Done():
			return
		case <-stopping:
			final = true
		case <-s.wake:
		case <-ticker.C:
		}
		if !final && s.yielding() {
			if yieldedAt.IsZero() {
				yieldedAt, deferredAt = time.Now(), s.deferred.Load()
				s.log.Info().Stringer("sent_after_at_least", s.cfg.YieldAfter).
					Msg("the relay is catching up: the sweeper yields until it has (marks beyond the queue are read back from the stream afterwards)")
			}
			continue
		}
		if !yieldedAt.IsZero() {
			n := s.deferred.Load() - deferredAt
			s.log.Info().Stringer("yielded_for", time.Since(yieldedAt).Round(time.Millisecond)).Uint64("deferred_marks", n).
				Msg("the relay has caught up: the sweeper writes its marks again")
			yieldedAt = time.Time{}
			if n > 0 {
				select {
				case s.catchUpNow <- struct{}{}:
				default:
				}
			}
		}
		if l := s.takeLater(); len(l) > 0 {
			s.retryLater(s.write(ctx, l))
			if ctx.Err() != nil {
				return
			}
		}
		for {
			batch = s.take(s.cfg.BatchSize, batch)
			if len(batch) == 0 {
				break
			}
			s.retryLater(s.write(ctx, batch))
			if ctx.Err() != nil {
				return
			}
			if len(batch) < s.cfg.BatchSize && !final {
				break
			}
		}
		if d := s.dropped.Load(); d != lastDropped {
			s.log.Warn().Uint64("dropped_total", d).Uint64("new", d-lastDropped).Int("queue", s.cfg.QueueSize).
				Msg("mark queue full: marks dropped (the relay never waits); the catch-up reads those messages back from the stream and marks their rows")
			lastDropped = d
		}
		if final {
			return
		}
	}
}

// write applies one batch, retrying with back-off while the database is away
// or the connection broke, and returns the marks whose rows it could not see.
// A batch the database refuses for good (say, permission denied) is dropped
// and counted.
func (s *Sweeper) write(ctx context.Context, batch []mark) (unseen []mark) {
	bo := retry.Backoff(s.cfg.BackoffInitial, s.cfg.BackoffMax)
	permanentFailures := 0
	for attempt := 1; ; attempt++ {
		w, err := s.apply(ctx, batch)
		if err == nil {
			if attempt > 1 {
				s.log.Info().Int("attempts", attempt).Msg("marks written again after a database error")
			}
			if w.procAll && w.errorAll {
				return nil // every mark found its row: the common case costs no more
			}
			return s.unseen(ctx, w, batch)
		}
		if ctx.Err() != nil {
			s.lose(batch...)
			s.dropped.Add(uint64(len(batch)))
			s.m.Dropped.Add(float64(len(batch)))
			return nil
		}
		s.info.Store(nil) // the table may have changed: look again
		if !fault.Transient(err) {
			permanentFailures++
			if permanentFailures >= 2 {
				s.log.Error().Err(err).Int("marks", len(batch)).Msg("marking rows failed; dropping this batch (the rows stay unprocessed)")
				s.lose(batch...)
				s.dropped.Add(uint64(len(batch)))
				s.m.Dropped.Add(float64(len(batch)))
				return nil
			}
		}
		wait := bo.NextBackOff()
		if attempt == 1 || attempt%10 == 0 {
			s.log.Warn().Err(err).Stringer("retry_in", wait).Int("attempt", attempt).Msg("marking rows failed; retrying (publishing goes on)")
		}
		select {
		case <-ctx.Done():
			s.lose(batch...)
			s.dropped.Add(uint64(len(batch)))
			s.m.Dropped.Add(float64(len(batch)))
			return nil
		case <-time.After(wait):
		}
	}
}

// tableInfo returns the outbox table's shape, inspecting it when unknown.
func (s *Sweeper) tableInfo(ctx context.Context) (*tableInfo, error) {
	if ti := s.info.Load(); ti != nil {
		return ti, nil
	}
	ti, err := inspect(ctx, s.pool, s.cfg.Table, s.cfg.Columns)
	if err != nil {
		return nil, err
	}
	if s.cfg.MarkProcessed && !ti.processed {
		s.warn("noprocessed", "outbox table has no boolean processed column: rows are not marked (archival needs it)")
	}
	s.info.Store(ti)
	return ti, nil
}

func (s *Sweeper) warn(key, msg string) {
	if _, loaded := s.warnOnce.LoadOrStore(key, true); !loaded {
		s.log.Warn().Str("table", s.cfg.Table.String()).Msg(msg)
	}
}

// marksProcessed: mk sets the processed flag (acked, or a stored dead letter).
func (ti *tableInfo) marksProcessed(mk *mark) bool { return ti.processed && (!mk.dlq || mk.stored) }

// marksError: mk writes a dead letter's reason.
func (ti *tableInfo) marksError(mk *mark) bool { return mk.dlq && ti.errorCol && !mk.errorDone }

// idCond matches an outbox row t to the id u.id of unnest(...) AS u.
func (ti *tableInfo) idCond() string {
	return fmt.Sprintf("t.%s = u.id::%s", cdc.QuoteIdent(ti.idCol), ti.idType)
}

// written is what apply wrote of a batch.
type written struct {
	ti       *tableInfo
	procAll  bool                // every processed flag of the batch was set
	errored  map[string]struct{} // ids whose dead-letter error was written
	errorAll bool                // every dead-letter error was written
}

// apply writes one batch: processed (and processed_at) for acked events and
// stored dead letters, error (and attempts) for dead letters whose rows do
// not record them yet, matching rows by id and created_at (so only the
// partition holding the row is touched), or by id alone when the table has
// no created_at role or the mark none. It reports which marks found their
// rows (see unseenFor for those that did not).
func (s *Sweeper) apply(ctx context.Context, batch []mark) (written, error) {
	ti, err := s.tableInfo(ctx)
	if err != nil {
		return written{}, err
	}
	// Each array goes as one parameter in PostgreSQL's text form, built as
	// the batch is read: pgx would box every element of a []string or
	// []time.Time to encode it (a fifth of the relay's allocations in a live
	// run), and the ack times as integers spare the server parsing
	// timestamps.
	type group struct {
		n                              int
		ids, cas, ats, reasons, stored arrayLiteral
	}
	var proc, procByID, dlq, dlqByID group
	for i := range batch {
		mk := &batch[i]
		byID := ti.createdCol == "" || mk.createdAt == ""
		if ti.marksProcessed(mk) {
			g := &proc
			if byID {
				g = &procByID
			}
			g.n++
			g.ids.text(mk.id)
			g.cas.text(mk.createdAt)
			g.ats.int(mk.at.UnixMicro())
		}
		if ti.marksError(mk) {
			g := &dlq
			if byID {
				g = &dlqByID
			}
			g.n++
			g.ids.text(mk.id)
			g.cas.text(mk.createdAt)
			g.reasons.text(mk.reason)
			g.stored.boolean(mk.stored)
		}
	}
	b := &pgx.Batch{}
	tq := ti.table.Quoted()
	idCond := ti.idCond()
	caCond := ""
	if ti.createdCol != "" {
		caCond = fmt.Sprintf(" AND t.%s = u.created_at::%s", cdc.QuoteIdent(ti.createdCol), ti.createdTy)
	}
	set := "processed = true"
	if ti.processedAt {
		// int8 * interval multiplies as float8: exact for microseconds up
		// to 2^53, the year 2255.
		set += ", processed_at = timestamptz 'epoch' + u.acked_us * interval '1 microsecond'"
	}
	eset := "error = u.reason"
	if ti.attempts {
		eset += ", attempts = t.attempts + 1"
	}
	// A dead letter's row is left as it is when it records that dead
	// letter already: stored, with this reason (and processed, which a
	// stored dead letter's batch sets in the same transaction). A stored
	// dead letter is final, the relay never tries its event again: it
	// comes again only when a read-back meets it in the dead-letter stream
	// (every start reads that stream's newest messages) or as the
	// duplicate a relay restarted before its checkpoint publishes, and
	// neither is an attempt; writing it would add to attempts and rewrite
	// the row each time. A dead letter the dead-letter stream refused is
	// not stored (its row stays unprocessed): each is an attempt of its
	// own. These statements run before the batch's processed flags are set,
	// so they see whether the row recorded the dead letter before it.
	recorded := "u.stored AND t.error IS NOT DISTINCT FROM u.reason"
	if ti.processed {
		recorded += " AND t.processed IS TRUE"
	}
	// The dead letters' statements return the ids of the rows that record
	// them, written now or before: attempts must count once, so a retry
	// needs to know which of them were written, and a mark whose row
	// recorded it already is done.
	errorStmt := func(unnest, cond string) string {
		return fmt.Sprintf(`WITH u AS (SELECT * FROM %s),
			w AS (UPDATE %s t SET %s FROM u WHERE %s AND NOT (%s) RETURNING u.id)
			SELECT id FROM w UNION ALL SELECT u.id FROM u JOIN %s t ON %s WHERE %s`, unnest, tq, eset, cond, recorded, tq, cond, recorded)
	}
	nerr := 0
	if dlq.n > 0 {
		b.Queue(errorStmt("unnest($1::text[], $2::text[], $3::text[], $4::bool[]) AS u(id, created_at, reason, stored)", idCond+caCond),
			dlq.ids.String(), dlq.cas.String(), dlq.reasons.String(), dlq.stored.String())
		nerr++
	}
	if dlqByID.n > 0 {
		b.Queue(errorStmt("unnest($1::text[], $2::text[], $3::bool[]) AS u(id, reason, stored)", idCond),
			dlqByID.ids.String(), dlqByID.reasons.String(), dlqByID.stored.String())
		nerr++
	}
	// A mark is a primary-key lookup, and its condition on processed is
	// written so that the partial index on unprocessed rows cannot serve
	// it: in the index's own form (cdc.Unprocessed) the planner scanned
	// every unprocessed row of every partition for each batch and joined
	// the marks to them, so a batch cost grew with the backlog of
	// unprocessed rows, not with its marks (24 ms per 1,000 marks beside
	// 60,000 unprocessed rows; 4 s with the 75,000 of the maintenance
	// bench, planned as a nested loop on stale statistics). IS DISTINCT
	// FROM true means the same on a NOT NULL and a nullable column, and
	// no partial index predicate matches it.
	notMarked := "t.processed IS DISTINCT FROM true"
	if proc.n > 0 {
		b.Queue(fmt.Sprintf(`UPDATE %s t SET %s FROM unnest($1::text[], $2::text[], $3::int8[]) AS u(id, created_at, acked_us)
			WHERE %s%s AND %s`, tq, set, idCond, caCond, notMarked),
			proc.ids.String(), proc.cas.String(), proc.ats.String())
	}
	if procByID.n > 0 {
		b.Queue(fmt.Sprintf(`UPDATE %s t SET %s FROM unnest($1::text[], $2::int8[]) AS u(id, acked_us)
			WHERE %s AND %s`, tq, set, idCond, notMarked), procByID.ids.String(), procByID.ats.String())
	}
	if b.Len() == 0 {
		return written{ti: ti, procAll: true, errorAll: true}, nil
	}
	// A batch runs as one implicit transaction: all or nothing, so a retry
	// after a failure does not count attempts twice.
	br := s.pool.SendBatch(ctx, b)
	var marked int64
	w := written{ti: ti}
	for i := range b.Len() {
		if i >= nerr {
			tag, err := br.Exec()
			if err != nil {
				br.Close()
				return written{}, err
			}
			marked += tag.RowsAffected()
			continue
		}
		if w.errored == nil {
			w.errored = map[string]struct{}{}
		}
		rows, err := br.Query()
		if err == nil {
			err = addIDs(rows, w.errored)
		}
		if err != nil {
			br.Close()
			return written{}, err
		}
	}
	if err := br.Close(); err != nil {
		return written{}, err
	}
	s.marked.Add(uint64(marked))
	s.m.Marked.Add(float64(marked))
	w.procAll = marked == int64(proc.n+procByID.n)
	w.errorAll = len(w.errored) == dlq.n+dlqByID.n
	return w, nil
}

// arrayLiteral builds a PostgreSQL array literal, one element at a time:
// text elements quoted, so that none reads as NULL and commas, braces and
// spaces stay in them, with backslash and double quote escaped
// ({"a","b\"c"}); integers as they are.
type arrayLiteral struct{ b []byte }

func (a *arrayLiteral) next() {
	if len(a.b) == 0 {
		a.b = append(a.b, '{')
	} else {
		a.b = append(a.b, ',')
	}
}

func (a *arrayLiteral) text(v string) {
	a.next()
	a.b = append(a.b, '"')
	for i := 0; i < len(v); i++ {
		if c := v[i]; c == '"' || c == '\\' {
			a.b = append(a.b, '\\')
		}
		a.b = append(a.b, v[i])
	}
	a.b = append(a.b, '"')
}

func (a *arrayLiteral) boolean(v bool) {
	a.next()
	if v {
		a.b = append(a.b, 't')
	} else {
		a.b = append(a.b, 'f')
	}
}

func (a *arrayLiteral) int(v int64) {
	a.next()
	a.b = strconv.AppendInt(a.b, v, 10)
}

// String is the literal; {} when nothing was added.
func (a *arrayLiteral) String() string {
	if len(a.b) == 0 {
		return "{}"
	}
	return string(append(a.b, '}'))
}

// addIDs adds the ids rows return (one text column) to set.
func addIDs(rows pgx.Rows, set map[string]struct{}) error {
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	for _, id := range ids {
		set[id] = struct{}{}
	}
	return err
}

// unseen returns the marks of batch that w left to be written: a mark can
// match no row because its row is processed already (a redelivery), or not
// visible to this session yet, or gone. When some processed flags were not
// set, the rows are looked up: a row processed by now needs nothing more; a
// row missing, or visible but unprocessed (it became visible after the
// update), is tried again. A failed lookup tries every flag again (harmless:
// setting it twice changes nothing); a dead letter's error is never written
// twice.
func (s *Sweeper) unseen(ctx context.Context, w written, batch []mark) []mark {
	ti := w.ti
	var processed map[string]struct{}
	var err error
	if !w.procAll {
		var ids arrayLiteral
		n := 0
		for i := range batch {
			if ti.marksProcessed(&batch[i]) {
				ids.text(batch[i].id)
				n++
			}
		}
		processed = make(map[string]struct{}, n)
		var rows pgx.Rows
		rows, err = s.pool.Query(ctx, fmt.Sprintf(`SELECT u.id FROM unnest($1::text[]) AS u(id) WHERE EXISTS (SELECT 1 FROM %s t WHERE %s AND t.processed)`,
			ti.table.Quoted(), ti.idCond()), ids.String())
		if err == nil {
			err = addIDs(rows, processed)
		}
		if err != nil {
			s.log.Debug().Err(err).Int("marks", n).Msg("could not look up the rows of marks that matched none; trying them again")
			clear(processed)
		}
	}
	var unseen []mark
	for _, mk := range batch {
		if _, ok := w.errored[mk.id]; ok && ti.marksError(&mk) {
			mk.errorDone = true
		}
		_, done := processed[mk.id]
		if ti.marksError(&mk) || (ti.marksProcessed(&mk) && !w.procAll && !done) {
			unseen = append(unseen, mk)
		}
	}
	return unseen
}

// Marked is the number of rows this sweeper marked processed.
func (s *Sweeper) Marked() uint64 { return s.marked.Load() }

// Dropped is the number of marks this sweeper dropped.
func (s *Sweeper) Dropped() uint64 { return s.dropped.Load() }

// Deferred is the number of marks left to the read-back while the sweeper
// yielded to a catching-up relay.
func (s *Sweeper) Deferred() uint64 { return s.deferred.Load() }

// statsLoop refreshes the unprocessed gauges.
func (s *Sweeper) statsLoop(ctx context.Context, stopping <-chan struct{}) {
	// The catch-up of dropped marks looks every 2 s (cheap: one look at
	// pg_replication_slots, and only after a drop); the gauges every
	// StatsInterval.
	tick := min(2*time.Second, s.cfg.StatsInterval)
	ticker := time.NewTicker(tick)
	defer ticker.Stop()
	var lastGauges time.Time
	for first := true; ; first = false {
		// While the relay catches up, the catch-up waits too (the ranges
		// stay in evidence): it would compete with the relay for the same
		// CPU and database. The first waits one tick, so that a relay
		// starting on a backlog is seen catching up before the read-back
		// at start begins.
		if !first && !s.yielding() {
			if err := s.catchUp(ctx); err != nil && ctx.Err() == nil {
				s.log.Warn().Err(err).Msg("catch-up of dropped marks failed; will retry")
			}
		}
		if time.Since(lastGauges) >= s.cfg.StatsInterval-tick/2 {
			lastGauges = time.Now()
			if _, err := s.refreshGauges(ctx); err != nil && ctx.Err() == nil {
				s.log.Debug().Err(err).Msg("unprocessed gauges not updated")
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-stopping:
			return
		case <-ticker.C:
		case <-s.catchUpNow:
		}
	}
}

// refreshGauges sets the unprocessed gauges and returns the number of rows
// not marked processed (0 when the table has no processed column).
func (s *Sweeper) refreshGauges(ctx context.Context) (unprocessedRows int64, err error) {
	ti, err := s.tableInfo(ctx)
	if err != nil {
		return 0, err
	}
	if ti.partitioned && ti.partCol != "" {
		// Without a default partition an INSERT past the newest partition
		// fails: how long until then (walbox_outbox_partitions_ahead_seconds).
		parts, err := partitions(ctx, s.pool, ti.table, ti.partType)
		if err != nil {
			return 0, err
		}
		var newest time.Time
		for _, p := range parts {
			if p.bounded && !p.detachPending && p.end.After(newest) {
				newest = p.end
			}
		}
		if !newest.IsZero() {
			s.m.PartitionsAhead.Set(time.Until(newest).Seconds())
		}
	}
	if !ti.processed {
		return 0, nil
	}
	n, age, err := unprocessed(ctx, s.pool, ti)
	if err != nil {
		return 0, err
	}
	s.m.Unprocessed.Set(float64(n))
	s.m.OldestUnprocessed.Set(age.Seconds())
	return n, nil
}

// catchUp marks the rows whose marks were dropped, from evidence alone: the
// stream sequences their acks named are read back, and each message of this
// source found there marks its row (a dead letter's row gets its reason). At
// start it reads back each stream's newest messages too, for the marks a
// crash or a shutdown left unwritten. A row is never marked because of its
// age or the slot's position: rows committed before a slot made without a
// snapshot, rows of a backfill cut short, and dead letters the DLQ refused
// were never delivered, and stay unprocessed.
func (s *Sweeper) catchUp(ctx context.Context) error {
	rb := s.reader.Load()
	if !s.cfg.MarkProcessed || rb == nil {
		return nil
	}
	type job struct {
		stream string
		r      seqRange
		tail   int
	}
	var jobs []job
	if s.tailOnStart.Load() {
		// A crash leaves at most this table's mark queue (its own
		// batch_size's) and the publish window unmarked: that many of its
		// newest messages in each stream. The read-back counts this
		// table's messages only, going back past those of other tables
		// and databases sharing the stream.
		tail := s.cfg.QueueSize + rb.window
		// At least as many as there are unprocessed rows: a stop while the
		// sweeper yielded (or after drops) can leave that many delivered
		// rows unmarked, beyond the mark queue and the publish window.
		n, err := s.refreshGauges(ctx)
		if err == nil && n > int64(tail) {
			tail = int(min(n, startTailMax))
		}
		// No unprocessed row: nothing a read-back could mark (a row
		// delivered but not marked is unprocessed), and a table whose
		// messages are sparse in a shared stream would read far back.
		if ti := s.info.Load(); err == nil && n == 0 && ti != nil && ti.processed {
			s.tailOnStart.Store(false)
		} else {
			for _, st := range rb.streams {
				jobs = append(jobs, job{stream: st, tail: tail})
			}
		}
	}
	s.mu.Lock()
	for st, r := range s.evidence {
		jobs = append(jobs, job{stream: st, r: r})
	}
	s.evidence = nil
	s.mu.Unlock()
	if len(jobs) == 0 {
		return nil
	}
	var total, read uint64
	for i, j := range jobs {
		var batch []mark
		flush := func() error {
			if len(batch) == 0 {
				return nil
			}
			before := s.marked.Load()
			_, err := s.apply(ctx, batch) // read back from a stream: a row not found now is not waited for
			total += s.marked.Load() - before
			batch = batch[:0]
			return err
		}
		var applyErr error
		rr := relay.ReadBackRange{First: j.r.first, Last: j.r.last, Want: j.tail, ScanMax: startScanMax}
		err := rb.r.ReadBack(ctx, j.stream, rb.source, rr, func(ev relay.StoredEvent) bool {
			if ev.ID == "" || !s.owns(ev.Table) {
				return false
			}
			read++
			if applyErr != nil {
				return true
			}
			// With its created_at the mark's UPDATE looks in the one
			// partition that holds the row (a start read-back of 10^6 ids
			// by id alone probes every partition's primary key for each);
			// without it (no created_at role, or a message from a relay
			// before walbox set the header) apply matches by id alone.
			//
			// processed_at is when this message was read back: the scan meets
			// messages the relay stores while it runs, and a time taken
			// before the scan would date the mark before its evidence.
			batch = append(batch, mark{id: ev.ID, createdAt: ev.CreatedAt, at: time.Now(), dlq: ev.Reason != "", stored: true, reason: ev.Reason})
			if len(batch) >= 1000 {
				applyErr = flush()
			}
			return true
		})
		if err == nil {
			err = applyErr
		}
		if err == nil {
			err = flush()
		}
		if err != nil {
			// Keep the evidence not yet read for the next round.
			s.mu.Lock()
			for _, rest := range jobs[i:] {
				if rest.tail == 0 {
					if s.evidence == nil {
						s.evidence = map[string]seqRange{}
					}
					s.evidence[rest.stream] = s.evidence[rest.stream].with(rest.r.first).with(rest.r.last)
				}
			}
			s.mu.Unlock()
			return fmt.Errorf("catch up marks from stream %s: %w", j.stream, err)
		}
	}
	s.tailOnStart.Store(false)
	s.log.Info().Uint64("rows", total).Uint64("messages", read).Int("ranges", len(jobs)).
		Msg("caught up dropped marks: rows whose ids were read back from their streams marked processed")
	return nil
}

// owns reports whether a stored message of table is one of this sweeper's
// rows: the same table, or no table named and this is the first table. A
// row is marked only from evidence about its own event: its table and id.
func (s *Sweeper) owns(table string) bool {
	if table == "" {
		return s.cfg.Unlabelled
	}
	return table == s.cfg.Table.String()
}

// startTailMax bounds this table's messages per stream the read-back at
// start looks for; startScanMax the messages it reads per stream (per Kafka
// partition) to find them, where the table's messages are sparse among other
// tables' and databases' (or it has unprocessed rows that were never
// delivered): past it, rows whose marks were lost stay unprocessed (safe,
// never wrong).
const (
	startTailMax = 1_000_000
	startScanMax = 10 * startTailMax
)

// unprocessed counts the rows not marked processed and the age of the oldest.
func unprocessed(ctx context.Context, q querier, ti *tableInfo) (int64, time.Duration, error) {
	age := "0::float8"
	if ti.createdCol != "" {
		age = fmt.Sprintf("coalesce(extract(epoch from now() - min(%s)::timestamptz), 0)::float8", cdc.QuoteIdent(ti.createdCol))
	}
	var n int64
	var secs float64
	err := q.QueryRow(ctx, fmt.Sprintf("SELECT count(*), %s FROM %s WHERE %s", age, ti.table.Quoted(), ti.unprocessed(""))).Scan(&n, &secs)
	if secs < 0 {
		secs = 0
	}
	return n, time.Duration(secs * float64(time.Second)), err
}

// maintenanceLoop runs Maintain at start and every MaintenanceInterval.
func (s *Sweeper) maintenanceLoop(ctx context.Context, stopping <-chan struct{}) {
	if s.cfg.NoMaintenance {
		s.log.Info().Str("table", s.cfg.Table.String()).Msg("sweeper.maintain is false: partitions and archival are left to the DBA (walbox archive, walbox.ensure_partitions)")
		return
	}
	bo := retry.Backoff(s.cfg.BackoffInitial, s.cfg.MaintenanceInterval)
	for {
		mctx, cancel := context.WithCancel(ctx)
		go func() {
			select {
			case <-stopping:
				cancel()
			case <-mctx.Done():
			}
		}()
		rep, err := s.Maintain(mctx, MaintainOptions{})
		cancel()
		wait := s.cfg.MaintenanceInterval
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			wait = bo.NextBackOff()
			if fault.SQLState(err) == fault.InsufficientPrivilege {
				s.m.MaintainFailures.WithLabelValues("privilege").Inc()
				// Not an outage: the role may not maintain the table. Say
				// so once with the fix, then try again at the normal pace.
				s.warn("maintain-privilege", fmt.Sprintf("partition upkeep and archival need ownership of %s (%v): grant walbox's role membership in the owner (see walbox migrate --print-grants), or set sweeper.maintain: false and run walbox archive from a DBA job", s.cfg.Table, err))
				wait = s.cfg.MaintenanceInterval
			} else {
				s.m.MaintainFailures.WithLabelValues("error").Inc()
				s.log.Warn().Err(err).Str("retry_in", wait.Round(time.Millisecond).String()).Msg("maintenance failed")
			}
		} else {
			bo.Reset()
			rep.log(s.log)
			if len(rep.Postponed) > 0 {
				wait = s.cfg.PostponedRetry
			}
		}
		now := time.Now()
		sched := &MaintenanceSchedule{Last: now, Next: now.Add(wait)}
		if err != nil {
			sched.Error = err.Error()
		} else if len(rep.Postponed) > 0 {
			sched.Error = fmt.Sprintf("%d step(s) postponed (a lock was not free in time)", len(rep.Postponed))
		}
		s.schedule.Store(sched)
		select {
		case <-ctx.Done():
			return
		case <-stopping:
			return
		case <-time.After(wait):
		}
	}
}

// MaintenanceSchedule is when the maintenance loop last ran, how that
// ended, and when it runs next.
type MaintenanceSchedule struct {
	Last  time.Time `json:"last"`
	Next  time.Time `json:"next"`
	Error string    `json:"error,omitempty"` // of the last run; "" when it went well
}

// Schedule is the maintenance loop's schedule; nil before its first run,
// and always with sweeper.maintain false.
func (s *Sweeper) Schedule() *MaintenanceSchedule { return s.schedule.Load() }

// MaintainOptions adjust one maintenance run.
type MaintainOptions struct {
	// DryRun reports what would be done and changes nothing.
	DryRun bool
	// Wait for another walbox's maintenance of this table to finish instead
	// of skipping the run.
	Wait bool
	// Progress, if set, receives a line now and then during long steps.
	Progress io.Writer
}
