//! The upstreams and the load generator: minimal HTTP/1.1 over tokio, and gRPC over HTTP/2 (the
//! `h2` crate), so that what they cost stays small next to Envoy's share (they run on the other
//! core). Loopback only.
//!
//! The load generator is closed-loop: a fixed number of keep-alive connections, each sending
//! its next request as soon as the previous response is complete (for gRPC: one unary call at a
//! time per HTTP/2 connection, as in the HTTP/1.1 runs). [`run_paced`] runs the same
//! connections at a fixed rate instead: request number `i` (over all connections) is not sent
//! before `i / rate` seconds into the run, so a connection waits for its request's turn, and one
//! behind its turn sends at once (a run the target cannot keep up with ends as a closed-loop one).
//! [`Conn`] is one HTTP/1.1 connection, for generators that pace their requests with their own
//! schedule (`fleet_harness.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What every upstream answers.
const UPSTREAM_RESPONSE: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 12\r\n\r\nupstream ok\n";

/// The path of the benchmark's unary gRPC calls.
pub const GRPC_PATH: &str = "/floodgate.bench.Echo/Unary";
/// A gRPC message frame: not compressed, 2 bytes (`"ok"`). Requests and answers carry it.
const GRPC_FRAME: &[u8] = b"\0\0\0\0\x02ok";

/// Per-upstream count of requests answered.
#[derive(Default)]
pub struct UpstreamCount(pub AtomicU64);

/// Starts an upstream on `127.0.0.1:<ephemeral>` in the current runtime; it runs until the
/// runtime stops.
pub async fn start_upstream() -> (SocketAddr, Arc<UpstreamCount>) {
    serve_on_loopback(serve_upstream).await
}

/// Listens on `127.0.0.1:<ephemeral>` and hands each connection to `serve` with the count of
/// requests answered, until the runtime stops.
pub(crate) async fn serve_on_loopback<F, Fut>(serve: F) -> (SocketAddr, Arc<UpstreamCount>)
where
    F: Fn(TcpStream, Arc<UpstreamCount>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind an upstream on 127.0.0.1");
    let addr = listener.local_addr().expect("upstream address");
    let count = Arc::new(UpstreamCount::default());
    let served = Arc::clone(&count);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let _ = stream.set_nodelay(true);
            tokio::spawn(serve(stream, Arc::clone(&served)));
        }
    });
    (addr, count)
}

async fn serve_upstream(mut stream: TcpStream, served: Arc<UpstreamCount>) {
    let mut buf = Vec::with_capacity(8192);
    let mut chunk = [0u8; 8192];
    loop {
        // Answer every complete request in the buffer (requests carry no body).
        let mut answered = 0;
        while let Some(end) = find(&buf, b"\r\n\r\n") {
            let body = content_length(&buf[..end]).unwrap_or(0);
            if buf.len() < end + 4 + body {
                break;
            }
            buf.drain(..end + 4 + body);
            answered += 1;
        }
        if answered > 0 {
            served.0.fetch_add(answered as u64, Ordering::Relaxed);
            let mut out = Vec::with_capacity(UPSTREAM_RESPONSE.len() * answered);
            for _ in 0..answered {
                out.extend_from_slice(UPSTREAM_RESPONSE);
            }
            if stream.write_all(&out).await.is_err() {
                return;
            }
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Starts a gRPC upstream (HTTP/2 without TLS) on `127.0.0.1:<ephemeral>`: every call is
/// answered `200`, `content-type: application/grpc`, one message frame, then the trailers with
/// `grpc-status: 0`. It runs until the runtime stops.
pub async fn start_grpc_upstream() -> (SocketAddr, Arc<UpstreamCount>) {
    serve_on_loopback(serve_grpc).await
}

async fn serve_grpc(stream: TcpStream, served: Arc<UpstreamCount>) {
    let Ok(mut conn) = h2::server::handshake(stream).await else { return };
    while let Some(Ok((request, respond))) = conn.accept().await {
        tokio::spawn(answer_grpc(request, respond, Arc::clone(&served)));
    }
}

async fn answer_grpc(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    served: Arc<UpstreamCount>,
) -> Result<(), h2::Error> {
    let mut body = request.into_body();
    while let Some(chunk) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk?.len());
    }
    let response = http::Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(())
        .expect("a response head");
    let mut send = respond.send_response(response, false)?;
    send.send_data(bytes::Bytes::from_static(GRPC_FRAME), false)?;
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    send.send_trailers(trailers)?;
    served.0.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The `content-length` of a message head (without the final blank line).
fn content_length(head: &[u8]) -> Option<usize> {
    head.split(|b| *b == b'\n').find_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|b| *b == b':')?;
        if !line[..colon].eq_ignore_ascii_case(b"content-length") {
            return None;
        }
        std::str::from_utf8(&line[colon + 1..]).ok()?.trim().parse().ok()
    })
}

