//! Load shedding and the health endpoint, end to end: the built module in a real Envoy
//! (2 workers) in front of an upstream that answers slowly. Each test starts its own Envoy.

use std::time::{Duration, Instant};

use floodgate_integration::*;

const HEALTH: &str = HEALTH_PATH;
const DELAY: Duration = Duration::from_millis(2500);
const SETTLE: Duration = Duration::from_millis(400);

fn slow_upstream() -> Upstream {
    Upstream::with_options(UpstreamOptions {
        delay: Some(DELAY),
        ..UpstreamOptions::default()
    })
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

    let pending = send_prioritized(envoy.addr(), "critical", 5 * MAX);
    tokio::time::sleep(SETTLE).await;
    let (status, body) = health(&envoy).await;
    println!("health under load: {status} {body}");
    assert_eq!(status, 503, "the health endpoint flips under load: {body}");
    assert_eq!(body["in_flight"], MAX as u64);

    let (ok, shed) = shed_outcome(pending, "critical", DELAY).await;
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
    let (ok, shed) = shed_outcome(send_prioritized(envoy.addr(), "critical", 2 * MAX), "critical", DELAY).await;
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

    let low = send_prioritized(addr, "low", 5);
    tokio::time::sleep(SETTLE).await;
    let normal = send_prioritized(addr, "normal", 5);
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
    let critical = send_prioritized(addr, "critical", 6);

    let low = shed_outcome(low, "low", DELAY).await;
    let normal = shed_outcome(normal, "normal", DELAY).await;
    let unnamed = shed_outcome(unnamed, "normal", DELAY).await;
    let critical = shed_outcome(critical, "critical", DELAY).await;
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
    let hanging = send_prioritized(envoy.addr(), "critical", MAX);
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
    let reset = send_prioritized(envoy.addr(), "critical", MAX);
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

/// The health endpoint answers `GET` and `HEAD` of its path; any other method on
/// that path is an ordinary request, which reaches the upstream (before, `POST
/// /floodgate/health` was answered by the filter and never reached it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_endpoint_answers_get_and_head_only() {
    let upstream = Upstream::start();
    let envoy = Envoy::start(shedding_config(4), &upstream);
    let request = |method: &str| {
        format!("{method} {HEALTH} HTTP/1.1\r\nhost: floodgate.test\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    };
    let head = raw_request(envoy.addr(), request("HEAD").as_bytes()).await.expect("HEAD");
    assert_eq!(head.status, 200, "{}", head.head);
    assert!(head.head.contains("content-type: application/json"), "{}", head.head);
    assert!(head.body.is_empty(), "no body for HEAD");
    let get = raw_request(envoy.addr(), request("GET").as_bytes()).await.expect("GET");
    assert_eq!(get.status, 200);
    assert!(String::from_utf8_lossy(&get.body).contains("\"in_flight\":0"), "{:?}", get.body);
    assert_eq!(upstream.total(), 0, "GET and HEAD are the filter's");
    for (i, method) in ["POST", "PUT", "DELETE", "OPTIONS"].into_iter().enumerate() {
        let r = raw_request(envoy.addr(), request(method).as_bytes()).await.expect(method);
        assert_eq!(r.status, 200, "{method}: {}", r.head);
        assert_eq!(String::from_utf8_lossy(&r.body), UPSTREAM_BODY, "{method} is answered by the upstream");
        assert_eq!(upstream.total(), i as u64 + 1);
    }
}

/// A request the filter refuses gives its in-flight unit back at once, not when
/// the client has read the refusal. HTTP/2 clients that grant no flow-control window
/// (`SETTINGS_INITIAL_WINDOW_SIZE` 0) receive a refusal's headers but never its body, so the
/// stream stays open; before, each such refused stream kept its unit of `max_active_requests`
/// until the client went away, and honest requests were shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_hold_no_in_flight_unit_while_the_client_reads_slowly() {
    const MAX: u32 = 2;
    let upstream = Upstream::start();
    let mut config = shedding_config(MAX);
    config["rate_limits"] = json!([{"name": "per-key", "key": [{"header": "x-key"}], "limit": 1, "window": "1h"}]);
    let envoy = Envoy::start(config, &upstream);
    let critical = ("x-floodgate-priority", "critical");
    assert_eq!(get(envoy.addr(), "/work", &[critical, ("x-key", "spent")]).await.status, 200);

    let stalled = slow_clients::StalledH2::connect(envoy.addr()).await;
    for _ in 0..MAX {
        let status = stalled.request("/work", &[critical, ("x-key", "spent")]).await;
        assert_eq!(status, 429, "refused by the rate limit, after the shedding stage admitted it");
    }
    // The refused streams are still open in Envoy: their bodies wait for flow-control credit.
    let active = envoy.stat("http.front.downstream_rq_active");
    println!("streams still open in Envoy: {active:?}");
    assert_eq!(active, Some(u64::from(MAX)), "the refusals' streams cannot finish");
    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(2)).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "refused requests hold no unit: {body}");
    for key in ["a", "b"] {
        let r = get(envoy.addr(), "/work", &[critical, ("x-key", key)]).await;
        assert_eq!(r.status, 200, "an honest request is admitted: {}", r.text());
    }
    drop(stalled);
    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(3)).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "{body}");
}

