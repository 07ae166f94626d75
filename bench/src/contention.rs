//! Measurement 4: every worker hammering one key. CPU per request against the same load
//! spread over many keys (and against no filter), and whether the admitted count is exact.

use crate::cpu::{key_requests, measure, KEYS};
use crate::envoy::{Envoy, Filter, Route, Spec};
use crate::load::{self, Load, Requests};
use crate::table::{count, median, Table};
use crate::variant::rule;
use crate::{progress, Settings};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A measured case: its label, the Envoy it runs against, the requests it sends.
type Case<'a> = (&'a str, &'a Envoy, &'a Arc<Vec<Vec<u8>>>);

fn workers(s: &Settings) -> usize {
    s.cpus.max(2)
}

fn spec(s: &Settings, filter: Filter, clusters: [std::net::SocketAddr; 3]) -> Spec {
    Spec { filter, route: Route::Fixed, clusters, http2: false, concurrency: workers(s), cpus: format!("0-{}", s.cpus.saturating_sub(1)), wrapper: Vec::new(), services: Vec::new() }
}

/// Worker connection counts, from the listener's per-worker stats.
fn connections_per_worker(envoy: &Envoy) -> String {
    let Ok((_, body)) = envoy.admin_get("/stats?filter=worker_[0-9]+\\.downstream_cx_total") else { return String::new() };
    let v: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("listener.127"))
        .filter_map(|l| l.rsplit_once(": ").map(|(_, v)| v))
        .collect();
    v.join(" / ")
}

/// Measurement 4.
pub async fn run(s: &Settings) {
    let n = workers(s);
    println!("## 4. Contention: all {n} workers on one key\n");
    let (a, upstream) = load::start_upstream().await;
    let clusters = [a, a, a];
    let none = spec(s, Filter::None, clusters).start(&s.envoy);
    let fg = spec(s, Filter::Wasm { module: s.floodgate_wasm.clone(), config: format!(r#"{{"rate_limits": [{}]}}"#, rule("per-key")) }, clusters).start(&s.envoy);
    let (Ok(none), Ok(fg)) = (none, fg) else {
        println!("Envoy could not be started\n");
        return;
    };
    let many = key_requests("k", KEYS);
    let one = key_requests("hot", 1);
    let cases: [Case<'_>; 3] =
        [("no filter", &none, &many), ("floodgate, 1 000 keys", &fg, &many), ("floodgate, one key", &fg, &one)];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut rps: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let rounds = if s.quick { 2 } else { 3 };
    let connections = 32;
    for round in 0..rounds {
        for (i, (label, envoy, requests)) in cases.iter().enumerate() {
            let load = Load { targets: vec![envoy.addr()], connections, requests: Requests::Cycle(Arc::clone(requests)), max_requests: None };
            crate::cpu::wait_for_quiet(Duration::from_secs(if s.quick { 3 } else { 6 })).await;
            let r = measure(envoy, &load, s).await;
            progress!("round {}/{rounds} {label}: {:.1} µs/req, {:.0} req/s", round + 1, r.cpu_ns_per_req / 1000.0, r.rps);
            runs[i].push(r.cpu_ns_per_req / 1000.0);
            rps[i].push(r.rps);
        }
    }
    let contention = fg.stat("wasmcustom.floodgate.rate_limit.per-key.contention").unwrap_or(0);
    let mut t = Table::new(&["load", "Envoy CPU µs/req (median)", "× no filter", "req/s"]);
    let base = median(&runs[0]);
    for (i, (label, _, _)) in cases.iter().enumerate() {
        t.row(vec![label.to_string(), format!("{:.2}", median(&runs[i])), format!("{:.3}", median(&runs[i]) / base), format!("{:.0}", median(&rps[i]))]);
    }
    println!(
        "Envoy with {n} workers on all cores (the load generator shares core {}), {connections} connections, every request admitted, {rounds} rounds. \
         Connections per worker: {}. Requests refused on CAS exhaustion (`contention` counter): {contention}.\n",
        s.cpus.saturating_sub(1),
        connections_per_worker(&fg)
    );
    println!("{}\n", t.render());

    // Exactness: a fresh Envoy, one key, a limit well below what is sent.
    let limit: u64 = if s.quick { 5_000 } else { 20_000 };
    let sent = 3 * limit;
    let config = format!(
        r#"{{"rate_limits": [{{"name": "exact", "key": [{{"header": "x-api-key"}}], "limit": {limit}, "window": "24h"}}], "ratelimit_headers": "on_reject"}}"#
    );
    let exact = match spec(s, Filter::Wasm { module: s.floodgate_wasm.clone(), config }, clusters).start(&s.envoy) {
        Ok(e) => e,
        Err(e) => {
            println!("exactness: Envoy could not be started: {e}\n");
            return;
        }
    };
    let secs_into_day = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() % 86_400);
    if secs_into_day > 86_400 - 300 {
        println!("(less than 5 minutes before a UTC day boundary: the 24 h window may roll over during the run)\n");
    }
    let before = upstream.0.load(Ordering::SeqCst);
    let load = Load {
        targets: vec![exact.addr()],
        connections,
        requests: Requests::Numbered(Arc::new(|_| load::request("/", &[("x-api-key", "hot".to_string())]))),
        max_requests: Some(sent),
    };
    let (out, _, _) = load::run(&load, Duration::ZERO, Duration::from_secs(300), || ()).await;
    let reached = upstream.0.load(Ordering::SeqCst) - before;
    let stat = |c: &str| exact.stat(&format!("wasmcustom.floodgate.rate_limit.exact.{c}")).unwrap_or(0);
    let (allowed, rejected, contention) = (stat("allowed"), stat("rejected"), stat("contention"));
    let ok = out.status(200) == limit && reached == limit && allowed == limit;
    let mut t = Table::new(&["limit", "sent", "200", "429", "reached upstream", "allowed (stat)", "rejected (stat)", "contention (stat)", "exact?"]);
    t.row(vec![
        count(limit),
        count(sent),
        count(out.status(200)),
        count(out.status(429)),
        count(reached),
        count(allowed),
        count(rejected),
        count(contention),
        if ok { "yes".into() } else { "**no**".into() },
    ]);
    progress!("exactness: {:?}, {} errors", out.statuses, out.errors);
    println!(
        "Admitted-count exactness: one key, limit {limit} per 24 h, {sent} requests over {connections} connections on {n} workers ({:.0} req/s; connections per worker {}).\n",
        out.throughput(),
        connections_per_worker(&exact)
    );
    println!("{}\n", t.render());
}
