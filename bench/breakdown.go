package main

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// Where a relay's CPU goes, from its CPU profile: each sample goes to the
// first group (in this order) that a frame of its stack belongs to, so GC
// assists count as GC, a socket write under nats.go as a system call, and
// a copy under the decoder as decoding. It is the evidence beside issue
// 36's relay-CPU targets: what limits the relay.
var relayGroups = []struct {
	name  string
	funcs []string // substrings of function names
}{
	{"garbage collection (background and assists)", []string{"runtime.gcBgMarkWorker", "runtime.gcAssistAlloc", "runtime.bgsweep", "runtime.bgscavenge"}},
	{"nats.go encoding headers", []string{"nats%2ego.(*Msg).headerBytes", "nats%2ego.encodeHeaders", "nats%2ego.(*Msg).headerSize"}},
	{"system calls (socket reads and writes)", []string{"syscall.Syscall", "syscall.RawSyscall", "internal/runtime/syscall"}},
	{"the rest of nats.go (publish, flush, reading acks)", []string{"nats-io/nats.go", "nats%2ego"}},
	{"pgoutput: receiving and decoding (cdc, pglogrepl, pgx)", []string{"walbox/walbox/cdc", "jackc/pglogrepl", "jackc/pgx"}},
	{"tracing", []string{"walbox/internal/leantrace", "go.opentelemetry.io"}},
	{"reading the clock (time.Now)", []string{"time.Now"}},
	{"walbox's publish path (relay/jssink: batches, acks)", []string{"walbox/walbox/relay/jssink"}},
	{"walbox's relay (routing, the message's headers, window, checkpoint)", []string{"walbox/walbox/relay", "walbox/walbox/internal"}},
}

// relayBreakdown returns the groups' shares of a relay profile's samples,
// largest first, and the sample count.
func relayBreakdown(path string) (string, int64, error) {
	prof, n, err := readCPUProfile(path)
	if err != nil {
		return "", 0, err
	}
	counts := make([]int64, len(relayGroups)+1) // the last: everything else
	var total int64
	for _, s := range prof.Sample {
		v := s.Value[n]
		total += v
		g := len(relayGroups)
		for i, grp := range relayGroups {
			if stackHas(s, grp.funcs...) {
				g = i
				break
			}
		}
		counts[g] += v
	}
	type share struct {
		name string
		n    int64
	}
	shares := make([]share, 0, len(counts))
	for i, c := range counts {
		name := "the Go scheduler and the rest of the runtime"
		if i < len(relayGroups) {
			name = relayGroups[i].name
		}
		shares = append(shares, share{name, c})
	}
	slices.SortStableFunc(shares, func(a, b share) int { return cmp.Compare(b.n, a.n) })
	parts := make([]string, 0, len(shares))
	for _, s := range shares {
		if s.n > 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f %%", s.name, 100*float64(s.n)/float64(max(total, 1))))
		}
	}
	return strings.Join(parts, "; "), total, nil
}
