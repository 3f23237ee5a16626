// Command consumer is the consuming half of walbox's example: for every
// user.created event (see examples/producer) it creates an account in its
// own database, exactly once per user, however often JetStream delivers the
// event. The account and the event's idempotency record
// (walbox.processed_events) are written in one transaction.
//
// With walbox's own config (stream USERS capturing user.>, and walbox's
// dead-letter stream WALBOX_DLQ):
//
//	go run ./examples/consumer -postgres-url postgres://accounts@localhost:5432/accounts -nats-url nats://localhost:4222
//
// With `walbox dev` (streams ORDERS and PAYMENTS; pair it with
// `examples/producer -topic orders.user.created`):
//
//	go run ./examples/consumer -postgres-url <PostgreSQL URL> -nats-url <NATS URL> -stream ORDERS -subject orders.user.created
//
// Without walbox, -create-streams creates USERS (user.>) and WALBOX_DLQ
// (walbox.dlq.>) when they are missing. Ctrl-C stops it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/consumer"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

type config struct {
	PostgresURL   string
	NATSURL       string
	Stream        string
	Subject       string
	Durable       string
	CreateStreams bool
}

func parseFlags(args []string, getenv func(string) string) (config, error) {
	var c config
	fs := flag.NewFlagSet("consumer", flag.ContinueOnError)
	dbURL := getenv("ACCOUNTS_DATABASE_URL")
	if dbURL == "" {
		dbURL = getenv("DATABASE_URL")
	}
	natsURL := getenv("NATS_URL")
	if natsURL == "" {
		natsURL = nats.DefaultURL
	}
	fs.StringVar(&c.PostgresURL, "postgres-url", dbURL, "the consumer's own database (env ACCOUNTS_DATABASE_URL, else DATABASE_URL)")
	fs.StringVar(&c.NATSURL, "nats-url", natsURL, "NATS server (env NATS_URL)")
	fs.StringVar(&c.Stream, "stream", "USERS", "stream to consume (walbox dev: ORDERS)")
	fs.StringVar(&c.Subject, "subject", "user.created", "subject of the user.created events (walbox dev: orders.user.created)")
	fs.StringVar(&c.Durable, "durable", "accounts", "durable consumer name = consumer group")
	fs.BoolVar(&c.CreateStreams, "create-streams", false, "create streams USERS (user.>) and WALBOX_DLQ (walbox.dlq.>) when missing")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.PostgresURL == "" {
		return c, errors.New("-postgres-url (or ACCOUNTS_DATABASE_URL) is required")
	}
	return c, nil
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	cfg, err := parseFlags(args, getenv)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, cfg.PostgresURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if err := migrate(ctx, pool); err != nil {
		return err
	}
	nc, err := nats.Connect(cfg.NATSURL, nats.Name("walbox-example-consumer"), nats.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("connect to NATS at %s: %w", cfg.NATSURL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	if cfg.CreateStreams {
		if err := createStreams(ctx, js); err != nil {
			return err
		}
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	fmt.Fprintf(stdout, "consuming %s from stream %s as %s\n", cfg.Subject, cfg.Stream, cfg.Durable)
	return consumer.Run(ctx, js, consumer.Config{
		Stream:         cfg.Stream,
		Durable:        cfg.Durable,
		FilterSubjects: []string{cfg.Subject},
		DB:             pool,
		Logger:         log,
		OnOutcome: func(msg consumer.Message, outcome consumer.Outcome, err error) {
			if err != nil {
				fmt.Fprintf(stdout, "event %s: %s: %v\n", msg.ID, outcome, err)
				return
			}
			fmt.Fprintf(stdout, "event %s: %s\n", msg.ID, outcome)
		},
	}, createAccount)
}

// migrate creates the idempotency table and the accounts table. accounts has
// no unique constraint on user_id, so that exactly-once is visibly the
// idempotency record's doing; a real service would add one as well.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := consumer.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS accounts (
		id         bigserial PRIMARY KEY,
		user_id    text NOT NULL,
		email      text NOT NULL,
		plan       text NOT NULL DEFAULT 'trial',
		event_id   text NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`)
	if err != nil {
		return fmt.Errorf("create table accounts: %w", err)
	}
	return nil
}

// UserCreated is the event's payload (as examples/producer writes it).
type UserCreated struct {
	UserID string `json:"user_id"`
	Email  string `json:"email"`
}

// createAccount is the handler: it runs inside the transaction that also
// records the event as processed for this consumer group.
func createAccount(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
	var ev UserCreated
	if err := msg.Decode(&ev); err != nil {
		return consumer.Permanent(err) // malformed: retrying will not help
	}
	if ev.UserID == "" {
		return consumer.Permanent(fmt.Errorf("event %s has no user_id", msg.ID))
	}
	_, err := tx.Exec(ctx, "INSERT INTO accounts (user_id, email, event_id) VALUES ($1, $2, $3)", ev.UserID, ev.Email, msg.ID)
	if err != nil {
		return fmt.Errorf("insert account for user %s: %w", ev.UserID, err)
	}
	return nil
}

// createStreams creates the example's stream and walbox's dead-letter stream
// when they are missing (walbox creates both from its config).
func createStreams(ctx context.Context, js jetstream.JetStream) error {
	for _, sc := range []jetstream.StreamConfig{
		{Name: "USERS", Subjects: []string{"user.>"}},
		{Name: "WALBOX_DLQ", Subjects: []string{"walbox.dlq.>"}},
	} {
		if _, err := js.Stream(ctx, sc.Name); err == nil {
			continue
		} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("look up stream %s: %w", sc.Name, err)
		}
		if _, err := js.CreateStream(ctx, sc); err != nil {
			return fmt.Errorf("create stream %s: %w", sc.Name, err)
		}
	}
	return nil
}
