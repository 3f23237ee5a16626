// Package ops holds the logic of walbox's operations commands: doctor,
// slot, status, tail, replay, dlq and the grants recipe of migrate. The CLI
// (cmd/walbox) only parses flags and calls in here; each command topic has
// a file of its own. Every function takes the configuration, a context for
// its blocking calls and writers for its output, and never prints a secret:
// URLs are shown redacted, passwords and tokens not at all.
package ops

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/redact"
	"github.com/walbox/walbox/relay/busops"
)

// connectTimeout bounds each connection attempt of a command.
const connectTimeout = 10 * time.Second

// RedactPostgresURL shows a database URL as user@host:port/db, without the
// password (or "(unparsable url)").
func RedactPostgresURL(u string) string { return redact.PostgresURL(u) }

// connectPG opens a regular connection to the configured database.
func connectPG(ctx context.Context, cfg config.Config) (*pgx.Conn, error) {
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	conn, err := pgx.Connect(cctx, cfg.Postgres.URL)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL %s: %w", RedactPostgresURL(cfg.Postgres.URL), err)
	}
	return conn, nil
}

// closePG closes conn without being cut short by a cancelled ctx.
func closePG(ctx context.Context, conn *pgx.Conn) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = conn.Close(cctx)
}

// connectNATS connects once (no retry: a command reports and exits) with
// the configured TLS and authentication.
func connectNATS(ctx context.Context, cfg config.Config) (*nats.Conn, jetstream.JetStream, error) {
	auth, err := app.NATSOptions(cfg.NATS)
	if err != nil {
		return nil, nil, err
	}
	timeout := connectTimeout
	if d, ok := ctx.Deadline(); ok && time.Until(d) < timeout {
		timeout = max(time.Until(d), 100*time.Millisecond)
	}
	nc, err := nats.Connect(cfg.NATS.URL, append(auth, nats.Name("walbox-cli"), nats.Timeout(timeout), nats.MaxReconnects(0))...)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to NATS at %s: %s", app.RedactNATSURL(cfg.NATS.URL), app.ScrubNATSError(err, cfg.NATS))
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	return nc, js, nil
}

// tableOf parses outbox.table (validated by config.Validate).
func tableOf(cfg config.Config) (cdc.TableName, error) { return cfg.OutboxTable() }

// ArchiveTable is the archive table of an outbox table (cdc.TableName.Archive).
func ArchiveTable(t cdc.TableName) cdc.TableName { return t.Archive() }

// source is the Walbox-Source header value of the configured relay.
func source(cfg config.Config) string {
	c, err := pgconn.ParseConfig(cfg.Postgres.URL)
	if err != nil {
		return ""
	}
	return c.Database + "/" + cfg.Postgres.Slot
}

// HumanBytes formats n in IEC units: 512 B, 1.5 KiB, 3.2 GiB.
func HumanBytes(n int64) string { return busops.HumanBytes(n) }

// humanDuration rounds d for people: 850ms, 3.2s, 4m10s, 3h2m.
func humanDuration(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + humanDuration(-d)
	case d < time.Millisecond:
		return d.Round(time.Microsecond).String()
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	default:
		return d.Round(time.Minute).String()
	}
}

// oneLine flattens a payload to one line and truncates it to n runes (n <= 0:
// no limit).
func oneLine(b []byte, n int) string {
	s := strings.Join(strings.Fields(string(b)), " ")
	if n > 0 {
		r := []rune(s)
		if len(r) > n {
			return string(r[:n-1]) + "…"
		}
	}
	return s
}

// confirm asks question on out and reads a yes from in.
// orDiscard is w, or io.Discard when w is nil (an Out left unset).
func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

func confirm(in io.Reader, out io.Writer, question string) bool {
	fmt.Fprintf(out, "%s [y/N] ", question)
	if in == nil {
		fmt.Fprintln(out)
		return false
	}
	var line []byte
	buf := make([]byte, 1)
	for {
		n, err := in.Read(buf)
		if n == 1 {
			if buf[0] == '\n' {
				break
			}
			line = append(line, buf[0])
		}
		if err != nil {
			break
		}
	}
	ans := strings.ToLower(strings.TrimSpace(string(line)))
	return ans == "y" || ans == "yes"
}
