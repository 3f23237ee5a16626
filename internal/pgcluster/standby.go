package pgcluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// StandbyOptions shape a standby.
type StandbyOptions struct {
	// ApplicationName names the standby to the primary
	// (synchronous_standby_names).
	ApplicationName string
	// DBName goes into primary_conninfo; slot synchronization (17+) needs it.
	DBName string
	// PrimarySlot is a physical slot on the primary the standby streams
	// from (primary_slot_name); the caller creates it.
	PrimarySlot string
	// Settings are written to the standby's configuration.
	Settings map[string]string
}

// Standby makes a streaming standby of c by a cold copy: it stops c (a fast
// shutdown leaves consistent data), copies its data directory into a new
// cluster on its own port, starts c again, and starts the copy with
// standby.signal and primary_conninfo. The caller must Close the standby.
// Cold copies need no pg_basebackup, which not every set of server binaries
// ships.
func (c *Cluster) Standby(ctx context.Context, o StandbyOptions) (*Cluster, error) {
	if err := c.Stop(ctx); err != nil {
		return nil, err
	}
	baseDir, err := makeBaseDir("", c.cred != nil)
	if err != nil {
		return nil, err
	}
	s := &Cluster{binDir: c.binDir, baseDir: baseDir, dataDir: filepath.Join(baseDir, "data"), cred: c.cred}
	fail := func(err error) (*Cluster, error) {
		_ = s.Close()
		_ = c.StartAgain(ctx)
		return nil, err
	}
	if err := s.prepareDir(baseDir); err != nil {
		return fail(err)
	}
	// cp -a keeps modes and owners (the server user's, when run as root).
	if out, err := exec.CommandContext(ctx, "cp", "-a", c.dataDir, s.dataDir).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("pgcluster: copy data directory: %w\n%s", err, out))
	}
	if err := s.reservePort(); err != nil {
		return fail(err)
	}
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", c.port, o.ApplicationName)
	if o.DBName != "" {
		conninfo += " dbname=" + o.DBName
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n# standby, written by walbox internal/pgcluster\nport = '%d'\nunix_socket_directories = '%s'\nhot_standby = 'on'\nprimary_conninfo = '%s'\n",
		s.port, s.dataDir, strings.ReplaceAll(conninfo, "'", "''"))
	if o.PrimarySlot != "" {
		fmt.Fprintf(&b, "primary_slot_name = '%s'\n", o.PrimarySlot)
	}
	for k, v := range o.Settings {
		fmt.Fprintf(&b, "%s = '%s'\n", k, strings.ReplaceAll(v, "'", "''"))
	}
	conf := b.String()
	f, err := os.OpenFile(filepath.Join(s.dataDir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fail(fmt.Errorf("pgcluster: standby config: %w", err))
	}
	_, err = f.WriteString(conf)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fail(fmt.Errorf("pgcluster: standby config: %w", err))
	}
	signal := filepath.Join(s.dataDir, "standby.signal")
	if err := os.WriteFile(signal, nil, 0o600); err != nil {
		return fail(fmt.Errorf("pgcluster: standby.signal: %w", err))
	}
	if s.cred != nil {
		if err := os.Chown(signal, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fail(fmt.Errorf("pgcluster: standby.signal: %w", err))
		}
	}
	if err := c.StartAgain(ctx); err != nil {
		return fail(err)
	}
	if err := s.start(ctx); err != nil {
		return fail(err)
	}
	return s, nil
}

// Promote makes a standby the primary (pg_ctl promote) and waits until it
// accepts writes.
func (c *Cluster) Promote(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed
	}
	if out, err := c.run(ctx, "pg_ctl", "-D", c.dataDir, "promote", "-w", "-t", pgCtlTimeoutSeconds); err != nil {
		return fmt.Errorf("pgcluster: pg_ctl promote: %w\n%s", err, out)
	}
	return nil
}

// Version is the server's major version, read from PG_VERSION.
func (c *Cluster) Version() (int, error) {
	b, err := os.ReadFile(filepath.Join(c.dataDir, "PG_VERSION"))
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}
