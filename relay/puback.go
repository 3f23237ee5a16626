package relay

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// errNoAck is an ack that timed out (the message may or may not be stored;
// the resend is deduplicated by Nats-Msg-Id).
var errNoAck = errors.New("no JetStream ack within nats.ack_timeout")

// pubAckReply is JetStream's answer to a publish.
type pubAckReply struct {
	Error     *jetstream.APIError `json:"error,omitempty"`
	Stream    string              `json:"stream"`
	Sequence  uint64              `json:"seq"`
	Duplicate bool                `json:"duplicate,omitempty"`
	Domain    string              `json:"domain,omitempty"`
}

// parsePubAck reads a JetStream publish reply: the stored position, or the
// server's error. The common shapes ({"stream":"S","seq":N} with an
// optional "duplicate":true) are read without encoding/json, which was a
// tenth of the relay's CPU; anything else goes through encoding/json.
func parsePubAck(m *nats.Msg, streams map[string]string) (jetstream.PubAck, error) {
	if len(m.Data) == 0 {
		// A status message: 503 when no stream listens on the subject
		// (or JetStream is not up), anything else is unexpected.
		status, desc := m.Header.Get("Status"), m.Header.Get("Description")
		if status == "503" {
			return jetstream.PubAck{}, jetstream.ErrNoStreamResponse
		}
		return jetstream.PubAck{}, fmt.Errorf("jetstream publish: unexpected reply status %q %q", status, desc)
	}
	if ack, ok := fastPubAck(m.Data, streams); ok {
		return ack, nil
	}
	var r pubAckReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		return jetstream.PubAck{}, fmt.Errorf("jetstream publish: unreadable ack %q: %w", truncateBytes(m.Data, 200), err)
	}
	if r.Error != nil {
		return jetstream.PubAck{}, r.Error
	}
	if r.Stream == "" {
		return jetstream.PubAck{}, fmt.Errorf("jetstream publish: ack without a stream: %q", truncateBytes(m.Data, 200))
	}
	return jetstream.PubAck{Stream: r.Stream, Sequence: r.Sequence, Duplicate: r.Duplicate, Domain: r.Domain}, nil
}

// fastPubAck reads exactly {"stream":"<name>","seq":<n>} or
// {"stream":"<name>","seq":<n>,"duplicate":true}; ok is false for any
// other shape. streams (may be nil) interns the stream names.
func fastPubAck(b []byte, streams map[string]string) (jetstream.PubAck, bool) {
	const head, seqKey, dup = `{"stream":"`, `","seq":`, `,"duplicate":true}`
	if !bytes.HasPrefix(b, []byte(head)) {
		return jetstream.PubAck{}, false
	}
	b = b[len(head):]
	end := bytes.IndexByte(b, '"')
	if end <= 0 || bytes.IndexByte(b[:end], '\\') >= 0 {
		return jetstream.PubAck{}, false
	}
	stream := b[:end]
	b = b[end:]
	if !bytes.HasPrefix(b, []byte(seqKey)) {
		return jetstream.PubAck{}, false
	}
	b = b[len(seqKey):]
	n := 0
	for n < len(b) && b[n] >= '0' && b[n] <= '9' {
		n++
	}
	if n == 0 || n > 20 {
		return jetstream.PubAck{}, false
	}
	seq, err := strconv.ParseUint(string(b[:n]), 10, 64)
	if err != nil {
		return jetstream.PubAck{}, false
	}
	name, known := streams[string(stream)]
	if !known {
		name = string(stream)
		if streams != nil && len(streams) < 256 {
			streams[name] = name
		}
	}
	ack := jetstream.PubAck{Stream: name, Sequence: seq}
	switch rest := b[n:]; {
	case len(rest) == 1 && rest[0] == '}':
	case bytes.Equal(rest, []byte(dup)):
		ack.Duplicate = true
	default:
		return jetstream.PubAck{}, false
	}
	return ack, true
}

func truncateBytes(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "..."
}
