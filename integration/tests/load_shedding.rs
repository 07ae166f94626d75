//! Load shedding and the health endpoint, end to end: the built module in a real Envoy
//! (2 workers) in front of an upstream that answers slowly. Each test starts its own Envoy.

use std::time::{Duration, Instant};

use floodgate_integration::*;
use tokio::task::JoinHandle;

const HEALTH: &str = HEALTH_PATH;
const DELAY: Duration = Duration::from_millis(2500);
const SETTLE: Duration = Duration::from_millis(400);

fn slow_upstream() -> Upstream {
    Upstream::with_options(UpstreamOptions {
        delay: Some(DELAY),
        ..UpstreamOptions::default()
    })
}

/// One request on its own connection, with its latency.
type Pending = JoinHandle<(u16, Duration, Response)>;

fn send(addr: std::net::SocketAddr, class: &'static str, n: usize) -> Vec<Pending> {
    (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let started = Instant::now();
                let r = get(addr, "/work", &[("x-floodgate-priority", class)]).await;
                (r.status, started.elapsed(), r)
            })
        })
        .collect()
}

/// Waits for every request; returns (admitted 200s, shed 503s), checking every shed answer was
/// fast and well-formed.
async fn outcome(pending: Vec<Pending>, class: &str) -> (usize, usize) {
    let (mut ok, mut shed) = (0, 0);
    for p in pending {
        let (status, latency, r) = p.await.expect("request task");
        match status {
            200 => ok += 1,
            503 => {
                shed += 1;
                assert!(
                    latency < DELAY / 5,
                    "a shed request must be refused fast: {latency:?} (upstream delay {DELAY:?})"
                );
                assert_eq!(r.header("content-type"), Some("application/problem+json"));
                assert_eq!(r.header("retry-after"), Some("2"));
                let body = r.json();
                assert_eq!(
                    body["type"],
                    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
                );
                assert_eq!(body["status"], 503);
                assert_eq!(body["class"], class);
                assert!(body["in_flight"].as_u64().is_some(), "{body}");
                assert!(body["max_active_requests"].as_u64().is_some(), "{body}");
            }
            other => panic!("unexpected status {other}: {}", r.text()),
        }
    }
    (ok, shed)
}

async fn health(envoy: &Envoy) -> (u16, Value) {
    let r = get(envoy.addr(), HEALTH, &[]).await;
    (r.status, r.json())
}

