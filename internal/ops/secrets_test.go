package ops

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/relaytest"
)

// TestSecretsNeverShown runs the relay and every command with a PostgreSQL
// password in the URL and a NATS user and password, then with wrong ones,
// and checks that no log line, error or output carries either password.
func TestSecretsNeverShown(t *testing.T) {
	const pgSecret = "pg-S3cret-in-url"
	const natsSecret = "nats-S3cret-pw"
	withPassword := func(c *config.Config) {
		u, _ := url.Parse(c.Postgres.URL)
		u.User = url.UserPassword(u.User.Username(), pgSecret)
		c.Postgres.URL = u.String()
		c.NATS.User, c.NATS.Password = "walbox", natsSecret
		c.Log.Level = "debug"
	}
	auth := func(o *server.Options) { o.Username, o.Password = "walbox", natsSecret }
	e := newEnvWithNATS(t, []natstest.Option{auth}, withPassword)
	e.logLevel = zerolog.DebugLevel
	ctx := testCtx(t)
	if !strings.Contains(e.cfg.Postgres.URL, pgSecret) {
		t.Fatalf("the test's URL has no password: %s", e.cfg.Postgres.URL)
	}

	var shown bytes.Buffer // everything a person or a log collector would see
	record := func(what string, err error) {
		if err != nil {
			fmt.Fprintf(&shown, "%s error: %v\n", what, err)
		}
	}

	r := e.startRelay()
	e.insert("orders.created", `{"n":1}`)
	e.insert("unrouted.x", `{"n":2}`)
	e.waitMsgs("ORDERS", 1)
	e.waitMsgs("WALBOX_DLQ", 1)

	relaytest.Eventually(t, 60*time.Second, "status to show the relay running (or fail)", func() bool {
		rep, err := Status(ctx, e.cfg)
		record("status", err)
		if err != nil {
			return true
		}
		if rep.Relay.State == "running" {
			rep.Print(&shown)
			record("status json", rep.PrintJSON(&shown))
			return true
		}
		return false
	})
	drep := Doctor(ctx, e.cfg)
	if c := checkOf(t, drep, "nats.connect"); c.Status != OK {
		t.Errorf("doctor cannot connect with user and password: %+v", c)
	}
	drep.Print(&shown)
	record("doctor json", drep.PrintJSON(&shown))
	srep, err := SlotStatus(ctx, e.cfg)
	record("slot status", err)
	srep.Print(&shown)
	dls, total, err := DLQList(ctx, e.cfg, 0)
	record("dlq list", err)
	PrintDeadLetters(&shown, dls, total, "WALBOX_DLQ")
	_, err = Tail(ctx, e.cfg, TailOptions{Subject: "orders.>", Since: time.Hour, Limit: 1}, &shown)
	record("tail", err)
	res, err := Replay(ctx, e.cfg, ReplayOptions{From: time.Now().Add(-time.Hour), To: time.Now().Add(time.Minute), DryRun: true})
	record("replay", err)
	if res != nil {
		res.Print(&shown)
	}
	r.stop(t)
	fmt.Fprintln(&shown, r.log.String())
	if !strings.Contains(r.log.String(), "walbox relay starting") {
		t.Errorf("relay log has no start line:\n%s", r.log.String())
	}

	// Wrong credentials and unreachable servers: the errors name the
	// target, not the password.
	bad := e.cfg
	bad.NATS.Password = natsSecret + "-wrong"
	drep = Doctor(ctx, bad)
	if c := checkOf(t, drep, "nats.connect"); c.Status != Fail {
		t.Errorf("doctor with a wrong NATS password: %+v", c)
	}
	drep.Print(&shown)
	_, err = Tail(ctx, bad, TailOptions{Subject: "orders.>", Limit: 1}, &shown)
	record("tail, wrong password", err)
	_, _, err = DLQList(ctx, bad, 0)
	record("dlq list, wrong password", err)
	inURL := e.cfg
	inURL.NATS.User, inURL.NATS.Password = "", ""
	inURL.NATS.URL = strings.Replace(e.nats.URL(), "nats://", "nats://walbox:"+natsSecret+"-wrong@", 1)
	_, _, err = DLQList(ctx, inURL, 0)
	record("dlq list, password in the NATS URL", err)
	drep = Doctor(ctx, inURL)
	drep.Print(&shown)

	// The relay itself with a wrong NATS password and a NATS URL with
	// credentials, for two seconds: whatever it logs.
	var relayLog relaytest.Buffer
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	err = app.Run(rctx, inURL, zerolog.New(&relayLog).Level(zerolog.DebugLevel), app.Options{})
	cancel()
	record("relay, wrong NATS password", err)
	fmt.Fprintln(&shown, relayLog.String())

	badPG := e.cfg
	badPG.Postgres.URL = strings.Replace(e.cfg.Postgres.URL, fmt.Sprint(pg.Port()), "1", 1)
	_, err = Status(ctx, badPG)
	record("status, PostgreSQL down", err)
	_, err = SlotStatus(ctx, badPG)
	record("slot status, PostgreSQL down", err)
	Doctor(ctx, badPG).Print(&shown)

	out := shown.String()
	for _, secret := range []string{pgSecret, natsSecret} {
		if strings.Contains(out, secret) {
			i := strings.Index(out, secret)
			t.Errorf("%q shown:\n...%s...", secret, out[max(i-300, 0):min(i+100, len(out))])
		}
	}
	// It did see the things around them.
	mustContain(t, "what was shown", out, "walbox:xxxxx@127.0.0.1", "postgres@127.0.0.1", "Authorization Violation")
}
