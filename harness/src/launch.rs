//! Starting Envoy, waiting until it is ready, and stopping it.
//!
//! [`Launch`] holds how to run Envoy (binary, wrapper command, arguments, environment, how long
//! to wait). [`Launch::start_with`] writes a bootstrap into a temporary directory, starts Envoy on
//! it with its log (stderr) in `envoy.log` there and its admin address in `admin-address`, and
//! waits until `GET /ready` on the admin API answers `LIVE`. A bootstrap with fixed ports picked
//! free beforehand can lose one to another process before Envoy binds it: Envoy then exits with
//! `Address already in use`, and the launch starts it again on a bootstrap made afresh (so on
//! other ports), up to [`Launch::attempts`] times. [`Running`] reports the addresses Envoy
//! actually bound: its admin API and each listener by name.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::http::http_get;
use crate::tail;

/// What Envoy writes when a port it is to bind is taken (a listener's or the admin API's).
const PORT_TAKEN: &str = "Address already in use";

/// The log file in Envoy's directory.
const LOG_FILE: &str = "envoy.log";

/// The file Envoy writes its admin address to (`--admin-address-path`).
const ADMIN_ADDRESS_FILE: &str = "admin-address";

/// How many lines of Envoy's log an error or a failing test shows.
const LOG_LINES: usize = 60;

/// How long [`Launch::start_with`] waits for Envoy to become ready.
#[derive(Clone, Copy, Debug)]
pub enum Wait {
    /// At most this long (wall-clock time).
    For(Duration),
    /// For as long as Envoy works towards it: it fails when the process has used no CPU time for
    /// `stall`, or after `cap` in all. For an Envoy under valgrind, whose start takes minutes of
    /// CPU time: on a loaded machine it gets a fraction of a core, and a bound on the wall-clock
    /// time alone gives up on an Envoy that is starting, slowly.
    WhileWorking {
        /// No CPU time used for this long: give up.
        stall: Duration,
        /// Give up after this long in all.
        cap: Duration,
    },
}

/// How to run Envoy; [`Launch::start_with`] runs it.
#[derive(Clone, Debug)]
pub struct Launch {
    binary: PathBuf,
    wrapper: Vec<OsString>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    current_dir: Option<PathBuf>,
    concurrency: usize,
    log_level: String,
    prefix: String,
    attempts: u32,
    wait: Wait,
}

impl Launch {
    /// Envoy `binary` with 2 workers, `--disable-hot-restart`, log level `info`, 3 attempts, and
    /// 60 s to become ready (V8 compiles the module once per VM).
    pub fn new(binary: impl Into<PathBuf>) -> Launch {
        Launch {
            binary: binary.into(),
            wrapper: Vec::new(),
            args: Vec::new(),
            env: Vec::new(),
            current_dir: None,
            concurrency: 2,
            log_level: "info".into(),
            prefix: "floodgate-envoy-".into(),
            attempts: 3,
            wait: Wait::For(Duration::from_secs(60)),
        }
    }

    /// Runs Envoy under this command (e.g. `taskset -c 0`, valgrind and its options).
    pub fn wrapper<S: Into<OsString>>(mut self, command: impl IntoIterator<Item = S>) -> Launch {
        self.wrapper.extend(command.into_iter().map(Into::into));
        self
    }

