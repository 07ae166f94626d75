#!/usr/bin/env bash
# Runs envoy/docker-compose.global.yaml for real and probes it from the host: Redis,
# floodgate-sync and two Envoys come up; one tenant's requests, split between the two Envoys,
# get ONE quota of 10 (the "per-tenant" rule in global scope), where the same traffic on the
# proxy-scope rule "per-client" gets 10 per Envoy; both Envoys' batches are confirmed and
# floodgate-sync applied them in Redis. Always tears it down.
#
# Needs a Docker engine with Compose (`docker compose` or `docker-compose`), nothing from a
# registry: unless FLOODGATE_ENVOY_IMAGE, FLOODGATE_REDIS_IMAGE and FLOODGATE_SYNC_IMAGE name
# images, it builds them FROM scratch (scripts/envoy-image.sh, scripts/redis-image.sh,
# scripts/sync-image.sh). The module is $FLOODGATE_WASM, else built by ./wasm-build.sh. Host
# ports are free ones on 127.0.0.1, chosen now. Takes about half a minute once the images exist
# (up to 20 s more to keep the requests within one minute of the clock: the quotas are per
# minute).
# Last line: `compose-global: N passed, M failed`; the exit status is non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."

me=compose-global-test
# shellcheck source=scripts/compose-lib.sh
source scripts/compose-lib.sh

wasm=${FLOODGATE_WASM:-$(./wasm-build.sh | tail -n1)}
[[ -f "$wasm" ]] || die "no module at $wasm"
envoy_image=${FLOODGATE_ENVOY_IMAGE:-$(scripts/envoy-image.sh | tail -n1)}
redis_image=${FLOODGATE_REDIS_IMAGE:-$(scripts/redis-image.sh | tail -n1)}
sync_image=${FLOODGATE_SYNC_IMAGE:-$(scripts/sync-image.sh | tail -n1)}
port_a=$(free_port)
port_b=$(free_port "$port_a")
admin_a=$(free_port "$port_a" "$port_b")
admin_b=$(free_port "$port_a" "$port_b" "$admin_a")
sync_port=$(free_port "$port_a" "$port_b" "$admin_a" "$admin_b")
project="floodgate-compose-global-test-$$"
export FLOODGATE_ENVOY_IMAGE="$envoy_image" FLOODGATE_REDIS_IMAGE="$redis_image" FLOODGATE_SYNC_IMAGE="$sync_image" \
  FLOODGATE_WASM="$wasm" FLOODGATE_PORT_A="$port_a" FLOODGATE_PORT_B="$port_b" \
  FLOODGATE_ADMIN_PORT_A="$admin_a" FLOODGATE_ADMIN_PORT_B="$admin_b" FLOODGATE_SYNC_PORT="$sync_port"
dc() { "${compose[@]}" -p "$project" -f envoy/docker-compose.global.yaml "$@"; }

work=$(mktemp -d)
trap cleanup EXIT

echo "$me: ${compose[*]} with images $envoy_image, $redis_image, $sync_image; module $wasm;" \
  "envoy-a on 127.0.0.1:$port_a (admin :$admin_a), envoy-b on :$port_b (admin :$admin_b), floodgate-sync on :$sync_port"
dc up --detach

