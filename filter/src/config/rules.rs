//! What a rate-limit rule may say beyond its key, limit and window: when it applies
//! (`match`), a limit that varies by key (`tiers`, `overrides`) and what a request costs
//! (`cost`). Parsed here, checked in [`validate_rule`]; compiled for the request path by
//! [`crate::ratelimit::rules`].

use super::values::Positive;
use super::{header_name, ConfigError, RateLimitRule};
use serde::Deserialize;
use std::collections::BTreeMap;

/// The longest header value, path or authority a condition, a tier or an override may name.
pub const MAX_VALUE_LEN: usize = 1024;
/// Tiers, overrides or header conditions one rule may list.
pub const MAX_ENTRIES: usize = 1024;

/// `match`: the conditions under which a rule applies to a request; every condition given must
/// hold. A rule without `match` applies to every request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// The request path (without its query).
    #[serde(default)]
    pub path: Option<PathMatch>,
    /// The request method is one of these (exact, case-sensitive: `"POST"`).
    #[serde(default)]
    pub methods: Option<Vec<String>>,
    /// Request headers: each condition must hold.
    #[serde(default)]
    pub headers: Vec<HeaderCondition>,
    /// The `:authority` without its port, compared case-insensitively.
    #[serde(default)]
    pub authority: Option<String>,
    /// The name of the Envoy route the request matched is one of these (the route's `name`
    /// in the route configuration; in Istio, the `VirtualService` route's `name`).
    #[serde(default)]
    pub routes: Option<Vec<String>>,
}

/// How the path is compared: exactly one of the three.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathMatch {
    /// The whole path, exactly.
    #[serde(default)]
    pub exact: Option<String>,
    /// The path starts with this.
    #[serde(default)]
    pub prefix: Option<String>,
    /// Segment by segment: `*` matches any one non-empty segment, other segments exactly
    /// (`/users/*/orders`).
    #[serde(default)]
    pub template: Option<String>,
}

/// A condition on one request header: exactly one of `present` and `equals`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderCondition {
    /// The header (any case; stored lower-case).
    pub name: String,
    /// `true`: the header is there (any value); `false`: it is not.
    #[serde(default)]
    pub present: Option<bool>,
    /// The header's (first) value is exactly this.
    #[serde(default)]
    pub equals: Option<String>,
}

/// `tiers`: a request header names the key's tier, and a tier its own limit. A request whose
/// header is absent or names no listed tier gets the rule's `limit`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tiers {
    /// The header naming the tier (e.g. `x-plan`).
    pub header: String,
    /// Tier name (the header's exact value) → limit per window.
    pub limits: BTreeMap<String, Positive>,
}

/// One entry of `overrides`: a key of its own limit (before any tier).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Override {
    /// The key's part values, one per part of the rule's `key`, in order, as the rule reads
    /// them (a header's value; `source_ip` without port; `path` without query).
    pub key: Vec<String>,
    /// Its limit per window.
    pub limit: Positive,
}

/// `cost`: what a request costs against the rule (default: 1).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cost {
    /// Where the cost comes from.
    pub from: CostSource,
    /// The header, for `request_header` and `response_header`.
    #[serde(default)]
    pub header: Option<String>,
    /// The cost when the header is absent or not a valid count (`request_header`: 1,
    /// `response_header`, `response_body`: 0). Not with `estimate` (its `unreported` says).
    #[serde(default)]
    pub default: Option<u32>,
    /// For `response_body`: the count's path in the JSON body (or in each event of a
    /// server-sent-event stream), object keys joined by dots: `usage.total_tokens`.
    #[serde(default)]
    pub path: Option<String>,
    /// For `response_body`, instead of `path`: the count as a weighted sum of several counts
    /// (input tokens × 1 + output tokens × 4), each at its own places.
    #[serde(default)]
    pub sum: Option<Vec<Term>>,
    /// For `response_body`: the most bytes of a response read for its count (default 1 MiB);
    /// a body longer than that is settled as unreported.
    #[serde(default)]
    pub max_body_bytes: Option<Positive>,
    /// For a cost the upstream reports (`response_header`, `response_body`): the units reserved
    /// at admission (which needs room for them), settled when the count comes.
    #[serde(default)]
    pub estimate: Option<Estimate>,
    /// With `estimate`: how a response that reports no valid count is settled (default
    /// `reservation`).
    #[serde(default)]
    pub unreported: Option<Unreported>,
}

