package main

import (
	"io"
	"os"

	"github.com/mattn/go-isatty"
	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
)

// loadConfig reads the file, then WALBOX_* variables, then flags, and validates.
func loadConfig(cmd *cobra.Command) (config.Config, error) { return load(cmd, true) }

// loadPostgresConfig is loadConfig for the commands that use only
// PostgreSQL: a URL is all they need (no nats.streams).
func loadPostgresConfig(cmd *cobra.Command) (config.Config, error) { return load(cmd, false) }

// newGroupCmd is a command that only groups subcommands.
func newGroupCmd(use, short string, subs ...*cobra.Command) *cobra.Command {
	cmd := &cobra.Command{Use: use, Short: short}
	cmd.AddCommand(subs...)
	return cmd
}

// configRun is a command's work once its configuration is loaded.
type configRun func(cmd *cobra.Command, args []string, cfg config.Config) error

// withConfig is a RunE that loads the configuration with loadConfig and
// then does run.
func withConfig(run configRun) func(*cobra.Command, []string) error {
	return withLoaded(loadConfig, run)
}

// withPostgresConfig is withConfig for the commands that use only
// PostgreSQL (loadPostgresConfig).
func withPostgresConfig(run configRun) func(*cobra.Command, []string) error {
	return withLoaded(loadPostgresConfig, run)
}

func withLoaded(load func(*cobra.Command) (config.Config, error), run configRun) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		cfg, err := load(cmd)
		if err != nil {
			return err
		}
		return run(cmd, args, cfg)
	}
}

// report is what doctor, status and slot status print.
type report interface {
	Print(w io.Writer)
	PrintJSON(w io.Writer) error
}

// printStatus prints rep as text, or with asJSON as JSON.
func printStatus(w io.Writer, rep report, asJSON bool) error {
	if asJSON {
		return rep.PrintJSON(w)
	}
	rep.Print(w)
	return nil
}

func load(cmd *cobra.Command, withNATS bool) (config.Config, error) {
	path, _ := cmd.Flags().GetString("config")
	if path == "" {
		path = os.Getenv("WALBOX_CONFIG")
	}
	if path == "" {
		// Like most tools: a walbox.yaml where walbox is started.
		if _, err := os.Stat("walbox.yaml"); err == nil {
			path = "walbox.yaml"
		}
	}
	cfg, err := config.Load(path, os.Environ())
	if err != nil {
		return cfg, err
	}
	if v, _ := cmd.Flags().GetString("postgres-url"); v != "" {
		cfg.Postgres.URL = v
	}
	if v, _ := cmd.Flags().GetString("nats-url"); v != "" {
		cfg.NATS.URL = v
	}
	if v, _ := cmd.Flags().GetString("log-level"); v != "" {
		cfg.Log.Level = v
	}
	if err := cfg.ApplyPasswordFile(); err != nil {
		return cfg, err
	}
	if !withNATS {
		return cfg, cfg.ValidatePostgres()
	}
	return cfg, cfg.Validate()
}

// newLogger builds the zerolog logger: JSON, or console output on a terminal.
func newLogger(c config.Log, w io.Writer) zerolog.Logger {
	level, err := zerolog.ParseLevel(c.Level)
	if err != nil {
		level = zerolog.InfoLevel
	}
	console := c.Format == "console"
	if c.Format == "auto" {
		if f, ok := w.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
			console = true
		}
	}
	if console {
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: "15:04:05.000"}
	}
	return zerolog.New(w).Level(level).With().Timestamp().Logger()
}

func tableOf(cfg config.Config) cdc.TableName {
	t, _ := cfg.OutboxTable() // validated
	return t
}
