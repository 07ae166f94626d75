//! The smoke suite: what must hold on every supported Envoy minor, in a few seconds each. It runs
//! with the rest of the integration tests on the newest supported minor, and alone on the oldest
//! (`./test.sh`: `scripts/envoy.sh 1.36`, then `cargo test -p floodgate-integration --test smoke`
//! with that `ENVOY_BIN`). docs/operations.md, "Compatibility", lists the minors.
//!
//! On the given Envoy (2 workers): the module loads and refuses a bad configuration naming the
//! field; a quota is exact across both workers; a refusal carries its fields (429, `retry-after`,
//! `ratelimit-policy`, `application/problem+json`); load shedding admits exactly its limit and its
//! in-flight count returns to zero; cluster selection steers away from a failing cluster.

use std::time::{Duration, Instant};

use floodgate_integration::*;

const HOUR: Duration = Duration::from_secs(3600);

/// The Envoy under test, printed first by every test so a log says which minor it ran on.
fn envoy_version() -> String {
    let out = std::process::Command::new(envoy_binary())
        .arg("--version")
        .output()
        .expect("envoy --version");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let version = text
        .split_whitespace()
        .find_map(|w| w.split('/').nth(1).filter(|v| v.starts_with("1.")).map(str::to_string))
        .unwrap_or_else(|| panic!("no version in `envoy --version`: {text}"));
    println!("Envoy {version}");
    version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_the_module_loads_and_a_bad_configuration_is_refused_naming_the_field() {
    envoy_version();
    let upstream = Upstream::start();
    let envoy = Envoy::start("{}", &upstream);
    let r = get(envoy.addr(), "/", &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.text(), UPSTREAM_BODY);
    let failures = wasm_failures(&envoy.log());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    drop(envoy);

    let log = Envoy::start_expecting_failure(
        json!({"rate_limits": [{"name": "r", "key": ["source_ip"], "limit": 0, "window": "10s"}]}),
    );
    let line = config_error_line(&log).unwrap_or_else(|| panic!("no `invalid configuration` line:\n{}", tail(&log, 15)));
    println!("{line}");
    assert!(line.contains("rate_limits[0].limit:"), "the field is named: {line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_a_quota_is_exact_across_two_workers() {
    const LIMIT: u64 = 200;
    const TOTAL: u64 = 3 * LIMIT;
    const CLIENTS: usize = 32;
    envoy_version();
    // The test takes about a second: keep it inside one hour-long window.
    wait_for_window_phase(HOUR, Duration::from_secs(5), HOUR - Duration::from_secs(20));
    let upstream = Upstream::counting_header("x-api-key");
    let envoy = Envoy::start(
        json!({"rate_limits": [
            {"name": "exact", "key": [{"header": "x-api-key"}], "limit": LIMIT, "window": "1h"}
        ]}),
        &upstream,
    );
    let started = Instant::now();
    // 32 keep-alive connections: the kernel spreads them over both workers.
    let statuses = send_numbered(envoy.addr(), CLIENTS, TOTAL, |_| vec![("x-api-key", "k".to_string())]).await;
    let ok = statuses.get(&200).copied().unwrap_or(0);
    let limited = statuses.get(&429).copied().unwrap_or(0);
    let other: Vec<_> = statuses.iter().filter(|(s, _)| !matches!(s, 200 | 429)).collect();
    let per_worker = envoy.connections_per_worker();
    println!(
        "{} requests in {:.2} s: {ok} × 200, {limited} × 429; upstream saw {}; connections per worker {per_worker:?}",
        statuses.values().sum::<u64>(),
        started.elapsed().as_secs_f64(),
        upstream.total()
    );
    assert!(other.is_empty(), "unexpected statuses: {other:?}");
    assert_eq!(ok, LIMIT, "exactly the limit is admitted");
    assert_eq!(limited, TOTAL - LIMIT, "the rest is refused");
    assert_eq!(upstream.count_for("k"), LIMIT);
    assert!(
        per_worker.len() >= 2 && per_worker.iter().all(|&c| c > 0),
        "traffic must reach both workers: {per_worker:?}"
    );
    assert_eq!(
        envoy.wait_for_stat(&rule_stat("exact", "allowed"), LIMIT, Duration::from_secs(5)),
        Some(LIMIT)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_a_refusal_has_its_status_headers_and_problem_body() {
    envoy_version();
    let upstream = Upstream::start();
    let envoy = Envoy::start(
        json!({"rate_limits": [
            {"name": "per-user", "key": [{"header": "x-user"}], "limit": 1, "window": "1m"}
        ]}),
        &upstream,
    );
    let mut client = Client::connect(envoy.addr()).await.expect("connect");
    let first = client.get("/", &[("x-user", "u")]).await.expect("request");
    assert_eq!(first.status, 200, "{}", first.text());
    let r = client.get("/", &[("x-user", "u")]).await.expect("request");
    println!("{} {:?}\n{}", r.status, r.headers, r.text());
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let retry_after: u64 = r
        .header("retry-after")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no numeric retry-after: {:?}", r.headers));
    // The sliding window: the earliest admission is at most two windows away.
    assert!((1..=120).contains(&retry_after), "retry-after {retry_after}");
    let (policy, params) = parse_ratelimit_item(r.header("ratelimit-policy").expect("ratelimit-policy"));
    assert_eq!(policy, "per-user");
    assert_eq!(int_param(&params, "q"), 1);
    assert_eq!(int_param(&params, "w"), 60);
    let body = r.json();
    assert_eq!(body["type"], "https://iana.org/assignments/http-problem-types#quota-exceeded");
    assert_eq!(body["status"], 429);
    assert_eq!(body["retry_after"], retry_after);
    assert_eq!(upstream.total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_shedding_admits_its_limit_and_returns_to_zero() {
    const MAX: usize = 4;
    const DELAY: Duration = Duration::from_millis(1500);
    envoy_version();
    let upstream = Upstream::with_options(UpstreamOptions {
        delay: Some(DELAY),
        ..UpstreamOptions::default()
    });
    let envoy = Envoy::start(shedding_config(MAX as u32), &upstream);
    let addr = envoy.addr();
    let pending = send_prioritized(addr, "critical", 3 * MAX);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let under_load = get(addr, HEALTH_PATH, &[]).await;
    println!("health under load: {} {}", under_load.status, under_load.text());
    assert_eq!(under_load.status, 503);
    assert_eq!(under_load.json()["in_flight"], MAX as u64);
    let (ok, shed) = shed_outcome(pending, "critical", DELAY).await;
    println!("admitted {ok}, shed {shed}");
    assert_eq!((ok, shed), (MAX, 2 * MAX));
    let deadline = Instant::now() + Duration::from_secs(3);
    let body = loop {
        let r = get(addr, HEALTH_PATH, &[]).await;
        let body = r.json();
        if (r.status == 200 && body["in_flight"] == 0) || Instant::now() > deadline {
            break (r.status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("health after: {} {}", body.0, body.1);
    assert_eq!((body.0, &body.1["in_flight"]), (200, &json!(0)), "back to zero");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_cluster_selection_avoids_a_failing_cluster() {
    const ROUTE_HEADER: &str = "x-floodgate-cluster";
    envoy_version();
    let (envoy, [a, b, c]) = three_clusters_one_failing(ROUTE_HEADER);
    let warmup = closed_loop(envoy.addr(), 8, Duration::from_secs(2), &[]).await;
    let before = (a.total(), b.total(), c.total());
    let measured = closed_loop(envoy.addr(), 8, Duration::from_secs(3), &[]).await;
    let to_c = c.total() - before.2;
    let upstream_total = to_c + (a.total() - before.0) + (b.total() - before.1);
    println!(
        "warm-up {warmup:?}; then {} requests, {to_c} of {upstream_total} reached the failing cluster, {measured:?}",
        measured.total()
    );
    assert!(measured.total() > 500, "too little traffic to judge: {measured:?}");
    assert!(to_c as f64 <= 0.01 * upstream_total as f64, "{to_c} of {upstream_total} reached the failing cluster");
    assert!(measured.success_rate() >= 0.99, "clients saw {measured:?}");
    assert_eq!(a.count_for("a"), a.total(), "the filter set the route header");
}
