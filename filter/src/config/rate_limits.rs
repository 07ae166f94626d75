//! `rate_limits[]`: one rate-limit rule's key, limit, window, capacity, scope and algorithm, with
//! the shape of its refusals (`refusal_format`, and the top-level `ratelimit_headers`). What a
//! rule may say beyond that (`match`, `tiers`, `overrides`, `cost`) is in `rules.rs`.
//!
//! Invariant: a token bucket's fields come only with the token bucket, and only in proxy scope
//! ([`Config::parse`] refuses the rest, naming the field).

use super::values::{DurationMs, Name, Positive};
use super::{header_name, Config, ConfigError, Cost, Match, Mode, Override, Tiers};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;

/// Tracked keys per rule when `capacity` is not given.
pub const DEFAULT_CAPACITY: u32 = 16_384;
/// The largest accepted `capacity` (tracked keys per rule).
pub const MAX_CAPACITY: u32 = 1 << 24;
/// The largest accepted token-bucket `burst`.
pub const MAX_BURST: u32 = 1 << 20;
/// The longest accepted `max_delay`: a minute.
pub const MAX_DELAY_MS: u64 = 60_000;

/// One rate-limit rule.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitRule {
    /// Unique name, used in metrics, shared-data keys and responses.
    pub name: Name,
    /// The parts of the request that make the key, joined in order.
    pub key: Vec<KeyPart>,
    /// Requests admitted per window and key.
    pub limit: Positive,
    /// The window length.
    pub window: DurationMs,
    /// How many distinct keys the rule tracks exactly (default 16384); beyond that, keys share
    /// slots as documented in [`crate::ratelimit::table`].
    #[serde(default = "default_capacity")]
    pub capacity: Positive,
    /// What the rule does with a request that lacks a key part.
    #[serde(default)]
    pub missing_key: MissingKey,
    /// Whether the quota holds across the workers of this proxy or across the whole fleet.
    #[serde(default)]
    pub scope: Scope,
    /// When the rule applies (`match`; absent: to every request).
    #[serde(default, rename = "match")]
    pub condition: Option<Match>,
    /// Limits by tier, a request header naming the tier.
    #[serde(default)]
    pub tiers: Option<Tiers>,
    /// Keys with a limit of their own.
    #[serde(default)]
    pub overrides: Vec<Override>,
    /// What a request costs (absent: 1).
    #[serde(default)]
    pub cost: Option<Cost>,
    /// The shape of the rule's `429` bodies (absent: the top-level `refusal_format`).
    #[serde(default)]
    pub refusal_format: Option<RefusalFormat>,
    /// In global scope: how the fleet shares the quota (default `batched`).
    #[serde(default)]
    pub consistency: Consistency,
    /// `shadow`: the rule only counts the requests it would refuse.
    #[serde(default)]
    pub mode: Mode,
    /// How the rule counts: a sliding window (the default) or a token bucket whose sustained
    /// rate is `limit` per `window`.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// Token bucket: the bucket's size, the units a key may spend at once (required with
    /// `"algorithm": "token_bucket"`, refused otherwise).
    #[serde(default)]
    pub burst: Option<Positive>,
    /// Token bucket: a request over the rate whose turn comes within this waits for its turn
    /// instead of being refused (absent: refused at once).
    #[serde(default)]
    pub max_delay: Option<DurationMs>,
}

impl RateLimitRule {
    /// Every limit the rule may apply: `limit`, its tiers' and its overrides'.
    pub fn limits(&self) -> impl Iterator<Item = std::num::NonZeroU32> + '_ {
        std::iter::once(self.limit.get())
            .chain(self.tiers.iter().flat_map(|t| t.limits.values().map(|l| l.get())))
            .chain(self.overrides.iter().map(|o| o.limit.get()))
    }
}

