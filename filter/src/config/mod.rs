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
mod global;
mod grpc;
mod leveling;
mod rules;
mod selection;
mod values;

pub use global::{Global, OnStoreFailure, StoreRoute, MAX_GLOBAL_KEYS, MAX_LEASE_TIMEOUT_MS, MAX_SYNC_INTERVAL_MS, MIN_SYNC_INTERVAL_MS, SYNC_PATH};
pub use grpc::{default_failure_grpc_statuses, Grpc, GrpcStatus};
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

/// `load_shedding`: refuse new requests fast when the proxy already has this many in flight, or
/// when a worker's event loop lags (at least one of the two).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadShedding {
    /// Proxy-wide (all workers) in-flight limit.
    #[serde(default)]
    pub max_active_requests: Option<Positive>,
    /// Shed on a worker while its event loop runs its timer this late ([`crate::shedding::lag`]).
    #[serde(default)]
    pub max_loop_lag: Option<DurationMs>,
    /// How often each worker probes its event loop's lag (with `max_loop_lag`).
    #[serde(default = "default_lag_probe_interval")]
    pub lag_probe_interval: DurationMs,
    /// A cap on each key's requests in flight (the bulkhead).
    #[serde(default)]
    pub per_key: Option<PerKey>,
    /// Load leveling: a request the in-flight limit would shed waits for a slot instead.
    #[serde(default)]
    pub queue: Option<Queue>,
    /// The request header whose value names the priority class.
    #[serde(default = "default_priority_header")]
    pub priority_header: String,
    /// Priority classes, each shed once the in-flight count reaches its fraction of the limit.
    #[serde(default = "default_classes")]
    pub classes: Vec<PriorityClass>,
    /// The class of requests without the header or with an unknown value.
    #[serde(default = "default_class")]
    pub default_class: Name,
    /// `retry-after` of a shed request (rounded up to whole seconds, at least 1).
    #[serde(default = "default_retry_after")]
    pub retry_after: DurationMs,
    /// `shadow`: shedding (in-flight and loop lag) only counts what it would shed.
    #[serde(default)]
    pub mode: Mode,
}

/// A priority class.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriorityClass {
    /// The header value that selects it.
    pub name: Name,
    /// Fraction of `max_active_requests` from which the class is shed, in (0, 1].
    pub shed_at: Fraction,
    /// The class's overrides of `load_shedding.queue`.
    #[serde(default)]
    pub queue: Option<ClassQueue>,
}

/// `health`: a path the filter answers itself.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Health {
    /// The path (matched without its query), e.g. `/floodgate/health`.
    pub path: String,
    /// What the answer says of the upstream clusters (cluster selection's view).
    #[serde(default)]
    pub dependencies: Dependencies,
    /// With `dependencies: "fail"`: the answer is `503` while every cluster's success rate is
    /// below this.
    #[serde(default = "default_min_success_rate")]
    pub min_success_rate: Fraction,
}

/// `watchdog`: a liveness path the filter answers itself, failing (`503`) while the proxy is
/// degraded in ways a restart cures ([`crate::watchdog`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Watchdog {
    /// The path (matched without its query), e.g. `/floodgate/alive`.
    pub path: String,
    /// A worker whose heartbeat is older than this, while another worker's is recent, fails
    /// the answer.
    #[serde(default = "default_worker_silence")]
    pub worker_silence: DurationMs,
    /// A worker's loop lag from which it counts as lagging.
    #[serde(default = "default_watchdog_lag")]
    pub max_loop_lag: DurationMs,
    /// How long a worker must lag past `max_loop_lag` (without `recover_after` good heartbeats
    /// in a row) before the answer fails.
    #[serde(default = "default_lag_for")]
    pub lag_for: DurationMs,
    /// A worker's Wasm linear memory past this many MiB fails the answer (none: not checked).
    #[serde(default)]
    pub max_memory_mb: Option<Positive>,
    /// Good heartbeats in a row a worker needs to count as recovered, after a silence or a lag.
    #[serde(default = "default_recover_after")]
    pub recover_after: Positive,
}

/// The shortest `watchdog.worker_silence`: three heartbeats (a heartbeat is every second, a
/// little later on a busy loop), so that a worker between two heartbeats is never silent.
pub const MIN_WORKER_SILENCE_MS: u64 = 3_000;
/// The shortest `watchdog.max_loop_lag`: what the heartbeat measures the lag to.
pub const MIN_WATCHDOG_LAG_MS: u64 = 100;
/// The most heartbeats `watchdog.recover_after` may ask for.
pub const MAX_RECOVER_AFTER: u32 = 60;

fn default_worker_silence() -> DurationMs {
    DurationMs::from_ms(5_000).unwrap_or(DurationMs::MIN)
}

fn default_watchdog_lag() -> DurationMs {
    DurationMs::from_ms(2_000).unwrap_or(DurationMs::MIN)
}

fn default_lag_for() -> DurationMs {
    DurationMs::from_ms(30_000).unwrap_or(DurationMs::MIN)
}

fn default_recover_after() -> Positive {
    Positive::new(3).unwrap_or(Positive::ONE)
}

/// What the health endpoint says of the upstream clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dependencies {
    /// Nothing: the answer is the proxy's own load only.
    #[default]
    Off,
    /// The clusters' success rates and limits in the body; the status stays the proxy's own.
    Report,
    /// As `report`, and `503` while every cluster fails (success rate below
    /// `min_success_rate`). Beware: every proxy of a fleet sees the same clusters, so they
    /// all turn red at once (see docs/configuration.md, `health`).
    Fail,
}

fn default_min_success_rate() -> Fraction {
    Fraction::trusted(0.5)
}

fn default_lag_probe_interval() -> DurationMs {
    DurationMs::from_ms(100).unwrap_or(DurationMs::MIN)
}

/// The shortest `lag_probe_interval`: Envoy's timers are millisecond timers, and a probe is a
/// tick of every worker.
pub const MIN_LAG_PROBE_MS: u64 = 10;
/// The longest `lag_probe_interval`.
pub const MAX_LAG_PROBE_MS: u64 = 1_000;

/// The priority header when `priority_header` is not given.
pub const DEFAULT_PRIORITY_HEADER: &str = "x-floodgate-priority";

fn default_priority_header() -> String {
    DEFAULT_PRIORITY_HEADER.into()
}

fn default_classes() -> Vec<PriorityClass> {
    [("critical", 1.0), ("normal", 0.9), ("low", 0.5)]
        .into_iter()
        .map(|(name, shed_at)| PriorityClass {
            name: Name::trusted(name),
            shed_at: Fraction::trusted(shed_at),
            queue: None,
        })
        .collect()
}

fn default_class() -> Name {
    Name::trusted("normal")
}

fn default_retry_after() -> DurationMs {
    DurationMs::from_ms(1000).unwrap_or(DurationMs::MIN)
}

fn default_stat_prefix() -> Name {
    Name::trusted(DEFAULT_STAT_PREFIX)
}

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

