//! The global scope's real components for the tests: `redis-server` (one node, or a local
//! Redis Cluster made with `redis-cli --cluster create`) and `floodgate-sync`, each its own
//! process on free 127.0.0.1 ports, in a temporary directory, stopped when dropped.
//!
//! Binaries: `$REDIS_SERVER` (else `redis-server` on the PATH; `scripts/redis.sh` installs it)
//! with `redis-cli` next to it, and `$FLOODGATE_SYNC_BIN` (else `target/debug/floodgate-sync`;
//! `./test.sh` builds it).

use crate::{free_ports, workspace_root, Envoy, EnvoyBuilder, Upstream, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `redis-server`.
pub fn redis_server() -> PathBuf {
    if let Some(p) = std::env::var_os("REDIS_SERVER") {
        return PathBuf::from(p);
    }
    which("redis-server").unwrap_or_else(|| {
        panic!("redis-server is not installed and REDIS_SERVER is unset: run ./test.sh (scripts/redis.sh installs it)")
    })
}

/// `redis-cli`, next to `redis-server` or on the PATH.
pub fn redis_cli() -> PathBuf {
    let beside = redis_server().with_file_name("redis-cli");
    if beside.is_file() {
        return beside;
    }
    which("redis-cli").unwrap_or_else(|| panic!("redis-cli not found next to redis-server nor on the PATH"))
}

/// `floodgate-sync`.
pub fn sync_binary() -> PathBuf {
    let p = std::env::var_os("FLOODGATE_SYNC_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/debug/floodgate-sync"));
    assert!(
        p.is_file(),
        "{} is missing: run ./test.sh (it builds floodgate-sync), or set FLOODGATE_SYNC_BIN",
        p.display()
    );
    p
}

/// `name` on the PATH.
pub(crate) fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).map(|dir| dir.join(name)).find(|p| p.is_file())
    })
}

fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ready() {
        assert!(Instant::now() < deadline, "{what} not ready in {timeout:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One `redis-server`.
pub struct Redis {
    child: Option<Child>,
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
    /// `redis-cli`'s arguments beyond host and port (TLS, credentials).
    cli_args: Vec<String>,
}

impl Redis {
    /// A node on a free port, without persistence.
    pub fn start() -> Redis {
        Redis::with_args(&[])
    }

    /// A node on a free port with extra `redis-server` arguments.
    pub fn with_args(extra: &[&str]) -> Redis {
        let port = free_ports(1)[0];
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        Redis::launch(port, extra, Vec::new())
    }

    /// A node that serves only TLS, with `pki`'s certificates (client certificates required),
    /// and `extra` arguments (an ACL user, say); `cli_auth` are `redis-cli`'s credentials
    /// (`-a PASSWORD`) when the default user has a password.
    pub fn with_tls(pki: &crate::tls::Pki, extra: &[&str], cli_auth: &[&str]) -> Redis {
        let port = free_ports(1)[0];
        let mut args = pki.redis_args(port);
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut cli_args = pki.cli_args();
        cli_args.extend(cli_auth.iter().map(|s| s.to_string()));
        Redis::launch(port, args, cli_args)
    }

    fn launch(port: u16, extra: Vec<String>, cli_args: Vec<String>) -> Redis {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut redis = Redis { child: None, port, dir, extra, cli_args };
        redis.spawn();
        redis
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("redis.log")).expect("log");
        let child = Command::new(redis_server())
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        wait_until("redis-server", Duration::from_secs(10), || self.try_cli(&["PING"]).is_ok_and(|o| o.trim() == "PONG"));
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli` against this node.
    pub fn cli(&self, args: &[&str]) -> String {
        self.try_cli(args).unwrap_or_else(|e| panic!("redis-cli {args:?}: {e}"))
    }

    fn try_cli(&self, args: &[&str]) -> Result<String, String> {
        let mut all: Vec<&str> = self.cli_args.iter().map(String::as_str).collect();
        all.extend_from_slice(args);
        cli(self.port, &all)
    }

    /// Stops the process (SIGSTOP): the node neither answers nor closes connections.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Resumes it (SIGCONT).
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, name: &str) {
        signal(self.child.as_ref(), name);
    }

    /// Kills it (SIGKILL) and waits.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and directory (with persistence, the data is back).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// Sends signal `name` (`STOP`, `CONT`) to `child`, if it runs.
fn signal(child: Option<&Child>, name: &str) {
    if let Some(child) = child {
        let status = Command::new("kill").args([format!("-{name}"), child.id().to_string()]).status().expect("kill");
        assert!(status.success(), "kill -{name}");
    }
}

fn cli(port: u16, args: &[&str]) -> Result<String, String> {
    let out = Command::new(redis_cli())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A local Redis Cluster: `masters` masters with `replicas` replicas each.
pub struct RedisCluster {
    /// Every node, masters first as `redis-cli --cluster create` assigned them.
    pub nodes: Vec<Redis>,
    tls: bool,
}

/// The cluster settings of every node.
const CLUSTER_ARGS: [&str; 6] = ["--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--cluster-config-file", "nodes.conf"];

impl RedisCluster {
    /// Starts the nodes and creates the cluster; waits until it reports `cluster_state:ok`.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        let nodes: Vec<Redis> = (0..masters * (1 + replicas)).map(|_| Redis::with_args(&CLUSTER_ARGS)).collect();
        RedisCluster::create(nodes, replicas, &[], false)
    }

    /// [`RedisCluster::start`] over TLS only, with `pki`'s certificates (client certificates
    /// required): clients, the cluster bus and replication all speak TLS, and the nodes announce
    /// their TLS ports.
    pub fn with_tls(pki: &crate::tls::Pki, masters: usize, replicas: usize) -> RedisCluster {
        let nodes: Vec<Redis> = (0..masters * (1 + replicas))
            .map(|_| {
                // The cluster bus listens on the port + 10000 (which `redis-cli --cluster create`
                // assumes): both free.
                let port = loop {
                    let port = free_ports(1)[0];
                    if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
                        break port;
                    }
                };
                let mut args = pki.redis_args(port);
                args.extend(CLUSTER_ARGS.iter().map(|s| s.to_string()));
                // The nodes' own connections (the bus, replication) present the client
                // certificate: the server's is for serving only.
                args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"].map(String::from));
                args.extend(["--tls-client-cert-file".into(), pki.file("client.pem"), "--tls-client-key-file".into(), pki.file("client.key")]);
                Redis::launch(port, args, pki.cli_args())
            })
            .collect();
        RedisCluster::create(nodes, replicas, &pki.cli_args(), true)
    }

    fn create(nodes: Vec<Redis>, replicas: usize, cli_args: &[String], tls: bool) -> RedisCluster {
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new(redis_cli())
            .args(cli_args)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli --cluster create");
        assert!(out.status.success(), "cluster create: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let cluster = RedisCluster { nodes, tls };
        cluster.wait_ok(Duration::from_secs(20));
        cluster
    }

    /// Waits until every live node reports `cluster_state:ok`.
    pub fn wait_ok(&self, timeout: Duration) {
        wait_until("redis cluster", timeout, || {
            self.nodes
                .iter()
                .filter(|n| n.child.is_some())
                .all(|n| n.try_cli(&["CLUSTER", "INFO"]).is_ok_and(|o| o.contains("cluster_state:ok")))
        });
    }

    /// The nodes' URLs (seeds for a cluster client): `rediss://` over TLS.
    pub fn urls(&self) -> Vec<String> {
        let scheme = if self.tls { "rediss" } else { "redis" };
        self.nodes.iter().map(|n| format!("{scheme}://127.0.0.1:{}", n.port)).collect()
    }

    /// Indices of the nodes that are masters now.
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].child.is_some())
            .filter(|&i| self.nodes[i].try_cli(&["ROLE"]).is_ok_and(|o| o.starts_with("master")))
            .collect()
    }
}

