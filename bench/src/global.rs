//! Measurement 5: the global scope (docs/global.md). Three Envoys (2 workers each,
//! pinned to core 0), one `floodgate-sync` and one `redis-server` (on the last core, with the
//! load generator and the upstream), all on 127.0.0.1:
//!
//! * **one quota over three proxies**: one key's traffic spread evenly over the three, paced
//!   (open loop) at a fixed rate, `sync_interval` 100 ms; the admitted total against the limit
//!   `L`, and the same traffic on a rule in proxy scope for contrast (about `3 × L`);
//! * **the store down for 10 s** mid-run (redis-server stopped with SIGSTOP, then resumed; or
//!   killed with SIGKILL and started again empty): what the fleet admitted before, during and
//!   after, against `L`;
//! * **CPU per request and Redis commands per request**: two fleets of three Envoys, one rule in
//!   global scope against the same rule in proxy scope, closed-loop load over 100 keys at the
//!   highest rate the machine reaches, alternated rounds as in measurement 1; the Envoys' CPU time
//!   from /proc, Redis's own counters (`INFO commandstats`) before and after each run;
//! * **instructions per request**: Envoys in each scope under callgrind, time stretched (a
//!   low rate and a long `sync_interval` with as many requests per interval as a busy proxy
//!   has at 100 ms), so the global scope's work per interval weighs on each request as it
//!   does at 1 000 and 3 330 req/s per proxy; without the noise of CPU time;
//! * **batched, leased, or a store call per request** ([`crate::leased`]): the same traffic
//!   under each, store calls, waits, latency and CPU per request side by side.

use crate::envoy::{cpu_ns_of, Envoy, Starting, SYNC_CLUSTER};
use crate::fleet_harness::{envoy_spec, fit_in_window, paced, run_id, Fleet, Sent, PACED_CONNECTIONS, PROXIES, WORKERS};
use crate::load::{self, Load, Requests};
use crate::services::{Redis, RedisCounts, Sync};
use crate::table::{count, median, Table};
use crate::{progress, Settings};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `global.sync_interval` of every configuration here.
const SYNC_INTERVAL_MS: u64 = 100;
/// Keys of the CPU and commands runs.
const KEYS: usize = 100;
/// Part (e): the rate of every phase under callgrind (req/s). At 111 req/s two proxy-scope
/// Envoys of one run differed by 5 % per request, at 33 by 0.05 % (why is not known: how the
/// slowed event loop groups requests, or each process's random key seed placing keys in its
/// tables differently).
const E_RATE: f64 = 100.0 / 3.0;
/// Part (e): the requests per interval of the regimes measured (100 and 333: 1 000 and 3 330
/// req/s per proxy at 100 ms, the second 10 000 req/s over three proxies), each at
/// the `sync_interval` that gives them at [`E_RATE`].
const E_PER_INTERVAL: [u64; 2] = [100, 333];
/// Part (e): Envoys per scope and regime.
const E_ENVOYS: usize = 2;
/// The quota reserves a worker may hold ahead near the limit (filter/src/ratelimit/reserve.rs).
const RESERVE_PER_WORKER: u64 = 16;

/// Which scope a rule has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    Global,
    Proxy,
}

impl Scope {
    fn name(self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Proxy => "proxy",
        }
    }
}

/// One quota case: a rule of its own (keyed on its own header), and the paced traffic it gets.
#[derive(Clone, Debug)]
struct QuotaCase {
    scope: Scope,
    limit: u64,
    /// Requests per second over the fleet.
    rate: f64,
}

impl QuotaCase {
    /// What the fleet should admit at most, ignoring the overshoot: `L`, or `3 × L` in proxy scope.
    fn expected(&self) -> u64 {
        match self.scope {
            Scope::Global => self.limit,
            Scope::Proxy => self.limit * PROXIES as u64,
        }
    }

    /// The overshoot bound of docs/global.md: `R · D · (P − 1) / P` with `D` three sync
    /// intervals plus a round trip (taken as one more interval), plus the quota reserves (16 per
    /// worker). Proxy scope: the reserves only.
    fn bound(&self) -> u64 {
        let reserves = RESERVE_PER_WORKER * (PROXIES * WORKERS) as u64;
        match self.scope {
            Scope::Global => {
                let d = 4.0 * SYNC_INTERVAL_MS as f64 / 1000.0;
                let spread = (PROXIES - 1) as f64 / PROXIES as f64;
                self.limit + (self.rate * d * spread).ceil() as u64 + reserves
            }
            Scope::Proxy => self.expected() + reserves,
        }
    }

    /// How long to send: until `expected()` would be offered, then 3 s more of refusals.
    fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.expected() as f64 / self.rate + 3.0)
    }
}

/// How the store goes down.
#[derive(Clone, Copy, Debug)]
enum Outage {
    /// SIGSTOP, then SIGCONT: a hung store that comes back with everything it held.
    Paused,
    /// SIGKILL, then a fresh redis-server on the same port: a store lost and replaced, empty.
    Killed,
}

