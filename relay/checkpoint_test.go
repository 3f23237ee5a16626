package relay

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/walbox/walbox/cdc"
)

// A checkpoint script: each step is one call; want is Confirmed() after it
// (checked for Commit, Ack and WALEnd, and for the others when non-zero).
type ckOp int

const (
	opBegin  ckOp = iota // Begin()
	opEvent              // NextSeq(); arg is the expected sequence
	opCommit             // Commit(arg)
	opAck                // Ack(arg)
	opWALEnd             // WALEnd(arg)
	opReset              // Reset()
)

type ckStep struct {
	op   ckOp
	arg  uint64
	want cdc.LSN
}

func (s ckStep) String() string {
	name := [...]string{"Begin", "Event", "Commit", "Ack", "WALEnd", "Reset"}[s.op]
	return fmt.Sprintf("%s(%d)", name, s.arg)
}

func begin() ckStep           { return ckStep{op: opBegin} }
func event(seq uint64) ckStep { return ckStep{op: opEvent, arg: seq} }
func reset() ckStep           { return ckStep{op: opReset} }
func commit(end uint64, want uint64) ckStep {
	return ckStep{op: opCommit, arg: end, want: cdc.LSN(want)}
}
func ack(seq uint64, want uint64) ckStep { return ckStep{op: opAck, arg: seq, want: cdc.LSN(want)} }
func walEnd(lsn uint64, want uint64) ckStep {
	return ckStep{op: opWALEnd, arg: lsn, want: cdc.LSN(want)}
}

// runScript plays steps and checks the confirmed LSN after each one. A step
// that reports a move must report it exactly when Confirmed() grew.
func runScript(t *testing.T, c *Checkpoint, steps []ckStep) {
	t.Helper()
	var trace []string
	for i, s := range steps {
		trace = append(trace, s.String())
		before := c.Confirmed()
		var got cdc.LSN
		var moved, reports bool
		switch s.op {
		case opBegin:
			c.Begin()
		case opEvent:
			if seq := c.NextSeq(); seq != s.arg {
				t.Fatalf("step %d %s: NextSeq = %d, want %d", i, s, seq, s.arg)
			}
		case opCommit:
			got, moved = c.Commit(cdc.LSN(s.arg))
			reports = true
		case opAck:
			got, moved = c.Ack(s.arg)
			reports = true
		case opWALEnd:
			got, moved = c.WALEnd(cdc.LSN(s.arg))
			reports = true
		case opReset:
			c.Reset()
		}
		after := c.Confirmed()
		if s.op == opReset {
			before = after // a new session starts from nothing (see Reset)
		}
		if s.op != opEvent && s.op != opBegin && s.op != opReset || s.want != 0 {
			if after != s.want {
				t.Fatalf("after %s: Confirmed() = %d, want %d", strings.Join(trace, " "), after, s.want)
			}
		}
		if after < before {
			t.Fatalf("after %s: confirmed moved backwards from %d to %d", strings.Join(trace, " "), before, after)
		}
		if reports {
			if got != after {
				t.Fatalf("after %s: call returned %d but Confirmed() = %d", strings.Join(trace, " "), got, after)
			}
			if moved != (after != before) {
				t.Fatalf("after %s: moved = %v, but confirmed went %d -> %d", strings.Join(trace, " "), moved, before, after)
			}
		}
	}
}

// ckCase is a named script.
type ckCase struct {
	name  string
	steps []ckStep
}

// runCases plays each case on a fresh checkpoint, as a subtest.
func runCases(t *testing.T, cases []ckCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { run(t, tc.steps...) })
	}
}

// run plays steps on a fresh checkpoint.
func run(t *testing.T, steps ...ckStep) *Checkpoint {
	t.Helper()
	c := NewCheckpoint()
	runScript(t, c, steps)
	return c
}

func TestConfirmIsEndLSNOfNewestFullyAckedTransaction(t *testing.T) {
	runCases(t, []ckCase{
		{"nothing confirmed at start", nil},
		{"one transaction confirms its end LSN after its last ack", []ckStep{
			begin(), event(0), event(1), commit(100, 0),
			ack(0, 0), ack(1, 100),
		}},
		{"acks before commit confirm at commit", []ckStep{
			begin(), event(0), event(1), ack(0, 0), ack(1, 0), commit(100, 100),
		}},
		{"the newest of several acked transactions is confirmed", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), event(1), commit(200, 0),
			begin(), event(2), commit(300, 0),
			ack(0, 100), ack(1, 200), ack(2, 300),
		}},
		{"one ack can confirm several transactions at once", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), event(1), commit(200, 0),
			begin(), event(2), commit(300, 0),
			ack(2, 0), ack(1, 0), ack(0, 300),
		}},
		{"acks of an open transaction confirm only the committed ones before it", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), event(1), event(2),
			ack(0, 100), ack(1, 100), ack(2, 100),
			commit(200, 200),
		}},
		{"confirms the end LSN, never a lower position inside the transaction", []ckStep{
			begin(), event(0), event(1), event(2), commit(0x16B3748, 0),
			ack(0, 0), ack(1, 0), ack(2, 0x16B3748),
		}},
	})
}

