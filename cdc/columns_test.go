package cdc

import (
	"testing"
)

func TestRoles(t *testing.T) {
	names := RoleNames()
	if len(names) != int(numRoles) {
		t.Fatalf("%d role names for %d roles", len(names), numRoles)
	}
	for i, n := range names {
		r, ok := ParseRole(n)
		if !ok || r != Role(i) || r.String() != n {
			t.Errorf("role %d %q: ParseRole = %d, %v; String = %q", i, n, r, ok, r.String())
		}
	}
	for _, n := range []string{"", "ID", "payload ", "processed"} {
		if _, ok := ParseRole(n); ok {
			t.Errorf("ParseRole(%q) accepted", n)
		}
	}
	def := DefaultColumns()
	for i, n := range names {
		if def[i] != n {
			t.Errorf("default column of role %s is %q", Role(i), def[i])
		}
	}
}

func TestColumnsFromMap(t *testing.T) {
	mod := func(f func(*Columns)) Columns {
		c := DefaultColumns()
		f(&c)
		return c
	}
	for _, c := range []struct {
		name        string
		m           map[string]string
		useDefaults bool
		want        Columns
		wantErr     string
	}{
		{name: "nothing configured", useDefaults: true, want: DefaultColumns()},
		{name: "renamed roles over the defaults", useDefaults: true,
			m:    map[string]string{"id": "event_id", "payload": "body"},
			want: mod(func(c *Columns) { c[RoleID], c[RolePayload] = "event_id", "body" })},
		{name: "an optional role left out", useDefaults: true,
			m:    map[string]string{"headers": "", "stream": ""},
			want: mod(func(c *Columns) { c[RoleHeaders], c[RoleStream] = "", "" })},
		{name: "without defaults only what is given",
			m: map[string]string{"id": "i", "topic": "t", "payload": "p"},
			want: func() Columns {
				var c Columns
				c[RoleID], c[RoleTopic], c[RolePayload] = "i", "t", "p"
				return c
			}()},
		{name: "an unknown role", useDefaults: true, m: map[string]string{"processed": "processed"},
			wantErr: `unknown column role "processed" (known roles: id, topic, payload, stream, event_type, aggregate_type, aggregate_id, partition_key, headers, created_at)`},
		{name: "a required role left out", useDefaults: true, m: map[string]string{"topic": ""},
			wantErr: `column role "topic" must be mapped to a column`},
		{name: "without defaults a required role is missing", m: map[string]string{"id": "i", "topic": "t"},
			wantErr: `column role "payload" must be mapped to a column`},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := ColumnsFromMap(c.m, c.useDefaults)
			if c.wantErr != "" {
				if err == nil || err.Error() != c.wantErr {
					t.Fatalf("err %v, want %q", err, c.wantErr)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("got %v, %v; want %v", got, err, c.want)
			}
		})
	}
}

func TestTableNames(t *testing.T) {
	for _, c := range []struct {
		in      string
		want    TableName
		wantErr bool
	}{
		{in: "outbox_events", want: TableName{"public", "outbox_events"}},
		{in: " billing.outbox ", want: TableName{"billing", "outbox"}},
		{in: "", wantErr: true},
		{in: "  ", wantErr: true},
		{in: "a.b.c", wantErr: true},
		{in: ".t", wantErr: true},
		{in: "s.", wantErr: true},
	} {
		got, err := ParseTableName(c.in)
		if (err != nil) != c.wantErr || got != c.want {
			t.Errorf("ParseTableName(%q) = %v, %v", c.in, got, err)
		}
	}
	tn := TableName{Schema: `my"schema`, Name: "Outbox Events"}
	if got, want := tn.Quoted(), `"my""schema"."Outbox Events"`; got != want {
		t.Errorf("Quoted = %s, want %s", got, want)
	}
	if got := tn.String(); got != `my"schema.Outbox Events` {
		t.Errorf("String = %s", got)
	}
	if got, want := QuoteLiteral(`it's`), `'it''s'`; got != want {
		t.Errorf("QuoteLiteral = %s, want %s", got, want)
	}
	if got := QuoteIdent(""); got != `""` {
		t.Errorf("QuoteIdent(\"\") = %s", got)
	}
}
