package console

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/walbox/walbox/relay"
)

// Live tail limits. The tail must cost the relay little (issue 38: ≤ 2 %
// of its CPU at 1,000 events/s with one viewer). What the publisher
// goroutine does per event is one atomic load with no viewer; with viewers
// it matches each viewer's filter and spends one unit of its budget, and
// only an event some viewer takes is copied. A viewer's stream is written
// every tailFlushEvery with at most tailPerFlush events: a person reads a
// few events a second, and encoding and writing 1,000 a second to a
// browser that shows 500 rows was most of the tail's cost (bench/console.go).
// What a viewer's filter keeps beyond its budget is counted and shown as
// "N not shown", never queued.
const (
	// tailPreviewMax is the most payload bytes an event carries; the
	// page opens the whole stored message on request (/ui/api/event).
	tailPreviewMax = 256
	// tailPerFlush is the most events a viewer is sent per flush:
	// 20 per 100 ms, 200 a second.
	tailPerFlush = 20
	// tailBuffer is each viewer's queue: its budget, with room for the
	// events offered while a flush drains it. A viewer whose queue is
	// full (its connection stuck) loses events, counted; the relay never
	// waits for it.
	tailBuffer = 2 * tailPerFlush
	// tailViewersMax bounds the viewers of one process.
	tailViewersMax = 16
	// tailFlushEvery is how often a viewer's stream is written.
	tailFlushEvery = 100 * time.Millisecond
	// tailFilterMax bounds a filter's length (query parameters).
	tailFilterMax = 256
)

// TailEvent is one event as the relay stored it (or dead-lettered it),
// as the live tail lists it.
type TailEvent struct {
	ID      string
	Subject string
	// Stream (Kafka: the topic) and Seq (Kafka: the offset + 1) where it
	// is stored; Partition for Kafka.
	Stream     string
	Seq        uint64
	Partition  int32
	Table      string
	CommitTime time.Time
	AckedAt    time.Time
	DeadLetter bool
	Reason     string
	// Preview is the payload's first tailPreviewMax bytes; Size its length.
	Preview string
	Size    int
}

// tailHub fans the relay's deliveries out to the live tail's viewers. The
// relay calls offer on its publisher goroutine for every event that left
// the window: with no viewer that is one atomic load; with viewers the
// event's fields are copied (the relay recycles its message after the
// call) and handed to each viewer's bounded queue without waiting: a full
// queue drops it and counts it.
type tailHub struct {
	viewers atomic.Int32
	mu      sync.RWMutex
	subs    map[*tailSub]struct{}

	sent    prometheus.Counter
	dropped prometheus.Counter
	gauge   prometheus.Gauge
}

type tailSub struct {
	ch     chan TailEvent
	filter tailFilter
	// budget is what the viewer may still be sent before its next flush
	// (the flush refills it); skipped counts what its filter kept beyond
	// the budget or its queue.
	budget  atomic.Int32
	skipped atomic.Uint64
}

// tailFilter is a viewer's filter, applied on the relay's side so that the
// budget is spent on what the viewer asked for: a subject pattern (NATS
// wildcards, matched against the subject or the stream/topic) and a text
// that the event id, subject or payload preview contains, ignoring case.
type tailFilter struct {
	subject []string // tokens; nil: any
	text    string   // lower case; "": any
}

func newTailFilter(subject, text string) (tailFilter, error) {
	subject, text = strings.TrimSpace(subject), strings.TrimSpace(text)
	if len(subject) > tailFilterMax || len(text) > tailFilterMax {
		return tailFilter{}, fmt.Errorf("a live tail filter is at most %d bytes", tailFilterMax)
	}
	var f tailFilter
	if subject != "" {
		f.subject = strings.Split(subject, ".")
	}
	f.text = strings.ToLower(text)
	return f, nil
}

// subjectMatch is the page's subjectMatch (app.js): "*" one token, ">"
// one or more at the end.
func subjectMatch(f []string, subject string) bool {
	rest, more := subject, true // more: a token is left in rest
	for _, tok := range f {
		if tok == ">" {
			return more
		}
		if !more {
			return false
		}
		var s string
		s, rest, more = strings.Cut(rest, ".")
		if tok != "*" && tok != s {
			return false
		}
	}
	return !more
}

// match reports whether d passes f. It runs on the relay's publisher
// goroutine for every event while someone watches: no allocation unless
// a text filter meets a payload with a URL in it (scrubbed first, so that
// the filter cannot probe for what the page redacts) or a non-ASCII text.
func (f *tailFilter) match(d *relay.Delivered) bool {
	var subject string
	var data []byte
	if d.Msg != nil {
		subject, data = d.Msg.Subject, d.Msg.Data
	}
	if f.subject != nil && !subjectMatch(f.subject, subject) && !subjectMatch(f.subject, d.Stream) {
		return false
	}
	if f.text == "" {
		return true
	}
	if len(data) > tailPreviewMax {
		data = data[:tailPreviewMax]
	}
	if bytes.Contains(data, []byte("://")) {
		return containsFold(d.ID, f.text) || containsFold(subject, f.text) || containsFold(scrub(string(data)), f.text)
	}
	return containsFold(d.ID, f.text) || containsFold(subject, f.text) || containsFold(data, f.text)
}

// containsFold reports whether s contains lower (lower case), ignoring
// case: byte by byte for ASCII, through strings.ToLower otherwise.
func containsFold[T string | []byte](s T, lower string) bool {
	for i := range len(lower) {
		if lower[i] >= utf8.RuneSelf {
			return strings.Contains(strings.ToLower(string(s)), lower)
		}
	}
	n := len(lower)
outer:
	for i := 0; i+n <= len(s); i++ {
		for j := range n {
			c := s[i+j]
			if 'A' <= c && c <= 'Z' {
				c += 'a' - 'A'
			}
			if c != lower[j] {
				continue outer
			}
		}
		return true
	}
	return false
}

