//! The global scope's other processes for the benchmark: a `redis-server` and a
//! `floodgate-sync`, each on a free 127.0.0.1 port in a temporary directory, and each started
//! under `timeout -s KILL` so that neither outlives the benchmark by more than its bound even if
//! the tool itself dies (the release profile aborts on panic, which runs no destructor).
//! Failures are values: the measurement reports them and goes on.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The longest any of these processes may live.
const LIFETIME_BOUND: Duration = Duration::from_secs(45 * 60);

/// A free port on 127.0.0.1 (bound, then released).
pub fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// `program args…` under `timeout -s KILL`, in its own process group (timeout's), with stdout
/// and stderr into `log`.
fn spawn_bounded(program: &Path, args: &[String], log: &Path, env: &[(&str, &str)]) -> Result<Child, String> {
    let log = std::fs::File::options().create(true).append(true).open(log).map_err(|e| e.to_string())?;
    let mut command = Command::new("timeout");
    command.args(["-s", "KILL", &format!("{}s", LIFETIME_BOUND.as_secs())]).arg(program).args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    command
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone().map_err(|e| e.to_string())?))
        .stderr(Stdio::from(log))
        .spawn()
        .map_err(|e| format!("cannot start timeout {}: {e}", program.display()))
}

/// The process `timeout` (pid `parent`) runs, once it has started it (at most 5 s).
fn child_of(parent: u32) -> Result<u32, String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).unwrap_or_default();
        if let Some(pid) = children.split_whitespace().next().and_then(|p| p.parse().ok()) {
            return Ok(pid);
        }
        if Instant::now() > deadline {
            return Err(format!("process {parent} started no child"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends `signal` (`STOP`, `CONT`, `KILL`) to `pid`, or to process group `pid` with `group`.
fn signal(pid: u32, signal: &str, group: bool) -> Result<(), String> {
    let target = if group { format!("-{pid}") } else { pid.to_string() };
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(&target)
        .stderr(Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{signal} {target} failed"))
    }
}

/// A bounded child and the process it runs.
struct Bounded {
    timeout: Child,
    pid: u32,
}

impl Bounded {
    fn start(program: &Path, args: &[String], log: &Path, env: &[(&str, &str)]) -> Result<Bounded, String> {
        let mut timeout = spawn_bounded(program, args, log, env)?;
        match child_of(timeout.id()) {
            Ok(pid) => Ok(Bounded { timeout, pid }),
            Err(e) => {
                let _ = timeout.kill();
                let _ = timeout.wait();
                Err(e)
            }
        }
    }

    fn alive(&mut self) -> bool {
        matches!(self.timeout.try_wait(), Ok(None))
    }
}

impl Drop for Bounded {
    fn drop(&mut self) {
        // The whole group: the program (even stopped) and timeout itself.
        let _ = signal(self.timeout.id(), "KILL", true);
        let _ = self.timeout.kill();
        let _ = self.timeout.wait();
    }
}

/// A `redis-server` without persistence.
pub struct Redis {
    process: Option<Bounded>,
    binary: PathBuf,
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: tempfile::TempDir,
    /// `redis-server` arguments beyond address and persistence (a cluster node's).
    extra: Vec<String>,
}

/// What Redis has executed so far, from `INFO commandstats`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RedisCounts {
    /// Script calls received (`EVALSHA` and `EVAL`): one round trip each.
    pub scripts: u64,
    /// Every command executed, those inside the scripts included, `INFO` and `PING` left out.
    pub commands: u64,
}

impl RedisCounts {
    /// What was executed between `before` and these counts.
    pub fn since(self, before: RedisCounts) -> RedisCounts {
        RedisCounts { scripts: self.scripts.saturating_sub(before.scripts), commands: self.commands.saturating_sub(before.commands) }
    }
}

/// Calls per command of an `INFO commandstats` answer (`INFO` and `PING` left out).
pub fn calls_by_name(info: &str) -> BTreeMap<String, u64> {
    field_by_name(info, "calls")
}

/// One field (`calls`, `usec`) per command of an `INFO commandstats` answer (`INFO` and `PING`
/// left out).
fn field_by_name(info: &str, field: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in info.lines() {
        let Some((name, fields)) = line.strip_prefix("cmdstat_").and_then(|l| l.split_once(':')) else { continue };
        if name == "info" || name == "ping" {
            continue;
        }
        let value = fields
            .split(',')
            .find_map(|f| f.strip_prefix(field).and_then(|rest| rest.strip_prefix('=')))
            .and_then(|c| c.trim().parse().ok())
            .unwrap_or(0);
        out.insert(name.to_owned(), value);
    }
    out
}

impl Redis {
    /// Starts `binary` on a free port and waits (at most 10 s) until it answers `PING`.
    pub fn start(binary: &Path) -> Result<Redis, String> {
        Redis::start_on(binary, free_port()?, &[])
    }

    /// Starts `binary` on `port` with `extra` arguments and waits (at most 10 s) until it answers
    /// `PING`.
    pub fn start_on(binary: &Path, port: u16, extra: &[&str]) -> Result<Redis, String> {
        let dir = tempfile::Builder::new().prefix("floodgate-bench-redis-").tempdir().map_err(|e| e.to_string())?;
        let extra = extra.iter().map(|s| s.to_string()).collect();
        let mut redis = Redis { process: None, binary: binary.to_path_buf(), port, dir, extra };
        redis.spawn()?;
        redis.wait_ready(Duration::from_secs(10))?;
        Ok(redis)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let args: Vec<String> = ["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--save", "", "--appendonly", "no", "--dir"]
            .iter()
            .map(|s| s.to_string())
            .chain([self.dir.path().display().to_string()])
            .chain(self.extra.iter().cloned())
            .collect();
        self.process = Some(Bounded::start(&self.binary, &args, &self.dir.path().join("redis.log"), &[])?);
        Ok(())
    }

    /// Waits until it answers `PING`.
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.command("PING").is_ok_and(|r| r == "PONG") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("redis-server not answering after {timeout:?}: {}", self.log_tail()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.pid)
    }

    /// SIGSTOP: it neither answers nor closes its connections.
    pub fn pause(&self) -> Result<(), String> {
        signal(self.pid().ok_or("redis-server is not running")?, "STOP", false)
    }

    /// SIGCONT.
    pub fn resume(&self) -> Result<(), String> {
        signal(self.pid().ok_or("redis-server is not running")?, "CONT", false)
    }

    /// SIGKILL: gone, with everything it held (no persistence).
    pub fn kill(&mut self) {
        self.process = None;
    }

    /// Starts it again, empty, on the same port, without waiting for it.
    pub fn respawn(&mut self) -> Result<(), String> {
        self.kill();
        self.spawn()
    }

    /// One command in Redis's inline form (`INFO commandstats`); the reply's text (a bulk string's
    /// content, or a simple string).
    pub fn command(&self, line: &str) -> Result<String, String> {
        let mut s = TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], self.port)), Duration::from_secs(2))
            .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
        write!(s, "{line}\r\n").map_err(|e| e.to_string())?;
        let mut reply = Vec::new();
        let mut chunk = [0u8; 16384];
        loop {
            let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed".into());
            }
            reply.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&reply);
            let Some((first, rest)) = text.split_once("\r\n") else { continue };
            match first.as_bytes().first() {
                Some(b'+') => return Ok(first[1..].to_string()),
                Some(b'-') => return Err(first[1..].to_string()),
                Some(b'$') => {
                    let len: usize = first[1..].parse().map_err(|_| format!("bad reply {first:?}"))?;
                    if rest.len() >= len {
                        return Ok(rest[..len].to_string());
                    }
                }
                _ => return Err(format!("unexpected reply {first:?}")),
            }
        }
    }

    /// Its counters now.
    pub fn counts(&self) -> Result<RedisCounts, String> {
        let mut counts = RedisCounts::default();
        for (name, calls) in self.calls_by_name()? {
            if name == "evalsha" || name == "eval" {
                counts.scripts += calls;
            }
            counts.commands += calls;
        }
        Ok(counts)
    }

    /// Calls per command so far (`INFO commandstats`, `INFO` and `PING` left out).
    pub fn calls_by_name(&self) -> Result<BTreeMap<String, u64>, String> {
        Ok(calls_by_name(&self.command("INFO commandstats")?))
    }

    /// Time spent per command so far, in µs (`INFO commandstats`' `usec`: a script's includes
    /// the commands it calls, which count under their own names too).
    pub fn usec_by_name(&self) -> Result<BTreeMap<String, u64>, String> {
        Ok(field_by_name(&self.command("INFO commandstats")?, "usec"))
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default();
        log.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
    }
}

