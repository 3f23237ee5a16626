package cdc

import (
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
)

// Type OIDs of the column types walbox treats specially.
const (
	oidJSON  = 114
	oidJSONB = 3802
	oidBool  = 16
)

// relation is what the decoder keeps of a pgoutput Relation message: where
// each role's column sits in the tuple. pgoutput sends Relation before the
// first row of a table in every session and again after its schema changes.
type relation struct {
	name          TableName
	outbox        bool
	table         int           // index of the outbox table in Config.Tables
	roleIdx       [numRoles]int // -1 when the role is unmapped or absent
	payloadIsJSON bool
	// unmappable: this definition of the outbox table lacks a column of a
	// required role (renamed or dropped). Rows decoded with it are
	// dead-lettered with this reason; the relay goes on.
	unmappable string
	// msg is kept for a relation that is not a configured outbox table:
	// its first row asks the unknown hook about it (a Relation alone may
	// be a partition's, which pgoutput sends beside its root's).
	msg *pglogrepl.RelationMessage
}

// decoder turns pgoutput frames into Changes. It is owned by the goroutine
// that owns the replication connection.
type decoder struct {
	tables    []Table
	byName    map[TableName]int
	relations map[uint32]*relation
	// unknown, if set, is asked about a published table that is not in
	// tables (see Config.OnUnknownTable).
	unknown func(TableName) (int, Columns, bool)
	// defaultTable is the table of logical messages that name none.
	defaultTable int

	inTxn      bool
	commitLSN  LSN
	commitTime time.Time
	index      uint32
}

func newDecoder(table TableName, columns Columns) *decoder {
	return newTablesDecoder([]Table{{Name: table, Columns: columns}})
}

func newTablesDecoder(tables []Table) *decoder {
	d := &decoder{tables: slices.Clone(tables), byName: make(map[TableName]int, len(tables)), relations: make(map[uint32]*relation)}
	for i, t := range tables {
		d.byName[t.Name] = i
	}
	return d
}

// tableIndex finds an outbox table by name: a configured one, or one the
// unknown hook adds (a table configured while walbox runs).
func (d *decoder) tableIndex(name TableName) (int, bool) {
	if i, ok := d.byName[name]; ok {
		return i, true
	}
	if d.unknown == nil {
		return -1, false
	}
	i, cols, ok := d.unknown(name)
	if !ok {
		return -1, false
	}
	for len(d.tables) <= i {
		d.tables = append(d.tables, Table{})
	}
	d.tables[i] = Table{Name: name, Columns: cols}
	d.byName[name] = i
	return i, true
}

// relation records a Relation message: column roles follow each one, since
// rows from before a DDL arrive with the old definition and rows after it
// with the new one. A definition that lacks the column of a required role
// (id, topic, payload) cannot map its rows: they are dead-lettered with the
// reason, naming the role, the column and the table.
func (d *decoder) relation(m *pglogrepl.RelationMessage) error {
	r := &relation{name: TableName{Schema: m.Namespace, Name: m.RelationName}}
	for i := range r.roleIdx {
		r.roleIdx[i] = -1
	}
	r.table, r.outbox = d.byName[r.name]
	if !r.outbox {
		r.msg = m
	}
	d.mapRoles(r, m)
	d.relations[m.RelationID] = r
	return nil
}

// mapRoles finds the column of each role of r's outbox table in m.
func (d *decoder) mapRoles(r *relation, m *pglogrepl.RelationMessage) {
	if r.outbox {
		for role, col := range d.tables[r.table].Columns {
			if col == "" {
				continue
			}
			found := false
			for i, c := range m.Columns {
				if c.Name == col {
					r.roleIdx[role] = i
					found = true
					if Role(role) == RolePayload {
						r.payloadIsJSON = c.DataType == oidJSON || c.DataType == oidJSONB
					}
					break
				}
			}
			if !found && (Role(role) == RoleID || Role(role) == RoleTopic || Role(role) == RolePayload) && r.unmappable == "" {
				r.unmappable = fmt.Sprintf("row of table %s written when it had no column %q (renamed or dropped?): outbox.columns.%s maps the %s role to it",
					r.name, col, Role(role), Role(role))
			}
		}
	}
}

