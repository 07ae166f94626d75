//! A rate limit's refusal in the shape of the API the rule guards (`refusal_format`), so that the
//! API's own clients show it: OpenAI's error object, whose `message` the `openai` SDK puts in its
//! `RateLimitError`, or Anthropic's, which the `anthropic` SDK shows whole. The headers are the
//! problem document's (`retry-after`, `retry-after-ms`, `ratelimit-policy`, `ratelimit`); only the
//! body and its `content-type` (`application/json`) differ.
//!
//! Invariant: the message names the quota, its limit and window, what is used and what remains,
//! and when to retry (the exact wait); the error object also carries them as members (`policy`,
//! `limit`, `unit`, `window`, `remaining`, `estimate`, `retry_after`, `retry_after_ms`), beside
//! the members the API defines (OpenAI: `type` `requests` or `tokens`, `code`
//! `rate_limit_exceeded`; Anthropic: `type` `rate_limit_error`).
//!
//! Rationale: docs/configuration.md, "Responses".

use crate::config::RefusalFormat;
use crate::ratelimit::RuleTable;
use crate::replies::window_text;
use serde_json::{json, Value};
use std::num::NonZeroU32;

/// What a `429` says, whatever its shape.
#[derive(Clone, Copy, Debug)]
pub struct Facts<'a> {
    /// The binding rule's table.
    pub table: &'a RuleTable,
    /// The key's limit.
    pub limit: NonZeroU32,
    /// Units left to the key.
    pub remaining: u64,
    /// The key's current count (the sliding-window estimate, or the bucket's level).
    pub estimate: f64,
    /// The exact wait.
    pub retry_after_ms: u64,
    /// `retry-after`.
    pub retry_after_secs: u64,
    /// The counters could not be updated (not over the limit).
    pub contention: bool,
}

/// The unit as an LLM API's client reads it: a cost counts tokens.
fn unit(table: &RuleTable) -> &'static str {
    match table.unit {
        "units" => "tokens",
        other => other,
    }
}

/// `2695` → `2.695s`, `120` → `120ms`, `3000` → `3s`.
fn wait_text(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let fraction = format!("{:03}", ms % 1000);
    let fraction = fraction.trim_end_matches('0');
    if fraction.is_empty() {
        format!("{}s", ms / 1000)
    } else {
        format!("{}.{fraction}s", ms / 1000)
    }
}

/// The body of a `429` in `format` (the problem document is [`crate::replies::rate_limited`]'s),
/// its members in the API's order: the API's own first, then floodgate's.
pub fn body(format: RefusalFormat, facts: &Facts<'_>) -> String {
    let table = facts.table;
    let (name, unit, window) = (table.name.as_str(), unit(table), window_text(table));
    let quota = format!("quota \"{name}\" of {} {unit} per {window}", facts.limit);
    let wait = wait_text(facts.retry_after_ms);
    let (message, api): (String, Vec<(&str, Value)>) = match format {
        RefusalFormat::Openai => {
            let message = if facts.contention {
                format!("Rate limit {quota} could not be counted under contention. Please try again in {wait}.")
            } else {
                format!("Rate limit reached for {quota} (used {}, remaining {}). Please try again in {wait}.", facts.estimate, facts.remaining)
            };
            let kind = if table.unit == "requests" { "requests" } else { "tokens" };
            (message, vec![("type", json!(kind)), ("param", Value::Null), ("code", json!("rate_limit_exceeded"))])
        }
        RefusalFormat::Anthropic | RefusalFormat::Problem => {
            let message = if facts.contention {
                format!("The rate limit {quota} could not be counted under contention. Please try again in {wait}.")
            } else {
                format!(
                    "This request would exceed the rate limit {quota} (used {}, remaining {}). Please try again in {wait}.",
                    facts.estimate, facts.remaining
                )
            };
            (message, vec![("type", json!("rate_limit_error"))])
        }
    };
    let mut members: Vec<(&str, Value)> = match format {
        RefusalFormat::Openai => vec![("message", json!(message))],
        RefusalFormat::Anthropic | RefusalFormat::Problem => Vec::new(),
    };
    members.extend(api);
    if format != RefusalFormat::Openai {
        members.push(("message", json!(message)));
    }
    members.extend([
        ("policy", json!(name)),
        ("limit", json!(facts.limit.get())),
        ("unit", json!(unit)),
        ("window", json!(window)),
        ("remaining", json!(facts.remaining)),
        ("estimate", json!(facts.estimate)),
        ("retry_after", json!(facts.retry_after_secs)),
        ("retry_after_ms", json!(facts.retry_after_ms)),
    ]);
    let error = object(&members);
    match format {
        RefusalFormat::Openai => format!("{{\"error\":{error}}}"),
        RefusalFormat::Anthropic | RefusalFormat::Problem => format!("{{\"type\":\"error\",\"error\":{error}}}"),
    }
}