fn rule(name: &str, header: &str, limit: u64, scope: Scope) -> Value {
    json!({"name": name, "key": [{"header": header}], "limit": limit, "window": "1h", "scope": scope.name()})
}

fn global_section() -> Value {
    global_section_every(SYNC_INTERVAL_MS)
}

fn global_section_every(interval_ms: u64) -> Value {
    json!({"cluster": SYNC_CLUSTER, "sync_interval": format!("{interval_ms}ms")})
}

/// The configuration of parts (c) and (e): one rule keyed on `x-api-key` with a limit no run
/// reaches, in `scope`, syncing every `interval_ms` in global scope.
fn per_key_config(scope: Scope, interval_ms: u64) -> Value {
    let mut config = json!({"rate_limits": [rule("per-key", "x-api-key", 1_000_000_000, scope)]});
    if scope == Scope::Global {
        config["global"] = global_section_every(interval_ms);
    }
    config
}

fn admitted(sent: &[Sent]) -> u64 {
    sent.iter().filter(|s| s.status == 200).count() as u64
}

/// Statuses other than 200 and 429, as `status×count` (empty when there are none).
fn unexpected(sent: &[Sent]) -> String {
    let mut other = std::collections::BTreeMap::new();
    for s in sent.iter().filter(|s| s.status != 200 && s.status != 429) {
        *other.entry(s.status).or_insert(0u64) += 1;
    }
    other.iter().map(|(k, v)| format!("{k}×{v}")).collect::<Vec<_>>().join(" ")
}

/// The 99th percentile of how late responses came after their request was due, in ms: whether
/// the generator and the proxies kept the pace.
fn lateness_p99_ms(sent: &[Sent]) -> f64 {
    let mut late: Vec<f64> = sent.iter().map(|s| s.done.saturating_sub(s.due).as_secs_f64() * 1000.0).collect();
    late.sort_by(|a, b| a.total_cmp(b));
    late.get(late.len().saturating_sub(1).min(late.len() * 99 / 100)).copied().unwrap_or(0.0)
}

/// Measurement 5.
pub async fn run(s: &Settings) {
    println!("## 5. Global scope: one quota over {PROXIES} proxies through floodgate-sync and Redis\n");
    if let Err(e) = run_fallible(s).await {
        println!("**global** could not be measured: {e}\n");
    }
}

async fn run_fallible(s: &Settings) -> Result<(), String> {
    let redis = Redis::start(&s.redis_server)?;
    let sync = Sync::start(&s.sync_bin, &redis.url())?;
    let (upstream, _) = load::start_upstream().await;
    progress!("redis-server on 127.0.0.1:{} (pid {:?}), floodgate-sync on {} (pid {})", redis.port, redis.pid(), sync.addr, sync.pid());
    println!(
        "{PROXIES} Envoys with {WORKERS} workers each, all pinned to core 0; redis-server (no persistence), floodgate-sync (default flags), \
         the load generator and the upstream on core {}. `sync_interval` {SYNC_INTERVAL_MS} ms, window 1 h, fresh keys for every case.\n",
        s.cpus.saturating_sub(1)
    );
    let mut redis = redis;
    if part(s, "quota") || part(s, "outage") {
        quotas_and_outages(s, &mut redis, &sync, upstream).await?;
    }
    if part(s, "cpu") {
        cpu_and_commands(s, &redis, &sync, upstream).await?;
    }
    if part(s, "instructions") {
        instructions(s, &sync, upstream).await?;
    }
    if part(s, "modes") {
        crate::leased::modes(s, &redis, &sync, upstream).await?;
    }
    Ok(())
}

/// Whether `--variants` leaves part `name` in (`quota`: (a), `outage`: (b), `cpu`: (c) and (d),
/// `instructions`: (e), `modes`: (f)).
fn part(s: &Settings, name: &str) -> bool {
    s.only.as_ref().is_none_or(|only| only.iter().any(|o| o == name))
}