/// Builds `GET <path>` with `headers`, for the load generator.
pub fn request(path: &str, headers: &[(&str, String)]) -> Vec<u8> {
    let mut r = format!("GET {path} HTTP/1.1\r\nhost: bench.floodgate\r\n");
    for (name, value) in headers {
        r.push_str(name);
        r.push_str(": ");
        r.push_str(value);
        r.push_str("\r\n");
    }
    r.push_str("\r\n");
    r.into_bytes()
}

/// Where the requests come from: a fixed list cycled through, or one made per request number.
#[derive(Clone)]
pub enum Requests {
    /// Connection `c` sends `list[(c * 7919 + n) % len]` as its `n`-th request.
    Cycle(Arc<Vec<Vec<u8>>>),
    /// Request number `i` (over all connections, each number used once) is `make(i)`.
    Numbered(Arc<dyn Fn(u64) -> Vec<u8> + Send + Sync>),
    /// Unary gRPC calls over HTTP/2 to [`GRPC_PATH`]; connection `c`'s `n`-th call carries
    /// `x-api-key: keys[(c * 7919 + n) % len]`. A call counts as status 200 when it ends with
    /// `grpc-status: 0`, as 0 otherwise.
    Grpc(Arc<Vec<String>>),
}

/// One run of the load generator.
#[derive(Clone)]
pub struct Load {
    /// Envoy listeners: connection `c` goes to `targets[c % len]` (one Envoy, or a fleet).
    pub targets: Vec<SocketAddr>,
    /// Concurrent keep-alive connections.
    pub connections: usize,
    /// What to send.
    pub requests: Requests,
    /// Stop after this many requests in all, if set.
    pub max_requests: Option<u64>,
}

/// What a run produced within its measurement interval.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Responses completed in the interval.
    pub completed: u64,
    /// Responses by status, over the interval.
    pub statuses: BTreeMap<u16, u64>,
    /// Connection or parse errors, over the whole run.
    pub errors: u64,
    /// Latency of each response of the interval, in microseconds.
    pub latencies_us: Vec<u32>,
    /// Length of the interval.
    pub elapsed: Duration,
}

