package ops

import (
	"context"
	"fmt"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay/busops"
	"github.com/walbox/walbox/relay/jssink"
	"github.com/walbox/walbox/relay/kafkasink"
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
		return kafkasink.OpenOps(sc, kafkasink.OpsConfig{Topics: cfg.TopicSpecs(), Router: ro})
	}
	nc, _, err := connectNATS(ctx, cfg)
	if err != nil {
		return nil, err
	}
	b, err := jssink.OpenOps(nc, jssink.OpsConfig{Streams: cfg.StreamSpecs(), SubjectPrefix: cfg.NATS.SubjectPrefix,
		DLQSubjectPrefix: cfg.NATS.DLQ.SubjectPrefix, Router: ro, AckTimeout: cfg.NATS.AckTimeout, RedactURL: app.RedactNATSURL})
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
