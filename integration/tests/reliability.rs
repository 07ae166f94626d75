//! Reliability in a real Envoy: faults (an upstream process killed mid-load, every cluster
//! down, an upstream that hangs past the route timeout, clients hanging up in bulk) and
//! reloads (a new filter configuration delivered to a running Envoy, a VM restart).
//!
//! What every test checks in the end: the in-flight count (health endpoint and gauge) is back
//! to exactly zero, the whole limit is available again, counters are exact, and the module
//! never failed (no panic, no trap: `wasm_failures` of Envoy's log is empty).
//!
//! Envoy is started through `dynamic::DynamicEnvoy` (the filter configuration comes from a file
//! by ECDS, as Istio delivers a `WasmPlugin`), so every test can also change it while running.
//! Figures are printed (`--nocapture`).

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use floodgate_integration::dynamic::{Delivery, DynamicEnvoy, FilterVersion};
use floodgate_integration::faults::{hang_up, HangUp, HangingUpstream, UpstreamProcess};
use floodgate_integration::*;
use tokio::task::JoinHandle;

const HEALTH: &str = HEALTH_PATH;
const IN_FLIGHT: &str = "floodgate.load_shedding.in_flight";
const ROUTE_HEADER: &str = "x-floodgate-cluster";

fn upstream_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_floodgate-upstream"))
}

fn shed_stat(class: &str) -> String {
    format!("{STAT_PREFIX}.load_shedding.{class}.shed")
}

/// The health endpoint: status and body.
async fn health(envoy: &DynamicEnvoy) -> (u16, Value) {
    envoy.get_json(HEALTH, &[]).await.expect("health endpoint")
}

/// Polls the health endpoint until its in-flight count is `expected`; returns the last answer
/// and how long it took.
async fn wait_in_flight(envoy: &DynamicEnvoy, expected: u64, within: Duration) -> (u16, Value, Duration) {
    let started = Instant::now();
    loop {
        let (status, body) = health(envoy).await;
        if body["in_flight"] == expected || started.elapsed() > within {
            return (status, body, started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asserts the in-flight count is back to zero, by the health endpoint and by the gauge.
async fn assert_back_to_zero(envoy: &DynamicEnvoy, within: Duration, what: &str) -> Duration {
    let (status, body, took) = wait_in_flight(envoy, 0, within).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "{what}: health says {body}");
    let gauge = envoy.wait_for_stat(IN_FLIGHT, 0, Duration::from_secs(5));
    assert_eq!(gauge, Some(0), "{what}: gauge {IN_FLIGHT}");
    println!("{what}: in flight back to 0 after {:.2} s", took.as_secs_f64());
    took
}

fn assert_no_wasm_failures(envoy: &DynamicEnvoy) {
    let failures = wasm_failures(&envoy.log());
    assert!(failures.is_empty(), "the module failed:\n{}", failures.join("\n"));
}

/// One request on its own connection: status, latency, body.
type Pending = JoinHandle<(u16, Duration, Value)>;

fn send(addr: SocketAddr, n: usize, headers: &'static [(&'static str, &'static str)]) -> Vec<Pending> {
    (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let started = Instant::now();
                match Client::connect(addr).await {
                    Ok(mut c) => match c.get("/work", headers).await {
                        Ok(r) => {
                            let body = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                            (r.status, started.elapsed(), body)
                        }
                        Err(_) => (0, started.elapsed(), Value::Null),
                    },
                    Err(_) => (0, started.elapsed(), Value::Null),
                }
            })
        })
        .collect()
}

async fn collect(pending: Vec<Pending>) -> Vec<(u16, Duration, Value)> {
    let mut out = Vec::with_capacity(pending.len());
    for p in pending {
        out.push(p.await.expect("request task"));
    }
    out
}

fn is_shed(status: u16, body: &Value) -> bool {
    status == 503 && body["class"].is_string() && body["in_flight"].is_u64()
}

