package devenv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/relay"
)

const (
	// sampleCap bounds the latencies kept for the run's percentiles
	// (reservoir sampling), so a long session's memory stays flat.
	sampleCap = 100_000
	// payloadWidth is how much of a payload an event line shows.
	payloadWidth = 80
)

// console owns the output: progress lines, one line per stored event, a
// summary every interval. Event handlers of several streams call it
// concurrently; mu serializes both the counters and the writes, so lines
// never interleave.
type console struct {
	start time.Time
	every time.Duration

	mu         sync.Mutex
	w          io.Writer
	headerDone bool
	printed    int64
	firstAt    time.Time
	// The current summary interval.
	winStart time.Time
	winCount int64
	winLat   []time.Duration
	// The whole run: a uniform sample of latencies.
	sample []time.Duration
	seen   int64
}

func newConsole(w io.Writer, start time.Time, every time.Duration) *console {
	return &console{w: w, start: start, every: every, winStart: start}
}

func (c *console) progress(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	fmt.Fprintf(c.w, "walbox dev: "+format+"\n", args...)
}

func (c *console) printf(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	fmt.Fprintf(c.w, format, args...)
}

// event prints one message as JetStream stored it. The latency is from the
// commit in PostgreSQL (the Walbox-Commit-Time header) to the time the
// stream stored the message (its metadata timestamp), which is when
// JetStream acked the relay's publish.
func (c *console) event(m jetstream.Msg) {
	meta, err := m.Metadata()
	if err != nil {
		return // not a JetStream message; cannot happen on a stream consumer
	}
	c.show(meta.Timestamp, meta.Stream, meta.Sequence.Stream, m.Subject(), relay.Header(m.Headers()), m.Data())
}

// show prints one stored message: when and where the bus stored it (stream
// and sequence, or topic/partition and offset), its subject (topic), and
// walbox's headers.
func (c *console) show(stored time.Time, stream string, seq uint64, subject string, h relay.Header, data []byte) {
	now := time.Now()
	lat, hasLat := time.Duration(0), false
	if ct, err := time.Parse(time.RFC3339Nano, h.Get(relay.HeaderCommitTime)); err == nil {
		lat, hasLat = max(stored.Sub(ct), 0), true
	}
	id := h.Get(relay.HeaderMsgID)
	if id == "" {
		id = "-"
	}
	detail := oneLine(data)
	if reason := h.Get(relay.HeaderDLQReason); reason != "" {
		detail = "DEAD LETTER: " + reason
	}
	latText := "-"
	if hasLat {
		latText = fmtDur(lat)
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.headerDone {
		c.headerDone = true
		fmt.Fprintf(c.w, "\n%-12s  %-18s %6s  %-18s  %-36s  %11s  %s\n",
			"STORED", "STREAM", "SEQ", "SUBJECT", "EVENT ID", "COMMIT->ACK", "PAYLOAD")
	}
	fmt.Fprintf(c.w, "%-12s  %-18s %6d  %-18s  %-36s  %11s  %s\n",
		stored.Local().Format("15:04:05.000"), stream, seq,
		subject, id, latText, detail)
	if c.firstAt.IsZero() {
		c.firstAt = now
	}
	c.printed++
	c.winCount++
	if hasLat {
		c.winLat = append(c.winLat, lat)
		c.seen++
		if len(c.sample) < sampleCap {
			c.sample = append(c.sample, lat)
		} else if i := rand.Int64N(c.seen); i < sampleCap {
			c.sample[i] = lat
		}
	}
}

// summaries prints a summary line every interval until ctx ends or the
// returned stop is called.
func (c *console) summaries(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	c.mu.Lock()
	c.winStart = time.Now() // the first interval starts now, not at start-up
	c.mu.Unlock()
	go func() {
		defer close(done)
		t := time.NewTicker(c.every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case now := <-t.C:
				c.summaryLine(now)
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

func (c *console) summaryLine(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	span := now.Sub(c.winStart)
	rate := float64(c.winCount) / span.Seconds()
	line := fmt.Sprintf("-- last %s: %d events, %.1f/s", span.Round(100*time.Millisecond), c.winCount, rate)
	if len(c.winLat) > 0 {
		slices.Sort(c.winLat)
		line += fmt.Sprintf(", commit->ack p50 %s p99 %s", fmtDur(percentile(c.winLat, 0.50)), fmtDur(percentile(c.winLat, 0.99)))
	}
	fmt.Fprintf(c.w, "%s (total %d)\n", line, c.printed)
	c.winStart, c.winCount, c.winLat = now, 0, c.winLat[:0]
}

// waitPrinted waits until at least n events were printed, or timeout.
func (c *console) waitPrinted(n int64, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		c.mu.Lock()
		printed := c.printed
		c.mu.Unlock()
		if printed >= n {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// totals fills the printed count, latency percentiles and time to the
// first event.
func (c *console) totals() Summary {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := Summary{Printed: c.printed}
	if len(c.sample) > 0 {
		sorted := slices.Clone(c.sample)
		slices.Sort(sorted)
		s.P50, s.P99 = percentile(sorted, 0.50), percentile(sorted, 0.99)
	}
	if !c.firstAt.IsZero() {
		s.FirstEvent = c.firstAt.Sub(c.start)
	}
	return s
}

func (c *console) final(s Summary) {
	var b strings.Builder
	fmt.Fprintf(&b, "\nwalbox dev: stopped after %s: %d events acked by JetStream, %d printed",
		s.Elapsed.Round(100*time.Millisecond), s.Acked, s.Printed)
	if s.Produced > 0 {
		fmt.Fprintf(&b, " (%d sample events committed)", s.Produced)
	}
	if s.DeadLettered > 0 {
		fmt.Fprintf(&b, ", %d dead-lettered", s.DeadLettered)
	}
	if s.Printed > 0 {
		fmt.Fprintf(&b, "; commit->ack p50 %s p99 %s; first event %s after start", fmtDur(s.P50), fmtDur(s.P99), s.FirstEvent.Round(100*time.Millisecond))
	}
	c.printf("%s\n", b.String())
}

// percentile of sorted (nearest rank).
func percentile(sorted []time.Duration, q float64) time.Duration {
	i := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func fmtDur(d time.Duration) string {
	ms := float64(d) / float64(time.Millisecond)
	switch {
	case ms < 10:
		return fmt.Sprintf("%.2fms", ms)
	case ms < 1000:
		return fmt.Sprintf("%.1fms", ms)
	default:
		return fmt.Sprintf("%.2fs", ms/1000)
	}
}

// oneLine shortens a payload to one line of at most payloadWidth runes;
// JSON loses the spaces jsonb's text form adds.
func oneLine(b []byte) string {
	var buf bytes.Buffer
	if json.Compact(&buf, b) == nil {
		b = buf.Bytes()
	}
	s := strings.Join(strings.Fields(string(b)), " ")
	if r := []rune(s); len(r) > payloadWidth {
		return string(r[:payloadWidth-3]) + "..."
	}
	return s
}
