package cdc

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

func pgErr(code, msg string) error {
	return fmt.Errorf("connect for replication: %w", &pgconn.PgError{Severity: "FATAL", Code: code, Message: msg})
}

// TestClassifyConnectError: the errors people meet on the first start
// become PreconditionErrors that name the fix; the others stay transient.
func TestClassifyConnectError(t *testing.T) {
	for _, c := range []struct {
		name     string
		err      error
		wantWhat string // "" for an error passed through unchanged
		wantFix  string
	}{
		{"no pg_hba.conf entry", pgErr("28000", `no pg_hba.conf entry for replication connection from host "10.0.0.5", user "walbox"`),
			"the server refuses replication connections from walbox", "add a pg_hba.conf line for the outbox database"},
		{"no REPLICATION attribute", pgErr("42501", "permission denied to start WAL sender"),
			"walbox's role may not use replication", "ALTER ROLE <role> WITH REPLICATION"},
		{"a role that may not log in", pgErr("28000", `role "walbox" is not permitted to log in`),
			"walbox's role may not use replication", "ALTER ROLE <role> WITH REPLICATION"},
		{"a wrong password", pgErr("28P01", `password authentication failed for user "walbox"`),
			"password authentication failed", "check the user and password in postgres.url"},
		{"wal_level too low", pgErr("55000", "logical decoding requires wal_level >= logical"),
			"logical decoding needs wal_level = logical", "set wal_level = logical in postgresql.conf"},
		{"another object-state error", pgErr("55000", "replication slot is being synchronized"), "", ""},
		{"every slot in use", pgErr("53400", "all replication slots are in use"),
			"all replication slots are in use", "raise max_replication_slots"},
		{"the server is starting", pgErr("57P03", "the database system is starting up"), "", ""},
		{"not a server error", errors.New("dial tcp 10.0.0.5:5432: connection refused"), "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := classifyConnectError(c.err)
			var pe *PreconditionError
			if c.wantWhat == "" {
				if got != c.err || IsPermanent(got) {
					t.Fatalf("got %v, want %v unchanged and transient", got, c.err)
				}
				return
			}
			if !errors.As(got, &pe) || !IsPermanent(got) {
				t.Fatalf("got %T %v, want a PreconditionError", got, got)
			}
			if pe.What != c.wantWhat || !strings.HasPrefix(pe.Fix, c.wantFix) || !errors.Is(got, c.err) {
				t.Errorf("What %q, Fix %q, wraps the cause %v", pe.What, pe.Fix, errors.Is(got, c.err))
			}
			if !strings.Contains(got.Error(), "("+c.err.Error()+")") {
				t.Errorf("message %q does not carry the cause", got.Error())
			}
		})
	}
}

func TestPermanentConnectError(t *testing.T) {
	const url = "postgres://payouts_relay:secret@db.internal:5432/payouts"
	for _, c := range []struct {
		name    string
		err     error
		want    string // "" for a transient error
		wantFix string
	}{
		{"no such database", pgErr("3D000", `database "payouts" does not exist`),
			"the database in postgres.url does not exist", "check the database name"},
		{"no pg_hba.conf entry", pgErr("28000", `no pg_hba.conf entry for host "10.0.0.5", user "payouts_relay", database "payouts"`),
			"pg_hba.conf has no entry that lets walbox's role connect to this database",
			"add a line for the database and walbox's role to pg_hba.conf, e.g. `host payouts payouts_relay <walbox address>/32 scram-sha-256`"},
		{"a role that may not log in", pgErr("28000", `role "payouts_relay" does not exist`),
			"the role in postgres.url may not log in (it does not exist, or lacks LOGIN)", "check the user in postgres.url"},
		{"a wrong password", pgErr("28P01", "password authentication failed"),
			"password authentication failed", "check the user and password (postgres.url, postgres.password_file"},
		{"the server is starting", pgErr("57P03", "the database system is starting up"), "", ""},
		{"the network", errors.New("dial tcp: i/o timeout"), "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := PermanentConnectError(c.err, url)
			if c.want == "" {
				if got != nil {
					t.Fatalf("got %v, want nil (retry)", got)
				}
				return
			}
			var pe *PreconditionError
			if !errors.As(got, &pe) || pe.What != c.want || !strings.HasPrefix(pe.Fix, c.wantFix) || !errors.Is(got, c.err) {
				t.Fatalf("got %v", got)
			}
			if strings.Contains(got.Error(), "secret") {
				t.Errorf("the password is in %q", got.Error())
			}
		})
	}
	// A URL that does not parse still gets a fix, with placeholders.
	got := PermanentConnectError(pgErr("28000", "no pg_hba.conf entry"), "postgres://%zz")
	if got == nil || !strings.Contains(got.Error(), "`host <database> <role> <walbox address>/32") {
		t.Errorf("got %v", got)
	}
}

