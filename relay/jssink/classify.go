package jssink

import (
	"context"
	"errors"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

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
)

// Row is one error a JetStream publish (a PUB with a reply subject to a
// stream's subject) can come back with: a JetStream API error the stream
// answers with (Code set), or an error of the NATS client (Err set).
type Row struct {
	// Code is the API error's err_code (nats-server's errors.json), 0 for
	// a client error.
	Code jetstream.ErrorCode
	// Status is the API error's HTTP-like code (code in the reply).
	Status int
	// Err is the client's error value, for a client error.
	Err error
	// Name is the server's constant for Code, or the client's variable.
	Name string
	// Desc is the server's description ({...} are filled in by the server)
	// or the client error's text.
	Desc string
	Kind Kind
	// Why says why the error has this kind.
	Why string
	// Details refine Kind by the error's description, for a code the
	// server sends for causes of different kinds (10077: "{err}").
	Details []Detail
}

// Detail is one cause of a Row's code, told apart by the description the
// server fills in.
type Detail struct {
	Desc string
	Kind Kind
	Why  string
}

// Label is the row's name in the docs and logs: the err_code as digits, or
// the client error's variable.
func (r Row) Label() string {
	if r.Code != 0 {
		return strconv.Itoa(int(r.Code))
	}
	return r.Name
}