/// `cost.estimate`: what a request reserves at admission when its cost is reported later.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Estimate {
    /// A request header holding the estimate (an LLM request's `max_tokens`, say). A request
    /// that has it is estimated by it (its body is not read).
    #[serde(default)]
    pub header: Option<String>,
    /// Places of the estimate in the request's JSON body, each object keys joined by dots
    /// (`max_completion_tokens`, `max_tokens`): the first listed that the body holds gives it.
    /// The request is decided once it is read (the body waits meanwhile).
    #[serde(default)]
    pub body: Option<Vec<String>>,
    /// Instead of `body`: the estimate as a weighted sum of counts in the request's JSON body
    /// (`max_tokens` × 4), each the first of its places the body holds.
    #[serde(default)]
    pub sum: Option<Vec<Term>>,
    /// With `body` or `sum`: the most bytes of a request body read for the estimate (default 256 KiB).
    #[serde(default)]
    pub max_body_bytes: Option<Positive>,
    /// The estimate when the header and the body hold no valid count.
    pub default: Positive,
    /// The largest estimate: a request asking more reserves this.
    pub max: Positive,
}

/// One term of a weighted sum (`cost.sum`, `cost.estimate.sum`): a count, at the first of its
/// places that has one, times `weight`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Term {
    /// Where the count is: one path (`"usage.output_tokens"`) or several, the first listed that
    /// has a count giving it (`["usage.input_tokens", "message.usage.input_tokens"]`: the same
    /// count where a JSON answer and a stream put it).
    pub path: Places,
    /// What one unit of the count costs (default 1).
    #[serde(default = "one")]
    pub weight: Positive,
}

fn one() -> Positive {
    Positive::ONE
}

/// A term's places: a path, or a list of paths (each object keys joined by dots).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Places(pub Vec<String>);

impl<'de> Deserialize<'de> for Places {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PlacesVisitor;
        impl<'de> serde::de::Visitor<'de> for PlacesVisitor {
            type Value = Places;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a path (\"usage.output_tokens\") or a list of paths")
            }
            fn visit_str<E: serde::de::Error>(self, path: &str) -> Result<Places, E> {
                Ok(Places(vec![path.to_owned()]))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Places, A::Error> {
                let mut paths = Vec::new();
                while let Some(path) = seq.next_element::<String>()? {
                    if paths.len() >= MAX_TERM_PLACES {
                        return Err(serde::de::Error::custom(format!("must list 1 to {MAX_TERM_PLACES} paths")));
                    }
                    paths.push(path);
                }
                Ok(Places(paths))
            }
        }
        deserializer.deserialize_any(PlacesVisitor)
    }
}

/// How a response without a valid count settles its reservation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unreported {
    /// The reservation stays charged (an error, a reset or a cut stream costs its estimate).
    #[default]
    Reservation,
    /// The reservation is given back (the response costs nothing).
    Refund,
}

/// The bytes of a response body read for its count by default (`cost.max_body_bytes`).
pub const DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;
/// The bytes of a request body read for its estimate by default (`cost.estimate.max_body_bytes`).
pub const DEFAULT_ESTIMATE_BODY_BYTES: u64 = 256 << 10;
/// The most places `cost.estimate.body` may list.
pub const MAX_ESTIMATE_PATHS: usize = 4;
/// The most terms a `sum` may have.
pub const MAX_SUM_TERMS: usize = 4;
/// The most places one term of a `sum` may list.
pub const MAX_TERM_PLACES: usize = 4;
/// The most places all the terms of a `sum` may list together (each is one more comparison
/// per key of the body).
pub const MAX_SUM_PLACES: usize = 8;
/// The largest weight of a term.
pub const MAX_WEIGHT: u32 = 1000;
/// The most segments a `cost.path` may have.
pub const MAX_PATH_SEGMENTS: usize = 8;
/// The longest segment of a `cost.path`.
pub const MAX_SEGMENT_LEN: usize = 64;

