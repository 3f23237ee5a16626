package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/consumer"
)

// Create an account for every new user, exactly once per user, in the
// consumer's own database.
func ExampleRun() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	db, err := pgxpool.New(ctx, "postgres://accounts@localhost:5432/accounts")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if err := consumer.Migrate(ctx, db); err != nil { // walbox.processed_events
		log.Fatal(err)
	}
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}

	err = consumer.Run(ctx, js, consumer.Config{
		Stream:         "USERS",
		Durable:        "accounts", // the consumer group: same name in every instance
		FilterSubjects: []string{"user.created"},
		DB:             db,
		Logger:         slog.Default(),
	}, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		var ev struct {
			UserID string `json:"user_id"`
		}
		if err := msg.Decode(&ev); err != nil {
			return consumer.Permanent(err) // to the dead-letter subject at once
		}
		_, err := tx.Exec(ctx, "INSERT INTO accounts (user_id) VALUES ($1)", ev.UserID)
		return err // an error: rolled back, retried with backoff
	})
	if err != nil {
		log.Fatal(err)
	}
}

func ExamplePermanent() {
	errNoSuchPlan := errors.New("no such plan")
	handler := func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		var ev struct {
			Plan string `json:"plan"`
		}
		if err := msg.Decode(&ev); err != nil {
			return consumer.Permanent(err)
		}
		if ev.Plan != "trial" && ev.Plan != "pro" {
			return consumer.Permanent(fmt.Errorf("plan %q: %w", ev.Plan, errNoSuchPlan))
		}
		return nil
	}
	err := handler(context.Background(), nil, consumer.Message{Data: []byte(`{"plan": "gold"}`)})
	fmt.Println(consumer.IsPermanent(err), errors.Is(err, errNoSuchPlan), err)
	// Output: true true plan "gold": no such plan
}
