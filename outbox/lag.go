package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrBackpressure is matched (errors.Is) by the error Write returns, having
// written nothing, when WithMaxLag is set and the relay is further behind
// than allowed. Retry later, slow down, or shed load.
var ErrBackpressure = errors.New("outbox: back-pressure: the relay is behind")

// ErrNoRelayStatus is returned by Lag when walbox.relay_status has no row for
// the slot: the relay has not reported yet (or runs with another slot name;
// see WithSlot).
var ErrNoRelayStatus = errors.New("outbox: no walbox.relay_status row for the slot")

// BackpressureError is the error behind ErrBackpressure, with the figures.
type BackpressureError struct {
	Slot   string
	Lag    time.Duration // as Lag reported it
	MaxLag time.Duration // the WithMaxLag limit
}

func (e *BackpressureError) Error() string {
	return fmt.Sprintf("outbox: back-pressure: relay of slot %q is %v behind, more than the %v allowed (WithMaxLag); retry later",
		e.Slot, e.Lag.Round(time.Millisecond), e.MaxLag)
}

// Is makes errors.Is(err, ErrBackpressure) true.
func (e *BackpressureError) Is(target error) bool { return target == ErrBackpressure }

// lagQuery reads the relay's lag: the lag it last reported plus the age of
// that report (by the database's clock), so a relay that stopped reporting,
// because it is down or stuck, counts as falling further behind. A healthy
// relay reports every second or so, which bounds the extra.
const lagQuery = `SELECT coalesce(lag_seconds, 0)::float8
       + greatest(extract(epoch FROM clock_timestamp() - updated_at), 0)::float8
  FROM walbox.relay_status WHERE slot_name = $1`

// Lag returns how far the relay of the slot (WithSlot; default "walbox") is
// behind, from walbox.relay_status: the lag_seconds it last reported plus the
// time since it reported (updated_at), so a relay that stopped reporting
// counts as falling behind. ErrNoRelayStatus when there is no row for the
// slot. db is a pgx pool, connection or transaction, or FromSQL(*sql.DB).
func Lag(ctx context.Context, db Querier, opts ...Option) (time.Duration, error) {
	o, err := buildOptions(opts)
	if err != nil {
		return 0, err
	}
	return lag(ctx, db, o.slot)
}

func lag(ctx context.Context, db Querier, slot string) (time.Duration, error) {
	if db == nil {
		return 0, errors.New("outbox: read relay lag: nil database")
	}
	var secs float64
	err := db.QueryRow(ctx, lagQuery, slot).Scan(&secs)
	if errors.Is(err, pgx.ErrNoRows) || errors.Is(err, sql.ErrNoRows) {
		return 0, fmt.Errorf("%w %q", ErrNoRelayStatus, slot)
	}
	if err != nil {
		return 0, fmt.Errorf("outbox: read relay lag of slot %q from walbox.relay_status: %w", slot, err)
	}
	if math.IsNaN(secs) || secs < 0 {
		secs = 0
	}
	if secs > math.MaxInt64/float64(time.Second) {
		return time.Duration(math.MaxInt64), nil
	}
	return time.Duration(secs * float64(time.Second)), nil
}

// checkLag returns a *BackpressureError when the relay is too far behind.
func (w *Writer) checkLag(ctx context.Context, tx Querier) error {
	l, err := lag(ctx, tx, w.opts.slot)
	if errors.Is(err, ErrNoRelayStatus) {
		return nil // nothing to judge by: do not hold producers back
	}
	if err != nil {
		return fmt.Errorf("%w (WithMaxLag)", err)
	}
	if l > w.opts.maxLag {
		return &BackpressureError{Slot: w.opts.slot, Lag: l, MaxLag: w.opts.maxLag}
	}
	return nil
}
