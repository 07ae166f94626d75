#!/usr/bin/env bash
# Packages the floodgate module as an OCI image for Istio's WasmPlugin (`url: oci://...`), in the
# Docker format Istio reads: FROM scratch, one layer holding one file, `plugin.wasm`.
#
#   scripts/oci-image.sh registry.example.com/floodgate:0.2.0
#   docker push registry.example.com/floodgate:0.2.0
#
# The module is $FLOODGATE_WASM, else the one ./wasm-build.sh builds. The LAST line printed is
# the image tag. See docs/istio.md.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "scripts/oci-image.sh: $*" >&2; exit 1; }
[[ $# -eq 1 && "$1" != -* ]] || die "usage: scripts/oci-image.sh IMAGE[:TAG]   (e.g. registry.example.com/floodgate:0.2.0)"
tag=$1
command -v docker >/dev/null || die "docker is not installed (buildah, podman or kaniko can build the same Dockerfile: see docs/istio.md)"

wasm=${FLOODGATE_WASM:-$(./wasm-build.sh | tail -n1)}
[[ -f "$wasm" ]] || die "no module at $wasm"
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
cp "$wasm" "$context/plugin.wasm"
# Exactly one COPY: the image must have exactly one layer.
cat > "$context/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY plugin.wasm ./
DOCKERFILE
docker build --quiet --tag "$tag" "$context" >&2
echo "scripts/oci-image.sh: $tag holds $(basename "$wasm") as /plugin.wasm ($(wc -c <"$wasm") bytes, sha256 $(sha256sum "$wasm" | cut -d' ' -f1))" >&2
echo "$tag"
