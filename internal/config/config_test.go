package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

// validYAML is the smallest file that validates.
const validYAML = `
postgres:
  url: postgres://walbox@127.0.0.1:5432/app
nats:
  streams:
    - name: ORDERS
      subjects: ["orders.>"]
`

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "walbox.yaml")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// load reads content as a config file with the given environment, and
// validates it as the CLI does.
func load(t *testing.T, content string, environ ...string) (Config, error) {
	t.Helper()
	cfg, err := Load(writeFile(t, content), environ)
	if err != nil {
		return cfg, err
	}
	return cfg, cfg.Validate()
}

func wantErrNaming(t *testing.T, err error, key string, more ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, want one naming %q", key)
	}
	for _, s := range append([]string{key}, more...) {
		if !strings.Contains(err.Error(), s) {
			t.Fatalf("error does not mention %q:\n%v", s, err)
		}
	}
}

// namedCase is a config that is refused, the key its error must name and
// more text the error must hold.
type namedCase struct {
	name, yaml string
	key        string
	more       []string
}

// wantNamed loads each case's YAML (and validates it) and wants an error
// naming its key and more.
func wantNamed(t *testing.T, tests []namedCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, tt.yaml)
			wantErrNaming(t, err, tt.key, tt.more...)
		})
	}
}

func TestValidFileLoads(t *testing.T) {
	cfg, err := load(t, validYAML)
	if err != nil {
		t.Fatalf("valid config: %v", err)
	}
	if cfg.Postgres.URL != "postgres://walbox@127.0.0.1:5432/app" {
		t.Errorf("postgres.url = %q", cfg.Postgres.URL)
	}
	if len(cfg.NATS.Streams) != 1 || cfg.NATS.Streams[0].Name != "ORDERS" {
		t.Errorf("nats.streams = %+v", cfg.NATS.Streams)
	}
	// Everything not in the file keeps its default.
	def := Default()
	if cfg.Postgres.Slot != def.Postgres.Slot || cfg.NATS.Window != def.NATS.Window || cfg.NATS.URL != def.NATS.URL ||
		cfg.Postgres.StatusInterval != def.Postgres.StatusInterval || cfg.NATS.DLQ != def.NATS.DLQ {
		t.Errorf("defaults lost: %+v", cfg)
	}
}

func TestFullFileLoads(t *testing.T) {
	cfg, err := load(t, `
postgres:
  url: postgres://u:p@db:5432/app?sslmode=require
  slot: orders_relay
  publication: orders_pub
  create_publication: false
  status_interval: 5s
outbox:
  table: app.events
  columns:
    id: event_id
    topic: subject
nats:
  url: nats://nats:4222
  subject_prefix: app.
  ack_timeout: 3s
  window: 256
  streams:
    - name: ORDERS
      subjects: ["app.orders.>"]
      storage: memory
      replicas: 3
      duplicate_window: 10m
      max_age: 72h
      manage: false
    - name: PAYMENTS
      subjects: ["app.payments.*", "app.refunds.*"]
  dlq:
    stream: DEAD
    subject_prefix: app.dead.
retry:
  initial: 500ms
  max: 30s
metrics:
  listen: 0.0.0.0:9187
log:
  level: debug
  format: json
`)
	if err != nil {
		t.Fatalf("full config: %v", err)
	}
	f := false
	// Keys the file leaves out keep their defaults.
	want := Default()
	want.Postgres.URL, want.Postgres.Slot, want.Postgres.Publication = "postgres://u:p@db:5432/app?sslmode=require", "orders_relay", "orders_pub"
	want.Postgres.CreatePublication, want.Postgres.StatusInterval = false, 5*time.Second
	want.Outbox = Outbox{Table: "app.events", Columns: map[string]string{"id": "event_id", "topic": "subject"}, Layout: LayoutWalbox}
	want.NATS = NATS{URL: "nats://nats:4222", SubjectPrefix: "app.", AckTimeout: 3 * time.Second, Window: 256, WindowBytes: 64 << 20, StrictOrder: true, FastBatch: true, FastBatchAfter: 32,
		SubjectTemplate: "{topic}", PartitionBuckets: 16, Envelope: "raw",
		Streams: []Stream{
			{Name: "ORDERS", Subjects: []string{"app.orders.>"}, Storage: "memory", Replicas: 3,
				DuplicateWindow: 10 * time.Minute, MaxAge: 72 * time.Hour, Manage: &f},
			{Name: "PAYMENTS", Subjects: []string{"app.payments.*", "app.refunds.*"}},
		},
		DLQ: DLQ{Stream: "DEAD", SubjectPrefix: "app.dead."}}
	want.Retry = Retry{Initial: 500 * time.Millisecond, Max: 30 * time.Second}
	want.Metrics.Listen = "0.0.0.0:9187"
	want.Log = Log{Level: "debug", Format: "json"}
	if !reflect.DeepEqual(cfg, want) {
		t.Fatalf("loaded\n%+v\nwant\n%+v", cfg, want)
	}
}

