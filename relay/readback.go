package relay

// StoredEvent is what a read-back of a stream (or topic) reports of one
// stored message: the evidence the sweeper marks a row from.
type StoredEvent struct {
	// Table is the message's outbox table (HeaderTable): "" when it names
	// none (a relay from before walbox recorded it).
	Table string
	// ID is the bare event id (IdentityID).
	ID string
	// CreatedAt is the row's created_at as the relay decoded it
	// (HeaderCreatedAt): the mark's UPDATE then looks in the one partition
	// that holds the row. "" when the message has none (no created_at role,
	// or a relay from before walbox set it): the row is matched by id alone.
	CreatedAt string
	// Reason is a dead letter's reason (HeaderDLQReason), "" for an event.
	Reason string
}

// StoredEventFromHeaders reads a stored message's StoredEvent from its
// headers (a Kafka record's as FromKafkaHeaders gives them).
func StoredEventFromHeaders(h Header) StoredEvent {
	return StoredEvent{Table: h.Get(HeaderTable), ID: IdentityID(h), CreatedAt: h.Get(HeaderCreatedAt), Reason: h.Get(HeaderDLQReason)}
}
