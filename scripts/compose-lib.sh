# Sourced by scripts/compose-test.sh and scripts/compose-global-test.sh: what both need to run a
# compose file for real and report on it. Sets `compose` (the command: `docker compose` or
# `docker-compose`) and defines die, free_port, pass, fail, the counters passed / failed, and
# cleanup (for `trap cleanup EXIT`: on failure the services' last log lines, then always
# `down`, and the scratch directory $work removed). Expects `me` (the script's name, for
# messages) to be set, and the script to define `dc` (its compose command) and `work`.

die() { echo "$me: $*" >&2; exit 1; }
command -v docker >/dev/null || die "docker is not installed: this test needs a Docker engine with Compose"
command -v curl >/dev/null || die "curl is not installed"
command -v python3 >/dev/null || die "python3 is not installed"
docker info >/dev/null 2>&1 || die "the Docker engine does not answer ('docker info' failed): start it"
if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
elif command -v docker-compose >/dev/null; then
  compose=(docker-compose)
else
  die "neither 'docker compose' nor 'docker-compose' is installed"
fi

# A free TCP port on 127.0.0.1, none of those given as arguments.
free_port() {
  local port
  while :; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    [[ " $* " == *" $port "* ]] || break
  done
  echo "$port"
}

passed=0
failed=0
pass() { passed=$((passed + 1)); echo "ok    $*"; }
fail() { failed=$((failed + 1)); echo "FAIL  $*"; }

cleanup() {
  local status=$?
  if [[ $status -ne 0 ]]; then
    echo "---- docker compose logs (last lines) ----" >&2
    dc logs --no-color --tail 30 >&2 2>/dev/null || true
  fi
  dc down --volumes --remove-orphans --timeout 2 >/dev/null 2>&1 || true
  rm -rf "$work"
  exit "$status"
}