func TestUnknownKeyIsNamed(t *testing.T) {
	tests := []namedCase{
		{"misspelled postgres key", "postgres:\n  url: x\n  slto: walbox\n", "postgres.slto", nil},
		{"misspelled top-level section", "postgress:\n  url: x\n", "unknown key postgress", nil},
		{"misspelled nats key", "nats:\n  windw: 5\n", "nats.windw", nil},
		{"misspelled stream key", "nats:\n  streams:\n    - name: A\n      subject: [a]\n", "nats.streams[].subject", nil},
		{"misspelled dlq key", "nats:\n  dlq:\n    strem: X\n", "nats.dlq.strem", nil},
		{"misspelled outbox key", "outbox:\n  tabel: t\n", "outbox.tabel", nil},
		{"misspelled retry key", "retry:\n  intial: 1s\n", "retry.intial", nil},
		{"misspelled metrics key", "metrics:\n  listn: :1\n", "metrics.listn", nil},
		{"misspelled log key", "log:\n  lvl: debug\n", "log.lvl", nil},
		{"misspelled route key", "postgres:\n  url: postgres://x\nnats:\n  streams:\n    - {name: ORDERS, subjects: [orders.>]}\n  routes:\n    - {prefix: o., stream: ORDERS}\n", "unknown key nats.routes[].prefix", nil},
	}
	for i := range tests {
		tests[i].more = []string{"unknown key"}
	}
	wantNamed(t, tests)
}

func TestBadYAMLIsAnError(t *testing.T) {
	for name, y := range map[string]string{
		"not a number":       "nats:\n  window: many\n",
		"not a duration":     "postgres:\n  status_interval: 5x\n",
		"section is a list":  "nats: [1]\n",
		"broken indentation": "postgres:\n url: a\n  slot: b\n",
	} {
		t.Run(name, func(t *testing.T) {
			p := writeFile(t, y)
			_, err := Load(p, nil)
			wantErrNaming(t, err, p)
		})
	}
}

func TestMissingFileIsAnError(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.yaml"), nil)
	wantErrNaming(t, err, "read config file")
}

func TestMissingRequiredKeyIsNamed(t *testing.T) {
	wantNamed(t, []namedCase{
		{"postgres.url", "nats:\n  streams:\n    - {name: ORDERS, subjects: [orders.>]}\n", "postgres.url", nil},
		{"postgres.url empty", "postgres:\n  url: \"\"\nnats:\n  streams:\n    - {name: ORDERS, subjects: [orders.>]}\n", "postgres.url", nil},
		{"nats.streams", "postgres:\n  url: postgres://x\n", "nats.streams", nil},
		{"nats.streams empty", "postgres:\n  url: postgres://x\nnats:\n  streams: []\n", "nats.streams", nil},
		{"nats.url empty", validYAML + "  url: \"\"\n", "nats.url", nil},
		{"postgres.publication empty", "postgres:\n  url: x\n  publication: \"\"\nnats:\n  streams:\n    - {name: ORDERS, subjects: [orders.>]}\n", "postgres.publication", nil},
		{"stream without subjects", "postgres:\n  url: x\nnats:\n  streams:\n    - {name: ORDERS}\n", "nats.streams[0].subjects", nil},
		{"stream without name", "postgres:\n  url: x\nnats:\n  streams:\n    - {subjects: [a]}\n", "nats.streams[0].name", nil},
	})
}