/// Parts (a) and (b): quota cases and outages, on one fleet with a rule per case.
async fn quotas_and_outages(s: &Settings, redis: &mut Redis, sync: &Sync, upstream: SocketAddr) -> Result<(), String> {
    let cases: Vec<QuotaCase> = if s.quick {
        vec![
            QuotaCase { scope: Scope::Global, limit: 2_000, rate: 1000.0 },
            QuotaCase { scope: Scope::Proxy, limit: 2_000, rate: 1000.0 },
            QuotaCase { scope: Scope::Global, limit: 10_000, rate: 1000.0 },
        ]
    } else {
        vec![
            QuotaCase { scope: Scope::Global, limit: 1_000, rate: 1000.0 },
            QuotaCase { scope: Scope::Global, limit: 5_000, rate: 1000.0 },
            QuotaCase { scope: Scope::Global, limit: 20_000, rate: 1000.0 },
            QuotaCase { scope: Scope::Proxy, limit: 2_000, rate: 1000.0 },
            QuotaCase { scope: Scope::Global, limit: 20_000, rate: 3000.0 },
        ]
    };
    let rate_outage = 1000.0;
    let (before, down, after) = if s.quick { (5u64, 10u64, 5u64) } else { (10, 10, 10) };
    // Two limits: reached halfway through the outage at the offered rate, or halfway before it.
    let mid_outage = (rate_outage as u64) * (before + down / 2);
    let before_outage = (rate_outage as u64) * before / 2;
    let outages = [(Outage::Paused, mid_outage), (Outage::Killed, mid_outage), (Outage::Paused, before_outage), (Outage::Killed, before_outage)];
    let mut rules: Vec<Value> = cases.iter().enumerate().map(|(i, c)| rule(&format!("q{i}"), &format!("x-q{i}"), c.limit, c.scope)).collect();
    for (k, (_, limit)) in outages.iter().enumerate() {
        rules.push(rule(&format!("outage{k}"), &format!("x-outage{k}"), *limit, Scope::Global));
    }
    let config = json!({"rate_limits": rules, "global": global_section()});
    let fleet = Fleet::start(s, &config, upstream, sync.addr)?;
    let addrs = fleet.addrs();
    let id = run_id();

    // (a) One quota over three proxies.
    let mut t = Table::new(&["scope", "limit L", "rate (req/s)", "sent", "admitted", "admitted ÷ L", "over L", "bound (docs/global.md)", "p99 lateness"]);
    for (i, case) in cases.iter().enumerate().filter(|_| part(s, "quota")) {
        fit_in_window(case.duration()).await;
        let key = format!("{id}-q{i}");
        let header = format!("x-q{i}");
        let sent = paced(&addrs, case.rate, case.duration(), |_| load::request("/", &[(header.as_str(), key.clone())])).await;
        let ok = admitted(&sent);
        let odd = unexpected(&sent);
        progress!("{} scope, L {}, {:.0} req/s: {} admitted of {} sent{}", case.scope.name(), case.limit, case.rate, ok, sent.len(), if odd.is_empty() { String::new() } else { format!(", other statuses {odd}") });
        t.row(vec![
            case.scope.name().into(),
            count(case.limit),
            format!("{:.0}", case.rate),
            count(sent.len() as u64),
            format!("{}{}", count(ok), if odd.is_empty() { String::new() } else { format!(" ⚠ {odd}") }),
            format!("{:.3}", ok as f64 / case.limit as f64),
            format!("{:+}", ok as i64 - case.expected() as i64),
            count(case.bound()),
            format!("{:.1} ms", lateness_p99_ms(&sent)),
        ]);
    }
    if part(s, "quota") {
        println!("### (a) One key's traffic spread evenly over the {PROXIES} proxies\n");
    println!(
        "Paced (open-loop) requests, round-robin over the proxies ({PACED_CONNECTIONS} keep-alive connections each), for as long as the fleet should admit \
         (`L` in global scope, `3 × L` in proxy scope) plus 3 s of refusals. \"over L\": admitted minus what the scope should admit (`L`, or `3 × L` in proxy scope). \
         Bound: `L + R · D · (P − 1)/P + 16 × workers` with `D` = 4 × `sync_interval` (docs/global.md: about 3 intervals plus a round trip). \
         \"p99 lateness\": how long after its due time the 99th-percentile response came (the generator kept the pace if small).\n"
    );
    println!("{}\n", t.render());
    }
    if !part(s, "outage") {
        return Ok(());
    }

    // (b) The store down for `down` seconds.
    let mut t = Table::new(&[
        "store down",
        "limit L",
        "admitted before (sent)",
        "admitted during (sent)",
        "admitted after (sent)",
        "total ÷ L",
        "staleness at the end of the outage",
        "sync failures",
        "not 200/429",
    ]);
    for (k, &(how, limit)) in outages.iter().enumerate() {
        let total = Duration::from_secs(before + down + after);
        fit_in_window(total).await;
        let key = format!("{id}-outage{k}");
        let failures_before = fleet.global_sum("failures");
        let control = async {
            tokio::time::sleep(Duration::from_secs(before)).await;
            let went_down = match how {
                Outage::Paused => redis.pause(),
                Outage::Killed => {
                    redis.kill();
                    Ok(())
                }
            };
            tokio::time::sleep(Duration::from_secs(down) - Duration::from_millis(200)).await;
            let staleness = fleet.staleness_ms();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let came_back = match how {
                Outage::Paused => redis.resume(),
                Outage::Killed => redis.respawn(),
            };
            went_down.and(came_back).map(|()| staleness)
        };
        let header = format!("x-outage{k}");
        let load = paced(&addrs, rate_outage, total, |_| load::request("/", &[(header.as_str(), key.clone())]));
        let (sent, control) = tokio::join!(load, control);
        let staleness = control?;
        redis.wait_ready(Duration::from_secs(10))?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let failures = fleet.global_sum("failures").saturating_sub(failures_before);
        let phase = |from: u64, to: u64| {
            let part: Vec<Sent> = sent
                .iter()
                .filter(|x| x.due >= Duration::from_secs(from) && x.due < Duration::from_secs(to))
                .copied()
                .collect();
            (admitted(&part), part.len() as u64)
        };
        let (b, d, a) = (phase(0, before), phase(before, before + down), phase(before + down, before + down + after));
        let all = b.0 + d.0 + a.0;
        let odd = unexpected(&sent);
        let what = match how {
            Outage::Paused => "paused (SIGSTOP, then SIGCONT)",
            Outage::Killed => "killed (SIGKILL, then started again empty)",
        };
        progress!("store {what}: admitted {} / {} / {} (before / during / after), staleness {staleness} ms, {failures} failures", b.0, d.0, a.0);
        t.row(vec![
            what.into(),
            count(limit),
            format!("{} ({})", count(b.0), count(b.1)),
            format!("{} ({})", count(d.0), count(d.1)),
            format!("{} ({})", count(a.0), count(a.1)),
            format!("{:.3}", all as f64 / limit as f64),
            format!("{:.1} s", staleness as f64 / 1000.0),
            count(failures),
            if odd.is_empty() { "none".into() } else { odd },
        ]);
    }
    println!("### (b) The store down for {down} s mid-run\n");
    println!(
        "One key at {rate_outage:.0} req/s over the {PROXIES} proxies for {} s: {before} s with the store up, {down} s with redis-server down, {after} s after it is back. \
         `L` = {}: the offered traffic reaches it halfway through the outage; `L` = {}: halfway before it. Without an outage the fleet would admit `L` and refuse the rest. \
         Phases by the moment each request was due; \"sync failures\": batches the proxies saw fail (`floodgate.global.failures`, summed).\n",
        before + down + after,
        count(mid_outage),
        count(before_outage)
    );
    println!("{}\n", t.render());
    Ok(())
}

