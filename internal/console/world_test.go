package console_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/console"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/ports"
	"github.com/walbox/walbox/internal/relaytest"
	walboxsql "github.com/walbox/walbox/sql"
)

var pg *pgtest.Cluster // one cluster for the package, set by TestMain

// browser is the package's one headless Chromium; each test opens tabs in it.
var browser struct {
	once   sync.Once
	ctx    context.Context
	cancel context.CancelFunc
	err    error
}

func TestMain(m *testing.M) {
	code := pgtest.Main(m, &pg)
	if browser.cancel != nil {
		browser.cancel()
	}
	os.Exit(code)
}

// testToken is console.token in the tests' worlds.
const testToken = "t0ken-for-tests"

// chromium finds the browser: $WALBOX_CHROMIUM, else Debian's chromium on
// the PATH.
func chromium() (string, error) {
	if p := os.Getenv("WALBOX_CHROMIUM"); p != "" {
		return p, nil
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", errors.New("no Chromium found: the console's browser tests need Debian's chromium package (apt-get install chromium; .ci/run installs it), or WALBOX_CHROMIUM=/path/to/chrome")
}

// tab opens a new tab of the package's browser for t. A missing browser
// fails the test (it never skips): the console is tested in a real one.
func tab(t *testing.T) context.Context {
	t.Helper()
	browser.once.Do(func() {
		path, err := chromium()
		if err != nil {
			browser.err = err
			return
		}
		dir, err := os.MkdirTemp("", "walbox-chromium-")
		if err != nil {
			browser.err = err
			return
		}
		opts := append(chromedp.DefaultExecAllocatorOptions[:],
			chromedp.ExecPath(path),
			chromedp.UserDataDir(dir),
			chromedp.NoSandbox, // tests run as root in CI
			chromedp.DisableGPU,
			chromedp.Flag("disable-quic", true),
			chromedp.Flag("disable-component-update", true),
			chromedp.WindowSize(1400, 900),
		)
		alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
		bctx, cancelB := chromedp.NewContext(alloc)
		if err := chromedp.Do(bctx); err != nil {
			browser.err = fmt.Errorf("start %s: %w (the console's browser tests need a working Chromium: apt-get install chromium, which .ci/run does, or WALBOX_CHROMIUM=/path/to/chrome)", path, err)
		}
		browser.ctx = bctx
		browser.cancel = func() { cancelB(); cancelAlloc(); os.RemoveAll(dir) }
	})
	if browser.err != nil {
		t.Fatal(browser.err)
	}
	ctx, cancel := chromedp.NewContext(browser.ctx)
	ctx, cancelT := context.WithTimeout(ctx, 60*time.Second)
	t.Cleanup(func() { cancelT(); cancel() })
	return ctx
}

// world is one test's PostgreSQL database, JetStream server and walbox
// config, the console on a port reserved for the test (kept across relay
// restarts).
type world struct {
	t     *testing.T
	dbURL string
	nats  *natstest.Server
	cfg   config.Config
	base  string // http://127.0.0.1:port/ui/
}

func newWorld(t *testing.T, mutate ...func(*config.Config)) *world {
	t.Helper()
	w := &world{t: t, dbURL: pg.NewDB(t), nats: natstest.New(t)}
	res, err := ports.Reserve(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(res.Release)
	pc, err := pgx.ParseConfig(w.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg := config.Default()
	cfg.Postgres.URL = w.dbURL
	cfg.Postgres.Slot = pc.Database
	cfg.Postgres.StatusInterval = time.Second
	cfg.NATS.URL = w.nats.URL()
	cfg.NATS.Streams = []config.Stream{
		{Name: "ORDERS", Subjects: []string{"orders.>"}},
		{Name: "PAYMENTS", Subjects: []string{"payments.>"}},
	}
	cfg.Retry.Initial, cfg.Retry.Max = 100*time.Millisecond, time.Second
	cfg.Metrics.Listen = "127.0.0.1:" + strconv.Itoa(res.Ports[0])
	cfg.Log.Format = "json"
	cfg.Console.Token = testToken
	for _, f := range mutate {
		f(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	w.cfg = cfg
	w.base = "http://" + cfg.Metrics.Listen + "/ui/"
	relaytest.Migrate(t, w.dbURL, walboxsql.Params{Publication: cfg.Postgres.Publication})
	return w
}

// relayRun is `walbox run` in-process, its console attached.
type relayRun struct {
	cancel context.CancelFunc
	done   chan error
}

// startRelay runs the relay with its console as walbox run does, until
// the test ends or stop.
func (w *world) startRelay() *relayRun {
	w.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	log := zerolog.New(zerolog.NewTestWriter(w.t)).Level(zerolog.WarnLevel)
	ready := make(chan struct{})
	opts, err := console.Attach(ctx, console.Options{Config: w.cfg, Log: log, SampleEvery: 250 * time.Millisecond, Version: "test"},
		app.Options{Ready: ready})
	if err != nil {
		cancel()
		w.t.Fatal(err)
	}
	r := &relayRun{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- app.Run(ctx, w.cfg, log, opts) }()
	w.t.Cleanup(r.stop)
	select {
	case <-ready:
	case err := <-r.done:
		w.t.Fatalf("relay exited at start: %v", err)
	case <-time.After(30 * time.Second):
		w.t.Fatal("relay did not stream within 30 s")
	}
	// The listener serves once Run has passed its start.
	relaytest.Eventually(w.t, 10*time.Second, "the console to answer", func() bool {
		resp, err := http.Get(w.base)
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == http.StatusOK
	})
	return r
}

func (r *relayRun) stop() {
	if r.cancel == nil {
		return
	}
	r.cancel()
	r.cancel = nil
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
	}
}

// insert commits one outbox row and returns its id.
func (w *world) insert(topic, payload string) string {
	w.t.Helper()
	var id string
	relaytest.WithConn(w.t, w.dbURL, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `INSERT INTO outbox_events (topic, payload) VALUES ($1, $2) RETURNING id::text`, topic, payload).Scan(&id)
	})
	return id
}

// artifacts is where the screenshots go: $WALBOX_ARTIFACTS, else a
// directory under the repository's ignored artifacts/.
func artifacts(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("WALBOX_ARTIFACTS")
	if dir == "" {
		_, file, _, _ := runtime.Caller(0)
		dir = filepath.Join(filepath.Dir(file), "..", "..", "artifacts", "console")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// readmeShots are the screenshots README shows.
var readmeShots = map[string]bool{"overview": true, "tail": true, "dlq": true, "doctor": true}

// screenshot saves the page as name.png among the artifacts and, with
// WALBOX_UPDATE_SCREENSHOTS=1, in docs/console for the README.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	dirs := []string{artifacts(t)}
	if os.Getenv("WALBOX_UPDATE_SCREENSHOTS") == "1" && readmeShots[name] {
		_, file, _, _ := runtime.Caller(0)
		dirs = append(dirs, filepath.Join(filepath.Dir(file), "..", "..", "docs", "console"))
	}
	for _, dir := range dirs {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, name+".png")
		if err := os.WriteFile(p, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot: %s", p)
	}
}

// waitJS polls a JavaScript expression in the page until it is true.
func waitJS(t *testing.T, ctx context.Context, timeout time.Duration, what, expr string) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](expr))
		if err == nil && ok {
			return time.Since(start)
		}
		if time.Since(start) > timeout {
			body, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector("main").innerText.slice(0, 2000)`))
			t.Fatalf("timed out after %v waiting for %s (%s; last error %v); the page shows:\n%s", timeout, what, expr, err, body)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// text is the text of the element matching sel.
func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](fmt.Sprintf(`(document.querySelector(%q) || {}).innerText || ""`, sel)))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(s)
}

// run runs the browser actions in order.
func run(t *testing.T, ctx context.Context, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	if err := chromedp.Do(ctx, actions...); err != nil {
		t.Fatal(err)
	}
}

// click clicks the element matching sel with the mouse.
func click(sel string) chromedp.Action[chromedp.Void] { return chromedp.Click(chromedp.CSS(sel)) }

// typeInto types v into the input matching sel.
func typeInto(sel, v string) chromedp.Action[chromedp.Void] {
	return chromedp.SendKeys(chromedp.CSS(sel), v)
}

// setInput replaces the value of the input matching sel, as typing does
// (an input event).
func setInput(sel, v string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		_, err := chromedp.Evaluate[any](fmt.Sprintf(`(() => { const e = document.querySelector(%q); e.value = %q; e.dispatchEvent(new Event("input")); })()`, sel, v))(ctx, t)
		return err
	})
}

// js runs a script in the page.
func js(expr string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		_, err := chromedp.Evaluate[any](expr)(ctx, t)
		return err
	})
}

// navigate opens url in the tab.
func navigate(url string) chromedp.Action[chromedp.Void] { return chromedp.Navigate(url) }

// contextWithTimeout is the test's context, bounded by d.
func contextWithTimeout(t *testing.T, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(t.Context(), d)
}
