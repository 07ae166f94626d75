#!/usr/bin/env bash
# Installs the official Python SDKs of the LLM APIs floodgate's token quotas are tested with,
# `openai` and `anthropic` (from PyPI), into the project-local virtualenv `.venv/` (the one
# scripts/envoy.sh puts Envoy in), if they are not there yet at these versions. The SDK tests
# (integration/tests/llm_sdk.rs) call through floodgate with them (integration/llm/sdk.py).
# Idempotent and fast once installed. The LAST line printed is the absolute path of the
# virtualenv's Python, which has both.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
OPENAI_VERSION=3.57.0
ANTHROPIC_VERSION=2.14.0

python="$root/.venv/bin/python"
have_sdks() {
  [[ -x "$python" ]] && "$python" -c "
import sys, openai, anthropic
sys.exit(openai.__version__ != '$OPENAI_VERSION' or anthropic.__version__ != '$ANTHROPIC_VERSION')" 2>/dev/null
}

if ! have_sdks; then
  if [[ ! -x "$python" ]]; then
    echo "scripts/llm-sdks.sh: creating virtualenv .venv" >&2
    python3 -m venv .venv
  fi
  echo "scripts/llm-sdks.sh: installing openai==$OPENAI_VERSION anthropic==$ANTHROPIC_VERSION into .venv" >&2
  "$python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: \
    "openai==$OPENAI_VERSION" "anthropic==$ANTHROPIC_VERSION" >&2
  if ! have_sdks; then
    echo "scripts/llm-sdks.sh: openai $OPENAI_VERSION and anthropic $ANTHROPIC_VERSION installed but .venv/bin/python cannot import them" >&2
    exit 1
  fi
fi
echo "$python"
