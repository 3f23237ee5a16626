// Package natsembed runs the real nats-server in-process, with JetStream
// enabled: for tests (through internal/natstest), which exercise the relay
// against genuine JetStream semantics (acks, dedup, file storage, RAFT leader
// elections) and inject faults by stopping and restarting servers or cluster
// nodes, and for `walbox dev`.
//
// The package keeps no package-level mutable state, so servers may run in
// parallel. It must not import "testing": the walbox binary links it.
package natsembed

import (
	"errors"
	"fmt"
	"iter"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/walbox/walbox/internal/ports"
)

const (
	// readyTimeout bounds how long a single server may take to open its
	// listeners; JetStream recovery of a small test store is far quicker.
	readyTimeout = 10 * time.Second
	// metaLeaderTimeout bounds the wait for the JetStream meta group of a
	// fresh cluster to elect a leader; elections take a few seconds.
	metaLeaderTimeout = 30 * time.Second
	// clusterName is shared by all nodes so that routes are accepted.
	clusterName = "walbox-test"
	// globalAccount is the account clients land in when no auth is set up.
	globalAccount = "$G"
)

// WithStoreDir keeps the JetStream store in dir (created if missing)
// instead of a fresh temporary directory. Close removes it; Stop keeps it.
func WithStoreDir(dir string) Option {
	return func(o *server.Options) { o.StoreDir = dir }
}

// Option adjusts the server options before a server is started, e.g. to set
// SyncInterval or MaxPayload for a specific fault scenario. Options run after
// natsembed's defaults, so they can override anything, and they are applied
// once: restarts reuse the resulting options unchanged.
type Option func(*server.Options)

// Server is one embedded nats-server with JetStream. It remembers its options
// (including its port and store directory) so that it can be stopped and
// restarted in place, which is what a crash/restart fault looks like to a
// client: same address, same persisted streams.
type Server struct {
	opts     *server.Options // template; cloned for every start
	storeDir string
	ports    *ports.Reservation // released by Close; nil for cluster nodes

	mu      sync.Mutex
	ns      *server.Server
	running bool
	closed  bool
}

// Start launches a standalone JetStream server on 127.0.0.1. The client port
// is reserved up front (rather than letting the server choose; see package
// ports) so that Restart can listen on the same address and reconnecting
// clients find it again. The
// JetStream store lives in a fresh temporary directory that survives Stop and
// Restart and is removed by Close.
func Start(opts ...Option) (*Server, error) {
	res, err := ports.Reserve(1)
	if err != nil {
		return nil, fmt.Errorf("natsembed: %w", err)
	}
	o := baseOptions(res.Ports[0])
	s, err := startServer(o, opts, res)
	if err != nil {
		res.Release()
	}
	return s, err
}

// baseOptions returns the defaults shared by standalone and cluster nodes.
func baseOptions(port int) *server.Options {
	return &server.Options{
		Host:      "127.0.0.1",
		Port:      port,
		JetStream: true,
		NoLog:     true,
		NoSigs:    true, // the test process owns signal handling
	}
}

// startServer creates the store dir, applies the caller's options and starts
// the first server instance.
func startServer(o *server.Options, opts []Option, res *ports.Reservation) (*Server, error) {
	dir, err := os.MkdirTemp("", "natstest-js-*")
	if err != nil {
		return nil, fmt.Errorf("natsembed: create store dir: %w", err)
	}
	o.StoreDir = dir
	for _, opt := range opts {
		if opt != nil {
			opt(o)
		}
	}
	if o.StoreDir != dir {
		// An option chose the store (WithStoreDir): drop the unused one.
		_ = os.Remove(dir)
	}
	s := &Server{opts: o, storeDir: o.StoreDir, ports: res}
	if err := s.Restart(); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// URL returns the client URL (nats://127.0.0.1:PORT). It stays valid across
// restarts because the port is fixed.
func (s *Server) URL() string {
	return fmt.Sprintf("nats://%s:%d", s.opts.Host, s.opts.Port)
}

// Port returns the fixed client port.
func (s *Server) Port() int { return s.opts.Port }

// StoreDir returns the JetStream store directory, e.g. for tests that want to
// corrupt or inspect files while the server is stopped.
func (s *Server) StoreDir() string { return s.storeDir }

// Stop shuts the server down and waits until it is fully gone, simulating a
// crash/stop of the broker. The store directory is kept so Restart can recover
// the streams. Calling Stop on a stopped server is a no-op.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopLocked()
}

