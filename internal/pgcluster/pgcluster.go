// Package pgcluster starts throwaway PostgreSQL clusters from the locally
// installed server binaries: for tests of walbox's logical-replication code
// (through internal/pgtest) and for `walbox dev`.
//
// A real server is used instead of mocks because the behaviour under test
// (replication slots, walsenders, WAL retention, crash recovery) only exists
// in a real postmaster. Each cluster gets its own data directory and TCP port,
// is configured with wal_level=logical, and is torn down by Close.
//
// The package works when the process runs as root (as it does in CI
// containers): PostgreSQL refuses to run as root, so the server programs are
// then run as the "postgres" OS user, and the data directory must be in a
// folder that user can reach (t.TempDir's parents are only accessible to
// root; by default a fresh directory under os.TempDir, else /tmp, is used).
//
// This package must not import "testing": the walbox binary links it.
package pgcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/ports"
)

const (
	// InstallHint says how to get the server binaries. It ends the
	// message of a NotFoundError, so the reader knows the fix without
	// reading this package.
	InstallHint = "install the PostgreSQL server binaries: Debian/Ubuntu: apt-get install postgresql; " +
		"Homebrew: brew install postgresql@17"

	// pgCtlTimeoutSeconds bounds every pg_ctl -w wait; crash recovery after
	// Kill on a small cluster takes well under this.
	pgCtlTimeoutSeconds = "60"

	// logTailBytes is how much of the server log is quoted in start errors.
	logTailBytes = 4096

	// MaxIdentLen is PostgreSQL's NAMEDATALEN-1; longer identifiers (such
	// as database names) are silently truncated by the server.
	MaxIdentLen = 63
)

// NotFoundError reports that no usable PostgreSQL server binaries (initdb,
// pg_ctl, postgres) were found. Searched lists the places looked at.
type NotFoundError struct {
	Searched []string
}

func (e *NotFoundError) Error() string {
	return fmt.Sprintf("pgcluster: PostgreSQL server binaries (initdb, pg_ctl, postgres) not found (searched %s); %s",
		strings.Join(e.Searched, ", "), InstallHint)
}

// BinSearch says where Start looks for the server binaries, in this order:
// the bindir reported by PGConfig, the directories matching Globs (highest
// version first), then the directory of initdb on Path.
type BinSearch struct {
	// Dir, when set, is the only place looked at (WALBOX_PG_BINDIR): a test
	// run against one PostgreSQL major must not fall back to another.
	Dir string
	// PGConfig is the pg_config program asked for --bindir; "" skips it.
	// pg_config may belong to a libpq-dev of another version than the
	// server, so its bindir is used only if it holds the server programs.
	PGConfig string
	// Globs are directory patterns for filepath.Glob. The version is read
	// from the parent folder's name ("17", "postgresql@17", "pgsql-16").
	Globs []string
	// Path is a PATH-style list searched for initdb; "" skips it.
	Path string
}

// DefaultBinSearch takes WALBOX_PG_BINDIR when it is set; otherwise it covers Debian/Ubuntu (/usr/lib/postgresql/N/bin, not on
// PATH), RHEL (/usr/pgsql-N/bin), Homebrew (keg-only postgresql@N) and
// anything on PATH.
func DefaultBinSearch() BinSearch {
	return BinSearch{
		Dir:      os.Getenv("WALBOX_PG_BINDIR"),
		PGConfig: "pg_config",
		Globs: []string{
			"/usr/lib/postgresql/*/bin",
			"/usr/pgsql-*/bin",
			"/opt/homebrew/opt/postgresql@*/bin",
			"/usr/local/opt/postgresql@*/bin",
		},
		Path: os.Getenv("PATH"),
	}
}

// Option configures Start. Options exist so a caller can deviate from the
// logical-replication defaults (e.g. to check how walbox reacts to a server
// with wal_level=replica) without this package growing a knob per setting.
type Option func(*options)

type options struct {
	settings map[string]string
	baseDir  string
	search   *BinSearch
}

// WithSetting adds or overrides one postgresql.conf setting. Values are
// written quoted, so any GUC value (numbers, sizes, lists) can be passed as a
// plain string, e.g. WithSetting("wal_level", "replica").
func WithSetting(name, value string) Option {
	return func(o *options) {
		if o.settings == nil {
			o.settings = make(map[string]string)
		}
		o.settings[name] = value
	}
}

