//! The filter's JSON configuration, parsed once (in `on_configure`) into typed, validated values
//! that every stream then shares by reference.
//!
//! Every problem is reported as one [`ConfigError`] naming the field path and what is wrong,
//! e.g. `rate_limits[0].window: "ten seconds" is not a duration ...`. Unknown fields, wrong
//! types, zero or negative numbers, bad durations, empty key lists and duplicate rule names are
//! all refused: nothing half-configured ever serves traffic.
//!
//! What each field does: docs/configuration.md; why: docs/design.md.

mod bulkhead;
mod endpoints;
mod flows;
mod global;
mod grpc;
mod leveling;
mod rate_limits;
mod rules;
mod selection;
mod shedding;
mod values;

pub use global::{Global, OnStoreFailure, StoreRoute, MAX_GLOBAL_KEYS, MAX_LEASE_TIMEOUT_MS, MAX_SYNC_INTERVAL_MS, MIN_SYNC_INTERVAL_MS, SYNC_PATH};
pub use grpc::{default_failure_grpc_statuses, Grpc, GrpcStatus};
pub use flows::{Flow, MAX_FLOW_QUEUED, MAX_FLOW_QUEUES};
pub use leveling::{ClassLimits, ClassQueue, Queue, QueueOrder, MAX_QUEUED, MAX_QUEUE_WAIT_MS};
pub use selection::{
    ClusterName, ClusterSelection, ConcurrencyLimit, FloorOn, LimitAlgorithm, StatusMatch, DEFAULT_ROUTE_HEADER,
    MAX_BUCKETS, MAX_CLUSTERS,
};
pub use bulkhead::{Partition, PerKey, WhenUnavailable, DEFAULT_SPILL_BELOW, MAX_PER_KEY_CAPACITY};
pub use rules::{
    Cost, CostSource, Estimate, HeaderCondition, Match, Override, PathMatch, Places, Term, Tiers, Unreported, DEFAULT_ESTIMATE_BODY_BYTES,
    DEFAULT_MAX_BODY_BYTES, MAX_SUM_PLACES, MAX_SUM_TERMS, MAX_TERM_PLACES, MAX_WEIGHT,
};
pub use values::{DurationMs, Fraction, Name, Positive, MAX_DURATION_MS};
pub use endpoints::{Dependencies, Health, Watchdog, MAX_RECOVER_AFTER, MIN_WATCHDOG_LAG_MS, MIN_WORKER_SILENCE_MS};
pub use rate_limits::{
    Algorithm, Consistency, KeyPart, MissingKey, RateLimitHeaders, RateLimitRule, RefusalFormat, Scope, DEFAULT_CAPACITY, MAX_BURST,
    MAX_CAPACITY, MAX_DELAY_MS,
};
pub use shedding::{LoadShedding, PriorityClass, DEFAULT_PRIORITY_HEADER, MAX_LAG_PROBE_MS, MIN_LAG_PROBE_MS};

use endpoints::check_path;
use serde::Deserialize;
use std::fmt;

/// The metric name prefix when `stat_prefix` is not given.
pub const DEFAULT_STAT_PREFIX: &str = "floodgate";

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Rate-limit rules; every rule that applies to a request must admit it.
    #[serde(default)]
    pub rate_limits: Vec<RateLimitRule>,
    /// Prefix of every metric name (default `floodgate`).
    #[serde(default = "default_stat_prefix")]
    pub stat_prefix: Name,
    /// When responses carry the `ratelimit` / `ratelimit-policy` fields.
    #[serde(default)]
    pub ratelimit_headers: RateLimitHeaders,
    /// The shape of the rules' `429` bodies, unless a rule says otherwise.
    #[serde(default)]
    pub refusal_format: RefusalFormat,
    /// The proxy-wide in-flight limit and its priority classes.
    #[serde(default)]
    pub load_shedding: Option<LoadShedding>,
    /// Chooses the upstream cluster of each request.
    #[serde(default)]
    pub cluster_selection: Option<ClusterSelection>,
    /// The health endpoint.
    #[serde(default)]
    pub health: Option<Health>,
    /// The liveness endpoint: fails when the proxy is degraded in ways a restart cures.
    #[serde(default)]
    pub watchdog: Option<Watchdog>,
    /// How rules with `"scope": "global"` reach the fleet-wide store.
    #[serde(default)]
    pub global: Option<Global>,
    /// The gRPC status codes of refusals of gRPC requests.
    #[serde(default)]
    pub grpc: Grpc,
    /// `shadow`: every mechanism of the filter only counts what it would refuse (each
    /// mechanism's own `mode` can also say so).
    #[serde(default)]
    pub mode: Mode,
    /// Write each request's decision into Envoy filter state (`wasm.<plugin name>.outcome`, ...), where
    /// access logs read it.
    #[serde(default)]
    pub access_log: bool,
}

