// Command walbox relays transactional-outbox rows from PostgreSQL's WAL to
// NATS JetStream or Kafka. This package only wires cdc and relay together and holds
// the CLI; it has no logic of its own.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime/debug"

	"github.com/spf13/cobra"

	"github.com/walbox/walbox/internal/vcs"
)

func main() {
	// SIGHUP (the terminal closed) and SIGPIPE on standard output
	// (`walbox dev | head` ended) stop walbox like SIGTERM, so what it
	// started is cleaned up; by default Go would just exit on them.
	ctx, stop := signalContext(context.Background())
	err := newRootCmd().ExecuteContext(ctx)
	stop()
	if err != nil {
		var ee exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		fmt.Fprintln(os.Stderr, "walbox:", err)
		os.Exit(1)
	}
}

// version is the module version and, for a build from a checkout, the
// commit it was built from.
func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	v := bi.Main.Version
	if rev, modified := vcs.Revision(bi.Settings); rev != "" {
		if modified {
			rev += "+dirty"
		}
		v += " (" + rev + ")"
	}
	return v + " " + bi.GoVersion
}

// exitError carries an exit code for a failure already reported.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit %d", e.code) }

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "walbox",
		Short:         "Transactional outbox relay: PostgreSQL WAL to NATS JetStream",
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       version(),
	}
	root.PersistentFlags().String("config", "", "YAML config file (env WALBOX_CONFIG)")
	root.PersistentFlags().String("postgres-url", "", "PostgreSQL URL (overrides postgres.url, env WALBOX_POSTGRES_URL); leave the password out of it, or it shows in the process list: use postgres.password_file (env WALBOX_POSTGRES_PASSWORD_FILE), PGPASSWORD or PGPASSFILE")
	root.PersistentFlags().String("nats-url", "", "NATS URL (overrides nats.url, env WALBOX_NATS_URL)")
	root.PersistentFlags().String("log-level", "", "log level: debug, info, warn, error (overrides log.level)")
	root.AddCommand(newRunCmd(), newMigrateCmd(), newDevCmd(), newArchiveCmd(),
		newDoctorCmd(), newSlotCmd(), newStatusCmd(), newTailCmd(), newReplayCmd(), newDLQCmd(), newConfigCmd(), newUninstallCmd(), newConsoleCmd())
	return root
}
