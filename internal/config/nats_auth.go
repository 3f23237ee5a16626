package config

import (
	"os"
)

// NATSTLS is TLS to the NATS server: a CA to verify it, and a client
// certificate when the server asks for one (verify: true).
type NATSTLS struct {
	// CA is a PEM file of the certificate authority that signed the server's
	// certificate; setting it turns TLS on.
	CA string `yaml:"ca" env:"CA"`
	// Cert and Key are the client certificate and its private key (PEM).
	Cert string `yaml:"cert" env:"CERT"`
	Key  string `yaml:"key" env:"KEY"`
}

// validateNATSAuth checks nats.tls and the authentication keys: files that
// must exist, pairs that go together, alternatives that exclude each other.
// It never quotes a secret.
func (c *Config) validateNATSAuth(bad func(key, format string, args ...any)) {
	n := c.NATS
	if (n.TLS.Cert == "") != (n.TLS.Key == "") {
		bad("nats.tls", "set both cert and key (the client certificate and its private key), or neither")
	}
	for _, f := range []struct{ key, path string }{
		{"nats.tls.ca", n.TLS.CA}, {"nats.tls.cert", n.TLS.Cert}, {"nats.tls.key", n.TLS.Key},
		{"nats.credentials", n.Credentials}, {"nats.nkey", n.NKey},
	} {
		if f.path == "" {
			continue
		}
		if _, err := os.Stat(f.path); err != nil {
			bad(f.key, "cannot read %s: %v", f.path, err)
		}
	}
	if n.User != "" && n.Password == "" {
		bad("nats.password", "is required with nats.user (or set WALBOX_NATS_PASSWORD)")
	}
	if n.Password != "" && n.User == "" {
		bad("nats.user", "is required with nats.password")
	}
	methods := 0
	for _, set := range []bool{n.Credentials != "", n.NKey != "", n.User != "" || n.Password != "", n.Token != ""} {
		if set {
			methods++
		}
	}
	if methods > 1 {
		bad("nats.credentials", "set one way to authenticate: nats.credentials, nats.nkey, nats.user and nats.password, or nats.token")
	}
}