/// A JSON object of `members`, in their order.
fn object(members: &[(&str, Value)]) -> String {
    let fields: Vec<String> = members.iter().map(|(name, value)| format!("{}:{value}", Value::from(*name))).collect();
    format!("{{{}}}", fields.join(","))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::primitives::store::MemoryStore;
    use crate::primitives::time::UnixMillis;
    use crate::ratelimit::reserve::Reserves;
    use crate::ratelimit::{Limiter, Probe, Verdict};
    use crate::replies::rate_limited;

    fn refusal(format: &str, cost: &str) -> crate::replies::Reply {
        let config = Config::parse(
            format!(r#"{{"rate_limits":[{{"name":"tokens","key":["source_ip"],"limit":100,"window":"1m","refusal_format":"{format}"{cost}}}]}}"#)
                .as_bytes(),
        )
        .unwrap();
        let limiter = Limiter::new(&config, "t");
        let store = MemoryStore::new();
        let now = UnixMillis(1_700_000_040_000 + 1_305);
        let mut reserves = Reserves::disabled();
        let probe = |cost| Probe { cost, ..Probe::new(0, 7) };
        assert!(matches!(limiter.check(&store, &mut reserves, &[probe(100)], &[], now), Verdict::Admitted { .. }));
        let verdict = limiter.check(&store, &mut reserves, &[probe(30)], &[], now);
        rate_limited(&limiter, &verdict, now).unwrap().with_exact_wait()
    }

    fn header(reply: &crate::replies::Reply, name: &str) -> String {
        reply.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()).unwrap_or_default()
    }

    #[test]
    fn openai_s_error_object_names_the_limit_and_the_wait() {
        let reply = refusal("openai", r#","cost":{"from":"request_header","header":"x-cost"}"#);
        let problem = refusal("problem", r#","cost":{"from":"request_header","header":"x-cost"}"#);
        assert_eq!(reply.status, 429);
        assert_eq!(header(&reply, "content-type"), "application/json");
        for name in ["retry-after", "retry-after-ms", "ratelimit-policy", "ratelimit"] {
            assert_eq!(header(&reply, name), header(&problem, name), "{name}: the same headers");
        }
        let ms: u64 = header(&reply, "retry-after-ms").parse().unwrap();
        let problem_body: Value = serde_json::from_str(&problem.body).unwrap();
        assert_eq!(problem_body["retry_after_ms"], ms, "the header is the body's exact wait");
        let body: Value = serde_json::from_str(&reply.body).unwrap();
        let error = &body["error"];
        assert_eq!((&error["type"], &error["code"], &error["param"]), (&json!("tokens"), &json!("rate_limit_exceeded"), &Value::Null));
        assert_eq!((&error["policy"], &error["limit"], &error["remaining"], &error["retry_after_ms"]), (&json!("tokens"), &json!(100), &json!(0), &json!(ms)));
        let message = error["message"].as_str().unwrap();
        assert_eq!(message, format!("Rate limit reached for quota \"tokens\" of 100 tokens per 1m (used 100, remaining 0). Please try again in {}.", wait_text(ms)));
        assert!(refusal("openai", "").body.contains("\"type\":\"requests\""), "a rule of requests");
    }

    #[test]
    fn anthropic_s_error_object_names_the_limit_and_the_wait() {
        let reply = refusal("anthropic", "");
        let body: Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!((&body["type"], &body["error"]["type"]), (&json!("error"), &json!("rate_limit_error")));
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("This request would exceed the rate limit quota \"tokens\" of 100 requests per 1m (used 100, remaining 0). Please try again in "), "{message}");
        assert_eq!(body["error"]["window"], "1m");
        assert!(reply.body.starts_with(r#"{"type":"error","error":{"type":"rate_limit_error","message":"This request"#), "the API's order: {}", reply.body);
        let openai = refusal("openai", "");
        assert!(openai.body.starts_with(r#"{"error":{"message":"Rate limit reached"#), "the API's order: {}", openai.body);
        assert_eq!(header(&reply, "content-type"), "application/json");
    }

    #[test]
    fn waits_read_as_the_apis_write_them() {
        assert_eq!(wait_text(0), "0ms");
        assert_eq!(wait_text(120), "120ms");
        assert_eq!(wait_text(1000), "1s");
        assert_eq!(wait_text(2695), "2.695s");
        assert_eq!(wait_text(2690), "2.69s");
        assert_eq!(wait_text(58_700), "58.7s");
    }
}