// WithBaseDir puts the cluster's files (the data directory "data" and its
// server log) in dir instead of a fresh temporary directory. dir must not
// exist yet, or be empty; Close removes it. When running as root, the
// "postgres" user must be able to traverse every folder above dir (see
// CheckReachable).
func WithBaseDir(dir string) Option {
	return func(o *options) { o.baseDir = dir }
}

// WithBinSearch replaces DefaultBinSearch, e.g. to pin a PostgreSQL version
// or to test what happens when no binaries are installed.
func WithBinSearch(s BinSearch) Option {
	return func(o *options) { o.search = &s }
}

// defaultSettings are appended to postgresql.conf. They make the cluster
// usable for logical replication and fast to throw away (no fsync), and keep
// slots from being invalidated by WAL size limits. Order is kept for a
// readable config file.
func defaultSettings(port int, dataDir string) [][2]string {
	return [][2]string{
		{"listen_addresses", "127.0.0.1"},
		{"port", strconv.Itoa(port)},
		{"unix_socket_directories", dataDir},
		{"wal_level", "logical"},
		{"max_replication_slots", "32"},
		{"max_wal_senders", "32"},
		{"fsync", "off"},
		{"synchronous_commit", "off"},
		{"full_page_writes", "off"},
		{"wal_sender_timeout", "60s"},
		{"max_connections", "200"},
		{"shared_buffers", "128MB"},
		{"logging_collector", "off"},
		{"log_min_messages", "warning"},
		{"max_slot_wal_keep_size", "-1"},
	}
}

// pgHBA trusts every local and loopback connection, including replication
// connections, because the cluster only lives for the duration of a test.
const pgHBA = `# written by walbox internal/pgcluster
local   all          all                  trust
local   replication  all                  trust
host    all          all    127.0.0.1/32  trust
host    all          all    ::1/128       trust
host    replication  all    127.0.0.1/32  trust
host    replication  all    ::1/128       trust
`

// Cluster is one running (or stopped) PostgreSQL cluster owned by this
// process. Its methods are safe for concurrent use; lifecycle operations
// (Stop, StartAgain, Restart, Kill, Close) are serialized.
type Cluster struct {
	binDir  string
	baseDir string // removed by Close; parent of dataDir
	dataDir string
	port    int
	ports   *ports.Reservation  // holds port until Close (see package ports)
	cred    *syscall.Credential // nil when not running as root

	mu     sync.Mutex
	closed bool
}

// Start creates, configures and starts a new cluster. The caller must Close
// it. ctx bounds the whole start-up (initdb and pg_ctl start). When no
// server binaries are found the error is a *NotFoundError.
func Start(ctx context.Context, opts ...Option) (*Cluster, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	search := DefaultBinSearch()
	if o.search != nil {
		search = *o.search
	}

	binDir, err := FindBinDir(search)
	if err != nil {
		return nil, err
	}

	cred, err := serverCredential()
	if err != nil {
		return nil, err
	}

	baseDir, err := makeBaseDir(o.baseDir, cred != nil)
	if err != nil {
		return nil, err
	}
	c := &Cluster{
		binDir:  binDir,
		baseDir: baseDir,
		dataDir: filepath.Join(baseDir, "data"),
		cred:    cred,
	}
	// From here on, failures must remove baseDir (and stop a half-started
	// server), which Close does.
	fail := func(err error) (*Cluster, error) {
		_ = c.Close()
		return nil, err
	}

	// The server user must be able to enter and write the base dir; initdb
	// creates the data dir itself (with the 0700 mode the server insists on).
	if err := c.prepareDir(baseDir); err != nil {
		return fail(err)
	}

	if err := c.reservePort(); err != nil {
		return fail(err)
	}

	if out, err := c.run(ctx, "initdb",
		"-D", c.dataDir,
		"-A", "trust",
		"-U", "postgres",
		"--no-sync",
		"-E", "UTF8",
		"--locale=C",
	); err != nil {
		return fail(fmt.Errorf("pgcluster: initdb: %w\n%s", err, out))
	}

	if err := c.writeConfig(o.settings); err != nil {
		return fail(err)
	}

	if err := c.start(ctx); err != nil {
		return fail(err)
	}
	return c, nil
}

