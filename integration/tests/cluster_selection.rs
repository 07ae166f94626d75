//! Cluster selection end to end: the built module in a real Envoy (2 workers) choosing among
//! real upstream clusters through the route's `cluster_header`. Each test starts its own Envoy.
//! Figures are printed (`--nocapture`) for the README and the closing notes.

use std::time::{Duration, Instant};

use floodgate_integration::*;

const ROUTE_HEADER: &str = "x-floodgate-cluster";

fn cluster_stat(cluster: &str, what: &str) -> String {
    format!("{STAT_PREFIX}.cluster.{cluster}.{what}")
}

/// An upstream that counts requests per value of the route header it receives.
fn counted() -> Upstream {
    Upstream::counting_header(ROUTE_HEADER)
}

/// Three clusters, `c` answering 503 to everything: floodgate (default tuning) steers away from
/// it; plain round-robin over the same three upstreams does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_cluster_gets_almost_no_traffic_unlike_round_robin() {
    let (envoy, [a, b, c]) = three_clusters_one_failing(ROUTE_HEADER);
    let warmup = closed_loop(envoy.addr(), 8, Duration::from_secs(3), &[]).await;
    let c_before = c.total();
    let (a_before, b_before) = (a.total(), b.total());
    let measured = closed_loop(envoy.addr(), 8, Duration::from_secs(5), &[]).await;
    let to_c = c.total() - c_before;
    let upstream_total = to_c + (a.total() - a_before) + (b.total() - b_before);
    let share_c = to_c as f64 / upstream_total.max(1) as f64;
    println!(
        "floodgate: warm-up 3 s {} requests ({:.2}% 200); next 5 s {} requests, {:.3}% reached the failing cluster, clients {:.3}% 200 ({:?})",
        warmup.total(),
        warmup.success_rate() * 100.0,
        measured.total(),
        share_c * 100.0,
        measured.success_rate() * 100.0,
        measured
    );
    assert!(measured.total() > 1000, "too little traffic to judge: {measured:?}");
    assert!(share_c <= 0.01, "{to_c} of {upstream_total} requests reached the failing cluster");
    assert!(measured.success_rate() >= 0.99, "clients saw {measured:?}");
    // The upstreams saw the header the filter set, and the stats agree with them.
    assert_eq!(a.count_for("a"), a.total());
    assert_eq!(b.count_for("b"), b.total());
    let stats = envoy.stats();
    let stat = |name: String| stats.get(&name).copied().unwrap_or(0);
    assert_eq!(stat(cluster_stat("c", "failure")), c.total(), "every 503 of c counted as a failure");
    assert_eq!(stat(cluster_stat("a", "success")), a.total());
    let rate_c = envoy.wait_for_stat(&cluster_stat("c", "success_rate_ppm"), 0, Duration::from_secs(3));
    assert_eq!(rate_c, Some(0), "c's success-rate gauge");
    assert_eq!(stat(cluster_stat("a", "success_rate_ppm")), 1_000_000);
    drop(envoy);

    // The same three upstreams behind Envoy's own round-robin, no selection.
    let baseline = Envoy::builder("{}").upstream(&a).upstream(&b).upstream(&c).start();
    let round_robin = closed_loop(baseline.addr(), 8, Duration::from_secs(5), &[]).await;
    println!(
        "round-robin: {} requests, clients {:.3}% 200 ({:?})",
        round_robin.total(),
        round_robin.success_rate() * 100.0,
        round_robin
    );
    assert!(round_robin.success_rate() < 0.75, "round-robin should suffer from c: {round_robin:?}");
    println!(
        "success rate: floodgate {:.3}% vs round-robin {:.3}%",
        measured.success_rate() * 100.0,
        round_robin.success_rate() * 100.0
    );
}

