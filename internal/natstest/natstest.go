// Package natstest runs the real nats-server in-process, with JetStream
// enabled, so that tests can exercise the relay against genuine JetStream
// semantics (acks, dedup, file storage, RAFT leader elections) and inject
// faults by stopping and restarting servers or cluster nodes.
//
// Using the embedded server instead of a mock matters for fault tests: the
// interesting failures (lost acks on restart, leader changes mid-publish,
// client reconnects) only appear with the real storage and clustering code.
//
// The servers live in internal/natsembed (the walbox binary uses it for
// `walbox dev` and must not link package testing); this package adds the
// test-friendly constructors New and NewCluster.
//
// The package keeps no package-level mutable state, so tests using it may run
// in parallel.
package natstest

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natsembed"
)

// Option adjusts the server options before a server is started, e.g. to set
// SyncInterval or MaxPayload for a specific fault scenario (see
// natsembed.Option).
type Option = natsembed.Option

// Server is one embedded nats-server with JetStream, restartable in place
// (see natsembed.Server).
type Server = natsembed.Server

// Cluster is a JetStream cluster of embedded servers (see natsembed.Cluster).
type Cluster = natsembed.Cluster

// Start launches a standalone JetStream server on 127.0.0.1 with its store
// in a fresh temporary directory (see natsembed.Start).
func Start(opts ...Option) (*Server, error) { return natsembed.Start(opts...) }

// StartCluster starts n JetStream nodes and waits until the JetStream meta
// group has elected a leader that knows all n peers (see
// natsembed.StartCluster).
func StartCluster(n int, opts ...Option) (*Cluster, error) { return natsembed.StartCluster(n, opts...) }

// New is the test-friendly form of Start: it fails the test on error and
// registers Close as cleanup so that no server or temp directory leaks.
func New(t testing.TB, opts ...Option) *Server {
	t.Helper()
	s, err := Start(opts...)
	if err != nil {
		t.Fatalf("natstest: start server: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

// NewCluster is the test-friendly form of StartCluster: it fails the test on
// error and registers Close as cleanup.
func NewCluster(t testing.TB, n int, opts ...Option) *Cluster {
	t.Helper()
	c, err := StartCluster(n, opts...)
	if err != nil {
		t.Fatalf("natstest: start cluster: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// WaitStreamReady waits until stream on cl has a leader and every replica
// current, and every node routes subject to it. CreateStream returns once
// the meta group placed the stream: its own group may not have elected a
// leader yet, and the leader's subscription reaches the other nodes over
// the routes a moment after the election; a publish before either gets "no
// response from stream".
func WaitStreamReady(t testing.TB, cl *Cluster, js jetstream.JetStream, stream, subject string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		if streamReady(ctx, js, stream) && cl.Reachable("", subject) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("stream %s: no leader with current replicas routed from every node within 30 s", stream)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func streamReady(ctx context.Context, js jetstream.JetStream, stream string) bool {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return false
	}
	info, err := st.Info(ctx)
	if err != nil || info.Cluster == nil || info.Cluster.Leader == "" || len(info.Cluster.Replicas) != info.Config.Replicas-1 {
		return false
	}
	for _, r := range info.Cluster.Replicas {
		if !r.Current {
			return false
		}
	}
	return true
}