/// Sends `max` requests at once (`max` the critical class's limit) and returns them once all of
/// them are in flight, with how many were shed on the way. A worker may hold a few units of
/// reserve it has not used when the other one reaches the limit (the in-flight figures count
/// them; configuration.md, "Reserves"): a request shed then is sent again once the heartbeat
/// gave the units back, and is admitted.
async fn fill_to_the_limit(envoy: &DynamicEnvoy, max: usize) -> (Vec<Pending>, usize) {
    let mut sent = send(envoy.addr(), max, CRITICAL);
    let (_, body, _) = wait_in_flight(envoy, max as u64, Duration::from_secs(5)).await;
    assert_eq!(body["in_flight"], max as u64, "{body}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (ended, mut held): (Vec<Pending>, Vec<Pending>) = sent.drain(..).partition(|p| p.is_finished());
    let ended = collect(ended).await;
    let shed = ended.iter().filter(|(s, _, b)| is_shed(*s, b)).count();
    let statuses: Vec<u16> = ended.iter().map(|r| r.0).collect();
    assert_eq!(shed, ended.len(), "only shed requests end before the upstream answers: {statuses:?}");
    assert!(shed <= 2 * 16, "at most each worker's reserve (16) shed at the limit: {shed}");
    held.extend(send(envoy.addr(), shed, CRITICAL));
    let (_, body, _) = wait_in_flight(envoy, max as u64, Duration::from_secs(5)).await;
    assert_eq!(body["in_flight"], max as u64, "{shed} shed at the limit and sent again: {body}");
    (held, shed)
}

const CRITICAL: &[(&str, &str)] = &[("x-floodgate-priority", "critical")];

// ---------------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------------

/// An upstream *process* is SIGKILLed while 300 requests wait on it: every stream ends at
/// once, every lease comes back; while it is down, requests fail fast; once it is back, the
/// whole limit is available.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_process_killed_mid_load_gives_every_lease_back() {
    const MAX: usize = 400;
    const STREAMS: usize = 300;
    let mut upstream = UpstreamProcess::start(upstream_bin(), Duration::from_secs(6));
    let mut config = shedding_config(MAX as u32);
    config["rate_limits"] = json!([{"name": "per-ip", "key": ["source_ip"], "limit": 1000000, "window": "1m"}]);
    let envoy = DynamicEnvoy::builder(FilterVersion::new(&config))
        .cluster("upstream", &[upstream.addr()])
        .start();

    let pending = send(envoy.addr(), STREAMS, CRITICAL);
    let (_, body, took) = wait_in_flight(&envoy, STREAMS as u64, Duration::from_secs(5)).await;
    assert_eq!(body["in_flight"], STREAMS as u64, "all {STREAMS} requests in flight: {body}");
    println!("{STREAMS} requests in flight after {:.2} s; killing the upstream process", took.as_secs_f64());

    let killed_at = Instant::now();
    upstream.kill();
    let results = collect(pending).await;
    let ended_in = killed_at.elapsed();
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for (status, _, _) in &results {
        *statuses.entry(*status).or_default() += 1;
    }
    println!("statuses after the kill: {statuses:?}; every stream ended {:.2} s after it", ended_in.as_secs_f64());
    assert_eq!(statuses.get(&503).copied(), Some(STREAMS), "every stream ends with Envoy's 503: {statuses:?}");
    assert!(ended_in < Duration::from_secs(3), "streams end at once, not at the upstream's pace: {ended_in:?}");
    assert_back_to_zero(&envoy, Duration::from_secs(3), "after the kill").await;

    // Down: connection refused, answered fast, nothing held.
    let down = collect(send(envoy.addr(), 50, CRITICAL)).await;
    let slowest = down.iter().map(|(_, d, _)| *d).max().unwrap_or_default();
    println!("while down: 50 requests, slowest {:.0} ms", slowest.as_secs_f64() * 1000.0);
    assert!(down.iter().all(|(s, _, _)| *s == 503), "{:?}", down.iter().map(|r| r.0).collect::<Vec<_>>());
    assert!(slowest < Duration::from_secs(1), "a down upstream fails fast: {slowest:?}");
    assert_back_to_zero(&envoy, Duration::from_secs(3), "while down").await;

    // Back: the whole limit is available again, and not one more.
    upstream.restart();
    let (full, shed_at_the_limit) = fill_to_the_limit(&envoy, MAX).await;
    let extra = collect(send(envoy.addr(), 5, CRITICAL)).await;
    let extra_statuses: Vec<u16> = extra.iter().map(|r| r.0).collect();
    assert!(extra.iter().all(|(s, _, b)| is_shed(*s, b)), "beyond the limit: shed, got {extra_statuses:?}");
    let full = collect(full).await;
    let ok = full.iter().filter(|r| r.0 == 200).count();
    println!("after the restart: {ok} of {MAX} admitted and answered 200 ({shed_at_the_limit} shed at the limit while a worker held a reserve, then sent again)");
    assert_eq!(ok, MAX, "the whole limit is available again");
    assert_back_to_zero(&envoy, Duration::from_secs(3), "after the restart").await;
    let shed = envoy.stat(&shed_stat("critical"));
    assert_eq!(shed, Some(5 + shed_at_the_limit as u64), "only the 5 requests beyond the limit, and those shed at it, were shed");
    assert_no_wasm_failures(&envoy);
}