/// Whether a mechanism refuses what it would refuse, or only counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// It refuses (the default).
    #[default]
    Enforce,
    /// It lets the request go on, consumes nothing for it, and counts it as a would-be
    /// refusal.
    Shadow,
}

impl Config {
    /// Whether a mechanism whose own mode is `mode` is in shadow under this configuration (its
    /// own mode, or the top-level one).
    pub fn shadows(&self, mode: Mode) -> bool {
        self.mode == Mode::Shadow || mode == Mode::Shadow
    }
}

fn default_stat_prefix() -> Name {
    Name::trusted(DEFAULT_STAT_PREFIX)
}

/// Checks an HTTP header name (RFC 9110 token) and lower-cases it, as Envoy stores them.
pub(crate) fn header_name(name: &str) -> Result<String, String> {
    let token_char = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    let pseudo = name.strip_prefix(':').unwrap_or(name);
    if pseudo.is_empty() || !pseudo.chars().all(token_char) {
        return Err(format!("{name:?} is not a valid header name"));
    }
    Ok(name.to_ascii_lowercase())
}

/// A configuration problem: the field path and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where, e.g. `rate_limits[0].window` (empty for the document itself).
    pub path: String,
    /// What is wrong.
    pub problem: String,
}

impl fmt::Display for ConfigError {
    /// One line whatever the input held: control characters (in echoed field names, say) are
    /// written escaped, so a configuration cannot forge log lines.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.path.is_empty() {
            write_escaped(f, &self.path)?;
            f.write_str(": ")?;
        }
        write_escaped(f, &self.problem)
    }
}

fn write_escaped(f: &mut fmt::Formatter<'_>, text: &str) -> fmt::Result {
    for c in text.chars() {
        if c.is_control() {
            write!(f, "{}", c.escape_default())?;
        } else {
            fmt::Write::write_char(f, c)?;
        }
    }
    Ok(())
}

impl std::error::Error for ConfigError {}

impl Config {
    /// The field of the first rule whose cost is in the response body (`rate_limits[0].cost.from`),
    /// if any: only the module that reads response bodies can serve it.
    pub fn response_body_cost(&self) -> Option<String> {
        self.rate_limits
            .iter()
            .position(|r| r.cost.as_ref().is_some_and(|c| c.from == CostSource::ResponseBody))
            .map(|index| format!("rate_limits[{index}].cost.from"))
    }

