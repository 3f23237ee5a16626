package jssink

// ScanAck is scanAck, for the tests against a real server.
var ScanAck = scanAck

// BatchAtOnce makes every strict message to a batching stream open a
// batch, without per-message publishes in flight first.
func (s *Sink) BatchAtOnce() { s.enter = 0 }

// SendOpenUncommitted sends every open atomic batch's messages without
// the commit, as a relay that dies before it would have.
func (s *Sink) SendOpenUncommitted() error {
	for _, ln := range s.lanes.Load().list {
		ln.mu.Lock()
		var err error
		if b := ln.aopen; b != nil {
			err = ln.sendAtomic(b, false)
		}
		ln.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}