    /// Adds arguments to Envoy's command line.
    pub fn args<S: Into<OsString>>(mut self, args: impl IntoIterator<Item = S>) -> Launch {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds variables to Envoy's environment.
    pub fn env<K: Into<OsString>, V: Into<OsString>>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> Launch {
        self.env.extend(vars.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }

    /// Envoy's working directory (default: its temporary directory, see [`Running::dir`]).
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Launch {
        self.current_dir = Some(dir.into());
        self
    }

    /// Worker threads (`--concurrency`, default 2).
    pub fn concurrency(mut self, n: usize) -> Launch {
        self.concurrency = n;
        self
    }

    /// Envoy's log level (`-l`, default `info`).
    pub fn log_level(mut self, level: &str) -> Launch {
        self.log_level = level.to_owned();
        self
    }

    /// The prefix of the temporary directory's name.
    pub fn dir_prefix(mut self, prefix: &str) -> Launch {
        self.prefix = prefix.to_owned();
        self
    }

    /// How many times at most Envoy is started when a port it is to bind was taken (default 3).
    pub fn attempts(mut self, n: u32) -> Launch {
        self.attempts = n.max(1);
        self
    }

    /// How long to wait for Envoy to become ready (default: 60 s).
    pub fn wait(mut self, wait: Wait) -> Launch {
        self.wait = wait;
        self
    }

    /// Starts Envoy on `bootstrap` (JSON or YAML text) and waits until it is ready. `Err` says
    /// why not, with the end of Envoy's log.
    pub fn start(&self, bootstrap: &str) -> Result<Running, String> {
        self.start_with(|| bootstrap.to_owned())
    }

    /// Starts Envoy on the bootstrap `make` returns and waits until it is ready; when Envoy exits
    /// because a port it was to bind is taken, starts it again on a bootstrap `make` returns
    /// afresh (picking other ports), up to [`Launch::attempts`] times.
    pub fn start_with<'a>(&self, make: impl FnMut() -> String + 'a) -> Result<Running, String> {
        self.spawn_with(make)?.wait_ready()
    }

    /// Starts Envoy on the bootstrap `make` returns, without waiting (several Envoys can then
    /// start side by side); [`Spawned::wait_ready`] waits, starting it again as
    /// [`Launch::start_with`] does.
    pub fn spawn_with<'a>(&self, mut make: impl FnMut() -> String + 'a) -> Result<Spawned<'a>, String> {
        let process = self.spawn(&make())?;
        Ok(Spawned { launch: self.clone(), make: Box::new(make), process, attempt: 1 })
    }

    /// Starts Envoy on `bootstrap` once, without waiting (for a bootstrap Envoy should refuse,
    /// say: see [`Running::wait_exit`] and [`Running::is_ready`]).
    pub fn spawn(&self, bootstrap: &str) -> Result<Running, String> {
        let dir = tempfile::Builder::new().prefix(&self.prefix).tempdir().map_err(|e| format!("temporary directory: {e}"))?;
        // Envoy parses a file by its extension (and JSON is YAML too).
        let json = bootstrap.trim_start().starts_with('{');
        let path = dir.path().join(if json { "bootstrap.json" } else { "bootstrap.yaml" });
        std::fs::write(&path, bootstrap).map_err(|e| format!("write {}: {e}", path.display()))?;
        let log = std::fs::File::create(dir.path().join(LOG_FILE)).map_err(|e| format!("create {LOG_FILE}: {e}"))?;
        let mut command = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(&self.binary);
                command
            }
            None => Command::new(&self.binary),
        };
        command
            .arg("-c")
            .arg(&path)
            .arg("--concurrency")
            .arg(self.concurrency.to_string())
            .arg("--disable-hot-restart")
            .arg("-l")
            .arg(&self.log_level)
            .arg("--admin-address-path")
            .arg(dir.path().join(ADMIN_ADDRESS_FILE))
            .args(&self.args)
            .current_dir(self.current_dir.as_deref().unwrap_or(dir.path()))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // Line by line (`--log-path` would buffer for up to 10 s).
            .stderr(Stdio::from(log));
        let child = command.spawn().map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        Ok(Running { child, dir, admin: None, listeners: BTreeMap::new() })
    }
}

/// An Envoy started by [`Launch::spawn_with`], not yet known to be ready.
pub struct Spawned<'a> {
    launch: Launch,
    make: Box<dyn FnMut() -> String + 'a>,
    process: Running,
    attempt: u32,
}

impl Spawned<'_> {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Waits until Envoy is ready (see [`Launch::start_with`]), as long as [`Launch::wait`] says.
    pub fn wait_ready(self) -> Result<Running, String> {
        let wait = self.launch.wait;
        self.wait_ready_within(wait)
    }

    /// Waits until Envoy is ready (see [`Launch::start_with`]), as long as `wait` says.
    pub fn wait_ready_within(mut self, wait: Wait) -> Result<Running, String> {
        loop {
            match self.process.wait_ready(wait) {
                Ok(()) => return Ok(self.process),
                Err(_) if self.attempt < self.launch.attempts && self.process.port_taken() => {
                    let log = self.process.log();
                    let line = log.lines().find(|l| l.contains(PORT_TAKEN)).unwrap_or(PORT_TAKEN).trim();
                    eprintln!(
                        "Envoy (start {} of at most {}): a port was taken before it bound it ({line}); starting again on others",
                        self.attempt, self.launch.attempts
                    );
                    self.attempt += 1;
                    self.process = self.launch.spawn(&(self.make)())?;
                }
                Err(why) => return Err(why),
            }
        }
    }
}

/// A running Envoy; killed when dropped. If the thread is panicking (a failing test), the end of
/// its log is printed first.
pub struct Running {
    child: Child,
    dir: tempfile::TempDir,
    admin: Option<SocketAddr>,
    listeners: BTreeMap<String, SocketAddr>,
}

