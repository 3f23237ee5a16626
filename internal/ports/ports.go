// Package ports hands out loopback TCP ports for the servers that tests and
// the demo start on an address chosen before the server runs (a PostgreSQL
// cluster, JetStream nodes that list each other as routes, a server that is
// restarted on the same address).
//
// Asking the kernel for port 0 and closing the listener leaves a window
// before the server binds the port, and in that window the port is up for
// grabs: the kernel hands the same range out as the local port of every
// outgoing connection, and other test processes pick from it too. Under a
// parallel test run that happened (a JetStream node's route port taken,
// "address already in use"). So a Reservation picks ports outside the
// kernel's ephemeral range, which no outgoing connection uses, and holds an
// exclusive lock file per port until it is released, so that no other
// process using this package takes the same port meanwhile, also while a
// server is stopped to be restarted on it.
package ports

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

const (
	// lowest is the lowest port handed out: below it live well-known and
	// registered services' defaults that a developer machine may run.
	lowest = 10000
	// attempts bounds the search for one port.
	attempts = 2000
)

// Reservation holds ports until Release.
type Reservation struct {
	Ports []int
	locks []*os.File
}

// Reserve finds n free loopback ports outside the ephemeral range and locks
// them for this process until Release.
func Reserve(n int) (*Reservation, error) {
	free, err := candidates()
	if err != nil {
		return nil, err
	}
	dir := lockDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("ports: create the lock directory: %w", err)
	}
	r := &Reservation{}
	for range n {
		port, lock, err := reserveOne(dir, free, r.Ports)
		if err != nil {
			r.Release()
			return nil, err
		}
		r.Ports = append(r.Ports, port)
		r.locks = append(r.locks, lock)
	}
	return r, nil
}

// Release frees the ports for other processes. It is idempotent.
func (r *Reservation) Release() {
	if r == nil {
		return
	}
	for _, f := range r.locks {
		// Remove while still locked (see lockPort), then close, which drops
		// the flock.
		_ = os.Remove(f.Name())
		_ = f.Close()
	}
	r.locks = nil
}

// lockDir holds one lock file per port, shared by every process on the
// machine.
func lockDir() string { return filepath.Join(os.TempDir(), "walbox-ports") }

// interval is a closed range of ports.
type interval struct{ lo, hi int }

// candidates are the ports from lowest to 65535 minus the kernel's
// ephemeral range.
func candidates() ([]interval, error) {
	elo, ehi := ephemeralRange()
	var out []interval
	if elo-1 >= lowest {
		out = append(out, interval{lowest, elo - 1})
	}
	if ehi+1 <= 65535 {
		out = append(out, interval{max(ehi+1, lowest), 65535})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("ports: the ephemeral port range %d-%d leaves no port above %d to reserve; narrow net.ipv4.ip_local_port_range", elo, ehi, lowest)
	}
	return out, nil
}

// ephemeralRange reads Linux's local port range, with its default when the
// file is not there.
func ephemeralRange() (int, int) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768, 60999
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 32768, 60999
	}
	lo, err1 := strconv.Atoi(f[0])
	hi, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || lo > hi {
		return 32768, 60999
	}
	return lo, hi
}

func pick(free []interval) int {
	total := 0
	for _, iv := range free {
		total += iv.hi - iv.lo + 1
	}
	k := rand.IntN(total)
	for _, iv := range free {
		if k <= iv.hi-iv.lo {
			return iv.lo + k
		}
		k -= iv.hi - iv.lo + 1
	}
	panic("unreachable")
}

func reserveOne(dir string, free []interval, taken []int) (int, *os.File, error) {
	var lastErr error
	for range attempts {
		port := pick(free)
		if slices.Contains(taken, port) {
			continue
		}
		lock, err := lockPort(dir, port)
		if err != nil {
			lastErr = err
			continue
		}
		// Locked against other walbox processes; now make sure nothing else
		// listens there.
		if err := Listenable(port); err != nil {
			_ = lock.Close()
			lastErr = err
			continue
		}
		return port, lock, nil
	}
	return 0, nil, fmt.Errorf("ports: no free loopback port after %d tries: %w", attempts, lastErr)
}

// Listenable says whether a server could listen on the loopback port now:
// nil, or the error of listening there (e.g. "address already in use").
func Listenable(port int) error {
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return err
	}
	return ln.Close()
}

var errLocked = errors.New("locked by another process")

// lockPort takes the port's lock file. Release removes the file before
// closing it, so a lock is good only if the path still names the file that
// was locked: another process may have opened it just before its holder
// removed it.
func lockPort(dir string, port int) (*os.File, error) {
	path := filepath.Join(dir, strconv.Itoa(port)+".lock")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("ports: open the lock file of port %d: %w", port, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("port %d: %w", port, errLocked)
		}
		return nil, fmt.Errorf("ports: lock port %d: %w", port, err)
	}
	held, err1 := f.Stat()
	named, err2 := os.Stat(path)
	if err1 != nil || err2 != nil || !os.SameFile(held, named) {
		_ = f.Close()
		return nil, fmt.Errorf("port %d: %w", port, errLocked)
	}
	return f, nil
}
