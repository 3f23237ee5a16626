package console

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
)

// offline is a console whose database and bus are unreachable: the
// actions are refused before either is asked.
func offline(t *testing.T, token string) *Console {
	t.Helper()
	cfg := config.Default()
	cfg.Postgres.URL = "postgres://walbox:s3cret-pw@127.0.0.1:1/db"
	cfg.NATS.URL = "nats://user:n4ts-pw@127.0.0.1:1"
	cfg.Console.Token = token
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c, err := New(ctx, Options{Config: cfg, SampleEvery: time.Hour, Live: &app.Live{Registry: prometheus.NewRegistry()}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func post(c *Console, body string, hdr map[string]string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1:9187/ui/api/dlq/retry", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		if v == "" {
			r.Header.Del(k)
		} else {
			r.Header.Set(k, v)
		}
	}
	w := httptest.NewRecorder()
	c.ServeHTTP(w, r)
	return w
}

func TestActionsAreRefusedWithoutTheTokenOrFromAnotherOrigin(t *testing.T) {
	c := offline(t, "right-token")
	for _, tc := range []struct {
		name   string
		hdr    map[string]string
		status int
		says   string
	}{
		{"no token", nil, http.StatusUnauthorized, "needs the console token"},
		{"wrong token", map[string]string{TokenHeader: "wrong-token"}, http.StatusUnauthorized, "wrong console token"},
		{"another origin", map[string]string{TokenHeader: "right-token", "Origin": "http://evil.example"}, http.StatusForbidden, "another origin"},
		{"cross-site fetch", map[string]string{TokenHeader: "right-token", "Sec-Fetch-Site": "cross-site"}, http.StatusForbidden, "cross-site"},
		{"a form's content type", map[string]string{TokenHeader: "right-token", "Content-Type": "application/x-www-form-urlencoded"}, http.StatusUnsupportedMediaType, "application/json"},
		{"empty selection", map[string]string{TokenHeader: "right-token", "Origin": "http://127.0.0.1:9187"}, http.StatusBadRequest, "say which dead letters"},
	} {
		body := `{"seqs":[1]}`
		if tc.name == "empty selection" {
			body = `{"seqs":[]}`
		}
		w := post(c, body, tc.hdr)
		if w.Code != tc.status || !strings.Contains(w.Body.String(), tc.says) {
			t.Errorf("%s: %d %s; want %d saying %q", tc.name, w.Code, w.Body.String(), tc.status, tc.says)
		}
	}
	// An action is a POST.
	r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1:9187/ui/api/dlq/retry?seqs=1", nil)
	r.Header.Set(TokenHeader, "right-token")
	w := httptest.NewRecorder()
	c.ServeHTTP(w, r)
	if w.Code != http.StatusMethodNotAllowed {
		t.Errorf("GET of an action: %d", w.Code)
	}
}

func TestConsoleWithoutATokenIsReadOnly(t *testing.T) {
	c := offline(t, "")
	w := post(c, `{"seqs":[1]}`, map[string]string{TokenHeader: "anything"})
	if w.Code != http.StatusForbidden || !strings.Contains(w.Body.String(), "read-only") {
		t.Errorf("action on a read-only console: %d %s", w.Code, w.Body.String())
	}
	r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1:9187/ui/", nil)
	pw := httptest.NewRecorder()
	c.ServeHTTP(pw, r)
	if pw.Code != http.StatusOK || !strings.Contains(pw.Body.String(), `data-readonly="true"`) || strings.Contains(pw.Body.String(), `id="token"`) {
		t.Errorf("read-only page: %d\n%s", pw.Code, pw.Body.String())
	}
}

func TestPageRendersNoSecretAndLoadsOnlyItsOwnAssets(t *testing.T) {
	c := offline(t, "right-token")
	for _, path := range []string{"/ui/", "/ui/api/overview", "/ui/static/app.js", "/ui/static/style.css"} {
		r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1:9187"+path, nil)
		w := httptest.NewRecorder()
		c.ServeHTTP(w, r)
		body := w.Body.String()
		if w.Code != http.StatusOK {
			t.Errorf("%s: %d %s", path, w.Code, body)
		}
		for _, secret := range []string{"s3cret-pw", "n4ts-pw", "right-token"} {
			if strings.Contains(body, secret) {
				t.Errorf("%s renders a secret (%s):\n%s", path, secret, body)
			}
		}
		if csp := w.Header().Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "script-src 'self'") {
			t.Errorf("%s: CSP %q", path, csp)
		}
	}
	// Air-gapped: no asset names another host.
	for _, name := range []string{"assets/index.html", "assets/static/app.js", "assets/static/style.css"} {
		b, err := assets.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if (strings.Contains(line, "http://") || strings.Contains(line, "https://")) && !strings.Contains(line, "http://www.w3.org/2000/svg") {
				t.Errorf("%s loads from another host: %s", name, strings.TrimSpace(line))
			}
		}
	}
}

