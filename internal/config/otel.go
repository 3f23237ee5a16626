package config

import (
	"fmt"
	"net/url"
	"os"
)

// OTel is tracing: a span per published event (README, Tracing), exported
// with OTLP over HTTP. Off unless an endpoint is configured here or in
// OpenTelemetry's own environment (OTEL_EXPORTER_OTLP_ENDPOINT,
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), which also configures the rest
// (headers, TLS, OTEL_TRACES_SAMPLER, OTEL_SERVICE_NAME, ...).
type OTel struct {
	// Endpoint is the OTLP/HTTP collector's base URL, e.g.
	// http://otel-collector:4318 (spans go to its /v1/traces).
	Endpoint string `yaml:"endpoint" env:"ENDPOINT"`
	// SampleRatio samples that share of new traces (a span with a parent
	// follows the parent's sampled flag). 0: OTEL_TRACES_SAMPLER, or every
	// trace.
	SampleRatio float64 `yaml:"sample_ratio" env:"SAMPLE_RATIO"`
	// ServiceName is service.name on the spans (OTEL_SERVICE_NAME wins).
	ServiceName string `yaml:"service_name" env:"SERVICE_NAME"`
}

// TracingOn reports whether spans are exported: an endpoint in the config
// or in OpenTelemetry's environment.
func (o OTel) TracingOn() bool {
	return o.Endpoint != "" || os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

func (c *Config) validateOTel(bad func(key, format string, args ...any)) {
	o := c.OTel
	if o.Endpoint != "" {
		if u, err := url.Parse(o.Endpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("otel.endpoint", "%q is not an http(s) URL of an OTLP/HTTP collector, e.g. http://otel-collector:4318", o.Endpoint)
		}
	}
	if o.SampleRatio < 0 || o.SampleRatio > 1 {
		bad("otel.sample_ratio", "%s is not between 0 and 1 (0: OTEL_TRACES_SAMPLER, or every trace)", fmt.Sprint(o.SampleRatio))
	}
}
