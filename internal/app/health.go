package app

import (
	"sync/atomic"

	"github.com/walbox/walbox/cdc"
)

// health answers /readyz: ready only when replicating and connected to the
// sink's bus.
type health struct {
	src *cdc.Source
	// busUp reports whether the sink's connection is up; bus names it.
	busUp   func() bool
	bus     string
	started atomic.Bool
	standby atomic.Bool
}

func (h *health) ready() (bool, string) {
	switch {
	case !h.started.Load():
		return false, "starting: " + h.bus + " not ready"
	case h.standby.Load():
		return false, "standby: another walbox holds the leader lock for this slot"
	case !h.src.Connected():
		return false, "not replicating: no replication connection to PostgreSQL"
	case h.busUp != nil && !h.busUp():
		return false, "not connected to " + h.bus
	}
	return true, ""
}
