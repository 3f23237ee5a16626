package deploytest

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
)

// root is the repository root, relative to this package.
const root = "../.."

// readRoot reads the file name at the repository's root.
func readRoot(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// words is a compose field that may be a string or a list of strings.
type words []string

func (w *words) UnmarshalYAML(n *yaml.Node) error {
	switch n.Kind {
	case yaml.ScalarNode:
		*w = strings.Fields(n.Value)
		return nil
	case yaml.SequenceNode:
		var s []string
		if err := n.Decode(&s); err != nil {
			return err
		}
		*w = s
		return nil
	}
	return fmt.Errorf("line %d: want a string or a list of strings", n.Line)
}

type build struct {
	Context    string `yaml:"context"`
	Dockerfile string `yaml:"dockerfile"`
}

func (b *build) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		b.Context = n.Value
		return nil
	}
	type plain build
	return n.Decode((*plain)(b))
}

type service struct {
	Image       string            `yaml:"image"`
	Build       *build            `yaml:"build"`
	Entrypoint  words             `yaml:"entrypoint"`
	Command     words             `yaml:"command"`
	Environment map[string]string `yaml:"environment"`
	Volumes     []string          `yaml:"volumes"`
	Ports       []string          `yaml:"ports"`
	DependsOn   map[string]struct {
		Condition string `yaml:"condition"`
	} `yaml:"depends_on"`
	Healthcheck *struct {
		Test words `yaml:"test"`
	} `yaml:"healthcheck"`
}

type compose struct {
	Services map[string]service `yaml:"services"`
}

func loadCompose(t *testing.T) compose {
	t.Helper()
	data := readRoot(t, "docker-compose.yml")
	var c compose
	if err := yaml.Unmarshal(data, &c); err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	for _, name := range []string{"postgres", "nats", "walbox", "producer"} {
		if _, ok := c.Services[name]; !ok {
			t.Fatalf("docker-compose.yml has no %s service", name)
		}
	}
	return c
}

// hostPath returns the repository file bind-mounted at containerPath.
func (s service) hostPath(t *testing.T, containerPath string) string {
	t.Helper()
	for _, v := range s.Volumes {
		parts := strings.Split(v, ":")
		if len(parts) >= 2 && parts[1] == containerPath && strings.HasPrefix(parts[0], ".") {
			return filepath.Join(root, parts[0])
		}
	}
	t.Fatalf("nothing from the repository is mounted at %s (volumes %v)", containerPath, s.Volumes)
	return ""
}

// argAfter returns the value following one of flags in args.
func argAfter(args []string, flags ...string) string {
	for i, a := range args {
		for _, f := range flags {
			if a == f && i+1 < len(args) {
				return args[i+1]
			}
			if v, ok := strings.CutPrefix(a, f+"="); ok {
				return v
			}
		}
	}
	return ""
}

func TestComposePostgresIs17WithLogicalWALAndACappedSlot(t *testing.T) {
	pg := loadCompose(t).Services["postgres"]
	if !regexp.MustCompile(`^postgres:17([.-].*)?$`).MatchString(pg.Image) {
		t.Errorf("postgres image %q: want PostgreSQL 17 (postgres:17...)", pg.Image)
	}
	settings := map[string]string{}
	for i, a := range pg.Command {
		if a == "-c" && i+1 < len(pg.Command) {
			k, v, _ := strings.Cut(pg.Command[i+1], "=")
			settings[k] = v
		}
	}
	if len(pg.Command) == 0 || pg.Command[0] != "postgres" {
		t.Errorf("postgres command %v: want postgres -c ...", pg.Command)
	}
	if settings["wal_level"] != "logical" {
		t.Errorf("wal_level = %q in the postgres command, want logical", settings["wal_level"])
	}
	if v, ok := settings["max_slot_wal_keep_size"]; !ok || v == "" || v == "-1" {
		t.Errorf("max_slot_wal_keep_size = %q: set a cap, so a stuck slot cannot fill the disk", v)
	}
	if pg.Healthcheck == nil || !strings.Contains(strings.Join(pg.Healthcheck.Test, " "), "pg_isready") {
		t.Errorf("postgres needs a pg_isready healthcheck for depends_on: service_healthy")
	}
}

