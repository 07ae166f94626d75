#!/usr/bin/env bash
# Builds a local Docker image `FROM scratch` holding one program, without pulling anything:
#
#   scripts/scratch-image.sh TAG BINARY PATH_IN_IMAGE [USER]
#
# BINARY is copied to PATH_IN_IMAGE (its entrypoint). A dynamically linked binary brings the
# libraries `ldd` resolves and the dynamic loader; a static one comes alone. USER (uid:gid) is the
# image's default user (default: root). The image answers `docker run --rm TAG --version` if the
# program does; this script does not check it (the callers do, each knowing what to expect).
# Used by scripts/envoy-image.sh, scripts/redis-image.sh and scripts/sync-image.sh.
set -euo pipefail

die() { echo "scripts/scratch-image.sh: $*" >&2; exit 1; }
[[ $# -ge 3 ]] || die "usage: scripts/scratch-image.sh TAG BINARY PATH_IN_IMAGE [USER]"
tag=$1 binary=$2 inside=$3 user=${4:-}
command -v docker >/dev/null || die "docker is not installed"
command -v ldd >/dev/null || die "ldd is not installed"
[[ -x "$binary" ]] || die "no executable at $binary"

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
mkdir -p "$context/lib"
cp -L "$binary" "$context/program"
# Every library ldd resolves, and the loader (the line without "=>"), copied through symlinks.
# A static binary has neither ("statically linked" / "not a dynamic executable").
loader=
while read -r line; do
  case "$line" in
    *"=> /"*) lib=${line#*=> }; lib=${lib%% (*}; cp -L "$lib" "$context/lib/" ;;
    /*) loader=${line%% (*} ;;
  esac
done < <(ldd "$binary" 2>/dev/null || true)
libdir=/lib/x86_64-linux-gnu
case "$(uname -m)" in aarch64) libdir=/lib/aarch64-linux-gnu ;; esac

{
  echo "FROM scratch"
  if [[ -n "$loader" ]]; then
    cp -L "$loader" "$context/loader"
    echo "COPY lib/ $libdir/"
    echo "COPY loader $loader"
  fi
  echo "COPY program $inside"
  if [[ -n "$user" ]]; then echo "USER $user"; fi
  echo "ENTRYPOINT [\"$inside\"]"
} > "$context/Dockerfile"

what="static"
if [[ -n "$loader" ]]; then what="with $(ls "$context/lib" | tr '\n' ' ')and $loader"; fi
echo "scripts/scratch-image.sh: building $tag from $binary ($what)" >&2
docker build --quiet --tag "$tag" "$context" >&2
