package jssink

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/mdtable"
	"github.com/walbox/walbox/relay"
)

// serverError is the server's own API error for code, from nats-server's
// generated table (errors.json), with its description's {...} filled in the
// way the server fills them.
func serverError(t *testing.T, code jetstream.ErrorCode) *server.ApiError {
	t.Helper()
	for _, e := range server.ApiErrors {
		if jetstream.ErrorCode(e.ErrCode) != code {
			continue
		}
		desc := strings.NewReplacer("{seq}", "41", "{id}", "e-41", "{err}", "maximum bytes exceeded",
			"{header}", "Nats-Msg-Id", "{size}", "1001").Replace(e.Description)
		return &server.ApiError{Code: e.Code, ErrCode: e.ErrCode, Description: desc}
	}
	return nil
}

// replyErr is the error the sink resolves a future with when the stream
// answers the publish with apiErr: the server's pub ack response, as
// processJetStreamMsg marshals it, through parseReply (which wraps 10071 in
// relay.ErrOrderRefused).
func replyErr(t *testing.T, apiErr *server.ApiError) error {
	t.Helper()
	data, err := json.Marshal(&server.JSPubAckResponse{Error: apiErr, PubAck: &server.PubAck{Stream: "ORDERS"}})
	if err != nil {
		t.Fatal(err)
	}
	m := &nats.Msg{Subject: "_INBOX.x.1", Data: data}
	if apiErr.Code == 429 { // queueInbound's reply carries the status too
		m.Header = nats.Header{"Status": {"429"}, "Description": {"Too Many Requests"}}
	}
	var stream string
	ack, err := parseReply(m, &stream)
	if ack != nil || err == nil {
		t.Fatalf("parseReply(%s) = ack %+v, err %v; want an error", data, ack, err)
	}
	return err
}

// TestClassifyEveryRow walks Table: each row's error, built as the sink
// meets it, has the row's kind and class, and its code names the row.
// Server rows are checked against nats-server's own error table, so a
// mistyped code, status or description fails here.
func TestClassifyEveryRow(t *testing.T) {
	seen := map[string]bool{}
	for _, r := range Table {
		t.Run(r.Label(), func(t *testing.T) {
			if seen[r.Label()] {
				t.Fatalf("two rows for %s", r.Label())
			}
			seen[r.Label()] = true
			if r.Kind > KindConfig || r.Why == "" || r.Name == "" || r.Desc == "" {
				t.Fatalf("incomplete row %+v", r)
			}
			if (r.Code == 0) == (r.Err == nil) {
				t.Fatalf("a row has a code or a client error, not both or neither: %+v", r)
			}
			var errs []error
			if r.Code != 0 {
				se := serverError(t, r.Code)
				if se == nil {
					t.Fatalf("nats-server has no error %d", r.Code)
				}
				if raw := rawServerDesc(r.Code); se.Code != r.Status || raw != r.Desc {
					t.Fatalf("row says %d %q, nats-server %d %q", r.Status, r.Desc, se.Code, raw)
				}
				err := replyErr(t, se)
				errs = append(errs, err, fmt.Errorf("publish to orders.created: %w", err))
			} else {
				if r.Err.Error() != r.Desc {
					t.Fatalf("row says %q, the client %q", r.Desc, r.Err.Error())
				}
				// As Publish returns it, as the ack timer resolves it, and
				// wrapped by a caller.
				errs = append(errs, wrapOrder(r.Err), r.Err, fmt.Errorf("publish to orders.created: %w", r.Err))
			}
			for _, err := range errs {
				if got := ErrKind(err); got != r.Kind {
					t.Errorf("ErrKind(%v) = %v, want %v", err, got, r.Kind)
				}
				if got, want := Classify(err), r.Kind.Class(); got != want {
					t.Errorf("Classify(%v) = %v, want %v", err, got, want)
				}
				if got := Code(err); got != r.Label() {
					t.Errorf("Code(%v) = %q, want %q", err, got, r.Label())
				}
			}
			if r.Kind == KindPermanent && r.Kind.Class() != relay.Permanent {
				t.Errorf("a permanent row is not dead-lettered")
			}
			if r.Kind != KindPermanent && r.Kind.Class() != relay.Transient {
				t.Errorf("a %v row is dead-lettered", r.Kind)
			}
		})
	}
}

// rawServerDesc is the server's description template for code.
func rawServerDesc(code jetstream.ErrorCode) string {
	for _, e := range server.ApiErrors {
		if jetstream.ErrorCode(e.ErrCode) == code {
			return e.Description
		}
	}
	return ""
}

