//! Soak: a bounded run at high load through every stage of the filter at once (many rate-limit
//! keys with evictions, load shedding by priority class, cluster selection over three
//! clusters), then the books are checked:
//!
//! - Envoy's resident memory is flat after the warm-up;
//! - the in-flight count (health endpoint, gauge, per-cluster leases) is back to exactly zero;
//! - admitted counts are exact: each tenant got exactly its quota, the counters agree with what
//!   the clients saw, and the upstreams saw exactly the requests answered 200;
//! - the module never failed.
//!
//! Duration: `FLOODGATE_SOAK_SECS` (default 40 s: the key table is full within the warm-up, a
//! quarter of the run, and a quarter of the requests are a tenant's, so that each tenant sends
//! several times its quota).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_integration::dynamic::{DynamicEnvoy, FilterVersion};
use floodgate_integration::*;

const HEALTH: &str = "/floodgate/health";
const ROUTE_HEADER: &str = "x-floodgate-cluster";
const CLUSTERS: [&str; 3] = ["a", "b", "c"];
const TENANTS: usize = 16;
/// Each tenant's quota (in a 366-day window: no boundary is crossed during the run).
const TENANT_QUOTA: u64 = 300;
const KEYS: u64 = 200_000;
const CLIENTS: usize = 48;
const MAX_ACTIVE: u32 = 32;
const UPSTREAM_DELAY: Duration = Duration::from_millis(10);
const CLASSES: [&str; 3] = ["critical", "normal", "low"];
/// How long a client pauses after being shed.
const SHED_PAUSE: Duration = Duration::from_millis(20);
const MAX_RSS_GROWTH: u64 = 16 * 1024 * 1024;