/// `floodgate-sync` in front of one Redis node.
pub struct Sync {
    process: Option<Bounded>,
    /// Where it listens.
    pub addr: SocketAddr,
    binary: PathBuf,
    args: Vec<String>,
    dir: tempfile::TempDir,
}

impl Sync {
    /// Starts `binary` against `redis_url` on a free port, with its default timeouts, and waits
    /// (at most 10 s) until `/healthz` answers.
    pub fn start(binary: &Path, redis_url: &str) -> Result<Sync, String> {
        Sync::start_with(binary, &["--redis", redis_url])
    }

    /// Starts `binary` with `args` (`--redis` and the rest; the address is added) on a free port,
    /// and waits (at most 10 s) until `/healthz` answers.
    pub fn start_with(binary: &Path, args: &[&str]) -> Result<Sync, String> {
        let dir = tempfile::Builder::new().prefix("floodgate-bench-sync-").tempdir().map_err(|e| e.to_string())?;
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        args.extend(["--listen".to_string(), addr.to_string()]);
        let mut sync = Sync { process: None, addr, binary: binary.to_path_buf(), args, dir };
        sync.spawn()?;
        Ok(sync)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = self.dir.path().join("sync.log");
        let mut process = Bounded::start(&self.binary, &self.args, &log, &[("RUST_LOG", "info")])?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !crate::envoy::http_get(self.addr, "/healthz").is_ok_and(|(s, _)| s == 200) {
            if !process.alive() || Instant::now() > deadline {
                return Err(format!("floodgate-sync did not start: {}", std::fs::read_to_string(&log).unwrap_or_default()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.process = Some(process);
        Ok(())
    }

    /// Kills it (SIGKILL) and starts it again on the same address, waiting until it answers.
    pub fn restart(&mut self) -> Result<(), String> {
        self.process = None;
        self.spawn()
    }

    /// Its pid (0 while it is not running).
    pub fn pid(&self) -> u32 {
        self.process.as_ref().map_or(0, |p| p.pid)
    }
}

/// A local Redis Cluster: `masters` masters with `replicas` replicas each, made with
/// `redis-cli --cluster create` as `integration/src/store.rs` makes its test clusters.
pub struct RedisCluster {
    /// Every node, masters first as `redis-cli --cluster create` assigned them.
    pub nodes: Vec<Redis>,
}

/// The cluster settings of every node (a failed master's replica takes over within about 2 s).
const CLUSTER_ARGS: [&str; 6] = ["--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--cluster-config-file", "nodes.conf"];

impl RedisCluster {
    /// Starts the nodes and creates the cluster; waits (at most 20 s) until every node reports
    /// `cluster_state:ok`.
    pub fn start(binary: &Path, masters: usize, replicas: usize) -> Result<RedisCluster, String> {
        let mut nodes = Vec::new();
        while nodes.len() < masters * (1 + replicas) {
            // The cluster bus listens on the port + 10000: both free.
            let port = free_port()?;
            if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
                nodes.push(Redis::start_on(binary, port, &CLUSTER_ARGS)?);
            }
        }
        let beside = binary.with_file_name("redis-cli");
        let cli = if beside.is_file() { beside } else { PathBuf::from("redis-cli") };
        let out = Command::new("timeout")
            .args(["-s", "KILL", "60"])
            .arg(&cli)
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("redis-cli --cluster create: {e}"))?;
        if !out.status.success() {
            return Err(format!("cluster create: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)));
        }
        let cluster = RedisCluster { nodes };
        cluster.wait_ok(Duration::from_secs(20))?;
        Ok(cluster)
    }

    /// Waits until every running node reports `cluster_state:ok`.
    pub fn wait_ok(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = self
                .nodes
                .iter()
                .filter(|n| n.pid().is_some())
                .all(|n| n.command("CLUSTER INFO").is_ok_and(|o| o.contains("cluster_state:ok")));
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("redis cluster not ok after {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The nodes' URLs, seeds for a cluster client.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Redis::url).collect()
    }

    /// Indices of the running nodes that are masters now.
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].pid().is_some())
            .filter(|&i| self.nodes[i].command("INFO replication").is_ok_and(|o| o.contains("role:master")))
            .collect()
    }
}

/// How Limitador keeps its counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitadorStorage {
    /// `redis`: every request checked and counted in Redis.
    Redis,
    /// `redis_cached`: counters cached in Limitador, their increments flushed to Redis every
    /// `flush_ms` (its `--flush-period`).
    RedisCached { flush_ms: u64 },
}

impl LimitadorStorage {
    /// A short id: `redis`, `cached-100ms`.
    pub fn id(self) -> String {
        match self {
            LimitadorStorage::Redis => "redis".into(),
            LimitadorStorage::RedisCached { flush_ms } => format!("cached-{flush_ms}ms"),
        }
    }

