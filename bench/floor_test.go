package main

import (
	"bytes"
	"encoding/binary"
	"io"
	"strings"
	"testing"
	"time"
)

// pgoutput builds pgoutput (proto_version 1) messages as pg_recvlogical
// writes them: each followed by a newline.
type pgoutput struct{ bytes.Buffer }

func (p *pgoutput) end() { p.WriteByte('\n') }

func (p *pgoutput) u16(v int)   { p.Write(binary.BigEndian.AppendUint16(nil, uint16(v))) }
func (p *pgoutput) u32(v int)   { p.Write(binary.BigEndian.AppendUint32(nil, uint32(v))) }
func (p *pgoutput) u64(v int64) { p.Write(binary.BigEndian.AppendUint64(nil, uint64(v))) }
func (p *pgoutput) cstr(s string) {
	p.WriteString(s)
	p.WriteByte(0)
}

func (p *pgoutput) begin(commit time.Time) {
	p.WriteByte('B')
	p.u64(0x1000)
	p.u64(commit.Sub(pgEpoch).Microseconds())
	p.u32(42)
	p.end()
}

func (p *pgoutput) relation(cols ...string) {
	p.WriteByte('R')
	p.u32(16384)
	p.cstr("public")
	p.cstr("outbox_events")
	p.WriteByte('d')
	p.u16(len(cols))
	for _, c := range cols {
		p.WriteByte(0)
		p.cstr(c)
		p.u32(25)
		p.u32(0xffffffff)
	}
	p.end()
}

// insert writes an Insert whose columns are values (nil: NULL); values
// may hold newlines and zero bytes, as binary-looking text might.
func (p *pgoutput) insert(values ...*string) {
	p.WriteByte('I')
	p.u32(16384)
	p.WriteByte('N')
	p.u16(len(values))
	for _, v := range values {
		if v == nil {
			p.WriteByte('n')
			continue
		}
		p.WriteByte('t')
		p.u32(len(*v))
		p.WriteString(*v)
	}
	p.end()
}

func (p *pgoutput) commit(at time.Time) {
	p.WriteByte('C')
	p.WriteByte(0)
	p.u64(0x1000)
	p.u64(0x1100)
	p.u64(at.Sub(pgEpoch).Microseconds())
	p.end()
}

func ptr(s string) *string { return &s }

func TestFloorReaderParsesPgoutput(t *testing.T) {
	c1 := time.Date(2026, 12, 2, 16, 0, 0, 123456000, time.UTC)
	c2 := c1.Add(3 * time.Millisecond)
	ins1, ins2 := c1.Add(-time.Millisecond), c2.Add(-2*time.Millisecond)
	var p pgoutput
	p.relation("id", "topic", "payload", "processed")
	p.begin(c1)
	p.insert(ptr("1"), ptr("bench.floor.r1000\n\x00x"), ptr(payloadFor(1, 200, ins1.UnixNano())), nil)
	p.commit(c1)
	p.begin(c2)
	p.insert(ptr("2"), ptr("bench.floor.r1000"), ptr(payloadFor(2, 200, ins2.UnixNano())), ptr("f"))
	p.commit(c2)

	var f floorReader
	f.read(&p)
	if err := f.error(); err != nil {
		t.Fatalf("read: %v", err)
	}
	got := f.since(0)
	if len(got) != 2 || f.count.Load() != 2 {
		t.Fatalf("got %d samples (count %d), want 2", len(got), f.count.Load())
	}
	for i, want := range []struct{ commit, insert time.Time }{{c1, ins1}, {c2, ins2}} {
		if !got[i].commit.Equal(want.commit) || !got[i].insert.Equal(want.insert) {
			t.Errorf("sample %d: commit %v insert %v, want %v and %v", i, got[i].commit, got[i].insert, want.commit, want.insert)
		}
	}
}

func TestFloorReaderRefusesWhatItCannotParse(t *testing.T) {
	for name, stream := range map[string]string{
		"unknown message": "Zabc\n",
		"no newline":      "C" + strings.Repeat("\x00", 25) + "x",
		"truncated":       "B\x00\x00",
	} {
		var f floorReader
		f.read(io.NopCloser(strings.NewReader(stream)))
		if f.error() == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