/// Every cluster of the selection goes down (their processes killed): requests fail fast
/// with 503s, nothing stays leased; when the clusters come back, traffic recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cluster_down_fails_fast_and_recovers() {
    let mut upstreams: Vec<UpstreamProcess> =
        (0..3).map(|_| UpstreamProcess::start(upstream_bin(), Duration::ZERO)).collect();
    let names = ["a", "b", "c"];
    let mut config = shedding_config(100);
    config["cluster_selection"] = json!({
        "route_header": ROUTE_HEADER,
        "clusters": names,
        "bucket_width": "1s",
        "buckets": 3
    });
    let mut builder = DynamicEnvoy::builder(FilterVersion::new(&config)).route_by_header(ROUTE_HEADER);
    for (name, upstream) in names.iter().zip(&upstreams) {
        builder = builder.cluster(name, &[upstream.addr()]);
    }
    let envoy = builder.start();
    let baseline = closed_loop(envoy.addr(), 4, Duration::from_secs(2)).await;
    println!("all up: {baseline:?}");
    assert!(baseline.ok > 0 && baseline.ok == baseline.total, "{baseline:?}");

    for u in &mut upstreams {
        u.kill();
    }
    let down = closed_loop(envoy.addr(), 8, Duration::from_secs(4)).await;
    println!("all down: {down:?}");
    assert!(down.total > 100, "requests keep being answered: {down:?}");
    assert_eq!(down.ok, 0, "{down:?}");
    assert_eq!(down.unavailable, down.total, "every answer is a 503: {down:?}");
    assert!(down.slowest < Duration::from_secs(1), "failing fast: {down:?}");
    assert_back_to_zero(&envoy, Duration::from_secs(3), "all clusters down").await;
    for name in names {
        let leased = envoy.wait_for_stat(&format!("{STAT_PREFIX}.cluster.{name}.in_flight"), 0, Duration::from_secs(5));
        assert_eq!(leased, Some(0), "cluster {name}: no lease left behind");
    }

    for u in &mut upstreams {
        u.restart();
    }
    let back = Instant::now();
    let mut streak = 0;
    while streak < 50 {
        assert!(back.elapsed() < Duration::from_secs(30), "no recovery within 30 s (streak {streak})");
        let r = get(envoy.addr(), "/work", &[]).await;
        streak = if r.status == 200 { streak + 1 } else { 0 };
    }
    println!("recovered: 50 consecutive 200s {:.2} s after the clusters came back", back.elapsed().as_secs_f64());
    let after = closed_loop(envoy.addr(), 4, Duration::from_secs(3)).await;
    println!("recovered: {after:?}");
    assert!(after.ok as f64 >= 0.99 * after.total as f64, "{after:?}");
    assert_back_to_zero(&envoy, Duration::from_secs(3), "after the recovery").await;
    assert_no_wasm_failures(&envoy);
}

