package sweep

// SetCrashAt makes archival stop at a step as a crash would (tests only).
func SetCrashAt(f func(step string) error) { crashAt = f }

// ArchiveName exposes the archive table's name to tests.
var ArchiveName = archiveName

// CatchUpWaiting reports whether the catch-up has taken its horizon and
// waits for the slot to pass it.
func (s *Sweeper) CatchUpWaiting() bool { return s.waiting.Load() }

// LockKey is the advisory lock of a table's maintenance.
var LockKey = lockKey
