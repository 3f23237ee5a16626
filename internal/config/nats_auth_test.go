package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestNATSAuthFromFileAndEnv(t *testing.T) {
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := load(t, validYAML+`
  tls: {ca: `+ca+`}
  user: walbox
`, "WALBOX_NATS_PASSWORD=s3cret-from-env")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.NATS.TLS.CA != ca || cfg.NATS.User != "walbox" || cfg.NATS.Password != "s3cret-from-env" {
		t.Fatalf("nats auth not loaded: tls %+v user %q", cfg.NATS.TLS, cfg.NATS.User)
	}
	cfg, err = load(t, validYAML, "WALBOX_NATS_TOKEN=tok", "WALBOX_NATS_TLS_CA="+ca)
	if err != nil || cfg.NATS.Token != "tok" || cfg.NATS.TLS.CA != ca {
		t.Fatalf("token from env: %v %+v", err, cfg.NATS.TLS)
	}
}

func TestNATSAuthErrorsNameTheKeyAndNotTheSecret(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		env  []string
		key  string
	}{
		{"  tls: {cert: /nonexistent/c.pem}\n", nil, "nats.tls"},
		{"  tls: {ca: /nonexistent/ca.pem}\n", nil, "nats.tls.ca"},
		{"  credentials: /nonexistent/x.creds\n", nil, "nats.credentials"},
		{"  nkey: /nonexistent/seed.nk\n", nil, "nats.nkey"},
		{"  user: walbox\n", nil, "nats.password"},
		{"", []string{"WALBOX_NATS_PASSWORD=hunter2-secret"}, "nats.user"},
		{"  user: walbox\n", []string{"WALBOX_NATS_PASSWORD=hunter2-secret", "WALBOX_NATS_TOKEN=tok-secret"}, "nats.credentials"},
	} {
		_, err := load(t, validYAML+tc.yaml, tc.env...)
		wantErrNaming(t, err, tc.key)
		for _, secret := range []string{"hunter2-secret", "tok-secret"} {
			if strings.Contains(err.Error(), secret) {
				t.Errorf("error quotes a secret: %v", err)
			}
		}
	}
}

func TestNATSTLSUnknownKeyIsNamed(t *testing.T) {
	_, err := load(t, validYAML+"  tls: {cafile: x}\n")
	wantErrNaming(t, err, "nats.tls.cafile")
}
