package ops

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/fault"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/sweep"
)

// staleAfter: relay_status older than this means the leader stopped
// writing it (it writes every second).
const staleAfter = 10 * time.Second

// RelayState is what walbox.relay_status and the leader lock say.
type RelayState struct {
	// State is running (status written in the last 10 s), stale (older) or
	// unknown (no row, or no walbox.relay_status table).
	State             string    `json:"state"`
	Leader            string    `json:"leader,omitempty"` // host/pid of the relay that wrote it
	UpdatedAt         time.Time `json:"updated_at,omitzero"`
	UpdatedAgoSeconds float64   `json:"updated_ago_seconds"`
	ConfirmedLSN      string    `json:"confirmed_lsn,omitempty"`
	LagBytes          int64     `json:"lag_bytes"`
	// LagSeconds is the age of the oldest committed event not yet acked by
	// JetStream (0 when caught up): the commit-to-ack lag.
	LagSeconds      float64 `json:"lag_seconds"`
	EventsPerSecond float64 `json:"events_per_second"`
	// LockHeld: some session holds the slot's leader lock (a relay leads);
	// LockPID is its backend pid.
	LockHeld bool   `json:"leader_lock_held"`
	LockPID  int    `json:"leader_lock_pid,omitempty"`
	Note     string `json:"note,omitempty"`
}

// OutboxState is the outbox table's side.
type OutboxState struct {
	Table string `json:"table"`
	// Unprocessed is -1 when unknown (no processed column).
	Unprocessed              int64   `json:"unprocessed"`
	OldestUnprocessedSeconds float64 `json:"oldest_unprocessed_seconds"`
	// DeadLettered rows (error set); -1 when the table has no error column.
	DeadLettered int64                   `json:"dead_lettered"`
	Partitioned  bool                    `json:"partitioned"`
	Partitions   []sweep.PartitionStatus `json:"partitions,omitempty"`
	DefaultRows  int64                   `json:"default_partition_rows"`
	Archive      *sweep.ArchiveStatus    `json:"archive,omitempty"`
	Error        string                  `json:"error,omitempty"`
}

// StatusReport is `walbox status`: one screen about the relay.
type StatusReport struct {
	Slot       string      `json:"slot"`
	Source     string      `json:"source"`
	Relay      RelayState  `json:"relay"`
	SlotStatus SlotReport  `json:"replication_slot"`
	Outbox     OutboxState `json:"outbox"`
	// Outboxes has every outbox table (outbox is the default one).
	Outboxes []OutboxState `json:"outboxes"`
	DLQ      *StreamCount  `json:"dlq,omitempty"`
	// LostHistory, per stream, counts the events of this source among the
	// stream's newest 2 x nats.window messages whose WAL positions (this
	// system, this timeline) the server has not reached: published from a
	// history the database no longer has (it was restored from a
	// snapshot). Only streams with such events are listed.
	LostHistory []StreamCount `json:"lost_history,omitempty"`
	Errors      []string      `json:"errors,omitempty"`
}

// StreamCount is a stream's message count, or why it is unknown.
type StreamCount struct {
	Stream   string `json:"stream"`
	Messages uint64 `json:"messages"`
	Error    string `json:"error,omitempty"`
}

// Status gathers the report. Parts that cannot be read are reported in
// Errors (and their fields left empty); only an unreachable database is an
// error.
func Status(ctx context.Context, cfg config.Config) (*StatusReport, error) {
	return status(ctx, cfg, true)
}