/// A step of the wall clock does not let the limit be exceeded. In-flight entries
/// carried wall-clock heartbeats: a step of more than 10 s forward made every other worker's
/// entries look dead until their next heartbeat, and the limit was exceeded (20 in flight at a
/// limit of 10). Heartbeats are now on the monotonic clock. The step is real for Envoy alone:
/// `wallclock` (a preloaded library) moves its wall clock 20 s forward mid-run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_step_does_not_let_the_limit_be_exceeded() {
    const MAX: usize = 10;
    let clock = wallclock::SteppedWallClock::new();
    let upstream = Upstream::with_options(UpstreamOptions {
        delay: Some(Duration::from_secs(6)),
        ..UpstreamOptions::default()
    });
    let envoy = Envoy::builder(shedding_config(MAX as u32)).upstream(&upstream).env(clock.env()).start();
    let held = send_prioritized(envoy.addr(), "critical", MAX);
    let (_, body) = wait_in_flight(&envoy, MAX as u64, Duration::from_secs(3)).await;
    assert_eq!(body["in_flight"], MAX as u64, "{body}");
    println!("connections per worker: {:?}", envoy.connections_per_worker());
    let stepped = Instant::now();
    clock.step(Duration::from_secs(20));
    // For the next 2.5 s (the step reaches Envoy within a second, the heartbeats come every
    // second), requests keep arriving on new connections, over both workers: none fits.
    let mut admitted = 0;
    let mut refused = 0;
    while stepped.elapsed() < Duration::from_millis(2_500) {
        let r = get(envoy.addr(), "/work", &[("x-floodgate-priority", "critical")]).await;
        match r.status {
            503 => refused += 1,
            200 => admitted += 1,
            other => panic!("unexpected {other}: {}", r.text()),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let date = get(envoy.addr(), HEALTH, &[]).await.header("date").map(str::to_owned);
    println!("after the step: {refused} refused, {admitted} admitted; Envoy's date header: {date:?}");
    assert_eq!(admitted, 0, "a request was admitted past the limit of {MAX} after the wall clock stepped");
    assert!(refused > 50, "requests kept coming: {refused}");
    let (ok, _) = shed_outcome(held, "critical", DELAY).await;
    assert_eq!(ok, MAX);
    let (status, body) = wait_in_flight(&envoy, 0, Duration::from_secs(3)).await;
    assert_eq!((status, &body["in_flight"]), (200, &json!(0)), "{body}");
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

// ---------------------------------------------------------------------------------------------
// Shedding on the event loop's lag
// ---------------------------------------------------------------------------------------------

/// Shedding on the event loop's lag, with no in-flight limit at all. One worker; a
/// Lua filter after floodgate burns CPU per request. Low-priority load makes the loop lag past
/// the low class's share of `max_loop_lag` (but far from the critical class's): low requests
/// are shed, critical ones are not. Heavy critical load then makes it lag past the whole of it:
/// critical requests are shed too, and the health endpoint says `503`. Once the load stops, the
/// proxy stops shedding within a few probes and the health endpoint says `200` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loop_lag_sheds_low_classes_first_and_stops_when_the_load_goes_away() {
    let upstream = Upstream::start();
    let config = json!({
        "load_shedding": {
            "max_loop_lag": "300ms", "lag_probe_interval": "50ms",
            "classes": [{"name": "critical", "shed_at": 1.0}, {"name": "low", "shed_at": 0.05}],
            "default_class": "critical"
        },
        "health": {"path": HEALTH}
    });
    let envoy = Envoy::builder(config).upstream(&upstream).concurrency(1).lua_after(BURN_LUA).start();
    let stat = |what: &str| envoy.stat(&format!("{STAT_PREFIX}.load_shedding.{what}")).unwrap_or(0);
    let (status, body) = health(&envoy).await;
    println!("idle: {status} {body}");
    assert_eq!((status, &body["shedding"]), (200, &json!(false)), "{body}");

    // The loop runs a timer after the requests that were ready with it: N clients sending
    // requests of T ms back to back make the probes about N × T ms late. T is set in
    // milliseconds of this machine's work.
    let per_ms = burn_rate_per_ms(envoy.addr()).await;
    // 1. Low-priority load (4 × ~40 ms: past low's 15 ms, far from critical's 300 ms), and a
    //    critical request of ~10 ms now and then.
    let low = Burners::start(envoy.addr(), 4, "low", 40 * per_ms);
    let critical_burn = (10 * per_ms).to_string();
    let mut critical = (0u64, 0u64);
    let phase = Instant::now();
    while phase.elapsed() < Duration::from_secs(5) {
        let r = get(envoy.addr(), "/work", &[("x-floodgate-priority", "critical"), ("x-burn", &critical_burn)]).await;
        match r.status {
            200 => critical.0 += 1,
            503 => critical.1 += 1,
            other => panic!("unexpected {other}: {}", r.text()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let low = low.stop();
    println!("phase 1 (low load): low {} admitted, {} shed; critical {} admitted, {} shed; shed_by_lag low {}, critical {}",
        low.0, low.1, critical.0, critical.1, stat("low.shed_by_lag"), stat("critical.shed_by_lag"));
    let figures = format!("low (admitted, shed) {low:?}, critical {critical:?}, low.shed_by_lag {}", stat("low.shed_by_lag"));
    assert!(low.1 > 0 && stat("low.shed_by_lag") == low.1, "low requests are shed for the lag: {figures}");
    assert!(low.0 > 0, "and admitted while the lag is low: {figures}");
    assert_eq!(critical.1, 0, "the critical class is not shed below its share of the lag: {figures}");
    assert!(critical.0 > 10, "{figures}");

    // 2. Heavy critical load (4 × ~1 s): the loop lags past max_loop_lag; the health endpoint
    //    says 503.
    let heavy = Burners::start(envoy.addr(), 4, "critical", 1000 * per_ms);
    let phase = Instant::now();
    let mut seen_red = None;
    let mut lags = Vec::new();
    while phase.elapsed() < Duration::from_secs(20) && seen_red.is_none() {
        let (status, body) = health(&envoy).await;
        lags.push(body["loop_lag_ms"].as_u64().unwrap_or(0));
        if status == 503 {
            seen_red = Some((phase.elapsed(), body));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let heavy = heavy.stop();
    println!("phase 2 (heavy critical load): critical {} admitted, {} shed; health red after {:?}; lags seen {lags:?}", heavy.0, heavy.1, seen_red.as_ref().map(|r| r.0));
    let (_, red) = seen_red.unwrap_or_else(|| panic!("the health endpoint turns 503 while the default class is shed: lags seen {lags:?}"));
    assert_eq!((&red["status"], &red["shedding"]), (&json!("overloaded"), &json!(true)), "{red}");
    assert!(heavy.1 > 0 || stat("critical.shed_by_lag") > 0, "critical requests are shed past max_loop_lag: {heavy:?}");

    // 3. No load: within a few probes, no shedding and a green health endpoint.
    let calm = Instant::now();
    let (status, body) = loop {
        let (status, body) = health(&envoy).await;
        if (status == 200 && body["shedding"] == json!(false)) || calm.elapsed() > Duration::from_secs(5) {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("calm after {:.2} s: {status} {body}", calm.elapsed().as_secs_f64());
    assert_eq!((status, &body["shedding"]), (200, &json!(false)), "{body}");
    let r = get(envoy.addr(), "/work", &[("x-floodgate-priority", "low")]).await;
    assert_eq!(r.status, 200, "low requests are admitted again: {}", r.text());
    let (_, histogram) = envoy.admin_get("/stats?filter=load_shedding.loop_lag_ms");
    println!("{histogram}");
    assert!(histogram.contains("loop_lag_ms: P0("), "the lag histogram is in /stats: {histogram}");
}

