#!/usr/bin/env bash
# The root module's tests, as make test runs them, under the race detector.
#
# The end-to-end package (internal/e2e) holds most of the suite's time
# (about 1,000 s of tests run one after another with the rest of the suite
# beside it, each waiting on real PostgreSQL, NATS and Kafka), so one
# `go test ./...` would wait for it long after every other package is done.
# It runs as three processes instead, each with its own PostgreSQL cluster
# (the shards below). The shards and the other packages run side by side;
# on 2 CPUs the machine is then busy throughout.
#
# Each step's output is printed whole when it ends; the script fails when any
# step failed, after all of them ran.
set -uo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
TIMEOUT=${TIMEOUT:-20m}

# internal/e2e runs as three processes, shards of about a third of its
# time each (seconds under -race with the whole suite running, as measured
# when the shards were drawn): A the chaos runs, the large transaction,
# the standby promotions and two relay kills; B the restarts, the
# process-level NATS clusters and the Kafka broker faults; C every other
# test (a new test lands in C).
E2E_SHARD_A='^(TestChaos|TestChaosKafka|TestLargeTransactionStreamsWithBoundedHeap|TestPromotedSyncStandbyLosesNothing|TestPromotedAsyncStandby|TestRelayKilledMidStreamLosesNothing|TestKafkaRelayKilledMidStreamLosesNothing|TestPgHBAForLogicalReplicationIsTheDatabaseLine)$'
E2E_SHARD_B='^(TestR3NATSProcessesLeaderKillAndRollingRestart|TestR3NATSProcessesAtomicTransactionsThroughLeaderKillAndRollingRestart|TestKafkaBrokerConnectionLossAndRefusedProducesLoseNothing|TestTablesSharingIDs|TestIdleOutboxRetainsNoWALWhileAnotherDatabaseWrites|TestBackfillInterruptedByCrashIsRedone|TestProbesFollowReplicationAndLivenessOnlyAWedge|TestNATSOutageLongerThanBackoffCeilingLosesNothing|TestSlotRecreatedOnAnotherClusterRedoesACutBackfill|TestCrashConsistentRestore|TestPostgresRestartMidLoadLosesNothing)$'

# The other packages run two at a time (three made every step slower: the
# CPUs are busy throughout), the slowest first (so that none of them starts
# last and runs alone): in this order, then go list's.
SLOW_FIRST='internal/claimtest cmd/walbox internal/ops relay/sweep relay/jssink internal/console internal/consumerlibtest relay/kafkasink internal/devenv cdc'

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
failed=()

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

# Build every package's test binary once, under the race detector, and run
# the binaries themselves: go test links a test binary each time it runs one
# (links are not cached), and under -race the links of this module's test
# binaries cost about 75 s of CPU a round, the largest single item of the
# suite after the tests themselves. So each binary is linked once, e2e's
# serving its three shards.
bins="$logs/bin"
# -w: no DWARF (stack traces and race reports come from the binary's own
# tables), a third less link time.
quiet compile "$GO" test -race -c -ldflags=-w -o "$bins/" ./... || { show compile; exit 1; }

# runpkg IMPORTPATH DIR [FLAGS...]: runs the package's test binary in its
# directory, as go test does, and prints go test's summary line.
runpkg() {
  local pkg=$1 dir=$2
  shift 2
  local bin="$bins/${pkg##*/}.test"
  if [ ! -x "$bin" ]; then
    echo "?   	$pkg	[no test files]"
    return 0
  fi
  local start=$SECONDS out rc
  out=$(cd "$dir" && "$bin" -test.paniconexit0 -test.timeout="$TIMEOUT" ${TESTFLAGS:-} "$@" 2>&1)
  rc=$?
  if [ $rc -eq 0 ]; then
    [ -n "${TESTFLAGS:-}" ] && printf '%s\n' "$out"
    echo "ok  	$pkg	$((SECONDS - start))s"
  else
    printf '%s\n' "$out"
    echo "FAIL	$pkg	$((SECONDS - start))s"
  fi
  return $rc
}

# packages: every package but internal/e2e, two at a time, each one's
# output printed whole when it ends.
packages() {
  local rc=0 pkg dir
  local -a names=()
  local list
  list=$("$GO" list -f '{{.ImportPath}} {{.Dir}}' ./...)
  while read -r pkg dir; do
    [ "$pkg" = github.com/walbox/walbox/internal/e2e ] && continue
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
    local name=${pkg//\//_}
    { runpkg "$pkg" "$dir"; echo $? >"$logs/rc.$name"; } >"$logs/pkg.$name" 2>&1 &
    names+=("$name")
  done < <(
    for s in $SLOW_FIRST; do grep "^github.com/walbox/walbox/$s " <<<"$list"; done
    grep -v -f <(for s in $SLOW_FIRST; do echo "^github.com/walbox/walbox/$s "; done) <<<"$list"
  )
  wait
  for name in "${names[@]}"; do
    cat "$logs/pkg.$name"
    [ "$(cat "$logs/rc.$name" 2>/dev/null)" = 0 ] || rc=1
  done
  [ $rc -eq 0 ] && echo PASS || echo FAIL
  return $rc
}

e2edir=$("$GO" list -f '{{.Dir}}' ./internal/e2e)
quiet packages packages &
pids=($!)
quiet e2e-a runpkg github.com/walbox/walbox/internal/e2e "$e2edir" -test.run "$E2E_SHARD_A" &
pids+=($!)
quiet e2e-b runpkg github.com/walbox/walbox/internal/e2e "$e2edir" -test.run "$E2E_SHARD_B" &
pids+=($!)
quiet e2e-c runpkg github.com/walbox/walbox/internal/e2e "$e2edir" -test.skip "$E2E_SHARD_A|$E2E_SHARD_B" &
pids+=($!)
steps=(packages e2e-a e2e-b e2e-c)
for i in "${!steps[@]}"; do
  wait "${pids[$i]}" || failed+=("${steps[$i]}")
  show "${steps[$i]}"
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