/// Where a request's cost comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostSource {
    /// A count in a request header, charged at admission.
    RequestHeader,
    /// The request body's size in bytes: `content-length` at admission, or, without one, the
    /// bytes counted as the body streams, charged when it ends.
    RequestBody,
    /// A count the upstream reports in a response header, charged when the response arrives.
    ResponseHeader,
    /// A count the upstream reports in its response body (JSON, or a server-sent-event
    /// stream), charged when it has been read.
    ResponseBody,
}

impl Cost {
    /// The cost of a request whose cost header is absent or not a count.
    pub fn default_units(&self) -> u32 {
        self.default.unwrap_or(match self.from {
            CostSource::RequestHeader => 1,
            CostSource::RequestBody | CostSource::ResponseHeader | CostSource::ResponseBody => 0,
        })
    }
}

fn error(path: String, problem: impl Into<String>) -> ConfigError {
    ConfigError { path, problem: problem.into() }
}

fn bounded(at: &str, value: &str) -> Result<(), ConfigError> {
    if value.is_empty() || value.len() > MAX_VALUE_LEN || value.chars().any(char::is_control) {
        return Err(error(
            at.to_owned(),
            format!("must be 1 to {MAX_VALUE_LEN} characters without control characters"),
        ));
    }
    Ok(())
}

/// Lower-cases the header names of a rule's `match`, `tiers` and `cost`, and refuses what the
/// types alone cannot (one and only one way to compare, sizes, header names, one value per key
/// part). `at` is the rule's path, e.g. `rate_limits[2]`.
pub fn validate_rule(rule: &mut RateLimitRule, at: &str) -> Result<(), ConfigError> {
    if let Some(condition) = &mut rule.condition {
        validate_match(condition, &format!("{at}.match"))?;
    }
    if let Some(tiers) = &mut rule.tiers {
        let at = format!("{at}.tiers");
        tiers.header = header_name(&tiers.header).map_err(|p| error(format!("{at}.header"), p))?;
        if tiers.limits.is_empty() || tiers.limits.len() > MAX_ENTRIES {
            return Err(error(format!("{at}.limits"), format!("must name 1 to {MAX_ENTRIES} tiers")));
        }
        for name in tiers.limits.keys() {
            bounded(&format!("{at}.limits.{name}"), name)?;
        }
    }
    if rule.overrides.len() > MAX_ENTRIES {
        return Err(error(format!("{at}.overrides"), format!("must list at most {MAX_ENTRIES} keys")));
    }
    for (index, entry) in rule.overrides.iter().enumerate() {
        let here = format!("{at}.overrides[{index}].key");
        if entry.key.len() != rule.key.len() {
            return Err(error(
                here,
                format!("must give one value per key part ({} for this rule's key), got {}", rule.key.len(), entry.key.len()),
            ));
        }
        for (part, value) in entry.key.iter().enumerate() {
            bounded(&format!("{here}[{part}]"), value)?;
        }
        if let Some(first) = rule.overrides.iter().take(index).position(|o| o.key == entry.key) {
            return Err(error(here, format!("the same key as {at}.overrides[{first}].key")));
        }
    }
    if let Some(cost) = &mut rule.cost {
        let at = format!("{at}.cost");
        match (cost.from, cost.header.as_deref()) {
            (CostSource::RequestHeader | CostSource::ResponseHeader, Some(name)) => {
                cost.header = Some(header_name(name).map_err(|p| error(format!("{at}.header"), p))?);
            }
            (CostSource::RequestHeader | CostSource::ResponseHeader, None) => {
                return Err(error(format!("{at}.header"), "is required when the cost comes from a header"));
            }
            (CostSource::RequestBody, Some(_)) => {
                return Err(error(format!("{at}.header"), "has no meaning with \"from\": \"request_body\""));
            }
            (CostSource::RequestBody | CostSource::ResponseBody, None) => {}
            (CostSource::ResponseBody, Some(_)) => {
                return Err(error(format!("{at}.header"), "has no meaning with \"from\": \"response_body\" (it reads \"path\")"));
            }
        }
        if cost.from == CostSource::RequestBody && cost.default.is_some() {
            return Err(error(format!("{at}.default"), "has no meaning with \"from\": \"request_body\""));
        }
        validate_reported(cost, &at)?;
    }
    Ok(())
}

