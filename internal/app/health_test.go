package app

import (
	"strings"
	"testing"
	"time"
)

// fakeHealth is a health on a clock the test moves.
type fakeHealth struct {
	*health
	clock     time.Time
	connected bool
	busUp     bool
	oldest    time.Time
	delivered uint64
}

func newFakeHealth() *fakeHealth {
	f := &fakeHealth{clock: time.Unix(1_000_000, 0), connected: true, busUp: true}
	f.health = newHealth(func() bool { return f.connected }, func() bool { return f.busUp }, "NATS", time.Minute, 2*time.Minute)
	f.health.now = func() time.Time { return f.clock }
	f.health.watch(func() (time.Time, uint64) { return f.oldest, f.delivered })
	return f
}

func (f *fakeHealth) wantReady(t *testing.T, ok, leader bool, says string) {
	t.Helper()
	gotOK, gotLeader, why := f.ready()
	if gotOK != ok || gotLeader != leader || !strings.Contains(why, says) {
		t.Fatalf("ready() = %v, leader %v, %q; want %v, leader %v, %q", gotOK, gotLeader, why, ok, leader, says)
	}
}

func (f *fakeHealth) wantLive(t *testing.T, ok bool, says string) {
	t.Helper()
	gotOK, why := f.live()
	if gotOK != ok || !strings.Contains(why, says) {
		t.Fatalf("live() = %v, %q; want %v, %q", gotOK, why, ok, says)
	}
}

// TestLivenessFailsOnlyWhenTheMainLoopStandsStill: healthy while starting
// (no loop yet) and while the loop turns, whatever replication does;
// failing once it has not turned for the liveness timeout, healthy again
// at its next turn.
func TestLivenessFailsOnlyWhenTheMainLoopStandsStill(t *testing.T) {
	f := newFakeHealth()
	f.clock = f.clock.Add(time.Hour)
	f.wantLive(t, true, "starting")
	f.started.Store(true)
	f.lead(true)
	f.connected, f.busUp = false, false // an outage is not a wedge
	for range 10 {
		f.clock = f.clock.Add(50 * time.Second)
		f.alive()
		f.wantLive(t, true, "ok")
	}
	f.clock = f.clock.Add(time.Minute)
	f.wantLive(t, true, "ok") // exactly the timeout
	f.clock = f.clock.Add(time.Second)
	f.wantLive(t, false, "has not turned for 1m1s")
	f.cannotAsk() // the standby wait turning counts too
	f.wantLive(t, true, "ok")
}

// TestReadinessFollowsReplication: the leader is ready while it streams,
// reaches the sink and its window moves; a standby is ready while it
// reaches PostgreSQL and sees the lock held; /leader only on the leader.
func TestReadinessFollowsReplication(t *testing.T) {
	f := newFakeHealth()
	f.wantReady(t, false, false, "starting: NATS not ready")
	f.started.Store(true)
	f.alive()
	f.wantReady(t, false, false, "taking the leader lock")

	f.standingBy()
	f.wantReady(t, true, false, "standby: another walbox holds the leader lock")
	f.clock = f.clock.Add(standbyFresh + time.Second)
	f.wantReady(t, false, false, "standby, unhealthy")
	f.standingBy()
	f.wantReady(t, true, false, "standby")
	f.cannotAsk()
	f.wantReady(t, false, false, "cannot reach PostgreSQL")

	f.lead(true)
	f.wantReady(t, true, true, "leader: streaming")
	f.connected = false
	f.wantReady(t, false, false, "no replication connection")
	f.connected, f.busUp = true, false
	f.wantReady(t, false, false, "not connected to NATS")
	f.busUp = true
	f.lead(false)
	f.wantReady(t, false, false, "taking the leader lock")
}

// TestReadinessFailsWhileTheWindowIsStuck: events waiting with nothing
// acked for stuck_after fail readiness; a backlog that moves, or a wait
// that has just begun after an idle spell (old commit times, as in a
// backfill), does not.
func TestReadinessFailsWhileTheWindowIsStuck(t *testing.T) {
	f := newFakeHealth()
	f.started.Store(true)
	f.lead(true)
	f.wantReady(t, true, true, "leader")

	// Idle for an hour, then a backfill of old rows starts.
	f.clock = f.clock.Add(time.Hour)
	f.wantReady(t, true, true, "leader")
	f.oldest = f.clock.Add(-48 * time.Hour)
	f.wantReady(t, true, true, "leader")
	// It moves: ready, however old the oldest event.
	for range 5 {
		f.clock = f.clock.Add(time.Minute)
		f.delivered += 100
		f.wantReady(t, true, true, "leader")
	}
	// It stops moving.
	f.clock = f.clock.Add(time.Minute)
	f.wantReady(t, true, true, "leader")
	f.clock = f.clock.Add(time.Minute + time.Second)
	f.wantReady(t, false, false, "stuck: events wait to be published and none was acked for 2m1s")
	f.delivered++
	f.wantReady(t, true, true, "leader")
	// Caught up: nothing waits, nothing is stuck however long it stays so.
	f.oldest = time.Time{}
	f.clock = f.clock.Add(time.Hour)
	f.wantReady(t, true, true, "leader")
	// A fresh event that waits, committed a moment ago: not stuck before
	// it has waited stuck_after itself.
	f.oldest = f.clock
	f.wantReady(t, true, true, "leader")
	f.clock = f.clock.Add(119 * time.Second)
	f.wantReady(t, true, true, "leader")
	f.clock = f.clock.Add(time.Second)
	f.wantReady(t, false, false, "stuck")
}
