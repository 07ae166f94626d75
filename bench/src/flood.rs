//! Measurement 3b: floods of new keys (docs/configuration.md, *Sizing*). While a flood of
//! other keys goes on, what does a brand-new key get of its quota, and does a key that was
//! active before keep its exact count?
//!
//! - **(c) Through the limiter as the filter runs it**: one worker VM's code path, natively:
//!   `Limiter::check` over the in-memory store with Envoy's semantics (the bounded table behind
//!   it), that VM's quota reserves and their heartbeat every second, on an epoch-aligned clock.
//!   Every decision of the trace is the module's own; only the host is simulated.
//! - **(d) In a real Envoy**: the built module, one worker, at two flood sizes, with (c) run on
//!   the same timing beside it (where the flood fell in the window, how long it took, when the
//!   keys asked), so the two can be compared row by row.
//!
//! The flood is counted in requests per set and window (`capacity / 4` sets): what fills a
//! set's doorkeepers is the flood's requests, whether each comes from a new key or from a key
//! the flood sends several times. A key active before the flood sent 2 requests; afterwards it
//! and each brand-new key send 7 requests at once against a limit of 5. What a key gets is
//! compared with what it gets on the same trace without the flood.

use crate::envoy::{Filter, Route, Spec};
use crate::load::{self, Conn, Load, Requests};
use crate::table::{count, Table};
use crate::{progress, Settings};
use floodgate::config::{Config, DEFAULT_CAPACITY};
use floodgate::keys::KeyHasher;
use floodgate::ratelimit::reserve::Reserves;
use floodgate::ratelimit::table::WAYS;
use floodgate::ratelimit::{Limiter, Probe, Verdict};
use floodgate::primitives::inflight::HEARTBEAT_MS;
use floodgate::primitives::store::MemoryStore;
use floodgate::primitives::time::UnixMillis;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The limit every key asks against.
const LIMIT: u64 = 5;
/// Requests a key sends when it asks: all it may have, and 2 more.
const ASKS: u64 = LIMIT + 2;
/// The window, ms.
const WINDOW_MS: u64 = 60_000;
/// A window bucket's start, as the traces' time origin (any multiple of the window).
const BUCKET: u64 = 1_800_000_000_000 / WINDOW_MS * WINDOW_MS;

/// One trace: a flood, the keys active before it, and the keys that ask after it.
#[derive(Clone, Copy, Debug)]
struct Trace {
    capacity: u32,
    /// Flood requests per set and window.
    per_set: u64,
    /// Requests each flood key sends (1: one-shot keys), interleaved over the flood.
    repeats: u64,
    /// When the keys active before the flood send their 2 requests (ms since the epoch).
    active_at: u64,
    /// When the flood starts and how long it lasts.
    flood_at: u64,
    flood_ms: u64,
    /// When the keys ask.
    ask_at: u64,
    newcomers: u64,
    established: u64,
}

impl Trace {
    fn sets(&self) -> u64 {
        u64::from(self.capacity).div_ceil(WAYS as u64)
    }
    fn flood_requests(&self) -> u64 {
        self.per_set * self.sets()
    }
    fn flood_keys(&self) -> u64 {
        (self.flood_requests() / self.repeats).max(1)
    }
}

/// What the keys got: per key, how many of its requests were admitted.
#[derive(Clone, Debug, Default)]
struct Outcome {
    newcomers: Vec<u64>,
    established: Vec<u64>,
    flood_refused: u64,
}

impl Outcome {
    /// Shares of brand-new keys that got all `LIMIT`, `LIMIT − 1`, and fewer.
    fn newcomer_shares(&self) -> [f64; 3] {
        let n = self.newcomers.len().max(1) as f64;
        let got = |f: &dyn Fn(u64) -> bool| self.newcomers.iter().filter(|&&a| f(a)).count() as f64 / n;
        [got(&|a| a >= LIMIT), got(&|a| a + 1 == LIMIT), got(&|a| a + 1 < LIMIT)]
    }
    /// Shares of active keys that got what they get without the flood, one less, and fewer
    /// (`reference`: their admissions on the same trace without the flood).
    fn established_shares(&self, reference: &[u64]) -> [f64; 3] {
        let n = self.established.len().max(1) as f64;
        let mut shares = [0.0; 3];
        for (got, exact) in self.established.iter().zip(reference) {
            let lost = exact.saturating_sub(*got);
            shares[(lost as usize).min(2)] += 1.0 / n;
        }
        shares
    }
}

