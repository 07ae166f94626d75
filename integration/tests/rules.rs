//! Rules that fit real APIs, end to end in a real Envoy (2 workers): conditions
//! (`match`), limits by tier and by key (`tiers`, `overrides`, a reload changing them), and
//! costs (a request header, the request body, units the upstream reports), with bad cost values.
//! Every rule has a 1 h window and the tests keep clear of the hour's end, so counts do not
//! slide during a test. Figures are printed (`--nocapture`).

use std::time::Duration;

use bytes::Bytes;
use floodgate_integration::dynamic::{Delivery, DynamicEnvoy, FilterVersion};
use floodgate_integration::*;

const HOUR: Duration = Duration::from_secs(3600);

fn clear_of_hour_boundary() {
    wait_for_window_phase(HOUR, Duration::from_secs(60), HOUR - Duration::from_secs(120));
}

/// Sends `method path` with `headers` (and `body`) on a new connection; returns the status.
async fn status(envoy: &Envoy, method: &str, path: &str, headers: &[(&str, &str)], body: &'static [u8]) -> u16 {
    let mut client = Client::connect(envoy.addr()).await.expect("connect");
    client.send(method, path, headers, Bytes::from_static(body)).await.expect("request").status
}

/// How many of `n` identical requests are admitted (200), the rest having to be 429.
async fn admitted(envoy: &Envoy, n: usize, method: &str, path: &str, headers: &[(&str, &str)]) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        match status(envoy, method, path, headers, b"").await {
            200 => ok += 1,
            429 => {}
            other => panic!("{method} {path} {headers:?}: unexpected {other}"),
        }
    }
    ok
}

/// The docs' examples: 5 logins per minute per client IP on `POST /login` only; anonymous
/// requests (no `authorization`) 3 per client IP, logged-in ones 6 per credential; a path
/// template. Requests a rule does not match are not counted by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditions_apply_a_rule_to_the_requests_it_matches_only() {
    clear_of_hour_boundary();
    let upstream = Upstream::start();
    let config = json!({"rate_limits": [
        {"name": "login", "key": ["source_ip"], "limit": 5, "window": "1h",
         "match": {"path": {"exact": "/login"}, "methods": ["POST"]}},
        {"name": "anonymous", "key": ["source_ip"], "limit": 3, "window": "1h",
         "match": {"path": {"prefix": "/api/"}, "headers": [{"name": "authorization", "present": false}]}},
        {"name": "user", "key": [{"header": "authorization"}], "limit": 6, "window": "1h",
         "match": {"path": {"prefix": "/api/"}, "headers": [{"name": "authorization", "present": true}]}},
        {"name": "orders", "key": ["source_ip"], "limit": 2, "window": "1h",
         "match": {"path": {"template": "/shop/*/orders"}}}
    ]});
    let envoy = Envoy::start(config, &upstream);
    assert_eq!(admitted(&envoy, 8, "POST", "/login", &[]).await, 5, "5 logins");
    assert_eq!(admitted(&envoy, 4, "GET", "/login", &[]).await, 4, "GET /login is not a login");
    assert_eq!(admitted(&envoy, 4, "POST", "/login/help", &[]).await, 4, "nor another path");
    assert_eq!(admitted(&envoy, 5, "GET", "/api/items", &[]).await, 3, "anonymous: 3");
    assert_eq!(admitted(&envoy, 8, "GET", "/api/items", &[("authorization", "Bearer alice")]).await, 6, "logged in: 6");
    assert_eq!(admitted(&envoy, 2, "GET", "/api/items", &[("authorization", "Bearer bob")]).await, 2, "per credential");
    assert_eq!(admitted(&envoy, 3, "GET", "/shop/7/orders?page=2", &[]).await, 2);
    assert_eq!(admitted(&envoy, 2, "GET", "/shop/7/orders/1", &[]).await, 2, "the template is whole");
    let stat = |rule: &str, what: &str| envoy.stat(&rule_stat(rule, what)).unwrap_or(0);
    println!(
        "login allowed {} rejected {}; anonymous {} / {}; user {} / {}",
        stat("login", "allowed"),
        stat("login", "rejected"),
        stat("anonymous", "allowed"),
        stat("anonymous", "rejected"),
        stat("user", "allowed"),
        stat("user", "rejected")
    );
    assert_eq!((stat("login", "allowed"), stat("login", "rejected")), (5, 3), "unmatched requests are not counted");
    assert_eq!((stat("user", "allowed"), stat("user", "rejected")), (8, 2));
}