fn soak_duration() -> Duration {
    let secs = std::env::var("FLOODGATE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(40);
    Duration::from_secs(secs.max(10))
}

fn config() -> Value {
    json!({
        "rate_limits": [
            {"name": "per-key", "key": [{"header": "x-api-key"}], "limit": 100, "window": "1m", "capacity": 4096},
            {"name": "per-tenant", "key": [{"header": "x-tenant"}], "limit": TENANT_QUOTA, "window": "8784h", "capacity": 1024}
        ],
        "load_shedding": {
            "max_active_requests": MAX_ACTIVE,
            "classes": [
                {"name": "critical", "shed_at": 1.0},
                {"name": "normal", "shed_at": 0.75},
                {"name": "low", "shed_at": 0.4}
            ]
        },
        "cluster_selection": {"route_header": ROUTE_HEADER, "clusters": CLUSTERS},
        "health": {"path": HEALTH}
    })
}

/// What the clients saw.
#[derive(Debug, Default)]
struct Books {
    sent: u64,
    statuses: BTreeMap<u16, u64>,
    errors: u64,
    /// 503s of load shedding, per class.
    shed: BTreeMap<String, u64>,
    /// 503s of cluster selection (no cluster with room).
    no_cluster: u64,
    /// Requests every rate limit admitted (neither shed nor 429).
    passed: u64,
    tenant_sent: [u64; TENANTS],
    tenant_passed: [u64; TENANTS],
}

impl Books {
    fn add(&mut self, other: Books) {
        self.sent += other.sent;
        for (s, n) in other.statuses {
            *self.statuses.entry(s).or_default() += n;
        }
        self.errors += other.errors;
        for (c, n) in other.shed {
            *self.shed.entry(c).or_default() += n;
        }
        self.no_cluster += other.no_cluster;
        self.passed += other.passed;
        for t in 0..TENANTS {
            self.tenant_sent[t] += other.tenant_sent[t];
            self.tenant_passed[t] += other.tenant_passed[t];
        }
    }

    fn status(&self, s: u16) -> u64 {
        self.statuses.get(&s).copied().unwrap_or(0)
    }
}

/// A small deterministic generator per client (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

async fn client(addr: SocketAddr, seed: u64, stop: Arc<AtomicBool>) -> Books {
    let mut books = Books::default();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut conn: Option<Client> = None;
    while !stop.load(Ordering::Relaxed) {
        if conn.is_none() {
            match Client::connect(addr).await {
                Ok(c) => conn = Some(c),
                Err(_) => {
                    books.errors += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let r = rng.next();
        let key = format!("key-{}", r % KEYS);
        let class = CLASSES[((r >> 20) % 3) as usize];
        let tenant = ((r >> 24) % 4 == 0).then(|| ((r >> 32) % TENANTS as u64) as usize);
        let tenant_name = tenant.map(|t| format!("tenant-{t}"));
        let mut headers = vec![("x-api-key", key.as_str()), ("x-floodgate-priority", class)];
        if let Some(name) = &tenant_name {
            headers.push(("x-tenant", name.as_str()));
        }
        books.sent += 1;
        if let Some(t) = tenant {
            books.tenant_sent[t] += 1;
        }
        let response = match c.get("/work", &headers).await {
            Ok(r) => r,
            Err(_) => {
                books.errors += 1;
                conn = None;
                continue;
            }
        };
        *books.statuses.entry(response.status).or_default() += 1;
        let passed = match response.status {
            429 => false,
            503 => {
                let body: Value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
                if let Some(class) = body["class"].as_str() {
                    *books.shed.entry(class.to_string()).or_default() += 1;
                    // A polite client waits a little before trying again.
                    tokio::time::sleep(SHED_PAUSE).await;
                    false
                } else {
                    if body["clusters"].is_array() {
                        books.no_cluster += 1;
                    }
                    true
                }
            }
            _ => true,
        };
        if passed {
            books.passed += 1;
            if let Some(t) = tenant {
                books.tenant_passed[t] += 1;
            }
        }
    }
    books
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_at_high_load_keeps_memory_flat_and_the_books_exact() {
    let duration = soak_duration();
    let upstreams: Vec<Upstream> = CLUSTERS
        .iter()
        .map(|_| {
            Upstream::with_options(UpstreamOptions {
                count_header: Some("x-tenant".into()),
                delay: Some(UPSTREAM_DELAY),
                ..UpstreamOptions::default()
            })
        })
        .collect();
    let mut builder = DynamicEnvoy::builder(FilterVersion::new(config())).route_by_header(ROUTE_HEADER);
    for (name, upstream) in CLUSTERS.iter().zip(&upstreams) {
        builder = builder.cluster(name, &[upstream.addr()]);
    }
    let envoy = builder.start();
    let rss_start = envoy.rss_bytes();
    println!("soak: {} s, {CLIENTS} clients, {KEYS} keys, {TENANTS} tenants × {TENANT_QUOTA}", duration.as_secs());

    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(client(envoy.addr(), i as u64 + 1, stop.clone())))
        .collect();
    let warm_up = duration / 4;
    let mut samples: Vec<(f64, u64, u64)> = Vec::new();
    let mut rss_warm = None;
    while started.elapsed() < duration {
        tokio::time::sleep(Duration::from_secs(5).min(duration.saturating_sub(started.elapsed()))).await;
        let (_, body) = envoy.get_json(HEALTH, &[]).await.expect("health");
        let in_flight = body["in_flight"].as_u64().unwrap_or(u64::MAX);
        let rss = envoy.rss_bytes();
        samples.push((started.elapsed().as_secs_f64(), rss, in_flight));
        if rss_warm.is_none() && started.elapsed() >= warm_up {
            rss_warm = Some(rss);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut books = Books::default();
    for t in tasks {
        books.add(t.await.expect("client task"));
    }
    let elapsed = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_end = envoy.rss_bytes();
    let rss_warm = rss_warm.unwrap_or(rss_start);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);

    println!(
        "sent {} in {:.1} s ({:.0}/s): statuses {:?}, transport errors {}",
        books.sent,
        elapsed.as_secs_f64(),
        books.sent as f64 / elapsed.as_secs_f64(),
        books.statuses,
        books.errors
    );
    println!("shed by class {:?}; no cluster with room {}; passed the rate limits {}", books.shed, books.no_cluster, books.passed);
    println!("per tenant, sent / passed: {:?}", books.tenant_sent.iter().zip(&books.tenant_passed).collect::<Vec<_>>());
    println!(
        "samples (s, RSS MiB, in flight): {:?}",
        samples.iter().map(|(t, r, f)| format!("{t:.0}s {:.1} {f}", mib(*r))).collect::<Vec<_>>()
    );
    println!(
        "Envoy RSS: {:.1} MiB at start, {:.1} MiB after the warm-up ({:.0} s), {:.1} MiB at the end ({:+.2} MiB)",
        mib(rss_start),
        mib(rss_warm),
        warm_up.as_secs_f64(),
        mib(rss_end),
        mib(rss_end) - mib(rss_warm)
    );
    println!("{}", stats_summary(&envoy));

    // Traffic went through every stage.
    assert_eq!(books.errors, 0, "no transport error");
    let expected_statuses = books.status(200) + books.status(429) + books.status(503);
    assert_eq!(expected_statuses, books.sent, "only 200, 429 and 503: {:?}", books.statuses);
    assert!(books.status(200) > 10_000, "sustained load: {:?}", books.statuses);
    assert!(books.shed.values().sum::<u64>() > 0, "shedding was exercised");
    assert!(envoy.stat(&rule_stat("per-key", "evictions")).unwrap_or(0) > 0, "the key table evicted");

    // Memory.
    assert!(
        rss_end < rss_warm + MAX_RSS_GROWTH,
        "Envoy's RSS grew {:.1} MiB after the warm-up",
        mib(rss_end) - mib(rss_warm)
    );

    // Nothing left in flight.
    let (status, body) = envoy.get_json(HEALTH, &[]).await.expect("health");
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "health at the end: {body}");
    let gauge = envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.in_flight"), 0, Duration::from_secs(5));
    assert_eq!(gauge, Some(0), "in-flight gauge at the end");
    for name in CLUSTERS {
        let leased = envoy.wait_for_stat(&format!("{STAT_PREFIX}.cluster.{name}.in_flight"), 0, Duration::from_secs(5));
        assert_eq!(leased, Some(0), "cluster {name}'s leases at the end");
    }

    // Exact books.
    assert_eq!(envoy.stat(&rule_stat("per-tenant", "evictions")), Some(0), "every tenant owns its entry");
    for t in 0..TENANTS {
        assert!(books.tenant_sent[t] > 2 * TENANT_QUOTA, "tenant {t} sent enough: {}", books.tenant_sent[t]);
        assert_eq!(books.tenant_passed[t], TENANT_QUOTA, "tenant {t} got exactly its quota");
        let upstream_saw: u64 = upstreams.iter().map(|u| u.count_for(&format!("tenant-{t}"))).sum();
        assert!(upstream_saw <= TENANT_QUOTA, "tenant {t}: upstreams saw {upstream_saw}");
    }
    let wait = Duration::from_secs(5);
    assert_eq!(
        envoy.wait_for_stat(&rule_stat("per-tenant", "allowed"), TENANTS as u64 * TENANT_QUOTA, wait),
        Some(TENANTS as u64 * TENANT_QUOTA)
    );
    assert_eq!(envoy.wait_for_stat(&rule_stat("per-key", "allowed"), books.passed, wait), Some(books.passed));
    for (class, n) in &books.shed {
        let name = format!("{STAT_PREFIX}.load_shedding.{class}.shed");
        assert_eq!(envoy.wait_for_stat(&name, *n, wait), Some(*n), "{name}");
    }
    let upstream_total: u64 = upstreams.iter().map(Upstream::total).sum();
    assert_eq!(upstream_total, books.status(200), "the upstreams saw exactly the requests answered 200");
    let selected: u64 = CLUSTERS
        .iter()
        .map(|c| envoy.stat(&format!("{STAT_PREFIX}.cluster.{c}.selected")).unwrap_or(0))
        .sum();
    assert_eq!(selected, books.passed - books.no_cluster, "every request that passed was routed once");

    let failures = wasm_failures(&envoy.log());
    assert!(failures.is_empty(), "the module failed:\n{}", failures.join("\n"));
}

fn stats_summary(envoy: &DynamicEnvoy) -> String {
    envoy
        .stats()
        .into_iter()
        .filter(|(k, _)| k.starts_with("floodgate."))
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join("\n")
}
