package natstest

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/ports"
)

// ProcCluster is a JetStream cluster of real nats-server processes, built
// from the nats-server version in walbox's go.mod: what users run, for
// faults that are about processes (a node killed, a rolling restart).
type ProcCluster struct {
	t     testing.TB
	bin   string
	Nodes []*Proc
}

// Proc is one nats-server process of a ProcCluster; its ports and store
// directory stay the same across restarts.
type Proc struct {
	Name                        string
	Port, ClusterPort, HTTPPort int
	dir, bin                    string
	routes                      string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	log  *os.File
}

// BuildServer builds nats-server into dir and returns its path.
func BuildServer(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "nats-server")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/nats-io/nats-server/v2")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build nats-server from go.mod's version: %v\n%s", err, out)
	}
	return bin, nil
}

// InstallServer installs nats-server at version (say "v2.11.9") from the
// Go module proxy, once per machine (in the user's cache directory), and
// returns its path: an older server, for the paths walbox takes on one.
func InstallServer(ctx context.Context, version string) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "walbox", "nats-server-"+version)
	bin := filepath.Join(dir, "nats-server")
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), "install-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	cmd := exec.CommandContext(ctx, "go", "install", "github.com/nats-io/nats-server/v2@"+version)
	cmd.Env = append(os.Environ(), "GOBIN="+tmp, "GOFLAGS=-mod=mod")
	cmd.Dir = tmp // outside walbox's module: its go.mod pins another version
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go install nats-server %s: %v\n%s", version, err, out)
	}
	// Concurrent installs: the first rename wins, the rest find it there.
	if err := os.Rename(tmp, dir); err != nil {
		if _, serr := os.Stat(bin); serr != nil {
			return "", fmt.Errorf("install nats-server %s into %s: %w", version, dir, err)
		}
	}
	return bin, nil
}

// NewProcServer starts one nats-server process of version (installed with
// InstallServer), JetStream on, not clustered; killed at the end of the
// test.
func NewProcServer(t testing.TB, version string) *Proc {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bin, err := InstallServer(ctx, version)
	if err != nil {
		t.Fatal(err)
	}
	res, err := ports.Reserve(2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(res.Release)
	p := &Proc{Name: "old", Port: res.Ports[0], HTTPPort: res.Ports[1], dir: t.TempDir(), bin: bin}
	t.Cleanup(p.Kill)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitHealthy(ctx); err != nil {
		t.Fatal(err)
	}
	return p
}

// NewProcCluster builds nats-server and starts n nodes, stopped at the end
// of the test.
func NewProcCluster(t testing.TB, n int) *ProcCluster {
	t.Helper()
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bin, err := BuildServer(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	res, err := ports.Reserve(3 * n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(res.Release)
	ps := res.Ports
	var routes []string
	for i := range n {
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", ps[3*i+1]))
	}
	c := &ProcCluster{t: t, bin: bin}
	for i := range n {
		p := &Proc{Name: fmt.Sprintf("n%d", i+1), Port: ps[3*i], ClusterPort: ps[3*i+1], HTTPPort: ps[3*i+2],
			dir: filepath.Join(dir, fmt.Sprintf("n%d", i+1)), bin: bin, routes: strings.Join(routes, ",")}
		if err := os.MkdirAll(p.dir, 0o755); err != nil {
			t.Fatal(err)
		}
		c.Nodes = append(c.Nodes, p)
	}
	t.Cleanup(func() {
		for _, p := range c.Nodes {
			p.Kill()
		}
	})
	for _, p := range c.Nodes {
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range c.Nodes {
		if err := p.WaitHealthy(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// URLs is the comma-separated client URL list of every node.
func (c *ProcCluster) URLs() string {
	var u []string
	for _, p := range c.Nodes {
		u = append(u, p.URL())
	}
	return strings.Join(u, ",")
}

// Node returns the node with this server name, or nil.
func (c *ProcCluster) Node(name string) *Proc {
	for _, p := range c.Nodes {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// URL is the node's client URL.
func (p *Proc) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", p.Port) }

// Start starts the process (again, after Stop or Kill).
func (p *Proc) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return fmt.Errorf("%s is running", p.Name)
	}
	log, err := os.OpenFile(filepath.Join(p.dir, "server.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	args := []string{"-n", p.Name, "-a", "127.0.0.1", "-p", fmt.Sprint(p.Port), "-m", fmt.Sprint(p.HTTPPort),
		"-js", "-sd", filepath.Join(p.dir, "store")}
	if p.routes != "" {
		args = append(args, "--cluster_name", "walbox",
			"-cluster", fmt.Sprintf("nats://127.0.0.1:%d", p.ClusterPort), "-routes", p.routes)
	}
	cmd := exec.Command(p.bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); log.Close(); close(done) }()
	p.cmd, p.done, p.log = cmd, done, log
	return nil
}

// Stop ends the process with SIGTERM (a graceful shutdown, as a rolling
// restart does) and waits for it.
func (p *Proc) Stop() { p.signal(syscall.SIGTERM) }

// Kill ends the process with SIGKILL and waits for it.
func (p *Proc) Kill() { p.signal(syscall.SIGKILL) }

func (p *Proc) signal(sig syscall.Signal) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	p.cmd = nil
}

// WaitHealthy waits until the node's /healthz says its JetStream is current
// with the cluster (meta and every stream it holds).
func (p *Proc) WaitHealthy(ctx context.Context) error {
	url := fmt.Sprintf("http://127.0.0.1:%d/healthz", p.HTTPPort)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := (&http.Client{Timeout: 2 * time.Second}).Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not healthy: %w (log: %s)", p.Name, ctx.Err(), filepath.Join(p.dir, "server.log"))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Log returns what the node has logged so far.
func (p *Proc) Log() string {
	b, _ := os.ReadFile(filepath.Join(p.dir, "server.log"))
	return string(b)
}
