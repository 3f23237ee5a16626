package cdc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/retry"
)

// Config configures a Source. Zero values take the defaults noted per field.
type Config struct {
	// ConnString is a regular Postgres URL or DSN; replication=database is added.
	ConnString  string
	Slot        string
	Publication string
	// Tables are the outbox tables; Event.Table is an index into them.
	// Table and Columns are the one-table shorthand, used when Tables is
	// empty.
	Tables  []Table
	Table   TableName
	Columns Columns
	// DefaultTable is the index of the table whose settings apply to a
	// logical message (walbox.emit_message) that names no table.
	DefaultTable int
	// OnUnknownTable, if set, is asked about a table the publication
	// streams that is not in Tables (added to the configuration and the
	// publication while walbox runs). It returns the table's index for
	// Event.Table (the next free one) and its columns; ok false: the
	// table's rows are not published (and a warning says so). It is
	// called from the replication goroutine, before the first row of the
	// table is handed over.
	OnUnknownTable func(TableName) (idx int, cols Columns, ok bool)
	// CreatePublication lets the source create a missing publication.
	CreatePublication bool
	// StatusInterval is how often a standby status update is sent even when
	// nothing changed; it must stay well below the server's wal_sender_timeout
	// (default 60 s). Default 10 s.
	StatusInterval time.Duration
	// BatchSize is how many changes are handed over at once inside a large
	// transaction (a commit always hands over what it has). Default 512.
	BatchSize int
	// BatchBytes hands a batch over once its payloads and headers reach
	// this many bytes, whatever its length (default 8 MiB): memory is
	// bounded by bytes, not by row count.
	BatchBytes int64
	// BackoffInitial and BackoffMax bound the reconnect back-off (1 s doubling
	// to 60 s, with jitter, by default).
	BackoffInitial time.Duration
	BackoffMax     time.Duration
	// FailOnSlotLost makes a dropped or invalidated slot a fatal error. By
	// default walbox recreates the slot from a snapshot and republishes the
	// unprocessed rows (the processed flag is the durable index for that).
	FailOnSlotLost bool
	// FailoverSlot creates the slot with FAILOVER (PostgreSQL 17+).
	FailoverSlot bool
	// Origin is pgoutput's origin filter (PostgreSQL 16+): "none" streams
	// only changes made on this server, not those applied by a logical
	// replication subscription; "" or "any" streams both.
	Origin string
	// OnSlotLost, if set, is told each time the slot was found lost: reason
	// is SlotMissing or SlotInvalidated, msg the logged explanation.
	OnSlotLost func(reason, msg string)
	// OnReconnect, if set, is called before each reconnection attempt.
	OnReconnect func()
	// HeartbeatInterval: when the confirmed position has not moved for this
	// long, emit pg_logical_emit_message(false, 'walbox.heartbeat', ...) so an
	// idle outbox in a busy cluster holds no WAL back. 0 turns it off.
	HeartbeatInterval time.Duration
	// SessionGate, if set, runs before every replication session; an
	// error keeps the session from starting (the leader lock was lost: the
	// caller stops the source).
	SessionGate func(ctx context.Context) error
	Logger      zerolog.Logger
}

// DefaultStatusInterval is the longest gap between standby status updates
// (postgres.status_interval): well below wal_sender_timeout's 60 s.
const DefaultStatusInterval = 10 * time.Second

func (c *Config) setDefaults() {
	if c.StatusInterval <= 0 {
		c.StatusInterval = DefaultStatusInterval
	}
	if c.BatchSize <= 0 {
		c.BatchSize = 512
	}
	if c.BatchBytes <= 0 {
		c.BatchBytes = 8 << 20
	}
	c.BackoffInitial, c.BackoffMax = retry.Defaults(c.BackoffInitial, c.BackoffMax)
}

