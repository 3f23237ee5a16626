package app

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
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

// TestRetryEnsure: an error sort lets pass is retried (and handed to warn
// as sort restated it) until ensure succeeds; a permanent one ends the
// retries with that error; a cancelled context ends them with nothing.
func TestRetryEnsure(t *testing.T) {
	cfg := config.Default()
	cfg.Retry.Initial, cfg.Retry.Max = time.Millisecond, time.Millisecond
	route := []relay.Route{{Stream: "ORDERS"}}
	transient, fatal := errors.New("down"), errors.New("misconfigured")
	sort := func(err error) (error, error) {
		if errors.Is(err, fatal) {
			return nil, fmt.Errorf("fix it: %w", err)
		}
		return fmt.Errorf("still %w", err), nil
	}

	var calls int
	var warned []string
	routes, err := retryEnsure(t.Context(), cfg, time.Second, func(context.Context) ([]relay.Route, error) {
		if calls++; calls < 3 {
			return nil, transient
		}
		return route, nil
	}, sort, func(err error, _ time.Duration) { warned = append(warned, err.Error()) })
	if err != nil || len(routes) != 1 || calls != 3 || len(warned) != 2 || warned[0] != "still down" {
		t.Fatalf("after two outages: routes %v, err %v, %d calls, warned %q", routes, err, calls, warned)
	}

	calls = 0
	routes, err = retryEnsure(t.Context(), cfg, time.Second, func(context.Context) ([]relay.Route, error) {
		calls++
		return nil, fatal
	}, sort, func(error, time.Duration) {})
	if routes != nil || !errors.Is(err, fatal) || !strings.HasPrefix(err.Error(), "fix it") || calls != 1 {
		t.Fatalf("permanent: routes %v, err %v, %d calls", routes, err, calls)
	}

	ctx, cancel := context.WithCancel(t.Context())
	routes, err = retryEnsure(ctx, cfg, time.Second, func(context.Context) ([]relay.Route, error) {
		cancel()
		return nil, transient
	}, sort, func(error, time.Duration) {})
	if routes != nil || err != nil {
		t.Fatalf("cancelled: routes %v, err %v; want neither", routes, err)
	}
}
