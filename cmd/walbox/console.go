package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/console"
)

// withConsole sets opts up to serve the web console on the metrics
// listener (console.enabled) and feed its live tail from the relay's acks.
func withConsole(ctx context.Context, cfg config.Config, log zerolog.Logger, opts app.Options) (app.Options, error) {
	return console.Attach(ctx, console.Options{Config: cfg, Log: log, Version: version()}, opts)
}

func readOnly(cfg config.Config) bool {
	tok, err := console.ReadToken(cfg)
	return err != nil || tok == ""
}

func newConsoleCmd() *cobra.Command {
	var listen string
	cmd := &cobra.Command{
		Use:   "console",
		Short: "Serve the web console without a relay: slot, WAL, lag, dead letters, doctor",
		Long: `console serves the web console (what walbox run serves at /ui/ on its
metrics listener) from this process alone, for a DBA on a laptop: the
Overview (slot, WAL, lag and events/s as the running relay writes them to
walbox.relay_status, unprocessed rows), Dead letters and Doctor. The live
tail needs the relay's acks: it is on walbox run's console.

It listens on --listen (default metrics.listen). Retrying dead letters
needs console.token (or console.token_file); without one it is read-only.`,
		RunE: withConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			log := newLogger(cfg.Log, os.Stderr)
			if listen == "" {
				listen = cfg.Metrics.Listen
			}
			if listen == "" {
				return &config.Error{Key: "metrics.listen", Msg: "empty: give walbox console --listen 127.0.0.1:9188"}
			}
			return serveConsole(cmd.Context(), cfg, log, listen, func(addr string) {
				fmt.Fprintf(cmd.OutOrStdout(), "walbox console on http://%s/ui/ (%s)\n", addr, map[bool]string{true: "read-only: no console.token", false: "actions need console.token"}[readOnly(cfg)])
			})
		}),
	}
	cmd.Flags().StringVar(&listen, "listen", "", "address to serve the console on (default metrics.listen)")
	return cmd
}

// serveConsole serves the console alone on listen until ctx ends.
func serveConsole(ctx context.Context, cfg config.Config, log zerolog.Logger, listen string, started func(addr string)) error {
	c, err := console.New(ctx, console.Options{Config: cfg, Log: log, Version: version()})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return &config.Error{Key: "metrics.listen", Msg: fmt.Sprintf("cannot listen on %s: %v (walbox run may be serving its console there: open it, or give --listen another address)", listen, err)}
	}
	mux := http.NewServeMux()
	mux.Handle("/ui/", c)
	mux.Handle("/", http.RedirectHandler("/ui/", http.StatusFound))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	started(ln.Addr().String())
	stop := context.AfterFunc(ctx, func() { _ = srv.Close() })
	defer stop()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve the console: %w", err)
	}
	return nil
}
