// Package claimtest checks the claim check end to end (issue 39): a real
// PostgreSQL, the real embedded nats-server, the relay started as `walbox
// run` starts it, and the consumer library reading the events back. It is a
// package of its own so that it runs beside internal/e2e.
package claimtest
