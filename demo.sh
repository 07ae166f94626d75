#!/usr/bin/env bash
# Runs the floodgate demo: checks the machine's prerequisites (scripts/preflight.sh), builds the
# Wasm module, installs Envoy into .venv/ if needed, then runs Envoy in the foreground with
# envoy/demo.yaml (Ctrl-C to stop). Everything listens on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")"

scripts/preflight.sh demo
./wasm-build.sh
envoy=$(scripts/envoy.sh | tail -n1)

cat <<'TXT'

floodgate demo: Envoy on 127.0.0.1:10000 (admin on 127.0.0.1:9901).
Rule "per-api-key" allows 5 requests per 10 s per x-api-key (10 for x-plan: gold); "logins" 3
POST /api/login per minute per client; "per-ip" 1000 per minute per client;
at most 10 requests in flight (normal priority shed from 9); health endpoint /floodgate/health.
Paths under /api/ go to zone-a alone; every other path goes through cluster selection over
zone-a, zone-b and the flaky zone-c (90 % of its answers are 503).
In another terminal, try (docs/getting-started.md shows what each prints):

  # cluster selection steers away from zone-c
  for i in $(seq 1 300); do curl -s -w '\n' localhost:10000/; done | grep . | sort | uniq -c
  curl -s localhost:9901/stats | grep 'floodgate.cluster.zone-c'

  # five 200s, then 429s; then a refused request in full: retry-after, ratelimit fields, problem+json body
  for i in $(seq 1 7); do curl -s -o /dev/null -w '%{http_code}\n' -H 'x-api-key: demo' localhost:10000/api/; done
  curl -i -H 'x-api-key: demo' localhost:10000/api/

  # rules that fit the API: a gold key gets 10, logins (POST /api/login only) 3 a minute
  for i in $(seq 1 12); do curl -s -o /dev/null -w '%{http_code}\n' -H 'x-api-key: gold-demo' -H 'x-plan: gold' localhost:10000/api/; done | sort | uniq -c
  for i in $(seq 1 4); do curl -s -o /dev/null -w '%{http_code}\n' -X POST localhost:10000/api/login; done

  # load shedding: of 12 concurrent slow requests, 3 get 503 at once, 9 get 200 after 2 s
  for i in $(seq 1 12); do curl -s -o /dev/null -w '%{http_code}\n' -H "x-api-key: k$i" -H 'x-envoy-fault-delay-request: 2000' localhost:10000/api/ & done; wait

  # the health endpoint (503 while the proxy sheds), the filter's counters
  curl -s localhost:10000/floodgate/health
  curl -s localhost:9901/stats | grep -E 'wasmcustom.*\.(allowed|rejected|shed):'

Starting Envoy (Ctrl-C to stop)...
TXT

exec "$envoy" -c envoy/demo.yaml --concurrency 2 -l info --disable-hot-restart