/// A failed cluster that recovers gets traffic back once its window ages out and a probe
/// succeeds. Short buckets and a larger floor keep the test short; the time is measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_cluster_gets_traffic_back() {
    let (a, b, c) = (counted(), counted(), counted());
    c.set_status(500);
    let config = json!({"cluster_selection": {
        "clusters": ["a", "b", "c"], "bucket_width": "500ms", "buckets": 6, "no_data_floor": 0.03
    }});
    let envoy = Envoy::builder(config)
        .cluster("a", &[a.addr()])
        .cluster("b", &[b.addr()])
        .cluster("c", &[c.addr()])
        .route_by_header(ROUTE_HEADER)
        .start();
    let failing = closed_loop(envoy.addr(), 8, Duration::from_secs(3), &[]).await;
    let c_failed = c.total();
    println!("while c fails: {failing:?}, c received {c_failed}");
    c.set_status(200);
    let recovered_at = Instant::now();
    let deadline = recovered_at + Duration::from_secs(20);
    let mut back_after = None;
    while Instant::now() < deadline {
        let before = (a.total() + b.total(), c.total());
        let slice = closed_loop(envoy.addr(), 8, Duration::from_millis(500), &[]).await;
        let to_c = c.total() - before.1;
        let total = (a.total() + b.total() - before.0) + to_c;
        if total > 0 && to_c as f64 / total as f64 >= 0.2 {
            back_after = Some(recovered_at.elapsed());
            println!("c back to {to_c} of {total} requests in a 500 ms slice, {:?} after it recovered ({slice:?})", recovered_at.elapsed());
            break;
        }
    }
    let back_after = back_after.expect("c did not get ≥ 20% of the traffic back within 20 s");
    // The window is 3 s; after it ages out the floor gives c ~0.5% of the requests as probes.
    assert!(back_after < Duration::from_secs(10), "recovery took {back_after:?}");
}

/// A cluster that answers slowly has its concurrency limit cut down (AIMD) and the others take
/// the load; clients see only successes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_cluster_s_limit_falls_and_the_others_take_the_load() {
    let (a, b) = (counted(), counted());
    let slow = Upstream::with_options(UpstreamOptions {
        delay: Some(Duration::from_millis(800)),
        count_header: Some(ROUTE_HEADER.into()),
        ..UpstreamOptions::default()
    });
    let config = json!({"cluster_selection": {
        "clusters": ["a", "b", "slow"],
        "concurrency_limit": {"initial_limit": 20, "min_limit": 1, "max_limit": 50, "timeout": "200ms"}
    }});
    let envoy = Envoy::builder(config)
        .cluster("a", &[a.addr()])
        .cluster("b", &[b.addr()])
        .cluster("slow", &[slow.addr()])
        .route_by_header(ROUTE_HEADER)
        .start();
    let first = closed_loop(envoy.addr(), 12, Duration::from_secs(4), &[]).await;
    let slow_before = slow.total();
    let fast_before = a.total() + b.total();
    let second = closed_loop(envoy.addr(), 12, Duration::from_secs(4), &[]).await;
    let to_slow = slow.total() - slow_before;
    let to_fast = a.total() + b.total() - fast_before;
    let limit = envoy.wait_for_stat(&cluster_stat("slow", "concurrency_limit"), 1, Duration::from_secs(3));
    println!(
        "slow cluster: limit gauge {limit:?}; first 4 s {first:?}; next 4 s {to_slow} requests to slow, {to_fast} to a+b, clients {:?}",
        second
    );
    assert_eq!(limit, Some(1), "the slow cluster's limit fell to min_limit");
    assert!(to_fast > 20 * to_slow.max(1), "a and b took the load: {to_fast} vs {to_slow}");
    assert!(to_slow <= 12, "at most ~1 lease per 0.8 s on the slow cluster: {to_slow}");
    assert_eq!(second.ok(), second.total(), "clients see only 200s: {second:?}");
    let slow_count = envoy.stat(&cluster_stat("slow", "slow")).unwrap_or(0);
    assert!(slow_count >= 1, "slow answers are counted as `slow`");
}

/// "Slow" is the upstream's latency, not the stream's. Clients that take seconds to
/// upload their request or to read their response (a big download through a small receive
/// window) say nothing about the upstream, which answers at once: before, each of them was a
/// "slow" success that cut the cluster's limit by ×0.9 (20 such requests cut 200 to 21), so a
/// client could shrink a healthy cluster on purpose. Now they are successes, and the limit
/// stays. An upstream that is slow to answer still is slow (see the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_do_not_shrink_a_healthy_cluster() {
    const LIMIT: u64 = 200;
    const BIG: usize = 16 << 20;
    let upstream = Upstream::with_options(UpstreamOptions { body_bytes: Some(BIG), ..UpstreamOptions::default() });
    let config = json!({"cluster_selection": {
        "clusters": ["a"],
        "concurrency_limit": {"initial_limit": LIMIT, "min_limit": 1, "max_limit": LIMIT, "timeout": "1s"}
    }});
    let envoy = Envoy::builder(config)
        .cluster("a", &[upstream.addr()])
        .route_by_header(ROUTE_HEADER)
        .start();
    let addr = envoy.addr();
    let uploads: Vec<_> = (0..10)
        .map(|_| tokio::spawn(async move { slow_clients::slow_upload(addr, "/work", &[], 10, Duration::from_millis(300)).await }))
        .collect();
    let downloads: Vec<_> = (0..10)
        .map(|_| tokio::spawn(async move { slow_clients::slow_download(addr, "/work", &[], 256 << 10, Duration::from_millis(100)).await }))
        .collect();
    let mut slowest = Duration::ZERO;
    for upload in uploads {
        let (status, took) = upload.await.expect("upload task").expect("slow upload");
        assert_eq!(status, 200);
        slowest = slowest.max(took);
    }
    for download in downloads {
        let (status, read, took) = download.await.expect("download task").expect("slow download");
        assert_eq!(status, 200);
        assert!(read >= BIG, "the whole body was read ({read} bytes)");
        slowest = slowest.max(took);
    }
    println!("20 slow clients, the slowest took {:.1} s", slowest.as_secs_f64());
    assert!(slowest > Duration::from_secs(2), "the clients were slow: {slowest:?}");
    // The gauges follow at the next heartbeat.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let stats = envoy.stats_matching(&format!("{STAT_PREFIX}.cluster.a."));
    println!("{stats}");
    assert_eq!(envoy.stat(&cluster_stat("a", "slow")), Some(0), "no slow answer");
    assert_eq!(envoy.stat(&cluster_stat("a", "success")), Some(20));
    assert_eq!(envoy.stat(&cluster_stat("a", "concurrency_limit")), Some(LIMIT), "the limit stays");
}