// makeBaseDir creates the folder for the cluster's files: dir if given (it
// may exist if empty), else a fresh temporary one the server user can reach.
func makeBaseDir(dir string, otherUser bool) (string, error) {
	if dir == "" {
		d, err := os.MkdirTemp(tempRoot(otherUser), "walbox-pg-*")
		if err != nil {
			return "", fmt.Errorf("pgcluster: create temp dir: %w", err)
		}
		return d, nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("pgcluster: base dir %s: %w", dir, err)
	}
	if otherUser {
		if err := CheckReachable(filepath.Dir(abs)); err != nil {
			return "", err
		}
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return "", fmt.Errorf("pgcluster: create base dir: %w", err)
	}
	entries, err := os.ReadDir(abs)
	if err != nil {
		return "", fmt.Errorf("pgcluster: read base dir: %w", err)
	}
	if len(entries) > 0 {
		return "", fmt.Errorf("pgcluster: base dir %s is not empty; remove it or choose another", abs)
	}
	return abs, nil
}

// CheckReachable reports whether the server, which runs as the "postgres"
// OS user when this process is root, can traverse every folder from / down
// to dir. It always succeeds when not running as root. It looks at the
// "other" execute bit only, which is what matters for a root-owned tree.
func CheckReachable(dir string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("pgcluster: %s: %w", dir, err)
	}
	for d := abs; ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err == nil && st.Mode().Perm()&0o001 == 0 && !ownedByServerUser(st) {
			return fmt.Errorf("pgcluster: the postgres user cannot reach %s: %s is not traversable by others (chmod o+x it, or use a folder under /tmp)", abs, d)
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}

func ownedByServerUser(st os.FileInfo) bool {
	cred, err := serverCredential()
	if err != nil || cred == nil {
		return false
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	return ok && sys.Uid == cred.Uid
}

// Port is the TCP port the server listens on at 127.0.0.1.
func (c *Cluster) Port() int { return c.port }

// DataDir is the cluster's data directory (PGDATA). It also holds the Unix
// socket and the server log file "logfile".
func (c *Cluster) DataDir() string { return c.dataDir }

// BinDir is the directory of the PostgreSQL server binaries in use, so tests
// can run other tools (pg_dump, pg_waldump, ...) of the same version.
func (c *Cluster) BinDir() string { return c.binDir }

// URL returns a connection URL for database dbname as the superuser
// "postgres" over TCP without TLS.
func (c *Cluster) URL(dbname string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User("postgres"),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(c.port)),
		Path:     "/" + dbname,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// Stop shuts the server down with the "fast" mode (active sessions are
// disconnected, a shutdown checkpoint is written) and keeps the data, so a
// test can observe walbox's behaviour while the source is down and then call
// StartAgain.
func (c *Cluster) Stop(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed
	}
	if out, err := c.run(ctx, "pg_ctl", "-D", c.dataDir, "stop", "-m", "fast", "-w", "-t", pgCtlTimeoutSeconds); err != nil {
		return fmt.Errorf("pgcluster: pg_ctl stop: %w\n%s", err, out)
	}
	return nil
}

// StartAgain starts the server after Stop or Kill on the same port with the
// same data; after Kill the server performs crash recovery.
func (c *Cluster) StartAgain(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed
	}
	return c.start(ctx)
}

// Restart stops (fast) and starts the server in one step, e.g. to apply a
// changed setting or to force walbox to reconnect.
func (c *Cluster) Restart(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed
	}
	out, err := c.run(ctx, "pg_ctl", "-D", c.dataDir, "-l", c.logFile(),
		"restart", "-m", "fast", "-w", "-t", pgCtlTimeoutSeconds)
	if err != nil {
		return fmt.Errorf("pgcluster: pg_ctl restart: %w\n%s\n--- server log tail ---\n%s", err, out, c.logTail())
	}
	return nil
}

// Kill simulates a server crash: it SIGKILLs the postmaster and all its
// child processes, without a shutdown checkpoint, and waits until they are
// gone. Afterwards StartAgain brings the cluster back through crash recovery.
//
// All children are killed, not just the postmaster, because a new postmaster
// refuses to start while old backends still hold the shared memory segment.
//
// Like a real crash, Kill loses commits whose WAL was not written yet: with
// the default synchronous_commit=off that is up to ~0.6 s of commits. Tests
// that need a commit to survive should run it with
// "SET synchronous_commit = on" (or WithSetting("synchronous_commit", "on")).
// Nothing is fsynced (fsync=off), which is fine because the OS survives.
func (c *Cluster) Kill() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed
	}
	pid, err := c.postmasterPID()
	if err != nil {
		return err
	}
	if !processAlive(pid) {
		return fmt.Errorf("pgcluster: postmaster (pid %d) is not running", pid)
	}
	return c.killTree(pid)
}

