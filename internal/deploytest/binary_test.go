package deploytest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestLinkedPackages checks what each shipped package links:
//   - the walbox binary no test harness: `walbox dev` uses
//     internal/pgcluster and internal/natsembed, never internal/pgtest or
//     internal/natstest, which import package testing (and with it its
//     flags);
//   - the producer and consumer libraries none of the relay, so that a
//     service importing them gets none of it.
func TestLinkedPackages(t *testing.T) {
	const walbox = "github.com/walbox/walbox/"
	testCode := func(pkg string) bool {
		return pkg == "testing" || strings.HasPrefix(pkg, "testing/") ||
			strings.HasSuffix(pkg, "/internal/pgtest") || strings.HasSuffix(pkg, "/internal/natstest")
	}
	for _, tc := range []struct {
		pkg       string
		forbidden func(dep string) bool
	}{
		{walbox + "cmd/walbox", testCode},
		{walbox + "outbox", func(dep string) bool { return strings.HasPrefix(dep, walbox) && dep != walbox+"outbox" }},
		{walbox + "consumer", func(dep string) bool { return strings.HasPrefix(dep, walbox) && dep != walbox+"consumer" }},
	} {
		out, err := exec.Command("go", "list", "-deps", tc.pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", tc.pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			if tc.forbidden(dep) {
				t.Errorf("%s links %s", tc.pkg, dep)
			}
		}
	}
}

// TestBuildSetsTheRuntimesDefaultGODEBUG: the Makefile builds walbox with a
// default GODEBUG linked in (runtime.godebugDefault, the variable the go
// command itself sets from //go:debug lines, which do not take schedtrace),
// and the benchmark builds it the same way. The linker ignores -X for a
// variable that does not exist, so a Go release that renamed it would drop
// the setting silently: a program linked the same way with a short
// schedtrace period must print the scheduler's trace, and not when the
// environment's GODEBUG turns it off.
func TestBuildSetsTheRuntimesDefaultGODEBUG(t *testing.T) {
	var ldflags string
	for _, a := range goBuild(t, "Makefile", string(readRoot(t, "Makefile"))) {
		if strings.HasPrefix(a, "-ldflags=") {
			ldflags = a
		}
	}
	const prefix = "-ldflags=-X=runtime.godebugDefault="
	if !strings.HasPrefix(ldflags, prefix) || !strings.Contains(ldflags, "schedtrace=") {
		t.Fatalf("the Makefile's build sets no default schedtrace (%q)", ldflags)
	}
	bench := string(readRoot(t, "bench/env.go"))
	if !strings.Contains(bench, `walboxGODEBUG = "`+strings.TrimPrefix(ldflags, prefix)+`"`) || !strings.Contains(bench, `"`+prefix+`"`) {
		t.Errorf("bench/env.go does not build walbox with the Makefile's %s", ldflags)
	}

	dir := t.TempDir()
	src := "package main\n\nimport \"time\"\n\nfunc main() { time.Sleep(300 * time.Millisecond) }\n"
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module sleeper\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "sleeper")
	build := exec.Command("go", "build", prefix+"schedtrace=50", "-o", bin, ".")
	build.Dir = dir
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	for _, tc := range []struct {
		godebug string
		trace   bool
	}{{"", true}, {"schedtrace=0", false}} {
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), "GODEBUG="+tc.godebug)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("GODEBUG=%q: %v\n%s", tc.godebug, err, stderr.String())
		}
		if got := strings.Contains(stderr.String(), "SCHED "); got != tc.trace {
			t.Errorf("GODEBUG=%q: scheduler trace printed %v, want %v (stderr %q)", tc.godebug, got, tc.trace, stderr.String())
		}
	}
}