impl Outcome {
    /// Responses per second over the interval.
    pub fn throughput(&self) -> f64 {
        self.completed as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The `q`-quantile latency in microseconds (0 with no samples).
    pub fn latency_us(&mut self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        self.latencies_us.sort_unstable();
        let idx = ((self.latencies_us.len() as f64 - 1.0) * q).round() as usize;
        f64::from(self.latencies_us[idx.min(self.latencies_us.len() - 1)])
    }

    /// Responses with `status`.
    pub fn status(&self, status: u16) -> u64 {
        self.statuses.get(&status).copied().unwrap_or(0)
    }
}

struct Shared {
    /// With a fixed rate: when the run started, and the requests per second.
    pace: Option<(Instant, f64)>,
    stop: AtomicBool,
    measuring: AtomicBool,
    completed: AtomicU64,
    next_number: AtomicU64,
    errors: AtomicU64,
    samples: Mutex<(Vec<u32>, BTreeMap<u16, u64>)>,
}

/// Runs `load`: `warmup`, then the measurement interval of `duration` (at whose start and end
/// `probe` is called, e.g. to read Envoy's CPU time), then stops. In `Numbered` mode with
/// `max_requests`, the interval ends early when they have all been answered. Returns the
/// outcome and the two probe readings.
pub async fn run<P: Clone>(load: &Load, warmup: Duration, duration: Duration, probe: impl FnMut() -> P) -> (Outcome, P, P) {
    run_at(load, None, warmup, duration, probe).await
}

/// [`run`] at `rate` requests per second in all (no faster; as fast as the answers come if
/// the target cannot keep up), the rate kept from the start of `warmup`.
pub async fn run_paced<P: Clone>(load: &Load, rate: f64, warmup: Duration, duration: Duration, probe: impl FnMut() -> P) -> (Outcome, P, P) {
    run_at(load, Some(rate).filter(|r| *r > 0.0), warmup, duration, probe).await
}

async fn run_at<P: Clone>(
    load: &Load,
    rate: Option<f64>,
    warmup: Duration,
    duration: Duration,
    mut probe: impl FnMut() -> P,
) -> (Outcome, P, P) {
    let shared = Arc::new(Shared {
        pace: rate.map(|rate| (Instant::now(), rate)),
        stop: AtomicBool::new(false),
        measuring: AtomicBool::new(warmup.is_zero()),
        completed: AtomicU64::new(0),
        next_number: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        samples: Mutex::new((Vec::new(), BTreeMap::new())),
    });
    let mut tasks = Vec::new();
    for c in 0..load.connections {
        tasks.push(tokio::spawn(connection(load.clone(), c, Arc::clone(&shared))));
    }
    tokio::time::sleep(warmup).await;
    shared.measuring.store(true, Ordering::SeqCst);
    let before = probe();
    let start = Instant::now();
    let deadline = start + duration;
    loop {
        let now = Instant::now();
        if now >= deadline || tasks.iter().all(|t| t.is_finished()) {
            break;
        }
        tokio::time::sleep((deadline - now).min(Duration::from_millis(20))).await;
    }
    let after = probe();
    let elapsed = start.elapsed();
    shared.measuring.store(false, Ordering::SeqCst);
    shared.stop.store(true, Ordering::SeqCst);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    let (latencies_us, statuses) = std::mem::take(&mut *shared.samples.lock().expect("samples"));
    let outcome = Outcome {
        completed: shared.completed.load(Ordering::SeqCst),
        statuses,
        errors: shared.errors.load(Ordering::SeqCst),
        latencies_us,
        elapsed,
    };
    (outcome, before, after)
}

impl Shared {
    /// A connection's next request: its number over all connections when the requests are
    /// `numbered`, once its turn came at a fixed rate (`Some(None)`: not numbered); `None` once
    /// `max` requests were sent.
    async fn next_request(&self, numbered: bool, max: Option<u64>) -> Option<Option<u64>> {
        if !numbered {
            return Some(None);
        }
        let i = self.next_number.fetch_add(1, Ordering::Relaxed);
        if max.is_some_and(|max| i >= max) {
            return None;
        }
        if let Some((start, rate)) = self.pace {
            let due = start + Duration::from_secs_f64(i as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        Some(Some(i))
    }
}

async fn connection(load: Load, index: usize, shared: Arc<Shared>) {
    if let Requests::Grpc(keys) = &load.requests {
        return grpc_connection(load.clone(), Arc::clone(keys), index, shared).await;
    }
    let mut n: u64 = 0;
    let mut local_lat: Vec<u32> = Vec::with_capacity(1 << 16);
    let mut local_status: BTreeMap<u16, u64> = BTreeMap::new();
    let flush = |lat: &mut Vec<u32>, st: &mut BTreeMap<u16, u64>| {
        let mut s = shared.samples.lock().expect("samples");
        s.0.append(lat);
        for (k, v) in std::mem::take(st) {
            *s.1.entry(k).or_insert(0) += v;
        }
    };
    let target = load.targets[index % load.targets.len()];
    'reconnect: while !shared.stop.load(Ordering::Relaxed) {
        let Some(mut conn) = Conn::connect(target).await else {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let numbered = shared.pace.is_some() || load.max_requests.is_some() || matches!(load.requests, Requests::Numbered(_));
        while !shared.stop.load(Ordering::Relaxed) {
            let Some(number) = shared.next_request(numbered, load.max_requests).await else { break 'reconnect };
            let req = match &load.requests {
                Requests::Cycle(list) => {
                    let i = (index as u64).wrapping_mul(7919).wrapping_add(n) as usize % list.len();
                    std::borrow::Cow::Borrowed(list[i].as_slice())
                }
                Requests::Grpc(_) => unreachable!("gRPC calls go through grpc_connection"),
                Requests::Numbered(make) => std::borrow::Cow::Owned(make(number.unwrap_or_default())),
            };
            n += 1;
            let sent = Instant::now();
            let Some(status) = conn.exchange(&req).await else {
                shared.errors.fetch_add(1, Ordering::Relaxed);
                continue 'reconnect;
            };
            if shared.measuring.load(Ordering::Relaxed) {
                shared.completed.fetch_add(1, Ordering::Relaxed);
                local_lat.push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
                *local_status.entry(status).or_insert(0) += 1;
                if local_lat.len() >= 1 << 16 {
                    flush(&mut local_lat, &mut local_status);
                }
            }
        }
    }
    flush(&mut local_lat, &mut local_status);
}

/// One call: its HTTP status if it ended with `grpc-status: 0` (in the trailers, or in the
/// headers of a trailers-only answer), 0 otherwise.
async fn grpc_call(
    client: h2::client::SendRequest<bytes::Bytes>,
    key: &str,
) -> Result<(h2::client::SendRequest<bytes::Bytes>, u16), h2::Error> {
    let mut client = client.ready().await?;
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://bench.floodgate{GRPC_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("x-api-key", key)
        .body(())
        .expect("a request head");
    let (response, mut send) = client.send_request(request, false)?;
    send.send_data(bytes::Bytes::from_static(GRPC_FRAME), true)?;
    let response = response.await?;
    let status = response.status().as_u16();
    let mut grpc_status = response.headers().get("grpc-status").cloned();
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk?.len());
    }
    if let Some(trailers) = body.trailers().await? {
        grpc_status = trailers.get("grpc-status").cloned().or(grpc_status);
    }
    let ok = grpc_status.is_some_and(|s| s.as_bytes() == b"0");
    Ok((client, if ok { status } else { 0 }))
}

async fn grpc_connection(load: Load, keys: Arc<Vec<String>>, index: usize, shared: Arc<Shared>) {
    let mut n: u64 = 0;
    let mut local_lat: Vec<u32> = Vec::with_capacity(1 << 16);
    let mut local_status: BTreeMap<u16, u64> = BTreeMap::new();
    'reconnect: while !shared.stop.load(Ordering::Relaxed) {
        let connected = tokio::time::timeout(Duration::from_secs(5), async {
            let target = load.targets.get(index % load.targets.len().max(1)).copied()?;
            let stream = TcpStream::connect(target).await.ok()?;
            let _ = stream.set_nodelay(true);
            h2::client::handshake(stream).await.ok()
        });
        let Ok(Some((mut client, conn))) = connected.await else {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let numbered = shared.pace.is_some() || load.max_requests.is_some();
        while !shared.stop.load(Ordering::Relaxed) {
            if shared.next_request(numbered, load.max_requests).await.is_none() {
                break 'reconnect;
            }
            let key = &keys[(index as u64).wrapping_mul(7919).wrapping_add(n) as usize % keys.len()];
            n += 1;
            let sent = Instant::now();
            let status = match grpc_call(client, key).await {
                Ok((ready, status)) => {
                    client = ready;
                    status
                }
                Err(_) => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    continue 'reconnect;
                }
            };
            if shared.measuring.load(Ordering::Relaxed) {
                shared.completed.fetch_add(1, Ordering::Relaxed);
                local_lat.push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
                *local_status.entry(status).or_insert(0) += 1;
            }
        }
    }
    let mut samples = shared.samples.lock().expect("samples");
    samples.0.append(&mut local_lat);
    for (k, v) in local_status {
        *samples.1.entry(k).or_insert(0) += v;
    }
}

/// One keep-alive HTTP/1.1 connection to Envoy: a request out, its response in.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    chunk: Vec<u8>,
}