func TestConfirmNeverPassesUnackedTransaction(t *testing.T) {
	runCases(t, []ckCase{
		{"later transaction acked, earlier not", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), event(1), commit(200, 0),
			ack(1, 0),
		}},
		{"first event of a transaction unacked", []ckStep{
			begin(), event(0), event(1), event(2), commit(100, 0),
			ack(1, 0), ack(2, 0),
		}},
		{"last event of a transaction unacked", []ckStep{
			begin(), event(0), event(1), event(2), commit(100, 0),
			ack(0, 0), ack(1, 0),
		}},
		{"stops at the first transaction with an unacked event", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), event(1), event(2), commit(200, 0),
			begin(), event(3), commit(300, 0),
			ack(0, 100), ack(1, 100), ack(3, 100),
			ack(2, 300),
		}},
		{"an empty transaction after an unacked one waits", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), commit(200, 0),
			begin(), commit(300, 0),
			ack(0, 300),
		}},
		{"a keepalive does not pass an unacked transaction", []ckStep{
			begin(), event(0), commit(100, 0),
			walEnd(500, 0),
			ack(0, 100),
		}},
	})
}

func TestLateDeadLetterAckDoesNotLetConfirmationPassTheGap(t *testing.T) {
	// Event 1 was dead-lettered: it is resent to the DLQ behind its
	// successors, so its ack comes after theirs.
	runCases(t, []ckCase{
		{"gap inside one transaction", []ckStep{
			begin(), event(0), event(1), event(2), event(3), commit(100, 0),
			ack(0, 0), ack(2, 0), ack(3, 0),
			ack(1, 100),
		}},
		{"gap in an earlier transaction holds back later ones", []ckStep{
			begin(), event(0), event(1), commit(100, 0),
			begin(), event(2), commit(200, 0),
			begin(), event(3), commit(300, 0),
			ack(0, 0), ack(2, 0), ack(3, 0),
			ack(1, 300),
		}},
		{"two gaps close one after the other", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), event(1), commit(200, 0),
			begin(), event(2), commit(300, 0),
			begin(), event(3), commit(400, 0),
			ack(1, 0), ack(3, 0),
			ack(0, 200),
			ack(2, 400),
		}},
		{"acks in reverse order", []ckStep{
			begin(), event(0), event(1), event(2), event(3), event(4), commit(100, 0),
			ack(4, 0), ack(3, 0), ack(2, 0), ack(1, 0), ack(0, 100),
		}},
		{"a late ack arrives after later transactions were committed", []ckStep{
			begin(), event(0), event(1), commit(100, 0),
			ack(1, 0),
			begin(), event(2), commit(200, 0),
			ack(2, 0),
			ack(0, 200),
		}},
		{"a keepalive while the dead letter is unacked is refused", []ckStep{
			begin(), event(0), event(1), commit(100, 0),
			ack(1, 0),
			walEnd(150, 0),
			ack(0, 100),
			walEnd(150, 150),
		}},
	})
}

func TestWALEndTakenOnlyWhenNothingInFlight(t *testing.T) {
	runCases(t, []ckCase{
		{"fresh checkpoint takes it", []ckStep{walEnd(100, 100)}},
		{"idle after a confirmed transaction takes it", []ckStep{
			begin(), event(0), commit(100, 0), ack(0, 100),
			walEnd(200, 200),
		}},
		{"open transaction without events refuses it", []ckStep{
			begin(), walEnd(100, 0),
		}},
		{"open transaction with acked events refuses it", []ckStep{
			begin(), event(0), ack(0, 0), walEnd(100, 0),
			commit(150, 150), walEnd(200, 200),
		}},
		{"committed but unconfirmed transaction refuses it", []ckStep{
			begin(), event(0), commit(100, 0), walEnd(200, 0),
			ack(0, 100), walEnd(200, 200),
		}},
		{"unacked event refuses it", []ckStep{
			begin(), event(0), event(1), commit(100, 0), ack(0, 0),
			walEnd(200, 0),
		}},
		{"early (out-of-order) ack does not make it idle", []ckStep{
			begin(), event(0), event(1), commit(100, 0), ack(1, 0),
			walEnd(200, 0),
		}},
		{"lower than confirmed: kept, not moved back", []ckStep{
			walEnd(500, 500), walEnd(400, 500), walEnd(500, 500),
		}},
		{"successive keepalives advance", []ckStep{
			walEnd(100, 100), walEnd(200, 200), walEnd(300, 300),
		}},
		{"after Reset an open transaction is forgotten", []ckStep{
			begin(), event(0), reset(), walEnd(100, 100),
		}},
	})
}

