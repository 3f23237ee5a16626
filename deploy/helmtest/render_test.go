package helmtest

import (
	"bytes"
	"fmt"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	chart "helm.sh/helm/v4/pkg/chart/v2"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
)

const (
	chartDir     = "../helm/walbox"
	repoRoot     = "../.."
	releaseName  = "walbox"
	releaseSpace = "walbox"
)

// object is one rendered Kubernetes object, decoded strictly into its type.
type object struct {
	source string // the template it came from
	kind   string
	name   string
	hook   string // helm.sh/hook, if any
	obj    any    // *corev1.ConfigMap, *appsv1.Deployment, ...
	raw    []byte
}

// newObject is the typed, empty object for a kind the chart may render;
// another kind is an error (the chart grew one these tests do not check).
func newObject(apiVersion, kind string) (any, error) {
	switch apiVersion + "/" + kind {
	case "v1/ConfigMap":
		return &corev1.ConfigMap{}, nil
	case "v1/Service":
		return &corev1.Service{}, nil
	case "v1/ServiceAccount":
		return &corev1.ServiceAccount{}, nil
	case "apps/v1/Deployment":
		return &appsv1.Deployment{}, nil
	case "policy/v1/PodDisruptionBudget":
		return &policyv1.PodDisruptionBudget{}, nil
	case "batch/v1/Job":
		return &batchv1.Job{}, nil
	case "monitoring.coreos.com/v1/ServiceMonitor":
		return &monitoringv1.ServiceMonitor{}, nil
	case "monitoring.coreos.com/v1/PodMonitor":
		return &monitoringv1.PodMonitor{}, nil
	case "monitoring.coreos.com/v1/PrometheusRule":
		return &monitoringv1.PrometheusRule{}, nil
	}
	return nil, fmt.Errorf("%s %s: a kind these tests do not know", apiVersion, kind)
}

// loadChart loads the chart from its folder, as `helm install ./walbox`.
func loadChart(t testing.TB) *chart.Chart {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load the chart: %v", err)
	}
	return ch
}

// ciValues lists the chart's ci/*.yaml values files.
func ciValues(t testing.TB) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no values files in %s/ci (%v)", chartDir, err)
	}
	return files
}

func readValues(t testing.TB, file string) map[string]any {
	t.Helper()
	vals, err := common.ReadValuesFile(file)
	if err != nil {
		t.Fatalf("read %s: %v", file, err)
	}
	return vals
}

// render renders the chart with vals, as `helm template` would for an
// install, and returns each template's output.
func render(ch *chart.Chart, vals map[string]any) (map[string]string, error) {
	rv, err := util.ToRenderValues(ch, vals, common.ReleaseOptions{Name: releaseName, Namespace: releaseSpace, Revision: 1, IsInstall: true}, common.DefaultCapabilities)
	if err != nil {
		return nil, fmt.Errorf("values: %w", err)
	}
	out, err := engine.Render(ch, rv)
	if err != nil {
		return nil, fmt.Errorf("render: %w", err)
	}
	return out, nil
}

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

