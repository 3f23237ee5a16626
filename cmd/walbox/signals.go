package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"
)

// signalContext ends on SIGINT, SIGTERM and SIGHUP (the terminal closed),
// and on SIGPIPE only when it came from standard output or error: the
// reader of `walbox dev | head` is gone, and walbox stops like on SIGTERM,
// so what it started is cleaned up.
//
// A program that asks for SIGPIPE gets it for every write to a broken
// socket too (os/signal), and a broker or database closing a connection is
// an outage walbox rides out, not a reason to stop: such a SIGPIPE is
// ignored, and the write fails with EPIPE for the client to reconnect.
func signalContext(parent context.Context) (context.Context, context.CancelFunc) {
	return signalContextWith(parent, stdioBroken, nil)
}

// signalContextWith is signalContext with the stdio check and, for tests,
// a callback after each SIGPIPE with what the check said.
func signalContextWith(parent context.Context, broken func() bool, seen func(broken bool)) (context.Context, context.CancelFunc) {
	ctx, stop := signal.NotifyContext(parent, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	ctx, cancel := context.WithCancel(ctx)
	pipe := make(chan os.Signal, 1)
	signal.Notify(pipe, syscall.SIGPIPE)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-pipe:
				b := broken()
				if b {
					cancel()
				}
				if seen != nil {
					seen(b)
				}
				if b {
					return
				}
			}
		}
	}()
	return ctx, func() {
		signal.Stop(pipe)
		cancel()
		stop()
	}
}

// stdioBroken reports whether standard output or error can no longer be
// written: the reading end of its pipe was closed (or its terminal hung up).
func stdioBroken() bool { return fdBroken(1, 2) }

// fdBroken reports whether writing to any of fds would fail for good.
func fdBroken(fd ...int) bool {
	fds := make([]unix.PollFd, len(fd))
	for i, f := range fd {
		fds[i] = unix.PollFd{Fd: int32(f), Events: unix.POLLOUT}
	}
	if _, err := unix.Poll(fds, 0); err != nil {
		return false
	}
	for _, fd := range fds {
		if fd.Revents&(unix.POLLERR|unix.POLLHUP) != 0 {
			return true
		}
	}
	return false
}
