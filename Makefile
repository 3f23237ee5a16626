# walbox: `make demo` for a first look, `make test` for the whole suite.
GO      ?= go
BIN     := bin/walbox
PKGS    := ./...
# The producer and consumer libraries are modules of their own (see go.mod's
# replace): ./... of the root module does not reach them.
LIBS    := outbox consumer

.PHONY: build test test-matrix test-short lint lint-helm bench bench-quick bench-maintenance demo chaos clean

# The binary's default GODEBUG keeps the Go runtime's sysmon thread from
# deep sleep: otherwise every wake-up of the idle relay wakes it, and it polls
# every 20 us until the relay is idle again, which cost 40 % of the relay's
# CPU in live mode (README, Performance). A GODEBUG environment variable wins.
build:
	$(GO) build -ldflags=-X=runtime.godebugDefault=schedtrace=2147483647 -o $(BIN) ./cmd/walbox

# The whole suite, race detector on, against real PostgreSQL and NATS. The
# Helm chart's tests (deploy/helmtest, a module of its own so that Helm's SDK
# stays out of walbox's go.mod) need no cluster.
test:
	bash scripts/ensure-kcat.sh
	bash scripts/ensure-chromium.sh
	$(GO) vet $(PKGS)
	for m in $(LIBS); do (cd $$m && $(GO) vet ./...) || exit 1; done
	cd bench && $(GO) vet ./...
	cd bench/watermill && $(GO) vet ./...
	cd deploy/helmtest && $(GO) vet ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))" || (echo "gofmt needed:"; gofmt -l .; exit 1)
	for m in $(LIBS); do (cd $$m && $(GO) test -race -count=1 ./...) || exit 1; done
	cd bench && $(GO) test -race -count=1 -ldflags=-w .
	cd deploy/helmtest && $(GO) test -race -count=1 -ldflags=-w ./...
	GO=$(GO) bash scripts/test-go.sh

# A few minutes: the unit tests (no servers) and one end-to-end smoke test
# (exactly-once in commit order under concurrent producers).
test-short:
	$(GO) vet $(PKGS)
	for m in $(LIBS); do (cd $$m && $(GO) vet ./... && $(GO) test -race -count=1 ./...) || exit 1; done
	$(GO) test -race -count=1 ./relay ./cdc ./internal/config ./internal/deploytest
	$(GO) test -race -count=1 -run 'TestConcurrentProducersArriveExactlyOnceInCommitOrder' ./internal/e2e

# The end-to-end core against every other supported PostgreSQL major (make
# test covers the local one, 15 on Debian): exactly-once under load, kill -9,
# slot dropped and invalidated, first-start backfill, idle WAL, heartbeat,
# table-less events, wrong wal_level and privileges, an asynchronous standby
# promoted after it fell behind (17), doctor, the grants
# recipe, slot commands. Each major's server binaries come from
# scripts/ensure-postgres.sh MAJOR (npm, cached outside the work tree).
MATRIX_MAJORS ?= 14 16 17 18
MATRIX_E2E := TestConcurrentProducersArriveExactlyOnceInCommitOrder|TestRelayKilledMidStreamLosesNothing|TestSlotDroppedMidStreamIsRecreatedAndNothingIsLost|TestInvalidatedSlotIsRecreatedAndUnprocessedRowsRepublished|TestFirstStartPublishesRowsAlreadyWaiting|TestBackfillKeepsInsertionOrderInsideTransactions|TestIdleOutboxRetainsNoWALWhileAnotherDatabaseWrites|TestIdleOutboxInBusyDatabaseDoesNotHoldWAL|TestTableLessEventsFromEmitMessage|TestWrongWALLevelNamesTheFix|TestMissingReplicationPrivilegeNamesTheFix|TestPromotedSyncStandbyLosesNothing|TestMovedClusterEventsAreNotSkipped|TestIdleSlotTimeoutInvalidationIsRecovered|TestFailoverSlotFollowsPromotion|TestOriginNoneSkipsRowsASubscriptionApplied|TestRunFailsFastOnPermanentConnectionErrors
# On 17 only (the first major with failover slots, beside the local 15): an
# asynchronous standby promoted without a failover slot.
MATRIX_E2E_17 := TestPromotedAsyncStandby
MATRIX_OPS := TestDoctorGoodSetup|TestDoctorBadRoleStreamsAndNATS|TestGrantsRecipeRunsTheRelay|TestSlotCreateStatusDrop|TestSlotCreateFailoverNeedsPG17|TestSlotDropRefusesActiveSlotUnlessForce
test-matrix:
	@set -e; for v in $(MATRIX_MAJORS); do \
	  bin=$$(bash scripts/ensure-postgres.sh $$v); \
	  echo "== PostgreSQL $$v"; \
	  run='$(MATRIX_E2E)'; if [ $$v = 17 ]; then run="$$run|$(MATRIX_E2E_17)"; fi; \
	  WALBOX_PG_BINDIR=$$bin $(GO) test -race -count=1 -timeout 20m -run "$$run" ./internal/e2e; \
	  WALBOX_PG_BINDIR=$$bin $(GO) test -race -count=1 -timeout 10m -run '$(MATRIX_OPS)' ./internal/ops; \
	done