/// How the load of a CPU run is driven.
#[derive(Clone, Copy, Debug)]
enum Pace {
    /// Closed loop, `--connections` connections: the highest rate the machine reaches.
    Closed,
    /// Open loop at this many requests per second.
    Paced(f64),
    /// Both fleets at once, closed loop, the connections shared between them: whatever else the
    /// machine does meanwhile weighs on both alike.
    Together,
}

impl Pace {
    fn label(self, s: &Settings) -> String {
        match self {
            Pace::Closed => format!("closed loop, {} connections", s.connections),
            Pace::Paced(rate) => format!("paced at {rate:.0} req/s"),
            Pace::Together => format!("both fleets at once, closed loop, {} connections each", s.connections / 2),
        }
    }
}

/// One measured run of the CPU comparison.
#[derive(Clone, Debug)]
struct CpuRun {
    /// The fleet's Envoy CPU nanoseconds per response.
    envoy_ns: f64,
    /// floodgate-sync's and redis-server's CPU nanoseconds per response.
    store_ns: f64,
    /// Redis's counters over the run.
    redis: RedisCounts,
    /// Responses.
    completed: u64,
    /// Seconds measured.
    seconds: f64,
    /// Non-200 responses and transport errors.
    bad: u64,
    /// CPU used by other processes of the machine meanwhile, in CPUs.
    others_busy: f64,
}

impl CpuRun {
    fn rps(&self) -> f64 {
        self.completed as f64 / self.seconds.max(1e-9)
    }
}

/// A reading at the start or end of a run: CPU nanoseconds of the fleet's Envoys, of
/// floodgate-sync and redis-server, of this process, of the whole machine; Redis's counters.
#[derive(Clone, Copy, Default)]
struct Probe {
    envoys: u64,
    store: u64,
    own: u64,
    machine: u64,
    redis: RedisCounts,
}

impl Probe {
    fn take(pids: &[u32], redis: &Redis, sync: &Sync) -> Probe {
        Probe {
            envoys: pids.iter().map(|&p| cpu_ns_of(p)).sum(),
            store: cpu_ns_of(sync.pid()) + redis.pid().map_or(0, cpu_ns_of),
            own: cpu_ns_of(std::process::id()),
            machine: crate::envoy::machine_busy_ns(),
            redis: redis.counts().unwrap_or_default(),
        }
    }
}

/// One run of `pace` load on `fleet`, warm-up first.
async fn cpu_run(s: &Settings, fleet: &Fleet, pace: Pace, requests: &Arc<Vec<Vec<u8>>>, redis: &Redis, sync: &Sync) -> CpuRun {
    let pids = fleet.pids();
    let warmup = Duration::from_secs_f64(s.warmup);
    let seconds = Duration::from_secs_f64(s.seconds);
    let (completed, ok, errors, elapsed, before, after) = match pace {
        // (Together is measured by together_run; alone it is the closed loop.)
        Pace::Closed | Pace::Together => {
            let load = Load { targets: fleet.addrs(), connections: s.connections, requests: Requests::Cycle(Arc::clone(requests)), max_requests: None };
            let (out, before, after) = load::run(&load, warmup, seconds, || Probe::take(&pids, redis, sync)).await;
            (out.completed, out.status(200), out.errors, out.elapsed, before, after)
        }
        Pace::Paced(rate) => {
            let make = |i: u64| requests[(i % requests.len() as u64) as usize].clone();
            paced(&fleet.addrs(), rate, warmup, make).await;
            let before = Probe::take(&pids, redis, sync);
            let started = Instant::now();
            let sent = paced(&fleet.addrs(), rate, seconds, make).await;
            let elapsed = started.elapsed();
            let after = Probe::take(&pids, redis, sync);
            let errors = sent.iter().filter(|x| x.status == 0).count() as u64;
            (sent.len() as u64 - errors, admitted(&sent), errors, elapsed, before, after)
        }
    };
    let n = completed.max(1) as f64;
    let secs = elapsed.as_secs_f64().max(1e-9);
    let envoy = after.envoys.saturating_sub(before.envoys) as f64;
    let store = after.store.saturating_sub(before.store) as f64;
    let own = after.own.saturating_sub(before.own) as f64;
    let machine = after.machine.saturating_sub(before.machine) as f64;
    CpuRun {
        envoy_ns: envoy / n,
        store_ns: store / n,
        redis: after.redis.since(before.redis),
        completed,
        seconds: secs,
        bad: completed - ok + errors,
        others_busy: ((machine - envoy - store - own) / 1e9 / secs).max(0.0),
    }
}