/// The fields of a cost the upstream reports: `path` and `max_body_bytes` for a body,
/// `estimate` and `unreported`.
fn validate_reported(cost: &mut Cost, at: &str) -> Result<(), ConfigError> {
    let body = cost.from == CostSource::ResponseBody;
    match (&cost.path, &cost.sum, body) {
        (None, None, true) => {
            return Err(error(format!("{at}.path"), "is required with \"from\": \"response_body\" (\"usage.total_tokens\"), or \"sum\""));
        }
        (Some(_), Some(_), _) => return Err(error(format!("{at}.sum"), "cannot be given with \"path\" (one says where the count is)")),
        (Some(_), None, false) => return Err(error(format!("{at}.path"), "has meaning only with \"from\": \"response_body\"")),
        (None, Some(_), false) => return Err(error(format!("{at}.sum"), "has meaning only with \"from\": \"response_body\"")),
        (Some(path), None, true) => json_path(path, &format!("{at}.path"))?,
        (None, Some(terms), true) => validate_sum(terms, &format!("{at}.sum"))?,
        (None, None, false) => {}
    }
    if cost.max_body_bytes.is_some() && !body {
        return Err(error(format!("{at}.max_body_bytes"), "has meaning only with \"from\": \"response_body\""));
    }
    let reported = matches!(cost.from, CostSource::ResponseHeader | CostSource::ResponseBody);
    match &mut cost.estimate {
        Some(_) if !reported => {
            return Err(error(format!("{at}.estimate"), "has meaning only for a cost the upstream reports (response_header, response_body)"));
        }
        Some(estimate) => {
            if let Some(name) = &estimate.header {
                estimate.header = Some(header_name(name).map_err(|p| error(format!("{at}.estimate.header"), p))?);
            }
            match (&estimate.body, &estimate.sum) {
                (Some(_), Some(_)) => {
                    return Err(error(format!("{at}.estimate.sum"), "cannot be given with estimate.body (one says where the estimate is)"));
                }
                (Some(paths), None) if paths.is_empty() || paths.len() > MAX_ESTIMATE_PATHS => {
                    return Err(error(format!("{at}.estimate.body"), format!("must list 1 to {MAX_ESTIMATE_PATHS} places (\"max_tokens\")")));
                }
                (Some(paths), None) => {
                    for (index, path) in paths.iter().enumerate() {
                        json_path(path, &format!("{at}.estimate.body[{index}]"))?;
                    }
                }
                (None, Some(terms)) => validate_sum(terms, &format!("{at}.estimate.sum"))?,
                (None, None) if estimate.max_body_bytes.is_some() => {
                    return Err(error(format!("{at}.estimate.max_body_bytes"), "has meaning only with estimate.body or estimate.sum"));
                }
                (None, None) => {}
            }
            if estimate.default.get() > estimate.max.get() {
                return Err(error(format!("{at}.estimate.default"), "must be at most estimate.max"));
            }
            if cost.default.is_some() {
                return Err(error(format!("{at}.default"), "has no meaning with \"estimate\" (\"unreported\" says what an unreported response costs)"));
            }
        }
        None if cost.unreported.is_some() => {
            return Err(error(format!("{at}.unreported"), "has meaning only with \"estimate\""));
        }
        None => {}
    }
    Ok(())
}

