//! [`Upstream`]: a hyper HTTP/1.1 server on an ephemeral loopback port that counts what it
//! receives; it can also answer slowly, with a big body or with a request header echoed, and
//! crash or hang on a poison request.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::HeaderName;
use hyper::service::service_fn;
use hyper::{Request, Response as HyperResponse};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

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
    /// When each request arrived, in arrival order.
    arrivals: Mutex<Vec<std::time::Instant>>,
    /// Requests being handled now, and the most at once.
    active: AtomicU64,
    most_active: AtomicU64,
}

/// Counts a request while the upstream handles it (until answered, or its connection goes).
struct Active(Arc<UpstreamState>);

impl Active {
    fn new(state: Arc<UpstreamState>) -> Active {
        let now = state.active.fetch_add(1, Ordering::SeqCst) + 1;
        state.most_active.fetch_max(now, Ordering::SeqCst);
        Active(state)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
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
    state: Arc<UpstreamState>,
    server: Server,
}

/// An HTTP/1.1 server (keep-alive) on `127.0.0.1:<ephemeral>` answering with `handle`, on its
/// own thread and tokio runtime; dropping it stops it.
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Starts it on a thread named `name`.
    pub fn start<F, Fut, B, E>(name: &str, handle: F) -> Server
    where
        F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = Result<HyperResponse<B>, E>> + Send + 'static,
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        listener.set_nonblocking(true).expect("nonblocking listener");
        let addr = listener.local_addr().expect("upstream address");
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.into())
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
                                let handle = handle.clone();
                                tokio::spawn(async move {
                                    let _ = hyper::server::conn::http1::Builder::new()
                                        .keep_alive(true)
                                        .serve_connection(TokioIo::new(stream), service_fn(handle))
                                        .await;
                                });
                            }
                        }
                    }
                });
                // Dropping the runtime here cancels the connection tasks.
            })
            .expect("spawn upstream thread");
        Server { addr, shutdown: Some(tx), thread: Some(thread) }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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
            arrivals: Mutex::new(Vec::new()),
            active: AtomicU64::new(0),
            most_active: AtomicU64::new(0),
            echo: options.echo.as_ref().map(|(from, to)| {
                (
                    HeaderName::from_bytes(from.as_bytes()).expect("a header name"),
                    HeaderName::from_bytes(to.as_bytes()).expect("a header name"),
                )
            }),
        });
        let state_for_server = state.clone();
        let server = Server::start("upstream", move |req| handle_upstream(state_for_server.clone(), req));
        Upstream { state, server }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
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

    /// When each request received so far arrived, in arrival order.
    pub fn arrivals(&self) -> Vec<std::time::Instant> {
        self.state.arrivals.lock().expect("upstream arrivals").clone()
    }

    /// The most requests it handled at once (from their headers to their answer), so far.
    pub fn most_concurrent(&self) -> u64 {
        self.state.most_active.load(Ordering::SeqCst)
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
    state.arrivals.lock().expect("upstream arrivals").push(std::time::Instant::now());
    state.total.fetch_add(1, Ordering::SeqCst);
    let _active = Active::new(state.clone());
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

