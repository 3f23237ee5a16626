package ops

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// kafkaReplay publishes to Kafka (sink: kafka) through a kafkasink.Sink:
// the relay's producer (idempotent, acks=all, key partitioning). Kafka
// drops no duplicate by id, so the check of what the topics hold is all
// that keeps a replay from storing an event twice.
type kafkaReplay struct {
	cfg   config.Config
	res   *ReplayResult
	adm   *kadm.Client
	admCl *kgo.Client
	sink  *kafkasink.Sink
	rts   []relay.Route
	rt    *relay.Router
	ackWindow[kafkaFlight]
}

type kafkaFlight struct {
	f   relay.Future
	id  string
	dlq bool
}

func openReplayKafka(ctx context.Context, cfg config.Config, res *ReplayResult) (*kafkaReplay, error) {
	cl, sc, err := kafkaClient(cfg)
	if err != nil {
		return nil, err
	}
	b := &kafkaReplay{cfg: cfg, res: res, admCl: cl, adm: kadm.NewClient(cl)}
	b.waitAck = b.wait
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if b.rts, err = kafkaRoutes(cctx, b.adm, cfg); err != nil {
		cl.Close()
		return nil, err
	}
	if b.rt, err = kafkaRouter(cfg, source(cfg), b.rts); err != nil {
		cl.Close()
		return nil, err
	}
	if b.sink, err = kafkasink.New(sc); err != nil {
		cl.Close()
		return nil, err
	}
	return b, nil
}

func (b *kafkaReplay) router() *relay.Router { return b.rt }
func (b *kafkaReplay) dlq() string           { return b.cfg.Kafka.DLQTopic }
func (b *kafkaReplay) close()                { b.sink.Close(); b.admCl.Close() }

// deadLetter is the relay's dead letter on Kafka: every one goes to the
// dead-letter topic.
func (b *kafkaReplay) deadLetter(ev *cdc.Event, reason string) *relay.Msg {
	m := b.rt.DeadLetter(ev, "", reason)
	m.Subject = b.cfg.Kafka.DLQTopic
	return m
}

// storeIDs reads the identity (Walbox-Source, Walbox-Table,
// Walbox-Event-Id) of every record stored since from in the configured
// topics that filter captures (all with "") into walbox_replay_stored, in
// batches.
func (b *kafkaReplay) storeIDs(ctx context.Context, conn *pgx.Conn, filter string, from time.Time) error {
	for _, rt := range b.rts {
		if filter != "" && !relay.SubjectMatches(filter, rt.Stream) {
			continue
		}
		if err := b.storeTopicIDs(ctx, conn, rt.Stream, from); err != nil {
			return fmt.Errorf("read back topic %s (--no-check skips that, but Kafka keeps every duplicate): %w", rt.Stream, err)
		}
	}
	return nil
}

func (b *kafkaReplay) storeTopicIDs(ctx context.Context, conn *pgx.Conn, topic string, from time.Time) error {
	spans, exists, err := topicSpans(ctx, b.adm, topic, from)
	if err != nil || !exists {
		return err
	}
	c := idCopier{conn: conn}
	err = readKafka(ctx, b.cfg, topic, spans, func(r *kgo.Record) error {
		return c.add(ctx, topic, kafkasink.FromKafkaHeaders(r.Headers))
	})
	if err != nil {
		return err
	}
	return c.flush(ctx)
}

func (b *kafkaReplay) wait(ctx context.Context, fl kafkaFlight) error {
	if _, err := relay.Await(ctx, fl.f); err != nil {
		if ctx.Err() != nil {
			return err
		}
		return fmt.Errorf("publish %s: %w", fl.id, err)
	}
	if !fl.dlq {
		b.res.Published++
	}
	return nil
}

func (b *kafkaReplay) publish(ctx context.Context, m *relay.Msg, _ string, dlq bool) error {
	f, err := b.sink.Publish(m)
	if err != nil {
		return fmt.Errorf("publish to %s: %w", m.Subject, err)
	}
	return b.add(ctx, kafkaFlight{f: f, id: m.Header.Get(relay.HeaderMsgID), dlq: dlq})
}
