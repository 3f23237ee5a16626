package claim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/metrics"
)

// Sweeper deletes the objects whose message can no longer be read, and the
// orphans (an object whose message was never published), and counts what
// the bucket holds. It sweeps a JetStream Object Store bucket (NewSweeper)
// or an S3 bucket (NewS3Sweeper); where the messages are (JetStream
// streams, Kafka topics) is its Horizon's business.
//
// Proof of the rule. Sink.Publish hands a message to the broker right after
// its upload is confirmed, and every attempt uploads again (a replay that
// finds the object intact renews it instead, Reuser: JetStream refreshes
// its modification time, S3 copies it to a new object); so the message of
// an object, if it was ever stored, was stored within Slack after the
// object's modification time (JetStream: the server's timestamp of its
// meta message; S3: the object's Last-Modified, which is when the upload
// began for a multipart upload, so Slack must also cover an upload's
// timeout, and which a listing gives to the second,
// so the store's resolution is added). A stream (topic) drops messages
// from its front only, so a Horizon's cutoff is a time such that every
// message it still holds was stored at or after it (less the clock
// margin in Slack); an object modified more than Slack before its
// stream's cutoff has no message left to read, and never will (a later
// attempt would have uploaded it again, or, in S3, written an object of
// its own and named that one). Cutoffs: JetStream, the stream's
// first held message's time, or now less its max_age, or now when it is
// empty or gone (JetStreamHorizon); Kafka, the oldest record any partition
// of the topic still holds (kafkasink.Horizon, whose proof is beside it).
// Slack must cover the upload's start to the broker's ack: the upload
// timeout and the ack timeout, plus a margin for clocks.
//
// The chunks of a JetStream upload that never completed (the relay killed
// mid-upload) belong to no object; they are purged once their newest chunk
// is older than Slack, which must therefore also cover an upload's timeout
// (JetStreamStore.PurgePartials). In S3 a partial upload is never an
// object: a PutObject, or a multipart upload's completion, makes the whole
// object appear at once, so no reference can name half an object and no
// listing shows one. The parts of a multipart upload that never completed
// (minio-go uploads payloads above 16 MiB in parts) are stored, and
// billed, until the upload is aborted: the sweep aborts those begun more
// than Slack ago (S3Store.purgePartials).
type Sweeper struct {
	store   sweepable
	horizon Horizon
	slack   time.Duration
	log     zerolog.Logger

	objects prometheus.Gauge
	bytes   prometheus.Gauge
	deleted prometheus.Counter
}

// Horizon says where a stream's (Kafka: a topic's) messages begin.
type Horizon interface {
	// Cutoff is a time, at most now, such that every message the stream
	// still holds was stored at or after it: now when the stream holds
	// none or is gone; the zero time keeps every object of the stream.
	Cutoff(ctx context.Context, stream string, now time.Time) (time.Time, error)
}

// storedObject is what the sweep needs to know of an object.
type storedObject struct {
	name    string // the object's name in the bucket, to delete it by
	size    int64
	modTime time.Time
	// stream is the MetaStream of the object when the listing carries it
	// (streamKnown); else streamOf looks it up.
	stream      string
	streamKnown bool
	nuid        string // JetStream: names its chunks
	// version tells one upload or renewal of the object from another
	// (S3, for an object under an event's bare key, which an older walbox
	// may write again: its ETag, walbox-written metadata and
	// Last-Modified, from streamOf; "" for a name written once).
	version string
}

// sweepable is a store the Sweeper can sweep.
type sweepable interface {
	list(ctx context.Context) ([]storedObject, error)
	// streamOf reads the stream of o, and its modification time and
	// version again (an upload since the listing renews them).
	streamOf(ctx context.Context, o storedObject) (storedObject, error)
	// remove deletes o unless it changed since the listing (an upload
	// or a renewal under its name; S3 writes a name once, but for an
	// older walbox's bare keys): removed says whether it did.
	remove(ctx context.Context, o storedObject) (removed bool, err error)
	// resolution is how much earlier than the truth a listed
	// modification time may be (S3 lists Last-Modified to the second).
	resolution() time.Duration
	// purgePartials removes what uploads that never completed left
	// behind, begun before before; live: the NUIDs of the objects listed
	// (JetStream). It returns how many uploads it removed.
	purgePartials(ctx context.Context, live map[string]bool, before time.Time) (int, error)
}

// DefaultSlack is the Sweeper's slack when none is given.
const DefaultSlack = 5 * time.Minute

// NewSweeper sweeps store, whose objects' messages are in js's streams.
func NewSweeper(store *JetStreamStore, js jetstream.JetStream, slack time.Duration, log zerolog.Logger, reg prometheus.Registerer) *Sweeper {
	return newSweeper(store, JetStreamHorizon{JS: js}, slack, log, reg)
}

