package cdc

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/walbox/walbox/internal/fault"
)

// The backfill marker (walbox.slot_backfill) makes a backfill durable: the
// slot's confirmed position starts at its consistent point, so once the slot
// exists the server never sends the snapshot's rows. If walbox stopped before
// every backfilled row was acked, only the marker says so.

// isMissingTable: the marker table is missing or walbox may not use it
// (migrations not applied, or grants missing). The relay then runs without
// the marker rather than not at all.
func isMissingTable(err error) bool {
	return fault.MissingRelation(err) || fault.SQLState(err) == fault.InsufficientPrivilege
}

// markerExec runs one statement on a short-lived regular connection.
func (s *Source) markerExec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.cfg.ConnString)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.Exec(ctx, sql, args...)
}

// backfillPending reports whether an earlier backfill of this slot did not
// finish. A missing marker table (migrations not applied) reads as no.
func (s *Source) backfillPending(ctx context.Context) (bool, error) {
	tag, err := s.markerExec(ctx, "SELECT 1 FROM walbox.slot_backfill WHERE slot_name = $1", s.cfg.Slot)
	if isMissingTable(err) {
		s.warnNoMarker()
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read backfill marker: %w", err)
	}
	return tag.RowsAffected() > 0, nil
}

// markBackfillStarted writes the marker before the slot is created.
func (s *Source) markBackfillStarted(ctx context.Context) error {
	_, err := s.markerExec(ctx, `INSERT INTO walbox.slot_backfill (slot_name) VALUES ($1)
		ON CONFLICT (slot_name) DO UPDATE SET started_at = now(), consistent_lsn = NULL`, s.cfg.Slot)
	if isMissingTable(err) {
		s.warnNoMarker()
		return nil
	}
	if err != nil {
		return fmt.Errorf("write backfill marker: %w", err)
	}
	return nil
}

func (s *Source) warnNoMarker() {
	if s.noMarkerWarned.CompareAndSwap(false, true) {
		s.log.Warn().Msg("walbox.slot_backfill is missing or not writable (run `walbox migrate`, see `walbox migrate --print-grants`): a backfill interrupted by a crash cannot be detected and redone")
	}
}

// clearMarkerWhenConfirmed deletes the marker once the relay has confirmed
// the backfill's consistent point, i.e. acked every backfilled row.
// gen is the slot it belongs to: once another slot was created, this one's
// consistent point means nothing.
func (s *Source) clearMarkerWhenConfirmed(ctx context.Context, consistent LSN, gen uint64) {
	covered := func() bool {
		return s.slotGen.Load() == gen && s.confirmed.reached(consistent)
	}
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			// A clean shutdown drains and confirms before the source stops:
			// if that covered the backfill, say so now, or the next start
			// would redo it for nothing.
			if covered() {
				bg, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
				_, _ = s.markerExec(bg, "DELETE FROM walbox.slot_backfill WHERE slot_name = $1", s.cfg.Slot)
				cancel()
			}
			return
		case <-t.C:
		}
		if s.slotGen.Load() != gen {
			return // the slot was recreated: that backfill's marker is the new one's
		}
		if !covered() {
			continue
		}
		_, err := s.markerExec(ctx, "DELETE FROM walbox.slot_backfill WHERE slot_name = $1", s.cfg.Slot)
		if err == nil || isMissingTable(err) {
			s.log.Info().Stringer("consistent_point", consistent).Msg("backfill acked in full")
			return
		}
		s.log.Debug().Err(err).Msg("clear backfill marker; retrying")
	}
}