func (s *Server) stopLocked() {
	if s.ns == nil || !s.running {
		return
	}
	s.ns.Shutdown()
	s.ns.WaitForShutdown()
	s.running = false
}

// Restart stops the server if it is running and starts a brand-new
// server.Server with the same options: same port, same store directory and,
// for cluster nodes, the same name and routes, so it recovers its streams
// and rejoins its cluster. A new instance is needed because a shut-down
// server.Server cannot be started again.
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errors.New("natsembed: server is closed")
	}
	s.stopLocked()

	// NewServer fills in defaults on the options it is given; clone so that
	// every instance starts from the same template and instances never share
	// mutable option state.
	ns, err := server.NewServer(s.opts.Clone())
	if err != nil {
		return fmt.Errorf("natsembed: new server: %w", err)
	}
	// Start runs in the background like the server tests do: for cluster
	// nodes JetStream setup can wait on peers, and all nodes of a cluster
	// must be starting at the same time for that to complete.
	go ns.Start()
	if !ns.ReadyForConnections(readyTimeout) {
		ns.Shutdown()
		ns.WaitForShutdown()
		return fmt.Errorf("natsembed: server on port %d not ready within %s%s", s.opts.Port, readyTimeout,
			portsTaken(s.opts.Port, s.opts.Cluster.Port))
	}
	s.ns = ns
	s.running = true
	return nil
}

// Running reports whether the server is currently up (started and neither
// stopped by us nor shut down on its own).
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.running && s.ns != nil && s.ns.Running()
}

// Close stops the server and deletes its store directory. It is idempotent so
// it can be used both explicitly and as a t.Cleanup.
func (s *Server) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopLocked()
	if s.closed {
		return
	}
	s.closed = true
	_ = os.RemoveAll(s.storeDir)
	s.ports.Release()
}

// NS returns the current underlying server.Server, for assertions that need
// server internals (e.g. JetStreamIsStreamLeader). It changes on Restart, so
// do not hold on to it across restarts. It is nil only if the first start
// failed.
func (s *Server) NS() *server.Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ns
}

// Cluster is a JetStream cluster of embedded servers connected by explicit
// routes, for tests that need replicated streams and leader elections.
type Cluster struct {
	// Servers are the nodes; index i has server_name "n<i+1>". Individual
	// nodes can be stopped and restarted and will rejoin the cluster.
	Servers []*Server
	ports   *ports.Reservation // client and route ports of all nodes, released by Close
}

