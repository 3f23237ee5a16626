package kafkasink

import (
	"context"
	"errors"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/relay"
)

// Kind is relay.ErrorKind: the kinds of every sink's table are one.
type Kind = relay.ErrorKind

// The kinds, as relay names them.
const (
	KindTransient    = relay.KindTransient
	KindOrderRefused = relay.KindOrderRefused
	KindPermanent    = relay.KindPermanent
	KindConfig       = relay.KindConfig
	KindBatchRefused = relay.KindBatchRefused
)

// Row is one error a produce can fail a record with: a Kafka error code a
// Produce (or the metadata or InitProducerID request behind it) answers
// with, as a *kerr.Error, or an error of franz-go's client.
type Row struct {
	// Err is the kerr error, or the client's error value.
	Err error
	// Name is the client error's variable (a kerr row is named by its
	// code's name, kerr.Error.Message).
	Name string
	Kind Kind
	// Why says why the error has this kind.
	Why string
}

// Code is the row's Kafka error code, 0 for a client error.
func (r Row) Code() int16 {
	var ke *kerr.Error
	if errors.As(r.Err, &ke) {
		return ke.Code
	}
	return 0
}

// Label is the row's name in the docs and logs: the Kafka error's name
// (MESSAGE_TOO_LARGE), or the client error's variable.
func (r Row) Label() string {
	var ke *kerr.Error
	if errors.As(r.Err, &ke) {
		return ke.Message
	}
	return r.Name
}

