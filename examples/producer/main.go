// Command producer is the producing half of walbox's example: it creates
// users, and for each one writes a user.created event into walbox's outbox in
// the same transaction, so the event exists if and only if the user does.
// walbox publishes it to JetStream; examples/consumer creates an account for
// it, exactly once.
//
// With walbox's own config (a stream capturing user.>, e.g.
// `{name: USERS, subjects: ["user.>"]}` under nats.streams):
//
//	go run ./examples/producer -postgres-url postgres://app@localhost:5432/app -email ada@example.com
//
// With `walbox dev`, whose streams are ORDERS (orders.>) and PAYMENTS
// (payments.>), use a topic one of them captures (events on a subject no
// stream captures are dead-lettered by walbox):
//
//	go run ./examples/producer -postgres-url <PostgreSQL URL walbox dev printed> -topic orders.user.created -n 3
//
// The database needs walbox's migrations (`walbox migrate`; walbox dev applies
// them). The producer creates its users table itself.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/walbox/walbox/outbox"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "producer:", err)
		os.Exit(1)
	}
}

// config is what the flags set.
type config struct {
	PostgresURL string
	Topic       string
	Emails      []string
	MaxLag      time.Duration
}

func parseFlags(args []string, getenv func(string) string) (config, error) {
	var c config
	fs := flag.NewFlagSet("producer", flag.ContinueOnError)
	fs.StringVar(&c.PostgresURL, "postgres-url", getenv("DATABASE_URL"), "the service's database, holding walbox's outbox table (env DATABASE_URL)")
	fs.StringVar(&c.Topic, "topic", "user.created", "subject of the events; a stream in walbox's config must capture it (walbox dev: orders.user.created)")
	email := fs.String("email", "", "create one user with this email")
	n := fs.Int("n", 0, "create this many users with generated emails")
	fs.DurationVar(&c.MaxLag, "max-lag", 0, "refuse to write while walbox is further behind than this (0: off)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.PostgresURL == "" {
		return c, errors.New("-postgres-url (or DATABASE_URL) is required")
	}
	if *email != "" {
		c.Emails = append(c.Emails, *email)
	}
	for i := range *n {
		c.Emails = append(c.Emails, fmt.Sprintf("user-%d-%d@example.com", time.Now().UnixNano(), i))
	}
	if len(c.Emails) == 0 {
		return c, errors.New("nothing to do: give -email or -n")
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
	w, err := outbox.New(outbox.WithMaxLag(cfg.MaxLag))
	if err != nil {
		return err
	}
	for _, email := range cfg.Emails {
		user, event, err := createUser(ctx, pool, w, cfg.Topic, email)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "user %s <%s> created; event %s on %s\n", user, email, event, cfg.Topic)
	}
	return nil
}

// migrate creates the example's users table.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS users (
		id         text PRIMARY KEY,
		email      text NOT NULL UNIQUE,
		created_at timestamptz NOT NULL DEFAULT now())`)
	if err != nil {
		return fmt.Errorf("create table users: %w", err)
	}
	return nil
}

// UserCreated is the event's payload.
type UserCreated struct {
	UserID string `json:"user_id"`
	Email  string `json:"email"`
}

// createUser inserts the user and its event in one transaction and returns
// both ids. If anything fails (a taken email, the database, back-pressure)
// neither exists.
func createUser(ctx context.Context, pool *pgxpool.Pool, w *outbox.Writer, topic, email string) (userID, eventID string, err error) {
	userID, eventID = outbox.NewID(), outbox.NewID()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO users (id, email) VALUES ($1, $2)", userID, email); err != nil {
			return fmt.Errorf("insert user %s: %w", email, err)
		}
		return w.Write(ctx, tx, outbox.Event{
			ID:            eventID,
			Topic:         topic,
			EventType:     "user.created",
			AggregateType: "user",
			AggregateID:   userID,
			Payload:       UserCreated{UserID: userID, Email: email},
		})
	})
	if err != nil {
		return "", "", fmt.Errorf("create user %s: %w", email, err)
	}
	return userID, eventID, nil
}
