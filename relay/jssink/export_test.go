package jssink

// ScanAck is scanAck, for the tests against a real server.
var ScanAck = scanAck

// BatchAtOnce makes every strict message to a batching stream open a
// batch, without per-message publishes in flight first.
func (s *Sink) BatchAtOnce() { s.enter = 0 }
