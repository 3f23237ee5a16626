package relay

import "strconv"

// ErrorKind is what a failed publish says, as each sink's table of errors
// sorts them (relay/jssink/classify.go, relay/kafkasink/classify.go, and
// docs/operations.md): about the server's passing state, about the order
// of the stream, about the message itself, about how the server is set
// up, or about a batch of messages together.
type ErrorKind uint8

const (
	// KindTransient: the server's state of the moment (a leader change, a
	// full queue or store, a lost connection, a timeout). Wait, resend in
	// order.
	KindTransient ErrorKind = iota
	// KindOrderRefused: the stream (partition) refused the message because
	// its expected predecessor is not its last one (strict order found a
	// gap, or another writer). Resent in order; the relay watches for
	// another writer.
	KindOrderRefused
	// KindPermanent: the message's own fault, and it fails the same way
	// whatever the server's state (too large, a name the server refuses).
	// The message is dead-lettered.
	KindPermanent
	// KindConfig: the server, the account, the stream or walbox's
	// credentials are set up so that it takes no message of walbox's (a
	// missing or sealed stream, an account without limits, a missing ACL),
	// or a header walbox never sends was drawn. Nothing is dead-lettered
	// for it: the relay waits, resends and logs until it is fixed.
	KindConfig
	// KindBatchRefused: the broker refused a whole batch for its content
	// (Kafka: too large, a record invalid, corrupt). A batch holds several
	// messages and all of them fail, so the error is not proof about any
	// one. It should be confirmed by publishing each alone (issue 35);
	// until then it keeps the class it had, permanent.
	KindBatchRefused
)

// String is the kind as the docs and the logs name it.
func (k ErrorKind) String() string {
	switch k {
	case KindTransient:
		return "transient"
	case KindOrderRefused:
		return "order refusal"
	case KindPermanent:
		return "permanent"
	case KindConfig:
		return "configuration"
	case KindBatchRefused:
		return "refused with its batch"
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// Class is what the relay does with k: a permanent error (and, for now, a
// batch's refusal) dead-letters the message; every other kind waits and
// resends in order.
func (k ErrorKind) Class() ErrorClass {
	if k == KindPermanent || k == KindBatchRefused {
		return Permanent
	}
	return Transient
}
