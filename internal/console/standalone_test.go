package console_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/console"
	"github.com/walbox/walbox/internal/relaytest"
)

// walbox console: the pages without a relay in the process read what the
// running relay wrote (here: the relay of another "process", an app.Run of
// its own), and say that the live tail is walbox run's.
func TestStandaloneConsoleReadsWhatTheRelayWrote(t *testing.T) {
	t.Parallel()
	w := newWorld(t, func(c *config.Config) { c.Console.Token = "" })
	w.startRelay()
	w.insert("orders.created", `{"n": 1}`)
	c, err := console.New(t.Context(), console.Options{Config: w.cfg, Log: zerolog.Nop(), SampleEvery: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	defer srv.Close()
	get := func(path string) (int, string) {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	relaytest.Eventually(t, 15*time.Second, "the overview to show the relay running and the slot", func() bool {
		_, body := get("/ui/api/overview")
		var ov struct {
			Report *struct {
				Relay      struct{ State string }
				SlotStatus struct {
					Exists, Active bool
				} `json:"replication_slot"`
			}
			Relay bool
		}
		return json.Unmarshal([]byte(body), &ov) == nil && ov.Report != nil && ov.Report.Relay.State == "running" &&
			ov.Report.SlotStatus.Exists && ov.Report.SlotStatus.Active && !ov.Relay
	})
	if code, body := get("/ui/api/tail"); code != http.StatusNotFound || !strings.Contains(body, "walbox run") {
		t.Errorf("tail without a relay: %d %s", code, body)
	}
	if code, body := get("/ui/"); code != http.StatusOK || !strings.Contains(body, "no relay") || !strings.Contains(body, "read-only") {
		t.Errorf("page: %d", code)
	}
	if code, body := get("/ui/api/dlq"); code != http.StatusOK || !strings.Contains(body, `"dead_letters":[]`) {
		t.Errorf("dead letters: %d %s", code, body)
	}
}
