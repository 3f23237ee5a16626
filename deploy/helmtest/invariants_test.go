package helmtest

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v4/pkg/chart/v2/lint"
	"helm.sh/helm/v4/pkg/chart/v2/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
)

var update = flag.Bool("update", false, "write the plain manifests in deploy/kubernetes and the chart's copies of docs/ files")

// pod is a pod template the chart renders, with the walbox container in it.
type pod struct {
	where  string
	spec   corev1.PodSpec
	walbox corev1.Container
	// relay: the container runs `walbox run` (not the migrate Job).
	relay bool
}

// pods finds the pods of a rendering: the Deployment's (walbox standalone,
// or the sidecar example's, walbox as a native sidecar) and the migrate
// Job's.
func (r rendered) pods(t *testing.T) []pod {
	t.Helper()
	var out []pod
	for _, o := range r.byKind("Deployment") {
		d := o.obj.(*appsv1.Deployment)
		spec := d.Spec.Template.Spec
		for _, c := range slices.Concat(spec.Containers, spec.InitContainers) {
			if c.Name == "walbox" {
				out = append(out, pod{where: "Deployment/" + d.Name, spec: spec, walbox: c, relay: true})
			}
		}
	}
	for _, o := range r.byKind("Job") {
		j := o.obj.(*batchv1.Job)
		spec := j.Spec.Template.Spec
		if len(spec.Containers) != 1 {
			t.Fatalf("%s: Job/%s has %d containers", r.file, j.Name, len(spec.Containers))
		}
		out = append(out, pod{where: "Job/" + j.Name, spec: spec, walbox: spec.Containers[0]})
	}
	if !slices.ContainsFunc(out, func(p pod) bool { return p.relay }) {
		t.Fatalf("%s: no pod runs walbox", r.file)
	}
	return out
}