#[derive(Debug, Default)]
struct LoopTally {
    total: u64,
    ok: u64,
    unavailable: u64,
    other: u64,
    slowest: Duration,
}

/// `clients` keep-alive connections sending one request after another for `duration`.
async fn closed_loop(addr: SocketAddr, clients: usize, duration: Duration) -> LoopTally {
    let deadline = Instant::now() + duration;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            tokio::spawn(async move {
                let mut t = LoopTally::default();
                let mut client: Option<Client> = None;
                while Instant::now() < deadline {
                    if client.is_none() {
                        client = Client::connect(addr).await.ok();
                    }
                    let Some(c) = client.as_mut() else { continue };
                    let started = Instant::now();
                    let status = match c.get("/work", &[]).await {
                        Ok(r) => r.status,
                        Err(_) => {
                            client = None;
                            0
                        }
                    };
                    t.slowest = t.slowest.max(started.elapsed());
                    t.total += 1;
                    match status {
                        200 => t.ok += 1,
                        503 => t.unavailable += 1,
                        _ => t.other += 1,
                    }
                }
                t
            })
        })
        .collect();
    let mut all = LoopTally::default();
    for task in tasks {
        let t = task.await.expect("client");
        all.total += t.total;
        all.ok += t.ok;
        all.unavailable += t.unavailable;
        all.other += t.other;
        all.slowest = all.slowest.max(t.slowest);
    }
    all
}

/// An upstream that accepts and never answers, with the limit saturated: the admitted requests
/// hang until the route timeout (504), the rest are shed at once; then the whole limit is
/// available again, twice in a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_hanging_past_the_route_timeout_gives_the_limit_back() {
    const MAX: usize = 20;
    const TIMEOUT: Duration = Duration::from_millis(1500);
    let upstream = HangingUpstream::start();
    let envoy = DynamicEnvoy::builder(FilterVersion::new(shedding_config(MAX as u32)))
        .cluster("upstream", &[upstream.addr()])
        .route_timeout(TIMEOUT)
        .start();

    for round in 1..=2 {
        let started = Instant::now();
        let results = collect(send(envoy.addr(), 2 * MAX, CRITICAL)).await;
        let timed_out: Vec<_> = results.iter().filter(|r| r.0 == 504).collect();
        let shed: Vec<_> = results.iter().filter(|r| is_shed(r.0, &r.2)).collect();
        let slowest_shed = shed.iter().map(|r| r.1).max().unwrap_or_default();
        let fastest_timeout = timed_out.iter().map(|r| r.1).min().unwrap_or_default();
        println!(
            "round {round}: {} × 504 (fastest {:.2} s), {} shed (slowest {:.0} ms), in {:.2} s",
            timed_out.len(),
            fastest_timeout.as_secs_f64(),
            shed.len(),
            slowest_shed.as_secs_f64() * 1000.0,
            started.elapsed().as_secs_f64()
        );
        assert_eq!((timed_out.len(), shed.len()), (MAX, MAX), "exactly the limit hangs, the rest is shed");
        assert!(fastest_timeout >= TIMEOUT - Duration::from_millis(100), "{fastest_timeout:?}");
        assert!(slowest_shed < Duration::from_millis(750), "shed fast while the upstream hangs: {slowest_shed:?}");
        assert_back_to_zero(&envoy, Duration::from_secs(2), &format!("round {round}")).await;
    }
    assert!(upstream.accepted() >= MAX as u64, "the requests reached the hanging upstream");
    assert_eq!(envoy.stat(&shed_stat("critical")), Some(2 * MAX as u64));
    assert_no_wasm_failures(&envoy);
}

