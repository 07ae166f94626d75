//! Token quotas as the official LLM SDKs meet them: `openai` and `anthropic` from PyPI
//! (`integration/llm/sdk.py`, installed by `scripts/llm-sdks.sh`) calling through
//! `floodgate-llm.wasm` in a real Envoy (2 workers), in front of the test upstream
//! ([`LlmUpstream`]), which answers as OpenAI's Chat Completions and Responses APIs and
//! Anthropic's Messages API do, as JSON or as event streams, gzip-compressed when asked.
//!
//! * The SDKs retry a `429` after `retry-after-ms` (the exact wait): a run of calls over the
//!   quota is all served, each refused call on its first retry, and the SDK waited the exact
//!   delays.
//! * A rule's `refusal_format` gives the `429` the API's error shape, whose message the SDK
//!   shows: the limit and when to retry.
//! * Through the shipped `envoy/llm.yaml` (its own bootstrap: floodgate, then the answers'
//!   decompression), with clients that accept gzip and an upstream that compresses, every
//!   answer's usage is read: the counts end at the usage reported, exactly.
//! * Without the decompressor, a compressed answer is counted as unreadable, and why.
//! * An Anthropic stream reporting 40 input and 25 output tokens costs 40 + 4 × 25 = 140.
//!
//! Figures are printed (`--nocapture`).

use std::time::Duration;

use bytes::Bytes;
use floodgate_integration::*;

/// One SDK run may take this long at most.
const SDK_LIMIT: Duration = Duration::from_secs(60);

/// A key no earlier run used.
fn fresh_key(name: &str) -> String {
    format!("{name}-{}", since_epoch().as_nanos())
}

/// Keeps the next `seconds` inside one minute's window bucket (a count read from a refusal is
/// then exact: no earlier bucket weighs in).
fn clear_of_minute_end(seconds: u64) {
    let minute = Duration::from_secs(60);
    wait_for_window_phase(minute, Duration::from_secs(1), minute - Duration::from_secs(seconds));
}

fn llm_envoy(config: Value, upstream: &LlmUpstream) -> Envoy {
    Envoy::builder(config).module(llm_wasm_module()).allow_on_headers_stop_iteration().upstream_at(upstream.addr()).start()
}

/// A run of `n` calls through `sdk` to `api` (`stream`ed or not), each asking `max_tokens` and
/// reported `usage` tokens (`prompt` of them input), with extra arguments.
#[allow(clippy::too_many_arguments)]
fn sdk_run(envoy: &Envoy, sdk: &str, api: &str, key: &str, n: u32, stream: bool, usage: (u32, u32), extra: &[&str]) -> Value {
    let base = if sdk == "openai" { envoy.url("/v1") } else { envoy.url("") };
    let (n, total, prompt) = (n.to_string(), usage.0.to_string(), usage.1.to_string());
    let mut args = vec!["--sdk", sdk, "--api", api, "--base-url", &base, "--key", key, "--n", &n, "--usage", &total, "--prompt", &prompt];
    if stream {
        args.push("--stream");
    }
    args.extend_from_slice(extra);
    run_sdk(&args, SDK_LIMIT)
}

/// A 429's exact wait, and the SDK's wait after it (until its next request).
struct Retry {
    told_ms: f64,
    waited_ms: f64,
    /// The status of the retry's answer.
    then: u64,
}

/// The retries of a run, from the exchanges its HTTP client saw.
fn retries(run: &Value) -> Vec<Retry> {
    let exchanges = run["exchanges"].as_array().expect("exchanges");
    let mut retries = Vec::new();
    for (at, exchange) in exchanges.iter().enumerate() {
        if exchange["kind"] != "response" || exchange["status"] != 429 {
            continue;
        }
        let told_ms: f64 = exchange["retry_after_ms"].as_str().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("a 429 without retry-after-ms: {exchange}"));
        let next = exchanges.get(at + 1).filter(|e| e["kind"] == "request").expect("a retry after the 429");
        let then = exchanges.get(at + 2).filter(|e| e["kind"] == "response").and_then(|e| e["status"].as_u64()).unwrap_or(0);
        let waited_ms = (next["t"].as_f64().unwrap_or(0.0) - exchange["t"].as_f64().unwrap_or(0.0)) * 1000.0;
        retries.push(Retry { told_ms, waited_ms, then });
    }
    retries
}

