//! `cluster_selection`: the clusters the filter chooses among, and the tuning of the
//! success-prioritized fallback cascade ([`crate::selection`]), with the published algorithm's
//! values as defaults.

use super::grpc::{default_failure_grpc_statuses, GrpcStatus};
use super::values::{DurationMs, Positive};
use super::{header_name, ConfigError};
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::fmt;

/// Clusters a configuration may list at most (the shuffle and the per-request reads are linear
/// in it; a handful is the intended use).
pub const MAX_CLUSTERS: usize = 64;
/// Stat buckets a configuration may ask for at most.
pub const MAX_BUCKETS: u32 = 60;
/// The route header when `route_header` is not given.
pub const DEFAULT_ROUTE_HEADER: &str = "x-floodgate-cluster";

/// `cluster_selection`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSelection {
    /// The request header set to the chosen cluster; the route reads it with `cluster_header`.
    #[serde(default = "default_route_header")]
    pub route_header: String,
    /// Envoy cluster names, one or more, distinct.
    pub clusters: Vec<ClusterName>,
    /// Width of one stat bucket (seed: 5 s).
    #[serde(default = "default_bucket_width")]
    pub bucket_width: DurationMs,
    /// Stat buckets in the rolling window, besides the sticky one (seed: 6).
    #[serde(default = "default_buckets")]
    pub buckets: Positive,
    /// Each bucket weighs this many times less than the next newer one (seed: 3); at least 1.
    #[serde(default = "default_decay_factor")]
    pub decay_factor: f64,
    /// Weight = success rate to this power (seed: 3); positive.
    #[serde(default = "default_weight_exponent")]
    pub weight_exponent: f64,
    /// With only the sticky bucket's data, the success rate is at least this divided by the
    /// number of clusters (seed: 0.0001); in [0, 1].
    #[serde(default = "default_no_data_floor")]
    pub no_data_floor: f64,
    /// Whether the floor also bounds the weight (`"weight"`, the default) or, as the published
    /// algorithm literally says, only the rate before it is raised to `weight_exponent` (`"rate"`: a
    /// cubed floor of 0.0001/3 is a weight of 4e-14, so a recovered cluster is in practice never
    /// tried again until the others are at their limits).
    #[serde(default)]
    pub no_data_floor_on: FloorOn,
    /// Upstream statuses that count as failures: codes (`503`) or classes (`"5xx"`).
    #[serde(default = "default_failure_statuses")]
    pub failure_statuses: Vec<StatusMatch>,
    /// The gRPC statuses of gRPC calls that count as failures (see [`crate::replies::grpc`]).
    #[serde(default = "default_failure_grpc_statuses")]
    pub failure_grpc_statuses: Vec<GrpcStatus>,
    /// The concurrency limit of each cluster.
    #[serde(default)]
    pub concurrency_limit: ConcurrencyLimit,
    /// `retry-after` of the 503 sent when no cluster has room.
    #[serde(default = "default_retry_after")]
    pub retry_after: DurationMs,
    /// Each key confined to a stable subset of the clusters (the bulkhead).
    #[serde(default)]
    pub partition: Option<super::Partition>,
}

/// The per-cluster concurrency limit: AIMD after Netflix concurrency-limits' `AIMDLimit`. The
/// limit grows by one on a success while at least half of it is in use, and is multiplied by
/// `backoff_ratio` on a timeout, an overflow, or a success slower than `timeout`; it stays
/// within `[min_limit, max_limit]`. Set `min_limit` = `max_limit` for a fixed limit.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencyLimit {
    /// Only `"aimd"` for now.
    #[serde(default)]
    pub algorithm: LimitAlgorithm,
    /// The limit of a cluster with no history (Netflix default 20).
    #[serde(default = "default_initial_limit")]
    pub initial_limit: Positive,
    /// The limit never falls below this (default 1).
    #[serde(default = "default_min_limit")]
    pub min_limit: Positive,
    /// The limit never grows above this (Netflix default 200).
    #[serde(default = "default_max_limit")]
    pub max_limit: Positive,
    /// Multiplier applied on a drop, in (0, 1) (Netflix default 0.9).
    #[serde(default = "default_backoff_ratio")]
    pub backoff_ratio: f64,
    /// A response slower than this counts as a drop for the limit (Netflix default 5 s).
    #[serde(default = "default_limit_timeout")]
    pub timeout: DurationMs,
}

impl Default for ConcurrencyLimit {
    fn default() -> Self {
        ConcurrencyLimit {
            algorithm: LimitAlgorithm::Aimd,
            initial_limit: default_initial_limit(),
            min_limit: default_min_limit(),
            max_limit: default_max_limit(),
            backoff_ratio: default_backoff_ratio(),
            timeout: default_limit_timeout(),
        }
    }
}

