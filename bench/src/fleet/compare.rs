//! The cross-check of the fleet tool against real Envoys (`bench/run.sh fleet --envoys`): what
//! one run measured on either side ([`Side`]), how they agree ([`agreement`]), and the
//! side-by-side table. Pure.

use super::per_k;
use super::tally::Summary;
use crate::table::{count, Table};
use std::collections::BTreeMap;

/// The acceptance bound on admitted counts: real within this per cent of the tool's.
pub const BOUND_PERCENT: u64 = 2;

/// What one side of a cross-check measured.
#[derive(Clone, Debug, Default)]
pub struct Side {
    /// Requests sent.
    pub requests: u64,
    /// Admitted (`200`).
    pub admitted: u64,
    /// Refused by the rule (`429`).
    pub refused: u64,
    /// Any other outcome (no answer, `503`).
    pub other: u64,
    /// The tally's summary.
    pub summary: Summary,
    /// Admitted per key and window, windows numbered from the run's first.
    pub windows: BTreeMap<(u32, u64), u32>,
    /// Calls `floodgate-sync` answered on `/v1/sync` (batches).
    pub sync_batches: u64,
    /// Calls `floodgate-sync` answered on `/v1/lease` (asks, lease calls).
    pub sync_leases: u64,
    /// The store calls the proxies sent: batches, asks, lease calls (Envoys: the module's
    /// `global.batches`, `global.asked`, `lease.calls`; the tool: its calls by kind).
    pub module: [u64; 3],
    /// Requests that waited for the store (`global.asked` + `lease.waited`).
    pub waited: u64,
    /// Decisions made without the store (`lease.without_store` + `global.ask_failures`).
    pub without_store: u64,
    /// Redis commands on the masters.
    pub redis_commands: u64,
    /// How late the open loop ran at its worst, ms (the tool: sending; Envoys: a response after
    /// its request was due).
    pub lateness_ms: f64,
}

/// How the two sides of one configuration agree.
#[derive(Clone, Debug, PartialEq)]
pub struct Agreement {
    /// Admitted, real ÷ tool.
    pub ratio: f64,
    /// Whether real is within [`BOUND_PERCENT`] of the tool's count.
    pub within: bool,
    /// (key, window) pairs either side admitted in.
    pub windows: usize,
    /// Of those, the pairs whose admitted counts differ.
    pub differing: usize,
    /// The largest difference in one pair, real − tool, and its pair.
    pub largest: (i64, u32, u64),
    /// The absolute differences summed over the pairs, over the tool's admitted total.
    pub moved: f64,
}

/// How `real` and `tool` agree.
pub fn agreement(real: &Side, tool: &Side) -> Agreement {
    let ratio = if tool.admitted == 0 {
        if real.admitted == 0 { 1.0 } else { f64::INFINITY }
    } else {
        real.admitted as f64 / tool.admitted as f64
    };
    let mut pairs: Vec<(u32, u64)> = real.windows.keys().chain(tool.windows.keys()).copied().collect();
    pairs.sort_unstable();
    pairs.dedup();
    let mut differing = 0;
    let mut largest = (0i64, 0u32, 0u64);
    let mut moved = 0u64;
    for &(key, window) in &pairs {
        let get = |side: &Side| i64::from(side.windows.get(&(key, window)).copied().unwrap_or(0));
        let d = get(real) - get(tool);
        if d != 0 {
            differing += 1;
            moved += d.unsigned_abs();
        }
        if d.abs() > largest.0.abs() {
            largest = (d, key, window);
        }
    }
    Agreement {
        ratio,
        within: real.admitted.abs_diff(tool.admitted) * 100 <= BOUND_PERCENT * tool.admitted && (tool.admitted > 0 || real.admitted == 0),
        windows: pairs.len(),
        differing,
        largest,
        moved: moved as f64 / tool.admitted.max(1) as f64,
    }
}

/// ms to wait from `now_ms` (unix) until `phase_ms` into a window of `window_ms`: every run of a
/// cross-check starts at the same point of its window.
pub fn until_phase(now_ms: u64, window_ms: u64, phase_ms: u64) -> u64 {
    let window_ms = window_ms.max(1);
    let into = now_ms % window_ms;
    let phase = phase_ms % window_ms;
    if into <= phase {
        phase - into
    } else {
        window_ms - into + phase
    }
}

/// One configuration measured both ways.
pub struct Pair {
    /// Proxies.
    pub proxies: usize,
    /// `batched` or `leased`.
    pub consistency: String,
    /// The mix, as the tables read it.
    pub mix: String,
    /// Through Envoys.
    pub real: Side,
    /// Through the tool's proxies.
    pub tool: Side,
    /// Through the tool's proxies, each with one more VM that serves no request (Envoy's main
    /// thread's), if run.
    pub tool_main: Option<Side>,
}


