package app

import (
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/redact"
)

// NATSOptions turns nats.tls, nats.credentials, nats.nkey, nats.user,
// nats.password and nats.token into connection options. The relay and every
// CLI command that talks to NATS use it. Errors name the key, never a secret.
func NATSOptions(n config.NATS) ([]nats.Option, error) {
	var opts []nats.Option
	if n.TLS.CA != "" {
		opts = append(opts, nats.RootCAs(n.TLS.CA))
	}
	if n.TLS.Cert != "" || n.TLS.Key != "" {
		opts = append(opts, nats.ClientCert(n.TLS.Cert, n.TLS.Key))
	}
	switch {
	case n.Credentials != "":
		opts = append(opts, nats.UserCredentials(n.Credentials))
	case n.NKey != "":
		o, err := nats.NkeyOptionFromSeed(n.NKey)
		if err != nil {
			return nil, &config.Error{Key: "nats.nkey", Msg: "cannot use the nkey seed file " + n.NKey + ": " + scrub(err.Error(), n)}
		}
		opts = append(opts, o)
	case n.User != "" || n.Password != "":
		opts = append(opts, nats.UserInfo(n.User, n.Password))
	case n.Token != "":
		opts = append(opts, nats.Token(n.Token))
	}
	return opts, nil
}

// RedactNATSURL hides credentials in a (comma-separated) NATS URL
// (redact.URL).
func RedactNATSURL(u string) string { return redact.URL(u) }

// scrub removes the configured secrets from a message.
func scrub(msg string, n config.NATS) string {
	for _, s := range []string{n.Password, n.Token} {
		if len(s) >= 3 {
			msg = strings.ReplaceAll(msg, s, "xxxxx")
		}
	}
	return msg
}

// ScrubNATSError is err's text with the configured NATS secrets and URL
// credentials removed, for messages a user sees.
func ScrubNATSError(err error, n config.NATS) string {
	msg := scrub(err.Error(), n)
	for _, p := range strings.Split(n.URL, ",") {
		p = strings.TrimSpace(p)
		if p != "" && strings.Contains(p, "@") {
			msg = strings.ReplaceAll(msg, p, RedactNATSURL(p))
		}
	}
	return msg
}
