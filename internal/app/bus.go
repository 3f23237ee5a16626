package app

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/retry"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/claim"
	"github.com/walbox/walbox/relay/jssink"
	"github.com/walbox/walbox/relay/kafkasink"
	"github.com/walbox/walbox/relay/sweep"
)

// bus is the sink Run publishes to, with what differs between JetStream
// and Kafka: how its streams (topics) are made ready, where dead letters
// go, and how readiness is judged.
type bus struct {
	name   string // for logs and /readyz
	sink   relay.Sink
	reader sweep.StreamReader
	// ensure makes the streams (topics) ready and returns the routes;
	// it retries while the bus is unreachable and returns nil routes when
	// ctx ends first.
	ensure     func(ctx context.Context) ([]relay.Route, error)
	up         func() bool
	dlqStream  string // the dead-letter stream or topic
	dlqSubject string // Kafka: every dead letter goes to this topic
	prefix     string // subject prefix
	template   string // subject (topic) template
	strict     bool
	// requireTail: the bus keeps resent duplicates (Kafka).
	requireTail bool
	tailTimeout time.Duration // one read-back of the resume check (0: the relay's default)
	url         string        // redacted, for the start line
	close       func()
	// takeOver starts a leadership term (Kafka transactions: fence the
	// previous leader); fenced is closed when another took over during it.
	// Both nil where the bus has no fence.
	takeOver func(ctx context.Context) error
	fenced   func() <-chan struct{}
	// claim and claimSweep: the claim check (claim_check.enabled), nil
	// when off.
	claim      *claim.Sink
	claimSweep *claim.Sweeper
}

// openBus connects the configured sink. Kafka is contacted only by ensure.
// reg takes the sink's own metrics (Kafka's).
func openBus(ctx context.Context, cfg config.Config, database string, log zerolog.Logger, metrics *relay.Metrics, reg prometheus.Registerer) (*bus, error) {
	if cfg.Sink == config.SinkKafka {
		return openKafka(ctx, cfg, database, log, reg)
	}
	var natsErr atomic.Pointer[error] // the last failed connection attempt, for the logs
	nc, err := connectNATS(ctx, cfg, log, metrics, &natsErr)
	if err != nil {
		return nil, err
	}
	sink, err := jssink.New(nc, cfg.NATS.AckTimeout)
	if err != nil {
		nc.Close()
		return nil, err
	}
	if err := registerBatchMetrics(reg, sink); err != nil {
		nc.Close()
		return nil, err
	}
	b := &bus{
		name: "NATS", sink: sink, reader: sink,
		up:        nc.IsConnected,
		dlqStream: cfg.NATS.DLQ.Stream, prefix: cfg.NATS.SubjectPrefix, template: cfg.NATS.SubjectTemplate,
		strict: cfg.NATS.StrictOrder, url: RedactNATSURL(cfg.NATS.URL), close: nc.Close,
	}
	var store *claim.JetStreamStore
	if cc := cfg.ClaimCheck; cc.Enabled && cfg.ClaimS3() {
		if err := b.claimInS3(cfg, claim.JetStreamHorizon{JS: sink.JetStream()}, cfg.NATS.AckTimeout, log, reg); err != nil {
			nc.Close()
			return nil, err
		}
	} else if cc.Enabled {
		store = claim.NewJetStreamStore(sink.JetStream(), cfg.ClaimBucketSpec())
		b.claim = claim.New(sink, store, claim.Options{Threshold: cc.Threshold, UploadTimeout: cc.UploadTimeout, Logger: log, Registerer: reg})
		b.sink = b.claim.AsSink()
		b.claimSweep = claim.NewSweeper(store, sink.JetStream(), claimSlack(cfg.NATS.AckTimeout, cc.UploadTimeout), log, reg)
	}
	b.ensure = func(ctx context.Context) ([]relay.Route, error) {
		return ensureStreams(ctx, sink, store, cfg, log, &natsErr)
	}
	return b, nil
}

