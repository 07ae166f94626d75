//! floodgate's benchmark tool (docs/benchmarks.md). Prints tables; asserts nothing
//! about time. Run it through `bench/run.sh`, which builds the modules and Envoy first.
//!
//! ```text
//! floodgate-bench [cpu|instructions|memory|accuracy|flood|contention|idle|global|peers|fleet|all] [--quick] [options]
//! ```

mod accuracy;
mod contention;
mod cpu;
mod envoy;
mod flood;
mod fleet;
mod fleet_harness;
mod host_calls;
mod global;
mod idle;
mod instructions;
mod leased;
mod llm;
mod load;
mod memory;
mod peers;
mod services;
mod table;
mod variant;

use std::path::PathBuf;
use std::time::Instant;

/// Where the artifacts are, and how long to measure.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Short runs (a few minutes in all).
    pub quick: bool,
    /// The Envoy binary.
    pub envoy: PathBuf,
    /// floodgate's module.
    pub floodgate_wasm: PathBuf,
    /// floodgate's module that reads response bodies (the LLM variants of `instructions`).
    pub llm_wasm: PathBuf,
    /// The no-op / host-call pricing module.
    pub noop_wasm: PathBuf,
    /// The naive per-key limiter module.
    pub naive_wasm: PathBuf,
    /// Other proxy-wasm modules to measure (`--extra-wasm`), each with its configuration string
    /// (`--extra-config`): variants `ext1`, `ext2`, … of `cpu` and `instructions`.
    pub extra: Vec<(PathBuf, String)>,
    /// Rounds of the CPU comparison (each variant once per round).
    pub rounds: usize,
    /// Measured seconds per run.
    pub seconds: f64,
    /// Warm-up seconds per run.
    pub warmup: f64,
    /// Load-generator connections.
    pub connections: usize,
    /// Also run the diagnostic variants (marginal costs, host-call prices).
    pub diagnose: bool,
    /// Whether the "everything on" variant includes cluster selection (`auto`: if the module
    /// accepts it and routes by it).
    pub selection: Selection,
    /// Number of CPUs.
    pub cpus: usize,
    /// Only these variants (ids), if given (`cpu`, `instructions`), or parts of `global`
    /// (`quota`, `outage`, `cpu`, `instructions`, `modes`).
    pub only: Option<Vec<String>>,
    /// `memory`: floodgate's table capacity, and distinct keys up to 1.5 × it (default: the
    /// default capacity, and keys up to 1 M); `flood`: the capacity of its real-Envoy runs
    /// (default 1 024).
    pub capacity: Option<u32>,
    /// `cpu`, `instructions`: distinct `x-api-key` values of the main comparison, instead of
    /// each measurement's default (1: every request on one hot key).
    pub keys: Option<usize>,
    /// `global`: the `redis-server` binary.
    pub redis_server: PathBuf,
    /// `global`: the `floodgate-sync` binary.
    pub sync_bin: PathBuf,
    /// `peers`: Kuadrant's wasm-shim module.
    pub wasm_shim_wasm: PathBuf,
    /// `peers`: the `limitador-server` binary.
    pub limitador_bin: PathBuf,
    /// `fleet`: fleet sizes, workers, mixes, consistencies, seconds, rate, events.
    pub fleet: fleet::FleetOptions,
}

impl Settings {
    /// The defaults, the artifacts' paths from the environment (`ENVOY_BIN`, `FLOODGATE_WASM`,
    /// ...; empty when unset), before the command line changes them.
    pub fn from_env() -> Settings {
        let env_path = |k: &str| std::env::var_os(k).map(PathBuf::from).unwrap_or_default();
        Settings {
            quick: false,
            envoy: env_path("ENVOY_BIN"),
            floodgate_wasm: env_path("FLOODGATE_WASM"),
            llm_wasm: env_path("FLOODGATE_LLM_WASM"),
            noop_wasm: env_path("NOOP_WASM"),
            naive_wasm: env_path("NAIVE_WASM"),
            extra: Vec::new(),
            rounds: 0,
            seconds: 0.0,
            warmup: 0.0,
            connections: 32,
            diagnose: true,
            selection: Selection::Auto,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            only: None,
            capacity: None,
            keys: None,
            redis_server: env_path("REDIS_SERVER"),
            sync_bin: env_path("FLOODGATE_SYNC_BIN"),
            wasm_shim_wasm: env_path("WASM_SHIM_WASM"),
            limitador_bin: env_path("LIMITADOR_BIN"),
            fleet: fleet::FleetOptions::default(),
        }
    }
}

