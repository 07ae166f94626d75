//! Measurement `fleet` (not part of `all`): the global scope across 10 to 1 000 proxies. Each
//! simulated proxy runs the module's own code natively ([`sim`]: its shared data, 2 to 8
//! workers, each a `Filter` as a VM) and calls two real `floodgate-sync` replicas over HTTP/2
//! ([`calls`]), in front of a real Redis Cluster of 3 masters and 3 replicas ([`stack`]), all on
//! 127.0.0.1, on the real clock. The traffic mixes are in [`mix`]; every decision is checked
//! against the limit in [`tally`].
//!
//! Per run: what the fleet admitted per key and window against the limit, refusals while the
//! fleet had room, store calls and Redis commands and bytes per 1 000 requests, CPU of Redis,
//! `floodgate-sync` and the tool per 1 000 requests, the added latency of requests that waited,
//! and, with `--events`, a rolling restart of the fleet, a Redis master failover, or the
//! `floodgate-sync` replicas restarted mid-run.
//!
//! With `--envoys`, each configuration runs twice, one worker per proxy: through real Envoys
//! loading the built module ([`envoys`]) and through the simulated proxies, the same schedule of
//! keys, proxies and times, the store emptied before each and each starting at the same point
//! of its window; [`compare`] sets the two side by side.

mod calls;
mod compare;
mod envoys;
mod mix;
mod sim;
mod stack;
mod tally;

use crate::table::{count, Table};
use crate::Settings;
use mix::{Mix, MixKind};
use sim::Fleet;
use stack::{spent, Stack};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tally::Tally;

/// `sync_interval` of the configurations.
const SYNC_INTERVAL_MS: u64 = 100;

/// What `bench/run.sh fleet` runs.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    /// Fleet sizes.
    pub proxies: Vec<usize>,
    /// Workers per proxy.
    pub workers: usize,
    /// Mixes.
    pub mixes: Vec<String>,
    /// Consistencies.
    pub consistencies: Vec<String>,
    /// Seconds of traffic per run.
    pub seconds: f64,
    /// Fleet-wide requests per second (default: each mix's own).
    pub rate: Option<f64>,
    /// Fleet events, one run each: `restart`, `failover`, `sync-restart`, `steady` (none).
    pub events: Vec<String>,
    /// Each configuration through real Envoys too, side by side with the simulated proxies.
    pub envoys: bool,
    /// VMs per simulated proxy that serve no request but tick (Envoy's main thread's).
    pub idle_vms: usize,
    /// `global.on_store_failure` of the leased runs.
    pub on_store_failure: String,
    /// `floodgate-sync --replica-acks` of the replicas.
    pub replica_acks: u32,
}

impl Default for FleetOptions {
    fn default() -> FleetOptions {
        FleetOptions {
            proxies: vec![10, 100],
            workers: 4,
            mixes: vec!["hot".into(), "users".into()],
            consistencies: vec!["batched".into(), "leased".into()],
            seconds: 20.0,
            rate: None,
            events: Vec::new(),
            envoys: false,
            idle_vms: 0,
            on_store_failure: "last_state".into(),
            replica_acks: 0,
        }
    }
}

/// A fleet event during a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    /// None.
    Steady,
    /// Every proxy restarted, one after another, from 20 % to 80 % of the run.
    Restart,
    /// A Redis master killed at a third of the run; its replica takes over.
    Failover,
    /// Both `floodgate-sync` replicas killed and started again, at a third and at half the run.
    SyncRestart,
}

impl Event {
    fn parse(name: &str) -> Option<Event> {
        match name {
            "restart" => Some(Event::Restart),
            "failover" => Some(Event::Failover),
            "sync-restart" => Some(Event::SyncRestart),
            "steady" => Some(Event::Steady),
            _ => None,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Event::Steady => "-",
            Event::Restart => "rolling restart",
            Event::Failover => "master failover",
            Event::SyncRestart => "sync restarts",
        }
    }
}

/// One run's figures.
struct RunResult {
    proxies: usize,
    consistency: String,
    mix: Mix,
    event: Event,
    requests: u64,
    /// Send lateness of the open loop at its worst (the tool falling behind), ms.
    lateness_ms: f64,
    tally: Tally,
    calls: sim::CallCounts,
    spent: stack::Spent,
    asked: i64,
    lease_waits: i64,
    /// Decisions without the store: leased `without_store`, batched asks that got no answer.
    without_store: i64,
    /// Lease calls the module counted as failed (`lease.failures`).
    lease_failures: i64,
    abandoned: u64,
    event_note: String,
    /// Leased keys sampled: holders of each in its current bucket, as `GET /v1/holders` gives.
    holders: Vec<usize>,
    /// Unix ms when the traffic started.
    start_wall_ms: u64,
}

