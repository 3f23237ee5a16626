package ops

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/relaytest"
)

// A server that carries Amazon RDS's setting is recognised: the wal_level
// fix names the parameter group (ALTER SYSTEM is not allowed there), and a
// role without the REPLICATION attribute that is a member of rds_replication
// passes, as on RDS (a local role mimics it).
func TestDoctorRecognisesRDS(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, dbURL := pgtest.OwnDB(ctx, t, pgtest.WithSetting("rds.logical_replication", "0"), pgtest.WithSetting("wal_level", "replica"))
	relaytest.Exec(t, dbURL, "CREATE ROLE rds_replication", "CREATE ROLE app_walbox LOGIN", "GRANT rds_replication TO app_walbox", "CREATE ROLE app_plain LOGIN")
	e := newEnv(t)
	as := func(role string) *DoctorReport {
		u, _ := url.Parse(dbURL)
		u.User = url.User(role)
		cfg := e.cfg
		cfg.Postgres.URL = u.String()
		return Doctor(ctx, cfg)
	}
	rep := as("app_walbox")
	if c := checkOf(t, rep, "postgres.provider"); c.Status != OK || !strings.Contains(c.Detail, "Amazon RDS") {
		t.Errorf("provider: %+v", c)
	}
	if c := checkOf(t, rep, "postgres.wal_level"); c.Status != Fail || !strings.Contains(c.Fix, "rds.logical_replication = 1") || !strings.Contains(c.Fix, "parameter group") {
		t.Errorf("wal_level on RDS: %+v", c)
	}
	if c := checkOf(t, rep, "postgres.role"); c.Status != OK || !strings.Contains(c.Detail, "rds_replication") {
		t.Errorf("a member of rds_replication: %+v", c)
	}
	if c := checkOf(t, as("app_plain"), "postgres.role"); c.Status != Fail || !strings.Contains(c.Fix, "GRANT rds_replication TO") {
		t.Errorf("a role without it: %+v", c)
	}
}

// Something between walbox and the server (here a TCP proxy, as a pooler
// would be) shows as a port that differs from the server's own.
func TestDoctorSeesSomethingInBetween(t *testing.T) {
	e := newEnv(t)
	u, _ := url.Parse(e.dbURL)
	proxy := relaytest.Proxy(t, u.Host, nil)
	if c := checkOf(t, Doctor(e.ctx, e.cfg), "postgres.direct"); c.Status != OK {
		t.Errorf("direct connection: %+v", c)
	}
	u.Host = proxy
	cfg := e.cfg
	cfg.Postgres.URL = u.String()
	if c := checkOf(t, Doctor(e.ctx, cfg), "postgres.direct"); c.Status != Warn || !strings.Contains(c.Fix, "pooler") {
		t.Errorf("through a proxy: %+v", c)
	}
}
