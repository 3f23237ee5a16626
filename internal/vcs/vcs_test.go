package vcs

import (
	"runtime/debug"
	"testing"
)

func TestRevision(t *testing.T) {
	for _, tc := range []struct {
		name     string
		settings []debug.BuildSetting
		rev      string
		modified bool
	}{
		{"no stamping", nil, "", false},
		{"clean", []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.modified", Value: "false"}}, "0123456789ab", false},
		{"modified", []debug.BuildSetting{{Key: "vcs.modified", Value: "true"}, {Key: "vcs.revision", Value: "abc"}}, "abc", true},
	} {
		rev, modified := Revision(tc.settings)
		if rev != tc.rev || modified != tc.modified {
			t.Errorf("%s: Revision = %q, %v; want %q, %v", tc.name, rev, modified, tc.rev, tc.modified)
		}
	}
}
