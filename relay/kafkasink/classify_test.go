package kafkasink

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/internal/mdtable"
	"github.com/walbox/walbox/relay"
)

// asPublished is err as the sink's future resolves with it: the produce
// promise's error, wrapped by Publish.
func asPublished(err error) error { return fmt.Errorf("produce to %s: %w", "orders", err) }

// TestClassifyEveryRow walks Table: each row's error, built as franz-go
// hands it to the produce promise and the sink wraps it, has the row's
// kind and class, and its code names the row.
func TestClassifyEveryRow(t *testing.T) {
	seen := map[string]bool{}
	for _, r := range Table {
		t.Run(r.Label(), func(t *testing.T) {
			if seen[r.Label()] {
				t.Fatalf("two rows for %s", r.Label())
			}
			seen[r.Label()] = true
			if r.Kind > KindBatchRefused || r.Why == "" || r.Err == nil || r.Label() == "" {
				t.Fatalf("incomplete row %+v", r)
			}
			var errs []error
			if ke, ok := r.Err.(*kerr.Error); ok {
				if r.Name != "" {
					t.Fatalf("a kerr row is named by its code: %+v", r)
				}
				// From a produce response's partition error code, as
				// handleReqRespBatch reads it.
				fromWire := kerr.ErrorForCode(ke.Code)
				if fromWire != r.Err {
					t.Fatalf("kerr.ErrorForCode(%d) = %v, want %v", ke.Code, fromWire, r.Err)
				}
				errs = append(errs, asPublished(fromWire), fromWire)
				if r.Err == kerr.MessageTooLarge {
					errs = append(errs,
						asPublished(fmt.Errorf("%w (uncompressed_bytes=%d, compressed_bytes=%d)", kerr.MessageTooLarge, 2<<20, 1<<20)), // the broker's
						asPublished(fmt.Errorf("%w (uncompressed_bytes=%d)", kerr.MessageTooLarge, 2<<20)))                             // the client's
				}
			} else {
				if !strings.Contains(r.Name, ".") {
					t.Fatalf("a client row names its package and variable: %+v", r)
				}
				errs = append(errs, asPublished(r.Err), r.Err)
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
			switch r.Kind {
			case KindPermanent, KindBatchRefused:
				if r.Kind.Class() != relay.Permanent {
					t.Errorf("a %v row is not dead-lettered", r.Kind)
				}
			default:
				if r.Kind.Class() != relay.Transient {
					t.Errorf("a %v row is dead-lettered", r.Kind)
				}
			}
		})
	}
}

// TestClassifyCases: what a record is refused for itself is permanent,
// a batch refused for its content keeps the permanent class it had (issue
// 35 will confirm each record alone), the cluster's state and its set-up
// wait, and so does any error the table does not know.
func TestClassifyCases(t *testing.T) {
	for _, tt := range []struct {
		name string
		err  error
		want relay.ErrorClass
		kind Kind
	}{
		{"invalid topic", kerr.InvalidTopicException, relay.Permanent, KindPermanent},
		{"batch too large", kerr.MessageTooLarge, relay.Permanent, KindBatchRefused},
		{"invalid record", kerr.InvalidRecord, relay.Permanent, KindBatchRefused},
		{"corrupt", kerr.CorruptMessage, relay.Permanent, KindBatchRefused},
		{"record list too large", kerr.RecordListTooLarge, relay.Permanent, KindBatchRefused},
		{"unknown topic", kerr.UnknownTopicOrPartition, relay.Transient, KindConfig},
		{"no ACL", kerr.TopicAuthorizationFailed, relay.Transient, KindConfig},
		{"old message format", kerr.UnsupportedForMessageFormat, relay.Transient, KindConfig},
		{"not enough replicas", kerr.NotEnoughReplicas, relay.Transient, KindTransient},
		{"storage", kerr.KafkaStorageError, relay.Transient, KindTransient},
		{"out of order sequence", kerr.OutOfOrderSequenceNumber, relay.Transient, KindOrderRefused},
		{"fenced", kerr.ProducerFenced, relay.Transient, KindOrderRefused},
		{"record timeout", kgo.ErrRecordTimeout, relay.Transient, KindTransient},
		// franz-go's timeout of a record waiting for its topic names the
		// last error; the timeout is what happened to the record.
		{"record timeout with last err", fmt.Errorf("%w, last err: %w", kgo.ErrRecordTimeout, kerr.UnknownTopicOrPartition), relay.Transient, KindTransient},
		{"an unknown code", kerr.ErrorForCode(30000), relay.Transient, KindTransient},
		{"a code the table does not list", kerr.GroupAuthorizationFailed, relay.Transient, KindTransient},
		{"anything else", errors.New("unable to partition record due to no usable partitions"), relay.Transient, KindTransient},
	} {
		err := asPublished(tt.err)
		if got := Classify(err); got != tt.want {
			t.Errorf("%s: Classify(%v) = %v, want %v", tt.name, err, got, tt.want)
		}
		if got := ErrKind(err); got != tt.kind {
			t.Errorf("%s: ErrKind(%v) = %v, want %v", tt.name, err, got, tt.kind)
		}
	}
	if c := Code(asPublished(kerr.GroupAuthorizationFailed)); c != "GROUP_AUTHORIZATION_FAILED" {
		t.Errorf("Code of a kerr error the table does not list = %q", c)
	}
	if c := Code(errors.New("x")); c != "" {
		t.Errorf("Code of an unknown error = %q", c)
	}
}

// TestClassifyTableInDocs: docs/operations.md lists every row of Table with
// its kind, so the runbook and the code cannot drift apart.
func TestClassifyTableInDocs(t *testing.T) {
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	lines := mdtable.Rows(string(doc), "#### Kafka")
	for _, r := range Table {
		line, ok := lines[r.Label()]
		if !ok {
			t.Errorf("docs/operations.md has no row for %s", r.Label())
			continue
		}
		if !strings.Contains(line, "| "+r.Kind.String()+" |") {
			t.Errorf("docs/operations.md's row for %s does not say %q: %s", r.Label(), r.Kind, line)
		}
		if code := r.Code(); code != 0 && !strings.Contains(line, fmt.Sprintf("| %d |", code)) {
			t.Errorf("docs/operations.md's row for %s does not give its code %d: %s", r.Label(), code, line)
		}
		delete(lines, r.Label())
	}
	for l := range lines {
		t.Errorf("docs/operations.md lists %s, which Table does not", l)
	}
}
