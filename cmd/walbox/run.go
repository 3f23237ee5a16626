package main

import (
	"os"

	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
)

func newRunCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "run",
		Short: "Stream committed outbox inserts to JetStream until SIGTERM",
		RunE: withConfig(func(cmd *cobra.Command, _ []string, cfg config.Config) error {
			log := newLogger(cfg.Log, os.Stderr)
			app.ApplyRuntime(cfg.Runtime, log)
			// A table added to outboxes while walbox runs is found by
			// reading the config again (see app.Options.Reload).
			reload := func() (config.Config, error) { return loadConfig(cmd) }
			opts, err := withConsole(cmd.Context(), cfg, log, app.Options{Reload: reload})
			if err != nil {
				return err
			}
			return app.Run(cmd.Context(), cfg, log, opts)
		}),
	}
}
