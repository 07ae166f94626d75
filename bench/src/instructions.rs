//! Measurement 1b: user-space instructions per request of the Envoy process, counted by
//! valgrind's callgrind. Slow (Envoy runs ~50× slower under valgrind, so few requests are
//! sent) but deterministic: unlike CPU time it does not move with the machine's other load,
//! the load level or the core's frequency, so it prices small differences (one host call) that
//! CPU time on a noisy machine cannot. It leaves out the kernel (syscalls, scheduling), which is
//! the same for every variant: the ratios are therefore larger than the CPU-time ratios.
//!
//! The measured requests go at one fixed rate, [`RATE`], for every variant (the load
//! generator's paced mode, [`load::run_paced`]). The module's timers (the heartbeat, the
//! ticks) cost the same per second however many requests come, so their share of a request
//! is their cost divided by the rate: a closed loop, where each variant runs as fast as its
//! Envoy answers (a few hundred a second here, several-fold apart), would charge a slow
//! variant more of them per request than a fast one, and two variants would compare only at
//! matched rates.
//! At one rate every variant pays the same timer share per request, so their differences are
//! what the module does per request. The rate is one that every variant sustains under
//! valgrind on a 2-core machine; the table's `req/s` column shows that each did (a variant
//! that cannot keep up runs as fast as it answers, below the rate).
//!
//! After the main table, a table per pipeline stage ([`Stage::ORDER`]): for each stage, the
//! variant whose configuration enables that stage alone (the queue: with the shedding it
//! needs), the instructions per request it adds over the variant without it (`fg-empty`, or
//! `fg-shed` for the queue), and the host calls per request it adds. Those host calls are
//! counted natively ([`crate::host_calls`]: the module's pipeline run against a host that counts
//! each call as the proxy-wasm shell makes it, on the same traffic at the same rate), not in
//! Envoy, which exposes no count of a module's calls: exact and deterministic. Stages that
//! need an external service (the leased global rules need `floodgate-sync`) or traffic these
//! `GET`s do not have are listed with the reason they are not measured.

use crate::cpu::{self, CALLS};
use crate::envoy::{Envoy, Filter};
use crate::load::{self, Load};
use crate::table::{count, Table};
use crate::variant::Variant;
use crate::{progress, Settings};
use floodgate::pipeline::Stage;
use std::process::Command;
use std::time::Duration;

/// Distinct `x-api-key` values. Under valgrind Envoy serves far fewer requests per second
/// than in the CPU runs ([`RATE`] here), but its timers (the module's 1 s heartbeat) keep their
/// pace: the CPU runs' 1 000 keys would each come back every 10 s here instead of every 36 ms,
/// a different regime (a worker forgets a key idle for a heartbeat). So the key set shrinks:
/// each of these keys comes back every 0.2 s, several times per heartbeat, as in the CPU runs.
pub const KEYS: usize = cpu::KEYS / 50;
/// The measured requests per second, the same for every variant (the module doc says why).
/// Sent as fast as they answer, the variants answer a few hundred a second under valgrind on
/// the 2-core AMD EPYC VM: each sustains 100 there, with room to spare.
pub const RATE: f64 = 100.0;
/// Warm-up requests per distinct key before measuring: 21 take a key's quota reserve to its full
/// size (writes grant 0, 1, 2, 4, 8, then 16 units), as in a long run.
const WARM_VISITS_PER_KEY: u64 = 21;

/// How many Envoys start ahead of the one measured (at least one per CPU).
const STARTING_AHEAD: usize = 3;
/// An Envoy starting under valgrind that uses no CPU time for this long is stuck.
const START_STALL: Duration = Duration::from_secs(120);
/// The longest an Envoy may take to start under valgrind, however busy the machine.
const START_CAP: Duration = Duration::from_secs(3 * 3600);
/// Answers at least this large are measured on fewer requests.
const LARGE_ANSWER: usize = 64 << 10;

/// The command an Envoy runs under to count its instructions (a dump per `callgrind_control -d`).
pub const CALLGRIND: [&str; 4] = ["valgrind", "--tool=callgrind", "--smc-check=all-non-file", "--callgrind-out-file=callgrind.out.%p"];

/// Runs `callgrind_control <what> <pid>` (`-z`: zero the counters, `-d`: dump them).
pub fn callgrind_control(pid: u32, what: &str) -> bool {
    Command::new("callgrind_control")
        .arg(what)
        .arg(pid.to_string())
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The newest callgrind dump in the Envoy's directory.
fn latest_dump(envoy: &Envoy) -> Option<std::path::PathBuf> {
    let mut dumps: Vec<_> = std::fs::read_dir(envoy.dir())
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("callgrind.out."))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    dumps.sort();
    Some(dumps.pop()?.1)
}