fn limiter(capacity: u32) -> Limiter {
    let config = Config::parse(
        format!(
            r#"{{"rate_limits": [{{"name": "r", "key": [{{"header": "x-api-key"}}], "limit": {LIMIT}, "window": "{}s", "capacity": {capacity}}}]}}"#,
            WINDOW_MS / 1000
        )
        .as_bytes(),
    )
    .expect("benchmark configuration");
    Limiter::new(&config, "bench")
}

/// Runs `trace` through one worker VM's limiter (the flood left out unless `flood`).
fn simulate(trace: &Trace, flood: bool) -> Outcome {
    let limiter = limiter(trace.capacity);
    let store = MemoryStore::new();
    let hasher = KeyHasher::new(*b"floodgate-flood!");
    let mut reserves = Reserves::new();
    let mut next_heartbeat = 0u64;
    let mut ask = |key: &str, now: u64, reserves: &mut Reserves| {
        if now >= next_heartbeat {
            limiter.heartbeat(&store, reserves, UnixMillis(now));
            next_heartbeat = now + HEARTBEAT_MS;
        }
        let probe = Probe::new(0, hasher.hash([Some(key.as_bytes())]));
        matches!(limiter.check(&store, reserves, &[probe], &[], UnixMillis(now)), Verdict::Admitted { .. })
    };
    for k in 0..trace.established {
        for _ in 0..2 {
            ask(&format!("active-{k}"), trace.active_at, &mut reserves);
        }
    }
    let mut out = Outcome::default();
    if flood {
        let (requests, keys) = (trace.flood_requests(), trace.flood_keys());
        for n in 0..requests {
            let at = trace.flood_at + n * trace.flood_ms / requests;
            if !ask(&format!("flood-{}", n % keys), at, &mut reserves) {
                out.flood_refused += 1;
            }
        }
    }
    let mut asked = |prefix: &str, keys: u64, reserves: &mut Reserves| -> Vec<u64> {
        (0..keys)
            .map(|k| (0..ASKS).map(|_| u64::from(ask(&format!("{prefix}-{k}"), trace.ask_at, reserves))).sum())
            .collect()
    };
    out.newcomers = asked("new", trace.newcomers, &mut reserves);
    out.established = asked("active", trace.established, &mut reserves);
    out
}

fn pct(share: f64) -> String {
    format!("{:.2}%", 100.0 * share)
}

/// The columns the simulated and the real runs share.
fn outcome_cells(out: &Outcome, reference: &[u64]) -> Vec<String> {
    let new = out.newcomer_shares();
    let old = out.established_shares(reference);
    vec![pct(new[0]), pct(new[1]), pct(new[2]), pct(old[0]), pct(old[1] + old[2])]
}

const OUTCOME_HEADER: [&str; 5] = ["new key gets 5 of 5", "4 of 5", "3 or fewer", "active key counted exactly", "active key over-counted"];

/// Where the flood falls against the window buckets.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// From 2 s to 42 s into a bucket; the keys ask at 43 s.
    Current,
    /// The same, and the keys ask 1 s into the next bucket.
    Previous,
    /// From 40 s into a bucket to 20 s into the next; the keys ask at 21 s.
    Spanning,
}

impl Shape {
    fn label(self) -> &'static str {
        match self {
            Shape::Current => "in the current bucket",
            Shape::Previous => "in the previous bucket",
            Shape::Spanning => "spanning both",
        }
    }
    fn trace(self, per_set: u64, repeats: u64, keys: u64) -> Trace {
        let (flood_at, ask_at) = match self {
            Shape::Current => (BUCKET + 2_000, BUCKET + 43_000),
            Shape::Previous => (BUCKET + 2_000, BUCKET + WINDOW_MS + 1_000),
            Shape::Spanning => (BUCKET + 40_000, BUCKET + WINDOW_MS + 21_000),
        };
        Trace {
            capacity: DEFAULT_CAPACITY,
            per_set,
            repeats,
            active_at: flood_at - 1_000,
            flood_at,
            flood_ms: 40_000,
            ask_at,
            newcomers: keys,
            established: keys,
        }
    }
}