// decode splits the rendered templates into objects, in a stable order,
// each decoded strictly: a field its type does not have is an error.
func decode(out map[string]string) ([]object, error) {
	names := make([]string, 0, len(out))
	for name := range out {
		names = append(names, name)
	}
	sort.Strings(names)
	var objs []object
	for _, name := range names {
		if strings.HasSuffix(name, "NOTES.txt") {
			continue
		}
		for _, doc := range docSep.Split(out[name], -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			obj, err := newObject(tm.APIVersion, tm.Kind)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				return nil, fmt.Errorf("%s: %s does not decode strictly: %w", name, tm.Kind, err)
			}
			meta := obj.(metav1.Object)
			objs = append(objs, object{source: name, kind: tm.Kind, name: meta.GetName(),
				hook: meta.GetAnnotations()["helm.sh/hook"], obj: obj, raw: []byte(doc)})
		}
	}
	return objs, nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for line := range strings.SplitSeq(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// rendered is one values file's objects.
type rendered struct {
	file string
	vals map[string]any
	objs []object
}

func renderAll(t *testing.T) []rendered {
	t.Helper()
	ch := loadChart(t)
	var all []rendered
	for _, file := range ciValues(t) {
		vals := readValues(t, file)
		out, err := render(ch, vals)
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		objs, err := decode(out)
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		all = append(all, rendered{file: filepath.Base(file), vals: vals, objs: objs})
	}
	return all
}

func (r rendered) byKind(kind string) []object {
	var out []object
	for _, o := range r.objs {
		if o.kind == kind {
			out = append(out, o)
		}
	}
	return out
}

// TestEveryValuesFileRendersStrictly: each ci/ values file renders, and
// every object decodes into its API type with no unknown field.
func TestEveryValuesFileRendersStrictly(t *testing.T) {
	for _, r := range renderAll(t) {
		var kinds []string
		for _, o := range r.objs {
			kinds = append(kinds, o.kind+"/"+o.name)
		}
		t.Logf("%s: %s", r.file, strings.Join(kinds, ", "))
		if len(r.byKind("ConfigMap")) == 0 {
			t.Errorf("%s: no ConfigMap", r.file)
		}
	}
}

// TestStrictDecodingRefusesUnknownFields: the decoding the other tests
// rely on fails on a field the type does not have (a misspelt
// readinessProbe would otherwise pass unseen).
func TestStrictDecodingRefusesUnknownFields(t *testing.T) {
	_, err := decode(map[string]string{"x.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\ndata: {}\nreadinesProbe: {}\n"})
	if err == nil || !strings.Contains(err.Error(), "readinesProbe") {
		t.Fatalf("an unknown field decoded: %v", err)
	}
	_, err = decode(map[string]string{"x.yaml": "apiVersion: v1\nkind: Secret\nmetadata:\n  name: a\n"})
	if err == nil {
		t.Fatal("a kind the tests do not check decoded")
	}
}

// valuesWith is the chart's defaults with the ci standalone file and one
// more setting at path.
func valuesWith(t *testing.T, path string, value any) map[string]any {
	t.Helper()
	vals := readValues(t, filepath.Join(chartDir, "ci", "standalone-values.yaml"))
	keys := strings.Split(path, ".")
	m := vals
	for _, k := range keys[:len(keys)-1] {
		next, ok := m[k].(map[string]any)
		if !ok {
			next = map[string]any{}
			m[k] = next
		}
		m = next
	}
	m[keys[len(keys)-1]] = value
	return vals
}

// TestSecretsInConfigAreRefused: a password where it would land in the
// ConfigMap stops the rendering with the fix.
func TestSecretsInConfigAreRefused(t *testing.T) {
	ch := loadChart(t)
	for _, tt := range []struct {
		path  string
		value any
		says  string
	}{
		{"config.postgres.url", "postgres://walbox:hunter2@db:5432/app", "secrets.postgresPassword"},
		{"config.postgres.url", "host=db dbname=app user=walbox password=hunter2", "secrets.postgresPassword"},
		{"config.nats.password", "hunter2", "secrets.natsPassword"},
		{"config.nats.token", "hunter2", "secrets.natsPassword"},
		{"config.kafka.sasl.password", "hunter2", "secrets.kafkaSaslPassword"},
		{"config.archive.s3.secret_key", "hunter2", "AWS_SECRET_ACCESS_KEY"},
		{"migrate.postgresUrl", "postgres://owner:hunter2@db:5432/app", "migrate.passwordSecret"},
	} {
		_, err := render(ch, valuesWith(t, tt.path, tt.value))
		if err == nil || !strings.Contains(err.Error(), tt.says) {
			t.Errorf("%s = %v: rendered (%v); want a refusal naming %s", tt.path, tt.value, err, tt.says)
		}
	}
	// The same URL without the password renders.
	if _, err := render(ch, valuesWith(t, "config.postgres.url", "postgres://walbox@db:5432/app")); err != nil {
		t.Errorf("a URL without a password: %v", err)
	}
}

// TestSidecarNeedsItsPodSelector: the PodMonitor of the sidecar shape
// cannot guess the application's pods.
func TestSidecarNeedsItsPodSelector(t *testing.T) {
	vals := readValues(t, filepath.Join(chartDir, "ci", "sidecar-values.yaml"))
	delete(vals["sidecar"].(map[string]any), "podSelector")
	if _, err := render(loadChart(t), vals); err == nil || !strings.Contains(err.Error(), "sidecar.podSelector") {
		t.Fatalf("sidecar without podSelector: %v", err)
	}
}

// manifestSets are the plain manifests in deploy/kubernetes: each the
// rendering of one ci/ values file, split in two, because `kubectl apply`
// knows no hooks: the migrate Job (apply it first, wait for it) and the
// rest.
var manifestSets = []struct{ values, dir string }{
	{"standalone-values.yaml", "standalone"},
	{"sidecar-values.yaml", "sidecar"},
}

// plainManifests renders the files of deploy/kubernetes/<dir>.
func plainManifests(t *testing.T, ch *chart.Chart, valuesFile string) map[string][]byte {
	t.Helper()
	out, err := render(ch, readValues(t, filepath.Join(chartDir, "ci", valuesFile)))
	if err != nil {
		t.Fatal(err)
	}
	objs, err := decode(out)
	if err != nil {
		t.Fatal(err)
	}
	header := "# Rendered from deploy/helm/walbox with ci/" + valuesFile + " (release " + releaseName +
		", namespace " + releaseSpace + ").\n# Do not edit: change the chart and run\n#   cd deploy/helmtest && go test -run TestPlainManifestsAreUpToDate -update\n"
	files := map[string]*bytes.Buffer{}
	for _, o := range objs {
		name := "walbox.yaml"
		if o.hook != "" {
			name = "migrate.yaml"
		}
		b := files[name]
		if b == nil {
			b = bytes.NewBufferString(header)
			if name == "migrate.yaml" {
				b.WriteString("# Apply before walbox.yaml and wait for the Job: kubectl wait --for=condition=complete job/" + releaseName + "-migrate\n")
			}
			files[name] = b
		}
		fmt.Fprintf(b, "---\n# Source: %s\n%s\n", o.source, strings.Trim(string(o.raw), "\n"))
	}
	res := map[string][]byte{}
	for name, b := range files {
		res[name] = b.Bytes()
	}
	return res
}
