#!/usr/bin/env bash
# Fuzzes floodgate: runs every cargo-fuzz target (libFuzzer, AddressSanitizer, overflow checks)
# for a bounded time and prints the executions of each.
#
#   fuzz/run.sh [--dev] [SECONDS_PER_TARGET] [TARGET...]     (default 25 s, every target)
#   fuzz/run.sh [--dev] --build-only                           (installs and builds, fuzzes nothing)
#
# --dev builds the targets with the fuzz crate's dev profile (`cargo fuzz build --dev`, its own
# build directory; opt-level 1 in many codegen units, fuzz/Cargo.toml): less compile time than the
# optimized build (opt-level 3, one codegen unit per crate), fewer executions per second; for a
# short run (test.sh's). The same sanitizer and instrumentation either way.
# Installs what it needs: the nightly toolchain (rustup) and cargo-fuzz (crates.io) when missing.
# Inputs: fuzz/seeds/<target>/ and fuzz/regressions/<target>/ (committed, read only), plus the
# growing corpus fuzz/corpus/<target>/ (git-ignored; delete it to start over). A failing input
# is written to fuzz/artifacts/<target>/; reproduce it with
#   cargo +nightly fuzz run --fuzz-dir fuzz <target> fuzz/artifacts/<target>/<file>
# and, once fixed, commit it to fuzz/regressions/<target>/ (filter/tests/fuzz_regressions.rs
# replays that folder in every `cargo test -p floodgate`). Exits non-zero if any target failed.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_dir=fuzz
build_only=
build=()
while [[ "${1:-}" == --build-only || "${1:-}" == --dev ]]; do
  case "$1" in
    --build-only) build_only=1 ;;
    --dev) build=(--dev) ;;
  esac
  shift
done
secs=${1:-25}
shift || true
[[ "$secs" =~ ^[0-9]+$ && "$secs" -gt 0 ]] || { echo "usage: fuzz/run.sh [--dev] [SECONDS_PER_TARGET] [TARGET...] | [--dev] --build-only" >&2; exit 2; }

if ! rustup toolchain list | grep -q '^nightly'; then
  echo "fuzz/run.sh: installing the nightly toolchain" >&2
  rustup toolchain install nightly --profile minimal >&2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  # A debug build: cargo-fuzz only drives cargo and libFuzzer, and builds in a fraction of the
  # time an optimized one takes.
  echo "fuzz/run.sh: installing cargo-fuzz (a minute or two, once)" >&2
  cargo install cargo-fuzz --locked --debug >&2
fi

if [[ $# -gt 0 ]]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list --fuzz-dir "$fuzz_dir")
fi
[[ ${#targets[@]} -gt 0 ]] || { echo "fuzz/run.sh: no fuzz targets" >&2; exit 1; }

echo "==> building ${#targets[@]} fuzz targets (cargo +nightly fuzz build ${build[*]})"
cargo +nightly fuzz build "${build[@]}" --fuzz-dir "$fuzz_dir"
[[ -z "$build_only" ]] || exit 0

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# Runs one target for $secs seconds; its log goes to $logs/<target>.log and its exit status to
# $logs/<target>.status.
fuzz_one() {
  local t=$1 status=0
  local extra=()
  [[ -f "$fuzz_dir/dicts/$t.dict" ]] && extra+=("-dict=$fuzz_dir/dicts/$t.dict")
  cargo +nightly fuzz run "${build[@]}" --fuzz-dir "$fuzz_dir" "$t" \
    "$fuzz_dir/corpus/$t" "$fuzz_dir/seeds/$t" "$fuzz_dir/regressions/$t" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -close_fd_mask=1 "${extra[@]}" >"$logs/$t.log" 2>&1 || status=$?
  echo "$status" >"$logs/$t.status"
}

# The targets run side by side, one per core (FUZZ_JOBS overrides): each is one libFuzzer
# process, and each still gets its $secs seconds.
jobs=${FUZZ_JOBS:-$(nproc)}
[[ "$jobs" =~ ^[0-9]+$ && "$jobs" -gt 0 ]] || jobs=1
echo "==> fuzzing ${#targets[@]} targets for ${secs} s each, $jobs at a time"
running=0
for t in "${targets[@]}"; do
  mkdir -p "$fuzz_dir/corpus/$t" "$fuzz_dir/seeds/$t" "$fuzz_dir/regressions/$t"
  if ((running >= jobs)); then
    wait -n || true
    running=$((running - 1))
  fi
  echo "==> fuzzing $t"
  fuzz_one "$t" &
  running=$((running + 1))
done
wait || true

failed=()
summary=()
for t in "${targets[@]}"; do
  status=$(cat "$logs/$t.status" 2>/dev/null || echo "no status")
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -n1 || true)
  cov=$(grep -Eo 'cov: [0-9]+' "$logs/$t.log" | tail -n1 | awk '{print $2}' || true)
  corpus=$(find "$fuzz_dir/corpus/$t" -type f | wc -l)
  if [[ "$status" != 0 ]]; then
    failed+=("$t")
    summary+=("$(printf '%-20s FAILED (exit %s) after %s executions' "$t" "$status" "${execs:-?}")")
    echo "---- $t failed ----"
    grep -m1 -A3 -E 'panicked at|ERROR: (AddressSanitizer|libFuzzer)' "$logs/$t.log" || tail -n 40 "$logs/$t.log"
    ls -1 "$fuzz_dir/artifacts/$t" 2>/dev/null | sed "s|^|artifact: $fuzz_dir/artifacts/$t/|" || true
  else
    summary+=("$(printf '%-20s %12s executions in %ss, %s coverage points, corpus %s' "$t" "${execs:-?}" "$secs" "${cov:-?}" "$corpus")")
  fi
done

echo
echo "==> fuzzing summary"
printf '%s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz: ${#failed[@]} target(s) failed: ${failed[*]}"
  exit 1
fi
echo "fuzz: ${#targets[@]} targets, no failures"
