// Package pgtest starts throwaway PostgreSQL clusters from the locally
// installed server binaries, for tests of walbox's logical-replication code.
//
// The cluster itself lives in internal/pgcluster (the walbox binary uses it
// for `walbox dev` and must not link package testing); this package adds
// what tests need on top: Main (one cluster per test package) and NewDB (one
// database per test, dropped with its replication slots afterwards).
//
// A real server is used instead of mocks because the behaviour under test
// (replication slots, walsenders, WAL retention, crash recovery) only exists
// in a real postmaster. When the test binary runs as root the server runs as
// the "postgres" OS user; see pgcluster.
package pgtest

import (
	"context"
	"sync/atomic"

	"github.com/walbox/walbox/internal/pgcluster"
)

// dbPrefix marks databases created by NewDB.
const dbPrefix = "walbox_t_"

// Option configures Start (see pgcluster.Option).
type Option = pgcluster.Option

// WithSetting adds or overrides one postgresql.conf setting. Values are
// written quoted, so any GUC value (numbers, sizes, lists) can be passed as a
// plain string, e.g. WithSetting("wal_level", "replica").
func WithSetting(name, value string) Option { return pgcluster.WithSetting(name, value) }

// Cluster is one running (or stopped) PostgreSQL cluster owned by a test
// process: every pgcluster.Cluster method (URL, Port, Stop, StartAgain,
// Restart, Kill, Close, Exec, CreateDB, ...) plus NewDB. Its methods are safe
// for concurrent use.
type Cluster struct {
	*pgcluster.Cluster

	dbSeq atomic.Int64 // makes NewDB names unique
}

// Start creates, configures and starts a new cluster. The caller must Close
// it. ctx bounds the whole start-up (initdb and pg_ctl start).
func Start(ctx context.Context, opts ...Option) (*Cluster, error) {
	c, err := pgcluster.Start(ctx, opts...)
	if err != nil {
		return nil, err
	}
	return &Cluster{Cluster: c}, nil
}
