package jssink

// scanAck reads the pub ack JetStream sends for a stored message, in the
// shapes nats-server writes: {"stream":"S","seq":N} (from a template, with
// "domain" when the account has one) and {"stream":"S","seq":N,"duplicate":true}
// (encoding/json). ok is false for anything else (an error, a key it does
// not know, an escaped string, a number out of range): the caller then
// decodes data with encoding/json, so this only has to be right where it
// says ok. A reply is about 30 bytes and json.Unmarshal's reflection cost
// several times the rest of the reply's handling per message.
//
// stream is the stream name's bytes inside data.
func scanAck(data []byte) (stream []byte, seq uint64, dup, ok bool) {
	p := ackScanner{b: data}
	if !p.byte('{') {
		return nil, 0, false, false
	}
	var haveStream, haveSeq bool
	for first := true; ; first = false {
		if p.byte('}') {
			return stream, seq, dup, haveStream && haveSeq && p.end()
		}
		if !first && !p.byte(',') {
			return nil, 0, false, false
		}
		key, kok := p.str()
		if !kok || !p.byte(':') {
			return nil, 0, false, false
		}
		switch string(key) {
		case "stream":
			stream, ok = p.str()
			if !ok || haveStream || len(stream) == 0 {
				return nil, 0, false, false
			}
			haveStream = true
		case "domain":
			if _, ok = p.str(); !ok {
				return nil, 0, false, false
			}
		case "seq":
			seq, ok = p.uint()
			if !ok || haveSeq {
				return nil, 0, false, false
			}
			haveSeq = true
		case "duplicate":
			dup, ok = p.boolean()
			if !ok {
				return nil, 0, false, false
			}
		default:
			return nil, 0, false, false
		}
	}
}

// ackScanner walks a pub ack; every method skips the blanks before what it
// reads.
type ackScanner struct {
	b []byte
	i int
}

func (p *ackScanner) skip() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// byte consumes c if it comes next.
func (p *ackScanner) byte(c byte) bool {
	p.skip()
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// end reports whether only blanks are left.
func (p *ackScanner) end() bool {
	p.skip()
	return p.i == len(p.b)
}

// str reads a string of printable ASCII without escapes.
func (p *ackScanner) str() ([]byte, bool) {
	if !p.byte('"') {
		return nil, false
	}
	start := p.i
	for ; p.i < len(p.b); p.i++ {
		switch c := p.b[p.i]; {
		case c == '"':
			p.i++
			return p.b[start : p.i-1], true
		case c == '\\' || c < 0x20 || c >= 0x7f:
			return nil, false
		}
	}
	return nil, false
}

// uint reads an unsigned decimal without a sign, fraction or exponent that
// fits 64 bits.
func (p *ackScanner) uint() (uint64, bool) {
	p.skip()
	start := p.i
	var n uint64
	for ; p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9'; p.i++ {
		d := uint64(p.b[p.i] - '0')
		if n > (1<<64-1-d)/10 {
			return 0, false
		}
		n = n*10 + d
	}
	digits := p.i - start
	if digits == 0 || (digits > 1 && p.b[start] == '0') {
		return 0, false
	}
	if p.i < len(p.b) && (p.b[p.i] == '.' || p.b[p.i] == 'e' || p.b[p.i] == 'E') {
		return 0, false
	}
	return n, true
}

func (p *ackScanner) boolean() (bool, bool) {
	p.skip()
	rest := p.b[p.i:]
	switch {
	case len(rest) >= 4 && string(rest[:4]) == "true":
		p.i += 4
		return true, true
	case len(rest) >= 5 && string(rest[:5]) == "false":
		p.i += 5
		return false, true
	}
	return false, false
}
