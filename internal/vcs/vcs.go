// Package vcs reads the commit a Go binary was built from out of its build
// settings, for `walbox version` and the benchmark report.
package vcs

import "runtime/debug"

// Revision returns the commit the binary was built from, shortened to 12
// characters, and whether the tree had uncommitted changes; rev is "" for a
// build without VCS stamping (-buildvcs=false, or not from a checkout).
func Revision(settings []debug.BuildSetting) (rev string, modified bool) {
	for _, s := range settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	return rev[:min(12, len(rev))], modified
}
