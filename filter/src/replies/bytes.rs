//! The bytes of every refusal: status, each header in order, the body, and what a gRPC status
//! would say, written out whole, so that a change of one byte in any of them fails here.

#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use super::*;
use crate::config::Config;
use std::fmt::Write as _;

/// The reply as the host sends it over HTTP (with `retry-after-ms`), as text.
fn render(reply: Reply) -> String {
    let reply = reply.with_exact_wait();
    let mut text = format!("{}\n", reply.status);
    for (name, value) in &reply.headers {
        writeln!(text, "{name}: {value}").unwrap();
    }
    writeln!(text, "{}", reply.body).unwrap();
    write!(text, "{:?}", reply.refusal).unwrap();
    text
}

fn limiter(rules: &str) -> Limiter {
    Limiter::new(&Config::parse(format!(r#"{{"rate_limits":[{rules}]}}"#).as_bytes()).unwrap(), "t")
}

const NOW: UnixMillis = UnixMillis(1_700_000_000_300);

fn violation(rule: usize, limit: u32, estimate: f64, remaining: u64, retry_in_ms: Option<u64>, cause: Cause) -> Violation {
    Violation {
        standing: Standing {
            rule,
            estimate,
            remaining,
            reset_ms: 9_000,
            retry_at: retry_in_ms.map(|ms| UnixMillis(NOW.0 + ms)),
            limit: NonZeroU32::new(limit).unwrap(),
            go_at: None,
        },
        cause,
    }
}

fn refused(limiter: &Limiter, violations: Vec<Violation>) -> String {
    render(rate_limited(limiter, &Verdict::Refused { violations }, NOW).unwrap())
}

const TWO_RULES: &str = r#"{"name":"per-api-key","key":[{"header":"x-api-key"}],"limit":4,"window":"4s"},
    {"name":"per-ip","key":["source_ip"],"limit":100,"window":"1m"}"#;

#[test]
fn the_429_of_two_refusing_rules() {
    let limiter = limiter(TWO_RULES);
    let violations = vec![
        violation(0, 4, 4.25, 0, Some(4_700), Cause::OverLimit),
        violation(1, 100, 100.0, 0, Some(1_200), Cause::OverLimit),
    ];
    assert_eq!(refused(&limiter, violations), r#"429
content-type: application/problem+json
retry-after: 5
ratelimit-policy: "per-api-key";q=4;w=4
ratelimit: "per-api-key";r=0;t=5
retry-after-ms: 4700
{"detail":"quota \"per-api-key\" of 4 requests per 4s is exhausted (current estimate 4.25); retry in 5 s","estimate":4.25,"limit":4,"policy":"per-api-key","quotas":[{"estimate":4.25,"limit":4,"policy":"per-api-key","retry_after_ms":4700,"unit":"requests","window_ms":4000},{"estimate":100.0,"limit":100,"policy":"per-ip","retry_after_ms":1200,"unit":"requests","window_ms":60000}],"retry_after":5,"retry_after_ms":4700,"status":429,"title":"Too Many Requests","type":"https://iana.org/assignments/http-problem-types#quota-exceeded","unit":"requests","violated-policies":["per-api-key","per-ip"],"window":"4s","window_ms":4000}
Some(Refusal { kind: RateLimited, detail: "quota \"per-api-key\" of 4 requests per 4s is exhausted (current estimate 4.25); retry in 5 s", retry_after_ms: 4700 })"#);
}

#[test]
fn the_429_of_a_rule_that_can_never_admit() {
    let limiter = limiter(TWO_RULES);
    assert_eq!(refused(&limiter, vec![violation(1, 7, 3.1234, 0, None, Cause::OverLimit)]), r#"429
content-type: application/problem+json
retry-after: 60
ratelimit-policy: "per-ip";q=7;w=60
ratelimit: "per-ip";r=0;t=60
retry-after-ms: 60000
{"detail":"quota \"per-ip\" of 7 requests per 1m is exhausted (current estimate 3.123); retry in 60 s","estimate":3.123,"limit":7,"policy":"per-ip","quotas":[{"estimate":3.123,"limit":7,"policy":"per-ip","retry_after_ms":60000,"unit":"requests","window_ms":60000}],"retry_after":60,"retry_after_ms":60000,"status":429,"title":"Too Many Requests","type":"https://iana.org/assignments/http-problem-types#quota-exceeded","unit":"requests","violated-policies":["per-ip"],"window":"1m","window_ms":60000}
Some(Refusal { kind: RateLimited, detail: "quota \"per-ip\" of 7 requests per 1m is exhausted (current estimate 3.123); retry in 60 s", retry_after_ms: 60000 })"#);
}

#[test]
fn the_429_under_contention() {
    let limiter = limiter(TWO_RULES);
    assert_eq!(refused(&limiter, vec![violation(0, 4, 1.0, 3, Some(10), Cause::Contention)]), r#"429
content-type: application/problem+json
retry-after: 1
ratelimit-policy: "per-api-key";q=4;w=4
ratelimit: "per-api-key";r=3;t=1
retry-after-ms: 10
{"detail":"quota \"per-api-key\" could not be counted under contention; retry in 1 s","estimate":1.0,"limit":4,"policy":"per-api-key","quotas":[{"estimate":1.0,"limit":4,"policy":"per-api-key","retry_after_ms":10,"unit":"requests","window_ms":4000}],"retry_after":1,"retry_after_ms":10,"status":429,"title":"Too Many Requests","type":"https://iana.org/assignments/http-problem-types#quota-exceeded","unit":"requests","violated-policies":["per-api-key"],"window":"4s","window_ms":4000}
Some(Refusal { kind: RateLimited, detail: "quota \"per-api-key\" could not be counted under contention; retry in 1 s", retry_after_ms: 10 })"#);
}

#[test]
fn the_429_of_a_token_bucket() {
    let limiter = limiter(r#"{"name":"api-burst","key":[{"header":"x-api-key"}],"limit":10,"window":"1s","algorithm":"token_bucket","burst":5}"#);
    assert_eq!(refused(&limiter, vec![violation(0, 10, 5.5, 0, Some(150), Cause::OverLimit)]), r#"429
content-type: application/problem+json
retry-after: 1
ratelimit-policy: "api-burst";q=5;w=1
ratelimit: "api-burst";r=0;t=1
retry-after-ms: 150
{"algorithm":"token_bucket","burst":5,"detail":"quota \"api-burst\" of 10 requests per 1s (a bucket of 5) is exhausted (current level 5.5); retry in 1 s","estimate":5.5,"limit":10,"policy":"api-burst","quotas":[{"estimate":5.5,"limit":10,"policy":"api-burst","retry_after_ms":150,"unit":"requests","window_ms":1000}],"retry_after":1,"retry_after_ms":150,"status":429,"title":"Too Many Requests","type":"https://iana.org/assignments/http-problem-types#quota-exceeded","unit":"requests","violated-policies":["api-burst"],"window":"1s","window_ms":1000}
Some(Refusal { kind: RateLimited, detail: "quota \"api-burst\" of 10 requests per 1s (a bucket of 5) is exhausted (current level 5.5); retry in 1 s", retry_after_ms: 150 })"#);
}

fn api_format(format: &str) -> Limiter {
    limiter(&format!(
        r#"{{"name":"tokens","key":["source_ip"],"limit":100,"window":"1m","refusal_format":"{format}","cost":{{"from":"request_header","header":"x-cost"}}}}"#
    ))
}

#[test]
fn the_429_in_the_apis_formats() {
    let openai = (r#"429
content-type: application/json
retry-after: 3
ratelimit-policy: "tokens";q=100;w=60
ratelimit: "tokens";r=0;t=3
retry-after-ms: 2695
{"error":{"message":"Rate limit reached for quota \"tokens\" of 100 tokens per 1m (used 100, remaining 0). Please try again in 2.695s.","type":"tokens","param":null,"code":"rate_limit_exceeded","policy":"tokens","limit":100,"unit":"tokens","window":"1m","remaining":0,"estimate":100.0,"retry_after":3,"retry_after_ms":2695}}
Some(Refusal { kind: RateLimited, detail: "quota \"tokens\" of 100 units per 1m is exhausted (current estimate 100); retry in 3 s", retry_after_ms: 2695 })"#, r#"429
content-type: application/json
retry-after: 1
ratelimit-policy: "tokens";q=100;w=60
ratelimit: "tokens";r=90;t=1
retry-after-ms: 120
{"error":{"message":"Rate limit quota \"tokens\" of 100 tokens per 1m could not be counted under contention. Please try again in 120ms.","type":"tokens","param":null,"code":"rate_limit_exceeded","policy":"tokens","limit":100,"unit":"tokens","window":"1m","remaining":90,"estimate":10.0,"retry_after":1,"retry_after_ms":120}}
Some(Refusal { kind: RateLimited, detail: "quota \"tokens\" could not be counted under contention; retry in 1 s", retry_after_ms: 120 })"#);
    let anthropic = (r#"429
content-type: application/json
retry-after: 3
ratelimit-policy: "tokens";q=100;w=60
ratelimit: "tokens";r=0;t=3
retry-after-ms: 2695
{"type":"error","error":{"type":"rate_limit_error","message":"This request would exceed the rate limit quota \"tokens\" of 100 tokens per 1m (used 100, remaining 0). Please try again in 2.695s.","policy":"tokens","limit":100,"unit":"tokens","window":"1m","remaining":0,"estimate":100.0,"retry_after":3,"retry_after_ms":2695}}
Some(Refusal { kind: RateLimited, detail: "quota \"tokens\" of 100 units per 1m is exhausted (current estimate 100); retry in 3 s", retry_after_ms: 2695 })"#, r#"429
content-type: application/json
retry-after: 1
ratelimit-policy: "tokens";q=100;w=60
ratelimit: "tokens";r=90;t=1
retry-after-ms: 120
{"type":"error","error":{"type":"rate_limit_error","message":"The rate limit quota \"tokens\" of 100 tokens per 1m could not be counted under contention. Please try again in 120ms.","policy":"tokens","limit":100,"unit":"tokens","window":"1m","remaining":90,"estimate":10.0,"retry_after":1,"retry_after_ms":120}}
Some(Refusal { kind: RateLimited, detail: "quota \"tokens\" could not be counted under contention; retry in 1 s", retry_after_ms: 120 })"#);
    for (format, (over_limit, contention)) in [("openai", openai), ("anthropic", anthropic)] {
        let limiter = api_format(format);
        assert_eq!(refused(&limiter, vec![violation(0, 100, 100.0, 0, Some(2_695), Cause::OverLimit)]), over_limit, "{format}");
        assert_eq!(refused(&limiter, vec![violation(0, 100, 10.0, 90, Some(120), Cause::Contention)]), contention, "{format}");
    }
}

#[test]
fn the_503_of_a_quota_whose_store_fails() {
    let limiter = limiter(TWO_RULES);
    assert_eq!(render(quota_store_unavailable(&limiter, 1)), r#"503
content-type: application/problem+json
retry-after: 1
retry-after-ms: 1000
{"detail":"quota \"per-ip\" cannot be checked: its store does not answer (global.on_store_failure: refuse); retry in 1 s","policy":"per-ip","retry_after":1,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: Shed, detail: "quota \"per-ip\" cannot be checked: its store does not answer (global.on_store_failure: refuse); retry in 1 s", retry_after_ms: 1000 })"#);
    assert_eq!(render(quota_store_unavailable(&limiter, 9)), r#"503
content-type: application/problem+json
retry-after: 1
retry-after-ms: 1000
{"detail":"quota \"?\" cannot be checked: its store does not answer (global.on_store_failure: refuse); retry in 1 s","policy":"?","retry_after":1,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: Shed, detail: "quota \"?\" cannot be checked: its store does not answer (global.on_store_failure: refuse); retry in 1 s", retry_after_ms: 1000 })"#);
}

fn shedder() -> Shedder {
    let config = Config::parse(
        br#"{"load_shedding":{"max_active_requests":10,"retry_after":"2s"}}"#,
    )
    .unwrap();
    Shedder::new(config.load_shedding.as_ref().unwrap(), "t").unwrap()
}

#[test]
fn the_503s_of_the_in_flight_limit() {
    let shedder = shedder();
    assert_eq!(render(shed(&shedder, &Shed { in_flight: 9, class: 2, contention: false })), r#"503
content-type: application/problem+json
retry-after: 2
retry-after-ms: 2000
{"class":"low","class_threshold":5,"detail":"9 requests in flight; class \"low\" is shed from 5 (limit 10); retry in 2 s","in_flight":9,"max_active_requests":10,"retry_after":2,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: Shed, detail: "9 requests in flight; class \"low\" is shed from 5 (limit 10); retry in 2 s", retry_after_ms: 2000 })"#);
    assert_eq!(render(shed(&shedder, &Shed { in_flight: 4, class: 1, contention: true })), r#"503
content-type: application/problem+json
retry-after: 2
retry-after-ms: 2000
{"class":"normal","class_threshold":9,"detail":"the in-flight count could not be updated under contention; retry in 2 s","in_flight":4,"max_active_requests":10,"retry_after":2,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: Shed, detail: "the in-flight count could not be updated under contention; retry in 2 s", retry_after_ms: 2000 })"#);
    assert_eq!(render(shed_after_wait(&shedder, &Shed { in_flight: 10, class: 1, contention: false }, 250)), r#"503
content-type: application/problem+json
retry-after: 2
retry-after-ms: 2000
{"class":"normal","class_threshold":9,"detail":"waited 250 ms for a slot; 10 requests in flight; class \"normal\" is shed from 9 (limit 10); retry in 2 s","in_flight":10,"max_active_requests":10,"retry_after":2,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity","waited_ms":250}
Some(Refusal { kind: Shed, detail: "waited 250 ms for a slot; 10 requests in flight; class \"normal\" is shed from 9 (limit 10); retry in 2 s", retry_after_ms: 2000 })"#);
    assert_eq!(render(shed(&shedder, &Shed { in_flight: 10, class: 7, contention: false })), r#"503
content-type: application/problem+json
retry-after: 2
retry-after-ms: 2000
{"class":"","class_threshold":0,"detail":"10 requests in flight; class \"\" is shed from 0 (limit 10); retry in 2 s","in_flight":10,"max_active_requests":10,"retry_after":2,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: Shed, detail: "10 requests in flight; class \"\" is shed from 0 (limit 10); retry in 2 s", retry_after_ms: 2000 })"#);
}

#[test]
fn the_503_of_the_loop_lag() {
    let config = Config::parse(
        br#"{"load_shedding":{"max_loop_lag":"40ms"}}"#,
    )
    .unwrap();
    let shedding = config.load_shedding.as_ref().unwrap();
    let monitor = LagMonitor::new(shedding).unwrap();
    let classes = Classes::new(shedding);
    let lag = LagShed { class: 2, lag_ms: 57, threshold_ms: 20 };
    assert_eq!(render(shed_by_lag(&classes, &monitor, &lag, 3)), r#"503
content-type: application/problem+json
retry-after: 3
retry-after-ms: 3000
{"class":"low","class_lag_threshold_ms":20,"detail":"this proxy's event loop is 57 ms late; class \"low\" is shed from 20 ms (max_loop_lag 40 ms); retry in 3 s","loop_lag_ms":57,"max_loop_lag_ms":40,"retry_after":3,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: Shed, detail: "this proxy's event loop is 57 ms late; class \"low\" is shed from 20 ms (max_loop_lag 40 ms); retry in 3 s", retry_after_ms: 3000 })"#);
}

const BULKHEAD: &[u8] = br#"{"load_shedding":{"per_key":{"key":[{"header":"x-client"},"source_ip"],"max_active_requests":5}},
    "cluster_selection":{"clusters":["a","b","c","outbound|80||d"],"partition":{"key":[{"header":"x-client"}],"size":2}}}"#;

#[test]
fn the_503s_of_the_per_key_cap() {
    let config = Config::parse(BULKHEAD).unwrap();
    let cap = PerKeyCap::new(config.load_shedding.as_ref().unwrap().per_key.as_ref().unwrap(), "t");
    assert_eq!(render(per_key_capped(&cap, &CapRefusal::Full { in_flight: 5 }, 1)), r#"503
content-type: application/problem+json
retry-after: 1
retry-after-ms: 1000
{"cap":"load_shedding.per_key","detail":"this client (per_key [header:x-client, source_ip]) has 5 requests in flight, its cap (load_shedding.per_key.max_active_requests 5); retry in 1 s","in_flight":5,"key":"header:x-client, source_ip","max_active_requests":5,"retry_after":1,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: Shed, detail: "this client (per_key [header:x-client, source_ip]) has 5 requests in flight, its cap (load_shedding.per_key.max_active_requests 5); retry in 1 s", retry_after_ms: 1000 })"#);
    assert_eq!(render(per_key_capped(&cap, &CapRefusal::Untracked, 4)), r#"503
content-type: application/problem+json
retry-after: 4
retry-after-ms: 4000
{"cap":"load_shedding.per_key","detail":"this client's requests in flight (per_key [header:x-client, source_ip]) cannot be counted: too many keys in flight at once for load_shedding.per_key.capacity, or contention; retry in 4 s","in_flight":null,"key":"header:x-client, source_ip","max_active_requests":5,"retry_after":4,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: Shed, detail: "this client's requests in flight (per_key [header:x-client, source_ip]) cannot be counted: too many keys in flight at once for load_shedding.per_key.capacity, or contention; retry in 4 s", retry_after_ms: 4000 })"#);
}

#[test]
fn the_503s_of_cluster_selection() {
    let config = Config::parse(BULKHEAD).unwrap();
    let selector = Selector::new(config.cluster_selection.as_ref().unwrap(), "t");
    let exhausted = Exhausted { clusters: vec![None, Some((2, 2)), None, Some((4, 4))], contention: false };
    let contended = Exhausted { contention: true, ..exhausted.clone() };
    let within = Confinement { members: vec![3, 1], others: vec![0, 2], spill_below: None };
    let spilling = Confinement { spill_below: Some(0.5), ..within.clone() };
    assert_eq!(render(no_capacity(&selector, &exhausted)), r#"503
content-type: application/problem+json
retry-after: 1
retry-after-ms: 1000
{"clusters":[{"in_flight":null,"limit":null,"name":"a"},{"in_flight":2,"limit":2,"name":"b"},{"in_flight":null,"limit":null,"name":"c"},{"in_flight":4,"limit":4,"name":"outbound|80||d"}],"detail":"every upstream cluster is at its concurrency limit; retry in 1 s","retry_after":1,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: NoCapacity, detail: "every upstream cluster is at its concurrency limit; retry in 1 s", retry_after_ms: 1000 })"#);
    assert_eq!(render(no_capacity(&selector, &contended)), r#"503
content-type: application/problem+json
retry-after: 1
retry-after-ms: 1000
{"clusters":[{"in_flight":null,"limit":null,"name":"a"},{"in_flight":2,"limit":2,"name":"b"},{"in_flight":null,"limit":null,"name":"c"},{"in_flight":4,"limit":4,"name":"outbound|80||d"}],"detail":"no upstream cluster had room, or its permit count could not be updated under contention; retry in 1 s","retry_after":1,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: NoCapacity, detail: "no upstream cluster had room, or its permit count could not be updated under contention; retry in 1 s", retry_after_ms: 1000 })"#);
    assert_eq!(render(no_capacity_within(&selector, &exhausted, Some(&within))), r#"503
content-type: application/problem+json
retry-after: 1
retry-after-ms: 1000
{"clusters":[{"in_flight":4,"limit":4,"name":"outbound|80||d"},{"in_flight":2,"limit":2,"name":"b"}],"detail":"every cluster of this request's partition (outbound|80||d, b) is at its concurrency limit; retry in 1 s","partition":["outbound|80||d","b"],"retry_after":1,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: NoCapacity, detail: "every cluster of this request's partition (outbound|80||d, b) is at its concurrency limit; retry in 1 s", retry_after_ms: 1000 })"#);
    assert_eq!(render(no_capacity_within(&selector, &contended, Some(&within))), r#"503
content-type: application/problem+json
retry-after: 1
retry-after-ms: 1000
{"clusters":[{"in_flight":4,"limit":4,"name":"outbound|80||d"},{"in_flight":2,"limit":2,"name":"b"}],"detail":"no cluster of this request's partition (outbound|80||d, b) had room, or its permit count could not be updated under contention; retry in 1 s","partition":["outbound|80||d","b"],"retry_after":1,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: NoCapacity, detail: "no cluster of this request's partition (outbound|80||d, b) had room, or its permit count could not be updated under contention; retry in 1 s", retry_after_ms: 1000 })"#);
    assert_eq!(render(no_capacity_within(&selector, &exhausted, Some(&spilling))), r#"503
content-type: application/problem+json
retry-after: 1
retry-after-ms: 1000
{"clusters":[{"in_flight":null,"limit":null,"name":"a"},{"in_flight":2,"limit":2,"name":"b"},{"in_flight":null,"limit":null,"name":"c"},{"in_flight":4,"limit":4,"name":"outbound|80||d"}],"detail":"every upstream cluster is at its concurrency limit; retry in 1 s","partition":["outbound|80||d","b"],"retry_after":1,"status":503,"title":"Service Unavailable","type":"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"}
Some(Refusal { kind: NoCapacity, detail: "every upstream cluster is at its concurrency limit; retry in 1 s", retry_after_ms: 1000 })"#);
}
