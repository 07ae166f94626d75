#!/usr/bin/env bash
# Builds a local Docker image of floodgate-sync without pulling anything: `FROM scratch` with the
# binary at /usr/local/bin/floodgate-sync, run as 65534:65534 (nobody). By default the binary is a
# static musl build (scripts/musl-build.sh: `cargo build -p floodgate-sync --release --target
# x86_64-unknown-linux-musl`, the target added with rustup when missing), so the image holds that
# one file; if the musl target cannot be had, the glibc build with the libraries it links and the
# loader. With
# $FLOODGATE_SYNC_BIN, that binary instead (nothing is built). envoy/docker-compose.global.yaml
# uses the default tag:
#   scripts/sync-image.sh && docker compose -f envoy/docker-compose.global.yaml up
# Checks that the image runs (`floodgate-sync --version` inside it). The LAST line printed is the
# image tag (default floodgate-local/floodgate-sync:<version>; set FLOODGATE_LOCAL_IMAGE to choose
# another).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "scripts/sync-image.sh: $*" >&2; exit 1; }
command -v docker >/dev/null || die "docker is not installed"

bin=${FLOODGATE_SYNC_BIN:-}
if [[ -z "$bin" ]]; then
  # A static build (scripts/musl-build.sh); without the musl target, the glibc build.
  set +e
  bin=$(scripts/musl-build.sh floodgate-sync floodgate-sync | tail -n1)
  rc=$?
  set -e
  if ((rc == 3)); then
    echo "scripts/sync-image.sh: no musl target; the image gets the glibc build and its libraries" >&2
    cargo build -p floodgate-sync --release >&2
    bin=target/release/floodgate-sync
  elif ((rc != 0)); then
    die "the static build of floodgate-sync failed"
  fi
fi
[[ -x "$bin" ]] || die "no floodgate-sync binary at $bin"
version=$("$bin" --version | awk '{print $2}')
[[ -n "$version" ]] || die "cannot read the version of $bin"
tag=${FLOODGATE_LOCAL_IMAGE:-floodgate-local/floodgate-sync:$version}

scripts/scratch-image.sh "$tag" "$bin" /usr/local/bin/floodgate-sync 65534:65534
inside=$(docker run --rm "$tag" --version 2>&1) || die "the image does not run: $inside"
[[ "$inside" == "floodgate-sync $version" ]] || die "unexpected output of floodgate-sync --version in the image: $inside"
echo "$tag"
