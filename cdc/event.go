// Package cdc is walbox's Postgres side: the replication connection, slot and
// publication upkeep, and the decoding of pgoutput messages into outbox events
// that carry their transaction's commit position.
//
// One goroutine (Source.Run) owns the replication connection: pgconn.PgConn is
// not safe for concurrent use. Everything else talks to it through the batch
// channel (events out) and Source.Confirm (the flush LSN back in).
package cdc

import (
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
)

// LSN is a position in the write-ahead log.
type LSN = pglogrepl.LSN

// Position identifies an event in commit order: the commit LSN of its
// transaction (pgoutput's Begin.FinalLSN, known before the first row arrives)
// and its index within that transaction. Positions compare in the order in
// which JetStream must store the events.
type Position struct {
	CommitLSN LSN
	Index     uint32
}

// Less reports whether p comes before q in commit order.
func (p Position) Less(q Position) bool {
	if p.CommitLSN != q.CommitLSN {
		return p.CommitLSN < q.CommitLSN
	}
	return p.Index < q.Index
}

func (p Position) String() string { return fmt.Sprintf("%s/%d", p.CommitLSN, p.Index) }

// Event is one outbox row (or one table-less message), decoded by column role.
// Byte slices are owned by the event: they were copied out of pgx's receive
// buffer, which is reused for the next message.
type Event struct {
	Pos        Position
	CommitTime time.Time
	// SentAfter is how long after the commit the server sent this event,
	// both read from the server's clock (the XLogData send time minus the
	// commit time): milliseconds when the relay keeps up, the backlog's age
	// while it catches up. 0 for backfilled rows.
	SentAfter time.Duration
	// Table is the index of the event's outbox table in cdc.Config.Tables
	// (for a logical message: the table it names, or the default table).
	Table int
	// TableLess: a table-less event (walbox.emit_message): Table only says
	// whose routing applies; no row of it exists to mark.
	TableLess bool

	ID            string
	Topic         string
	TopicNull     bool
	Stream        string
	EventType     string
	AggregateType string
	AggregateID   string
	PartitionKey  string
	CreatedAt     string
	Payload       []byte
	PayloadNull   bool
	// PayloadIsJSON is false when the payload column is not json/jsonb, so the
	// relay must validate it before publishing (a poison row is dead-lettered).
	PayloadIsJSON bool
	Headers       []byte // JSON object from the headers column, if mapped and not NULL
	// Poison, when set, says why the event cannot be published as it is:
	// the relay dead-letters it with this reason.
	Poison string
}

// ChangeKind tells what a Change carries.
type ChangeKind uint8

const (
	// KindBegin opens a transaction; LSN is its commit LSN.
	KindBegin ChangeKind = iota + 1
	// KindEvent carries one outbox event of the open transaction.
	KindEvent
	// KindCommit closes the open transaction; LSN is its end LSN, the one
	// that is safe to confirm once every event in it is acked.
	KindCommit
	// KindWALEnd reports the server's WAL end from a keepalive while no
	// transaction is open. It may be confirmed only when nothing is in flight.
	KindWALEnd
	// KindReset says the replication connection was re-established: the server
	// resends from the slot's confirmed_flush_lsn, so the receiver must forget
	// any transaction it has not finished.
	KindReset
	// KindOrigin names the WAL history (Origin) that the positions of the
	// changes after it belong to. It starts every session, after KindReset.
	KindOrigin
)

// Change is one element of the ordered stream a Source hands to the relay.
type Change struct {
	Kind   ChangeKind
	LSN    LSN
	Event  Event   // only for KindEvent
	Origin *Origin // only for KindOrigin
}
