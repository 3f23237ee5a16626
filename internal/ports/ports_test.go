package ports

import (
	"net"
	"os"
	"testing"
)

func TestReservedPortsAreOutsideTheEphemeralRangeAndExclusive(t *testing.T) {
	lo, hi := ephemeralRange()
	first, err := Reserve(50)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Release()
	second, err := Reserve(50)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range append(append([]int{}, first.Ports...), second.Ports...) {
		if p >= lo && p <= hi || p < lowest || p > 65535 {
			t.Fatalf("port %d is in the ephemeral range %d-%d or out of bounds", p, lo, hi)
		}
		if seen[p] {
			t.Fatalf("port %d handed out twice while reserved", p)
		}
		seen[p] = true
	}
	// A held port cannot be locked again (another process would skip it);
	// once released it can.
	dir := lockDir()
	if f, err := lockPort(dir, second.Ports[0]); err == nil {
		(&Reservation{locks: []*os.File{f}}).Release()
		t.Fatalf("port %d locked twice", second.Ports[0])
	}
	second.Release()
	second.Release()
	f, err := lockPort(dir, second.Ports[0])
	if err != nil {
		t.Fatalf("a released port stays locked: %v", err)
	}
	(&Reservation{locks: []*os.File{f}}).Release()
}

func TestReserveSkipsAPortSomethingListensOn(t *testing.T) {
	// Only the listening check can refuse here: occupy every candidate but
	// one of a tiny range and see that only the free one is handed out.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	busy := ln.Addr().(*net.TCPAddr).Port
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	want := free.Addr().(*net.TCPAddr).Port
	free.Close()
	ivs := []interval{{busy, busy}, {want, want}}
	for range 20 {
		port, lock, err := reserveOne(t.TempDir(), ivs, nil)
		if err != nil {
			t.Fatal(err)
		}
		lock.Close()
		if port != want {
			t.Fatalf("reserved %d, which is listened on", port)
		}
	}
}
