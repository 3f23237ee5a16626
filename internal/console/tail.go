package console

import (
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/walbox/walbox/relay"
)

// Live tail limits. The tail must cost the relay little (issue 38: ≤ 2 %
// of its CPU at 1,000 events/s with one viewer): what the publisher
// goroutine does per event is a few copies, and a viewer's stream is
// written a few times a second, not once per event.
const (
	// tailPreviewMax is the most payload bytes an event carries; the
	// page opens the whole stored message on request (/ui/api/event).
	tailPreviewMax = 256
	// tailBuffer is each viewer's queue: a browser that falls this far
	// behind loses events (counted), the relay never waits for it.
	tailBuffer = 2048
	// tailViewersMax bounds the viewers of one process.
	tailViewersMax = 16
	// tailFlushEvery is how often a viewer's stream is written.
	tailFlushEvery = 100 * time.Millisecond
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
	ch      chan TailEvent
	dropped atomic.Uint64
}

func newTailHub(reg prometheus.Registerer) (*tailHub, error) {
	h := &tailHub{subs: map[*tailSub]struct{}{},
		sent: prometheus.NewCounter(prometheus.CounterOpts{Name: "walbox_console_tail_events_total",
			Help: "Events handed to the web console's live tail viewers."}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "walbox_console_tail_dropped_total",
			Help: "Events the web console's live tail dropped because a viewer fell behind (the relay never waits for it)."}),
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
func (h *tailHub) subscribe() *tailSub {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.subs) >= tailViewersMax {
		return nil
	}
	s := &tailSub{ch: make(chan TailEvent, tailBuffer)}
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
	ev := tailEvent(d)
	var sent, dropped int
	h.mu.RLock()
	for s := range h.subs {
		select {
		case s.ch <- ev:
			sent++
		default:
			s.dropped.Add(1)
			dropped++
		}
	}
	h.mu.RUnlock()
	if sent > 0 {
		h.sent.Add(float64(sent))
	}
	if dropped > 0 {
		h.dropped.Add(float64(dropped))
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
