//! The load-shedding filter configuration that several tests share, the health endpoint it
//! exposes, and the load that makes a worker's event loop lag (a Lua filter burning CPU, driven
//! by `curl` loops).

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

use crate::client::{get, Response};

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

/// A Lua filter after floodgate that burns `x-burn` iterations of CPU on the worker per request
/// (about 8 ms per million on this project's machine): what makes a worker's event loop lag.
pub const BURN_LUA: &str = "function envoy_on_request(h) \
    local n = tonumber(h:headers():get('x-burn') or '0') or 0 \
    local x = 0 \
    for i = 1, n do x = (x + i) % 1000003 end \
    h:headers():add('x-burned', tostring(x)) \
end";

/// Client processes, each a shell loop of `curl` sending requests of class `class` that burn
/// `burn` iterations, one after another (a new connection each), until [`Burners::stop`]: load
/// from outside the test process, which a busy test runtime cannot thin out.
pub struct Burners {
    children: Vec<std::process::Child>,
    stop_file: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Burners {
    pub fn start(addr: std::net::SocketAddr, clients: usize, class: &str, burn: u64) -> Burners {
        let dir = tempfile::tempdir().expect("tempdir");
        let stop_file = dir.path().join("stop");
        let script = format!(
            "while [ ! -e '{stop}' ]; do curl -s -o /dev/null -w '%{{http_code}}\\n' --max-time 20 \
             -H 'x-floodgate-priority: {class}' -H 'x-burn: {burn}' http://{addr}/work; done",
            stop = stop_file.display()
        );
        let children = (0..clients)
            .map(|_| {
                std::process::Command::new("sh")
                    .arg("-c")
                    .arg(&script)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("sh and curl")
            })
            .collect();
        Burners { children, stop_file, _dir: dir }
    }

    /// Stops the loops (each finishes its request) and returns (admitted, shed).
    pub fn stop(self) -> (u64, u64) {
        std::fs::write(&self.stop_file, b"").expect("stop file");
        let (mut ok, mut shed) = (0, 0);
        for child in self.children {
            let out = child.wait_with_output().expect("a burner");
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                match line.trim() {
                    "200" => ok += 1,
                    "503" => shed += 1,
                    other => panic!("unexpected status {other:?}"),
                }
            }
        }
        (ok, shed)
    }
}

/// The Lua filter's iterations per millisecond on this machine, with the proxy idle: the
/// median over 5 requests of (time with `x-burn: 4000000` − time without). The lag test sizes
/// its load in milliseconds of work, not iterations, so a machine twice as fast or slow as the
/// one it was written on makes the loop lag as much.
pub async fn burn_rate_per_ms(addr: std::net::SocketAddr) -> u64 {
    const PROBE: u64 = 4_000_000;
    let burn = PROBE.to_string();
    let mut samples = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        assert_eq!(crate::client::get(addr, "/work", &[]).await.status, 200);
        let base = started.elapsed();
        let started = Instant::now();
        assert_eq!(crate::client::get(addr, "/work", &[("x-burn", &burn)]).await.status, 200);
        let burnt = started.elapsed().saturating_sub(base).as_secs_f64() * 1000.0;
        samples.push(burnt.max(1.0));
    }
    samples.sort_by(f64::total_cmp);
    let ms = samples[samples.len() / 2];
    println!("calibration: {PROBE} iterations in {ms:.1} ms (samples {samples:.1?})");
    ((PROBE as f64 / ms) as u64).max(1)
}

/// One request on its own connection: its status, latency and response.
pub type Pending = JoinHandle<(u16, Duration, Response)>;

/// `n` requests `GET /work` in the priority class `class`, each on its own connection, at once.
pub fn send_prioritized(addr: std::net::SocketAddr, class: &'static str, n: usize) -> Vec<Pending> {
    (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let started = Instant::now();
                let r = get(addr, "/work", &[("x-floodgate-priority", class)]).await;
                (r.status, started.elapsed(), r)
            })
        })
        .collect()
}

/// Waits for every request; returns (admitted 200s, shed 503s), checking every shed answer was
/// fast (under a fifth of `upstream_delay`, the time an admitted request takes) and well-formed
/// for [`shedding_config`].
pub async fn shed_outcome(pending: Vec<Pending>, class: &str, upstream_delay: Duration) -> (usize, usize) {
    let (mut ok, mut shed) = (0, 0);
    for p in pending {
        let (status, latency, r) = p.await.expect("request task");
        match status {
            200 => ok += 1,
            503 => {
                shed += 1;
                assert!(
                    latency < upstream_delay / 5,
                    "a shed request must be refused fast: {latency:?} (upstream delay {upstream_delay:?})"
                );
                assert_eq!(r.header("content-type"), Some("application/problem+json"));
                assert_eq!(r.header("retry-after"), Some("2"));
                let body = r.json();
                assert_eq!(
                    body["type"],
                    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
                );
                assert_eq!(body["status"], 503);
                assert_eq!(body["class"], class);
                assert!(body["in_flight"].as_u64().is_some(), "{body}");
                assert!(body["max_active_requests"].as_u64().is_some(), "{body}");
            }
            other => panic!("unexpected status {other}: {}", r.text()),
        }
    }
    (ok, shed)
}
