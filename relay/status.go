package relay

import (
	"context"
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/fault"
)

// StatusWriter upserts the leader's lag into walbox.relay_status every
// second: producers read it for back-pressure (outbox.Lag), humans and
// `walbox status` read it too. lag_seconds is the age of the oldest committed
// event not yet acked (0 when caught up); lag_bytes is the WAL between the
// server's current position and the confirmed one.
type StatusWriter struct {
	ConnString string
	Slot       string
	Relay      *Relay
	Confirmed  func() cdc.LSN
	Interval   time.Duration
	Log        zerolog.Logger
}

// Run writes until ctx ends. A missing table (migrations not applied) is
// reported once and the writer stops: publishing never depends on it.
func (w *StatusWriter) Run(ctx context.Context) {
	interval := w.Interval
	if interval <= 0 {
		interval = time.Second
	}
	host, _ := os.Hostname()
	leader := host + "/" + strconv.Itoa(os.Getpid())
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.WithoutCancel(ctx))
		}
	}()
	t := time.NewTicker(interval)
	defer t.Stop()
	var lastCount uint64
	lastAt := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if conn == nil || conn.IsClosed() {
			c, err := pgx.Connect(ctx, w.ConnString)
			if err != nil {
				continue
			}
			conn = c
		}
		oldest, count := w.Relay.Progress()
		now := time.Now()
		lagSeconds := 0.0
		if !oldest.IsZero() {
			lagSeconds = max(now.Sub(oldest).Seconds(), 0)
		}
		rate := float64(count-lastCount) / now.Sub(lastAt).Seconds()
		lastCount, lastAt = count, now
		_, err := conn.Exec(ctx, `INSERT INTO walbox.relay_status (slot_name, updated_at, leader, confirmed_lsn, lag_bytes, lag_seconds, events_per_second)
			VALUES ($1, now(), $2, $3::pg_lsn, pg_wal_lsn_diff(pg_current_wal_lsn(), $3::pg_lsn)::bigint, $4, $5)
			ON CONFLICT (slot_name) DO UPDATE SET updated_at = now(), leader = EXCLUDED.leader, confirmed_lsn = EXCLUDED.confirmed_lsn,
				lag_bytes = EXCLUDED.lag_bytes, lag_seconds = EXCLUDED.lag_seconds, events_per_second = EXCLUDED.events_per_second`,
			w.Slot, leader, w.Confirmed().String(), lagSeconds, rate)
		if err != nil {
			if fault.MissingRelation(err) {
				w.Log.Warn().Msg("walbox.relay_status does not exist (run `walbox migrate`); producers' back-pressure and `walbox status` will not see the relay's lag")
				return
			}
			if ctx.Err() == nil {
				w.Log.Debug().Err(err).Msg("write relay status")
			}
			conn.Close(context.WithoutCancel(ctx))
			conn = nil
		}
	}
}
