//! The store path secured, end to end, with real Envoys (two workers each), the built module,
//! `floodgate-sync` and `redis-server`, all on 127.0.0.1:
//!
//! - `floodgate-sync` with a token refuses the batches and leases of proxies with a missing or a
//!   wrong `global.token` (401, 403): nothing reaches Redis, both sides count the failures, and
//!   requests are still decided; a proxy with the right token syncs.
//! - Redis over TLS only (certificates the test makes, client certificates required) with an
//!   ACL user: three Envoys with the token and a `key_secret` hold one batched quota and one
//!   leased quota fleet-wide, keep deciding through a Redis restart (`on_store_failure`), and
//!   hold the quota again after it.
//! - A Redis Cluster over TLS only (every seed `rediss://`, the cluster bus and replication over
//!   TLS too): three Envoys hold one leased quota exactly, and `floodgate-sync`'s
//!   `GET /v1/holders` shows the three proxies holding it.
//!
//! Run through `./test.sh` (it installs Redis with scripts/redis.sh and builds floodgate-sync).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use floodgate_integration::store::{fleet, Redis, RedisCluster, SyncService};
use floodgate_integration::tls::Pki;
use floodgate_integration::*;

const WINDOW: Duration = Duration::from_secs(3600);
const TOKEN: &str = "the-fleet-token-0123456789";
const KEY_SECRET: &str = "a fleet-wide key secret";

/// A batched rule on `x-fleet-key` and a leased one on `x-paid-key`, both global, per hour.
fn config(token: Option<&str>, batched: u64, leased: u64) -> Value {
    let mut global = json!({"cluster": "floodgate-sync", "sync_interval": "100ms", "timeout": "500ms",
                            "lease_timeout": "500ms", "on_store_failure": "last_state", "key_secret": KEY_SECRET});
    if let Some(token) = token {
        global["token"] = json!(token);
    }
    json!({
        "rate_limits": [
            {"name": "fleet", "key": [{"header": "x-fleet-key"}], "limit": batched, "window": "1h", "scope": "global"},
            {"name": "paid", "key": [{"header": "x-paid-key"}], "limit": leased, "window": "1h", "scope": "global", "consistency": "leased"}
        ],
        "global": global
    })
}

/// The keys floodgate-sync wrote (`fg:*`).
fn store_keys(redis: &Redis) -> Vec<String> {
    let mut keys: Vec<String> = redis.cli(&["--scan", "--pattern", "fg:*"]).lines().map(str::to_owned).collect();
    keys.sort();
    keys.dedup();
    keys
}

/// Sum of the counters of the current 1 h bucket.
fn hour_total(redis: &Redis) -> u64 {
    let bucket = (since_epoch().as_millis() / WINDOW.as_millis()) as u64;
    let keys: std::collections::BTreeSet<String> =
        redis.cli(&["--scan", "--pattern", &format!("fg:*:3600000:{bucket}")]).lines().map(str::to_owned).collect();
    keys.iter().map(|key| redis.cli(&["GET", key]).trim().parse::<u64>().unwrap_or(0)).sum()
}

fn stat_sum(envoys: &[&Envoy], name: &str) -> u64 {
    envoys.iter().map(|e| e.stat(&format!("{WASM_CUSTOM_NAMESPACE}floodgate.{name}")).unwrap_or(0)).sum()
}