func openKafka(ctx context.Context, cfg config.Config, database string, log zerolog.Logger, reg prometheus.Registerer) (*bus, error) {
	sc, err := cfg.KafkaSinkConfig(cfg.NATS.Window)
	if err != nil {
		return nil, &config.Error{Key: "kafka", Msg: err.Error()}
	}
	sc.Log, sc.Registerer = log.With().Str("sink", "kafka").Logger(), reg
	sc.TransactionalID = cfg.KafkaTransactionalID(database)
	sink, err := kafkasink.New(sc)
	if err != nil {
		return nil, &config.Error{Key: "kafka.brokers", Msg: err.Error()}
	}
	var up atomic.Bool
	b := &bus{
		name: "Kafka", sink: sink, reader: sink,
		up:        up.Load,
		dlqStream: cfg.Kafka.DLQTopic, dlqSubject: cfg.Kafka.DLQTopic, template: cfg.Kafka.TopicTemplate,
		// Kafka has no expected-last-sequence: the idempotent producer
		// keeps each partition gapless instead.
		strict: false, requireTail: true, url: fmt.Sprint(cfg.Kafka.Brokers), close: sink.Close,
		// The read-back gives up by itself when no fetch answers for 10 s
		// and keeps what it read: a large topic may take minutes.
		tailTimeout: 5 * time.Minute,
	}
	if sink.Transactional() {
		b.takeOver, b.fenced = sink.TakeOver, sink.Fenced
	}
	if cfg.ClaimCheck.Enabled {
		if err := b.claimInS3(cfg, kafkasink.NewHorizon(sc, claimClockMargin), cfg.Kafka.AckTimeout, log, reg); err != nil {
			sink.Close()
			return nil, err
		}
	}
	// Readiness: the brokers answered a metadata request in the last 10 s.
	pingCtx, stopPing := context.WithCancel(ctx)
	go func() {
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		for {
			c, cancel := context.WithTimeout(pingCtx, 5*time.Second)
			up.Store(sink.Client().Ping(c) == nil)
			cancel()
			select {
			case <-pingCtx.Done():
				return
			case <-t.C:
			}
		}
	}()
	b.close = func() { stopPing(); sink.Close() }
	b.ensure = func(ctx context.Context) ([]relay.Route, error) {
		return retryEnsure(ctx, cfg, 15*time.Second,
			func(ctx context.Context) ([]relay.Route, error) {
				return sink.EnsureTopics(ctx, cfg.TopicSpecs())
			},
			func(err error) (retry, permanent error) {
				var ke *kerr.Error
				if errors.As(err, &ke) && !ke.Retriable && !errors.Is(err, kerr.UnknownTopicOrPartition) {
					return nil, fmt.Errorf("%w (fix kafka.topics in the config, or the topic on the brokers)", err)
				}
				return err, nil
			},
			func(err error, wait time.Duration) {
				log.Warn().Err(err).Str("retry_in", wait.Round(time.Millisecond).String()).Strs("brokers", cfg.Kafka.Brokers).Msg("Kafka not ready; retrying")
			})
	}
	return b, nil
}

// newBackoff is the retry back-off of the config: retry.initial doubling
// to retry.max, forever.
func newBackoff(cfg config.Config) *backoff.ExponentialBackOff {
	return retry.Backoff(cfg.Retry.Initial, cfg.Retry.Max)
}

// retryEnsure calls ensure, each call bounded by timeout, until it returns
// the routes, sort finds its error permanent (returned), or ctx ends (nil,
// nil). Between calls it hands the error as sort restated it to warn and
// waits the config's back-off: an outage at start is an outage like any
// other.
func retryEnsure(ctx context.Context, cfg config.Config, timeout time.Duration,
	ensure func(context.Context) ([]relay.Route, error),
	sort func(error) (retry, permanent error),
	warn func(err error, wait time.Duration),
) ([]relay.Route, error) {
	bo := newBackoff(cfg)
	for {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		routes, err := ensure(cctx)
		cancel()
		if err == nil {
			return routes, nil
		}
		if ctx.Err() != nil {
			return nil, nil
		}
		err, permanent := sort(err)
		if permanent != nil {
			return nil, permanent
		}
		wait := bo.NextBackOff()
		warn(err, wait)
		select {
		case <-ctx.Done():
			return nil, nil
		case <-time.After(wait):
		}
	}
}

