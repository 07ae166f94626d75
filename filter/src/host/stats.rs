//! Every metric the filter defines, in one place. Envoy 1.40 shows them in `/stats` under
//! `wasmcustom.<name>`, and in `/stats/prometheus` as `<name>` with dots and dashes turned into
//! underscores (`floodgate_rate_limit_per_api_key_allowed`).
//!
//! | name | type | meaning |
//! |---|---|---|
//! | `<prefix>.rate_limit.<rule>.allowed` | counter | requests the rule admitted (and the request went on) |
//! | `<prefix>.rate_limit.<rule>.rejected` | counter | requests the rule refused with 429 |
//! | `<prefix>.rate_limit.<rule>.skipped` | counter | requests lacking a key part (`missing_key: skip`) |
//! | `<prefix>.rate_limit.<rule>.contention` | counter | requests refused because the counters could not be updated (CAS attempts ran out) |
//! | `<prefix>.rate_limit.<rule>.evictions` | counter | live keys evicted from a full table slot set |

use crate::config::Config;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Metric ids of one rule.
#[derive(Clone, Copy, Debug, Default)]
pub struct RuleStats {
    /// Admitted.
    pub allowed: Option<u32>,
    /// Refused.
    pub rejected: Option<u32>,
    /// Key part missing.
    pub skipped: Option<u32>,
    /// CAS attempts exhausted.
    pub contention: Option<u32>,
    /// Live entries evicted.
    pub evictions: Option<u32>,
}

/// All metric ids, defined once per configuration.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Per rule, in configuration order.
    pub rules: Vec<RuleStats>,
}

fn counter(name: &str) -> Option<u32> {
    match hostcalls::define_metric(MetricType::Counter, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("metric {name} could not be defined: {status:?}");
            None
        }
    }
}

impl Stats {
    /// Defines every metric of `config`.
    pub fn define(config: &Config) -> Stats {
        let prefix = config.stat_prefix.as_str();
        let rules = config
            .rate_limits
            .iter()
            .map(|rule| {
                let name = |what: &str| format!("{prefix}.rate_limit.{}.{what}", rule.name);
                RuleStats {
                    allowed: counter(&name("allowed")),
                    rejected: counter(&name("rejected")),
                    skipped: counter(&name("skipped")),
                    contention: counter(&name("contention")),
                    evictions: counter(&name("evictions")),
                }
            })
            .collect();
        Stats { rules }
    }

    /// The ids of rule `index` (all absent for an unknown index).
    pub fn rule(&self, index: usize) -> RuleStats {
        self.rules.get(index).copied().unwrap_or_default()
    }
}

/// Adds one to a counter.
pub fn increment(id: Option<u32>) {
    if let Some(id) = id {
        if let Err(status) = hostcalls::increment_metric(id, 1) {
            log::debug!("metric {id} not incremented: {status:?}");
        }
    }
}
