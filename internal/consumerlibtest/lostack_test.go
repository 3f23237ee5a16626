package consumerlibtest

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/consumer"
)

// ackLoser loses the ack of every delivery whose handler committed, as if
// the ack never reached JetStream: it naks instead, so JetStream redelivers
// an event the group has already processed. It wraps the JetStream handed to
// consumer.Run and the consumers and messages Run gets from it; the handler
// marks its deliveries with ran. Run acks only after a successful commit,
// and a delivery found to be a duplicate never calls the handler, so an ack
// of a marked delivery is exactly the ack after a first processing.
type ackLoser struct {
	mu     sync.Mutex
	ran    map[delivery]bool // deliveries whose handler ran
	forced atomic.Int64      // acks lost
}

// delivery is one delivery of one stream message.
type delivery struct {
	stream   string
	sequence uint64
	attempt  int
}

func newAckLoser() *ackLoser { return &ackLoser{ran: map[delivery]bool{}} }

// handler wraps h to mark each delivery it runs for.
func (l *ackLoser) handler(h consumer.Handler) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		l.mu.Lock()
		l.ran[delivery{msg.Stream, msg.Sequence, msg.Attempt}] = true
		l.mu.Unlock()
		return h(ctx, tx, msg)
	}
}

// handlerRan reports whether the handler ran for m's delivery.
func (l *ackLoser) handlerRan(m jetstream.Msg) bool {
	meta, err := m.Metadata()
	if err != nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ran[delivery{meta.Stream, meta.Sequence.Stream, int(meta.NumDelivered)}]
}

// jetStream wraps js.
func (l *ackLoser) jetStream(js jetstream.JetStream) jetstream.JetStream {
	return &loserJS{JetStream: js, l: l}
}

type loserJS struct {
	jetstream.JetStream
	l *ackLoser
}

func (j *loserJS) CreateOrUpdateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	c, err := j.JetStream.CreateOrUpdateConsumer(ctx, stream, cfg)
	if err != nil {
		return nil, err
	}
	return &loserConsumer{Consumer: c, l: j.l}, nil
}

type loserConsumer struct {
	jetstream.Consumer
	l *ackLoser
}

func (c *loserConsumer) Messages(opts ...jetstream.PullMessagesOpt) (jetstream.MessagesContext, error) {
	it, err := c.Consumer.Messages(opts...)
	if err != nil {
		return nil, err
	}
	return &loserIter{MessagesContext: it, l: c.l}, nil
}

type loserIter struct {
	jetstream.MessagesContext
	l *ackLoser
}

func (it *loserIter) Next(opts ...jetstream.NextOpt) (jetstream.Msg, error) {
	m, err := it.MessagesContext.Next(opts...)
	if err != nil {
		return nil, err
	}
	return &loserMsg{Msg: m, l: it.l}, nil
}

type loserMsg struct {
	jetstream.Msg
	l *ackLoser
}

func (m *loserMsg) Ack() error {
	if m.l.handlerRan(m.Msg) {
		m.l.forced.Add(1)
		return m.Msg.Nak()
	}
	return m.Msg.Ack()
}