// walboxConfig loads the ConfigMap's walbox.yaml the way `walbox run`
// does in the pod: the file, then the container's WALBOX_* environment
// (a Secret's value stands in as "from-a-secret"), then Validate.
func walboxConfig(t *testing.T, r rendered, p pod) config.Config {
	t.Helper()
	var cmName string
	for _, v := range p.spec.Volumes {
		for _, m := range p.walbox.VolumeMounts {
			if m.Name == v.Name && v.ConfigMap != nil && strings.HasSuffix(m.MountPath, "/config") {
				cmName = v.ConfigMap.Name
			}
		}
	}
	var data string
	for _, o := range r.byKind("ConfigMap") {
		if cm := o.obj.(*corev1.ConfigMap); cm.Name == cmName {
			data = cm.Data["walbox.yaml"]
		}
	}
	if data == "" {
		t.Fatalf("%s: %s mounts no ConfigMap with walbox.yaml (%q)", r.file, p.where, cmName)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "walbox.yaml")
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	var environ []string
	for _, e := range p.walbox.Env {
		switch {
		case e.Name == "WALBOX_POSTGRES_PASSWORD_FILE":
			pw := filepath.Join(dir, "password")
			if err := os.WriteFile(pw, []byte("from-a-secret\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			environ = append(environ, e.Name+"="+pw)
		case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil:
			environ = append(environ, e.Name+"=from-a-secret")
		case e.ValueFrom == nil:
			environ = append(environ, e.Name+"="+e.Value)
		}
	}
	cfg, err := config.Load(path, environ)
	if err != nil {
		t.Fatalf("%s: %s: walbox would not load this config: %v\n%s", r.file, p.where, err, data)
	}
	// Files walbox reads by path (credentials, keys, CAs) are Secrets
	// mounted read-only; stand-ins take their place for Validate, which
	// checks that they exist.
	for key, f := range map[string]*string{"nats.tls.ca": &cfg.NATS.TLS.CA, "nats.tls.cert": &cfg.NATS.TLS.Cert, "nats.tls.key": &cfg.NATS.TLS.Key,
		"nats.credentials": &cfg.NATS.Credentials, "nats.nkey": &cfg.NATS.NKey,
		"kafka.tls.ca": &cfg.Kafka.TLS.CA, "kafka.tls.cert": &cfg.Kafka.TLS.Cert, "kafka.tls.key": &cfg.Kafka.TLS.Key} {
		if *f == "" || !p.relay { // walbox migrate reads none of them
			continue
		}
		if !mountedFromSecret(p, *f) {
			t.Errorf("%s: %s: %s %s is not in a Secret mounted read-only", r.file, p.where, key, *f)
		}
		*f = filepath.Join(dir, strings.ReplaceAll(key, ".", "_"))
		if err := os.WriteFile(*f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	err = cfg.ApplyPasswordFile()
	if err == nil && p.relay {
		err = cfg.Validate()
	} else if err == nil {
		err = cfg.ValidatePostgres() // what walbox migrate checks
	}
	if err != nil {
		t.Fatalf("%s: %s: walbox would not start with this config: %v\n%s", r.file, p.where, err, data)
	}
	return cfg
}

// TestNoSecretInAConfigMap: no ConfigMap holds a password, token or key,
// and every secret walbox is given comes from a Secret: a file mounted
// from one (postgres.password_file) or an env var referring to one.
func TestNoSecretInAConfigMap(t *testing.T) {
	secretish := regexp.MustCompile(`(?i)^\s*(password|token|secret_key|access_key|nkey)\s*:\s*(\S+)`)
	for _, r := range renderAll(t) {
		for _, o := range r.byKind("ConfigMap") {
			cm := o.obj.(*corev1.ConfigMap)
			if len(cm.BinaryData) > 0 {
				t.Errorf("%s: ConfigMap/%s has binary data", r.file, cm.Name)
			}
			for key, v := range cm.Data {
				if key != "walbox.yaml" {
					continue
				}
				for line := range strings.SplitSeq(v, "\n") {
					if m := secretish.FindStringSubmatch(line); m != nil && m[2] != `""` && m[2] != "''" {
						t.Errorf("%s: ConfigMap/%s holds %s", r.file, cm.Name, strings.TrimSpace(line))
					}
				}
				var c struct {
					Postgres struct{ URL string } `json:"postgres"`
				}
				if err := yaml.Unmarshal([]byte(v), &c); err != nil {
					t.Fatalf("%s: ConfigMap/%s: %v", r.file, cm.Name, err)
				}
				if u, err := url.Parse(c.Postgres.URL); err == nil && u.User != nil {
					if _, set := u.User.Password(); set {
						t.Errorf("%s: ConfigMap/%s: postgres.url carries a password", r.file, cm.Name)
					}
				}
			}
		}
		for _, p := range r.pods(t) {
			cfg := walboxConfig(t, r, p)
			if cfg.Postgres.PasswordFile == "" && !strings.Contains(cfg.Postgres.URL, "from-a-secret") {
				t.Errorf("%s: %s: no PostgreSQL password from a Secret", r.file, p.where)
			}
			for _, e := range p.walbox.Env {
				// A password file is a mounted Secret, read-only.
				if e.Name == "WALBOX_POSTGRES_PASSWORD_FILE" && !mountedFromSecret(p, e.Value) {
					t.Errorf("%s: %s: postgres.password_file %s is not in a mounted Secret", r.file, p.where, e.Value)
				}
				if strings.Contains(e.Name, "PASSWORD") && e.Name != "WALBOX_POSTGRES_PASSWORD_FILE" && (e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil) {
					t.Errorf("%s: %s: %s is not from a Secret", r.file, p.where, e.Name)
				}
			}
		}
	}
}

func mountedFromSecret(p pod, file string) bool {
	for _, m := range p.walbox.VolumeMounts {
		if !strings.HasPrefix(file, m.MountPath+"/") || !m.ReadOnly {
			continue
		}
		for _, v := range p.spec.Volumes {
			if v.Name == m.Name && v.Secret != nil {
				return true
			}
		}
	}
	return false
}

// TestProbesOnTheMetricsPort: the relay's liveness probe asks /healthz and
// its readiness probe /readyz, both on the container port walbox's
// metrics.listen serves; the Service and the monitors scrape that port.
func TestProbesOnTheMetricsPort(t *testing.T) {
	for _, r := range renderAll(t) {
		for _, p := range r.pods(t) {
			if !p.relay {
				if p.walbox.LivenessProbe != nil || p.walbox.ReadinessProbe != nil {
					t.Errorf("%s: %s: a Job needs no probes", r.file, p.where)
				}
				continue
			}
			cfg := walboxConfig(t, r, p)
			_, port, _ := strings.Cut(cfg.Metrics.Listen, ":")
			want, _ := strconv.Atoi(port)
			if !strings.HasPrefix(cfg.Metrics.Listen, "0.0.0.0:") {
				t.Errorf("%s: %s: metrics.listen %s: the kubelet cannot reach it", r.file, p.where, cfg.Metrics.Listen)
			}
			var portName string
			for _, cp := range p.walbox.Ports {
				if int(cp.ContainerPort) == want {
					portName = cp.Name
				}
			}
			if portName == "" {
				t.Fatalf("%s: %s: no container port %d (metrics.listen)", r.file, p.where, want)
			}
			for _, pr := range []struct {
				name  string
				probe *corev1.Probe
				path  string
			}{{"liveness", p.walbox.LivenessProbe, "/healthz"}, {"readiness", p.walbox.ReadinessProbe, "/readyz"}} {
				if pr.probe == nil || pr.probe.HTTPGet == nil {
					t.Errorf("%s: %s: no HTTP %s probe", r.file, p.where, pr.name)
					continue
				}
				g := pr.probe.HTTPGet
				if g.Path != pr.path || g.Port != intstr.FromString(portName) && g.Port != intstr.FromInt32(int32(want)) {
					t.Errorf("%s: %s: %s probe %s on %s, want %s on %s", r.file, p.where, pr.name, g.Path, g.Port.String(), pr.path, portName)
				}
			}
			// The liveness probe must not give up before walbox itself says
			// the loop is wedged; it only polls that verdict.
			if lp := p.walbox.LivenessProbe; lp != nil {
				if window := time.Duration(lp.PeriodSeconds*lp.FailureThreshold) * time.Second; window > cfg.Metrics.LivenessTimeout {
					t.Errorf("%s: %s: the liveness probe's window %v exceeds metrics.liveness_timeout %v: it adds to it", r.file, p.where, window, cfg.Metrics.LivenessTimeout)
				}
			}
			for _, o := range r.byKind("Service") {
				svc := o.obj.(*corev1.Service)
				if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].TargetPort != intstr.FromString(portName) {
					t.Errorf("%s: Service/%s ports %+v, want the metrics port %s", r.file, svc.Name, svc.Spec.Ports, portName)
				}
			}
			for _, o := range r.byKind("ServiceMonitor") {
				sm := o.obj.(*monitoringv1.ServiceMonitor)
				if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != portName {
					t.Errorf("%s: ServiceMonitor/%s does not scrape %s", r.file, sm.Name, portName)
				}
				checkJobRelabel(t, r.file, o.kind, sm.Spec.Endpoints[0].RelabelConfigs)
			}
			for _, o := range r.byKind("PodMonitor") {
				pm := o.obj.(*monitoringv1.PodMonitor)
				if len(pm.Spec.PodMetricsEndpoints) != 1 || pm.Spec.PodMetricsEndpoints[0].Port == nil || *pm.Spec.PodMetricsEndpoints[0].Port != portName {
					t.Errorf("%s: PodMonitor/%s does not scrape %s", r.file, pm.Name, portName)
				}
				checkJobRelabel(t, r.file, o.kind, pm.Spec.PodMetricsEndpoints[0].RelabelConfigs)
				if !selects(pm.Spec.Selector.MatchLabels, p.spec, r) {
					t.Errorf("%s: PodMonitor/%s selects %v, not the example's pods", r.file, pm.Name, pm.Spec.Selector.MatchLabels)
				}
			}
		}
	}
}

// selects: every label of sel is on the Deployment's pods that hold spec.
func selects(sel map[string]string, spec corev1.PodSpec, r rendered) bool {
	for _, o := range r.byKind("Deployment") {
		d := o.obj.(*appsv1.Deployment)
		if !reflect.DeepEqual(d.Spec.Template.Spec, spec) {
			continue
		}
		for k, v := range sel {
			if d.Spec.Template.Labels[k] != v {
				return false
			}
		}
		return len(sel) > 0
	}
	return false
}

// checkJobRelabel: the scrape's job label is "walbox", the job
// docs/alerts.yml's up{job="walbox"} selects.
func checkJobRelabel(t *testing.T, file, kind string, rc []monitoringv1.RelabelConfig) {
	t.Helper()
	for _, c := range rc {
		if c.TargetLabel == "job" && c.Replacement != nil && *c.Replacement == "walbox" {
			return
		}
	}
	t.Errorf("%s: the %s does not set job=\"walbox\", which the alerts select", file, kind)
}

// TestPDBAndRolloutWithReplicas: with more than one replica a
// PodDisruptionBudget lets one pod go at a time and selects the
// Deployment's pods; the rollout never adds a pod (maxSurge 0) and takes
// one down at a time. With one replica there is no budget (it would block
// every node drain).
func TestPDBAndRolloutWithReplicas(t *testing.T) {
	sawPDB, sawSingle := false, false
	for _, r := range renderAll(t) {
		pdbs := r.byKind("PodDisruptionBudget")
		for _, o := range r.byKind("Deployment") {
			d := o.obj.(*appsv1.Deployment)
			if d.Name != releaseName {
				continue // the sidecar example: the application's own
			}
			replicas := int32(1)
			if d.Spec.Replicas != nil {
				replicas = *d.Spec.Replicas
			}
			if replicas == 1 {
				sawSingle = true
				if len(pdbs) != 0 {
					t.Errorf("%s: a PodDisruptionBudget with one replica", r.file)
				}
				continue
			}
			if len(pdbs) != 1 {
				t.Fatalf("%s: %d replicas and %d PodDisruptionBudgets, want 1", r.file, replicas, len(pdbs))
			}
			sawPDB = true
			pdb := pdbs[0].obj.(*policyv1.PodDisruptionBudget)
			if pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 || pdb.Spec.MinAvailable != nil {
				t.Errorf("%s: PodDisruptionBudget maxUnavailable %v minAvailable %v, want maxUnavailable 1", r.file, pdb.Spec.MaxUnavailable, pdb.Spec.MinAvailable)
			}
			for k, v := range pdb.Spec.Selector.MatchLabels {
				if d.Spec.Template.Labels[k] != v {
					t.Errorf("%s: the PodDisruptionBudget selects %s=%s, the pods do not have it", r.file, k, v)
				}
			}
			ru := d.Spec.Strategy.RollingUpdate
			if d.Spec.Strategy.Type != appsv1.RollingUpdateDeploymentStrategyType || ru == nil ||
				ru.MaxSurge == nil || ru.MaxSurge.IntValue() != 0 || ru.MaxUnavailable == nil || ru.MaxUnavailable.IntValue() != 1 {
				t.Errorf("%s: strategy %+v, want RollingUpdate with maxSurge 0 and maxUnavailable 1", r.file, d.Spec.Strategy)
			}
		}
	}
	if !sawPDB || !sawSingle {
		t.Errorf("the ci/ values files cover replicas > 1: %v, replicas 1: %v; want both", sawPDB, sawSingle)
	}
}

// TestSecurityContext: every container runs as a non-root user, on a
// read-only root filesystem, with no capability and no privilege
// escalation; the pod's service account token is not mounted.
func TestSecurityContext(t *testing.T) {
	for _, r := range renderAll(t) {
		for _, p := range r.pods(t) {
			ps := p.spec.SecurityContext
			for _, c := range slices.Concat(p.spec.Containers, p.spec.InitContainers) {
				sc := c.SecurityContext
				where := fmt.Sprintf("%s: %s container %s", r.file, p.where, c.Name)
				if sc == nil {
					t.Errorf("%s: no securityContext", where)
					continue
				}
				nonRoot := sc.RunAsNonRoot != nil && *sc.RunAsNonRoot || ps != nil && ps.RunAsNonRoot != nil && *ps.RunAsNonRoot
				if !nonRoot {
					t.Errorf("%s: runAsNonRoot is not set", where)
				}
				if ps == nil || ps.RunAsUser == nil || *ps.RunAsUser == 0 {
					t.Errorf("%s: no non-root runAsUser on the pod", where)
				}
				if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
					t.Errorf("%s: the root filesystem is writable", where)
				}
				if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
					t.Errorf("%s: privilege escalation allowed", where)
				}
				if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) > 0 {
					t.Errorf("%s: capabilities %+v, want drop [ALL] and none added", where, sc.Capabilities)
				}
			}
			if p.spec.AutomountServiceAccountToken == nil || *p.spec.AutomountServiceAccountToken {
				t.Errorf("%s: %s mounts a service account token walbox does not use", r.file, p.where)
			}
		}
	}
}

