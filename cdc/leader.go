package cdc

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Leadership is a session-level advisory lock, derived from the slot name,
// held on a connection of its own. With several relays per database one
// holds it and streams; the others wait. When the holder dies its session
// ends, PostgreSQL releases the lock, and a waiting relay takes over.
// The slot itself admits one reader at a time, so the lock only coordinates:
// correctness does not depend on it.
type Leadership struct {
	conn     *pgx.Conn
	connMu   sync.Mutex // the watcher and Check share conn
	lost     chan struct{}
	lostOnce sync.Once
	stop     chan struct{}
	once     sync.Once
	stopped  sync.WaitGroup
}

// LockKeySQL is the advisory lock key expression for a slot.
const lockKeySQL = "hashtextextended('walbox:' || $1, 0)"

// AcquireLeadership blocks until this process holds the lock for slot, or ctx
// ends. waiting is called after every poll that finds another relay holding
// it (a standby's sign of life: it reached PostgreSQL and asked). A connection
// error that retrying cannot cure (no such database or role, a wrong
// password, no pg_hba.conf entry) is returned at once, with its fix; others
// (the network, a server starting) are passed to retrying, if set, and
// retried.
func AcquireLeadership(ctx context.Context, connString, slot string, poll time.Duration, waiting func(), retrying func(error)) (*Leadership, error) {
	var conn *pgx.Conn
	for {
		if conn == nil || conn.IsClosed() {
			c, err := pgx.Connect(ctx, connString)
			if err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				if perm := PermanentConnectError(err, connString); perm != nil {
					return nil, perm
				}
				if retrying != nil {
					retrying(err)
				}
				if !sleepCtx(ctx, poll) {
					return nil, ctx.Err()
				}
				continue
			}
			conn = c
		}
		var got bool
		if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock("+lockKeySQL+")", slot).Scan(&got); err != nil {
			conn.Close(context.WithoutCancel(ctx))
			conn = nil
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
		} else if got {
			l := &Leadership{conn: conn, lost: make(chan struct{}), stop: make(chan struct{})}
			l.stopped.Add(1)
			go l.watch(poll)
			return l, nil
		} else if waiting != nil {
			waiting()
		}
		if !sleepCtx(ctx, poll) {
			if conn != nil {
				conn.Close(context.WithoutCancel(ctx))
			}
			return nil, ctx.Err()
		}
	}
}

// PermanentConnectError turns a connection error that reconnecting cannot
// cure into a PreconditionError that names the fix; it returns nil for the
// others.
func PermanentConnectError(err error, connString string) error {
	user, db := "<role>", "<database>"
	if pc, perr := pgconn.ParseConfig(connString); perr == nil {
		user, db = pc.User, pc.Database
	}
	switch sqlState(err) {
	case stateInvalidCatalogName:
		return &PreconditionError{What: "the database in postgres.url does not exist", Fix: "check the database name in postgres.url (or WALBOX_POSTGRES_URL), or create it", Err: err}
	case stateInvalidAuthorization:
		if strings.Contains(err.Error(), "pg_hba.conf") {
			return &PreconditionError{What: "pg_hba.conf has no entry that lets walbox's role connect to this database",
				Fix: fmt.Sprintf("add a line for the database and walbox's role to pg_hba.conf, e.g. `host %s %s <walbox address>/32 scram-sha-256`, and reload PostgreSQL; it also covers walbox's logical replication connection, which is matched by database name (the keyword `replication` matches physical replication only)", db, user), Err: err}
		}
		return &PreconditionError{What: "the role in postgres.url may not log in (it does not exist, or lacks LOGIN)",
			Fix: "check the user in postgres.url, or create the role: `walbox migrate --print-grants` prints the recipe", Err: err}
	case stateInvalidPassword:
		return &PreconditionError{What: "password authentication failed", Fix: "check the user and password (postgres.url, postgres.password_file, PGPASSWORD or ~/.pgpass)", Err: err}
	}
	return nil
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// watch pings the lock's session; when it is gone, so is the lock.
func (l *Leadership) watch(poll time.Duration) {
	defer l.stopped.Done()
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), poll+5*time.Second)
		err := l.Check(ctx)
		cancel()
		if err != nil {
			return
		}
	}
}

// Check pings the lock's session now, and reports (and marks Lost) when it
// is gone. The source calls it before every replication session: after a
// failover the replication connection may reach the new primary before the
// watcher notices that the lock's session on the old one is gone, and a
// session started then (a slot recreated, a backfill begun) would be cut
// short by the lock's loss a moment later.
func (l *Leadership) Check(ctx context.Context) error {
	select {
	case <-l.lost:
		return errLeadershipLost
	default:
	}
	l.connMu.Lock()
	err := l.conn.Ping(ctx)
	l.connMu.Unlock()
	if err != nil {
		l.lostOnce.Do(func() { close(l.lost) })
		return fmt.Errorf("%w: %v", errLeadershipLost, err)
	}
	return nil
}

// errLeadershipLost: the leader lock's session is gone.
var errLeadershipLost = errors.New("the leader lock's session is gone; another walbox may lead")

// Lost is closed when the lock's session ended: stop streaming.
func (l *Leadership) Lost() <-chan struct{} { return l.lost }

// Release gives the lock up (closing its session).
func (l *Leadership) Release() {
	l.once.Do(func() {
		close(l.stop)
		l.stopped.Wait()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		l.connMu.Lock()
		_ = l.conn.Close(ctx) // the session's end releases the lock either way
		l.connMu.Unlock()
	})
}