/// 1 200 clients hang up mid-request, in four waves and every way (after the headers, in the
/// middle of the body, in the middle of the headers; FIN or RST): nothing is ever shed (no
/// lease leaks from one wave to the next), the count is back to zero after each wave, memory
/// is flat, and at the end exactly the limit is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_client_hang_ups_leave_nothing_behind() {
    const MAX: usize = 300;
    const WAVE: usize = 300;
    const WAVES: usize = 4;
    // Long enough for the requests that fill the limit at the end to stay in flight while
    // those shed at it are sent again (`fill_to_the_limit`).
    let upstream = Upstream::with_options(UpstreamOptions {
        delay: Some(Duration::from_secs(5)),
        ..UpstreamOptions::default()
    });
    let mut config = shedding_config(MAX as u32);
    config["rate_limits"] = json!([{"name": "per-key", "key": [{"header": "x-key"}], "limit": 1000000, "window": "1m"}]);
    let envoy = DynamicEnvoy::builder(FilterVersion::new(&config))
        .cluster("upstream", &[upstream.addr()])
        .start();
    let kinds = [HangUp::AfterHeaders, HangUp::MidBody, HangUp::MidHeaders];
    let mut rss = Vec::new();
    for wave in 0..WAVES {
        let tasks: Vec<_> = (0..WAVE)
            .map(|i| {
                let addr = envoy.addr();
                let how = kinds[i % kinds.len()];
                let reset = (i / kinds.len()) % 2 == 1;
                let hold = Duration::from_millis(200 + (i as u64 * 7) % 300);
                tokio::spawn(async move {
                    let key = format!("k{}", i % 17);
                    hang_up(addr, how, &[("x-floodgate-priority", "critical"), ("x-key", &key)], hold, reset).await
                })
            })
            .collect();
        let mut errors = 0;
        for t in tasks {
            if t.await.expect("task").is_err() {
                errors += 1;
            }
        }
        assert_eq!(errors, 0, "wave {wave}: every client could connect and send");
        assert_back_to_zero(&envoy, Duration::from_secs(5), &format!("wave {wave}")).await;
        rss.push(envoy.rss_bytes());
    }
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "RSS after each wave: {:?} MiB",
        rss.iter().map(|b| format!("{:.1}", mib(*b))).collect::<Vec<_>>()
    );
    assert!(
        rss[WAVES - 1] < rss[0] + 8 * 1024 * 1024,
        "Envoy's RSS grew by {:.1} MiB over the waves",
        mib(rss[WAVES - 1]) - mib(rss[0])
    );
    assert_eq!(envoy.stat(&shed_stat("critical")), Some(0), "nothing leaked, so nothing was ever shed");
    let allowed = envoy.stat(&rule_stat("per-key", "allowed")).unwrap_or(0);
    println!("admitted (then hung up on): {allowed}; reached the upstream: {}", upstream.total());
    assert!(allowed >= (WAVES * WAVE * 2 / 3) as u64, "the complete requests were admitted: {allowed}");

    // Exactly the limit is available.
    let (full, shed_at_the_limit) = fill_to_the_limit(&envoy, MAX).await;
    let extra = collect(send(envoy.addr(), 3, CRITICAL)).await;
    let extra_statuses: Vec<u16> = extra.iter().map(|r| r.0).collect();
    assert!(extra.iter().all(|(s, _, b)| is_shed(*s, b)), "beyond the limit: shed, got {extra_statuses:?}");
    let full = collect(full).await;
    let ok = full.iter().filter(|r| r.0 == 200).count();
    println!("the limit: {ok} of {MAX} admitted ({shed_at_the_limit} shed at the limit while a worker held a reserve, then sent again)");
    assert_eq!(ok, MAX);
    assert_back_to_zero(&envoy, Duration::from_secs(3), "the end").await;
    assert_no_wasm_failures(&envoy);
}

// ---------------------------------------------------------------------------------------------
// Reloads
// ---------------------------------------------------------------------------------------------

const HOUR: Duration = Duration::from_secs(3600);

fn rule(name: &str, header: &str, limit: u32, window: &str) -> Value {
    json!({"name": name, "key": [{"header": header}], "limit": limit, "window": window})
}

