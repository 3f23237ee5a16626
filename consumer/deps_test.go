package consumer_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoRelayCode: a service importing consumer links none of the relay.
func TestNoRelayCode(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/walbox/walbox/consumer").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "github.com/walbox/walbox/") && dep != "github.com/walbox/walbox/consumer" {
			t.Errorf("consumer depends on %s", dep)
		}
	}
}
