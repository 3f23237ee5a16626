package app

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/walbox/walbox/relay/sweep"
)

// Live is what only the running relay knows, for the web console: the
// probes' verdict and the sweepers' maintenance schedules. The rest of what
// the console shows it reads where walbox status reads it.
type Live struct {
	// Ready is /readyz's verdict and why.
	Ready func() (ok bool, why string)
	// Maintenance lists each outbox table's maintenance schedule.
	Maintenance func() []TableMaintenance
	// Registry takes the console's own metrics; Gatherer reads the relay's
	// (the commit -> ack histogram the chart samples).
	Registry prometheus.Registerer
	Gatherer prometheus.Gatherer
}

// TableMaintenance is one outbox table's maintenance schedule; Schedule is
// nil before the first run and with sweeper.maintain false.
type TableMaintenance struct {
	Table    string                     `json:"table"`
	Schedule *sweep.MaintenanceSchedule `json:"schedule,omitempty"`
}

// live is the Live view of a running relay.
func live(h *health, ts *tableSet, reg *prometheus.Registry) Live {
	return Live{
		Registry: reg,
		Gatherer: reg,
		Ready: func() (bool, string) {
			ok, _, why := h.ready()
			return ok, why
		},
		Maintenance: func() []TableMaintenance {
			ts.mu.Lock()
			tables := ts.tables
			ts.mu.Unlock()
			sws := ts.current()
			out := make([]TableMaintenance, 0, len(sws))
			for i, sw := range sws {
				if i < len(tables) {
					out = append(out, TableMaintenance{Table: tables[i].Name.String(), Schedule: sw.Schedule()})
				}
			}
			return out
		},
	}
}

// mountConsole serves ui at /ui/ on mux (and /ui redirects there).
func mountConsole(mux *http.ServeMux, ui http.Handler) {
	if ui == nil {
		return
	}
	mux.Handle("/ui/", ui)
	mux.Handle("/ui", http.RedirectHandler("/ui/", http.StatusFound))
}
