package main

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/pgtest"
)

// buildWalbox builds the walbox binary into the test's folder.
func buildWalbox(ctx context.Context, t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "walbox")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	return bin
}

// startDev starts bin dev with args and no WALBOX_CONFIG, and returns it
// with its output and a scanner on that.
func startDev(ctx context.Context, t *testing.T, bin string, args ...string) (*exec.Cmd, io.ReadCloser, *bufio.Scanner) {
	t.Helper()
	cmd := exec.CommandContext(ctx, bin, append([]string{"dev"}, args...)...)
	cmd.Env = append(os.Environ(), "WALBOX_CONFIG=")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, stdout, bufio.NewScanner(stdout)
}

// TestDevCleansUpOnHangupAndBrokenPipe: closing the terminal (SIGHUP) or
// ending the reader of `walbox dev | head` (SIGPIPE on the next write)
// stops walbox dev as Ctrl-C does: the throwaway PostgreSQL is stopped and
// the run's folder removed. By default Go exits on both at once and left
// the postmaster and .walbox-dev/run-* behind.
func TestDevCleansUpOnHangupAndBrokenPipe(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	bin := buildWalbox(ctx, t)
	for _, how := range []string{"hangup", "broken pipe"} {
		t.Run(how, func(t *testing.T) {
			dir := pgtest.ServerDir(t, "walbox-dev-signal-*")
			cmd, stdout, sc := startDev(ctx, t, bin, "--dir", dir, "--rate", "20")
			// Wait for the first stored event: everything is up.
			up := false
			for sc.Scan() {
				if strings.Contains(sc.Text(), "STORED") || strings.Contains(sc.Text(), "ORDERS") {
					up = true
					break
				}
			}
			if !up {
				t.Fatal("walbox dev printed no stored event")
			}
			if how == "hangup" {
				_ = cmd.Process.Signal(syscall.SIGHUP)
				go func() {
					for sc.Scan() {
					}
				}()
			} else {
				stdout.Close() // the reader is gone: the next write gets SIGPIPE
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			select {
			case <-done:
			case <-time.After(60 * time.Second):
				_ = cmd.Process.Kill()
				t.Fatal("walbox dev did not stop within 60 s")
			}
			left, _ := filepath.Glob(filepath.Join(dir, "run-*"))
			if len(left) > 0 {
				t.Fatalf("walbox dev left %v behind after a %s", left, how)
			}
		})
	}
}

// With --postgres-url (a user's database), dev writes no sample events
// unless --rate is given.
func TestDevWritesNoSampleEventsIntoAGivenDatabase(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	url := freshDB(ctx, t)
	dir := pgtest.ServerDir(t, "walbox-dev-url-*")
	out, err := runCLI(ctx, "", "dev", "--postgres-url", url, "--duration", "2s", "--dir", dir)
	if err != nil {
		t.Fatalf("walbox dev --postgres-url: %v\n%s", err, out)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM outbox_events").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("walbox dev wrote %d sample events into the given database without --rate", n)
	}
}

// A walbox dev killed with -9 leaves its folder and a running PostgreSQL;
// the next walbox dev stops and removes them, and says so. Its banner names
// the run's walbox.yaml and the commands that work against it.
func TestDevRemovesWhatAKilledRunLeft(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	bin := buildWalbox(ctx, t)
	dir := pgtest.ServerDir(t, "walbox-dev-left-*")
	first, _, sc := startDev(ctx, t, bin, "--dir", dir, "--rate", "5")
	var banner strings.Builder
	for sc.Scan() {
		banner.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), "walbox dlq list --config") {
			break
		}
	}
	if !strings.Contains(banner.String(), "walbox status --config") {
		t.Fatalf("the banner names no configuration to point the other commands at:\n%s", banner.String())
	}
	left, _ := filepath.Glob(filepath.Join(dir, "run-*", "walbox.yaml"))
	if len(left) != 1 {
		t.Fatalf("the run's walbox.yaml: %v", left)
	}
	_ = first.Process.Kill() // -9: nothing is cleaned up
	_ = first.Wait()
	pm, _ := filepath.Glob(filepath.Join(dir, "run-*", "postgres", "data", "postmaster.pid"))
	if len(pm) != 1 {
		t.Fatalf("the killed run left no running PostgreSQL to clean up: %v", pm)
	}
	out, err := exec.CommandContext(ctx, bin, "dev", "--dir", dir, "--rate", "5", "--duration", "2s").CombinedOutput()
	if err != nil {
		t.Fatalf("second walbox dev: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "left behind by an earlier walbox dev (its PostgreSQL was still running: stopped)") {
		t.Fatalf("the second run does not say it cleaned up:\n%s", out)
	}
	if runs, _ := filepath.Glob(filepath.Join(dir, "run-*")); len(runs) != 0 {
		t.Fatalf("left after the second run: %v", runs)
	}
}