/// One run of both fleets at once ([`Pace::Together`]): each fleet's CPU per response, its
/// responses counted by its Envoys (`http.front.downstream_rq_completed`).
async fn together_run(s: &Settings, fleets: &[(Scope, Fleet); 2], requests: &Arc<Vec<Vec<u8>>>) -> [CpuRun; 2] {
    let addrs = [fleets[0].1.addrs(), fleets[1].1.addrs()];
    // Interleaved, so that connection c alternates between the fleets.
    let targets: Vec<SocketAddr> = (0..PROXIES).flat_map(|k| [addrs[0][k], addrs[1][k]]).collect();
    let load = Load { targets, connections: s.connections, requests: Requests::Cycle(Arc::clone(requests)), max_requests: None };
    let take = || {
        let per_fleet = fleets.each_ref().map(|(_, fleet)| {
            let cpu: u64 = fleet.pids().iter().map(|&p| cpu_ns_of(p)).sum();
            let done: u64 = fleet.envoys.iter().filter_map(|e| e.stat("http.front.downstream_rq_completed")).sum();
            (cpu, done)
        });
        (per_fleet, cpu_ns_of(std::process::id()), crate::envoy::machine_busy_ns())
    };
    let (out, before, after) = load::run(&load, Duration::from_secs_f64(s.warmup), Duration::from_secs_f64(s.seconds), take).await;
    let secs = out.elapsed.as_secs_f64().max(1e-9);
    let envoys: Vec<f64> = (0..2).map(|i| after.0[i].0.saturating_sub(before.0[i].0) as f64).collect();
    let others = after.2.saturating_sub(before.2) as f64 - envoys.iter().sum::<f64>() - after.1.saturating_sub(before.1) as f64;
    [0, 1].map(|i| {
        let completed = after.0[i].1.saturating_sub(before.0[i].1);
        CpuRun {
            envoy_ns: envoys[i] / completed.max(1) as f64,
            store_ns: 0.0,
            redis: RedisCounts::default(),
            completed,
            seconds: secs,
            bad: (out.completed - out.status(200) + out.errors) / 2,
            others_busy: (others / 1e9 / secs).max(0.0),
        }
    })
}

