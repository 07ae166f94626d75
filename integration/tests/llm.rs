//! Token quotas for LLM APIs, end to end in a real Envoy (2 workers) loading
//! `floodgate-llm.wasm`, in front of an OpenAI-like upstream ([`LlmUpstream`]) that reports the
//! token counts each request asks for, as a JSON body or as a server-sent-event stream.
//!
//! A rule of 1 000 tokens per minute reserves each request's estimate (the `max_tokens` of its
//! JSON body, 100, as OpenAI-compatible clients send it; or, in one test, the `x-max-tokens`
//! header) at admission and settles it to the count the response reports (30). The plugin sets
//! `allow_on_headers_stop_iteration`, so that a request paused on its headers hands its body to
//! the filter. Concurrent requests never
//! have more estimates in flight than the quota holds; when they settle, the unused part goes
//! back and further requests are admitted; the key's count ends equal to the reported usage.
//! A key's count is read from a refusal's `estimate` (a request whose estimate is the whole
//! quota), within one window bucket (the test keeps clear of the minute's end), so it is exact.
//! Figures are printed (`--nocapture`).

use std::time::{Duration, Instant};

use bytes::Bytes;
use floodgate_integration::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MINUTE: Duration = Duration::from_secs(60);
const RULE: &str = "tokens";

fn config(extra_cost: serde_json::Value) -> Value {
    let mut cost = json!({"from": "response_body", "path": "usage.total_tokens",
                          "estimate": {"body": ["max_completion_tokens", "max_tokens"], "default": 256, "max": 4096}});
    if let (Some(cost), Some(extra)) = (cost.as_object_mut(), extra_cost.as_object()) {
        cost.extend(extra.clone());
    }
    json!({"rate_limits": [{"name": RULE, "key": [{"header": "x-api-key"}], "limit": 1000, "window": "1m", "cost": cost}]})
}

/// The LLM module in Envoy (2 workers) in front of `upstream`, the body handed to the filter
/// while it decides.
fn llm_envoy(config: Value, upstream: &LlmUpstream) -> Envoy {
    Envoy::builder(config)
        .module(llm_wasm_module())
        .allow_on_headers_stop_iteration()
        .request_body_buffer_limit(BODY_BUFFER_LIMIT)
        .upstream_at(upstream.addr())
        .start()
}

/// The routes' `request_body_buffer_limit`, as envoy/llm.yaml sets it: the estimate's bound
/// (256 KiB) and one read of the listener (1 MiB) fit in it.
const BODY_BUFFER_LIMIT: u64 = 2 << 20;

/// A key no earlier run used (counts live in Envoy's shared data only, but be safe).
fn fresh_key(name: &str) -> String {
    format!("{name}-{}", since_epoch().as_nanos())
}

/// Keeps the next `seconds` inside one window bucket.
fn clear_of_minute_end(seconds: u64) {
    wait_for_window_phase(MINUTE, Duration::from_secs(1), MINUTE - Duration::from_secs(seconds));
}

/// One chat completion request whose body's `max_tokens` is `max_tokens` (raw JSON: `100`,
/// `-1`, `"abc"`); returns its status and body.
async fn chat(envoy: &Envoy, key: &str, max_tokens: &str, usage: u64, mode: &str) -> (u16, Bytes) {
    chat_padded(envoy, key, max_tokens, usage, mode, 0).await
}

