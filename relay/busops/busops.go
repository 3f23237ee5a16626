// Package busops is what walbox's operations commands need of a sink's bus
// besides publishing: the configured streams (topics) as the relay's router
// sees them, read-back by id and by time, the dead letters to list and
// retry, and the doctor's checks of the streams (topics). Each sink package
// implements Bus (jssink.OpenOps, kafkasink.OpenOps); the commands
// (internal/ops: dlq list and retry, replay, doctor) are written once over
// it, so a sink adds no command code.
package busops

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
)

// Bus is one sink's bus, opened for a command.
type Bus interface {
	// Terms are the bus's words and ways, for the commands' output.
	Terms() Terms
	// Streams names the configured streams (topics) of events, the
	// dead-letter one not included.
	Streams() []string
	// Routes are the configured streams (topics) the server has, dead
	// letters' included where the relay routes to it, as the relay's
	// router sees them.
	Routes(ctx context.Context) ([]relay.Route, error)
	// Router is the relay's router for events of source over routes: the
	// sink's prefix, template and payload limit.
	Router(source string, routes []relay.Route) (*relay.Router, error)
	// Destination is the stream (topic) that stores what is published to
	// subject now; why says, when none does, what would make one.
	Destination(ctx context.Context, subject string) (dest, why string, err error)
	// DeadLetter is the relay's dead letter of ev, addressed to the
	// dead-letter stream (topic).
	DeadLetter(rt *relay.Router, ev *cdc.Event, reason string) *relay.Msg
	// DLQName names the dead-letter stream (topic).
	DLQName() string
	// Publish stores m in dest (the stream it must land in: JetStream
	// refuses it elsewhere).
	Publish(m *relay.Msg, dest string) (relay.Future, error)
	// ReadBack is the relay's read-back by id (relay.ReadBackRange): what
	// every message of source in the range says of its event.
	ReadBack(ctx context.Context, dest, source string, rr relay.ReadBackRange, fn func(relay.StoredEvent) bool) error
	// StoredTail is the relay's read-back of a stream's tail (relay.Sink).
	StoredTail(ctx context.Context, stream, source string, n int) (relay.StoredTail, error)
	// Scan calls fn with the headers of every message of dest stored since
	// since (zero: all) whose subject filter matches ("": all), in order.
	Scan(ctx context.Context, dest, filter string, since time.Time, fn func(relay.Header) error) error
	// DeadLetters opens the dead-letter stream (topic) as it is now.
	DeadLetters(ctx context.Context) (DLQ, error)
	// Check reports the doctor's checks of the bus and its streams
	// (topics), read-only.
	Check(ctx context.Context, report Report)
	Close()
}

// Names are a bus's configured streams (topics); embedded in a Bus, they
// implement DLQName and Streams.
type Names struct {
	Events []string // the streams (topics) of events
	DLQ    string   // the dead-letter stream (topic)
}

// NamesOf are names, the dead-letter stream's last.
func NamesOf(names []string) Names {
	return Names{Events: slices.Clip(names[:len(names)-1]), DLQ: names[len(names)-1]}
}

// DLQName implements Bus.
func (n Names) DLQName() string { return n.DLQ }

// Streams implements Bus.
func (n Names) Streams() []string { return n.Events }

// Terms are how a bus's things are called, and what it does itself.
type Terms struct {
	Stream  string // what stores messages: "stream", "topic"
	Subject string // what a message is sent to: "subject", "topic"
	// Dedupes: the bus drops a message under an id it holds (JetStream,
	// inside its duplicate window).
	Dedupes bool
	// Partitioned: an ack's partition tells where a message is (Kafka).
	Partitioned bool
	// NoCheck is what replay --no-check leaves to the bus.
	NoCheck string
	// Remove and Removed are what dlq retry does to a retried dead letter:
	// "delete them from", "deleted from"; "mark them retried in", ...
	Remove, Removed string
}

// DeadLetter is one dead letter of the dead-letter stream (topic).
type DeadLetter struct {
	// Seq is the message's sequence (Kafka: its offset + 1).
	Seq             uint64    `json:"seq"`
	Time            time.Time `json:"time"`
	Subject         string    `json:"subject"`
	OriginalSubject string    `json:"original_subject"`
	ID              string    `json:"id"`
	Reason          string    `json:"reason"`
	// Group is the consumer group that dead-lettered it; empty for the
	// relay's dead letters (events no stream stored).
	Group string `json:"group,omitempty"`
	// Partition of the dead-letter topic (Kafka).
	Partition int32 `json:"partition,omitempty"`
	// Header and Data are the message's, when it was read with them.
	Header relay.Header `json:"-"`
	Data   []byte       `json:"-"`
}

// Headers of dead letters besides relay's.
const (
	// HeaderConsumerGroup names the consumer group that dead-lettered an
	// event (the consumer library's HeaderGroup).
	HeaderConsumerGroup = "Walbox-Consumer-Group"
	// HeaderRetriedFrom is set on a retried dead letter: <dlq>/<seq>.
	HeaderRetriedFrom = "Walbox-Dlq-Retried-From"
)

// NewDeadLetter is the dead letter stored at seq with headers h.
func NewDeadLetter(seq uint64, at time.Time, subject string, h relay.Header) DeadLetter {
	return DeadLetter{Seq: seq, Time: at, Subject: subject, Header: h,
		OriginalSubject: h.Get(relay.HeaderDLQOriginalSubject), Reason: h.Get(relay.HeaderDLQReason),
		// A consumer's dead letter has a Nats-Msg-Id of its own.
		ID: relay.IdentityID(h), Group: h.Get(HeaderConsumerGroup)}
}

// DLQ is the dead-letter stream (topic) as one dlq list or retry reads it.
type DLQ interface {
	// List reads up to limit dead letters waiting (oldest first; limit <=
	// 0: all), with their payloads when data, and how many wait.
	List(ctx context.Context, limit int, data bool) ([]DeadLetter, uint64, error)
	// Pick reads the dead letters at seqs, with their payloads.
	Pick(ctx context.Context, seqs []uint64) ([]DeadLetter, error)
	// Retried takes dl out of those waiting: its event was republished at
	// at (<stream>/<seq>), or found stored ("").
	Retried(ctx context.Context, dl DeadLetter, at string) error
	// Count is how many dead letters wait, for walbox status (cheaper
	// than List, and may count retried ones on a large topic).
	Count(ctx context.Context) (uint64, error)
	// Close saves what the retries changed (Kafka: the group's offsets);
	// its error leaves the retried dead letters hidden still.
	Close(ctx context.Context) error
}

// Status is the outcome of one doctor check.
type Status string

// Check outcomes.
const (
	OK   Status = "ok"
	Warn Status = "warn"
	Fail Status = "fail"
	Skip Status = "skip"
)

// Report receives one doctor check: what was found and, when it is not
// ok, the exact fix.
type Report func(name string, st Status, detail, fix string)

// HumanBytes formats n in IEC units: 512 B, 1.5 KiB, 3.2 GiB.
func HumanBytes(n int64) string {
	if n < 0 {
		return "-" + HumanBytes(-n)
	}
	if n < 1024 {
		return fmt.Sprintf("%d B", n)
	}
	units := []string{"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
	v := float64(n) / 1024
	i := 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	return fmt.Sprintf("%.1f %s", v, units[i])
}
