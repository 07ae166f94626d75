//! Measurement 5, part (f): the three ways a fleet can share a quota, side by side on
//! the same traffic, one after the other in one run: `batched` (the default global scope),
//! `leased` (units taken from the store ahead of use) and a store call on every request (leased
//! with `max_lease: 1`, what Envoy's global rate limit service and Higress's cluster rate limit
//! do), with the same rule in proxy scope as the baseline of latency and CPU.
//!
//! The traffic: paced (open loop) over the three proxies, half of it on one hot key at twice its
//! limit, the other half spread over 200 keys (each a few requests a second, far under the
//! limit). For each mode: the hot key's admitted total against the limit, store calls (HTTP
//! calls to `floodgate-sync`) and Redis scripts per request, the fraction of requests that
//! waited for the store, the latency of admitted requests (p50, p99) and what it adds to proxy
//! scope's, and the Envoys' CPU time per request against proxy scope's, over `--rounds` rounds.
//! Each `--extra-wasm` module runs `leased` once more per round, as a row of its own (another
//! build of the filter, side by side with this one).

use crate::envoy::{cpu_ns_of, http_get, SYNC_CLUSTER};
use crate::fleet_harness::{fit_in_window, paced, run_id, Fleet, Sent};
use crate::load;
use crate::services::{Redis, Sync};
use crate::table::{count, median, range, Table};
use crate::{progress, Settings};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;

/// Keys sharing the other half of the traffic.
const COLD_KEYS: u64 = 200;

/// How the rule shares its quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Proxy,
    Batched,
    Leased,
    PerRequest,
}

impl Mode {
    const ALL: [Mode; 4] = [Mode::Proxy, Mode::Batched, Mode::Leased, Mode::PerRequest];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Proxy => "proxy scope (baseline)",
            Mode::Batched => "global, batched",
            Mode::Leased => "global, leased",
            Mode::PerRequest => "global, a store call per request",
        }
    }

    pub(crate) fn config(self, limit: u64) -> Value {
        let mut rule = json!({"name": "paid", "key": [{"header": "x-api-key"}], "limit": limit, "window": "1h"});
        let mut global = json!({"cluster": SYNC_CLUSTER, "sync_interval": "100ms"});
        match self {
            Mode::Proxy => return json!({"rate_limits": [rule]}),
            Mode::Batched => rule["scope"] = json!("global"),
            Mode::Leased | Mode::PerRequest => {
                rule["scope"] = json!("global");
                rule["consistency"] = json!("leased");
            }
        }
        if self == Mode::PerRequest {
            global["max_lease"] = json!(1);
        }
        json!({"rate_limits": [rule], "global": global})
    }
}

/// What one mode's run measured.
struct Run {
    sent: Vec<Sent>,
    hot_admitted: u64,
    store_calls: u64,
    scripts: u64,
    waited: u64,
    envoy_ns: u64,
}