/// Sends requests with `header: key` on `client` until the first `429` (at most `limit`);
/// returns how many were admitted and the `429`.
async fn admitted_until_refused(client: &mut Client, header: &str, key: &str, at_most: usize) -> (usize, Option<Response>) {
    for n in 0..=at_most {
        let r = client.get("/work", &[(header, key)]).await.expect("request");
        match r.status {
            200 => continue,
            429 => return (n, Some(r)),
            other => panic!("{header}: unexpected status {other}: {}", r.text()),
        }
    }
    (at_most + 1, None)
}

/// A new configuration delivered to a running Envoy: a rule left unchanged keeps its counters,
/// a changed limit applies at once (to existing connections too) on the counters already there,
/// a changed window starts fresh counters (as documented), a new rule applies at once; a
/// refused configuration changes nothing; a VM restart keeps every counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_unchanged_counters_and_applies_new_limits_at_once() {
    wait_for_window_phase(HOUR, Duration::from_secs(60), HOUR - Duration::from_secs(120));
    let upstream = Upstream::start();
    let v1 = json!({"rate_limits": [
        rule("stable", "x-a", 8, "1h"),
        rule("tightened", "x-b", 10, "1h"),
        rule("loosened", "x-d", 2, "1h"),
        rule("rewindowed", "x-c", 5, "1h"),
    ]});
    let v2 = json!({"rate_limits": [
        rule("stable", "x-a", 8, "1h"),
        rule("tightened", "x-b", 3, "1h"),
        rule("loosened", "x-d", 6, "1h"),
        rule("rewindowed", "x-c", 5, "2h"),
        rule("added", "x-e", 2, "1h"),
    ]});
    let mut envoy = DynamicEnvoy::builder(FilterVersion::new(&v1))
        .cluster("upstream", &[upstream.addr()])
        .start();
    let mut kept = Client::connect(envoy.addr()).await.expect("connect");
    for header in ["x-a", "x-b"] {
        for _ in 0..5 {
            assert_eq!(kept.get("/work", &[(header, "k")]).await.expect("request").status, 200);
        }
    }
    assert_eq!(admitted_until_refused(&mut kept, "x-d", "k", 5).await.0, 2);
    assert_eq!(admitted_until_refused(&mut kept, "x-c", "k", 10).await.0, 5);
    let vms_before = envoy.vms_created();

    assert_eq!(envoy.deliver(&FilterVersion::new(&v2)), Delivery::Taken);
    // The keep-alive connection opened before the reload sees the new configuration at once.
    let (n, refused) = admitted_until_refused(&mut kept, "x-b", "k", 10).await;
    assert_eq!(n, 0, "tightened 10 → 3 with 5 counted: refused at once");
    let policy = refused.expect("a 429").header("ratelimit-policy").map(str::to_owned);
    assert_eq!(policy.as_deref(), Some("\"tightened\";q=3;w=3600"));
    let mut fresh = Client::connect(envoy.addr()).await.expect("connect");
    assert_eq!(admitted_until_refused(&mut fresh, "x-b", "k", 10).await.0, 0, "on a new connection too");
    assert_eq!(admitted_until_refused(&mut kept, "x-a", "k", 10).await.0, 3, "stable: 5 of 8 were kept");
    assert_eq!(admitted_until_refused(&mut fresh, "x-d", "k", 10).await.0, 4, "loosened 2 → 6 with 2 counted");
    assert_eq!(admitted_until_refused(&mut fresh, "x-c", "k", 10).await.0, 5, "a new window starts afresh");
    assert_eq!(admitted_until_refused(&mut kept, "x-e", "k", 10).await.0, 2, "a new rule applies at once");
    // Envoy validates a new plugin configuration in one throw-away VM; the serving VMs stay.
    let created = envoy.vms_created() - vms_before;
    assert!(created <= 1, "a plugin-config change keeps the VMs: {created} created");
    assert_eq!(envoy.stat(&rule_stat("stable", "allowed")), Some(8), "the counter runs on across the reload");

    // A configuration Envoy refuses leaves the running one in place.
    let failures_before_refusal = wasm_failures(&envoy.log());
    let mut bad = v2.clone();
    bad["rate_limits"][0]["window"] = json!("forever");
    assert_eq!(envoy.deliver(&FilterVersion::new(&bad)), Delivery::Refused);
    assert!(
        config_error_line(&envoy.log()).is_some_and(|l| l.contains("rate_limits[0].window")),
        "the refusal names the field"
    );
    assert_eq!(admitted_until_refused(&mut kept, "x-a", "k", 3).await.0, 0, "still enforced after a refusal");
    assert_eq!(admitted_until_refused(&mut fresh, "x-e", "other", 3).await.0, 2);

    // New VMs (a new VM configuration, as a code update): shared data, and so every counter,
    // survives.
    let before_restart = envoy.vms_created();
    assert_eq!(envoy.deliver(&FilterVersion::new(&v2).vm_generation(2)), Delivery::Taken);
    let created = envoy.vms_created() - before_restart;
    println!("VMs created by the VM restart: {created}");
    assert!(created >= 3, "new VMs for the main thread and both workers: {created}");
    let mut after = Client::connect(envoy.addr()).await.expect("connect");
    assert_eq!(admitted_until_refused(&mut after, "x-a", "k", 3).await.0, 0, "stable still exhausted");
    assert_eq!(admitted_until_refused(&mut after, "x-d", "k", 3).await.0, 0, "loosened still exhausted");
    assert_eq!(admitted_until_refused(&mut after, "x-e", "fresh", 3).await.0, 2, "other keys unaffected");
    let admitted = (5 + 5 + 2 + 5) + (3 + 4 + 5 + 2) + 2 + 2;
    assert_eq!(upstream.total(), admitted, "the upstream saw exactly the admitted requests");
    assert!(failures_before_refusal.is_empty(), "the module failed:\n{}", failures_before_refusal.join("\n"));
    let crashes: Vec<String> = wasm_failures(&envoy.log())
        .into_iter()
        .filter(|l| ["panicked", "Uncaught", "RuntimeError", "wasm_fail_stream"].iter().any(|m| l.contains(m)))
        .collect();
    assert!(crashes.is_empty(), "the module failed:\n{}", crashes.join("\n"));
}