// Close stops the server immediately (no checkpoint) and removes all its
// files. It is safe to call more than once and after Stop or Kill.
func (c *Cluster) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true

	var errs []error
	if pid, err := c.postmasterPID(); err == nil && processAlive(pid) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_, stopErr := c.run(ctx, "pg_ctl", "-D", c.dataDir, "stop", "-m", "immediate", "-w", "-t", pgCtlTimeoutSeconds)
		cancel()
		if stopErr != nil || processAlive(pid) {
			// Don't leave a server running over a deleted directory.
			if err := c.killTree(pid); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := os.RemoveAll(c.baseDir); err != nil {
		errs = append(errs, fmt.Errorf("pgcluster: remove %s: %w", c.baseDir, err))
	}
	c.ports.Release()
	return errors.Join(errs...)
}

// reservePort picks the server's port and holds it until Close, also while
// the server is stopped to be started again on it.
func (c *Cluster) reservePort() error {
	res, err := ports.Reserve(1)
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	c.ports = res
	c.port = res.Ports[0]
	return nil
}

// Exec runs one SQL statement in database dbname on a fresh connection. It
// is meant for test setup, where a pool is not worth the bother.
func (c *Cluster) Exec(ctx context.Context, dbname, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, c.URL(dbname))
	if err != nil {
		return fmt.Errorf("pgcluster: connect to %q: %w", dbname, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		return fmt.Errorf("pgcluster: exec in %q: %w", dbname, err)
	}
	return nil
}

// CreateDB creates database name and returns its URL.
//
// On PostgreSQL 15 and later it copies the template's files (STRATEGY
// FILE_COPY, PostgreSQL 14's only way) rather than writing the template
// into the WAL (WAL_LOG, 15's default): that is about 4 MB of WAL a
// database, which every logical walsender of the cluster then reads, and a
// test suite creates a few hundred databases in clusters where relays
// stream.
func (c *Cluster) CreateDB(ctx context.Context, name string) (string, error) {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return "", fmt.Errorf("pgcluster: connect to create database %q: %w", name, err)
	}
	defer conn.Close(context.Background())
	sql := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	var num string
	if err := conn.QueryRow(ctx, "SHOW server_version_num").Scan(&num); err != nil {
		return "", fmt.Errorf("pgcluster: read the server version to create database %q: %w", name, err)
	}
	if v, err := strconv.Atoi(num); err == nil && v >= 150000 {
		sql += " STRATEGY = FILE_COPY"
	}
	if _, err := conn.Exec(ctx, sql); err != nil {
		return "", fmt.Errorf("pgcluster: create database %q: %w", name, err)
	}
	return c.URL(name), nil
}

var errClosed = errors.New("pgcluster: cluster is closed")

// start runs pg_ctl start; the caller holds c.mu or owns c exclusively.
func (c *Cluster) start(ctx context.Context) error {
	out, err := c.run(ctx, "pg_ctl", "-D", c.dataDir, "-l", c.logFile(), "-w", "-t", pgCtlTimeoutSeconds, "start")
	if err != nil {
		return fmt.Errorf("pgcluster: pg_ctl start (port %d): %w\n%s\n--- server log tail ---\n%s", c.port, err, out, c.logTail())
	}
	return nil
}

func (c *Cluster) logFile() string { return filepath.Join(c.dataDir, "logfile") }

// logTail returns the end of the server log, which is where the reason for
// a failed start is; pg_ctl itself only says "could not start server".
func (c *Cluster) logTail() string {
	f, err := os.Open(c.logFile())
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	off := st.Size() - logTailBytes
	if off < 0 {
		off = 0
	}
	buf := make([]byte, st.Size()-off)
	n, _ := f.ReadAt(buf, off)
	return string(buf[:n])
}

// run executes a PostgreSQL program from binDir as the server user and
// returns its combined output.
func (c *Cluster) run(ctx context.Context, prog string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(c.binDir, prog), args...)
	// The working directory must be accessible to the server user, and the
	// test's cwd (often under /root) may not be.
	cmd.Dir = c.baseDir
	cmd.Env = serverEnv()
	if c.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	// pg_ctl's children redirect their output to the log file, but if one
	// ever held our pipe open, don't hang the test on it.
	cmd.WaitDelay = 5 * time.Second
	err := cmd.Run()
	return out.Bytes(), err
}

