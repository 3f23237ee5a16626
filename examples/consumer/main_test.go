package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/outbox"
)

// TestUserGetsOneAccount is the whole example: users created with their
// user.created events in the service's database, walbox relaying them, and
// the consumer creating one account per user in its own database, also
// when the whole stream is delivered again. It is the package's one test
// with a database: it starts a PostgreSQL cluster of its own.
func TestUserGetsOneAccount(t *testing.T) {
	ctx := relaytest.Ctx(t)
	pg := pgtest.StartOwn(ctx, t)
	serviceDB, accountsDB := pg.NewDB(t), pg.NewDB(t)
	srv := natstest.New(t)
	relaytest.StartUsersRelay(t, serviceDB, srv.URL())
	natsURL := srv.URL()

	// The producer side, as examples/producer does it.
	service := relaytest.Pool(t, serviceDB)
	if _, err := service.Exec(ctx, "CREATE TABLE users (id text PRIMARY KEY, email text NOT NULL UNIQUE)"); err != nil {
		t.Fatal(err)
	}
	const users = 5
	for i := range users {
		id, email := outbox.NewID(), fmt.Sprintf("user%d@example.com", i)
		err := pgx.BeginFunc(ctx, service, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO users (id, email) VALUES ($1, $2)", id, email); err != nil {
				return err
			}
			return outbox.Write(ctx, tx, outbox.Event{Topic: "user.created", EventType: "user.created", AggregateType: "user",
				AggregateID: id, Payload: UserCreated{UserID: id, Email: email}})
		})
		if err != nil {
			t.Fatal(err)
		}
	}

	accounts := relaytest.Pool(t, accountsDB)
	args := []string{"-postgres-url", accountsDB, "-nats-url", natsURL}
	noEnv := func(string) string { return "" }

	// First run: every user gets an account.
	out1 := startConsumer(t, ctx, args, noEnv)
	relaytest.Eventually(t, 30*time.Second, "5 accounts", func() bool {
		var n int
		err := accounts.QueryRow(ctx, "SELECT count(*) FROM accounts").Scan(&n) // the consumer creates the table
		return err == nil && n == users
	})
	out1.stop()

	// Replay: the durable consumer is recreated and delivers every event
	// again; nothing is created twice.
	_, js := relaytest.JetStream(t, natsURL)
	if err := js.DeleteConsumer(ctx, "USERS", "accounts"); err != nil {
		t.Fatal(err)
	}
	out2 := startConsumer(t, ctx, args, noEnv)
	relaytest.Eventually(t, 30*time.Second, "the replay", func() bool { return strings.Count(out2.out.String(), ": duplicate") == users })
	out2.stop()

	n := count(t, accounts, "SELECT count(*) FROM accounts")
	distinct := count(t, accounts, "SELECT count(DISTINCT user_id) FROM accounts")
	records := count(t, accounts, "SELECT count(*) FROM walbox.processed_events WHERE consumer_group = 'accounts'")
	t.Logf("first run:\n%sreplay:\n%s", out1.out.String(), out2.out.String())
	t.Logf("%d users; accounts rows %d (distinct users %d); processed_events rows %d", users, n, distinct, records)
	if n != users || distinct != users || records != users {
		t.Errorf("want %d of each", users)
	}
	if c := count(t, accounts, "SELECT count(*) FROM accounts a JOIN walbox.processed_events p ON p.event_id = a.event_id"); c != users {
		t.Errorf("%d accounts match an idempotency record, want %d", c, users)
	}
}

type running struct {
	out  *relaytest.Buffer
	stop func()
}

func startConsumer(t *testing.T, ctx context.Context, args []string, env func(string) string) running {
	t.Helper()
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	out := &relaytest.Buffer{}
	go func() { done <- run(cctx, args, env, out) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("consumer: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return running{out: out, stop: stop}
}

func TestCreateAccountRejectsMalformedEvents(t *testing.T) {
	for _, data := range []string{`{"user_id": `, `{"email": "x@example.com"}`} {
		err := createAccount(context.Background(), nil, consumer.Message{ID: "e", Data: []byte(data)})
		if !consumer.IsPermanent(err) {
			t.Errorf("%s: %v, want a permanent error", data, err)
		}
	}
}

func TestConsumerFlags(t *testing.T) {
	env := map[string]string{"DATABASE_URL": "postgres://db", "ACCOUNTS_DATABASE_URL": "postgres://accounts", "NATS_URL": "nats://n:4222"}
	c, err := parseFlags([]string{"-stream", "ORDERS", "-subject", "orders.user.created"}, func(k string) string { return env[k] })
	if err != nil || c.PostgresURL != "postgres://accounts" || c.NATSURL != "nats://n:4222" || c.Stream != "ORDERS" || c.Subject != "orders.user.created" || c.Durable != "accounts" {
		t.Errorf("parseFlags = %+v, %v", c, err)
	}
	if _, err := parseFlags(nil, func(string) string { return "" }); err == nil {
		t.Error("no database URL: accepted")
	}
}

// TestCreateStreams: without walbox, -create-streams makes the streams the
// consumer needs, and leaves existing ones alone.
func TestCreateStreams(t *testing.T) {
	ctx := relaytest.Ctx(t)
	srv := natstest.New(t)
	_, js := relaytest.JetStream(t, srv.URL())
	for range 2 {
		if err := createStreams(ctx, js); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"USERS", "WALBOX_DLQ"} {
		if _, err := js.Stream(ctx, name); err != nil {
			t.Errorf("stream %s: %v", name, err)
		}
	}
}

func count(t *testing.T, pool *pgxpool.Pool, query string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), query).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}
