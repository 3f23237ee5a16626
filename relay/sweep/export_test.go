package sweep

import (
	"context"

	"github.com/walbox/walbox/cdc"
)

// SetCrashAt makes archival stop at a step as a crash would (tests only).
func SetCrashAt(f func(step string) error) { crashAt = f }

// ArchiveName exposes the archive table's name to tests.
var ArchiveName = cdc.TableName.Archive

// LockKey is the advisory lock of a table's maintenance.
var LockKey = lockKey

// Yielding reports whether the sweeper yields to a catching-up relay.
func (s *Sweeper) Yielding() bool { return s.yielding() }

// RefreshGauges runs the gauge loop's queries once.
func (s *Sweeper) RefreshGauges(ctx context.Context) (int64, error) { return s.refreshGauges(ctx) }
