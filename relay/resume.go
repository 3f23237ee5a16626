package relay

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/cdc"
)

// LastStoredReader reads back the newest message of a stream. The relay uses
// it for the resume check: JetStream drops a resent duplicate only inside the
// stream's duplicate window, so after a longer outage the relay itself skips
// events at or before the last position this source stored in each stream.
type LastStoredReader interface {
	LastStored(ctx context.Context, stream string) (nats.Header, error)
}

// LastStored implements LastStoredReader.
func (s *JetStreamSink) LastStored(ctx context.Context, stream string) (nats.Header, error) {
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, err
	}
	if info.State.Msgs == 0 {
		return nil, nil
	}
	m, err := st.GetMsg(ctx, info.State.LastSeq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return m.Header, nil
}

// PositionFromHeaders reads the position headers walbox sets, when they were
// set by source.
func PositionFromHeaders(h nats.Header, source string) (cdc.Position, bool) {
	if h == nil || h.Get(HeaderSource) != source {
		return cdc.Position{}, false
	}
	lsn, err := pglogrepl.ParseLSN(h.Get(HeaderCommitLSN))
	if err != nil {
		return cdc.Position{}, false
	}
	idx, err := strconv.ParseUint(h.Get(HeaderIndex), 10, 32)
	if err != nil {
		return cdc.Position{}, false
	}
	return cdc.Position{CommitLSN: lsn, Index: uint32(idx)}, true
}

// refreshResume reads the last stored position of every routed stream. A
// stream that cannot be read keeps what was known: Nats-Msg-Id still
// deduplicates inside the window.
func (l *loop) refreshResume() {
	rd, ok := l.r.sink.(LastStoredReader)
	if !ok {
		return
	}
	if l.resumeAt == nil {
		l.resumeAt = make(map[string]cdc.Position)
	}
	for _, rt := range l.r.router.routes {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		h, err := rd.LastStored(ctx, rt.Stream)
		cancel()
		if err != nil {
			l.r.log.Debug().Err(err).Str("stream", rt.Stream).Msg("resume check: cannot read the last message")
			continue
		}
		if pos, ok := PositionFromHeaders(h, l.r.router.source); ok && pos.CommitLSN > 0 {
			l.resumeAt[rt.Stream] = pos
		}
	}
}

// alreadyStored reports whether p's event is at or before the last position
// this source stored in its stream. Backfilled events (commit LSN 0) have no
// WAL position; Nats-Msg-Id is their only guard.
func (l *loop) alreadyStored(p *pending) bool {
	if p.dlq || p.stream == "" || p.ev.Pos.CommitLSN == 0 {
		return false
	}
	last, ok := l.resumeAt[p.stream]
	return ok && !last.Less(p.ev.Pos)
}
