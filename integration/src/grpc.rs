//! The gRPC tests' real components: a gRPC server and client of gRPC's own C core (grpcio,
//! driven by `integration/grpc/peer.py`), and nghttp2's HTTP/2 load generator `h2load`.
//!
//! * Python with grpcio: `$GRPC_PYTHON`, else `<workspace>/.venv/bin/python` (where
//!   `scripts/grpc.sh`, run by `./test.sh`, installs grpcio).
//! * h2load: `$H2LOAD_BIN`, else `h2load` on the PATH (`scripts/h2load.sh` installs Debian's
//!   `nghttp2-client`).
//!
//! A missing one fails the test with a message saying how to get it; nothing is skipped. Every
//! process listens on or talks to 127.0.0.1 only, every wait is bounded, and a server is killed
//! when dropped (it also exits by itself when the test process dies: its stdin closes).

use crate::store::which;
use crate::workspace_root;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a server may take to listen.
const SERVER_START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long one client run may take.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(90);

/// The Python that has grpcio (checked once).
pub fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| crate::artifacts::venv_python("GRPC_PYTHON", "grpc", "scripts/grpc.sh"))
        .clone()
}

fn peer() -> PathBuf {
    workspace_root().join("integration/grpc/peer.py")
}

/// `h2load`.
pub fn h2load_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("H2LOAD_BIN") {
        return PathBuf::from(p);
    }
    which("h2load").unwrap_or_else(|| {
        panic!("h2load is not installed and H2LOAD_BIN is unset: run ./test.sh (scripts/h2load.sh installs nghttp2-client)")
    })
}

/// Waits for `child` at most `limit` (reading its output meanwhile, so that it never blocks on
/// a full pipe); kills it past that. Returns its output and whether it finished by itself.
pub(crate) fn wait_bounded(child: Child, limit: Duration) -> (Output, bool) {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let (output, finished) = match rx.recv_timeout(limit) {
        Ok(output) => (output, true),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            (rx.recv_timeout(Duration::from_secs(10)).expect("the killed process is reaped"), false)
        }
    };
    (output.expect("child output"), finished)
}

/// A grpcio server (`peer.py serve`) on 127.0.0.1; see `integration/grpc/peer.py` for what it
/// answers and how request metadata steers it.
pub struct GrpcServer {
    child: Option<(Child, ChildStdin)>,
    addr: SocketAddr,
}

impl GrpcServer {
    /// Starts a server with `peer.py serve` options, e.g. `["--status", "14"]`.
    pub fn start(options: &[&str]) -> GrpcServer {
        let mut child = Command::new(python())
            .arg(peer())
            .args(["serve", "--watch-stdin"])
            .args(options)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", peer().display()));
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep reading, so that the server never blocks on a full pipe.
            for _ in lines {}
        });
        let line = rx
            .recv_timeout(SERVER_START_TIMEOUT)
            .unwrap_or_else(|_| panic!("the gRPC server did not report its port within {SERVER_START_TIMEOUT:?}"));
        let port = serde_json::from_str::<Value>(&line)
            .ok()
            .and_then(|v| v["port"].as_u64())
            .and_then(|p| u16::try_from(p).ok())
            .unwrap_or_else(|| panic!("unexpected first line from the gRPC server: {line}"));
        GrpcServer {
            child: Some((child, stdin)),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Calls of `method` (`Unary`, `Upload`, `Watch`) that reached it so far.
    pub fn started(&self, method: &str) -> u64 {
        let out = run_peer(&["stats", &self.addr.to_string()], Duration::from_secs(20));
        let stats: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("stats of the gRPC server ({e}): {}", String::from_utf8_lossy(&out.stdout)));
        stats["started"][method].as_u64().unwrap_or(0)
    }

    /// Stops it the way a server shuts down: SIGTERM, on which it stops accepting calls and
    /// sends GOAWAY, and cancels the calls still running after its grace period (`--grace-ms`).
    /// Waits (bounded) until it has exited.
    pub fn shut_down(&mut self) {
        GrpcServer::shut_down_all(&mut [self]);
    }

    /// Shuts several servers down at once: SIGTERM to each first, then waits (bounded) for
    /// every one to exit, so that their grace periods run together (one after the other, a
    /// slow exit of the first would let the calls on the next finish before it is told).
    pub fn shut_down_all(servers: &mut [&mut GrpcServer]) {
        let mut stopping = Vec::new();
        for server in servers.iter_mut() {
            let Some((child, stdin)) = server.child.take() else { continue };
            let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
            assert!(status.success(), "kill -TERM the gRPC server");
            stopping.push((child, stdin));
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        for (mut child, stdin) in stopping {
            while child.try_wait().expect("try_wait").is_none() {
                assert!(Instant::now() < deadline, "the gRPC server did not exit after SIGTERM");
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(stdin);
        }
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        if let Some((mut child, stdin)) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            drop(stdin);
        }
    }
}

