package ops

import (
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// walbox status counts, per stream (topic), this source's events whose
// positions, of this server's system and timeline, its WAL has not reached:
// events of a history the database lost (a restore from a snapshot; the
// end-to-end TestCrashConsistentRestore makes a real one). One such event
// and one of the present history go in; status counts the first only.
func TestStatusCountsEventsOfALostHistory(t *testing.T) {
	for _, sink := range []string{"nats", "kafka"} {
		t.Run(sink, func(t *testing.T) {
			var e *env
			if sink == "kafka" {
				e = newKafkaEnv(t).env
			} else {
				e = newEnv(t)
			}
			ctx := testCtx(t)
			r := e.startRelay() // creates the streams (topics)
			r.stop(t)
			origin, err := cdc.IdentifyServer(ctx, e.cfg.Postgres.URL)
			if err != nil {
				t.Fatal(err)
			}
			msg := func(id string, lsn cdc.LSN) relay.Header {
				return relay.Header{relay.HeaderMsgID: {id}, relay.HeaderSource: {source(e.cfg)},
					relay.HeaderSystemID: {origin.SystemID}, relay.HeaderTimeline: {strconv.Itoa(int(origin.Timeline))},
					relay.HeaderCommitLSN: {lsn.String()}, relay.HeaderIndex: {"0"}}
			}
			headers := []relay.Header{msg("present", origin.WALPos-1), msg("lost", origin.WALPos+1<<32)}
			stream := "ORDERS"
			if sink == "kafka" {
				stream = "orders.created"
				sc, err := e.cfg.KafkaSinkConfig(replayWindow)
				if err != nil {
					t.Fatal(err)
				}
				ks, err := kafkasink.New(sc)
				if err != nil {
					t.Fatal(err)
				}
				defer ks.Close()
				for _, h := range headers {
					f, err := ks.Publish(&relay.Msg{Subject: stream, Key: "k", Header: h, Data: []byte(`{}`)})
					if err != nil {
						t.Fatal(err)
					}
					if _, err := relay.Await(ctx, f); err != nil {
						t.Fatal(err)
					}
				}
			} else {
				js := e.connectJS()
				for _, h := range headers {
					if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: "orders.created", Header: nats.Header(h), Data: []byte(`{}`)}); err != nil {
						t.Fatal(err)
					}
				}
			}
			rep, err := Status(ctx, e.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if len(rep.LostHistory) != 1 || rep.LostHistory[0].Stream != stream || rep.LostHistory[0].Messages != 1 {
				t.Fatalf("lost history %+v (errors %v), want %s: 1", rep.LostHistory, rep.Errors, stream)
			}
			var out strings.Builder
			rep.Print(&out)
			if !strings.Contains(out.String(), "lost history") || !strings.Contains(out.String(), stream+": 1 events") {
				t.Fatalf("status does not print the lost history:\n%s", out.String())
			}
		})
	}
}
