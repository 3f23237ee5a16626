package main

import (
	"strings"
	"testing"
	"time"
)

func TestPGSideTableGivesMediansAgainstTodaysOptions(t *testing.T) {
	ms := func(total, sys int) pgsideRun {
		return pgsideRun{WalsenderCPU: time.Duration(total) * time.Millisecond, WalsenderSys: time.Duration(sys) * time.Millisecond, Took: time.Second}
	}
	r := &pgsideResult{Events: 1000, Rounds: 3, Skipped: map[string]string{"c": "needs PostgreSQL 15+", "d": "needs PostgreSQL 15+"},
		Runs: map[string][]pgsideRun{
			// (a): totals 6, 8, 10 µs/event; user 3, 4, 5; kernel 3, 4, 5.
			"a": {ms(10, 5), ms(6, 3), ms(8, 4)},
			// (b): totals 6, 7, 9 µs/event; user 3, 3, 4; kernel 3, 4, 5.
			"b": {ms(7, 4), ms(9, 5), ms(6, 3)},
		}}
	md := r.markdown()
	for _, want := range []string{
		"| (a) today: proto_version 1, text, whole row | 8.00 (+0 %) | 4.00 (+0 %) | 4.00 (+0 %) | 1000 | 10.00, 6.00, 8.00 |",
		"| (b) binary 'true' | 7.00 (-12 %) | 3.00 (-25 %) | 4.00 (+0 %) | 1000 | 7.00, 9.00, 6.00 |",
		"| (c) column list (no processed, processed_at, attempts, error) | skipped: needs PostgreSQL 15+ |",
		"| (d) binary + column list | skipped: needs PostgreSQL 15+ |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("table lacks %q:\n%s", want, md)
		}
	}
	if (*pgsideResult)(nil).markdown() != "" {
		t.Error("a phase that did not run renders something")
	}
}
