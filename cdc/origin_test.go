package cdc

import "testing"

func TestTimelineHistoryAndComparability(t *testing.T) {
	left, err := parseTimelineHistory([]byte("1\t0/3000158\tno recovery target specified\n\n2\t0/5000000\tat restore point \"x\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	if left[1] != 0x3000158 || left[2] != 0x5000000 {
		t.Fatalf("history %v", left)
	}
	o := &Origin{SystemID: "7300", Timeline: 3, Left: left}
	for _, c := range []struct {
		sys  string
		tl   int32
		pos  LSN
		want bool
	}{
		{"7300", 3, 0x9000000, true},  // same history
		{"7300", 2, 0x4000000, true},  // timeline 2 below where it was left
		{"7300", 2, 0x5000000, false}, // at or past the fork: may not exist here
		{"7300", 1, 0x3000157, true},
		{"7300", 1, 0x3000158, false},
		{"7300", 4, 0x1000000, false}, // a later timeline of another branch
		{"7301", 3, 0x1000000, false}, // another cluster
		{"", 3, 0x1000000, false},     // recorded by a relay that did not say
	} {
		if got := o.Comparable(c.sys, c.tl, c.pos); got != c.want {
			t.Errorf("Comparable(%s, %d, %s) = %v, want %v", c.sys, c.tl, c.pos, got, c.want)
		}
	}
	if (*Origin)(nil).Comparable("7300", 3, 1) {
		t.Error("an unknown origin compares with nothing")
	}
	if _, err := parseTimelineHistory([]byte("x\t0/1\n")); err == nil {
		t.Error("malformed history accepted")
	}
}
