package app

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
)

// walThresholds are the retained-WAL sizes at which the slot monitor warns
// (each once per crossing): walbox must never quietly fill a disk.
var walThresholds = [...]int64{1 << 30, 10 << 30, 50 << 30}

// monitorSlot reads the slot's status every interval into the metrics, warns
// as retained WAL crosses thresholds and reports wal_status 'unreserved' (the
// slot is about to be invalidated) at error level.
func monitorSlot(ctx context.Context, url, slot string, interval time.Duration, r *relay.Relay, m *relay.Metrics, log zerolog.Logger) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.WithoutCancel(ctx))
		}
	}()
	crossed := 0
	lastStatus := ""
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if oldest, _ := r.Progress(); !oldest.IsZero() {
			m.SlotLagSeconds.Set(time.Since(oldest).Seconds())
		} else {
			m.SlotLagSeconds.Set(0)
		}
		if conn == nil || conn.IsClosed() {
			if c, err := pgx.Connect(ctx, url); err == nil {
				conn = c
			}
		}
		if conn != nil {
			st, err := cdc.ReadSlotStatus(ctx, conn, slot)
			status := st.WALStatus
			switch {
			case errors.Is(err, cdc.ErrNoSlot):
				status = "missing"
			case err != nil:
				conn.Close(context.WithoutCancel(ctx))
				conn = nil
			}
			if err == nil {
				m.SlotLagBytes.Set(float64(st.LagBytes))
				m.SlotRetainedWAL.Set(float64(st.RetainedBytes))
				m.SlotSafeWALSize.Set(float64(st.SafeWALSize))
				m.ReplicationLagS.Set(st.LagSeconds)
				if st.Active {
					m.SlotActive.Set(1)
				} else {
					m.SlotActive.Set(0)
				}
				for crossed < len(walThresholds) && st.RetainedBytes >= walThresholds[crossed] {
					log.Warn().Int64("retained_wal_bytes", st.RetainedBytes).Int64("threshold", walThresholds[crossed]).
						Msg("the replication slot retains a lot of WAL: walbox is behind or was away; check NATS and the relay")
					crossed++
				}
				for crossed > 0 && st.RetainedBytes < walThresholds[crossed-1]/2 {
					crossed--
				}
			}
			if status != "" && status != lastStatus {
				m.SlotWALStatus.Reset()
				m.SlotWALStatus.WithLabelValues(status).Set(1)
				if status == "unreserved" {
					log.Error().Str("slot", slot).Int64("safe_wal_size", st.SafeWALSize).
						Msg("slot wal_status is 'unreserved': WAL it needs is past max_slot_wal_keep_size and will be removed at the next checkpoint; the slot is about to be lost")
				}
				lastStatus = status
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