func TestBothMissingRequiredKeysAreNamed(t *testing.T) {
	_, err := load(t, "")
	wantErrNaming(t, err, "postgres.url", "nats.streams")
}

// withStreams returns a config with postgres.url set and the given
// nats.streams items.
func withStreams(streams string) string {
	return "postgres:\n  url: postgres://x\nnats:\n  streams:\n" + streams
}

func TestImpossibleValueIsNamed(t *testing.T) {
	base := "postgres:\n  url: postgres://x\n"
	streams := "  streams:\n    - {name: ORDERS, subjects: [orders.>]}\n"
	tests := []namedCase{
		{"window 0", base + "nats:\n  window: 0\n" + streams, "nats.window", nil},
		{"window negative", base + "nats:\n  window: -1\n" + streams, "nats.window", nil},
		{"window too large", base + "nats:\n  window: 1000000\n" + streams, "nats.window", nil},
		{"storage disk", withStreams("    - {name: ORDERS, subjects: [orders.>], storage: disk}\n"), "nats.streams[0].storage", []string{"disk"}},
		{"storage of the second stream", withStreams("    - {name: ORDERS, subjects: [orders.>]}\n    - {name: P, subjects: [p.>], storage: ssd}\n"),
			"nats.streams[1].storage", nil},
		{"overlapping subjects in two streams", withStreams("    - {name: ORDERS, subjects: [orders.>]}\n    - {name: CREATED, subjects: [orders.created]}\n"),
			"nats.streams", []string{"overlap", "orders.>", "orders.created", "ORDERS", "CREATED"}},
		{"overlapping * and literal", withStreams("    - {name: A, subjects: [orders.*]}\n    - {name: B, subjects: [orders.paid]}\n"),
			"nats.streams", []string{"overlap"}},
		{"overlapping * and *", withStreams("    - {name: A, subjects: [orders.*]}\n    - {name: B, subjects: [\"*.paid\"]}\n"),
			"nats.streams", []string{"overlap"}},
		{"overlapping > catch-all", withStreams("    - {name: A, subjects: [orders.x]}\n    - {name: B, subjects: [\">\"]}\n"),
			"nats.streams", []string{"overlap"}},
		{"same subject in two streams", withStreams("    - {name: A, subjects: [orders.x]}\n    - {name: B, subjects: [orders.x]}\n"),
			"nats.streams", []string{"overlap"}},
		{"stream declared twice", withStreams("    - {name: A, subjects: [a]}\n    - {name: A, subjects: [b]}\n"),
			"nats.streams[1].name", []string{"declared twice"}},
		{"stream name with a dot", withStreams("    - {name: A.B, subjects: [a]}\n"), "nats.streams[0].name", nil},
		{"stream name with a space", withStreams("    - {name: A B, subjects: [a]}\n"), "nats.streams[0].name", nil},
		{"stream named like the DLQ stream", withStreams("    - {name: WALBOX_DLQ, subjects: [a]}\n"), "nats.streams[0].name", []string{"dead-letter"}},
		{"stream capturing the DLQ subjects", withStreams("    - {name: ALL, subjects: [\"walbox.>\"]}\n"), "nats.streams[0].subjects", []string{"dead-letter"}},
		{"subject with a space", withStreams("    - {name: A, subjects: [\"a b\"]}\n"), "nats.streams[0].subjects", nil},
		{"empty subject", withStreams("    - {name: A, subjects: [\"\"]}\n"), "nats.streams[0].subjects", nil},
		{"replicas 7", withStreams("    - {name: A, subjects: [a], replicas: 7}\n"), "nats.streams[0].replicas", nil},
		{"negative duplicate window", withStreams("    - {name: A, subjects: [a], duplicate_window: -1s}\n"), "nats.streams[0].duplicate_window", nil},
		{"status_interval 5m", "postgres:\n  url: x\n  status_interval: 5m\nnats:\n" + streams, "postgres.status_interval", []string{"30s"}},
		{"status_interval 31s", "postgres:\n  url: x\n  status_interval: 31s\nnats:\n" + streams, "postgres.status_interval", nil},
		{"status_interval 0", "postgres:\n  url: x\n  status_interval: 0s\nnats:\n" + streams, "postgres.status_interval", nil},
		{"slot with upper case and dash", "postgres:\n  url: x\n  slot: Walbox-Slot\nnats:\n" + streams, "postgres.slot", []string{"Walbox-Slot"}},
		{"slot empty", "postgres:\n  url: x\n  slot: \"\"\nnats:\n" + streams, "postgres.slot", nil},
		{"slot too long", "postgres:\n  url: x\n  slot: " + strings.Repeat("s", 64) + "\nnats:\n" + streams, "postgres.slot", nil},
		{"slot with a dot", "postgres:\n  url: x\n  slot: a.b\nnats:\n" + streams, "postgres.slot", nil},
		{"subject prefix without a dot", base + "nats:\n  subject_prefix: app\n" + streams, "nats.subject_prefix", nil},
		{"ack timeout zero", base + "nats:\n  ack_timeout: 0s\n" + streams, "nats.ack_timeout", nil},
		{"dlq prefix without a dot", base + "nats:\n  dlq:\n    subject_prefix: dead\n" + streams, "nats.dlq", nil},
		{"dlq stream empty", base + "nats:\n  dlq:\n    stream: \"\"\n" + streams, "nats.dlq", nil},
		{"retry max below initial", base + "retry:\n  initial: 10s\n  max: 1s\nnats:\n" + streams, "retry", nil},
		{"retry initial zero", base + "retry:\n  initial: 0s\nnats:\n" + streams, "retry", nil},
		{"log format", base + "log:\n  format: xml\nnats:\n" + streams, "log.format", nil},
		{"log level", base + "log:\n  level: verbose\nnats:\n" + streams, "log.level", nil},
		{"outbox table with three parts", base + "outbox:\n  table: a.b.c\nnats:\n" + streams, "outbox.table", nil},
		{"outbox table empty", base + "outbox:\n  table: \"\"\nnats:\n" + streams, "outbox.table", nil},
		{"outbox unknown column role", base + "outbox:\n  columns:\n    subjekt: s\nnats:\n" + streams, "outbox.columns", []string{"subjekt"}},
		{"outbox id role unmapped", base + "outbox:\n  columns:\n    id: \"\"\nnats:\n" + streams, "outbox.columns", nil},
	}
	for i := range tests {
		tests[i].key += ":"
	}
	wantNamed(t, tests)
}

