//! Loads over many [`Client`]s: closed-loop ones as fast as Envoy answers (a number of requests,
//! or for a while), and a paced one spread round-robin over several proxies.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::client::Client;

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

/// Statuses of a steady load: `rate` requests per second in all, spread round-robin over the
/// proxies, each with header `(name, value)`, for `duration`, over a few keep-alive connections
/// per proxy. `during(elapsed)` is called about every 100 ms (to break things on cue).
pub async fn steady_load(
    proxies: &[SocketAddr],
    header: (&str, &str),
    rate: u64,
    duration: Duration,
    during: impl FnMut(Duration),
) -> BTreeMap<u16, u64> {
    let (name, value) = (header.0.to_owned(), header.1.to_owned());
    let ended = paced_round_robin(proxies, 4, rate, duration, during, |_| {
        let (name, value) = (name.clone(), value.clone());
        move |mut client: Client| async move {
            let status = client.get("/", &[(name.as_str(), value.as_str())]).await.map(|r| r.status).unwrap_or(0);
            (client, status)
        }
    })
    .await;
    let mut statuses = BTreeMap::new();
    for status in ended {
        *statuses.entry(status).or_insert(0) += 1;
    }
    statuses
}

/// Statuses seen by a closed-loop load: `clients` keep-alive connections, each sending one
/// request after another for a while ([`closed_loop`]).
#[derive(Default, Debug)]
pub struct Tally {
    /// Answers by status.
    pub statuses: BTreeMap<u16, u64>,
    /// Requests that got no answer (the connection failed; the client reconnects).
    pub errors: u64,
}

impl Tally {
    /// Every request sent.
    pub fn total(&self) -> u64 {
        self.statuses.values().sum::<u64>() + self.errors
    }
    /// Requests answered `200`.
    pub fn ok(&self) -> u64 {
        self.statuses.get(&200).copied().unwrap_or(0)
    }
    /// The share of requests answered `200`.
    pub fn success_rate(&self) -> f64 {
        self.ok() as f64 / self.total().max(1) as f64
    }
}

/// Runs a closed loop of `GET /work` with `headers` for `duration` and returns what the clients saw.
pub async fn closed_loop(addr: SocketAddr, clients: usize, duration: Duration, headers: &'static [(&'static str, &'static str)]) -> Tally {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (tally, stop) = (tally.clone(), stop.clone());
            tokio::spawn(async move {
                let mut client = None;
                while !stop.load(Ordering::Relaxed) {
                    if client.is_none() {
                        client = Client::connect(addr).await.ok();
                    }
                    let Some(c) = client.as_mut() else { continue };
                    match c.get("/work", headers).await {
                        Ok(r) => *tally.lock().unwrap().statuses.entry(r.status).or_default() += 1,
                        Err(_) => {
                            tally.lock().unwrap().errors += 1;
                            client = None;
                        }
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("load task");
    }
    Arc::try_unwrap(tally).expect("tasks done").into_inner().unwrap()
}
