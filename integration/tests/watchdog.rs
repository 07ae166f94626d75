//! The watchdog's liveness answer, end to end: the built module in a real Envoy with 2 workers.
//! A Lua filter after floodgate burns CPU on the worker that runs a request (`x-burn`,
//! [`BURN_LUA`]): a request that burns for seconds blocks its worker, whose heartbeats stop, and
//! the other worker, which still answers, says so. Overload the proxy copes with (shedding on
//! the loop lag and at `max_active_requests`) leaves liveness green.

use std::time::{Duration, Instant};

use floodgate_integration::*;

const ALIVE: &str = "/floodgate/alive";

/// One request on a new connection, given up after `within` (a connection that a blocked
/// worker accepted is answered only once it unblocks): the status and the JSON body.
async fn ask(addr: std::net::SocketAddr, path: &str, within: Duration) -> Option<(u16, Value)> {
    let answer = tokio::time::timeout(within, async {
        let mut client = Client::connect(addr).await.ok()?;
        client.get(path, &[]).await.ok()
    });
    let response = answer.await.ok().flatten()?;
    Some((response.status, response.json()))
}

/// `path` asked over `connections` new connections at once: the first answer (a connection the
/// kernel gives a blocked worker is not answered until it runs again; with a few, one reaches a
/// running worker).
async fn ask_any(addr: std::net::SocketAddr, path: &'static str, within: Duration, connections: usize) -> Option<(u16, Value)> {
    let mut asks = tokio::task::JoinSet::new();
    for _ in 0..connections {
        asks.spawn(ask(addr, path, within));
    }
    while let Some(answer) = asks.join_next().await {
        if let Ok(Some(answer)) = answer {
            asks.abort_all();
            return Some(answer);
        }
    }
    None
}

