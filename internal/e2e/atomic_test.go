package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/relay"
)

// TestAtomicTransactionsSurviveRelayKills: with nats.atomic_transactions
// on, a relay killed twice and stopped once under a load of multi-row
// transactions loses nothing, stores nothing twice, keeps commit order, and
// each transaction's events sit back to back in their stream (one atomic
// batch each: no other transaction's event between them).
func TestAtomicTransactionsSurviveRelayKills(t *testing.T) {
	e := newMigratedEnv(t, func(c *config.Config) { c.NATS.AtomicTransactions = true })
	w := e.witness("outbox_events")
	stop := e.killMidStream(outboxtest.Load{Producers: 2, MinRows: 2, MaxRows: 12, Rollback: 0.1, Rate: 25}, 300*time.Millisecond, func() func() {
		return func() { time.Sleep(700 * time.Millisecond) } // fault timing: the signal lands mid-load
	})
	res := stop()
	p := e.spawnRelay()
	e.check(w, res)
	if out := p.output(); !strings.Contains(out, "publishing each transaction in an atomic batch") {
		t.Fatalf("the relay did not say it publishes atomic batches:\n%s", out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, name := range e.streamNames() {
		if strings.HasPrefix(name, "WALBOX") || strings.Contains(strings.ToUpper(name), "DLQ") {
			continue
		}
		st, info := e.stream(ctx, name)
		seen := map[string]bool{}
		prev := ""
		for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
			m, err := st.GetMsg(ctx, seq)
			if err != nil {
				t.Fatalf("%s seq %d: %v", name, seq, err)
			}
			txn := m.Header.Get(relay.HeaderCommitLSN)
			if txn != prev && seen[txn] {
				t.Fatalf("%s seq %d: an event of transaction %s after another transaction's: not one batch", name, seq, txn)
			}
			seen[txn], prev = true, txn
		}
		t.Logf("%s: %d messages of %d transactions, each back to back", name, info.State.Msgs, len(seen))
	}
}