/// Polls the health endpoint until the in-flight count is `expected` (bounded).
async fn wait_in_flight(envoy: &Envoy, expected: u64, within: Duration) -> (u16, Value) {
    let deadline = Instant::now() + within;
    loop {
        let (status, body) = health(envoy).await;
        if body["in_flight"] == expected || Instant::now() > deadline {
            return (status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_the_limit_is_admitted_and_the_rest_refused_fast() {
    const MAX: usize = 8;
    let upstream = slow_upstream();
    let envoy = Envoy::start(shedding_config(MAX as u32), &upstream);
    let (status, body) = health(&envoy).await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")), "{body}");

    let pending = send(envoy.addr(), "critical", 5 * MAX);
    tokio::time::sleep(SETTLE).await;
    let (status, body) = health(&envoy).await;
    println!("health under load: {status} {body}");
    assert_eq!(status, 503, "the health endpoint flips under load: {body}");
    assert_eq!(body["in_flight"], MAX as u64);

    let (ok, shed) = outcome(pending, "critical").await;
    println!("admitted {ok}, shed {shed}, upstream saw {}", upstream.total());
    assert_eq!((ok, shed), (MAX, 4 * MAX));
    assert_eq!(upstream.total(), MAX as u64);

    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(3)).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "back to zero: {body}");
    assert_eq!(
        envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.critical.shed"), 4 * MAX as u64, Duration::from_secs(5)),
        Some(4 * MAX as u64)
    );
    assert_eq!(
        envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.in_flight"), 0, Duration::from_secs(5)),
        Some(0)
    );

    // The whole limit is available again.
    let (ok, shed) = outcome(send(envoy.addr(), "critical", 2 * MAX), "critical").await;
    assert_eq!((ok, shed), (MAX, MAX));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_classes_are_shed_in_order() {
    // Limit 10: low is shed from 3 in flight, normal from 6, critical from 10.
    let upstream = Upstream::with_options(UpstreamOptions {
        delay: Some(Duration::from_secs(4)),
        ..UpstreamOptions::default()
    });
    let envoy = Envoy::start(shedding_config(10), &upstream);
    let addr = envoy.addr();

    let low = send(addr, "low", 5);
    tokio::time::sleep(SETTLE).await;
    let normal = send(addr, "normal", 5);
    tokio::time::sleep(SETTLE).await;
    let unnamed: Vec<Pending> = (0..2)
        .map(|_| {
            tokio::spawn(async move {
                let started = Instant::now();
                let r = get(addr, "/work", &[("x-floodgate-priority", "no-such-class")]).await;
                (r.status, started.elapsed(), r)
            })
        })
        .collect();
    tokio::time::sleep(SETTLE).await;
    let critical = send(addr, "critical", 6);

    let low = outcome(low, "low").await;
    let normal = outcome(normal, "normal").await;
    let unnamed = outcome(unnamed, "normal").await;
    let critical = outcome(critical, "critical").await;
    println!("admitted/shed: low {low:?}, normal {normal:?}, unknown class {unnamed:?}, critical {critical:?}");
    assert_eq!(low, (3, 2), "low fills to 3");
    assert_eq!(normal, (3, 2), "normal fills from 3 to 6");
    assert_eq!(unnamed, (0, 2), "an unknown class is the default class (normal), full at 6");
    assert_eq!(critical, (4, 2), "critical fills to the limit, 10");
    assert_eq!(upstream.total(), 10);
    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(3)).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_up_clients_and_upstream_resets_give_the_limit_back() {
    const MAX: usize = 6;
    let upstream = Upstream::with_options(UpstreamOptions {
        delay: Some(Duration::from_secs(10)),
        ..UpstreamOptions::default()
    });
    let envoy = Envoy::start(shedding_config(MAX as u32), &upstream);

    // Clients that hang up mid-request.
    let hanging = send(envoy.addr(), "critical", MAX);
    tokio::time::sleep(SETTLE).await;
    let (status, body) = health(&envoy).await;
    assert_eq!((status, &body["in_flight"]), (503, &json!(MAX)), "{body}");
    for task in &hanging {
        task.abort();
    }
    let started = Instant::now();
    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(5)).await;
    println!("in flight back to 0 {:?} after the clients hung up", started.elapsed());
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "{body}");

    // Upstream resets: the upstream goes away while requests are in flight.
    let reset = send(envoy.addr(), "critical", MAX);
    tokio::time::sleep(SETTLE).await;
    let (_, body) = health(&envoy).await;
    assert_eq!(body["in_flight"], MAX as u64, "{body}");
    drop(upstream);
    let mut statuses = Vec::new();
    for task in reset {
        statuses.push(task.await.expect("request task").0);
    }
    println!("statuses after the upstream reset: {statuses:?}");
    assert!(statuses.iter().all(|s| *s >= 500), "{statuses:?}");
    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(5)).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "{body}");

    // None of those requests was shed: the limit was fully available each time.
    let shed_total = envoy.stat(&format!("{STAT_PREFIX}.load_shedding.critical.shed"));
    assert_eq!(shed_total, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_endpoint_never_reaches_the_upstream_nor_counts() {
    let upstream = Upstream::start();
    let envoy = Envoy::start(shedding_config(4), &upstream);
    for _ in 0..20 {
        let r = get(envoy.addr(), "/floodgate/health?probe=1", &[]).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.json()["in_flight"], 0);
    }
    assert_eq!(upstream.total(), 0);
    let r = get(envoy.addr(), "/other", &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(upstream.total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_timeouts_and_later_refusals_give_the_limit_back() {
    const MAX: usize = 4;
    let upstream = Upstream::with_options(UpstreamOptions {
        delay: Some(Duration::from_secs(5)),
        ..UpstreamOptions::default()
    });
    // A rate limit after the shedding stage refuses the third request of every key.
    let mut config = shedding_config(MAX as u32);
    config["rate_limits"] = json!([{"name": "per-key", "key": [{"header": "x-key"}], "limit": 2, "window": "1h"}]);
    let envoy = Envoy::builder(config)
        .upstream(&upstream)
        .route_timeout(Duration::from_millis(800))
        .start();

    // Timeouts: the upstream answers after 5 s, the route gives up after 0.8 s with a 504.
    let pending: Vec<Pending> = (0..MAX)
        .map(|i| {
            let addr = envoy.addr();
            tokio::spawn(async move {
                let started = Instant::now();
                let key = format!("timeout-{i}");
                let r = get(addr, "/work", &[("x-floodgate-priority", "critical"), ("x-key", &key)]).await;
                (r.status, started.elapsed(), r)
            })
        })
        .collect();
    for p in pending {
        let (status, _, r) = p.await.expect("task");
        assert_eq!(status, 504, "{}", r.text());
    }
    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(3)).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "after timeouts: {body}");

    // Local replies of a later stage: the rate limit refuses after the request was admitted.
    let mut statuses = Vec::new();
    for _ in 0..3 * MAX {
        let r = get(envoy.addr(), "/work", &[("x-floodgate-priority", "critical"), ("x-key", "same")]).await;
        statuses.push(r.status);
        if r.status == 429 {
            assert_eq!(r.json()["violated-policies"], json!(["per-key"]));
        }
    }
    // Two 504s (the upstream is slow), then 429s; never a 503: nothing leaked.
    println!("statuses: {statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 3 * MAX - 2, "{statuses:?}");
    assert!(!statuses.contains(&503), "{statuses:?}");
    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(3)).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "after 429s: {body}");
}
