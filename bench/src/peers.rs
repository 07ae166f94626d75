//! Measurement 7 (`peers`): floodgate's global scope against the other Rust proxy-wasm design
//! of a global limit, Kuadrant's wasm-shim in front of Limitador, side by side in one run on
//! the same machine: the same quota, the same traffic, the same three Envoys of two workers
//! pinned to core 0, one Redis.
//!
//! * floodgate in global scope, `batched` and `leased`, through `floodgate-sync`, and the same
//!   rule in proxy scope as the baseline of latency;
//! * wasm-shim (the module at `WASM_SHIM_WASM`) calling Limitador (`LIMITADOR_BIN`) over gRPC
//!   (Envoy's rate limit service) on every request: Limitador with its `redis` storage (every
//!   request checked in Redis), and with `redis_cached` (counters cached in Limitador, flushed
//!   to Redis every `--flush-period`: its batched answer), at floodgate's 100 ms and at its
//!   default 1 s.
//!
//! The traffic is shaped as part (f)'s of measurement 5 ([`crate::leased::shared_traffic`]), at
//! half its rate: paced over the three proxies, half of it on one hot key at twice its limit
//! `L`, the rest over 200 keys far under it. Per configuration: the hot key's admitted count against `L`, the latency of
//! admitted requests, and the CPU time per request of the Envoys and of the limiter service
//! (`floodgate-sync` or Limitador, and Redis), each configuration once per round, the order
//! rotated, and the ratios to floodgate batched taken within a round.

use crate::envoy::{cpu_ns_of, machine_busy_ns, LIMITADOR_CLUSTER};
use crate::fleet_harness::{fleet_spec, Fleet, Sent, PROXIES};
use crate::leased::{latency_ms, shared_traffic, Mode, Traffic};
use crate::services::{free_port, Limitador, LimitadorStorage, Redis, RedisCounts, Sync};
use crate::table::{count, median, range, Table};
use crate::{progress, Settings};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The Limitador namespace (wasm-shim's `scope`, the rate limit request's `domain`).
const NAMESPACE: &str = "bench";

/// One configuration measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Peer {
    Floodgate(Mode),
    /// wasm-shim → Limitador with this storage, one Limitador for the fleet or one per proxy.
    Shim(LimitadorStorage, Replicas),
}

/// How many Limitador processes serve the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replicas {
    /// One, for every proxy.
    One,
    /// One per proxy, each Envoy calling its own (all on the same Redis): what scaling
    /// Limitador out looks like, and where `redis_cached` shares counters through Redis.
    PerProxy,
}

impl Replicas {
    fn count(self) -> usize {
        match self {
            Replicas::One => 1,
            Replicas::PerProxy => PROXIES,
        }
    }
}

impl Peer {
    const ALL: [Peer; 8] = [
        Peer::Floodgate(Mode::Proxy),
        Peer::Floodgate(Mode::Batched),
        Peer::Floodgate(Mode::Leased),
        Peer::Shim(LimitadorStorage::Redis, Replicas::One),
        Peer::Shim(LimitadorStorage::RedisCached { flush_ms: 100 }, Replicas::One),
        Peer::Shim(LimitadorStorage::RedisCached { flush_ms: 1000 }, Replicas::One),
        Peer::Shim(LimitadorStorage::RedisCached { flush_ms: 100 }, Replicas::PerProxy),
        Peer::Shim(LimitadorStorage::RedisCached { flush_ms: 1000 }, Replicas::PerProxy),
    ];

    /// Its id for `--variants`.
    fn id(self) -> String {
        match self {
            Peer::Floodgate(Mode::Proxy) => "proxy".into(),
            Peer::Floodgate(Mode::Batched) => "batched".into(),
            Peer::Floodgate(Mode::Leased) => "leased".into(),
            Peer::Floodgate(Mode::PerRequest) => "per-request".into(),
            Peer::Shim(storage, Replicas::One) => format!("limitador-{}", storage.id()),
            Peer::Shim(storage, Replicas::PerProxy) => format!("limitador-{}-x{PROXIES}", storage.id()),
        }
    }

