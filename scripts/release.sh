#!/usr/bin/env bash
# Builds floodgate's release artifacts into dist/ (git-ignored), named by the workspace version,
# with their SHA-256 checksums in dist/SHA256SUMS:
#
#   floodgate-<version>.wasm                          the trimmed module (./wasm-build.sh)
#   floodgate-llm-<version>.wasm                      the module that reads response bodies
#                                                     (token quotas for LLM APIs: docs/llm.md)
#   floodgate-<version>-wasmplugin-image.tar          its OCI image for Istio's WasmPlugin
#                                                     (scripts/oci-image.sh; `docker load` it,
#                                                     then tag and push it to your registry)
#   floodgate-llm-<version>-wasmplugin-image.tar      the same for floodgate-llm.wasm
#   floodgate-<version>-x86_64-unknown-linux-musl     the `floodgate` CLI, static
#   floodgate-sync-<version>-x86_64-unknown-linux-musl  floodgate-sync, static
#   floodgate-sync-<version>-image.tar                floodgate-sync's FROM scratch image
#                                                     (scripts/sync-image.sh)
#
#   scripts/release.sh             everything
#   scripts/release.sh cli wasm    only those parts (wasm, wasm-image, cli, sync, sync-image);
#                                  SHA256SUMS lists what dist/ then holds
#
# Run it in a clean clone: it refuses a work tree with changes to tracked files (set
# RELEASE_ALLOW_DIRTY=1 to build anyway, e.g. while changing this script), and writes the commit
# it built into dist/BUILDINFO. The images need a Docker engine; the static binaries add the musl
# target with rustup (scripts/musl-build.sh). Checks each binary: static, and it answers
# `--version` with the release's version. The LAST line printed is the dist/ directory.
# See docs/operations.md, "Release artifacts".
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

die() { echo "scripts/release.sh: $*" >&2; exit 1; }
say() { echo "scripts/release.sh: $*" >&2; }

all=(wasm wasm-image cli sync sync-image)
parts=("$@")
((${#parts[@]} > 0)) || parts=("${all[@]}")
for p in "${parts[@]}"; do
  [[ " ${all[*]} " == *" $p "* ]] || die "unknown part $p (parts: ${all[*]})"
done
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }

if [[ -n "$(git status --porcelain --untracked-files=no)" && "${RELEASE_ALLOW_DIRTY:-}" != 1 ]]; then
  die "the work tree has changes to tracked files: release from a clean clone (or set RELEASE_ALLOW_DIRTY=1)"
fi
version=$(cargo metadata --no-deps --format-version 1 --offline 2>/dev/null \
  | python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "floodgate"))') \
  || die "cannot read the workspace version (cargo metadata)"
commit=$(git rev-parse HEAD)
musl=x86_64-unknown-linux-musl
case "$(uname -m)" in aarch64) musl=aarch64-unknown-linux-musl ;; esac
dist=$root/dist
mkdir -p "$dist"
say "floodgate $version at $commit into $dist (${parts[*]})"

# A binary of the release: static, answering --version with the release's version.
check_binary() {
  local bin=$1 expected=$2 out
  # ldd names a library ("libc.so.6 => /lib/...") only for a dynamically linked binary.
  if ldd "$bin" 2>&1 | grep -q '=>'; then
    die "$bin is dynamically linked: $(ldd "$bin" 2>&1 | tr '\n' ' ')"
  fi
  out=$("$bin" --version 2>&1) || die "$bin --version failed: $out"
  [[ "$out" == "$expected" ]] || die "$bin --version says \"$out\", not \"$expected\""
}

if want wasm || want wasm-image; then
  wasm=$(./wasm-build.sh | tail -n1)
  cp "$wasm" "$dist/floodgate-$version.wasm"
  cp "$(dirname "$wasm")/floodgate-llm.wasm" "$dist/floodgate-llm-$version.wasm"
fi
if want wasm-image; then
  for module in floodgate floodgate-llm; do
    tag=$module:$version
    FLOODGATE_WASM="$dist/$module-$version.wasm" scripts/oci-image.sh "$tag" >/dev/null
    docker save "$tag" -o "$dist/$module-$version-wasmplugin-image.tar"
  done
fi
# The modules were copied for the images too: they ship when asked for.
want wasm || rm -f "$dist/floodgate-$version.wasm" "$dist/floodgate-llm-$version.wasm"
if want cli; then
  bin=$(scripts/musl-build.sh floodgate-cli floodgate | tail -n1)
  check_binary "$bin" "floodgate $version"
  cp "$bin" "$dist/floodgate-$version-$musl"
fi
if want sync || want sync-image; then
  sync_bin=$(scripts/musl-build.sh floodgate-sync floodgate-sync | tail -n1)
  check_binary "$sync_bin" "floodgate-sync $version"
  want sync && cp "$sync_bin" "$dist/floodgate-sync-$version-$musl"
fi
if want sync-image; then
  tag=$(FLOODGATE_SYNC_BIN="$sync_bin" FLOODGATE_LOCAL_IMAGE="floodgate-sync:$version" scripts/sync-image.sh | tail -n1)
  docker save "$tag" -o "$dist/floodgate-sync-$version-image.tar"
fi

printf 'floodgate %s\ncommit %s\nbuilt %s\nrustc %s\n' "$version" "$commit" \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(rustc --version)" >"$dist/BUILDINFO"
(
  cd "$dist"
  rm -f SHA256SUMS
  find . -maxdepth 1 -type f ! -name SHA256SUMS -printf '%f\n' | LC_ALL=C sort | xargs sha256sum >SHA256SUMS
  sha256sum --check --quiet SHA256SUMS
  ls -l --time-style=+ . | awk 'NR > 1 { printf "  %12d  %s\n", $5, $NF }' >&2
)
echo "$dist"
