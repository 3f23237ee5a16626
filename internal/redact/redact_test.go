package redact

import (
	"strings"
	"testing"
)

func TestNoSecretSurvives(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"nats://u:s3cret@h:4222", "nats://u:xxxxx@h:4222"},
		{"nats://t0ken@h:4222", "nats://xxxxx@h:4222"},
		{"nats://a:s3cret@h1:4222, nats://b:s3cret@h2:4222", "nats://a:xxxxx@h1:4222,nats://b:xxxxx@h2:4222"},
		{"postgres://walbox:s3cret@db:5432/app?sslmode=disable", "postgres://walbox:xxxxx@db:5432/app?sslmode=disable"},
		{"nats://h:4222", "nats://h:4222"},
		{"postgres://u:s3c%zzret@db/app", "postgres://xxxxx@db/app"},
	} {
		if got := URL(tt.in); got != tt.want {
			t.Errorf("URL(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
	for _, in := range []string{"postgres://walbox:s3cret@db:5432/app", "host=db user=walbox password=s3cret dbname=app"} {
		got := PostgresURL(in)
		if strings.Contains(got, "s3cret") || got != "walbox@db:5432/app" {
			t.Errorf("PostgresURL(%q) = %q, want walbox@db:5432/app", in, got)
		}
	}
	if got := PostgresURL("postgres://%zz"); got != "(unparsable url)" {
		t.Errorf("unparsable: %q", got)
	}
}