    fn name(self) -> String {
        match self {
            Peer::Floodgate(mode) => format!("floodgate, {}", mode.name()),
            Peer::Shim(storage, Replicas::One) => format!("wasm-shim → Limitador, {}", storage.name()),
            Peer::Shim(storage, Replicas::PerProxy) => format!("wasm-shim → {PROXIES} Limitadors (one per proxy), {}", storage.name()),
        }
    }

    /// The processes whose CPU is counted as the limiter service's.
    fn service(self) -> &'static str {
        match self {
            Peer::Floodgate(Mode::Proxy) => "none",
            Peer::Floodgate(_) => "floodgate-sync + Redis",
            Peer::Shim(_, Replicas::One) => "Limitador + Redis",
            Peer::Shim(_, Replicas::PerProxy) => "Limitadors + Redis",
        }
    }
}

/// wasm-shim's configuration: every request to `bench.floodgate` calls Limitador with the
/// descriptor `api_key` = the `x-api-key` header, in namespace [`NAMESPACE`]; a failed call
/// refuses the request (`failureMode: deny`), after at most 1 s.
fn shim_config() -> String {
    json!({
        "services": {"limitador": {"type": "ratelimit", "endpoint": LIMITADOR_CLUSTER, "failureMode": "deny", "timeout": "1s"}},
        "actionSets": [{
            "name": "bench",
            "routeRuleConditions": {"hostnames": ["bench.floodgate"]},
            "actions": [{
                "service": "limitador",
                "scope": NAMESPACE,
                "conditionalData": [{"data": [{"expression": {"key": "api_key", "value": "request.headers['x-api-key']"}}]}]
            }]
        }]
    })
    .to_string()
}

/// Limitador's limits file: `limit` per `api_key` per hour (floodgate's rule: per `x-api-key`,
/// a 1 h window).
fn limits_file(limit: u64) -> String {
    format!("---\n- namespace: {NAMESPACE}\n  max_value: {limit}\n  seconds: 3600\n  conditions: []\n  variables:\n    - descriptors[0].api_key\n")
}

/// The fleet that serves `peer`: its floodgate mode's, or wasm-shim's with as many Limitadors.
fn fleet_of(fleets: &[(Peer, Fleet)], peer: Peer) -> Option<&Fleet> {
    let same = |p: &Peer| match (p, peer) {
        (Peer::Shim(_, a), Peer::Shim(_, b)) => *a == b,
        (a, b) => *a == b,
    };
    fleets.iter().find(|(p, _)| same(p)).map(|(_, f)| f)
}

/// Waits (at most 60 s) until `fleet`'s Envoys use under 5 % of a core.
async fn settle(fleet: &Fleet) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let cpu = || fleet.pids().iter().map(|&p| cpu_ns_of(p)).sum::<u64>();
    while Instant::now() < deadline {
        let before = cpu();
        tokio::time::sleep(Duration::from_millis(500)).await;
        if cpu().saturating_sub(before) < 25_000_000 {
            return;
        }
    }
    progress!("a fleet still busy after 60 s");
}

/// What one configuration's run measured.
#[derive(Clone, Debug)]
struct Run {
    sent: Vec<Sent>,
    hot_admitted: u64,
    /// The Envoys' CPU time over the run, ns.
    envoy_ns: u64,
    /// The limiter service's (floodgate-sync or Limitador, and Redis), ns.
    service_ns: u64,
    /// Of which redis-server's, ns.
    redis_ns: u64,
    /// Redis's counters over the run.
    redis: RedisCounts,
    /// CPU used by other processes of the machine meanwhile, in CPUs.
    others_busy: f64,
}

impl Run {
    fn per_request(&self, ns: u64) -> f64 {
        ns as f64 / self.sent.len().max(1) as f64
    }

    fn total_per_request(&self) -> f64 {
        self.per_request(self.envoy_ns + self.service_ns)
    }

    /// Responses other than 200 and 429, and transport errors.
    fn bad(&self) -> u64 {
        self.sent.iter().filter(|x| x.status != 200 && x.status != 429).count() as u64
    }
}

/// A reading around a run.
#[derive(Clone, Copy)]
struct Probe {
    envoys: u64,
    service: u64,
    redis_cpu: u64,
    own: u64,
    machine: u64,
    redis: RedisCounts,
}