/// Liveness until `done` says the answer is the one awaited (bounded by `within`): every answer
/// seen, with when it came. Each poll asks over four connections, so that a blocked worker's
/// connections do not delay it.
async fn poll_until(addr: std::net::SocketAddr, within: Duration, done: impl Fn(u16, &Value) -> bool) -> Vec<(Duration, u16, Value)> {
    let started = Instant::now();
    let mut seen = Vec::new();
    while started.elapsed() < within {
        if let Some((status, body)) = ask_any(addr, ALIVE, Duration::from_millis(800), 4).await {
            let stop = done(status, &body);
            seen.push((started.elapsed(), status, body));
            if stop {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    seen
}

/// How many workers a liveness answer lists.
fn workers_listed(body: &Value) -> usize {
    body["workers"].as_array().map_or(0, Vec::len)
}

/// A worker blocked for about 10 s (a request whose Lua filter burns that long): within
/// `worker_silence` and a heartbeat, liveness asked on the other worker says `503`, naming the
/// silent worker, and stays `503` while it is blocked; readiness (the health endpoint) still
/// answers from the running worker with what it knows (`200`, the blocked request in flight).
/// Once the worker runs again, liveness is `200` after `recover_after` heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_worker_fails_liveness_on_the_other_worker_and_readiness_stays_truthful() {
    let upstream = Upstream::start();
    let config = json!({
        "load_shedding": {"max_active_requests": 100},
        "health": {"path": HEALTH_PATH},
        "watchdog": {"path": ALIVE, "worker_silence": "3s", "max_loop_lag": "2s", "lag_for": "30s"}
    });
    let envoy = Envoy::builder(config).upstream(&upstream).lua_after(BURN_LUA).start();
    let addr = envoy.addr();
    // Both workers served a probe: the answer lists them, and not the main thread's VM.
    let seen = poll_until(addr, Duration::from_secs(15), |status, body| status == 200 && workers_listed(body) == 2).await;
    let (_, status, body) = seen.last().expect("liveness answers");
    println!("idle: {status} {body}");
    assert_eq!(*status, 200, "{body}");
    assert_eq!(body["status"], "alive");
    let workers = workers_listed(body);
    assert_eq!(workers, 2, "exactly --concurrency (2) workers: {body}");
    assert!(seen.iter().all(|(_, _, body)| workers_listed(body) <= 2), "never more workers than --concurrency: {seen:?}");
    let per_ms = burn_rate_per_ms(addr).await;

    // One request burns ~10 s on whichever worker takes it.
    const BLOCK_MS: u64 = 10_000;
    let burn = (BLOCK_MS * per_ms).to_string();
    let blocked = tokio::spawn(async move {
        let started = Instant::now();
        let mut client = Client::connect(addr).await.expect("connect");
        let status = client.get("/work", &[("x-burn", burn.as_str())]).await.map(|r| r.status);
        (status, started.elapsed())
    });
    let started = Instant::now();
    let red = poll_until(addr, Duration::from_secs(9), |status, _| status == 503).await;
    let (red_after, status, body) = red.last().cloned().expect("liveness answers from the running worker");
    println!("blocked: {status} after {red_after:?}: {body}");
    assert_eq!(status, 503, "a blocked worker fails liveness: {red:?}");
    assert!(red_after <= Duration::from_secs(7), "within worker_silence (3 s) and a few heartbeats: {red_after:?}");
    assert_eq!(body["status"], "failing");
    let reasons = body["reasons"].to_string();
    assert!(reasons.contains("has not beaten for") && reasons.contains("worker_silence 3000 ms"), "{body}");
    let silent: Vec<&Value> = body["workers"].as_array().expect("workers").iter().filter(|w| w["state"] == "silent").collect();
    assert_eq!(silent.len(), 1, "one silent worker: {body}");
    // Readiness, from the running worker: its own view, green, the blocked request in flight.
    let readiness = loop {
        if let Some(answer) = ask(addr, HEALTH_PATH, Duration::from_millis(800)).await {
            break answer;
        }
        assert!(started.elapsed() < Duration::from_secs(9), "the running worker answers readiness");
    };
    println!("readiness while blocked: {readiness:?}");
    assert_eq!(readiness.0, 200, "{readiness:?}");
    assert!(readiness.1["in_flight"].as_u64().is_some_and(|n| n >= 1), "{readiness:?}");
    // Failing, not flapping, while the worker is blocked.
    let mut while_blocked = Vec::new();
    while !blocked.is_finished() && started.elapsed() < Duration::from_secs(25) {
        if let Some((status, _)) = ask(addr, ALIVE, Duration::from_millis(800)).await {
            while_blocked.push(status);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, took) = blocked.await.expect("the blocking request");
    println!("the blocking request: {status:?} after {took:?}; liveness while it blocked: {while_blocked:?}");
    // (Its answer may come after the client's 20 s timeout on a machine busy with other tests.)
    assert!(took >= Duration::from_secs(4), "the worker was blocked past worker_silence: {took:?}");
    assert!(while_blocked.iter().all(|s| *s == 503), "{while_blocked:?}");

    // The worker runs again: alive after recover_after (3) heartbeats on time.
    let unblocked = Instant::now();
    let green = poll_until(addr, Duration::from_secs(15), |status, _| status == 200).await;
    let (_, status, body) = green.last().cloned().expect("liveness answers");
    println!("recovered after {:?}: {status} {body}", unblocked.elapsed());
    assert_eq!(status, 200, "{green:?}");
    let statuses: Vec<u16> = green.iter().map(|(_, s, _)| *s).collect();
    assert!(statuses.len() >= 2 && statuses[..statuses.len() - 1].iter().all(|s| *s == 503), "503 until recovered, then 200: {statuses:?}");
    assert_eq!(body["workers"].as_array().map_or(0, Vec::len), workers, "{body}");
    // Liveness and readiness answers are counted nowhere: the shedder saw the work requests only.
    let prefix = format!("{STAT_PREFIX}.load_shedding");
    println!("{}", envoy.stats_matching(&prefix));
}

/// A worker blocked by a request sent as soon as Envoy is ready (within its first second, before
/// it has beaten for long): liveness, asked on the other worker, fails naming it within
/// `worker_silence` and a few heartbeats, stays failing while it is blocked, and is alive again
/// after `recover_after` heartbeats once it runs, without turning red again; the answer lists
/// exactly the 2 workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_blocked_as_envoy_becomes_ready_fails_liveness_and_recovers() {
    let upstream = Upstream::start();
    let config = json!({"watchdog": {"path": ALIVE, "worker_silence": "3s", "max_loop_lag": "2s", "lag_for": "30s"}});
    // The burn rate, measured on an Envoy of its own: the one under test is blocked at once.
    let per_ms = {
        let envoy = Envoy::builder(config.clone()).upstream(&upstream).lua_after(BURN_LUA).start();
        burn_rate_per_ms(envoy.addr()).await
    };
    const BLOCK_MS: u64 = 12_000;
    let burn = (BLOCK_MS * per_ms).to_string();
    let envoy = Envoy::builder(config).upstream(&upstream).lua_after(BURN_LUA).start();
    let ready = Instant::now();
    let addr = envoy.addr();
    let blocked = tokio::spawn(async move {
        let mut client = Client::connect(addr).await.expect("connect");
        let sent = ready.elapsed();
        let status = client.get("/work", &[("x-burn", burn.as_str())]).await.map(|r| r.status);
        (sent, status, ready.elapsed())
    });
    // Liveness until the blocking request is answered, then until green.
    let mut seen = Vec::new();
    while !blocked.is_finished() && ready.elapsed() < Duration::from_secs(30) {
        if let Some((status, body)) = ask_any(addr, ALIVE, Duration::from_millis(800), 4).await {
            seen.push((ready.elapsed(), status, body));
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let (sent, status, unblocked) = blocked.await.expect("the blocking request");
    println!("the blocking request, sent {sent:?} after Envoy was ready: {status:?}, answered {unblocked:?} after ready");
    let polled_from = ready.elapsed();
    let after = poll_until(addr, Duration::from_secs(15), |status, body| status == 200 && workers_listed(body) == 2).await;
    // Its answers' times, from when Envoy was ready too.
    let after: Vec<(Duration, u16, Value)> = after.into_iter().map(|(at, status, body)| (polled_from + at, status, body)).collect();
    let statuses = |answers: &[(Duration, u16, Value)]| answers.iter().map(|(at, s, _)| (at.as_millis(), *s)).collect::<Vec<_>>();
    println!("liveness while blocked (ms after ready, status): {:?}", statuses(&seen));
    println!("liveness after: {:?}", statuses(&after));
    assert!(sent < Duration::from_secs(1), "blocked within its first second after ready: {sent:?}");
    assert!(unblocked >= Duration::from_secs(6), "the worker was blocked well past worker_silence: {unblocked:?}");
    let first_red = seen.iter().find(|(_, status, _)| *status == 503).unwrap_or_else(|| panic!("a worker blocked early fails liveness: {:?}", statuses(&seen)));
    println!("first failing answer, {:?} after ready: {}", first_red.0, first_red.2);
    assert!(first_red.0 <= sent + Duration::from_secs(7), "within worker_silence (3 s) and a few heartbeats: {:?}", first_red.0);
    let silent: Vec<&Value> = first_red.2["workers"].as_array().expect("workers").iter().filter(|w| w["state"] == "silent").collect();
    assert_eq!(silent.len(), 1, "one silent worker: {}", first_red.2);
    assert!(first_red.2["reasons"].to_string().contains("worker_silence 3000 ms"), "{}", first_red.2);
    // Once red, red until the worker runs again (answers that came after it was unblocked may
    // already be in `seen`): then red for recover_after heartbeats, then green for good.
    let from_red: Vec<u16> = seen.iter().chain(after.iter()).skip_while(|(_, s, _)| *s != 503).map(|(_, s, _)| *s).collect();
    let first_green = from_red.iter().position(|s| *s == 200).unwrap_or(from_red.len());
    assert!(from_red[first_green..].iter().all(|s| *s == 200), "no red after it recovered: {from_red:?}");
    let red_until = seen.iter().chain(after.iter()).find(|(at, s, _)| *s == 200 && *at > first_red.0).map(|(at, _, _)| *at);
    assert!(red_until.is_some_and(|at| at >= unblocked.saturating_sub(Duration::from_secs(1))), "red while blocked: {red_until:?}, unblocked {unblocked:?}");
    let (_, status, body) = after.last().expect("liveness answers");
    assert_eq!(*status, 200, "alive again: {body}");
    assert_eq!(workers_listed(body), 2, "exactly --concurrency (2) workers: {body}");
    assert!(seen.iter().chain(after.iter()).all(|(_, _, body)| workers_listed(body) <= 2), "never more workers than --concurrency");
}

/// Normal overload: CPU burn that makes the loops lag (critical requests burning ~300 ms each
/// from 6 clients on 2 workers; low requests are shed for the lag past their share of load
/// shedding's `max_loop_lag`), then requests past `max_active_requests` (shed fast), 20 s in
/// all. Liveness (a lag past 1 s only counts after `lag_for` 30 s) answers `200` throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_the_proxy_sheds_does_not_fail_liveness() {
    let upstream = Upstream::with_options(UpstreamOptions { delay: Some(Duration::from_millis(600)), ..UpstreamOptions::default() });
    let config = json!({
        "load_shedding": {
            "max_active_requests": 10, "max_loop_lag": "300ms", "lag_probe_interval": "50ms",
            "classes": [{"name": "critical", "shed_at": 1.0}, {"name": "low", "shed_at": 0.2}],
            "default_class": "critical"
        },
        "health": {"path": HEALTH_PATH},
        "watchdog": {"path": ALIVE, "max_loop_lag": "1s", "lag_for": "30s"}
    });
    let envoy = Envoy::builder(config).upstream(&upstream).lua_after(BURN_LUA).start();
    let addr = envoy.addr();
    let seen = poll_until(addr, Duration::from_secs(15), |status, body| status == 200 && workers_listed(body) == 2).await;
    assert!(seen.last().is_some_and(|(_, s, _)| *s == 200), "{seen:?}");
    let per_ms = burn_rate_per_ms(addr).await;
    let stat = |what: &str| envoy.stat(&format!("{STAT_PREFIX}.load_shedding.{what}")).unwrap_or(0);

    // Phase 1 (10 s): critical requests burning ~300 ms each from 6 clients, on 2 workers: the
    // loops lag; low requests (2 clients, no burn) are shed for it.
    let burners = Burners::start(addr, 6, "critical", 300 * per_ms);
    let low = Burners::start(addr, 2, "low", 0);
    let (mut answers, mut max_lag, mut slowest) = (Vec::new(), 0u64, Duration::ZERO);
    let phase = Instant::now();
    while phase.elapsed() < Duration::from_secs(10) {
        let asked = Instant::now();
        match ask(addr, ALIVE, Duration::from_secs(5)).await {
            Some((status, body)) => {
                slowest = slowest.max(asked.elapsed());
                for worker in body["workers"].as_array().into_iter().flatten() {
                    max_lag = max_lag.max(worker["loop_lag_ms"].as_u64().unwrap_or(0));
                }
                if status != 200 {
                    println!("liveness failed under overload: {body}");
                }
                answers.push(status);
            }
            None => answers.push(0),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let burnt = burners.stop();
    let low = low.stop();
    let shed_by_lag = stat("low.shed_by_lag") + stat("critical.shed_by_lag");
    println!(
        "phase 1 (CPU burn): critical requests {burnt:?} (admitted, shed), low {low:?}, {shed_by_lag} shed for the lag; \
         largest loop lag in the liveness answers {max_lag} ms; slowest liveness answer {slowest:?}"
    );

    // Phase 2 (10 s): waves of 30 concurrent slow requests against max_active_requests 10.
    let phase = Instant::now();
    let mut shed = 0;
    while phase.elapsed() < Duration::from_secs(10) {
        let wave: Vec<_> = (0..30)
            .map(|_| tokio::spawn(async move { get(addr, "/work", &[]).await.status }))
            .collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        match ask(addr, ALIVE, Duration::from_secs(5)).await {
            Some((status, body)) => {
                if status != 200 {
                    println!("liveness failed under overload: {body}");
                }
                answers.push(status);
            }
            None => answers.push(0),
        }
        for request in wave {
            shed += u32::from(request.await.expect("a request") == 503);
        }
    }
    println!("phase 2 (in flight): {shed} requests shed at max_active_requests");
    println!("liveness answers: {} ({} not 200): {answers:?}", answers.len(), answers.iter().filter(|s| **s != 200).count());
    assert!(burnt.0 > 0 && shed_by_lag > 0, "the loops lagged enough to shed: {shed_by_lag} for the lag");
    assert!(max_lag >= 100, "the heartbeats saw the lag: {max_lag} ms");
    assert!(shed > 0, "requests past max_active_requests were shed");
    assert!(answers.len() >= 15, "{answers:?}");
    assert!(answers.iter().all(|s| *s == 200), "liveness stays 200 under overload: {answers:?}");
}

/// A configuration change (a new root context in each VM; the old one retired) and new VMs (a
/// new VM configuration: Envoy starts new VMs and retires the old ones) are no stuck workers:
/// liveness stays `200` through both, and counts as many workers after as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_change_and_new_vms_leave_liveness_green() {
    use floodgate_integration::dynamic::{Delivery, DynamicEnvoy, FilterVersion};
    let upstream = Upstream::start();
    let config = |lag_for: &str| {
        json!({"health": {"path": HEALTH_PATH}, "watchdog": {"path": ALIVE, "worker_silence": "3s", "lag_for": lag_for}}).to_string()
    };
    let mut envoy = DynamicEnvoy::builder(FilterVersion::new(config("30s"))).cluster("upstream", &[upstream.addr()]).start();
    let addr = envoy.addr();
    let seen = poll_until(addr, Duration::from_secs(15), |status, body| status == 200 && workers_listed(body) == 2).await;
    assert!(seen.last().is_some_and(|(_, status, _)| *status == 200), "{seen:?}");
    let (status, body) = ask(addr, ALIVE, Duration::from_secs(2)).await.expect("liveness answers");
    assert_eq!(status, 200, "{body}");
    let workers = workers_listed(&body);
    assert_eq!(workers, 2, "{body}");
    let vms = envoy.vms_created();
    // Watches liveness for `seconds`: (answers, how many were not 200, the last body).
    async fn watch(addr: std::net::SocketAddr, seconds: u64) -> (usize, Vec<Value>, Value) {
        let started = Instant::now();
        let (mut answers, mut red, mut last) = (0, Vec::new(), Value::Null);
        while started.elapsed() < Duration::from_secs(seconds) {
            if let Some((status, body)) = ask(addr, ALIVE, Duration::from_secs(2)).await {
                answers += 1;
                if status != 200 {
                    red.push(body.clone());
                }
                last = body;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        (answers, red, last)
    }

    assert_eq!(envoy.deliver(&FilterVersion::new(config("20s"))), Delivery::Taken);
    let (answers, red, last) = watch(addr, 8).await;
    println!("after a configuration change: {answers} answers, {} not 200; {last}", red.len());
    assert!(answers >= 10 && red.is_empty(), "{red:?}");
    assert_eq!(last["lag_for_ms"], 20_000, "the new configuration answers: {last}");
    assert_eq!(last["workers"].as_array().map_or(0, Vec::len), workers, "the same workers: {last}");

    assert_eq!(envoy.deliver(&FilterVersion::new(config("20s")).vm_generation(2)), Delivery::Taken);
    let (answers, red, last) = watch(addr, 10).await;
    println!(
        "after new VMs ({} VMs created before, {} after): {answers} answers, {} not 200; {last}",
        vms,
        envoy.vms_created(),
        red.len()
    );
    assert!(envoy.vms_created() > vms, "Envoy made new VMs");
    assert!(answers >= 10 && red.is_empty(), "{red:?}");
    assert_eq!(last["workers"].as_array().map_or(0, Vec::len), workers, "as many workers as before: {last}");
}

/// A loop that keeps lagging: one worker, four clients sending requests that burn ~1 s each,
/// with `max_loop_lag: 300ms` and `lag_for: 4s` (and a `worker_silence` too long to matter).
/// Liveness fails with the worker `lagging` once the lag has lasted `lag_for`, and is alive
/// again once the load stops and `recover_after` heartbeats came on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_lagging_past_max_loop_lag_for_lag_for_fails_liveness_then_recovers() {
    let upstream = Upstream::start();
    let config = json!({
        "watchdog": {"path": ALIVE, "worker_silence": "60s", "max_loop_lag": "300ms", "lag_for": "4s"}
    });
    let envoy = Envoy::builder(config).upstream(&upstream).concurrency(1).lua_after(BURN_LUA).start();
    let addr = envoy.addr();
    let seen = poll_until(addr, Duration::from_secs(15), |status, body| {
        status == 200 && body["workers"].as_array().is_some_and(|w| !w.is_empty())
    })
    .await;
    assert!(seen.last().is_some_and(|(_, status, _)| *status == 200), "{seen:?}");
    let per_ms = burn_rate_per_ms(addr).await;
    let heavy = Burners::start(addr, 4, "critical", 1000 * per_ms);
    let loaded = Instant::now();
    // The probe waits its turn behind the burning requests: a few seconds each.
    let mut red = None;
    let mut statuses = Vec::new();
    while loaded.elapsed() < Duration::from_secs(40) && red.is_none() {
        if let Some((status, body)) = ask(addr, ALIVE, Duration::from_secs(10)).await {
            statuses.push(status);
            if status == 503 {
                red = Some((loaded.elapsed(), body));
            }
        }
    }
    let burnt = heavy.stop();
    println!("under load: liveness {statuses:?}; burning requests (admitted, shed) {burnt:?}");
    let (after, body) = red.unwrap_or_else(|| panic!("a loop lagging for longer than lag_for fails liveness: {statuses:?}"));
    println!("failing after {after:?}: {body}");
    assert!(after >= Duration::from_secs(4), "not before lag_for: {after:?}");
    let lagging: Vec<&Value> = body["workers"].as_array().expect("workers").iter().filter(|w| w["state"] == "lagging").collect();
    assert!(!lagging.is_empty(), "{body}");
    assert!(body["reasons"].to_string().contains("lagged past 300 ms"), "{body}");
    // The load stops: alive again after recover_after (3) heartbeats on time.
    let calm = Instant::now();
    let green = poll_until(addr, Duration::from_secs(20), |status, _| status == 200).await;
    println!("alive again after {:?}: {:?}", calm.elapsed(), green.last().map(|(_, s, b)| (s, b.to_string())));
    assert!(green.last().is_some_and(|(_, status, _)| *status == 200), "{green:?}");
}
