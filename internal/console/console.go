// Package console is walbox's web console: Overview (slot, WAL, lag and
// events/s over the last hour, unprocessed rows, sink health, maintenance),
// Live tail, Dead letters (list, detail, retry) and Doctor, served at /ui/
// on the metrics listener by `walbox run`, or alone by `walbox console`.
//
// It keeps no figures of its own: every page shows what a walbox command
// computes (internal/ops: status, dlq list and retry, doctor), and the live
// tail is the relay's ack path (relay.Config.OnDelivered) fanned out
// without waiting. Every asset is embedded: it works air-gapped.
//
// Security: it binds where the metrics bind (loopback by default). Pages
// and their reads need nothing; an action that changes something (dlq
// retry) is a POST whose X-Walbox-Token header matches console.token
// (compared in constant time), from the console's own origin, with a JSON
// body; with no token configured the console is read-only. No cookie is
// used, so a page of another site cannot act with the operator's
// credentials. Addresses are shown redacted (internal/redact).
package console

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/ops"
	"github.com/walbox/walbox/internal/redact"
	"github.com/walbox/walbox/relay"
)

//go:embed assets
var assets embed.FS

// TokenHeader carries console.token on an action.
const TokenHeader = "X-Walbox-Token"

// DefaultSampleEvery is how often the Overview reads walbox status.
const DefaultSampleEvery = 5 * time.Second

// dlqLimit is the most dead letters the Dead letters page lists.
const dlqLimit = 500

// Options configure a console.
type Options struct {
	Config config.Config
	// Live is what the running relay knows; nil for `walbox console`
	// (no relay in this process: no live tail, no readiness).
	Live *app.Live
	Log  zerolog.Logger
	// SampleEvery is how often the Overview samples (DefaultSampleEvery).
	SampleEvery time.Duration
	// Version is shown in the page's footer.
	Version string
}

// Console serves the web console.
type Console struct {
	opts    Options
	token   []byte // sha256 of console.token; nil: read-only
	page    *template.Template
	static  http.Handler
	sampler *sampler
	hub     *tailHub
}

// ReadToken is console.token, or the first line of console.token_file.
func ReadToken(cfg config.Config) (string, error) {
	if cfg.Console.TokenFile == "" {
		return cfg.Console.Token, nil
	}
	b, err := os.ReadFile(cfg.Console.TokenFile)
	if err != nil {
		return "", &config.Error{Key: "console.token_file", Msg: fmt.Sprintf("cannot read it: %v", err)}
	}
	tok, _, _ := strings.Cut(string(b), "\n")
	tok = strings.TrimSpace(tok)
	if tok == "" {
		return "", &config.Error{Key: "console.token_file", Msg: "the file's first line is empty"}
	}
	return tok, nil
}

// New makes the console; its sampler runs until ctx ends.
func New(ctx context.Context, opts Options) (*Console, error) {
	tok, err := ReadToken(opts.Config)
	if err != nil {
		return nil, err
	}
	if opts.SampleEvery <= 0 {
		opts.SampleEvery = DefaultSampleEvery
	}
	page, err := template.ParseFS(assets, "assets/index.html")
	if err != nil {
		return nil, fmt.Errorf("parse the console's page: %w", err)
	}
	static, err := fs.Sub(assets, "assets/static")
	if err != nil {
		return nil, err
	}
	c := &Console{opts: opts, page: page, sampler: newSampler(opts.Config, opts.SampleEvery, gatherer(opts.Live)),
		static: http.StripPrefix("/ui/static/", http.FileServerFS(static))}
	if tok != "" {
		sum := sha256.Sum256([]byte(tok))
		c.token = sum[:]
	}
	if opts.Live != nil {
		if c.hub, err = newTailHub(opts.Live.Registry); err != nil {
			return nil, fmt.Errorf("register the console's metrics: %w", err)
		}
	}
	go c.sampler.run(ctx)
	return c, nil
}

// Attach sets opts (for app.Run) up to serve the console on the metrics
// listener when console.enabled, its live tail fed by the relay's acks. The
// token file is read now: an unreadable one fails the start.
func Attach(ctx context.Context, o Options, opts app.Options) (app.Options, error) {
	cfg := o.Config
	if !cfg.Console.Enabled || cfg.Metrics.Listen == "" {
		return opts, nil
	}
	tok, err := ReadToken(cfg)
	if err != nil {
		return opts, err
	}
	var ui atomic.Pointer[Console]
	next := opts.OnDelivered
	opts.OnDelivered = func(d relay.Delivered) {
		if c := ui.Load(); c != nil {
			c.OnDelivered(d)
		}
		if next != nil {
			next(d)
		}
	}
	opts.Console = func(live app.Live) http.Handler {
		o := o
		o.Live = &live
		c, err := New(ctx, o)
		if err != nil {
			o.Log.Error().Err(err).Msg("web console not served")
			return nil
		}
		ui.Store(c)
		o.Log.Info().Str("url", "http://"+cfg.Metrics.Listen+"/ui/").Bool("read_only", tok == "").Msg("web console")
		return c
	}
	return opts, nil
}