func TestEmptyTransactionConfirmsOnceEarlierOnesAreAcked(t *testing.T) {
	runCases(t, []ckCase{
		{"alone: confirms at commit", []ckStep{
			begin(), commit(100, 100),
		}},
		{"several alone", []ckStep{
			begin(), commit(100, 100), begin(), commit(200, 200),
		}},
		{"after an acked transaction: confirms at commit", []ckStep{
			begin(), event(0), commit(100, 0), ack(0, 100),
			begin(), commit(200, 200),
		}},
		{"after an unacked transaction: waits for its ack", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), commit(200, 0),
			ack(0, 200),
		}},
		{"between two transactions", []ckStep{
			begin(), event(0), commit(100, 0),
			begin(), commit(200, 0),
			begin(), event(1), commit(300, 0),
			ack(0, 200), ack(1, 300),
		}},
		{"with an ack of a later open transaction", []ckStep{
			begin(), commit(100, 100),
			begin(), event(0), ack(0, 100), commit(200, 200),
		}},
	})
}

// A reset starts a new replication session, whose slot may be new or on
// another server (a restore, a promoted standby) with lower positions than
// the last session's: what was confirmed belongs to the old slot. Issue 33,
// item 7: with the old confirmed position kept, the new session's
// transactions were never confirmed.
func TestResetStartsConfirmingTheNewSessionFromNothing(t *testing.T) {
	runCases(t, []ckCase{
		{"a new session with lower positions is confirmed", []ckStep{
			begin(), event(0), commit(1000, 0), ack(0, 1000),
			reset(),
			begin(), event(1), commit(500, 0), ack(1, 500),
			begin(), event(2), commit(600, 500), ack(2, 600),
		}},
		{"a keepalive of a new session with a lower WAL end is taken", []ckStep{
			walEnd(1000, 1000), reset(), walEnd(300, 300),
		}},
		{"unconfirmed transactions are forgotten", []ckStep{
			begin(), event(0), commit(100, 0), ack(0, 100),
			begin(), event(1), commit(200, 100),
			reset(),
			ack(1, 0), // stale ack from before the reconnect
			walEnd(150, 150),
		}},
		{"open transaction is forgotten", []ckStep{
			begin(), event(0), event(1), ack(0, 0),
			reset(),
			walEnd(100, 100),
		}},
		{"early acks are forgotten", []ckStep{
			begin(), event(0), event(1), event(2), commit(100, 0),
			ack(2, 0), ack(1, 0),
			reset(),
			// The server resends the transaction; the new events get new
			// sequences and need their own acks.
			begin(), event(3), event(4), event(5), commit(100, 0),
			ack(3, 0), ack(4, 0), ack(5, 100),
		}},
		{"stale acks of old sequences after a reset do not confirm resent transactions", []ckStep{
			begin(), event(0), event(1), commit(100, 0),
			reset(),
			begin(), event(2), event(3), commit(100, 0),
			ack(0, 0), ack(1, 0),
			ack(2, 0), ack(3, 100),
		}},
		{"a resent transaction is confirmed again (the server ignores a position below its slot's)", []ckStep{
			begin(), event(0), commit(100, 0), ack(0, 100),
			begin(), event(1), commit(200, 100),
			reset(),
			begin(), event(2), commit(100, 0), ack(2, 100),
			begin(), event(3), commit(200, 100), ack(3, 200),
		}},
		{"reset on a fresh checkpoint", []ckStep{
			reset(), walEnd(10, 10), reset(), walEnd(5, 5),
		}},
	})
}

func TestResetMakesCheckpointIdle(t *testing.T) {
	c := run(t, begin(), event(0), event(1), commit(100, 0), begin(), event(2))
	if c.Idle() {
		t.Fatal("Idle() with events in flight")
	}
	if got := c.Unacked(); got != 3 {
		t.Fatalf("Unacked() = %d, want 3", got)
	}
	c.Ack(2) // an early ack, kept aside until the gap closes
	c.Reset()
	if !c.Idle() {
		t.Fatal("not Idle() after Reset")
	}
	if len(c.early) != 0 || len(c.txns) != 0 {
		t.Fatalf("Reset kept %d early acks and %d transactions: memory must not grow across reconnects", len(c.early), len(c.txns))
	}
	if got := c.Unacked(); got != 0 {
		t.Fatalf("Unacked() after Reset = %d, want 0", got)
	}
	if seq := c.NextSeq(); seq != 3 {
		t.Fatalf("NextSeq() after Reset = %d, want 3 (sequences are never reused)", seq)
	}
}