/// A weighted sum's terms, at `at`: 1 to [`MAX_SUM_TERMS`] of them, each 1 to
/// [`MAX_TERM_PLACES`] valid paths ([`MAX_SUM_PLACES`] in all), each weight at most
/// [`MAX_WEIGHT`].
fn validate_sum(terms: &[Term], at: &str) -> Result<(), ConfigError> {
    if terms.is_empty() || terms.len() > MAX_SUM_TERMS {
        return Err(error(at.to_owned(), format!("must list 1 to {MAX_SUM_TERMS} terms ({{\"path\": \"usage.output_tokens\", \"weight\": 4}})")));
    }
    let places: usize = terms.iter().map(|t| t.path.0.len()).sum();
    if places > MAX_SUM_PLACES {
        return Err(error(at.to_owned(), format!("lists {places} paths in all; at most {MAX_SUM_PLACES}")));
    }
    for (index, term) in terms.iter().enumerate() {
        let here = format!("{at}[{index}]");
        if term.path.0.is_empty() {
            return Err(error(format!("{here}.path"), format!("must list 1 to {MAX_TERM_PLACES} paths")));
        }
        for (place, path) in term.path.0.iter().enumerate() {
            let there = if term.path.0.len() == 1 { format!("{here}.path") } else { format!("{here}.path[{place}]") };
            json_path(path, &there)?;
        }
        if term.weight.get().get() > MAX_WEIGHT {
            return Err(error(format!("{here}.weight"), format!("must be 1 to {MAX_WEIGHT}, got {}", term.weight.get())));
        }
    }
    Ok(())
}

/// A JSON path of object keys joined by dots (`usage.total_tokens`), at `at`.
fn json_path(path: &str, at: &str) -> Result<(), ConfigError> {
    let segments: Vec<&str> = path.split('.').collect();
    let fine = |s: &&str| !s.is_empty() && s.len() <= MAX_SEGMENT_LEN && !s.contains(['"', '\\']) && !s.chars().any(char::is_control);
    if segments.len() > MAX_PATH_SEGMENTS || !segments.iter().all(fine) {
        return Err(error(
            at.to_owned(),
            format!("{path:?} must be 1 to {MAX_PATH_SEGMENTS} object keys joined by '.', each 1 to {MAX_SEGMENT_LEN} characters without quotes"),
        ));
    }
    Ok(())
}

