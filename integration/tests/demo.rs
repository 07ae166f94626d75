//! The demo (`envoy/demo.yaml`, what `./demo.sh` runs) started for real and probed the way the
//! README's commands do: a 429 with its fields, a shed 503, the health endpoint, and cluster
//! selection steering away from the flaky zone-c. Its fixed ports are swapped for free ones.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use floodgate_integration::*;

struct Demo {
    child: Child,
    dir: tempfile::TempDir,
    front: SocketAddr,
    admin: SocketAddr,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts Envoy with the demo config, its ports (9901, 10000 to 10003) replaced by free ones
/// and the module path made absolute.
fn start_demo() -> Demo {
    start_demo_edited(|text| text)
}

/// [`start_demo`] with the demo config's text passed through `edit` first.
fn start_demo_edited(edit: impl FnOnce(String) -> String) -> Demo {
    let root = workspace_root();
    let mut text = edit(std::fs::read_to_string(root.join("envoy/demo.yaml")).expect("read envoy/demo.yaml"));
    let fixed_ports = [9901u16, 10000, 10001, 10002, 10003];
    let ports = free_ports(fixed_ports.len());
    for (fixed, port) in fixed_ports.into_iter().zip(ports.iter().copied()) {
        let needle = format!("port_value: {fixed}");
        assert!(text.contains(&needle), "demo.yaml no longer uses {needle}");
        text = text.replace(&needle, &format!("port_value: {port}"));
    }
    let module = "target/wasm32-wasip1/release/floodgate.wasm";
    assert!(text.contains(module), "demo.yaml no longer loads {module}");
    text = text.replace(module, &wasm_module().display().to_string());
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("demo.yaml");
    std::fs::write(&config, text).expect("write config");
    let log = std::fs::File::create(dir.path().join("envoy.log")).expect("log");
    let child = Command::new(envoy_binary())
        .args(["--concurrency", "2", "--disable-hot-restart", "-l", "info", "-c"])
        .arg(&config)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .expect("start envoy");
    let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let demo = Demo { child, dir, front: at(ports[1]), admin: at(ports[0]) };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((200, body)) = http_get_blocking(demo.admin, "/ready") {
            if body.trim() == "LIVE" {
                return demo;
            }
        }
        assert!(Instant::now() < deadline, "the demo did not start:\n{}", tail(&log_of(demo.dir.path()), 40));
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn log_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("envoy.log")).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_steering_a_429_a_shed_503_and_health() {
    let demo = start_demo();
    let addr = demo.front;

    // Cluster selection: 300 requests one after another, as the README's loop sends them.
    let mut bodies = std::collections::BTreeMap::<String, u64>::new();
    let mut client = Client::connect(addr).await.unwrap();
    for _ in 0..300 {
        let r = client.get("/", &[]).await.unwrap();
        *bodies.entry(format!("{} {}", r.status, r.text().trim())).or_default() += 1;
    }
    println!("300 requests: {bodies:?}");
    let zone = |name: &str| bodies.get(&format!("200 {name}")).copied().unwrap_or(0);
    let failed: u64 = bodies.iter().filter(|(k, _)| k.starts_with("503")).map(|(_, v)| v).sum();
    assert!(zone("zone-a") > 100 && zone("zone-b") > 100, "{bodies:?}");
    assert!(failed <= 5, "zone-c's failures are learned after a few: {bodies:?}");

    // Rate limiting: five 200s, then a 429 with every field.
    let statuses: Vec<u16> = {
        let mut out = Vec::new();
        for _ in 0..7 {
            out.push(client.get("/", &[("x-api-key", "demo")]).await.unwrap().status);
        }
        out
    };
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
    let refused = client.get("/", &[("x-api-key", "demo")]).await.unwrap();
    assert_eq!(refused.status, 429);
    for header in ["retry-after", "ratelimit-policy", "ratelimit"] {
        assert!(refused.header(header).is_some(), "{header} missing: {:?}", refused.headers);
    }
    assert_eq!(refused.json()["violated-policies"], json!(["per-api-key"]));

    // Load shedding: 12 slow concurrent requests, 10 in flight at most, normal class from 9.
    let pending: Vec<_> = (0..12)
        .map(|i| {
            tokio::spawn(async move {
                let key = format!("k{i}");
                get(addr, "/", &[("x-api-key", key.as_str()), ("x-envoy-fault-delay-request", "2000")]).await.status
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let health = get(addr, "/floodgate/health", &[]).await;
    assert_eq!(health.status, 503, "{}", health.text());
    let mut shed = (0, 0);
    for p in pending {
        match p.await.unwrap() {
            200 => shed.0 += 1,
            503 => shed.1 += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(shed, (9, 3), "(200s, 503s) of 12 slow requests");
    let health = get(addr, "/floodgate/health", &[]).await;
    assert_eq!(health.status, 200, "{}", health.text());

    // The metrics the README points at.
    let (status, stats) = http_get_blocking(demo.admin, "/stats").unwrap();
    assert_eq!(status, 200);
    for name in [
        "wasmcustom.floodgate.rate_limit.per-api-key.rejected: 3",
        "wasmcustom.floodgate.load_shedding.normal.shed: 3",
        "wasmcustom.floodgate.cluster.zone-c.selected",
    ] {
        assert!(stats.contains(name), "{name} not in /stats");
    }
}

/// With the demo's connection manager settings, `source_ip` is the TCP peer's address: a client
/// that writes its own `x-forwarded-for` gets no fresh per-IP quota (with Envoy's default
/// `use_remote_address: false` it did: Envoy took the address from the header's last entry).
/// The demo's per-ip limit is lowered to 3 so that a few requests reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spoofed_x_forwarded_for_gets_no_fresh_per_ip_quota() {
    let per_ip = r#"{"name": "per-ip", "key": ["source_ip"], "limit": 1000, "window": "1m"}"#;
    let demo = start_demo_edited(|text| {
        assert!(text.contains(per_ip), "envoy/demo.yaml no longer has {per_ip}");
        text.replace(per_ip, &per_ip.replace("1000", "3"))
    });
    // Clear of the epoch-aligned minute boundary, so that the six requests share one window bucket.
    wait_for_window_phase(Duration::from_secs(60), Duration::from_millis(200), Duration::from_secs(50));
    let mut statuses = Vec::new();
    let mut last = None;
    for i in 1..=6 {
        let spoofed = format!("203.0.113.{i}");
        let response = get(demo.front, "/", &[("x-forwarded-for", spoofed.as_str())]).await;
        statuses.push(response.status);
        last = Some(response);
    }
    println!("six requests, each with another x-forwarded-for: {statuses:?}");
    assert!(statuses[..3].iter().all(|s| *s != 429), "{statuses:?}");
    assert_eq!(statuses[3..], [429, 429, 429], "a spoofed x-forwarded-for got fresh per-IP quota");
    let last = last.expect("a response");
    assert_eq!(last.json()["violated-policies"], json!(["per-ip"]));
}
