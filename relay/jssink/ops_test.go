package jssink_test

import (
	"testing"

	"github.com/walbox/walbox/relay/jssink"
)

func TestFilterCovers(t *testing.T) {
	for _, tc := range []struct {
		have, want string
		ok         bool
	}{
		{"orders.>", "orders.>", true},
		{"orders.>", "orders.created", true},
		{"orders.>", "orders.*", true},
		{"orders.*", "orders.>", false},
		{"orders.*", "orders.created", true},
		{"orders.created", "orders.*", false},
		{">", "a.b.c", true},
		{"orders.*.x", "orders.a.x", true},
		{"orders", "orders.>", false},
	} {
		if got := jssink.FilterCovers(tc.have, tc.want); got != tc.ok {
			t.Errorf("FilterCovers(%q, %q) = %v", tc.have, tc.want, got)
		}
	}
}
