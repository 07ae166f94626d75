//! The sync tests' harness: real `redis-server` processes (single node or a local Redis Cluster)
//! on free 127.0.0.1 ports in temp dirs, `floodgate-sync` as its own process, and a small
//! HTTP/1.1 + HTTP/2 client. Every process started here is stopped when its handle drops, and
//! every wait is bounded.
#![allow(
    dead_code,
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};

/// The test PKI, shared with the integration tests.
#[path = "../../../integration/src/tls.rs"]
pub mod tls;

/// `redis-server` (from PATH, or $REDIS_SERVER; scripts/redis.sh installs it).
pub fn redis_server_bin() -> PathBuf {
    std::env::var_os("REDIS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("redis-server"))
}

/// `redis-cli`, next to redis-server when $REDIS_SERVER names it.
pub fn redis_cli_bin() -> PathBuf {
    match std::env::var_os("REDIS_SERVER") {
        Some(server) => Path::new(&server).with_file_name("redis-cli"),
        None => PathBuf::from("redis-cli"),
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Waits until `check` is true, polling every 50 ms, at most `limit`; panics with `what` after.
pub fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `n` free ports, all bound at once (so no two are equal). With `bus`, each port + 10000 (the
/// cluster bus port) is free too.
pub fn free_ports(n: usize, bus: bool) -> Vec<u16> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    let mut attempts = 0;
    while ports.len() < n {
        attempts += 1;
        assert!(attempts < 1000, "no free ports");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        if bus {
            if port > 55_000 {
                continue;
            }
            match TcpListener::bind(("127.0.0.1", port + 10_000)) {
                Ok(bus_listener) => held.push(bus_listener),
                Err(_) => continue,
            }
        }
        held.push(listener);
        ports.push(port);
    }
    ports
}

/// A `redis-server` process of this test.
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    cluster: bool,
    /// More `redis-server` arguments (after the usual ones, so they override them).
    extra: Vec<String>,
    /// More `redis-cli` arguments (TLS, credentials), for [`Redis::cli`].
    cli_args: Vec<String>,
}

impl Redis {
    /// Starts a node (cluster-enabled or not) on `port` and waits until it answers PING.
    pub fn start(port: u16, cluster: bool) -> Redis {
        Redis::launch(port, cluster, &[], &[])
    }

    /// A node with more `redis-server` arguments (`extra`), reached by `redis-cli` with
    /// `cli_args` (TLS and credentials: [`Redis::cli`] uses them, [`Redis::conn`] does not).
    pub fn start_with(port: u16, extra: &[String], cli_args: &[String]) -> Redis {
        Redis::launch(port, false, extra, cli_args)
    }

    fn launch(port: u16, cluster: bool, extra: &[String], cli_args: &[String]) -> Redis {
        let dir = tempfile::tempdir().unwrap();
        let mut redis = Redis {
            port,
            child: None,
            dir,
            cluster,
            extra: extra.to_vec(),
            cli_args: cli_args.to_vec(),
        };
        redis.spawn();
        redis
    }

    fn spawn(&mut self) {
        let mut command = Command::new(redis_server_bin());
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--dir", self.dir.path().to_str().unwrap()])
            .args(["--logfile", "redis.log"])
            .args(&self.extra);
        if self.cluster {
            command.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
            ]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (run scripts/redis.sh to install it)");
        self.child = Some(child);
        let port = self.port;
        wait_until(
            &format!("redis-server on {port}"),
            Duration::from_secs(10),
            || {
                self.cli(&["PING"])
                    .map(|out| out == "PONG")
                    .unwrap_or(false)
            },
        );
    }

    /// SIGKILL: the process dies at once, like a crashed node.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP or SIGCONT: a node that hangs (accepts connections, answers nothing) and wakes.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().unwrap().id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Starts it again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli -p PORT args...`: trimmed stdout, or the error text.
    pub fn cli(&self, args: &[&str]) -> Result<String, String> {
        let output = Command::new(redis_cli_bin())
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(&self.cli_args)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|err| err.to_string())?;
        let out = String::from_utf8_lossy(&output.stdout).trim().to_string();
        if output.status.success()
            && !out.starts_with("ERR")
            && !out.starts_with("Could not connect")
        {
            Ok(out)
        } else {
            Err(format!("{out} {}", String::from_utf8_lossy(&output.stderr)))
        }
    }

    /// A connection for inspecting the node (GET, PTTL, DBSIZE, INFO).
    pub fn conn(&self) -> redis::Connection {
        let client = redis::Client::open(self.url()).unwrap();
        client
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap()
    }

    pub fn dbsize(&self) -> u64 {
        redis::cmd("DBSIZE").query(&mut self.conn()).unwrap()
    }

    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut self.conn()).unwrap();
        keys.sort();
        keys
    }

    pub fn get(&self, key: &str) -> Option<u64> {
        redis::cmd("GET").arg(key).query(&mut self.conn()).unwrap()
    }

    /// A hash's fields and values, sorted by field.
    pub fn hgetall(&self, key: &str) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> = redis::cmd("HGETALL").arg(key).query(&mut self.conn()).unwrap();
        all.sort();
        all
    }

    pub fn set(&self, key: &str, value: &str) {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query(&mut self.conn())
            .unwrap();
    }

    /// PTTL in ms (-2: no key, -1: no expiry).
    pub fn pttl(&self, key: &str) -> i64 {
        redis::cmd("PTTL").arg(key).query(&mut self.conn()).unwrap()
    }

    /// PEXPIRETIME in ms since the epoch (Redis 7).
    pub fn pexpiretime(&self, key: &str) -> i64 {
        redis::cmd("PEXPIRETIME")
            .arg(key)
            .query(&mut self.conn())
            .unwrap()
    }

    /// `INFO <section>` as key → value.
    pub fn info(&self, section: &str) -> std::collections::HashMap<String, String> {
        let text: String = redis::cmd("INFO")
            .arg(section)
            .query(&mut self.conn())
            .unwrap();
        text.lines()
            .filter_map(|line| line.split_once(':'))
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect()
    }

    /// `calls` of one command in INFO commandstats (`evalsha`, `incrby`, ...).
    pub fn command_calls(&self, command: &str) -> u64 {
        let stats = self.info("commandstats");
        stats
            .get(&format!("cmdstat_{command}"))
            .and_then(|v| v.split(',').find_map(|f| f.strip_prefix("calls=")))
            .map(|n| n.parse().unwrap())
            .unwrap_or(0)
    }

    pub fn total_commands(&self) -> u64 {
        self.info("stats")["total_commands_processed"]
            .parse()
            .unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `floodgate-sync` process of this test, with its stderr collected.
pub struct Sync {
    pub port: u16,
    child: Option<Child>,
    log: Arc<Mutex<String>>,
}

impl Sync {
    /// Starts the built binary on a free port with `args` and waits for its startup line.
    pub fn start(args: &[&str]) -> Sync {
        Sync::start_with_env(args, &[])
    }

    /// Like [`Sync::start`], with environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Sync {
        let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate-sync"))
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    {
                        let mut log = log.lock().unwrap();
                        log.push_str(&line);
                        log.push('\n');
                    }
                    if let Some(rest) = line.split("on http://127.0.0.1:").nth(1) {
                        let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                        let _ = port_tx.send(port.parse::<u16>().unwrap());
                    }
                }
            });
        }
        let port = match port_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(port) => port,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("floodgate-sync did not start:\n{}", log.lock().unwrap());
            }
        };
        Sync {
            port,
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// SIGTERM, then waits (at most 10 s) for the exit; returns whether it exited with 0.
    pub fn terminate(&mut self) -> bool {
        let mut child = self.child.take().unwrap();
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.success();
            }
            if start.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Sync {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- floodgate-sync log ---\n{}", self.log());
        }
    }
}