/// Runs the measurement.
pub async fn run(s: &Settings) {
    if let Err(e) = run_fallible(s).await {
        println!("\n## Fleet\n\nnot measured: {e}\n");
    }
}

async fn run_fallible(s: &Settings) -> Result<(), String> {
    let o = &s.fleet;
    let mixes: Vec<MixKind> = o.mixes.iter().map(|m| MixKind::parse(m).ok_or(format!("unknown mix {m:?}"))).collect::<Result<_, _>>()?;
    let events: Vec<Event> = if o.events.is_empty() {
        vec![Event::Steady]
    } else {
        o.events.iter().map(|e| Event::parse(e).ok_or(format!("unknown event {e:?}"))).collect::<Result<_, _>>()?
    };
    crate::progress!("start a Redis Cluster (3 masters, 3 replicas) and 2 floodgate-sync replicas (--replica-acks {})", o.replica_acks);
    let stack = Arc::new(Mutex::new(Stack::start(&s.redis_server, &s.sync_bin, o.replica_acks)?));
    if o.envoys {
        return crosscheck(s, &stack, &mixes).await;
    }
    let mut results = Vec::new();
    let mut run_id = 0;
    for &proxies in &o.proxies {
        for consistency in &o.consistencies {
            for &kind in &mixes {
                for &event in &events {
                    run_id += 1;
                    let rate = o.rate.unwrap_or(match kind {
                        MixKind::Hot | MixKind::Zipf => 2000.0,
                        MixKind::Users => 1000.0,
                    });
                    let mix = Mix::new(kind, rate, proxies, 0x5eed + run_id);
                    crate::progress!("{proxies} proxies × {} workers, {consistency}, {} ({}), {}: {} s", o.workers, kind.name(), mix.describe(), event.name(), o.seconds);
                    // The fleet size floodgate-sync counts covers the last 3 s: the previous
                    // run's proxies leave it first.
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    match one_run(o, &stack, proxies, consistency, mix, event, run_id, &format!("r{run_id}"), None).await {
                        Ok(r) => {
                            crate::progress!("{} requests, {} admitted, {} refused ({} with room), {} store calls", r.requests, r.tally.admitted, r.tally.refused, r.tally.refused_with_room, r.calls.sent.iter().sum::<u64>());
                            results.push(r);
                        }
                        Err(e) => println!("run {run_id} ({proxies} proxies, {consistency}, {}): {e}\n", kind.name()),
                    }
                }
            }
        }
    }
    print_tables(s, &results);
    Ok(())
}

/// The configuration of a run: one rule keyed on the key header, in global scope.
fn config(o: &FleetOptions, consistency: &str, limit: u32, window_ms: u64) -> String {
    serde_json::json!({
        "rate_limits": [{"name": "fleet", "key": [{"header": sim::KEY_HEADER}], "limit": limit, "window": format!("{}s", window_ms / 1000),
                         "scope": "global", "consistency": consistency}],
        "global": {"cluster": "floodgate-sync", "sync_interval": format!("{SYNC_INTERVAL_MS}ms"), "on_store_failure": o.on_store_failure},
    })
    .to_string()
}

