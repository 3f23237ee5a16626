package console

import (
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/walbox/walbox/relay"
)

// Live tail limits: what one event carries to a browser, and how many
// events wait for a slow one before they are dropped.
const (
	// tailPayloadMax is the most payload bytes an event carries (the page
	// pretty-prints it when it is whole JSON); the rest is cut.
	tailPayloadMax = 16 << 10
	// tailBuffer is each viewer's queue: a browser that falls this far
	// behind loses events (counted), the relay never waits for it.
	tailBuffer = 512
	// tailViewersMax bounds the viewers of one process.
	tailViewersMax = 16
)

// TailEvent is one event as the relay stored it (or dead-lettered it),
// as the live tail shows it.
type TailEvent struct {
	ID      string `json:"id"`
	Subject string `json:"subject"`
	// Stream (Kafka: the topic) and Seq (Kafka: the offset + 1) where it
	// is stored; Partition for Kafka.
	Stream     string            `json:"stream"`
	Seq        uint64            `json:"seq"`
	Partition  int32             `json:"partition"`
	Table      string            `json:"table,omitempty"`
	LagMillis  float64           `json:"commit_to_ack_ms"` // commit -> ack
	AckedAt    time.Time         `json:"acked_at"`
	DeadLetter bool              `json:"dead_letter,omitempty"`
	Reason     string            `json:"reason,omitempty"`
	Headers    map[string]string `json:"headers"`
	Payload    string            `json:"payload"`
	Truncated  bool              `json:"truncated,omitempty"`
}

// tailHub fans the relay's deliveries out to the live tail's viewers. The
// relay calls offer on its publisher goroutine for every event that left
// the window: with no viewer that is one atomic load; with viewers the
// event is copied (the relay recycles its message after the call) and
// handed to each viewer's bounded queue without waiting: a full queue
// drops it and counts it.
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
// block: it runs on the relay's publisher goroutine.
func (h *tailHub) offer(d relay.Delivered) {
	if h.viewers.Load() == 0 {
		return
	}
	ev := tailEvent(d)
	h.mu.RLock()
	defer h.mu.RUnlock()
	for s := range h.subs {
		select {
		case s.ch <- ev:
			h.sent.Inc()
		default:
			s.dropped.Add(1)
			h.dropped.Inc()
		}
	}
}

// tailEvent copies what the page shows of d: its message is the relay's,
// recycled after the call.
func tailEvent(d relay.Delivered) TailEvent {
	ev := TailEvent{ID: d.ID, Stream: d.Stream, Seq: d.Seq, Partition: d.Partition, AckedAt: d.AckedAt,
		DeadLetter: d.DeadLetter, Reason: d.Reason}
	if !d.CommitTime.IsZero() {
		ev.LagMillis = float64(d.AckedAt.Sub(d.CommitTime).Microseconds()) / 1000
	}
	if m := d.Msg; m != nil {
		ev.Subject = m.Subject
		ev.Headers = make(map[string]string, len(m.Header))
		for k, v := range m.Header {
			if len(v) > 0 {
				ev.Headers[k] = v[0]
			}
		}
		data := m.Data
		if len(data) > tailPayloadMax {
			data, ev.Truncated = data[:tailPayloadMax], true
			// Cut at a rune's start: a rune is at most 4 bytes.
			for i := 0; i < utf8.UTFMax-1 && !utf8.Valid(data); i++ {
				data = data[:len(data)-1]
			}
		}
		ev.Payload = string(data)
		if t := m.Header.Get(relay.HeaderTable); t != relay.TableLessTable {
			ev.Table = t
		}
	}
	return ev
}