// Table is every error a record produced by this sink can fail with, and
// its kind. The Kafka codes are those a Produce response carries per
// partition (Kafka's ProduceResponse, and franz-go's handling of it in
// kgo/sink.go handleReqRespBatch), with those of the metadata and
// InitProducerID requests franz-go fails buffered records with; the
// client's are franz-go's record errors. franz-go retries a retriable code
// itself until kafka.ack_timeout (the record then fails with
// kgo.ErrRecordTimeout): the relay sees those codes only in rare paths, and
// they are listed for them. A code not in the table is transient: waiting
// is always safe, dead-lettering a healthy event is not. docs/operations.md
// ("Which broker errors dead-letter an event") lists the same rows; a test
// keeps them equal.
var Table = []Row{
	// A batch refused for its content: not proof about one record.
	{Err: kerr.MessageTooLarge, Kind: KindBatchRefused,
		Why: "the batch is over the topic's max.message.bytes; several records of the partition share it and all fail. The sink never hands it on bare: it decides per record (kafkasink.ErrRecordTooLarge or kafkasink.ErrBatchTooLarge)"},
	{Err: kerr.RecordListTooLarge, Kind: KindBatchRefused,
		Why: "the batch is over the broker's segment size (log.segment.bytes): a property of the batch, not of one record"},
	{Err: kerr.InvalidRecord, Kind: KindBatchRefused,
		Why: "the broker's validation refused a record of the batch (no key on a compacted topic, ...); the broker names the record, but franz-go fails the whole batch"},
	{Err: kerr.CorruptMessage, Kind: KindBatchRefused,
		Why: "the batch failed its CRC or size check, or (older brokers) holds a record without key for a compacted topic: usually the batch's bytes, not one record"},

	// The record's own fault.
	{Err: kerr.InvalidTopicException, Kind: KindPermanent,
		Why: "the record's topic (the row's topic column) is not a valid Kafka topic name, or an internal one: every record of the batch shares the topic, so it holds for each, and the same record fails every time"},

	// Set-up: the topic or the cluster takes no record of walbox's.
	{Err: kerr.UnknownTopicOrPartition, Kind: KindConfig,
		Why: "the topic does not exist and the brokers do not create it (walbox creates the topics of kafka.topics at start); franz-go waits for it, then fails the records"},
	{Err: kerr.TopicAuthorizationFailed, Kind: KindConfig,
		Why: "walbox's principal may not write to the topic: an ACL"},
	{Err: kerr.ClusterAuthorizationFailed, Kind: KindConfig,
		Why: "the idempotent producer needs IDEMPOTENT_WRITE on the cluster (brokers before Kafka 3.0): an ACL"},
	{Err: kerr.TransactionalIDAuthorizationFailed, Kind: KindConfig,
		Why: "walbox's principal may not use its transactional id (kafka.transactional_id): grant WRITE and DESCRIBE on that TransactionalId, or set kafka.transactions: false"},
	{Err: kerr.SaslAuthenticationFailed, Kind: KindConfig,
		Why: "the brokers refused kafka.sasl's credentials"},
	{Err: kerr.UnsupportedSaslMechanism, Kind: KindConfig,
		Why: "the brokers do not offer kafka.sasl's mechanism"},
	{Err: kerr.IllegalSaslState, Kind: KindConfig,
		Why: "the SASL handshake went wrong: the client's and the brokers' settings disagree"},
	{Err: kerr.UnsupportedVersion, Kind: KindConfig,
		Why: "the brokers are too old for a request the producer needs"},
	{Err: kerr.UnsupportedForMessageFormat, Kind: KindConfig,
		Why: "the topic's message.format.version predates record headers (0.11), which every walbox record has"},
	{Err: kerr.UnsupportedCompressionType, Kind: KindConfig,
		Why: "the topic's compression.type or the brokers' version refuse the producer's compression"},
	{Err: kerr.InvalidRequiredAcks, Kind: KindConfig,
		Why: "the producer always asks acks=all, which every broker takes: a broker or proxy in the way"},
	{Err: kerr.InvalidRequest, Kind: KindConfig,
		Why: "the broker could not read the request: a broker or proxy incompatible with the client"},
	{Err: kerr.InvalidTimestamp, Kind: KindConfig,
		Why: "the producer stamps records with its host's clock: outside the topic's message.timestamp.*.max.ms it is the clock or the topic setting, for every record alike"},
	{Err: kerr.PolicyViolation, Kind: KindConfig,
		Why: "a broker policy refused the request: the cluster's setting"},

	// The producer's sequence in the partition.
	{Err: kerr.OutOfOrderSequenceNumber, Kind: KindOrderRefused,
		Why: "the batch's sequence does not follow the partition's last one from this producer (records lost before it, or a broker that forgot the producer); franz-go resets the producer id and resends, so the record fails only when that fails: resend in order"},
	{Err: kerr.DuplicateSequenceNumber, Kind: KindOrderRefused,
		Why: "the batch was stored already: franz-go takes it as success and fails no record with it"},
	{Err: kerr.UnknownProducerID, Kind: KindOrderRefused,
		Why: "the broker forgot the producer (its records left with retention); franz-go resets the producer id and resends"},
	{Err: kerr.InvalidProducerEpoch, Kind: KindOrderRefused,
		Why: "another session of the producer id bumped its epoch: another writer, or franz-go's own reset"},
	{Err: kerr.ProducerFenced, Kind: KindOrderRefused,
		Why: "another producer with the same transactional id took over (a standby's takeover): the sink turns it into kafkasink.ErrFenced and the relay stops leading"},

	// The cluster's passing state.
	{Err: kerr.UnknownServerError, Kind: KindTransient,
		Why: "the broker failed unexpectedly; franz-go also returns it for a code it does not know"},
	{Err: kerr.LeaderNotAvailable, Kind: KindTransient,
		Why: "the partition is electing a leader"},
	{Err: kerr.NotLeaderForPartition, Kind: KindTransient,
		Why: "the leader moved; franz-go reloads metadata and resends"},
	{Err: kerr.FencedLeaderEpoch, Kind: KindTransient,
		Why: "the client's view of the leader is older than the broker's: franz-go reloads metadata"},
	{Err: kerr.UnknownLeaderEpoch, Kind: KindTransient,
		Why: "the client's view of the leader is newer than the broker's: it passes when the broker catches up"},
	{Err: kerr.RequestTimedOut, Kind: KindTransient,
		Why: "the broker did not get acks=all in request.timeout.ms: whether it was stored is unknown, and the idempotent producer's resend is not duplicated"},
	{Err: kerr.BrokerNotAvailable, Kind: KindTransient,
		Why: "a broker is down"},
	{Err: kerr.ReplicaNotAvailable, Kind: KindTransient,
		Why: "a replica is down"},
	{Err: kerr.NetworkException, Kind: KindTransient,
		Why: "the broker closed the connection before answering"},
	{Err: kerr.ListenerNotFound, Kind: KindTransient,
		Why: "the leader has no listener of this name yet (a broker starting)"},
	{Err: kerr.NotEnoughReplicas, Kind: KindTransient,
		Why: "fewer in-sync replicas than min.insync.replicas: nothing stored; it passes when replicas catch up"},
	{Err: kerr.NotEnoughReplicasAfterAppend, Kind: KindTransient,
		Why: "stored on the leader but on too few replicas: the idempotent producer's resend is not duplicated"},
	{Err: kerr.KafkaStorageError, Kind: KindTransient,
		Why: "the leader's log directory failed: the partition moves to another replica"},
	{Err: kerr.UnknownTopicID, Kind: KindTransient,
		Why: "the topic was deleted and created again: franz-go reloads its id"},
	{Err: kerr.ThrottlingQuotaExceeded, Kind: KindTransient,
		Why: "a quota is exhausted for now: back off"},
	{Err: kerr.CoordinatorLoadInProgress, Kind: KindTransient,
		Why: "producer id allocation: the coordinator is loading"},
	{Err: kerr.CoordinatorNotAvailable, Kind: KindTransient,
		Why: "producer id allocation: no coordinator yet"},
	{Err: kerr.NotCoordinator, Kind: KindTransient,
		Why: "producer id allocation: the coordinator moved"},
	{Err: kerr.ConcurrentTransactions, Kind: KindTransient,
		Why: "producer id allocation raced another; franz-go retries it"},
	{Err: kerr.InvalidTxnState, Kind: KindTransient,
		Why: "the transaction coordinator's state disagrees with the producer's: the transaction is aborted, franz-go recovers with a new producer id, and its records are resent in order"},
	{Err: kerr.InvalidProducerIDMapping, Kind: KindTransient,
		Why: "the coordinator forgot the transactional id (it expired while walbox was idle): the transaction is aborted and resent; franz-go recovers with a new producer id"},
	{Err: kerr.TransactionAbortable, Kind: KindTransient,
		Why: "the brokers ask to abort the transaction: it is aborted and its records resent in order"},

	// The sink's verdict on a MESSAGE_TOO_LARGE, per record (limits.go,
	// decideTooLarge); listed before the Kafka code they wrap.
	{Err: ErrRecordTooLarge, Name: "kafkasink.ErrRecordTooLarge", Kind: KindPermanent,
		Why: "MESSAGE_TOO_LARGE for a record that alone, as a batch of one, is over its topic's max.message.bytes (read from the brokers at start) or kafka.max_message_bytes: franz-go refuses it before sending, every time"},
	{Err: ErrBatchTooLarge, Name: "kafkasink.ErrBatchTooLarge", Kind: KindTransient,
		Why: "MESSAGE_TOO_LARGE for a record that alone fits its topic's limit: its batch was too large (the topic's limit lowered since walbox read it); resent in order"},

	// The sink's guard of per-key order (partitions.go).
	{Err: ErrTxnAborted, Name: "kafkasink.ErrTxnAborted", Kind: KindTransient,
		Why: "the record was acked by its partition, but another record of its transaction failed (or the commit did), so walbox aborted the transaction: not stored, resent in order"},
	{Err: ErrEpochMoved, Name: "kafkasink.ErrEpochMoved", Kind: KindTransient,
		Why: "a record published before this one failed and the relay had not heard of it yet: refused unsent, resent in order behind the failed one"},
	{Err: ErrFenced, Name: "kafkasink.ErrFenced", Kind: KindConfig,
		Why: "another walbox took over the transactional id (a standby took over while this relay was paused, or two deployments share kafka.transactional_id): nothing uncommitted is stored, and this relay stops leading"},
	{Err: ErrPartitionCountChanged, Name: "kafkasink.ErrPartitionCountChanged", Kind: KindConfig,
		Why: "the topic's partition count changed since walbox started (partitions added): keys would move to other partitions, so nothing more is published to the topic until walbox restarts and records the new count"},

	// franz-go's client errors.
	{Err: kgo.ErrRecordTimeout, Name: "kgo.ErrRecordTimeout", Kind: KindTransient,
		Why: "not acked within kafka.ack_timeout (franz-go's retries of a retriable code end here): the record and those behind it in its partition are resent in order"},
	{Err: kgo.ErrRecordRetries, Name: "kgo.ErrRecordRetries", Kind: KindTransient,
		Why: "franz-go's retry limit for the record: resent in order"},
	{Err: kgo.ErrMaxBuffered, Name: "kgo.ErrMaxBuffered", Kind: KindTransient,
		Why: "franz-go's buffer is full (walbox sizes it at twice the window, so Produce does not meet it)"},
	{Err: kgo.ErrAborting, Name: "kgo.ErrAborting", Kind: KindTransient,
		Why: "buffered records were aborted (the client is shutting down)"},
	{Err: kgo.ErrClientClosed, Name: "kgo.ErrClientClosed", Kind: KindTransient,
		Why: "walbox is stopping; what was not acked is sent again on the next start"},
	{Err: context.DeadlineExceeded, Name: "context.DeadlineExceeded", Kind: KindTransient,
		Why: "no answer in time"},
	{Err: context.Canceled, Name: "context.Canceled", Kind: KindTransient,
		Why: "walbox is stopping; what was not acked is sent again on the next start"},
}

