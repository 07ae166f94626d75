//! Load leveling (`load_shedding.queue`), end to end: the built module in a real Envoy (2
//! workers) in front of an upstream that answers slowly and measures how many requests it holds
//! at once. A request the in-flight limit would shed waits for a slot; past its wait it gets the
//! shed `503`; clients that hang up while they wait leave nothing behind; gRPC calls over HTTP/2
//! wait the same way. Each test starts its own Envoy.

use std::time::{Duration, Instant};

use floodgate_integration::grpc::{client, GrpcServer};
use floodgate_integration::*;

const UPSTREAM_DELAY: Duration = Duration::from_millis(300);

/// Limit 4 in flight, one class (`normal`, shed at the limit) and a queue of `max_wait`.
/// `interval` is 2 s: the tests' requests all arrive at the start, but on a loaded machine they
/// can take more than CoDel's default 100 ms to do so, and a later one would then join a
/// "standing" queue and wait only `target`.
fn queue_config(max_wait: &str) -> Value {
    json!({
        "load_shedding": {
            "max_active_requests": 4,
            "classes": [{"name": "normal", "shed_at": 1.0}],
            "default_class": "normal",
            "retry_after": "2s",
            "queue": {"max_queued": 64, "max_wait": max_wait, "interval": "2s"}
        },
        "health": {"path": HEALTH_PATH}
    })
}

fn stat(envoy: &Envoy, what: &str) -> u64 {
    envoy.stat(&format!("{STAT_PREFIX}.load_shedding.{what}")).unwrap_or(0)
}

