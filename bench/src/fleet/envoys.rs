//! The real side of `bench/run.sh fleet --envoys`: the traffic of a fleet run sent through real
//! Envoys (one worker each, the built module, the run's configuration) in front of a real
//! upstream, each Envoy calling one of the stack's `floodgate-sync` replicas as the simulated
//! proxy of the same index does. The same schedule ([`Mix::arrival`]: the n-th request's time,
//! proxy and key) goes out open-loop through the bench's paced load ([`paced_routed`]), and every
//! answer goes into the same [`Tally`] the simulated proxies' decisions go into.

use super::compare::Side;
use super::mix::{Arrival, Mix};
use super::sim::KEY_HEADER;
use super::stack::{spent, Stack};
use super::tally::Tally;
use crate::envoy::{Filter, Route, Spec, SYNC_CLUSTER};
use crate::fleet_harness::{paced_routed, Fleet};
use crate::{load, Settings};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The module's counters a cross-check reads, as Envoy names them.
const STATS: [&str; 7] = [
    "wasmcustom.floodgate.global.batches",
    "wasmcustom.floodgate.global.asked",
    "wasmcustom.floodgate.lease.calls",
    "wasmcustom.floodgate.lease.waited",
    "wasmcustom.floodgate.lease.without_store",
    "wasmcustom.floodgate.global.ask_failures",
    "wasmcustom.floodgate.lease.failures",
];

/// Starts `proxies` Envoys of one worker each running the module with `config` in front of
/// `upstream`, Envoy `i` calling `syncs[i % len]`; they may run on every CPU.
pub fn start(s: &Settings, config: &str, proxies: usize, upstream: SocketAddr, syncs: &[SocketAddr]) -> Result<Fleet, String> {
    let cpus = format!("0-{}", s.cpus.saturating_sub(1));
    let specs = (0..proxies)
        .map(|i| Spec {
            filter: Filter::Wasm { module: s.floodgate_wasm.clone(), config: config.to_owned() },
            route: Route::Fixed,
            clusters: [upstream; 3],
            http2: false,
            concurrency: 1,
            cpus: cpus.clone(),
            wrapper: Vec::new(),
            services: vec![(SYNC_CLUSTER, syncs[i % syncs.len().max(1)])],
        })
        .collect();
    Fleet::of_each(s, specs)
}

/// The module's counters of [`STATS`], summed over the fleet.
fn stats(fleet: &Fleet) -> [u64; 7] {
    let mut out = [0; 7];
    for (i, name) in STATS.iter().enumerate() {
        out[i] = fleet.envoys.iter().filter_map(|e| e.stat(name)).sum();
    }
    out
}

/// Unix ms now.
pub fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Sends `seconds` of `mix` through `fleet` with keys `<prefix>-<index>`, the store emptied
/// first and the traffic starting `phase_ms` into a window.
pub async fn run(stack: &Arc<Mutex<Stack>>, fleet: &Fleet, mut mix: Mix, seconds: f64, prefix: &str, phase_ms: u64) -> Result<(Side, String), String> {
    let end_us = (seconds * 1e6) as u64;
    let mut arrivals: Vec<Arrival> = Vec::new();
    for n in 0.. {
        let a = mix.arrival(n);
        if a.at_us >= end_us {
            break;
        }
        arrivals.push(a);
    }
    let requests: Vec<(usize, Vec<u8>)> = arrivals.iter().map(|a| (a.proxy, load::request("/", &[(KEY_HEADER, format!("{prefix}-{}", a.key))]))).collect();
    let addrs = fleet.addrs();
    stack.lock().map_err(|_| "stack lock")?.flush()?;
    tokio::time::sleep(Duration::from_millis(super::compare::until_phase(wall_ms(), mix.window_ms, phase_ms))).await;
    let before = stack.lock().map_err(|_| "stack lock")?.snapshot();
    let stats_before = stats(fleet);
    let start_wall = wall_ms();
    let sent = paced_routed(&addrs, mix.rate, Duration::from_micros(end_us), |i| requests.get(i as usize).cloned().unwrap_or((usize::MAX, Vec::new()))).await;
    let after = stack.lock().map_err(|_| "stack lock")?.snapshot();
    let stats_after = stats(fleet);
    let d = |i: usize| stats_after[i].saturating_sub(stats_before[i]);
    let spent = spent(&before, &after);
    let mut tally = Tally::new(mix.limit, mix.window_ms);
    let mut side = Side::default();
    let mut others = std::collections::BTreeMap::new();
    for s in &sent {
        let Some(a) = arrivals.get(s.n as usize) else { continue };
        // Decided about when the answer came (the upstream answers at once), as the simulation counts.
        let wall = start_wall + s.done.as_millis() as u64;
        match s.status {
            200 => tally.admit(a.key, wall),
            429 => {
                tally.refuse(a.key, wall);
            }
            status => {
                side.other += 1;
                *others.entry(status).or_insert(0u64) += 1;
            }
        }
        side.lateness_ms = side.lateness_ms.max(s.done.saturating_sub(s.due).as_secs_f64() * 1000.0);
    }
    side.requests = arrivals.len() as u64;
    side.other += side.requests.saturating_sub(sent.len() as u64);
    side.admitted = tally.admitted;
    side.refused = tally.refused;
    side.summary = tally.summary();
    side.windows = tally.per_window(start_wall / tally.window_ms());
    side.sync_batches = spent.sync_batches;
    side.sync_leases = spent.sync_leases;
    side.module = [d(0), d(1), d(2)];
    side.waited = d(1) + d(3);
    side.without_store = d(4) + d(5);
    side.redis_commands = spent.commands;
    let note = if others.is_empty() && d(6) == 0 {
        String::new()
    } else {
        format!(
            "statuses other than 200 and 429: {}; lease.failures {}",
            others.iter().map(|(k, v)| format!("{k}×{v}")).collect::<Vec<_>>().join(" "),
            d(6)
        )
    };
    Ok((side, note))
}