// Table is every error a publish can get back, with its kind. The server's
// codes are from nats-server v2.15's publish path (stream.go
// processJetStreamMsg, jetstream_cluster.go processClusteredInboundMsg,
// jetstream_batching.go checkMsgHeadersPreClusteredProposal, stream.go
// queueInbound and the batch publishes) and the few API codes a publish
// may meet on the way (no leader, no limits, no stream); the client's are
// what nats.go's PublishMsg and this sink return. A code not in the table
// is transient: waiting is always safe, dead-lettering a healthy event is
// not. docs/operations.md ("Which broker errors dead-letter an event")
// lists the same rows; a test keeps them equal.
//
// Of the headers a stream acts on, Nats-*, walbox sends Nats-Msg-Id and
// Nats-Expected-Last-Sequence and drops every Nats-* key of a row's headers
// column (relay/router.go). A code only another Nats-* header can draw is
// therefore never the event's fault: it is a walbox defect or a server
// feature switched on for the stream (KindConfig), never dead-lettered.
var Table = []Row{
	// The server's passing state.
	{Code: 10008, Status: 503, Name: "JSClusterNotAvailErr", Desc: "JetStream system temporarily unavailable", Kind: KindTransient,
		Why: "the cluster has no meta leader (an election, a restart): it passes when one is elected"},
	{Code: 10009, Status: 500, Name: "JSClusterNotLeaderErr", Desc: "JetStream cluster can not handle request", Kind: KindTransient,
		Why: "the server that took the publish no longer leads the stream (a leader change); v2.15 drops such a publish unanswered, so the ack timeout fires instead"},
	{Code: 10023, Status: 503, Name: "JSInsufficientResourcesErr", Desc: "insufficient resources", Kind: KindTransient,
		Why: "the server is over its own max_memory_store/max_file_store; the stream leader steps down, and it passes when another server leads or space frees"},
	{Code: 10002, Status: 400, Name: "JSAccountResourcesExceededErr", Desc: "resource limits exceeded for account", Kind: KindTransient,
		Why: "the account's JetStream storage is full: a state of the account, not of the message; it passes as messages age out or are consumed, or when an operator raises the limit"},
	{Code: 10028, Status: 500, Name: "JSMemoryResourcesExceededErr", Desc: "insufficient memory resources available", Kind: KindTransient,
		Why: "the server's memory store is full (stream create and update answer it; listed for a publish that meets it): it passes as space frees"},
	{Code: 10047, Status: 500, Name: "JSStorageResourcesExceededErr", Desc: "insufficient storage resources available", Kind: KindTransient,
		Why: "the server's file store is full (stream create and update answer it; listed for a publish that meets it): it passes as space frees"},
	{Code: 10063, Status: 503, Name: "JSStreamSequenceNotMatchErr", Desc: "expected stream sequence does not match", Kind: KindTransient,
		Why: "a replicated stream's log and the proposal disagree after a leader change: the next attempt goes through the settled leader"},
	{Code: 10077, Status: 503, Name: "JSStreamStoreFailedF", Desc: "{err}", Kind: KindTransient,
		Why: "the store refused the write: the stream is full with discard: new (maximum messages, bytes or messages per subject exceeded) or its store is closed; it passes as messages age out or are consumed",
		Details: []Detail{{Desc: "message too large", Kind: KindPermanent,
			Why: "this message is over the file store's record limit (32 MiB, reachable when max_payload is set above it): the same message fails every time"}}},
	{Code: 10158, Status: 409, Name: "JSStreamDuplicateMessageConflict", Desc: "duplicate message id is in process", Kind: KindTransient,
		Why: "an earlier publish of this same event id is still being proposed (R3, a resend after an ack timeout while the leader had trouble): once it commits, the resend is acked as a duplicate"},
	{Code: 10167, Status: 429, Name: "JSStreamTooManyRequests", Desc: "too many requests", Kind: KindTransient,
		Why: "the stream's inbound queue is full (publishes come faster than it stores): back off and resend"},

	// Order refusals.
	{Code: 10071, Status: 400, Name: "JSStreamWrongLastSequenceErrF", Desc: "wrong last sequence: {seq}", Kind: KindOrderRefused,
		Why: "Nats-Expected-Last-Sequence (strict order) is not the stream's last sequence: a gap before this message, or another writer; wrapped in relay.ErrOrderRefused: resent in order, and walbox watches for another writer"},
	{Code: 10164, Status: 400, Name: "JSStreamWrongLastSequenceConstantErr", Desc: "wrong last sequence", Kind: KindOrderRefused,
		Why: "the same refusal without the sequence, for per-subject and batch expectations (walbox's whole-stream expectation gets 10071)"},
	{Code: 10070, Status: 400, Name: "JSStreamWrongLastMsgIDErrF", Desc: "wrong last msg ID: {id}", Kind: KindOrderRefused,
		Why: "Nats-Expected-Last-Msg-Id, which walbox no longer sends (an earlier version did): the stream's last message is not the expected one"},

	// The message's own fault.
	{Code: 10054, Status: 400, Name: "JSStreamMessageExceedsMaximumErr", Desc: "message size exceeds maximum allowed", Kind: KindPermanent,
		Why: "this message (headers and payload) is larger than the stream's max_msg_size, a per-message limit: the same message fails every time, whatever the server's state"},
	{Code: 10097, Status: 400, Name: "JSStreamHeaderExceedsMaximumErr", Desc: "header size exceeds maximum allowed of 64k", Kind: KindPermanent,
		Why: "this message's headers (the row's headers column) exceed 64 KiB: the same message fails every time"},
	{Code: 10060, Status: 400, Name: "JSStreamNotMatchErr", Desc: "expected stream does not match", Kind: KindPermanent,
		Why: "Nats-Expected-Stream names another stream than the one that captures the subject: the row's stream column disagrees with the routing (walbox checks this before publishing and dead-letters with the same reason)"},

	// Set-up: the stream or the account takes no message of walbox's.
	{Code: 10059, Status: 404, Name: "JSStreamNotFoundErr", Desc: "stream not found", Kind: KindConfig,
		Why: "the stream API's answer (a publish that no stream captures gets no responders): the stream walbox publishes to is missing"},
	{Code: 10120, Status: 400, Name: "JSNoLimitsErr", Desc: "no JetStream default or applicable tiered limit present", Kind: KindConfig,
		Why: "the account has no JetStream limits for the stream's tier (R1, R3): no publish to the stream succeeds until an operator adds them"},
	{Code: 10109, Status: 400, Name: "JSStreamSealedErr", Desc: "invalid operation on sealed stream", Kind: KindConfig,
		Why: "the stream is sealed: it takes no message at all"},
	{Code: 10169, Status: 400, Name: "JSMessageIncrMissingErr", Desc: "message counter increment is missing", Kind: KindConfig,
		Why: "the stream is a counter stream (allow_msg_counter): it takes only Nats-Incr messages, none of walbox's"},
	{Code: 10168, Status: 400, Name: "JSMessageIncrDisabledErr", Desc: "message counters is disabled", Kind: KindConfig,
		Why: "drawn only by a Nats-Incr header, which walbox never sends"},
	{Code: 10170, Status: 400, Name: "JSMessageIncrPayloadErr", Desc: "message counter has payload", Kind: KindConfig,
		Why: "drawn only by a Nats-Incr header, which walbox never sends"},
	{Code: 10171, Status: 400, Name: "JSMessageIncrInvalidErr", Desc: "message counter increment is invalid", Kind: KindConfig,
		Why: "drawn only by a Nats-Incr header, which walbox never sends"},
	{Code: 10172, Status: 400, Name: "JSMessageCounterBrokenErr", Desc: "message counter is broken", Kind: KindConfig,
		Why: "a counter stream's last value does not parse: the stream's state, and only Nats-Incr messages meet it"},
	{Code: 10165, Status: 400, Name: "JSMessageTTLInvalidErr", Desc: "invalid per-message TTL", Kind: KindConfig,
		Why: "drawn only by a Nats-TTL header, which walbox never sends"},
	{Code: 10166, Status: 400, Name: "JSMessageTTLDisabledErr", Desc: "per-message TTL is disabled", Kind: KindConfig,
		Why: "drawn only by a Nats-TTL header (or a schedule's TTL), which walbox never sends"},
	{Code: 10111, Status: 500, Name: "JSStreamRollupFailedF", Desc: "{err}", Kind: KindConfig,
		Why: "drawn only by a Nats-Rollup header, which walbox never sends"},
	{Code: 10193, Status: 400, Name: "JSStreamExpectedLastSeqPerSubjectInvalid", Desc: "missing sequence for expected last sequence per subject", Kind: KindConfig,
		Why: "drawn only by a Nats-Expected-Last-Subject-Sequence-Subject header, which walbox never sends"},
	{Code: 10188, Status: 400, Name: "JSMessageSchedulesDisabledErr", Desc: "message schedules is disabled", Kind: KindConfig,
		Why: "drawn only by Nats-Schedule* headers, which walbox never sends"},
	{Code: 10189, Status: 400, Name: "JSMessageSchedulesPatternInvalidErr", Desc: "message schedules pattern is invalid", Kind: KindConfig,
		Why: "drawn only by Nats-Schedule* headers, which walbox never sends"},
	{Code: 10190, Status: 400, Name: "JSMessageSchedulesTargetInvalidErr", Desc: "message schedules target is invalid", Kind: KindConfig,
		Why: "drawn only by Nats-Schedule* headers, which walbox never sends"},
	{Code: 10191, Status: 400, Name: "JSMessageSchedulesTTLInvalidErr", Desc: "message schedules invalid per-message TTL", Kind: KindConfig,
		Why: "drawn only by Nats-Schedule* headers, which walbox never sends"},
	{Code: 10192, Status: 400, Name: "JSMessageSchedulesRollupInvalidErr", Desc: "message schedules invalid rollup", Kind: KindConfig,
		Why: "drawn only by Nats-Schedule* headers, which walbox never sends"},
	{Code: 10203, Status: 400, Name: "JSMessageSchedulesSourceInvalidErr", Desc: "message schedules source is invalid", Kind: KindConfig,
		Why: "drawn only by Nats-Schedule* headers, which walbox never sends"},
	{Code: 10212, Status: 400, Name: "JSMessageSchedulesSchedulerInvalidErr", Desc: "message schedules invalid scheduler", Kind: KindConfig,
		Why: "drawn only by Nats-Scheduler or Nats-Schedule-Next headers, which walbox never sends"},
	{Code: 10223, Status: 400, Name: "JSMessageSchedulesTimeZoneInvalidErr", Desc: "message schedules time zone is invalid", Kind: KindConfig,
		Why: "drawn only by Nats-Schedule* headers, which walbox never sends"},
	{Code: 10227, Status: 400, Name: "JSMessageSourceHdrNotAllowedErr", Desc: "message stream source header is not allowed", Kind: KindConfig,
		Why: "drawn only by a Nats-Stream-Source header, which walbox never sends"},

	// Batch publishes. walbox sends fast batches (batch.go); a batch's
	// refusal of its first message comes back as one of these and fails
	// that message (the sink also falls back on 10205 and pauses batches
	// on 10211). With nats.atomic_transactions it sends atomic batches
	// (atomic.go): a commit's refusal fails the whole transaction with
	// relay.ErrTxnRefused (transient whatever the row says), which the
	// relay resends per message; 10174 turns them off for the stream,
	// 10199 lowers the sink's batch limit.
	{Code: 10174, Status: 400, Name: "JSAtomicPublishDisabledErr", Desc: "atomic publish is disabled", Kind: KindConfig,
		Why: "the stream does not allow atomic batches (allow_atomic)"},
	{Code: 10205, Status: 400, Name: "JSBatchPublishDisabledErr", Desc: "batch publish is disabled", Kind: KindConfig,
		Why: "the stream does not allow fast batches"},
	{Code: 10185, Status: 412, Name: "JSRequiredApiLevelErr", Desc: "JetStream minimum api level required", Kind: KindConfig,
		Why: "the server is too old for the batch feature asked for"},
	{Code: 10175, Status: 400, Name: "JSAtomicPublishMissingSeqErr", Desc: "atomic publish sequence is missing", Kind: KindConfig,
		Why: "a batch header the sink built wrong: a walbox defect, not the event's"},
	{Code: 10177, Status: 400, Name: "JSAtomicPublishUnsupportedHeaderBatchErr", Desc: "atomic publish unsupported header used: {header}", Kind: KindConfig,
		Why: "a header atomic batches refuse, set by the sink: a walbox defect, not the event's"},
	{Code: 10179, Status: 400, Name: "JSAtomicPublishInvalidBatchIDErr", Desc: "atomic publish batch ID is invalid", Kind: KindConfig,
		Why: "a batch id the sink built wrong: a walbox defect, not the event's"},
	{Code: 10199, Status: 400, Name: "JSAtomicPublishTooLargeBatchErrF", Desc: "atomic publish batch is too large: {size}", Kind: KindConfig,
		Why: "the sink's batch is over the server's batch limit: a sink setting"},
	{Code: 10200, Status: 400, Name: "JSAtomicPublishInvalidBatchCommitErr", Desc: "atomic publish batch commit is invalid", Kind: KindConfig,
		Why: "a batch commit the sink built wrong: a walbox defect, not the event's"},
	{Code: 10201, Status: 400, Name: "JSAtomicPublishContainsDuplicateMessageErr", Desc: "atomic publish batch contains duplicate message id", Kind: KindTransient,
		Why: "an atomic batch holds an event the stream stores already (a resend): nothing of it is stored, and the transaction is resent per message, where that event gets its duplicate ack"},
	{Code: 10206, Status: 400, Name: "JSBatchPublishInvalidPatternErr", Desc: "batch publish pattern is invalid", Kind: KindConfig,
		Why: "a fast-batch reply pattern the sink built wrong: a walbox defect"},
	{Code: 10207, Status: 400, Name: "JSBatchPublishInvalidBatchIDErr", Desc: "batch publish ID is invalid", Kind: KindConfig,
		Why: "a fast-batch id the sink built wrong: a walbox defect"},
	{Code: 10176, Status: 400, Name: "JSAtomicPublishIncompleteBatchErr", Desc: "atomic publish batch is incomplete", Kind: KindTransient,
		Why: "a message of the batch did not arrive (a lost connection, a leader change): resend the batch"},
	{Code: 10208, Status: 400, Name: "JSBatchPublishUnknownBatchIDErr", Desc: "batch publish ID unknown", Kind: KindTransient,
		Why: "the server lost the fast batch's state (a leader change, an expiry): resend the batch"},
	{Code: 10210, Status: 429, Name: "JSAtomicPublishTooManyInflight", Desc: "atomic publish too many inflight", Kind: KindTransient,
		Why: "too many batches in flight on the stream: back off and resend"},
	{Code: 10211, Status: 429, Name: "JSBatchPublishTooManyInflight", Desc: "batch publish too many inflight", Kind: KindTransient,
		Why: "too many batches in flight on the stream: back off and resend"},

	// The client's errors (nats.go, and this sink's own).
	{Err: nats.ErrMaxPayload, Name: "nats.ErrMaxPayload", Desc: "nats: maximum payload exceeded", Kind: KindPermanent,
		Why: "this message is larger than the server's max_payload: the client refuses it before sending (the router checks the same bound first)"},
	{Err: nats.ErrBadSubject, Name: "nats.ErrBadSubject", Desc: "nats: invalid subject", Kind: KindPermanent,
		Why: "the row's topic makes an empty subject or one with blanks: the client refuses it (the router checks first)"},
	{Err: nats.ErrBadHeaderMsg, Name: "nats.ErrBadHeaderMsg", Desc: "nats: message could not decode headers", Kind: KindPermanent,
		Why: "a header key the client refuses, from the row's headers column (the router drops such keys first): the same message fails every time"},
	{Err: nats.ErrHeadersNotSupported, Name: "nats.ErrHeadersNotSupported", Desc: "nats: headers not supported by this server", Kind: KindConfig,
		Why: "the server takes no headers, and every walbox message has some (Nats-Msg-Id): the server's setting, not the message's fault"},
	{Err: nats.ErrPermissionViolation, Name: "nats.ErrPermissionViolation", Desc: "nats: permissions violation", Kind: KindConfig,
		Why: "the user may not publish to the subject or subscribe to its reply inbox: the account's setting (the server says it asynchronously, so the publish then times out)"},
	{Err: nats.ErrAuthorization, Name: "nats.ErrAuthorization", Desc: "nats: authorization violation", Kind: KindConfig,
		Why: "the server refused the connection's credentials"},
	{Err: relay.ErrOrderRefused, Name: "relay.ErrOrderRefused", Desc: relay.ErrOrderRefused.Error(), Kind: KindOrderRefused,
		Why: "the sink's mark of an order refusal (10071 comes wrapped in it)"},
	{Err: nats.ErrNoResponders, Name: "nats.ErrNoResponders", Desc: "nats: no responders available for request", Kind: KindTransient,
		Why: "no stream took the subject: the stream is being created or deleted, or JetStream is restarting"},
	{Err: jetstream.ErrNoStreamResponse, Name: "jetstream.ErrNoStreamResponse", Desc: "nats: no response from stream", Kind: KindTransient,
		Why: "this sink's form of no responders (a 503 status reply): as nats.ErrNoResponders"},
	{Err: jetstream.ErrAsyncPublishTimeout, Name: "jetstream.ErrAsyncPublishTimeout", Desc: "nats: timeout waiting for ack", Kind: KindTransient,
		Why: "no ack within nats.ack_timeout: a slow or electing stream, a lost connection; the resend is deduplicated by Nats-Msg-Id"},
	{Err: nats.ErrTimeout, Name: "nats.ErrTimeout", Desc: "nats: timeout", Kind: KindTransient,
		Why: "no answer in time"},
	{Err: context.DeadlineExceeded, Name: "context.DeadlineExceeded", Desc: "context deadline exceeded", Kind: KindTransient,
		Why: "no answer in time"},
	{Err: context.Canceled, Name: "context.Canceled", Desc: "context canceled", Kind: KindTransient,
		Why: "walbox is stopping; what was not acked is sent again on the next start"},
	{Err: jetstream.ErrInvalidJSAck, Name: "jetstream.ErrInvalidJSAck", Desc: "nats: invalid jetstream publish response", Kind: KindTransient,
		Why: "a reply that is neither an ack nor an API error: whether it was stored is unknown, and the resend is deduplicated by Nats-Msg-Id"},
	{Err: jetstream.ErrTooManyStalledMsgs, Name: "jetstream.ErrTooManyStalledMsgs", Desc: "nats: stalled with too many outstanding async published messages", Kind: KindTransient,
		Why: "the client's async window is full (the tools that publish through nats.go's PublishMsgAsync)"},
	{Err: nats.ErrConnectionClosed, Name: "nats.ErrConnectionClosed", Desc: "nats: connection closed", Kind: KindTransient,
		Why: "the connection is closed: walbox is stopping, or gave up reconnecting"},
	{Err: nats.ErrConnectionDraining, Name: "nats.ErrConnectionDraining", Desc: "nats: connection draining", Kind: KindTransient,
		Why: "the connection is draining: walbox is stopping"},
	{Err: nats.ErrDisconnected, Name: "nats.ErrDisconnected", Desc: "nats: server is disconnected", Kind: KindTransient,
		Why: "the connection dropped with the ack outstanding: whether it was stored is unknown, and the resend is deduplicated by Nats-Msg-Id"},
	{Err: nats.ErrReconnectBufExceeded, Name: "nats.ErrReconnectBufExceeded", Desc: "nats: outbound buffer limit exceeded", Kind: KindTransient,
		Why: "reconnecting, and the client's reconnect buffer is full"},
	{Err: nats.ErrStaleConnection, Name: "nats.ErrStaleConnection", Desc: "nats: stale connection", Kind: KindTransient,
		Why: "the server stopped answering pings: the client reconnects"},
}

