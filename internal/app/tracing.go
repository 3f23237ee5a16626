package app

import (
	"context"
	"fmt"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/leantrace"
)

// tracerName is the instrumentation scope of the relay's spans.
const tracerName = "github.com/walbox/walbox/relay"

// startTracing builds the OTLP/HTTP trace pipeline of cfg.OTel and returns
// the relay's tracer, its sampling ratio (relay.Config.TraceRatio) and a
// stop that flushes what is buffered; a nil tracer when tracing is off. The exporter connects when it first sends.
func startTracing(ctx context.Context, cfg config.OTel, log zerolog.Logger, reg prometheus.Registerer) (trace.Tracer, float64, func(), error) {
	if !cfg.TracingOn() {
		return nil, 0, func() {}, nil
	}
	var opts []otlptracehttp.Option
	if cfg.Endpoint != "" {
		opts = append(opts, otlptracehttp.WithEndpointURL(strings.TrimSuffix(cfg.Endpoint, "/")+"/v1/traces"))
	}
	version := "devel"
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		version = bi.Main.Version
	}
	// OpenTelemetry's environment (OTEL_SERVICE_NAME,
	// OTEL_RESOURCE_ATTRIBUTES) wins over the config.
	res, err := resource.Merge(resource.NewWithAttributes(semconv.SchemaURL,
		semconv.ServiceName(cfg.ServiceName), semconv.ServiceVersion(version)), resource.Environment())
	if err != nil {
		res = resource.Environment()
	}
	// The relay samples before it starts a span (relay.Config.TraceRatio):
	// parent-based, and the ratio for events without a parent. The
	// provider then records what it is given (ParentBased(AlwaysSample)),
	// and writes each span straight into its OTLP message: see
	// internal/leantrace for why not the SDK's provider.
	ratio := sampleRatio(cfg.SampleRatio)
	tp, err := leantrace.New(ctx, leantrace.Options{Client: otlptracehttp.NewClient(opts...), Resource: res,
		Logger: log, Registerer: reg}.BatchFromEnv())
	if err != nil {
		return nil, 0, nil, &config.Error{Key: "otel.endpoint", Msg: fmt.Sprintf("OTLP trace exporter: %v", err)}
	}
	log.Info().Str("endpoint", cfg.Endpoint).Float64("sample_ratio", ratio).Msg("tracing: a span per published event, exported with OTLP/HTTP")
	stop := func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(sctx); err != nil {
			log.Warn().Err(err).Msg("tracing: spans not flushed at shutdown")
		}
	}
	return tp.Tracer(tracerName, trace.WithInstrumentationVersion(version)), ratio, stop, nil
}

// sampleRatio is the share of events without a producer's context that
// get a span: otel.sample_ratio, else OTEL_TRACES_SAMPLER's (a
// traceidratio sampler's argument; always_off: none, as -1), else all.
func sampleRatio(configured float64) float64 {
	if configured > 0 {
		return configured
	}
	switch os.Getenv("OTEL_TRACES_SAMPLER") {
	case "traceidratio", "parentbased_traceidratio":
		if r, err := strconv.ParseFloat(os.Getenv("OTEL_TRACES_SAMPLER_ARG"), 64); err == nil && r >= 0 && r <= 1 {
			if r == 0 {
				return -1
			}
			return r
		}
	case "always_off", "parentbased_always_off":
		return -1
	}
	return 1
}