// StartCluster starts n JetStream nodes (3 is typical: the smallest size
// that survives losing one node) and waits until the JetStream meta group has
// elected a leader that knows all n peers, so that creating a stream with up
// to n replicas works right away. All client and
// cluster ports are reserved up front so every node can list every other node
// as an explicit route; explicit routes are retried forever, which is what
// lets a restarted node rejoin.
func StartCluster(n int, opts ...Option) (*Cluster, error) {
	if n < 1 {
		return nil, fmt.Errorf("natsembed: cluster size must be >= 1, got %d", n)
	}
	res, err := ports.Reserve(2 * n)
	if err != nil {
		return nil, fmt.Errorf("natsembed: %w", err)
	}
	clientPorts, routePorts := res.Ports[:n], res.Ports[n:]

	c := &Cluster{Servers: make([]*Server, n), ports: res}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		o := baseOptions(clientPorts[i])
		o.ServerName = fmt.Sprintf("n%d", i+1)
		o.Cluster = server.ClusterOpts{
			Name: clusterName,
			Host: "127.0.0.1",
			Port: routePorts[i],
		}
		var routes []string
		for j := range n {
			if j != i {
				routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", routePorts[j]))
			}
		}
		o.Routes = server.RoutesFromStr(strings.Join(routes, ","))
		// Start nodes concurrently: clustered JetStream startup makes
		// progress only once peers are reachable.
		wg.Go(func() {
			c.Servers[i], errs[i] = startServer(o, opts, nil)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		c.Close()
		return nil, err
	}
	if err := c.waitMetaLeader(metaLeaderTimeout); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// waitMetaLeader polls until some node is the JetStream meta leader, that
// leader sees every node as an online JetStream peer with current stats, and
// every node considers itself current with the meta group. A leader alone is
// not enough: until it has received stats from all peers, creating an R3
// stream fails with "no suitable peers for placement".
func (c *Cluster) waitMetaLeader(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var leader *server.Server
		current := true
		for _, s := range c.Servers {
			ns := s.NS()
			if ns == nil || !ns.JetStreamEnabled() {
				current = false
				continue
			}
			if ns.JetStreamIsLeader() {
				leader = ns
			}
			if !ns.JetStreamIsCurrent() {
				current = false
			}
		}
		if leader != nil && current && len(leader.JetStreamClusterPeers()) == len(c.Servers) {
			return nil
		}
		if time.Now().After(deadline) {
			if leader == nil {
				return fmt.Errorf("natsembed: no JetStream meta leader within %s", timeout)
			}
			return fmt.Errorf("natsembed: JetStream meta leader %s sees %d of %d peers (all current: %v) after %s",
				leader.Name(), len(leader.JetStreamClusterPeers()), len(c.Servers), current, timeout)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// URLs returns the comma-separated client URLs of all nodes, the form
// nats.Connect accepts, so clients can fail over between nodes.
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.Servers))
	for i, s := range c.Servers {
		urls[i] = s.URL()
	}
	return strings.Join(urls, ",")
}

// StreamLeader returns the index in Servers of the node currently leading
// the given stream, or -1 if no running node is leader (e.g. mid-election).
// Tests use it to stop exactly the leader. An empty account means the
// global account "$G", where clients without auth live.
func (c *Cluster) StreamLeader(account, stream string) int {
	for i, ns := range c.running() {
		if ns.JetStreamIsStreamLeader(orGlobal(account), stream) {
			return i
		}
	}
	return -1
}

// Reachable reports whether every running node has interest in subject,
// that is whether a publish to subject reaches a subscriber (a stream's
// leader) from whichever node a client is connected to. A stream leader
// subscribes to its subjects when elected, and the other nodes learn of it
// over the routes a moment later; until then a publish through them gets
// "no responders". An empty account means "$G".
func (c *Cluster) Reachable(account, subject string) bool {
	for _, ns := range c.running() {
		acc, err := ns.LookupAccount(orGlobal(account))
		if err != nil || acc.Interest(subject) == 0 {
			return false
		}
	}
	return true
}

// running yields the index and server of every node that is up.
func (c *Cluster) running() iter.Seq2[int, *server.Server] {
	return func(yield func(int, *server.Server) bool) {
		for i, s := range c.Servers {
			if !s.Running() {
				continue
			}
			if ns := s.NS(); ns != nil && !yield(i, ns) {
				return
			}
		}
	}
}

func orGlobal(account string) string {
	if account == "" {
		return globalAccount
	}
	return account
}

// Close stops all nodes and removes their store directories. It is
// idempotent and tolerates nodes that failed to start.
func (c *Cluster) Close() {
	var wg sync.WaitGroup
	for _, s := range c.Servers {
		if s != nil {
			wg.Go(s.Close)
		}
	}
	wg.Wait()
	c.ports.Release()
}

// portsTaken says which of the ports something else listens on now, for the
// error of a server that could not open its listeners.
func portsTaken(ps ...int) string {
	var taken []string
	for _, p := range ps {
		if p <= 0 {
			continue
		}
		if err := ports.Listenable(p); err != nil {
			taken = append(taken, err.Error())
		}
	}
	if len(taken) == 0 {
		return ""
	}
	return " (" + strings.Join(taken, "; ") + ")"
}
