#!/usr/bin/env bash
# Builds a local Docker image holding redis-server without pulling anything: `FROM scratch` with
# the redis-server of this machine (scripts/redis.sh installs Debian's; or $REDIS_SERVER) at
# /usr/local/bin/redis-server, where the official `redis` image has it, plus the libraries it
# links and the dynamic loader (scripts/scratch-image.sh); default user 999:999 (the official
# image's `redis`). For machines that cannot reach Docker Hub:
#   FLOODGATE_REDIS_IMAGE=$(scripts/redis-image.sh | tail -n1) docker compose -f envoy/docker-compose.global.yaml up
# Checks that the image runs (`redis-server --version` inside it). The LAST line printed is the
# image tag (default floodgate-local/redis:<version>; set FLOODGATE_LOCAL_IMAGE to choose another).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "scripts/redis-image.sh: $*" >&2; exit 1; }
command -v docker >/dev/null || die "docker is not installed"

# Not resolved through links: Debian's redis-server is a link to redis-check-rdb, which picks
# its mode from the name it runs under; in the image it runs as redis-server.
redis=${REDIS_SERVER:-$(scripts/redis.sh | tail -n1)}
[[ -x "$redis" ]] || die "no redis-server at $redis"
version=$("$redis" --version | sed -n 's/.* v=\([0-9][0-9.]*\).*/\1/p')
[[ -n "$version" ]] || die "cannot read the version of $redis"
tag=${FLOODGATE_LOCAL_IMAGE:-floodgate-local/redis:$version}

scripts/scratch-image.sh "$tag" "$redis" /usr/local/bin/redis-server 999:999
inside=$(docker run --rm "$tag" --version 2>&1) || die "the image does not run: $inside"
case "$inside" in
  *"v=$version "*) ;;
  *) die "unexpected output of redis-server --version in the image: $inside" ;;
esac
echo "$tag"
