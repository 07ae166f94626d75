//! The fleets of the global-scope measurements (measurement 5 in [`crate::global`], its part (f)
//! in [`crate::leased`], the peers in [`crate::peers`], and the Envoys of the fleet tool's
//! cross-check): [`PROXIES`] Envoys running the module, and the paced (open-loop) load sent to
//! them.

use crate::envoy::{Envoy, Filter, Route, Spec, Starting, SYNC_CLUSTER};
use crate::load::Conn;
use crate::{progress, Settings};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Proxies in the fleet.
pub(crate) const PROXIES: usize = 3;
/// Worker threads per proxy.
pub(crate) const WORKERS: usize = 2;
/// The window of the quota rules: long, so a run's counts never roll into another bucket.
const WINDOW: Duration = Duration::from_secs(3600);
/// Keep-alive connections per proxy of the paced load.
pub(crate) const PACED_CONNECTIONS: usize = 8;

/// An Envoy of the fleets here: `WORKERS` workers on core 0, the floodgate module with
/// `config`, `floodgate-sync` at `sync` if any, run under `wrapper` (empty: none).
pub(crate) fn envoy_spec(s: &Settings, config: &Value, upstream: SocketAddr, sync: Option<SocketAddr>, wrapper: Vec<String>) -> Spec {
    let services = sync.map(|addr| vec![(SYNC_CLUSTER, addr)]).unwrap_or_default();
    fleet_spec(&s.floodgate_wasm, config.to_string(), upstream, services, wrapper)
}

/// An Envoy of the fleets here running `module` with `config`: `WORKERS` workers on core 0,
/// the limiter `services` it calls, under `wrapper` (empty: none).
pub(crate) fn fleet_spec(module: &Path, config: String, upstream: SocketAddr, services: Vec<(&'static str, SocketAddr)>, wrapper: Vec<String>) -> Spec {
    Spec {
        filter: Filter::Wasm { module: module.to_path_buf(), config },
        route: Route::Fixed,
        clusters: [upstream; 3],
        http2: false,
        concurrency: WORKERS,
        cpus: "0".into(),
        wrapper,
        services,
    }
}

/// Three Envoys with this configuration, talking to `sync`.
pub(crate) struct Fleet {
    pub(crate) envoys: Vec<Envoy>,
}

impl Fleet {
    pub(crate) fn start(s: &Settings, config: &Value, upstream: SocketAddr, sync: SocketAddr) -> Result<Fleet, String> {
        Fleet::of(s, &envoy_spec(s, config, upstream, Some(sync), Vec::new()))
    }

    /// [`PROXIES`] Envoys of `spec`.
    pub(crate) fn of(s: &Settings, spec: &Spec) -> Result<Fleet, String> {
        Fleet::of_each(s, vec![spec.clone(); PROXIES])
    }

    /// An Envoy of each spec.
    pub(crate) fn of_each(s: &Settings, specs: Vec<Spec>) -> Result<Fleet, String> {
        // Spawn all, then wait: each compiles the module.
        let spawned: Vec<Result<Starting, String>> = specs.iter().map(|spec| spec.spawn(&s.envoy)).collect();
        let mut envoys = Vec::new();
        for e in spawned {
            envoys.push(e.and_then(|e| e.wait_ready(Duration::from_secs(60)))?);
        }
        Ok(Fleet { envoys })
    }

    pub(crate) fn addrs(&self) -> Vec<SocketAddr> {
        self.envoys.iter().map(Envoy::addr).collect()
    }

    pub(crate) fn pids(&self) -> Vec<u32> {
        self.envoys.iter().map(Envoy::pid).collect()
    }

    /// A `wasmcustom.floodgate.global.<what>` stat summed over the fleet.
    pub(crate) fn global_sum(&self, what: &str) -> u64 {
        self.envoys.iter().filter_map(|e| e.stat(&format!("wasmcustom.floodgate.global.{what}"))).sum()
    }

    /// The largest `staleness_ms` of the fleet.
    pub(crate) fn staleness_ms(&self) -> u64 {
        self.envoys.iter().filter_map(|e| e.stat("wasmcustom.floodgate.global.staleness_ms")).max().unwrap_or(0)
    }
}

/// One request of a paced run: its number, when it was due (since the start), its status (0: no
/// response), and when its response was in.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sent {
    pub(crate) n: u64,
    pub(crate) due: Duration,
    pub(crate) status: u16,
    pub(crate) done: Duration,
}

