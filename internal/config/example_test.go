package config_test

import (
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
)

// examplePath is the documented example: every key with its default.
const examplePath = "../../testdata/walbox.yaml"

// yamlName is the key of a struct field in the YAML file, "" if it has none.
func yamlName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	if name == "-" {
		return ""
	}
	return name
}

// structKeys lists the dotted YAML keys of t: "postgres.url",
// "nats.streams.name" (list items share their list's key).
func structKeys(t reflect.Type, prefix string) []string {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct {
		return nil
	}
	var keys []string
	for f := range t.Fields() {
		name := yamlName(f)
		if name == "" || !f.IsExported() {
			continue
		}
		key := prefix + name
		keys = append(keys, key)
		keys = append(keys, structKeys(f.Type, key+".")...)
	}
	return keys
}

// fileKeys lists the dotted keys of a YAML document the same way.
func fileKeys(n *yaml.Node, prefix string, into map[string]bool) {
	switch n.Kind {
	case yaml.DocumentNode, yaml.SequenceNode:
		for _, c := range n.Content {
			fileKeys(c, prefix, into)
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			key := prefix + n.Content[i].Value
			into[key] = true
			fileKeys(n.Content[i+1], key+".", into)
		}
	}
}

// envNames lists the WALBOX_* variables of t's env tags.
func envNames(t reflect.Type, prefix string) []string {
	var names []string
	for f := range t.Fields() {
		if p, ok := f.Tag.Lookup("envPrefix"); ok {
			names = append(names, envNames(f.Type, prefix+p)...)
		} else if e := f.Tag.Get("env"); e != "" {
			names = append(names, prefix+strings.Split(e, ",")[0])
		}
	}
	return names
}

// diff names the fields (by YAML key) where a and b differ.
func diff(a, b reflect.Value, key string) []string {
	if reflect.DeepEqual(a.Interface(), b.Interface()) {
		return nil
	}
	if a.Kind() != reflect.Struct {
		return []string{fmt.Sprintf("%s: %v, want %v", key, a.Interface(), b.Interface())}
	}
	var out []string
	for i := range a.NumField() {
		f := a.Type().Field(i)
		k := yamlName(f)
		if key != "" {
			k = key + "." + k
		}
		out = append(out, diff(a.Field(i), b.Field(i), k)...)
	}
	return out
}

func loadExample(t *testing.T) config.Config {
	t.Helper()
	// No environment: WALBOX_* variables of whoever runs the test must not
	// count.
	cfg, err := config.Load(examplePath, nil)
	if err != nil {
		t.Fatalf("load %s: %v", examplePath, err)
	}
	return cfg
}

func TestExampleConfigShowsTheDefaults(t *testing.T) {
	got := loadExample(t)
	if err := got.Validate(); err != nil {
		t.Fatalf("%s is not a valid configuration: %v", examplePath, err)
	}

	// The columns are listed role by role with their default names, which
	// is the same mapping as leaving them out.
	cols, err := cdc.ColumnsFromMap(got.Outbox.Columns, false)
	if err != nil {
		t.Fatalf("outbox.columns: %v", err)
	}
	if cols != cdc.DefaultColumns() {
		t.Errorf("outbox.columns maps %v, the default is %v", cols, cdc.DefaultColumns())
	}
	for _, role := range cdc.RoleNames() {
		if _, ok := got.Outbox.Columns[role]; !ok {
			t.Errorf("outbox.columns does not list role %s", role)
		}
	}

	// The first stream spells out every stream key with the value walbox
	// uses when the key is left out.
	if len(got.NATS.Streams) == 0 {
		t.Fatal("no nats.streams")
	}
	first := got.NATS.Streams[0]
	bare := config.Config{NATS: config.NATS{DLQ: got.NATS.DLQ, StrictOrder: got.NATS.StrictOrder, FastBatch: got.NATS.FastBatch, Streams: []config.Stream{{Name: first.Name, Subjects: first.Subjects}}}}
	implied := bare.StreamSpecs()[0]
	// The relay creates a stream with storage "" as file and replicas 0
	// as 1 (jssink.StreamSpec).
	if implied.Storage == "" {
		implied.Storage = "file"
	}
	if implied.Replicas == 0 {
		implied.Replicas = 1
	}
	if spelled := got.StreamSpecs()[0]; !reflect.DeepEqual(spelled, implied) {
		t.Errorf("nats.streams[0] as written gives %+v; with only name and subjects it would be %+v", spelled, implied)
	}

	// Everything else is exactly config.Default(), apart from the keys
	// that have no default.
	want := config.Default()
	want.Postgres.URL = got.Postgres.URL
	want.NATS.Streams = got.NATS.Streams
	want.NATS.Routes = got.NATS.Routes
	want.Kafka.Brokers = got.Kafka.Brokers
	want.Kafka.Topics = got.Kafka.Topics
	got.Outbox.Columns = nil
	if len(got.Outboxes) == 0 {
		got.Outboxes = nil
	}
	for _, d := range diff(reflect.ValueOf(got), reflect.ValueOf(want), "") {
		t.Errorf("%s differs from config.Default(): %s", examplePath, d)
	}
	if got.Postgres.URL == "" {
		t.Error("postgres.url has no example value")
	}
}

func TestExampleConfigListsEveryKey(t *testing.T) {
	data, err := os.ReadFile(examplePath)
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	inFile := map[string]bool{}
	fileKeys(&doc, "", inFile)
	keys := structKeys(reflect.TypeFor[config.Config](), "")
	if len(keys) < 20 {
		t.Fatalf("walking config.Config found only %v", keys)
	}
	for _, k := range keys {
		// An entry of outboxes takes outbox's keys; its own are shown in
		// the comment above outboxes: [].
		if leaf, ok := strings.CutPrefix(k, "outboxes."); ok {
			if parts := strings.Split(leaf, "."); !strings.Contains(string(data), parts[len(parts)-1]+":") {
				t.Errorf("%s does not show key %s in the comment on outboxes", examplePath, k)
			}
			continue
		}
		if !inFile[k] {
			t.Errorf("%s does not show key %s: add it with its default and a comment", examplePath, k)
		}
	}
	checkComments(t, &doc, "", keys)
}

// checkComments reports keys of config.Config without a comment above them
// or at the end of their line. Sections (mappings) are exempt: their keys
// carry the comments. Of a list, the first item must explain every key.
func checkComments(t *testing.T, n *yaml.Node, prefix string, keys []string) {
	t.Helper()
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			checkComments(t, c, prefix, keys)
		}
	case yaml.SequenceNode:
		if len(n.Content) > 0 {
			checkComments(t, n.Content[0], prefix, keys)
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			key := prefix + k.Value
			if slices.Contains(keys, key) && v.Kind != yaml.MappingNode &&
				k.HeadComment == "" && k.LineComment == "" && v.LineComment == "" {
				t.Errorf("%s: key %s (line %d) has no comment", examplePath, key, k.Line)
			}
			checkComments(t, v, key+".", keys)
		}
	}
}

func TestExampleConfigNamesEveryEnvironmentVariable(t *testing.T) {
	data, err := os.ReadFile(examplePath)
	if err != nil {
		t.Fatal(err)
	}
	names := envNames(reflect.TypeFor[config.Config](), "WALBOX_")
	if len(names) < 15 {
		t.Fatalf("walking env tags found only %v", names)
	}
	for _, n := range names {
		if !strings.Contains(string(data), n) {
			t.Errorf("%s does not name %s", examplePath, n)
		}
	}
}