/// Limits by tier (`x-plan`) and by key (an override), and a reload that changes them: the
/// counters stay, the new limits apply at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_and_overrides_give_keys_their_own_limits_and_a_reload_keeps_the_counts() {
    clear_of_hour_boundary();
    let upstream = Upstream::start();
    let rule = |gold: u32, vip: u32| {
        json!({"rate_limits": [{"name": "plan", "key": [{"header": "x-api-key"}], "limit": 2, "window": "1h",
            "tiers": {"header": "x-plan", "limits": {"gold": gold, "silver": 4}},
            "overrides": [{"key": ["vip"], "limit": vip}]}]})
    };
    let mut envoy = DynamicEnvoy::builder(FilterVersion::new(rule(6, 10))).cluster("upstream", &[upstream.addr()]).start();
    let addr = envoy.addr();
    let count = |key: &'static str, plan: Option<&'static str>, n: usize| {
        async move {
            let mut ok = 0;
            for _ in 0..n {
                let mut headers = vec![("x-api-key", key)];
                headers.extend(plan.map(|p| ("x-plan", p)));
                let r = get(addr, "/work", &headers).await;
                match r.status {
                    200 => ok += 1,
                    429 => {
                        let body = r.json();
                        assert!(body["limit"].is_u64(), "{body}");
                    }
                    other => panic!("unexpected {other}"),
                }
            }
            ok
        }
    };
    assert_eq!(count("free", None, 5).await, 2, "the rule's limit");
    assert_eq!(count("gold", Some("gold"), 9).await, 6, "gold: 6");
    assert_eq!(count("silver", Some("silver"), 6).await, 4);
    assert_eq!(count("vip", Some("silver"), 12).await, 10, "the override before the tier");
    let refused = get(envoy.addr(), "/work", &[("x-api-key", "gold"), ("x-plan", "gold")]).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("ratelimit-policy"), Some("\"plan\";q=6;w=3600"), "the policy names the tier's limit");
    assert_eq!(refused.json()["limit"], 6);
    let admitted = get(envoy.addr(), "/work", &[("x-api-key", "other"), ("x-plan", "gold")]).await;
    assert_eq!(admitted.header("ratelimit-policy"), Some("\"plan\";q=6;w=3600"));
    assert!(admitted.header("ratelimit").is_some_and(|r| r.starts_with("\"plan\";r=5;")), "{:?}", admitted.header("ratelimit"));
    // Gold raised to 8, the override to 11: the counts stay, the new limits apply.
    assert_eq!(envoy.deliver(&FilterVersion::new(rule(8, 11))), Delivery::Taken);
    assert_eq!(count("gold", Some("gold"), 4).await, 2, "6 of 8 were kept");
    assert_eq!(count("vip", None, 3).await, 1, "10 of 11 were kept");
    assert_eq!(count("free", None, 2).await, 0, "the rule's limit still holds");
}