func TestValuesThatLookOddButAreFine(t *testing.T) {
	tests := []struct{ name, yaml string }{
		{"same stream may hold overlapping subjects", withStreams("    - {name: ORDERS, subjects: [orders.>, orders.created]}\n")},
		{"> and its parent token do not overlap", withStreams("    - {name: A, subjects: [orders.>]}\n    - {name: B, subjects: [orders]}\n")},
		{"different lengths do not overlap", withStreams("    - {name: A, subjects: [orders.*]}\n    - {name: B, subjects: [orders.a.b]}\n")},
		{"different literals do not overlap", withStreams("    - {name: A, subjects: [orders.created]}\n    - {name: B, subjects: [orders.paid]}\n")},
		{"memory storage, R5", withStreams("    - {name: A, subjects: [a], storage: memory, replicas: 5}\n")},
		{"status_interval 30s", "postgres:\n  url: x\n  status_interval: 30s\nnats:\n  streams:\n    - {name: A, subjects: [a]}\n"},
		{"slot at 63 characters", "postgres:\n  url: x\n  slot: " + strings.Repeat("s", 63) + "\nnats:\n  streams:\n    - {name: A, subjects: [a]}\n"},
		{"window 1", "postgres:\n  url: x\nnats:\n  window: 1\n  streams:\n    - {name: A, subjects: [a]}\n"},
		{"window 65536", "postgres:\n  url: x\nnats:\n  window: 65536\n  streams:\n    - {name: A, subjects: [a]}\n"},
		{"a section with no keys keeps its defaults", "postgres:\n  url: x\nlog:\nnats:\n  streams:\n    - {name: A, subjects: [a]}\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := load(t, tt.yaml); err != nil {
				t.Fatalf("want valid, got %v", err)
			}
		})
	}
}

