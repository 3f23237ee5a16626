package cdc

import (
	"encoding/binary"
	"time"
)

// Encoders of the frames a walsender sends with pgoutput proto_version 1,
// written by hand from the protocol description ("Logical Streaming
// Replication Protocol" and "Streaming Replication Protocol" in the
// PostgreSQL documentation), the way pglogrepl's own message tests build
// their input: the decoder under test reads bytes, not pglogrepl structs.

// pgEpoch is PostgreSQL's timestamp epoch: timestamps on the wire are
// microseconds since 2000-01-01 UTC.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

func pgTime(t time.Time) uint64 { return uint64(t.Sub(pgEpoch).Microseconds()) }

// frame is a message under construction.
type frame []byte

func (f frame) u8(v byte) frame      { return append(f, v) }
func (f frame) u16(v uint16) frame   { return binary.BigEndian.AppendUint16(f, v) }
func (f frame) u32(v uint32) frame   { return binary.BigEndian.AppendUint32(f, v) }
func (f frame) u64(v uint64) frame   { return binary.BigEndian.AppendUint64(f, v) }
func (f frame) lsn(v LSN) frame      { return f.u64(uint64(v)) }
func (f frame) ts(t time.Time) frame { return f.u64(pgTime(t)) }
func (f frame) str(s string) frame   { return append(append(f, s...), 0) }

// beginMsg is 'B': final LSN of the transaction, commit time, xid.
func beginMsg(finalLSN LSN, commitTime time.Time, xid uint32) []byte {
	return frame{'B'}.lsn(finalLSN).ts(commitTime).u32(xid)
}

// commitMsg is 'C': flags (0), commit LSN, end LSN, commit time.
func commitMsg(commitLSN, endLSN LSN, commitTime time.Time) []byte {
	return frame{'C'}.u8(0).lsn(commitLSN).lsn(endLSN).ts(commitTime)
}

// relCol is one column of a Relation message.
type relCol struct {
	name string
	oid  uint32
	key  bool
}

// Type OIDs as pg_type has them.
const (
	oidBytea       = 17
	oidInt8        = 20
	oidText        = 25
	oidVarchar     = 1043
	oidTimestamptz = 1184
	oidUUID        = 2950
)

// relationMsg is 'R': relation id, namespace, name, replica identity, then
// per column: flags (1 = part of the key), name, type OID, type modifier.
func relationMsg(relID uint32, schema, name string, cols ...relCol) []byte {
	f := frame{'R'}.u32(relID).str(schema).str(name).u8('d').u16(uint16(len(cols)))
	for _, c := range cols {
		var flags byte
		if c.key {
			flags = 1
		}
		f = f.u8(flags).str(c.name).u32(c.oid).u32(0xffffffff) // atttypmod -1
	}
	return f
}

// tupleCol is one column of a TupleData: kind 't' (text), 'b' (binary),
// 'n' (NULL) or 'u' (unchanged TOAST value, not sent).
type tupleCol struct {
	kind byte
	val  string
}

func txt(s string) tupleCol { return tupleCol{kind: 't', val: s} }

var (
	null      = tupleCol{kind: 'n'}
	unchanged = tupleCol{kind: 'u'}
)

// insertMsg is 'I': relation id, 'N' (new tuple), column count, columns.
func insertMsg(relID uint32, cols ...tupleCol) []byte {
	f := frame{'I'}.u32(relID).u8('N').u16(uint16(len(cols)))
	for _, c := range cols {
		f = f.u8(c.kind)
		if c.kind == 't' || c.kind == 'b' {
			f = append(f.u32(uint32(len(c.val))), c.val...)
		}
	}
	return f
}

// logicalMsg is 'M': flags (1 = transactional), LSN, prefix, content.
func logicalMsg(transactional bool, lsn LSN, prefix string, content string) []byte {
	var flags byte
	if transactional {
		flags = 1
	}
	return append(frame{'M'}.u8(flags).lsn(lsn).str(prefix).u32(uint32(len(content))), content...)
}

// originMsg is 'O': the commit LSN on the origin server and its name.
func originMsg(lsn LSN, name string) []byte { return frame{'O'}.lsn(lsn).str(name) }

// typeMsg is 'Y': type OID, namespace, name.
func typeMsg(oid uint32, schema, name string) []byte {
	return frame{'Y'}.u32(oid).str(schema).str(name)
}

// truncateMsg is 'T': relation count, options, relation ids.
func truncateMsg(relIDs ...uint32) []byte {
	f := frame{'T'}.u32(uint32(len(relIDs))).u8(0)
	for _, id := range relIDs {
		f = f.u32(id)
	}
	return f
}

// xlogData wraps a pgoutput message in a CopyData 'w' frame: WAL start,
// the server's WAL end, its clock.
func xlogData(walStart, walEnd LSN, at time.Time, msg []byte) []byte {
	return append(frame{'w'}.lsn(walStart).lsn(walEnd).ts(at), msg...)
}

// keepaliveMsg is a CopyData 'k' frame: the server's WAL end, its clock,
// and whether it wants a status update at once.
func keepaliveMsg(walEnd LSN, at time.Time, reply bool) []byte {
	var r byte
	if reply {
		r = 1
	}
	return frame{'k'}.lsn(walEnd).ts(at).u8(r)
}

// statusUpdate is a decoded standby status update ('r') a client sent.
type statusUpdate struct {
	write, flush, apply LSN
	clientTime          time.Time
	reply               bool
}

// parseStatusUpdate reads an 'r' frame: three positions, the client's clock,
// reply-requested. ok is false for anything else.
func parseStatusUpdate(b []byte) (statusUpdate, bool) {
	if len(b) != 34 || b[0] != 'r' {
		return statusUpdate{}, false
	}
	be := binary.BigEndian
	return statusUpdate{
		write:      LSN(be.Uint64(b[1:])),
		flush:      LSN(be.Uint64(b[9:])),
		apply:      LSN(be.Uint64(b[17:])),
		clientTime: pgEpoch.Add(time.Duration(int64(be.Uint64(b[25:]))) * time.Microsecond),
		reply:      b[33] != 0,
	}, true
}
