//! Test harness for floodgate's integration tests.
//!
//! The tests in `integration/tests/` load the built Wasm module into a real Envoy process, put a
//! real HTTP/1.1 upstream behind it, and talk to it over loopback (127.0.0.1 only). This crate
//! holds what they share:
//!
//! * [`wasm_module`] and [`envoy_binary`] locate the artifacts (`FLOODGATE_WASM` / `ENVOY_BIN`, or
//!   their default places in the workspace). A missing artifact fails the test with a message
//!   telling to run `./test.sh`; nothing is ever skipped silently.
//! * [`Upstream`]: a hyper HTTP/1.1 server on an ephemeral port that counts what it receives.
//! * [`Envoy`]: a real Envoy started from a generated bootstrap with the floodgate filter in front
//!   of the router; exposes its listener address, admin API, stats, RSS and log.
//! * [`Client`] (hyper, keep-alive) and [`raw_request`] (arbitrary bytes over a `TcpStream`) to send
//!   requests.
//! * [`wait_for_window_phase`] to keep a timing-sensitive test clear of an epoch-aligned window
//!   boundary.
//! * [`slow_clients`]: slow uploads and downloads, and an HTTP/2 client that grants no window.
//! * [`wallclock`]: a wall clock of Envoy's own that a test can step.
//!
//! Every wait in here is bounded; every server binds 127.0.0.1.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream as StdTcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderName};
use hyper::service::service_fn;
use hyper::{Request, Response as HyperResponse};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub use serde_json::{json, Value};

pub mod dynamic;
pub mod faults;
pub mod grpc;
pub mod slow_clients;
pub mod store;
pub mod wallclock;

/// The health endpoint the shedding tests configure.
pub const HEALTH_PATH: &str = "/floodgate/health";

/// A filter configuration with load shedding at `max` in flight (classes critical 1.0, normal
/// 0.6, low 0.3; default normal; `retry-after` 2 s) and the health endpoint at [`HEALTH_PATH`].
pub fn shedding_config(max: u32) -> Value {
    json!({
        "load_shedding": {
            "max_active_requests": max,
            "classes": [
                {"name": "critical", "shed_at": 1.0},
                {"name": "normal", "shed_at": 0.6},
                {"name": "low", "shed_at": 0.3}
            ],
            "default_class": "normal",
            "retry_after": "2s"
        },
        "health": {"path": HEALTH_PATH}
    })
}

/// Default stat prefix of the filter's metrics (`stat_prefix` in the configuration).
pub const STAT_PREFIX: &str = "floodgate";

/// The namespace Envoy puts the module's metrics in (shown in `/stats`, not in
/// `/stats/prometheus`).
pub const WASM_CUSTOM_NAMESPACE: &str = "wasmcustom.";

/// How long Envoy may take to become ready (V8 compiles the module once per VM).
const ENVOY_START_TIMEOUT: Duration = Duration::from_secs(60);

/// How long [`EnvoyBuilder::start_expecting_failure`] waits for Envoy to exit.
const ENVOY_FAILURE_TIMEOUT: Duration = Duration::from_secs(30);

/// Timeout of one request made by the helpers in this crate.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// Error type of the client helpers.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------------------------------------
// Artifacts
// ---------------------------------------------------------------------------------------------

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .expect("integration/ has a parent directory")
        .to_path_buf()
}

/// The built floodgate Wasm module: `$FLOODGATE_WASM`, else
/// `<workspace>/target/wasm32-wasip1/release/floodgate.wasm`. Panics with a clear message if it is
/// missing.
pub fn wasm_module() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOODGATE_WASM") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "FLOODGATE_WASM={} does not exist: run ./test.sh (it builds the module with ./wasm-build.sh)",
            p.display()
        );
        return absolute(&p);
    }
    let p = workspace_root().join("target/wasm32-wasip1/release/floodgate.wasm");
    assert!(
        p.is_file(),
        "the floodgate Wasm module is not built ({} is missing and FLOODGATE_WASM is unset): \
         run ./test.sh, which builds it with ./wasm-build.sh",
        p.display()
    );
    p
}

/// The real Envoy binary: `$ENVOY_BIN`, else
/// `<workspace>/.venv/lib/python3*/site-packages/envoy/_bin/envoy` (installed by
/// `scripts/envoy.sh`). Panics with a clear message if it is missing.
pub fn envoy_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "ENVOY_BIN={} does not exist: run ./test.sh (it installs Envoy with scripts/envoy.sh)",
            p.display()
        );
        return absolute(&p);
    }
    let lib = workspace_root().join(".venv/lib");
    if let Ok(entries) = std::fs::read_dir(&lib) {
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        if let Some(p) = found.pop() {
            return p;
        }
    }
    panic!(
        "Envoy is not installed (no {}/python3*/site-packages/envoy/_bin/envoy and ENVOY_BIN is \
         unset): run ./test.sh, which installs it with scripts/envoy.sh",
        lib.display()
    );
}

fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .expect("current directory")
            .join(p)
    }
}

// ---------------------------------------------------------------------------------------------
// Time windows
// ---------------------------------------------------------------------------------------------

/// Time since the Unix epoch, from the system clock (the clock Envoy gives the filter).
pub fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("system clock after 1970")
}

/// How far "now" is into the current window, windows being aligned to multiples of `window`
/// since the Unix epoch.
pub fn window_phase(window: Duration) -> Duration {
    let w = window.as_nanos();
    assert!(w > 0, "window must be positive");
    Duration::from_nanos((since_epoch().as_nanos() % w) as u64)
}

/// Blocks until "now" is between `min_phase` and `max_phase` into an epoch-aligned window of
/// length `window` (so a test that starts now stays clear of a window boundary), and returns the
/// phase at that moment. Waits at most one window.
pub fn wait_for_window_phase(window: Duration, min_phase: Duration, max_phase: Duration) -> Duration {
    assert!(
        min_phase < max_phase && max_phase <= window,
        "need min_phase < max_phase <= window"
    );
    let deadline = Instant::now() + window + Duration::from_secs(1);
    let mut announced = false;
    loop {
        let phase = window_phase(window);
        if phase >= min_phase && phase <= max_phase {
            return phase;
        }
        let wait = if phase < min_phase {
            min_phase - phase
        } else {
            window - phase + min_phase
        };
        if !announced && wait > Duration::from_secs(1) {
            eprintln!(
                "waiting {:.1} s to be {:?}..{:?} into a {:?} window",
                wait.as_secs_f64(),
                min_phase,
                max_phase,
                window
            );
            announced = true;
        }
        assert!(
            Instant::now() < deadline,
            "wait_for_window_phase did not converge"
        );
        // Aim a little past the start of the range: sleeping overshoots by scheduling jitter only.
        std::thread::sleep(wait + Duration::from_millis(2));
    }
}