func TestEveryBadKeyIsReported(t *testing.T) {
	_, err := load(t, `
postgres:
  url: x
  slot: Bad-Slot
  status_interval: 5m
nats:
  window: 0
  streams:
    - {name: A, subjects: [orders.>], storage: disk}
    - {name: B, subjects: [orders.created]}
`)
	wantErrNaming(t, err, "postgres.slot:", "postgres.status_interval:", "nats.window:", "nats.streams[0].storage:", "nats.streams:")
}

func TestSubjectsOverlap(t *testing.T) {
	tests := []struct {
		a, b string
		want bool
	}{
		{"orders.>", "orders.created", true},
		{"orders.>", "orders.created.v2", true},
		{"orders.>", "orders", false},
		{"orders.*", "orders.created", true},
		{"orders.*", "orders.created.v2", false},
		{"orders.*", "*.created", true},
		{"orders.created", "orders.created", true},
		{"orders.created", "orders.paid", false},
		{"orders.created", "payments.created", false},
		{">", "x", true},
		{">", "x.y.z", true},
		{"*", "x", true},
		{"*", "x.y", false},
		{"a.>", "*.b.c", true},
		{"a.b.>", "a.b", false},
		{"a.*.c", "a.b.>", true},
		{"a.*.c", "a.b.d", false},
	}
	for _, tt := range tests {
		t.Run(tt.a+"~"+tt.b, func(t *testing.T) {
			if got := subjectsOverlap(tt.a, tt.b); got != tt.want {
				t.Fatalf("subjectsOverlap(%q, %q) = %v, want %v", tt.a, tt.b, got, tt.want)
			}
			if got := subjectsOverlap(tt.b, tt.a); got != tt.want {
				t.Fatalf("subjectsOverlap(%q, %q) = %v, want %v (not symmetric)", tt.b, tt.a, got, tt.want)
			}
			// Overlap must agree with the router's matching on a literal subject.
			if !strings.ContainsAny(tt.b, "*>") {
				if got := relay.SubjectMatches(tt.a, tt.b); got != tt.want {
					t.Fatalf("relay.SubjectMatches(%q, %q) = %v, but overlap says %v", tt.a, tt.b, got, tt.want)
				}
			}
		})
	}
}

func TestEnvOverridesFile(t *testing.T) {
	file := `
postgres:
  url: postgres://file@db/app
  slot: from_file
nats:
  url: nats://file:4222
  window: 100
  streams:
    - {name: ORDERS, subjects: [orders.>]}
`
	env := []string{
		"WALBOX_POSTGRES_URL=postgres://env@db/app?sslmode=disable",
		"WALBOX_NATS_URL=nats://env:4222",
		"WALBOX_NATS_WINDOW=2048",
		"WALBOX_POSTGRES_SLOT=from_env",
		"WALBOX_POSTGRES_STATUS_INTERVAL=3s",
		"WALBOX_LOG_LEVEL=debug",
		"WALBOX_NATS_DLQ_STREAM=DEAD",
		"WALBOX_OUTBOX_COLUMNS=id:event_id,topic:subject",
		"PATH=/usr/bin", // not ours
		"POSTGRES_URL=postgres://not-ours@db/app",
	}
	cfg, err := load(t, file, env...)
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	tests := []struct {
		key       string
		got, want any
	}{
		{"postgres.url", cfg.Postgres.URL, "postgres://env@db/app?sslmode=disable"},
		{"nats.url", cfg.NATS.URL, "nats://env:4222"},
		{"nats.window", cfg.NATS.Window, 2048},
		{"postgres.slot", cfg.Postgres.Slot, "from_env"},
		{"postgres.status_interval", cfg.Postgres.StatusInterval, 3 * time.Second},
		{"log.level", cfg.Log.Level, "debug"},
		{"nats.dlq.stream", cfg.NATS.DLQ.Stream, "DEAD"},
		{"outbox.columns", cfg.Outbox.Columns, map[string]string{"id": "event_id", "topic": "subject"}},
		// not overridden: the file's or the default value stays
		{"nats.streams", len(cfg.NATS.Streams), 1},
		{"nats.dlq.subject_prefix", cfg.NATS.DLQ.SubjectPrefix, "walbox.dlq."},
		{"postgres.publication", cfg.Postgres.Publication, "walbox_outbox"},
	}
	for _, tt := range tests {
		if !reflect.DeepEqual(tt.got, tt.want) {
			t.Errorf("%s = %v, want %v", tt.key, tt.got, tt.want)
		}
	}
}

