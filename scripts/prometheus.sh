#!/usr/bin/env bash
# Installs Prometheus (Debian's `prometheus` package, which brings `promtool` with it) with
# apt-get when `prometheus` or `promtool` is not on the PATH yet; the observability tests
# (`promtool check rules` / `promtool test rules` on observability/prometheus/, and
# integration/tests/observability.rs) start their own Prometheus on a free 127.0.0.1 port with a
# temporary data directory, never a system service.
# Idempotent and fast once installed. Needs apt-get and root (or sudo) only to install; without
# recommends (no node exporter).
# The package's postinst starts its `prometheus` service (on :9090, every address) through
# invoke-rc.d or systemd when the machine allows it: if installing started it, it is stopped and
# disabled again, so nothing keeps listening afterwards. The LAST line printed is the absolute
# path of `prometheus` (promtool sits next to it).
set -euo pipefail

PROMETHEUS_MIN=2.37 # the oldest Prometheus the rules and the tests are checked with (bookworm: 2.42)

as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    echo "scripts/prometheus.sh: need root or sudo to run: $*" >&2
    return 1
  fi
}

stop_service() {
  # Only the package's own service, through the service manager: stopped if it runs, and disabled
  # (the postinst enables it even where it could not start it, as in a container), so that it
  # does not start at the next boot either.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    echo "scripts/prometheus.sh: stopping the prometheus service the package started" >&2
    as_root systemctl stop prometheus >&2 || true
  elif command -v service >/dev/null 2>&1 && service prometheus status >/dev/null 2>&1; then
    echo "scripts/prometheus.sh: stopping the prometheus service the package started" >&2
    as_root service prometheus stop >&2 || true
  fi
  if command -v systemctl >/dev/null 2>&1 && systemctl is-enabled --quiet prometheus 2>/dev/null; then
    echo "scripts/prometheus.sh: disabling the prometheus service the package enabled" >&2
    as_root systemctl disable prometheus >&2 2>&1 || true
  fi
  if command -v update-rc.d >/dev/null 2>&1 && compgen -G "/etc/rc[2-5].d/S*prometheus" >/dev/null; then
    as_root update-rc.d prometheus disable >&2 2>&1 || true
  fi
}

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/prometheus.sh: prometheus is missing and there is no apt-get to install it;" \
      "install Prometheus $PROMETHEUS_MIN or newer (prometheus and promtool on the PATH)" >&2
    exit 1
  fi
  echo "scripts/prometheus.sh: installing prometheus with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! as_root apt-get install -y -q --no-install-recommends prometheus >&2; then
    # A fresh machine (or container) may not have the package lists yet.
    as_root apt-get update -q >&2
    as_root apt-get install -y -q --no-install-recommends prometheus >&2
  fi
  stop_service
fi

bin=$(command -v prometheus)
version=$("$bin" --version 2>&1 | sed -n 's/^prometheus, version \([0-9][0-9.]*\).*/\1/p')
if [[ -z "$version" || "$(printf '%s\n%s\n' "$PROMETHEUS_MIN" "$version" | sort -V | head -n1)" != "$PROMETHEUS_MIN" ]]; then
  echo "scripts/prometheus.sh: $bin is Prometheus '${version:-unknown}'; the tests need $PROMETHEUS_MIN or newer" >&2
  exit 1
fi
if [[ ! -x "$(dirname "$bin")/promtool" ]]; then
  echo "scripts/prometheus.sh: prometheus is there but promtool is not next to it ($(dirname "$bin")/promtool)" >&2
  exit 1
fi
echo "$bin"
