#!/usr/bin/env bash
# Installs Redis (Debian's `redis-server` package, which brings `redis-cli` with it) with apt-get
# when `redis-server` is not on the PATH yet; the sync tests (`cargo test -p floodgate-sync`)
# start their own redis-server processes on free 127.0.0.1 ports, never a system service.
# Idempotent and fast once installed. Needs apt-get and root (or sudo) only to install.
# If installing started the package's own Redis service, it is stopped and disabled again, so
# nothing keeps listening on 6379 afterwards. The LAST line printed is the absolute path of
# `redis-server` (redis-cli sits next to it).
set -euo pipefail

REDIS_MIN=7.0 # the oldest Redis the sync service supports (Debian bookworm ships 7.0)

# shellcheck source=scripts/apt.sh
source "$(dirname "$0")/apt.sh"

stop_service() {
  # Only the package's own service, through the service manager, and only if it runs.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet redis-server 2>/dev/null; then
    echo "scripts/redis.sh: stopping and disabling the redis-server service the package started" >&2
    as_root systemctl stop redis-server >&2 || true
    as_root systemctl disable redis-server >&2 2>&1 || true
  elif command -v service >/dev/null 2>&1 && service redis-server status >/dev/null 2>&1; then
    echo "scripts/redis.sh: stopping the redis-server service the package started" >&2
    as_root service redis-server stop >&2 || true
    if command -v update-rc.d >/dev/null 2>&1; then as_root update-rc.d redis-server disable >&2 2>&1 || true; fi
  fi
}

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/redis.sh: redis-server is missing and there is no apt-get to install it;" \
      "install Redis $REDIS_MIN or newer (redis-server and redis-cli on the PATH)" >&2
    exit 1
  fi
  apt_install scripts/redis.sh redis-server
  stop_service
fi

bin=$(command -v redis-server)
version=$("$bin" --version 2>&1 | sed -n 's/.* v=\([0-9][0-9.]*\).*/\1/p')
if [[ -z "$version" || "$(printf '%s\n%s\n' "$REDIS_MIN" "$version" | sort -V | head -n1)" != "$REDIS_MIN" ]]; then
  echo "scripts/redis.sh: $bin is Redis '${version:-unknown}'; the sync service needs $REDIS_MIN or newer" >&2
  exit 1
fi
if ! command -v redis-cli >/dev/null 2>&1; then
  echo "scripts/redis.sh: redis-server is there but redis-cli is not (Debian: apt-get install redis-tools)" >&2
  exit 1
fi
# Not resolved through symlinks: Debian's redis-server is a link to redis-check-rdb, and the
# binary picks its mode from the name it was started as.
echo "$bin"