/// [`chat`], the answer padded with `pad` more bytes of content.
async fn chat_padded(envoy: &Envoy, key: &str, max_tokens: &str, usage: u64, mode: &str, pad: usize) -> (u16, Bytes) {
    let body = format!(r#"{{"model":"test","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"hi"}}]}}"#);
    chat_body(envoy, key, Bytes::from(body), usage, mode, pad).await
}

/// A chat completion request with this body.
async fn chat_body(envoy: &Envoy, key: &str, body: Bytes, usage: u64, mode: &str, pad: usize) -> (u16, Bytes) {
    let mut client = Client::connect(envoy.addr()).await.expect("connect");
    let usage = usage.to_string();
    let pad = pad.to_string();
    let headers = [("x-api-key", key), ("x-test-usage", usage.as_str()), ("x-test-mode", mode), ("x-test-pad", pad.as_str()), ("content-type", "application/json")];
    let response = client.send("POST", "/v1/chat/completions", &headers, body).await.expect("a response");
    (response.status, response.body)
}

/// The key's count: the `estimate` of a refusal of a request whose estimate is the whole quota.
async fn count(envoy: &Envoy, key: &str) -> f64 {
    let (status, body) = chat(envoy, key, "4096", 0, "json").await;
    assert_eq!(status, 429, "a request of the whole quota is refused while the key has a count: {}", String::from_utf8_lossy(&body));
    let body: Value = serde_json::from_slice(&body).expect("a problem+json body");
    body["estimate"].as_f64().expect("an estimate")
}

/// How a request tells its estimate.
#[derive(Clone, Copy, PartialEq)]
enum Ask {
    /// `max_tokens` in its JSON body.
    Body,
    /// The `x-max-tokens` header (its body without `max_tokens`).
    Header,
}

/// `n` concurrent requests of estimate 100 and usage 30 while the upstream holds them: returns
/// (admitted, refused, the most the upstream held at once), after releasing them.
async fn concurrent_round(envoy: &Envoy, upstream: &LlmUpstream, key: &str, n: usize, mode: &str, ask: Ask) -> (usize, usize, u64) {
    upstream.hold();
    let arrived_before = upstream.arrived();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (addr, key, mode) = (envoy.addr(), key.to_owned(), mode.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await.expect("connect");
            let mut headers = vec![("x-api-key", key.as_str()), ("x-test-usage", "30"), ("x-test-mode", mode.as_str())];
            let body = if ask == Ask::Header {
                headers.push(("x-max-tokens", "100"));
                Bytes::from_static(br#"{"model":"test","stream":true,"messages":[]}"#)
            } else {
                Bytes::from_static(br#"{"model":"test","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":100}"#)
            };
            let response = client.send("POST", "/v1/chat/completions", &headers, body).await.expect("a response");
            (response.status, response.body)
        }));
    }
    // The refused come back at once; the admitted wait at the upstream.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut refused = 0;
    let mut pending = Vec::new();
    for task in tasks {
        if task.is_finished() {
            let (status, _) = task.await.expect("task");
            assert_eq!(status, 429);
            refused += 1;
        } else {
            pending.push(task);
        }
    }
    // Let every request arrive somewhere: the upstream or a 429.
    loop {
        let finished = pending.iter().filter(|t| t.is_finished()).count();
        let arrived = usize::try_from(upstream.arrived() - arrived_before).unwrap_or(usize::MAX);
        if refused + finished + arrived >= n || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = upstream.held();
    let most = upstream.most_held();
    upstream.release();
    let mut admitted = 0;
    for task in pending {
        let (status, body) = task.await.expect("task");
        match status {
            200 => {
                admitted += 1;
                assert!(body.len() > 20, "a whole answer");
            }
            429 => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(held, most, "every admitted request waited at once");
    (admitted, refused, most)
}

/// JSON answers: 20 concurrent requests of estimate 100 under 1 000 tokens: 10 in flight at
/// once, 10 refused; as they settle to 30 each, 7 of the next 20 fit, then 4; the key's count
/// equals the reported usage exactly, and every unused unit went back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_cannot_overrun_a_token_quota_json() {
    let upstream = LlmUpstream::start();
    let envoy = llm_envoy(config(json!({})), &upstream);
    clear_of_minute_end(30);
    let key = fresh_key("json");
    let mut expected = 0u64;
    for (round, want) in [10usize, 7, 4].into_iter().enumerate() {
        let (admitted, refused, most) = concurrent_round(&envoy, &upstream, &key, 20, "json", Ask::Body).await;
        expected += 30 * u64::try_from(admitted).unwrap_or(0);
        let now = count(&envoy, &key).await;
        println!("round {round}: admitted {admitted}, refused {refused}, most in flight {most}, count {now}");
        assert_eq!((admitted, refused, most), (want, 20 - want, u64::try_from(want).unwrap_or(0)), "round {round}");
        assert_eq!(now, expected as f64, "the count is the reported usage, exactly");
    }
    assert_eq!(upstream.reported(), expected);
    let stat = |what: &str| envoy.stat(&rule_stat(RULE, what)).unwrap_or(0);
    println!("allowed {}, rejected {}, refunded {}, charged {}, unreported {}", stat("allowed"), stat("rejected"), stat("refunded"), stat("charged"), stat("unreported"));
    assert_eq!(stat("refunded"), 70 * (expected / 30), "each admitted request gave 70 back");
    assert_eq!((stat("charged"), stat("unreported")), (0, 0));
}

/// The same through event streams, the usage in the last event; then a stream the client cuts
/// mid-way is settled by the policy (`unreported: reservation`): its estimate stays charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_cannot_overrun_a_token_quota_sse() {
    let upstream = LlmUpstream::start();
    let envoy = llm_envoy(config(json!({})), &upstream);
    clear_of_minute_end(30);
    let key = fresh_key("sse");
    let (admitted, refused, most) = concurrent_round(&envoy, &upstream, &key, 20, "sse", Ask::Body).await;
    let now = count(&envoy, &key).await;
    println!("streams: admitted {admitted}, refused {refused}, most in flight {most}, count {now}");
    assert_eq!((admitted, refused, most), (10, 10, 10));
    assert_eq!(now, 300.0);
    let (admitted, _, _) = concurrent_round(&envoy, &upstream, &key, 20, "sse", Ask::Body).await;
    assert_eq!(admitted, 7);
    assert_eq!(count(&envoy, &key).await, 510.0);

    // A stream the client cuts after its first events: the reservation (100) stays.
    let cut_key = fresh_key("cut");
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: floodgate.test\r\nx-api-key: {cut_key}\r\nx-test-usage: 30\r\nx-test-mode: sse-hang\r\ncontent-length: 18\r\n\r\n{{\"max_tokens\":100}}"
    );
    let mut stream = tokio::net::TcpStream::connect(envoy.addr()).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("there") {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await.expect("events in time").expect("read");
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(buf.get(..n).unwrap_or_default());
    }
    drop(stream);
    let unreported = rule_stat(RULE, "unreported");
    assert_eq!(envoy.wait_for_stat(&unreported, 1, Duration::from_secs(10)), Some(1), "the cut stream is settled");
    assert_eq!(count(&envoy, &cut_key).await, 100.0, "cut: the reservation stays charged");
}

/// Bad answers and bad estimates, each on a key of its own: a 10 MiB body (past
/// `max_body_bytes`), a truncated JSON, a stream without a usage event, a stream longer than
/// `max_body_bytes` (its usage event past it) settle by the policy
/// (the estimate, 100, stays) and are counted; a body's `max_tokens` of `-1`, `1e9` or `"abc"`
/// reserves the rule's default (256), is counted as invalid, and settles to the reported 30; a
/// body without it, or not JSON, reserves the default uncounted. The VM lives on: a plain
/// request after them all is settled exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_answers_and_estimates_settle_as_documented() {
    let upstream = LlmUpstream::start();
    let envoy = llm_envoy(config(json!({})), &upstream);
    clear_of_minute_end(40);
    let stat = |what: &str| envoy.stat(&rule_stat(RULE, what)).unwrap_or(0);
    for (mode, unreadable, pad) in [("huge", 1, 0), ("truncated", 0, 0), ("sse-no-usage", 0, 0), ("sse", 1, 1 << 20)] {
        let key = fresh_key(mode);
        let before = (stat("unreported"), stat("unreadable"));
        let started = Instant::now();
        let (status, body) = chat_padded(&envoy, &key, "100", 30, mode, pad).await;
        println!("{mode}: {status}, {} bytes in {:?}", body.len(), started.elapsed());
        assert_eq!(status, 200);
        if mode == "huge" {
            assert!(body.len() > HUGE_BODY_BYTES, "the whole body went through");
        }
        assert_eq!(count(&envoy, &key).await, 100.0, "{mode}: the reservation stays");
        assert_eq!((stat("unreported") - before.0, stat("unreadable") - before.1), (1, unreadable), "{mode}: counted");
    }
    for bad in ["-1", "1e9", "\"abc\""] {
        let key = fresh_key("bad");
        let before = stat("invalid_cost");
        assert_eq!(chat(&envoy, &key, bad, 30, "json").await.0, 200);
        assert_eq!(stat("invalid_cost") - before, 1, "{bad}: counted");
        assert_eq!(count(&envoy, &key).await, 30.0, "{bad}: settled to the report");
    }
    // The default (256) is what an invalid estimate reserves: with 800 used, it no longer fits.
    let key = fresh_key("default");
    for _ in 0..8 {
        assert_eq!(chat(&envoy, &key, "100", 100, "json").await.0, 200);
    }
    let before = stat("invalid_cost");
    assert_eq!(chat(&envoy, &key, "\"abc\"", 1, "json").await.0, 429, "256 > 200 left");
    assert_eq!(stat("invalid_cost") - before, 1, "counted");
    let without = Bytes::from_static(br#"{"model":"test","messages":[{"role":"user","content":"hi"}]}"#);
    assert_eq!(chat_body(&envoy, &key, without, 1, "json", 0).await.0, 429, "no max_tokens: the default, 256 > 200 left");
    assert_eq!(chat_body(&envoy, &key, Bytes::from_static(b"max_tokens=100"), 1, "json", 0).await.0, 429, "not JSON: the default");
    assert_eq!(chat_body(&envoy, &key, Bytes::from_static(br#"{"model":"test","max_tok"#), 1, "json", 0).await.0, 429, "truncated: the default");
    assert_eq!(stat("invalid_cost") - before, 1, "absent, not JSON, truncated: not counted as invalid");
    assert_eq!(chat(&envoy, &key, "200", 1, "json").await.0, 200, "200 fits");
    assert_eq!(count(&envoy, &key).await, 801.0);
    assert!(!envoy.log().contains("panicked"), "no VM crash");
}

/// The estimate in the `x-max-tokens` header (a gateway that computes it): the same quota holds,
/// and the body is not read (the header wins).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_estimate_in_a_header_holds_the_quota_too() {
    let upstream = LlmUpstream::start();
    let with_header = json!({"estimate": {"header": "x-max-tokens", "body": ["max_tokens"], "default": 256, "max": 4096}});
    let envoy = llm_envoy(config(with_header), &upstream);
    clear_of_minute_end(30);
    let key = fresh_key("header");
    let (admitted, refused, most) = concurrent_round(&envoy, &upstream, &key, 20, "json", Ask::Header).await;
    println!("header: admitted {admitted}, refused {refused}, most in flight {most}");
    assert_eq!((admitted, refused, most), (10, 10, 10));
    assert_eq!(count(&envoy, &key).await, 300.0);
}

/// A client that sends its headers and part of its body, then goes away while the request waits
/// for the estimate: nothing was taken, nothing is left. The in-flight limit is 1: a permit left
/// behind would shed the next request; the key's count is untouched: a request of the whole
/// quota (1 000) is admitted after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_its_body_ends_leaves_nothing_behind() {
    let upstream = LlmUpstream::start();
    let mut config = config(json!({}));
    config["load_shedding"] = json!({"max_active_requests": 1});
    let envoy = llm_envoy(config, &upstream);
    clear_of_minute_end(30);
    let key = fresh_key("gone");
    for _ in 0..3 {
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: floodgate.test\r\nx-api-key: {key}\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{{\"model\":\"test\",\"messages\":[{{\"role\":\"user\",\"content\":\"hel"
        );
        let mut stream = tokio::net::TcpStream::connect(envoy.addr()).await.expect("connect");
        stream.write_all(head.as_bytes()).await.expect("send");
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(stream);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stat = |what: &str| envoy.stat(&rule_stat(RULE, what)).unwrap_or(0);
    assert_eq!((stat("allowed"), stat("rejected"), upstream.arrived()), (0, 0, 0), "never decided, never sent on");
    let (status, body) = chat(&envoy, &key, "1000", 30, "json").await;
    assert_eq!(status, 200, "the whole quota is there and the in-flight slot free: {}", String::from_utf8_lossy(&body));
    assert_eq!(count(&envoy, &key).await, 30.0);
    assert!(!envoy.log().contains("panicked"), "no VM crash");
}

/// A request body of 3 MiB goes on whole: with `max_completion_tokens` at its start, the
/// estimate is read from it (100: 70 refunded); with `max_tokens` after 3 MiB of prompt, past
/// `estimate.max_body_bytes` (256 KiB by default), the request reserves the default (256: 226
/// refunded). The same when its first kilobyte comes alone and the rest at once: Envoy holds the
/// kilobyte, then reads up to its listener's buffer limit (1 MiB) in one go, more than that limit
/// in all; the route's `request_body_buffer_limit` holds it (without it: a `413` from Envoy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_request_body_is_read_up_to_the_bound_and_goes_on_whole() {
    let upstream = LlmUpstream::start();
    let envoy = llm_envoy(config(json!({})), &upstream);
    clear_of_minute_end(30);
    let prompt = "x".repeat(3 << 20);
    let stat = |what: &str| envoy.stat(&rule_stat(RULE, what)).unwrap_or(0);
    for (first, refund) in [(true, 70), (false, 226)] {
        let body = if first {
            format!(r#"{{"max_completion_tokens":100,"model":"test","messages":[{{"role":"user","content":"{prompt}"}}]}}"#)
        } else {
            format!(r#"{{"model":"test","messages":[{{"role":"user","content":"{prompt}"}}],"max_tokens":100}}"#)
        };
        let len = u64::try_from(body.len()).unwrap_or(0);
        let key = fresh_key("large");
        let before = stat("refunded");
        let started = Instant::now();
        let (status, answer) = chat_body(&envoy, &key, Bytes::from(body), 30, "json", 0).await;
        println!("3 MiB body, estimate first {first}: {status} in {:?}", started.elapsed());
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        assert_eq!(upstream.last_body_bytes(), len, "the whole body reached the upstream");
        assert_eq!(stat("refunded") - before, refund, "estimate first: {first}");
        assert_eq!(count(&envoy, &key).await, 30.0);
    }
    let body = format!(r#"{{"model":"test","messages":[{{"role":"user","content":"{prompt}"}}],"max_tokens":100}}"#);
    let key = fresh_key("large-split");
    let before = stat("refunded");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: floodgate.test\r\nx-api-key: {key}\r\nx-test-usage: 30\r\nx-test-mode: json\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(envoy.addr()).await.expect("connect");
    stream.write_all(head.as_bytes()).await.expect("send");
    stream.write_all(&body.as_bytes()[..1024]).await.expect("send");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stream.write_all(&body.as_bytes()[1024..]).await.expect("send the rest");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("the answer");
    let answer = String::from_utf8_lossy(&answer);
    println!("3 MiB body, its first kilobyte alone: {}", answer.lines().next().unwrap_or_default());
    assert!(answer.starts_with("HTTP/1.1 200"), "{}", answer.get(..400).unwrap_or(&answer));
    assert_eq!(upstream.last_body_bytes(), u64::try_from(body.len()).unwrap_or(0), "the whole body reached the upstream");
    assert_eq!(stat("refunded") - before, 226);
    assert_eq!(count(&envoy, &key).await, 30.0);
}

/// Without `allow_on_headers_stop_iteration`, Envoy holds the body back from the filter: a
/// request is decided without it after about a second (the tick), on `estimate.default` (256),
/// and goes on with its body. After two such requests a worker stops waiting for bodies: the
/// requests after them are decided on their headers, on the default, at once, and the log says
/// what to set. So of ten requests on two workers, at most four wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_body_in_the_filter_requests_are_decided_on_the_default_and_soon_without_waiting() {
    let upstream = LlmUpstream::start();
    let envoy = Envoy::builder(config(json!({}))).module(llm_wasm_module()).upstream_at(upstream.addr()).start();
    clear_of_minute_end(40);
    let key = fresh_key("held-back");
    let stat = |what: &str| envoy.stat(&rule_stat(RULE, what)).unwrap_or(0);
    let mut waits = Vec::new();
    for _ in 0..10 {
        let started = Instant::now();
        let (status, body) = chat(&envoy, &key, "100", 30, "json").await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert!(upstream.last_body_bytes() > 0, "the body went on");
        waits.push(started.elapsed());
    }
    println!("decided without the body after {waits:?}");
    assert!(waits[0] >= Duration::from_millis(900), "the first waited for its body: {waits:?}");
    let waited = waits.iter().filter(|w| **w >= Duration::from_millis(900)).count();
    assert!((2..=4).contains(&waited), "two per worker wait, then none: {waits:?}");
    assert_eq!(stat("refunded"), 10 * (256 - 30), "the default was reserved each time");
    assert_eq!(stat("invalid_cost"), 0);
    assert!(envoy.log().contains("decided on their headers from now on"), "the log says so");
    assert!(envoy.log().contains("allow_on_headers_stop_iteration"), "the log says what to set");
}

/// The default (trimmed) module has no response body callback: it refuses a body-reported
/// cost, naming the field; the LLM module loads the same configuration.
#[test]
fn the_trimmed_module_refuses_a_body_reported_cost() {
    let log = Envoy::start_expecting_failure(config(json!({})));
    assert!(log.contains("rate_limits[0].cost.from") && log.contains("floodgate-llm.wasm"), "{}", tail(&log, 20));
}

fn tail(log: &str, lines: usize) -> String {
    let all: Vec<&str> = log.lines().collect();
    all.get(all.len().saturating_sub(lines)..).unwrap_or_default().join("\n")
}

/// The shipped examples (envoy/llm.yaml, envoy/istio/llm-wasmplugin.yaml) hold the same
/// configuration (envoy/llm.yaml runs as shipped in `tests/llm_sdk.rs`).
#[test]
fn the_shipped_examples_hold_the_same_rules() {
    let read = |path: &str| {
        let text = std::fs::read_to_string(workspace_root().join(path)).expect("the example");
        let found = floodgate_cli::find_configurations(path, text.as_bytes(), Default::default()).expect("configurations");
        let bytes = found.into_iter().next().and_then(|f| f.bytes.ok()).expect("a floodgate configuration");
        serde_json::from_slice::<Value>(&bytes).expect("JSON")
    };
    let config = read("envoy/llm.yaml");
    assert_eq!(config, read("envoy/istio/llm-wasmplugin.yaml"), "the two examples agree");
    let names: Vec<&str> = config["rate_limits"].as_array().expect("rules").iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ["chat-tokens", "responses-tokens", "messages-tokens", "messages-tokens-x-api-key"]);
}

