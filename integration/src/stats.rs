//! An Envoy's counters and gauges: the names floodgate gives its metrics, reading `/stats`
//! through the admin API, and waiting for a stat to reach a value.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::client::http_get_blocking;

/// Default stat prefix of the filter's metrics (`stat_prefix` in the configuration).
pub const STAT_PREFIX: &str = "floodgate";

/// The namespace Envoy puts the module's metrics in (shown in `/stats`, not in
/// `/stats/prometheus`).
pub const WASM_CUSTOM_NAMESPACE: &str = "wasmcustom.";

/// Counters and gauges of an Envoy's `/stats` (admin API at `admin`) by name; the module's own
/// are listed both under `wasmcustom.<name>` and under `<name>`.
pub fn stats_of(admin: SocketAddr) -> BTreeMap<String, u64> {
    let (status, body) = http_get_blocking(admin, "/stats").unwrap_or_else(|e| panic!("admin GET /stats: {e}"));
    assert_eq!(status, 200, "GET /stats");
    let mut stats = BTreeMap::new();
    for l in body.lines() {
        let Some((name, value)) = l.rsplit_once(": ") else { continue };
        let Ok(value) = value.trim().parse::<u64>() else { continue };
        if let Some(custom) = name.strip_prefix(WASM_CUSTOM_NAMESPACE) {
            stats.insert(custom.to_string(), value);
        }
        stats.insert(name.to_string(), value);
    }
    stats
}

/// Polls (at most `timeout`) until stat `name` of the Envoy at `admin` equals `expected`;
/// returns its last value. Stats may lag the responses by a moment.
pub fn wait_for_stat_of(admin: SocketAddr, name: &str, expected: u64, timeout: Duration) -> Option<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let v = stats_of(admin).get(name).copied();
        if v == Some(expected) || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Name of a floodgate rate-limit counter with the default stat prefix:
/// `floodgate.rate_limit.<rule>.<counter>` (`allowed`, `rejected`, `skipped`, `contention`,
/// `evictions`), as [`crate::Envoy::stats`] lists it (Envoy's `/stats` page shows it as
/// `wasmcustom.floodgate.rate_limit...`; `/stats/prometheus` as `floodgate_rate_limit_...`).
pub fn rule_stat(rule: &str, counter: &str) -> String {
    format!("{STAT_PREFIX}.rate_limit.{rule}.{counter}")
}
