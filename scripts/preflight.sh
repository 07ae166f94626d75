#!/usr/bin/env bash
# Checks, before anything is built, that this machine has what `./demo.sh` or `./test.sh` needs
# and no script of this repository can install; prints EVERY missing prerequisite at once with
# how to get it, then exits 1. Prints one line of what it found and exits 0 otherwise.
#
#   scripts/preflight.sh demo     what ./demo.sh needs (and the demo's walkthrough: curl)
#   scripts/preflight.sh test     what ./test.sh needs (everything of demo, and more)
#
# Not checked, because a script installs them when missing: the wasm32-wasip1 target
# (wasm-build.sh, with rustup), Envoy 1.40, grpcio and the openai and anthropic SDKs
# (scripts/envoy.sh, scripts/grpc.sh, scripts/llm-sdks.sh, from PyPI into .venv/), Redis 7, h2load and Prometheus with promtool (scripts/redis.sh,
# scripts/h2load.sh, scripts/prometheus.sh: Debian's redis-server, nghttp2-client and prometheus
# with apt-get), the nightly toolchain and cargo-fuzz (fuzz/run.sh). What those installers need is
# checked instead (rustup, python3 with venv, a C/C++ compiler, apt-get with root or sudo unless
# Redis, h2load and Prometheus are there), and they need the network (rustup, PyPI, crates.io, the
# Debian mirror).
#
# Adding a prerequisite: write a `have_*` check below and one `need` line in the list of the
# command(s) that use it. A tool that a script installs itself (from Debian or PyPI) is not a
# `need`; its installer's needs are (python3 with venv for PyPI; apt-get and root or sudo for
# Debian packages).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: scripts/preflight.sh demo|test" >&2; exit 2; }
[[ $# -eq 1 ]] || usage
for_what=$1
case "$for_what" in demo | test) ;; *) usage ;; esac

RUST_MIN=1.85 # the workspace's rust-version (Cargo.toml)

missing=()
found=()
how_instead= # a check may say better than HOW what to do (why the Docker engine failed, ...)
# need WHAT HOW CHECK [ARGS...]: CHECK succeeds when WHAT is there (and may add to `found`).
need() {
  local what=$1 how=$2
  shift 2
  how_instead=
  "$@" || missing+=("$what"$'\n'"    how: ${how_instead:-$how}")
}

have() { command -v "$1" >/dev/null 2>&1; }

have_linux() { [[ "$(uname -s)" == Linux ]]; }

have_rust() {
  have rustup && have cargo && have rustc || return 1
  local version
  version=$(rustc --version 2>/dev/null | awk '{print $2}')
  # sort -V puts the smaller first: the minimum must come first (or both be equal).
  [[ "$(printf '%s\n%s\n' "$RUST_MIN" "${version%%-*}" | sort -V | head -n1)" == "$RUST_MIN" ]] || return 1
  found+=("rustc $version")
}

have_cc() { have cc && found+=("cc"); }

have_cxx() { have c++ && found+=("c++"); }

have_python_venv() {
  # scripts/envoy.sh needs python3 with venv and pip only until Envoy is in .venv/.
  if compgen -G ".venv/lib/python3*/site-packages/envoy/_bin/envoy" >/dev/null; then
    found+=("Envoy in .venv/")
    return 0
  fi
  have python3 && python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 8))' 2>/dev/null || return 1
  found+=("python3 $(python3 -c 'import platform; print(platform.python_version())') with venv")
}

have_python_for_tests() {
  # grpcio and the openai and anthropic SDKs (scripts/grpc.sh, scripts/llm-sdks.sh) need 3.10;
  # they go into .venv/, made from python3 when missing.
  local py=python3
  [[ -x .venv/bin/python ]] && py=.venv/bin/python
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || return 1
  found+=("python $("$py" -c 'import platform; print(platform.python_version())') for the test clients")
}

have_curl() { have curl && found+=("curl"); }

have_tools() {
  local tool
  for tool in timeout ldd tar; do have "$tool" || return 1; done
}

# apt-get with root or sudo, so that SCRIPT can install Debian's PACKAGE itself.
have_apt_root() {
  local script=$1 package=$2
  have apt-get || return 1
  if [[ $(id -u) -eq 0 ]] || sudo -n true 2>/dev/null; then
    found+=("apt-get (for $package)")
    return 0
  fi
  how_instead="$script runs apt-get install $package, which needs root: run as root, allow sudo without a password, or install it yourself (sudo apt-get install $package)"
  return 1
}

have_redis_or_apt() {
  # scripts/redis.sh installs Debian's redis-server with apt-get only when it is missing.
  if have redis-server && have redis-cli; then
    found+=("$(redis-server --version 2>/dev/null | awk '{print $3}' | sed 's/^v=/redis-server /')")
    return 0
  fi
  have_apt_root scripts/redis.sh redis-server
}

have_h2load_or_apt() {
  # scripts/h2load.sh installs Debian's nghttp2-client with apt-get only when h2load is missing.
  if have h2load; then
    found+=("h2load")
    return 0
  fi
  have_apt_root scripts/h2load.sh nghttp2-client
}

