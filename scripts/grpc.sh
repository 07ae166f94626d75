#!/usr/bin/env bash
# Installs grpcio (the gRPC library of gRPC's own C core, from PyPI) into the project-local
# virtualenv `.venv/` (the one scripts/envoy.sh puts Envoy in), if it is not there yet. The gRPC
# tests (integration/tests/grpc.rs) run a real gRPC server and client with it
# (integration/grpc/peer.py). Idempotent and fast once installed. The LAST line printed is the
# absolute path of the virtualenv's Python, which has grpcio.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
GRPCIO_VERSION=1.85.1

python="$root/.venv/bin/python"
have_grpcio() {
  [[ -x "$python" ]] && "$python" -c "import grpc, sys; sys.exit(grpc.__version__ != '$GRPCIO_VERSION')" 2>/dev/null
}

if ! have_grpcio; then
  if [[ ! -x "$python" ]]; then
    echo "scripts/grpc.sh: creating virtualenv .venv" >&2
    python3 -m venv .venv
  fi
  echo "scripts/grpc.sh: installing grpcio==$GRPCIO_VERSION into .venv" >&2
  # A wheel only: building grpcio from source takes many minutes and a C++ toolchain.
  "$python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: "grpcio==$GRPCIO_VERSION" >&2
  if ! have_grpcio; then
    echo "scripts/grpc.sh: grpcio $GRPCIO_VERSION installed but .venv/bin/python cannot import it" >&2
    exit 1
  fi
fi
echo "$python"
