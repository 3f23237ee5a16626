package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/devenv"
)

func newDevCmd() *cobra.Command {
	cfg := devenv.Config{Rate: devenv.DefaultRate, Dir: devenv.DefaultDir}
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Start a throwaway PostgreSQL, an embedded JetStream, the relay and a sample producer",
		Long: `dev starts everything walbox needs on this machine, for a first look:
a throwaway PostgreSQL cluster from the local server binaries (wal_level=logical),
or the database at --postgres-url; an embedded NATS server with JetStream, or the
one at --nats-url; walbox's migrations; the relay; and a producer committing
sample events (orders.* into stream ORDERS, payments.* into PAYMENTS).
With --sink kafka the relay publishes to an in-process Kafka (kfake, the
Kafka protocol in Go; or your --kafka-brokers) instead: one topic per event
topic, the order id as the record key.

It prints every event as JetStream stored it, with its commit-to-ack latency,
and a summary every 5 seconds. Ctrl-C stops everything and removes the data
(--keep keeps it). With --postgres-url it uses the slot walbox_dev, dropped at exit.
--config is not read: dev builds its own configuration.`,
		Example: `  walbox dev
  walbox dev --rate 50 --duration 30s
  walbox dev --sink kafka
  walbox dev --postgres-url postgres://me@localhost:5432/app --rate 0`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.PostgresURL, _ = cmd.Flags().GetString("postgres-url")
			if cfg.PostgresURL != "" && !cmd.Flags().Changed("rate") {
				// A user's database: no sample events unless asked.
				cfg.Rate = 0
				fmt.Fprintln(cmd.ErrOrStderr(), "walbox dev: --postgres-url given: no sample events are written (pass --rate to write some)")
			}
			cfg.NATSURL, _ = cmd.Flags().GetString("nats-url")
			switch cfg.Sink {
			case config.SinkNATS, config.SinkKafka:
			default:
				return fmt.Errorf("--sink %q: use nats or kafka", cfg.Sink)
			}
			level, _ := cmd.Flags().GetString("log-level")
			if level == "" {
				// The event lines are the show; the relay speaks up only
				// when something is wrong.
				level = "warn"
			}
			cfg.Out = cmd.OutOrStdout()
			cfg.Log = newLogger(config.Log{Level: level, Format: "auto"}, os.Stderr)
			_, err := devenv.Run(cmd.Context(), cfg)
			return err
		},
	}
	f := cmd.Flags()
	f.Float64Var(&cfg.Rate, "rate", cfg.Rate, "sample events committed per second (0: none, e.g. to watch your own)")
	f.DurationVar(&cfg.Duration, "duration", 0, "stop after running this long, counted once everything is up (0: until Ctrl-C)")
	f.StringVar(&cfg.Dir, "dir", cfg.Dir, "folder for the run's data (each run gets a fresh subfolder)")
	f.StringVar(&cfg.Sink, "sink", config.SinkNATS, "where the relay publishes: nats (embedded JetStream, or --nats-url) or kafka (an in-process Kafka, or --kafka-brokers)")
	f.StringSliceVar(&cfg.KafkaBrokers, "kafka-brokers", nil, "with --sink kafka: your brokers (host:port,...) instead of the in-process Kafka")
	f.BoolVar(&cfg.Keep, "keep", false, "keep the run's data (and the walbox_dev slot of --postgres-url) at exit")
	return cmd
}