/// One run of the simulated fleet, keys named `<prefix>-<index>`. With `phase_ms`, the store is
/// emptied first and the traffic starts that far into a window (a cross-check's run).
#[allow(clippy::too_many_arguments)]
async fn one_run(o: &FleetOptions, stack: &Arc<Mutex<Stack>>, proxies: usize, consistency: &str, mut mix: Mix, event: Event, run_id: u64, prefix: &str, phase_ms: Option<u64>) -> Result<RunResult, String> {
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let addrs = stack.lock().map_err(|_| "stack lock")?.addrs();
    let tally = Tally::new(mix.limit, mix.window_ms);
    let local = tokio::task::LocalSet::new();
    if let Some(phase_ms) = phase_ms {
        stack.lock().map_err(|_| "stack lock")?.flush()?;
        tokio::time::sleep(Duration::from_millis(compare::until_phase(envoys::wall_ms(), mix.window_ms, phase_ms))).await;
    }
    local
        .run_until(async move {
            let mut fleet = Fleet::new(&config(o, consistency, mix.limit, mix.window_ms), proxies, o.workers.max(1), o.idle_vms, &addrs, prefix, tally, done_tx, run_id)?;
            let before = stack.lock().map_err(|_| "stack lock")?.snapshot();
            let start_wall_ms = envoys::wall_ms();
            let start = Instant::now();
            let end_us = (o.seconds * 1e6) as u64;
            let mut n: u64 = 0;
            let mut next = mix.arrival(0);
            let mut lateness_us: u64 = 0;
            let mut restarted = 0usize;
            let mut background: Vec<tokio::task::JoinHandle<Result<String, String>>> = Vec::new();
            let mut fired = [false; 2];
            let mut holders = None;
            loop {
                while let Ok(done) = done_rx.try_recv() {
                    fleet.answered(done);
                }
                let el = start.elapsed().as_micros() as u64;
                let mut burst = 0;
                while next.at_us <= el && next.at_us < end_us && burst < 2000 {
                    lateness_us = lateness_us.max(el - next.at_us);
                    fleet.request(next.proxy, next.key);
                    n += 1;
                    next = mix.arrival(n);
                    burst += 1;
                }
                fleet.run_ticks();
                // Events.
                let frac = el as f64 / end_us as f64;
                match event {
                    Event::Steady => {}
                    Event::Restart => {
                        // Proxy i restarts at 20 % + 60 % × i / P of the run.
                        while restarted < proxies && frac >= 0.2 + 0.6 * restarted as f64 / proxies as f64 {
                            fleet.restart(restarted)?;
                            restarted += 1;
                        }
                    }
                    Event::Failover if !fired[0] && frac >= 1.0 / 3.0 => {
                        fired[0] = true;
                        let stack = Arc::clone(stack);
                        background.push(tokio::task::spawn_blocking(move || {
                            let took = stack.lock().map_err(|_| "stack lock")?.fail_a_master()?;
                            Ok(format!("a master killed at {:.1} s; the cluster ok again {:.1} s later", frac * end_us as f64 / 1e6, took.as_secs_f64()))
                        }));
                    }
                    Event::SyncRestart => {
                        for (i, at) in [1.0 / 3.0, 0.5].into_iter().enumerate() {
                            if !fired[i] && frac >= at {
                                fired[i] = true;
                                let stack = Arc::clone(stack);
                                background.push(tokio::task::spawn_blocking(move || {
                                    let t = Instant::now();
                                    stack.lock().map_err(|_| "stack lock")?.syncs[i].restart()?;
                                    Ok(format!("replica {i} killed at {:.1} s, serving again {:.2} s later", at * end_us as f64 / 1e6, t.elapsed().as_secs_f64()))
                                }));
                            }
                        }
                    }
                    Event::Failover => {}
                }
                if el >= end_us && holders.is_none() {
                    // As the traffic stops: who holds the sampled leased keys (read aside: the
                    // fleet's loop goes on meanwhile).
                    let (sync, keys) = (addrs[0], fleet.leased_keys.clone());
                    holders = Some(tokio::task::spawn_blocking(move || keys.iter().filter_map(|(key, window_ms)| holders_of(sync, key, *window_ms)).collect::<Vec<usize>>()));
                }
                if el >= end_us && ((fleet.paused() == 0 && fleet.in_flight == 0) || el >= end_us + 3_000_000) {
                    break;
                }
                // Until the next arrival, the next tick or an answer, at most 1 ms.
                let tick_in = fleet.next_tick().map_or(1000, |t| t.saturating_sub(fleet.now().mono.0) * 1000);
                let wait = next.at_us.saturating_sub(start.elapsed().as_micros() as u64).min(tick_in).min(1000);
                if wait > 0 {
                    tokio::select! {
                        done = done_rx.recv() => if let Some(done) = done { fleet.answered(done) },
                        _ = tokio::time::sleep(Duration::from_micros(wait)) => {}
                    }
                }
            }
            let holders = match holders {
                Some(handle) => handle.await.unwrap_or_default(),
                None => Vec::new(),
            };
            let mut notes = Vec::new();
            for handle in background {
                match handle.await {
                    Ok(Ok(note)) => notes.push(note),
                    Ok(Err(e)) => notes.push(format!("event failed: {e}")),
                    Err(e) => notes.push(format!("event failed: {e}")),
                }
            }
            if event == Event::Restart {
                notes.push(format!("{restarted} proxies restarted from {:.0} s to {:.0} s", o.seconds * 0.2, o.seconds * 0.8));
            }
            let after = stack.lock().map_err(|_| "stack lock")?.snapshot();

            let calls = std::mem::take(&mut fleet.calls);
            let metrics = fleet.metrics();
            Ok(RunResult {
                proxies,
                consistency: consistency.to_owned(),
                event,
                requests: n,
                lateness_ms: lateness_us as f64 / 1000.0,
                calls,
                spent: spent(&before, &after),
                asked: metrics.get("floodgate.global.asked"),
                lease_waits: metrics.get("floodgate.lease.waited"),
                without_store: metrics.get("floodgate.lease.without_store") + metrics.get("floodgate.global.ask_failures"),
                lease_failures: metrics.get("floodgate.lease.failures"),
                abandoned: fleet.abandoned,
                event_note: notes.join("; "),
                holders,
                start_wall_ms,
                tally: std::mem::replace(&mut fleet.tally, Tally::new(1, 1)),
                mix,
            })
        })
        .await
}