have_prometheus_or_apt() {
  # scripts/prometheus.sh installs Debian's prometheus (with promtool) only when it is missing.
  if have prometheus && have promtool; then
    found+=("$(prometheus --version 2>&1 | awk 'NR == 1 {print $1, $3}' | tr -d ,)")
    return 0
  fi
  have apt-get || return 1
  if [[ $(id -u) -eq 0 ]] || sudo -n true 2>/dev/null; then
    found+=("apt-get (for prometheus)")
    return 0
  fi
  how_instead="scripts/prometheus.sh runs apt-get install prometheus, which needs root: run as root, allow sudo without a password, or install it yourself (sudo apt-get install prometheus)"
  return 1
}

have_docker_cli() { have docker; }

have_docker_engine() {
  have docker || return 0 # reported by have_docker_cli
  local out
  if out=$(timeout 20 docker info --format '{{.ServerVersion}}' 2>&1); then
    found+=("Docker $out")
    return 0
  fi
  case "$out" in
    *"permission denied"*) how_instead="you may not use it: add yourself to the docker group (sudo usermod -aG docker \"\$USER\", then log in again)" ;;
  esac
  return 1
}

have_compose() {
  have docker || return 0 # reported by have_docker_cli
  if docker compose version >/dev/null 2>&1; then
    found+=("docker compose")
  elif have docker-compose; then
    found+=("docker-compose")
  else
    return 1
  fi
}

# ---- what each command needs -------------------------------------------------------------------
rust_how="curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh (https://rustup.rs), then open a new shell; a Rust that is only too old: rustup update stable"
need "Rust $RUST_MIN or newer, installed with rustup (rustup, cargo, rustc)" "$rust_how" have_rust
need "a C compiler and linker (cc), which Rust links build scripts and native code with" \
  "Debian/Ubuntu: sudo apt-get install build-essential; Fedora: sudo dnf install gcc gcc-c++" have_cc
need "Python 3.8 or newer with venv and pip (scripts/envoy.sh installs Envoy, scripts/grpc.sh grpcio, scripts/llm-sdks.sh the openai and anthropic SDKs, from PyPI into .venv/)" \
  "Debian/Ubuntu: sudo apt-get install python3 python3-venv; elsewhere https://www.python.org/downloads/" have_python_venv
need "curl (the demo's walkthrough, and the tests, send requests with it)" \
  "Debian/Ubuntu: sudo apt-get install curl" have_curl
if [[ "$for_what" == test ]]; then
  need "Linux (the tests build a FROM scratch Envoy image from the host's glibc)" \
    "run ./test.sh on Linux (x86-64 is what CI runs)" have_linux
  need "a C++ compiler (c++), for libFuzzer (fuzz/run.sh)" \
    "Debian/Ubuntu: sudo apt-get install build-essential; Fedora: sudo dnf install gcc-c++" have_cxx
  need "timeout, ldd and tar" "Debian/Ubuntu: sudo apt-get install coreutils libc-bin tar" have_tools
  need "Python 3.10 or newer for the test clients (grpcio, the openai and anthropic SDKs in .venv/)" \
    "Debian 12 / Ubuntu 22.04 or newer ship it: sudo apt-get install python3 python3-venv; then rm -rf .venv so it is made again" \
    have_python_for_tests
  need "Redis 7.0+ (redis-server and redis-cli), or apt-get with root or sudo so scripts/redis.sh can install Debian's redis-server (floodgate-sync's tests)" \
    "Debian/Ubuntu: sudo apt-get install redis-server; elsewhere Redis 7 or Valkey from https://redis.io/docs/latest/operate/oss_and_stack/install/" \
    have_redis_or_apt
  need "h2load (HTTP/2 load for the gRPC tests), or apt-get with root or sudo so scripts/h2load.sh can install Debian's nghttp2-client" \
    "Debian/Ubuntu: sudo apt-get install nghttp2-client; elsewhere nghttp2's h2load, https://nghttp2.org" \
    have_h2load_or_apt
  need "Prometheus 2.37+ with promtool, or apt-get with root or sudo so scripts/prometheus.sh can install Debian's prometheus (the tests of observability/)" \
    "Debian/Ubuntu: sudo apt-get install prometheus; elsewhere https://prometheus.io/download/ (prometheus and promtool on the PATH)" \
    have_prometheus_or_apt
  need "Docker (the docker command), to run the Compose demo and build the Istio OCI image" \
    "Docker Engine with the Compose plugin, https://docs.docker.com/engine/install/ (Debian/Ubuntu: sudo apt-get install docker.io docker-compose also works)" \
    have_docker_cli
  need "a running Docker engine that you may use ('docker info' failed)" \
    "start it (sudo systemctl start docker)" have_docker_engine
  need "Docker Compose ('docker compose' or 'docker-compose')" \
    "the Compose plugin (https://docs.docker.com/compose/install/linux/), or Debian/Ubuntu: sudo apt-get install docker-compose" have_compose
fi

if [[ ${#missing[@]} -gt 0 ]]; then
  {
    echo "preflight: ./$for_what.sh cannot run on this machine yet. Missing:"
    printf '  - %s\n' "${missing[@]}"
    echo "Nothing was built. Install what is missing, then run ./$for_what.sh again."
  } >&2
  exit 1
fi
echo "preflight: ./$for_what.sh has what it needs: $(printf '%s, ' "${found[@]}" | sed 's/, $//')"
