//! gRPC end to end: the built module in a real Envoy (2 workers) in front of real
//! gRPC servers, called by a real gRPC client (grpcio, gRPC's C core: `integration/grpc/peer.py`)
//! over HTTP/2, and loaded by h2load. Each test starts its own Envoy and servers. Figures are
//! printed (`--nocapture`).

use std::time::{Duration, Instant};

use floodgate_integration::grpc::{client, client_in_background, grpc_frame, h2load, h2load_killed_after, Calls, GrpcServer};
use floodgate_integration::*;

const ROUTE_HEADER: &str = "x-floodgate-cluster";

fn cluster_stat(cluster: &str, what: &str) -> String {
    format!("{STAT_PREFIX}.cluster.{cluster}.{what}")
}

fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(name).unwrap_or(0)
}

/// A metadata value of a call as text.
fn meta<'a>(call: &'a Value, kind: &str, name: &str) -> &'a str {
    call[kind][name].as_str().unwrap_or_else(|| panic!("no {kind} metadata {name} in {call}"))
}

/// The health endpoint's in-flight count.
fn in_flight(envoy: &Envoy) -> u64 {
    let (status, body) = http_get_blocking(envoy.addr(), HEALTH_PATH).expect("GET health");
    assert!(status == 200 || status == 503, "health: {status} {body}");
    serde_json::from_str::<Value>(&body).expect("health JSON")["in_flight"].as_u64().expect("in_flight")
}

