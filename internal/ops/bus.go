package ops

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/busops"
	"github.com/walbox/walbox/relay/claim"
	"github.com/walbox/walbox/relay/jssink"
	"github.com/walbox/walbox/relay/kafkasink"
	"github.com/walbox/walbox/relay/sweep"
)

// openBus opens the configured sink's bus for a command: the one place
// that knows which sinks walbox has. With sink: kafka nothing is contacted
// yet; NATS is connected once (no retry).
func openBus(ctx context.Context, cfg config.Config) (busops.Bus, error) {
	ro := cfg.RouterOptions()
	ro.SubjectTemplate = cfg.SinkTemplate()
	if cfg.Sink == config.SinkKafka {
		sc, err := kafkaConfig(cfg)
		if err != nil {
			return nil, err
		}
		oc := kafkasink.OpsConfig{Topics: cfg.TopicSpecs(), Router: ro}
		if oc.Claim, err = claimWrap(cfg, nil); err != nil {
			return nil, err
		}
		return kafkasink.OpenOps(sc, oc)
	}
	nc, js, err := connectNATS(ctx, cfg)
	if err != nil {
		return nil, err
	}
	oc := jssink.OpsConfig{Streams: cfg.StreamSpecs(), SubjectPrefix: cfg.NATS.SubjectPrefix,
		DLQSubjectPrefix: cfg.NATS.DLQ.SubjectPrefix, Router: ro, AckTimeout: cfg.NATS.AckTimeout, RedactURL: app.RedactNATSURL}
	if oc.Claim, err = claimWrap(cfg, js); err != nil {
		nc.Close()
		return nil, err
	}
	b, err := jssink.OpenOps(nc, oc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	return b, nil
}

// busUnreachable reports the doctor's checks of a bus openBus could not
// open.
func busUnreachable(cfg config.Config, err error, report busops.Report) {
	if cfg.Sink == config.SinkKafka {
		report("kafka.connect", busops.Fail, fmt.Sprintf("brokers %s: %v", kafkaBrokers(cfg), err), kafkasink.ConnectFix)
		report("kafka.topics", busops.Skip, "no connection to Kafka", "")
		return
	}
	report("nats.connect", busops.Fail, err.Error(),
		"check nats.url (or WALBOX_NATS_URL / --nats-url), nats.tls and the credentials; is nats-server running and reachable from here?")
	report("nats.jetstream", busops.Skip, "no connection to NATS", "")
}

// claimWrap is the claim check the commands publish through when
// claim_check is on (nil when off): replay and dlq retry publish a large
// event as the relay does, an object of the event's key, then the
// reference naming it; when the store holds its payload intact already,
// without uploading it again (claim.Options.ReuseIntact). js is the JetStream of the Object Store
// (nil with Kafka).
func claimWrap(cfg config.Config, js jetstream.JetStream) (func(relay.Sink) (relay.Sink, int), error) {
	cc := cfg.ClaimCheck
	if !cc.Enabled {
		return nil, nil
	}
	var store claim.Store
	if s3 := cc.S3; cfg.ClaimS3() {
		c, err := sweep.NewS3Client(sweep.S3Config{Endpoint: s3.Endpoint, Bucket: s3.Bucket, Prefix: s3.Prefix,
			AccessKey: s3.AccessKey, SecretKey: s3.SecretKey, UseSSL: s3.UseSSL})
		if err != nil {
			return nil, &config.Error{Key: "claim_check.s3", Msg: err.Error()}
		}
		store = claim.NewS3Store(c, s3.Bucket, s3.Prefix, cc.MaxBytes)
	} else {
		store = claim.NewJetStreamStore(js, cfg.ClaimBucketSpec())
	}
	return func(inner relay.Sink) (relay.Sink, int) {
		cs := claim.New(inner, store, claim.Options{Threshold: cc.Threshold, UploadTimeout: cc.UploadTimeout, ReuseIntact: true})
		return cs.AsSink(), cs.Threshold()
	}, nil
}
