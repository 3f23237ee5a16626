package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/walbox/walbox/outbox"
)

// A user and its user.created event, in one transaction: the event is
// published if and only if the user was created.
func ExampleWrite() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@localhost:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	userID := "u-42"
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO users (id, email) VALUES ($1, $2)", userID, "ada@example.com"); err != nil {
			return err
		}
		return outbox.Write(ctx, tx, outbox.Event{
			Topic:         "user.created",
			EventType:     "user.created",
			AggregateType: "user",
			AggregateID:   userID, // also the partition key
			Payload:       map[string]any{"user_id": userID, "email": "ada@example.com"},
		})
	})
	if err != nil {
		log.Fatal(err)
	}
}

// Several events in one call go into the table with one COPY.
func ExampleWrite_many() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, "postgres://app@localhost:5432/app")
	defer pool.Close()

	events := make([]outbox.Event, 0, 100)
	for i := range 100 {
		events = append(events, outbox.Event{Topic: "user.imported", Payload: map[string]int{"row": i}})
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Write(ctx, tx, events...)
	})
	if err != nil {
		log.Fatal(err)
	}
}

// A Writer with options, built once and reused: the outbox table and
// producer back-pressure.
func ExampleNew() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, "postgres://app@localhost:5432/app")
	defer pool.Close()

	w, err := outbox.New(
		outbox.WithTable("public.outbox_events"),
		outbox.WithMaxLag(30*time.Second),
	)
	if err != nil {
		log.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return w.Write(ctx, tx, outbox.Event{Topic: "payout.generated", Payload: map[string]string{"payout_id": "p_001"}})
	})
	if errors.Is(err, outbox.ErrBackpressure) {
		// The relay is more than 30 s behind: nothing was written. Retry
		// later, or tell the caller to slow down (e.g. HTTP 503).
		fmt.Println("busy:", err)
		return
	}
	if err != nil {
		log.Fatal(err)
	}
}

// database/sql with the pgx stdlib driver (import _ "github.com/jackc/pgx/v5/stdlib").
func ExampleFromSQL() {
	ctx := context.Background()
	db, err := sql.Open("pgx", "postgres://app@localhost:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()

	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback()
	id := outbox.NewID() // known before the write
	if err := outbox.Write(ctx, outbox.FromSQL(tx), outbox.Event{ID: id, Topic: "user.created", Payload: []byte(`{"user_id":"u-42"}`)}); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("event", id)
}

// How far behind is the relay? For dashboards or a custom throttle.
// An existing outbox table of another layout, e.g. DAARION's (id text,
// stream, topic, payload jsonb, processed, error): map the roles it lacks to "".
func ExampleWithColumns() {
	w, err := outbox.New(
		outbox.WithTable("public.outbox_events"),
		outbox.WithColumns(map[string]string{
			"event_type": "", "aggregate_type": "", "aggregate_id": "", "partition_key": "", "headers": "",
		}),
	)
	if err != nil {
		log.Fatal(err)
	}
	_ = w // w.Write(ctx, tx, outbox.Event{Topic: "agent.run.started", Stream: "STREAM_AGENT_RUN", Payload: ...})
}

func ExampleLag() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, "postgres://app@localhost:5432/app")
	defer pool.Close()

	lag, err := outbox.Lag(ctx, pool, outbox.WithSlot("walbox"))
	switch {
	case errors.Is(err, outbox.ErrNoRelayStatus):
		fmt.Println("the relay has not reported yet")
	case err != nil:
		log.Fatal(err)
	default:
		fmt.Println("relay lag:", lag)
	}
}