/// What `no_data_floor` bounds from below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FloorOn {
    /// The success rate and the weight (so a cluster with only old data keeps a chance of about
    /// `no_data_floor / clusters` per request to be tried again).
    #[default]
    Weight,
    /// The success rate only (the published algorithm's literal wording).
    Rate,
}

/// The concurrency-limit algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitAlgorithm {
    /// Additive increase, multiplicative decrease.
    #[default]
    Aimd,
}

/// An Envoy cluster name: 1 to 255 visible ASCII characters (Istio's names such as
/// `outbound|80||reviews.default.svc.cluster.local` included), usable as a header value.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClusterName(String);

impl ClusterName {
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Checks a cluster name.
    pub fn parse(text: &str) -> Result<ClusterName, String> {
        if text.is_empty() || text.len() > 255 || !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "{text:?} is not a valid cluster name (1 to 255 visible ASCII characters)"
            ));
        }
        Ok(ClusterName(text.to_owned()))
    }
}

impl fmt::Display for ClusterName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ClusterName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;
        impl Visitor<'_> for NameVisitor {
            type Value = ClusterName;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a cluster name string")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<ClusterName, E> {
                ClusterName::parse(text).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(NameVisitor)
    }
}

/// Statuses that count as failures: one code or a class of a hundred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMatch {
    /// One status code, 100 to 599.
    Code(u16),
    /// A class: 1 to 5 for `"1xx"` to `"5xx"`.
    Class(u8),
}

impl StatusMatch {
    /// Whether `status` matches.
    pub fn matches(self, status: u16) -> bool {
        match self {
            StatusMatch::Code(code) => code == status,
            StatusMatch::Class(class) => status / 100 == u16::from(class),
        }
    }
}

impl fmt::Display for StatusMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatusMatch::Code(code) => write!(f, "{code}"),
            StatusMatch::Class(class) => write!(f, "{class}xx"),
        }
    }
}

impl<'de> Deserialize<'de> for StatusMatch {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StatusVisitor;
        impl Visitor<'_> for StatusVisitor {
            type Value = StatusMatch;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a status code (100 to 599) or a class such as \"5xx\"")
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<StatusMatch, E> {
                u16::try_from(value)
                    .ok()
                    .filter(|code| (100..=599).contains(code))
                    .map(StatusMatch::Code)
                    .ok_or_else(|| E::custom(format!("{value} is not a status code (100 to 599)")))
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<StatusMatch, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::custom(format!("{value} is not a status code (100 to 599)"))),
                }
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<StatusMatch, E> {
                match text.as_bytes() {
                    [digit @ b'1'..=b'5', b'x', b'x'] => Ok(StatusMatch::Class(digit.saturating_sub(b'0'))),
                    _ => match text.parse::<u64>() {
                        Ok(code) => self.visit_u64(code),
                        Err(_) => Err(E::custom(format!(
                            "{text:?} is not a status code or class (use 503 or \"5xx\")"
                        ))),
                    },
                }
            }
        }
        deserializer.deserialize_any(StatusVisitor)
    }
}

fn default_route_header() -> String {
    DEFAULT_ROUTE_HEADER.into()
}

fn default_bucket_width() -> DurationMs {
    DurationMs::from_ms(5_000).unwrap_or(DurationMs::MIN)
}

fn default_buckets() -> Positive {
    Positive::new(6).unwrap_or(Positive::ONE)
}

fn default_decay_factor() -> f64 {
    3.0
}

fn default_weight_exponent() -> f64 {
    3.0
}

fn default_no_data_floor() -> f64 {
    0.0001
}

fn default_failure_statuses() -> Vec<StatusMatch> {
    vec![StatusMatch::Class(5)]
}

fn default_retry_after() -> DurationMs {
    DurationMs::from_ms(1000).unwrap_or(DurationMs::MIN)
}

fn default_initial_limit() -> Positive {
    Positive::new(20).unwrap_or(Positive::ONE)
}

fn default_min_limit() -> Positive {
    Positive::ONE
}

fn default_max_limit() -> Positive {
    Positive::new(200).unwrap_or(Positive::ONE)
}

fn default_backoff_ratio() -> f64 {
    0.9
}

fn default_limit_timeout() -> DurationMs {
    DurationMs::from_ms(5_000).unwrap_or(DurationMs::MIN)
}