/// With each SDK's default retries (2), a run of calls over a quota (300 tokens per second,
/// each call reserving and using 100) is all served: each refused call is admitted on its
/// first retry, and the SDK waited the exact delays (`retry-after-ms`), within 0.25 s per
/// refusal in all, instead of `retry-after`'s whole seconds. OpenAI's Chat Completions and
/// Anthropic's Messages, JSON and streams, four keys at once.
#[test]
fn the_sdks_retry_after_the_exact_wait_and_are_admitted_on_their_first_retry() {
    let upstream = LlmUpstream::start();
    let rule = |name: &str, path: &str, count: &str| {
        json!({"name": name, "key": [{"header": "authorization"}], "limit": 300, "window": "1s",
               "match": {"path": {"exact": path}},
               "cost": {"from": "response_body", "path": count,
                        "estimate": {"body": ["max_tokens"], "default": 100, "max": 100}}})
    };
    let config = json!({"rate_limits": [rule("chat", "/v1/chat/completions", "usage.total_tokens"), rule("messages", "/v1/messages", "usage.output_tokens")]});
    let envoy = llm_envoy(config, &upstream);
    let runs = [("openai", "chat", false), ("openai", "chat", true), ("anthropic", "messages", false), ("anthropic", "messages", true)];
    let results: Vec<(String, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .iter()
            .map(|&(sdk, api, stream)| {
                let envoy = &envoy;
                scope.spawn(move || {
                    let key = fresh_key(&format!("{sdk}-{api}-{stream}"));
                    (format!("{sdk} {api} stream={stream}"), sdk_run(envoy, sdk, api, &key, 7, stream, (100, 0), &["--max-tokens", "100"]))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("an SDK run")).collect()
    });
    for (name, run) in &results {
        let calls = run["calls"].as_array().expect("calls");
        assert!(calls.iter().all(|c| c["ok"] == true), "{name}: every call served: {run}");
        let retries = retries(run);
        let told: f64 = retries.iter().map(|r| r.told_ms).sum();
        let waited: f64 = retries.iter().map(|r| r.waited_ms).sum();
        let waits: Vec<String> = retries.iter().map(|r| format!("{:.0}/{:.0}", r.told_ms, r.waited_ms)).collect();
        println!("{name}: {} calls, {} refusals, told/waited ms {waits:?}, in all {told:.0}/{waited:.0}", calls.len(), retries.len());
        assert!(retries.len() >= 2, "{name}: the run exceeds the quota");
        assert!(retries.iter().all(|r| r.then == 200), "{name}: each refused call is admitted on its first retry");
        let slack = 250.0 * retries.len() as f64;
        assert!((waited - told).abs() <= slack, "{name}: waited {waited:.0} ms for {told:.0} ms of exact delays (at most {slack} ms apart)");
    }
}

/// With `refusal_format`, the SDKs' errors say the limit and when to retry: the `openai` SDK's
/// `RateLimitError` shows the `message` of OpenAI's error object, the `anthropic` SDK's the
/// whole body of Anthropic's. (Without retries, to see the error.)
#[test]
fn the_sdks_errors_name_the_limit_and_the_wait_in_the_api_s_shape() {
    let upstream = LlmUpstream::start();
    let rule = |name: &str, path: &str, format: &str| {
        json!({"name": name, "key": [{"header": "authorization"}], "limit": 150, "window": "1m",
               "match": {"path": {"exact": path}}, "refusal_format": format,
               "cost": {"from": "response_body", "sum": [{"path": ["usage.input_tokens", "usage.prompt_tokens", "message.usage.input_tokens"]},
                                                         {"path": ["usage.output_tokens", "usage.completion_tokens"]}],
                        "estimate": {"body": ["max_tokens"], "default": 100, "max": 100}}})
    };
    let config = json!({"rate_limits": [rule("chat-tokens", "/v1/chat/completions", "openai"), rule("messages-tokens", "/v1/messages", "anthropic")]});
    let envoy = llm_envoy(config, &upstream);
    clear_of_minute_end(30);
    for (sdk, api, rule, error_type, shape) in [
        ("openai", "chat", "chat-tokens", "RateLimitError", "Error code: 429 - Rate limit reached for quota \"chat-tokens\" of 150 tokens per 1m (used 80, remaining 70)."),
        ("anthropic", "messages", "messages-tokens", "RateLimitError", "'type': 'rate_limit_error', 'message': 'This request would exceed the rate limit quota \"messages-tokens\" of 150 tokens per 1m (used 80, remaining 70)."),
    ] {
        let key = fresh_key(sdk);
        let run = sdk_run(&envoy, sdk, api, &key, 2, false, (80, 30), &["--max-tokens", "100", "--max-retries", "0"]);
        let calls = run["calls"].as_array().expect("calls");
        assert_eq!(calls[0]["ok"], true, "{sdk}: the first call fits: {run}");
        let error = calls[1]["error"].as_str().unwrap_or_default();
        println!("{sdk}: {}: {error}", calls[1]["error_type"]);
        assert_eq!(calls[1]["error_type"], error_type, "{sdk}: {run}");
        assert!(error.contains(shape), "{sdk}: the message names the limit: {error}");
        assert!(error.contains("Please try again in "), "{sdk}: and when to retry: {error}");
        assert_eq!(envoy.stat(&rule_stat(rule, "rejected")), Some(1));
    }
}

/// The shipped `envoy/llm.yaml`, started as it is (its ports, module path and upstream set by
/// the test): clients that accept gzip (the SDKs' own `accept-encoding`), an upstream that
/// compresses: every answer's usage is read, and each rule's count ends at input + 4 × output
/// of what was reported, exactly (reserved − refunded + charged); nothing is unreadable. Each
/// API through its SDK, JSON and streams, and Anthropic's older `x-api-key` through a plain
/// client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_answers_settle_exactly_through_the_shipped_config() {
    let upstream = LlmUpstream::start();
    upstream.compress(true);
    let text = std::fs::read_to_string(workspace_root().join("envoy/llm.yaml")).expect("envoy/llm.yaml");
    let mut bootstrap: Value = serde_norway::from_str(&text).expect("YAML");
    bootstrap["admin"]["address"]["socket_address"] = json!({"address": "127.0.0.1", "port_value": 0});
    let listener = &mut bootstrap["static_resources"]["listeners"][0];
    listener["address"]["socket_address"] = json!({"address": "127.0.0.1", "port_value": 0});
    let filters = &mut listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"];
    let names: Vec<&str> = filters.as_array().expect("filters").iter().filter_map(|f| f["name"].as_str()).collect();
    assert_eq!(names, ["envoy.filters.http.wasm", "envoy.filters.http.header_mutation", "envoy.filters.http.decompressor", "envoy.filters.http.router"]);
    filters[0]["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = json!(llm_wasm_module().display().to_string());
    let cluster = &mut bootstrap["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    *cluster = json!({"address": "127.0.0.1", "port_value": upstream.addr().port()});
    let envoy = Envoy::from_bootstrap(&bootstrap);

    // (rule, SDK, API, stream, max tokens, total, input): each reserves 4 × max tokens.
    let calls = [
        ("chat-tokens", "openai", "chat", false, 100u32, 65u32, 40u32),
        ("chat-tokens", "openai", "chat", true, 100, 30, 10),
        ("responses-tokens", "openai", "responses", false, 100, 65, 40),
        ("responses-tokens", "openai", "responses", true, 100, 50, 20),
        ("messages-tokens", "anthropic", "messages", false, 100, 65, 40),
        ("messages-tokens", "anthropic", "messages", true, 100, 65, 40),
    ];
    let mut used = std::collections::BTreeMap::<&str, u64>::new();
    let mut reserved = std::collections::BTreeMap::<&str, u64>::new();
    for (rule, sdk, api, stream, max_tokens, total, input) in calls {
        let key = fresh_key(api);
        let run = sdk_run(&envoy, sdk, api, &key, 1, stream, (total, input), &["--max-tokens", &max_tokens.to_string()]);
        let exchanges = run["exchanges"].as_array().expect("exchanges");
        let accept = exchanges[0]["accept_encoding"].as_str().unwrap_or_default();
        assert!(accept.contains("gzip"), "{sdk} {api}: the client accepts gzip ({accept})");
        assert_eq!(run["calls"][0]["ok"], true, "{sdk} {api} stream={stream}: {run}");
        assert_eq!(run["calls"][0]["text"], "Hello there", "{sdk} {api} stream={stream}: the whole answer");
        *used.entry(rule).or_default() += u64::from(input + 4 * (total - input));
        *reserved.entry(rule).or_default() += u64::from(4 * max_tokens);
    }
    // Anthropic's older SDKs: the key in x-api-key, no authorization.
    let mut client = Client::connect(envoy.addr()).await.expect("connect");
    let key = fresh_key("x-api-key");
    let headers = [("x-api-key", key.as_str()), ("accept-encoding", "gzip, deflate"), ("x-test-usage", "65"), ("x-test-prompt", "40"), ("content-type", "application/json")];
    let body = Bytes::from_static(br#"{"model":"claude-test","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#);
    let response = client.send("POST", "/v1/messages", &headers, body).await.expect("a response");
    assert_eq!(response.status, 200);
    assert!(String::from_utf8_lossy(&response.body).contains("message_delta"), "a plain stream reaches the client");
    used.insert("messages-tokens-x-api-key", 40 + 4 * 25);
    reserved.insert("messages-tokens-x-api-key", 400);

    assert_eq!(upstream.compressed(), 7, "the upstream compressed every answer");
    for (rule, used) in &used {
        let stat = |what: &str| envoy.stat(&rule_stat(rule, what)).unwrap_or(0);
        let count = reserved[rule] - stat("refunded") + stat("charged");
        println!("{rule}: reserved {}, refunded {}, charged {}: count {count}, reported {used}", reserved[rule], stat("refunded"), stat("charged"));
        assert_eq!((stat("unreported"), stat("unreadable"), stat("unreadable_compressed")), (0, 0, 0), "{rule}: every answer read");
        assert_eq!(count, *used, "{rule}: the count is the usage reported, exactly");
    }
}

/// Without the decompressor (the harness's Envoy: floodgate, then the router), a compressed
/// answer cannot be read: it is settled as unreported (the reservation stays), counted in
/// `unreadable` and `unreadable_compressed`, and the log says why, once per worker at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_answer_without_the_decompressor_is_counted_and_said_once() {
    let upstream = LlmUpstream::start();
    upstream.compress(true);
    let config = json!({"rate_limits": [{"name": "tokens", "key": [{"header": "x-api-key"}], "limit": 1000, "window": "1m",
                         "cost": {"from": "response_body", "path": "usage.total_tokens", "estimate": {"body": ["max_tokens"], "default": 100, "max": 100}}}]});
    let envoy = llm_envoy(config, &upstream);
    let key = fresh_key("gzip");
    for _ in 0..4 {
        let mut client = Client::connect(envoy.addr()).await.expect("connect");
        let headers = [("x-api-key", key.as_str()), ("accept-encoding", "gzip"), ("x-test-usage", "30"), ("content-type", "application/json")];
        let response = client.send("POST", "/v1/chat/completions", &headers, Bytes::from_static(br#"{"max_tokens":100}"#)).await.expect("a response");
        assert_eq!((response.status, response.header("content-encoding")), (200, Some("gzip")), "the answer goes on as it came");
    }
    let stat = |what: &str| envoy.stat(&rule_stat("tokens", what)).unwrap_or(0);
    assert_eq!((stat("unreported"), stat("unreadable"), stat("unreadable_compressed"), stat("refunded")), (4, 4, 4, 0));
    let said = envoy.log().matches("came compressed (content-encoding: gzip)").count();
    println!("unreadable_compressed {}, said {said} times", stat("unreadable_compressed"));
    assert!((1..=2).contains(&said), "said once per worker at most: {said}");
}

/// An Anthropic stream (the SDK's own, `stream=True`) reporting 40 input tokens in
/// `message_start` and 25 output tokens in `message_delta`, under a rule weighting output × 4:
/// the count is 140 (the `estimate` of a refusal in Anthropic's shape says so).
#[test]
fn an_anthropic_stream_of_40_input_and_25_output_tokens_counts_140() {
    let upstream = LlmUpstream::start();
    let config = json!({"rate_limits": [{"name": "messages", "key": [{"header": "authorization"}], "limit": 1000, "window": "1m",
                         "refusal_format": "anthropic",
                         "cost": {"from": "response_body",
                                  "sum": [{"path": ["usage.input_tokens", "message.usage.input_tokens"]}, {"path": "usage.output_tokens", "weight": 4}],
                                  "estimate": {"sum": [{"path": "max_tokens", "weight": 4}], "default": 400, "max": 1000}}}]});
    let envoy = llm_envoy(config, &upstream);
    clear_of_minute_end(20);
    let key = fresh_key("anthropic");
    let run = sdk_run(&envoy, "anthropic", "messages", &key, 1, true, (65, 40), &["--max-tokens", "100"]);
    assert_eq!(run["calls"][0]["ok"], true, "{run}");
    // 4 × 250 = 1000 reserved does not fit beside 140: refused, saying the count.
    let refused = sdk_run(&envoy, "anthropic", "messages", &key, 1, true, (0, 0), &["--max-tokens", "250", "--max-retries", "0"]);
    let error = refused["calls"][0]["error"].as_str().unwrap_or_default();
    println!("{error}");
    assert!(error.contains("'estimate': 140.0") && error.contains("(used 140, remaining 860)"), "the count is 40 + 4 × 25 = 140: {error}");
    assert_eq!(envoy.stat(&rule_stat("messages", "refunded")), Some(400 - 140));
}