// status is Status; lostHistory false skips reading back the streams'
// tails (the web console samples the rest every few seconds).
func status(ctx context.Context, cfg config.Config, lostHistory bool) (*StatusReport, error) {
	tables, err := cfg.Tables()
	if err != nil {
		return nil, err
	}
	rep := &StatusReport{Slot: cfg.Postgres.Slot, Source: source(cfg)}
	conn, err := connectPG(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer closePG(ctx, conn)

	rep.Relay = readRelayState(ctx, conn, cfg.Postgres.Slot, rep)
	st, err := cdc.ReadSlotStatus(ctx, conn, cfg.Postgres.Slot)
	if err != nil && !errors.Is(err, cdc.ErrNoSlot) {
		rep.Errors = append(rep.Errors, err.Error())
	}
	rep.SlotStatus = slotReport(st)
	for _, t := range tables {
		o := readOutbox(ctx, conn, cfg, t)
		if t.Default {
			rep.Outbox = o
		}
		rep.Outboxes = append(rep.Outboxes, o)
	}

	// The dead-letter stream (topic), when the bus answers quickly.
	nctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	rep.DLQ = &StreamCount{Stream: DLQName(cfg)}
	bus, err := openBus(nctx, cfg)
	if err != nil {
		rep.DLQ.Error = err.Error()
		return rep, nil
	}
	defer bus.Close()
	// With Kafka past the offsets walbox dlq retry committed (group
	// walbox-dlq).
	dlq, err := bus.DeadLetters(nctx)
	if err == nil {
		rep.DLQ.Messages, err = dlq.Count(nctx)
	}
	if err != nil {
		rep.DLQ.Error = err.Error()
	}
	if lostHistory {
		readLostHistory(ctx, cfg, bus, bus.Streams(), rep)
	}
	return rep, nil
}

// tailReader reads back a stream's (topic's) tail as the relay's resume
// check does: jssink.Sink and kafkasink.Sink.
type tailReader interface {
	StoredTail(ctx context.Context, stream, source string, n int) (relay.StoredTail, error)
}

// readLostHistory fills rep.LostHistory: each stream's tail read back as the
// relay's resume check reads it, its positions compared with how far the
// server's WAL has reached (relay.loop's rewind proof, seen from outside).
func readLostHistory(ctx context.Context, cfg config.Config, r tailReader, streams []string, rep *StatusReport) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	origin, err := cdc.IdentifyServer(ctx, cfg.Postgres.URL)
	if err != nil {
		rep.Errors = append(rep.Errors, fmt.Sprintf("identify the server (for events of a lost history): %v", err))
		return
	}
	for _, name := range streams {
		tail, err := r.StoredTail(ctx, name, rep.Source, 2*cfg.NATS.Window)
		if err != nil {
			rep.Errors = append(rep.Errors, fmt.Sprintf("read back %s: %v", name, err))
			continue
		}
		if n := relay.LostHistoryEvents(tail, origin); n > 0 {
			rep.LostHistory = append(rep.LostHistory, StreamCount{Stream: name, Messages: uint64(n)})
		}
	}
}

