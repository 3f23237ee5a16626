package ops

import (
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/internal/config"
)

const repoRoot = "../.."

var (
	// A series is defined by its Name option or by internal/metrics:
	// f.Counter("walbox_…", …).
	metricDefRe = regexp.MustCompile(`(?:Name:\s*|\.(?:Counter|Gauge|Histogram)(?:Vec)?\(\s*)"(walbox_[a-z0-9_]+)"`)
	metricUseRe = regexp.MustCompile(`\bwalbox_[a-z0-9_]+\b`)
)

// definedMetrics greps the Go sources that register metrics for their names.
func definedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	for _, dir := range []string{"relay", "internal/app", "cdc", "internal/console", "internal/leantrace"} {
		err := filepath.WalkDir(filepath.Join(repoRoot, dir), func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			src, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			for _, m := range metricDefRe.FindAllStringSubmatch(string(src), -1) {
				names[m[1]] = true
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(names) < 15 {
		t.Fatalf("found only %d metric definitions: %v", len(names), names)
	}
	return names
}

// checkMetricNames reports every walbox_* name in exprs that no Go source
// defines (histogram series _bucket, _sum, _count count as their base).
func checkMetricNames(t *testing.T, file string, exprs []string, defined map[string]bool) map[string]bool {
	t.Helper()
	used := map[string]bool{}
	for _, e := range exprs {
		for _, name := range metricUseRe.FindAllString(e, -1) {
			base := name
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if b, ok := strings.CutSuffix(name, suffix); ok && defined[b] {
					base = b
				}
			}
			used[base] = true
			if !defined[base] {
				t.Errorf("%s uses %s, which no Go source defines (relay/metrics.go, relay/sweep/metrics.go)", file, name)
			}
		}
	}
	return used
}

func TestGrafanaDashboardUsesExistingMetrics(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "docs/grafana-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title  string `json:"title"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("docs/grafana-dashboard.json does not parse: %v", err)
	}
	var exprs []string
	for _, p := range dash.Panels {
		if p.Title == "" || len(p.Targets) == 0 {
			t.Errorf("panel %+v has no title or no query", p)
		}
		for _, tg := range p.Targets {
			exprs = append(exprs, tg.Expr)
		}
	}
	used := checkMetricNames(t, "docs/grafana-dashboard.json", exprs, definedMetrics(t))
	for _, want := range []string{"walbox_published_total", "walbox_commit_to_ack_seconds", "walbox_inflight", "walbox_slot_lag_bytes",
		"walbox_slot_retained_wal_bytes", "walbox_dead_lettered_total", "walbox_leader", "walbox_outbox_unprocessed"} {
		if !used[want] {
			t.Errorf("the dashboard has no panel for %s", want)
		}
	}
}

func TestAlertRulesUseExistingMetrics(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "docs/alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				For         string            `yaml:"for"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	dec.KnownFields(true)
	if err := dec.Decode(&rules); err != nil {
		t.Fatalf("docs/alerts.yml does not parse as Prometheus rules: %v", err)
	}
	var exprs []string
	alerts := map[string]string{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" || r.Expr == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("rule %q lacks alert, expr, severity or summary", r.Alert)
			}
			alerts[r.Alert] = r.Expr
			exprs = append(exprs, r.Expr)
		}
	}
	checkMetricNames(t, "docs/alerts.yml", exprs, definedMetrics(t))
	for name, frag := range map[string]string{
		"WalboxRelayDown":          "walbox_leader",
		"WalboxSlotLagHigh":        "walbox_slot_lag_bytes",
		"WalboxRetainedWALHigh":    "walbox_slot_retained_wal_bytes",
		"WalboxDeadLetters":        "walbox_dead_lettered_total",
		"WalboxUnprocessedAgeHigh": "walbox_outbox_oldest_unprocessed_seconds) > 300",
	} {
		if !strings.Contains(alerts[name], frag) {
			t.Errorf("alert %s: expr %q does not use %q", name, alerts[name], frag)
		}
	}
	if !strings.Contains(alerts["WalboxRelayDown"], "absent(up") {
		t.Errorf("WalboxRelayDown does not fire when no walbox is scraped: %s", alerts["WalboxRelayDown"])
	}
	// Every alert has a row in the runbook.
	doc, err := os.ReadFile(filepath.Join(repoRoot, "docs/operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	var missing []string
	for name := range alerts {
		if name != "WalboxCommitToAckP99High" && !strings.Contains(string(doc), "`"+name+"`") {
			missing = append(missing, name)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("docs/operations.md does not explain alerts %v", missing)
	}
}

// TestOperationsDocIsInStep checks the runbook quotes the grants recipe as
// `walbox migrate --print-grants` prints it, and names only metrics that
// exist.
func TestOperationsDocIsInStep(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(repoRoot, "docs/operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := config.Default()
	for _, line := range strings.Split(Grants(cfg, "walbox"), "\n") {
		if strings.HasPrefix(line, "CREATE ") || strings.HasPrefix(line, "GRANT ") || strings.HasPrefix(line, "DO ") {
			if !strings.Contains(string(doc), line) {
				t.Errorf("docs/operations.md does not show the recipe line\n%s", line)
			}
		}
	}
	// Names of other things that look like metrics: the publication, a check.
	text := strings.NewReplacer("walbox_outbox`", "", "walbox_outbox ", "", "postgres.walbox_schema", "").Replace(string(doc))
	checkMetricNames(t, "docs/operations.md", []string{text}, definedMetrics(t))
}
