// Package metrics builds walbox's Prometheus series: each is created and
// registered in one call, on the registry given (no global registry; nil:
// unregistered).
package metrics

import "github.com/prometheus/client_golang/prometheus"

// On builds series registered on reg (nil: unregistered).
func On(reg prometheus.Registerer) Factory { return Factory{reg: reg} }

// Factory creates series and registers them. Registering a name twice
// panics, as prometheus.MustRegister does.
type Factory struct{ reg prometheus.Registerer }

func register[C prometheus.Collector](f Factory, c C) C {
	if f.reg != nil {
		f.reg.MustRegister(c)
	}
	return c
}

// Counter is a counter called name.
func (f Factory) Counter(name, help string) prometheus.Counter {
	return register(f, prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help}))
}

// CounterVec is a counter called name with labels.
func (f Factory) CounterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return register(f, prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels))
}

// Gauge is a gauge called name.
func (f Factory) Gauge(name, help string) prometheus.Gauge {
	return register(f, prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help}))
}

// GaugeVec is a gauge called name with labels.
func (f Factory) GaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	return register(f, prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels))
}

// Histogram is a histogram called name with buckets.
func (f Factory) Histogram(name, help string, buckets []float64) prometheus.Histogram {
	return register(f, prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}))
}