// ---------------------------------------------------------------------------------------------
// Ports
// ---------------------------------------------------------------------------------------------

/// `n` distinct free loopback ports for a configuration to bind. All `n` are held bound at once
/// while they are picked: a port bound and released one at a time can be handed out again by
/// the kernel for the next pick, and two listeners of one Envoy would then collide.
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local address").port())
        .collect()
}

/// `envoy/demo.yaml` (what `./demo.sh` runs) passed through `edit`, then with its fixed ports
/// (admin 9901, front 10000, zones 10001 to 10003) replaced by free ones and its module path made
/// absolute: the text, the admin address and the front listener's address.
pub fn demo_config(edit: impl FnOnce(String) -> String) -> (String, SocketAddr, SocketAddr) {
    let path = workspace_root().join("envoy/demo.yaml");
    let mut text = edit(std::fs::read_to_string(&path).expect("read envoy/demo.yaml"));
    let fixed_ports = [9901u16, 10000, 10001, 10002, 10003];
    let ports = free_ports(fixed_ports.len());
    for (fixed, port) in fixed_ports.into_iter().zip(ports.iter().copied()) {
        let needle = format!("port_value: {fixed}");
        assert!(text.contains(&needle), "demo.yaml no longer uses {needle}");
        text = text.replace(&needle, &format!("port_value: {port}"));
    }
    let module = "target/wasm32-wasip1/release/floodgate.wasm";
    assert!(text.contains(module), "demo.yaml no longer loads {module}");
    text = text.replace(module, &wasm_module().display().to_string());
    let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    (text, at(ports[0]), at(ports[1]))
}

// ---------------------------------------------------------------------------------------------
// Upstream
// ---------------------------------------------------------------------------------------------

/// Options of an [`Upstream`].
#[derive(Clone, Debug, Default)]
pub struct UpstreamOptions {
    /// Also count requests per value of this request header (see [`Upstream::count_for`]).
    pub count_header: Option<String>,
    /// Wait this long before answering each request.
    pub delay: Option<Duration>,
    /// Answer with a body of this many bytes instead of [`UPSTREAM_BODY`] (a big download).
    pub body_bytes: Option<usize>,
    /// `(request header, response header)`: answer with the request header's value in the
    /// response header (an upstream reporting what a request cost, as the test asks).
    pub echo: Option<(String, String)>,
    /// Requests whose header has this value are poison (the bulkhead tests).
    pub poison: Option<Poison>,
}

/// A poison request: one whose `header` has the value `value`.
#[derive(Clone, Debug)]
pub struct Poison {
    /// The request header.
    pub header: String,
    /// Its poisonous value.
    pub value: String,
    /// What a poison request does to the upstream.
    pub effect: PoisonEffect,
    /// Poison requests hanging now and at most, over every upstream sharing it.
    pub gauge: Arc<HangingGauge>,
}

/// Poison requests hanging ([`PoisonEffect::Hang`]), summed over the upstreams that share it.
///
/// Envoy gives up on a hanging request at its route timeout and ends the stream at once (a
/// filter then releases what the request held), while the upstream sees the request's
/// connection close a moment later: for that moment a new request may overlap it here.
/// [`HangingGauge::most_held`] counts only the requests younger than a given age (set it a
/// little under the route timeout), which Envoy certainly still holds.
#[derive(Debug, Default)]
pub struct HangingGauge {
    most: AtomicU64,
    /// Requests counted by `most_held` are younger than this (0: every one).
    held_ms: AtomicU64,
    most_held: AtomicU64,
    /// When each hanging request began, by id.
    started: Mutex<BTreeMap<u64, std::time::Instant>>,
    next_id: AtomicU64,
}

impl HangingGauge {
    /// Hanging now.
    pub fn now(&self) -> u64 {
        u64::try_from(self.started.lock().expect("hanging requests").len()).unwrap_or(u64::MAX)
    }

    /// The most that hung at once.
    pub fn most(&self) -> u64 {
        self.most.load(Ordering::SeqCst)
    }

    /// The most that hung at once among those younger than [`HangingGauge::count_held_for`]'s
    /// age, counted when each began.
    pub fn most_held(&self) -> u64 {
        self.most_held.load(Ordering::SeqCst)
    }

