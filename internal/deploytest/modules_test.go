package deploytest

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// libraries are walbox's Go libraries for services, each a module of its
// own so that a service importing one gets only what the library needs:
// allowed lists the module paths (or path prefixes, ending in /) that may
// appear in its dependency graph.
var libraries = []struct {
	dir, module string
	direct      []string // the most its go.mod may require directly
	allowed     []string
}{
	{
		dir: "outbox", module: "github.com/walbox/walbox/outbox",
		direct: []string{"github.com/jackc/pgx/v5", "github.com/google/uuid", "go.opentelemetry.io/otel", "go.opentelemetry.io/otel/trace"},
		allowed: []string{
			"github.com/jackc/pgx/v5", "github.com/jackc/pgpassfile", "github.com/jackc/pgservicefile", "github.com/jackc/puddle/v2",
			"github.com/google/uuid", "go.opentelemetry.io/", "github.com/go-logr/", "github.com/cespare/xxhash/v2", "golang.org/x/",
			// Test dependencies of those, in go.sum only for `go mod verify`.
			"github.com/google/go-cmp", "github.com/stretchr/", "github.com/davecgh/go-spew", "github.com/pmezard/go-difflib",
			"gopkg.in/yaml.v3", "go.yaml.in/yaml/v3", "gopkg.in/check.v1", "github.com/kr/pretty", "github.com/rogpeppe/go-internal",
		},
	},
	{
		dir: "consumer", module: "github.com/walbox/walbox/consumer",
		direct: []string{"github.com/jackc/pgx/v5", "github.com/nats-io/nats.go", "go.opentelemetry.io/otel", "go.opentelemetry.io/otel/trace"},
		allowed: []string{
			"github.com/jackc/pgx/v5", "github.com/jackc/pgpassfile", "github.com/jackc/pgservicefile", "github.com/jackc/puddle/v2",
			"github.com/nats-io/nats.go", "github.com/nats-io/nkeys", "github.com/nats-io/nuid", "github.com/klauspost/compress",
			"go.opentelemetry.io/", "github.com/go-logr/", "github.com/cespare/xxhash/v2", "golang.org/x/",
			"github.com/google/go-cmp", "github.com/stretchr/", "github.com/davecgh/go-spew", "github.com/pmezard/go-difflib",
			"gopkg.in/yaml.v3", "go.yaml.in/yaml/v3", "gopkg.in/check.v1", "github.com/kr/pretty", "github.com/rogpeppe/go-internal",
		},
	},
}

// relayOnly are modules of the relay that a library must never bring in,
// named so a failure says what leaked.
var relayOnly = []string{
	"github.com/nats-io/nats-server/v2", "github.com/minio/", "github.com/jackc/pglogrepl",
	"github.com/prometheus/", "github.com/rs/zerolog", "github.com/spf13/cobra", "github.com/johannesboyne/gofakes3",
}

func allowedBy(list []string, mod string) bool {
	for _, a := range list {
		if mod == a || strings.HasSuffix(a, "/") && strings.HasPrefix(mod, a) {
			return true
		}
	}
	return false
}

// goMod is what these tests read of a go.mod.
type goMod struct {
	module   string
	requires map[string]bool // path -> indirect
	replaces map[string]string
}

// readGoMod reads the module, require and replace directives, in their
// one-line and block forms.
func readGoMod(t *testing.T, path string) goMod {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := goMod{requires: map[string]bool{}, replaces: map[string]string{}}
	block := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := sc.Text()
		indirect := strings.Contains(line, "// indirect")
		if i := strings.Index(line, "//"); i >= 0 {
			line = line[:i]
		}
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if block != "" {
			if f[0] == ")" {
				block = ""
				continue
			}
			f = append([]string{block}, f...)
		} else if len(f) == 2 && f[1] == "(" {
			block = f[0]
			continue
		}
		switch f[0] {
		case "module":
			m.module = f[1]
		case "require":
			m.requires[f[1]] = indirect
		case "replace":
			if i := slices.Index(f, "=>"); i > 0 && i+1 < len(f) {
				m.replaces[f[1]] = f[i+1]
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestLibrariesDoNotPullInTheRelay keeps a service that imports outbox or
// consumer free of the relay's dependencies: the libraries' go.mod, go.sum
// and module graph name only what the library needs (nats-server, minio,
// pglogrepl are the relay's), and neither library requires walbox's root
// module, which would bring all of them back.
func TestLibrariesDoNotPullInTheRelay(t *testing.T) {
	for _, lib := range libraries {
		t.Run(lib.dir, func(t *testing.T) {
			dir := filepath.Join(root, lib.dir)
			mod := readGoMod(t, filepath.Join(dir, "go.mod"))
			if mod.module != lib.module {
				t.Fatalf("%s/go.mod: module %q, want %q", lib.dir, mod.module, lib.module)
			}
			if len(mod.replaces) > 0 {
				t.Errorf("%s/go.mod replaces %v: a library's replace is ignored by the services that import it", lib.dir, mod.replaces)
			}
			for path, indirect := range mod.requires {
				if !indirect && !slices.Contains(lib.direct, path) {
					t.Errorf("%s/go.mod requires %s directly; the library needs only %v", lib.dir, path, lib.direct)
				}
			}

			check := func(where string, mods []string) {
				t.Helper()
				if len(mods) == 0 {
					t.Fatalf("%s lists no module", where)
				}
				for _, m := range mods {
					switch {
					case m == lib.module:
					case m == "github.com/walbox/walbox" || strings.HasPrefix(m, "github.com/walbox/"):
						t.Errorf("%s names %s: the library must not depend on walbox's other modules", where, m)
					case allowedBy(relayOnly, m):
						t.Errorf("%s names %s, a dependency of the relay, not of the library", where, m)
					case !allowedBy(lib.allowed, m):
						t.Errorf("%s names %s, which the library does not need (allowed: %v)", where, m, lib.allowed)
					}
				}
			}

			sum, err := os.ReadFile(filepath.Join(dir, "go.sum"))
			if err != nil {
				t.Fatal(err)
			}
			var summed []string
			for line := range strings.Lines(string(sum)) {
				if f := strings.Fields(line); len(f) > 0 && !slices.Contains(summed, f[0]) {
					summed = append(summed, f[0])
				}
			}
			check(lib.dir+"/go.sum", summed)

			// The module graph as the go command sees it (read from the
			// module cache: no network once the module's tests have run).
			cmd := exec.CommandContext(t.Context(), "go", "mod", "graph")
			cmd.Dir = dir
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("go mod graph in %s: %v\n%s", lib.dir, err, exitStderr(err))
			}
			var graph []string
			for _, node := range strings.Fields(string(out)) {
				m, _, _ := strings.Cut(node, "@")
				if m != "go" && m != "toolchain" && !slices.Contains(graph, m) {
					graph = append(graph, m)
				}
			}
			check("go mod graph in "+lib.dir, graph)
		})
	}
}

func exitStderr(err error) []byte {
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.Stderr
	}
	return nil
}

// TestLibraryModulesAreWiredIn: each library module is replaced with its
// directory in walbox's go.mod and in the benchmark's (a replace in a
// dependency's go.mod is ignored), its go.mod is copied into the image
// before `go mod download`, and `make test` vets and tests it (./... of the
// root module stops at a nested module).
func TestLibraryModulesAreWiredIn(t *testing.T) {
	rootMod := readGoMod(t, filepath.Join(root, "go.mod"))
	benchMod := readGoMod(t, filepath.Join(root, "bench", "go.mod"))
	df := readRoot(t, "Dockerfile")
	mk := readRoot(t, "Makefile")
	libs := regexp.MustCompile(`(?m)^LIBS\s*:=(.*)$`).FindSubmatch(mk)
	if libs == nil {
		t.Fatal("Makefile has no LIBS")
	}
	download := strings.Index(string(df), "RUN go mod download")
	if download < 0 {
		t.Fatal("Dockerfile: no `RUN go mod download`")
	}
	var want []string
	for _, lib := range libraries {
		want = append(want, lib.dir)
		if _, ok := rootMod.requires[lib.module]; !ok {
			t.Errorf("go.mod does not require %s", lib.module)
		}
		if got := rootMod.replaces[lib.module]; got != "./"+lib.dir {
			t.Errorf("go.mod replaces %s with %q, want ./%s", lib.module, got, lib.dir)
		}
		if got := benchMod.replaces[lib.module]; got != "../"+lib.dir {
			t.Errorf("bench/go.mod replaces %s with %q, want ../%s", lib.module, got, lib.dir)
		}
		cp := regexp.MustCompile(`(?m)^COPY ` + lib.dir + `/go\.mod ` + lib.dir + `/go\.sum \./` + lib.dir + `/\s*$`).FindIndex(df)
		if cp == nil || cp[0] > download {
			t.Errorf("Dockerfile: want `COPY %[1]s/go.mod %[1]s/go.sum ./%[1]s/` before `go mod download`", lib.dir)
		}
	}
	// Every local replace of the root module is one of the libraries.
	for path, dir := range rootMod.replaces {
		if strings.HasPrefix(dir, "./") && !slices.Contains(want, strings.TrimPrefix(dir, "./")) {
			t.Errorf("go.mod replaces %s with %s, a module these tests do not know", path, dir)
		}
	}
	got := strings.Fields(string(libs[1]))
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("Makefile LIBS = %v, want %v", got, want)
	}
	for _, target := range []string{"test", "lint"} {
		body := regexp.MustCompile(`(?ms)^` + target + `:\n(.*?)\n\n`).FindSubmatch(mk)
		if body == nil {
			t.Fatalf("Makefile has no %s target", target)
		}
		if !strings.Contains(string(body[1]), "for m in $(LIBS); do (cd $$m && $(GO) vet ./...") {
			t.Errorf("make %s does not vet the library modules", target)
		}
		if target == "test" && !strings.Contains(string(body[1]), "for m in $(LIBS); do (cd $$m && $(GO) test -race -count=1 ./...)") {
			t.Errorf("make test does not test the library modules")
		}
	}
}
