//! Measurement 2: Envoy's resident memory against the number of distinct keys seen, for
//! floodgate (bounded table, default capacity) and for the naive one-entry-per-key design.

use crate::envoy::{Filter, Route, Spec};
use crate::load::{self, Load, Requests};
use crate::table::{count, Table};
use crate::{progress, Settings};
use floodgate::config::DEFAULT_CAPACITY;
use floodgate::ratelimit::table::{RECORD_LEN, WAYS};
use std::sync::Arc;
use std::time::Duration;

/// Measurement 2.
pub async fn run(s: &Settings) {
    println!("## 2. Memory against distinct keys\n");
    let capacity = s.capacity.unwrap_or(DEFAULT_CAPACITY);
    let checkpoints: Vec<u64> = match s.capacity {
        Some(c) => [0, c / 2, c, c + c / 2].into_iter().map(u64::from).collect(),
        None if s.quick => vec![0, 1_000, 10_000, 100_000],
        None => vec![0, 1_000, 10_000, 100_000, 300_000, 1_000_000],
    };
    let checkpoints = checkpoints.as_slice();
    let records = u64::from(capacity).div_ceil(WAYS as u64);
    let (a, _) = load::start_upstream().await;
    let clusters = [a, a, a];
    let designs = [
        (
            format!("floodgate (1 rule, capacity {})", count(u64::from(capacity))),
            Filter::Wasm {
                module: s.floodgate_wasm.clone(),
                config: format!(
                    r#"{{"rate_limits": [{{"name": "per-key", "key": [{{"header": "x-api-key"}}], "limit": 1000000000, "window": "1m", "capacity": {capacity}}}], "ratelimit_headers": "on_reject"}}"#
                ),
            },
        ),
        ("naive: one shared-data entry per key".into(), Filter::Wasm { module: s.naive_wasm.clone(), config: crate::variant::NAIVE_RULE.into() }),
        ("no-op wasm filter (reference)".into(), Filter::Wasm { module: s.noop_wasm.clone(), config: String::new() }),
    ];
    // The no-op reference (what Envoy with a wasm filter does by itself with many distinct header
    // values) only with --diagnose: it costs as long as the others.
    let designs: Vec<_> = if s.diagnose { designs.into_iter().collect() } else { designs.into_iter().take(2).collect() };
    let mut columns: Vec<(String, Vec<u64>)> = Vec::new();
    for (label, filter) in designs {
        let spec = Spec { filter, route: Route::Fixed, clusters, http2: false, concurrency: 2, cpus: format!("0-{}", s.cpus.saturating_sub(1)), wrapper: Vec::new(), services: Vec::new() };
        let envoy = match spec.start(&s.envoy) {
            Ok(e) => e,
            Err(e) => {
                println!("**{label}** could not be started: {e}\n");
                continue;
            }
        };
        // Warm up on one key, so "0 keys" is a warmed-up proxy.
        let warm = Load { targets: vec![envoy.addr()], connections: 16, requests: Requests::Cycle(crate::cpu::key_requests("warm", 1)), max_requests: None };
        let _ = load::run(&warm, Duration::ZERO, Duration::from_secs(2), || ()).await;
        let mut rss = Vec::new();
        let mut sent = 0u64;
        for &target in checkpoints {
            if target > sent {
                let offset = sent;
                let make = Arc::new(move |i: u64| load::request("/", &[("x-api-key", format!("m{}", offset + i))]));
                let load = Load { targets: vec![envoy.addr()], connections: 32, requests: Requests::Numbered(make), max_requests: Some(target - sent) };
                let (out, _, _) = load::run(&load, Duration::ZERO, Duration::from_secs(600), || ()).await;
                if out.completed != target - sent || out.status(200) != out.completed {
                    progress!("{label}: {} of {} answered, statuses {:?}", out.completed, target - sent, out.statuses);
                }
                sent = target;
            }
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let r = envoy.rss_bytes();
            progress!("{label}: {} keys → RSS {:.1} MiB", count(target), r as f64 / 1048576.0);
            rss.push(r);
        }
        columns.push((label, rss));
    }
    let mut header = vec!["distinct keys".to_string()];
    header.extend(columns.iter().map(|(l, _)| format!("{l}: RSS MiB (Δ from 0 keys)")));
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut t = Table::new(&header);
    for (i, &k) in checkpoints.iter().enumerate() {
        let mut row = vec![count(k)];
        for (_, rss) in &columns {
            let mib = |b: u64| b as f64 / 1048576.0;
            row.push(format!("{:.1} ({:+.1})", mib(rss[i]), mib(rss[i]) - mib(rss[0])));
        }
        t.row(row);
    }
    println!(
        "Envoy with 2 workers; each distinct `x-api-key` sent once (32 connections), RSS (`VmRSS`) read 1.5 s after each step. \
         floodgate's table holds at most capacity/{WAYS} = {} records of {RECORD_LEN} bytes per rule, whatever the number of keys.\n",
        count(records)
    );
    println!("{}\n", t.render());
    let last = checkpoints.len() - 1;
    for (label, rss) in &columns {
        if checkpoints[last] > 0 {
            println!(
                "- {label}: {:.0} bytes per distinct key over the whole range",
                (rss[last] as f64 - rss[0] as f64) / checkpoints[last] as f64
            );
        }
    }
    if let (Some(c), Some((_, rss))) = (s.capacity, columns.first()) {
        // The last checkpoint (1.5 × capacity) fills nearly every record.
        println!(
            "- floodgate: {:.0} bytes per tracked key (growth at {} keys / capacity {}), {:.0} bytes per record",
            (rss[last] as f64 - rss[0] as f64) / f64::from(c),
            count(checkpoints[last]),
            count(u64::from(c)),
            (rss[last] as f64 - rss[0] as f64) / records as f64
        );
    }
    println!();
}