    /// `most_held` counts only the requests younger than `age`.
    pub fn count_held_for(&self, age: Duration) {
        self.held_ms.store(u64::try_from(age.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Starts counting the most afresh.
    pub fn reset_most(&self) {
        let (now, held) = self.counts(&self.started.lock().expect("hanging requests"));
        self.most.store(now, Ordering::SeqCst);
        self.most_held.store(held, Ordering::SeqCst);
    }

    /// Of the requests in `started`: how many hang, and how many of them are younger than the
    /// held age.
    fn counts(&self, started: &BTreeMap<u64, std::time::Instant>) -> (u64, u64) {
        let held_ms = self.held_ms.load(Ordering::SeqCst);
        let young = started.values().filter(|at| held_ms == 0 || at.elapsed() < Duration::from_millis(held_ms)).count();
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        (count(started.len()), count(young))
    }
}

/// What a poison request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoisonEffect {
    /// It crashes the upstream: it and every request for this long after it are answered `500`
    /// (the upstream restarting).
    Crash(Duration),
    /// It hangs: never answered (until the connection goes, at the route timeout).
    Hang,
}

struct UpstreamState {
    total: AtomicU64,
    count_header: Option<HeaderName>,
    by_value: Mutex<HashMap<Vec<u8>, u64>>,
    delay: Option<Duration>,
    /// The body every request is answered with.
    body: Bytes,
    echo: Option<(HeaderName, HeaderName)>,
    /// The status every request is answered with (200 unless changed at run time).
    status: std::sync::atomic::AtomicU16,
    poison: Option<(HeaderName, Vec<u8>, PoisonEffect, Arc<HangingGauge>)>,
    /// A poison request crashed it until then.
    crashed_until: Mutex<Option<std::time::Instant>>,
    /// Poison requests received.
    poisoned: AtomicU64,
}

/// Counts a hanging request while it hangs (its future is dropped when the connection goes).
struct Hanging(Arc<HangingGauge>, u64);

impl Hanging {
    fn new(gauge: Arc<HangingGauge>) -> Hanging {
        let id = gauge.next_id.fetch_add(1, Ordering::SeqCst);
        let mut started = gauge.started.lock().expect("hanging requests");
        started.insert(id, std::time::Instant::now());
        let (now, held) = gauge.counts(&started);
        drop(started);
        gauge.most.fetch_max(now, Ordering::SeqCst);
        gauge.most_held.fetch_max(held, Ordering::SeqCst);
        Hanging(gauge, id)
    }
}

impl Drop for Hanging {
    fn drop(&mut self) {
        self.0.started.lock().expect("hanging requests").remove(&self.1);
    }
}

/// The body every [`Upstream`] answers with.
pub const UPSTREAM_BODY: &str = "upstream ok\n";

/// A hyper HTTP/1.1 server on `127.0.0.1:<ephemeral>` that answers every request `200` with
/// [`UPSTREAM_BODY`] and counts the requests it received. It runs on its own thread and tokio
/// runtime; dropping it stops it.
pub struct Upstream {
    addr: SocketAddr,
    state: Arc<UpstreamState>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Upstream {
    /// Starts an upstream with default options.
    pub fn start() -> Upstream {
        Upstream::with_options(UpstreamOptions::default())
    }

    /// Starts an upstream that also counts requests per value of `header`.
    pub fn counting_header(header: &str) -> Upstream {
        Upstream::with_options(UpstreamOptions {
            count_header: Some(header.to_string()),
            ..UpstreamOptions::default()
        })
    }

    /// Starts an upstream with the given options.
    pub fn with_options(options: UpstreamOptions) -> Upstream {
        let state = Arc::new(UpstreamState {
            total: AtomicU64::new(0),
            count_header: options.count_header.as_deref().map(|h| {
                HeaderName::from_bytes(h.as_bytes()).expect("count_header is a valid header name")
            }),
            by_value: Mutex::new(HashMap::new()),
            delay: options.delay,
            body: options
                .body_bytes
                .map_or_else(|| Bytes::from_static(UPSTREAM_BODY.as_bytes()), |n| Bytes::from(vec![b'x'; n])),
            status: std::sync::atomic::AtomicU16::new(200),
            poison: options.poison.as_ref().map(|p| {
                (HeaderName::from_bytes(p.header.as_bytes()).expect("a header name"), p.value.clone().into_bytes(), p.effect, p.gauge.clone())
            }),
            crashed_until: Mutex::new(None),
            poisoned: AtomicU64::new(0),
            echo: options.echo.as_ref().map(|(from, to)| {
                (
                    HeaderName::from_bytes(from.as_bytes()).expect("a header name"),
                    HeaderName::from_bytes(to.as_bytes()).expect("a header name"),
                )
            }),
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        listener.set_nonblocking(true).expect("nonblocking listener");
        let addr = listener.local_addr().expect("upstream address");
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let thread_state = state.clone();
        let thread = std::thread::Builder::new()
            .name("upstream".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("upstream runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("tokio listener");
                    loop {
                        tokio::select! {
                            _ = &mut rx => break,
                            accepted = listener.accept() => {
                                let Ok((stream, _)) = accepted else { continue };
                                let _ = stream.set_nodelay(true);
                                let state = thread_state.clone();
                                tokio::spawn(async move {
                                    let svc = service_fn(move |req| handle_upstream(state.clone(), req));
                                    let _ = hyper::server::conn::http1::Builder::new()
                                        .keep_alive(true)
                                        .serve_connection(TokioIo::new(stream), svc)
                                        .await;
                                });
                            }
                        }
                    }
                });
                // Dropping the runtime here cancels the connection tasks.
            })
            .expect("spawn upstream thread");
        Upstream {
            addr,
            state,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers every later request with `status` (e.g. 503 to make it fail, 200 to recover).
    pub fn set_status(&self, status: u16) {
        self.state.status.store(status, Ordering::SeqCst);
    }

    /// Requests received so far.
    pub fn total(&self) -> u64 {
        self.state.total.load(Ordering::SeqCst)
    }

    /// Requests received so far whose `count_header` had this value (0 if none).
    pub fn count_for(&self, value: &str) -> u64 {
        self.count_for_bytes(value.as_bytes())
    }

    /// Like [`Upstream::count_for`], for a value given as bytes.
    pub fn count_for_bytes(&self, value: &[u8]) -> u64 {
        assert!(
            self.state.count_header.is_some(),
            "this upstream does not count per header value"
        );
        let map = self.state.by_value.lock().expect("upstream counts");
        map.get(value).copied().unwrap_or(0)
    }

    /// Poison requests received so far.
    pub fn poisoned(&self) -> u64 {
        self.state.poisoned.load(Ordering::SeqCst)
    }

    /// The values of `count_header` seen so far, with their counts.
    pub fn counts(&self) -> HashMap<Vec<u8>, u64> {
        self.state.by_value.lock().expect("upstream counts").clone()
    }

    /// Requests received so far that lacked `count_header`.
    pub fn count_without_header(&self) -> u64 {
        let with: u64 = {
            let map = self.state.by_value.lock().expect("upstream counts");
            map.values().sum()
        };
        self.total() - with
    }
}

async fn handle_upstream(
    state: Arc<UpstreamState>,
    req: Request<Incoming>,
) -> Result<HyperResponse<Full<Bytes>>, hyper::Error> {
    if let Some(name) = &state.count_header {
        if let Some(v) = req.headers().get(name) {
            let mut map = state.by_value.lock().expect("upstream counts");
            *map.entry(v.as_bytes().to_vec()).or_insert(0) += 1;
        }
    }
    state.total.fetch_add(1, Ordering::SeqCst);
    let echoed = state.echo.as_ref().and_then(|(from, to)| Some((to.clone(), req.headers().get(from)?.clone())));
    let poison = state
        .poison
        .as_ref()
        .filter(|(name, value, _, _)| req.headers().get(name).is_some_and(|v| v.as_bytes() == value.as_slice()))
        .map(|(_, _, effect, gauge)| (*effect, gauge.clone()));
    // Drain the request body (this keeps the connection reusable).
    let _ = req.into_body().collect().await;
    let mut status = state.status.load(Ordering::SeqCst);
    match poison {
        Some((PoisonEffect::Crash(down), _)) => {
            state.poisoned.fetch_add(1, Ordering::SeqCst);
            let until = std::time::Instant::now() + down;
            let mut crashed = state.crashed_until.lock().expect("crash time");
            *crashed = Some(crashed.map_or(until, |t| t.max(until)));
        }
        Some((PoisonEffect::Hang, gauge)) => {
            state.poisoned.fetch_add(1, Ordering::SeqCst);
            let _hanging = Hanging::new(gauge);
            std::future::pending::<()>().await;
        }
        None => {}
    }
    if state.crashed_until.lock().expect("crash time").is_some_and(|t| std::time::Instant::now() < t) {
        status = 500;
    }
    if let Some(d) = state.delay {
        tokio::time::sleep(d).await;
    }
    let mut response = HyperResponse::builder()
        .status(status)
        .header("content-type", "text/plain");
    if let Some((name, value)) = echoed {
        response = response.header(name, value);
    }
    Ok(response.body(Full::new(state.body.clone())).expect("upstream response"))
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Envoy
// ---------------------------------------------------------------------------------------------

/// A static cluster with generous circuit breakers (tests measure floodgate, not Envoy's limits).
fn static_cluster(name: &str, endpoints: Vec<Value>) -> Value {
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "circuit_breakers": {"thresholds": [{
            "max_connections": 100000,
            "max_pending_requests": 100000,
            "max_requests": 100000,
            "max_retries": 100000
        }]},
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": endpoints}]
        }
    })
}

/// The routes and extra clusters of a test Envoy, shared by [`EnvoyBuilder`] and
/// [`dynamic::DynamicEnvoyBuilder`].
#[derive(Clone, Debug)]
pub(crate) struct Routing {
    /// Clusters by name, each with its endpoints (besides `upstream` in [`EnvoyBuilder`]).
    pub(crate) clusters: Vec<(String, Vec<SocketAddr>)>,
    /// Route by this request header (`cluster_header`) instead of to the `upstream` cluster.
    pub(crate) route_header: Option<String>,
    /// Without a route header: the cluster every request goes to (default `upstream`).
    pub(crate) route_cluster: Option<String>,
    /// The route's upstream timeout.
    pub(crate) route_timeout: Duration,
    /// Names of the clusters that speak HTTP/2 (cleartext, prior knowledge) to their endpoints.
    pub(crate) http2: Vec<String>,
}

impl Default for Routing {
    fn default() -> Routing {
        Routing {
            clusters: Vec::new(),
            route_header: None,
            route_cluster: None,
            route_timeout: Duration::from_secs(30),
            http2: Vec::new(),
        }
    }
}

impl Routing {
    /// The one route's action: to the cluster the route header names, or to one cluster
    /// (`upstream` unless [`EnvoyBuilder::route_to`] says another).
    pub(crate) fn route(&self) -> Value {
        let timeout = format!("{}s", self.route_timeout.as_secs_f64());
        match &self.route_header {
            Some(header) => json!({"cluster_header": header, "timeout": timeout}),
            None => json!({"cluster": self.route_cluster.as_deref().unwrap_or("upstream"), "timeout": timeout}),
        }
    }

    /// The clusters added by name.
    pub(crate) fn clusters(&self) -> impl Iterator<Item = Value> + '_ {
        self.clusters.iter().map(|(name, addrs)| {
            let mut cluster = static_cluster(name, addrs.iter().map(|a| endpoint(*a)).collect());
            if self.http2.contains(name) {
                cluster["typed_extension_protocol_options"] = json!({
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}
                    }
                });
            }
            cluster
        })
    }
}

