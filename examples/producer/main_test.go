package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestProducer runs the example against a real database, JetStream and the
// relay: each created user yields one user.created message; a user that
// cannot be created yields none.
//
// It is the package's one test with a database: it starts a PostgreSQL
// cluster of its own.
func TestProducer(t *testing.T) {
	ctx := relaytest.Ctx(t)
	_, dbURL := pgtest.OwnDB(ctx, t)
	js := startWalbox(t, dbURL)
	env := func(string) string { return "" }

	var out bytes.Buffer
	if err := run(ctx, []string{"-postgres-url", dbURL, "-email", "ada@example.com", "-n", "2"}, env, &out); err != nil {
		t.Fatal(err)
	}
	t.Logf("producer printed:\n%s", out.String())
	if strings.Count(out.String(), "created; event") != 3 {
		t.Fatalf("want 3 users")
	}
	// The email is taken: no user, no event.
	if err := run(ctx, []string{"-postgres-url", dbURL, "-email", "ada@example.com"}, env, &out); err == nil || !strings.Contains(err.Error(), "create user ada@example.com") {
		t.Fatalf("second ada: %v", err)
	}
	out.Reset()
	if err := run(ctx, []string{"-postgres-url", dbURL, "-email", "last@example.com"}, env, &out); err != nil {
		t.Fatal(err)
	}

	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	users := map[string]string{} // id -> email
	rows, err := conn.Query(ctx, "SELECT id, email FROM users")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, email string
		if err := rows.Scan(&id, &email); err != nil {
			t.Fatal(err)
		}
		users[id] = email
	}
	if len(users) != 4 {
		t.Fatalf("%d users, want 4", len(users))
	}

	var got []UserCreated
	for _, m := range relaytest.CollectN(t, js, "USERS", jetstream.OrderedConsumerConfig{}, 30*time.Second, 4) {
		var ev UserCreated
		if err := json.Unmarshal(m.Data(), &ev); err != nil {
			t.Fatal(err)
		}
		if users[ev.UserID] != ev.Email || m.Headers().Get("Walbox-Aggregate-Id") != ev.UserID ||
			m.Headers().Get("Walbox-Event-Type") != "user.created" || m.Subject() != "user.created" {
			t.Errorf("message %s %s %v does not match a user", m.Subject(), m.Data(), m.Headers())
		}
		got = append(got, ev)
	}
	if got[3].Email != "last@example.com" {
		t.Errorf("4th event is for %s: the failed user produced an event", got[3].Email)
	}
	// The relay publishes in commit order: with the last user's event
	// stored, so is every event committed before it.
	st, err := js.Stream(ctx, "USERS")
	if err != nil {
		t.Fatal(err)
	}
	if n := st.CachedInfo().State.Msgs; n != 4 {
		t.Errorf("stream USERS holds %d messages, want 4", n)
	}
}

func TestProducerFlags(t *testing.T) {
	env := func(k string) string {
		if k == "DATABASE_URL" {
			return "postgres://from-env"
		}
		return ""
	}
	c, err := parseFlags([]string{"-n", "2", "-topic", "orders.user.created"}, env)
	if err != nil || c.PostgresURL != "postgres://from-env" || len(c.Emails) != 2 || c.Topic != "orders.user.created" {
		t.Errorf("parseFlags = %+v, %v", c, err)
	}
	if _, err := parseFlags(nil, env); err == nil {
		t.Error("no users to create: accepted")
	}
	if _, err := parseFlags([]string{"-n", "1"}, func(string) string { return "" }); err == nil {
		t.Error("no database URL: accepted")
	}
}

// startWalbox migrates the database and runs the relay in-process with a
// USERS stream, until the test ends.
func startWalbox(t *testing.T, dbURL string) jetstream.JetStream {
	t.Helper()
	srv := natstest.New(t)
	relaytest.StartUsersRelay(t, dbURL, srv.URL())
	_, js := relaytest.JetStream(t, srv.URL())
	return js
}