func TestComposeNATSRunsJetStreamThatSyncsBeforeEveryAck(t *testing.T) {
	nats := loadCompose(t).Services["nats"]
	if !strings.HasPrefix(nats.Image, "nats:") {
		t.Errorf("nats image %q", nats.Image)
	}
	conf := argAfter(nats.Command, "--config", "-c")
	if conf == "" {
		t.Fatalf("nats command %v names no config file", nats.Command)
	}
	opts, err := server.ProcessConfigFile(nats.hostPath(t, conf))
	if err != nil {
		t.Fatalf("nats config: %v", err)
	}
	if !opts.JetStream {
		t.Error("JetStream is not enabled in the nats config")
	}
	if !opts.SyncAlways {
		t.Error("jetstream.sync_interval is not 'always': an ack would not mean the message is on disk")
	}
	stored := false
	for _, v := range nats.Volumes {
		if parts := strings.Split(v, ":"); len(parts) >= 2 && parts[1] == opts.StoreDir {
			stored = true
		}
	}
	if !stored {
		t.Errorf("the JetStream store %q is not on a volume: streams would not survive the container", opts.StoreDir)
	}
	if nats.Healthcheck == nil || !strings.Contains(strings.Join(nats.Healthcheck.Test, " "), "healthz") {
		t.Error("nats needs a /healthz healthcheck for depends_on: service_healthy")
	}
}

func TestComposeWalboxMigratesThenRunsAfterHealthyPostgresAndNATS(t *testing.T) {
	c := loadCompose(t)
	wb := c.Services["walbox"]
	if wb.Build == nil || filepath.Clean(wb.Build.Context) != "." || (wb.Build.Dockerfile != "" && wb.Build.Dockerfile != "Dockerfile") {
		t.Errorf("walbox must build from the repository's Dockerfile, got %+v", wb.Build)
	}
	for _, dep := range []string{"postgres", "nats"} {
		if wb.DependsOn[dep].Condition != "service_healthy" {
			t.Errorf("walbox depends on %s with condition %q, want service_healthy", dep, wb.DependsOn[dep].Condition)
		}
	}
	script := strings.Join(append(slices.Clone(wb.Entrypoint), wb.Command...), " ")
	migrate, run := strings.Index(script, "walbox migrate"), strings.Index(script, "walbox run")
	if migrate < 0 || run < 0 || migrate > run {
		t.Errorf("walbox must run `walbox migrate` and then `walbox run`, got %q", script)
	}
	if !strings.Contains(script, "&&") {
		t.Errorf("walbox run must not start when migrate fails: join them with &&, got %q", script)
	}
	if strings.Contains(script, "sh") && strings.Contains(runtimeImage(t), "distroless") {
		t.Errorf("the walbox command needs a shell, but the image is distroless")
	}

	// The config the container loads: the mounted file, then WALBOX_* vars.
	var env []string
	for k, v := range wb.Environment {
		env = append(env, k+"="+v)
	}
	path := wb.Environment["WALBOX_CONFIG"]
	if path == "" {
		t.Fatal("walbox has no WALBOX_CONFIG")
	}
	cfg, err := config.Load(wb.hostPath(t, path), env)
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("the compose walbox config is invalid: %v", err)
	}
	if !strings.Contains(cfg.Postgres.URL, "@postgres:5432/") {
		t.Errorf("postgres.url %q does not point at the postgres service", cfg.Postgres.URL)
	}
	if cfg.NATS.URL != "nats://nats:4222" {
		t.Errorf("nats.url %q does not point at the nats service", cfg.NATS.URL)
	}
	if strings.HasPrefix(cfg.Metrics.Listen, "127.0.0.1:") {
		t.Errorf("metrics.listen %q is loopback: the published port would not reach it", cfg.Metrics.Listen)
	}
	// Metrics and health have no authentication: the host publishes them on
	// its loopback only.
	for _, p := range wb.Ports {
		if strings.Contains(p, "9187") && !strings.HasPrefix(p, "127.0.0.1:") {
			t.Errorf("walbox publishes %q on every host interface; bind it to 127.0.0.1", p)
		}
	}
	if wb.Healthcheck == nil || !strings.Contains(strings.Join(wb.Healthcheck.Test, " "), "/readyz") {
		t.Error("walbox needs a /readyz healthcheck (the producer waits for it)")
	}

	// Every healthy-condition dependency has a healthcheck to wait for.
	for name, s := range c.Services {
		for dep, d := range s.DependsOn {
			if d.Condition == "service_healthy" && c.Services[dep].Healthcheck == nil {
				t.Errorf("%s waits for %s to be healthy, but %s has no healthcheck", name, dep, dep)
			}
		}
	}
}

