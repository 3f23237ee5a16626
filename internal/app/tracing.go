package app

import (
	"context"
	"fmt"
	"runtime/debug"
	"strings"
	"time"

	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/walbox/walbox/internal/config"
)

// tracerName is the instrumentation scope of the relay's spans.
const tracerName = "github.com/walbox/walbox/relay"

// startTracing builds the OTLP/HTTP trace pipeline of cfg.OTel and returns
// the relay's tracer and a stop that flushes what is buffered; a nil
// tracer when tracing is off. The exporter connects when it first sends.
func startTracing(ctx context.Context, cfg config.OTel, log zerolog.Logger) (trace.Tracer, func(), error) {
	if !cfg.TracingOn() {
		return nil, func() {}, nil
	}
	var opts []otlptracehttp.Option
	if cfg.Endpoint != "" {
		opts = append(opts, otlptracehttp.WithEndpointURL(strings.TrimSuffix(cfg.Endpoint, "/")+"/v1/traces"))
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, nil, &config.Error{Key: "otel.endpoint", Msg: fmt.Sprintf("OTLP trace exporter: %v", err)}
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
	tpOpts := []sdktrace.TracerProviderOption{sdktrace.WithBatcher(exp), sdktrace.WithResource(res)}
	if cfg.SampleRatio > 0 {
		// A span with a parent keeps the parent's decision: a sampled
		// producer's trace is never cut at the relay.
		tpOpts = append(tpOpts, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(cfg.SampleRatio))))
	}
	tp := sdktrace.NewTracerProvider(tpOpts...)
	log.Info().Str("endpoint", cfg.Endpoint).Float64("sample_ratio", cfg.SampleRatio).Msg("tracing: a span per published event, exported with OTLP/HTTP")
	stop := func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(sctx); err != nil {
			log.Warn().Err(err).Msg("tracing: spans not flushed at shutdown")
		}
	}
	return tp.Tracer(tracerName), stop, nil
}