// TestGracePeriodOutlastsTheDrain: SIGTERM starts the relay's drain (in-
// flight acks, at most relay.DefaultDrainTimeout), then the sweeper's last
// marks and the final status update; the kubelet's SIGKILL must come
// well after: at least twice the drain.
func TestGracePeriodOutlastsTheDrain(t *testing.T) {
	for _, r := range renderAll(t) {
		for _, p := range r.pods(t) {
			if !p.relay {
				continue
			}
			g := p.spec.TerminationGracePeriodSeconds
			if g == nil {
				t.Errorf("%s: %s: no terminationGracePeriodSeconds", r.file, p.where)
			} else if time.Duration(*g)*time.Second < 2*relay.DefaultDrainTimeout {
				t.Errorf("%s: %s: terminationGracePeriodSeconds %d, want at least %v (twice the drain)", r.file, p.where, *g, 2*relay.DefaultDrainTimeout)
			}
		}
	}
}

// benchNumbers reads the relay's peak RSS and its CPU per event at
// 1,000 events/s from the benchmark's latest report.
func benchNumbers(t *testing.T) (rss resource.Quantity, cpu resource.Quantity) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "bench", "results", "latest.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`relay peak RSS \(VmHWM\) \| ([\d.]+) MB`).FindSubmatch(b)
	c := regexp.MustCompile(`1000/s: relay / walsender CPU per event; machine busy \| ([\d.]+) / [\d.]+ µs`).FindSubmatch(b)
	if m == nil || c == nil {
		t.Fatal("bench/results/latest.md: no peak RSS or no CPU per event at 1000/s (did the report's wording change?)")
	}
	mb, _ := strconv.ParseFloat(string(m[1]), 64)
	us, _ := strconv.ParseFloat(string(c[1]), 64)
	rss = *resource.NewQuantity(int64(mb*1e6), resource.BinarySI)
	// µs of CPU per event × 1,000 events/s = millicores.
	cpu = *resource.NewMilliQuantity(int64(us+0.999), resource.DecimalSI)
	return rss, cpu
}

