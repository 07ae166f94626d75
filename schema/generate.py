#!/usr/bin/env python3
"""Writes schema/floodgate.schema.json, the JSON Schema (draft 2020-12) of floodgate's
configuration (or the file given as argument). Edit the schema here and run
`python3 schema/generate.py`: the duration pattern is
generated (a whole number and a unit, at most 366 days, exactly as the parser in
filter/src/config/values.rs). integration/tests/operator.rs checks the result against the parser,
the docs and every example configuration in the repository.
"""
import json, os, re

def upto(n):
    """Regex (no anchors) matching decimal integers 1..n without leading zeros."""
    s = str(n)
    k = len(s)
    alts = []
    if k > 1:
        alts.append("[1-9]" + ("[0-9]{0,%d}" % (k - 2) if k > 2 else ""))
        if k == 2: alts[-1] = "[1-9]"
    # exactly k digits, <= n
    for i in range(k):
        d = int(s[i])
        lo = 1 if i == 0 else 0
        if d - 1 >= lo:
            rng = str(lo) if d - 1 == lo else "[%d-%d]" % (lo, d - 1)
            rest = k - i - 1
            alts.append(s[:i] + rng + ("[0-9]" if rest == 1 else "[0-9]{%d}" % rest if rest > 1 else ""))
    alts.append(s)
    return "(?:" + "|".join(alts) + ")"

