package outboxtest

import (
	"fmt"
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	committed := []string{"a", "b", "c", "d", "e"}
	rolledBack := []string{"x", "y"}
	tests := []struct {
		name       string
		committed  []string
		rolledBack []string
		streams    map[string][]string
		want       Report // Examples are checked separately
		examples   []string
	}{
		{
			name:    "clean run in one stream",
			streams: map[string][]string{"ORDERS": {"a", "b", "c", "d", "e"}},
			want:    Report{Checked: 5},
		},
		{
			name:    "clean run split over streams",
			streams: map[string][]string{"ORDERS": {"a", "c", "e"}, "PAYMENTS": {"b", "d"}},
			want:    Report{Checked: 5},
		},
		{
			name:    "clean run with an empty stream",
			streams: map[string][]string{"ORDERS": {"a", "b", "c", "d", "e"}, "EMPTY": nil},
			want:    Report{Checked: 5},
		},
		{
			name:    "ids from outside the run are ignored",
			streams: map[string][]string{"ORDERS": {"fixture-1", "a", "b", "fixture-0", "c", "d", "e"}},
			want:    Report{Checked: 5},
		},
		{
			name:      "nothing committed, nothing stored",
			committed: []string{},
			streams:   map[string][]string{},
			want:      Report{},
		},
		{
			name:     "one lost",
			streams:  map[string][]string{"ORDERS": {"a", "b", "d", "e"}},
			want:     Report{Checked: 5, Lost: 1},
			examples: []string{"lost: c"},
		},
		{
			name:    "all lost",
			streams: map[string][]string{},
			want:    Report{Checked: 5, Lost: 5},
		},
		{
			name:    "lost from one of two streams",
			streams: map[string][]string{"ORDERS": {"a", "c"}, "PAYMENTS": {"b", "d"}},
			want:    Report{Checked: 5, Lost: 1},
		},
		{
			name:     "duplicated within a stream",
			streams:  map[string][]string{"ORDERS": {"a", "b", "b", "c", "d", "e"}},
			want:     Report{Checked: 5, Duplicated: 1},
			examples: []string{"duplicated: b in ORDERS"},
		},
		{
			name:     "duplicated across two streams",
			streams:  map[string][]string{"ORDERS": {"a", "b", "c"}, "PAYMENTS": {"c", "d", "e"}},
			want:     Report{Checked: 5, Duplicated: 1},
			examples: []string{"duplicated: c in PAYMENTS"},
		},
		{
			name:    "three copies count as one duplicated id",
			streams: map[string][]string{"ORDERS": {"a", "b", "c", "d", "e", "e"}, "PAYMENTS": {"e"}},
			want:    Report{Checked: 5, Duplicated: 1},
		},
		{
			name:    "two ids duplicated",
			streams: map[string][]string{"ORDERS": {"a", "a", "b", "c", "d", "e", "e"}},
			want:    Report{Checked: 5, Duplicated: 2},
		},
		{
			name:     "out of order within a stream",
			streams:  map[string][]string{"ORDERS": {"a", "c", "b", "d", "e"}},
			want:     Report{Checked: 5, OutOfOrder: 1},
			examples: []string{"out of order in ORDERS: b (commit #1) after c (commit #2)"},
		},
		{
			name:    "one early event puts the ones it jumped out of order",
			streams: map[string][]string{"ORDERS": {"e", "a", "b", "c", "d"}},
			want:    Report{Checked: 5, OutOfOrder: 4},
		},
		{
			name:    "reversed stream",
			streams: map[string][]string{"ORDERS": {"e", "d", "c", "b", "a"}},
			want:    Report{Checked: 5, OutOfOrder: 4},
		},
		{
			name:    "out of order in one stream of two",
			streams: map[string][]string{"ORDERS": {"a", "c", "e"}, "PAYMENTS": {"d", "b"}},
			want:    Report{Checked: 5, OutOfOrder: 1},
		},
		{
			name: "order across different streams is not checked",
			// PAYMENTS holds an earlier commit than the last one of ORDERS:
			// that is fine, order is kept per stream.
			streams: map[string][]string{"ORDERS": {"c", "d", "e"}, "PAYMENTS": {"a", "b"}},
			want:    Report{Checked: 5},
		},
		{
			name:    "interleaved streams each in order",
			streams: map[string][]string{"A": {"b", "e"}, "B": {"a", "d"}, "C": {"c"}},
			want:    Report{Checked: 5},
		},
		{
			name:     "from a rolled-back transaction",
			streams:  map[string][]string{"ORDERS": {"a", "b", "x", "c", "d", "e"}},
			want:     Report{Checked: 5, FromRolledBack: 1},
			examples: []string{"from a rolled-back transaction: x in ORDERS"},
		},
		{
			name:    "rolled-back ids in two streams",
			streams: map[string][]string{"ORDERS": {"a", "b", "x", "c"}, "PAYMENTS": {"y", "d", "e"}},
			want:    Report{Checked: 5, FromRolledBack: 2},
		},
		{
			name:    "rolled-back id does not disturb the order check",
			streams: map[string][]string{"ORDERS": {"a", "b", "c", "d", "x", "e"}},
			want:    Report{Checked: 5, FromRolledBack: 1},
		},
		{
			name:    "every fault at once",
			streams: map[string][]string{"ORDERS": {"a", "c", "b", "b", "x"}, "PAYMENTS": {"a", "e"}},
			want:    Report{Checked: 5, Lost: 1, Duplicated: 2, OutOfOrder: 2, FromRolledBack: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, rb := committed, rolledBack
			if tt.committed != nil {
				c = tt.committed
			}
			if tt.rolledBack != nil {
				rb = tt.rolledBack
			}
			got := Check(c, rb, tt.streams)
			ex := got.Examples
			got.Examples = nil
			if got.Checked != tt.want.Checked || got.Lost != tt.want.Lost || got.Duplicated != tt.want.Duplicated ||
				got.OutOfOrder != tt.want.OutOfOrder || got.FromRolledBack != tt.want.FromRolledBack {
				t.Fatalf("Check = %s\nwant    %s\nexamples: %q", got, tt.want, ex)
			}
			clean := tt.want.Lost == 0 && tt.want.Duplicated == 0 && tt.want.OutOfOrder == 0 && tt.want.FromRolledBack == 0
			if got.OK() != clean {
				t.Fatalf("OK() = %v for %s", got.OK(), got)
			}
			if clean && len(ex) != 0 {
				t.Fatalf("clean run has examples: %q", ex)
			}
			if !clean && len(ex) == 0 {
				t.Fatal("a failed check gives no example")
			}
			for _, e := range tt.examples {
				found := false
				for _, g := range ex {
					found = found || g == e
				}
				if !found {
					t.Errorf("examples %q lack %q", ex, e)
				}
			}
		})
	}
}