func gatherer(l *app.Live) prometheus.Gatherer {
	if l == nil {
		return nil
	}
	return l.Gatherer
}

// OnDelivered feeds the live tail; pass it to the relay (it never blocks).
func (c *Console) OnDelivered(d relay.Delivered) {
	if c.hub != nil {
		c.hub.offer(d)
	}
}

// ServeHTTP serves /ui/ and below.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	// Everything the page loads is its own: no CDN, no inline script.
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("X-Frame-Options", "DENY")
	if !c.hostAllowed(r.Host) {
		http.Error(w, "walbox console: refused: it answers under an IP address, localhost or a name in console.allowed_hosts, not "+r.Host, http.StatusMisdirectedRequest)
		return
	}
	path := strings.TrimPrefix(r.URL.Path, "/ui")
	switch {
	case path == "/" || path == "":
		c.index(w, r)
	case strings.HasPrefix(path, "/static/"):
		c.static.ServeHTTP(w, r)
	case path == "/api/overview":
		c.get(w, r, c.overview)
	case path == "/api/tail":
		c.tail(w, r)
	case path == "/api/event":
		c.get(w, r, c.event)
	case path == "/api/row":
		c.get(w, r, c.row)
	case path == "/api/dlq":
		c.get(w, r, c.dlq)
	case path == "/api/dlq/retry":
		c.action(w, r, c.retry)
	case path == "/api/doctor":
		c.get(w, r, c.doctor)
	default:
		http.NotFound(w, r)
	}
}

func (c *Console) index(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	cfg := c.opts.Config
	data := map[string]any{
		"ReadOnly": c.token == nil,
		"Relay":    c.opts.Live != nil,
		"Sink":     cfg.Sink,
		"Slot":     cfg.Postgres.Slot,
		"Postgres": redact.PostgresURL(cfg.Postgres.URL),
		"Bus":      busAddress(cfg),
		"Version":  c.opts.Version,
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := c.page.Execute(w, data); err != nil {
		c.opts.Log.Warn().Err(err).Msg("console: render the page")
	}
}

// busAddress is the bus's address, redacted.
func busAddress(cfg config.Config) string {
	if cfg.Sink == config.SinkKafka {
		return redact.URL(strings.Join(cfg.Kafka.Brokers, ","))
	}
	return app.RedactNATSURL(cfg.NATS.URL)
}

// get answers a read: JSON of what fn returns, its secrets redacted.
func (c *Console) get(w http.ResponseWriter, r *http.Request, fn func(*http.Request) (any, error)) {
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", "GET")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	v, err := fn(r)
	if err != nil {
		c.writeError(w, err)
		return
	}
	c.writeJSON(w, http.StatusOK, v)
}

// writeError answers err: its status when it is an httpError, else 502
// (what the console asked, the database or the bus, failed).
func (c *Console) writeError(w http.ResponseWriter, err error) {
	status := http.StatusBadGateway
	var he *httpError
	if errors.As(err, &he) {
		status = he.status
	}
	c.writeJSON(w, status, map[string]string{"error": err.Error()})
}

// urlInText finds URLs with credentials in free text (an error message).
var urlInText = regexp.MustCompile(`[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/@"]+@[^\s"]+`)

// scrub hides every credential of a URL in text: no secret is rendered,
// whatever an error message quoted.
func scrub(text string) string {
	if !strings.Contains(text, "://") {
		return text // most answers, and every event without a URL: no regexp
	}
	return urlInText.ReplaceAllStringFunc(text, redact.URL)
}

func (c *Console) writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"error":"encode the answer"}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, scrub(string(b)))
}

// overviewAnswer is the Overview page's data.
type overviewAnswer struct {
	Report    *ops.StatusReport      `json:"report"`
	Error     string                 `json:"error,omitempty"`
	SampledAt time.Time              `json:"sampled_at,omitzero"`
	Every     float64                `json:"sample_every_seconds"`
	History   []Sample               `json:"history"`
	Relay     bool                   `json:"relay"` // served by walbox run
	Ready     *readiness             `json:"ready,omitempty"`
	Maint     []app.TableMaintenance `json:"maintenance,omitempty"`
	Sink      string                 `json:"sink"`
	Viewers   int32                  `json:"tail_viewers"`
}

type readiness struct {
	OK  bool   `json:"ok"`
	Why string `json:"why"`
}