# 1. Both Envoys ready (admin /ready says LIVE) and floodgate-sync ready (/readyz: Redis answers),
#    within 60 s.
ready_a= ready_b= ready_sync=
for _ in $(seq 1 120); do
  [[ "$(curl -s --max-time 2 "http://127.0.0.1:$admin_a/ready" || true)" == LIVE* ]] && ready_a=1
  [[ "$(curl -s --max-time 2 "http://127.0.0.1:$admin_b/ready" || true)" == LIVE* ]] && ready_b=1
  [[ "$(curl -s --max-time 2 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$sync_port/readyz" || true)" == 200 ]] && ready_sync=1
  if [[ -n "$ready_a" && -n "$ready_b" && -n "$ready_sync" ]]; then break; fi
  sleep 0.5
done
if [[ -n "$ready_a" && -n "$ready_b" && -n "$ready_sync" ]]; then
  pass "envoy-a, envoy-b and floodgate-sync (with Redis) are ready"
else
  fail "not ready within 60 s: envoy-a '${ready_a:-no}', envoy-b '${ready_b:-no}', floodgate-sync /readyz '${ready_sync:-no}'"
  echo "compose-global: $passed passed, $failed failed"
  exit 1
fi

# Requests: `send PORT HEADER VALUE COUNT` appends COUNT statuses to $work/<HEADER>.
send() {
  local i
  for i in $(seq 1 "$4"); do
    curl -s --max-time 10 -o /dev/null -w '%{http_code}\n' -H "$2: $3" "http://127.0.0.1:$1/" >>"$work/$2" || echo 000 >>"$work/$2"
  done
}
count_of() { grep -cx "$2" "$work/$1" || true; }

# The quotas are per minute: keep every request of the test within one minute of the clock.
second=$((10#$(date +%S)))
if [[ $second -gt 40 ]]; then sleep $((61 - second)); fi

# 2. One quota for the fleet: 6 requests to envoy-a; after a sync, 1 to envoy-b (a key new to it
#    is decided on its own counts, then learnt from its batch); after a sync, 6 more to envoy-b;
#    after a sync, 3 to each. Limit 10: ten 200s in all (a worker may hold back a unit or two of
#    quota reserve), never more: without the shared count envoy-b alone would admit 7.
tenant="tenant-$$"
send "$port_a" x-tenant "$tenant" 6
sleep 1.5
send "$port_b" x-tenant "$tenant" 1
sleep 1.5
send "$port_b" x-tenant "$tenant" 6
sleep 1.5
send "$port_a" x-tenant "$tenant" 3
send "$port_b" x-tenant "$tenant" 3
admitted=$(count_of x-tenant 200)
refused=$(count_of x-tenant 429)
statuses=$(tr '\n' ' ' <"$work/x-tenant")
if [[ $admitted -le 10 && $admitted -ge 8 && $((admitted + refused)) -eq 19 ]]; then
  pass "global scope: $admitted of 19 requests admitted over both Envoys, limit 10 (statuses: $statuses)"
else
  fail "global scope: $admitted admitted and $refused refused of 19 over both Envoys, expected 10 (8 to 10) admitted in all (statuses: $statuses)"
fi

# 3. The same traffic in proxy scope: 12 requests to each Envoy, 10 admitted by each.
client="client-$$"
send "$port_a" x-client "$client" 12
send "$port_b" x-client "$client" 12
local_admitted=$(count_of x-client 200)
if [[ $local_admitted -ge 18 && $local_admitted -le 20 ]]; then
  pass "proxy scope, for contrast: $local_admitted of 24 admitted (10 per Envoy)"
else
  fail "proxy scope: $local_admitted of 24 admitted, expected 20 (18 to 20)"
fi

# 4. The sync itself: each Envoy's batches confirmed, floodgate-sync applied batches in Redis.
stat() { curl -s --max-time 10 "http://127.0.0.1:$1/stats?filter=^wasmcustom%5C.floodgate%5C.global%5C." | awk -v name="wasmcustom.floodgate.global.$2:" '$1 == name { print $2 }'; }
confirmed_a=$(stat "$admin_a" confirmed)
confirmed_b=$(stat "$admin_b" confirmed)
if [[ "${confirmed_a:-0}" -ge 1 && "${confirmed_b:-0}" -ge 1 ]]; then
  pass "batches confirmed: envoy-a $confirmed_a, envoy-b $confirmed_b (staleness $(stat "$admin_a" staleness_ms) ms, $(stat "$admin_b" staleness_ms) ms)"
else
  fail "batches confirmed: envoy-a '${confirmed_a}', envoy-b '${confirmed_b}'"
fi
metrics=$(curl -s --max-time 10 "http://127.0.0.1:$sync_port/metrics")
applied=$(awk '$1 == "floodgate_sync_batches_applied_total" { print $2 }' <<<"$metrics")
if [[ "${applied:-0}" -ge 2 ]]; then
  pass "floodgate-sync applied $applied batches to Redis"
else
  fail "floodgate-sync /metrics: floodgate_sync_batches_applied_total '${applied}'"
fi

echo "compose-global: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
