// Package deploytest checks the deployment files at the repository root
// (docker-compose.yml, Dockerfile, deploy/) against the code and the
// Makefile. No container engine runs in the test environment, so the files
// are parsed and their settings checked: the PostgreSQL and NATS settings
// walbox's guarantees depend on, the start-up order, and that the image is
// built the way `make build` builds the binary.
package deploytest
