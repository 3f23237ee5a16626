package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"syscall"

	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/console"
)

// profiledRelayArg, as the first argument, makes this binary run the relay
// itself (app.Run, what `walbox run` calls) with a CPU profile: for
// -cpuprofile, since the walbox binary serves no pprof endpoint.
const profiledRelayArg = "__relay-with-cpuprofile"

// runProfiledRelay is `walbox run --config cfg` writing a CPU profile to out.
func runProfiledRelay(cfgPath, out string) int {
	cfg, err := config.Load(cfgPath, os.Environ())
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 1
	}
	f, err := os.Create(out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 1
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 1
	}
	defer pprof.StopCPUProfile()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := zerolog.New(os.Stderr).Level(zerolog.WarnLevel).With().Timestamp().Logger()
	app.ApplyRuntime(cfg.Runtime, log) // as `walbox run` does
	// The web console too, as walbox run attaches it (console.enabled).
	opts, err := console.Attach(ctx, console.Options{Config: cfg, Log: log}, app.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 1
	}
	if err := app.Run(ctx, cfg, log, opts); err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 1
	}
	if err := writeAllocs(strings.TrimSuffix(out, ".pprof") + ".allocs.pprof"); err != nil {
		fmt.Fprintln(os.Stderr, "relay:", err)
		return 1
	}
	return 0
}

// writeAllocs writes the relay's allocation profile (every allocation
// since it started, sampled), beside its CPU profile.
func writeAllocs(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		f.Close()
		return fmt.Errorf("allocation profile: %w", err)
	}
	return f.Close()
}

// relayCommand returns the program and arguments that run the relay for a
// phase: the walbox binary, or this binary with a CPU profile.
func (b *bench) relayCommand(phase string) (string, []string, error) {
	if b.p.CPUProfile == "" {
		return b.env.binary, []string{"run", "--config", b.env.cfgFile}, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	if err := os.MkdirAll(b.p.CPUProfile, 0o755); err != nil {
		return "", nil, err
	}
	out, err := filepath.Abs(filepath.Join(b.p.CPUProfile, "relay-"+phase+".pprof"))
	if err != nil {
		return "", nil, err
	}
	return self, []string{profiledRelayArg, b.env.cfgFile, out}, nil
}