func TestConfirmedNeverMovesBackwards(t *testing.T) {
	runCases(t, []ckCase{
		{"commit with a lower end LSN than a keepalive", []ckStep{
			walEnd(1000, 1000),
			begin(), event(0), commit(500, 1000), ack(0, 1000),
		}},
		{"empty transaction with a lower end LSN", []ckStep{
			walEnd(1000, 1000), begin(), commit(900, 1000),
		}},
		{"lower keepalive", []ckStep{
			begin(), commit(1000, 1000), walEnd(10, 1000),
		}},
		{"lower commit after a higher one", []ckStep{
			begin(), event(0), commit(300, 0),
			begin(), event(1), commit(200, 0),
			ack(0, 300), ack(1, 300),
		}},
	})
}

func TestDuplicateAcksAreHarmless(t *testing.T) {
	tests := []ckCase{
		{"in-order ack repeated", []ckStep{
			begin(), event(0), event(1), commit(100, 0),
			ack(0, 0), ack(0, 0), ack(1, 100), ack(1, 100), ack(0, 100),
		}},
		{"early ack repeated does not close the gap", []ckStep{
			begin(), event(0), event(1), event(2), commit(100, 0),
			ack(2, 0), ack(2, 0), ack(1, 0), ack(1, 0),
			ack(0, 100),
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := run(t, tt.steps...)
			if !c.Idle() || c.Unacked() != 0 {
				t.Fatalf("Idle() = %v, Unacked() = %d; want idle with nothing unacked", c.Idle(), c.Unacked())
			}
		})
	}
}

func TestUnackedCountsHandedOutEvents(t *testing.T) {
	c := NewCheckpoint()
	check := func(wantUnacked uint64, wantIdle bool) {
		t.Helper()
		if got := c.Unacked(); got != wantUnacked {
			t.Fatalf("Unacked() = %d, want %d", got, wantUnacked)
		}
		if got := c.Idle(); got != wantIdle {
			t.Fatalf("Idle() = %v, want %v", got, wantIdle)
		}
	}
	check(0, true)
	c.Begin()
	check(0, false)
	for i := 0; i < 3; i++ {
		c.NextSeq()
	}
	check(3, false)
	c.Ack(2) // early: does not count until the gap closes
	check(3, false)
	c.Ack(0)
	check(2, false)
	c.Commit(100)
	check(2, false)
	c.Ack(1)
	check(0, true)
}

// ckModel is the rule written as plainly as possible: a transaction is
// confirmable when all its events and those of every earlier transaction are
// acked; a keepalive only when nothing at all is in flight.
type ckModel struct {
	confirmed cdc.LSN
	open      bool
	openSeqs  []uint64
	txns      []modelTxn // committed, not yet confirmable, oldest first
	live      map[uint64]bool
	acked     map[uint64]bool
}

type modelTxn struct {
	end  cdc.LSN
	seqs []uint64
}

func newCkModel() *ckModel {
	return &ckModel{live: map[uint64]bool{}, acked: map[uint64]bool{}}
}

func (m *ckModel) allAcked(seqs []uint64) bool {
	for _, s := range seqs {
		if !m.acked[s] {
			return false
		}
	}
	return true
}

func (m *ckModel) settle() {
	for len(m.txns) > 0 && m.allAcked(m.txns[0].seqs) {
		m.confirmed = max(m.confirmed, m.txns[0].end)
		m.txns = m.txns[1:]
	}
}

func (m *ckModel) idle() bool {
	if m.open || len(m.txns) > 0 {
		return false
	}
	for s := range m.live {
		if !m.acked[s] {
			return false
		}
	}
	return true
}

func (m *ckModel) unacked() uint64 {
	// Events count as unacked until every earlier one is acked too.
	var lowest uint64
	found := false
	for s := range m.live {
		if !m.acked[s] && (!found || s < lowest) {
			lowest, found = s, true
		}
	}
	if !found {
		return 0
	}
	var n uint64
	for s := range m.live {
		if s >= lowest {
			n++
		}
	}
	return n
}