impl Conn {
    /// Connects (at most 5 s); `None` if that fails.
    pub async fn connect(target: SocketAddr) -> Option<Conn> {
        let stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(target)).await.ok()?.ok()?;
        let _ = stream.set_nodelay(true);
        Some(Conn { stream, buf: Vec::with_capacity(16384), chunk: vec![0u8; 16384] })
    }

    /// Sends `request` and reads one response (head, then `content-length` bytes); its status,
    /// or `None` if the connection failed or the response could not be read (connect again).
    pub async fn exchange(&mut self, request: &[u8]) -> Option<u16> {
        self.stream.write_all(request).await.ok()?;
        loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                let head = &self.buf[..end];
                let status: u16 =
                    std::str::from_utf8(head.get(9..12).unwrap_or(b"000")).ok().and_then(|s| s.parse().ok()).unwrap_or(0);
                let len = content_length(head)?;
                if self.buf.len() >= end + 4 + len {
                    self.buf.drain(..end + 4 + len);
                    return Some(status);
                }
            }
            match self.stream.read(&mut self.chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(k) => self.buf.extend_from_slice(&self.chunk[..k]),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{request, run, run_paced, start_upstream, Load, Requests};
    use std::sync::Arc;
    use std::time::Duration;

    fn load(target: std::net::SocketAddr, requests: u64) -> Load {
        Load { targets: vec![target], connections: 4, requests: Requests::Cycle(Arc::new(vec![request("/", &[])])), max_requests: Some(requests) }
    }

    /// Paced, 60 requests at 200 a second take 0.3 s however fast the upstream answers; a
    /// closed loop sends them as fast as it answers.
    #[tokio::test]
    async fn a_paced_run_holds_its_rate_and_a_closed_loop_does_not_wait() {
        let (upstream, _) = start_upstream().await;
        let (paced, _, _) = run_paced(&load(upstream, 60), 200.0, Duration::ZERO, Duration::from_secs(30), || ()).await;
        assert_eq!(paced.status(200), 60, "{paced:?}");
        assert!(paced.elapsed >= Duration::from_millis(290), "{:?}", paced.elapsed);
        assert!(paced.throughput() <= 205.0, "{}", paced.throughput());
        let (closed, _, _) = run(&load(upstream, 60), Duration::ZERO, Duration::from_secs(30), || ()).await;
        assert_eq!(closed.status(200), 60, "{closed:?}");
        assert!(closed.elapsed < Duration::from_millis(290), "{:?}", closed.elapsed);
    }
}