func TestCheckDoesNotChangeItsInput(t *testing.T) {
	committed := []string{"a", "b", "c"}
	streams := map[string][]string{"S": {"c", "b", "a"}}
	Check(committed, nil, streams)
	if strings.Join(committed, ",") != "a,b,c" || strings.Join(streams["S"], ",") != "c,b,a" {
		t.Fatalf("inputs changed: %v %v", committed, streams)
	}
}

func TestCheckIsDeterministic(t *testing.T) {
	committed := []string{"a", "b", "c", "d"}
	streams := map[string][]string{"Z": {"d", "c"}, "A": {"b", "a"}, "M": {"a", "c"}}
	first := Check(committed, nil, streams).String()
	for i := 0; i < 20; i++ {
		if got := Check(committed, nil, streams).String(); got != first {
			t.Fatalf("run %d:\n%s\nfirst:\n%s", i, got, first)
		}
	}
}

func TestCheckLimitsExamples(t *testing.T) {
	var committed []string
	for i := 0; i < 100; i++ {
		committed = append(committed, fmt.Sprintf("id-%d", i))
	}
	rep := Check(committed, nil, map[string][]string{})
	if rep.Lost != 100 {
		t.Fatalf("Lost = %d, want 100", rep.Lost)
	}
	if len(rep.Examples) != 10 {
		t.Fatalf("%d examples, want 10", len(rep.Examples))
	}
}

func TestReportString(t *testing.T) {
	rep := Report{Checked: 3, Lost: 1, Duplicated: 2, OutOfOrder: 3, FromRolledBack: 4, Examples: []string{"lost: a", "duplicated: b in S"}}
	want := "checked=3 lost=1 duplicated=2 out_of_order=3 from_rolled_back=4\n  lost: a\n  duplicated: b in S"
	if got := rep.String(); got != want {
		t.Fatalf("String() =\n%s\nwant\n%s", got, want)
	}
	if got := (Report{Checked: 7}).String(); got != "checked=7 lost=0 duplicated=0 out_of_order=0 from_rolled_back=0" {
		t.Fatalf("String() = %q", got)
	}
	if !(Report{Checked: 7}).OK() {
		t.Fatal("a report with only Checked set is not OK")
	}
	for _, r := range []Report{{Lost: 1}, {Duplicated: 1}, {OutOfOrder: 1}, {FromRolledBack: 1}} {
		if r.OK() {
			t.Fatalf("%s is OK", r)
		}
	}
}