func TestCheckpointMatchesReferenceModelOnRandomRuns(t *testing.T) {
	const runs = 2000
	for r := 0; r < runs; r++ {
		seed := uint64(r)
		rng := rand.New(rand.NewPCG(seed, 0x5eed))
		c := NewCheckpoint()
		m := newCkModel()
		var nextSeq uint64
		var lsn cdc.LSN = 0x1000
		var trace []string
		fail := func(format string, args ...any) {
			t.Helper()
			t.Fatalf("seed %d: %s\ntrace: %s", seed, fmt.Sprintf(format, args...), strings.Join(trace, " "))
		}
		var pending []uint64 // handed out, not yet acked (since the last reset)
		var stale []uint64   // handed out before a reset
		steps := 20 + rng.IntN(200)
		for i := 0; i < steps; i++ {
			var got cdc.LSN
			var moved, reports bool
			before := c.Confirmed()
			switch k := rng.IntN(100); {
			case k < 10 && !m.open: // begin
				c.Begin()
				m.open, m.openSeqs = true, nil
				trace = append(trace, "B")
			case k < 35 && m.open: // event
				seq := c.NextSeq()
				if seq != nextSeq {
					fail("NextSeq = %d, want %d", seq, nextSeq)
				}
				nextSeq++
				m.openSeqs = append(m.openSeqs, seq)
				m.live[seq] = true
				pending = append(pending, seq)
				trace = append(trace, fmt.Sprintf("E%d", seq))
			case k < 45 && m.open: // commit
				lsn += cdc.LSN(1 + rng.IntN(100))
				got, moved = c.Commit(lsn)
				reports = true
				m.open = false
				m.txns = append(m.txns, modelTxn{end: lsn, seqs: m.openSeqs})
				m.settle()
				trace = append(trace, fmt.Sprintf("C%d", lsn))
			case k < 80 && len(pending) > 0: // ack, mostly in order, sometimes not
				j := 0
				if rng.IntN(3) == 0 {
					j = rng.IntN(len(pending))
				}
				seq := pending[j]
				pending = append(pending[:j], pending[j+1:]...)
				got, moved = c.Ack(seq)
				reports = true
				m.acked[seq] = true
				m.settle()
				trace = append(trace, fmt.Sprintf("A%d", seq))
			case k < 85 && len(stale) > 0: // a stale ack from before a reset
				j := rng.IntN(len(stale))
				seq := stale[j]
				stale = append(stale[:j], stale[j+1:]...)
				got, moved = c.Ack(seq)
				reports = true
				trace = append(trace, fmt.Sprintf("a%d", seq))
			case k < 90 && rng.IntN(2) == 0: // a repeated ack
				if len(m.acked) == 0 {
					continue
				}
				for seq := range m.acked {
					got, moved = c.Ack(seq)
					reports = true
					trace = append(trace, fmt.Sprintf("A%d", seq))
					break
				}
			case k < 96: // keepalive: WAL end is at or past every commit seen, and later commits end past it
				w := lsn + cdc.LSN(rng.IntN(50))
				lsn = w
				got, moved = c.WALEnd(w)
				reports = true
				if m.idle() {
					m.confirmed = max(m.confirmed, w)
				}
				trace = append(trace, fmt.Sprintf("W%d", w))
			case k >= 98: // reconnect
				c.Reset()
				stale = append(stale, pending...)
				pending = nil
				m.open, m.openSeqs, m.txns = false, nil, nil
				m.live, m.acked = map[uint64]bool{}, map[uint64]bool{}
				// A new session confirms from nothing; its slot may be on a
				// server whose positions are lower (a restore, a promotion).
				m.confirmed, before = 0, 0
				if rng.IntN(2) == 0 {
					lsn /= 2
				}
				trace = append(trace, "R")
			default:
				continue
			}
			after := c.Confirmed()
			if after != m.confirmed {
				fail("Confirmed() = %d, model says %d", after, m.confirmed)
			}
			if after < before {
				fail("confirmed moved backwards from %d to %d", before, after)
			}
			if reports && (got != after || moved != (after != before)) {
				fail("call returned (%d, %v); confirmed went %d -> %d", got, moved, before, after)
			}
			if c.Idle() != m.idle() {
				fail("Idle() = %v, model says %v", c.Idle(), m.idle())
			}
			if c.Unacked() != m.unacked() {
				fail("Unacked() = %d, model says %d", c.Unacked(), m.unacked())
			}
			// G5 directly: never past a committed transaction with an unacked event.
			for _, tx := range m.txns {
				if !m.allAcked(tx.seqs) && after >= tx.end {
					fail("confirmed %d reaches the end %d of a transaction with an unacked event", after, tx.end)
				}
			}
		}
	}
}
