//! Faults for the reliability tests: an upstream in its own process (to be SIGKILLed mid-load
//! and started again on the same port), an upstream that accepts connections and never answers,
//! and clients that hang up mid-request in several ways.
//!
//! Everything binds 127.0.0.1; every wait is bounded; processes and threads stop on drop.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long an [`UpstreamProcess`] may take to listen.
const PROCESS_START_TIMEOUT: Duration = Duration::from_secs(10);

/// The `floodgate-upstream` binary in its own process (pass `env!("CARGO_BIN_EXE_floodgate-upstream")`
/// from a test). Killed on drop; it also exits by itself when the test process dies (its stdin
/// closes).
pub struct UpstreamProcess {
    bin: PathBuf,
    delay: Duration,
    addr: SocketAddr,
    child: Option<(Child, ChildStdin)>,
}

impl UpstreamProcess {
    /// Starts it on an ephemeral port, answering after `delay`.
    pub fn start(bin: &Path, delay: Duration) -> UpstreamProcess {
        let (child, addr) = spawn_upstream(bin, 0, delay);
        UpstreamProcess {
            bin: bin.to_path_buf(),
            delay,
            addr,
            child: Some(child),
        }
    }

    /// Where it listens (the same address after [`Self::restart`]).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|(c, _)| c.id())
    }

    /// SIGKILLs the process (every connection it had ends at once) and reaps it.
    pub fn kill(&mut self) {
        if let Some((mut child, stdin)) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            drop(stdin);
        }
    }

    /// Starts it again on the same port (retrying the bind for a few seconds).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + PROCESS_START_TIMEOUT;
        loop {
            match try_spawn_upstream(&self.bin, self.addr.port(), self.delay) {
                Ok((child, addr)) => {
                    assert_eq!(addr, self.addr);
                    self.child = Some(child);
                    return;
                }
                Err(e) if Instant::now() < deadline => {
                    eprintln!("restarting the upstream on {}: {e}; retrying", self.addr);
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("cannot restart the upstream on {}: {e}", self.addr),
            }
        }
    }
}

impl Drop for UpstreamProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

fn spawn_upstream(bin: &Path, port: u16, delay: Duration) -> ((Child, ChildStdin), SocketAddr) {
    try_spawn_upstream(bin, port, delay).unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()))
}

fn try_spawn_upstream(bin: &Path, port: u16, delay: Duration) -> Result<((Child, ChildStdin), SocketAddr), String> {
    let mut child = Command::new(bin)
        .arg(port.to_string())
        .arg(delay.as_millis().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
    let stdin = child.stdin.take().ok_or("no stdin")?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(PROCESS_START_TIMEOUT).unwrap_or_default();
    match line.trim().parse::<SocketAddr>() {
        Ok(addr) => Ok(((child, stdin), addr)),
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("the upstream did not start (printed {line:?})"))
        }
    }
}

/// An upstream that accepts connections, reads what it is sent, and never answers: requests to
/// it hang until the route timeout (or forever). Stops on drop, closing every connection.
pub struct HangingUpstream {
    addr: SocketAddr,
    accepted: Arc<AtomicU64>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HangingUpstream {
    /// Starts it on `127.0.0.1:<ephemeral>`.
    pub fn start() -> HangingUpstream {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("address");
        let accepted = Arc::new(AtomicU64::new(0));
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let counter = accepted.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("listener");
                loop {
                    tokio::select! {
                        _ = &mut rx => break,
                        accepted = listener.accept() => {
                            let Ok((mut stream, _)) = accepted else { continue };
                            counter.fetch_add(1, Ordering::SeqCst);
                            tokio::spawn(async move {
                                let mut sink = [0u8; 4096];
                                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                            });
                        }
                    }
                }
            });
        });
        HangingUpstream {
            addr,
            accepted,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections it accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for HangingUpstream {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How a client hangs up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HangUp {
    /// Sends complete request headers (the request reaches the upstream), then closes.
    AfterHeaders,
    /// Sends headers announcing a body and part of the body, then closes.
    MidBody,
    /// Sends part of the request headers, then closes (the filter never sees the request).
    MidHeaders,
}

/// Opens a connection, sends a request as `how` says, waits `hold`, then closes it: with a
/// reset (`SO_LINGER` 0) when `reset`, else with a FIN. `headers` are added to the request.
pub async fn hang_up(
    addr: SocketAddr,
    how: HangUp,
    headers: &[(&str, &str)],
    hold: Duration,
    reset: bool,
) -> std::io::Result<()> {
    let mut stream = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr)).await??;
    stream.set_nodelay(true)?;
    let mut request = String::from("POST /work HTTP/1.1\r\nhost: floodgate.test\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    match how {
        HangUp::AfterHeaders => request.push_str("content-length: 0\r\n\r\n"),
        HangUp::MidBody => request.push_str("content-length: 100000\r\n\r\nfirst part of a body that never ends"),
        HangUp::MidHeaders => request.push_str("x-incomplete: the headers never en"),
    }
    stream.write_all(request.as_bytes()).await?;
    stream.flush().await?;
    tokio::time::sleep(hold).await;
    if reset {
        stream.set_zero_linger()?;
    }
    drop(stream);
    Ok(())
}