    /// Parses and validates a configuration. Empty input (Envoy passes none when the
    /// `configuration` field is absent) is the same as `{}`.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|err| ConfigError {
            path: String::new(),
            problem: format!("the configuration is not UTF-8 ({err})"),
        })?;
        let text = if text.trim().is_empty() { "{}" } else { text };
        let document: serde_json::Value = serde_json::from_str(text).map_err(|err| ConfigError {
            path: String::new(),
            problem: without_position(&err.to_string()),
        })?;
        require_objects(&document)?;
        let config: Config = serde_path_to_error::deserialize(document).map_err(|err| {
            let path = err.path().to_string();
            ConfigError {
                path: if path == "." { String::new() } else { path },
                problem: without_position(&err.inner().to_string()),
            }
        })?;
        let mut config = config;
        for (index, rule) in config.rate_limits.iter_mut().enumerate() {
            rules::validate_rule(rule, &format!("rate_limits[{index}]"))?;
        }
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for (index, rule) in self.rate_limits.iter().enumerate() {
            let at = |field: &str| format!("rate_limits[{index}].{field}");
            if rule.key.is_empty() {
                return Err(ConfigError {
                    path: at("key"),
                    problem: "must list at least one key part".into(),
                });
            }
            if rule.capacity.get().get() > MAX_CAPACITY {
                return Err(ConfigError {
                    path: at("capacity"),
                    problem: format!("must be at most {MAX_CAPACITY}, got {}", rule.capacity.get()),
                });
            }
            if rule.scope == Scope::Global && self.global.is_none() {
                return Err(ConfigError {
                    path: at("scope"),
                    problem: "\"global\" needs the top-level \"global\" section (the Envoy cluster of floodgate-sync)".into(),
                });
            }
            self.validate_algorithm(rule, &at)?;
            if rule.consistency == Consistency::Leased {
                if rule.scope != Scope::Global {
                    return Err(ConfigError {
                        path: at("consistency"),
                        problem: "\"leased\" needs \"scope\": \"global\" (a proxy-scope quota is exact already)".into(),
                    });
                }
                if rule.cost.as_ref().is_some_and(|c| c.from != CostSource::RequestHeader && c.estimate.is_none()) {
                    return Err(ConfigError {
                        path: at("cost.from"),
                        problem: "a leased rule takes its units before the request goes on: its cost must come from a request header, or be reserved (\"estimate\")".into(),
                    });
                }
            }
            if self.cluster_selection.is_some() && rule.condition.as_ref().is_some_and(|m| m.routes.is_some()) {
                return Err(ConfigError {
                    path: at("match.routes"),
                    problem: "cannot be used with \"cluster_selection\": Envoy picks the request's route after floodgate sets its cluster header, so the route floodgate would read is not the request's".into(),
                });
            }
            if let Some(first) = earlier_duplicate(&self.rate_limits, index, |r| &r.name) {
                return Err(ConfigError {
                    path: at("name"),
                    problem: format!(
                        "duplicate rule name \"{}\" (also rate_limits[{first}].name)",
                        rule.name
                    ),
                });
            }
        }
        if let Some(shedding) = &self.load_shedding {
            self.validate_shedding(shedding)?;
        }
        if let Some(selection) = &self.cluster_selection {
            selection.validate()?;
        }
        if let Some(global) = &self.global {
            global.validate()?;
        }
        if let Some(health) = &self.health {
            check_path(&health.path, "health.path")?;
            if health.dependencies != Dependencies::Off && self.cluster_selection.is_none() {
                return Err(ConfigError {
                    path: "health.dependencies".into(),
                    problem: "reports the clusters of cluster_selection, which is not configured".into(),
                });
            }
        }
        if let Some(watchdog) = &self.watchdog {
            self.validate_watchdog(watchdog)?;
        }
        Ok(())
    }

    /// A one-line summary of what the configuration enforces, for the configure-time log.
    pub fn summary(&self) -> String {
        let mut parts = vec![self.rate_limit_summary()];
        if let Some(shedding) = &self.load_shedding {
            let classes: Vec<String> = shedding
                .classes
                .iter()
                .map(|c| format!("{} at {}", c.name, c.shed_at.get()))
                .collect();
            let mut limits = Vec::new();
            if let Some(max) = shedding.max_active_requests {
                limits.push(format!("{} in flight", max.get()));
            }
            if let Some(lag) = shedding.max_loop_lag {
                limits.push(format!(
                    "{}ms loop lag (probed every {}ms)",
                    lag.get(),
                    shedding.lag_probe_interval.get()
                ));
            }
            if let Some(per_key) = &shedding.per_key {
                limits.push(per_key.summary());
            }
            let queue = shedding.queue.as_ref().map_or_else(String::new, |q| format!(", {}", q.summary()));
            parts.push(format!(
                "load shedding: {}{queue}, classes by {} [{}], default {}",
                limits.join(" or "),
                shedding.priority_header,
                classes.join(", "),
                shedding.default_class
            ));
        }
        if let Some(selection) = &self.cluster_selection {
            parts.push(selection.summary());
        }
        if let Some(health) = &self.health {
            parts.push(format!("health endpoint {}", health.path));
        }
        if let Some(watchdog) = &self.watchdog {
            parts.push(format!(
                "watchdog {}: a worker silent {}, or lagging past {} for {}{}",
                watchdog.path,
                watchdog.worker_silence,
                watchdog.max_loop_lag,
                watchdog.lag_for,
                watchdog.max_memory_mb.map_or_else(String::new, |mb| format!(", or past {} MiB of memory", mb.get()))
            ));
        }
        if let Some(global) = &self.global {
            parts.push(global.summary());
        }
        if self.grpc != Grpc::default() {
            parts.push(self.grpc.summary());
        }
        parts.join("; ")
    }

    fn rate_limit_summary(&self) -> String {
        if self.rate_limits.is_empty() {
            return "no rate limits".into();
        }
        let rules: Vec<String> = self
            .rate_limits
            .iter()
            .map(|r| {
                let key: Vec<String> = r.key.iter().map(ToString::to_string).collect();
                let bucket = match (r.algorithm, r.burst) {
                    (Algorithm::TokenBucket, Some(burst)) => match r.max_delay {
                        Some(delay) => format!(" (token bucket of {}, waits up to {delay})", burst.get()),
                        None => format!(" (token bucket of {})", burst.get()),
                    },
                    _ => String::new(),
                };
                format!(
                    "{} = {} per {}{bucket} by [{}] ({} keys{})",
                    r.name,
                    r.limit.get(),
                    r.window,
                    key.join(", "),
                    r.capacity.get(),
                    match (r.scope, r.consistency) {
                        (Scope::Global, Consistency::Leased) => ", global, leased",
                        (Scope::Global, Consistency::Batched) => ", global",
                        (Scope::Proxy, _) => "",
                    }
                )
            })
            .collect();
        format!("rate limits: {}", rules.join(", "))
    }
}

/// The index of the first item before `index` with the same name as item `index`.
fn earlier_duplicate<T>(items: &[T], index: usize, name: impl Fn(&T) -> &Name) -> Option<usize> {
    let wanted = name(items.get(index)?);
    items.iter().position(|item| name(item) == wanted).filter(|first| *first < index)
}

/// serde's derived structs also accept a JSON array of their fields in order; a configuration
/// written that way is unreadable and surely a mistake, so sections must be objects.
fn require_objects(document: &serde_json::Value) -> Result<(), ConfigError> {
    let not_object = |path: String| ConfigError {
        path,
        problem: "must be a JSON object".into(),
    };
    let top = document.as_object().ok_or_else(|| not_object(String::new()))?;
    let selection = top.get("cluster_selection");
    let sections = [
        ("load_shedding", top.get("load_shedding")),
        ("health", top.get("health")),
        ("watchdog", top.get("watchdog")),
        ("global", top.get("global")),
        ("grpc", top.get("grpc")),
        ("cluster_selection", selection),
        ("cluster_selection.concurrency_limit", selection.and_then(|s| s.get("concurrency_limit"))),
        ("cluster_selection.partition", selection.and_then(|s| s.get("partition"))),
        ("load_shedding.per_key", top.get("load_shedding").and_then(|s| s.get("per_key"))),
        ("load_shedding.queue", top.get("load_shedding").and_then(|s| s.get("queue"))),
        ("load_shedding.flow", top.get("load_shedding").and_then(|s| s.get("flow"))),
    ];
    for (path, section) in sections {
        if section.is_some_and(|v| !v.is_object() && !v.is_null()) {
            return Err(not_object(path.into()));
        }
    }
    let lists = [
        ("rate_limits", top.get("rate_limits")),
        ("load_shedding.classes", top.get("load_shedding").and_then(|s| s.get("classes"))),
    ];
    for (path, list) in lists {
        if let Some(serde_json::Value::Array(items)) = list {
            if let Some(index) = items.iter().position(|item| !item.is_object()) {
                return Err(not_object(format!("{path}[{index}]")));
            }
        }
    }
    if let Some(serde_json::Value::Array(classes)) = top.get("load_shedding").and_then(|s| s.get("classes")) {
        for field in ["queue", "flow"] {
            let malformed = |class: &serde_json::Value| class.get(field).is_some_and(|q| !q.is_object() && !q.is_null());
            if let Some(index) = classes.iter().position(malformed) {
                return Err(not_object(format!("load_shedding.classes[{index}].{field}")));
            }
        }
    }
    Ok(())
}