// textRoles are the columns an Event holds as strings.
var textRoles = [...]Role{RoleID, RoleTopic, RoleStream, RoleEventType, RoleAggregateType, RoleAggregateID, RolePartitionKey, RoleCreatedAt}

// textColumns copies the text columns of a row into strings that share one
// allocation: they live as long as the event does (the id and created_at a
// little longer, in the sweeper's queue), so one allocation serves them
// instead of one per column.
func textColumns(vals *[numRoles][]byte) (text [numRoles]string) {
	n := 0
	for _, role := range textRoles {
		n += len(vals[role])
	}
	if n == 0 {
		return text
	}
	var b strings.Builder
	b.Grow(n)
	for _, role := range textRoles {
		b.Write(vals[role])
	}
	all := b.String()
	for _, role := range textRoles {
		text[role], all = all[:len(vals[role])], all[len(vals[role]):]
	}
	return text
}

// insert decodes an Insert frame ('I', relid, 'N', tuple) straight from the
// wire bytes, copying only the mapped columns. pglogrepl's generic decoder
// allocates every column; this is the hot path of catch-up.
func (d *decoder) insert(data []byte, ev *Event) (bool, error) {
	if len(data) < 8 {
		return false, fmt.Errorf("decode insert: short message (%d bytes)", len(data))
	}
	relID := binary.BigEndian.Uint32(data[1:5])
	r, ok := d.relations[relID]
	if !ok {
		return false, fmt.Errorf("decode insert: relation %d arrived before its Relation message", relID)
	}
	if !r.outbox && r.msg != nil {
		// The first row of a table that is not configured: it may have
		// been added to the configuration while walbox runs.
		m := r.msg
		r.msg = nil
		if r.table, r.outbox = d.tableIndex(r.name); r.outbox {
			d.mapRoles(r, m)
		}
	}
	if !r.outbox {
		return false, nil
	}
	if data[5] != 'N' {
		return false, fmt.Errorf("decode insert: unexpected tuple type %q", data[5])
	}
	ncols := int(binary.BigEndian.Uint16(data[6:8]))
	var vals [numRoles][]byte
	var nulls [numRoles]bool
	p := 8
	for i := 0; i < ncols; i++ {
		if p >= len(data) {
			return false, fmt.Errorf("decode insert: tuple truncated at column %d", i)
		}
		kind := data[p]
		p++
		var val []byte
		isNull := false
		switch kind {
		case 't', 'b':
			if p+4 > len(data) {
				return false, fmt.Errorf("decode insert: tuple truncated at column %d", i)
			}
			n := int(binary.BigEndian.Uint32(data[p : p+4]))
			p += 4
			if p+n > len(data) {
				return false, fmt.Errorf("decode insert: tuple truncated at column %d", i)
			}
			val = data[p : p+n]
			p += n
		case 'n', 'u':
			isNull = true
		default:
			return false, fmt.Errorf("decode insert: unknown tuple data kind %q", kind)
		}
		for role, idx := range r.roleIdx {
			if idx == i {
				vals[role] = val
				nulls[role] = isNull
			}
		}
	}
	text := textColumns(&vals)
	*ev = Event{
		Poison:        r.unmappable,
		Table:         r.table,
		Pos:           Position{CommitLSN: d.commitLSN, Index: d.index},
		CommitTime:    d.commitTime,
		ID:            text[RoleID],
		Topic:         text[RoleTopic],
		TopicNull:     nulls[RoleTopic] || r.roleIdx[RoleTopic] < 0,
		Stream:        text[RoleStream],
		EventType:     text[RoleEventType],
		AggregateType: text[RoleAggregateType],
		AggregateID:   text[RoleAggregateID],
		PartitionKey:  text[RolePartitionKey],
		CreatedAt:     text[RoleCreatedAt],
		PayloadNull:   nulls[RolePayload],
		PayloadIsJSON: r.payloadIsJSON,
	}
	if vals[RolePayload] != nil {
		ev.Payload = append([]byte(nil), vals[RolePayload]...)
	}
	if vals[RoleHeaders] != nil {
		ev.Headers = append([]byte(nil), vals[RoleHeaders]...)
	}
	d.index++
	return true, nil
}