func TestComposeProducerWritesEventsTheRelayCanRoute(t *testing.T) {
	c := loadCompose(t)
	p := c.Services["producer"]
	if p.DependsOn["walbox"].Condition != "service_healthy" {
		t.Errorf("the producer must wait for walbox (which creates outbox_events), got %+v", p.DependsOn)
	}
	entry := strings.Join(append(slices.Clone(p.Entrypoint), p.Command...), " ")
	script := argAfter(strings.Fields(entry), "bash")
	data, err := os.ReadFile(p.hostPath(t, script))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), "INSERT INTO outbox_events") {
		t.Errorf("%s does not insert into outbox_events", script)
	}
	wb := c.Services["walbox"]
	cfg, err := config.Load(wb.hostPath(t, wb.Environment["WALBOX_CONFIG"]), nil)
	if err != nil {
		t.Fatal(err)
	}
	topics := regexp.MustCompile(`topic=([a-z_.]+)`).FindAllStringSubmatch(string(data), -1)
	if len(topics) == 0 {
		t.Fatalf("no topic=... in %s", script)
	}
	for _, m := range topics {
		routed := false
		for _, s := range cfg.NATS.Streams {
			for _, f := range s.Subjects {
				routed = routed || relay.SubjectMatches(f, m[1])
			}
		}
		if !routed {
			t.Errorf("the producer's topic %q is captured by no stream in the walbox config: it would be dead-lettered", m[1])
		}
	}
}

// goBuild returns the arguments of the first `go build` in text, without
// the output path (-o X) and with variables like $(GO) taken as "go".
func goBuild(t *testing.T, name, text string) []string {
	t.Helper()
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(strings.ReplaceAll(line, "$(GO)", "go"))
		i := slices.Index(f, "go")
		if i < 0 || i+1 >= len(f) || f[i+1] != "build" {
			continue
		}
		var args []string
		for j := i + 2; j < len(f); j++ {
			if f[j] == "-o" {
				j++
				continue
			}
			if f[j] == "&&" || f[j] == ";" {
				break
			}
			args = append(args, f[j])
		}
		return args
	}
	t.Fatalf("%s has no `go build` command", name)
	return nil
}

func TestDockerfileBuildsLikeTheMakefile(t *testing.T) {
	mk := readRoot(t, "Makefile")
	df := readRoot(t, "Dockerfile")
	want := goBuild(t, "Makefile", string(mk))
	got := goBuild(t, "Dockerfile", string(df))
	if !slices.Contains(want, "./cmd/walbox") {
		t.Fatalf("the Makefile's build does not build ./cmd/walbox: %v", want)
	}
	if !slices.Equal(got, want) {
		t.Errorf("Dockerfile builds with %v, the Makefile with %v (besides -o): keep them the same", got, want)
	}

	// The build image's Go is the one go.mod asks for.
	gomod := readRoot(t, "go.mod")
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(gomod)
	if m == nil {
		t.Fatal("go.mod has no go directive")
	}
	from := regexp.MustCompile(`(?m)^FROM\s+(\S+)`).FindAllStringSubmatch(string(df), -1)
	if len(from) < 2 {
		t.Fatalf("Dockerfile: want a multi-stage build, found FROM %v", from)
	}
	if !strings.HasPrefix(from[0][1], "golang:"+string(m[1])) {
		t.Errorf("Dockerfile builds with %s, go.mod asks for Go %s", from[0][1], m[1])
	}
}

// runtimeImage is the base of the Dockerfile's last stage.
func runtimeImage(t *testing.T) string {
	t.Helper()
	df := readRoot(t, "Dockerfile")
	from := regexp.MustCompile(`(?m)^FROM\s+(\S+)`).FindAllStringSubmatch(string(df), -1)
	if len(from) == 0 {
		t.Fatal("Dockerfile has no FROM")
	}
	return from[len(from)-1][1]
}