/// serde_json appends " at line L column C"; the field path says more, so drop it.
fn without_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(cut) => message.get(..cut).unwrap_or(message).to_owned(),
        None => message.to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::rate_limits::default_capacity;
    use super::*;

    pub(super) fn error_of(json: &str) -> String {
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

    const RULE: &str = r#"{"name":"a","key":[{"header":"X-Api-Key"}],"limit":5,"window":"10s"}"#;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(Name::parse(DEFAULT_STAT_PREFIX).unwrap(), default_stat_prefix());
        assert_eq!(default_capacity().get().get(), DEFAULT_CAPACITY);
    }

    #[test]
    fn empty_object_and_empty_input_do_nothing() {
        for text in ["{}", "", "  \n"] {
            let config = Config::parse(text.as_bytes()).unwrap();
            assert!(config.rate_limits.is_empty());
            assert_eq!(config.stat_prefix.as_str(), "floodgate");
        }
    }

    #[test]
    fn spec_example_parses_into_typed_values() {
        let config = Config::parse(
            br#"{"rate_limits":[
                {"name":"per-api-key","key":[{"header":"x-api-key"}],"limit":100,"window":"60s"},
                {"name":"per-ip","key":["source_ip","path","method","authority"],"limit":1000,"window":"1m",
                 "capacity":1000,"missing_key":"shared"}],
               "ratelimit_headers":"on_reject","stat_prefix":"edge"}"#,
        )
        .unwrap();
        let rule = &config.rate_limits[1];
        assert_eq!(rule.window.get().get(), 60_000);
        assert_eq!(rule.limit.get().get(), 1000);
        assert_eq!(rule.capacity.get().get(), 1000);
        assert_eq!(rule.missing_key, MissingKey::Shared);
        assert_eq!(
            rule.key,
            vec![KeyPart::SourceIp, KeyPart::Path, KeyPart::Method, KeyPart::Authority]
        );
        assert_eq!(config.rate_limits[0].key, vec![KeyPart::Header("x-api-key".into())]);
        assert_eq!(config.rate_limits[0].capacity.get().get(), DEFAULT_CAPACITY);
        assert_eq!(config.ratelimit_headers, RateLimitHeaders::OnReject);
        assert!(config.summary().contains("per-api-key = 100 per 1m by [header:x-api-key]"));
    }

    #[test]
    fn header_names_are_lower_cased() {
        let config = Config::parse(format!(r#"{{"rate_limits":[{RULE}]}}"#).as_bytes()).unwrap();
        assert_eq!(config.rate_limits[0].key, vec![KeyPart::Header("x-api-key".into())]);
    }

    #[test]
    fn unknown_field_is_named() {
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limt":5,"limit":5,"window":"1s"}]}"#,
        );
        assert!(err.starts_with("rate_limits[0].limt: unknown field `limt`"), "{err}");
        let err = error_of(r#"{"rate_limit":[]}"#);
        assert!(err.starts_with("rate_limit: unknown field `rate_limit`"), "{err}");
    }

    #[test]
    fn bad_duration_is_named() {
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":"ten seconds"}]}"#,
        );
        assert!(err.starts_with(r#"rate_limits[0].window: "ten seconds" is not a duration"#), "{err}");
        let err =
            error_of(r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":10}]}"#);
        assert!(err.starts_with("rate_limits[0].window: invalid type: integer `10`"), "{err}");
    }

    #[test]
    fn zero_negative_fractional_and_huge_limits_are_refused() {
        for (limit, words) in [
            ("0", "must be a positive integer"),
            ("-5", "must be a positive integer, got -5"),
            ("1.5", "must be a positive integer, got 1.5"),
            ("4294967296", "at most 4294967295"),
            ("\"5\"", "invalid type: string \"5\", expected a positive integer"),
        ] {
            let err = error_of(&format!(
                r#"{{"rate_limits":[{{"name":"a","key":["path"],"limit":{limit},"window":"1s"}}]}}"#
            ));
            assert!(err.starts_with("rate_limits[0].limit: "), "{err}");
            assert!(err.contains(words), "{limit}: {err}");
        }
    }

    #[test]
    fn zero_and_oversized_capacity_are_refused() {
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":"1s","capacity":0}]}"#,
        );
        assert!(err.starts_with("rate_limits[0].capacity: must be a positive integer"), "{err}");
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":"1s","capacity":99999999}]}"#,
        );
        assert!(err.starts_with("rate_limits[0].capacity: must be at most"), "{err}");
    }

    #[test]
    fn duplicate_rule_names_are_refused() {
        let err = error_of(&format!(r#"{{"rate_limits":[{RULE},{RULE}]}}"#));
        assert_eq!(err, r#"rate_limits[1].name: duplicate rule name "a" (also rate_limits[0].name)"#);
    }

    #[test]
    fn empty_key_list_is_refused() {
        let err = error_of(r#"{"rate_limits":[{"name":"a","key":[],"limit":5,"window":"1s"}]}"#);
        assert_eq!(err, "rate_limits[0].key: must list at least one key part");
    }

    #[test]
    fn bad_key_parts_are_named() {
        let err = error_of(r#"{"rate_limits":[{"name":"a","key":["ip"],"limit":5,"window":"1s"}]}"#);
        assert!(err.starts_with(r#"rate_limits[0].key[0]: unknown key part "ip""#), "{err}");
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path",{"header":"bad header"}],"limit":5,"window":"1s"}]}"#,
        );
        assert!(err.starts_with(r#"rate_limits[0].key[1]: "bad header" is not a valid header name"#), "{err}");
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":[{"cookie":"x"}],"limit":5,"window":"1s"}]}"#,
        );
        assert!(err.starts_with(r#"rate_limits[0].key[0]: unknown field "cookie""#), "{err}");
    }

    #[test]
    fn bad_names_and_enums_are_named() {
        let err = error_of(r#"{"rate_limits":[{"name":"a b","key":["path"],"limit":5,"window":"1s"}]}"#);
        assert!(err.starts_with(r#"rate_limits[0].name: "a b" is not a valid name"#), "{err}");
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":"1s","missing_key":"deny"}]}"#,
        );
        assert!(err.starts_with("rate_limits[0].missing_key: unknown variant `deny`"), "{err}");
    }

    #[test]
    fn missing_required_fields_are_named() {
        let err = error_of(r#"{"rate_limits":[{"name":"a","key":["path"],"window":"1s"}]}"#);
        assert!(err.starts_with("rate_limits[0]: missing field `limit`"), "{err}");
    }

    #[test]
    fn load_shedding_errors_are_named() {
        for (json, expected) in [
            (r#"{"load_shedding":{}}"#, "load_shedding: needs max_active_requests (an in-flight limit), max_loop_lag (a lag limit) or per_key (a cap per key), or several"),
            (r#"{"load_shedding":{"per_key":{"key":[],"max_active_requests":2}}}"#, "load_shedding.per_key.key: must list at least one key part"),
            (r#"{"load_shedding":{"per_key":{"key":[{"header":"x-k"}],"max_active_requests":0}}}"#, "load_shedding.per_key.max_active_requests: must be a positive integer"),
            (r#"{"load_shedding":{"per_key":{"key":[{"header":"x-k"}]}}}"#, "load_shedding.per_key: missing field `max_active_requests`"),
            (r#"{"load_shedding":{"per_key":{"key":[{"header":"x-k"}],"max_active_requests":2,"capacity":2000000}}}"#, "load_shedding.per_key.capacity: must be at most 1048576, got 2000000"),
            (r#"{"load_shedding":{"per_key":{"key":[{"header":"x-k"}],"max_active_requests":2,"cap":1}}}"#, "load_shedding.per_key.cap: unknown field `cap`"),
            (r#"{"load_shedding":{"per_key":[1]}}"#, "load_shedding.per_key: must be a JSON object"),
            (r#"{"load_shedding":{"max_active_requests":4,"flow":{"key":[{"header":"x-t"}]}}}"#, "load_shedding.flow: needs load_shedding.queue (flows share the class's slots and its queue; without a queue nothing waits)"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":8,"max_wait":"1s"},"flow":{"key":[]}}}"#, "load_shedding.flow.key: must list at least one key part"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":8,"max_wait":"1s"},"flow":{"key":[{"header":"x-t"}],"queues":200}}}"#, "load_shedding.flow.queues: must be at most 128, got 200"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":8,"max_wait":"1s"},"flow":{"key":[{"header":"x-t"}],"queues":0}}}"#, "load_shedding.flow.queues: must be a positive integer"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":8,"max_wait":"1s"},"classes":[{"name":"normal","shed_at":1.0,"flow":{"key":[{"header":"x-t"}],"queues":4,"hand_size":5}}]}}"#, "load_shedding.classes[0].flow.hand_size: must be at most queues (4), got 5"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":2000,"max_wait":"1s"},"flow":{"key":[{"header":"x-t"}]}}}"#, "load_shedding.queue.max_queued: must be at most 1024 in a class shared by flow, got 2000"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":8,"max_wait":"1s"},"classes":[{"name":"normal","shed_at":1.0,"flow":{"key":[{"header":"x-t"}]},"queue":{"max_queued":1500}}]}}"#, "load_shedding.classes[0].queue.max_queued: must be at most 1024 in a class shared by flow, got 1500"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":8,"max_wait":"1s"},"flow":{"key":[{"header":"x-t"}],"hand":2}}}"#, "load_shedding.flow.hand: unknown field `hand`"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":8,"max_wait":"1s"},"flow":[1]}}"#, "load_shedding.flow: must be a JSON object"),
            (r#"{"load_shedding":{"max_active_requests":4,"queue":{"max_queued":8,"max_wait":"1s"},"classes":[{"name":"normal","shed_at":1.0,"flow":"x-t"}]}}"#, "load_shedding.classes[0].flow: must be a JSON object"),
            (r#"{"cluster_selection":{"clusters":["a","b"],"partition":{"key":[{"header":"x-k"}],"size":3}}}"#, "cluster_selection.partition.size: must be at most the number of clusters (2), got 3"),
            (r#"{"cluster_selection":{"clusters":["a","b"],"partition":{"key":[{"header":"x-k"}],"size":0}}}"#, "cluster_selection.partition.size: must be a positive integer"),
            (r#"{"cluster_selection":{"clusters":["a","b"],"partition":{"key":[],"size":1}}}"#, "cluster_selection.partition.key: must list at least one key part"),
            (r#"{"cluster_selection":{"clusters":["a","b"],"partition":{"key":[{"header":"x-k"}],"size":1,"when_unavailable":"wait"}}}"#, "cluster_selection.partition.when_unavailable: unknown variant `wait`"),
            (r#"{"cluster_selection":{"clusters":["a","b"],"partition":{"key":[{"header":"x-k"}],"size":1,"spill_below":0.5}}}"#, r#"cluster_selection.partition.spill_below: applies only with "when_unavailable": "spill""#),
            (r#"{"cluster_selection":{"clusters":["a","b"],"partition":{"key":[{"header":"x-k"}],"size":1,"when_unavailable":"spill","spill_below":0}}}"#, "cluster_selection.partition.spill_below: must be a fraction in (0, 1], got 0"),
            (r#"{"cluster_selection":{"clusters":["a","b"],"partition":"x-k"}}"#, "cluster_selection.partition: must be a JSON object"),
            (r#"{"load_shedding":{"max_loop_lag":"0ms"}}"#, "load_shedding.max_loop_lag: "),
            (r#"{"load_shedding":{"max_loop_lag":"50ms","lag_probe_interval":"5ms"}}"#, "load_shedding.lag_probe_interval: must be from 10ms to 1000ms, got 5ms"),
            (r#"{"load_shedding":{"max_loop_lag":"50ms","lag_probe_interval":"2s"}}"#, "load_shedding.lag_probe_interval: must be from 10ms to 1000ms, got 2000ms"),
            (r#"{"health":{"path":"/h","dependencies":"report"}}"#, "health.dependencies: reports the clusters of cluster_selection, which is not configured"),
            (r#"{"health":{"path":"/h","dependencies":"always"}}"#, "health.dependencies: unknown variant `always`"),
            (r#"{"health":{"path":"/h","min_success_rate":2}}"#, "health.min_success_rate: must be a fraction in (0, 1], got 2"),
            (r#"{"load_shedding":{"max_active_requests":0}}"#, "load_shedding.max_active_requests: must be a positive integer"),
            (r#"{"load_shedding":{"max_active_requests":5,"classes":[]}}"#, "load_shedding.classes: must list at least one class"),
            (r#"{"load_shedding":{"max_active_requests":5,"classes":[{"name":"a","shed_at":1.5}],"default_class":"a"}}"#, "load_shedding.classes[0].shed_at: must be a fraction in (0, 1], got 1.5"),
            (r#"{"load_shedding":{"max_active_requests":5,"classes":[{"name":"a","shed_at":0}],"default_class":"a"}}"#, "load_shedding.classes[0].shed_at: must be a fraction in (0, 1], got 0"),
            (r#"{"load_shedding":{"max_active_requests":5,"classes":[{"name":"a","shed_at":1},{"name":"a","shed_at":0.5}],"default_class":"a"}}"#, "load_shedding.classes[1].name: duplicate class name"),
            (r#"{"load_shedding":{"max_active_requests":5,"default_class":"bulk"}}"#, r#"load_shedding.default_class: "bulk" is not one of the classes"#),
            (r#"{"load_shedding":{"max_active_requests":5,"priority_header":"a b"}}"#, "load_shedding.priority_header: \"a b\" is not a valid header name"),
            (r#"{"load_shedding":{"max_active_requests":5,"retry_after":"soon"}}"#, r#"load_shedding.retry_after: "soon" is not a duration"#),
            (r#"{"load_shedding":{"max_active_requests":5,"classes":["low"]}}"#, "load_shedding.classes[0]: must be a JSON object"),
            (r#"{"load_shedding":[5]}"#, "load_shedding: must be a JSON object"),
            (r#"{"health":{"path":"health"}}"#, r#"health.path: "health" must be a path"#),
            (r#"{"health":{"path":"/h","port":1}}"#, "health.port: unknown field `port`"),
            (r#"{"watchdog":{"path":"/alive","worker_silence":"0s"}}"#, r#"watchdog.worker_silence: "0s" must be longer than zero"#),
            (r#"{"watchdog":{"path":"/alive","max_loop_lag":"0ms"}}"#, r#"watchdog.max_loop_lag: "0ms" must be longer than zero"#),
            (r#"{"watchdog":{"path":"/alive","lag_for":"0s"}}"#, r#"watchdog.lag_for: "0s" must be longer than zero"#),
            (r#"{"watchdog":{"path":"/alive","max_memory_mb":0}}"#, "watchdog.max_memory_mb: must be a positive integer"),
            (r#"{"watchdog":{"path":"/alive","recover_after":0}}"#, "watchdog.recover_after: must be a positive integer"),
            (r#"{"watchdog":{"path":"/alive","recover_after":61}}"#, "watchdog.recover_after: must be at most 60, got 61"),
            (r#"{"watchdog":{"path":"/alive","worker_silence":"2s"}}"#, "watchdog.worker_silence: must be at least 3000ms (three heartbeats), got 2s"),
            (r#"{"watchdog":{"path":"/alive","max_loop_lag":"50ms"}}"#, "watchdog.max_loop_lag: must be at least 100ms"),
            (r#"{"watchdog":{"path":"alive"}}"#, r#"watchdog.path: "alive" must be a path"#),
            (r#"{"watchdog":{"path":"/h"},"health":{"path":"/h"}}"#, r#"watchdog.path: "/h" is health.path too"#),
            (r#"{"watchdog":{}}"#, "watchdog: missing field `path`"),
            (r#"{"watchdog":{"path":"/alive","silence":"5s"}}"#, "watchdog.silence: unknown field `silence`"),
            (r#"{"watchdog":"/alive"}"#, "watchdog: must be a JSON object"),
        ] {
            let err = error_of(json);
            assert!(err.starts_with(expected), "{json}\n  got: {err}\n want: {expected}");
        }
    }

    #[test]
    fn wrong_document_shapes_are_refused() {
        let err = error_of(r#"{"rate_limits":{}}"#);
        assert!(err.starts_with("rate_limits: invalid type: map, expected a sequence"), "{err}");
        assert_eq!(error_of("[]"), "must be a JSON object");
        let err = error_of(r#"{"rate_limits":[["a",["path"],5,"1s"]]}"#);
        assert_eq!(err, "rate_limits[0]: must be a JSON object");
        assert!(error_of("{} {}").contains("trailing characters"));
        assert!(error_of("{").contains("EOF"));
        assert!(Config::parse(b"\xff").unwrap_err().problem.contains("not UTF-8"));
    }

    #[test]
    fn errors_are_one_line_whatever_the_input_holds() {
        let err = error_of("{\"x\\r\\nfloodgate: forged\":1}");
        assert!(!err.contains(['\r', '\n']), "{err}");
        assert!(err.starts_with("x\\r\\nfloodgate: forged: unknown field"), "{err}");
        let err = error_of(r#"{"health":{"path":"/a\nb"}}"#);
        assert!(err.starts_with("health.path: \"/a\\nb\" must be a path"), "{err}");
        assert!(!err.contains('\n'));
        let err = error_of(r#"{"health":{"path":"/a b"}}"#);
        assert!(err.starts_with("health.path:"), "{err}");
    }
}