/// How a rule counts ([`crate::ratelimit::window`], [`crate::ratelimit::bucket`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// `limit` units per sliding `window` (the default).
    #[default]
    SlidingWindow,
    /// A token bucket of `burst` units refilled at `limit` per `window` (GCRA).
    TokenBucket,
}

/// How the proxies of a fleet share a rule's quota in global scope (`docs/global.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// Each proxy decides on its own counts plus the fleet's as last synced, and sends its
    /// admissions in batches: no request waits, the fleet may overshoot a little.
    #[default]
    Batched,
    /// Each proxy takes units from the store ahead of use, shared by its workers
    /// ([`crate::fleet::leased`]): never over the limit; a request waits on the store when its
    /// key's lease is empty.
    Leased,
}

/// Where a rule's quota holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Across the workers of one proxy (the default).
    #[default]
    Proxy,
    /// Across every proxy of the fleet, through the store named in the `global` section.
    Global,
}

pub(super) fn default_capacity() -> Positive {
    Positive::new(DEFAULT_CAPACITY).unwrap_or(Positive::ONE)
}

/// What a rule does when a request lacks one of its key parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    /// The rule does not apply to the request (the default).
    #[default]
    Skip,
    /// All requests lacking any part share one counter per rule, whatever the present parts hold.
    Shared,
}

/// The shape of a rate limit's `429` body: the problem document, or the error object of the
/// API the rule guards, so that the API's own clients show it (the headers are the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalFormat {
    /// RFC 9457 problem details (`application/problem+json`), the default.
    #[default]
    Problem,
    /// OpenAI's error object: `{"error": {"message", "type", "param", "code": "rate_limit_exceeded"}}`.
    Openai,
    /// Anthropic's: `{"type": "error", "error": {"type": "rate_limit_error", "message"}}`.
    Anthropic,
}

/// When admitted responses carry the `ratelimit` / `ratelimit-policy` fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitHeaders {
    /// On every response a rule applied to: the rule with the least remaining quota (default).
    #[default]
    Always,
    /// Only on `429` responses.
    OnReject,
}

/// One part of a rate-limit key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPart {
    /// A request header (name stored lower-case); its raw bytes.
    Header(String),
    /// The downstream peer address without its port.
    SourceIp,
    /// The request path without its query.
    Path,
    /// The request method.
    Method,
    /// The `:authority` (host) header.
    Authority,
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::Header(name) => write!(f, "header:{name}"),
            KeyPart::SourceIp => f.write_str("source_ip"),
            KeyPart::Path => f.write_str("path"),
            KeyPart::Method => f.write_str("method"),
            KeyPart::Authority => f.write_str("authority"),
        }
    }
}

