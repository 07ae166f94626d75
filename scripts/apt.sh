# Sourced by the scripts that install a Debian package when a tool is missing (scripts/redis.sh,
# scripts/h2load.sh): `as_root CMD...` runs a command as root (directly, or through sudo), and
# `apt_install SCRIPT PACKAGE...` installs packages with apt-get, refreshing the package lists
# once if the first attempt fails (a fresh machine or container may have none yet).

as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    echo "need root or sudo to run: $*" >&2
    return 1
  fi
}

apt_install() {
  local script=$1
  shift
  echo "$script: installing $* with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! as_root apt-get install -y -q --no-install-recommends "$@" >&2; then
    as_root apt-get update -q >&2
    as_root apt-get install -y -q --no-install-recommends "$@" >&2
  fi
}
