package cdc

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// heartbeat emits a non-transactional logical message whenever the confirmed
// position has not moved for HeartbeatInterval. The walsender then sends it
// (and a keepalive past it); with nothing in flight the relay confirms that
// position, so a quiet outbox in a busy cluster does not retain WAL.
// pg_logical_emit_message with transactional = false needs PG14+ to reach
// pgoutput (messages 'true').
func (s *Source) heartbeat(ctx context.Context) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.WithoutCancel(ctx))
		}
	}()
	last := s.Confirmed()
	lastMove := time.Now()
	tick := time.NewTicker(s.cfg.HeartbeatInterval / 4)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if cur := s.Confirmed(); cur != last {
			last, lastMove = cur, time.Now()
			continue
		}
		if time.Since(lastMove) < s.cfg.HeartbeatInterval || !s.Connected() {
			continue
		}
		if conn == nil || conn.IsClosed() {
			c, err := pgx.Connect(ctx, s.cfg.ConnString)
			if err != nil {
				s.log.Debug().Err(err).Msg("heartbeat: connect")
				continue
			}
			conn = c
		}
		if _, err := conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'walbox.heartbeat', now()::text)"); err != nil {
			s.log.Warn().Err(err).Msg("heartbeat: emit message failed")
			conn.Close(ctx)
			conn = nil
			continue
		}
		lastMove = time.Now()
		s.log.Debug().Stringer("confirmed", last).Msg("slot idle: heartbeat emitted")
	}
}