// serverEnv is the environment for server programs: the caller's, minus PG*
// variables (PGDATA, PGPORT, PGOPTIONS... would change what pg_ctl does),
// with the C locale so messages in errors and logs are predictable.
func serverEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PG") || strings.HasPrefix(kv, "LC_") || strings.HasPrefix(kv, "LANG=") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "LANG=C", "LC_ALL=C")
}

// prepareDir makes dir traversable by everyone and, when running as root,
// owned by the server user, so initdb (running as that user) can create the
// data directory in it.
func (c *Cluster) prepareDir(dir string) error {
	if err := os.Chmod(dir, 0o755); err != nil {
		return fmt.Errorf("pgcluster: chmod %s: %w", dir, err)
	}
	if c.cred != nil {
		if err := os.Chown(dir, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			return fmt.Errorf("pgcluster: chown %s: %w", dir, err)
		}
	}
	return nil
}

// writeConfig appends the settings to postgresql.conf (later lines win, so
// the defaults initdb wrote are overridden) and replaces pg_hba.conf. The
// files already belong to the server user, and writing to them as root keeps
// that ownership.
func (c *Cluster) writeConfig(extra map[string]string) error {
	settings := defaultSettings(c.port, c.dataDir)
	seen := make(map[string]bool, len(extra))
	for i, kv := range settings {
		if v, ok := extra[kv[0]]; ok {
			settings[i][1] = v
			seen[kv[0]] = true
		}
	}
	var names []string
	for name := range extra {
		if !seen[name] {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		settings = append(settings, [2]string{name, extra[name]})
	}

	var b strings.Builder
	b.WriteString("\n# written by walbox internal/pgcluster\n")
	for _, kv := range settings {
		fmt.Fprintf(&b, "%s = '%s'\n", kv[0], strings.ReplaceAll(kv[1], "'", "''"))
	}
	conf := filepath.Join(c.dataDir, "postgresql.conf")
	f, err := os.OpenFile(conf, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("pgcluster: open %s: %w", conf, err)
	}
	if _, err := f.WriteString(b.String()); err != nil {
		f.Close()
		return fmt.Errorf("pgcluster: write %s: %w", conf, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("pgcluster: write %s: %w", conf, err)
	}

	hba := filepath.Join(c.dataDir, "pg_hba.conf")
	if err := os.WriteFile(hba, []byte(pgHBA), 0o600); err != nil {
		return fmt.Errorf("pgcluster: write %s: %w", hba, err)
	}
	return nil
}

// postmasterPID reads the postmaster's pid from the first line of
// postmaster.pid.
func (c *Cluster) postmasterPID() (int, error) {
	b, err := os.ReadFile(filepath.Join(c.dataDir, "postmaster.pid"))
	if err != nil {
		return 0, fmt.Errorf("pgcluster: server not running: %w", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("pgcluster: bad postmaster.pid first line %q", line)
	}
	return pid, nil
}

// killTree SIGKILLs the postmaster and then its children and waits until
// all are dead. The postmaster goes first so it cannot respawn children.
//
// Once everything is dead it removes the lock files (postmaster.pid and the
// socket's .lock): the postmaster was started by pg_ctl and reparented to
// PID 1, and in containers whose init does not reap, the dead postmaster
// stays a zombie; kill(pid, 0) succeeds on zombies, so a new postmaster
// would take the stale lock files as held by a live server and refuse to
// start.
func (c *Cluster) killTree(pid int) error {
	children := childPIDs(pid)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("pgcluster: kill postmaster %d: %w", pid, err)
	}
	for _, child := range children {
		_ = syscall.Kill(child, syscall.SIGKILL)
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, p := range append([]int{pid}, children...) {
		for processAlive(p) {
			if time.Now().After(deadline) {
				return fmt.Errorf("pgcluster: process %d still alive after SIGKILL", p)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	// The socket lock file holds the same pid and is checked the same way.
	locks := []string{filepath.Join(c.dataDir, ".s.PGSQL."+strconv.Itoa(c.port)+".lock")}
	if cur, err := c.postmasterPID(); err == nil && cur == pid {
		locks = append(locks, filepath.Join(c.dataDir, "postmaster.pid"))
	}
	for _, f := range locks {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("pgcluster: remove stale lock file: %w", err)
		}
	}
	return nil
}

// childPIDs lists the direct children of ppid from /proc. Without /proc
// (non-Linux) it returns nil and only the postmaster is killed.
func childPIDs(ppid int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		_, parent, ok := procStat(pid)
		if ok && parent == ppid {
			pids = append(pids, pid)
		}
	}
	return pids
}

// procStat returns the state letter and parent pid of pid from
// /proc/<pid>/stat.
func procStat(pid int) (state byte, ppid int, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// Format: pid (comm) state ppid ...; comm may contain spaces and ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 2 || len(fields[0]) != 1 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(fields[1])
	if err != nil {
		return 0, 0, false
	}
	return fields[0][0], ppid, true
}

// processAlive reports whether pid is a running (not zombie) process.
func processAlive(pid int) bool {
	if state, _, ok := procStat(pid); ok {
		return state != 'Z' && state != 'X'
	}
	if _, err := os.Stat("/proc/self/stat"); err == nil {
		return false // /proc works and pid is not in it
	}
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// FindBinDir locates the directory holding initdb, pg_ctl and postgres,
// searching as s says. It returns a *NotFoundError if none has them.
func FindBinDir(s BinSearch) (string, error) {
	var searched []string
	if s.Dir != "" {
		if hasServerBinaries(s.Dir) {
			return s.Dir, nil
		}
		return "", &NotFoundError{Searched: []string{s.Dir + " (WALBOX_PG_BINDIR)"}}
	}
	if s.PGConfig != "" {
		searched = append(searched, s.PGConfig+" --bindir")
		if out, err := exec.Command(s.PGConfig, "--bindir").Output(); err == nil {
			dir := strings.TrimSpace(string(out))
			if hasServerBinaries(dir) {
				return dir, nil
			}
		}
	}
	var matches []string
	for _, g := range s.Globs {
		searched = append(searched, g)
		m, _ := filepath.Glob(g)
		matches = append(matches, m...)
	}
	sort.SliceStable(matches, func(i, j int) bool {
		return versionLess(dirVersion(matches[j]), dirVersion(matches[i]))
	})
	for _, dir := range matches {
		if hasServerBinaries(dir) {
			return dir, nil
		}
	}
	if s.Path != "" {
		searched = append(searched, "initdb on PATH")
		for _, dir := range filepath.SplitList(s.Path) {
			if dir != "" && hasServerBinaries(dir) {
				return dir, nil
			}
		}
	}
	return "", &NotFoundError{Searched: searched}
}

// dirVersion reads the version from a bin folder's parent: "17" from
// /usr/lib/postgresql/17/bin, /usr/pgsql-17/bin or .../postgresql@17/bin.
func dirVersion(binDir string) string {
	name := filepath.Base(filepath.Dir(binDir))
	if i := strings.LastIndexAny(name, "@-"); i >= 0 {
		name = name[i+1:]
	}
	return name
}

func hasServerBinaries(dir string) bool {
	for _, prog := range []string{"initdb", "pg_ctl", "postgres"} {
		st, err := os.Stat(filepath.Join(dir, prog))
		if err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// versionLess compares directory names like "9.6", "15", "17" numerically.
func versionLess(a, b string) bool {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) && i < len(bs); i++ {
		x, errX := strconv.Atoi(as[i])
		y, errY := strconv.Atoi(bs[i])
		if errX != nil || errY != nil {
			if as[i] != bs[i] {
				return as[i] < bs[i]
			}
			continue
		}
		if x != y {
			return x < y
		}
	}
	return len(as) < len(bs)
}

// serverCredential returns the uid/gid of the "postgres" OS user when
// running as root (the server refuses to run as root), or nil otherwise.
func serverCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: running as root needs a \"postgres\" OS user to run the server as: %w; %s", err, InstallHint)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: postgres uid %q: %w", u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: postgres gid %q: %w", u.Gid, err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// tempRoot is os.TempDir(), unless the server runs as another user and
// cannot traverse it (e.g. TMPDIR under /root); then /tmp.
func tempRoot(otherUser bool) string {
	dir := os.TempDir()
	if !otherUser {
		return dir
	}
	for d := dir; ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err != nil || st.Mode().Perm()&0o001 == 0 {
			return "/tmp"
		}
		if d == filepath.Dir(d) {
			return dir
		}
	}
}