/// Cluster selection in the "everything on" variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Use it if the module accepts the section and a request gets through; else leave it out.
    Auto,
    /// Always (fail if the module refuses it).
    On,
    /// Never.
    Off,
}

fn usage() -> ! {
    eprintln!(
        "usage: floodgate-bench [cpu|keys|latency|instructions|memory|accuracy|flood|contention|idle|global|peers|fleet|all]... [--quick] [--rounds N] [--seconds S]\n\
         \x20      [--warmup S] [--connections N] [--diagnose|--no-diagnose] [--selection auto|on|off] [--variants id,id] [--capacity N] [--keys N]\n\
         \x20      [--envoy PATH] [--wasm PATH] [--llm-wasm PATH] [--noop-wasm PATH] [--naive-wasm PATH] [--redis-server PATH] [--sync PATH]\n\
         \x20      [--wasm-shim PATH] [--limitador PATH]\n\
         \x20      [--extra-wasm PATH [--extra-config STRING]]...\n\
         \x20      fleet: [--proxies N,N] [--workers N] [--mix hot,users,zipf] [--consistency batched,leased] [--rate REQ_PER_S] [--events restart,failover,sync-restart,steady] [--on-store-failure last_state|refuse] [--replica-acks N] [--envoys]\n\
         fleet --envoys runs each configuration through real Envoys of one worker (--envoy, --wasm) and through the simulated proxies, side by side.\n\
         --extra-wasm adds another module to `cpu` and `instructions` as variant ext1, ext2, ... with the --extra-config after it, and to global part (f) as one more `leased` row.\n\
         The LLM variants of `instructions` (--variants llm-plain,llm-json-1k,...; docs/benchmarks.md) load --llm-wasm,\n\
         by default $FLOODGATE_LLM_WASM, or floodgate-llm.wasm beside the floodgate module.\n\
         Paths default to $ENVOY_BIN, $FLOODGATE_WASM, $NOOP_WASM, $NAIVE_WASM, $REDIS_SERVER, $FLOODGATE_SYNC_BIN,\n\
         $WASM_SHIM_WASM, $LIMITADOR_BIN (`peers`: bench/peers/build.sh builds them; without them `peers` runs floodgate's configurations only, named with --variants). Use bench/run.sh, which builds them."
    );
    std::process::exit(2)
}