// byCode indexes Table's Kafka codes; clientRows are its client errors.
var byCode, clientRows = func() (map[int16]*Row, []*Row) {
	m := make(map[int16]*Row)
	var c []*Row
	for i := range Table {
		r := &Table[i]
		if ke, ok := r.Err.(*kerr.Error); ok {
			m[ke.Code] = r
		} else {
			c = append(c, r)
		}
	}
	return m, c
}()

// lookup returns err's row, nil when the table has none. The client's
// errors come first: franz-go wraps the last retriable code in a record
// timeout ("records have timed out ..., last err: ..."), and then the
// timeout says what happened to the record.
func lookup(err error) *Row {
	if err == nil {
		return nil
	}
	for _, r := range clientRows {
		if errors.Is(err, r.Err) {
			return r
		}
	}
	var ke *kerr.Error
	if errors.As(err, &ke) {
		return byCode[ke.Code]
	}
	return nil
}

// ErrKind is the kind of a produce error: its row's in Table, and
// KindTransient for an error the table does not know.
func ErrKind(err error) Kind {
	if r := lookup(err); r != nil {
		return r.Kind
	}
	return KindTransient
}

// Classify sorts Kafka produce errors by their row in Table: a record the
// brokers refuse for itself is permanent (dead-lettered), and so, until
// issue 35, is a batch refused for its content (INVALID_RECORD,
// CORRUPT_MESSAGE; MESSAGE_TOO_LARGE the sink decides per record);
// everything else, an
// unknown topic, a missing ACL and any error the table does not know
// included, waits and is resent in order.
func Classify(err error) relay.ErrorClass { return ErrKind(err).Class() }

// Code names err's code for logs, metrics and comparing the errors of one
// window: the Kafka error's name (also one the table does not know), or the
// client error's variable; "" for any other error.
func Code(err error) string {
	if r := lookup(err); r != nil {
		return r.Label()
	}
	var ke *kerr.Error
	if errors.As(err, &ke) {
		return ke.Message
	}
	return ""
}

// ErrorCode implements relay.ErrorCoder.
func (s *Sink) ErrorCode(err error) string { return Code(err) }
