package deploytest

import (
	"os/exec"
	"strings"
	"testing"
)

// TestWalboxBinaryLinksNoTestCode keeps the test harnesses out of the
// shipped binary: `walbox dev` uses internal/pgcluster and
// internal/natsembed, never internal/pgtest or internal/natstest, which
// import package testing (and with it its flags).
func TestWalboxBinaryLinksNoTestCode(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/walbox/walbox/cmd/walbox").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		switch {
		case pkg == "testing", strings.HasPrefix(pkg, "testing/"),
			strings.HasSuffix(pkg, "/internal/pgtest"), strings.HasSuffix(pkg, "/internal/natstest"):
			t.Errorf("cmd/walbox links %s", pkg)
		}
	}
}
