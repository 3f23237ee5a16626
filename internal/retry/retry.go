// Package retry is walbox's one back-off, for every loop that waits out an
// outage (replication, publishing, marking, maintenance, start-up): from
// initial, doubling, with ±20 % jitter so that relays restarted together do
// not retry in step, capped at max, and never giving up.
package retry

import (
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Multiplier and Jitter are the growth per attempt and the random spread.
const (
	Multiplier = 2
	Jitter     = 0.2
)

// The back-off every loop uses unless configured (retry.initial, retry.max).
const (
	DefaultInitial = time.Second
	DefaultMax     = time.Minute
)

// Defaults fills in an unset back-off: initial <= 0 becomes DefaultInitial,
// max <= 0 DefaultMax, and a max below initial becomes initial.
func Defaults(initial, max time.Duration) (time.Duration, time.Duration) {
	if initial <= 0 {
		initial = DefaultInitial
	}
	if max <= 0 {
		max = DefaultMax
	}
	if max < initial {
		max = initial
	}
	return initial, max
}

// Backoff returns a reset back-off from initial to max.
func Backoff(initial, max time.Duration) *backoff.ExponentialBackOff {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = initial
	bo.MaxInterval = max
	bo.Multiplier = Multiplier
	bo.RandomizationFactor = Jitter
	bo.MaxElapsedTime = 0
	bo.Reset()
	return bo
}