lint:
	$(GO) vet $(PKGS)
	for m in $(LIBS); do (cd $$m && $(GO) vet ./...) || exit 1; done
	cd bench && $(GO) vet ./...
	cd bench/watermill && $(GO) vet ./...
	cd deploy/helmtest && $(GO) vet ./...
	@out=$$(gofmt -l .); test -z "$$out" || (echo "gofmt needed: $$out"; exit 1)

# The helm binary's own lint of the chart (make test runs Helm's lint code
# through deploy/helmtest already): built from the Go module proxy, about
# 2 minutes the first time. CI runs it.
HELM_VERSION ?= v4.3.2
lint-helm:
	cd deploy/helmtest && $(GO) run helm.sh/helm/v4/cmd/helm@$(HELM_VERSION) lint --strict ../helm/walbox
	cd deploy/helmtest && for v in ../helm/walbox/ci/*-values.yaml; do $(GO) run helm.sh/helm/v4/cmd/helm@$(HELM_VERSION) lint --strict ../helm/walbox -f $$v || exit 1; done

# The benchmark is its own module (bench/go.mod): its peers and chart library
# stay out of walbox's go.mod. BENCH_ARGS for more flags (see bench/README.md).
BENCH_ARGS ?=
bench:
	cd bench && $(GO) run . $(BENCH_ARGS)

bench-quick:
	cd bench && $(GO) run . -quick $(BENCH_ARGS)

# The sweeper's maintenance on a 5,000,000-row outbox under 4 producers and a
# 30 s reader, beside the same load without it (bench/README.md; ~6 min).
bench-maintenance:
	cd bench && $(GO) run . maintenance $(BENCH_ARGS)

# A throwaway PostgreSQL, an embedded JetStream, the relay and a sample producer.
# Flags for walbox dev go in DEMO_ARGS, e.g. make demo DEMO_ARGS="--rate 50 --duration 30s".
DEMO_ARGS ?=
demo: build
	@bash scripts/ensure-postgres.sh
	./$(BIN) dev $(DEMO_ARGS)

# Random faults (relay kill -9, NATS and PostgreSQL restarts, slot drops) under
# load, judged by the one checker. CHAOS_DURATION=10m for longer (30 s of it
# runs in `make test`).
CHAOS_DURATION ?= 3m
chaos:
	bash scripts/ensure-kcat.sh
	WALBOX_CHAOS_DURATION=$(CHAOS_DURATION) $(GO) test -race -count=1 -v -run 'TestChaos$$|TestChaosKafka$$' -timeout 60m ./internal/e2e

clean:
	rm -rf bin .walbox-dev
