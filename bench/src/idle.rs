//! Measurement 6: what an idle proxy costs, ticks included. Each variant's Envoy (2 workers, as
//! deployed) runs with no traffic at all; its CPU time over a quiet stretch, per second, is what
//! its timers cost: the module's heartbeat (every second), the loop-lag probe (every
//! `lag_probe_interval`), and Envoy's own.

use crate::cpu;
use crate::envoy::{cpu_ns_of, Filter, Route, Spec};
use crate::load;
use crate::table::{median, Table};
use crate::variant::Variant;
use crate::{progress, Settings};
use std::time::Duration;

fn variants(s: &Settings) -> Vec<Variant> {
    let fg = |config: &str| Filter::Wasm { module: s.floodgate_wasm.clone(), config: config.into() };
    vec![
        Variant { id: "none", label: "no filter".into(), filter: Filter::None, route: Route::Fixed },
        Variant { id: "noop", label: "no-op proxy-wasm filter (no tick)".into(), filter: Filter::Wasm { module: s.noop_wasm.clone(), config: String::new() }, route: Route::Fixed },
        Variant { id: "fg-shed", label: "floodgate, in-flight shedding (tick every 1 s)".into(), filter: fg(r#"{"load_shedding": {"max_active_requests": 1000}}"#), route: Route::Fixed },
        Variant {
            id: "fg-lag",
            label: "floodgate, loop-lag shedding (probe every 100 ms, the default)".into(),
            filter: fg(r#"{"load_shedding": {"max_loop_lag": "50ms"}}"#),
            route: Route::Fixed,
        },
        Variant {
            id: "fg-lag-10ms",
            label: "floodgate, loop-lag shedding (probe every 10 ms, the shortest)".into(),
            filter: fg(r#"{"load_shedding": {"max_loop_lag": "50ms", "lag_probe_interval": "10ms"}}"#),
            route: Route::Fixed,
        },
    ]
}

/// Measurement 6.
pub async fn run(s: &Settings) {
    println!("## 6. An idle proxy: CPU per second with no traffic (timers only)\n");
    let (a, _) = load::start_upstream().await;
    let seconds = if s.quick { 5.0 } else { 15.0 };
    let rounds = if s.quick { 2 } else { 3 };
    let mut t = Table::new(&["variant", "what", "Envoy CPU ms per second idle (median)", "range"]);
    for v in variants(s) {
        let spec = Spec { filter: v.filter.clone(), route: v.route.clone(), clusters: [a, a, a], http2: false, concurrency: 2, cpus: "0".into(), wrapper: Vec::new(), services: Vec::new() };
        let envoy = match spec.start(&s.envoy) {
            Ok(e) => e,
            Err(e) => {
                println!("**{}** could not be measured: {e}\n", v.id);
                continue;
            }
        };
        // Let start-up work (V8 compiling the module) finish.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut per_second = Vec::new();
        for _ in 0..rounds {
            cpu::wait_for_quiet(Duration::from_secs(5)).await;
            let before = cpu_ns_of(envoy.pid());
            tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
            let ns = cpu_ns_of(envoy.pid()).saturating_sub(before) as f64;
            per_second.push(ns / seconds / 1e6);
        }
        progress!("{}: {:?} CPU ms/s", v.id, per_second);
        let (lo, hi) = crate::table::range(&per_second);
        t.row(vec![format!("`{}`", v.id), v.label.clone(), format!("{:.2}", median(&per_second)), format!("{lo:.2}–{hi:.2}")]);
    }
    println!(
        "Envoy with 2 workers pinned to core 0 and no traffic; CPU time (user + system, /proc) over {rounds} quiet stretches of {seconds:.0} s each, per second.\n\n{}\n",
        t.render()
    );
}