/// The queue gauge and the in-flight gauge are back to exactly 0 (the in-flight gauge follows
/// the heartbeat, every second), and no VM failed.
fn assert_back_to_zero(envoy: &Envoy, what: &str) {
    let queue = envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.queue_length"), 0, Duration::from_secs(5));
    let in_flight = envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.in_flight"), 0, Duration::from_secs(5));
    println!("{what}: queue_length {queue:?}, in_flight {in_flight:?}");
    assert_eq!((queue, in_flight), (Some(0), Some(0)), "{what}: {}", envoy.stats_matching(STAT_PREFIX));
    let failures = wasm_failures(&envoy.log());
    assert!(failures.is_empty(), "{what}: {failures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_requests_over_a_limit_of_four_all_get_a_slot_and_the_upstream_never_holds_more() {
    let upstream = Upstream::with_options(UpstreamOptions { delay: Some(UPSTREAM_DELAY), ..UpstreamOptions::default() });
    let envoy = Envoy::start(queue_config("2s"), &upstream);
    let started = Instant::now();
    let pending = send_prioritized(envoy.addr(), "normal", 20);
    let mut latencies = Vec::new();
    for p in pending {
        let (status, latency, r) = p.await.expect("request task");
        assert_eq!(status, 200, "{}", r.text());
        latencies.push(latency);
    }
    latencies.sort();
    println!(
        "20 requests, limit 4, upstream {UPSTREAM_DELAY:?}: all 200 in {:?}; latencies {:?} .. {:?}; upstream held at most {}",
        started.elapsed(),
        latencies.first(),
        latencies.last(),
        upstream.most_concurrent()
    );
    assert_eq!(upstream.total(), 20);
    assert_eq!(upstream.most_concurrent(), 4, "the upstream never holds more than the limit, and the limit is used");
    // 20 requests, 4 at a time, 300 ms each: the last ones waited for four rounds at least.
    assert!(latencies.last().is_some_and(|l| *l >= UPSTREAM_DELAY * 4), "{latencies:?}");
    let (queued, dequeued) = (stat(&envoy, "normal.queued"), stat(&envoy, "normal.dequeued"));
    println!("queued {queued}, dequeued {dequeued}");
    assert!(queued >= 12, "most requests waited: {queued}");
    assert_eq!(dequeued, queued, "every waiter got its slot");
    assert_eq!((stat(&envoy, "normal.queue_timeout"), stat(&envoy, "normal.shed")), (0, 0));
    assert_back_to_zero(&envoy, "after 20 requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_wait_a_waiting_request_gets_the_shed_reply_after_about_the_wait() {
    let upstream = Upstream::with_options(UpstreamOptions { delay: Some(UPSTREAM_DELAY), ..UpstreamOptions::default() });
    let envoy = Envoy::start(queue_config("400ms"), &upstream);
    let pending = send_prioritized(envoy.addr(), "normal", 20);
    let (mut ok, mut shed_latencies) = (0, Vec::new());
    for p in pending {
        let (status, latency, r) = p.await.expect("request task");
        match status {
            200 => ok += 1,
            503 => {
                // Today's shed reply, with its fields, and how long the request waited.
                assert_eq!(r.header("content-type"), Some("application/problem+json"));
                assert_eq!((r.header("retry-after"), r.header("retry-after-ms")), (Some("2"), Some("2000")));
                let body = r.json();
                assert_eq!(body["type"], "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity");
                assert_eq!((body["status"].as_u64(), body["class"].as_str(), body["max_active_requests"].as_u64()), (Some(503), Some("normal"), Some(4)));
                assert!(body["in_flight"].as_u64().is_some(), "{body}");
                let waited = body["waited_ms"].as_u64().unwrap_or_else(|| panic!("no waited_ms: {body}"));
                assert!((400..1_000).contains(&waited), "{body}");
                shed_latencies.push(latency);
            }
            other => panic!("unexpected status {other}: {}", r.text()),
        }
    }
    shed_latencies.sort();
    println!(
        "max_wait 400ms: {ok} admitted, {} shed after {:?} .. {:?}; upstream held at most {}",
        shed_latencies.len(),
        shed_latencies.first(),
        shed_latencies.last(),
        upstream.most_concurrent()
    );
    // 4 at once and 4 more after 300 ms fit in 400 ms; the rest cannot (a loaded machine may
    // admit fewer in time, never more than 12).
    assert!((4..=12).contains(&ok), "{ok} admitted");
    assert_eq!(ok + shed_latencies.len(), 20);
    // Shed after the wait, not at once, and not much later (the tick is 10 ms; a loaded
    // machine adds its own lateness).
    assert!(shed_latencies.iter().all(|l| *l >= Duration::from_millis(400) && *l < Duration::from_millis(1_500)), "{shed_latencies:?}");
    assert!(upstream.most_concurrent() <= 4);
    assert_eq!(stat(&envoy, "normal.queue_timeout"), shed_latencies.len() as u64);
    assert_eq!(stat(&envoy, "normal.shed"), shed_latencies.len() as u64);
    assert_back_to_zero(&envoy, "after the timeouts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_hang_up_while_queued_leave_nothing_behind() {
    let upstream = Upstream::with_options(UpstreamOptions { delay: Some(Duration::from_secs(2)), ..UpstreamOptions::default() });
    let envoy = Envoy::start(queue_config("20s"), &upstream);
    let holders = send_prioritized(envoy.addr(), "normal", 4);
    let in_flight = envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.in_flight"), 4, Duration::from_secs(3));
    assert_eq!(in_flight, Some(4));
    let waiting = send_prioritized(envoy.addr(), "normal", 10);
    let queued = envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.queue_length"), 10, Duration::from_secs(3));
    assert_eq!(queued, Some(10), "{}", envoy.stats_matching(STAT_PREFIX));
    // The health endpoint says so, answered by either worker.
    for _ in 0..4 {
        let health = get(envoy.addr(), HEALTH_PATH, &[]).await;
        let body = health.json();
        assert_eq!((health.status, &body["queued"], &body["in_flight"]), (503, &json!(10), &json!(4)), "{body}");
    }
    // The 10 waiting clients hang up.
    for task in &waiting {
        task.abort();
    }
    let abandoned = envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.normal.queue_abandoned"), 10, Duration::from_secs(3));
    assert_eq!(abandoned, Some(10));
    assert_eq!(stat(&envoy, "queue_length"), 0, "the queue is empty at once");
    assert_eq!(get(envoy.addr(), HEALTH_PATH, &[]).await.json()["queued"], json!(0));
    for p in holders {
        assert_eq!(p.await.expect("request task").0, 200);
    }
    assert_back_to_zero(&envoy, "after 10 hang-ups");
    assert_eq!(upstream.total(), 4, "no abandoned request reached the upstream");
    // Later requests are admitted at once, without waiting.
    let started = Instant::now();
    for p in send_prioritized(envoy.addr(), "normal", 4) {
        assert_eq!(p.await.expect("request task").0, 200);
    }
    println!("4 later requests answered in {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_millis(3_500));
    assert_eq!((stat(&envoy, "normal.queued"), stat(&envoy, "normal.dequeued")), (10, 0));
    assert_back_to_zero(&envoy, "after the later requests");
}

/// gRPC calls (HTTP/2 streams multiplexed on one connection) wait the same way: all answered
/// `OK` under the section's wait; a class with a shorter wait gets `UNAVAILABLE`, with gRFC A6's
/// pushback, after about its wait.
#[test]
fn grpc_calls_wait_for_a_slot_the_same_way() {
    let server = GrpcServer::start(&["--delay-ms", "300"]);
    let envoy = Envoy::builder(json!({
        "load_shedding": {
            "max_active_requests": 4,
            "classes": [{"name": "normal", "shed_at": 1.0}, {"name": "brief", "shed_at": 1.0, "queue": {"max_wait": "400ms"}}],
            "default_class": "normal",
            "retry_after": "2s",
            "queue": {"max_queued": 64, "max_wait": "3s", "interval": "3s"}
        },
        "health": {"path": HEALTH_PATH}
    }))
    .http2_cluster("grpc", &[server.addr()])
    .route_to("grpc")
    .start();
    let target = envoy.addr().to_string();
    let calls = client(&["call", &target, "--n", "12", "--concurrency", "12"]);
    // `elapsed_ms` has a tenth of a millisecond.
    let mut elapsed: Vec<u64> = calls.calls.iter().filter_map(|c| c["elapsed_ms"].as_f64()).map(|ms| ms as u64).collect();
    elapsed.sort_unstable();
    println!("12 calls, limit 4: {:?}, elapsed {elapsed:?} ms", calls.codes);
    assert_eq!(calls.count("OK"), 12, "{:?}", calls.codes);
    assert!(elapsed.last().is_some_and(|ms| *ms >= 900), "three rounds of 300 ms: {elapsed:?}");
    let queued = stat(&envoy, "normal.queued");
    assert!(queued >= 6, "calls waited: {queued}");
    assert_eq!(stat(&envoy, "normal.dequeued"), queued);

    let calls = client(&["call", &target, "--n", "12", "--concurrency", "12", "--metadata", "x-floodgate-priority=brief"]);
    println!("12 calls of the brief class: {:?}", calls.codes);
    let unavailable: Vec<&Value> = calls.with_code("UNAVAILABLE").collect();
    assert!(!unavailable.is_empty() && calls.count("OK") >= 4, "{:?}", calls.codes);
    assert_eq!(calls.count("OK") + unavailable.len() as u64, 12, "{:?}", calls.codes);
    for call in &unavailable {
        let ms = call["elapsed_ms"].as_f64().expect("elapsed_ms") as u64;
        assert!((400..1_500).contains(&ms), "shed after about 400 ms: {call}");
        assert_eq!(call["trailing"]["grpc-retry-pushback-ms"], "2000", "{call}");
        assert!(call["details"].as_str().is_some_and(|d| d.contains("for a slot")), "{call}");
    }
    assert_eq!(stat(&envoy, "brief.queue_timeout"), unavailable.len() as u64);
    assert_back_to_zero(&envoy, "after the gRPC calls");
}

/// The access log says how long a request waited for a slot, whether it then went on or was
/// shed; a request that did not wait has no such field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_says_how_long_a_request_waited() {
    let upstream = Upstream::with_options(UpstreamOptions { delay: Some(Duration::from_secs(1)), ..UpstreamOptions::default() });
    let envoy = Envoy::builder(json!({
        "access_log": true,
        "load_shedding": {
            "max_active_requests": 1,
            "classes": [{"name": "normal", "shed_at": 1.0}, {"name": "brief", "shed_at": 1.0, "queue": {"max_wait": "200ms"}}],
            "default_class": "normal",
            "queue": {"max_queued": 8, "max_wait": "5s", "interval": "5s"}
        }
    }))
    .upstream(&upstream)
    .with_access_log()
    .start();
    let addr = envoy.addr();
    let first = tokio::spawn(async move { get(addr, "/first", &[]).await.status });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waits = tokio::spawn(async move { get(addr, "/waits", &[]).await.status });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let brief = get(addr, "/brief", &[("x-floodgate-priority", "brief")]).await.status;
    assert_eq!((first.await.expect("request"), waits.await.expect("request"), brief), (200, 200, 503));
    let lines = envoy.access_log(3);
    let line = |path: &str| lines.iter().find(|l| l["path"] == path).unwrap_or_else(|| panic!("no {path} in {lines:?}")).clone();
    let waited = |l: &Value| l["waited_ms"].as_str().and_then(|w| w.parse::<u64>().ok());
    println!("access log: {lines:?}");
    assert_eq!(waited(&line("/first")), None, "it did not wait");
    let (admitted, shed) = (line("/waits"), line("/brief"));
    assert_eq!((admitted["outcome"].as_str(), shed["outcome"].as_str(), shed["by"].as_str()), (Some("admitted"), Some("shed"), Some("max_active_requests")));
    assert!(waited(&admitted).is_some_and(|w| (700..3_000).contains(&w)), "{admitted}");
    assert!(waited(&shed).is_some_and(|w| (200..1_000).contains(&w)), "{shed}");
}

/// Bad queue settings stop the configuration in Envoy, with the field named in the log (the
/// parser's own refusals, with `floodgate validate` and the schema, are in `operator.rs`).
#[test]
fn envoy_refuses_a_queue_without_a_wait_naming_the_field() {
    let log = Envoy::start_expecting_failure(json!({"load_shedding": {"max_active_requests": 4, "queue": {"max_queued": 0, "max_wait": "1s"}}}));
    assert!(log.contains("load_shedding.queue.max_queued"), "{}", tail(&log, 20));
}