/// Part (c) and (d): CPU per request and Redis commands per request, global scope against
/// proxy scope, closed loop and paced.
async fn cpu_and_commands(s: &Settings, redis: &Redis, sync: &Sync, upstream: SocketAddr) -> Result<(), String> {
    let per_key = |scope: Scope| per_key_config(scope, SYNC_INTERVAL_MS);
    let fleets = [
        (Scope::Global, Fleet::start(s, &per_key(Scope::Global), upstream, sync.addr)?),
        (Scope::Proxy, Fleet::start(s, &per_key(Scope::Proxy), upstream, sync.addr)?),
    ];
    let requests = crate::cpu::key_requests("g", KEYS);
    for (scope, fleet) in &fleets {
        let load = Load { targets: fleet.addrs(), connections: 6, requests: Requests::Cycle(Arc::clone(&requests)), max_requests: None };
        let (out, _, _) = load::run(&load, Duration::ZERO, Duration::from_millis(500), || ()).await;
        if out.completed == 0 || out.status(200) != out.completed {
            return Err(format!("{} scope fleet: requests fail: statuses {:?}, {} errors", scope.name(), out.statuses, out.errors));
        }
    }
    let paces = [Pace::Closed, Pace::Paced(1000.0), Pace::Together];
    // runs[pace][fleet], ratios[pace]: global over proxy within a round.
    let mut runs: Vec<[Vec<CpuRun>; 2]> = paces.iter().map(|_| [Vec::new(), Vec::new()]).collect();
    let mut ratios: Vec<Vec<f64>> = paces.iter().map(|_| Vec::new()).collect();
    for round in 0..s.rounds {
        for (p, &pace) in paces.iter().enumerate() {
            let mut this = [0.0f64; 2];
            let together = match pace {
                Pace::Together => {
                    crate::cpu::wait_for_quiet(Duration::from_secs(if s.quick { 3 } else { 6 })).await;
                    Some(together_run(s, &fleets, &requests).await)
                }
                _ => None,
            };
            for k in 0..2 {
                let i = (k + round) % 2;
                let (scope, fleet) = &fleets[i];
                let run = match &together {
                    Some(pair) => pair[i].clone(),
                    None => {
                        crate::cpu::wait_for_quiet(Duration::from_secs(if s.quick { 3 } else { 6 })).await;
                        cpu_run(s, fleet, pace, &requests, redis, sync).await
                    }
                };
                progress!(
                    "round {}/{} {} {:<6} scope: Envoy {:>6.1} µs/req, sync+Redis {:>5.2} µs/req, {:>6.0} req/s, {} scripts, others busy {:.0}%",
                    round + 1,
                    s.rounds,
                    pace.label(s),
                    scope.name(),
                    run.envoy_ns / 1000.0,
                    run.store_ns / 1000.0,
                    run.rps(),
                    run.redis.scripts,
                    run.others_busy * 100.0
                );
                this[i] = run.envoy_ns;
                runs[p][i].push(run);
            }
            ratios[p].push(this[0] / this[1]);
        }
    }
    let med = |rs: &[CpuRun], f: &dyn Fn(&CpuRun) -> f64| median(&rs.iter().map(f).collect::<Vec<_>>());
    let mut t = Table::new(&[
        "load",
        "scope",
        "Envoy CPU µs/req (median)",
        "× proxy scope (median; range)",
        "floodgate-sync + Redis CPU µs/req",
        "req/s",
        "others busy",
        "non-200/errors",
    ]);
    for (p, &pace) in paces.iter().enumerate() {
        let (lo, hi) = crate::table::range(&ratios[p]);
        for (i, (scope, _)) in fleets.iter().enumerate() {
            let rs = &runs[p][i];
            t.row(vec![
                pace.label(s),
                scope.name().into(),
                format!("{:.2}", med(rs, &|r| r.envoy_ns / 1000.0)),
                if *scope == Scope::Global { format!("{:.3} ({lo:.3}–{hi:.3})", median(&ratios[p])) } else { "1.000".into() },
                format!("{:.2}", med(rs, &|r| r.store_ns / 1000.0)),
                format!("{:.0}", med(rs, &|r| r.rps())),
                format!("{:.0}%", 100.0 * med(rs, &|r| r.others_busy)),
                count(rs.iter().map(|r| r.bad).sum()),
            ]);
        }
    }
    println!("### (c) CPU per request: a rule in global scope against the same rule in proxy scope\n");
    println!(
        "Two fleets of {PROXIES} Envoys ({WORKERS} workers each, core 0): one rule keyed on `x-api-key` with a limit no run reaches (every request admitted, the common path), \
         `\"scope\": \"global\"` in one fleet and `\"scope\": \"proxy\"` in the other; {KEYS} keys. Each round runs both fleets closed-loop ({} connections spread over \
         the proxies: the highest rate the machine reaches) and paced at 1 000 req/s, one fleet after the other, and then both fleets at once (the connections shared \
         between them, so that the rest of the machine weighs on both alike; responses counted by the Envoys); {} rounds of {:.0} s (after {:.0} s warm-up) per fleet and load, alternated. \
         Envoy CPU: every thread of the three processes, from /proc. Ratio: global over proxy within a round, median over rounds (range). \
         floodgate-sync and redis-server run on the other core: their CPU is the global scope's cost outside the proxies.\n",
        s.connections, s.rounds, s.seconds, s.warmup
    );
    println!("{}\n", t.render());
    // Where the difference goes: the extra CPU per second at each load. Equal at both rates,
    // it is work per interval (ticks, batches, views), not per request.
    let extra: Vec<String> = paces
        .iter()
        .enumerate()
        .map(|(p, pace)| {
            let rate = med(&runs[p][0], &|r| r.rps());
            let per_second_ms = (med(&runs[p][0], &|r| r.envoy_ns) - med(&runs[p][1], &|r| r.envoy_ns)) * rate / 1e6;
            format!("{per_second_ms:.0} ms per second ({:.0} per proxy) {} ({rate:.0} req/s)", per_second_ms / PROXIES as f64, pace.label(s))
        })
        .collect();
    println!(
        "The global fleet's Envoys used, beyond the proxy fleet's: {}. Where the two agree, the difference is work per interval \
         (ticks, batches, views), not per request: per request it is that figure over the rate.\n",
        extra.join("; ")
    );

    let global = &runs[0][0];
    let scripts: u64 = global.iter().map(|r| r.redis.scripts).sum();
    let commands: u64 = global.iter().map(|r| r.redis.commands).sum();
    let requests_done: u64 = global.iter().map(|r| r.completed).sum();
    let seconds: f64 = global.iter().map(|r| r.seconds).sum();
    let rate = requests_done as f64 / seconds.max(1e-9);
    let scripts_per_s = scripts as f64 / seconds.max(1e-9);
    let mut t = Table::new(&["global scope, 100 keys", "measured", "per second", "per request at the measured rate", "per request at 10 000 req/s"]);
    t.row(vec!["requests".into(), count(requests_done), format!("{rate:.0}"), String::new(), String::new()]);
    t.row(vec![
        "script calls sent to Redis (`EVALSHA`/`EVAL`: round trips)".into(),
        count(scripts),
        format!("{scripts_per_s:.1}"),
        format!("{:.5}", scripts as f64 / requests_done.max(1) as f64),
        format!("{:.5}", scripts_per_s / 10_000.0),
    ]);
    t.row(vec![
        "commands Redis executed (those inside the scripts included)".into(),
        count(commands),
        format!("{:.1}", commands as f64 / seconds.max(1e-9)),
        format!("{:.5}", commands as f64 / requests_done.max(1) as f64),
        format!("{:.5}", commands as f64 / seconds.max(1e-9) / 10_000.0),
    ]);
    println!("### (d) Redis commands per request\n");
    println!(
        "Redis's own counters (`INFO commandstats`, `INFO` and `PING` left out) before and after each closed-loop global-scope run of (c), summed over its {} runs ({:.0} s). \
         Script calls do not follow the request rate: at most one batch per proxy per `sync_interval` ({} per second for {PROXIES} proxies), one script call each on a single node. \
         So per request = script calls per second ÷ requests per second, and the last column divides the measured calls per second by 10 000.{}\n",
        global.len(),
        seconds,
        PROXIES as u64 * 1000 / SYNC_INTERVAL_MS,
        if rate < 10_000.0 { format!(" The machine reached {rate:.0} req/s through the three Envoys, not 10 000.") } else { String::new() }
    );
    println!("{}\n", t.render());
    let fleet = &fleets[0].1;
    println!(
        "Global-scope fleet's batches: {} sent, {} confirmed, {} failed.\n",
        count(fleet.global_sum("batches")),
        count(fleet.global_sum("confirmed")),
        count(fleet.global_sum("failures"))
    );
    Ok(())
}