// TestResourcesFromTheBenchmark: the relay's requests cover what `make
// bench` measured (peak RSS; CPU at 1,000 events/s), and its memory limit
// also the bytes of events nats.window_bytes lets it hold.
func TestResourcesFromTheBenchmark(t *testing.T) {
	rss, cpu := benchNumbers(t)
	t.Logf("bench: peak RSS %s, CPU at 1,000 events/s %s", rss.String(), cpu.String())
	for _, r := range renderAll(t) {
		for _, p := range r.pods(t) {
			if !p.relay {
				continue
			}
			cfg := walboxConfig(t, r, p)
			res := p.walbox.Resources
			if q := res.Requests[corev1.ResourceMemory]; q.Cmp(rss) < 0 {
				t.Errorf("%s: %s: memory request %s below the peak RSS %s", r.file, p.where, q.String(), rss.String())
			}
			if q := res.Requests[corev1.ResourceCPU]; q.Cmp(cpu) < 0 {
				t.Errorf("%s: %s: CPU request %s below the %s measured at 1,000 events/s", r.file, p.where, q.String(), cpu.String())
			}
			limit, ok := res.Limits[corev1.ResourceMemory]
			need := rss.DeepCopy()
			need.Add(*resource.NewQuantity(cfg.NATS.WindowBytes, resource.BinarySI))
			if !ok || limit.Cmp(need) < 0 {
				t.Errorf("%s: %s: memory limit %s below peak RSS + nats.window_bytes (%s)", r.file, p.where, limit.String(), need.String())
			}
			if _, ok := res.Limits[corev1.ResourceCPU]; ok {
				t.Errorf("%s: %s: a CPU limit throttles the relay's latency", r.file, p.where)
			}
		}
	}
}

