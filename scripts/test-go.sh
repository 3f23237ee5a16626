#!/usr/bin/env bash
# The root module's tests, as make test runs them, under the race detector.
#
# The end-to-end package (internal/e2e) holds most of the suite's time
# (about 510 s of tests run one after another, each waiting on real
# PostgreSQL, NATS and Kafka), so one `go test ./...` would wait for it long
# after every other package is done. It runs as two processes instead, each
# with its own PostgreSQL cluster: shard A is the tests named in E2E_SHARD_A
# below, shard B every other test (a new test lands in B). The shards and
# the other packages run side by side: the suite mostly waits (on timeouts,
# restarts and the servers), and used about 0.6 of a core on average when
# the shards ran after the other packages.
#
# Each step's output is printed whole when it ends; the script fails when any
# step failed, after all of them ran.
set -uo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
TIMEOUT=${TIMEOUT:-20m}

# About half of internal/e2e's time (seconds under -race on 2 cores, as
# measured when the shards were drawn): the chaos runs, the large
# transaction, the standby promotions and the restarts.
E2E_SHARD_A='^(TestChaos|TestChaosKafka|TestLargeTransactionStreamsWithBoundedHeap|TestIdleOutboxRetainsNoWALWhileAnotherDatabaseWrites|TestProbesFollowReplicationAndLivenessOnlyAWedge|TestPromotedSyncStandbyLosesNothing|TestPromotedAsyncStandby|TestNATSOutageLongerThanBackoffCeilingLosesNothing|TestSlotRecreatedOnAnotherClusterRedoesACutBackfill|TestCrashConsistentRestore|TestBackfillInterruptedByCrashIsRedone|TestPostgresRestartMidLoadLosesNothing)$'

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
failed=()

# step NAME CMD...: runs CMD into its own log, then prints the log.
step() {
  local name=$1
  shift
  quiet "$name" "$@"
  local rc=$?
  show "$name"
  return $rc
}

# quiet NAME CMD...: runs CMD into its own log; show NAME prints it.
quiet() {
  local name=$1
  shift
  local start=$SECONDS
  "$@" >"$logs/$name" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s" >>"$logs/$name"
  return $rc
}
show() { cat "$logs/$1"; }

# Compile every test binary once, without running it, so that the steps
# below do not compile the same packages side by side.
quiet compile "$GO" test -race -count=1 -exec /bin/true ./... || { show compile; exit 1; }

others=$("$GO" list ./... | grep -v '/internal/e2e$')
# shellcheck disable=SC2086 # one argument per package
quiet packages "$GO" test -race -count=1 -timeout "$TIMEOUT" $others &
p=$!
quiet e2e-a "$GO" test -race -count=1 -timeout "$TIMEOUT" -run "$E2E_SHARD_A" ./internal/e2e &
a=$!
quiet e2e-b "$GO" test -race -count=1 -timeout "$TIMEOUT" -skip "$E2E_SHARD_A" ./internal/e2e &
b=$!
wait $p || failed+=(packages)
show packages
wait $a || failed+=(e2e-a)
show e2e-a
wait $b || failed+=(e2e-b)
show e2e-b

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