/// `floodgate-sync`, talking to Redis.
pub struct SyncService {
    child: Option<Child>,
    /// Where it listens.
    pub addr: SocketAddr,
    args: Vec<String>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

/// `count` Envoys with 2 workers each, running `config`, whose cluster `floodgate-sync` (HTTP/2)
/// is the service at `sync`.
pub fn fleet(count: usize, config: &Value, sync: SocketAddr, upstream: &Upstream) -> Vec<Envoy> {
    fleet_with(count, config, sync, |envoy| envoy.upstream(upstream))
}

/// [`fleet`] in front of an LLM API (a [`crate::LlmUpstream`] at `upstream`), loading the module
/// that reads response bodies ([`crate::llm_wasm_module`]), with `allow_on_headers_stop_iteration`
/// (a request that waits for its body's estimate gets its body: docs/llm.md).
pub fn llm_fleet(count: usize, config: &Value, sync: SocketAddr, upstream: SocketAddr) -> Vec<Envoy> {
    fleet_with(count, config, sync, |envoy| envoy.module(crate::llm_wasm_module()).allow_on_headers_stop_iteration().upstream_at(upstream))
}

fn fleet_with(count: usize, config: &Value, sync: SocketAddr, setup: impl Fn(EnvoyBuilder) -> EnvoyBuilder) -> Vec<Envoy> {
    (0..count)
        .map(|_| setup(Envoy::builder(config.clone())).http2_cluster("floodgate-sync", &[sync]).concurrency(2).start())
        .collect()
}

impl SyncService {
    /// Starts it in front of the single node at `redis_url`.
    pub fn single(redis_url: &str) -> SyncService {
        SyncService::start(vec!["--redis".into(), redis_url.into()])
    }

    /// Starts it in front of a Redis Cluster with these seeds.
    pub fn cluster(seeds: &[String]) -> SyncService {
        SyncService::start(vec!["--cluster".into(), "--redis".into(), seeds.join(",")])
    }

    /// Starts it with these arguments (`--redis` and the rest; the address and the Redis
    /// timeout are added).
    pub fn start(mut args: Vec<String>) -> SyncService {
        let port = free_ports(1)[0];
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        args.extend(["--listen".into(), addr.to_string(), "--redis-timeout".into(), "500ms".into()]);
        let dir = tempfile::tempdir().expect("tempdir");
        let mut service = SyncService { child: None, addr, args, log: dir.path().join("sync.log"), _dir: dir };
        service.spawn();
        service
    }

    /// The value of one series of its `/metrics` (`name{labels}`), which it must have.
    pub fn metric(&self, series: &str) -> u64 {
        let (_, text) = crate::http_get_blocking(self.addr, "/metrics").expect("/metrics");
        text.lines()
            .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .parse()
            .expect("a number")
    }

    fn spawn(&mut self) {
        let log = std::fs::File::options().create(true).append(true).open(&self.log).expect("log");
        let child = Command::new(sync_binary())
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start floodgate-sync");
        self.child = Some(child);
        let addr = self.addr;
        wait_until("floodgate-sync", Duration::from_secs(10), || {
            crate::http_get_blocking(addr, "/healthz").is_ok_and(|(s, _)| s == 200)
        });
    }

    /// Kills it (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the process (SIGSTOP): a partition as the proxies see it, connections open and
    /// nothing answered.
    pub fn pause(&self) {
        signal(self.child.as_ref(), "STOP");
    }

    /// Resumes it (SIGCONT): what it received meanwhile is answered, late.
    pub fn resume(&self) {
        signal(self.child.as_ref(), "CONT");
    }

    /// Starts it again on the same address.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

impl Drop for SyncService {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}
