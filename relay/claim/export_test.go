package claim

import "context"

// hooked runs before ahead of each remove: what another process does
// between the sweep's listing and its delete.
type hooked struct {
	sweepable
	before func(name string)
}

func (h hooked) remove(ctx context.Context, o storedObject) (bool, error) {
	h.before(o.name)
	return h.sweepable.remove(ctx, o)
}

// BeforeRemove makes sw call before(name) ahead of each delete it decides.
func BeforeRemove(sw *Sweeper, before func(name string)) { sw.store = hooked{sw.store, before} }

// BeforeRenew makes Reuse call f between its read of an object's meta and
// its renewal.
func (s *JetStreamStore) BeforeRenew(f func()) { s.beforeRenew = f }

// BeforeRenew makes Reuse call f between its check of an intact object
// and its copy.
func (s *S3Store) BeforeRenew(f func()) { s.beforeRenew = f }

// UniqueName is uniqueName.
var UniqueName = uniqueName

// BeforeDelete makes the sweep's remove call f(name) right before its
// DELETE: after the last read it makes of the object.
func (s *S3Store) BeforeDelete(f func(name string)) { s.beforeDelete = f }
