#!/usr/bin/env bash
# Installs h2load, nghttp2's HTTP/2 load generator (Debian's `nghttp2-client` package), with
# apt-get when it is not on the PATH yet; the gRPC tests (integration/tests/grpc.rs) load Envoy
# with it over HTTP/2. Idempotent and fast once installed. Needs apt-get and root (or sudo) only
# to install. The LAST line printed is the absolute path of `h2load`.
set -euo pipefail

# shellcheck source=scripts/apt.sh
source "$(dirname "$0")/apt.sh"

if ! command -v h2load >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/h2load.sh: h2load is missing and there is no apt-get to install it;" \
      "install nghttp2's h2load (package nghttp2-client on Debian/Ubuntu) so that it is on the PATH" >&2
    exit 1
  fi
  apt_install scripts/h2load.sh nghttp2-client
fi

bin=$(command -v h2load)
if ! "$bin" --version >/dev/null 2>&1; then
  echo "scripts/h2load.sh: $bin does not run" >&2
  exit 1
fi
echo "$bin"