/// Open-loop load: request `i` is due at `i / rate` seconds and goes to `targets[i % len]`, over
/// [`PACED_CONNECTIONS`] keep-alive connections per target, until `duration`. A request is not
/// sent again after a transport error (it would count twice); it is recorded with status 0.
pub(crate) async fn paced(targets: &[SocketAddr], rate: f64, duration: Duration, make: impl Fn(u64) -> Vec<u8>) -> Vec<Sent> {
    let len = targets.len().max(1) as u64;
    paced_routed(targets, rate, duration, |i| ((i % len) as usize, make(i))).await
}

/// [`paced`], request `i` going to `targets[route(i).0]` with `route(i).1` as its bytes.
pub(crate) async fn paced_routed(targets: &[SocketAddr], rate: f64, duration: Duration, route: impl Fn(u64) -> (usize, Vec<u8>)) -> Vec<Sent> {
    type Job = (u64, Duration, Vec<u8>);
    let start = Instant::now();
    let out: Arc<Mutex<Vec<Sent>>> = Arc::new(Mutex::new(Vec::new()));
    let mut senders = Vec::new();
    let mut workers = Vec::new();
    for &target in targets {
        let (tx, rx) = tokio::sync::mpsc::channel::<Job>(1 << 16);
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        senders.push(tx);
        for _ in 0..PACED_CONNECTIONS {
            let (rx, out) = (Arc::clone(&rx), Arc::clone(&out));
            workers.push(tokio::spawn(async move {
                let mut conn: Option<Conn> = None;
                loop {
                    let job = rx.lock().await.recv().await;
                    let Some((n, due, request)) = job else { break };
                    if conn.is_none() {
                        conn = Conn::connect(target).await;
                    }
                    let status = match conn.as_mut() {
                        Some(c) => c.exchange(&request).await,
                        None => None,
                    };
                    if status.is_none() {
                        conn = None;
                    }
                    let sent = Sent { n, due, status: status.unwrap_or(0), done: start.elapsed() };
                    out.lock().map(|mut o| o.push(sent)).unwrap_or_default();
                }
            }));
        }
    }
    let mut i: u64 = 0;
    loop {
        let due = Duration::from_secs_f64(i as f64 / rate);
        if due >= duration {
            break;
        }
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let (target, request) = route(i);
        let Some(sender) = senders.get(target) else { break };
        if sender.send((i, due, request)).await.is_err() {
            break;
        }
        i += 1;
    }
    drop(senders);
    for w in workers {
        let _ = tokio::time::timeout(Duration::from_secs(30), w).await;
    }
    let mut sent = out.lock().map(|mut o| std::mem::take(&mut *o)).unwrap_or_default();
    sent.sort_by_key(|s| s.due);
    sent
}

/// Waits, if needed, until the current 1 h window bucket has `needed` left: a case's counts must
/// all fall in one bucket.
pub(crate) async fn fit_in_window(needed: Duration) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let into = Duration::from_millis((now.as_millis() % WINDOW.as_millis()) as u64);
    if into + needed + Duration::from_secs(5) > WINDOW {
        let wait = WINDOW - into + Duration::from_secs(1);
        progress!("waiting {:.0} s for the next 1 h window bucket", wait.as_secs_f64());
        tokio::time::sleep(wait).await;
    }
}

/// A value unique to this run, for fresh keys.
pub(crate) fn run_id() -> String {
    let ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    format!("{}-{ms}", std::process::id())
}