fn default_capacity() -> Positive {
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

    fn validate_watchdog(&self, watchdog: &Watchdog) -> Result<(), ConfigError> {
        check_path(&watchdog.path, "watchdog.path")?;
        if self.health.as_ref().is_some_and(|h| h.path == watchdog.path) {
            return Err(ConfigError {
                path: "watchdog.path".into(),
                problem: format!("{:?} is health.path too: liveness and readiness need paths of their own", watchdog.path),
            });
        }
        let at_least = |field: &str, value: DurationMs, min_ms: u64, why: &str| {
            if value.get().get() < min_ms {
                return Err(ConfigError {
                    path: format!("watchdog.{field}"),
                    problem: format!("must be at least {min_ms}ms ({why}), got {value}"),
                });
            }
            Ok(())
        };
        at_least("worker_silence", watchdog.worker_silence, MIN_WORKER_SILENCE_MS, "three heartbeats")?;
        at_least("max_loop_lag", watchdog.max_loop_lag, MIN_WATCHDOG_LAG_MS, "the heartbeat measures the lag to that")?;
        let recover_after = watchdog.recover_after.get().get();
        if recover_after > MAX_RECOVER_AFTER {
            return Err(ConfigError {
                path: "watchdog.recover_after".into(),
                problem: format!("must be at most {MAX_RECOVER_AFTER}, got {recover_after}"),
            });
        }
        Ok(())
    }

    /// A token bucket's fields, only with the token bucket, and only in proxy scope.
    fn validate_algorithm(&self, rule: &RateLimitRule, at: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
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

    fn validate_shedding(&self, shedding: &LoadShedding) -> Result<(), ConfigError> {
        let error = |path: String, problem: String| ConfigError { path, problem };
        if shedding.max_active_requests.is_none() && shedding.max_loop_lag.is_none() && shedding.per_key.is_none() {
            return Err(error(
                "load_shedding".into(),
                "needs max_active_requests (an in-flight limit), max_loop_lag (a lag limit) or per_key (a cap per key), or several".into(),
            ));
        }
        if let Some(per_key) = &shedding.per_key {
            bulkhead::validate_per_key(per_key)?;
        }
        let probe = shedding.lag_probe_interval.get().get();
        if !(MIN_LAG_PROBE_MS..=MAX_LAG_PROBE_MS).contains(&probe) {
            return Err(error(
                "load_shedding.lag_probe_interval".into(),
                format!("must be from {MIN_LAG_PROBE_MS}ms to {MAX_LAG_PROBE_MS}ms, got {probe}ms"),
            ));
        }
        header_name(&shedding.priority_header)
            .map_err(|problem| error("load_shedding.priority_header".into(), problem))?;
        if shedding.classes.is_empty() {
            return Err(error("load_shedding.classes".into(), "must list at least one class".into()));
        }
        for (index, class) in shedding.classes.iter().enumerate() {
            if let Some(first) = earlier_duplicate(&shedding.classes, index, |c| &c.name) {
                return Err(error(
                    format!("load_shedding.classes[{index}].name"),
                    format!("duplicate class name \"{}\" (also load_shedding.classes[{first}].name)", class.name),
                ));
            }
        }
        if !shedding.classes.iter().any(|c| c.name == shedding.default_class) {
            return Err(error(
                "load_shedding.default_class".into(),
                format!("\"{}\" is not one of the classes", shedding.default_class),
            ));
        }
        leveling::validate(shedding)
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

/// Checks a path the filter answers itself (`field`: where it is in the configuration).
fn check_path(path: &str, field: &str) -> Result<(), ConfigError> {
    let odd = |c: char| c.is_control() || c.is_whitespace() || c == '?' || c == '#';
    if !path.starts_with('/') || path.contains(odd) {
        return Err(ConfigError {
            path: field.into(),
            problem: format!("{path:?} must be a path starting with '/', without query, spaces or control characters"),
        });
    }
    Ok(())
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
        let queue = |class: &serde_json::Value| class.get("queue").is_some_and(|q| !q.is_object() && !q.is_null());
        if let Some(index) = classes.iter().position(queue) {
            return Err(not_object(format!("load_shedding.classes[{index}].queue")));
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
    use super::*;

    fn error_of(json: &str) -> String {
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

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
    fn load_shedding_and_health_parse_with_defaults() {
        let config = Config::parse(
            br#"{"load_shedding":{"max_active_requests":500},"health":{"path":"/floodgate/health"}}"#,
        )
        .unwrap();
        let shedding = config.load_shedding.unwrap();
        assert_eq!(shedding.max_active_requests.unwrap().get().get(), 500);
        assert_eq!((shedding.max_loop_lag, shedding.lag_probe_interval.get().get()), (None, 100));
        assert_eq!(shedding.priority_header, DEFAULT_PRIORITY_HEADER);
        assert_eq!(shedding.classes.len(), 3);
        assert_eq!(shedding.default_class.as_str(), "normal");
        assert_eq!(shedding.retry_after.get().get(), 1000);
        assert_eq!(config.health.unwrap().path, "/floodgate/health");
    }

    #[test]
    fn the_watchdog_parses_with_defaults() {
        let config = Config::parse(br#"{"watchdog":{"path":"/floodgate/alive"}}"#).unwrap();
        let dog = config.watchdog.as_ref().unwrap();
        assert_eq!(
            (dog.worker_silence.get().get(), dog.max_loop_lag.get().get(), dog.lag_for.get().get(), dog.max_memory_mb, dog.recover_after.get().get()),
            (5_000, 2_000, 30_000, None, 3)
        );
        assert!(config.summary().contains("watchdog /floodgate/alive: a worker silent 5s, or lagging past 2s for 30s"), "{}", config.summary());
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