/// The count of `floodgate-sync`'s answers so far (batches and lease calls), from `/metrics`.
fn sync_calls(sync: &Sync) -> u64 {
    let Ok((_, text)) = http_get(sync.addr, "/metrics") else { return 0 };
    text.lines()
        .filter(|l| l.starts_with("floodgate_sync_request_duration_seconds_count") || l.starts_with("floodgate_sync_lease_duration_seconds_count"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// Latency quantile of the admitted requests, in ms (from when each was due: the generator's
/// own lateness is in every mode alike).
pub(crate) fn latency_ms(sent: &[Sent], q: f64) -> f64 {
    let mut ms: Vec<f64> = sent.iter().filter(|s| s.status == 200).map(|s| s.done.saturating_sub(s.due).as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    ms.get(((ms.len() as f64 - 1.0) * q).round().max(0.0) as usize).copied().unwrap_or(0.0)
}

/// The traffic of every mode: the hot key's limit, the rate (req/s), the seconds measured.
#[derive(Clone, Copy)]
pub(crate) struct Traffic {
    pub(crate) limit: u64,
    pub(crate) rate: f64,
    pub(crate) seconds: u64,
}

impl Traffic {
    /// Part (f)'s: 1 200 req/s for 15 s (600 for 6 s with `--quick`).
    pub(crate) fn of(s: &Settings) -> Traffic {
        if s.quick {
            Traffic::at(600, 6)
        } else {
            Traffic::at(1200, 15)
        }
    }

    /// `rate` req/s for `seconds`, the hot key's limit half of what it gets.
    pub(crate) fn at(rate: u64, seconds: u64) -> Traffic {
        Traffic { limit: (rate / 2) * seconds / 2, rate: rate as f64, seconds }
    }
}

/// What one run of the traffic gave: every request, the hot key's admitted count, and the
/// counters `take` read just before and just after it.
pub(crate) struct Shared<T> {
    pub(crate) sent: Vec<Sent>,
    pub(crate) hot_admitted: u64,
    pub(crate) before: T,
    pub(crate) after: T,
}

/// The traffic on the fleet at `addrs`, on keys of its own: 1 s of warm-up on other keys (the
/// connections, the module's first calls), then every other request on one hot key, the others
/// over [`COLD_KEYS`] keys, paced; `take` reads the counters around it.
pub(crate) async fn shared_traffic<T>(addrs: &[SocketAddr], traffic: Traffic, take: impl Fn() -> T) -> Shared<T> {
    let Traffic { rate, seconds, .. } = traffic;
    let id = run_id();
    fit_in_window(Duration::from_secs(seconds + 10)).await;
    let _ = paced(addrs, rate, Duration::from_secs(1), |i| load::request("/", &[("x-api-key", format!("{id}-warm-{}", i % 50))])).await;
    let before = take();
    let hot = format!("{id}-hot");
    let sent = paced(addrs, rate, Duration::from_secs(seconds), |i| {
        let key = if i % 2 == 0 { hot.clone() } else { format!("{id}-cold-{}", (i / 2) % COLD_KEYS) };
        load::request("/", &[("x-api-key", key)])
    })
    .await;
    let after = take();
    let hot_admitted = sent.iter().enumerate().filter(|(_, x)| x.status == 200).filter(|(i, _)| i % 2 == 0).count() as u64;
    Shared { sent, hot_admitted, before, after }
}

async fn one_mode(s: &Settings, mode: Mode, traffic: Traffic, redis: &Redis, sync: &Sync, upstream: SocketAddr) -> Result<Run, String> {
    let fleet = Fleet::start(s, &mode.config(traffic.limit), upstream, sync.addr)?;
    let take = || {
        (
            sync_calls(sync),
            redis.counts().map(|c| c.scripts).unwrap_or(0),
            fleet.pids().iter().map(|&p| cpu_ns_of(p)).sum::<u64>(),
            fleet.envoys.iter().filter_map(|e| e.stat("wasmcustom.floodgate.lease.waited")).sum::<u64>(),
        )
    };
    let run = shared_traffic(&fleet.addrs(), traffic, take).await;
    let ((calls0, scripts0, cpu0, waited0), (calls1, scripts1, cpu1, waited1)) = (run.before, run.after);
    Ok(Run {
        hot_admitted: run.hot_admitted,
        store_calls: calls1.saturating_sub(calls0),
        scripts: scripts1.saturating_sub(scripts0),
        waited: waited1.saturating_sub(waited0),
        envoy_ns: cpu1.saturating_sub(cpu0),
        sent: run.sent,
    })
}

/// Part (f): every configuration once per round (`--rounds`), in an order rotated from round
/// to round, each on a fresh fleet; medians over the rounds, and each configuration's CPU over
/// proxy scope's taken within each round (the VM's speed drifts between rounds).
pub async fn modes(s: &Settings, redis: &Redis, sync: &Sync, upstream: SocketAddr) -> Result<(), String> {
    let traffic = Traffic::of(s);
    let Traffic { limit, rate, seconds } = traffic;
    // This module's modes, then `leased` with each extra module.
    let extras = s.extra.iter().enumerate().map(|(n, (wasm, _))| {
        let name = format!("global, leased (ext{}: {})", n + 1, wasm.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned()));
        (Mode::Leased, name, Some(wasm.clone()))
    });
    let plan: Vec<(Mode, String, Option<std::path::PathBuf>)> = Mode::ALL.iter().map(|m| (*m, m.name().to_string(), None)).chain(extras).collect();
    // runs[configuration][round]
    let mut runs: Vec<Vec<Run>> = plan.iter().map(|_| Vec::new()).collect();
    for round in 0..s.rounds.max(1) {
        for k in 0..plan.len() {
            let i = (k + round) % plan.len();
            let (mode, name, wasm) = &plan[i];
            let settings = wasm.as_ref().map(|w| Settings { floodgate_wasm: w.clone(), ..s.clone() });
            let run = one_mode(settings.as_ref().unwrap_or(s), *mode, traffic, redis, sync, upstream).await?;
            progress!(
                "round {}/{} {name}: hot key {} admitted of limit {limit}; {} store calls, {} waited, p99 {:.2} ms, Envoy {:.0} µs/req",
                round + 1,
                s.rounds.max(1),
                run.hot_admitted,
                run.store_calls,
                run.waited,
                latency_ms(&run.sent, 0.99),
                run.envoy_ns as f64 / run.sent.len().max(1) as f64 / 1000.0
            );
            runs[i].push(run);
        }
    }
    let per_request = |r: &Run, n: u64| n as f64 / r.sent.len().max(1) as f64;
    let med = |rs: &[Run], f: &dyn Fn(&Run) -> f64| median(&rs.iter().map(f).collect::<Vec<_>>());
    let base = &runs[0];
    let (base_p50, base_p99) = (med(base, &|r| latency_ms(&r.sent, 0.5)), med(base, &|r| latency_ms(&r.sent, 0.99)));
    let mut t = Table::new(&[
        "mode",
        "hot key admitted ÷ limit (median; range)",
        "store calls / request",
        "Redis scripts / request",
        "requests that waited",
        "latency p50 (added)",
        "latency p99 (added)",
        "Envoy CPU / request",
        "× proxy scope (median; range)",
    ]);
    for ((mode, name, _), rs) in plan.iter().zip(&runs) {
        let hot: Vec<f64> = rs.iter().map(|r| r.hot_admitted as f64).collect();
        let (hot_lo, hot_hi) = range(&hot);
        let (p50, p99) = (med(rs, &|r| latency_ms(&r.sent, 0.5)), med(rs, &|r| latency_ms(&r.sent, 0.99)));
        let ns = med(rs, &|r| per_request(r, r.envoy_ns));
        // Within each round: this configuration's CPU over proxy scope's.
        let ratios: Vec<f64> = rs.iter().zip(base).map(|(r, b)| per_request(r, r.envoy_ns) / per_request(b, b.envoy_ns).max(1.0)).collect();
        let (lo, hi) = range(&ratios);
        let (calls, scripts) = if *mode == Mode::Proxy {
            ("—".to_string(), "—".to_string())
        } else {
            (format!("{:.3}", med(rs, &|r| per_request(r, r.store_calls))), format!("{:.3}", med(rs, &|r| per_request(r, r.scripts))))
        };
        t.row(vec![
            name.clone(),
            format!("{} ({:.4}; {}–{})", count(median(&hot) as u64), median(&hot) / limit as f64, count(hot_lo as u64), count(hot_hi as u64)),
            calls,
            scripts,
            format!("{:.1} %", 100.0 * med(rs, &|r| per_request(r, r.waited))),
            format!("{p50:.2} ms ({:+.2})", p50 - base_p50),
            format!("{p99:.2} ms ({:+.2})", p99 - base_p99),
            format!("{:.0} µs", ns / 1000.0),
            format!("{:.2} × ({lo:.2}–{hi:.2})", median(&ratios)),
        ]);
    }
    println!("### (f) Batched, leased, or a store call per request: the same traffic\n");
    println!(
        "Paced at {rate:.0} req/s over the {} proxies for {seconds} s, after 1 s of warm-up on other keys: every other request on one hot key whose \
         limit ({limit} per hour) is half of what it gets, the others over {COLD_KEYS} keys far under it. {} rounds, each configuration once per \
         round on a fresh fleet, in an order rotated from round to round; medians over the rounds. Store calls: HTTP calls to floodgate-sync \
         (batches and lease calls); latency: admitted requests, from when each was due; CPU: the three Envoys' CPU time (all pinned to core 0) \
         over the requests sent, and over proxy scope's in the same round. Proxy scope admits the hot key's limit on each proxy (3 × the limit).\n",
        crate::fleet_harness::PROXIES,
        s.rounds.max(1)
    );
    println!("{}\n", t.render());
    Ok(())
}