/// An HTTP answer: status, content type, body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub content_type: Option<String>,
    /// `floodgate-proxies`, the fleet size a sync answer gives.
    pub proxies: Option<u64>,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|err| panic!("not JSON ({err}): {:?}", self.body))
    }

    /// The `[(previous, current), ...]` of a 200 answer.
    pub fn totals(&self) -> Vec<(u64, u64)> {
        assert_eq!(self.status, 200, "{}", self.body);
        let json = self.json();
        assert_eq!(json["version"], 1, "{}", self.body);
        json["counters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["previous"].as_u64().unwrap(),
                    c["current"].as_u64().unwrap(),
                )
            })
            .collect()
    }
}

/// Sends one request on a new connection (HTTP/1.1, or HTTP/2 with prior knowledge).
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: impl Into<Bytes>,
    http2: bool,
) -> Answer {
    let headers: Vec<(&str, &str)> = content_type.map(|t| ("content-type", t)).into_iter().collect();
    request_with(port, method, path, &headers, body, http2)
}

/// [`request`] with any headers.
pub fn request_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
    http2: bool,
) -> Answer {
    let body = body.into();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let io = TokioIo::new(stream);
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("http://127.0.0.1:{port}{path}"));
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let request = builder.body(Full::new(body)).unwrap();
        let response = tokio::time::timeout(Duration::from_secs(30), async {
            if http2 {
                let (mut sender, connection) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                        .await
                        .unwrap();
                tokio::spawn(connection);
                sender.send_request(request).await.unwrap()
            } else {
                let (mut sender, connection) =
                    hyper::client::conn::http1::handshake(io).await.unwrap();
                tokio::spawn(connection);
                sender.send_request(request).await.unwrap()
            }
        })
        .await
        .expect("an answer within 30 s");
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string());
        let proxies = response
            .headers()
            .get("floodgate-proxies")
            .map(|v| v.to_str().unwrap().parse().unwrap());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Answer {
            status,
            content_type,
            proxies,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    })
}

pub fn get(port: u16, path: &str) -> Answer {
    request(port, "GET", path, None, Bytes::new(), false)
}

/// POST /v1/sync with a JSON body over HTTP/1.1.
pub fn post(port: u16, body: &Value) -> Answer {
    request(
        port,
        "POST",
        "/v1/sync",
        Some("application/json"),
        serde_json::to_vec(body).unwrap(),
        false,
    )
}

/// A batch body: `counters` are (key, window_ms, bucket, delta).
pub fn batch(proxy: &str, seq: u64, counters: &[(&str, u64, u64, u64)]) -> Value {
    json!({
        "version": 1,
        "proxy": proxy,
        "seq": seq,
        "counters": counters
            .iter()
            .map(|(key, window_ms, bucket, delta)| json!({
                "key": key, "window_ms": window_ms, "bucket": bucket, "delta": delta
            }))
            .collect::<Vec<_>>(),
    })
}

/// A 32-hex key whose shard (of 16) is `shard`, made distinct by `n`.
pub fn key_in_shard(shard: u32, n: u32) -> String {
    format!("{:08x}{:024x}", shard + 16 * n, n)
}

/// The value of one metric line (`name{labels} value`) in a /metrics text.
pub fn metric(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}
