package claimtest

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/consumer"
)

// TestA64MiBEventBetweenSmallOnes: an event of 64 MiB between small events,
// through a relay process of its own, is delivered once and in order, by
// reference, and the consumer library hands its handler the row's payload
// byte for byte. The relay's peak RSS is logged for the record (measured
// by make bench, never asserted here; a -race build inflates it).
func TestA64MiBEventBetweenSmallOnes(t *testing.T) {
	e := newEnv(t)
	cmd, _ := e.spawnRelay()
	e.insert(100)
	large := e.insert(64 * MiB)
	e.insert(100)
	if n := len(e.payloads[large]); n < 64*MiB {
		t.Fatalf("the large row's payload is %d bytes, want at least 64 MiB", n)
	}
	msgs := e.stored(120 * time.Second)
	for _, m := range msgs {
		id, ref := m.Headers().Get("Nats-Msg-Id"), m.Headers().Get(consumer.HeaderClaimCheck)
		if (id == large) != (ref != "") || (id == large && len(m.Data()) != 0) {
			t.Errorf("event %s: reference %q, %d bytes of body; want a reference and no body exactly for the 64 MiB event", id, ref, len(m.Data()))
		}
	}
	if hwm, ok := peakRSS(cmd.Process.Pid); ok {
		t.Logf("relay process peak RSS (VmHWM): %d MiB", hwm>>20)
	}
	e.wantHandledAsRows()
}

// peakRSS is the VmHWM of process pid in bytes (false where /proc has
// none).
func peakRSS(pid int) (int64, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, false
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err == nil
		}
	}
	return 0, false
}