func (c *Console) overview(*http.Request) (any, error) {
	c.sampler.look()
	rep, errText, at, pts := c.sampler.snapshot()
	a := overviewAnswer{Report: rep, Error: errText, SampledAt: at, History: pts, Every: c.opts.SampleEvery.Seconds(),
		Relay: c.opts.Live != nil, Sink: c.opts.Config.Sink}
	if pts == nil {
		a.History = []Sample{}
	}
	if l := c.opts.Live; l != nil {
		if l.Ready != nil {
			ok, why := l.Ready()
			a.Ready = &readiness{OK: ok, Why: why}
		}
		if l.Maintenance != nil {
			a.Maint = l.Maintenance()
		}
	}
	if c.hub != nil {
		a.Viewers = c.hub.viewers.Load()
	}
	return a, nil
}

func (c *Console) row(r *http.Request) (any, error) {
	q := r.URL.Query()
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	row, err := ops.EventRow(ctx, c.opts.Config, q.Get("table"), q.Get("id"))
	if err != nil {
		return nil, err
	}
	return map[string]any{"row": row}, nil
}

func (c *Console) dlq(r *http.Request) (any, error) {
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	dls, total, terms, name, err := ops.DLQView(ctx, c.opts.Config, dlqLimit)
	if err != nil {
		return nil, fmt.Errorf("read the dead letters: %w", err)
	}
	if dls == nil {
		dls = []ops.ConsoleDeadLetter{}
	}
	return map[string]any{"dead_letters": dls, "total": total, "name": name, "terms": terms,
		"read_only": c.token == nil, "now": time.Now()}, nil
}

func (c *Console) doctor(r *http.Request) (any, error) {
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	return ops.Doctor(ctx, c.opts.Config), nil
}

// retryRequest is the body of POST /ui/api/dlq/retry.
type retryRequest struct {
	Seqs []uint64 `json:"seqs"`
}

func (c *Console) retry(r *http.Request) (any, error) {
	var req retryRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
		return nil, &httpError{http.StatusBadRequest, "the body must be JSON: {\"seqs\": [1, 2]}"}
	}
	if len(req.Seqs) == 0 {
		return nil, &httpError{http.StatusBadRequest, "say which dead letters to retry: {\"seqs\": [1, 2]}"}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Minute)
	defer cancel()
	var out strings.Builder
	res, err := ops.DLQRetry(ctx, c.opts.Config, ops.DLQRetryOptions{Seqs: req.Seqs, Yes: true, Out: &out})
	c.opts.Log.Info().Uints64("seqs", req.Seqs).Str("from", r.RemoteAddr).Msg("console: dlq retry")
	answer := map[string]any{"result": res, "output": strings.Split(strings.TrimSpace(out.String()), "\n")}
	if err != nil {
		if errors.Is(err, ops.ErrDLQRetryRunning) {
			return nil, &httpError{http.StatusConflict, err.Error()}
		}
		answer["error"] = err.Error()
	}
	return answer, nil
}

// httpError is an answer other than 502 for a failed action.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

// action runs fn for an action that changes something: a POST with a JSON
// body from this console's own origin, carrying the token.
func (c *Console) action(w http.ResponseWriter, r *http.Request, fn func(*http.Request) (any, error)) {
	if status, why := c.authorize(r); status != 0 {
		c.writeJSON(w, status, map[string]string{"error": why})
		return
	}
	v, err := fn(r)
	if err != nil {
		c.writeError(w, err)
		return
	}
	c.writeJSON(w, http.StatusOK, v)
}

// authorize says why r may not act (status 0: it may).
//
// CSRF: a page of another origin can make a browser POST here, but not
// with a custom header or a JSON content type without a CORS preflight,
// which this server never grants; and the token is in no cookie, so the
// browser adds nothing of the operator's by itself. The Origin check is
// the second wall (a browser always sends Origin on a cross-origin POST).
func (c *Console) authorize(r *http.Request) (int, string) {
	if r.Method != http.MethodPost {
		return http.StatusMethodNotAllowed, "actions are POST requests"
	}
	if c.token == nil {
		return http.StatusForbidden, "the console is read-only: set console.token (or console.token_file) to allow actions"
	}
	if o := r.Header.Get("Origin"); o != "" && !sameOrigin(o, r.Host) {
		return http.StatusForbidden, "refused: the request comes from another origin (" + o + ")"
	}
	if r.Header.Get("Sec-Fetch-Site") == "cross-site" {
		return http.StatusForbidden, "refused: a cross-site request"
	}
	if ct := r.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		return http.StatusUnsupportedMediaType, "send the body as application/json"
	}
	got := r.Header.Get(TokenHeader)
	if got == "" {
		return http.StatusUnauthorized, "this action needs the console token (console.token) in the " + TokenHeader + " header: enter it on the page"
	}
	sum := sha256.Sum256([]byte(got))
	if subtle.ConstantTimeCompare(sum[:], c.token) != 1 {
		return http.StatusUnauthorized, "wrong console token"
	}
	return 0, ""
}

