package cdc

import (
	"testing"
	"time"
)

// An old session's confirmation racing the new session's fence must never
// land in the new session (issue 33, item 8). The test slips the fence in
// at the worst moment, between the confirmation's check of the fence and
// its store: when the fence can run there (the check and the store apart,
// as before the fix) the old position lands in the new session; when it
// cannot (one lock) it waits, and zeroes the position after the store.
func TestConfirmationRacingAFenceNeverLandsInTheNewSession(t *testing.T) {
	var c confirmation
	c.confirm(0x100)
	fenced := make(chan struct{})
	c.checked = func() {
		c.checked = nil
		go func() {
			c.fence() // the new session starts
			close(fenced)
		}()
		select {
		case <-fenced: // the fence got in between: the bug
		case <-time.After(200 * time.Millisecond): // blocked behind the confirmation, as it must be
		}
	}
	c.confirm(0x9000) // the old session's
	<-fenced
	if got := c.load(); got != 0 {
		t.Fatalf("the old session's position %s landed in the new session", got)
	}
	if c.reached(0) {
		t.Fatal("reached while fenced")
	}
	c.confirm(0x9000) // late, still the old session's
	if got := c.load(); got != 0 {
		t.Fatalf("a confirmation got through the fence: %s", got)
	}
	c.unfence()
	c.confirm(0x50) // the new session's positions may be lower than the old
	if got := c.load(); got != 0x50 || !c.reached(0x50) {
		t.Fatalf("new session's confirmation: %s", got)
	}
}