/// Builds and starts an [`Envoy`]: the floodgate filter (with the given JSON configuration) in
/// front of the router, routing every request to a cluster of the given upstreams.
pub struct EnvoyBuilder {
    filter_config: String,
    upstreams: Vec<SocketAddr>,
    concurrency: usize,
    routing: Routing,
    /// Extra environment of the Envoy process.
    env: Vec<(String, String)>,
    /// HTTP filters between floodgate and the router.
    filters_after: Vec<Value>,
}

impl EnvoyBuilder {
    /// A builder with the filter configuration `filter_config` (a `serde_json::Value` or a JSON
    /// string; it is passed verbatim as the plugin's `StringValue` configuration).
    pub fn new(filter_config: impl Display) -> EnvoyBuilder {
        EnvoyBuilder {
            filter_config: filter_config.to_string(),
            upstreams: Vec::new(),
            concurrency: 2,
            routing: Routing::default(),
            env: Vec::new(),
            filters_after: Vec::new(),
        }
    }

    /// Adds an Envoy Lua filter with `code` after floodgate (before the router): e.g. one that
    /// burns CPU on the worker to make its event loop lag.
    pub fn lua_after(mut self, code: &str) -> EnvoyBuilder {
        self.filters_after.push(json!({
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": code}
            }
        }));
        self
    }

    /// Adds `vars` to the Envoy process's environment (e.g. [`wallclock::SteppedWallClock::env`]).
    pub fn env(mut self, vars: Vec<(String, String)>) -> EnvoyBuilder {
        self.env.extend(vars);
        self
    }

    /// Adds a cluster `name` whose endpoints are `addrs` (an address nothing listens on makes a
    /// cluster that is down: Envoy answers 503 with flag UF).
    pub fn cluster(mut self, name: &str, addrs: &[SocketAddr]) -> EnvoyBuilder {
        self.routing.clusters.push((name.to_string(), addrs.to_vec()));
        self
    }

    /// Adds a cluster `name` whose endpoints speak HTTP/2 without TLS (prior knowledge), as
    /// `floodgate-sync` and gRPC servers do.
    pub fn http2_cluster(mut self, name: &str, addrs: &[SocketAddr]) -> EnvoyBuilder {
        self.routing.clusters.push((name.to_string(), addrs.to_vec()));
        self.routing.http2.push(name.to_string());
        self
    }

    /// Routes every request to the cluster named by request header `header` (the route's
    /// `cluster_header`), as cluster selection needs.
    pub fn route_by_header(mut self, header: &str) -> EnvoyBuilder {
        self.routing.route_header = Some(header.to_string());
        self
    }

    /// Routes every request to cluster `name` (added with [`EnvoyBuilder::cluster`] or
    /// [`EnvoyBuilder::http2_cluster`]) instead of `upstream`.
    pub fn route_to(mut self, name: &str) -> EnvoyBuilder {
        self.routing.route_cluster = Some(name.to_string());
        self
    }

    /// The route's upstream timeout (default 30 s); past it Envoy answers `504` itself.
    pub fn route_timeout(mut self, timeout: Duration) -> EnvoyBuilder {
        self.routing.route_timeout = timeout;
        self
    }

    /// Adds an upstream to the `upstream` cluster.
    pub fn upstream(mut self, upstream: &Upstream) -> EnvoyBuilder {
        self.upstreams.push(upstream.addr());
        self
    }

    /// Adds an endpoint to the `upstream` cluster by address (an upstream in another process).
    pub fn upstream_at(mut self, addr: SocketAddr) -> EnvoyBuilder {
        self.upstreams.push(addr);
        self
    }

    /// Number of Envoy worker threads (`--concurrency`, default 2).
    pub fn concurrency(mut self, n: usize) -> EnvoyBuilder {
        self.concurrency = n;
        self
    }

    /// The bootstrap configuration (JSON, which Envoy reads as YAML too).
    pub fn bootstrap(&self) -> Value {
        let endpoints: Vec<Value> = if self.upstreams.is_empty() {
            // Nothing listens there: requests that reach the router get 503 (no test relies on it).
            vec![endpoint("127.0.0.1:9".parse().expect("addr"))]
        } else {
            self.upstreams.iter().map(|a| endpoint(*a)).collect()
        };
        let route = self.routing.route();
        let mut clusters = vec![static_cluster("upstream", endpoints)];
        clusters.extend(self.routing.clusters());
        let mut http_filters = vec![json!({
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": "floodgate",
                    "root_id": "floodgate",
                    "failure_policy": "FAIL_CLOSED",
                    "configuration": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": self.filter_config
                    },
                    "vm_config": {
                        "vm_id": "floodgate",
                        "runtime": "envoy.wasm.runtime.v8",
                        "code": {"local": {"filename": wasm_module().display().to_string()}}
                    }
                }
            }
        })];
        http_filters.extend(self.filters_after.iter().cloned());
        http_filters.push(json!({
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
        }));
        json!({
            "admin": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}
            },
            "static_resources": {
                "listeners": [{
                    "name": "front",
                    "stat_prefix": "front",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [{
                        "filters": [{
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                                "stat_prefix": "front",
                                "max_request_headers_kb": 96,
                                "route_config": {
                                    "name": "front",
                                    "virtual_hosts": [{
                                        "name": "all",
                                        "domains": ["*"],
                                        "routes": [{
                                            "match": {"prefix": "/"},
                                            "route": route
                                        }]
                                    }]
                                },
                                "http_filters": http_filters
                            }
                        }]
                    }]
                }],
                "clusters": clusters
            }
        })
    }

    fn spawn(&self) -> (Child, tempfile::TempDir) {
        let dir = tempfile::Builder::new()
            .prefix("floodgate-envoy-")
            .tempdir()
            .expect("tempdir");
        let child = spawn_envoy(dir.path(), &self.bootstrap(), self.concurrency, &self.env);
        (child, dir)
    }

    /// Starts Envoy and waits (bounded) until it is ready and its listener's port is known.
    /// Panics, showing the end of Envoy's log, if it exits or does not become ready.
    pub fn start(self) -> Envoy {
        let (child, dir) = self.spawn();
        let mut envoy = Envoy {
            child,
            dir,
            admin: None,
            listener: None,
        };
        let (admin, listener) = wait_for_envoy(&mut envoy.child, envoy.dir.path());
        envoy.admin = Some(admin);
        envoy.listener = Some(listener);
        envoy
    }

    /// Starts Envoy expecting it to refuse the configuration: waits (bounded) for it to exit with
    /// a non-zero status and returns its log. Panics if it becomes ready or keeps running.
    pub fn start_expecting_failure(self) -> String {
        let (mut child, dir) = self.spawn();
        let deadline = Instant::now() + ENVOY_FAILURE_TIMEOUT;
        let read_log = |dir: &Path| read_logs(dir);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                let log = read_log(dir.path());
                assert!(
                    !status.success(),
                    "Envoy exited successfully; expected a configuration error. Log:\n{}",
                    tail(&log, 40)
                );
                return log;
            }
            let ready = read_admin_address(dir.path())
                .and_then(|a| http_get_blocking(a, "/ready").ok())
                .is_some_and(|(s, b)| s == 200 && b.trim() == "LIVE");
            if ready || Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                let log = read_log(dir.path());
                panic!(
                    "Envoy {} with a configuration that should be refused; end of its log:\n{}",
                    if ready { "became ready" } else { "kept running" },
                    tail(&log, 40)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn endpoint(addr: SocketAddr) -> Value {
    json!({"endpoint": {"address": {"socket_address": {
        "address": addr.ip().to_string(), "port_value": addr.port()
    }}}})
}

/// Starts Envoy with `bootstrap`, written into `dir`, which also receives its log (`envoy.log`,
/// line by line: `--log-path` would buffer for up to 10 s) and its admin address.
pub(crate) fn spawn_envoy(dir: &Path, bootstrap: &Value, concurrency: usize, env: &[(String, String)]) -> Child {
    let path = dir.join("bootstrap.json");
    std::fs::write(&path, serde_json::to_string_pretty(bootstrap).expect("bootstrap json")).expect("write bootstrap");
    let log = std::fs::File::create(dir.join("envoy.log")).expect("log file");
    Command::new(envoy_binary())
        .arg("-c")
        .arg(&path)
        .arg("--concurrency")
        .arg(concurrency.to_string())
        .arg("--disable-hot-restart")
        .arg("-l")
        .arg("info")
        .arg("--admin-address-path")
        .arg(dir.join("admin-address"))
        .current_dir(dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", envoy_binary().display()))
}

/// Waits (bounded) until the Envoy started by [`spawn_envoy`] in `dir` is ready; returns its
/// admin address and the address of its listener `front`. Panics, showing the end of its log, if
/// it exits or does not become ready.
pub(crate) fn wait_for_envoy(child: &mut Child, dir: &Path) -> (SocketAddr, SocketAddr) {
    let deadline = Instant::now() + ENVOY_START_TIMEOUT;
    let admin = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("Envoy exited ({status}) instead of starting; end of its log:\n{}", tail(&read_logs(dir), 60));
        }
        assert!(
            Instant::now() < deadline,
            "Envoy not ready after {ENVOY_START_TIMEOUT:?}; end of its log:\n{}",
            tail(&read_logs(dir), 60)
        );
        if let Some(admin) = read_admin_address(dir) {
            if let Ok((200, body)) = http_get_blocking(admin, "/ready") {
                if body.trim() == "LIVE" {
                    break admin;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (status, body) = http_get_blocking(admin, "/listeners?format=json").expect("GET /listeners");
    assert_eq!(status, 200, "GET /listeners: {body}");
    let v: Value = serde_json::from_str(&body).expect("listeners json");
    let port = v["listener_statuses"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["name"] == "front"))
        .and_then(|l| l["local_address"]["socket_address"]["port_value"].as_u64())
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or_else(|| panic!("no port for listener `front` in {body}"));
    (admin, SocketAddr::from(([127, 0, 0, 1], port)))
}

fn read_admin_address(dir: &Path) -> Option<SocketAddr> {
    std::fs::read_to_string(dir.join("admin-address"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

fn read_logs(dir: &Path) -> String {
    let bytes = std::fs::read(dir.join("envoy.log")).unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A running Envoy (see [`EnvoyBuilder`]); killed when dropped. If the test is panicking, the end
/// of Envoy's log is printed first.
pub struct Envoy {
    child: Child,
    dir: tempfile::TempDir,
    admin: Option<SocketAddr>,
    listener: Option<SocketAddr>,
}

impl Envoy {
    /// Starts Envoy (2 workers) with the filter configuration `filter_config` in front of
    /// `upstream`. See [`EnvoyBuilder`] for more options.
    pub fn start(filter_config: impl Display, upstream: &Upstream) -> Envoy {
        EnvoyBuilder::new(filter_config).upstream(upstream).start()
    }

    /// A builder, for more options.
    pub fn builder(filter_config: impl Display) -> EnvoyBuilder {
        EnvoyBuilder::new(filter_config)
    }

    /// Starts Envoy with `filter_config` expecting it to refuse it; returns Envoy's log.
    pub fn start_expecting_failure(filter_config: impl Display) -> String {
        EnvoyBuilder::new(filter_config).start_expecting_failure()
    }

    /// The address of the listener with the floodgate filter.
    pub fn addr(&self) -> SocketAddr {
        self.listener.expect("listener address")
    }

    /// `http://127.0.0.1:<port><path>` on the floodgate listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr(), path)
    }

    /// The admin API's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.expect("admin address")
    }

    /// `http://127.0.0.1:<admin port><path>`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin_addr(), path)
    }

    /// GET on the admin API (blocking); returns status and body.
    pub fn admin_get(&self, path: &str) -> (u16, String) {
        http_get_blocking(self.admin_addr(), path)
            .unwrap_or_else(|e| panic!("admin GET {path}: {e}"))
    }

    /// Envoy's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Envoy's resident set size (`VmRSS` of `/proc/<pid>/status`), in bytes.
    pub fn rss_bytes(&self) -> u64 {
        rss_bytes_of(self.pid())
    }

    /// All counters and gauges of the admin `/stats` page, by name (histograms are left out).
    ///
    /// Envoy 1.40's `/stats` shows the module's metrics in their namespace, as
    /// `wasmcustom.<name>` (only `/stats/prometheus` drops it); each such stat is also listed
    /// under `<name>`, the name the module defined, which is what the tests use.
    pub fn stats(&self) -> BTreeMap<String, u64> {
        stats_of(self.admin_addr())
    }

    /// One stat by its full name, if Envoy has it.
    pub fn stat(&self, name: &str) -> Option<u64> {
        self.stats().get(name).copied()
    }

    /// Polls (at most `timeout`) until stat `name` equals `expected`; returns its last value.
    /// Stats may lag the responses by a moment.
    pub fn wait_for_stat(&self, name: &str, expected: u64, timeout: Duration) -> Option<u64> {
        wait_for_stat_of(self.admin_addr(), name, expected, timeout)
    }

    /// All stats whose name starts with `prefix`, as `name: value` lines (for printing).
    pub fn stats_matching(&self, prefix: &str) -> String {
        self.stats()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Downstream connections accepted by each worker on the floodgate listener
    /// (`listener.front.worker_<n>.downstream_cx_total`), in worker order.
    pub fn connections_per_worker(&self) -> Vec<u64> {
        let stats = self.stats();
        let prefix = "listener.front.worker_";
        let mut v: Vec<(u64, u64)> = stats
            .iter()
            .filter_map(|(k, val)| {
                let rest = k.strip_prefix(prefix)?;
                let (n, stat) = rest.split_once('.')?;
                (stat == "downstream_cx_total").then(|| Some((n.parse().ok()?, *val)))?
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, c)| c).collect()
    }

    /// Envoy's log so far (its stderr, at level info, kept in a file of the temporary directory).
    pub fn log(&self) -> String {
        read_logs(self.dir.path())
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- end of Envoy's log (pid {}) ----\n{}\n----",
                self.child.id(),
                tail(&self.log(), 60)
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Counters and gauges of an Envoy's `/stats` (admin API at `admin`) by name; the module's own
/// are listed both under `wasmcustom.<name>` and under `<name>`.
pub fn stats_of(admin: SocketAddr) -> BTreeMap<String, u64> {
    let (status, body) = http_get_blocking(admin, "/stats").unwrap_or_else(|e| panic!("admin GET /stats: {e}"));
    assert_eq!(status, 200, "GET /stats");
    let mut stats = BTreeMap::new();
    for l in body.lines() {
        let Some((name, value)) = l.rsplit_once(": ") else { continue };
        let Ok(value) = value.trim().parse::<u64>() else { continue };
        if let Some(custom) = name.strip_prefix(WASM_CUSTOM_NAMESPACE) {
            stats.insert(custom.to_string(), value);
        }
        stats.insert(name.to_string(), value);
    }
    stats
}

/// Polls (at most `timeout`) until stat `name` of the Envoy at `admin` equals `expected`;
/// returns its last value. Stats may lag the responses by a moment.
pub fn wait_for_stat_of(admin: SocketAddr, name: &str, expected: u64, timeout: Duration) -> Option<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let v = stats_of(admin).get(name).copied();
        if v == Some(expected) || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The resident set size of process `pid` (`VmRSS` of `/proc/<pid>/status`), in bytes.
pub fn rss_bytes_of(pid: u32) -> u64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/<pid>/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS line");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmRSS value");
    kb * 1024
}

/// Log lines that show a Wasm VM failure or a panic in the module: a Rust panic message, a V8
/// trap (`Uncaught RuntimeError`), a stream failed by a broken VM (`wasm_fail_stream`), or any
/// line at level error/critical from the `wasm` logger.
pub fn wasm_failures(log: &str) -> Vec<String> {
    const MARKERS: [&str; 5] = [
        "panicked",
        "Uncaught",
        "RuntimeError",
        "wasm_fail_stream",
        "Plugin configured to fail closed",
    ];
    log.lines()
        .filter(|l| {
            MARKERS.iter().any(|m| l.contains(m))
                || ((l.contains("][error][") || l.contains("][critical]["))
                    && (l.contains("[wasm]") || l.contains("wasm log")))
        })
        .map(str::to_string)
        .collect()
}

/// Name of a floodgate rate-limit counter with the default stat prefix:
/// `floodgate.rate_limit.<rule>.<counter>` (`allowed`, `rejected`, `skipped`, `contention`,
/// `evictions`), as [`Envoy::stats`] lists it (Envoy's `/stats` page shows it as
/// `wasmcustom.floodgate.rate_limit...`; `/stats/prometheus` as `floodgate_rate_limit_...`).
pub fn rule_stat(rule: &str, counter: &str) -> String {
    format!("{STAT_PREFIX}.rate_limit.{rule}.{counter}")
}

/// The first log line that reports a refused filter configuration (`invalid configuration: ...`),
/// from `invalid configuration` on.
pub fn config_error_line(log: &str) -> Option<String> {
    log.lines().find_map(|l| {
        l.find("invalid configuration")
            .map(|i| l[i..].to_string())
    })
}

// ---------------------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------------------

/// A response read by [`Client`].
#[derive(Debug)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Response headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Response {
    /// A header's value as text (`None` if absent or not visible ASCII).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON; panics with the body if it is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }
}

/// A closed-loop load as fast as Envoy answers: `total` requests over `connections`
/// keep-alive connections to `addr`, request `n` (each number sent once) carrying the headers
/// `headers(n)`. Returns how many were answered with each status.
pub async fn send_numbered(
    addr: SocketAddr,
    connections: usize,
    total: u64,
    headers: impl Fn(u64) -> Vec<(&'static str, String)> + Send + Sync + 'static,
) -> BTreeMap<u16, u64> {
    let next = Arc::new(AtomicU64::new(0));
    let headers = Arc::new(headers);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let (next, headers) = (Arc::clone(&next), Arc::clone(&headers));
        tasks.spawn(async move {
            let mut statuses = BTreeMap::new();
            let mut client = Client::connect(addr).await.expect("connect");
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    return statuses;
                }
                let owned = headers(n);
                let pairs: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let status = client.get("/", &pairs).await.map_or(0, |r| r.status);
                *statuses.entry(status).or_insert(0) += 1;
            }
        });
    }
    let mut statuses = BTreeMap::new();
    while let Some(done) = tasks.join_next().await {
        for (status, n) in done.expect("load task") {
            *statuses.entry(status).or_insert(0) += n;
        }
    }
    statuses
}

/// A paced load: `rate` requests a second in all for `duration`, request `n` sent when it is
/// due to proxy `n % proxies.len()` (round-robin) over `per_proxy` keep-alive connections to
/// each (another is opened when all are busy). `request(n)` gives what makes request `n` on a
/// client, which hands the client back with its result; the results come in the order the
/// requests ended. `during(elapsed)` runs about every 100 ms (to break things on cue).
pub async fn paced_round_robin<T, MakeRequest, Fut>(
    proxies: &[SocketAddr],
    per_proxy: usize,
    rate: u64,
    duration: Duration,
    mut during: impl FnMut(Duration),
    request: impl Fn(u64) -> MakeRequest,
) -> Vec<T>
where
    T: Send + 'static,
    MakeRequest: FnOnce(Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = (Client, T)> + Send + 'static,
{
    let mut pools = Vec::new();
    for addr in proxies {
        let mut pool = Vec::new();
        for _ in 0..per_proxy {
            pool.push(Client::connect(*addr).await.expect("connect"));
        }
        pools.push(Arc::new(tokio::sync::Mutex::new(pool)));
    }
    let mut results = Vec::new();
    let mut pending = tokio::task::JoinSet::new();
    let started = Instant::now();
    let gap = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let mut next_call = Duration::ZERO;
    let mut sent = 0u64;
    while started.elapsed() < duration {
        let due = gap * u32::try_from(sent).expect("requests");
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        if started.elapsed() >= next_call {
            during(started.elapsed());
            next_call += Duration::from_millis(100);
        }
        let at = usize::try_from(sent % proxies.len() as u64).expect("a proxy");
        let (pool, addr, request) = (Arc::clone(&pools[at]), proxies[at], request(sent));
        pending.spawn(async move {
            let client = pool.lock().await.pop();
            let client = match client {
                Some(c) => c,
                None => Client::connect(addr).await.expect("connect"),
            };
            let (client, result) = request(client).await;
            pool.lock().await.push(client);
            result
        });
        sent += 1;
        while let Some(done) = pending.try_join_next() {
            results.push(done.expect("request task"));
        }
    }
    while let Some(done) = pending.join_next().await {
        results.push(done.expect("request task"));
    }
    results
}

/// An HTTP/1.1 client on one keep-alive connection (hyper). Requests on one `Client` are sent one
/// after another; open several clients for concurrency.
pub struct Client {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl Client {
    /// Opens a connection to `addr`.
    pub async fn connect(addr: SocketAddr) -> Result<Client, Error> {
        let stream = tokio::time::timeout(REQUEST_TIMEOUT, TcpStream::connect(addr)).await??;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Client { sender })
    }

    /// Sends `GET path` with the given headers (plus `host: floodgate.test`) and reads the whole
    /// response.
    pub async fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> Result<Response, Error> {
        self.send("GET", path, headers, Bytes::new()).await
    }

    /// Sends `method path` with `headers` and `body` (with its `content-length`; none for an
    /// empty `GET`) and reads the whole response.
    pub async fn send(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: Bytes) -> Result<Response, Error> {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "floodgate.test");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body))?;
        let fut = async {
            self.sender.ready().await?;
            let resp = self.sender.send_request(req).await?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, Error>(Response {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(REQUEST_TIMEOUT, fut).await?
    }
}

/// One request on a new connection: `GET path` with `headers`. Panics on a transport error.
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    let mut c = Client::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    c.get(path, headers)
        .await
        .unwrap_or_else(|e| panic!("GET {path} {headers:?}: {e}"))
}

/// A response read by [`raw_request`].
#[derive(Debug)]
pub struct RawResponse {
    /// Status code.
    pub status: u16,
    /// Status line and headers, as received (lossy UTF-8).
    pub head: String,
    /// The body (as much as was sent before the connection closed, or `content-length` bytes).
    pub body: Vec<u8>,
}

/// Sends `request` verbatim (it should ask for `connection: close`) on a new connection to `addr`
/// and reads one response. Use it for requests hyper would refuse to build, such as header values
/// that are not UTF-8.
pub async fn raw_request(addr: SocketAddr, request: &[u8]) -> Result<RawResponse, Error> {
    let fut = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(request).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let head_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(format!(
                    "connection closed before a full response head; got {:?}",
                    String::from_utf8_lossy(&buf)
                )
                .into());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line in {head:?}"))?;
        let content_length: Option<usize> = head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        });
        let mut body = buf[head_end..].to_vec();
        match content_length {
            Some(len) => {
                while body.len() < len {
                    let n = stream.read(&mut chunk).await?;
                    if n == 0 {
                        break;
                    }
                    body.extend_from_slice(&chunk[..n]);
                }
                body.truncate(len);
            }
            None => {
                stream.read_to_end(&mut body).await?;
            }
        }
        Ok::<_, Error>(RawResponse { status, head, body })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut).await?
}