/// The `totals:` of the newest callgrind dump in the Envoy's directory.
pub fn latest_totals(envoy: &Envoy) -> Option<u64> {
    totals(&latest_dump(envoy)?)
}

/// The `totals:` of callgrind dump `dump`.
fn totals(dump: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(dump).ok()?;
    text.lines().find_map(|l| l.strip_prefix("totals:")?.split_whitespace().next()?.parse().ok())
}

/// With `FLOODGATE_BENCH_DUMPS=dir`, keeps the measured dump as `dir/<variant>.callgrind`, for
/// `callgrind_annotate --inclusive=yes` (where the instructions go, function by function).
fn keep_dump(dump: &std::path::Path, variant: &str) {
    let Some(dir) = std::env::var_os("FLOODGATE_BENCH_DUMPS") else { return };
    let dir = std::path::PathBuf::from(dir);
    let kept = std::fs::create_dir_all(&dir).ok().and_then(|()| {
        let to = dir.join(format!("{variant}.callgrind"));
        std::fs::copy(dump, &to).ok().map(|_| to)
    });
    match kept {
        Some(to) => progress!("{variant}: callgrind dump kept as {}", to.display()),
        None => progress!("{variant}: the callgrind dump could not be kept in {}", dir.display()),
    }
}

/// Measurement 1b.
pub async fn run(s: &Settings) {
    println!("## 1b. Instructions per request (callgrind; deterministic)\n");
    let have = |tool: &str| Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if !have("valgrind") || Command::new("callgrind_control").arg("-h").output().is_err() {
        println!("valgrind is not installed (Debian: `apt-get install valgrind`): skipped.\n");
        return;
    }
    let wanted: &[&str] = if s.quick && !s.diagnose {
        &["none", "noop", "fg-rl", "fg-all", "grpc-none", "grpc-fg-all"]
    } else if !s.diagnose {
        &["none", "native", "noop", "fg-empty", "fg-rl", "naive-rl", "fg-all", "grpc-none", "grpc-noop", "grpc-fg-all", "fg-health", "fg-shed", "fg-queue", "fg-per-key", "fg-select"]
    } else {
        &["none", "native", "noop", "fg-empty", "fg-rl", "naive-rl", "fg-rl-onreject", "fg-rl2", "fg-shed", "fg-rl-shed", "fg-all", "grpc-none", "grpc-noop", "grpc-fg-all", "fg-health", "fg-queue", "fg-per-key", "fg-select", "call-time", "call-header", "call-absent", "call-pairs", "call-prop", "call-get", "call-set", "call-incr", "call-resp"]
    };
    let extra = cpu::extra_variants(s);
    let wanted: Vec<&str> = match &s.only {
        Some(only) => only.iter().map(String::as_str).collect(),
        None => wanted.iter().copied().chain(extra.iter().map(|v| v.id)).collect(),
    };
    let all = cpu::all_variants(s);
    let (variants, missing): (Vec<Variant>, Vec<Variant>) =
        wanted.iter().filter_map(|id| all.iter().find(|v| v.id == *id).cloned()).partition(|v| match &v.filter {
            Filter::Wasm { module, .. } => module.is_file(),
            _ => true,
        });
    for v in &missing {
        println!("**{}** could not be measured: its module is not there ({:?}; `--llm-wasm`)\n", v.id, v.filter);
    }
    let upstreams = cpu::Upstreams::start().await;
    let keys = s.keys.unwrap_or(KEYS);
    let traffic = cpu::Traffic::new("k", keys);
    // Each Envoy takes minutes of CPU time to compile the module under valgrind: a few start
    // ahead of the one measured (their instructions before the zeroing are not counted), not
    // all of them at once, which on a small machine would make the first one wait for all.
    let mut waiting = variants.iter();
    let mut pending = std::collections::VecDeque::new();
    let per_variant: u64 = if s.quick { 1_000 } else { 2_000 };
    let mut results: Vec<(Variant, f64, u64)> = Vec::new();
    // Each result's requests per second.
    let mut rates: Vec<f64> = Vec::new();
    loop {
        while pending.len() < STARTING_AHEAD.max(s.cpus) {
            let Some(v) = waiting.next() else { break };
            let spec = upstreams.spec(v, format!("0-{}", s.cpus.saturating_sub(1)), CALLGRIND.map(String::from).to_vec());
            pending.push_back((v.clone(), spec.spawn(&s.envoy), std::time::Instant::now()));
        }
        let Some((v, envoy, spawned)) = pending.pop_front() else { break };
        let envoy = match envoy.and_then(|e| e.wait_ready_while_working(START_STALL, START_CAP)) {
            Ok(e) => e,
            Err(e) => {
                println!("**{}** could not be measured: {e}\n", v.id);
                continue;
            }
        };
        progress!("{}: ready after {:.0} s ({:.0} s of CPU time)", v.id, spawned.elapsed().as_secs_f64(), crate::envoy::cpu_ns_of(envoy.pid()) as f64 / 1e9);
        // Large answers take seconds each under valgrind: fewer of them (instructions per
        // request are deterministic; what varies is the timers' share, which is small next to a
        // large answer's).
        let large = crate::llm::answer_of(&v).is_some_and(|(_, size)| size >= LARGE_ANSWER);
        let per_variant = if large { if s.quick { 8 } else { 24 } } else { per_variant };
        // Warm up to the steady state of the CPU runs, where every key comes back many times.
        let warm_requests = if large { 8 } else { (WARM_VISITS_PER_KEY * keys as u64).max(300) };
        let warm = Load { targets: vec![envoy.addr()], connections: 4, requests: traffic.requests(&v), max_requests: Some(warm_requests) };
        let (out, _, _) = load::run(&warm, Duration::ZERO, Duration::from_secs(900), || ()).await;
        if out.status(200) != out.completed || out.completed == 0 {
            println!("**{}**: warm-up requests failed ({:?}); skipped\n", v.id, out.statuses);
            continue;
        }
        if !callgrind_control(envoy.pid(), "-z") {
            println!("**{}**: callgrind_control -z failed; skipped\n", v.id);
            continue;
        }
        let load = Load { targets: vec![envoy.addr()], connections: 8, requests: traffic.requests(&v), max_requests: Some(per_variant) };
        let (out, _, _) = load::run_paced(&load, RATE, Duration::ZERO, Duration::from_secs(if large { 3600 } else { 600 }), || ()).await;
        if !callgrind_control(envoy.pid(), "-d") {
            println!("**{}**: callgrind_control -d failed; skipped\n", v.id);
            continue;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Some((dump, total)) = latest_dump(&envoy).and_then(|dump| totals(&dump).map(|total| (dump, total))) else {
            println!("**{}**: no callgrind dump found; skipped\n", v.id);
            continue;
        };
        keep_dump(&dump, v.id);
        let per = total as f64 / out.completed.max(1) as f64;
        progress!("{}: {} requests at {:.1}/s, {:.0} instructions/request", v.id, out.completed, out.throughput(), per);
        results.push((v, per, out.completed));
        rates.push(out.throughput());
    }
    let of = |id: &str| results.iter().find(|(v, _, _)| v.id == id).map(|r| r.1);
    let noop = of("noop");
    let mut t = Table::new(&["variant", "what", "requests", "req/s", "instructions/request", "× no filter", "Δ over no-op"]);
    for ((v, per, requests), rate) in results.iter().zip(&rates).filter(|((v, _, _), _)| !v.id.starts_with("call-")) {
        t.row(vec![
            format!("`{}`", v.id),
            v.label.clone(),
            count(*requests),
            format!("{rate:.0}"),
            count(*per as u64),
            of(cpu::base_of(v)).map_or("–".into(), |b| format!("{:.3}", per / b)),
            of(cpu::noop_of(v)).map_or("–".into(), |n| format!("{:+}", (per - n) as i64)),
        ]);
    }
    let warm = count((WARM_VISITS_PER_KEY * keys as u64).max(300));
    println!(
        "Envoy 1 worker under callgrind, {per_variant} keep-alive requests over 8 connections at {RATE:.0} requests per second for every variant (answers of 64 KiB and more: fewer, after 8 of warm-up), {keys} distinct x-api-key values, after {warm} of warm-up; \
         all user-space instructions of the process (Envoy, V8, the module) divided by requests.\n\n{}\n",
        t.render()
    );
    stage_table(&results, keys);
    crate::llm::report(&results);
    if let Some(n) = noop.filter(|_| results.iter().any(|(v, _, _)| v.id.starts_with("call-"))) {
        let mut t = Table::new(&["host call", "instructions per call"]);
        for (v, per, _) in results.iter().filter(|(v, _, _)| v.id.starts_with("call-")) {
            t.row(vec![v.label.trim_start_matches(&format!("no-op + {CALLS} × ")).to_string(), count(((per - n) / f64::from(CALLS)).max(0.0) as u64)]);
        }
        println!("Price of one host call (no-op module making {CALLS} per request, minus the no-op):\n\n{}\n", t.render());
    }
}

/// How a pipeline stage is measured: the variant that enables it (with the stages it needs)
/// and the variant without it, or why it is not measured.
fn stage_variants(stage: Stage) -> Result<(&'static str, &'static str), &'static str> {
    match stage {
        Stage::Body => Err("needs requests with a body and a rule that reads its estimate there (these are `GET`s)"),
        Stage::Endpoints => Ok(("fg-health", "fg-empty")),
        Stage::Shed => Ok(("fg-shed", "fg-empty")),
        Stage::Queue => Ok(("fg-queue", "fg-shed")),
        Stage::Cap => Ok(("fg-per-key", "fg-empty")),
        Stage::Leased => Err("needs an external service (leased global rules call `floodgate-sync`)"),
        Stage::RateLimit => Ok(("fg-rl", "fg-empty")),
        Stage::Delay => Err("runs only with a token-bucket rule that delays (the rate-limit stage's cost)"),
        Stage::Select => Ok(("fg-select", "fg-empty")),
    }
}

