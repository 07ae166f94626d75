//! Envoy's stats behind [`Metrics`]: every VM that defines a name gets the same stat, shown in
//! `/stats` as `wasmcustom.<name>`.

use crate::pipeline::stats::{MetricKind, Metrics};
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Envoy's stats, through proxy-wasm's metric calls.
pub struct EnvoyMetrics;

impl Metrics for EnvoyMetrics {
    fn define(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        match hostcalls::define_metric(kind, name) {
            Ok(id) => Some(id),
            Err(status) => {
                log::warn!("metric {name} could not be defined: {status:?}");
                None
            }
        }
    }

    fn add(&self, id: u32, delta: i64) {
        if let Err(status) = hostcalls::increment_metric(id, delta) {
            log::debug!("metric {id} not moved: {status:?}");
        }
    }

    fn record(&self, id: u32, value: u64) {
        if let Err(status) = hostcalls::record_metric(id, value) {
            log::debug!("metric {id} not set: {status:?}");
        }
    }
}
