package jssink

// ScanAck is scanAck, for the tests against a real server.
var ScanAck = scanAck
