// Package consumerlibtest tests the consumer module
// (github.com/walbox/walbox/consumer) against a real PostgreSQL and an
// embedded JetStream. The tests live in walbox's root module, not in the
// consumer module, so that the module's dependency graph stays pgx, nats.go
// and OpenTelemetry: the test servers would otherwise land in the go.sum of
// every service that imports consumer. The consumer module keeps its
// examples, which need no server.
package consumerlibtest
