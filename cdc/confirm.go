package cdc

import (
	"sync"
	"sync/atomic"
)

// confirmation is the position the relay says is safe to flush, and the
// fence that keeps an old session's confirmations out of a new session.
//
// The fence and the position change together, under one lock: checked apart
// (is the fence down? then compare-and-swap the position), a confirmation of
// the old session could pass the check, the new session could then raise the
// fence and zero the position, and the old position would land in the new
// session, skipping its transactions (issue 33, item 8). Readers of the
// position alone (status updates, lag) take it without the lock.
type confirmation struct {
	mu     sync.Mutex
	fenced bool
	lsn    atomic.Uint64
	// checked, if set, runs between the fence check and the store (tests:
	// it must not be able to slip a fence in there).
	checked func()
}

// confirm raises the position to lsn unless the fence is up.
func (c *confirmation) confirm(lsn LSN) {
	c.mu.Lock()
	if !c.fenced && uint64(lsn) > c.lsn.Load() {
		if c.checked != nil {
			c.checked()
		}
		c.lsn.Store(uint64(lsn))
	}
	c.mu.Unlock()
}

// fence starts a new session: the position goes to zero (the server resends
// from the slot's own position; a status update of 0 is ignored) and
// confirmations are dropped until unfence.
func (c *confirmation) fence() {
	c.mu.Lock()
	c.fenced = true
	c.lsn.Store(0)
	c.mu.Unlock()
}

// unfence lets confirmations in: the relay has taken the new session's reset.
func (c *confirmation) unfence() {
	c.mu.Lock()
	c.fenced = false
	c.mu.Unlock()
}

// load returns the position.
func (c *confirmation) load() LSN { return LSN(c.lsn.Load()) }

// reached reports whether the fence is down and the position is at least lsn.
func (c *confirmation) reached(lsn LSN) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.fenced && LSN(c.lsn.Load()) >= lsn
}