fn run_peer(args: &[&str], limit: Duration) -> Output {
    let child = Command::new(python())
        .arg(peer())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", peer().display()));
    let (out, finished) = wait_bounded(child, limit);
    assert!(
        finished && out.status.success(),
        "peer.py {args:?} {}: {}",
        if finished { "failed" } else { "did not finish in time" },
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// What a client run saw: calls per gRPC status code name, and every call (`code`, `details`,
/// `initial` and `trailing` metadata, `elapsed_ms`) in the order they finished.
#[derive(Clone, Debug)]
pub struct Calls {
    /// Calls per code name (`"OK"`, `"RESOURCE_EXHAUSTED"`, …).
    pub codes: BTreeMap<String, u64>,
    /// Every call.
    pub calls: Vec<Value>,
}

impl Calls {
    /// Calls that ended with `code`.
    pub fn count(&self, code: &str) -> u64 {
        self.codes.get(code).copied().unwrap_or(0)
    }

    /// Every call.
    pub fn total(&self) -> u64 {
        self.codes.values().sum()
    }

    /// The calls that ended with `code`.
    pub fn with_code<'a>(&'a self, code: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
        self.calls.iter().filter(move |c| c["code"] == code)
    }
}

/// Runs the gRPC client: `peer.py <args>` (`call`, `cancel` or `close`, see
/// `integration/grpc/peer.py`), bounded in time; returns what its calls ended with.
pub fn client(args: &[&str]) -> Calls {
    let out = run_peer(args, CLIENT_TIMEOUT);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("peer.py {args:?} printed no JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    let codes = v["codes"]
        .as_object()
        .map(|m| m.iter().map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0))).collect())
        .unwrap_or_default();
    let calls = v["calls"].as_array().cloned().unwrap_or_default();
    Calls { codes, calls }
}

/// [`client`] on its own thread.
pub fn client_in_background(args: &[&str]) -> std::thread::JoinHandle<Calls> {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    std::thread::spawn(move || client(&args.iter().map(String::as_str).collect::<Vec<_>>()))
}

/// What h2load reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct H2load {
    /// Requests: total, started, done, succeeded, failed, errored, timeout.
    pub requests: BTreeMap<String, u64>,
    /// Responses per status class: `2xx` … `5xx`.
    pub statuses: BTreeMap<String, u64>,
    /// Its whole output.
    pub output: String,
}

impl H2load {
    /// A `requests:` figure (`"done"`, `"succeeded"`, …).
    pub fn requests(&self, what: &str) -> u64 {
        self.requests.get(what).copied().unwrap_or(0)
    }

    /// Responses of a status class (`"2xx"`, `"5xx"`).
    pub fn status(&self, class: &str) -> u64 {
        self.statuses.get(class).copied().unwrap_or(0)
    }
}

/// `"requests: 100 total, 100 started, ..."` → {"total": 100, "started": 100, ...}.
fn figures(line: &str) -> BTreeMap<String, u64> {
    let (_, list) = line.split_once(':').unwrap_or(("", line));
    list.split(',')
        .filter_map(|item| {
            let mut words = item.split_whitespace();
            let n = words.next()?.parse().ok()?;
            Some((words.next()?.to_string(), n))
        })
        .collect()
}

/// Parses h2load's report.
pub fn parse_h2load(output: &str) -> H2load {
    let line = |prefix: &str| output.lines().find(|l| l.starts_with(prefix)).map(figures).unwrap_or_default();
    H2load {
        requests: line("requests:"),
        statuses: line("status codes:"),
        output: output.to_string(),
    }
}

fn spawn_h2load(args: &[&str]) -> Child {
    Command::new(h2load_binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start h2load: {e}"))
}

/// Runs h2load with `args` (its target URL among them) and waits for its report, at most
/// `limit`.
pub fn h2load(args: &[&str], limit: Duration) -> H2load {
    let (out, finished) = wait_bounded(spawn_h2load(args), limit);
    let output = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        finished && out.status.success(),
        "h2load {args:?} {}: {output}{}",
        if finished { "failed" } else { "did not finish in time" },
        String::from_utf8_lossy(&out.stderr)
    );
    parse_h2load(&output)
}

/// Runs h2load with `args` and SIGKILLs it after `after`, mid-load: its connections end at
/// once, with their streams open.
pub fn h2load_killed_after(args: &[&str], after: Duration) {
    let (_, finished) = wait_bounded(spawn_h2load(args), after);
    assert!(!finished, "h2load {args:?} finished before it was killed: give it more work");
}

/// A gRPC message frame for a request body: the 5-byte prefix (not compressed, length) and
/// `message`.
pub fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(message.len()).expect("a small message").to_be_bytes());
    frame.extend_from_slice(message);
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_h2load_reports() {
        let report = "finished in 2.01s, 995.02 req/s, 40.98KB/s\n\
                      requests: 2000 total, 2000 started, 2000 done, 1985 succeeded, 15 failed, 0 errored, 0 timeout\n\
                      status codes: 1985 2xx, 0 3xx, 0 4xx, 15 5xx\n";
        let r = parse_h2load(report);
        assert_eq!(r.requests("total"), 2000);
        assert_eq!(r.requests("succeeded"), 1985);
        assert_eq!(r.requests("timeout"), 0);
        assert_eq!(r.status("2xx"), 1985);
        assert_eq!(r.status("5xx"), 15);
        assert_eq!(parse_h2load("nothing"), H2load { output: "nothing".into(), ..H2load::default() });
    }

    #[test]
    fn frames_a_message() {
        assert_eq!(grpc_frame(b"hi"), vec![0, 0, 0, 0, 2, b'h', b'i']);
    }
}
