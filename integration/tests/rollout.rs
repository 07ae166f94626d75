//! Rolling a limit out, end to end in a real Envoy (2 workers): a rule in shadow counts what it
//! would refuse and lets everything through, then enforces at once after a reload; shedding in
//! shadow; every decision in Envoy's access log; rules that follow Envoy's named routes.

use std::time::Duration;

use floodgate_integration::dynamic::{Delivery, DynamicEnvoy, FilterVersion};
use floodgate_integration::*;
use serde_json::{json, Value};

const HOUR: Duration = Duration::from_secs(3600);

/// Away from the one-hour windows' bucket boundary, where counts would start to slide.
fn clear_of_hour_boundary() {
    wait_for_window_phase(HOUR, Duration::from_secs(60), HOUR - Duration::from_secs(120));
}

fn rule(mode: &str) -> Value {
    json!({"access_log": true, "rate_limits": [
        {"name": "per-key", "key": [{"header": "x-key"}], "limit": 5, "window": "1h", "mode": mode}
    ]})
}

/// A field of an access-log line as text (`-` when absent; Envoy writes numbers as numbers).
fn field(line: &Value, name: &str) -> String {
    match &line[name] {
        Value::Null => "-".to_owned(),
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_in_shadow_admits_all_counts_its_would_be_refusals_and_enforces_after_a_reload() {
    shadow_then_enforced(false).await;
}

/// The same reload as a changed listener (LDS from a file, the filter inline): the new listener's
/// filter keeps the rule's counters too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_listener_keeps_the_counters_and_enforces_at_once() {
    shadow_then_enforced(true).await;
}

/// Twelve requests of one key under a rule in shadow, then the rule enforced by a reload of the
/// filter's configuration (ECDS), or of the whole listener (`lds`).
async fn shadow_then_enforced(lds: bool) {
    clear_of_hour_boundary();
    let upstream = Upstream::start();
    let builder = DynamicEnvoy::builder(FilterVersion::new(rule("shadow"))).cluster("upstream", &[upstream.addr()]);
    let mut envoy = if lds { builder.listener_by_lds() } else { builder }.start();
    let mut statuses = Vec::new();
    for n in 0..12 {
        let r = get(envoy.addr(), &format!("/shadow/{n}"), &[("x-key", "k")]).await;
        statuses.push(r.status);
    }
    assert_eq!(statuses, vec![200; 12]);
    assert_eq!(upstream.total(), 12);
    assert_eq!(envoy.wait_for_stat("floodgate.rate_limit.per-key.shadow_rejected", 7, Duration::from_secs(5)), Some(7));
    assert_eq!(envoy.stat("floodgate.rate_limit.per-key.allowed"), Some(5));
    assert_eq!(envoy.stat("floodgate.rate_limit.per-key.rejected"), Some(0));
    let lines = envoy.access_log(12);
    assert_eq!(lines.len(), 12, "{lines:?}");
    let shadowed: Vec<String> =
        lines.iter().filter(|l| field(l, "outcome") == "shadow_refused").map(|l| field(l, "path")).collect();
    assert_eq!(shadowed, (5..12).map(|n| format!("/shadow/{n}")).collect::<Vec<_>>(), "exactly the 6th to the 12th");
    for line in &lines {
        if field(line, "outcome") == "shadow_refused" {
            assert_eq!([field(line, "by"), field(line, "limit"), field(line, "remaining")], ["per-key", "5", "0"], "{line}");
        } else {
            assert_eq!([field(line, "outcome"), field(line, "by")], ["admitted", "-"], "{line}");
        }
    }
    // Enforced by a reload: the counts are kept, the next request is refused at once.
    let modified = envoy.stat("listener_manager.listener_modified").unwrap_or(0) + envoy.stat("listener_manager.listener_in_place_updated").unwrap_or(0);
    assert_eq!(envoy.deliver(&FilterVersion::new(rule("enforce"))), Delivery::Taken);
    let modified_now = envoy.stat("listener_manager.listener_modified").unwrap_or(0) + envoy.stat("listener_manager.listener_in_place_updated").unwrap_or(0);
    println!("reloaded by {}: listener modified {modified} -> {modified_now} times", if lds { "LDS" } else { "ECDS" });
    assert_eq!(modified_now > modified, lds, "a changed listener by LDS, or only the filter's configuration by ECDS");
    let refused = get(envoy.addr(), "/enforced", &[("x-key", "k")]).await;
    assert_eq!(refused.status, 429);
    assert_eq!(get(envoy.addr(), "/enforced", &[("x-key", "other")]).await.status, 200);
    let lines = envoy.access_log(14);
    let last = lines.iter().find(|l| field(l, "path") == "/enforced" && field(l, "status") == "429");
    let last = last.unwrap_or_else(|| panic!("no refused line in {lines:?}"));
    assert_eq!([field(last, "outcome"), field(last, "by"), field(last, "limit"), field(last, "remaining")], ["refused", "per-key", "5", "0"]);
}

/// The `RateLimit`, `RateLimit-Policy` and `Retry-After` fields of a response (`None`: absent).
fn limit_fields(response: &Response) -> [Option<String>; 3] {
    ["ratelimit", "ratelimit-policy", "retry-after"].map(|name| response.header(name).map(str::to_owned))
}

/// A rule in shadow contributes nothing to the response: alone, no field at all, whether it
/// would admit or refuse; beside an enforced rule, the enforced rule's fields only, even while
/// the shadow rule has less left. It still counts and logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_in_shadow_shows_no_limit_to_clients() {
    clear_of_hour_boundary();
    let upstream = Upstream::start();
    let shadow = json!({"name": "trial", "key": [{"header": "x-key"}], "limit": 2, "window": "1h", "mode": "shadow"});
    let alone = Envoy::builder(json!({"access_log": true, "rate_limits": [shadow.clone()]})).upstream(&upstream).with_access_log().start();
    for n in 0..4 {
        let response = get(alone.addr(), &format!("/alone/{n}"), &[("x-key", "k")]).await;
        assert_eq!(response.status, 200);
        assert_eq!(limit_fields(&response), [None, None, None], "request {n}: no field of a rule in shadow");
    }
    assert_eq!(alone.wait_for_stat("floodgate.rate_limit.trial.shadow_rejected", 2, Duration::from_secs(5)), Some(2));
    let lines = alone.access_log(4);
    let logged: Vec<[String; 3]> = lines.iter().map(|l| ["outcome", "limit", "remaining"].map(|f| field(l, f))).collect();
    assert!(logged.iter().any(|l| *l == ["shadow_refused", "2", "0"].map(str::to_owned)), "the log still tells: {logged:?}");

    let enforced = json!({"name": "enforced", "key": [{"header": "x-key"}], "limit": 4, "window": "1h"});
    let beside = Envoy::builder(json!({"rate_limits": [shadow, enforced]})).upstream(&upstream).start();
    let mut seen = Vec::new();
    for n in 0..5 {
        let response = get(beside.addr(), &format!("/beside/{n}"), &[("x-key", "k")]).await;
        seen.push((response.status, limit_fields(&response)));
    }
    let some = |text: &str| Some(text.to_owned());
    let policy = some("\"enforced\";q=4;w=3600");
    for (n, (status, fields)) in seen.iter().enumerate().take(4) {
        let ratelimit = format!("\"enforced\";r={};t=", 3 - n);
        assert_eq!(*status, 200);
        assert!(fields[0].as_deref().is_some_and(|f| f.starts_with(&ratelimit)), "request {n}: the enforced rule's fields only: {fields:?}");
        assert_eq!(fields[1..], [policy.clone(), None], "request {n}: {fields:?}");
    }
    let (status, fields) = &seen[4];
    assert_eq!(*status, 429);
    assert!(fields[0].as_deref().is_some_and(|f| f.starts_with("\"enforced\";r=0;t=")), "{fields:?}");
    assert_eq!(fields[1], policy);
    assert!(fields[2].is_some(), "the enforced rule's retry-after");
    assert_eq!(beside.stat("floodgate.rate_limit.trial.shadow_rejected"), Some(3), "the shadow rule still counts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shedding_in_shadow_admits_every_request_and_counts_the_would_be_shed() {
    let upstream = Upstream::with_options(UpstreamOptions { delay: Some(Duration::from_millis(1500)), ..UpstreamOptions::default() });
    let config = json!({"access_log": true, "load_shedding": {
        "max_active_requests": 4, "mode": "shadow", "classes": [{"name": "normal", "shed_at": 1.0}]
    }});
    let envoy = Envoy::builder(config).upstream(&upstream).with_access_log().start();
    let addr = envoy.addr();
    let pending: Vec<_> = (0..10).map(|_| tokio::spawn(async move { get(addr, "/slow", &[]).await.status })).collect();
    let mut statuses = Vec::new();
    for p in pending {
        statuses.push(p.await.expect("request"));
    }
    assert_eq!(statuses, vec![200; 10]);
    assert_eq!(envoy.stat("floodgate.load_shedding.normal.shadow_shed"), Some(6));
    assert_eq!(envoy.stat("floodgate.load_shedding.normal.shed"), Some(0));
    assert_eq!(envoy.wait_for_stat("floodgate.load_shedding.in_flight", 0, Duration::from_secs(5)), Some(0));
    let lines = envoy.access_log(10);
    let by_in_flight = lines.iter().filter(|l| field(l, "outcome") == "shadow_refused" && field(l, "by") == "max_active_requests").count();
    assert_eq!(by_in_flight, 6, "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_shows_each_decision() {
    clear_of_hour_boundary();
    let upstream = Upstream::with_options(UpstreamOptions { delay: Some(Duration::from_millis(1500)), ..UpstreamOptions::default() });
    let config = json!({
        "access_log": true,
        "rate_limits": [
            {"name": "per-key", "key": [{"header": "x-key"}], "limit": 1, "window": "1h"},
            {"name": "wide", "key": [{"header": "x-key"}], "limit": 100, "window": "1h"},
        ],
        "load_shedding": {"max_active_requests": 1, "classes": [{"name": "normal", "shed_at": 1.0}]},
        "cluster_selection": {"route_header": "x-cluster", "clusters": ["upstream-a"]},
    });
    let envoy = Envoy::builder(config)
        .cluster("upstream-a", &[upstream.addr()])
        .route_by_header("x-cluster")
        .with_access_log()
        .start();
    let addr = envoy.addr();
    // Admitted, and slow: it holds the proxy's one in-flight unit meanwhile.
    let admitted = tokio::spawn(async move { get(addr, "/admitted", &[("x-key", "a")]).await.status });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(get(addr, "/shed", &[("x-key", "b")]).await.status, 503);
    assert_eq!(admitted.await.expect("request"), 200);
    assert_eq!(get(addr, "/refused", &[("x-key", "a")]).await.status, 429);
    let grpc = get(addr, "/grpc.Service/Call", &[("x-key", "a"), ("content-type", "application/grpc")]).await;
    assert_eq!(grpc.header("grpc-status"), Some("8"), "RESOURCE_EXHAUSTED");
    let lines = envoy.access_log(4);
    let line = |path: &str| lines.iter().find(|l| field(l, "path") == path).unwrap_or_else(|| panic!("no {path} in {lines:?}")).clone();
    let fields = |l: &Value| {
        ["status", "outcome", "by", "limit", "remaining", "cluster"].map(|f| field(l, f)).to_vec()
    };
    assert_eq!(fields(&line("/admitted")), ["200", "admitted", "-", "1", "0", "upstream-a"]);
    assert_eq!(fields(&line("/shed")), ["503", "shed", "max_active_requests", "-", "-", "-"]);
    assert_eq!(fields(&line("/refused")), ["429", "refused", "per-key", "1", "0", "-"]);
    let grpc = line("/grpc.Service/Call");
    assert_eq!(fields(&grpc)[1..], ["refused", "per-key", "1", "0", "-"]);
    assert_eq!(field(&grpc, "grpc_status"), "8");
}

/// A request a token bucket let in to wait for its turn (`max_delay`) is logged `delayed`, by
/// the bucket, with its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_says_delayed_with_the_wait() {
    let upstream = Upstream::start();
    let config = json!({"access_log": true, "rate_limits": [
        {"name": "paced", "key": [{"header": "x-key"}], "limit": 2, "window": "1s",
         "algorithm": "token_bucket", "burst": 1, "max_delay": "2s"}
    ]});
    let envoy = Envoy::builder(config).upstream(&upstream).with_access_log().start();
    let addr = envoy.addr();
    assert_eq!(get(addr, "/first", &[("x-key", "k")]).await.status, 200);
    assert_eq!(get(addr, "/second", &[("x-key", "k")]).await.status, 200);
    let lines = envoy.access_log(2);
    let line = |path: &str| lines.iter().find(|l| field(l, "path") == path).unwrap_or_else(|| panic!("no {path} in {lines:?}")).clone();
    let fields = |l: &Value| ["outcome", "by"].map(|f| field(l, f)).to_vec();
    assert_eq!(fields(&line("/first")), ["admitted", "-"]);
    assert_eq!(field(&line("/first"), "waited_ms"), "-");
    let second = line("/second");
    assert_eq!(fields(&second), ["delayed", "paced"], "{second}");
    let waited: u64 = field(&second, "waited_ms").parse().unwrap_or_else(|_| panic!("a wait: {second}"));
    assert!((300..=900).contains(&waited), "about half a second (2 per second, a burst of 1): {waited} ms");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_matched_by_route_name_limits_that_route_only() {
    clear_of_hour_boundary();
    let upstream = Upstream::start();
    let config = json!({"rate_limits": [
        {"name": "api", "key": [{"header": "x-key"}], "limit": 2, "window": "1h", "match": {"routes": ["api-route"]}}
    ]});
    let envoy = Envoy::builder(config)
        .upstream(&upstream)
        .named_routes(&[("/api", "api-route"), ("/", "default-route")])
        .start();
    let mut api = Vec::new();
    let mut other = Vec::new();
    for _ in 0..4 {
        api.push(get(envoy.addr(), "/api/items", &[("x-key", "k")]).await.status);
        other.push(get(envoy.addr(), "/static/items", &[("x-key", "k")]).await.status);
    }
    assert_eq!(api, [200, 200, 429, 429]);
    assert_eq!(other, [200; 4]);
    assert_eq!(envoy.stat("floodgate.rate_limit.api.allowed"), Some(2));
    assert_eq!(envoy.stat("floodgate.rate_limit.api.rejected"), Some(2));
}
