package claim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/metrics"
	"github.com/walbox/walbox/relay"
)

// Defaults of Options.
const (
	// DefaultHeaderMargin is what the default threshold leaves of the
	// server's max_payload for a message's headers.
	DefaultHeaderMargin = 64 << 10
	// DefaultUploadTimeout bounds one upload: the relay's publisher waits
	// for it (order), so a store that hangs must not hold it forever.
	DefaultUploadTimeout = time.Minute
)

// slowUpload is how long an upload may take before it is logged at info:
// the publisher waits for it.
const slowUpload = 5 * time.Second

// Options configure a Sink.
type Options struct {
	// Threshold: payloads larger than this go to the store (0: the
	// sink's MaxPayload less DefaultHeaderMargin, which is also the most
	// it can be: a larger payload would not fit in a message).
	Threshold int
	// UploadTimeout bounds one upload (0: DefaultUploadTimeout).
	UploadTimeout time.Duration
	Logger        zerolog.Logger
	// Registerer takes the upload metrics (nil: unregistered).
	Registerer prometheus.Registerer
	// ReuseIntact: when the store already holds the payload intact as an
	// object of the event (Reuser), publish a reference to it, renewed,
	// without uploading it again. For walbox replay and dlq retry, whose
	// events were uploaded before; the relay uploads on every attempt. A
	// replay under a new id (relay.HeaderReplayOf) then also looks among
	// the objects of the event's own key.
	ReuseIntact bool
}

// Sink is a relay.Sink that moves large payloads to a Store before it hands
// their messages to the sink it wraps (see the package doc).
type Sink struct {
	inner   relay.Sink
	store   Store
	opts    Options
	log     zerolog.Logger
	uploads prometheus.Counter
	bytes   prometheus.Counter
	failed  prometheus.Counter
	refused prometheus.Counter
	seconds prometheus.Histogram
}

// New wraps inner. Use AsSink to hand it to the relay.
func New(inner relay.Sink, store Store, opts Options) *Sink {
	if opts.UploadTimeout <= 0 {
		opts.UploadTimeout = DefaultUploadTimeout
	}
	f := metrics.On(opts.Registerer)
	return &Sink{inner: inner, store: store, opts: opts, log: opts.Logger.With().Str("component", "claim-check").Logger(),
		uploads: f.Counter("walbox_claim_uploads_total", "Payloads stored in the claim-check store (each publish attempt of a large event uploads)."),
		bytes:   f.Counter("walbox_claim_upload_bytes_total", "Bytes of payload stored in the claim-check store."),
		failed:  f.Counter("walbox_claim_upload_failures_total", "Uploads to the claim-check store that failed (transient: the event waits and is resent in order)."),
		refused: f.Counter("walbox_claim_refused_total", "Payloads the claim-check store refused for themselves (larger than the bucket): dead-lettered."),
		seconds: f.Histogram("walbox_claim_upload_seconds", "Time to store one payload in the claim-check store, confirmed.", prometheus.ExponentialBuckets(0.001, 2, 18)),
	}
}

// Threshold is the payload size above which a payload is moved.
func (s *Sink) Threshold() int {
	most := 0
	if mp := s.inner.MaxPayload(); mp > DefaultHeaderMargin {
		most = mp - DefaultHeaderMargin
	}
	if t := s.opts.Threshold; t > 0 && (most == 0 || t < most) {
		return t
	}
	return most
}

// AsSink is s as the relay takes it: with the optional interfaces of the
// wrapped sink (relay.ErrorCoder, relay.DuplicateChecker,
// relay.Partitioner) exactly when it has them, since the relay acts on
// their presence.
func (s *Sink) AsSink() relay.Sink {
	dc, isDC := s.inner.(relay.DuplicateChecker)
	pt, isPT := s.inner.(relay.Partitioner)
	switch {
	case isDC && isPT:
		return struct {
			*Sink
			relay.DuplicateChecker
			relay.Partitioner
		}{s, dc, pt}
	case isDC:
		return struct {
			*Sink
			relay.DuplicateChecker
		}{s, dc}
	case isPT:
		return struct {
			*Sink
			relay.Partitioner
		}{s, pt}
	}
	return s
}

// EndTxn implements relay.TxnSink: the relay's word on where transactions
// end goes to the wrapped sink. A JetStream sink with atomic transactions
// on holds each batch until it hears it; were the interface hidden (as for
// the optional ones AsSink picks), it would hold every event forever.
// Without a wrapped TxnSink it does nothing, and TxnOpen is false: the
// relay then acts as it does for a sink without transactions.
func (s *Sink) EndTxn(end relay.TxnEnd) {
	if ts, ok := s.inner.(relay.TxnSink); ok {
		ts.EndTxn(end)
	}
}