/// Costs: a count in a request header; the request body's bytes (`content-length`, or counted
/// as the body streams); units the upstream reports, charged when the response comes. Bad
/// values (negative, fractional, not a number, too large) cost the default and are counted;
/// a cost above the limit takes the whole quota; a response without a report costs the default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costs_come_from_a_header_the_body_or_the_upstreams_report() {
    clear_of_hour_boundary();
    let upstream = Upstream::with_options(UpstreamOptions {
        echo: Some(("x-report-tokens".into(), "x-tokens-used".into())),
        ..UpstreamOptions::default()
    });
    let config = json!({"rate_limits": [
        {"name": "units", "key": [{"header": "x-api-key"}], "limit": 10, "window": "1h",
         "match": {"path": {"prefix": "/units"}}, "cost": {"from": "request_header", "header": "x-cost"}},
        {"name": "bytes", "key": [{"header": "x-api-key"}], "limit": 1000, "window": "1h",
         "match": {"path": {"prefix": "/upload"}}, "cost": {"from": "request_body"}},
        {"name": "tokens", "key": [{"header": "x-api-key"}], "limit": 100, "window": "1h",
         "match": {"path": {"prefix": "/llm"}}, "cost": {"from": "response_header", "header": "x-tokens-used"}}
    ]});
    let envoy = Envoy::builder(config).upstream(&upstream).start();
    let stat = |rule: &str, what: &str| envoy.stat(&rule_stat(rule, what)).unwrap_or(0);

    // A count in a request header: 4 + 4 fit in 10, 4 more do not, 2 do.
    let units = |key: &'static str, cost: &'static str| {
        let envoy = &envoy;
        async move { status(envoy, "GET", "/units", &[("x-api-key", key), ("x-cost", cost)], b"").await }
    };
    assert_eq!((units("a", "4").await, units("a", "4").await, units("a", "4").await, units("a", "2").await), (200, 200, 429, 200));
    let refused = get(envoy.addr(), "/units", &[("x-api-key", "a"), ("x-cost", "1")]).await;
    assert_eq!(refused.status, 429);
    let body = refused.json();
    println!("units, spent: {body}");
    assert_eq!((&body["limit"], &body["unit"], &body["estimate"]), (&json!(10), &json!("units"), &json!(10.0)));
    assert!(body["detail"].as_str().unwrap_or_default().contains("of 10 units per 1h"), "{body}");
    // Bad counts cost the default (1) and are counted; a huge one is capped at the limit.
    for bad in ["-3", "2.5", "lots", "99999999999"] {
        assert_eq!(units("b", bad).await, 200, "{bad}");
    }
    assert_eq!(stat("units", "invalid_cost"), 4);
    assert_eq!(units("b", "4294967295").await, 429, "a cost of the whole quota needs an empty key");
    assert_eq!(units("c", "4294967295").await, 200, "an empty key takes it whole");
    assert_eq!(units("c", "1").await, 429);

    // The body's bytes: content-length, then a chunked body counted as it streams.
    let upload = |key: &'static str, body: &'static [u8]| {
        let envoy = &envoy;
        async move { status(envoy, "POST", "/upload", &[("x-api-key", key)], body).await }
    };
    assert_eq!(upload("u", &[b'x'; 600]).await, 200);
    assert_eq!(upload("u", &[b'x'; 600]).await, 429, "600 more do not fit in 1000");
    assert_eq!(upload("u", &[b'x'; 400]).await, 200);
    let mut chunked = b"POST /upload HTTP/1.1\r\nhost: floodgate.test\r\nx-api-key: s\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    for _ in 0..4 {
        chunked.extend_from_slice(b"64\r\n"); // 100 bytes a chunk
        chunked.extend_from_slice(&[b'x'; 100]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    for _ in 0..2 {
        let r = raw_request(envoy.addr(), &chunked).await.expect("chunked upload");
        assert_eq!(r.status, 200, "admitted while the key has room: {}", r.head);
    }
    // 2 × 400 bytes streamed: charged when each body ended.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while stat("bytes", "charged") < 800 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stat("bytes", "charged"), 800);
    assert_eq!(upload("s", &[b'x'; 300]).await, 429, "800 streamed + 300 > 1000");
    assert_eq!(upload("s", &[b'x'; 200]).await, 200);

    // Units the upstream reports: admitted while the key has room for one unit, charged when
    // the response comes; the report makes the key's later requests refused.
    let llm = |key: &'static str, report: Option<&'static str>| {
        let envoy = &envoy;
        async move {
            let mut headers = vec![("x-api-key", key)];
            headers.extend(report.map(|r| ("x-report-tokens", r)));
            status(envoy, "POST", "/llm", &headers, b"{\"prompt\": \"hi\"}").await
        }
    };
    assert_eq!(llm("t", Some("70")).await, 200);
    assert_eq!(llm("t", Some("45")).await, 200, "30 left: admitted, and charged 45");
    assert_eq!(llm("t", Some("1")).await, 429, "115 of 100 used: refused");
    assert_eq!(stat("tokens", "charged"), 115);
    assert_eq!(llm("t1", None).await, 200, "no report: costs the default, 0");
    assert_eq!(stat("tokens", "charged"), 115);
    let before = stat("tokens", "invalid_cost");
    let bad = get(envoy.addr(), "/llm", &[("x-api-key", "t2"), ("x-report-tokens", "many")]).await;
    assert_eq!(bad.status, 200);
    assert_eq!(stat("tokens", "invalid_cost"), before + 1, "an unreadable report is counted");
    println!(
        "charged: bytes {}, tokens {}; invalid costs: units {}, tokens {}",
        stat("bytes", "charged"),
        stat("tokens", "charged"),
        stat("units", "invalid_cost"),
        stat("tokens", "invalid_cost")
    );
    let failures = wasm_failures(&envoy.log());
    assert!(failures.is_empty(), "the module failed:\n{}", failures.join("\n"));
}