/// Measurement 7.
pub async fn run(s: &Settings) {
    println!("## 7. Peers: floodgate's global scope against wasm-shim → Limitador\n");
    // The peers' builds are needed only when a configuration of theirs is measured.
    let shims = selected(s).iter().any(|p| matches!(p, Peer::Shim(..)));
    let missing: Vec<String> = [("WASM_SHIM_WASM", &s.wasm_shim_wasm), ("LIMITADOR_BIN", &s.limitador_bin)]
        .iter()
        .filter(|(_, p)| shims && !p.is_file())
        .map(|(name, p)| format!("`{name}` ({})", if p.as_os_str().is_empty() { "not set".into() } else { format!("no file at {}", p.display()) }))
        .collect();
    if !missing.is_empty() {
        println!(
            "Skipped: {} — the peers are not built here. `bench/peers/build.sh` builds wasm-shim and limitador-server from their sources and prints the two variables.\n",
            missing.join(" and ")
        );
        return;
    }
    if let Err(e) = run_fallible(s).await {
        println!("**peers** could not be measured: {e}\n");
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

/// The configurations `--variants` leaves (all without it).
fn selected(s: &Settings) -> Vec<Peer> {
    Peer::ALL.into_iter().filter(|p| s.only.as_ref().is_none_or(|only| only.contains(&p.id()))).collect()
}

async fn run_fallible(s: &Settings) -> Result<(), String> {
    let peers = selected(s);
    if peers.is_empty() {
        return Err("no configuration left by --variants".into());
    }
    // The ratios are to floodgate batched (or to the first configuration if it is left out).
    let base = peers.iter().position(|p| *p == Peer::Floodgate(Mode::Batched)).unwrap_or(0);
    // Half part (f)'s rate: at 1 200 req/s, wasm-shim's three Envoys needed all of core 0
    // on a 2-core VM, and latency measured their queues.
    let traffic = if s.quick { Traffic::at(400, 6) } else { Traffic::at(600, 15) };
    let redis = Redis::start(&s.redis_server)?;
    let sync = Sync::start(&s.sync_bin, &redis.url())?;
    let (upstream, _) = crate::load::start_upstream().await;
    // Limitador's addresses: one per proxy (the first is also the single one's).
    let limitador_addrs: Vec<SocketAddr> = (0..PROXIES).map(|_| free_port().map(|p| SocketAddr::from(([127, 0, 0, 1], p)))).collect::<Result<_, _>>()?;
    let limits = limits_file(traffic.limit);
    let load_before = load_average();

    // One fleet per floodgate mode, and one per number of Limitador replicas for wasm-shim
    // (Limitador started afresh for each of its runs, on the same ports).
    let mut fleets: Vec<(Peer, Fleet)> = Vec::new();
    for &peer in &peers {
        if fleet_of(&fleets, peer).is_some() {
            continue;
        }
        let fleet = match peer {
            Peer::Floodgate(mode) => Fleet::start(s, &mode.config(traffic.limit), upstream, sync.addr)?,
            Peer::Shim(_, replicas) => {
                let specs = (0..PROXIES).map(|k| {
                    let limitador = limitador_addrs[k % replicas.count()];
                    fleet_spec(&s.wasm_shim_wasm, shim_config(), upstream, vec![(LIMITADOR_CLUSTER, limitador)], Vec::new())
                });
                Fleet::of_each(s, specs.collect())?
            }
        };
        fleets.push((peer, fleet));
    }

    // runs[peer][round]
    let mut runs: Vec<Vec<Run>> = peers.iter().map(|_| Vec::new()).collect();
    for round in 0..s.rounds {
        for k in 0..peers.len() {
            let i = (k + round) % peers.len();
            let peer = peers[i];
            let fleet = fleet_of(&fleets, peer).ok_or("no fleet")?;
            // A fleet that fell behind still works through its queue after its run: not during this one.
            for (_, f) in &fleets {
                settle(f).await;
            }
            let limitadors: Vec<Limitador> = match peer {
                Peer::Shim(storage, replicas) => limitador_addrs[..replicas.count()]
                    .iter()
                    .map(|&addr| Limitador::start(&s.limitador_bin, &limits, storage, &redis.url(), addr))
                    .collect::<Result<_, _>>()?,
                Peer::Floodgate(_) => Vec::new(),
            };
            // The limiter service: its processes and Redis (none in proxy scope).
            let service_pids: Vec<u32> = match peer {
                Peer::Floodgate(Mode::Proxy) => Vec::new(),
                Peer::Floodgate(_) => [sync.pid()].into_iter().chain(redis.pid()).collect(),
                Peer::Shim(..) => limitadors.iter().map(Limitador::pid).chain(redis.pid()).collect(),
            };
            let pids = fleet.pids();
            let take = || Probe {
                envoys: pids.iter().map(|&p| cpu_ns_of(p)).sum(),
                service: service_pids.iter().map(|&p| cpu_ns_of(p)).sum(),
                redis_cpu: redis.pid().map_or(0, cpu_ns_of),
                own: cpu_ns_of(std::process::id()),
                machine: machine_busy_ns(),
                redis: redis.counts().unwrap_or_default(),
            };
            let by_name_before = redis.calls_by_name().unwrap_or_default();
            let usec_before = redis.usec_by_name().unwrap_or_default();
            let started = Instant::now();
            let shared = shared_traffic(&fleet.addrs(), traffic, take).await;
            let by_name = redis.calls_by_name().unwrap_or_default();
            let usec = redis.usec_by_name().unwrap_or_default();
            let seconds = started.elapsed().as_secs_f64().max(1e-9);
            let (a, b) = (shared.before, shared.after);
            let envoy_ns = b.envoys.saturating_sub(a.envoys);
            let service_ns = b.service.saturating_sub(a.service);
            // Redis counts as the service's only where the service uses it (not in proxy scope).
            let redis_ns = if service_pids.is_empty() { 0 } else { b.redis_cpu.saturating_sub(a.redis_cpu) };
            let others = b.machine.saturating_sub(a.machine) as f64 - (envoy_ns + service_ns + b.own.saturating_sub(a.own)) as f64;
            let run = Run {
                sent: shared.sent,
                hot_admitted: shared.hot_admitted,
                envoy_ns,
                service_ns,
                redis_ns,
                redis: b.redis.since(a.redis),
                others_busy: (others / 1e9 / seconds).max(0.0),
            };
            drop(limitadors);
            progress!(
                "round {}/{} {}: hot key {} of L {}; p50 {:.2} ms, p99 {:.2} ms; Envoy {:.1} µs/req, service {:.1} µs/req; Redis {:.3} scripts, {:.3} commands/req; {} other statuses",
                round + 1,
                s.rounds,
                peer.name(),
                run.hot_admitted,
                traffic.limit,
                latency_ms(&run.sent, 0.5),
                latency_ms(&run.sent, 0.99),
                run.per_request(run.envoy_ns) / 1000.0,
                run.per_request(run.service_ns) / 1000.0,
                run.redis.scripts as f64 / run.sent.len().max(1) as f64,
                run.redis.commands as f64 / run.sent.len().max(1) as f64,
                run.bad()
            );
            let mut per_request: Vec<(u64, &String)> =
                by_name.iter().map(|(name, calls)| (calls.saturating_sub(by_name_before.get(name).copied().unwrap_or(0)), name)).filter(|(n, _)| *n > 0).collect();
            per_request.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
            let listed: Vec<String> =
                per_request.iter().map(|(n, name)| format!("{name} {:.3}", *n as f64 / run.sent.len().max(1) as f64)).collect();
            progress!("  Redis commands per request by name (those inside scripts included): {}", listed.join(", "));
            let mut time: Vec<(u64, &String)> =
                usec.iter().map(|(name, us)| (us.saturating_sub(usec_before.get(name).copied().unwrap_or(0)), name)).filter(|(n, _)| *n > 0).collect();
            time.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
            let listed: Vec<String> = time.iter().map(|(us, name)| format!("{name} {:.2}", *us as f64 / run.sent.len().max(1) as f64)).collect();
            progress!(
                "  Redis time per request by name, µs (INFO commandstats; a script's includes the commands it calls; the CPU above also has the event loop and the network): {}",
                listed.join(", ")
            );
            runs[i].push(run);
        }
    }
    let load_after = load_average();

    let med = |rs: &[Run], f: &dyn Fn(&Run) -> f64| median(&rs.iter().map(f).collect::<Vec<_>>());
    let spread = |v: &[f64], digits: usize| {
        let (lo, hi) = range(v);
        format!("{:.digits$} ({lo:.digits$}–{hi:.digits$})", median(v))
    };
    let mut t = Table::new(&[
        "configuration",
        "hot key admitted ÷ L (median; range)",
        "latency p50",
        "latency p99",
        "Envoy CPU µs/req",
        "limiter service CPU µs/req",
        "of which Redis µs/req",
        "total CPU µs/req",
        &format!("total × {} (median; range)", peers[base].name()),
        "Redis calls / request (scripts; all commands)",
        "other statuses",
        "others busy",
    ]);
    for (i, peer) in peers.iter().enumerate() {
        let rs = &runs[i];
        let ratios: Vec<f64> = rs.iter().zip(&runs[base]).map(|(r, b)| r.total_per_request() / b.total_per_request().max(1.0)).collect();
        let admitted: Vec<f64> = rs.iter().map(|r| r.hot_admitted as f64 / traffic.limit as f64).collect();
        t.row(vec![
            peer.name(),
            spread(&admitted, 4),
            format!("{:.2} ms", med(rs, &|r| latency_ms(&r.sent, 0.5))),
            format!("{:.2} ms", med(rs, &|r| latency_ms(&r.sent, 0.99))),
            format!("{:.1}", med(rs, &|r| r.per_request(r.envoy_ns) / 1000.0)),
            format!("{:.1} ({})", med(rs, &|r| r.per_request(r.service_ns) / 1000.0), peer.service()),
            format!("{:.1}", med(rs, &|r| r.per_request(r.redis_ns) / 1000.0)),
            format!("{:.1}", med(rs, &|r| r.total_per_request() / 1000.0)),
            if i == base { "1.000".into() } else { spread(&ratios, 3) },
            format!(
                "{:.3}; {:.3}",
                med(rs, &|r| r.redis.scripts as f64 / r.sent.len().max(1) as f64),
                med(rs, &|r| r.redis.commands as f64 / r.sent.len().max(1) as f64)
            ),
            count(rs.iter().map(Run::bad).sum()),
            format!("{:.0}%", 100.0 * med(rs, &|r| r.others_busy)),
        ]);
    }
    let Traffic { limit, rate, seconds } = traffic;
    println!(
        "{} Envoys (2 workers each, all pinned to core 0) per configuration; floodgate-sync, Limitador, redis-server, the load generator and the upstream on core {}. \
         Paced at {rate:.0} req/s over the proxies for {seconds} s, after 1 s of warm-up on other keys: every other request on one hot key whose limit `L` = {limit} \
         per hour is half of what it gets, the others over 200 keys far under it; fresh keys for every run. floodgate: one rule per `x-api-key`, `window: 1h`, \
         `sync_interval` 100 ms. wasm-shim: one action calling Limitador (Envoy's rate limit service, gRPC, `failureMode: deny`, timeout 1 s) with the descriptor \
         `api_key` = `x-api-key`; Limitador: `max_value` `L`, `seconds: 3600`, variable `descriptors[0].api_key`, started afresh for each run: one for the three proxies, or one per proxy (each Envoy calling its own, all on the one Redis). {} rounds, each configuration \
         once per round in a rotated order; medians over rounds. Latency: admitted requests, from when each was due. CPU: the three Envoys' time, and the limiter \
         service's (its process and redis-server; redis-server's alone beside it), over the requests sent; the ratio is taken within each round. \"others busy\": CPUs used meanwhile by the rest of \
         the machine. Load average before and after: {load_before} / {load_after}.\n",
        PROXIES,
        s.cpus.saturating_sub(1),
        s.rounds
    );
    println!("{}\n", t.render());
    if peers.iter().any(|p| matches!(p, Peer::Shim(..))) {
        println!(
            "Modules: floodgate {} ; wasm-shim {} ; limitador-server {}.\n",
            s.floodgate_wasm.display(),
            s.wasm_shim_wasm.display(),
            s.limitador_bin.display()
        );
    } else {
        println!("Module: floodgate {}.\n", s.floodgate_wasm.display());
    }
    Ok(())
}
