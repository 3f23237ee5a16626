package ops

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestGrantsRecipeRunsTheRelay applies the printed recipe and runs doctor and
// the relay as the role it creates.
func TestGrantsRecipeRunsTheRelay(t *testing.T) {
	e := newEnv(t, func(c *config.Config) {
		c.Postgres.CreatePublication = false
		c.Archive.After = 0 // partition upkeep needs ownership; the recipe says so
	})
	ctx := testCtx(t)
	role := uniqueName(t, "walbox_least")
	sql := Grants(e.cfg, role)
	for _, want := range []string{"CREATE ROLE " + `"` + role + `"` + " LOGIN REPLICATION", "GRANT SELECT ON \"public\".\"outbox_events\"",
		"GRANT UPDATE (processed, processed_at, error, attempts)", "GRANT USAGE ON SCHEMA walbox", "walbox.relay_status",
		"create_publication: false", "host", "replication"} {
		if !strings.Contains(sql, want) {
			t.Errorf("recipe lacks %q:\n%s", want, sql)
		}
	}
	conn := relaytest.Conn(t, e.dbURL)
	if _, err := conn.PgConn().Exec(ctx, sql).ReadAll(); err != nil {
		t.Fatalf("the recipe does not run: %v\n%s", err, sql)
	}
	t.Cleanup(func() {
		e.exec(`DROP OWNED BY "` + role + `"`)
		e.exec(`DROP ROLE "` + role + `"`)
	})

	u, _ := url.Parse(e.dbURL)
	u.User = url.User(role)
	e.cfg.Postgres.URL = u.String()
	rep := Doctor(ctx, e.cfg)
	for _, name := range []string{"postgres.role", "postgres.replication_connection", "postgres.outbox_privileges", "postgres.publication", "postgres.walbox_schema"} {
		wantCheck(t, rep, name, OK, "")
	}
	if !rep.OK {
		t.Errorf("doctor as the least-privilege role failed: %+v", rep.Checks)
	}

	e.startRelay()
	id := e.insert("orders.created", `{"least":"privilege"}`)
	e.waitMsgs("ORDERS", 1)
	if got := e.streamIDs("ORDERS"); len(got) != 1 || got[0] != id {
		t.Fatalf("ORDERS: %v", got)
	}
	// The sweeper marks the row as the role.
	relaytest.Eventually(t, 60*time.Second, "the row marked processed by the least-privilege role", func() bool {
		var done bool
		if err := conn.QueryRow(ctx, "SELECT processed FROM outbox_events WHERE id = $1", id).Scan(&done); err != nil {
			t.Fatal(err)
		}
		return done
	})
	// relay_status is written by the role, too.
	relaytest.Eventually(t, 60*time.Second, "relay_status written by the role", func() bool {
		rep, err := Status(ctx, e.cfg)
		if err != nil {
			t.Fatal(err)
		}
		return rep.Relay.State == "running"
	})
	_ = context.Background
}