/// Polls the health endpoint until its in-flight count satisfies `done` (bounded); returns it.
fn wait_in_flight(envoy: &Envoy, within: Duration, done: impl Fn(u64) -> bool) -> u64 {
    let deadline = Instant::now() + within;
    loop {
        let n = in_flight(envoy);
        if done(n) || Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// After `what`: the proxy-wide in-flight count and every cluster's leases are back to exactly
/// zero, and no VM failed.
fn assert_nothing_left(envoy: &Envoy, clusters: &[&str], what: &str) {
    let n = wait_in_flight(envoy, Duration::from_secs(3), |n| n == 0);
    assert_eq!(n, 0, "{what}: the in-flight count is not back to zero");
    for cluster in clusters {
        // The gauge follows the record on every heartbeat (each second).
        let leases = envoy.wait_for_stat(&cluster_stat(cluster, "in_flight"), 0, Duration::from_secs(4));
        assert_eq!(leases, Some(0), "{what}: cluster {cluster} still has leases");
    }
    let failures = wasm_failures(&envoy.log());
    assert!(failures.is_empty(), "{what}: {failures:?}");
    println!("{what}: in flight 0, leases 0 on {clusters:?}");
}

/// Refusals of gRPC calls are gRPC statuses: RESOURCE_EXHAUSTED for a quota, UNAVAILABLE when
/// shed, each with a one-line message, gRFC A6's pushback and the HTTP reply's fields as
/// metadata of a trailers-only response; content types decide as Envoy does.
#[test]
fn refusals_are_grpc_statuses_with_pushback_and_metadata() {
    let server = GrpcServer::start(&[]);
    let envoy = Envoy::builder(json!({
        "rate_limits": [{"name": "per-key", "key": [{"header": "x-api-key"}], "limit": 3, "window": "30s"}],
        "load_shedding": {"max_active_requests": 2, "classes": [{"name": "normal", "shed_at": 1.0}],
                          "default_class": "normal", "retry_after": "2s"},
        "health": {"path": HEALTH_PATH}
    }))
    .http2_cluster("grpc", &[server.addr()])
    .route_to("grpc")
    .start();
    let target = envoy.addr().to_string();

    // Quota: 5 calls one after another, in one window.
    wait_for_window_phase(Duration::from_secs(30), Duration::ZERO, Duration::from_secs(20));
    let calls = client(&["call", &target, "--n", "5", "--metadata", "x-api-key=alice"]);
    println!("quota 3: {:?}", calls.codes);
    assert_eq!((calls.count("OK"), calls.count("RESOURCE_EXHAUSTED")), (3, 2), "{calls:?}");
    for refused in calls.with_code("RESOURCE_EXHAUSTED") {
        println!("refused: {refused}");
        let retry_after: u64 = meta(refused, "trailing", "retry-after").parse().expect("retry-after");
        let pushback: u64 = meta(refused, "trailing", "grpc-retry-pushback-ms").parse().expect("pushback");
        assert!(
            pushback > (retry_after - 1) * 1000 && pushback <= retry_after * 1000,
            "the pushback {pushback} ms is the exact wait that retry-after {retry_after} s rounds up"
        );
        assert_eq!(
            refused["details"],
            format!("quota \"per-key\" of 3 requests per 30s is exhausted (current estimate 3); retry in {retry_after} s")
        );
        assert_eq!(meta(refused, "trailing", "ratelimit-policy"), "\"per-key\";q=3;w=30");
        assert_eq!(meta(refused, "trailing", "ratelimit"), format!("\"per-key\";r=0;t={retry_after}"));
        assert_eq!(refused["initial"], json!({}), "a trailers-only response: {refused}");
    }
    assert_eq!(server.started("Unary"), 3, "the refused calls never reached the server");
    assert_eq!(stat(&envoy, &rule_stat("per-key", "rejected")), 2);

    // Shedding: 4 slow calls at once (no x-api-key: the rule skips them), 2 fit.
    let calls = client(&["call", &target, "--n", "4", "--concurrency", "4", "--metadata", "x-test-delay-ms=1500"]);
    println!("4 calls, 2 in flight at most: {:?}", calls.codes);
    assert_eq!((calls.count("OK"), calls.count("UNAVAILABLE")), (2, 2), "{calls:?}");
    for shed in calls.with_code("UNAVAILABLE") {
        println!("shed: {shed}");
        assert_eq!(shed["details"], "2 requests in flight; class \"normal\" is shed from 2 (limit 2); retry in 2 s");
        assert_eq!(meta(shed, "trailing", "grpc-retry-pushback-ms"), "2000");
        assert_eq!(meta(shed, "trailing", "retry-after"), "2");
        assert!(shed["elapsed_ms"].as_f64().unwrap_or(f64::MAX) < 750.0, "shed at once: {shed}");
    }
    assert_nothing_left(&envoy, &[], "after the refusals");

    // Over HTTP/1.1, by content type: application/grpc+proto is gRPC, application/grpc-web is
    // not (Envoy's rule): the latter gets the HTTP 429.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let path = "/floodgate.test.Echo/Unary";
    let proto = rt.block_on(get(envoy.addr(), path, &[("content-type", "application/grpc+proto"), ("x-api-key", "alice")]));
    println!("application/grpc+proto over HTTP/1.1: {} {:?}", proto.status, proto.headers);
    assert_eq!(proto.status, 200);
    assert_eq!(proto.header("grpc-status"), Some("8"));
    assert_eq!(proto.header("content-type"), Some("application/grpc"));
    assert!(proto.header("grpc-message").is_some_and(|m| m.contains("per-key")), "{:?}", proto.headers);
    assert!(proto.header("grpc-retry-pushback-ms").is_some());
    let web = rt.block_on(get(envoy.addr(), path, &[("content-type", "application/grpc-web"), ("x-api-key", "alice")]));
    assert_eq!(web.status, 429, "{}", web.text());
    assert_eq!(web.header("content-type"), Some("application/problem+json"));
    assert_eq!(web.header("grpc-status"), None);

    // Why the health endpoint cannot answer grpc.health.v1.Health/Check: Envoy turns any local
    // reply to a gRPC request into a trailers-only response, so the JSON body (a gRPC answer's
    // message alike) is dropped and only reaches the client as grpc-message.
    let health = rt.block_on(get(envoy.addr(), HEALTH_PATH, &[("content-type", "application/grpc")]));
    println!("the health endpoint asked as gRPC: {} {:?} body {:?}", health.status, health.headers, health.text());
    assert_eq!(health.status, 200);
    assert_eq!(health.header("content-type"), Some("application/grpc"));
    assert!(health.header("grpc-status").is_some());
    assert!(health.header("grpc-message").is_some_and(|m| m.contains("in_flight")), "{:?}", health.headers);
    assert!(health.body.is_empty(), "{}", health.text());
}

/// Another status for quota refusals, the way Envoy's rate_limited_as_resource_exhausted
/// chooses: with UNAVAILABLE a client whose retry policy retries it does, and it waits the
/// pushback it is told instead of its own backoff.
#[test]
fn the_refusal_status_is_configurable_and_a_retrying_client_waits_as_told() {
    let server = GrpcServer::start(&[]);
    let envoy = Envoy::builder(json!({
        "grpc": {"rate_limited_status": "UNAVAILABLE"},
        "rate_limits": [{"name": "per-key", "key": [{"header": "x-api-key"}], "limit": 1, "window": "2s"}]
    }))
    .http2_cluster("grpc", &[server.addr()])
    .route_to("grpc")
    .start();
    let target = envoy.addr().to_string();
    // Early in a window: after one admission the next is possible two buckets later, at least
    // 2 s away (previous bucket 1 × (1 − elapsed/2 s) + 1 ≤ 1 only at elapsed = 2 s).
    wait_for_window_phase(Duration::from_secs(2), Duration::ZERO, Duration::from_millis(500));
    let probe = client(&["call", &target, "--n", "2", "--metadata", "x-api-key=bob"]);
    assert_eq!((probe.count("OK"), probe.count("UNAVAILABLE")), (1, 1), "{probe:?}");
    let refused = probe.with_code("UNAVAILABLE").next().expect("a refused call");
    let pushback: f64 = meta(refused, "trailing", "grpc-retry-pushback-ms").parse().expect("pushback");
    assert!(pushback >= 1500.0, "{refused}");

    // Up to 5 attempts 10 to 50 ms apart by its own backoff: all would fail within ~150 ms.
    let service_config = json!({"methodConfig": [{
        "name": [{"service": "floodgate.test.Echo"}],
        "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    }]})
    .to_string();
    let retried = client(&["call", &target, "--n", "1", "--metadata", "x-api-key=bob", "--service-config", &service_config]);
    let call = &retried.calls[0];
    println!("probe told {pushback} ms; the retrying call: {call}");
    assert_eq!(call["code"], "OK", "the retry after the pushback is admitted: {call}");
    // It waited until the quota had room: far longer than its backoff allows (the exact wait
    // depends on how long the client took to start; at least 1.5 s minus that).
    let elapsed = call["elapsed_ms"].as_f64().expect("elapsed");
    assert!(elapsed >= 200.0, "the client waited the pushback, not its backoff: {elapsed} ms");
    // Two refusals in all (the probe's and the retrying call's first attempt): it did not hammer.
    assert_eq!(stat(&envoy, &rule_stat("per-key", "rejected")), 2);
    assert_eq!(stat(&envoy, &rule_stat("per-key", "allowed")), 2);
    assert_eq!(server.started("Unary"), 2);
}

/// Two gRPC clusters, one answering every call UNAVAILABLE with HTTP 200 (a failure that
/// HTTP's status hides): its failures count, and it gets almost no calls.
#[test]
fn cluster_selection_steers_away_from_a_cluster_failing_its_grpc_calls() {
    let good = GrpcServer::start(&[]);
    let bad = GrpcServer::start(&["--status", "14"]);
    let envoy = Envoy::builder(json!({"cluster_selection": {"route_header": ROUTE_HEADER, "clusters": ["good", "bad"]}}))
        .http2_cluster("good", &[good.addr()])
        .http2_cluster("bad", &[bad.addr()])
        .route_by_header(ROUTE_HEADER)
        .start();
    let calls = client(&["call", &envoy.addr().to_string(), "--n", "600", "--concurrency", "8"]);
    let (to_good, to_bad) = (good.started("Unary"), bad.started("Unary"));
    let share = to_bad as f64 / (to_good + to_bad) as f64;
    println!(
        "600 calls: {:?}; good got {to_good}, bad got {to_bad} ({:.2}%); stats: bad failure {}, success {}; good success {}",
        calls.codes,
        share * 100.0,
        stat(&envoy, &cluster_stat("bad", "failure")),
        stat(&envoy, &cluster_stat("bad", "success")),
        stat(&envoy, &cluster_stat("good", "success"))
    );
    assert_eq!(to_good + to_bad, 600);
    assert!(share <= 0.03, "the failing cluster got {to_bad} of 600 calls");
    assert_eq!(calls.count("UNAVAILABLE"), to_bad);
    assert_eq!(stat(&envoy, &cluster_stat("bad", "failure")), to_bad, "every call of bad is a failure");
    assert_eq!(stat(&envoy, &cluster_stat("bad", "success")), 0);
    assert_eq!(stat(&envoy, &cluster_stat("good", "success")), to_good);
}

/// One cluster, every kind of ending: the status read from a trailers-only response's headers
/// or from the trailers, configured failure codes, DEADLINE_EXCEEDED as a timeout that backs
/// the concurrency limit off, and cancelled calls not counted.
#[test]
fn grpc_statuses_from_headers_or_trailers_decide_the_outcome() {
    let server = GrpcServer::start(&[]);
    let envoy = Envoy::builder(json!({
        "cluster_selection": {
            "route_header": ROUTE_HEADER, "clusters": ["one"],
            "failure_grpc_statuses": ["UNAVAILABLE", "INTERNAL", "NOT_FOUND"],
            "concurrency_limit": {"initial_limit": 20, "timeout": "10s"}
        },
        "load_shedding": {"max_active_requests": 1000},
        "health": {"path": HEALTH_PATH}
    }))
    .http2_cluster("one", &[server.addr()])
    .route_by_header(ROUTE_HEADER)
    .start();
    // The gauge shows the limit from the start, not 0 until the first heartbeat a second later.
    assert_eq!(stat(&envoy, &cluster_stat("one", "concurrency_limit")), 20);
    let target = envoy.addr().to_string();
    let counters = || {
        ["success", "failure", "timeout", "ignored", "slow"].map(|what| stat(&envoy, &cluster_stat("one", what)))
    };
    // (what, client arguments, expected code, calls, the counter that moves)
    let headers_first = "x-test-headers-first=1";
    let cases: [(&str, Vec<&str>, &str, u64, usize); 8] = [
        ("OK", vec![], "OK", 6, 0),
        ("UNAVAILABLE, trailers-only", vec!["x-test-status=14"], "UNAVAILABLE", 4, 1),
        ("INTERNAL, in trailers", vec!["x-test-status=13", headers_first], "INTERNAL", 4, 1),
        ("NOT_FOUND (configured a failure)", vec!["x-test-status=5"], "NOT_FOUND", 4, 1),
        ("PERMISSION_DENIED, in trailers", vec!["x-test-status=7", headers_first], "PERMISSION_DENIED", 4, 0),
        ("UNKNOWN (not in the configured list)", vec!["x-test-status=2"], "UNKNOWN", 4, 0),
        ("DEADLINE_EXCEEDED from the server", vec!["x-test-status=4"], "DEADLINE_EXCEEDED", 3, 2),
        ("DEADLINE_EXCEEDED in trailers", vec!["x-test-status=4", headers_first], "DEADLINE_EXCEEDED", 1, 2),
    ];
    for (what, metadata, code, n, moves) in cases {
        let before = counters();
        let mut args = vec!["call".to_string(), target.clone(), "--n".into(), n.to_string()];
        for m in &metadata {
            args.extend(["--metadata".to_string(), (*m).to_string()]);
        }
        let calls = client(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(calls.count(code), n, "{what}: {calls:?}");
        let after = counters();
        let mut expected = before;
        expected[moves] += n;
        println!("{what}: {n} × {code} → success/failure/timeout/ignored/slow {after:?}");
        assert_eq!(after, expected, "{what}");
    }
    // Four timeouts from 20: the limit backed off (AIMD, × 0.9 each).
    let limit = (0..40)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            stat(&envoy, &cluster_stat("one", "concurrency_limit"))
        })
        .find(|l| *l < 20)
        .unwrap_or(20);
    println!("concurrency limit after 4 DEADLINE_EXCEEDED: {limit}");
    assert!((1..=14).contains(&limit), "{limit}");

    // Calls the client cancels, before the response and in the middle of a streamed one.
    let before = counters();
    let cancelled = client(&["cancel", &target, "--kind", "unary", "--n", "5", "--after-ms", "300", "--metadata", "x-test-delay-ms=5000"]);
    let mid_response = client(&["cancel", &target, "--kind", "watch", "--n", "5", "--after-ms", "100", "--metadata", "x-test-delay-ms=200"]);
    assert_eq!((cancelled.count("CANCELLED"), mid_response.count("CANCELLED")), (5, 5));
    let after = counters();
    let mut expected = before;
    expected[3] += 10;
    println!("10 cancelled calls → {after:?}");
    assert_eq!(after, expected, "cancelled calls are not counted");
    assert_nothing_left(&envoy, &["one"], "after every kind of ending");
}

/// Ends of HTTP/2 streams and gRPC calls of every kind, on two clusters: many streams on one
/// connection, cancelled calls (RST_STREAM before the response, in the middle of the request
/// and of the response), expired deadlines, a closed channel, servers shutting down (GOAWAY,
/// then their calls reset): after each, the in-flight count and every cluster's leases are
/// back to exactly zero.
#[test]
fn every_http2_and_grpc_stream_end_gives_every_unit_back() {
    let mut a = GrpcServer::start(&["--grace-ms", "300"]);
    let mut b = GrpcServer::start(&["--grace-ms", "300"]);
    let envoy = Envoy::builder(json!({
        "load_shedding": {"max_active_requests": 1000},
        "health": {"path": HEALTH_PATH},
        "cluster_selection": {"route_header": ROUTE_HEADER, "clusters": ["a", "b"],
                              "concurrency_limit": {"initial_limit": 200, "max_limit": 400}}
    }))
    .http2_cluster("a", &[a.addr()])
    .http2_cluster("b", &[b.addr()])
    .route_by_header(ROUTE_HEADER)
    .start();
    let target = envoy.addr().to_string();
    let clusters = ["a", "b"];
    let ignored = || stat(&envoy, &cluster_stat("a", "ignored")) + stat(&envoy, &cluster_stat("b", "ignored"));
    let slow = "x-test-delay-ms=5000";

    // 100 calls over one connection, 50 streams at once.
    let running = client_in_background(&["call", &target, "--n", "100", "--concurrency", "50", "--metadata", "x-test-delay-ms=500"]);
    let peak = wait_in_flight(&envoy, Duration::from_secs(10), |n| n >= 40);
    let calls = running.join().expect("client");
    println!("100 calls, 50 streams at once on one connection: {:?}, {peak} in flight seen", calls.codes);
    assert_eq!(calls.count("OK"), 100);
    assert!(peak >= 40, "{peak}");
    assert_nothing_left(&envoy, &clusters, "many streams on one connection");

    let timeouts = || stat(&envoy, &cluster_stat("a", "timeout")) + stat(&envoy, &cluster_stat("b", "timeout"));
    // Each call ended by its client is not counted, but for an expired deadline: the server
    // (told by grpc-timeout) may end the call with DEADLINE_EXCEEDED just before the client's
    // RST_STREAM, and that is a timeout.
    let mut expected = (ignored(), timeouts());
    let mut ended = |what: &str, calls: Calls, code: &str, n: u64| {
        println!("{what}: {:?}", calls.codes);
        assert_eq!(calls.count(code), n, "{what}: {calls:?}");
        assert_nothing_left(&envoy, &clusters, what);
        let now = (ignored(), timeouts());
        let (by_client, by_server) = (now.0 - expected.0, now.1 - expected.1);
        println!("{what}: {by_client} not counted, {by_server} timeouts");
        assert_eq!(by_client + by_server, n, "{what}: every call counted once at most");
        if code != "DEADLINE_EXCEEDED" {
            assert_eq!(by_server, 0, "{what}: the client left first, the calls are not counted");
        }
        expected = now;
    };
    let c = client(&["cancel", &target, "--kind", "unary", "--n", "30", "--after-ms", "300", "--metadata", slow]);
    ended("30 unary calls cancelled before their response (RST_STREAM)", c, "CANCELLED", 30);
    let c = client(&["cancel", &target, "--kind", "upload", "--n", "30", "--after-ms", "300", "--metadata", slow]);
    ended("30 client-streaming calls cancelled in the middle of their request", c, "CANCELLED", 30);
    let c = client(&["cancel", &target, "--kind", "watch", "--n", "30", "--after-ms", "300", "--metadata", "x-test-delay-ms=100"]);
    ended("30 server-streaming calls cancelled in the middle of their response", c, "CANCELLED", 30);
    let c = client(&["call", &target, "--n", "30", "--concurrency", "30", "--timeout-ms", "300", "--metadata", slow]);
    ended("30 calls whose 300 ms deadline expired", c, "DEADLINE_EXCEEDED", 30);
    let c = client(&["close", &target, "--n", "30", "--after-ms", "300", "--metadata", slow]);
    ended("a channel closed with 30 calls open", c, "CANCELLED", 30);

    // The servers shut down under 30 calls: GOAWAY, and after 300 ms their calls are reset.
    let failures = || stat(&envoy, &cluster_stat("a", "failure")) + stat(&envoy, &cluster_stat("b", "failure"));
    let failures_before = failures();
    let running = client_in_background(&["call", &target, "--n", "30", "--concurrency", "30", "--metadata", slow]);
    assert_eq!(wait_in_flight(&envoy, Duration::from_secs(10), |n| n == 30), 30);
    GrpcServer::shut_down_all(&mut [&mut a, &mut b]);
    let calls = running.join().expect("client");
    println!("servers shut down under 30 calls: {:?}", calls.codes);
    assert_eq!(calls.count("OK"), 0, "{calls:?}");
    assert_eq!(calls.total(), 30);
    assert_nothing_left(&envoy, &clusters, "servers shut down (GOAWAY, then resets)");
    assert_eq!(failures() - failures_before, 30, "calls reset by their server are failures");
}

/// h2load over HTTP/2: plain requests and gRPC calls, many streams per connection, past the
/// shedding limit; then h2load stopping mid-run (its duration ends with streams open: GOAWAY
/// and close) and killed mid-run: the in-flight count is back to zero each time.
#[test]
fn h2load_past_the_shedding_limit_and_hang_ups() {
    let upstream = Upstream::with_options(UpstreamOptions { delay: Some(Duration::from_millis(100)), ..UpstreamOptions::default() });
    let server = GrpcServer::start(&[]);
    let envoy = Envoy::builder(json!({
        "load_shedding": {"max_active_requests": 20, "classes": [{"name": "normal", "shed_at": 1.0}], "default_class": "normal"},
        "health": {"path": HEALTH_PATH}
    }))
    .upstream(&upstream)
    .http2_cluster("grpc", &[server.addr()])
    .route_by_header(ROUTE_HEADER)
    .start();
    let url = envoy.url("/floodgate.test.Echo/Unary");
    let shed = || stat(&envoy, &format!("{STAT_PREFIX}.load_shedding.normal.shed"));
    let limit = Duration::from_secs(60);

    // Plain HTTP/2: 4 connections × 25 streams against 20 in flight.
    let before = shed();
    let report = h2load(&["-c", "4", "-m", "25", "-n", "2000", "-H", &format!("{ROUTE_HEADER}: upstream"), &url], limit);
    let shed_now = shed() - before;
    println!(
        "h2load, plain HTTP/2: {:?} {:?}; shed {shed_now}, upstream saw {}",
        report.requests,
        report.statuses,
        upstream.total()
    );
    assert_eq!(report.requests("done"), 2000, "{}", report.output);
    assert_eq!(report.status("5xx"), shed_now);
    assert_eq!(report.status("2xx"), upstream.total());
    assert_eq!(report.status("2xx") + report.status("5xx"), 2000);
    assert!(shed_now > 0, "100 streams at once against 20 in flight");
    assert_nothing_left(&envoy, &[], "h2load, plain HTTP/2");

    // gRPC calls: every answer is HTTP 200, the shed ones UNAVAILABLE trailers-only.
    let body = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(body.path(), grpc_frame(b"x")).expect("write body");
    let body_path = body.path().to_str().expect("path").to_string();
    let grpc_args = |extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = [
            "-d", &body_path, "-H", "content-type: application/grpc", "-H", "te: trailers",
            "-H", &format!("{ROUTE_HEADER}: grpc"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args.push(url.clone());
        args
    };
    let before = shed();
    let args = grpc_args(&["-c", "4", "-m", "25", "-n", "1000", "-H", "x-test-delay-ms: 100"]);
    let report = h2load(&args.iter().map(String::as_str).collect::<Vec<_>>(), limit);
    let shed_now = shed() - before;
    let reached = server.started("Unary");
    println!("h2load, gRPC: {:?} {:?}; shed {shed_now}, the server got {reached}", report.requests, report.statuses);
    assert_eq!(report.status("2xx"), 1000, "{}", report.output);
    assert_eq!(reached + shed_now, 1000);
    assert!(shed_now > 0);
    assert_nothing_left(&envoy, &[], "h2load, gRPC");

    // Its duration ends with every stream open (the server answers after 5 s).
    let args = grpc_args(&["-c", "4", "-m", "50", "-D", "2", "-H", "x-test-delay-ms: 5000"]);
    let report = h2load(&args.iter().map(String::as_str).collect::<Vec<_>>(), limit);
    println!("h2load -D 2 over calls that take 5 s: {:?}", report.requests);
    assert_nothing_left(&envoy, &[], "h2load stopped with its streams open");

    // Killed mid-run.
    let args = grpc_args(&["-c", "4", "-m", "50", "-n", "1000000", "-H", "x-test-delay-ms: 5000"]);
    h2load_killed_after(&args.iter().map(String::as_str).collect::<Vec<_>>(), Duration::from_millis(1500));
    println!("h2load killed after 1.5 s");
    assert_nothing_left(&envoy, &[], "h2load killed mid-run");
}
