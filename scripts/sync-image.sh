#!/usr/bin/env bash
# Builds a local Docker image of floodgate-sync without pulling anything: `FROM scratch` with the
# binary at /usr/local/bin/floodgate-sync, run as 65534:65534 (nobody). By default the binary is a
# static musl build (`cargo build -p floodgate-sync --release --target x86_64-unknown-linux-musl`;
# the target is added with rustup when missing), so the image holds that one file; if the musl
# target cannot be had, the glibc build with the libraries it links and the loader. With
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

musl=x86_64-unknown-linux-musl
case "$(uname -m)" in aarch64) musl=aarch64-unknown-linux-musl ;; esac
bin=${FLOODGATE_SYNC_BIN:-}
if [[ -z "$bin" ]]; then
  if rustup target list --installed 2>/dev/null | grep -qx "$musl" || rustup target add "$musl" >&2; then
    # ring (rustls' cryptography, for rediss://) compiles some C: without a musl cross
    # compiler, the host's cc builds it (its C is freestanding: no libc headers).
    cc_var=CC_${musl//-/_}
    if [[ -z "${!cc_var:-}" ]] && ! command -v "${musl%%-*}-linux-musl-gcc" >/dev/null && ! command -v musl-gcc >/dev/null; then
      export "$cc_var"=cc
    fi
    echo "scripts/sync-image.sh: cargo build -p floodgate-sync --release --target $musl" >&2
    cargo build -p floodgate-sync --release --target "$musl" >&2
    bin=target/$musl/release/floodgate-sync
  else
    echo "scripts/sync-image.sh: no $musl target; the image gets the glibc build and its libraries" >&2
    cargo build -p floodgate-sync --release >&2
    bin=target/release/floodgate-sync
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