// byCode indexes Table's API errors; clientRows are its client errors, in
// the order Kind tries them.
var byCode, clientRows = func() (map[jetstream.ErrorCode]*Row, []*Row) {
	m := make(map[jetstream.ErrorCode]*Row)
	var c []*Row
	for i := range Table {
		r := &Table[i]
		if r.Code != 0 {
			m[r.Code] = r
		} else {
			c = append(c, r)
		}
	}
	return m, c
}()

// lookup returns err's row and the kind it has, with the row's details
// applied; nil when the table has no row for err.
func lookup(err error) (*Row, Kind) {
	if err == nil {
		return nil, KindTransient
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		r := byCode[apiErr.ErrorCode]
		if r == nil {
			return nil, KindTransient
		}
		for _, d := range r.Details {
			if strings.EqualFold(strings.TrimSpace(apiErr.Description), d.Desc) {
				return r, d.Kind
			}
		}
		return r, r.Kind
	}
	for _, r := range clientRows {
		if errors.Is(err, r.Err) {
			return r, r.Kind
		}
	}
	return nil, KindTransient
}

// ErrKind is the kind of a publish error: its row's in Table, and
// KindTransient for an error the table does not know (an unknown API code
// of any status included).
func ErrKind(err error) Kind {
	_, k := lookup(err)
	return k
}

// Code names err's code for logs, metrics and comparing the errors of one
// window: an API error's err_code as digits (also one the table does not
// know; "status N" without one), or the client error's variable; "" for
// any other error.
func Code(err error) string {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		if apiErr.ErrorCode == 0 {
			return "status " + strconv.Itoa(apiErr.Code)
		}
		return strconv.Itoa(int(apiErr.ErrorCode))
	}
	if r, _ := lookup(err); r != nil {
		return r.Label()
	}
	return ""
}

// ErrorCode implements relay.ErrorCoder.
func (s *Sink) ErrorCode(err error) string { return Code(err) }