/// A configuration change gives the old configuration's quota reserves back. Envoy
/// gives the new plugin configuration a new root context and retires the old one (`on_done`);
/// the old one held units of the hot key counted ahead of use. Before, they stayed counted: one
/// hot key, limit 1 000 → 1 001 mid-traffic, then idle: `ratelimit` said `r=916` where the
/// exact remaining was 930. Now, once the proxy is idle, `r` is exact again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_change_gives_the_old_quota_reserves_back() {
    wait_for_window_phase(HOUR, Duration::from_secs(60), HOUR - Duration::from_secs(120));
    let upstream = Upstream::start();
    let key = format!("hot-{}", since_epoch().as_nanos());
    let reserved = rule_stat("hot", "reserved");
    let v1 = json!({"rate_limits": [rule("hot", "x-api-key", 1_000, "1h")]});
    let v2 = json!({"rate_limits": [rule("hot", "x-api-key", 1_001, "1h")]});
    let mut envoy = DynamicEnvoy::builder(FilterVersion::new(&v1))
        .cluster("upstream", &[upstream.addr()])
        .start();
    // The hot key's traffic, on one keep-alive connection (one worker), until the change is in:
    // its writes keep counting units ahead, so the old configuration holds some when retired.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (addr, key, stop) = (envoy.addr(), key.clone(), stop.clone());
        tokio::spawn(async move {
            let mut client = Client::connect(addr).await.expect("connect");
            let mut admitted = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let r = client.get("/work", &[("x-api-key", key.as_str())]).await.expect("request");
                assert_eq!(r.status, 200, "{}", r.text());
                admitted += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            admitted
        })
    };
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let held = envoy.stat(&reserved).unwrap_or(0);
    assert_eq!(envoy.deliver(&FilterVersion::new(&v2)), Delivery::Taken);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let admitted = traffic.await.expect("traffic task");
    println!("{admitted} admitted across the change; {held} units reserved at the last heartbeat before it");
    // Idle: every reserve still held goes back within two heartbeats.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let r = Client::connect(envoy.addr())
        .await
        .expect("connect")
        .get("/work", &[("x-api-key", key.as_str())])
        .await
        .expect("request");
    assert_eq!(r.status, 200, "{}", r.text());
    let (policy, fields) = parse_ratelimit_item(r.header("ratelimit").expect("a ratelimit field"));
    assert_eq!(policy, "hot");
    let exact = 1_001 - (admitted + 1);
    println!("after the change and 3.5 s idle: r={} (exact: {exact})", fields["r"]);
    assert_eq!(fields["r"], exact.to_string(), "no unit is left counted by the retired configuration");
    assert_eq!(envoy.wait_for_stat(&reserved, 0, Duration::from_secs(4)), Some(0), "the reserved gauge is back to 0");
    assert_eq!(upstream.total(), admitted + 1);
    assert_no_wasm_failures(&envoy);
}

