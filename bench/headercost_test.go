package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/pprof/profile"
)

// writeProfile writes a CPU profile whose samples have the given stacks
// (leaf first), each with count samples.
func writeProfile(t *testing.T, stacks map[string]int64) string {
	t.Helper()
	p := &profile.Profile{
		SampleType: []*profile.ValueType{{Type: "samples", Unit: "count"}, {Type: "cpu", Unit: "nanoseconds"}},
		PeriodType: &profile.ValueType{Type: "cpu", Unit: "nanoseconds"}, Period: 10_000_000,
	}
	funcs := map[string]*profile.Function{}
	var id uint64
	for stack, n := range stacks {
		var locs []*profile.Location
		for _, name := range strings.Split(stack, ";") {
			fn := funcs[name]
			if fn == nil {
				id++
				fn = &profile.Function{ID: id, Name: name}
				funcs[name] = fn
				p.Function = append(p.Function, fn)
			}
			loc := &profile.Location{ID: uint64(len(p.Location) + 1), Line: []profile.Line{{Function: fn}}}
			p.Location = append(p.Location, loc)
			locs = append(locs, loc)
		}
		p.Sample = append(p.Sample, &profile.Sample{Location: locs, Value: []int64{n, n * 10_000_000}})
	}
	path := filepath.Join(t.TempDir(), "relay.pprof")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := p.Write(f); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestRelayBreakdownGivesEachSampleToItsFirstGroup(t *testing.T) {
	path := writeProfile(t, map[string]int64{
		// GC first: an assist under the router is GC.
		"runtime.scanObject;runtime.gcAssistAlloc;runtime.mallocgc;github.com/walbox/walbox/relay.(*Router).Message": 10,
		// Header encoding before system calls and the rest of nats.go.
		"runtime.memmove;github.com/nats-io/nats%2ego.encodeHeaders;github.com/nats-io/nats%2ego.(*Msg).headerBytes;github.com/nats-io/nats%2ego.(*Conn).PublishMsg": 40,
		// A socket write under nats.go is a system call.
		"internal/runtime/syscall/linux.Syscall6;syscall.Syscall;github.com/nats-io/nats%2ego.(*Conn).flusher": 20,
		"github.com/nats-io/nats%2ego.(*Conn).processMsg;github.com/nats-io/nats%2ego.(*Conn).readLoop":        5,
		"runtime.memmove;github.com/walbox/walbox/cdc.(*Decoder).Decode":                                       10,
		"time.runtimeNow;time.Now;github.com/walbox/walbox/relay.(*loop).done":                                 5,
		"runtime.findRunnable;runtime.schedule":                                                                10,
	})
	got, n, err := relayBreakdown(path)
	if err != nil {
		t.Fatal(err)
	}
	if n != 100 {
		t.Fatalf("samples %d, want 100", n)
	}
	want := "nats.go encoding headers 40 %; system calls (socket reads and writes) 20 %; garbage collection (background and assists) 10 %; " +
		"pgoutput: receiving and decoding (cdc, pglogrepl, pgx) 10 %; the Go scheduler and the rest of the runtime 10 %; " +
		"the rest of nats.go (publish, flush, reading acks) 5 %; reading the clock (time.Now) 5 %"
	if got != want {
		t.Fatalf("breakdown\n got %s\nwant %s", got, want)
	}
}

func TestBatchReportSaysWhyTheCeilingIsMissedAndWhatHeadersCost(t *testing.T) {
	n := 300_000
	c := catchupResult{Events: n, Took: 4 * time.Second, CPU: 1860 * time.Millisecond, WalsenderCPU: 1260 * time.Millisecond, Busy: 0.89,
		Where: []cpuShare{{Label: "walbox relay", CPU: 1860 * time.Millisecond}, {Label: "bench driver + nats-server", CPU: 4040 * time.Millisecond},
			{Label: "postgres walsender", CPU: 1260 * time.Millisecond}, {Label: "other: kworker", CPU: 5 * time.Second}}}
	cb := concurrentResult{Busy: 0.85, Decode: ceilingResult{Events: n, Took: 2 * time.Second}, Publish: ceilingResult{Events: n, Took: 3 * time.Second},
		Where: []cpuShare{{Label: "bench driver + nats-server", CPU: 2790 * time.Millisecond}, {Label: "postgres exited backends and walsenders", CPU: 1440 * time.Millisecond}}}
	a := c
	a.Busy, a.Where = 0.80, []cpuShare{{Label: "walbox relay", CPU: 10 * time.Second}}
	a.Batch.Atomic = uint64(n)
	g := bigResult{Rows: 1_000_000, Took: 20 * time.Second, RelaySpan: 20 * time.Second, RelayBusy: 0.9,
		RelayWhere: []cpuShare{{Label: "walbox relay", CPU: 10 * time.Second}, {Label: "bench driver + nats-server", CPU: 20 * time.Second}}}
	gp := g
	gp.Took, gp.RelayWhere = 25*time.Second, []cpuShare{{Label: "bench driver + nats-server", CPU: 40 * time.Second}}
	r := &results{catchup: c, perMsg: c, atomic: a, big: g, bigPerMsg: gp, concBatch: cb, headerCost: map[string][]headerCostRun{
		hdrIDOnly: {{Events: n, CPU: 3 * time.Second, HeaderBytes: 63, Samples: 100, Publisher: 10, Lookups: 10, Took: time.Second}},
		hdrWalbox: {{Events: n, CPU: 4 * time.Second, HeaderBytes: 254, Samples: 100, Publisher: 15, Lookups: 20, Took: 2 * time.Second}},
	}}
	r.tracedProfiles.CatchUpWhere, r.tracedProfiles.CatchUpSamples = "nats.go encoding headers 40 %", 1000
	rows := map[string]string{}
	r.batchReport(func(string) {}, func(what, value, target, verdict string) { rows[what] = value })
	find := func(part string) string {
		for what, v := range rows {
			if strings.Contains(what, part) {
				return v
			}
		}
		t.Fatalf("no row with %q in %v", part, rows)
		return ""
	}
	// 7.16 s over 300,000 events = 23.9 µs, 4.23 s = 14.1 µs (the foreign
	// group left out); (0.89/23.9) / (0.85/14.1) = 0.62.
	if got, want := find("relay run / concurrent ceiling with the batched publisher (the relay process 6.2 µs of the first)"), "23.9 / 14.1 µs; 89% / 85% of 2 CPUs; 0.62"; !strings.HasPrefix(got, "23.9 / 14.1 µs; 89% / 85% of ") || !strings.HasSuffix(got, "; 0.62") {
		t.Errorf("why row %q, want %q", got, want)
	}
	// Atomic: 10 s over 300,000 = 33.3 µs at 80 % against the fast
	// batches' 23.9 at 89 %: (0.80/33.3) / (0.89/23.9) = 0.64.
	if got := find("atomic transactions / fast batches"); !strings.HasPrefix(got, "33.3 / 23.9 µs; 80% / 89% of ") || !strings.HasSuffix(got, "; 0.64") {
		t.Errorf("atomic why row %q", got)
	}
	// The large transaction, relaying only: 30 s / 1,000,000 = 30.0 µs at
	// 90 %, 40 s = 40.0 µs at 90 %: 1.33.
	if got := find("from the commit to the last ack (foreign load left out)"); !strings.HasPrefix(got, "30.0 / 40.0 µs; 90% / 90% of ") || !strings.HasSuffix(got, "; 1.33") {
		t.Errorf("large transaction why row %q", got)
	}
	// 3 s × 90 % = 2.7 s over 300,000 = 9.0 µs; 4 s × 85 % = 11.3 µs.
	if got, want := find("what walbox's headers cost a fast batch"), "nats-server 9.0 / 11.3 µs/msg (of which its header look-ups 1.0 / 2.7); publisher 1.0 / 2.0 µs/msg; 300000 / 150000 msgs/s"; got != want {
		t.Errorf("header cost row\n got %s\nwant %s", got, want)
	}
	if got := find("what the relay's CPU is spent on"); got != "nats.go encoding headers 40 %" {
		t.Errorf("breakdown row %q", got)
	}
}

func TestMergeWhereAddsTwoPhasesByGroup(t *testing.T) {
	got := mergeWhere([]cpuShare{{Label: "a", CPU: 1}, {Label: "b", CPU: 5, Wait: 1}}, []cpuShare{{Label: "b", CPU: 1, Wait: 2}, {Label: "c", CPU: 3}})
	want := []cpuShare{{Label: "b", CPU: 6, Wait: 3}, {Label: "c", CPU: 3}, {Label: "a", CPU: 1}}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
}
