// Package relay is walbox's delivery side, for any bus: routing outbox
// events to subjects (JetStream) or topics (Kafka), the pipelined publisher
// with its bounded window, the checkpoint that decides which LSN is safe to
// confirm, the resume check, and dead-lettering. The buses themselves are
// the Sinks in relay/jssink and relay/kafkasink.
package relay

import "github.com/walbox/walbox/cdc"

// Checkpoint decides which LSN the slot may confirm. The rule (DESIGN.md,
// "LSN rules"): the confirmable LSN is the end LSN of the newest transaction
// such that it and every earlier one is fully acked; a keepalive's WAL end is
// confirmable only when nothing at all is in flight.
//
// Events get consecutive sequence numbers in stream order. Acks normally come
// in that order (one connection, one window); a dead-lettered event may be
// acked later than its successors, so out-of-order acks are kept aside until
// the gap closes.
type Checkpoint struct {
	nextSeq uint64 // sequence of the next event
	ackedTo uint64 // every seq < ackedTo is acked
	early   map[uint64]struct{}
	txns    []txnMark // commits not yet confirmable, oldest first
	inTxn   bool

	confirmed cdc.LSN
}

type txnMark struct {
	end  cdc.LSN
	upto uint64 // every seq < upto belongs to this or an earlier transaction
}

// NewCheckpoint starts a checkpoint that has confirmed nothing yet.
func NewCheckpoint() *Checkpoint {
	return &Checkpoint{early: make(map[uint64]struct{})}
}

// Begin opens a transaction.
func (c *Checkpoint) Begin() { c.inTxn = true }

// NextSeq assigns the next event its sequence number.
func (c *Checkpoint) NextSeq() uint64 {
	s := c.nextSeq
	c.nextSeq++
	return s
}

// Commit closes the open transaction, whose end LSN is end. It returns the
// new confirmable LSN and whether it moved.
func (c *Checkpoint) Commit(end cdc.LSN) (cdc.LSN, bool) {
	c.inTxn = false
	c.txns = append(c.txns, txnMark{end: end, upto: c.nextSeq})
	return c.advance()
}

// Ack records that the event with sequence seq is durably stored (or
// dead-lettered). It returns the new confirmable LSN and whether it moved.
func (c *Checkpoint) Ack(seq uint64) (cdc.LSN, bool) {
	if seq == c.ackedTo {
		c.ackedTo++
		for len(c.early) > 0 {
			if _, ok := c.early[c.ackedTo]; !ok {
				break
			}
			delete(c.early, c.ackedTo)
			c.ackedTo++
		}
	} else if seq > c.ackedTo {
		c.early[seq] = struct{}{}
		return c.confirmed, false
	}
	return c.advance()
}

// WALEnd offers a keepalive's WAL end. It is taken only when no transaction is
// open or waiting and every event is acked: otherwise confirming it would
// pass an unacked event.
func (c *Checkpoint) WALEnd(lsn cdc.LSN) (cdc.LSN, bool) {
	if c.Idle() && lsn > c.confirmed {
		c.confirmed = lsn
		return lsn, true
	}
	return c.confirmed, false
}

// Idle reports whether nothing is in flight.
func (c *Checkpoint) Idle() bool {
	return !c.inTxn && len(c.txns) == 0 && c.ackedTo == c.nextSeq
}

// Unacked is the number of events handed out but not yet acked.
func (c *Checkpoint) Unacked() uint64 { return c.nextSeq - c.ackedTo }

// Confirmed returns the highest confirmable LSN of the session so far.
func (c *Checkpoint) Confirmed() cdc.LSN { return c.confirmed }

// Reset forgets everything in flight: after a reconnect the server resends
// from the slot's confirmed position, so unfinished transactions come again.
// It forgets the confirmed LSN too: a new session's slot may be a new one,
// or on another server (a restore, a promoted standby) whose positions are
// all below the last session's, and a position kept from the old slot
// would hold every confirmation of the new one back until the new WAL
// passed it (WAL piling up, the backfill marker never cleared). Within one
// slot nothing is lost by starting from zero: the server resends from the
// slot's confirmed_flush_lsn and ignores a confirmation below it.
func (c *Checkpoint) Reset() {
	c.txns = c.txns[:0]
	c.inTxn = false
	c.ackedTo = c.nextSeq
	clear(c.early)
	c.confirmed = 0
}

func (c *Checkpoint) advance() (cdc.LSN, bool) {
	moved := false
	i := 0
	for ; i < len(c.txns) && c.txns[i].upto <= c.ackedTo; i++ {
		if c.txns[i].end > c.confirmed {
			c.confirmed = c.txns[i].end
			moved = true
		}
	}
	if i > 0 {
		n := copy(c.txns, c.txns[i:])
		c.txns = c.txns[:n]
	}
	return c.confirmed, moved
}
