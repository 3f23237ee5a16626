package config_test

import (
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/walbox/walbox/internal/config"
)

// The README's configuration table names every leaf key (a section such as
// nats.tls may be one row for its keys, and a list's fields one row).
func TestREADMEConfigTableListsEveryKey(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	keys := structKeys(reflect.TypeOf(config.Config{}), "")
	var missing []string
	for _, key := range keys {
		leaf := true
		for _, k := range keys {
			if strings.HasPrefix(k, key+".") {
				leaf = false
			}
		}
		if !leaf {
			continue
		}
		// A row may name several keys of one section: archive.s3.{endpoint,bucket}.
		if i := strings.LastIndex(key, "."); i > 0 && strings.Contains(readme, "`"+key[:i]+".{") {
			if braces := readme[strings.Index(readme, "`"+key[:i]+".{"):]; strings.Contains(braces[:strings.Index(braces, "}")], key[i+1:]) {
				continue
			}
		}
		parts := strings.Split(key, ".")
		covered := false
		// The key itself, or one of its parents (a row for a section or a
		// list, e.g. `nats.streams[]`, `nats.tls`, `archive.s3`).
		for i := len(parts); i > 0 && !covered; i-- {
			k := strings.Join(parts[:i], ".")
			covered = strings.Contains(readme, "`"+k+"`") || strings.Contains(readme, "`"+k+"[]`")
		}
		if !covered {
			missing = append(missing, key)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("README's configuration table lacks: %s", strings.Join(missing, ", "))
	}
}