/// (c): the simulated tables.
fn simulated(s: &Settings) -> String {
    let keys = if s.quick { 500 } else { 2_000 };
    let mut sizes = Table::new(
        &[&["flood requests per set and window", "per window at the default capacity (16 384)"][..], &OUTCOME_HEADER[..]].concat(),
    );
    let sizes_list: &[u64] = if s.quick { &[25, 75, 150, 300] } else { &[25, 75, 150, 300, 500, 1_000] };
    for &per_set in sizes_list {
        let trace = Shape::Current.trace(per_set, 1, keys);
        let reference = simulate(&trace, false).established;
        let out = simulate(&trace, true);
        progress!("flood {per_set} per set: {:?}", out.newcomer_shares());
        let mut row = vec![count(per_set), count(trace.flood_requests())];
        row.extend(outcome_cells(&out, &reference));
        sizes.row(row);
    }
    let mut shapes = Table::new(&[&["where the flood falls", "requests per flood key"][..], &OUTCOME_HEADER[..]].concat());
    for shape in [Shape::Current, Shape::Previous, Shape::Spanning] {
        for repeats in [1, 2, 3, 4, 8] {
            let trace = shape.trace(75, repeats, keys);
            let reference = simulate(&trace, false).established;
            let out = simulate(&trace, true);
            let mut row = vec![shape.label().to_string(), count(repeats)];
            row.extend(outcome_cells(&out, &reference));
            shapes.row(row);
        }
    }
    format!(
        "**(c) Floods, through the limiter as the filter runs it** (one worker VM: `Limiter::check`, the bounded table \
         over a store with Envoy's semantics, quota reserves and their heartbeat; default capacity; {keys} brand-new keys \
         and {keys} keys active before the flood (2 requests) each send 7 requests at once against a limit of 5; an active \
         key is counted exactly when it gets what it gets on the same trace without the flood).\n\n\
         One-shot keys, the flood from 2 s to 42 s into a window bucket, the keys asking at 43 s:\n\n{}\n\n\
         75 requests per set and window, by where the flood falls (in the current bucket as above; in the previous one, \
         the keys asking 1 s into the next; spanning both, from 40 s into a bucket to 20 s into the next, the keys asking \
         at 21 s) and by how many requests each flood key sends:\n\n{}\n",
        sizes.render(),
        shapes.render()
    )
}