impl<'de> Deserialize<'de> for KeyPart {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyPartVisitor;
        impl<'de> Visitor<'de> for KeyPartVisitor {
            type Value = KeyPart;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "\"source_ip\", \"path\", \"method\", \"authority\" or {\"header\": NAME}",
                )
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<KeyPart, E> {
                match text {
                    "source_ip" => Ok(KeyPart::SourceIp),
                    "path" => Ok(KeyPart::Path),
                    "method" => Ok(KeyPart::Method),
                    "authority" => Ok(KeyPart::Authority),
                    other => Err(E::custom(format!(
                        "unknown key part {other:?} (expected \"source_ip\", \"path\", \"method\", \"authority\" or {{\"header\": NAME}})"
                    ))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KeyPart, A::Error> {
                let mut header: Option<String> = None;
                while let Some(field) = map.next_key::<String>()? {
                    if field != "header" {
                        return Err(de::Error::custom(format!(
                            "unknown field {field:?} in a key part (expected {{\"header\": NAME}})"
                        )));
                    }
                    if header.is_some() {
                        return Err(de::Error::custom("duplicate field \"header\""));
                    }
                    header = Some(map.next_value()?);
                }
                let name = header.ok_or_else(|| de::Error::custom("missing field \"header\""))?;
                header_name(&name).map(KeyPart::Header).map_err(de::Error::custom)
            }
        }
        deserializer.deserialize_any(KeyPartVisitor)
    }
}

impl Config {
    /// A token bucket's fields, only with the token bucket, and only in proxy scope.
    pub(super) fn validate_algorithm(&self, rule: &RateLimitRule, at: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
        let error = |field: &str, problem: &str| Err(ConfigError { path: at(field), problem: problem.into() });
        match rule.algorithm {
            Algorithm::SlidingWindow => {
                if rule.burst.is_some() {
                    return error("burst", "needs \"algorithm\": \"token_bucket\" (a sliding window has no burst: its limit is the most a key may send in one window)");
                }
                if rule.max_delay.is_some() {
                    return error("max_delay", "needs \"algorithm\": \"token_bucket\" (a request waits for its turn in a bucket; a sliding window has no turns)");
                }
            }
            Algorithm::TokenBucket => {
                let Some(burst) = rule.burst else {
                    return error("burst", "is required with \"algorithm\": \"token_bucket\" (the units a key may spend at once, at least 1)");
                };
                if burst.get().get() > MAX_BURST {
                    return error("burst", &format!("must be at most {MAX_BURST}, got {}", burst.get()));
                }
                if rule.max_delay.is_some_and(|d| d.get().get() > MAX_DELAY_MS) {
                    return error("max_delay", &format!("must be at most {}s (a request waits in the proxy, holding its connection)", MAX_DELAY_MS / 1000));
                }
                if rule.scope == Scope::Global {
                    return error("scope", "a token bucket holds in proxy scope only: its state is one instant per key, which neither the batched sync (counts added across proxies) nor leases (units taken ahead) can share");
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::super::tests::error_of;
    use super::*;

    #[test]
    fn token_bucket_fields_are_checked_and_named() {
        let rule = |extra: &str| format!(r#"{{"rate_limits":[{{"name":"b","key":["path"],"limit":10,"window":"1s"{extra}}}]}}"#);
        let ok = Config::parse(rule(r#","algorithm":"token_bucket","burst":5,"max_delay":"3s""#).as_bytes()).unwrap();
        let parsed = &ok.rate_limits[0];
        assert_eq!((parsed.algorithm, parsed.burst.map(|b| b.get().get()), parsed.max_delay.map(|d| d.get().get())), (Algorithm::TokenBucket, Some(5), Some(3000)));
        assert!(ok.summary().contains("b = 10 per 1s (token bucket of 5, waits up to 3s)"), "{}", ok.summary());
        assert!(error_of(&rule(r#","algorithm":"token_bucket","burst":0"#)).starts_with("rate_limits[0].burst: "));
        assert!(error_of(&rule(r#","algorithm":"token_bucket""#)).starts_with("rate_limits[0].burst: is required"));
        assert!(error_of(&rule(r#","burst":5"#)).starts_with("rate_limits[0].burst: needs \"algorithm\": \"token_bucket\""));
        assert!(error_of(&rule(r#","max_delay":"1s""#)).starts_with("rate_limits[0].max_delay: needs \"algorithm\": \"token_bucket\""));
        assert!(error_of(&rule(r#","algorithm":"token_bucket","burst":5,"max_delay":"0s""#)).starts_with("rate_limits[0].max_delay: "));
        assert!(error_of(&rule(r#","algorithm":"token_bucket","burst":5,"max_delay":"2m""#)).starts_with("rate_limits[0].max_delay: must be at most 60s"));
        assert!(error_of(&rule(r#","algorithm":"leaky""#)).starts_with("rate_limits[0].algorithm: unknown variant `leaky`"));
        let global = r#"{"global":{"cluster":"sync"},"rate_limits":[{"name":"b","key":["path"],"limit":10,"window":"1s","algorithm":"token_bucket","burst":5,"scope":"global"}]}"#;
        assert!(error_of(global).starts_with("rate_limits[0].scope: a token bucket holds in proxy scope only"), "{}", error_of(global));
    }
}