/// The side-by-side table: two rows per configuration.
pub fn table(pairs: &[Pair]) -> String {
    let mut t = Table::new(&[
        "proxies × 1 worker",
        "consistency",
        "mix",
        "through",
        "requests",
        "admitted",
        "fullest window ÷ L (p50, p99, max)",
        "windows over L (largest over)",
        "refused (other)",
        "store calls /1k: batches, asks or leases (floodgate-sync)",
        "sent by the proxies: batches, asks, lease calls /1k",
        "waited; decided without the store",
        "Redis cmds /1k",
        "worst lateness ms",
        "admitted: Envoys ÷ this row",
        "(key, window) pairs differing from the Envoys; largest; moved",
    ]);
    for p in pairs {
        let rows = [("Envoys", Some(&p.real)), ("tool", Some(&p.tool)), ("tool, + idle VM", p.tool_main.as_ref())];
        for (name, side) in rows.into_iter().filter_map(|(n, s)| Some((n, s?))) {
            let s = &side.summary;
            let simulated = !std::ptr::eq(side, &p.real);
            let a = agreement(&p.real, side);
            t.row(vec![
                p.proxies.to_string(),
                p.consistency.clone(),
                p.mix.clone(),
                name.into(),
                count(side.requests),
                count(side.admitted),
                format!("{:.3}, {:.3}, {:.3}", s.fullest[0], s.fullest[1], s.fullest[2]),
                format!("{} of {} ({})", s.windows_over, side.windows.len(), s.largest_over),
                format!("{} ({})", count(side.refused), count(side.other)),
                format!("{}, {}", per_k(side.sync_batches as f64, side.requests), per_k(side.sync_leases as f64, side.requests)),
                format!("{}, {}, {}", per_k(side.module[0] as f64, side.requests), per_k(side.module[1] as f64, side.requests), per_k(side.module[2] as f64, side.requests)),
                format!("{}; {}", count(side.waited), count(side.without_store)),
                per_k(side.redis_commands as f64, side.requests),
                format!("{:.0}", side.lateness_ms),
                if simulated { format!("**{:.4}**{}", a.ratio, if a.within { String::new() } else { format!(" (outside ±{BOUND_PERCENT} %)") }) } else { String::new() },
                if simulated { format!("{} of {}; {:+} (key {}, window {}); {:.2} %", a.differing, a.windows, a.largest.0, a.largest.1, a.largest.2, a.moved * 100.0) } else { String::new() },
            ]);
        }
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(admitted: u64, windows: &[((u32, u64), u32)]) -> Side {
        Side { admitted, windows: windows.iter().copied().collect(), ..Side::default() }
    }

    #[test]
    fn admitted_counts_agree_within_two_per_cent_and_no_further() {
        let tool = side(1000, &[]);
        assert!(agreement(&side(1020, &[]), &tool).within);
        assert!(agreement(&side(980, &[]), &tool).within);
        assert!(!agreement(&side(1021, &[]), &tool).within);
        assert!(!agreement(&side(979, &[]), &tool).within);
        assert_eq!(agreement(&side(0, &[]), &side(0, &[])).ratio, 1.0);
        assert!(!agreement(&side(5, &[]), &side(0, &[])).within);
    }

    #[test]
    fn windows_compare_pair_by_pair() {
        let real = side(25, &[((1, 0), 10), ((1, 1), 10), ((2, 0), 5)]);
        let tool = side(24, &[((1, 0), 10), ((1, 1), 7), ((2, 0), 5), ((3, 0), 2)]);
        let a = agreement(&real, &tool);
        assert_eq!((a.windows, a.differing), (4, 2));
        assert_eq!(a.largest, (3, 1, 1));
        assert!((a.moved - 5.0 / 24.0).abs() < 1e-12);
    }

    #[test]
    fn runs_start_at_the_same_point_of_their_window() {
        assert_eq!(until_phase(10_000, 10_000, 500), 500);
        assert_eq!(until_phase(10_400, 10_000, 500), 100);
        assert_eq!(until_phase(10_500, 10_000, 500), 0);
        assert_eq!(until_phase(10_501, 10_000, 500), 9_999);
        assert_eq!(until_phase(119_000, 60_000, 500), 1_500);
    }

    #[test]
    fn the_table_has_a_row_per_side_and_the_ratios_on_the_simulated_ones() {
        let pair = Pair { proxies: 12, consistency: "leased".into(), mix: "hot".into(), real: side(1010, &[((0, 0), 1010)]), tool: side(1000, &[((0, 0), 1000)]), tool_main: None };
        let text = table(&[pair]);
        let rows: Vec<&str> = text.lines().skip(2).collect();
        assert_eq!(rows.len(), 2);
        assert!(rows[0].contains("Envoys") && !rows[0].contains("**"), "{}", rows[0]);
        assert!(rows[1].contains("tool") && rows[1].contains("**1.0100**"), "{}", rows[1]);
        assert!(rows[1].contains("1 of 1; +10 (key 0, window 0); 1.00 %"), "{}", rows[1]);
        let pair = Pair { proxies: 12, consistency: "leased".into(), mix: "hot".into(), real: side(1010, &[]), tool: side(1000, &[]), tool_main: Some(side(1030, &[])) };
        let text = table(&[pair]);
        let rows: Vec<&str> = text.lines().skip(2).collect();
        assert_eq!(rows.len(), 3);
        assert!(rows[2].contains("idle VM") && rows[2].contains("**0.9806**"), "{}", rows[2]);
    }
}
