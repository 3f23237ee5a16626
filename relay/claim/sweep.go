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
// the bucket holds.
//
// Proof of the rule. Sink.Publish hands a message to the broker right after
// its upload is confirmed, and every attempt uploads again; so the message
// of an object, if it was ever stored, was stored within Slack after the
// object's modification time (the server's timestamp of its meta message).
// A JetStream stream drops messages from its front only (max_age,
// max_msgs, max_bytes, a purge), so every message stored before the
// stream's first held message is gone: an object modified more than Slack
// before that time, or before now less the stream's max_age, or before now
// when the stream is empty or gone, has no message left to read, and never
// will (a later attempt would have uploaded it again). Slack must cover the
// upload's end to the broker's ack: the ack timeout, plus a margin.
//
// The chunks of an upload that never completed (the relay killed
// mid-upload) belong to no object; they are purged once their newest chunk
// is older than Slack, which must therefore also cover an upload's timeout
// (JetStreamStore.PurgePartials).
type Sweeper struct {
	store *JetStreamStore
	js    jetstream.JetStream
	slack time.Duration
	log   zerolog.Logger

	objects prometheus.Gauge
	bytes   prometheus.Gauge
	deleted prometheus.Counter
}

// DefaultSlack is the Sweeper's slack when none is given.
const DefaultSlack = 5 * time.Minute

// NewSweeper sweeps store, whose objects' messages are in js's streams.
func NewSweeper(store *JetStreamStore, js jetstream.JetStream, slack time.Duration, log zerolog.Logger, reg prometheus.Registerer) *Sweeper {
	if slack <= 0 {
		slack = DefaultSlack
	}
	f := metrics.On(reg)
	return &Sweeper{store: store, js: js, slack: slack, log: log.With().Str("component", "claim-sweep").Logger(),
		objects: f.Gauge("walbox_claim_objects", "Objects held in the claim-check bucket (at the last sweep)."),
		bytes:   f.Gauge("walbox_claim_bytes", "Bytes of payload held in the claim-check bucket (at the last sweep)."),
		deleted: f.Counter("walbox_claim_swept_total", "Objects the claim-check sweep deleted: their message aged out or was never stored."),
	}
}

// SweepStats is what one sweep found.
type SweepStats struct {
	Objects, Bytes int64 // kept
	Deleted        int
	Partials       int // uploads that never completed, purged
}

// Sweep deletes what the rule allows (see Sweeper) and returns what is left.
func (s *Sweeper) Sweep(ctx context.Context) (SweepStats, error) {
	var st SweepStats
	list, err := s.store.Objects(ctx)
	if err != nil {
		return st, err
	}
	now := time.Now()
	cutoffs := map[string]time.Time{}
	live := map[string]bool{}
	for _, o := range list {
		if o.Deleted {
			continue
		}
		live[o.NUID] = true
		stream := o.Metadata[MetaStream]
		cutoff, ok := cutoffs[stream]
		if !ok {
			if cutoff, err = s.cutoff(ctx, stream, now); err != nil {
				return st, err
			}
			cutoffs[stream] = cutoff
		}
		if o.ModTime.Add(s.slack).Before(cutoff) {
			if err := s.store.Delete(ctx, o.Name); err != nil {
				return st, err
			}
			s.deleted.Inc()
			st.Deleted++
			continue
		}
		st.Objects++
		st.Bytes += int64(o.Size)
	}
	if st.Partials, err = s.store.PurgePartials(ctx, live, now.Add(-s.slack)); err != nil {
		return st, err
	}
	s.objects.Set(float64(st.Objects))
	s.bytes.Set(float64(st.Bytes))
	if st.Deleted > 0 || st.Partials > 0 {
		s.log.Info().Int("deleted", st.Deleted).Int("partial_uploads", st.Partials).Int64("objects", st.Objects).Int64("bytes", st.Bytes).Msg("claim-check sweep deleted objects whose message is gone")
	}
	return st, nil
}

// cutoff is the time before which no message of stream is held.
func (s *Sweeper) cutoff(ctx context.Context, stream string, now time.Time) (time.Time, error) {
	if stream == "" {
		return time.Time{}, nil // not walbox's: kept
	}
	st, err := s.js.Stream(ctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return now, nil
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("claim-check sweep: stream %s: %w", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("claim-check sweep: stream %s: %w", stream, err)
	}
	cutoff := info.State.FirstTime
	if info.State.Msgs == 0 {
		cutoff = now
	}
	if age := info.Config.MaxAge; age > 0 && now.Add(-age).After(cutoff) {
		cutoff = now.Add(-age)
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
			s.log.Warn().Err(err).Msg("claim-check sweep failed; retrying at the next interval")
		}
		cancel()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
