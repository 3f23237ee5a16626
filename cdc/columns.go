package cdc

import (
	"fmt"
	"strings"
)

// Role is what a column means to walbox, independent of its name. The relay
// reads columns by role so that an existing outbox table works as it is.
type Role int

// Column roles. RoleID, RoleTopic and RolePayload are required.
const (
	RoleID Role = iota
	RoleTopic
	RolePayload
	RoleStream
	RoleEventType
	RoleAggregateType
	RoleAggregateID
	RolePartitionKey
	RoleHeaders
	RoleCreatedAt
	numRoles
)

var roleNames = [numRoles]string{"id", "topic", "payload", "stream", "event_type", "aggregate_type", "aggregate_id", "partition_key", "headers", "created_at"}

func (r Role) String() string { return roleNames[r] }

// RoleNames lists every role name in a stable order (for config validation).
func RoleNames() []string { return roleNames[:] }

// ParseRole maps a role name from the config to its Role.
func ParseRole(name string) (Role, bool) {
	for i, n := range roleNames {
		if n == name {
			return Role(i), true
		}
	}
	return 0, false
}

// Columns maps roles to column names. An empty name leaves the role unmapped.
type Columns [numRoles]string

// DefaultColumns is the mapping for walbox's own outbox_events table.
func DefaultColumns() Columns {
	var c Columns
	for i := range c {
		c[i] = roleNames[i]
	}
	return c
}

// ColumnsFromMap builds a mapping from config: role -> column. Roles missing
// from m keep the default name only when useDefaults is set.
func ColumnsFromMap(m map[string]string, useDefaults bool) (Columns, error) {
	var c Columns
	if useDefaults {
		c = DefaultColumns()
	}
	for role, col := range m {
		r, ok := ParseRole(role)
		if !ok {
			return c, fmt.Errorf("unknown column role %q (known roles: %s)", role, strings.Join(roleNames[:], ", "))
		}
		c[r] = col
	}
	for _, r := range []Role{RoleID, RoleTopic, RolePayload} {
		if c[r] == "" {
			return c, fmt.Errorf("column role %q must be mapped to a column", r)
		}
	}
	return c, nil
}

// TableName is a schema-qualified table name.
type TableName struct{ Schema, Name string }

// Archive is the archive table of an outbox table, the one name walbox
// uses for it (the sweeper, walbox archive and replay, and the migrations):
// walbox.<table>_archive for a table in schema public,
// walbox.<schema>_<table>_archive otherwise.
func (t TableName) Archive() TableName {
	if t.Schema == "public" {
		return TableName{Schema: "walbox", Name: t.Name + "_archive"}
	}
	return TableName{Schema: "walbox", Name: t.Schema + "_" + t.Name + "_archive"}
}

// ParseTableName splits "schema.table" (schema defaults to public).
func ParseTableName(s string) (TableName, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return TableName{}, fmt.Errorf("table name is empty")
	}
	parts := strings.Split(s, ".")
	switch len(parts) {
	case 1:
		return TableName{Schema: "public", Name: parts[0]}, nil
	case 2:
		if parts[0] == "" || parts[1] == "" {
			return TableName{}, fmt.Errorf("table name %q: want schema.table", s)
		}
		return TableName{Schema: parts[0], Name: parts[1]}, nil
	default:
		return TableName{}, fmt.Errorf("table name %q: want schema.table", s)
	}
}

func (t TableName) String() string { return t.Schema + "." + t.Name }

// Quoted returns the identifier quoted for SQL.
func (t TableName) Quoted() string { return QuoteIdent(t.Schema) + "." + QuoteIdent(t.Name) }

// QuoteIdent quotes a SQL identifier.
func QuoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// QuoteLiteral quotes a SQL string literal.
func QuoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }
