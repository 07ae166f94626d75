//! `load_shedding`: the proxy-wide in-flight limit, the event-loop lag limit and the priority
//! classes they shed by. Its `per_key` cap is in `bulkhead.rs`, its `queue` in `leveling.rs`.
//!
//! Invariant: a checked section has a limit (in flight, lag or per key), distinct class names
//! and a default class among them.

use super::values::{DurationMs, Fraction, Name, Positive};
use super::{bulkhead, earlier_duplicate, flows, header_name, leveling, ClassQueue, Config, ConfigError, Flow, Mode, PerKey, Queue};
use serde::Deserialize;

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
    /// Fair shares between flows, in every class without its own `flow`.
    #[serde(default)]
    pub flow: Option<Flow>,
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
    /// Fair shares between the class's flows (instead of `load_shedding.flow`).
    #[serde(default)]
    pub flow: Option<Flow>,
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
            flow: None,
        })
        .collect()
}

fn default_class() -> Name {
    Name::trusted("normal")
}

fn default_retry_after() -> DurationMs {
    DurationMs::from_ms(1000).unwrap_or(DurationMs::MIN)
}

impl Config {
    pub(super) fn validate_shedding(&self, shedding: &LoadShedding) -> Result<(), ConfigError> {
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
        leveling::validate(shedding)?;
        flows::validate(shedding)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
}
