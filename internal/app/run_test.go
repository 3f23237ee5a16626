package app

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// TestStreamsErrorRetriesMissingPeers: "no suitable peers for placement"
// (a node offline in a rolling restart, or a cluster that has just
// started) is waited out, as main's CI met it on a fresh 3-node cluster;
// before, it counted as a 4xx configuration error and `walbox run` exited.
func TestStreamsErrorRetriesMissingPeers(t *testing.T) {
	for _, tt := range []struct {
		name      string
		err       error
		permanent bool
		says      string
	}{
		{"no peers", fmt.Errorf("create or update stream PAYMENTS: %w", &jetstream.APIError{Code: 400, ErrorCode: 10005, Description: "no suitable peers for placement, peer offline"}),
			false, "waiting for enough JetStream peers"},
		{"not clustered", &jetstream.APIError{Code: 500, ErrorCode: 10074, Description: "replicas > 1 not supported in non-clustered mode"},
			true, "set replicas: 1"},
		{"bad config", &jetstream.APIError{Code: 400, ErrorCode: 10058, Description: "stream name already in use with a different configuration"},
			true, "fix nats.streams"},
		{"timeout", context.DeadlineExceeded, false, "deadline"},
		{"server error", &jetstream.APIError{Code: 503, Description: "JetStream system temporarily unavailable"}, false, "unavailable"},
	} {
		permanent, err := streamsError(tt.err)
		if permanent != tt.permanent || !strings.Contains(err.Error(), tt.says) {
			t.Errorf("%s: permanent %v, %q; want %v and %q", tt.name, permanent, err, tt.permanent, tt.says)
		}
		if !errors.Is(err, tt.err) && tt.name != "not clustered" {
			t.Errorf("%s: the cause is lost: %v", tt.name, err)
		}
	}
}