// Source streams outbox inserts from a pgoutput slot. Run owns the
// replication connection; Confirm may be called from any goroutine.
type Source struct {
	cfg       Config
	log       zerolog.Logger
	confirmed confirmation // highest LSN the relay says is safe to flush, and the fence
	sessions  atomic.Int64
	received  atomic.Uint64 // last WAL position received, for lag
	connected atomic.Bool
	hadSlot   atomic.Bool            // the slot existed during this process: its absence is a loss
	slotGen   atomic.Uint64          // slots this process created; a backfill marker belongs to one
	origin    atomic.Pointer[Origin] // of the current or last session

	noMarkerWarned atomic.Bool
	background     sync.WaitGroup // marker upkeep; Run waits for it

	// free holds batches the consumer is done with (Recycle): a batch is
	// handed over at every commit, and allocating a fresh one each time was
	// a tenth of the relay's catch-up CPU (allocation and GC).
	free chan []Change

	tablesMu sync.Mutex
	tables   []Table // Config.Tables and those OnUnknownTable added
	ignored  map[TableName]bool
}

// Table is one outbox table and the columns of its roles.
type Table struct {
	Name    TableName
	Columns Columns
}

// Tables returns the outbox tables, those added while running included.
func (s *Source) Tables() []Table {
	s.tablesMu.Lock()
	defer s.tablesMu.Unlock()
	return slices.Clone(s.tables)
}

// unknownTable is the decoder's hook for a published table it does not know.
func (s *Source) unknownTable(name TableName) (int, Columns, bool) {
	s.tablesMu.Lock()
	defer s.tablesMu.Unlock()
	for i, t := range s.tables {
		if t.Name == name {
			return i, t.Columns, true
		}
	}
	if s.cfg.OnUnknownTable != nil {
		if i, cols, ok := s.cfg.OnUnknownTable(name); ok {
			for len(s.tables) <= i {
				s.tables = append(s.tables, Table{})
			}
			s.tables[i] = Table{Name: name, Columns: cols}
			s.log.Info().Str("table", name.String()).Int("index", i).Msg("publishing a newly configured outbox table")
			return i, cols, true
		}
	}
	if !s.ignored[name] {
		if s.ignored == nil {
			s.ignored = map[TableName]bool{}
		}
		s.ignored[name] = true
		s.log.Warn().Str("table", name.String()).Str("publication", s.cfg.Publication).
			Msg("the publication streams a table that is not a configured outbox table: its rows are not published (add it to outboxes, or take it out of the publication)")
	}
	return -1, Columns{}, false
}

// Recycle gives back a batch received from Run once nothing refers to its
// changes any more; Run reuses it. Optional: an unreturned batch is GC'd.
func (s *Source) Recycle(b []Change) {
	if cap(b) == 0 || cap(b) > 4*s.cfg.BatchSize {
		return
	}
	clear(b) // drop the references to payloads and strings
	select {
	case s.free <- b[:0]:
	default:
	}
}

// newBatch returns an empty batch, a recycled one when there is one.
func (s *Source) newBatch() []Change {
	select {
	case b := <-s.free:
		return b
	default:
		return make([]Change, 0, 32)
	}
}

// NewSource validates cfg and returns a Source.
func NewSource(cfg Config) (*Source, error) {
	cfg.setDefaults()
	if cfg.ConnString == "" {
		return nil, &ConfigError{Key: "postgres.url", Msg: "is required (env WALBOX_POSTGRES_URL, flag --postgres-url)"}
	}
	if cfg.Slot == "" {
		return nil, &ConfigError{Key: "postgres.slot", Msg: "is required"}
	}
	if cfg.Publication == "" {
		return nil, &ConfigError{Key: "postgres.publication", Msg: "is required"}
	}
	if len(cfg.Tables) == 0 && cfg.Table.Name != "" {
		cfg.Tables = []Table{{Name: cfg.Table, Columns: cfg.Columns}}
	}
	if len(cfg.Tables) == 0 {
		return nil, &ConfigError{Key: "outbox.table", Msg: "is required"}
	}
	if cfg.DefaultTable < 0 || cfg.DefaultTable >= len(cfg.Tables) {
		cfg.DefaultTable = 0
	}
	return &Source{cfg: cfg, log: cfg.Logger.With().Str("component", "cdc").Logger(), free: make(chan []Change, 8),
		tables: slices.Clone(cfg.Tables)}, nil
}