func newTailHub(reg prometheus.Registerer) (*tailHub, error) {
	h := &tailHub{subs: map[*tailSub]struct{}{},
		sent: prometheus.NewCounter(prometheus.CounterOpts{Name: "walbox_console_tail_events_total",
			Help: "Events handed to the web console's live tail viewers."}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "walbox_console_tail_dropped_total",
			Help: "Events a live tail viewer's filter kept but it was not sent: over its 200 a second, or its connection fell behind (the relay never waits for it)."}),
		gauge: prometheus.NewGauge(prometheus.GaugeOpts{Name: "walbox_console_tail_viewers",
			Help: "Browsers on the web console's live tail."}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{h.sent, h.dropped, h.gauge} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return h, nil
}

// subscribe adds a viewer; nil when there are tailViewersMax already.
func (h *tailHub) subscribe(f tailFilter) *tailSub {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.subs) >= tailViewersMax {
		return nil
	}
	s := &tailSub{ch: make(chan TailEvent, tailBuffer), filter: f}
	s.budget.Store(tailPerFlush)
	h.subs[s] = struct{}{}
	h.viewers.Store(int32(len(h.subs)))
	h.gauge.Set(float64(len(h.subs)))
	return s
}

func (h *tailHub) unsubscribe(s *tailSub) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.subs, s)
	h.viewers.Store(int32(len(h.subs)))
	h.gauge.Set(float64(len(h.subs)))
}

// offer is relay.Config.OnDelivered's part for the console. It must not
// block: it runs on the relay's publisher goroutine. No viewer waits on a
// queue (each is drained by a ticker), so a send wakes no goroutine.
func (h *tailHub) offer(d relay.Delivered) {
	if h.viewers.Load() == 0 {
		return
	}
	var ev TailEvent
	copied := false
	var sent, skipped int
	h.mu.RLock()
	for s := range h.subs {
		if !s.filter.match(&d) {
			continue
		}
		if s.budget.Add(-1) < 0 {
			s.skipped.Add(1)
			skipped++
			continue
		}
		if !copied {
			ev, copied = tailEvent(d), true
		}
		select {
		case s.ch <- ev:
			sent++
		default:
			s.skipped.Add(1)
			skipped++
		}
	}
	h.mu.RUnlock()
	if sent > 0 {
		h.sent.Add(float64(sent))
	}
	if skipped > 0 {
		h.dropped.Add(float64(skipped))
	}
}

// tailEvent copies what the tail lists of d: its message is the relay's,
// recycled after the call (strings stay valid; the payload bytes do not).
func tailEvent(d relay.Delivered) TailEvent {
	ev := TailEvent{ID: d.ID, Stream: d.Stream, Seq: d.Seq, Partition: d.Partition, CommitTime: d.CommitTime, AckedAt: d.AckedAt,
		DeadLetter: d.DeadLetter, Reason: d.Reason}
	if m := d.Msg; m != nil {
		ev.Subject = m.Subject
		if t := m.Header.Get(relay.HeaderTable); t != relay.TableLessTable {
			ev.Table = t
		}
		ev.Size = len(m.Data)
		data := m.Data
		if len(data) > tailPreviewMax {
			data = data[:tailPreviewMax]
			// Cut at a rune's start: a rune is at most 4 bytes.
			for i := 0; i < utf8.UTFMax-1 && !utf8.Valid(data); i++ {
				data = data[:len(data)-1]
			}
		}
		ev.Preview = string(data)
	}
	return ev
}

// appendJSON appends ev as the JSON object the page reads. It is written
// by hand: json.Marshal's reflection would cost more than everything else
// the tail does per event.
func (ev *TailEvent) appendJSON(b []byte) []byte {
	b = append(b, `{"id":`...)
	b = appendJSONString(b, ev.ID)
	b = append(b, `,"subject":`...)
	b = appendJSONString(b, ev.Subject)
	b = append(b, `,"stream":`...)
	b = appendJSONString(b, ev.Stream)
	b = append(b, `,"seq":`...)
	b = strconv.AppendUint(b, ev.Seq, 10)
	b = append(b, `,"partition":`...)
	b = strconv.AppendInt(b, int64(ev.Partition), 10)
	b = append(b, `,"table":`...)
	b = appendJSONString(b, ev.Table)
	b = append(b, `,"acked_at_ms":`...)
	b = strconv.AppendInt(b, ev.AckedAt.UnixMilli(), 10)
	b = append(b, `,"commit_to_ack_ms":`...)
	if ev.CommitTime.IsZero() {
		b = append(b, "null"...)
	} else {
		b = strconv.AppendFloat(b, float64(ev.AckedAt.Sub(ev.CommitTime).Microseconds())/1000, 'f', 3, 64)
	}
	if ev.DeadLetter {
		b = append(b, `,"dead_letter":true,"reason":`...)
		b = appendJSONString(b, ev.Reason)
	}
	b = append(b, `,"size":`...)
	b = strconv.AppendInt(b, int64(ev.Size), 10)
	b = append(b, `,"preview":`...)
	b = appendJSONString(b, ev.Preview)
	return append(b, '}')
}

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string: quotes, backslashes and
// control characters escaped, <, > and & too (as encoding/json does, so
// that no payload can close a script), invalid UTF-8 as U+FFFD.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 || r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			switch r {
			case '\u2028':
				b = append(b, `\u2028`...)
			case '\u2029':
				b = append(b, `\u2029`...)
			default:
				b = append(b, `\ufffd`...)
			}
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
