package main

import (
	"context"
	"os"
	"syscall"
	"testing"
	"time"
)

// TestSIGPIPEStopsOnlyWhenStdioBroke: a SIGPIPE (raised here with kill, as
// the kernel raises it for a write to a socket the peer closed) leaves the
// context running while standard output is fine, and ends it once it broke.
func TestSIGPIPEStopsOnlyWhenStdioBroke(t *testing.T) {
	for _, broken := range []bool{false, true} {
		seen := make(chan bool, 1)
		ctx, stop := signalContextWith(context.Background(), func() bool { return broken }, func(b bool) { seen <- b })
		if err := syscall.Kill(os.Getpid(), syscall.SIGPIPE); err != nil {
			t.Fatal(err)
		}
		select {
		case <-seen:
		case <-time.After(10 * time.Second):
			t.Fatal("SIGPIPE never reached the handler")
		}
		if got := ctx.Err() != nil; got != broken {
			t.Errorf("stdio broken %v: context ended %v", broken, got)
		}
		stop()
	}
}

func TestFdBrokenSeesAPipeWhoseReaderClosed(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if fdBroken(int(w.Fd())) {
		t.Fatal("an open pipe reported broken")
	}
	r.Close()
	if !fdBroken(int(w.Fd())) {
		t.Fatal("a pipe whose reader closed reported fine")
	}
}
