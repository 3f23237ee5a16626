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

// ReadBackRange is what a read-back reads of a stream (a Kafka topic): the
// messages with sequences First to Last, both included; or, with First 0,
// the newest ones, then older and older ones until the callback has counted
// Want of them (returned true), the stream's start is reached, or ScanMax
// messages were read (0: no bound). Messages of other sources are read but
// never passed to the callback: in a stream shared with other tables or
// databases, the newest Want messages can hold few of the caller's. A Kafka
// topic reads each partition on its own (a sequence is an offset + 1, and
// Want and ScanMax count per partition): what a crash left unmarked can sit
// in any of them.
type ReadBackRange struct {
	First, Last uint64
	Want        int
	ScanMax     int
}
