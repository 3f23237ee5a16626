package deploytest

import (
	"os/exec"
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
