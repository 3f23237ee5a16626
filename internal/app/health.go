package app

import (
	"sync/atomic"

	"github.com/nats-io/nats.go"

	"github.com/walbox/walbox/cdc"
)

// health answers /readyz: ready only when replicating and connected to NATS.
type health struct {
	src     *cdc.Source
	nc      *nats.Conn
	started atomic.Bool
	standby atomic.Bool
}

func (h *health) ready() (bool, string) {
	switch {
	case !h.started.Load():
		return false, "starting: JetStream streams not ready"
	case h.standby.Load():
		return false, "standby: another walbox holds the leader lock for this slot"
	case !h.src.Connected():
		return false, "not replicating: no replication connection to PostgreSQL"
	case !h.nc.IsConnected():
		return false, "not connected to NATS"
	}
	return true, ""
}