// hostAllowed: the request names this server by an IP address, localhost
// or an allowed name. A browser sends the name it resolved: a site that
// rebinds its own name to this address is refused (DNS rebinding).
func (c *Console) hostAllowed(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.Trim(host, "[]"), ".")
	if host == "" || net.ParseIP(host) != nil || strings.EqualFold(host, "localhost") || strings.HasSuffix(strings.ToLower(host), ".localhost") {
		return true
	}
	for _, a := range c.opts.Config.Console.AllowedHosts {
		if strings.EqualFold(strings.TrimSpace(a), host) {
			return true
		}
	}
	return false
}

// sameOrigin: origin is this server's own (the Host the browser asked).
func sameOrigin(origin, host string) bool {
	u, err := url.Parse(origin)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && strings.EqualFold(u.Host, host)
}

// tail streams the live tail as Server-Sent Events: "event" messages,
// one per event stored that passes the viewer's filter (query parameters
// subject and text, as the page's filter fields), at most tailPerFlush
// written together every tailFlushEvery; a "skipped" message with the
// count of events the filter kept but the viewer was not sent (over its
// budget, or its connection behind).
func (c *Console) tail(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	if c.hub == nil {
		http.Error(w, "no relay runs in this process (walbox console): the live tail is served by walbox run's console", http.StatusNotFound)
		return
	}
	flusher, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	filter, err := newTailFilter(r.URL.Query().Get("subject"), r.URL.Query().Get("text"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	sub := c.hub.subscribe(filter)
	if sub == nil {
		http.Error(w, "too many live tail viewers", http.StatusServiceUnavailable)
		return
	}
	defer c.hub.unsubscribe(sub)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no")
	// retry: reconnect a second after the relay restarts.
	_, _ = io.WriteString(w, "retry: 1000\n: walbox live tail\n\n")
	flusher.Flush()
	tick := time.NewTicker(tailFlushEvery)
	defer tick.Stop()
	lastWrite := time.Now()
	var told uint64
	var buf []byte
	for {
		select {
		case <-r.Context().Done():
			return
		case <-tick.C:
		}
		buf = buf[:0]
		for n := len(sub.ch); n > 0; n-- {
			ev := <-sub.ch
			ev.Subject, ev.Preview, ev.Reason = scrub(ev.Subject), scrub(ev.Preview), scrub(ev.Reason)
			buf = append(buf, "event: event\ndata: "...)
			buf = ev.appendJSON(buf)
			buf = append(buf, "\n\n"...)
		}
		// Refilled once the queue is drained: what was offered while
		// it drained spent the last window's budget.
		sub.budget.Store(tailPerFlush)
		if d := sub.skipped.Load(); d != told {
			told = d
			buf = append(buf, "event: skipped\ndata: "+strconv.FormatUint(d, 10)+"\n\n"...)
		}
		if len(buf) == 0 && time.Since(lastWrite) < 15*time.Second {
			continue
		}
		if len(buf) == 0 {
			buf = append(buf, ": ping\n\n"...)
		}
		if _, err := w.Write(buf); err != nil {
			return
		}
		flusher.Flush()
		lastWrite = time.Now()
		if cap(buf) > 1<<20 {
			buf = nil // a burst's buffer is not kept
		}
	}
}

// event is one stored message, read back from its stream (topic): what
// the live tail opens.
func (c *Console) event(r *http.Request) (any, error) {
	q := r.URL.Query()
	seq, err := strconv.ParseUint(q.Get("seq"), 10, 64)
	if err != nil {
		return nil, &httpError{http.StatusBadRequest, "seq: a stream sequence (Kafka: offset + 1)"}
	}
	part, _ := strconv.ParseInt(q.Get("partition"), 10, 32)
	stream := q.Get("stream")
	if !c.walboxStream(stream) {
		return nil, &httpError{http.StatusForbidden, "the console reads walbox's own streams (topics) only, not " + stream}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 15*time.Second)
	defer cancel()
	return ops.ReadStored(ctx, c.opts.Config, stream, int32(part), seq)
}

// walboxStream: name is one of the configured streams (topics) or the
// dead-letter one, whose messages the live tail lists.
func (c *Console) walboxStream(name string) bool {
	cfg := c.opts.Config
	if name == "" {
		return false
	}
	if name == ops.DLQName(cfg) {
		return true
	}
	if cfg.Sink == config.SinkKafka {
		for _, t := range cfg.Kafka.Topics {
			if t.Name == name {
				return true
			}
		}
		return false
	}
	for _, st := range cfg.NATS.Streams {
		if st.Name == name {
			return true
		}
	}
	return false
}