    /// As a table names it: `` `redis` ``, `` `redis_cached`, flush 100 ms ``.
    pub fn name(self) -> String {
        match self {
            LimitadorStorage::Redis => "`redis`".into(),
            LimitadorStorage::RedisCached { flush_ms } => format!("`redis_cached`, flush {flush_ms} ms"),
        }
    }
}

/// Limitador (`limitador-server`) in front of one Redis node, serving Envoy's rate limit
/// service (gRPC) on a port of 127.0.0.1.
pub struct Limitador {
    process: Bounded,
    _dir: tempfile::TempDir,
}

impl Limitador {
    /// Starts `binary` with the limits file `limits` (YAML) and `storage` on `redis_url`,
    /// listening on `addr` (a port of 127.0.0.1), and waits (at most 20 s) until its HTTP
    /// `/status` answers and its gRPC port accepts connections.
    pub fn start(binary: &Path, limits: &str, storage: LimitadorStorage, redis_url: &str, addr: SocketAddr) -> Result<Limitador, String> {
        let dir = tempfile::Builder::new().prefix("floodgate-bench-limitador-").tempdir().map_err(|e| e.to_string())?;
        let file = dir.path().join("limits.yaml");
        std::fs::write(&file, limits).map_err(|e| e.to_string())?;
        let http = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut args: Vec<String> = vec![
            "--rls-ip".into(),
            addr.ip().to_string(),
            "--rls-port".into(),
            addr.port().to_string(),
            "--http-ip".into(),
            http.ip().to_string(),
            "--http-port".into(),
            http.port().to_string(),
            file.display().to_string(),
        ];
        match storage {
            LimitadorStorage::Redis => args.push("redis".into()),
            LimitadorStorage::RedisCached { flush_ms } => args.extend(["redis_cached".into(), "--flush-period".into(), flush_ms.to_string()]),
        }
        args.push(redis_url.into());
        let log = dir.path().join("limitador.log");
        let mut process = Bounded::start(binary, &args, &log, &[])?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(crate::envoy::http_get(http, "/status").is_ok_and(|(s, _)| s == 200) && TcpStream::connect(addr).is_ok()) {
            if !process.alive() || Instant::now() > deadline {
                return Err(format!("limitador-server did not start: {}", std::fs::read_to_string(&log).unwrap_or_default()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Limitador { process, _dir: dir })
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.process.pid
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_give_calls_and_time_by_name() {
        let info = "# Commandstats\r\n\
            cmdstat_evalsha:calls=59,usec=8909,usec_per_call=151.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_incrby:calls=649,usec=454,usec_per_call=0.70,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_info:calls=3,usec=90,usec_per_call=30.00,rejected_calls=0,failed_calls=0\r\n";
        assert_eq!(calls_by_name(info), BTreeMap::from([("evalsha".to_owned(), 59), ("incrby".to_owned(), 649)]));
        // `usec=` is not taken for `usec_per_call=`, nor the other way round.
        assert_eq!(field_by_name(info, "usec"), BTreeMap::from([("evalsha".to_owned(), 8909), ("incrby".to_owned(), 454)]));
    }
}