// TxnOpen implements relay.TxnSink.
func (s *Sink) TxnOpen() bool {
	ts, ok := s.inner.(relay.TxnSink)
	return ok && ts.TxnOpen()
}

// UploadError is a failed upload: transient, the event waits.
type UploadError struct {
	Key string
	Err error
}

func (e *UploadError) Error() string {
	return fmt.Sprintf("claim check: store the payload under %s: %v", e.Key, e.Err)
}

func (e *UploadError) Unwrap() error { return e.Err }

// Publish implements relay.Sink. A payload above the threshold is stored
// first and confirmed; only then is the message, with the reference and an
// empty body, handed to the wrapped sink. The relay's publisher waits for
// the upload, so later events cannot pass it: order is kept. Dead letters
// go as they are (the dead-letter path drops a payload the stream refuses;
// the row keeps it).
func (s *Sink) Publish(m *relay.Msg) (relay.Future, error) {
	th := s.Threshold()
	if th <= 0 || len(m.Data) <= th || m.Header.Get(relay.HeaderDLQReason) != "" {
		return s.inner.Publish(m)
	}
	id := relay.IdentityID(m.Header)
	if of := m.Header.Get(relay.HeaderReplayOf); s.opts.ReuseIntact && of != "" && strings.HasPrefix(id, of+".replay.") {
		// A replay under a new id carries the event's payload again: the
		// event's own object serves it.
		id = of
	}
	key := Key(m.Header.Get(relay.HeaderSource), m.Header.Get(relay.HeaderTable), id)
	sum := sha256.Sum256(m.Data)
	// The store names the object (Put, Reuse): the Ref carries that name.
	ref := Ref{Store: s.store.Kind(), Bucket: s.store.Bucket(), Size: int64(len(m.Data)), SHA256: hex.EncodeToString(sum[:])}
	meta := map[string]string{MetaStream: m.Stream, MetaEventID: id, MetaSHA256: ref.SHA256}
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.UploadTimeout)
	defer cancel()
	if r, ok := s.store.(Reuser); ok && s.opts.ReuseIntact {
		name, reused, err := r.Reuse(ctx, key, int64(len(m.Data)), sum, meta)
		if err != nil {
			s.log.Warn().Err(err).Str("id", id).Str("key", key).Msg("cannot tell whether the claim-check store holds the payload intact; uploading it")
		}
		if reused {
			s.log.Info().Str("id", id).Str("key", key).Str("object", name).Int("bytes", len(m.Data)).Msg("the claim-check store holds the payload intact: its reference is published without an upload")
			ref.Key = name
			return s.inner.Publish(m.Replaced(nil, Header, ref.String()))
		}
	}
	start := time.Now()
	name, err := s.store.Put(ctx, key, m.Data, meta)
	cancel()
	took := time.Since(start)
	if err != nil {
		if errors.Is(err, ErrRefused) {
			s.refused.Inc()
			return nil, &relay.PoisonError{Reason: "claim check: " + err.Error()}
		}
		s.failed.Inc()
		s.log.Warn().Err(err).Str("id", id).Str("key", key).Int("bytes", len(m.Data)).Dur("took", took).Dur("timeout", s.opts.UploadTimeout).
			Msg("cannot store a large payload in the claim-check store; the event and those after it wait and are resent in order")
		return nil, &UploadError{Key: key, Err: err}
	}
	s.uploads.Inc()
	s.bytes.Add(float64(len(m.Data)))
	s.seconds.Observe(took.Seconds())
	ev := s.log.Debug()
	if took > slowUpload {
		ev = s.log.Info() // the publisher waited this long
	}
	ev.Str("id", id).Str("key", key).Str("object", name).Int("bytes", len(m.Data)).Dur("took", took).Msg("payload stored in the claim-check store")
	ref.Key = name
	return s.inner.Publish(m.Replaced(nil, Header, ref.String()))
}

// Classify implements relay.Sink: a failed upload is transient.
func (s *Sink) Classify(err error) relay.ErrorClass {
	var ue *UploadError
	if errors.As(err, &ue) {
		return relay.Transient
	}
	return s.inner.Classify(err)
}

// ErrorCode implements relay.ErrorCoder.
func (s *Sink) ErrorCode(err error) string {
	if c, ok := s.inner.(relay.ErrorCoder); ok {
		return c.ErrorCode(err)
	}
	return err.Error()
}

// MaxPayload implements relay.Sink.
func (s *Sink) MaxPayload() int { return s.inner.MaxPayload() }

// Epoch implements relay.Sink.
func (s *Sink) Epoch() uint64 { return s.inner.Epoch() }

// StoredTail implements relay.Sink.
func (s *Sink) StoredTail(ctx context.Context, stream, source string, n int) (relay.StoredTail, error) {
	return s.inner.StoredTail(ctx, stream, source, n)
}