# The generated ranges are checked against plain integer comparison.
for n in [1, 9, 10, 99, 100, 527040, 8784, 31622400, 31622400000, 60]:
    r = re.compile("^" + upto(n) + "$")
    for x in list(range(0, 2000)) + [n - 1, n, n + 1, n * 10, n // 10]:
        if x < 0: continue
        assert bool(r.match(str(x))) == (1 <= x <= n), (n, x)

MAX_MS = 366 * 24 * 3600 * 1000
units = [("ms", MAX_MS), ("s", MAX_MS // 1000), ("m", MAX_MS // 60000), ("h", MAX_MS // 3600000)]
DURATION = "^0*(?:" + "|".join(upto(n) + u for u, n in units) + ")$"
for t, ok in [("250ms", 1), ("10s", 1), ("1m", 1), ("1h", 1), ("0s", 0), ("8784h", 1), ("8785h", 0), ("010s", 1), ("1.5s", 0), ("1d", 0), ("10S", 0), ("527040m", 1), ("527041m", 0), ("31622400s", 1), ("31622401s", 0), ("31622400000ms", 1), ("31622400001ms", 0), ("00ms", 0)]:
    assert bool(re.match(DURATION, t)) == bool(ok), t

TOKEN = "!#$%&'*+.^_`|~0-9A-Za-z-"

# A JSON path of object keys joined by dots (cost.path, estimate.body, sum), as the parser checks it.
PLACE = "^[^.\"\\\\\\u0000-\\u001f]{1,64}(\\.[^.\"\\\\\\u0000-\\u001f]{1,64}){0,7}$"

# gRPC status code names by code (doc/statuscodes.md of grpc/grpc).
GRPC_NAMES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
              "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
              "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
              "UNAUTHENTICATED"]

def mode(desc):
    return {"description": desc, "enum": ["enforce", "shadow"], "default": "enforce"}

def positive(desc, default=None, maximum=4294967295):
    s = {"type": "integer", "minimum": 1, "maximum": maximum, "description": desc}
    if default is not None: s["default"] = default
    return s

schema = {
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "title": "floodgate configuration",
  "description": "The JSON configuration of the floodgate proxy-wasm filter (the `configuration` of Envoy's envoy.filters.http.wasm, or `pluginConfig` of an Istio WasmPlugin). Every section is optional: {} does nothing. Reference: docs/configuration.md. The module's parser also refuses, beyond this schema: duplicate rule names, duplicate class names, a default_class that is not one of the classes, concurrency_limit bounds out of order (min_limit <= initial_limit <= max_limit), a global sync_interval outside 10ms..60s or timeout above 60s, consistency leased without scope global or with a cost from the request body, or from the response without estimate, a partition size above the number of clusters, a max_delay above 60s, a queue max_wait above 60s, a queue target above max_wait or an interval below target, a flow hand_size above its queues or a max_queued above 1024 in a class shared by flow, spill_below without when_unavailable spill, a watchdog worker_silence under 3s or max_loop_lag under 100ms, a watchdog path equal to health.path, a response_body cost without path or sum (or path, sum, max_body_bytes with another source), path with sum, estimate.body with estimate.sum, a sum of more than 8 paths in all, estimate with a request source, estimate.max_body_bytes without estimate.body or estimate.sum, estimate.default above estimate.max, default beside estimate, unreported without estimate, and integers written with a fraction or exponent (5.0, 1e3). `floodgate validate FILE` runs that parser.",
  "type": "object",
  "additionalProperties": False,
  "allOf": [
    {
      "description": "A rule with scope global needs the top-level global section.",
      "if": {"required": ["rate_limits"], "properties": {"rate_limits": {"type": "array", "contains": {"type": "object", "required": ["scope"], "properties": {"scope": {"const": "global"}}}}}},
      "then": {"required": ["global"], "properties": {"global": {"$ref": "#/$defs/global"}}}
    },
    {
      "description": "match.routes cannot be used with cluster_selection: Envoy picks the request's route after floodgate sets its cluster header.",
      "if": {"required": ["cluster_selection"], "properties": {"cluster_selection": {"type": "object"}}},
      "then": {"properties": {"rate_limits": {"items": {"properties": {"match": {"properties": {"routes": {"type": "null"}}}}}}}}
    }
  ],
  "properties": {
    "rate_limits": {
      "description": "Rate-limit rules; every rule that applies to a request must admit it. Rule names must be unique.",
      "type": "array", "items": {"$ref": "#/$defs/rateLimitRule"}, "default": []
    },
    "stat_prefix": {"description": "Prefix of every metric name; give each filter instance its own.", "$ref": "#/$defs/name", "default": "floodgate"},
    "ratelimit_headers": {
      "description": "always: admitted responses also carry ratelimit / ratelimit-policy for the rule with the least remaining quota; on_reject: only 429s do.",
      "enum": ["always", "on_reject"], "default": "always"
    },
    "refusal_format": {"description": "The body of the rules' 429s, unless a rule says otherwise: problem = an RFC 9457 problem document (application/problem+json); openai = OpenAI's error object ({\"error\": {\"message\", \"type\", \"param\", \"code\": \"rate_limit_exceeded\"}}); anthropic = Anthropic's ({\"type\": \"error\", \"error\": {\"type\": \"rate_limit_error\", \"message\"}}); both application/json, with the limit, what remains and the wait in the message and as members. The headers are the same.", "$ref": "#/$defs/refusalFormat", "default": "problem"},
    "load_shedding": {"description": "Shedding on the proxy-wide in-flight count, on each worker's event-loop lag, or both, by priority class (null: none).", "anyOf": [{"$ref": "#/$defs/loadShedding"}, {"type": "null"}]},
    "cluster_selection": {"description": "Chooses the upstream cluster of each request (null: none).", "anyOf": [{"$ref": "#/$defs/clusterSelection"}, {"type": "null"}]},
    "health": {"description": "A path the filter answers itself with its load (null: none).", "anyOf": [{"$ref": "#/$defs/health"}, {"type": "null"}]},
    "watchdog": {"description": "A liveness path the filter answers itself, failing (503) while the proxy is degraded in ways a restart cures: a silent worker, a loop lag that lasts, memory past a bound (null: none).", "anyOf": [{"$ref": "#/$defs/watchdog"}, {"type": "null"}]},
    "global": {"description": "How rules with scope global reach the fleet-wide store through floodgate-sync (null: none).", "anyOf": [{"$ref": "#/$defs/global"}, {"type": "null"}]},
    "grpc": {"$ref": "#/$defs/grpc"},
    "mode": mode("shadow: every mechanism (rate limits, load shedding, the per-key cap, partitions) only counts what it would refuse, and lets the request go on; enforce: each mechanism as its own mode says."),
    "access_log": {"description": "Write each request's decision into Envoy filter state (wasm.<plugin name>.outcome, ...), where access logs read it.", "type": "boolean", "default": False}
  },
  "$defs": {
    "name": {
      "description": "1 to 64 of ASCII letters, digits, '-', '_', '.'.",
      "type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"
    },
    "duration": {
      "description": "A whole number and one unit: \"250ms\", \"10s\", \"1m\", \"1h\"; longer than zero, at most 366 days.",
      "type": "string", "pattern": DURATION,
      "examples": ["250ms", "10s", "1m", "1h"]
    },
    "headerName": {
      "description": "An HTTP header name (RFC 9110 token, case-insensitive); a pseudo-header such as :authority is allowed.",
      "type": "string", "pattern": "^:?[" + TOKEN + "]+$"
    },
    "positive": positive("A positive integer of at most 4294967295."),
    "rateLimitRule": {
      "type": "object", "additionalProperties": False,
      "required": ["name", "key", "limit", "window"],
      "properties": {
        "name": {"description": "Unique among the rules; used in metrics, shared-data keys and responses.", "$ref": "#/$defs/name"},
        "key": {"description": "The parts of the request that make the key, joined in order.", "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/keyPart"}},
        "limit": positive("Units (requests, unless the rule has a cost) admitted per window and key, unless a tier or an override says otherwise."),
        "window": {"description": "The window length.", "$ref": "#/$defs/duration"},
        "capacity": positive("How many distinct keys the rule tracks individually (memory: about 170 bytes per tracked key, see docs/configuration.md#sizing).", 16384, 16777216),
        "missing_key": {
          "description": "A request lacking a key part: skip = the rule does not apply to it; shared = all such requests share one counter.",
          "enum": ["skip", "shared"], "default": "skip"
        },
        "scope": {
          "description": "proxy: the quota holds across the workers of one Envoy; global: across every proxy of the fleet, through the store named in the top-level global section (which it requires).",
          "enum": ["proxy", "global"], "default": "proxy"
        },
        "consistency": {
          "description": "In global scope: batched = each proxy decides on its own counts plus the fleet's as last synced and sends its admissions in batches (no request waits; the fleet may overshoot a little); leased = each proxy takes units of the key's quota from the store ahead of use, shared by its workers, so the fleet never admits more than the limit, and a request waits on the store only when its proxy's lease of the key is empty. leased needs scope global and a cost, if any, from a request header or reserved with estimate.",
          "enum": ["batched", "leased"], "default": "batched"
        },
        "match": {"description": "The rule applies only to requests that meet every condition given (null: to every request).", "anyOf": [{"$ref": "#/$defs/match"}, {"type": "null"}], "default": None},
        "tiers": {"description": "A request header names the key's tier, and each tier its own limit (null: none).", "anyOf": [{"$ref": "#/$defs/tiers"}, {"type": "null"}], "default": None},
        "overrides": {"description": "Keys with a limit of their own (before any tier).", "type": "array", "maxItems": 1024, "items": {"$ref": "#/$defs/override"}, "default": []},
        "cost": {"description": "What a request costs against the rule (null: 1).", "anyOf": [{"$ref": "#/$defs/cost"}, {"type": "null"}], "default": None},
        "refusal_format": {"description": "The body of this rule's 429s (null: the top-level refusal_format).", "anyOf": [{"$ref": "#/$defs/refusalFormat"}, {"type": "null"}], "default": None},
        "mode": mode("shadow: the rule counts the requests it would refuse (a metric) and lets them go on, consuming nothing for them; enforce: it refuses them (unless the top-level mode is shadow)."),
        "algorithm": {
          "description": "How the rule counts: sliding_window = at most limit units per sliding window; token_bucket = a bucket of burst units per key, refilled at limit per window (GCRA), which needs burst and holds in proxy scope only.",
          "enum": ["sliding_window", "token_bucket"], "default": "sliding_window"
        },
        "burst": {"description": "token_bucket (required there, refused otherwise): the units a key may spend at once.", "anyOf": [{"type": "integer", "minimum": 1, "maximum": 1048576}, {"type": "null"}], "default": None},
        "max_delay": {"description": "token_bucket only: a request over the rate whose turn comes within this waits for it instead of being refused (at most 60s; null: refused at once).", "anyOf": [{"$ref": "#/$defs/duration"}, {"type": "null"}], "default": None}
      },
      "allOf": [
        {
          "if": {"required": ["algorithm"], "properties": {"algorithm": {"const": "token_bucket"}}},
          "then": {"required": ["burst"], "properties": {"burst": {"type": "integer"}, "scope": {"const": "proxy"}}},
          "else": {"properties": {"burst": {"type": "null"}, "max_delay": {"type": "null"}}}
        }
      ]
    },
    "match": {
      "type": "object", "additionalProperties": False,
      "properties": {
        "path": {"description": "The request path without its query (null: any).", "anyOf": [{"$ref": "#/$defs/pathMatch"}, {"type": "null"}], "default": None},
        "methods": {"description": "The request method is one of these, exactly (upper case) (null: any).", "anyOf": [{"type": "array", "minItems": 1, "maxItems": 32, "items": {"type": "string", "pattern": "^[A-Z_-]+$"}}, {"type": "null"}], "default": None},
        "headers": {"description": "Conditions on request headers, all of which must hold.", "type": "array", "maxItems": 1024, "items": {"$ref": "#/$defs/headerCondition"}, "default": []},
        "authority": {"description": "The :authority without its port, compared case-insensitively (null: any).", "anyOf": [{"type": "string", "pattern": "^[^/ :]{1,1024}$"}, {"type": "null"}], "default": None},
        "routes": {"description": "The name of the Envoy route the request matched (xds.route_name: the route's name in the route configuration; in Istio, the VirtualService route's name) is one of these (null: any). Not with cluster_selection.", "anyOf": [{"type": "array", "minItems": 1, "maxItems": 1024, "items": {"type": "string", "minLength": 1, "maxLength": 1024}}, {"type": "null"}], "default": None}
      }
    },
    "pathMatch": {
      "description": "Exactly one of exact, prefix and template (the others absent or null).",
      "type": "object", "additionalProperties": False,
      "properties": {
        "exact": {"description": "The whole path.", "anyOf": [{"type": "string", "pattern": "^/[^?#]*$"}, {"type": "null"}], "default": None},
        "prefix": {"description": "The path starts with this.", "anyOf": [{"type": "string", "pattern": "^/[^?#]*$"}, {"type": "null"}], "default": None},
        "template": {"description": "Segment by segment: '*' matches any one non-empty segment (\"/users/*/orders\").", "anyOf": [{"type": "string", "pattern": "^/[^?#]*$"}, {"type": "null"}], "default": None}
      }
    },
    "headerCondition": {
      "description": "A request header and exactly one of present and equals (the other absent or null).",
      "type": "object", "additionalProperties": False, "required": ["name"],
      "properties": {
        "name": {"description": "The header (any case).", "$ref": "#/$defs/headerName"},
        "present": {"description": "true: the request has the header; false: it does not.", "anyOf": [{"type": "boolean"}, {"type": "null"}], "default": None},
        "equals": {"description": "The header's (first) value is exactly this.", "anyOf": [{"type": "string", "minLength": 1, "maxLength": 1024}, {"type": "null"}], "default": None}
      }
    },
    "tiers": {
      "type": "object", "additionalProperties": False, "required": ["header", "limits"],
      "properties": {
        "header": {"description": "The request header naming the tier; absent, or naming no listed tier: the rule's limit.", "$ref": "#/$defs/headerName"},
        "limits": {"description": "Tier name (the header's exact value) to its limit per window.", "type": "object", "minProperties": 1, "maxProperties": 1024, "additionalProperties": positive("The tier's limit per window.")}
      }
    },
    "override": {
      "type": "object", "additionalProperties": False, "required": ["key", "limit"],
      "properties": {
        "key": {"description": "The key's part values, one per part of the rule's key, in order (a header's value; source_ip without port; path without query).", "type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1, "maxLength": 1024}},
        "limit": positive("The key's limit per window.")
      }
    },
    "cost": {
      "type": "object", "additionalProperties": False, "required": ["from"],
      "properties": {
        "from": {"description": "request_header: a count in a request header, charged at admission; request_body: the body's bytes (content-length, or counted as it streams and charged when it ends); response_header: a count the upstream reports in a header, charged when the response arrives; response_body: a count the upstream reports in its body (JSON, or the events of a text/event-stream), read as it streams (only floodgate-llm.wasm reads response bodies).", "enum": ["request_header", "request_body", "response_header", "response_body"]},
        "header": {"description": "The header, for request_header and response_header (null with request_body and response_body).", "anyOf": [{"$ref": "#/$defs/headerName"}, {"type": "null"}], "default": None},
        "default": {"description": "The cost when the header is absent or holds no valid count (null: 1 for request_header, 0 for response_header and response_body; none with request_body or with estimate).", "anyOf": [{"type": "integer", "minimum": 0, "maximum": 4294967295}, {"type": "null"}]},
        "path": {"description": "For response_body: the count's place in the JSON body (or in each event of a text/event-stream), object keys joined by dots, e.g. usage.total_tokens.", "anyOf": [{"type": "string", "pattern": "^[^.\"\\\\\\u0000-\\u001f]{1,64}(\\.[^.\"\\\\\\u0000-\\u001f]{1,64}){0,7}$"}, {"type": "null"}], "default": None},
        "sum": {"description": "For response_body, instead of path: the count as a weighted sum of counts, each at its own places (input tokens + 4 × output tokens); each term's count is the first of its places that has one (in an event stream, each place's last value); the sum is reported once every term has its count. At most 8 paths in all.", "anyOf": [{"$ref": "#/$defs/sum"}, {"type": "null"}], "default": None},
        "max_body_bytes": {"description": "For response_body: the most bytes of a response read for its count (null: 1048576); a longer body is settled as unreported.", "anyOf": [{"$ref": "#/$defs/positive"}, {"type": "null"}], "default": 1048576},
        "estimate": {"description": "For response_header and response_body: what a request reserves at admission (which needs room for it), settled when the count comes.", "anyOf": [{"$ref": "#/$defs/estimate"}, {"type": "null"}], "default": None},
        "unreported": {"description": "With estimate: how a response without a valid count settles (null: reservation). reservation: the estimate stays charged; refund: it is given back.", "anyOf": [{"enum": ["reservation", "refund"]}, {"type": "null"}], "default": "reservation"}
      }
    },
    "estimate": {
      "type": "object", "additionalProperties": False, "required": ["default", "max"],
      "properties": {
        "header": {"description": "A request header holding the estimate (e.g. the request's max_tokens); a request that has it is estimated by it, its body is not read (null: none).", "anyOf": [{"$ref": "#/$defs/headerName"}, {"type": "null"}], "default": None},
        "body": {"description": "Places of the estimate in the request's JSON body, each object keys joined by dots (max_completion_tokens, max_tokens): the first listed that the body holds gives it; the request waits for its body until it is read (needs the plugin's allow_on_headers_stop_iteration: true). null: the body is not read.", "anyOf": [{"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "pattern": "^[^.\"\\\\\\u0000-\\u001f]{1,64}(\\.[^.\"\\\\\\u0000-\\u001f]{1,64}){0,7}$"}}, {"type": "null"}], "default": None},
        "sum": {"description": "Instead of body: the estimate as a weighted sum of counts in the request's JSON body (4 × max_tokens), each term at the first of its places the body holds; a term without a count leaves the request to default. At most 8 paths in all.", "anyOf": [{"$ref": "#/$defs/sum"}, {"type": "null"}], "default": None},
        "max_body_bytes": {"description": "With body or sum: the most bytes of a request body read for the estimate (null: 262144); past it the request reserves default. Keep it below Envoy's per_connection_buffer_limit_bytes (1 MiB by default), which answers 413 to a request whose held body exceeds it.", "anyOf": [{"$ref": "#/$defs/positive"}, {"type": "null"}], "default": 262144},
        "default": positive("The estimate when the header and the body hold no valid count."),
        "max": positive("The largest estimate: a request asking more reserves this.")
      }
    },
    "refusalFormat": {"enum": ["problem", "openai", "anthropic"]},
    "sum": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"$ref": "#/$defs/sumTerm"}},
    "sumTerm": {
      "type": "object", "additionalProperties": False, "required": ["path"],
      "properties": {
        "path": {"description": "Where the term's count is: a path (object keys joined by dots), or a list of paths, the first that has a count giving it (usage.input_tokens where a JSON answer has it, message.usage.input_tokens where a stream does).", "anyOf": [
          {"type": "string", "pattern": PLACE},
          {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "pattern": PLACE}}]},
        "weight": {"description": "What one unit of the count costs.", "type": "integer", "minimum": 1, "maximum": 1000, "default": 1}
      }
    },
    "keyPart": {
      "oneOf": [
        {"description": "source_ip: the downstream peer address without its port; path: without the query; method; authority.", "enum": ["source_ip", "path", "method", "authority"]},
        {"description": "A request header's raw value (an absent header is a missing key part).", "type": "object", "additionalProperties": False, "required": ["header"], "properties": {"header": {"$ref": "#/$defs/headerName"}}}
      ]
    },
    "loadShedding": {
      "type": "object", "additionalProperties": False,
      "anyOf": [
        {"required": ["max_active_requests"], "properties": {"max_active_requests": {"not": {"type": "null"}}}},
        {"required": ["max_loop_lag"], "properties": {"max_loop_lag": {"not": {"type": "null"}}}},
        {"required": ["per_key"], "properties": {"per_key": {"not": {"type": "null"}}}}
      ],
      "allOf": [
        {"if": {"required": ["queue"], "properties": {"queue": {"type": "object"}}},
         "then": {"required": ["max_active_requests"], "properties": {"max_active_requests": {"type": "integer"}}}},
        {"if": {"required": ["classes"], "properties": {"classes": {"type": "array", "contains": {"type": "object", "required": ["queue"], "properties": {"queue": {"type": "object"}}}}}},
         "then": {"required": ["queue"], "properties": {"queue": {"type": "object"}}}},
        {"if": {"required": ["flow"], "properties": {"flow": {"type": "object"}}},
         "then": {"required": ["queue", "max_active_requests"], "properties": {"queue": {"type": "object"}, "max_active_requests": {"type": "integer"}}}},
        {"if": {"required": ["classes"], "properties": {"classes": {"type": "array", "contains": {"type": "object", "required": ["flow"], "properties": {"flow": {"type": "object"}}}}}},
         "then": {"required": ["queue", "max_active_requests"], "properties": {"queue": {"type": "object"}, "max_active_requests": {"type": "integer"}}}}
      ],
      "properties": {
        "max_active_requests": {"description": "Proxy-wide (all workers) limit of requests in flight (null: none; at least one of max_active_requests, max_loop_lag and per_key).", "anyOf": [positive(""), {"type": "null"}], "default": None},
        "max_loop_lag": {"description": "Shed on a worker while its event loop runs timers this late: class c from shed_at(c) * max_loop_lag (null: none; at least one of max_active_requests, max_loop_lag and per_key).", "anyOf": [{"$ref": "#/$defs/duration"}, {"type": "null"}], "default": None},
        "per_key": {"description": "The bulkhead's cap on each key's requests in flight, proxy-wide (null: none).", "anyOf": [{"$ref": "#/$defs/perKey"}, {"type": "null"}], "default": None},
        "queue": {"description": "Load leveling: a request max_active_requests would shed waits for a slot instead, in a bounded queue per class, for a bounded time (null: none, shed at once; needs max_active_requests).", "anyOf": [{"$ref": "#/$defs/queue"}, {"type": "null"}], "default": None},
        "flow": {"description": "Fair shares between flows in every class without its own flow: the class's slots and queue are shared fairly between the flows its key tells apart, and when the queue is full the request shed is one of the flow holding the most (null: none; needs queue and max_active_requests; the class's max_queued at most 1024).", "anyOf": [{"$ref": "#/$defs/flow"}, {"type": "null"}], "default": None},
        "lag_probe_interval": {"description": "How often each worker probes its event loop's lag, from 10ms to 1s (with max_loop_lag).", "$ref": "#/$defs/duration", "default": "100ms"},
        "priority_header": {"description": "The request header whose value names the priority class.", "$ref": "#/$defs/headerName", "default": "x-floodgate-priority"},
        "classes": {
          "description": "Priority classes (unique names); a class is shed once the in-flight count reaches max(1, floor(shed_at * max_active_requests)), or the loop lag shed_at * max_loop_lag.",
          "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/priorityClass"},
          "default": [{"name": "critical", "shed_at": 1.0}, {"name": "normal", "shed_at": 0.9}, {"name": "low", "shed_at": 0.5}]
        },
        "default_class": {"description": "The class of requests without the header or with an unknown value; must be one of the classes.", "$ref": "#/$defs/name", "default": "normal"},
        "retry_after": {"description": "retry-after of a shed request (rounded up to whole seconds, at least 1).", "$ref": "#/$defs/duration", "default": "1s"},
        "mode": mode("shadow: shedding (on the in-flight count and on the loop lag) counts the requests it would shed and lets them go on; enforce: it sheds them (unless the top-level mode is shadow).")
      }
    },
    "perKey": {
      "type": "object", "additionalProperties": False,
      "required": ["key", "max_active_requests"],
      "properties": {
        "key": {"description": "The parts of the request that make the key, as a rate limit's key; a request lacking one is not capped.", "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/keyPart"}},
        "max_active_requests": positive("Requests of one key in flight at most, proxy-wide; the next is refused with 503."),
        "capacity": positive("(key, worker) pairs in flight the cap tracks at once, in sets of 8; a request whose set is full of other keys in flight is refused (untracked).", 4096, 1048576),
        "mode": mode("shadow: the cap counts the requests it would refuse and lets them go on; enforce: it refuses them (unless the top-level mode is shadow).")
      }
    },
    "partition": {
      "description": "Shuffle sharding: each key gets a stable pseudo-random subset of size clusters (uniform over the C(n, size) subsets, the same on every worker and proxy with the same configuration), and cluster selection runs within it.",
      "type": "object", "additionalProperties": False,
      "required": ["key", "size"],
      "properties": {
        "key": {"description": "The parts of the request that make the key, as a rate limit's key; a request lacking one may use every cluster.", "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/keyPart"}},
        "size": positive("Clusters in each key's partition, at most the number of clusters.", None, 64),
        "when_unavailable": {"description": "refuse: members only, 503 when all are at their concurrency limit (a poison key never reaches more than its partition); spill: when all members are full, the other clusters too, and first when every member's success rate is below spill_below.", "enum": ["refuse", "spill"], "default": "refuse"},
        "spill_below": {"description": "With spill only: a member below this success rate is failing, in (0, 1] (null: the default, 0.5).", "anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, {"type": "null"}], "default": 0.5},
        "mode": mode("shadow: a request whose partition has no room goes to any cluster with room, and is counted as a would-be refusal; enforce: the partition holds (unless the top-level mode is shadow).")
      }
    },
    "priorityClass": {
      "type": "object", "additionalProperties": False,
      "required": ["name", "shed_at"],
      "properties": {
        "name": {"description": "The priority header value that selects the class.", "$ref": "#/$defs/name"},
        "shed_at": {"description": "Fraction of max_active_requests (and of max_loop_lag) from which the class is shed, in (0, 1].", "type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "queue": {"description": "The class's own max_queued and max_wait, overriding load_shedding.queue's (null: the section's; needs load_shedding.queue).", "anyOf": [{"$ref": "#/$defs/classQueue"}, {"type": "null"}], "default": None},
        "flow": {"description": "Fair shares between the class's flows, instead of load_shedding.flow (null: the section's).", "anyOf": [{"$ref": "#/$defs/flow"}, {"type": "null"}], "default": None}
      }
    },
    "flow": {
      "description": "A flow key and the fair queues flows are dealt to (shuffle sharding, as Kubernetes API Priority and Fairness): a flow asking less than its fair share of the class's slots gets what it asks, the others share the rest, and no slot idles while a request waits.",
      "type": "object", "additionalProperties": False,
      "required": ["key"],
      "properties": {
        "key": {"description": "The parts of the request that name its flow (a tenant, a client), as a rate limit's key; requests lacking one are one flow.", "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/keyPart"}},
        "queues": positive("Fair queues of the class; more queues, fewer flows share one. The record is 20 + 32 x queues + 16 x waiting bytes.", 64, 128),
        "hand_size": positive("Queues dealt to each flow (at most queues); a flow takes the shortest of its hand and keeps to it while it uses it.", 4, 128)
      }
    },
    "queue": {
      "type": "object", "additionalProperties": False,
      "required": ["max_queued", "max_wait"],
      "properties": {
        "max_queued": positive("Requests of one class waiting at most, proxy-wide; the next is shed at once.", None, 100000),
        "max_wait": {"description": "How long a request waits for a slot at most (at most 60s); then it gets the shed 503.", "$ref": "#/$defs/duration"},
        "order": {"description": "adaptive_lifo: first come first served, newest first once the class's queue has stood for interval; fifo: first come first served always.", "enum": ["adaptive_lifo", "fifo"], "default": "adaptive_lifo"},
        "target": {"description": "CoDel's target: a request that joins a queue standing for interval waits at most this (at most max_wait).", "$ref": "#/$defs/duration", "default": "5ms"},
        "interval": {"description": "CoDel's interval: a class's queue that has not been empty for this long is standing (at least target).", "$ref": "#/$defs/duration", "default": "100ms"}
      }
    },
    "classQueue": {
      "type": "object", "additionalProperties": False,
      "properties": {
        "max_queued": {"description": "The class's max_queued (null: the section's).", "anyOf": [positive("", None, 100000), {"type": "null"}], "default": None},
        "max_wait": {"description": "The class's max_wait, at most 60s (null: the section's).", "anyOf": [{"$ref": "#/$defs/duration"}, {"type": "null"}], "default": None}
      }
    },
    "health": {
      "type": "object", "additionalProperties": False,
      "required": ["path"],
      "properties": {
        "path": {"description": "The path the filter answers for GET and HEAD (matched without the query).", "type": "string", "pattern": "^/[^?#]*$"},
        "dependencies": {"description": "off: the proxy's own load only; report: also the clusters' success rates and limits (needs cluster_selection); fail: as report, and 503 while every cluster's success rate is below min_success_rate.", "enum": ["off", "report", "fail"], "default": "off"},
        "min_success_rate": {"description": "With dependencies fail: a cluster below this success rate counts as failing, in (0, 1].", "type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 0.5}
      }
    },
    "watchdog": {
      "type": "object", "additionalProperties": False,
      "required": ["path"],
      "properties": {
        "path": {"description": "The liveness path the filter answers for GET and HEAD (matched without the query); not health.path.", "type": "string", "pattern": "^/[^?#]*$"},
        "worker_silence": {"description": "A worker whose last heartbeat is older than this, while another worker beats, fails liveness; at least 3s.", "$ref": "#/$defs/duration", "default": "5s"},
        "max_loop_lag": {"description": "A worker's event-loop lag from which it counts as lagging; at least 100ms.", "$ref": "#/$defs/duration", "default": "2s"},
        "lag_for": {"description": "How long a worker must lag past max_loop_lag before liveness fails.", "$ref": "#/$defs/duration", "default": "30s"},
        "max_memory_mb": {"description": "A worker's Wasm linear memory past this many MiB fails liveness (null: not checked).", "anyOf": [{"type": "integer", "minimum": 1, "maximum": 4294967295}, {"type": "null"}], "default": None},
        "recover_after": positive("Heartbeats on time in a row a worker needs, after a silence or a lag, before liveness counts it recovered.", 3, 60)
      }
    },
    "global": {
      "type": "object", "additionalProperties": False,
      "required": ["cluster"],
      "properties": {
        "cluster": {"description": "The Envoy cluster of floodgate-sync (in Istio: outbound|PORT||HOST).", "$ref": "#/$defs/clusterName"},
        "authority": {"description": "The :authority of the batch calls (null: the cluster name).", "anyOf": [{"type": "string", "pattern": "^[A-Za-z0-9._~:%\\[\\]-]{1,255}$"}, {"type": "null"}], "default": None},
        "sync_interval": {"description": "Each proxy sends at most one batch per interval; between 10ms and 60s.", "$ref": "#/$defs/duration", "default": "100ms"},
        "timeout": {"description": "How long a batch call may take before it counts as failed and is sent again; at most 60s.", "$ref": "#/$defs/duration", "default": "1s"},
        "max_keys": positive("Keys per global rule whose fleet-wide counts a proxy keeps.", 4096, 65536),
        "key_secret": {"description": "A secret mixed into the fleet-wide key hashes, the same on every proxy of the fleet (at least 16 characters), so the store's key names do not reveal client keys (null: none).", "anyOf": [{"type": "string", "minLength": 16}, {"type": "null"}], "default": None},
        "token": {"description": "The bearer token sent on every call to floodgate-sync (authorization: Bearer TOKEN), one of those its --token accepts: 16 to 512 characters among A-Z a-z 0-9 - . _ ~ + / = (null: none; floodgate-sync without --token accepts any caller).", "anyOf": [{"type": "string", "pattern": "^[A-Za-z0-9._~+/=-]{16,512}$"}, {"type": "null"}], "default": None},
        "lease_timeout": {"description": "The longest a request waits for the store: a leased rule's call, a batched rule's ask; at most 10s.", "$ref": "#/$defs/duration", "default": "50ms"},
        "on_store_failure": {"description": "Leased rules, when the store fails or does not answer within lease_timeout: last_state = decide on the last counts read from the store plus this proxy's admissions since; refuse = answer 503.", "enum": ["last_state", "refuse"], "default": "last_state"},
        "max_lease": {"description": "Leased rules: the most units a proxy asks for at a time beyond what its waiting requests need (null: no cap but the limit); 1 = every request asks the store and nothing is held between requests, as a rate-limit service does.", "anyOf": [{"type": "integer", "minimum": 1, "maximum": 4294967295}, {"type": "null"}], "default": None}
      }
    },
    "grpcStatus": {
      "description": "A gRPC status code other than OK: its name (upper case) or its number.",
      "oneOf": [
        {"enum": GRPC_NAMES[1:]},
        {"type": "integer", "minimum": 1, "maximum": 16}
      ]
    },
    "grpc": {
      "description": "The gRPC status codes of the filter's refusals of gRPC requests (content-type application/grpc or application/grpc+...), sent as trailers-only responses with grpc-retry-pushback-ms and the HTTP reply's retry-after / ratelimit / ratelimit-policy as metadata. Like Envoy's rate_limited_as_resource_exhausted, per kind of refusal.",
      "type": "object", "additionalProperties": False,
      "properties": {
        "rate_limited_status": {"description": "A rate-limited call (UNAVAILABLE is Envoy's default mapping of a 429, and the code gRPC clients retry).", "$ref": "#/$defs/grpcStatus", "default": "RESOURCE_EXHAUSTED"},
        "shed_status": {"description": "A call shed by load shedding.", "$ref": "#/$defs/grpcStatus", "default": "UNAVAILABLE"},
        "no_capacity_status": {"description": "A call refused because no cluster had room.", "$ref": "#/$defs/grpcStatus", "default": "UNAVAILABLE"}
      }
    },
    "clusterName": {
      "description": "An Envoy cluster name: 1 to 255 visible ASCII characters.",
      "type": "string", "pattern": "^[!-~]{1,255}$"
    },
    "statusMatch": {
      "oneOf": [
        {"description": "A status code.", "type": "integer", "minimum": 100, "maximum": 599},
        {"description": "A class (\"5xx\") or a status code as a string.", "type": "string", "pattern": "^(?:[1-5]xx|\\+?0*[1-5][0-9]{2})$"}
      ]
    },
    "clusterSelection": {
      "type": "object", "additionalProperties": False,
      "required": ["clusters"],
      "properties": {
        "route_header": {"description": "The request header the filter sets to the chosen cluster (overwriting any client value); the Envoy route reads it with cluster_header.", "type": "string", "pattern": "^[" + TOKEN + "]+$", "default": "x-floodgate-cluster"},
        "clusters": {"description": "Envoy cluster names, distinct.", "type": "array", "minItems": 1, "maxItems": 64, "uniqueItems": True, "items": {"$ref": "#/$defs/clusterName"}},
        "bucket_width": {"description": "Width of one stat bucket.", "$ref": "#/$defs/duration", "default": "5s"},
        "buckets": positive("Stat buckets in the rolling window, besides the sticky one.", 6, 60),
        "decay_factor": {"description": "Each bucket weighs this many times less than the next newer one (1: all equal).", "type": "number", "minimum": 1, "maximum": 1000, "default": 3},
        "weight_exponent": {"description": "A cluster's weight is its success rate to this power.", "type": "number", "exclusiveMinimum": 0, "maximum": 100, "default": 3},
        "no_data_floor": {"description": "With only the sticky bucket's data, the success rate is at least this divided by the number of clusters.", "type": "number", "minimum": 0, "maximum": 1, "default": 0.0001},
        "no_data_floor_on": {"description": "weight: the floor bounds the success rate and the weight, so a cluster with only old data keeps a chance of about no_data_floor / clusters per request to be tried again; rate: it bounds the rate only, before weight_exponent (the seed's literal formula).", "enum": ["weight", "rate"], "default": "weight"},
        "failure_statuses": {"description": "Upstream statuses that count as failures (timeouts and resets always do).", "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/statusMatch"}, "default": ["5xx"]},
        "failure_grpc_statuses": {"description": "gRPC statuses of gRPC calls (from grpc-status in the trailers or a trailers-only response) that count as failures; DEADLINE_EXCEEDED always counts as a timeout.", "type": "array", "items": {"$ref": "#/$defs/grpcStatus"}, "default": ["UNAVAILABLE", "INTERNAL", "UNKNOWN", "DATA_LOSS"]},
        "concurrency_limit": {"$ref": "#/$defs/concurrencyLimit"},
        "retry_after": {"description": "retry-after of the 503 sent when no cluster has room.", "$ref": "#/$defs/duration", "default": "1s"},
        "partition": {"description": "Each key confined to a stable subset of the clusters (null: none).", "anyOf": [{"$ref": "#/$defs/partition"}, {"type": "null"}], "default": None}
      }
    },
    "concurrencyLimit": {
      "description": "The per-cluster concurrency limit (AIMD): +1 on a success while at least half of it is in use, times backoff_ratio on a timeout, an overflow or a success slower than timeout; min_limit <= initial_limit <= max_limit.",
      "type": "object", "additionalProperties": False,
      "properties": {
        "algorithm": {"description": "The limit algorithm.", "enum": ["aimd"], "default": "aimd"},
        "initial_limit": positive("The limit of a cluster with no history.", 20),
        "min_limit": positive("The limit never falls below this.", 1),
        "max_limit": positive("The limit never grows above this.", 200),
        "backoff_ratio": {"description": "Multiplier applied on a drop, in (0, 1).", "type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "default": 0.9},
        "timeout": {"description": "A response slower than this counts as a drop for the limit.", "$ref": "#/$defs/duration", "default": "5s"}
      }
    }
  }
}
import sys
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "floodgate.schema.json")
with open(out, "w") as f:
    f.write(json.dumps(schema, indent=2, ensure_ascii=False) + "\n")
print(out)