/// Builds a `GET` request with a raw request target and raw header bytes, ending with
/// `host: floodgate.test` and `connection: close`.
pub fn raw_get_request(target: &[u8], headers: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend_from_slice(b"GET ");
    r.extend_from_slice(target);
    r.extend_from_slice(b" HTTP/1.1\r\nhost: floodgate.test\r\n");
    for (k, v) in headers {
        r.extend_from_slice(k);
        r.extend_from_slice(b": ");
        r.extend_from_slice(v);
        r.extend_from_slice(b"\r\n");
    }
    r.extend_from_slice(b"connection: close\r\n\r\n");
    r
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A blocking `GET` (HTTP/1.1, `connection: close`) used for Envoy's admin API; returns status and
/// body (de-chunked).
pub fn http_get_blocking(addr: SocketAddr, path: &str) -> Result<(u16, String), Error> {
    let mut s = StdTcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    s.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let head_end = find(&buf, b"\r\n\r\n").ok_or("no response head")? + 4;
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("bad status line")?;
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding")
                && v.to_ascii_lowercase().contains("chunked")
        })
    });
    let raw = &buf[head_end..];
    let body = if chunked { dechunk(raw)? } else { raw.to_vec() };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut raw: &[u8]) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    loop {
        let line_end = find(raw, b"\r\n").ok_or("bad chunk")?;
        let size_str = std::str::from_utf8(&raw[..line_end])?;
        let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16)?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if raw.len() < size + 2 {
            return Err("truncated chunk".into());
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing helpers for the rate-limit response headers
// ---------------------------------------------------------------------------------------------

/// Parses a structured `ratelimit` / `ratelimit-policy` item such as `"per-key";r=0;t=7` into the
/// policy name and its parameters.
pub fn parse_ratelimit_item(value: &str) -> (String, BTreeMap<String, String>) {
    let mut parts = value.trim().split(';');
    let name = parts.next().unwrap_or("").trim();
    assert!(
        name.len() >= 2 && name.starts_with('"') && name.ends_with('"'),
        "policy name is not a quoted string in {value:?}"
    );
    let params = parts
        .map(|p| {
            let (k, v) = p
                .split_once('=')
                .unwrap_or_else(|| panic!("parameter without '=' in {value:?}"));
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect();
    (name[1..name.len() - 1].to_string(), params)
}

/// An integer parameter of a parsed `ratelimit` item; panics if missing or not an integer.
pub fn int_param(params: &BTreeMap<String, String>, key: &str) -> i64 {
    params
        .get(key)
        .unwrap_or_else(|| panic!("missing parameter {key} in {params:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("parameter {key} is not an integer in {params:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ratelimit_items() {
        let (n, p) = parse_ratelimit_item("\"per-key\";r=0;t=7");
        assert_eq!(n, "per-key");
        assert_eq!(int_param(&p, "r"), 0);
        assert_eq!(int_param(&p, "t"), 7);
    }

    #[test]
    fn dechunks() {
        let body = dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap();
        assert_eq!(body, b"abcde");
    }

    #[test]
    fn window_phase_is_below_window() {
        let w = Duration::from_secs(4);
        assert!(window_phase(w) < w);
        let p = wait_for_window_phase(w, Duration::from_millis(0), Duration::from_secs(4));
        assert!(p <= w);
    }
}
