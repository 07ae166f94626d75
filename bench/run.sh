#!/usr/bin/env bash
# floodgate's benchmark tool: builds what it needs, then runs the measurements and prints tables
# (markdown) on stdout, progress on stderr. See docs/benchmarks.md.
#
#   bench/run.sh [--quick] [--diagnose] [cpu|keys|latency|instructions|memory|accuracy|flood|contention|idle|global|peers|fleet|all] [options]
#
# On a 2-core VM (2026-11-25) --quick took about 10 min, and 14 more for `global`; the full run
# about 25 min before `global` (its parts timed one by one); --diagnose adds the
# where-the-time-goes variants. valgrind is needed for `instructions` (skipped with a message
# without it). `global` (part of `all`) also needs Redis, which scripts/redis.sh installs when
# missing (apt-get), and builds floodgate-sync.
# `peers` (not part of `all`) sets floodgate's global scope beside Kuadrant's wasm-shim in front
# of Limitador, in one run; it needs WASM_SHIM_WASM (the module) and LIMITADOR_BIN
# (limitador-server), which bench/peers/build.sh builds from their sources, and is skipped with a
# message without them (floodgate's configurations alone, e.g. --variants batched,leased, need
# neither). Like `global`, it needs Redis and floodgate-sync.
# `fleet` (not part of `all`) runs no Envoy: simulated proxies (the module's code, natively) call
# two floodgate-sync replicas in front of a local Redis Cluster (3 masters, 3 replicas); options
# --proxies N,N --workers N --mix hot,users,zipf --consistency batched,leased --seconds S
# --rate R --events restart,failover,sync-restart,steady --on-store-failure last_state|refuse
# --replica-acks N (floodgate-sync's). Each run is bounded (--seconds, default 20).
# `fleet --envoys` builds the module and gets Envoy too: each configuration runs through real
# Envoys of one worker and through as many simulated proxies of one worker, the same schedule,
# side by side (the cross-check of the simulation; --rate defaults to 400 there). ENVOY_BIN=path
# uses that Envoy instead of scripts/envoy.sh's.
# Other options go to the tool (bench/run.sh --help lists them). FLOODGATE_WASM=path measures a
# module built elsewhere instead of building this tree's. FLOODGATE_BENCH_DUMPS=dir keeps the
# callgrind dump of each `instructions` variant there (read it with callgrind_annotate).
# The LLM variants of `instructions` (not in its default set; named with --variants) load
# floodgate-llm.wasm (FLOODGATE_LLM_WASM=path, else the one beside the floodgate module) in front
# of an OpenAI-like upstream: `llm-plain` (fg-rl's rule, fg-rl's traffic), and for each answer
# `json-1k`, `json-1m` (a JSON body with its usage at the end, ~1 KiB or ~1 MiB) and `sse-1k`,
# `sse-1m` (an event stream, one frame per event, the usage in the last): `none-<answer>`,
# `fg-rl-<answer>` (floodgate.wasm), `llm-plain-<answer>`, `llm-<answer>` (the token rule), e.g.
#   bench/run.sh instructions --variants fg-rl,llm-plain,fg-rl-sse-1k,llm-plain-sse-1k,llm-sse-1k,fg-rl-sse-1m,llm-plain-sse-1m,llm-sse-1m
# (each Envoy takes over a minute of CPU time to start under valgrind; all 20 variants of
# docs/llm.md took 25 min on a loaded 2-core VM).
# Loopback only; every server it starts listens on 127.0.0.1 on a port picked at run time, and
# everything stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '==> %s\n' "$*" >&2; }

for tool in taskset cargo rustup python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "bench/run.sh: \`$tool\` is needed (taskset: Debian/Ubuntu package util-linux)" >&2
    exit 1
  fi
done
if [[ "$(nproc)" -lt 2 ]]; then
  echo "bench/run.sh: warning: one CPU only; Envoy and the load generator will share it" >&2
fi

# `fleet` alone needs no module and no Envoy; `fleet --envoys` needs both, not the contrast modules.
fleet_only=
fleet_envoys=
for a in "$@"; do
  case "$a" in
    fleet) fleet_only=1 ;;
    --envoys) fleet_envoys=1 ;;
  esac
done
for a in "$@"; do
  case "$a" in
    cpu|keys|latency|instructions|memory|accuracy|flood|contention|idle|global|peers|all) fleet_only= ;;
  esac
done

if [[ -n "$fleet_only" && -z "$fleet_envoys" ]]; then
  wasm=; rev="built from $(git rev-parse --short HEAD 2>/dev/null || echo '?') (native)"; filters=; envoy=
elif [[ -n "${FLOODGATE_WASM:-}" ]]; then
  wasm=$FLOODGATE_WASM
  rev="$wasm (FLOODGATE_WASM)"
  step "floodgate module: $rev"
else
  step "build the floodgate module (./wasm-build.sh)"
  wasm=$(./wasm-build.sh | tail -n1)
  rev="built from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  if ! git diff --quiet HEAD -- filter 2>/dev/null; then rev="$rev + uncommitted changes in filter/"; fi
fi

if [[ -n "$fleet_only" && -n "$fleet_envoys" ]]; then
  rev="$rev; the simulated proxies: the native build of the same tree"
  filters=
  if [[ -n "${ENVOY_BIN:-}" ]]; then
    envoy=$ENVOY_BIN
    step "Envoy: $envoy (ENVOY_BIN)"
  else
    step "get Envoy (scripts/envoy.sh)"
    envoy=$(scripts/envoy.sh | tail -n1)
  fi
elif [[ -z "$fleet_only" ]]; then
  step "build the contrast modules (bench/filters: no-op, naive per-key limiter)"
  if ! rustup target list --installed | grep -qx wasm32-wasip1; then
    rustup target add wasm32-wasip1 >&2
  fi
  (cd bench/filters && cargo build --release --target wasm32-wasip1 >&2)
  filters=bench/filters/target/wasm32-wasip1/release

  step "get Envoy (scripts/envoy.sh)"
  envoy=$(scripts/envoy.sh | tail -n1)
fi

# `global` runs when named, or when no measurement is named (all); `peers` needs the same.
global=1
for a in "$@"; do
  case "$a" in
    global|peers|fleet|all) global=1; break ;;
    cpu|keys|latency|instructions|memory|accuracy|flood|contention|idle) global= ;;
  esac
done
redis=${REDIS_SERVER:-}
sync_bin=${FLOODGATE_SYNC_BIN:-}
if [[ -n "$global" ]]; then
  if [[ -z "$redis" ]]; then
    step "get Redis (scripts/redis.sh)"
    redis=$(scripts/redis.sh | tail -n1)
  fi
  if [[ -z "$sync_bin" ]]; then
    step "build floodgate-sync (cargo build --release -p floodgate-sync)"
    cargo build --release -p floodgate-sync >&2
    sync_bin=$PWD/target/release/floodgate-sync
  fi
fi

step "build the benchmark tool (cargo build --release -p floodgate-bench)"
cargo build --release -p floodgate-bench >&2

step "run"
exec env ENVOY_BIN="$envoy" FLOODGATE_WASM="$wasm" FLOODGATE_REV="$rev" REDIS_SERVER="$redis" FLOODGATE_SYNC_BIN="$sync_bin" \
  NOOP_WASM="$filters/floodgate_bench_noop.wasm" NAIVE_WASM="$filters/floodgate_bench_naive.wasm" \
  target/release/floodgate-bench "$@"