// NewS3Sweeper sweeps store, whose objects' messages are where horizon
// looks: a JetStreamHorizon with NATS, a kafkasink.Horizon with Kafka.
func NewS3Sweeper(store *S3Store, horizon Horizon, slack time.Duration, log zerolog.Logger, reg prometheus.Registerer) *Sweeper {
	return newSweeper(store, horizon, slack, log, reg)
}

func newSweeper(store sweepable, horizon Horizon, slack time.Duration, log zerolog.Logger, reg prometheus.Registerer) *Sweeper {
	if slack <= 0 {
		slack = DefaultSlack
	}
	f := metrics.On(reg)
	return &Sweeper{store: store, horizon: horizon, slack: slack, log: log.With().Str("component", "claim-sweep").Logger(),
		objects: f.Gauge("walbox_claim_objects", "Objects held in the claim-check bucket (JetStream Object Store or S3, at the last sweep)."),
		bytes:   f.Gauge("walbox_claim_bytes", "Bytes of payload held in the claim-check bucket (JetStream Object Store or S3, at the last sweep)."),
		deleted: f.Counter("walbox_claim_swept_total", "Objects the claim-check sweep deleted: their message aged out or was never stored."),
	}
}

// SweepStats is what one sweep found.
type SweepStats struct {
	Objects, Bytes int64 // kept
	Deleted        int
	Partials       int // uploads that never completed, purged (JetStream) or aborted (S3)
}

// Sweep deletes what the rule allows (see Sweeper) and returns what is
// left. A stream whose cutoff cannot be read keeps its objects; the sweep
// goes on with the others and returns the first such error at its end.
func (s *Sweeper) Sweep(ctx context.Context) (SweepStats, error) {
	var st SweepStats
	list, err := s.store.list(ctx)
	if err != nil {
		return st, err
	}
	now := time.Now()
	margin := s.slack + s.store.resolution()
	cutoffs := map[string]time.Time{}
	live := map[string]bool{}
	var firstErr error
	for _, o := range list {
		live[o.nuid] = true
		keep := func() {
			st.Objects++
			st.Bytes += o.size
		}
		// No cutoff is later than now: an object this young stays
		// without a look at its stream.
		if !o.modTime.Add(margin).Before(now) {
			keep()
			continue
		}
		if !o.streamKnown {
			if o, err = s.store.streamOf(ctx, o); err != nil {
				firstErr = cmp(firstErr, err)
				keep()
				continue
			}
		}
		stream := o.stream
		cutoff, ok := cutoffs[stream]
		if !ok {
			if stream != "" { // "": not walbox's, kept (zero cutoff)
				if cutoff, err = s.horizon.Cutoff(ctx, stream, now); err != nil {
					firstErr = cmp(firstErr, fmt.Errorf("claim-check sweep: where the messages of %s begin: %w", stream, err))
					cutoff = time.Time{}
				}
			}
			cutoffs[stream] = cutoff
		}
		if o.modTime.Add(margin).Before(cutoff) {
			removed, err := s.store.remove(ctx, o)
			if removed {
				s.deleted.Inc()
				st.Deleted++
			}
			if err != nil {
				return st, err
			}
			if removed {
				continue
			}
		}
		keep()
	}
	if st.Partials, err = s.store.purgePartials(ctx, live, now.Add(-s.slack)); err != nil {
		return st, err
	}
	s.objects.Set(float64(st.Objects))
	s.bytes.Set(float64(st.Bytes))
	if st.Deleted > 0 || st.Partials > 0 {
		s.log.Info().Int("deleted", st.Deleted).Int("partial_uploads", st.Partials).Int64("objects", st.Objects).Int64("bytes", st.Bytes).Msg("claim-check sweep deleted objects whose message is gone")
	}
	return st, firstErr
}

// cmp keeps the first error.
func cmp(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

// JetStreamHorizon is where the messages of JetStream streams begin.
type JetStreamHorizon struct{ JS jetstream.JetStream }

// Cutoff implements Horizon: the stream's first held message's time, or
// now less its max_age when that is later (JetStream expires messages
// older than max_age), or now when it is empty or gone; never after now.
func (h JetStreamHorizon) Cutoff(ctx context.Context, stream string, now time.Time) (time.Time, error) {
	st, err := h.JS.Stream(ctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return now, nil
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("stream %s: %w", stream, err)
	}
	cutoff := info.State.FirstTime
	if info.State.Msgs == 0 {
		cutoff = now
	}
	if age := info.Config.MaxAge; age > 0 && now.Add(-age).After(cutoff) {
		cutoff = now.Add(-age)
	}
	if cutoff.After(now) { // the server's clock ahead of ours
		cutoff = now
	}
	return cutoff, nil
}

// Run sweeps every interval until ctx ends, logging failures.
func (s *Sweeper) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		sctx, cancel := context.WithTimeout(ctx, interval)
		if _, err := s.Sweep(sctx); err != nil && ctx.Err() == nil {
			s.log.Warn().Err(err).Msg("claim-check sweep failed; what it could not prove gone is kept, retrying at the next interval")
		}
		cancel()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