/// New VMs replace the old ones while requests are in flight on them: the in-flight count is
/// shared across the generations (no double capacity during the switch), and once the old
/// requests end nothing of them is left: the count is back to zero, the whole limit available.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_restart_leaves_no_in_flight_count_behind() {
    const MAX: usize = 10;
    const DELAY: Duration = Duration::from_secs(4);
    let upstream = Upstream::with_options(UpstreamOptions {
        delay: Some(DELAY),
        ..UpstreamOptions::default()
    });
    let config = shedding_config(MAX as u32);
    let mut envoy = DynamicEnvoy::builder(FilterVersion::new(&config))
        .cluster("upstream", &[upstream.addr()])
        .start();
    let old = send(envoy.addr(), MAX, CRITICAL);
    let (_, body, _) = wait_in_flight(&envoy, MAX as u64, Duration::from_secs(3)).await;
    assert_eq!(body["in_flight"], MAX as u64, "{body}");

    let vms_before = envoy.vms_created();
    let restarted = Instant::now();
    assert_eq!(envoy.deliver(&FilterVersion::new(&config).vm_generation(2)), Delivery::Taken);
    let created = envoy.vms_created() - vms_before;
    println!("VM restart: {created} new VMs in {:.2} s", restarted.elapsed().as_secs_f64());
    assert!(created >= 3, "new VMs for the main thread and both workers: {created}");
    let (status, body) = health(&envoy).await;
    println!("right after the restart, the new VMs see: {status} {body}");
    assert_eq!((status, &body["in_flight"]), (503, &json!(MAX)), "the old VMs' requests still count");
    let extra = collect(send(envoy.addr(), 3, CRITICAL)).await;
    assert!(extra.iter().all(|(s, _, b)| is_shed(*s, b)), "no double capacity during the switch");

    let old = collect(old).await;
    assert!(old.iter().all(|r| r.0 == 200), "the old VMs finish their requests");
    let took = assert_back_to_zero(&envoy, Duration::from_secs(15), "after the VM restart").await;
    assert!(took < Duration::from_secs(15));

    let full = send(envoy.addr(), MAX, CRITICAL);
    let (_, body, _) = wait_in_flight(&envoy, MAX as u64, Duration::from_secs(3)).await;
    assert_eq!(body["in_flight"], MAX as u64, "{body}");
    let extra = collect(send(envoy.addr(), 2, CRITICAL)).await;
    assert!(extra.iter().all(|(s, _, b)| is_shed(*s, b)));
    assert!(collect(full).await.iter().all(|r| r.0 == 200), "the new VMs admit the whole limit");
    assert_back_to_zero(&envoy, Duration::from_secs(3), "the end").await;
    assert_eq!(envoy.stat(&shed_stat("critical")), Some(5));
    assert_no_wasm_failures(&envoy);
}