func TestNewSourceConfig(t *testing.T) {
	ok := Config{ConnString: "postgres://walbox@db/app", Slot: "walbox", Publication: "walbox_outbox", Table: outboxTable, Columns: DefaultColumns()}
	for _, c := range []struct {
		name string
		mod  func(*Config)
		key  string
	}{
		{"no URL", func(c *Config) { c.ConnString = "" }, "postgres.url"},
		{"no slot", func(c *Config) { c.Slot = "" }, "postgres.slot"},
		{"no publication", func(c *Config) { c.Publication = "" }, "postgres.publication"},
		{"no table", func(c *Config) { c.Table = TableName{} }, "outbox.table"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := ok
			c.mod(&cfg)
			_, err := NewSource(cfg)
			var ce *ConfigError
			if !errors.As(err, &ce) || ce.Key != c.key || !IsPermanent(err) || !strings.HasPrefix(err.Error(), "config "+c.key+": ") {
				t.Fatalf("err %v, want a ConfigError for %s", err, c.key)
			}
		})
	}
	s, err := NewSource(ok)
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.StatusInterval != 10*time.Second || s.cfg.BatchSize != 512 || s.cfg.BatchBytes != 8<<20 ||
		s.cfg.BackoffInitial != time.Second || s.cfg.BackoffMax != time.Minute {
		t.Errorf("defaults %+v", s.cfg)
	}
	if s.Connected() || s.Origin() != nil || s.Confirmed() != 0 || s.Received() != 0 {
		t.Errorf("a new source reports state")
	}
}

func TestReplicationConfig(t *testing.T) {
	cfg, err := replicationConfig("postgres://walbox:secret@db.internal:5433/app?sslmode=disable&application_name=other")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.RuntimeParams["replication"] != "database" || cfg.RuntimeParams["application_name"] != "walbox" || cfg.Port != 5433 || cfg.Database != "app" {
		t.Errorf("config %+v", cfg.RuntimeParams)
	}
	_, err = replicationConfig("postgres://walbox:secret@db.internal:notaport/app")
	var ce *ConfigError
	if !errors.As(err, &ce) || ce.Key != "postgres.url" || strings.Contains(err.Error(), "secret") {
		t.Errorf("err %v", err)
	}
}

func TestPositionOrder(t *testing.T) {
	a := Position{CommitLSN: 0x100, Index: 5}
	b := Position{CommitLSN: 0x100, Index: 6}
	c := Position{CommitLSN: 0x200, Index: 0}
	if !a.Less(b) || !b.Less(c) || !a.Less(c) || b.Less(a) || c.Less(b) || a.Less(a) {
		t.Error("positions out of commit order")
	}
	if got := b.String(); got != "0/100/6" {
		t.Errorf("String = %q", got)
	}
	if got := (&Origin{SystemID: "7300", Timeline: 2}).String(); got != "system 7300 timeline 2" {
		t.Errorf("Origin.String = %q", got)
	}
	if got := (*Origin)(nil).String(); got != "unknown" {
		t.Errorf("nil Origin.String = %q", got)
	}
}

// TestPluginArgs: what walbox asks pgoutput for. Protocol version 1 and no
// "streaming" option: a transaction's changes only ever arrive between its
// Begin and Commit, which is all the decoder handles (no Stream Start,
// Stream Commit or xid-prefixed frames).
func TestPluginArgs(t *testing.T) {
	for _, c := range []struct {
		origin string
		want   []string
	}{
		{"", []string{"proto_version '1'", "publication_names 'it''s_outbox'", "messages 'true'"}},
		{"any", []string{"proto_version '1'", "publication_names 'it''s_outbox'", "messages 'true'"}},
		{"none", []string{"proto_version '1'", "publication_names 'it''s_outbox'", "messages 'true'", "origin 'none'"}},
	} {
		if got := pluginArgs("it's_outbox", c.origin); !reflect.DeepEqual(got, c.want) {
			t.Errorf("origin %q: %q, want %q", c.origin, got, c.want)
		}
	}
}