fn validate_match(condition: &mut Match, at: &str) -> Result<(), ConfigError> {
    if let Some(path) = &condition.path {
        let at = format!("{at}.path");
        let given = [("exact", &path.exact), ("prefix", &path.prefix), ("template", &path.template)];
        let set: Vec<(&str, &String)> = given.iter().filter_map(|(n, v)| v.as_ref().map(|v| (*n, v))).collect();
        let [(kind, value)] = set.as_slice() else {
            return Err(error(at, "must give exactly one of \"exact\", \"prefix\" and \"template\""));
        };
        let here = format!("{at}.{kind}");
        bounded(&here, value)?;
        if !value.starts_with('/') || value.contains(['?', '#']) {
            return Err(error(here, format!("{value:?} must be a path starting with '/', without query")));
        }
        if *kind == "template" && value.split('/').any(|s| s.contains('*') && s != "*") {
            return Err(error(here, "a '*' must be a whole segment (\"/users/*/orders\")"));
        }
    }
    if let Some(methods) = &condition.methods {
        let here = format!("{at}.methods");
        if methods.is_empty() || methods.len() > 32 {
            return Err(error(here, "must list 1 to 32 methods"));
        }
        for (index, method) in methods.iter().enumerate() {
            if method.is_empty() || !method.chars().all(|c| c.is_ascii_uppercase() || c == '-' || c == '_') {
                return Err(error(format!("{here}[{index}]"), format!("{method:?} is not a method (upper case: \"POST\")")));
            }
        }
    }
    if condition.headers.len() > MAX_ENTRIES {
        return Err(error(format!("{at}.headers"), format!("must list at most {MAX_ENTRIES} conditions")));
    }
    for (index, header) in condition.headers.iter_mut().enumerate() {
        let here = format!("{at}.headers[{index}]");
        header.name = header_name(&header.name).map_err(|p| error(format!("{here}.name"), p))?;
        match (&header.present, &header.equals) {
            (Some(_), None) => {}
            (None, Some(value)) => bounded(&format!("{here}.equals"), value)?,
            _ => return Err(error(here, "must give exactly one of \"present\" and \"equals\"")),
        }
    }
    if let Some(authority) = &mut condition.authority {
        let here = format!("{at}.authority");
        bounded(&here, authority)?;
        if authority.contains(['/', ' ', ':']) {
            return Err(error(here, format!("{authority:?} must be a host name without port")));
        }
        *authority = authority.to_ascii_lowercase();
    }
    if let Some(routes) = &condition.routes {
        let here = format!("{at}.routes");
        if routes.is_empty() || routes.len() > MAX_ENTRIES {
            return Err(error(here, format!("must list 1 to {MAX_ENTRIES} route names")));
        }
        for (index, route) in routes.iter().enumerate() {
            let here = format!("{here}[{index}]");
            bounded(&here, route)?;
            if route.is_empty() {
                return Err(error(here, "must be a route's name, not empty"));
            }
        }
    }
    if condition.path.is_none()
        && condition.methods.is_none()
        && condition.headers.is_empty()
        && condition.authority.is_none()
        && condition.routes.is_none()
    {
        return Err(error(at.to_owned(), "must give at least one condition (path, methods, headers, authority, routes)"));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use crate::config::Config;

    fn error_of(rule_extra: &str) -> String {
        let json = format!(r#"{{"rate_limits":[{{"name":"r","key":[{{"header":"x-k"}}],"limit":5,"window":"1m"{rule_extra}}}]}}"#);
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn rule_extras_parse_and_lower_case_their_header_names() {
        let config = Config::parse(
            br#"{"rate_limits":[{"name":"r","key":[{"header":"x-k"}],"limit":5,"window":"1m",
                "match":{"path":{"template":"/a/*/b"},"methods":["POST"],"headers":[{"name":"X-Env","equals":"prod"}],"authority":"API.example.com"},
                "tiers":{"header":"X-Plan","limits":{"gold":50}},
                "overrides":[{"key":["vip"],"limit":500}],
                "cost":{"from":"request_header","header":"X-Cost"}}]}"#,
        )
        .unwrap();
        let rule = &config.rate_limits[0];
        let condition = rule.condition.as_ref().unwrap();
        assert_eq!(condition.headers[0].name, "x-env");
        assert_eq!(condition.authority.as_deref(), Some("api.example.com"));
        assert_eq!(rule.tiers.as_ref().unwrap().header, "x-plan");
        assert_eq!(rule.cost.as_ref().unwrap().header.as_deref(), Some("x-cost"));
        assert_eq!(rule.cost.as_ref().unwrap().default_units(), 1);
    }

    #[test]
    fn a_weighted_sum_parses_with_one_path_or_several_per_term() {
        let config = Config::parse(
            br#"{"refusal_format":"anthropic","rate_limits":[{"name":"r","key":[{"header":"x-k"}],"limit":5,"window":"1m","refusal_format":"openai",
                "cost":{"from":"response_body","sum":[{"path":["usage.input_tokens","message.usage.input_tokens"]},{"path":"usage.output_tokens","weight":4}],
                        "estimate":{"sum":[{"path":["max_tokens"],"weight":4}],"max_body_bytes":1000,"default":1,"max":2}}}]}"#,
        )
        .unwrap();
        let rule = &config.rate_limits[0];
        let cost = rule.cost.as_ref().unwrap();
        let sum = cost.sum.as_ref().unwrap();
        assert_eq!(sum[0].path.0, ["usage.input_tokens", "message.usage.input_tokens"]);
        assert_eq!((sum[0].weight.get().get(), sum[1].weight.get().get()), (1, 4));
        assert_eq!(sum[1].path.0, ["usage.output_tokens"]);
        assert_eq!(cost.estimate.as_ref().unwrap().sum.as_ref().unwrap()[0].weight.get().get(), 4);
        assert_eq!((config.refusal_format, rule.refusal_format), (crate::config::RefusalFormat::Anthropic, Some(crate::config::RefusalFormat::Openai)));
    }

    #[test]
    fn rule_extra_errors_are_named() {
        for (extra, expected) in [
            (r#","match":{}"#, "rate_limits[0].match: must give at least one condition"),
            (r#","match":{"path":{}}"#, "rate_limits[0].match.path: must give exactly one of"),
            (r#","match":{"path":{"exact":"/a","prefix":"/b"}}"#, "rate_limits[0].match.path: must give exactly one of"),
            (r#","match":{"path":{"prefix":"a"}}"#, "rate_limits[0].match.path.prefix: \"a\" must be a path"),
            (r#","match":{"path":{"template":"/a/b*"}}"#, "rate_limits[0].match.path.template: a '*' must be a whole segment"),
            (r#","match":{"path":{"regex":".*"}}"#, "rate_limits[0].match.path.regex: unknown field"),
            (r#","match":{"methods":[]}"#, "rate_limits[0].match.methods: must list 1 to 32 methods"),
            (r#","match":{"methods":["post"]}"#, "rate_limits[0].match.methods[0]: \"post\" is not a method"),
            (r#","match":{"headers":[{"name":"x"}]}"#, "rate_limits[0].match.headers[0]: must give exactly one of \"present\" and \"equals\""),
            (r#","match":{"headers":[{"name":"x y","present":true}]}"#, "rate_limits[0].match.headers[0].name: \"x y\" is not a valid header name"),
            (r#","match":{"authority":"a.com:80"}"#, "rate_limits[0].match.authority: \"a.com:80\" must be a host name without port"),
            (r#","tiers":{"header":"x-plan","limits":{}}"#, "rate_limits[0].tiers.limits: must name 1 to 1024 tiers"),
            (r#","tiers":{"header":"x-plan","limits":{"gold":0}}"#, "rate_limits[0].tiers.limits.gold: must be a positive integer"),
            (r#","overrides":[{"key":["a","b"],"limit":5}]"#, "rate_limits[0].overrides[0].key: must give one value per key part (1 for this rule's key), got 2"),
            (r#","overrides":[{"key":["a"],"limit":5},{"key":["a"],"limit":6}]"#, "rate_limits[0].overrides[1].key: the same key as rate_limits[0].overrides[0].key"),
            (r#","cost":{"from":"request_header"}"#, "rate_limits[0].cost.header: is required when the cost comes from a header"),
            (r#","cost":{"from":"request_body","header":"x"}"#, "rate_limits[0].cost.header: has no meaning"),
            (r#","cost":{"from":"request_body","default":3}"#, "rate_limits[0].cost.default: has no meaning"),
            (r#","cost":{"from":"response_header","header":"x","default":-1}"#, "rate_limits[0].cost.default: invalid value"),
            (r#","cost":{"from":"bytes"}"#, "rate_limits[0].cost.from: unknown variant `bytes`"),
            (r#","cost":{"from":"response_body","path":"u.t","estimate":{"body":[],"default":1,"max":2}}"#, "rate_limits[0].cost.estimate.body: must list 1 to 4 places"),
            (r#","cost":{"from":"response_body","path":"u.t","estimate":{"body":["max_tokens",""],"default":1,"max":2}}"#, "rate_limits[0].cost.estimate.body[1]: \"\" must be 1 to 8 object keys"),
            (r#","cost":{"from":"response_body","path":"u.t","estimate":{"body":["a..b"],"default":1,"max":2}}"#, "rate_limits[0].cost.estimate.body[0]: \"a..b\" must be"),
            (r#","cost":{"from":"response_body","path":"u.t","estimate":{"body":"max_tokens","default":1,"max":2}}"#, "rate_limits[0].cost.estimate.body: invalid type"),
            (r#","cost":{"from":"response_body","path":"u.t","estimate":{"max_body_bytes":10,"default":1,"max":2}}"#, "rate_limits[0].cost.estimate.max_body_bytes: has meaning only with estimate.body"),
            (r#","cost":{"from":"response_header","header":"x","estimate":{"body":["max_tokens"],"max_body_bytes":0,"default":1,"max":2}}"#, "rate_limits[0].cost.estimate.max_body_bytes: must be a positive integer"),
            (r#","cost":{"from":"request_header","header":"x","estimate":{"body":["max_tokens"],"default":1,"max":2}}"#, "rate_limits[0].cost.estimate: has meaning only for a cost the upstream reports"),
            (r#","cost":{"from":"response_body"}"#, "rate_limits[0].cost.path: is required with \"from\": \"response_body\" (\"usage.total_tokens\"), or \"sum\""),
            (r#","cost":{"from":"response_body","path":"u.t","sum":[{"path":"u.o"}]}"#, "rate_limits[0].cost.sum: cannot be given with \"path\""),
            (r#","cost":{"from":"response_header","header":"x","sum":[{"path":"u.o"}]}"#, "rate_limits[0].cost.sum: has meaning only with \"from\": \"response_body\""),
            (r#","cost":{"from":"response_body","sum":[]}"#, "rate_limits[0].cost.sum: must list 1 to 4 terms"),
            (r#","cost":{"from":"response_body","sum":[{"path":"a"},{"path":"b"},{"path":"c"},{"path":"d"},{"path":"e"}]}"#, "rate_limits[0].cost.sum: must list 1 to 4 terms"),
            (r#","cost":{"from":"response_body","sum":[{"path":["a","b","c","d"]},{"path":["e","f","g","h"]},{"path":"i"}]}"#, "rate_limits[0].cost.sum: lists 9 paths in all; at most 8"),
            (r#","cost":{"from":"response_body","sum":[{"path":["a","b","c","d","e"]}]}"#, "rate_limits[0].cost.sum[0].path: must list 1 to 4 paths"),
            (r#","cost":{"from":"response_body","sum":[{"path":[]}]}"#, "rate_limits[0].cost.sum[0].path: must list 1 to 4 paths"),
            (r#","cost":{"from":"response_body","sum":[{"path":"a"},{"path":["b","c..d"]}]}"#, "rate_limits[0].cost.sum[1].path[1]: \"c..d\" must be 1 to 8 object keys"),
            (r#","cost":{"from":"response_body","sum":[{"path":"a.b","weight":0}]}"#, "rate_limits[0].cost.sum[0].weight: must be a positive integer"),
            (r#","cost":{"from":"response_body","sum":[{"path":"a.b","weight":1001}]}"#, "rate_limits[0].cost.sum[0].weight: must be 1 to 1000, got 1001"),
            (r#","cost":{"from":"response_body","sum":[{"path":"a.b","weight":1.5}]}"#, "rate_limits[0].cost.sum[0].weight: must be a positive integer, got 1.5"),
            (r#","cost":{"from":"response_body","sum":[{"path":7}]}"#, "rate_limits[0].cost.sum[0].path: invalid type: integer `7`, expected a path"),
            (r#","cost":{"from":"response_body","sum":[{"path":"a","price":2}]}"#, "rate_limits[0].cost.sum[0].price: unknown field"),
            (r#","cost":{"from":"response_body","path":"u.t","estimate":{"body":["m"],"sum":[{"path":"m"}],"default":1,"max":2}}"#, "rate_limits[0].cost.estimate.sum: cannot be given with estimate.body"),
            (r#","cost":{"from":"response_body","path":"u.t","estimate":{"sum":[{"path":"max_tokens","weight":2000}],"default":1,"max":2}}"#, "rate_limits[0].cost.estimate.sum[0].weight: must be 1 to 1000"),
            (r#","refusal_format":"xml""#, "rate_limits[0].refusal_format: unknown variant `xml`"),
        ] {
            let err = error_of(extra);
            assert!(err.starts_with(expected), "{extra}\n  got: {err}\n want: {expected}");
        }
    }
}