// registerBatchMetrics exports the sink's fast-batch and atomic-batch counts.
func registerBatchMetrics(reg prometheus.Registerer, sink *jssink.Sink) error {
	batch := func(f func(jssink.BatchStats) uint64) func() float64 {
		return func() float64 { return float64(f(sink.BatchStats())) }
	}
	atomic := func(f func(jssink.AtomicStats) uint64) func() float64 {
		return func() float64 { return float64(f(sink.AtomicStats())) }
	}
	for _, c := range []struct {
		opts  prometheus.CounterOpts
		value func() float64
	}{
		{prometheus.CounterOpts{Name: "walbox_nats_batches_total", Help: "Fast batches opened (nats.fast_batch)."},
			batch(func(s jssink.BatchStats) uint64 { return s.Batches })},
		{prometheus.CounterOpts{Name: "walbox_nats_batched_messages_total", Help: "Messages published in fast batches."},
			batch(func(s jssink.BatchStats) uint64 { return s.Batched })},
		{prometheus.CounterOpts{Name: "walbox_nats_batch_flow_acks_total", Help: "Flow acks received for fast batches."},
			batch(func(s jssink.BatchStats) uint64 { return s.FlowAcks })},
		{prometheus.CounterOpts{Name: "walbox_nats_batch_unproven_total", Help: "Batched messages whose batch ended without proof they were stored: resent on their own."},
			batch(func(s jssink.BatchStats) uint64 { return s.Unproven })},
		// Atomic transactions (nats.atomic_transactions).
		{prometheus.CounterOpts{Name: "walbox_nats_atomic_batches_total", Help: "Atomic batches committed (nats.atomic_transactions)."},
			atomic(func(s jssink.AtomicStats) uint64 { return s.Batches })},
		{prometheus.CounterOpts{Name: "walbox_nats_atomic_messages_total", Help: "Messages sent in atomic batches."},
			atomic(func(s jssink.AtomicStats) uint64 { return s.Messages })},
		{prometheus.CounterOpts{Name: "walbox_nats_atomic_splits_total", Help: "Atomic batches ended before their transaction: the server's batch limit or the relay's window."},
			atomic(func(s jssink.AtomicStats) uint64 { return s.Splits })},
		{prometheus.CounterOpts{Name: "walbox_nats_atomic_refused_total", Help: "Atomic batches the server refused (a duplicate inside, a poison event): their transactions resent per message."},
			atomic(func(s jssink.AtomicStats) uint64 { return s.Refused })},
	} {
		if err := reg.Register(prometheus.NewCounterFunc(c.opts, c.value)); err != nil {
			return fmt.Errorf("register %s: %w", c.opts.Name, err)
		}
	}
	return nil
}

// claimClockMargin is what the claim-check sweep's slack allows for the
// clocks of the servers (the store's, the brokers', walbox's).
const claimClockMargin = time.Minute

// claimSlack is the claim-check sweep's slack (claim.Sweeper's proof): an
// object's message is stored within the upload timeout plus the ack
// timeout after the object's modification time (S3: when the upload
// began), and an upload's chunks are named by an object within the upload
// timeout; a margin more for the clocks.
func claimSlack(ackTimeout, uploadTimeout time.Duration) time.Duration {
	return ackTimeout + uploadTimeout + claimClockMargin
}

// claimInS3 puts the claim check around b's sink with claim_check.s3 as its
// store, and sweeps the bucket every claim_check.sweep_interval: an object
// goes when horizon shows its message gone (ackTimeout: the sink's).
func (b *bus) claimInS3(cfg config.Config, horizon claim.Horizon, ackTimeout time.Duration, log zerolog.Logger, reg prometheus.Registerer) error {
	s3 := cfg.ClaimCheck.S3
	c, err := sweep.NewS3Client(sweep.S3Config{Endpoint: s3.Endpoint, Bucket: s3.Bucket, Prefix: s3.Prefix,
		AccessKey: s3.AccessKey, SecretKey: s3.SecretKey, UseSSL: s3.UseSSL})
	if err != nil {
		return &config.Error{Key: "claim_check.s3", Msg: err.Error()}
	}
	cc := cfg.ClaimCheck
	store := claim.NewS3Store(c, s3.Bucket, s3.Prefix, cc.MaxBytes)
	b.claim = claim.New(b.sink, store, claim.Options{Threshold: cc.Threshold, UploadTimeout: cc.UploadTimeout, Logger: log, Registerer: reg})
	b.sink = b.claim.AsSink()
	b.claimSweep = claim.NewS3Sweeper(store, horizon, claimSlack(ackTimeout, cc.UploadTimeout), log, reg)
	return nil
}