func TestScrubHidesCredentialsInText(t *testing.T) {
	in := `cannot reach NATS at nats://user:pw@host:4222 and postgres://walbox:pw2@db/x failed; plain http://host/ok`
	out := scrub(in)
	if strings.Contains(out, ":pw@") || strings.Contains(out, "pw2") || !strings.Contains(out, "http://host/ok") {
		t.Errorf("scrub: %s", out)
	}
}

func TestTokenFileFirstLine(t *testing.T) {
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte("from-file\nsecond line\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := config.Default()
	cfg.Console.TokenFile = p
	if tok, err := ReadToken(cfg); err != nil || tok != "from-file" {
		t.Errorf("token %q, %v", tok, err)
	}
	cfg.Console.TokenFile = filepath.Join(t.TempDir(), "missing")
	if _, err := ReadToken(cfg); err == nil || !strings.Contains(err.Error(), "console.token_file") {
		t.Errorf("missing token file: %v", err)
	}
}

// The relay's publisher goroutine never waits for a viewer: a viewer that
// reads nothing is sent its budget and no more, the rest counted as not
// shown.
func TestSlowViewerSkipsEventsAndNeverBlocksTheRelay(t *testing.T) {
	h, err := newTailHub(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	h.offer(relay.Delivered{ID: "before-anyone"}) // no viewer: nothing copied
	slow := h.subscribe(tailFilter{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 3 * tailBuffer {
			h.offer(relay.Delivered{ID: "e", Seq: uint64(i + 1), Msg: &relay.Msg{Subject: "orders.x", Data: []byte(`{}`)}})
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("offer blocked on a viewer that reads nothing")
	}
	if got := len(slow.ch); got != tailPerFlush {
		t.Errorf("queue holds %d, want its budget %d", got, tailPerFlush)
	}
	if got := slow.skipped.Load(); got != 3*tailBuffer-tailPerFlush {
		t.Errorf("skipped %d, want %d", got, 3*tailBuffer-tailPerFlush)
	}
	if ev := <-slow.ch; ev.Seq != 1 || ev.Subject != "orders.x" {
		t.Errorf("first event %+v", ev)
	}
	h.unsubscribe(slow)
	if h.viewers.Load() != 0 {
		t.Error("viewer count after unsubscribe")
	}
}

// A viewer's filter is applied before its budget: one matching event among
// a thousand others offered in the same flush window reaches it, and the
// others neither spend the budget nor count as not shown.
func TestTailFilterIsAppliedBeforeTheBudget(t *testing.T) {
	h, err := newTailHub(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	f, err := newTailFilter("payments.>", "Needle")
	if err != nil {
		t.Fatal(err)
	}
	sub := h.subscribe(f)
	all := h.subscribe(tailFilter{})
	for i := range 1000 {
		h.offer(relay.Delivered{ID: fmt.Sprintf("o-%d", i), Stream: "ORDERS", Msg: &relay.Msg{Subject: "orders.created", Data: []byte(`{"needle":1}`)}})
		if i == 500 {
			h.offer(relay.Delivered{ID: "p-1", Stream: "PAYMENTS", Msg: &relay.Msg{Subject: "payments.settled", Data: []byte(`{"note":"a NEEDLE here"}`)}})
			h.offer(relay.Delivered{ID: "p-2", Stream: "PAYMENTS", Msg: &relay.Msg{Subject: "payments.settled", Data: []byte(`{"note":"none"}`)}})
		}
	}
	if got := len(sub.ch); got != 1 {
		t.Fatalf("filtered viewer holds %d events, want 1", got)
	}
	if ev := <-sub.ch; ev.ID != "p-1" {
		t.Errorf("filtered viewer got %s, want p-1", ev.ID)
	}
	if got := sub.skipped.Load(); got != 0 {
		t.Errorf("filtered viewer: %d not shown, want 0", got)
	}
	if got, want := all.skipped.Load(), uint64(1002-tailPerFlush); len(all.ch) != tailPerFlush || got != want {
		t.Errorf("unfiltered viewer: %d queued, %d not shown; want %d and %d", len(all.ch), got, tailPerFlush, want)
	}
}

// The relay's subject match is the page's (app.js subjectMatch), and the
// text match ignores case, looks at the id, subject and payload preview,
// and never matches what the page redacts.
func TestTailFilterMatchesAsThePageDoes(t *testing.T) {
	for _, c := range []struct {
		filter, subject string
		want            bool
	}{
		{"orders.>", "orders.created", true}, {"orders.>", "orders.a.b", true}, {"orders.>", "orders", false},
		{"orders.*", "orders.created", true}, {"orders.*", "orders.a.b", false}, {"orders", "orders", true},
		{"orders", "orders.created", false}, {"*", "", true}, {"*.created", "orders.created", true},
		{"orders.created", "orders.creat", false}, {">", "x", true}, {"a.b.c", "a.b", false},
	} {
		if got := subjectMatch(strings.Split(c.filter, "."), c.subject); got != c.want {
			t.Errorf("subjectMatch(%q, %q) = %v, want %v", c.filter, c.subject, got, c.want)
		}
	}
	d := relay.Delivered{ID: "0190-ABC", Stream: "ORDERS", Msg: &relay.Msg{Subject: "orders.created",
		Data: []byte(`{"Customer":"Zoë","hook":"https://user:s3cret@hooks.example/x"}` + strings.Repeat(" ", tailPreviewMax) + "beyond")}}
	for text, want := range map[string]bool{"abc": true, "ORDERS.CREATED": true, "customer": true, "zoë": true, "ZOË": true,
		"s3cret": false, "beyond": false, "missing": false, "": true} {
		f, err := newTailFilter("", text)
		if err != nil {
			t.Fatal(err)
		}
		if got := f.match(&d); got != want {
			t.Errorf("text %q: %v, want %v", text, got, want)
		}
	}
	if _, err := newTailFilter(strings.Repeat("x", tailFilterMax+1), ""); err == nil {
		t.Error("an overlong filter was taken")
	}
}

func TestLongPayloadPreviewIsCutAtARuneBoundary(t *testing.T) {
	data := []byte(strings.Repeat("é", tailPreviewMax)) // 2 bytes each
	ev := tailEvent(relay.Delivered{Msg: &relay.Msg{Data: data[:tailPreviewMax+1]}})
	if ev.Size != tailPreviewMax+1 || len(ev.Preview) != tailPreviewMax || !strings.HasSuffix(ev.Preview, "é") {
		t.Errorf("preview: size %d, %d bytes", ev.Size, len(ev.Preview))
	}
}

// The tail's hand-written JSON reads back as encoding/json reads it.
func TestTailEventJSONDecodesToWhatWasSent(t *testing.T) {
	at := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC)
	for _, s := range []string{"", "plain", `q"uote\back`, "new\nline\ttab\x01", "<script>&</script>", "héllo ✓ 😀", "bad \xff utf8", "\u2028sep\u2029"} {
		ev := TailEvent{ID: s, Subject: "orders.x", Stream: "ORDERS", Seq: 7, Partition: 2, Table: "public.outbox_events",
			CommitTime: at, AckedAt: at.Add(1500 * time.Microsecond), DeadLetter: true, Reason: s, Preview: s, Size: len(s)}
		b := ev.appendJSON(nil)
		var got map[string]any
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("%q: %v\n%s", s, err, b)
		}
		want := strings.ToValidUTF8(s, "\ufffd")
		if got["id"] != want || got["preview"] != want || got["reason"] != want || got["seq"] != 7.0 || got["commit_to_ack_ms"] != 1.5 || got["dead_letter"] != true {
			t.Errorf("%q: %s", s, b)
		}
		if strings.ContainsAny(string(b), "<>") {
			t.Errorf("%q: unescaped < or >: %s", s, b)
		}
	}
}

// BenchmarkTailOffer is what the relay's publisher goroutine pays per
// event with one viewer: "sent" for an event the viewer is sent (copied,
// queued and encoded), "over-budget" for one beyond its 200 a second
// (a filter match and a counter), "filtered" for one its filter drops.
func BenchmarkTailOffer(b *testing.B) {
	hdr := relay.Header{}
	for _, k := range []string{"Nats-Msg-Id", "Walbox-Commit-Lsn", "Walbox-Commit-Time", "Walbox-Source", "Walbox-Table", "Walbox-Txn-Index"} {
		hdr.Set(k, "some-value-0123456789")
	}
	m := &relay.Msg{Subject: "orders.created", Header: hdr, Data: []byte(strings.Repeat(`{"k":"v"},`, 20))}
	d := relay.Delivered{ID: "0190a1b2-0000-7000-8000-000000000001", Stream: "ORDERS", Seq: 1, CommitTime: time.Now(), AckedAt: time.Now(), Msg: m}
	b.Run("sent", func(b *testing.B) {
		h, _ := newTailHub(nil)
		sub := h.subscribe(tailFilter{})
		var buf []byte
		b.ReportAllocs()
		for b.Loop() {
			sub.budget.Store(tailPerFlush)
			h.offer(d)
			ev := <-sub.ch
			buf = ev.appendJSON(buf[:0])
		}
	})
	b.Run("over-budget", func(b *testing.B) {
		h, _ := newTailHub(nil)
		sub := h.subscribe(tailFilter{})
		sub.budget.Store(0)
		b.ReportAllocs()
		for b.Loop() {
			h.offer(d)
		}
	})
	b.Run("filtered", func(b *testing.B) {
		h, _ := newTailHub(nil)
		f, _ := newTailFilter("payments.>", "needle")
		h.subscribe(f)
		b.ReportAllocs()
		for b.Loop() {
			h.offer(d)
		}
	})
}