// Confirm records that every transaction ending at or before lsn is fully
// delivered, so the slot may release WAL up to it. It never moves backwards
// within one session's slot.
func (s *Source) Confirm(lsn LSN) { s.confirmed.confirm(lsn) }

// ResetTaken is called by the relay once it has handled a KindReset: every
// confirmation after it belongs to the new session's slot.
func (s *Source) ResetTaken() { s.confirmed.unfence() }

// Origin returns the WAL history of the current (or last) session.
func (s *Source) Origin() *Origin { return s.origin.Load() }

// Confirmed returns the highest LSN passed to Confirm.
func (s *Source) Confirmed() LSN { return s.confirmed.load() }

// Received returns the last WAL position the server sent.
func (s *Source) Received() LSN { return LSN(s.received.Load()) }

// Connected reports whether the replication stream is up.
func (s *Source) Connected() bool { return s.connected.Load() }

// Run streams changes into out until ctx is cancelled, reconnecting with
// back-off after transient failures. It returns nil on cancellation and an
// error only for problems that reconnecting cannot fix (configuration,
// missing privileges, wrong wal_level), which name their fix. Batches are
// handed over in commit order; after a reconnect a KindReset change comes
// first, because the server resends from the slot's confirmed position.
func (s *Source) Run(ctx context.Context, out chan<- []Change) error {
	defer s.background.Wait()
	if s.cfg.HeartbeatInterval > 0 {
		hbCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		go s.heartbeat(hbCtx)
	}
	bo := retry.Backoff(s.cfg.BackoffInitial, s.cfg.BackoffMax)
	for {
		streamed, err := s.session(ctx, out)
		s.connected.Store(false)
		if ctx.Err() != nil {
			return nil
		}
		if IsPermanent(err) {
			return err
		}
		if streamed {
			bo.Reset()
		}
		wait := bo.NextBackOff()
		s.log.Warn().Err(err).Stringer("retry_in", wait).Msg("replication stream interrupted; reconnecting")
		if s.cfg.OnReconnect != nil {
			s.cfg.OnReconnect()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// connectReplication opens a logical replication connection to connString;
// a connection error comes classified (permanent ones name their fix).
func connectReplication(ctx context.Context, connString string) (*pgconn.PgConn, error) {
	pcfg, err := replicationConfig(connString)
	if err != nil {
		return nil, err
	}
	conn, err := pgconn.ConnectConfig(ctx, pcfg)
	if err != nil {
		return nil, classifyConnectError(fmt.Errorf("connect for replication: %w", err))
	}
	return conn, nil
}

// awaitSlotReleased waits, at shutdown, until the walsender that served
// this process has let go of the slot. Closing the replication connection
// returns before the server's walsender has noticed and released the slot,
// so without this wait a clean stop could exit with the slot still active:
// `walbox slot drop` right after it (the pg_upgrade procedure,
// docs/operations.md §5) refused it, and a standby's takeover found it held.
// Bounded at 5 s; a slot still held then is logged.
func (s *Source) awaitSlotReleased(walsender uint32) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.cfg.ConnString)
	if err != nil {
		s.log.Warn().Err(err).Msg("could not check that the slot was released at shutdown")
		return
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for {
		var held bool
		err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active_pid = $2)`,
			s.cfg.Slot, int64(walsender)).Scan(&held)
		if err != nil {
			s.log.Warn().Err(err).Msg("could not check that the slot was released at shutdown")
			return
		}
		if !held {
			return
		}
		select {
		case <-ctx.Done():
			s.log.Warn().Uint32("walsender_pid", walsender).Str("slot", s.cfg.Slot).
				Msg("the server's walsender still holds the slot 5 s after walbox closed its connection")
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// replicationURL adds replication=database to a connection string.
func replicationConfig(connString string) (*pgconn.Config, error) {
	cfg, err := pgconn.ParseConfig(connString)
	if err != nil {
		// pgconn masks the password in its parse errors.
		return nil, &ConfigError{Key: "postgres.url", Msg: fmt.Sprintf("cannot parse: %v", err)}
	}
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["application_name"] = "walbox"
	return cfg, nil
}

// session runs one replication connection from connect to failure. streamed
// reports whether data flowed (so the back-off can start over).
func (s *Source) session(ctx context.Context, out chan<- []Change) (streamed bool, err error) {
	if s.cfg.SessionGate != nil {
		gateCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := s.cfg.SessionGate(gateCtx)
		cancel()
		if err != nil {
			return false, fmt.Errorf("before a replication session: %w", err)
		}
	}
	connectCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	conn, err := connectReplication(connectCtx, s.cfg.ConnString)
	cancel()
	if err != nil {
		return false, err
	}
	walsender := conn.PID()
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn.Close(closeCtx)
		cancel()
		if ctx.Err() != nil {
			s.awaitSlotReleased(walsender)
		}
	}()

	if err := checkServer(ctx, conn); err != nil {
		return false, err
	}
	origin, err := identify(ctx, conn)
	if err != nil {
		return false, classifyConnectError(err)
	}
	if prev := s.origin.Load(); prev != nil {
		switch {
		case prev.SystemID != origin.SystemID:
			s.log.Warn().Str("old_system_id", prev.SystemID).Str("new_system_id", origin.SystemID).Int32("timeline", origin.Timeline).
				Msg("the server is another PostgreSQL cluster than before (a restore, a new cluster, or one with the same names): its WAL positions do not continue the old ones; event ids alone decide what is already stored")
		case prev.Timeline != origin.Timeline:
			s.log.Warn().Str("system_id", origin.SystemID).Int32("old_timeline", prev.Timeline).Int32("new_timeline", origin.Timeline).
				Msg("the server is on another timeline than before (a standby was promoted): positions are compared only on the history the timelines share")
		}
	}
	s.origin.Store(origin)
	tables := s.Tables()
	if err := ensurePublication(ctx, conn, s.cfg.Publication, tables, s.cfg.CreatePublication); err != nil {
		return false, err
	}
	for _, t := range tables {
		if err := checkColumns(ctx, conn, t.Name, t.Columns); err != nil {
			return false, err
		}
	}
	// After a reconnect the server resends from confirmed_flush_lsn: the
	// relay must forget what it had not finished before anything new arrives.
	var prefix []Change
	if s.sessions.Load() > 0 {
		prefix = []Change{{Kind: KindReset}}
		// What was confirmed belongs to the last session's slot, which may
		// be gone, or on a server whose WAL is elsewhere: start over from
		// the slot's own position (the server resends from it; a status
		// update of 0 is ignored). Confirmations of the old session that
		// arrive before the relay takes the reset are dropped.
		s.confirmed.fence()
	}
	prefix = append(prefix, Change{Kind: KindOrigin, Origin: origin})
	created, err := s.ensureSlot(ctx, conn)
	if err != nil {
		return false, err
	}
	if created != nil {
		gen := s.slotGen.Add(1)
		consistent, err := pglogrepl.ParseLSN(created.ConsistentPoint)
		if err != nil {
			return false, fmt.Errorf("parse consistent point %q: %w", created.ConsistentPoint, err)
		}
		s.log.Info().Str("slot", s.cfg.Slot).Stringer("consistent_point", consistent).Msg("created replication slot; backfilling unprocessed rows from its snapshot")
		if err := s.backfill(ctx, created.SnapshotName, consistent, tables, out, prefix); err != nil {
			return false, err
		}
		prefix = nil
		s.background.Add(1)
		go func() {
			defer s.background.Done()
			s.clearMarkerWhenConfirmed(ctx, consistent, gen)
		}()
	}

	// Start at LSN 0: on an existing slot the server resumes at
	// confirmed_flush_lsn. Starting at IDENTIFY_SYSTEM's position would skip
	// transactions that were never acked.
	if s.cfg.Origin == "none" {
		if v, verr := serverVersion(ctx, conn); verr == nil && v < 160000 {
			return false, &PreconditionError{What: fmt.Sprintf("postgres.origin: none needs PostgreSQL 16 or newer; this server is %d", v/10000),
				Fix: "set postgres.origin: any (rows a subscription applies are then published too; Nats-Msg-Id drops those the stream already holds)"}
		}
	}
	args := pluginArgs(s.cfg.Publication, s.cfg.Origin)
	err = pglogrepl.StartReplication(ctx, conn, s.cfg.Slot, 0, pglogrepl.StartReplicationOptions{PluginArgs: args})
	if err != nil {
		switch sqlState(err) {
		case stateUndefinedObject:
			return false, fmt.Errorf("%w: start replication: %v", ErrSlotLost, err)
		case stateObjectInUse:
			return false, fmt.Errorf("replication slot %q is active for another process (another walbox?); will retry: %w", s.cfg.Slot, err)
		}
		return false, classifyConnectError(fmt.Errorf("start replication on slot %s: %w", s.cfg.Slot, err))
	}
	s.connected.Store(true)
	session := s.sessions.Add(1)
	s.log.Info().Str("slot", s.cfg.Slot).Int64("session", session).Stringer("confirmed", s.Confirmed()).Msg("replication started")

	dec := newTablesDecoder(tables)
	dec.unknown, dec.defaultTable = s.unknownTable, s.cfg.DefaultTable
	st := &stream{src: s, conn: conn, out: out, dec: dec, batch: prefix}
	err = st.run(ctx)
	return st.streamed, err
}

// pluginArgs are pgoutput's options for START_REPLICATION: protocol
// version 1 (no streaming of transactions in progress, so every change
// arrives between its Begin and Commit), the publication, logical messages
// (table-less events and heartbeats), and the origin filter.
func pluginArgs(publication, origin string) []string {
	args := []string{
		"proto_version '1'",
		"publication_names " + QuoteLiteral(publication),
		"messages 'true'",
	}
	if origin == "none" {
		args = append(args, "origin 'none'")
	}
	return args
}

// stream is the state of one replication session.
type stream struct {
	src        *Source
	conn       *pgconn.PgConn
	out        chan<- []Change
	dec        *decoder
	batch      []Change
	batchBytes int64 // payloads and headers in batch
	streamed   bool

	serverWALEnd LSN
	lastSent     LSN
	nextStatus   time.Time
	deadline     time.Time
}

func (st *stream) run(ctx context.Context) error {
	netConn := st.conn.Conn()
	// Cancelling ctx interrupts a blocked read by moving the deadline to now.
	// ReceiveMessage gets context.Background(): a per-call deadline context
	// was half of the receive cost in profiles.
	stop := context.AfterFunc(ctx, func() { _ = netConn.SetReadDeadline(time.Now()) })
	defer stop()
	defer st.finalStatus()

	interval := st.src.cfg.StatusInterval
	st.nextStatus = time.Now().Add(interval)
	for {
		now := time.Now()
		if !now.Before(st.nextStatus) {
			if err := st.sendStatus(false); err != nil {
				return err
			}
			st.nextStatus = now.Add(interval)
		}
		if !st.deadline.Equal(st.nextStatus) {
			st.deadline = st.nextStatus
			if err := netConn.SetReadDeadline(st.deadline); err != nil {
				return fmt.Errorf("set read deadline: %w", err)
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
		}
		msg, err := st.conn.ReceiveMessage(context.Background())
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if pgconn.Timeout(err) || isNetTimeout(err) {
				continue
			}
			return fmt.Errorf("receive replication message: %w", err)
		}
		switch m := msg.(type) {
		case *pgproto3.CopyData:
			if err := st.handleCopyData(ctx, m.Data); err != nil {
				return err
			}
		case *pgproto3.ErrorResponse:
			pgErr := pgconn.ErrorResponseToPgError(m)
			if pgErr.Code == stateObjectNotInPrereqState || pgErr.Code == stateUndefinedObject {
				return fmt.Errorf("%w: %v", ErrSlotLost, pgErr)
			}
			return fmt.Errorf("replication stream: %w", pgErr)
		case *pgproto3.CopyDone:
			return errors.New("replication stream: server ended the copy stream")
		default:
			// NoticeResponse and the like carry nothing for us.
		}
	}
}

func isNetTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func (st *stream) handleCopyData(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("parse keepalive: %w", err)
		}
		if ka.ServerWALEnd > st.serverWALEnd {
			st.serverWALEnd = ka.ServerWALEnd
			st.src.received.Store(uint64(ka.ServerWALEnd))
		}
		if !st.dec.inTxn && ka.ServerWALEnd > 0 {
			// The WAL end is confirmable only once everything handed over
			// before it is acked; the relay decides, in order.
			st.batch = append(st.batch, Change{Kind: KindWALEnd, LSN: ka.ServerWALEnd})
			if err := st.flush(ctx); err != nil {
				return err
			}
		}
		if ka.ReplyRequested {
			return st.sendStatus(false)
		}
		return nil
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("parse XLogData: %w", err)
		}
		st.streamed = true
		return st.handleWAL(ctx, xld)
	}
	return nil
}

func (st *stream) handleWAL(ctx context.Context, xld pglogrepl.XLogData) error {
	d := xld.WALData
	if len(d) == 0 {
		return nil
	}
	switch pglogrepl.MessageType(d[0]) {
	case pglogrepl.MessageTypeBegin:
		var m pglogrepl.BeginMessage
		if err := m.Decode(d[1:]); err != nil {
			return fmt.Errorf("decode begin: %w", err)
		}
		st.dec.inTxn = true
		st.dec.commitLSN = m.FinalLSN
		st.dec.commitTime = m.CommitTime
		st.dec.index = 0
		st.batch = append(st.batch, Change{Kind: KindBegin, LSN: m.FinalLSN})
	case pglogrepl.MessageTypeInsert:
		st.batch = append(st.batch, Change{Kind: KindEvent})
		ok, err := st.dec.insert(d, &st.batch[len(st.batch)-1].Event)
		if err != nil {
			return err
		}
		if !ok {
			st.batch = st.batch[:len(st.batch)-1]
			return nil
		}
		return st.appended(ctx, xld.ServerTime)
	case pglogrepl.MessageTypeCommit:
		var m pglogrepl.CommitMessage
		if err := m.Decode(d[1:]); err != nil {
			return fmt.Errorf("decode commit: %w", err)
		}
		st.dec.inTxn = false
		// Confirm TransactionEndLSN, never CommitLSN: confirming the commit
		// record's start makes the server send the transaction again.
		st.batch = append(st.batch, Change{Kind: KindCommit, LSN: m.TransactionEndLSN})
		if xld.ServerWALEnd > st.serverWALEnd {
			st.serverWALEnd = xld.ServerWALEnd
			st.src.received.Store(uint64(xld.ServerWALEnd))
		}
		return st.flush(ctx)
	case pglogrepl.MessageTypeRelation:
		m, err := pglogrepl.Parse(d)
		if err != nil {
			return fmt.Errorf("decode relation: %w", err)
		}
		return st.dec.relation(m.(*pglogrepl.RelationMessage))
	case pglogrepl.MessageTypeMessage:
		var m pglogrepl.LogicalDecodingMessage
		if err := m.Decode(d[1:]); err != nil {
			return fmt.Errorf("decode logical message: %w", err)
		}
		if m.Transactional && m.Prefix == MessagePrefix && st.dec.inTxn {
			st.batch = append(st.batch, Change{Kind: KindEvent})
			if err := st.dec.message(m.Content, &st.batch[len(st.batch)-1].Event); err != nil {
				// A malformed message is still an event: the relay
				// dead-letters it with the reason.
				st.src.log.Error().Err(err).Stringer("lsn", m.LSN).Msg("table-less event with a malformed body")
			}
			return st.appended(ctx, xld.ServerTime)
		} else if !m.Transactional && !st.dec.inTxn {
			// A heartbeat: everything before it was handed over already.
			st.batch = append(st.batch, Change{Kind: KindWALEnd, LSN: m.LSN})
			return st.flush(ctx)
		}
	default:
		// Type, Origin and anything else carry no outbox rows.
	}
	return nil
}

// appended accounts for the event just appended to the batch (sent by the
// server at sent) and hands the batch over when it is full.
func (st *stream) appended(ctx context.Context, sent time.Time) error {
	ev := &st.batch[len(st.batch)-1].Event
	ev.SentAfter = sentAfter(sent, ev.CommitTime)
	st.batchBytes += int64(len(ev.Payload) + len(ev.Headers))
	if len(st.batch) >= st.src.cfg.BatchSize || st.batchBytes >= st.src.cfg.BatchBytes {
		return st.flush(ctx)
	}
	return nil
}

// sentAfter is how long after its commit the server sent an event; a send
// time the server did not fill in (zero), or a commit stamped after it (the
// clock stepped back), gives 0.
func sentAfter(sent, commit time.Time) time.Duration {
	if sent.IsZero() || commit.IsZero() || sent.Before(commit) {
		return 0
	}
	return sent.Sub(commit)
}

// flush hands the batch to the relay. While the relay is not taking batches
// (NATS down, window full) status updates keep flowing, or the walsender
// would drop the connection after wal_sender_timeout.
func (st *stream) flush(ctx context.Context) error {
	if len(st.batch) == 0 {
		return nil
	}
	b := st.batch
	st.batch = st.src.newBatch()
	st.batchBytes = 0
	select {
	case st.out <- b: // the relay is waiting for it: no timer needed
		return nil
	default:
	}
	for {
		wait := time.Until(st.nextStatus)
		if wait <= 0 {
			if err := st.sendStatus(false); err != nil {
				return err
			}
			st.nextStatus = time.Now().Add(st.src.cfg.StatusInterval)
			continue
		}
		timer := time.NewTimer(wait)
		select {
		case st.out <- b:
			timer.Stop()
			return nil
		case <-ctx.Done():
			timer.Stop()
			return ctx.Err()
		case <-timer.C:
		}
	}
}

// sendStatus reports the relay's confirmed position. Write, Flush and Apply
// are all set explicitly: pglogrepl copies Write into a zero Flush, and the
// server advances confirmed_flush_lsn from Flush.
func (st *stream) sendStatus(reply bool) error {
	lsn := st.src.Confirmed()
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), st.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: lsn,
		WALFlushPosition: lsn,
		WALApplyPosition: lsn,
		ClientTime:       time.Now(),
		ReplyRequested:   reply,
	})
	if err != nil {
		return fmt.Errorf("send standby status: %w", err)
	}
	if lsn != st.lastSent {
		st.src.log.Debug().Stringer("flush_lsn", lsn).Msg("confirmed")
	}
	st.lastSent = lsn
	return nil
}

// finalStatus sends the last confirmed position before the connection closes,
// so a clean shutdown leaves the slot exactly at what was acked.
func (st *stream) finalStatus() {
	if st.conn.IsClosed() {
		return
	}
	_ = st.conn.Conn().SetWriteDeadline(time.Now().Add(2 * time.Second))
	_ = st.sendStatus(false)
}