/// A series of floodgate-sync's `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_with_a_missing_or_wrong_token_change_nothing_in_redis_and_are_counted() {
    wait_for_window_phase(WINDOW, Duration::from_secs(1), WINDOW - Duration::from_secs(120));
    let redis = Redis::start();
    let sync = SyncService::start(vec!["--redis".into(), redis.url(), "--token".into(), TOKEN.into()]);
    let upstream = Upstream::start();
    let missing = fleet(1, &config(None, 1000, 1000), sync.addr, &upstream).remove(0);
    let wrong = fleet(1, &config(Some("not-the-fleet-token-0000"), 1000, 1000), sync.addr, &upstream).remove(0);
    let run = std::process::id();
    let mut statuses = BTreeMap::new();
    for envoy in [&missing, &wrong] {
        for (header, key) in [("x-fleet-key", format!("batched-{run}")), ("x-paid-key", format!("leased-{run}"))] {
            for (status, n) in steady_load(&[envoy.addr()], (header, &key), 50, Duration::from_secs(1), |_| {}).await {
                *statuses.entry(status).or_insert(0) += n;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await; // a few more batches refused
    let unauthorized = sync.metric("floodgate_sync_errors_total{status=\"401\",kind=\"unauthorized\"}");
    let forbidden = sync.metric("floodgate_sync_errors_total{status=\"403\",kind=\"forbidden\"}");
    let keys = store_keys(&redis);
    let failures = |envoy: &Envoy| (stat_sum(&[envoy], "global.failures"), stat_sum(&[envoy], "lease.failures"), stat_sum(&[envoy], "global.confirmed"));
    println!(
        "statuses {statuses:?}; floodgate-sync refused {unauthorized} without a token, {forbidden} with a wrong one; \
         (batch failures, lease failures, confirmed): no token {:?}, wrong token {:?}; Redis keys {keys:?}",
        failures(&missing),
        failures(&wrong)
    );
    assert_eq!(statuses.keys().copied().collect::<Vec<_>>(), vec![200], "every request decided without the store, none failed");
    assert!(keys.is_empty(), "nothing written to Redis: {keys:?}");
    assert_eq!(sync.metric("floodgate_sync_batches_received_total"), 0);
    assert_eq!(sync.metric("floodgate_sync_leases_received_total"), 0);
    for (envoy, refused) in [(&missing, unauthorized), (&wrong, forbidden)] {
        let (batches, leases, confirmed) = failures(envoy);
        assert!(batches > 0 && leases > 0, "the proxy counts its refused calls: {batches} batches, {leases} leases");
        assert_eq!(confirmed, 0);
        assert!(refused >= batches + leases - 2, "floodgate-sync counts them too: {refused} for {batches} + {leases}");
    }

    // The right token: the same traffic syncs.
    let right = fleet(1, &config(Some(TOKEN), 1000, 1000), sync.addr, &upstream).remove(0);
    let key = format!("right-{run}");
    let batched = steady_load(&[right.addr()], ("x-fleet-key", &key), 50, Duration::from_secs(1), |_| {}).await;
    let leased = steady_load(&[right.addr()], ("x-paid-key", &key), 50, Duration::from_secs(1), |_| {}).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while stat_sum(&[&right], "global.confirmed") == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("right token: {batched:?} {leased:?}; Redis keys {}", store_keys(&redis).len());
    assert!(stat_sum(&[&right], "global.confirmed") > 0);
    assert_eq!(stat_sum(&[&right], "lease.failures"), 0);
    assert!(hour_total(&redis) >= batched[&200], "the batched admissions reached Redis");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_an_acl_user_three_proxies_hold_one_quota_through_a_redis_restart() {
    const BATCHED: u64 = 600;
    const LEASED: u64 = 300;
    wait_for_window_phase(WINDOW, Duration::from_secs(1), WINDOW - Duration::from_secs(180));
    let pki = Pki::new();
    let mut redis = Redis::with_tls(
        &pki,
        &["--requirepass", "admin-password-0", "--user", "floodgate", "on", ">sync-password-0", "~fg:*", "+@all", "-@dangerous"],
        &["-a", "admin-password-0", "--no-auth-warning"],
    );
    let mut args = vec![
        "--redis".to_string(),
        format!("rediss://floodgate:sync-password-0@127.0.0.1:{}", redis.port),
        "--token".into(),
        TOKEN.into(),
    ];
    args.extend(pki.sync_args());
    let sync = SyncService::start(args);
    assert!(sync.log().contains("TLS, CA of --redis-ca, client certificate"), "{}", sync.log());
    let upstream = Upstream::counting_header("x-fleet-key");
    let envoys = fleet(3, &config(Some(TOKEN), BATCHED, LEASED), sync.addr, &upstream);
    let all: Vec<&Envoy> = envoys.iter().collect();
    let addrs: Vec<SocketAddr> = envoys.iter().map(Envoy::addr).collect();
    let run = std::process::id();

    // One batched quota: 300 req/s for 6 s over the three proxies, limit 600.
    let key = format!("batched-{run}");
    let batched = steady_load(&addrs, ("x-fleet-key", &key), 300, Duration::from_secs(6), |_| {}).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let admitted = batched.get(&200).copied().unwrap_or(0);
    let in_redis = hour_total(&redis);
    println!("batched over TLS: {batched:?}; Redis holds {in_redis}");
    assert_eq!(batched.keys().filter(|s| **s != 200 && **s != 429).count(), 0, "{batched:?}");
    // The bounds of integration/tests/global.rs: up to 2 short, and the overshoot bound.
    assert!((BATCHED - 2..=BATCHED + 40 + 96).contains(&admitted), "{admitted} admitted of {BATCHED}");
    assert_eq!(in_redis, admitted, "Redis holds every admission once");
    assert_eq!(upstream.count_for(&key), admitted);

    // One leased quota: 150 req/s for 4 s, limit 300: never more.
    let leased_key = |phase: &str| format!("leased-{run}-{phase}");
    let before = steady_load(&addrs, ("x-paid-key", &leased_key("before")), 150, Duration::from_secs(4), |_| {}).await;
    let before_admitted = before.get(&200).copied().unwrap_or(0);
    println!("leased over TLS: {before:?}");
    assert!(before_admitted <= LEASED && before_admitted + 6 * 4 >= LEASED, "{before_admitted} admitted of {LEASED}");

    // Redis restarted (same port, TLS, empty) mid-load: every request is decided as
    // on_store_failure says (last_state: 200 or 429, never a 5xx), the failures are counted.
    // (The restarted Redis has forgotten the key's grants: its quota starts again.)
    let failures_before = stat_sum(&all, "lease.failures") + stat_sum(&all, "global.failures");
    let mut killed_at = None;
    let mut restarted = false;
    let during = steady_load(&addrs, ("x-paid-key", &leased_key("during")), 100, Duration::from_secs(5), |elapsed| {
        if elapsed >= Duration::from_secs(1) && killed_at.is_none() {
            redis.kill();
            killed_at = Some(elapsed);
        }
        if elapsed >= Duration::from_secs(3) && !restarted {
            redis.restart();
            restarted = true;
        }
    })
    .await;
    let failures = stat_sum(&all, "lease.failures") + stat_sum(&all, "global.failures") - failures_before;
    let without_store = stat_sum(&all, "lease.without_store");
    println!("through the restart: {during:?}; {failures} failed calls, {without_store} decisions without the store");
    assert!(restarted);
    assert_eq!(during.keys().filter(|s| **s != 200 && **s != 429).count(), 0, "decided through the outage: {during:?}");
    assert!(failures > 0, "the calls that failed while Redis was down are counted");

    // After it, over the same TLS settings, the quota holds again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = steady_load(&addrs, ("x-paid-key", &leased_key("after")), 150, Duration::from_secs(4), |_| {}).await;
    let after_admitted = after.get(&200).copied().unwrap_or(0);
    let failures_after = stat_sum(&all, "lease.failures") + stat_sum(&all, "global.failures") - failures_before - failures;
    println!("after the restart: {after:?}; {failures_after} more failed calls; Redis keys {}", store_keys(&redis).len());
    assert_eq!(after.keys().filter(|s| **s != 200 && **s != 429).count(), 0, "{after:?}");
    assert!(after_admitted <= LEASED && after_admitted + 6 * 4 >= LEASED, "{after_admitted} admitted of {LEASED} after the restart");
    assert!(!store_keys(&redis).is_empty(), "the restarted Redis is written to again");
}

/// `GET /v1/holders` on floodgate-sync, with the token: the JSON answer.
async fn holders(sync: SocketAddr, counter: &str) -> Value {
    let path = format!("/v1/holders?key={}", counter.replace('{', "%7B").replace('}', "%7D"));
    let bearer = format!("Bearer {TOKEN}");
    let mut client = Client::connect(sync).await.expect("connect to floodgate-sync");
    let answer = client.get(&path, &[("authorization", bearer.as_str())]).await.expect("GET /v1/holders");
    assert_eq!(answer.status, 200, "{}", answer.text());
    answer.json()
}

/// A Redis Cluster of three masters reached over TLS only (every seed `rediss://`, client
/// certificates required; the cluster bus and replication over TLS too), floodgate-sync with
/// the token, three Envoys of two workers: one leased quota is never exceeded and, once the
/// units the proxies held unused came back, admits its limit exactly. While the load runs,
/// `GET /v1/holders` shows the three proxies holding units of the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_tls_redis_cluster_three_proxies_hold_one_leased_quota_exactly() {
    const LEASED: u64 = 300;
    wait_for_window_phase(WINDOW, Duration::from_secs(1), WINDOW - Duration::from_secs(120));
    let pki = Pki::new();
    let cluster = RedisCluster::with_tls(&pki, 3, 0);
    let seeds = cluster.urls();
    assert!(seeds.iter().all(|url| url.starts_with("rediss://")), "{seeds:?}");
    let mut args = vec!["--cluster".to_string(), "--redis".into(), seeds.join(","), "--token".into(), TOKEN.into()];
    args.extend(pki.sync_args());
    let sync = SyncService::start(args);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_get_blocking(sync.addr, "/readyz").is_ok_and(|(status, _)| status == 200) {
        assert!(Instant::now() < deadline, "floodgate-sync ready over TLS to the cluster:\n{}", sync.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    let upstream = Upstream::counting_header("x-paid-key");
    let envoys = fleet(3, &config(Some(TOKEN), 1000, LEASED), sync.addr, &upstream);
    let addrs: Vec<SocketAddr> = envoys.iter().map(Envoy::addr).collect();
    let key = format!("leased-cluster-{}", std::process::id());
    let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
    let mut tally = |answers: BTreeMap<u16, u64>| {
        for (status, n) in answers {
            *statuses.entry(status).or_insert(0) += n;
        }
    };

    // A few requests create the key's counter; its name, as the masters list it.
    tally(steady_load(&addrs, ("x-paid-key", &key), 30, Duration::from_millis(500), |_| {}).await);
    let bucket = (since_epoch().as_millis() / WINDOW.as_millis()) as u64;
    let pattern = format!("fg:*:3600000:{bucket}");
    let counters: Vec<String> =
        cluster.masters().iter().flat_map(|&i| cluster.nodes[i].cli(&["--scan", "--pattern", &pattern]).lines().map(str::to_owned).collect::<Vec<_>>()).collect();
    let [counter] = counters.as_slice() else { panic!("one leased counter: {counters:?}") };
    let counter = counter.clone();

    // 150 req/s for 4 s over the three proxies; meanwhile, who holds the key's units.
    let sampler = {
        let counter = counter.clone();
        let sync_addr = sync.addr;
        tokio::spawn(async move {
            let mut most = Value::Null;
            let mut most_holders = 0;
            for _ in 0..12 {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let answer = holders(sync_addr, &counter).await;
                let count = answer["buckets"][0]["holders"].as_array().map_or(0, Vec::len);
                if count > most_holders {
                    (most_holders, most) = (count, answer);
                }
            }
            (most_holders, most)
        })
    };
    let load = steady_load(&addrs, ("x-paid-key", &key), 150, Duration::from_secs(4), |_| {}).await;
    println!("leased over a TLS cluster: {load:?}");
    tally(load);
    let (most_holders, seen) = sampler.await.expect("the holders sampler");
    println!("GET /v1/holders while the load ran: {seen}");
    assert_eq!(most_holders, 3, "the three proxies hold units of the key: {seen}");
    for holder in seen["buckets"][0]["holders"].as_array().into_iter().flatten() {
        assert!(holder["units"].as_u64().is_some_and(|u| u > 0) && holder["expires_at_ms"].as_u64().is_some(), "{holder}");
    }
    assert!(upstream.count_for(&key) <= LEASED, "never over the limit: {}", upstream.count_for(&key));

    // Units the proxies held unused come back after their horizon: a slower load takes them,
    // until the key has admitted its limit.
    for round in 0..6 {
        if upstream.count_for(&key) >= LEASED {
            break;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        let more = steady_load(&addrs, ("x-paid-key", &key), 30, Duration::from_secs(2), |_| {}).await;
        println!("round {round}: {more:?}, {} admitted in all", upstream.count_for(&key));
        tally(more);
    }
    let admitted = upstream.count_for(&key);
    let answer = holders(sync.addr, &counter).await;
    println!("statuses {statuses:?}; {admitted} admitted of {LEASED}; the store: {answer}");
    assert_eq!(statuses.keys().filter(|s| **s != 200 && **s != 429).count(), 0, "only 200 and 429: {statuses:?}");
    assert_eq!(statuses.get(&200).copied(), Some(admitted), "the upstream saw every admission");
    assert_eq!(admitted, LEASED, "the limit exactly, never more");
    assert_eq!(answer["buckets"][0]["count"], LEASED, "the store counts the limit: {answer}");
    let failures: u64 = envoys.iter().map(|e| e.stat(&format!("{WASM_CUSTOM_NAMESPACE}floodgate.lease.failures")).unwrap_or(0)).sum();
    assert_eq!(failures, 0, "no lease call failed over TLS");
}
