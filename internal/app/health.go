package app

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// standbyFresh is how recent a standby's last look at the leader lock must
// be for it to count as healthy: it asks every second.
const standbyFresh = 10 * time.Second

// health answers the probes (docs/kubernetes.md, Probes):
//
//   - /healthz (liveness) fails only when the main loop is wedged: the
//     publisher loop while leading, the leader-lock wait while standing by,
//     has not turned for livenessTimeout;
//   - /readyz (readiness) is this pod's part in replication: leading and
//     streaming from the slot, the sink reachable, the publish window not
//     stuck; or a healthy standby (it reaches PostgreSQL and sees another
//     walbox hold the leader lock);
//   - /leader is 200 only on the ready leader, to tell it apart.
type health struct {
	// connected reports whether the replication connection streams.
	connected func() bool
	// busUp reports whether the sink's connection is up; bus names it.
	busUp           func() bool
	bus             string
	livenessTimeout time.Duration
	stuckAfter      time.Duration
	now             func() time.Time

	started atomic.Bool
	leading atomic.Bool
	standby atomic.Bool
	// beat is when the main loop last turned (unix ns); 0 before it runs.
	beat atomic.Int64
	// standbySeen is when the leader-lock wait last found another walbox
	// holding the lock (unix ns); 0 when it could not ask.
	standbySeen atomic.Int64

	mu sync.Mutex // the window's progress, sampled by probes
	// progress is the relay's (set once it exists): the commit time of the
	// oldest event not yet acked (zero when none), the events delivered.
	progress      func() (time.Time, uint64)
	lastDelivered uint64
	lastMoved     time.Time
	wasWaiting    bool
}

func newHealth(connected, busUp func() bool, bus string, livenessTimeout, stuckAfter time.Duration) *health {
	return &health{connected: connected, busUp: busUp, bus: bus,
		livenessTimeout: livenessTimeout, stuckAfter: stuckAfter, now: time.Now}
}

// watch makes the relay's progress part of readiness.
func (h *health) watch(progress func() (time.Time, uint64)) {
	h.mu.Lock()
	h.progress = progress
	h.mu.Unlock()
}

// alive records a turn of the main loop.
func (h *health) alive() { h.beat.Store(h.now().UnixNano()) }

// standingBy records that the leader-lock wait found another walbox
// holding the lock: a turn of the main loop, and a healthy standby.
func (h *health) standingBy() {
	now := h.now().UnixNano()
	h.beat.Store(now)
	h.standbySeen.Store(now)
	h.standby.Store(true)
}

// cannotAsk records that the leader-lock wait could not reach PostgreSQL:
// a turn of the main loop, and no longer a healthy standby.
func (h *health) cannotAsk() {
	h.beat.Store(h.now().UnixNano())
	h.standbySeen.Store(0)
}

// lead records that this walbox holds the leader lock (or no longer does).
func (h *health) lead(on bool) {
	if on {
		h.standby.Store(false)
		h.standbySeen.Store(0)
	}
	h.leading.Store(on)
	h.alive()
}

// live answers /healthz.
func (h *health) live() (bool, string) {
	beat := h.beat.Load()
	if beat == 0 {
		// Before the main loop: each start-up step is bounded by a timeout
		// of its own and retried with a warning; nothing to be wedged yet.
		return true, "ok: starting"
	}
	if idle := h.now().Sub(time.Unix(0, beat)); idle > h.livenessTimeout {
		return false, fmt.Sprintf("wedged: the main loop has not turned for %s (metrics.liveness_timeout %s)", idle.Round(time.Second), h.livenessTimeout)
	}
	return true, "ok"
}

// ready answers /readyz; leader is true on the ready leader only.
func (h *health) ready() (ok bool, leader bool, why string) {
	switch {
	case !h.started.Load():
		return false, false, "starting: " + h.bus + " not ready"
	case h.standby.Load():
		seen := h.standbySeen.Load()
		if seen == 0 || h.now().Sub(time.Unix(0, seen)) > standbyFresh {
			return false, false, "standby, unhealthy: cannot reach PostgreSQL to watch the leader lock"
		}
		return true, false, "standby: another walbox holds the leader lock for this slot"
	case !h.leading.Load():
		return false, false, "not replicating: taking the leader lock (PostgreSQL unreachable?)"
	case !h.connected():
		return false, false, "not replicating: no replication connection to PostgreSQL (down, or the slot held by another process)"
	case h.busUp != nil && !h.busUp():
		return false, false, "not connected to " + h.bus
	}
	if stuck, why := h.stuck(); stuck {
		return false, false, why
	}
	return true, true, "leader: streaming"
}

// stuck: events wait in the publish window, none has left it for
// stuckAfter, and the oldest was committed at least that long ago. Probes
// sample the relay's progress; the start of a wait counts as progress, so
// a window that has just filled after an idle spell is not stuck.
func (h *health) stuck() (bool, string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.progress == nil {
		return false, ""
	}
	oldest, delivered := h.progress()
	now := h.now()
	waiting := !oldest.IsZero()
	if delivered != h.lastDelivered || h.lastMoved.IsZero() || waiting && !h.wasWaiting {
		h.lastDelivered, h.lastMoved = delivered, now
	}
	h.wasWaiting = waiting
	moved := h.lastMoved
	if waiting && now.Sub(moved) >= h.stuckAfter && now.Sub(oldest) >= h.stuckAfter {
		return true, fmt.Sprintf("stuck: events wait to be published and none was acked for %s (metrics.stuck_after %s)", now.Sub(moved).Round(time.Second), h.stuckAfter)
	}
	return false, ""
}
