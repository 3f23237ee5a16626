// Package redact is walbox's one way to show a connection address without
// its secrets, in logs, errors and reports.
package redact

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// Mask stands in for a password or token.
const Mask = "xxxxx"

// PostgresURL shows a database URL (or key=value string) as
// user@host:port/db, without the password; "(unparsable url)" when it does
// not parse.
func PostgresURL(u string) string {
	c, err := pgconn.ParseConfig(u)
	if err != nil {
		return "(unparsable url)"
	}
	return fmt.Sprintf("%s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
}

// URL hides the credentials of a URL, or of several separated by commas:
// scheme://user:pass@host becomes scheme://user:xxxxx@host, and a bare
// token (scheme://token@host) becomes xxxxx. A URL that does not parse
// loses everything between the scheme and the host.
func URL(u string) string {
	parts := strings.Split(u, ",")
	for i, p := range parts {
		p = strings.TrimSpace(p)
		pu, err := url.Parse(p)
		if err != nil || pu.User == nil {
			if at := strings.LastIndex(p, "@"); at >= 0 {
				prefix := ""
				if scheme := strings.Index(p, "://"); scheme >= 0 && scheme < at {
					prefix = p[:scheme+3]
				}
				parts[i] = prefix + Mask + p[at:]
				continue
			}
			parts[i] = p
			continue
		}
		if _, hasPass := pu.User.Password(); hasPass {
			pu.User = url.UserPassword(pu.User.Username(), Mask)
		} else {
			pu.User = url.User(Mask)
		}
		parts[i] = pu.String()
	}
	return strings.Join(parts, ",")
}