/// With every cluster at its (fixed) limit, further requests fail fast with the 503 that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_cluster_at_its_limit_requests_fail_fast() {
    let slow = || {
        Upstream::with_options(UpstreamOptions {
            delay: Some(Duration::from_millis(1500)),
            ..UpstreamOptions::default()
        })
    };
    let (a, b) = (slow(), slow());
    let config = json!({"cluster_selection": {
        "clusters": ["a", "b"], "retry_after": "2s",
        "concurrency_limit": {"initial_limit": 2, "min_limit": 2, "max_limit": 2, "timeout": "10s"}
    }});
    let envoy = Envoy::builder(config)
        .cluster("a", &[a.addr()])
        .cluster("b", &[b.addr()])
        .route_by_header(ROUTE_HEADER)
        .start();
    let addr = envoy.addr();
    let held: Vec<_> = (0..4).map(|_| tokio::spawn(async move { get(addr, "/work", &[]).await })).collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut fast = Vec::new();
    for _ in 0..8 {
        let started = Instant::now();
        let r = get(addr, "/work", &[]).await;
        fast.push((r, started.elapsed()));
    }
    for (r, latency) in &fast {
        assert_eq!(r.status, 503, "{}", r.text());
        assert!(*latency < Duration::from_millis(500), "a refusal took {latency:?}");
        assert_eq!(r.header("retry-after"), Some("2"));
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        let body = r.json();
        assert_eq!(body["type"], "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity");
        assert!(body["detail"].as_str().unwrap().contains("concurrency limit"), "{body}");
        assert_eq!(body["clusters"], json!([{"name": "a", "in_flight": 2, "limit": 2}, {"name": "b", "in_flight": 2, "limit": 2}]));
    }
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(a.total() + b.total(), 4, "only the four leased requests reached upstreams");
    assert_eq!(envoy.stat(&format!("{STAT_PREFIX}.cluster_selection.exhausted")), Some(8));
    let slowest = fast.iter().map(|(_, l)| *l).max().unwrap();
    println!("8 refusals with both clusters at 2/2, slowest {slowest:?}");
    // Leases came back: the next requests are admitted.
    assert_eq!(get(addr, "/work", &[]).await.status, 200);
    let in_flight = envoy.wait_for_stat(&cluster_stat("a", "in_flight"), 0, Duration::from_secs(3));
    assert_eq!(in_flight, Some(0));
}

/// A request the rate limit admits and no cluster has room for gets the 503 and gives its
/// units back: the key's next requests are not refused by a quota they never used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_no_cluster_has_room_for_consumes_no_quota() {
    wait_for_window_phase(Duration::from_secs(3600), Duration::from_secs(60), Duration::from_secs(3600 - 120));
    let slow = Upstream::with_options(UpstreamOptions { delay: Some(Duration::from_millis(1000)), ..UpstreamOptions::default() });
    let config = json!({
        "rate_limits": [{"name": "per-key", "key": [{"header": "x-key"}], "limit": 3, "window": "1h"}],
        "cluster_selection": {
            "clusters": ["a"],
            "concurrency_limit": {"initial_limit": 1, "min_limit": 1, "max_limit": 1, "timeout": "10s"}
        }
    });
    let envoy = Envoy::builder(config).cluster("a", &[slow.addr()]).route_by_header(ROUTE_HEADER).start();
    let addr = envoy.addr();
    let held = tokio::spawn(async move { get(addr, "/work", &[("x-key", "k")]).await.status });
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..4 {
        assert_eq!(get(addr, "/work", &[("x-key", "k")]).await.status, 503, "the cluster is full");
    }
    assert_eq!(held.await.unwrap(), 200);
    let mut after = Vec::new();
    for _ in 0..3 {
        after.push(get(addr, "/work", &[("x-key", "k")]).await.status);
    }
    assert_eq!(after, [200, 200, 429], "the four 503s took none of the key's 3");
    assert_eq!(envoy.stat(&format!("{STAT_PREFIX}.rate_limit.per-key.allowed")), Some(7));
}