/// One paced phase of part (e) on one Envoy under callgrind: requests answered, seconds between
/// the counters' reset and their dump, and the instructions counted.
struct Counted {
    requests: u64,
    seconds: f64,
    instructions: u64,
}

impl Counted {
    /// Instructions per request beyond an idle Envoy's own (`idle_per_s` instructions a second).
    fn per_request(&self, idle_per_s: f64) -> f64 {
        (self.instructions as f64 - idle_per_s * self.seconds) / self.requests.max(1) as f64
    }
}

/// Counts one Envoy's instructions (callgrind) while `load` runs.
async fn counted<F: std::future::Future<Output = Vec<Sent>>>(envoy: &Envoy, load: F) -> Result<(Counted, Vec<Sent>), String> {
    if !crate::instructions::callgrind_control(envoy.pid(), "-z") {
        return Err("callgrind_control -z failed".into());
    }
    let started = Instant::now();
    let sent = load.await;
    if !crate::instructions::callgrind_control(envoy.pid(), "-d") {
        return Err("callgrind_control -d failed".into());
    }
    let seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let instructions = crate::instructions::latest_totals(envoy).ok_or("no callgrind dump found")?;
    let requests = sent.iter().filter(|x| x.status == 200).count() as u64;
    Ok((Counted { requests, seconds, instructions }, sent))
}