func TestEnvOverridesDefaultsWithoutFile(t *testing.T) {
	cfg, err := Load("", []string{"WALBOX_POSTGRES_URL=postgres://env", "WALBOX_NATS_WINDOW=7"})
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if cfg.Postgres.URL != "postgres://env" || cfg.NATS.Window != 7 {
		t.Fatalf("postgres.url = %q, nats.window = %d", cfg.Postgres.URL, cfg.NATS.Window)
	}
}

func TestEnvValueIsValidatedToo(t *testing.T) {
	tests := []struct {
		env, key string
	}{
		{"WALBOX_NATS_WINDOW=0", "nats.window:"},
		{"WALBOX_POSTGRES_SLOT=Bad-Slot", "postgres.slot:"},
		{"WALBOX_POSTGRES_STATUS_INTERVAL=5m", "postgres.status_interval:"},
	}
	for _, tt := range tests {
		t.Run(tt.env, func(t *testing.T) {
			_, err := load(t, validYAML, tt.env)
			wantErrNaming(t, err, tt.key)
		})
	}
}

func TestEmptyEnvValueKeepsTheFileValue(t *testing.T) {
	cfg, err := load(t, validYAML, "WALBOX_POSTGRES_URL=", "WALBOX_NATS_URL=")
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	if cfg.Postgres.URL != "postgres://walbox@127.0.0.1:5432/app" || cfg.NATS.URL != Default().NATS.URL {
		t.Fatalf("postgres.url = %q, nats.url = %q: an empty variable must not clear a value", cfg.Postgres.URL, cfg.NATS.URL)
	}
}

func TestEnvUnparsableValueIsAnError(t *testing.T) {
	for _, e := range []string{"WALBOX_NATS_WINDOW=many", "WALBOX_POSTGRES_STATUS_INTERVAL=5", "WALBOX_POSTGRES_CREATE_PUBLICATION=maybe"} {
		t.Run(e, func(t *testing.T) {
			_, err := Load(writeFile(t, validYAML), []string{e})
			wantErrNaming(t, err, "environment")
		})
	}
}

func TestEmptyFileGivesDefaults(t *testing.T) {
	for name, content := range map[string]string{
		"empty":         "",
		"only comments": "# walbox config\n# nothing yet\n",
		"document mark": "---\n",
		"blank lines":   "\n\n  \n",
	} {
		t.Run(name, func(t *testing.T) {
			cfg, err := Load(writeFile(t, content), nil)
			if err != nil {
				t.Fatalf("Load: %v", err)
			}
			if !reflect.DeepEqual(cfg, Default()) {
				t.Fatalf("got\n%+v\nwant the defaults\n%+v", cfg, Default())
			}
		})
	}
	t.Run("no file", func(t *testing.T) {
		cfg, err := Load("", nil)
		if err != nil {
			t.Fatalf("Load: %v", err)
		}
		if !reflect.DeepEqual(cfg, Default()) {
			t.Fatalf("got\n%+v\nwant the defaults", cfg)
		}
	})
}

func TestDefaultsAreValidOnceRequiredKeysAreSet(t *testing.T) {
	cfg := Default()
	cfg.Postgres.URL = "postgres://x"
	cfg.NATS.Streams = []Stream{{Name: "ORDERS", Subjects: []string{"orders.>"}}}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("defaults plus the required keys: %v", err)
	}
	if cfg.Postgres.StatusInterval > 10*time.Second {
		t.Fatalf("default status_interval %s exceeds the 10 s the protocol needs", cfg.Postgres.StatusInterval)
	}
}