// TestClassifyServerConditions: the server's conditions of issue 33 are
// transient (before, every 4xx API error was permanent and a whole window
// was dead-lettered while a stream was full or electing); what is the
// message's own fault stays permanent; an order refusal is transient and
// marked as one.
func TestClassifyServerConditions(t *testing.T) {
	for _, tt := range []struct {
		name   string
		apiErr *server.ApiError
		want   relay.ErrorClass
		kind   Kind
	}{
		{"10158 duplicate message id in process", server.NewJSStreamDuplicateMessageConflictError(), relay.Transient, KindTransient},
		{"10002 account resource limits exceeded", server.NewJSAccountResourcesExceededError(), relay.Transient, KindTransient},
		{"unknown code 10999 with 400", &server.ApiError{Code: 400, ErrCode: 10999, Description: "a code from a newer server"}, relay.Transient, KindTransient},
		{"unknown code 10998 with 404", &server.ApiError{Code: 404, ErrCode: 10998, Description: "a code from a newer server"}, relay.Transient, KindTransient},
		{"10167 too many requests", server.NewJSStreamTooManyRequestsError(), relay.Transient, KindTransient},
		{"10023 insufficient resources", server.NewJSInsufficientResourcesError(), relay.Transient, KindTransient},
		{"10077 stream full, discard new", server.NewJSStreamStoreFailedError(server.ErrMaxBytes, server.Unless(server.ErrMaxBytes)), relay.Transient, KindTransient},
		{"10077 per-subject limit, discard new", server.NewJSStreamStoreFailedError(server.ErrMaxMsgsPerSubject), relay.Transient, KindTransient},
		{"10077 message over the file store's record limit", server.NewJSStreamStoreFailedError(server.ErrMsgTooLarge), relay.Permanent, KindPermanent},
		{"10059 stream not found", server.NewJSStreamNotFoundError(), relay.Transient, KindConfig},
		{"10120 no limits", server.NewJSNoLimitsError(), relay.Transient, KindConfig},
		{"10054 message size exceeds maximum", server.NewJSStreamMessageExceedsMaximumError(), relay.Permanent, KindPermanent},
		{"10060 expected stream does not match", server.NewJSStreamNotMatchError(), relay.Permanent, KindPermanent},
		{"10071 wrong last sequence", server.NewJSStreamWrongLastSequenceError(41), relay.Transient, KindOrderRefused},
		{"10070 wrong last msg id", server.NewJSStreamWrongLastMsgIDError("e-41"), relay.Transient, KindOrderRefused},
	} {
		err := replyErr(t, tt.apiErr)
		if got := Classify(err); got != tt.want {
			t.Errorf("%s: Classify(%v) = %v, want %v", tt.name, err, got, tt.want)
		}
		if got := ErrKind(err); got != tt.kind {
			t.Errorf("%s: ErrKind(%v) = %v, want %v", tt.name, err, got, tt.kind)
		}
	}

	// 10071 reaches the relay as relay.ErrOrderRefused.
	err := replyErr(t, server.NewJSStreamWrongLastSequenceError(41))
	if !errors.Is(err, relay.ErrOrderRefused) {
		t.Errorf("10071: %v does not wrap relay.ErrOrderRefused", err)
	}

	// A 503 status without data: no stream took the subject.
	var stream string
	if _, err := parseReply(&nats.Msg{Header: nats.Header{"Status": {"503"}}}, &stream); Classify(err) != relay.Transient || Code(err) != "jetstream.ErrNoStreamResponse" {
		t.Errorf("no responders: %v is %v (%s), want transient", err, Classify(err), Code(err))
	}
	// A server without headers takes no walbox message: its set-up, not
	// the message's fault (before: permanent).
	if k := ErrKind(nats.ErrHeadersNotSupported); k != KindConfig || Classify(nats.ErrHeadersNotSupported) != relay.Transient {
		t.Errorf("nats.ErrHeadersNotSupported: %v", k)
	}
	// An error nobody knows waits.
	if k := ErrKind(errors.New("something else")); k != KindTransient {
		t.Errorf("an unknown error is %v, want transient", k)
	}
	if c := Code(errors.New("something else")); c != "" {
		t.Errorf("Code of an unknown error = %q", c)
	}
	if c := Code(&jetstream.APIError{Code: 503}); c != "status 503" {
		t.Errorf("Code of an API error without err_code = %q", c)
	}
}

// TestClassifyTableInDocs: docs/operations.md lists every row of Table with
// its kind, so the runbook and the code cannot drift apart.
func TestClassifyTableInDocs(t *testing.T) {
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	lines := mdtable.Rows(string(doc), "#### JetStream")
	for _, r := range Table {
		line, ok := lines[r.Label()]
		if !ok {
			t.Errorf("docs/operations.md has no row for %s (%s)", r.Label(), r.Name)
			continue
		}
		want := []string{"| " + r.Kind.String()}
		for _, d := range r.Details {
			want = append(want, d.Kind.String()+" for `"+d.Desc+"`")
		}
		for _, w := range want {
			if !strings.Contains(line, w) {
				t.Errorf("docs/operations.md's row for %s does not say %q: %s", r.Label(), w, line)
			}
		}
		delete(lines, r.Label())
	}
	for l := range lines {
		t.Errorf("docs/operations.md lists %s, which Table does not", l)
	}
}