func readRelayState(ctx context.Context, conn *pgx.Conn, slot string, rep *StatusReport) RelayState {
	rs := RelayState{State: "unknown"}
	var leader, lsn *string
	var lagBytes *int64
	var lagSec, eps *float64
	var ago float64
	err := conn.QueryRow(ctx, `SELECT updated_at, leader, confirmed_lsn::text, lag_bytes, lag_seconds, events_per_second,
		extract(epoch FROM now() - updated_at)::float8 FROM walbox.relay_status WHERE slot_name = $1`, slot).
		Scan(&rs.UpdatedAt, &leader, &lsn, &lagBytes, &lagSec, &eps, &ago)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		rs.Note = "no relay has written walbox.relay_status for this slot yet"
	case fault.MissingRelation(err):
		rs.Note = "walbox.relay_status does not exist (run walbox migrate)"
	case err != nil:
		rep.Errors = append(rep.Errors, fmt.Sprintf("read walbox.relay_status: %v", err))
	default:
		rs.UpdatedAgoSeconds = ago
		rs.State = "running"
		if time.Duration(ago*float64(time.Second)) > staleAfter {
			rs.State = "stale"
		}
		rs.Leader, rs.ConfirmedLSN = deref(leader), deref(lsn)
		if lagBytes != nil {
			rs.LagBytes = *lagBytes
		}
		if lagSec != nil {
			rs.LagSeconds = *lagSec
		}
		if eps != nil {
			rs.EventsPerSecond = *eps
		}
	}
	// The leader lock is a session advisory lock on a bigint key: pg_locks
	// shows its high half as classid, its low half as objid, objsubid 1.
	err = conn.QueryRow(ctx, `WITH k AS (SELECT hashtextextended('walbox:' || $1, 0) AS key)
		SELECT l.pid FROM pg_locks l, k
		 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
		   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
		   AND l.classid = ((k.key >> 32) & 4294967295)::oid AND l.objid = (k.key & 4294967295)::oid
		 LIMIT 1`, slot).Scan(&rs.LockPID)
	switch {
	case err == nil:
		rs.LockHeld = true
	case errors.Is(err, pgx.ErrNoRows):
	default:
		rep.Errors = append(rep.Errors, fmt.Sprintf("read the leader lock: %v", err))
	}
	if rs.State == "running" && !rs.LockHeld {
		rs.Note = "relay_status is fresh but nobody holds the leader lock: the relay just stopped"
	}
	if rs.State == "stale" && rs.LockHeld {
		rs.Note = "a relay holds the leader lock but has not written relay_status recently (starting, or cannot write it)"
	}
	return rs
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// readOutbox asks the sweeper's Status for the outbox and archive state,
// and falls back to plain counts when it cannot.
func readOutbox(ctx context.Context, conn *pgx.Conn, cfg config.Config, t config.Table) OutboxState {
	table := t.Name
	out := OutboxState{Table: table.String(), Unprocessed: -1, DeadLettered: -1}
	sw, err := app.NewTableSweeper(cfg, t, zerolog.Nop(), nil)
	if err == nil {
		st, serr := sw.Status(ctx)
		sw.Close()
		if serr == nil {
			if st.HasProcessed {
				out.Unprocessed = st.Unprocessed
				out.OldestUnprocessedSeconds = st.OldestUnprocessed.Seconds()
			}
			out.DeadLettered = st.DeadLettered
			out.Partitioned = st.Partitioned
			out.Partitions = st.Partitions
			out.DefaultRows = st.DefaultRows
			arch := st.Archive
			out.Archive = &arch
			return out
		}
		err = serr
	}
	// Fallback: counts by hand.
	_, notNull, cerr := cdc.ProcessedFlag(ctx, conn, table)
	if cerr != nil {
		out.Error = fmt.Sprintf("%v; counting by hand: %v", err, cerr)
		return out
	}
	q := fmt.Sprintf(`SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM %s WHERE %s`,
		table.Quoted(), cdc.Unprocessed("", notNull))
	if cerr := conn.QueryRow(ctx, q).Scan(&out.Unprocessed, &out.OldestUnprocessedSeconds); cerr != nil {
		out.Unprocessed = -1
		out.Error = fmt.Sprintf("%v; counting by hand: %v", err, cerr)
		return out
	}
	_ = conn.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s WHERE error IS NOT NULL`, table.Quoted())).Scan(&out.DeadLettered)
	return out
}

// Print writes the report on one screen.
func (r *StatusReport) Print(w io.Writer) {
	line := func(k, format string, args ...any) { fmt.Fprintf(w, "%-14s %s\n", k, fmt.Sprintf(format, args...)) }
	var names []string
	for _, o := range r.Outboxes {
		names = append(names, o.Table)
	}
	if len(names) == 0 {
		names = []string{r.Outbox.Table}
	}
	what := "table"
	if len(names) > 1 {
		what = "tables"
	}
	fmt.Fprintf(w, "walbox status: slot %s, source %s, %s %s\n\n", r.Slot, r.Source, what, strings.Join(names, ", "))
	rs := r.Relay
	switch rs.State {
	case "unknown":
		line("relay", "unknown")
	default:
		line("relay", "%s (leader %s, status written %s ago)", rs.State, orDash(rs.Leader), humanDuration(time.Duration(rs.UpdatedAgoSeconds*float64(time.Second))))
	}
	if rs.LockHeld {
		line("leader lock", "held by backend pid %d (one relay streams; others wait as standby)", rs.LockPID)
	} else {
		line("leader lock", "not held: no relay is streaming")
	}
	if rs.Note != "" {
		line("", "note: %s", rs.Note)
	}
	if rs.State != "unknown" {
		line("throughput", "%.1f events/s", rs.EventsPerSecond)
		line("commit->ack", "%s lag (age of the oldest committed event not yet acked; percentiles: walbox_commit_to_ack_seconds)", humanDuration(time.Duration(rs.LagSeconds*float64(time.Second))))
		line("confirmed LSN", "%s", orDash(rs.ConfirmedLSN))
	}
	s := r.SlotStatus
	if !s.Exists {
		line("slot", "%s does not exist (walbox run creates it)", s.Slot)
	} else {
		active := "inactive"
		if s.Active {
			active = fmt.Sprintf("active (walsender pid %d)", s.ActivePID)
		}
		line("slot", "%s, %s", active, walStatusText(s.WALStatus))
		line("  lag", "%s not yet confirmed (%d bytes)", HumanBytes(s.LagBytes), s.LagBytes)
		line("  retained", "%s of WAL (%d bytes)", HumanBytes(s.RetainedBytes), s.RetainedBytes)
		if s.SafeWALSize >= 0 {
			line("  safe size", "%s more before the slot is in danger", HumanBytes(s.SafeWALSize))
		}
	}
	outboxes := r.Outboxes
	if len(outboxes) == 0 {
		outboxes = []OutboxState{r.Outbox}
	}
	for _, o := range outboxes {
		if len(outboxes) > 1 {
			fmt.Fprintf(w, "%s\n", o.Table)
		}
		printOutbox(line, o)
	}
	if r.DLQ != nil {
		if r.DLQ.Error != "" {
			line("DLQ stream", "%s: unknown (%s)", r.DLQ.Stream, r.DLQ.Error)
		} else {
			line("DLQ stream", "%s: %d messages (walbox dlq list)", r.DLQ.Stream, r.DLQ.Messages)
		}
	}
	for _, lh := range r.LostHistory {
		line("lost history", "%s: %d events from WAL this database has not reached (it was restored from a snapshot; docs/operations.md, WalboxDatabaseRestored)", lh.Stream, lh.Messages)
	}
	for _, e := range r.Errors {
		line("error", "%s", e)
	}
}

// printOutbox writes one outbox table's lines of the report.
func printOutbox(line func(k, format string, args ...any), o OutboxState) {
	switch {
	case o.Error != "":
		line("outbox", "unknown: %s", o.Error)
	case o.Unprocessed < 0:
		line("outbox", "no processed column: unprocessed rows are not tracked")
	default:
		line("outbox", "%d unprocessed (oldest %s)", o.Unprocessed, humanDuration(time.Duration(o.OldestUnprocessedSeconds*float64(time.Second))))
	}
	if o.DeadLettered >= 0 {
		line("dead-lettered", "%d rows with error set", o.DeadLettered)
	}
	if o.Partitioned {
		var dated []sweep.PartitionStatus
		def := "no default partition"
		for _, p := range o.Partitions {
			if !p.Default {
				dated = append(dated, p)
			} else {
				def = fmt.Sprintf("default partition %s: %d rows (an older walbox's is emptied and removed by the sweeper)", p.Name, o.DefaultRows)
			}
		}
		if len(dated) > 0 {
			line("partitions", "%d dated, %s .. %s; %s", len(dated),
				dated[0].From.Format("2006-01-02"), dated[len(dated)-1].To.Format("2006-01-02"), def)
		} else {
			line("partitions", "none dated; %s", def)
		}
	}
	if a := o.Archive; a != nil {
		var parts []string
		if !a.Exists {
			parts = append(parts, "not created yet")
		} else if o.Partitioned {
			parts = append(parts, fmt.Sprintf("%d partitions", len(a.Partitions)))
		} else {
			parts = append(parts, fmt.Sprintf("~%d rows", a.EstimatedRows))
		}
		if len(a.Blocked) > 0 {
			var b []string
			for _, x := range a.Blocked {
				b = append(b, fmt.Sprintf("%s (%d unprocessed)", x.Partition, x.Unprocessed))
			}
			parts = append(parts, "blocked: "+strings.Join(b, ", "))
		}
		if len(a.Pending) > 0 {
			parts = append(parts, "pending: "+strings.Join(a.Pending, ", "))
		}
		if a.Exported > 0 || a.Deleted > 0 {
			parts = append(parts, fmt.Sprintf("%d exported (%d rows), %d deleted", a.Exported, a.ExportedRows, a.Deleted))
		}
		if a.Store != "" {
			parts = append(parts, "store "+a.Store)
		}
		line("archive", "%s: %s", a.Table, strings.Join(parts, "; "))
	}
}

// PrintJSON writes the report as JSON.
func (r *StatusReport) PrintJSON(w io.Writer) error { return WriteJSON(w, r) }