/// The holders of leased `key` (`GET /v1/holders`): the most in its current bucket or the one
/// before.
fn holders_of(sync: std::net::SocketAddr, key: &str, window_ms: u64) -> Option<usize> {
    let (status, body) = crate::envoy::http_get(sync, &format!("/v1/holders?key={key}&window_ms={window_ms}")).ok()?;
    if status != 200 {
        return None;
    }
    let answer: serde_json::Value = serde_json::from_str(&body).ok()?;
    answer.get("buckets")?.as_array()?.iter().filter_map(|b| b.get("holders")?.as_array().map(Vec::len)).max()
}

/// Per 1 000 requests.
pub(super) fn per_k(x: f64, requests: u64) -> String {
    if requests == 0 {
        return "-".into();
    }
    let v = x * 1000.0 / requests as f64;
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn print_tables(s: &Settings, results: &[RunResult]) {
    let o = &s.fleet;
    println!(
        "## Fleet: the global scope over simulated proxies\n\nEach proxy runs the module's code natively ({} workers, each a VM with its own filter; one shared data per proxy), \
         calling 2 floodgate-sync replicas over HTTP/2 (one connection per proxy) in front of a Redis Cluster of 3 masters + 3 replicas, all on 127.0.0.1; \
         `sync_interval` {SYNC_INTERVAL_MS} ms, default `lease_timeout`; {} s of open-loop traffic per run.\n",
        o.workers, o.seconds
    );
    let mut t = Table::new(&["proxies", "consistency", "mix", "event", "requests", "admitted", "fullest window / L (p50, p99, max)", "windows over L", "largest over", "peak sliding − L", "refused with room (largest room)"]);
    for r in results {
        let sum = r.tally.summary();
        t.row(vec![
            r.proxies.to_string(),
            r.consistency.clone(),
            r.mix.describe(),
            r.event.name().into(),
            count(r.requests),
            count(r.tally.admitted),
            format!("{:.3}, {:.3}, {:.3}", sum.fullest[0], sum.fullest[1], sum.fullest[2]),
            format!("{} of {} keys", sum.keys_over, sum.keys),
            count(sum.largest_over),
            format!("{:.1}", sum.peak_over),
            format!("{} ({})", count(r.tally.refused_with_room), r.tally.largest_room),
        ]);
    }
    println!("### What the fleet admitted against the limit\n\n{}\n", t.render());
    let over: Vec<String> = results
        .iter()
        .flat_map(|r| r.tally.overshoots(1.01).into_iter().map(move |line| format!("- {} proxies, {}, {}: {line}", r.proxies, r.consistency, r.mix.kind.name())))
        .collect();
    if !over.is_empty() {
        println!("Windows more than 1 % over their limit:\n\n{}\n", over.join("\n"));
    }
    let mut t = Table::new(&["proxies", "consistency", "mix", "event", "store calls /1k (batch, ask, lease)", "failed calls (lease.failures)", "call p50 / p99 / max ms", "Redis cmds /1k", "HTTP bytes /1k", "Redis bytes /1k", "Redis CPU ms /1k", "sync CPU ms /1k", "tool CPU ms /1k", "waited", "wait p50 / p99 / max ms", "added p99, all requests, ms", "decided without the store", "lease holders per key (max; keys read)", "send lateness max ms"]);
    for r in results {
        let sum = r.tally.summary();
        let calls: u64 = r.calls.sent.iter().sum();
        t.row(vec![
            r.proxies.to_string(),
            r.consistency.clone(),
            r.mix.kind.name().into(),
            r.event.name().into(),
            format!("{} ({}, {}, {})", per_k(calls as f64, r.requests), per_k(r.calls.sent[0] as f64, r.requests), per_k(r.calls.sent[1] as f64, r.requests), per_k(r.calls.sent[2] as f64, r.requests)),
            format!("{} ({})", count(r.calls.failed), r.lease_failures),
            {
                let mut took: Vec<f64> = r.calls.took_us.iter().map(|&us| us as f64 / 1000.0).collect();
                took.sort_by(f64::total_cmp);
                format!("{:.1} / {:.1} / {:.0}", tally::quantile(&took, 0.5), tally::quantile(&took, 0.99), took.last().copied().unwrap_or(0.0))
            },
            per_k(r.spent.commands as f64, r.requests),
            per_k(r.calls.bytes as f64, r.requests),
            per_k(r.spent.bytes as f64, r.requests),
            per_k(r.spent.redis_cpu_ns as f64 / 1e6, r.requests),
            per_k(r.spent.sync_cpu_ns as f64 / 1e6, r.requests),
            per_k(r.spent.tool_cpu_ns as f64 / 1e6, r.requests),
            format!("{} (asks {}, lease waits {})", count(sum.waits.0 as u64), r.asked, r.lease_waits),
            format!("{:.1} / {:.1} / {:.0}", sum.waits.1, sum.waits.2, sum.waits.3),
            format!("{:.1}", sum.added_p99),
            count(u64::try_from(r.without_store).unwrap_or(0)),
            if r.holders.is_empty() { "-".into() } else { format!("{} ({})", r.holders.iter().max().unwrap_or(&0), r.holders.len()) },
            format!("{:.0}", r.lateness_ms),
        ]);
    }
    println!("### Store cost and waits\n\n{}\n", t.render());
    let mut t = Table::new(&["proxies", "consistency", "mix", "event", "Redis commands /1k by command (those inside scripts included)"]);
    for r in results {
        let mut named: Vec<(&String, &u64)> = r.spent.by_name.iter().collect();
        named.sort_by(|a, b| b.1.cmp(a.1));
        t.row(vec![
            r.proxies.to_string(),
            r.consistency.clone(),
            r.mix.kind.name().into(),
            r.event.name().into(),
            named.iter().map(|(name, calls)| format!("{name} {}", per_k(**calls as f64, r.requests))).collect::<Vec<_>>().join(", "),
        ]);
    }
    println!("### Redis commands by name\n\n{}\n", t.render());
    let notes: Vec<String> = results
        .iter()
        .filter(|r| !r.event_note.is_empty() || r.abandoned > 0)
        .map(|r| format!("- {} proxies, {}, {}: {}{}", r.proxies, r.consistency, r.mix.kind.name(), r.event_note, if r.abandoned > 0 { format!(" ({} paused requests lost with their proxies)", r.abandoned) } else { String::new() }))
        .collect();
    if !notes.is_empty() {
        println!("Events:\n\n{}\n", notes.join("\n"));
    }
}

/// Where in its window every run of a cross-check starts, ms: the same for both sides, so that
/// their windows hold the same part of the schedule.
const PHASE_MS: u64 = 500;

/// `--envoys`: each configuration through real Envoys of one worker, then through as many
/// simulated proxies of one worker, the same schedule (a mix's seed is the same for both); the
/// two side by side.
async fn crosscheck(s: &Settings, stack: &Arc<Mutex<Stack>>, mixes: &[MixKind]) -> Result<(), String> {
    let o = FleetOptions { workers: 1, ..s.fleet.clone() };
    let (upstream, _) = crate::load::start_upstream().await;
    let addrs = stack.lock().map_err(|_| "stack lock")?.addrs();
    let mut pairs = Vec::new();
    let mut notes = Vec::new();
    let mut run_id = 0;
    for &proxies in &o.proxies {
        for consistency in &o.consistencies {
            for &kind in mixes {
                run_id += 1;
                let rate = o.rate.unwrap_or(400.0);
                let mix = Mix::new(kind, rate, proxies, 0x5eed + run_id);
                let what = format!("{proxies} proxies × 1 worker, {consistency}, {} ({})", kind.name(), mix.describe());
                crate::progress!("{what}: start {proxies} Envoys");
                let fleet = envoys::start(s, &config(&o, consistency, mix.limit, mix.window_ms), proxies, upstream, &addrs)?;
                tokio::time::sleep(Duration::from_secs(3)).await;
                crate::progress!("{what}: through the Envoys, {} s", o.seconds);
                let (real, note) = envoys::run(stack, &fleet, mix.clone(), o.seconds, "k", PHASE_MS).await?;
                drop(fleet);
                if !note.is_empty() {
                    notes.push(format!("- {what}, Envoys: {note}"));
                }
                crate::progress!("Envoys: {} requests, {} admitted, {} refused, {} other", real.requests, real.admitted, real.refused, real.other);
                tokio::time::sleep(Duration::from_secs(3)).await;
                crate::progress!("{what}: through the tool, {} s", o.seconds);
                let r = one_run(&o, stack, proxies, consistency, mix.clone(), Event::Steady, run_id, "k", Some(PHASE_MS)).await?;
                let tool = side_of(&r);
                if r.calls.failed > 0 || r.lease_failures > 0 {
                    notes.push(format!("- {what}, tool: {} calls failed (lease.failures {})", r.calls.failed, r.lease_failures));
                }
                let a = compare::agreement(&real, &tool);
                crate::progress!("tool: {} requests, {} admitted, {} refused; admitted real ÷ tool {:.4}", tool.requests, tool.admitted, tool.refused, a.ratio);
                // Once more with each proxy's idle VM, as an Envoy's main thread has one.
                tokio::time::sleep(Duration::from_secs(3)).await;
                crate::progress!("{what}: through the tool with an idle VM per proxy, {} s", o.seconds);
                let with_main = FleetOptions { idle_vms: 1, ..o.clone() };
                let r = one_run(&with_main, stack, proxies, consistency, mix.clone(), Event::Steady, run_id, "k", Some(PHASE_MS)).await?;
                let tool_main = side_of(&r);
                if r.calls.failed > 0 || r.lease_failures > 0 {
                    notes.push(format!("- {what}, tool with an idle VM: {} calls failed (lease.failures {})", r.calls.failed, r.lease_failures));
                }
                crate::progress!("tool with an idle VM: {} admitted; admitted real ÷ it {:.4}", tool_main.admitted, compare::agreement(&real, &tool_main).ratio);
                pairs.push(compare::Pair { proxies, consistency: consistency.clone(), mix: mix.describe(), real, tool, tool_main: Some(tool_main) });
            }
        }
    }
    println!(
        "## Fleet cross-check: real Envoys against the simulated proxies\n\n\
         Each configuration, one worker per proxy: through real Envoys (`--concurrency 1`, the built module) in front of a real upstream, then through \
         as many simulated proxies; the same schedule (each request's time, proxy and key), the same rule, the same 2 floodgate-sync replicas (proxy i calls \
         replica i mod 2) and Redis Cluster (3 masters + 3 replicas), the store emptied (`FLUSHALL`) before each run and each run starting {PHASE_MS} ms into a \
         window; `sync_interval` {SYNC_INTERVAL_MS} ms, {} s of open-loop traffic per run. The third row of each configuration runs the tool again with \
         one more VM per proxy that ticks and serves no request, as the main thread's VM of an Envoy does. Store calls from floodgate-sync's `/metrics` (calls answered \
         on `/v1/sync` and `/v1/lease`), the module's own counters beside them; Redis commands on the masters.\n",
        o.seconds
    );
    println!("{}\n", compare::table(&pairs));
    if !notes.is_empty() {
        println!("{}\n", notes.join("\n"));
    }
    Ok(())
}

/// The simulated side of a cross-check.
fn side_of(r: &RunResult) -> compare::Side {
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    compare::Side {
        requests: r.requests,
        admitted: r.tally.admitted,
        refused: r.tally.refused,
        other: 0,
        summary: r.tally.summary(),
        windows: r.tally.per_window(r.start_wall_ms / r.tally.window_ms()),
        sync_batches: r.spent.sync_batches,
        sync_leases: r.spent.sync_leases,
        module: r.calls.sent,
        waited: n(r.asked) + n(r.lease_waits),
        without_store: n(r.without_store),
        redis_commands: r.spent.commands,
        lateness_ms: r.lateness_ms,
    }
}