impl ClusterSelection {
    /// Checks what serde cannot: ranges, duplicates, consistency of the limit bounds.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let error = |field: &str, problem: String| ConfigError {
            path: format!("cluster_selection.{field}"),
            problem,
        };
        header_name(&self.route_header).map_err(|problem| error("route_header", problem))?;
        if self.route_header.starts_with(':') {
            return Err(error("route_header", "must not be a pseudo-header".into()));
        }
        if self.clusters.is_empty() {
            return Err(error("clusters", "must list at least one cluster".into()));
        }
        if let Some(partition) = &self.partition {
            super::bulkhead::validate_partition(partition, self.clusters.len())?;
        }
        if self.clusters.len() > MAX_CLUSTERS {
            return Err(error("clusters", format!("lists {} clusters; at most {MAX_CLUSTERS}", self.clusters.len())));
        }
        for (index, cluster) in self.clusters.iter().enumerate() {
            if let Some(first) = self.clusters.iter().position(|c| c == cluster).filter(|f| *f < index) {
                return Err(error(
                    &format!("clusters[{index}]"),
                    format!("duplicate cluster \"{cluster}\" (also cluster_selection.clusters[{first}])"),
                ));
            }
        }
        if self.buckets.get().get() > MAX_BUCKETS {
            return Err(error("buckets", format!("must be at most {MAX_BUCKETS}, got {}", self.buckets.get())));
        }
        let finite_at_least = |field: &str, value: f64, low: f64, high: f64, words: &str| {
            if value.is_finite() && value >= low && value <= high {
                Ok(())
            } else {
                Err(error(field, format!("must be {words}, got {value}")))
            }
        };
        finite_at_least("decay_factor", self.decay_factor, 1.0, 1000.0, "a number from 1 to 1000")?;
        if !(self.weight_exponent.is_finite() && self.weight_exponent > 0.0 && self.weight_exponent <= 100.0) {
            return Err(error(
                "weight_exponent",
                format!("must be a number in (0, 100], got {}", self.weight_exponent),
            ));
        }
        finite_at_least("no_data_floor", self.no_data_floor, 0.0, 1.0, "a number in [0, 1]")?;
        if self.failure_statuses.is_empty() {
            return Err(error(
                "failure_statuses",
                "must list at least one status or class (timeouts and resets always count)".into(),
            ));
        }
        let limit = &self.concurrency_limit;
        let (min, max, initial) = (limit.min_limit.get(), limit.max_limit.get(), limit.initial_limit.get());
        if min > max {
            return Err(error(
                "concurrency_limit.min_limit",
                format!("{min} is above max_limit {max}"),
            ));
        }
        if initial < min || initial > max {
            return Err(error(
                "concurrency_limit.initial_limit",
                format!("{initial} is outside [min_limit, max_limit] = [{min}, {max}]"),
            ));
        }
        if !(limit.backoff_ratio.is_finite() && limit.backoff_ratio > 0.0 && limit.backoff_ratio < 1.0) {
            return Err(error(
                "concurrency_limit.backoff_ratio",
                format!("must be a number in (0, 1), got {}", limit.backoff_ratio),
            ));
        }
        Ok(())
    }

    /// One line for the configure-time log.
    pub fn summary(&self) -> String {
        let clusters: Vec<&str> = self.clusters.iter().map(ClusterName::as_str).collect();
        let failures: Vec<String> = self.failure_statuses.iter().map(ToString::to_string).collect();
        let grpc_failures: Vec<&str> = self.failure_grpc_statuses.iter().map(|s| s.name()).collect();
        let limit = &self.concurrency_limit;
        format!(
            "cluster selection by {} over [{}]: {} buckets of {}, decay {}, weight rate^{}, \
             failures [{}] (gRPC [{}]), AIMD limit {} in [{}, {}] (backoff {}, timeout {})",
            self.route_header,
            clusters.join(", "),
            self.buckets.get(),
            self.bucket_width,
            self.decay_factor,
            self.weight_exponent,
            failures.join(", "),
            grpc_failures.join(", "),
            limit.initial_limit.get(),
            limit.min_limit.get(),
            limit.max_limit.get(),
            limit.backoff_ratio,
            limit.timeout
        ) + &self.partition.as_ref().map_or_else(String::new, |p| format!(", {}", p.summary(self.clusters.len())))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use crate::config::{Config, FloorOn, GrpcStatus, LimitAlgorithm, StatusMatch};

    fn error_of(json: &str) -> String {
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn spec_example_parses_with_the_seed_defaults() {
        let config = Config::parse(
            br#"{"cluster_selection":{"route_header":"x-floodgate-cluster","clusters":["zone-a","zone-b","outbound|80||reviews.default.svc.cluster.local"]}}"#,
        )
        .unwrap();
        let selection = config.cluster_selection.unwrap();
        assert_eq!(selection.clusters.len(), 3);
        assert_eq!(selection.clusters[2].as_str(), "outbound|80||reviews.default.svc.cluster.local");
        assert_eq!(selection.bucket_width.get().get(), 5_000);
        assert_eq!(selection.buckets.get().get(), 6);
        assert_eq!(selection.decay_factor, 3.0);
        assert_eq!(selection.weight_exponent, 3.0);
        assert_eq!(selection.no_data_floor, 0.0001);
        assert_eq!(selection.no_data_floor_on, FloorOn::Weight);
        assert_eq!(selection.failure_statuses, vec![StatusMatch::Class(5)]);
        assert_eq!(
            selection.failure_grpc_statuses,
            vec![GrpcStatus::UNAVAILABLE, GrpcStatus::INTERNAL, GrpcStatus::UNKNOWN, GrpcStatus::DATA_LOSS]
        );
        let limit = &selection.concurrency_limit;
        assert_eq!(limit.algorithm, LimitAlgorithm::Aimd);
        assert_eq!(
            (limit.initial_limit.get().get(), limit.min_limit.get().get(), limit.max_limit.get().get()),
            (20, 1, 200)
        );
        assert_eq!(limit.backoff_ratio, 0.9);
        assert_eq!(limit.timeout.get().get(), 5_000);
        assert_eq!(selection.retry_after.get().get(), 1_000);
        assert!(selection.summary().starts_with("cluster selection by x-floodgate-cluster over [zone-a, zone-b,"));
    }

    #[test]
    fn every_field_can_be_set() {
        let config = Config::parse(
            br#"{"cluster_selection":{"route_header":"x-c","clusters":["a"],"bucket_width":"1s","buckets":10,
                "decay_factor":2,"weight_exponent":2.5,"no_data_floor":0,"no_data_floor_on":"rate","failure_statuses":["5xx",429,"404"],
                "failure_grpc_statuses":["INTERNAL",4,"RESOURCE_EXHAUSTED"],
                "concurrency_limit":{"algorithm":"aimd","initial_limit":5,"min_limit":5,"max_limit":5,
                                     "backoff_ratio":0.5,"timeout":"250ms"},"retry_after":"3s"}}"#,
        )
        .unwrap();
        let selection = config.cluster_selection.unwrap();
        assert_eq!(
            selection.failure_statuses,
            vec![StatusMatch::Class(5), StatusMatch::Code(429), StatusMatch::Code(404)]
        );
        assert!(StatusMatch::Class(5).matches(503) && !StatusMatch::Class(5).matches(429));
        assert_eq!(
            selection.failure_grpc_statuses,
            vec![GrpcStatus::INTERNAL, GrpcStatus::DEADLINE_EXCEEDED, GrpcStatus::RESOURCE_EXHAUSTED]
        );
        assert!(selection.summary().contains("failures [5xx, 429, 404] (gRPC [INTERNAL, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED])"));
        let none = Config::parse(br#"{"cluster_selection":{"clusters":["a"],"failure_grpc_statuses":[]}}"#).unwrap();
        assert!(none.cluster_selection.unwrap().failure_grpc_statuses.is_empty());
        assert_eq!(selection.concurrency_limit.timeout.get().get(), 250);
        assert_eq!(selection.decay_factor, 2.0);
        assert_eq!(selection.no_data_floor_on, FloorOn::Rate);
    }

    #[test]
    fn selection_errors_are_named() {
        for (json, expected) in [
            (r#"{"cluster_selection":{}}"#, "cluster_selection: missing field `clusters`"),
            (r#"{"cluster_selection":{"clusters":[]}}"#, "cluster_selection.clusters: must list at least one cluster"),
            (r#"{"cluster_selection":{"clusters":["a","b","a"]}}"#, r#"cluster_selection.clusters[2]: duplicate cluster "a" (also cluster_selection.clusters[0])"#),
            (r#"{"cluster_selection":{"clusters":["a b"]}}"#, r#"cluster_selection.clusters[0]: "a b" is not a valid cluster name"#),
            (r#"{"cluster_selection":{"clusters":[""]}}"#, r#"cluster_selection.clusters[0]: "" is not a valid cluster name"#),
            (r#"{"cluster_selection":{"clusters":[7]}}"#, "cluster_selection.clusters[0]: invalid type: integer `7`"),
            (r#"{"cluster_selection":{"clusters":"a"}}"#, "cluster_selection.clusters: invalid type: string"),
            (r#"{"cluster_selection":{"clusters":["a"],"route_header":"bad header"}}"#, r#"cluster_selection.route_header: "bad header" is not a valid header name"#),
            (r#"{"cluster_selection":{"clusters":["a"],"route_header":":authority"}}"#, "cluster_selection.route_header: must not be a pseudo-header"),
            (r#"{"cluster_selection":{"clusters":["a"],"buckets":0}}"#, "cluster_selection.buckets: must be a positive integer"),
            (r#"{"cluster_selection":{"clusters":["a"],"buckets":61}}"#, "cluster_selection.buckets: must be at most 60, got 61"),
            (r#"{"cluster_selection":{"clusters":["a"],"bucket_width":"0s"}}"#, r#"cluster_selection.bucket_width: "0s" must be longer than zero"#),
            (r#"{"cluster_selection":{"clusters":["a"],"decay_factor":0.5}}"#, "cluster_selection.decay_factor: must be a number from 1 to 1000, got 0.5"),
            (r#"{"cluster_selection":{"clusters":["a"],"weight_exponent":0}}"#, "cluster_selection.weight_exponent: must be a number in (0, 100], got 0"),
            (r#"{"cluster_selection":{"clusters":["a"],"no_data_floor":2}}"#, "cluster_selection.no_data_floor: must be a number in [0, 1], got 2"),
            (r#"{"cluster_selection":{"clusters":["a"],"failure_statuses":[]}}"#, "cluster_selection.failure_statuses: must list at least one"),
            (r#"{"cluster_selection":{"clusters":["a"],"failure_statuses":["6xx"]}}"#, r#"cluster_selection.failure_statuses[0]: "6xx" is not a status code or class"#),
            (r#"{"cluster_selection":{"clusters":["a"],"failure_statuses":[99]}}"#, "cluster_selection.failure_statuses[0]: 99 is not a status code (100 to 599)"),
            (r#"{"cluster_selection":{"clusters":["a"],"failure_grpc_statuses":["UNAVAILABLE","OK"]}}"#, "cluster_selection.failure_grpc_statuses[1]: OK is not a refusal or a failure"),
            (r#"{"cluster_selection":{"clusters":["a"],"failure_grpc_statuses":[503]}}"#, "cluster_selection.failure_grpc_statuses[0]: 503 is not a gRPC status code (1 to 16)"),
            (r#"{"cluster_selection":{"clusters":["a"],"failure_grpc_statuses":"UNAVAILABLE"}}"#, "cluster_selection.failure_grpc_statuses: invalid type: string"),
            (r#"{"cluster_selection":{"clusters":["a"],"concurrency_limit":{"algorithm":"vegas"}}}"#, "cluster_selection.concurrency_limit.algorithm: unknown variant `vegas`"),
            (r#"{"cluster_selection":{"clusters":["a"],"concurrency_limit":{"min_limit":10,"max_limit":5,"initial_limit":5}}}"#, "cluster_selection.concurrency_limit.min_limit: 10 is above max_limit 5"),
            (r#"{"cluster_selection":{"clusters":["a"],"concurrency_limit":{"initial_limit":500}}}"#, "cluster_selection.concurrency_limit.initial_limit: 500 is outside [min_limit, max_limit] = [1, 200]"),
            (r#"{"cluster_selection":{"clusters":["a"],"concurrency_limit":{"backoff_ratio":1}}}"#, "cluster_selection.concurrency_limit.backoff_ratio: must be a number in (0, 1), got 1"),
            (r#"{"cluster_selection":{"clusters":["a"],"concurrency_limit":{"limit":5}}}"#, "cluster_selection.concurrency_limit.limit: unknown field `limit`"),
            (r#"{"cluster_selection":{"clusters":["a"],"concurrency_limit":[5]}}"#, "cluster_selection.concurrency_limit: must be a JSON object"),
            (r#"{"cluster_selection":["a"]}"#, "cluster_selection: must be a JSON object"),
            (r#"{"cluster_selection":{"clusters":["a"],"cluster":"b"}}"#, "cluster_selection.cluster: unknown field `cluster`"),
        ] {
            let err = error_of(json);
            assert!(err.starts_with(expected), "{json}\n  got: {err}\n want: {expected}");
        }
        let many: Vec<String> = (0..65).map(|i| format!("\"c{i}\"")).collect();
        let err = error_of(&format!(r#"{{"cluster_selection":{{"clusters":[{}]}}}}"#, many.join(",")));
        assert_eq!(err, "cluster_selection.clusters: lists 65 clusters; at most 64");
    }
}