// TestPrometheusRuleIsDocsAlerts: the PrometheusRule's groups are
// docs/alerts.yml's, alert for alert, and the chart's copy of the alerts
// and of the Grafana dashboard are the docs' files, byte for byte
// (-update copies them).
func TestPrometheusRuleIsDocsAlerts(t *testing.T) {
	for _, f := range []string{"alerts.yml", "grafana-dashboard.json"} {
		src := filepath.Join(repoRoot, "docs", f)
		dst := filepath.Join(chartDir, "files", f)
		want, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if *update {
			if err := os.WriteFile(dst, want, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		got, err := os.ReadFile(dst)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s is not a copy of docs/%s (%v): run go test -run TestPrometheusRuleIsDocsAlerts -update", dst, f, err)
		}
	}
	data, err := os.ReadFile(filepath.Join(repoRoot, "docs", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var docs monitoringv1.PrometheusRuleSpec
	if err := yaml.UnmarshalStrict(data, &docs); err != nil {
		t.Fatalf("docs/alerts.yml: %v", err)
	}
	if len(docs.Groups) == 0 || len(docs.Groups[0].Rules) == 0 {
		t.Fatal("docs/alerts.yml has no rules")
	}
	dashboard, err := os.ReadFile(filepath.Join(repoRoot, "docs", "grafana-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	checkProvisionable(t, dashboard)
	sawRule, sawDashboard := false, false
	for _, r := range renderAll(t) {
		for _, o := range r.byKind("PrometheusRule") {
			sawRule = true
			got := o.obj.(*monitoringv1.PrometheusRule).Spec
			if !reflect.DeepEqual(got, docs) {
				t.Errorf("%s: the PrometheusRule's groups differ from docs/alerts.yml", r.file)
			}
		}
		for _, o := range r.byKind("ConfigMap") {
			if cm := o.obj.(*corev1.ConfigMap); strings.HasSuffix(cm.Name, "-dashboard") {
				sawDashboard = true
				if strings.TrimSpace(cm.Data["walbox.json"]) != strings.TrimSpace(string(dashboard)) {
					t.Errorf("%s: ConfigMap/%s is not docs/grafana-dashboard.json", r.file, cm.Name)
				}
				if cm.Labels["grafana_dashboard"] != "1" {
					t.Errorf("%s: ConfigMap/%s lacks the grafana_dashboard label", r.file, cm.Name)
				}
			}
		}
	}
	if !sawRule || !sawDashboard {
		t.Errorf("no ci/ values file renders the PrometheusRule (%v) or the dashboard (%v)", sawRule, sawDashboard)
	}
}

// TestMigrateRunsAsAPreInstallHook: `walbox migrate` is a Job that Helm
// runs before install and upgrade, with a ConfigMap of its own made
// before it (the release's does not exist yet at pre-install).
func TestMigrateRunsAsAPreInstallHook(t *testing.T) {
	saw := false
	for _, r := range renderAll(t) {
		enabled := true
		if m, ok := r.vals["migrate"].(map[string]any); ok && m["enabled"] == false {
			enabled = false
		}
		jobs := r.byKind("Job")
		if !enabled {
			if len(jobs) != 0 {
				t.Errorf("%s: migrate off, but a Job", r.file)
			}
			continue
		}
		if len(jobs) != 1 {
			t.Fatalf("%s: %d Jobs, want the migrate Job", r.file, len(jobs))
		}
		saw = true
		j := jobs[0].obj.(*batchv1.Job)
		if j.Annotations["helm.sh/hook"] != "pre-install,pre-upgrade" {
			t.Errorf("%s: Job/%s hook %q", r.file, j.Name, j.Annotations["helm.sh/hook"])
		}
		c := j.Spec.Template.Spec.Containers[0]
		if len(c.Args) == 0 || c.Args[0] != "migrate" {
			t.Errorf("%s: Job/%s runs %v", r.file, j.Name, c.Args)
		}
		if j.Spec.Template.Spec.ServiceAccountName != "" {
			t.Errorf("%s: Job/%s uses ServiceAccount %s, which does not exist yet at pre-install", r.file, j.Name, j.Spec.Template.Spec.ServiceAccountName)
		}
		jobWeight, _ := strconv.Atoi(j.Annotations["helm.sh/hook-weight"])
		for _, v := range j.Spec.Template.Spec.Volumes {
			if v.ConfigMap == nil {
				continue
			}
			found := false
			for _, o := range r.byKind("ConfigMap") {
				cm := o.obj.(*corev1.ConfigMap)
				if cm.Name != v.ConfigMap.Name {
					continue
				}
				found = true
				w, _ := strconv.Atoi(cm.Annotations["helm.sh/hook-weight"])
				if !strings.Contains(cm.Annotations["helm.sh/hook"], "pre-install") || w >= jobWeight {
					t.Errorf("%s: the migrate Job's ConfigMap/%s is not a hook made before it (%v)", r.file, cm.Name, cm.Annotations)
				}
			}
			if !found {
				t.Errorf("%s: the migrate Job mounts ConfigMap/%s, which the chart does not render", r.file, v.ConfigMap.Name)
			}
		}
	}
	if !saw {
		t.Error("no ci/ values file renders the migrate Job")
	}
}

// TestHelmLint runs Helm's own linter (the code `helm lint` runs) on the
// chart with each ci/ values file: no error, no warning.
func TestHelmLint(t *testing.T) {
	for _, file := range ciValues(t) {
		res := lint.RunAll(chartDir, readValues(t, file), releaseSpace)
		for _, m := range res.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("helm lint with %s: %s", filepath.Base(file), m)
			} else {
				t.Logf("helm lint with %s: %s", filepath.Base(file), m)
			}
		}
	}
}

// TestPlainManifestsAreUpToDate: deploy/kubernetes holds the chart's
// rendering (-update writes it).
func TestPlainManifestsAreUpToDate(t *testing.T) {
	ch := loadChart(t)
	for _, set := range manifestSets {
		dir := filepath.Join(repoRoot, "deploy", "kubernetes", set.dir)
		files := plainManifests(t, ch, set.values)
		if *update {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			old, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
			for _, f := range old {
				os.Remove(f)
			}
			for name, b := range files {
				if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
		have, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
		if len(have) != len(files) {
			t.Errorf("%s has %d files, the chart renders %d: run go test -run TestPlainManifestsAreUpToDate -update", dir, len(have), len(files))
		}
		for name, want := range files {
			got, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil || !bytes.Equal(got, want) {
				t.Errorf("%s/%s is not the chart's rendering (%v): run go test -run TestPlainManifestsAreUpToDate -update", dir, name, err)
			}
		}
	}
}

// checkProvisionable: Grafana's dashboard sidecar (and file provisioning)
// loads the JSON as it is: an import input such as ${DS_PROMETHEUS} is never
// substituted, and every panel would show "datasource not found". The
// dashboard selects its data source with a variable of its own instead,
// which the import dialog and provisioning both fill.
func checkProvisionable(t *testing.T, dashboard []byte) {
	t.Helper()
	var d struct {
		Inputs     []json.RawMessage `json:"__inputs"`
		Templating struct {
			List []struct{ Name, Type, Query string } `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(dashboard, &d); err != nil {
		t.Fatalf("docs/grafana-dashboard.json: %v", err)
	}
	if len(d.Inputs) > 0 {
		t.Error("docs/grafana-dashboard.json has __inputs: provisioning does not fill them; use the datasource variable")
	}
	hasVar := false
	for _, v := range d.Templating.List {
		hasVar = hasVar || (v.Name == "datasource" && v.Type == "datasource" && v.Query == "prometheus")
	}
	if !hasVar {
		t.Error("docs/grafana-dashboard.json lacks the templating variable datasource (type datasource, query prometheus)")
	}
	for _, m := range regexp.MustCompile(`\$\{[A-Za-z_]+\}`).FindAll(dashboard, -1) {
		if string(m) != "${datasource}" {
			t.Errorf("docs/grafana-dashboard.json uses %s: no variable or provisioning fills it", m)
		}
	}
	if !bytes.Contains(dashboard, []byte(`"uid": "${datasource}"`)) {
		t.Error(`docs/grafana-dashboard.json: no panel takes its data source from ${datasource}`)
	}
}