/// Part (e): instructions per request, global scope against proxy scope, at the regimes of the
/// target, Envoys of 2 workers (as deployed) under callgrind. Under callgrind an Envoy
/// answers only some tens of requests a second, so the measurement keeps a busy proxy's regime
/// by stretching time: what costs the global scope per interval (every worker's tick, the batch,
/// the answer, the view) depends on the keys and requests per interval, so `n` requests per
/// interval over [`KEYS`] keys at [`E_RATE`] (a `sync_interval` of `n / E_RATE` s) stands for
/// `10 n` req/s per proxy at 100 ms ([`E_PER_INTERVAL`]).
///
/// Two things would blur a few per cent: an Envoy's own timers, which stretched time spreads
/// over far fewer requests than the real regime does (an idle phase measures them on a
/// proxy-scope Envoy and they are taken out of every count, so the ratio is of the work that
/// requests and the global machinery cause); and the differences between processes of one
/// scope ([`E_RATE`]). So [`E_ENVOYS`] Envoys per scope and regime are measured, one after the
/// other, and the medians compared. Each global-scope phase lasts a whole number of its
/// intervals, so that it holds as many batches as it should.
async fn instructions(s: &Settings, sync: &Sync, upstream: SocketAddr) -> Result<(), String> {
    println!("### (e) Instructions per request: global scope against proxy scope\n");
    if std::process::Command::new("valgrind").arg("--version").output().is_err() {
        println!("Skipped: valgrind is not installed (`apt-get install valgrind`).\n");
        return Ok(());
    }
    let wrapper = crate::instructions::CALLGRIND.map(String::from).to_vec();
    // What each Envoy is: None for proxy scope, Some(regime) for global scope at that regime.
    let interval_ms = |n: u64| (n as f64 * 1000.0 / E_RATE).round() as u64;
    let kinds: Vec<Option<usize>> =
        (0..E_ENVOYS).flat_map(|_| std::iter::once(None).chain((0..E_PER_INTERVAL.len()).map(Some))).collect();
    // Spawn all, then wait: each compiles the module under valgrind for a minute or more.
    let spawned: Vec<Result<Starting, String>> = kinds
        .iter()
        .map(|kind| {
            let config = match kind {
                None => per_key_config(Scope::Proxy, SYNC_INTERVAL_MS),
                Some(r) => per_key_config(Scope::Global, interval_ms(E_PER_INTERVAL[*r])),
            };
            envoy_spec(s, &config, upstream, kind.map(|_| sync.addr), wrapper.clone()).spawn(&s.envoy)
        })
        .collect();
    let mut envoys = Vec::new();
    for e in spawned {
        envoys.push(e.and_then(|e| e.wait_ready(Duration::from_secs(1800)))?);
    }
    let requests = crate::cpu::key_requests("e", KEYS);
    let make = |i: u64| requests[(i % requests.len() as u64) as usize].clone();
    for envoy in &envoys {
        // Every key seen many times, and in global scope synced, before counting.
        paced(&[envoy.addr()], E_RATE, Duration::from_secs(10), make).await;
    }
    let (idle, _) = counted(&envoys[0], async {
        tokio::time::sleep(Duration::from_secs(10)).await;
        Vec::new()
    })
    .await?;
    let idle_per_s = idle.instructions as f64 / idle.seconds;
    progress!("proxy scope, idle: {} instructions a second", count(idle_per_s as u64));
    // At least 4 intervals of the longest regime per phase.
    let seconds = Duration::from_secs(if s.quick { 40 } else { 80 });
    let mut proxy: Vec<f64> = Vec::new();
    let mut global: Vec<Vec<f64>> = vec![Vec::new(); E_PER_INTERVAL.len()];
    for (envoy, kind) in envoys.iter().zip(&kinds) {
        let seconds = match kind {
            None => seconds,
            Some(r) => {
                let interval = Duration::from_millis(interval_ms(E_PER_INTERVAL[*r]));
                interval * (seconds.as_secs_f64() / interval.as_secs_f64()).round().max(1.0) as u32
            }
        };
        let (c, sent) = counted(envoy, paced(&[envoy.addr()], E_RATE, seconds, make)).await?;
        let name = kind.map_or("proxy scope".to_string(), |r| format!("global scope, {} ms", interval_ms(E_PER_INTERVAL[r])));
        if c.requests != sent.len() as u64 {
            return Err(format!("{name}: {} of {} requests answered 200", c.requests, sent.len()));
        }
        let late = sent.iter().filter(|x| x.done.saturating_sub(x.due) > Duration::from_millis(200)).count();
        progress!(
            "{name} (pid {}): {} requests in {:.1} s ({late} answered over 200 ms late), {} instructions, {} per request",
            envoy.pid(),
            c.requests,
            c.seconds,
            count(c.instructions),
            count(c.per_request(idle_per_s) as u64)
        );
        match kind {
            None => proxy.push(c.per_request(idle_per_s)),
            Some(r) => global[*r].push(c.per_request(idle_per_s)),
        }
    }
    let spread = |v: &[f64]| {
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        format!("{} ({}–{})", count(median(v) as u64), count(lo as u64), count(hi as u64))
    };
    let mut t = Table::new(&[
        "requests per interval (≙ req/s per proxy at 100 ms)",
        "global scope's `sync_interval` here",
        "proxy scope: instructions per request, median (range over Envoys)",
        "global scope",
        "global ÷ proxy (medians)",
    ]);
    for (r, &n) in E_PER_INTERVAL.iter().enumerate() {
        t.row(vec![
            format!("{n} ({})", n * (1000 / SYNC_INTERVAL_MS)),
            format!("{} ms", interval_ms(n)),
            spread(&proxy),
            spread(&global[r]),
            format!("**{:.3}**", median(&global[r]) / median(&proxy)),
        ]);
    }
    println!(
        "Envoys of {WORKERS} workers under callgrind, {E_ENVOYS} per scope and regime, the rule of (c), {KEYS} keys (every key in every \
         batch), each paced at {E_RATE:.1} req/s for about {:.0} s (a whole number of intervals in global scope) after 10 s of warm-up, one after the other. All user-space instructions \
         of the process, less the proxy-scope Envoy's idle {} a second (its timers), per request answered:\n\n{}\n",
        seconds.as_secs_f64(),
        count(idle_per_s as u64),
        t.render()
    );
    // The same counts split into a part per request and a part per interval (informative).
    let (lo, hi) = (E_PER_INTERVAL[0] as f64, E_PER_INTERVAL[1] as f64);
    let (extra_lo, extra_hi) = (median(&global[0]) - median(&proxy), median(&global[1]) - median(&proxy));
    let per_interval = (extra_lo - extra_hi) / (1.0 / lo - 1.0 / hi);
    println!(
        "Split (`extra = p + per-interval / requests per interval`, from the two regimes): the global scope adds {:+.0} \
         instructions per request and {:+.0} per interval with {KEYS} keys in the batch.\n",
        extra_lo - per_interval / lo,
        per_interval,
    );
    Ok(())
}