fn epoch_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Each key of `keys` sends [`ASKS`] requests one after another on one connection (one
/// worker); how many each got admitted.
async fn ask_envoy(addr: std::net::SocketAddr, keys: &[String], requests: u64) -> Vec<u64> {
    let mut out = Vec::with_capacity(keys.len());
    let Some(mut conn) = Conn::connect(addr).await else { return out };
    for key in keys {
        let mut admitted = 0;
        for _ in 0..requests {
            let status = conn.exchange(&load::request("/", &[("x-api-key", key.clone())])).await;
            admitted += u64::from(status == Some(200));
        }
        out.push(admitted);
    }
    out
}

/// One real-Envoy run of a flood of `per_set` requests per set (each key sending `repeats`),
/// as soon after a window bucket starts as it can; returns the trace as it happened and what
/// the keys got.
async fn envoy_run(s: &Settings, capacity: u32, per_set: u64, repeats: u64, keys: u64) -> Result<(Trace, Outcome, f64), String> {
    let (upstream, _) = load::start_upstream().await;
    let config = format!(
        r#"{{"rate_limits": [{{"name": "r", "key": [{{"header": "x-api-key"}}], "limit": {LIMIT}, "window": "{}s", "capacity": {capacity}}}]}}"#,
        WINDOW_MS / 1000
    );
    let spec = Spec {
        filter: Filter::Wasm { module: s.floodgate_wasm.clone(), config },
        route: Route::Fixed,
        clusters: [upstream; 3],
        http2: false,
        concurrency: 1,
        cpus: "0".into(),
        wrapper: Vec::new(),
        services: Vec::new(),
    };
    let envoy = spec.start(&s.envoy)?;
    let addr = envoy.addr();
    // Start 1 s into a bucket, so that a flood of up to ~50 s stays within it.
    let into = epoch_ms() % WINDOW_MS;
    let wait = (WINDOW_MS + 1_000 - into) % WINDOW_MS;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let run = epoch_ms();
    let active: Vec<String> = (0..keys).map(|k| format!("active-{run}-{k}")).collect();
    let _ = ask_envoy(addr, &active, 2).await;
    let mut trace = Trace {
        capacity,
        per_set,
        repeats,
        active_at: run,
        flood_at: epoch_ms(),
        flood_ms: 0,
        ask_at: 0,
        newcomers: keys,
        established: keys,
    };
    let distinct = trace.flood_keys();
    let make = Arc::new(move |n: u64| load::request("/", &[("x-api-key", format!("flood-{run}-{}", n % distinct))]));
    let flood = Load { targets: vec![addr], connections: 32, requests: Requests::Numbered(make), max_requests: Some(trace.flood_requests()) };
    let (done, _, _) = load::run(&flood, Duration::ZERO, Duration::from_secs(600), || ()).await;
    trace.flood_ms = epoch_ms().saturating_sub(trace.flood_at);
    trace.ask_at = epoch_ms();
    let newcomers: Vec<String> = (0..keys).map(|k| format!("new-{run}-{k}")).collect();
    let out = Outcome {
        newcomers: ask_envoy(addr, &newcomers, ASKS).await,
        established: ask_envoy(addr, &active, ASKS).await,
        flood_refused: done.completed.saturating_sub(done.status(200)),
    };
    let rate = done.completed as f64 / (trace.flood_ms.max(1) as f64 / 1000.0);
    Ok((trace, out, rate))
}

/// (d): real Envoy beside the simulation of the same timing.
async fn in_envoy(s: &Settings) -> String {
    // The guarantee is per set: a small table takes the documented flood within a few seconds
    // of one window bucket, as the simulation's rows have it.
    let capacity = s.capacity.unwrap_or(1_024);
    let keys = if s.quick { 100 } else { 500 };
    let mut t = Table::new(
        &[&["flood", "flood rate (requests/s)", "flood, in s since its window bucket began", "run"][..], &OUTCOME_HEADER[..], &["flood requests refused"][..]].concat(),
    );
    for (per_set, repeats) in [(75, 1), (300, 1), (75, 3)] {
        let (trace, out, rate) = match envoy_run(s, capacity, per_set, repeats, keys).await {
            Ok(r) => r,
            Err(e) => {
                t.row(vec![format!("{per_set} per set"), format!("Envoy could not be started: {e}")]);
                continue;
            }
        };
        progress!("Envoy, flood {per_set} per set x{repeats}: {:?} in {} ms", out.newcomer_shares(), trace.flood_ms);
        let reference = simulate(&trace, false).established;
        let simulated = simulate(&trace, true);
        let label = format!("{per_set} per set, {}", if repeats == 1 { "one-shot keys".to_string() } else { format!("{repeats} requests per key") });
        // Seconds since the window bucket the flood started in began.
        let bucket = trace.flood_at / WINDOW_MS * WINDOW_MS;
        let secs = |at: u64| at.saturating_sub(bucket) as f64 / 1000.0;
        let span = format!(
            "{:.1} s to {:.1} s (asked at {:.1} s)",
            secs(trace.flood_at),
            secs(trace.flood_at + trace.flood_ms),
            secs(trace.ask_at)
        );
        for (run, o) in [("Envoy", &out), ("simulated, same timing", &simulated)] {
            let mut row = vec![label.clone(), format!("{rate:.0}"), span.clone(), run.to_string()];
            // The real run's active keys are judged against the same reference: the
            // simulation of its trace without the flood.
            row.extend(outcome_cells(o, &reference));
            row.push(count(o.flood_refused));
            t.row(row);
        }
    }
    format!(
        "**(d) The same in a real Envoy** (the built module, 1 worker, capacity {}, so {} sets; {keys} brand-new keys and \
         {keys} active keys; the flood from 32 connections as fast as Envoy answers, starting 1 s into a window bucket; \
         each row's simulation replays the run's own timing):\n\n{}\n",
        count(u64::from(capacity)),
        count(u64::from(capacity).div_ceil(WAYS as u64)),
        t.render()
    )
}

/// Measurement 3b.
pub async fn run(s: &Settings) {
    println!("## 3b. Floods of new keys\n");
    println!("{}", simulated(s));
    println!("{}", in_envoy(s).await);
}