/// A client cannot choose the cluster: the filter overwrites the route header, even when it
/// names a cluster Envoy has but the selection does not list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sent_route_header_cannot_steer() {
    let (a, b) = (counted(), counted());
    let forbidden = Upstream::start();
    let envoy = Envoy::builder(json!({"cluster_selection": {"clusters": ["a", "b"]}}))
        .upstream(&forbidden)
        .cluster("a", &[a.addr()])
        .cluster("b", &[b.addr()])
        .route_by_header(ROUTE_HEADER)
        .start();
    let steered = closed_loop(envoy.addr(), 4, Duration::from_secs(2), &[(ROUTE_HEADER, "upstream")]).await;
    let only_b = closed_loop(envoy.addr(), 4, Duration::from_secs(2), &[(ROUTE_HEADER, "b")]).await;
    println!("client-sent header: {steered:?} / {only_b:?}; a {} b {} forbidden {}", a.total(), b.total(), forbidden.total());
    assert_eq!(forbidden.total(), 0, "a client-named cluster outside the selection was never reached");
    assert_eq!(steered.ok(), steered.total());
    // Asking for `b` does not pin traffic to b: both clusters keep their share.
    let both = (a.total() + b.total()) as f64;
    assert!(a.total() as f64 > 0.2 * both && b.total() as f64 > 0.2 * both, "a {} b {}", a.total(), b.total());
    assert_eq!(a.count_for("a"), a.total(), "the value upstream sees is the filter's choice");
    assert_eq!(b.count_for("b"), b.total());
}

/// The health endpoint's dependency view. With `dependencies: "report"` the answer
/// lists the clusters' success rates and limits but stays the proxy's own (200: every proxy of
/// a fleet sees the same failing clusters, and would leave rotation at once); with `"fail"` it
/// turns 503 while every cluster fails, and back to 200 when one recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_endpoint_reports_dependencies_and_fails_on_them_only_when_asked() {
    let (a, b) = (counted(), counted());
    let start = |dependencies: &str| {
        let config = json!({
            "cluster_selection": {"clusters": ["a", "b"], "bucket_width": "1s"},
            "health": {"path": HEALTH_PATH, "dependencies": dependencies}
        });
        Envoy::builder(config)
            .cluster("a", &[a.addr()])
            .cluster("b", &[b.addr()])
            .route_by_header(ROUTE_HEADER)
            .start()
    };
    let (reporting, failing) = (start("report"), start("fail"));
    a.set_status(503);
    b.set_status(503);
    for envoy in [&reporting, &failing] {
        for _ in 0..40 {
            assert_eq!(get(envoy.addr(), "/work", &[]).await.status, 503);
        }
    }
    let health = |envoy: &Envoy| {
        let addr = envoy.addr();
        async move {
            let r = get(addr, HEALTH_PATH, &[]).await;
            (r.status, r.json())
        }
    };
    let (status, body) = health(&reporting).await;
    println!("report, every cluster failing: {status} {body}");
    assert_eq!((status, &body["status"], &body["dependencies"]), (200, &json!("ok"), &json!("failing")), "{body}");
    assert_eq!(body["clusters"].as_array().map(Vec::len), Some(2), "{body}");
    assert!(body["clusters"][0]["success_rate"].as_f64().is_some_and(|r| r < 0.5), "{body}");
    let (status, body) = health(&failing).await;
    println!("fail, every cluster failing: {status} {body}");
    assert_eq!((status, &body["status"]), (503, &json!("dependencies_failing")), "{body}");
    // One cluster recovers: once its bucket holds successes, the answer is green again.
    a.set_status(200);
    let deadline = Instant::now() + Duration::from_secs(10);
    let (status, body) = loop {
        let _ = get(failing.addr(), "/work", &[]).await;
        let (status, body) = health(&failing).await;
        if status == 200 || Instant::now() > deadline {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("fail, cluster a recovered: {status} {body}");
    assert_eq!((status, &body["dependencies"]), (200, &json!("ok")), "{body}");
}

