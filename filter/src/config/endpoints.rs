//! `health` and `watchdog`: the two paths the filter answers itself, readiness (the proxy's load
//! and, optionally, the upstream clusters) and liveness (failing while the proxy is degraded in
//! ways a restart cures).
//!
//! Invariant: each path starts with '/' and has no query, spaces or control characters, and the
//! two are not the same path.

use super::values::{DurationMs, Fraction, Positive};
use super::{Config, ConfigError};
use serde::Deserialize;

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

impl Config {
    pub(super) fn validate_watchdog(&self, watchdog: &Watchdog) -> Result<(), ConfigError> {
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
}

/// Checks a path the filter answers itself (`field`: where it is in the configuration).
pub(super) fn check_path(path: &str, field: &str) -> Result<(), ConfigError> {
    let odd = |c: char| c.is_control() || c.is_whitespace() || c == '?' || c == '#';
    if !path.starts_with('/') || path.contains(odd) {
        return Err(ConfigError {
            path: field.into(),
            problem: format!("{path:?} must be a path starting with '/', without query, spaces or control characters"),
        });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
}