/// The machine's CPU model, as `/proc/cpuinfo` names it: figures from different machines must
/// never be set side by side, so every report says where it was measured.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name").and_then(|rest| rest.split_once(':')).map(|(_, m)| m.trim().to_owned()))
        })
        .unwrap_or_else(|| "unknown CPU model".into())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut what: Vec<String> = Vec::new();
    let mut s = Settings::from_env();
    let mut fleet_seconds = None;
    let mut diagnose: Option<bool> = None;
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "cpu" | "keys" | "latency" | "instructions" | "memory" | "accuracy" | "flood" | "contention" | "idle" | "global" | "peers" | "fleet" | "all" => what.push(a),
            "--quick" => s.quick = true,
            "--rounds" => s.rounds = value().parse().unwrap_or_else(|_| usage()),
            "--seconds" => {
                s.seconds = value().parse().unwrap_or_else(|_| usage());
                fleet_seconds = Some(s.seconds);
            }
            "--proxies" => s.fleet.proxies = value().split(',').map(|p| p.parse().ok().filter(|p| *p > 0).unwrap_or_else(|| usage())).collect(),
            "--workers" => s.fleet.workers = value().parse().ok().filter(|w| (1..=64).contains(w)).unwrap_or_else(|| usage()),
            "--mix" => s.fleet.mixes = value().split(',').map(str::to_string).collect(),
            "--consistency" => s.fleet.consistencies = value().split(',').map(str::to_string).collect(),
            "--rate" => s.fleet.rate = Some(value().parse().ok().filter(|r: &f64| *r > 0.0).unwrap_or_else(|| usage())),
            "--events" => s.fleet.events = value().split(',').map(str::to_string).collect(),
            "--envoys" => s.fleet.envoys = true,
            "--replica-acks" => s.fleet.replica_acks = value().parse().ok().filter(|n| *n <= 16).unwrap_or_else(|| usage()),
            "--on-store-failure" => s.fleet.on_store_failure = Some(value()).filter(|v| v == "last_state" || v == "refuse").unwrap_or_else(|| usage()),
            "--warmup" => s.warmup = value().parse().unwrap_or_else(|_| usage()),
            "--connections" => s.connections = value().parse().unwrap_or_else(|_| usage()),
            "--variants" => s.only = Some(value().split(',').map(str::to_string).collect()),
            "--capacity" => s.capacity = Some(value().parse().ok().filter(|c| *c > 0).unwrap_or_else(|| usage())),
            "--keys" => s.keys = Some(value().parse().ok().filter(|k| *k > 0).unwrap_or_else(|| usage())),
            "--diagnose" => diagnose = Some(true),
            "--no-diagnose" => diagnose = Some(false),
            "--selection" => {
                s.selection = match value().as_str() {
                    "auto" => Selection::Auto,
                    "on" => Selection::On,
                    "off" => Selection::Off,
                    _ => usage(),
                }
            }
            "--envoy" => s.envoy = value().into(),
            "--wasm" => s.floodgate_wasm = value().into(),
            "--llm-wasm" => s.llm_wasm = value().into(),
            "--noop-wasm" => s.noop_wasm = value().into(),
            "--naive-wasm" => s.naive_wasm = value().into(),
            "--extra-wasm" => s.extra.push((value().into(), String::new())),
            "--extra-config" => {
                let config = value();
                s.extra.last_mut().unwrap_or_else(|| usage()).1 = config;
            }
            "--redis-server" => s.redis_server = value().into(),
            "--sync" => s.sync_bin = value().into(),
            "--wasm-shim" => s.wasm_shim_wasm = value().into(),
            "--limitador" => s.limitador_bin = value().into(),
            _ => usage(),
        }
    }
    if what.is_empty() || what.iter().any(|w| w == "all") {
        what = ["accuracy", "flood", "cpu", "keys", "latency", "instructions", "contention", "memory", "idle", "global"].map(String::from).to_vec();
    }
    if s.rounds == 0 {
        s.rounds = if s.quick { 3 } else { 7 };
    }
    if let Some(seconds) = fleet_seconds {
        s.fleet.seconds = seconds;
    }
    if s.seconds == 0.0 {
        s.seconds = if s.quick { 3.0 } else { 5.0 };
    }
    if s.warmup == 0.0 {
        s.warmup = 1.0;
    }
    s.diagnose = diagnose.unwrap_or(false);
    if s.llm_wasm.as_os_str().is_empty() {
        // Beside floodgate.wasm, as ./wasm-build.sh leaves them.
        s.llm_wasm = s.floodgate_wasm.with_file_name("floodgate-llm.wasm");
    }
    // Not redis-server: Debian's is a link to redis-check-rdb, which picks its mode from the name
    // it was started as.
    for p in [&mut s.envoy, &mut s.floodgate_wasm, &mut s.llm_wasm, &mut s.noop_wasm, &mut s.naive_wasm, &mut s.sync_bin, &mut s.wasm_shim_wasm, &mut s.limitador_bin].into_iter().chain(s.extra.iter_mut().map(|e| &mut e.0)) {
        if let Ok(abs) = std::fs::canonicalize(&*p) {
            *p = abs;
        }
    }
    let needs_envoy = what.iter().any(|w| w != "accuracy" && w != "fleet");
    if what.iter().any(|w| w == "fleet") {
        for (name, p) in [("redis-server", &s.redis_server), ("floodgate-sync", &s.sync_bin)] {
            if !p.is_file() {
                eprintln!("floodgate-bench: {name} not found at {:?}; run bench/run.sh, which installs and builds it", p);
                std::process::exit(2);
            }
        }
        if s.fleet.envoys {
            for (name, p) in [("Envoy", &s.envoy), ("floodgate module", &s.floodgate_wasm)] {
                if !p.is_file() {
                    eprintln!("floodgate-bench: {name} not found at {:?}; run bench/run.sh fleet --envoys, which builds it", p);
                    std::process::exit(2);
                }
            }
        }
    }
    if needs_envoy {
        let modules = [("Envoy", &s.envoy), ("floodgate module", &s.floodgate_wasm), ("no-op module", &s.noop_wasm), ("naive module", &s.naive_wasm)];
        for (name, p) in modules.into_iter().chain(s.extra.iter().map(|e| ("--extra-wasm module", &e.0))) {
            if !p.is_file() {
                eprintln!("floodgate-bench: {name} not found at {:?}; run bench/run.sh, which builds everything", p);
                std::process::exit(2);
            }
        }
        if what.iter().any(|w| w == "global" || w == "peers") {
            for (name, p) in [("redis-server", &s.redis_server), ("floodgate-sync", &s.sync_bin)] {
                if !p.is_file() {
                    eprintln!("floodgate-bench: {name} not found at {:?}; run bench/run.sh, which installs and builds it", p);
                    std::process::exit(2);
                }
            }
        }
        if std::process::Command::new("taskset").arg("-V").output().is_err() {
            eprintln!("floodgate-bench: `taskset` (util-linux) is needed to pin Envoy and the load generator to cores");
            std::process::exit(2);
        }
        // The load generator and the upstreams run on the last core; Envoy (in the CPU
        // comparison) on core 0. Threads created from now on inherit this.
        if s.cpus >= 2 {
            let _ = std::process::Command::new("taskset")
                .args(["-a", "-p", "-c", &(s.cpus - 1).to_string(), &std::process::id().to_string()])
                .stdout(std::process::Stdio::null())
                .status();
        }
    }
    let started = Instant::now();
    println!(
        "# floodgate benchmark ({}{}; {}, {} CPUs; {}; module {})\n",
        if s.quick { "quick" } else { "full" },
        if s.diagnose { ", diagnostic variants" } else { "" },
        cpu_model(),
        s.cpus,
        now_utc(),
        std::env::var("FLOODGATE_REV").unwrap_or_else(|_| s.floodgate_wasm.display().to_string())
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for w in &what {
        let t = Instant::now();
        match w.as_str() {
            "accuracy" => accuracy::run(&s),
            "flood" => rt.block_on(flood::run(&s)),
            "cpu" => rt.block_on(cpu::run(&s)),
            "keys" => rt.block_on(cpu::keys(&s)),
            "latency" => rt.block_on(cpu::latency(&s)),
            "instructions" => rt.block_on(instructions::run(&s)),
            "contention" => rt.block_on(contention::run(&s)),
            "memory" => rt.block_on(memory::run(&s)),
            "idle" => rt.block_on(idle::run(&s)),
            "global" => rt.block_on(global::run(&s)),
            "peers" => rt.block_on(peers::run(&s)),
            "fleet" => rt.block_on(fleet::run(&s)),
            _ => unreachable!(),
        }
        eprintln!("[{w} took {:.0} s]", t.elapsed().as_secs_f64());
    }
    println!("\n(total {:.0} s)", started.elapsed().as_secs_f64());
}

/// The date and time, UTC, from `date` (no time crate needed).
fn now_utc() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Progress on stderr.
#[macro_export]
macro_rules! progress {
    ($($t:tt)*) => { eprintln!("  .. {}", format!($($t)*)) };
}