impl Running {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its temporary directory: the bootstrap, the log, and (unless [`Launch::current_dir`] says
    /// otherwise) its working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Its log so far (stderr).
    pub fn log(&self) -> String {
        let bytes = std::fs::read(self.dir.path().join(LOG_FILE)).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The end of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log(), lines)
    }

    /// The admin API's address (once ready).
    pub fn admin(&self) -> Option<SocketAddr> {
        self.admin.or_else(|| self.read_admin_address())
    }

    /// The address listener `name` bound (once ready; the static listeners and those known then).
    pub fn listener(&self, name: &str) -> Option<SocketAddr> {
        self.listeners.get(name).copied()
    }

    /// Every listener's address by name, as known once ready.
    pub fn listeners(&self) -> &BTreeMap<String, SocketAddr> {
        &self.listeners
    }

    /// Whether the admin API answers `GET /ready` with `LIVE`.
    pub fn is_ready(&self) -> bool {
        self.admin()
            .and_then(|admin| http_get(admin, "/ready").ok())
            .is_some_and(|(status, body)| status == 200 && body.trim() == "LIVE")
    }

    /// Whether Envoy has exited, and how.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits (at most `timeout`) until Envoy exits, or becomes ready (`Ok(None)`), or neither
    /// (`Err`). For a bootstrap Envoy should refuse.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Option<ExitStatus>, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit() {
                return Ok(Some(status));
            }
            if self.is_ready() {
                return Ok(None);
            }
            if Instant::now() >= deadline {
                return Err(format!("Envoy kept running for {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops Envoy (SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether Envoy exited because a port it was to bind is taken.
    fn port_taken(&mut self) -> bool {
        self.try_exit().is_some() && self.log().contains(PORT_TAKEN)
    }

    fn read_admin_address(&self) -> Option<SocketAddr> {
        std::fs::read_to_string(self.dir.path().join(ADMIN_ADDRESS_FILE)).ok().and_then(|s| s.trim().parse().ok())
    }

    /// Waits until ready, then learns its admin address and listeners. `Err`: why not, with the
    /// end of its log.
    fn wait_ready(&mut self, wait: Wait) -> Result<(), String> {
        let started = Instant::now();
        let mut progress = (0, started);
        let fail = |envoy: &Running, why: String| Err(format!("Envoy {why}; end of its log:\n{}", envoy.log_tail(LOG_LINES)));
        loop {
            if let Some(status) = self.try_exit() {
                return fail(self, format!("exited ({status}) instead of becoming ready"));
            }
            if self.is_ready() {
                break;
            }
            let why = match wait {
                Wait::For(limit) => (started.elapsed() > limit).then(|| format!("not ready after {limit:?}")),
                Wait::WhileWorking { stall, cap } => {
                    let cpu = cpu_ns_of(self.pid());
                    if cpu > progress.0 {
                        progress = (cpu, Instant::now());
                    }
                    let seconds = cpu as f64 / 1e9;
                    if progress.1.elapsed() > stall {
                        Some(format!("not ready, and no CPU time used for {stall:?} (after {seconds:.0} s of CPU time)"))
                    } else {
                        (started.elapsed() > cap).then(|| format!("not ready after {cap:?} ({seconds:.0} s of CPU time)"))
                    }
                }
            };
            if let Some(why) = why {
                return fail(self, why);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.admin = self.read_admin_address();
        let admin = self.admin.ok_or("ready, but no admin address")?;
        let (status, body) = http_get(admin, "/listeners?format=json").map_err(|e| format!("GET /listeners: {e}"))?;
        if status != 200 {
            return Err(format!("GET /listeners: {status} {body}"));
        }
        self.listeners = listener_addresses(&body)?;
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- end of Envoy's log (pid {}) ----\n{}\n----", self.pid(), self.log_tail(LOG_LINES));
        }
        self.stop();
    }
}

/// The listeners' addresses by name, from the admin API's `/listeners?format=json`.
fn listener_addresses(body: &str) -> Result<BTreeMap<String, SocketAddr>, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("/listeners: {e}: {body}"))?;
    Ok(v["listener_statuses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| {
            let address = &l["local_address"]["socket_address"];
            let ip = address["address"].as_str()?.parse().ok()?;
            let port = u16::try_from(address["port_value"].as_u64()?).ok()?;
            Some((l["name"].as_str()?.to_owned(), SocketAddr::new(ip, port)))
        })
        .collect())
}

/// CPU time of every thread of `pid` so far, in nanoseconds (the first field of
/// `/proc/<pid>/task/<tid>/schedstat`, summed; Envoy's threads live as long as it does).
pub fn cpu_ns_of(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The resident set size of process `pid` (`VmRSS` of `/proc/<pid>/status`), in bytes.
pub fn rss_bytes_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