/// The configuration of a floodgate variant.
fn config_of(variant: &Variant) -> Option<&str> {
    match &variant.filter {
        Filter::Wasm { config, .. } => Some(config),
        _ => None,
    }
}

/// The per-stage table, for the stages whose variants were measured.
fn stage_table(results: &[(Variant, f64, u64)], keys: usize) {
    let of = |id: &str| results.iter().find(|(v, _, _)| v.id == id);
    if of("fg-empty").is_none() || !Stage::ORDER.iter().any(|s| stage_variants(*s).is_ok_and(|(id, _)| of(id).is_some())) {
        return;
    }
    let warm = (WARM_VISITS_PER_KEY * keys as u64).max(300);
    let calls = |v: &Variant| config_of(v).and_then(|c| crate::host_calls::per_request(c, keys, warm, 2_000, RATE).ok());
    let mut t = Table::new(&["stage", "variant", "over", "instructions/request", "host calls/request"]);
    for stage in Stage::ORDER {
        let name = format!("{stage:?}");
        let (id, base) = match stage_variants(stage) {
            Ok(pair) => pair,
            Err(why) => {
                t.row(vec![name, "–".into(), "–".into(), format!("not measured: {why}"), "–".into()]);
                continue;
            }
        };
        let (Some((v, per, _)), Some((b, base_per, _))) = (of(id), of(base)) else {
            t.row(vec![name, format!("`{id}`"), format!("`{base}`"), "not measured in this run".into(), "–".into()]);
            continue;
        };
        let added_calls = calls(v).zip(calls(b)).map_or("–".into(), |(c, cb)| format!("{:+.2}", c - cb));
        t.row(vec![name, format!("`{id}`"), format!("`{base}`"), format!("{:+}", (per - base_per) as i64), added_calls]);
    }
    let empty_calls = of("fg-empty").and_then(|(v, _, _)| calls(v)).map_or("–".into(), |c| format!("{c:.2}"));
    println!(
        "Per pipeline stage: what the variant enabling the stage adds over the variant without it (instructions per request from the runs above; \
         host calls per request counted natively on the same traffic, the module's pipeline against a counting host; `fg-empty` itself makes {empty_calls}).\n\n{}\n",
        t.render()
    );
}

#[cfg(test)]
mod tests {
    use super::{config_of, stage_variants, KEYS, RATE};
    use crate::Settings;
    use floodgate::pipeline::Stage;

    /// Every stage's variant exists, its configuration is accepted, and its pipeline admits
    /// the traffic (the host calls are counted on it).
    #[test]
    fn every_measured_stage_has_a_variant_whose_configuration_admits_the_traffic() {
        let all = crate::cpu::all_variants(&Settings::from_env());
        for stage in Stage::ORDER {
            let Ok((id, base)) = stage_variants(stage) else { continue };
            for id in [id, base] {
                let v = all.iter().find(|v| v.id == id).unwrap_or_else(|| panic!("{stage:?}: no variant {id}"));
                let config = config_of(v).unwrap_or_else(|| panic!("{id} is not a module"));
                crate::host_calls::per_request(config, KEYS, 420, 100, RATE).unwrap_or_else(|e| panic!("{id}: {e}"));
            }
        }
    }
}
