# walbox: build the relay with the Makefile's build command, run it on a slim
# Debian (a shell, so compose can run `walbox migrate` before `walbox run`).
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
# The producer and consumer libraries are modules of their own that go.mod
# replaces with these directories.
COPY outbox/go.mod outbox/go.sum ./outbox/
COPY consumer/go.mod consumer/go.sum ./consumer/
RUN go mod download
COPY . .
# Keep in step with the Makefile's build target (internal/deploytest checks).
# CGO off: a static binary that does not care about the runtime's libc.
RUN CGO_ENABLED=0 go build -ldflags=-X=runtime.godebugDefault=schedtrace=2147483647 -o /out/walbox ./cmd/walbox

FROM debian:trixie-slim
COPY --from=build /out/walbox /usr/local/bin/walbox
# Not root: the relay needs no privileges.
USER 65532:65532
EXPOSE 9187
ENTRYPOINT ["/usr/local/bin/walbox"]
CMD ["run"]
