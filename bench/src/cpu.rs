//! Measurement 1: CPU per request of the Envoy process, one worker pinned to core 0, the load
//! generator and the upstreams on the other core, for each variant, alternated over several
//! rounds; medians and ratios to "no filter". Latency and throughput at a fixed connection
//! count are secondary figures.

use crate::envoy::{Envoy, Filter, KernelCounts, Route, Spec};
use crate::load::{self, Load, Requests};
use crate::table::{median, range, Table};
use crate::variant::{rule, Variant, NAIVE_RULE};
use crate::{progress, Selection, Settings};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Distinct `x-api-key` values the load cycles through.
pub const KEYS: usize = 1000;
/// The route header of cluster selection.
pub const ROUTE_HEADER: &str = "x-floodgate-cluster";

/// The path of the health endpoint of the variants that have one.
pub const HEALTH_PATH: &str = "/floodgate/health";

/// floodgate's "everything on" configuration.
pub fn everything_config(selection: bool) -> String {
    let selection = if selection {
        format!(r#", "cluster_selection": {{"route_header": "{ROUTE_HEADER}", "clusters": ["a", "b", "c"]}}"#)
    } else {
        String::new()
    };
    format!(
        r#"{{"rate_limits": [{}], "load_shedding": {{"max_active_requests": 100000}}, "health": {{"path": "{HEALTH_PATH}"}}{selection}}}"#,
        rule("per-key")
    )
}

fn wasm(module: &std::path::Path, config: impl Into<String>) -> Filter {
    Filter::Wasm { module: module.to_path_buf(), config: config.into() }
}

/// The five variants compared, the naive limiter enforcing `fg-rl`'s rule and floodgate
/// with that rule and the naive limiter's output (`fg-rl-onreject`), and the external
/// modules given with `--extra-wasm` (`ext1`, `ext2`, … in the order given).
fn main_variants(s: &Settings) -> Vec<Variant> {
    let fg = |config: String| wasm(&s.floodgate_wasm, config);
    let mut v = vec![
        Variant { id: "none", label: "no filter (router only)".into(), filter: Filter::None, route: Route::Fixed },
        Variant { id: "native", label: "Envoy local_ratelimit (one token bucket)".into(), filter: Filter::NativeLocalRateLimit, route: Route::Fixed },
        Variant { id: "noop", label: "no-op proxy-wasm filter".into(), filter: wasm(&s.noop_wasm, ""), route: Route::Fixed },
        Variant { id: "fg-rl", label: "floodgate: rate limiting (1 rule)".into(), filter: fg(format!(r#"{{"rate_limits": [{}]}}"#, rule("per-key"))), route: Route::Fixed },
        Variant {
            id: "fg-rl-onreject",
            label: "floodgate: the same rule, `ratelimit` fields on 429s only (the naive limiter's output)".into(),
            filter: fg(format!(r#"{{"rate_limits": [{}], "ratelimit_headers": "on_reject"}}"#, rule("per-key"))),
            route: Route::Fixed,
        },
        Variant {
            id: "naive-rl",
            label: "naive limiter, the same rule (one shared-data entry per key: get + CAS set per request)".into(),
            filter: wasm(&s.naive_wasm, NAIVE_RULE),
            route: Route::Fixed,
        },
        Variant { id: "fg-all", label: "floodgate: everything on".into(), filter: fg(everything_config(true)), route: Route::ClusterHeader(ROUTE_HEADER.into()) },
    ];
    v.extend(extra_variants(s));
    v
}

/// The modules of `--extra-wasm`, each with its `--extra-config`: one-off measurements of
/// another proxy-wasm filter (e.g. another rate limiter configured for `fg-rl`'s rule).
pub fn extra_variants(s: &Settings) -> Vec<Variant> {
    s.extra
        .iter()
        .enumerate()
        .map(|(i, (module, config))| Variant {
            id: Box::leak(format!("ext{}", i + 1).into_boxed_str()),
            label: format!("external module {} `{config}`", module.file_name().map_or_else(|| module.display().to_string(), |f| f.to_string_lossy().into_owned())),
            filter: wasm(module, config.as_str()),
            route: Route::Fixed,
        })
        .collect()
}

/// Host-call pricing: the no-op module making this many calls of one kind per request.
pub const CALLS: u32 = 20;

/// Variants that show where the time goes.
fn diagnostic_variants(s: &Settings) -> Vec<Variant> {
    let fg = |config: String| wasm(&s.floodgate_wasm, config);
    let mut v = vec![
        Variant { id: "fg-empty", label: "floodgate `{}` (loaded, nothing configured)".into(), filter: fg("{}".into()), route: Route::Fixed },
        Variant {
            id: "fg-rl2",
            label: "floodgate: 2 rules (x-api-key; source_ip)".into(),
            filter: fg(format!(
                r#"{{"rate_limits": [{}, {{"name": "per-ip", "key": ["source_ip"], "limit": 1000000000, "window": "1m"}}]}}"#,
                rule("per-key")
            )),
            route: Route::Fixed,
        },
        Variant {
            id: "fg-shed",
            label: "floodgate: load shedding only".into(),
            filter: fg(r#"{"load_shedding": {"max_active_requests": 100000}}"#.into()),
            route: Route::Fixed,
        },
        Variant {
            id: "fg-queue",
            label: "floodgate: load shedding with a queue (load leveling)".into(),
            filter: fg(r#"{"load_shedding": {"max_active_requests": 100000, "queue": {"max_queued": 64, "max_wait": "1s"}}}"#.into()),
            route: Route::Fixed,
        },
        Variant { id: "fg-health", label: "floodgate: health endpoint only".into(), filter: fg(format!(r#"{{"health": {{"path": "{HEALTH_PATH}"}}}}"#)), route: Route::Fixed },
        Variant { id: "fg-rl-shed", label: "floodgate: rate limiting + shedding + health".into(), filter: fg(everything_config(false)), route: Route::Fixed },
        // Ten rules whose condition never matches, next to fg-rl's rule: what
        // conditions cost a request they do not apply to.
        Variant {
            id: "fg-rl-10-unmatched",
            label: "floodgate: 1 rule + 10 rules whose match fails (path, method)".into(),
            filter: fg(format!(
                r#"{{"rate_limits": [{}{}]}}"#,
                rule("per-key"),
                (0..10)
                    .map(|i| format!(
                        r#", {{"name": "never-{i}", "key": ["source_ip"], "limit": 5, "window": "1m", "match": {{"path": {{"prefix": "/never/{i}/"}}, "methods": ["POST"]}}}}"#
                    ))
                    .collect::<String>()
            )),
            route: Route::Fixed,
        },
        // The bulkhead's cost. Cluster selection alone over a, b, c; the same with
        // each x-api-key confined to 2 of the 3 clusters (it weighs 2 records, not 3); and the
        // per-key in-flight cap alone (a compare-and-swap on the key's set at admission and at
        // the end of the stream).
        Variant {
            id: "fg-select",
            label: "floodgate: cluster selection only (3 clusters)".into(),
            filter: fg(format!(r#"{{"cluster_selection": {{"route_header": "{ROUTE_HEADER}", "clusters": ["a", "b", "c"]}}}}"#)),
            route: Route::ClusterHeader(ROUTE_HEADER.into()),
        },
        Variant {
            id: "fg-select-partition",
            label: "floodgate: cluster selection, partitions of 2 of 3 by x-api-key".into(),
            filter: fg(format!(
                r#"{{"cluster_selection": {{"route_header": "{ROUTE_HEADER}", "clusters": ["a", "b", "c"], "partition": {{"key": [{{"header": "x-api-key"}}], "size": 2}}}}}}"#
            )),
            route: Route::ClusterHeader(ROUTE_HEADER.into()),
        },
        Variant {
            id: "fg-per-key",
            label: "floodgate: per-key in-flight cap only (x-api-key)".into(),
            filter: fg(r#"{"load_shedding": {"per_key": {"key": [{"header": "x-api-key"}], "max_active_requests": 1000}}}"#.into()),
            route: Route::Fixed,
        },
        // The host calls one admitted request of `fg-rl` makes, and nothing else: fg-rl minus
        // this is floodgate's own code (and the allocations the calls cause).
        Variant {
            id: "calls-rl",
            label: "no-op making fg-rl's host calls (clock, key header, counter, 2 response headers)".into(),
            filter: wasm(&s.noop_wasm, "time=1,header=1,incr=1,resp=2"),
            route: Route::Fixed,
        },
    ];
    for (kind, what) in [
        ("time", "get_current_time"),
        ("header", "request header read"),
        ("absent", "read of an absent request header"),
        ("pairs", "read of all request headers at once"),
        ("prop", "get_property(source.address)"),
        ("get", "get_shared_data (84 B)"),
        ("set", "set_shared_data (84 B)"),
        ("incr", "increment_metric"),
        ("resp", "response header add"),
    ] {
        v.push(Variant {
            id: Box::leak(format!("call-{kind}").into_boxed_str()),
            label: format!("no-op + {CALLS} × {what}"),
            filter: wasm(&s.noop_wasm, format!("{kind}={CALLS}")),
            route: Route::Fixed,
        });
    }
    v
}

/// The gRPC variants: unary gRPC calls over HTTP/2 (downstream and upstream, every call
/// answered with a message and `grpc-status: 0` in the trailers) instead of HTTP/1.1 `GET`s.
fn grpc_variants(s: &Settings) -> Vec<Variant> {
    vec![
        Variant { id: "grpc-none", label: "gRPC calls, no filter (router only)".into(), filter: Filter::None, route: Route::Fixed },
        Variant { id: "grpc-noop", label: "gRPC calls, no-op proxy-wasm filter".into(), filter: wasm(&s.noop_wasm, ""), route: Route::Fixed },
        Variant {
            id: "grpc-fg-all",
            label: "gRPC calls, floodgate: everything on".into(),
            filter: wasm(&s.floodgate_wasm, everything_config(true)),
            route: Route::ClusterHeader(ROUTE_HEADER.into()),
        },
    ]
}

/// Whether a variant's traffic is gRPC calls.
pub fn is_grpc(variant: &Variant) -> bool {
    variant.id.starts_with("grpc-")
}

/// The variant every variant's ratio is taken against: the router only, with the same traffic.
pub fn base_of(variant: &Variant) -> &'static str {
    if let Some(base) = crate::llm::base_of(variant) {
        return base;
    }
    if is_grpc(variant) { "grpc-none" } else { "none" }
}

/// The no-op module with the same traffic.
pub fn noop_of(variant: &Variant) -> &'static str {
    if crate::llm::answer_of(variant).is_some() {
        return "";
    }
    if is_grpc(variant) { "grpc-noop" } else { "noop" }
}

/// Every variant: main, diagnostic and gRPC.
pub fn all_variants(s: &Settings) -> Vec<Variant> {
    main_variants(s).into_iter().chain(diagnostic_variants(s)).chain(grpc_variants(s)).chain(crate::llm::variants(s)).collect()
}

/// The upstreams of clusters `a`, `b`, `c`: HTTP/1.1 ones and gRPC ones; and the OpenAI-like
/// one of the LLM variants.
#[derive(Clone, Copy, Debug)]
pub struct Upstreams {
    /// HTTP/1.1.
    pub http: [SocketAddr; 3],
    /// gRPC (HTTP/2).
    pub grpc: [SocketAddr; 3],
    /// The LLM variants' (HTTP/2, [`crate::llm`]).
    pub llm: SocketAddr,
}

impl Upstreams {
    /// Starts three of each.
    pub async fn start() -> Upstreams {
        let mut http = Vec::new();
        let mut grpc = Vec::new();
        for _ in 0..3 {
            http.push(load::start_upstream().await.0);
            grpc.push(load::start_grpc_upstream().await.0);
        }
        Upstreams {
            http: [http[0], http[1], http[2]],
            grpc: [grpc[0], grpc[1], grpc[2]],
            llm: crate::llm::start_upstream().await,
        }
    }

    /// The Envoy of `variant`: its filter and route, these upstreams for its traffic.
    pub fn spec(&self, variant: &Variant, cpus: String, wrapper: Vec<String>) -> Spec {
        let llm = crate::llm::answer_of(variant).is_some();
        Spec {
            filter: variant.filter.clone(),
            route: variant.route.clone(),
            clusters: if llm {
                [self.llm; 3]
            } else if is_grpc(variant) {
                self.grpc
            } else {
                self.http
            },
            http2: is_grpc(variant) || llm,
            concurrency: 1,
            cpus,
            wrapper,
            services: Vec::new(),
        }
    }
}

/// What a variant's clients send: `x-api-key` cycling over [`KEYS`] values (HTTP/1.1 `GET /`,
/// unary gRPC calls, or an LLM variant's `GET /v1/<kind>/<size>`).
#[derive(Clone)]
pub struct Traffic {
    prefix: String,
    http: Arc<Vec<Vec<u8>>>,
    grpc: Arc<Vec<String>>,
}

impl Traffic {
    /// `keys` distinct keys, `<prefix><i>`.
    pub fn new(prefix: &str, keys: usize) -> Traffic {
        Traffic {
            prefix: prefix.into(),
            http: key_requests(prefix, keys),
            grpc: Arc::new((0..keys).map(|i| format!("{prefix}{i}")).collect()),
        }
    }

    /// The requests of `variant`.
    pub fn requests(&self, variant: &Variant) -> Requests {
        if let Some((kind, size)) = crate::llm::answer_of(variant) {
            Requests::Cycle(crate::llm::requests(&self.prefix, self.grpc.len(), kind, size))
        } else if is_grpc(variant) {
            Requests::Grpc(Arc::clone(&self.grpc))
        } else {
            Requests::Cycle(Arc::clone(&self.http))
        }
    }
}

/// `variants` less those `--variants` leaves out.
fn selected(s: &Settings, variants: Vec<Variant>) -> Vec<Variant> {
    match &s.only {
        Some(only) => variants.into_iter().filter(|v| only.iter().any(|o| o == v.id)).collect(),
        None => variants,
    }
}

/// The `x-api-key` requests every variant gets (identical bytes for all).
pub fn key_requests(prefix: &str, n: usize) -> Arc<Vec<Vec<u8>>> {
    Arc::new((0..n).map(|i| load::request("/", &[("x-api-key", format!("{prefix}{i}"))])).collect())
}

/// One measured run.
#[derive(Clone, Debug)]
pub struct Run {
    /// Envoy CPU nanoseconds per response.
    pub cpu_ns_per_req: f64,
    /// Responses per second.
    pub rps: f64,
    /// Latency percentiles (µs).
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Non-200 responses.
    pub not_ok: u64,
    /// Transport errors.
    pub errors: u64,
    /// Envoy's CPU time over the interval's length.
    pub envoy_busy: f64,
    /// The load generator's and upstreams' (this process's) CPU time over the interval's length.
    pub loadgen_busy: f64,
    /// Everything else on the machine (other processes), in CPUs.
    pub others_busy: f64,
    /// Envoy's user-mode CPU nanoseconds per response (10 ms ticks: rougher than `cpu_ns_per_req`).
    pub user_ns_per_req: f64,
    /// Envoy's kernel-mode CPU nanoseconds per response (likewise).
    pub system_ns_per_req: f64,
    /// Envoy's minor page faults per response.
    pub minor_faults_per_req: f64,
    /// Envoy's context switches (all threads) per response.
    pub switches_per_req: f64,
}

/// Waits (at most `max`) until the rest of the machine is quiet: less than a quarter of a CPU
/// busy over 300 ms, with our own Envoys idle. Other processes on a small machine (builds,
/// tests) skew CPU-per-request figures; this keeps most runs clear of them. Returns whether it
/// got quiet.
pub async fn wait_for_quiet(max: Duration) -> bool {
    let deadline = std::time::Instant::now() + max;
    loop {
        let before = crate::envoy::machine_busy_ns();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let busy = crate::envoy::machine_busy_ns().saturating_sub(before) as f64 / 300e6;
        if busy < 0.25 {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
    }
}

/// Runs `load` against `envoy` and measures Envoy's CPU over the interval.
pub async fn measure(envoy: &Envoy, load: &Load, s: &Settings) -> Run {
    let pid = envoy.pid();
    let (mut out, before, after) = load::run(
        load,
        Duration::from_secs_f64(s.warmup),
        Duration::from_secs_f64(s.seconds),
        || (crate::envoy::cpu_ns_of(pid), crate::envoy::cpu_ns_of(std::process::id()), crate::envoy::machine_busy_ns(), KernelCounts::of(pid)),
    )
    .await;
    let kernel = after.3.since(&before.3);
    let completed = out.completed.max(1) as f64;
    let per_request = |n: u64| n as f64 / completed;
    let machine = after.2.saturating_sub(before.2) as f64;
    let cpu = after.0.saturating_sub(before.0) as f64;
    let own = after.1.saturating_sub(before.1) as f64;
    let elapsed_ns = out.elapsed.as_nanos().max(1) as f64;
    Run {
        cpu_ns_per_req: cpu / out.completed.max(1) as f64,
        rps: out.throughput(),
        p50: out.latency_us(0.50),
        p99: out.latency_us(0.99),
        not_ok: out.completed - out.status(200),
        errors: out.errors,
        envoy_busy: cpu / elapsed_ns,
        loadgen_busy: own / elapsed_ns,
        others_busy: ((machine - cpu - own) / elapsed_ns).max(0.0),
        user_ns_per_req: per_request(kernel.user_ns),
        system_ns_per_req: per_request(kernel.system_ns),
        minor_faults_per_req: per_request(kernel.minor_faults),
        switches_per_req: per_request(kernel.context_switches),
    }
}

/// Sends a few requests; `Ok` if all got 200 (gRPC: and `grpc-status: 0`).
pub async fn sanity(envoy: &Envoy, requests: Requests) -> Result<(), String> {
    let load = Load { targets: vec![envoy.addr()], connections: 2, requests, max_requests: None };
    let (out, _, _) = load::run(&load, Duration::ZERO, Duration::from_millis(300), || ()).await;
    if out.completed == 0 || out.status(200) != out.completed {
        return Err(format!("{} responses, statuses {:?}, {} errors", out.completed, out.statuses, out.errors));
    }
    Ok(())
}

struct Started {
    variant: Variant,
    envoy: Envoy,
    runs: Vec<Run>,
    /// Ratio to "none" of the same round, per round.
    ratios: Vec<f64>,
}

async fn start_all(variants: Vec<Variant>, s: &Settings, upstreams: Upstreams, traffic: &Traffic) -> Vec<Started> {
    let mut started = Vec::new();
    for mut variant in variants {
        let spec = |v: &Variant| upstreams.spec(v, "0".into(), Vec::new());
        let mut result = spec(&variant).start(&s.envoy);
        if let Ok(envoy) = &result {
            if let Err(e) = sanity(envoy, traffic.requests(&variant)).await {
                result = Err(format!("requests fail: {e}; end of its log:\n{}", envoy.log_tail(10)));
            }
        }
        if variant.id.ends_with("fg-all") && s.selection != Selection::On {
            let fallback = match (&result, s.selection) {
                (_, Selection::Off) => Some("cluster selection off (--selection off)"),
                (Err(e), _) => {
                    progress!("fg-all with cluster_selection failed ({}); running it without cluster selection", e.lines().next().unwrap_or(""));
                    Some("without cluster selection: this module refused it")
                }
                _ => None,
            };
            if let Some(why) = fallback {
                variant.filter = wasm(&s.floodgate_wasm, everything_config(false));
                variant.route = Route::Fixed;
                variant.label = format!("floodgate: rate limiting + shedding + health ({why})");
                result = spec(&variant).start(&s.envoy);
            }
        }
        match result {
            Ok(envoy) => {
                progress!("started {} (pid {})", variant.id, envoy.pid());
                started.push(Started { variant, envoy, runs: Vec::new(), ratios: Vec::new() });
            }
            Err(e) => {
                println!("\n**{}** could not be measured: {e}\n", variant.id);
            }
        }
    }
    started
}

async fn rounds(group: &mut [Started], rounds: usize, load_for: impl Fn(&Started) -> Load, s: &Settings) {
    let n = group.len();
    for round in 0..rounds {
        let mut this_round = vec![None; n];
        // Alternate, and rotate the order from round to round so drift spreads evenly.
        for k in 0..n {
            let i = (k + round) % n;
            let load = load_for(&group[i]);
            wait_for_quiet(Duration::from_secs(if s.quick { 3 } else { 6 })).await;
            let run = measure(&group[i].envoy, &load, s).await;
            progress!(
                "round {}/{} {:<16} {:>7.1} µs/req {:>8.0} req/s p99 {:>6.0} µs, busy: Envoy {:.0}% load {:.0}% others {:.0}%{}",
                round + 1,
                rounds,
                group[i].variant.id,
                run.cpu_ns_per_req / 1000.0,
                run.rps,
                run.p99,
                run.envoy_busy * 100.0,
                run.loadgen_busy * 100.0,
                run.others_busy * 100.0,
                if run.not_ok + run.errors > 0 { format!(" ({} not 200, {} errors)", run.not_ok, run.errors) } else { String::new() }
            );
            this_round[i] = Some(run.cpu_ns_per_req);
            group[i].runs.push(run);
        }
        let of = |id: &str| group.iter().position(|g| g.variant.id == id).and_then(|b| this_round[b]);
        let bases: Vec<Option<f64>> = group.iter().map(|g| of(base_of(&g.variant))).collect();
        for ((g, cpu), base) in group.iter_mut().zip(&this_round).zip(bases) {
            if let (Some(cpu), Some(base)) = (cpu, base) {
                g.ratios.push(cpu / base);
            }
        }
    }
}

fn table(group: &[Started]) -> Table {
    let mut t = Table::new(&["variant", "what", "CPU µs/req (median)", "× no filter (median; range)", "req/s", "p50 µs", "p99 µs", "Envoy busy", "others busy"]);
    for g in group {
        let cpu: Vec<f64> = g.runs.iter().map(|r| r.cpu_ns_per_req / 1000.0).collect();
        let (lo, hi) = range(&g.ratios);
        let bad: u64 = g.runs.iter().map(|r| r.not_ok + r.errors).sum();
        t.row(vec![
            format!("`{}`", g.variant.id),
            format!("{}{}", g.variant.label, if bad > 0 { format!(" ⚠ {bad} non-200/errors") } else { String::new() }),
            format!("{:.2}", median(&cpu)),
            format!("{:.3} ({:.3}–{:.3})", median(&g.ratios), lo, hi),
            format!("{:.0}", median(&g.runs.iter().map(|r| r.rps).collect::<Vec<_>>())),
            format!("{:.0}", median(&g.runs.iter().map(|r| r.p50).collect::<Vec<_>>())),
            format!("{:.0}", median(&g.runs.iter().map(|r| r.p99).collect::<Vec<_>>())),
            format!("{:.0}%", 100.0 * median(&g.runs.iter().map(|r| r.envoy_busy).collect::<Vec<_>>())),
            format!("{:.0}%", 100.0 * median(&g.runs.iter().map(|r| r.others_busy).collect::<Vec<_>>())),
        ]);
    }
    t
}

/// Where Envoy's CPU time went, per response (medians over rounds): user and kernel time, page
/// faults, context switches. Instruction counts (measurement 1b) see none of the kernel's share.
fn kernel_table(group: &[Started]) -> Table {
    let mut t = Table::new(&["variant", "user µs/req", "system µs/req", "minor faults per 1 000 req", "context switches per 1 000 req"]);
    for g in group {
        let of = |f: fn(&Run) -> f64| median(&g.runs.iter().map(f).collect::<Vec<_>>());
        t.row(vec![
            format!("`{}`", g.variant.id),
            format!("{:.2}", of(|r| r.user_ns_per_req) / 1000.0),
            format!("{:.2}", of(|r| r.system_ns_per_req) / 1000.0),
            format!("{:.1}", of(|r| r.minor_faults_per_req) * 1000.0),
            format!("{:.1}", of(|r| r.switches_per_req) * 1000.0),
        ]);
    }
    t
}

/// floodgate against the other rate limiters of the group (the naive design, `--extra-wasm`
/// modules), round by round: the ratio of their CPU per request within each round (measured
/// seconds to a minute apart), which does not carry the noise of a third variant's run (the
/// ratios to "no filter" do).
/// `None` when the group holds no such pair.
fn head_to_head(group: &[Started]) -> Option<Table> {
    let mut t = Table::new(&["floodgate", "against", "CPU/req ratio per round, median (range)", "rounds floodgate used less CPU"]);
    let ours = group.iter().filter(|g| ["fg-rl", "fg-rl-onreject"].contains(&g.variant.id));
    for a in ours {
        for b in group.iter().filter(|g| g.variant.id == "naive-rl" || g.variant.id.starts_with("ext")) {
            let ratios: Vec<f64> = a.runs.iter().zip(&b.runs).map(|(x, y)| x.cpu_ns_per_req / y.cpu_ns_per_req.max(1.0)).collect();
            if ratios.is_empty() {
                continue;
            }
            let (lo, hi) = range(&ratios);
            t.row(vec![
                format!("`{}`", a.variant.id),
                format!("`{}`", b.variant.id),
                format!("{:.3} ({lo:.3}–{hi:.3})", median(&ratios)),
                format!("{} of {}", ratios.iter().filter(|r| **r < 1.0).count(), ratios.len()),
            ]);
        }
    }
    (!t.is_empty()).then_some(t)
}

/// Measurement 1.
pub async fn run(s: &Settings) {
    println!("## 1. CPU per request (Envoy: 1 worker pinned to core 0; load generator and upstreams on core {})\n", s.cpus.saturating_sub(1));
    if s.cpus < 2 {
        println!("(only one CPU: Envoy and the load generator share it; figures are rougher)\n");
    }
    let upstreams = Upstreams::start().await;
    let traffic = Traffic::new("k", KEYS);
    let load_for = |started: &Started| Load {
        targets: vec![started.envoy.addr()],
        connections: s.connections,
        requests: traffic.requests(&started.variant),
        max_requests: None,
    };
    let mut group = start_all(selected(s, main_variants(s)), s, upstreams, &traffic).await;
    rounds(&mut group, s.rounds, load_for, s).await;
    println!(
        "{} connections, {} distinct x-api-key values, every request admitted; {} rounds of {:.0} s (after {:.0} s warm-up) per variant, alternated. \
         Ratio: the variant's CPU/request over \"no filter\"'s in the same round, median over rounds (range). \
         \"Envoy busy\": share of its core; \"others busy\": CPU used by other processes of the machine meanwhile (noise).\n",
        s.connections, KEYS, s.rounds, s.seconds, s.warmup
    );
    println!("{}\n", table(&group).render());
    if let Some(t) = head_to_head(&group) {
        println!("Against other rate limiters, round by round:\n\n{}\n", t.render());
    }
    println!("Where Envoy's CPU time went (the kernel's counts for its process, medians over rounds):\n\n{}\n", kernel_table(&group).render());
    drop(group);
    let mut group = start_all(selected(s, grpc_variants(s)), s, upstreams, &traffic).await;
    if !group.is_empty() {
        rounds(&mut group, s.rounds, load_for, s).await;
        println!(
            "### gRPC calls\n\nThe same, with unary gRPC calls over HTTP/2 (one at a time per connection, {} connections; HTTP/2 \
             upstreams answering a message and grpc-status 0 in the trailers). Ratio: over \"gRPC calls, no filter\" in the same round.\n\n{}\n",
            s.connections,
            table(&group).render()
        );
    }
    drop(group);
    if !s.diagnose {
        return;
    }
    println!("### Where the time goes: diagnostic variants\n");
    let base = main_variants(s).into_iter().filter(|v| ["none", "noop", "fg-rl", "fg-rl-onreject"].contains(&v.id));
    let variants: Vec<Variant> = base.chain(diagnostic_variants(s)).collect();
    let diag_rounds = s.rounds.div_ceil(2).clamp(2, 3);
    let mut group = start_all(selected(s, variants), s, upstreams, &traffic).await;
    rounds(&mut group, diag_rounds, load_for, s).await;
    println!("{diag_rounds} rounds, same method.\n");
    println!("{}\n", table(&group).render());
    println!("Where Envoy's CPU time went:\n\n{}\n", kernel_table(&group).render());
    let median_of = |id: &str| {
        group
            .iter()
            .find(|g| g.variant.id == id)
            .map(|g| median(&g.runs.iter().map(|r| r.cpu_ns_per_req).collect::<Vec<_>>()))
    };
    if let Some(noop) = median_of("noop") {
        let mut t = Table::new(&["host call", "ns per call (Δ over no-op ÷ calls)"]);
        for g in group.iter().filter(|g| g.variant.id.starts_with("call-")) {
            let per = (median(&g.runs.iter().map(|r| r.cpu_ns_per_req).collect::<Vec<_>>()) - noop) / f64::from(CALLS);
            t.row(vec![g.variant.label.trim_start_matches(&format!("no-op + {CALLS} × ")).to_string(), format!("{per:.0}")]);
        }
        println!("Price of one host call from the no-op module (V8, Envoy 1.40):\n\n{}\n", t.render());
        let mut t = Table::new(&["step", "Δ CPU ns/req"]);
        let pairs = [
            ("noop", "none", "a wasm filter at all (no-op)"),
            ("fg-empty", "noop", "floodgate loaded with `{}` over the no-op"),
            ("fg-rl", "fg-empty", "one rate-limit rule (ratelimit headers always)"),
            ("fg-rl-onreject", "fg-empty", "one rule, headers on reject only"),
            ("fg-rl2", "fg-rl", "a second rule (source_ip)"),
            ("fg-shed", "fg-empty", "load shedding alone"),
            ("fg-rl-shed", "fg-rl", "shedding + health on top of one rule"),
        ];
        for (a, b, what) in pairs {
            if let (Some(x), Some(y)) = (median_of(a), median_of(b)) {
                t.row(vec![what.into(), format!("{:+.0}", x - y)]);
            }
        }
        println!("Marginal costs (differences of medians):\n\n{}\n", t.render());
    }
}

/// The variants of the keys and latency measurements: the references and floodgate's two
/// main configurations.
fn key_variants(s: &Settings) -> Vec<Variant> {
    selected(s, main_variants(s).into_iter().filter(|v| ["none", "noop", "fg-rl", "fg-all"].contains(&v.id)).collect())
}

/// Keys: the same variants with one hot key on every request, with [`KEYS`] keys and with
/// 100 000 keys (beyond the default table: every request may meet a key the table lost). The
/// hot key is the case the quota reserves are for.
pub async fn keys(s: &Settings) {
    println!("## 1c. One hot key, {KEYS} keys, 100 000 keys (Envoy: 1 worker pinned to core 0)\n");
    let upstreams = Upstreams::start().await;
    let mut t = Table::new(&["keys", "variant", "what", "CPU µs/req (median)", "× no filter (median; range)", "Δ over no-op", "req/s"]);
    for keys in [1, KEYS, 100_000] {
        let traffic = Traffic::new(if keys == 1 { "hot" } else { "k" }, keys);
        let load_for = |started: &Started| Load {
            targets: vec![started.envoy.addr()],
            connections: s.connections,
            requests: traffic.requests(&started.variant),
            max_requests: None,
        };
        let mut group = start_all(key_variants(s), s, upstreams, &traffic).await;
        rounds(&mut group, s.rounds, load_for, s).await;
        let ratio_of = |id: &str| group.iter().find(|g| g.variant.id == id).map(|g| median(&g.ratios));
        let noop = ratio_of("noop");
        for g in &group {
            let cpu: Vec<f64> = g.runs.iter().map(|r| r.cpu_ns_per_req / 1000.0).collect();
            let (lo, hi) = range(&g.ratios);
            let ratio = median(&g.ratios);
            t.row(vec![
                keys.to_string(),
                format!("`{}`", g.variant.id),
                g.variant.label.clone(),
                format!("{:.2}", median(&cpu)),
                format!("{ratio:.3} ({lo:.3}–{hi:.3})"),
                noop.filter(|_| g.variant.id != "none").map_or_else(String::new, |n| format!("{:+.3}", ratio - n)),
                format!("{:.0}", median(&g.runs.iter().map(|r| r.rps).collect::<Vec<_>>())),
            ]);
        }
    }
    println!(
        "{} connections, every request admitted; {} rounds of {:.0} s (after {:.0} s warm-up) per variant and key count, alternated. \
         Ratio: CPU/request over \"no filter\"'s in the same round, median (range).\n\n{}\n",
        s.connections,
        s.rounds,
        s.seconds,
        s.warmup,
        t.render()
    );
}

/// Latency a client sees, added by each variant: one connection sending one request after
/// another (no queueing), p50 and p99 against "no filter" in the same round.
pub async fn latency(s: &Settings) {
    println!("## 1d. Added latency (Envoy: 1 worker pinned to core 0; one connection, one request at a time)\n");
    let upstreams = Upstreams::start().await;
    let traffic = Traffic::new("k", KEYS);
    let load_for = |started: &Started| Load {
        targets: vec![started.envoy.addr()],
        connections: 1,
        requests: traffic.requests(&started.variant),
        max_requests: None,
    };
    let mut group = start_all(key_variants(s), s, upstreams, &traffic).await;
    rounds(&mut group, s.rounds, load_for, s).await;
    let per_round = |g: &Started, q: fn(&Run) -> f64| g.runs.iter().map(q).collect::<Vec<f64>>();
    let Some(base) = group.iter().find(|g| g.variant.id == "none") else {
        println!("(no \"none\" variant: nothing to compare with)\n");
        return;
    };
    let (base_p50, base_p99) = (per_round(base, |r| r.p50), per_round(base, |r| r.p99));
    let mut t = Table::new(&["variant", "what", "p50 µs (median)", "p99 µs (median)", "added p50 µs (median; range)", "added p99 µs (median; range)", "req/s"]);
    for g in &group {
        let (p50, p99) = (per_round(g, |r| r.p50), per_round(g, |r| r.p99));
        let added = |mine: &[f64], base: &[f64]| {
            let d: Vec<f64> = mine.iter().zip(base).map(|(a, b)| a - b).collect();
            let (lo, hi) = range(&d);
            format!("{:+.0} ({lo:+.0}…{hi:+.0})", median(&d))
        };
        t.row(vec![
            format!("`{}`", g.variant.id),
            g.variant.label.clone(),
            format!("{:.0}", median(&p50)),
            format!("{:.0}", median(&p99)),
            if g.variant.id == "none" { String::new() } else { added(&p50, &base_p50) },
            if g.variant.id == "none" { String::new() } else { added(&p99, &base_p99) },
            format!("{:.0}", median(&g.runs.iter().map(|r| r.rps).collect::<Vec<_>>())),
        ]);
    }
    println!(
        "{} keys; {} rounds of {:.0} s (after {:.0} s warm-up) per variant, alternated; latency from the request's first byte \
         sent to the response's last byte read, loopback.\n\n{}\n",
        KEYS,
        s.rounds,
        s.seconds,
        s.warmup,
        t.render()
    );
}
