// Package outboxlibtest tests the outbox module (github.com/walbox/walbox/outbox)
// against a real PostgreSQL and, end to end, through the relay and JetStream.
// The tests live in walbox's root module, not in the outbox module, so that
// the module's dependency graph stays pgx, uuid and OpenTelemetry: the test
// servers and the relay they need would otherwise land in the go.sum of every
// service that imports outbox. The outbox module keeps its unit tests and
// examples, which need no server.
package outboxlibtest
