package main

import (
	"strings"
	"testing"
	"time"
)

// The live tail's JSON gives the commit time as acked_at_ms less
// commit_to_ack_ms; an event re-read from a snapshot has none.
func TestShownAfterCommitReadsTheTailsJSON(t *testing.T) {
	acked := time.UnixMilli(1_800_000_000_000)
	at := acked.Add(40 * time.Millisecond)
	d, ok := shownAfterCommit([]byte(`{"id":"a","acked_at_ms":1800000000000,"commit_to_ack_ms":2.500,"size":3}`), at)
	if !ok || d != 42500*time.Microsecond {
		t.Fatalf("got %v %v, want 42.5 ms", d, ok)
	}
	if _, ok := shownAfterCommit([]byte(`{"id":"b","acked_at_ms":1800000000000,"commit_to_ack_ms":null}`), at); ok {
		t.Fatal("an event without a commit time gave a latency")
	}
	if _, ok := shownAfterCommit([]byte(`not json`), at); ok {
		t.Fatal("a line that is not JSON gave a latency")
	}
}

// The console's rows give the viewer's commit → received percentiles, and
// judge the p99 against the console's 1 s.
func TestConsoleReportGivesCommitToShown(t *testing.T) {
	run := []liveResult{{Events: 1000, CPU: time.Second}}
	for _, tc := range []struct {
		worst   time.Duration
		verdict string
	}{{900 * time.Millisecond, met(true)}, {1500 * time.Millisecond, met(false)}} {
		r := &results{}
		r.console.Off, r.console.On = run, run
		for i := range 100 {
			r.console.Shown = append(r.console.Shown, time.Duration(i+1)*time.Millisecond)
		}
		r.console.Shown[50] = tc.worst
		r.console.Shown[51] = tc.worst
		var value, verdict string
		r.consoleReport(func(string) {}, func(what, v, target, vd string) {
			if strings.Contains(what, "commit → event received") {
				value, verdict = v, vd
			}
		})
		if verdict != tc.verdict || !strings.Contains(value, "(100 events)") || !strings.Contains(value, ms(tc.worst)) {
			t.Fatalf("worst %v: row %q, verdict %q; want the percentiles and %q", tc.worst, value, verdict, tc.verdict)
		}
	}
}