func TestStreamSpecs(t *testing.T) {
	yes, no := true, false
	tests := []struct {
		name    string
		streams []Stream
		dlq     DLQ
		want    []jssink.StreamSpec
	}{
		{
			name:    "defaults and the DLQ stream",
			streams: []Stream{{Name: "ORDERS", Subjects: []string{"orders.>"}}},
			dlq:     Default().NATS.DLQ,
			want: []jssink.StreamSpec{
				{Name: "ORDERS", Subjects: []string{"orders.>"}, DuplicateWindow: 2 * time.Minute, Manage: true, FastBatch: true},
				{Name: "WALBOX_DLQ", Subjects: []string{"walbox.dlq.>"}, Storage: "file", Replicas: 1, DuplicateWindow: 2 * time.Minute, Manage: true, FastBatch: true, NoBatch: "dead letters are published one at a time"},
			},
		},
		{
			name: "explicit values are kept",
			streams: []Stream{
				{Name: "ORDERS", Subjects: []string{"orders.>"}, Storage: "memory", Replicas: 3, DuplicateWindow: 10 * time.Minute, MaxAge: time.Hour, Manage: &no},
				{Name: "PAYMENTS", Subjects: []string{"payments.*", "refunds.*"}, Manage: &yes},
			},
			dlq: DLQ{Stream: "DEAD", SubjectPrefix: "app.dead."},
			want: []jssink.StreamSpec{
				{Name: "ORDERS", Subjects: []string{"orders.>"}, Storage: "memory", Replicas: 3, DuplicateWindow: 10 * time.Minute, MaxAge: time.Hour, Manage: false, FastBatch: true},
				{Name: "PAYMENTS", Subjects: []string{"payments.*", "refunds.*"}, DuplicateWindow: 2 * time.Minute, Manage: true, FastBatch: true},
				{Name: "DEAD", Subjects: []string{"app.dead.>"}, Storage: "file", Replicas: 3, DuplicateWindow: 2 * time.Minute, Manage: true, FastBatch: true, NoBatch: "dead letters are published one at a time"},
			},
		},
		{
			name:    "nats.dlq.replicas overrides the streams' replicas",
			streams: []Stream{{Name: "ORDERS", Subjects: []string{"orders.>"}, Replicas: 3}},
			dlq:     DLQ{Stream: "WALBOX_DLQ", SubjectPrefix: "walbox.dlq.", Replicas: 5},
			want: []jssink.StreamSpec{
				{Name: "ORDERS", Subjects: []string{"orders.>"}, Replicas: 3, DuplicateWindow: 2 * time.Minute, Manage: true, FastBatch: true},
				{Name: "WALBOX_DLQ", Subjects: []string{"walbox.dlq.>"}, Storage: "file", Replicas: 5, DuplicateWindow: 2 * time.Minute, Manage: true, FastBatch: true, NoBatch: "dead letters are published one at a time"},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Default()
			cfg.NATS.Streams, cfg.NATS.DLQ = tt.streams, tt.dlq
			got := cfg.StreamSpecs()
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("StreamSpecs:\n got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestStreamSpecsFromFile(t *testing.T) {
	cfg, err := load(t, withStreams("    - {name: ORDERS, subjects: [orders.>], duplicate_window: 5m}\n    - {name: PAYMENTS, subjects: [payments.>], manage: false}\n"))
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	specs := cfg.StreamSpecs()
	if len(specs) != 3 {
		t.Fatalf("got %d specs, want 2 streams and the DLQ: %+v", len(specs), specs)
	}
	if specs[0].DuplicateWindow != 5*time.Minute || !specs[0].Manage {
		t.Errorf("ORDERS = %+v, want duplicate_window 5m, managed", specs[0])
	}
	if specs[1].DuplicateWindow != 2*time.Minute || specs[1].Manage {
		t.Errorf("PAYMENTS = %+v, want the 2m default duplicate window, not managed", specs[1])
	}
	if d := specs[2]; d.Name != "WALBOX_DLQ" || !reflect.DeepEqual(d.Subjects, []string{"walbox.dlq.>"}) || !d.Manage {
		t.Errorf("DLQ = %+v", d)
	}
	// Every subject a dead letter can get is captured by the DLQ stream, and
	// by no other.
	for _, subject := range []string{"walbox.dlq.invalid", "walbox.dlq.orders.created"} {
		n := 0
		for _, sp := range specs {
			for _, f := range sp.Subjects {
				if relay.SubjectMatches(f, subject) {
					n++
					if sp.Name != "WALBOX_DLQ" {
						t.Errorf("dead-letter subject %s captured by %s", subject, sp.Name)
					}
				}
			}
		}
		if n != 1 {
			t.Errorf("dead-letter subject %s captured %d times", subject, n)
		}
	}
}

func TestPasswordFileGoesIntoTheURL(t *testing.T) {
	dir := t.TempDir()
	pw := filepath.Join(dir, "pw")
	if err := os.WriteFile(pw, []byte("s3cr'et @/x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct{ in, want string }{
		{"postgres://walbox@db:5432/app?sslmode=require", "postgres://walbox:s3cr%27et%20%40%2Fx@db:5432/app?sslmode=require"},
		{"host=db user=walbox dbname=app", `host=db user=walbox dbname=app password='s3cr\'et @/x'`},
	} {
		c := Default()
		c.Postgres.URL, c.Postgres.PasswordFile = tt.in, pw
		if err := c.ApplyPasswordFile(); err != nil {
			t.Fatal(err)
		}
		if c.Postgres.URL != tt.want {
			t.Errorf("%s: got %s, want %s", tt.in, c.Postgres.URL, tt.want)
		}
		pc, err := pgconn.ParseConfig(c.Postgres.URL)
		if err != nil || pc.Password != "s3cr'et @/x" {
			t.Errorf("%s: pgx reads password %q (%v)", tt.in, pc.Password, err)
		}
	}
	c := Default()
	c.Postgres.PasswordFile = filepath.Join(dir, "missing")
	if err := c.ApplyPasswordFile(); err == nil || !strings.Contains(err.Error(), "postgres.password_file") {
		t.Errorf("missing file: %v", err)
	}
}

func TestEnvironmentErrorsNameTheVariableAndTheForm(t *testing.T) {
	c := Default()
	err := ApplyEnv(&c, []string{"WALBOX_NATS_ACK_TIMEOUT=10", "WALBOX_NATS_WINDOW=abc", "WALBOX_NATS_STRICT_ORDER=yes please", "WALBOX_NATS_ACKTIMEOUT=5s", "WALBOX_PG_BINDIR=/x", "WALBOX_CONFIG=/y"})
	if err == nil {
		t.Fatal("bad environment accepted")
	}
	for _, want := range []string{"WALBOX_NATS_ACK_TIMEOUT=10: want a duration like 10s", "WALBOX_NATS_WINDOW=abc: want a whole number",
		"WALBOX_NATS_STRICT_ORDER=yes please: want true or false", "WALBOX_NATS_ACKTIMEOUT matches no configuration key"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "PG_BINDIR") || strings.Contains(err.Error(), "WALBOX_CONFIG") {
		t.Errorf("variables of the scripts around walbox are not config errors: %v", err)
	}
	c = Default()
	if err := ApplyEnv(&c, []string{"WALBOX_NATS_ACK_TIMEOUT=3s", "WALBOX_SWEEPER_MAINTAIN=false"}); err != nil || c.NATS.AckTimeout != 3*time.Second || c.Sweeper.Maintain {
		t.Fatalf("good environment: %v %+v", err, c.NATS)
	}
}

func TestYAMLTypeErrorsNameTheKeyAndTheForm(t *testing.T) {
	c := Default()
	err := decodeYAML([]byte("postgres:\n  url: x\nnats:\n  ack_timeout: 10\n  window: ten\n  strict_order: maybe\n"), &c)
	if err == nil {
		t.Fatal("bad types accepted")
	}
	for _, want := range []string{"nats.ack_timeout: `10` is not a duration like 10s", "nats.window: `ten` is not a whole number", "nats.strict_order: `maybe` is not true or false"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}
