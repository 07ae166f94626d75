//! The demo (`envoy/demo.yaml`, what `./demo.sh` runs) started for real: the walkthrough of
//! docs/getting-started.md replayed command by command (with `bash` and `curl`, as a reader runs
//! it) against the outputs the page prints, and the client address that floodgate's `source_ip` sees. The demo's fixed
//! ports are swapped for free ones.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use floodgate_integration::*;

/// The demo's Envoy and the addresses it bound.
struct Demo {
    _envoy: Envoy,
    front: SocketAddr,
    admin: SocketAddr,
}

/// Starts Envoy with the demo config, its ports (9901, 10000 to 10003) replaced by free ones
/// and the module path made absolute.
fn start_demo() -> Demo {
    start_demo_edited(|text| text)
}

/// [`start_demo`] with the demo config's text passed through `edit` first. A port picked free
/// that another process took before Envoy bound it makes the launch start again on others.
fn start_demo_edited(edit: impl Fn(String) -> String) -> Demo {
    let envoy = Envoy::launched_with(&launch(), || demo_config(&edit).0);
    Demo { front: envoy.addr(), admin: envoy.admin_addr(), _envoy: envoy }
}

/// The page with the demo's walkthrough.
const GUIDE: &str = "docs/getting-started.md";

/// One command of the walkthrough and the output the page prints for it.
#[derive(Debug)]
struct Step {
    command: String,
    output: Vec<String>,
}

/// The walkthrough: every `$ ` line of the ```console blocks between "With the demo running"
/// and the page's next section, each with the lines the page prints after it.
fn readme_walkthrough() -> Vec<Step> {
    let readme = std::fs::read_to_string(workspace_root().join(GUIDE)).expect("read docs/getting-started.md");
    let start = readme.find("With the demo running").expect("docs/getting-started.md: no \"With the demo running\"");
    let section = &readme[start..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    let mut steps: Vec<Step> = Vec::new();
    let mut in_console = false;
    for line in section.lines() {
        if line.starts_with("```") {
            in_console = !in_console && line.trim() == "```console";
            continue;
        }
        if !in_console {
            continue;
        }
        if let Some(command) = line.strip_prefix("$ ") {
            steps.push(Step { command: command.to_owned(), output: Vec::new() });
        } else {
            steps.last_mut().expect("docs/getting-started.md: output before any command").output.push(line.to_owned());
        }
    }
    steps
}

/// How a step's output is checked against the page's.
#[derive(Clone, Copy, Debug)]
enum Check {
    /// Line for line.
    Exact,
    /// `uniq -c` counts of 300 answers: zone-a and zone-b over 100 each, zone-c's (its failures,
    /// "fault filter abort", and its rare successes) at most 10: a success among zone-c's first
    /// answers (one in ten) keeps its success rate above zero, and success-rate³ weighting still
    /// sends it a request now and then; the page's example obeys the same bounds.
    ClusterCounts,
    /// The same metric names as the page; zone-c's `failure` and `selected` agree with the
    /// previous step's counts.
    ZoneCStats,
    /// Line for line once every number is `#` and the `date` header's value `<date>` (the figures
    /// of a refusal depend on the moment within the window).
    Shape,
}

/// The walkthrough's commands in order: a piece of each command, and how its output is checked.
const STEPS: &[(&str, Check)] = &[
    ("$(seq 1 300)", Check::ClusterCounts),
    ("grep 'floodgate.cluster.zone-c'", Check::ZoneCStats),
    ("$(seq 1 7)", Check::Exact),
    ("curl -i -H 'x-api-key: demo'", Check::Shape),
    ("-H 'x-plan: gold'", Check::Exact),
    ("-X POST localhost:10000/api/login", Check::Exact),
    ("$(seq 1 12)", Check::Exact),
    ("/floodgate/health", Check::Exact),
    ("(allowed|rejected|shed):", Check::Exact),
];

/// Counts of `uniq -c` output, by label; panics on a label cluster selection cannot produce.
fn cluster_counts(lines: &[String], origin: &str) -> std::collections::BTreeMap<String, u64> {
    let mut counts = std::collections::BTreeMap::new();
    for line in lines {
        let (count, label) = line.trim().split_once(' ').unwrap_or_else(|| panic!("{origin}: {line:?}"));
        let count: u64 = count.parse().unwrap_or_else(|_| panic!("{origin}: {line:?}"));
        assert!(
            ["zone-a", "zone-b", "zone-c", "fault filter abort"].contains(&label),
            "{origin}: unexpected answer {label:?}"
        );
        counts.insert(label.to_owned(), count);
    }
    let count = |label: &str| counts.get(label).copied().unwrap_or(0);
    assert_eq!(counts.values().sum::<u64>(), 300, "{origin}: {counts:?}");
    assert!(count("zone-a") > 100 && count("zone-b") > 100, "{origin}: {counts:?}");
    assert!(
        count("fault filter abort") + count("zone-c") <= 10,
        "{origin}: zone-c's failures are learned after a few: {counts:?}"
    );
    counts
}

fn stat_lines(lines: &[String]) -> std::collections::BTreeMap<String, u64> {
    lines
        .iter()
        .filter_map(|l| l.split_once(": "))
        .map(|(name, value)| (name.to_owned(), value.trim().parse().expect("a stat value")))
        .collect()
}

fn shape(line: &str) -> String {
    if line.to_ascii_lowercase().starts_with("date:") {
        return "date: <date>".into();
    }
    let mut out = String::new();
    for c in line.chars() {
        if c.is_ascii_digit() {
            if !out.ends_with('#') {
                out.push('#');
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The walkthrough of docs/getting-started.md (the commands `./demo.sh` prints too), replayed with `bash` and
/// `curl` against the demo in the page's order: each step prints what the page says it
/// prints. Only the demo's ports are changed.
#[test]
fn the_walkthrough_prints_what_getting_started_says() {
    let steps = readme_walkthrough();
    let commands: Vec<&str> = steps.iter().map(|s| s.command.as_str()).collect();
    assert_eq!(steps.len(), STEPS.len(), "docs/getting-started.md's walkthrough changed: {commands:?}");
    for (step, (piece, _)) in steps.iter().zip(STEPS) {
        assert!(step.command.contains(piece), "docs/getting-started.md: expected a command with {piece:?}, found {:?}", step.command);
    }
    let demo_sh = std::fs::read_to_string(workspace_root().join("demo.sh")).expect("read demo.sh");
    for command in &commands {
        assert!(demo_sh.contains(command), "demo.sh does not print the walkthrough's command {command}");
    }

    let demo = start_demo();
    let mut counts = std::collections::BTreeMap::new();
    for (step, (_, check)) in steps.iter().zip(STEPS) {
        let command = step
            .command
            .replace("localhost:10000", &demo.front.to_string())
            .replace("localhost:9901", &demo.admin.to_string());
        assert_ne!(command, step.command, "{}: no demo address to point at", step.command);
        if step.command.contains("x-api-key: demo") && step.command.contains("$(seq 1 7)") {
            // The rate-limit steps within one 10 s window bucket, so that the refusal's estimate
            // is a whole 5 as on the page (across a boundary it would be a fraction).
            wait_for_window_phase(Duration::from_secs(10), Duration::from_millis(300), Duration::from_secs(7));
        }
        if step.command.contains("x-plan: gold") {
            // The gold key's 12 requests within one 10 s bucket: exactly 10 admitted.
            wait_for_window_phase(Duration::from_secs(10), Duration::from_millis(300), Duration::from_secs(7));
        }
        if step.command.contains("/api/login") {
            // The logins within one minute bucket: exactly 3 admitted.
            wait_for_window_phase(Duration::from_secs(60), Duration::from_millis(300), Duration::from_secs(50));
        }
        let out = Command::new("timeout")
            .args(["120", "bash", "-c", &command])
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .expect("run bash (and curl)");
        assert!(out.status.success(), "{command}: {}", out.status);
        let printed: Vec<String> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim_end_matches('\r').to_owned()).collect();
        println!("$ {}\n{}", step.command, printed.join("\n"));
        let context = format!("$ {}\ndocs/getting-started.md:\n{}\ndemo:\n{}", step.command, step.output.join("\n"), printed.join("\n"));
        match check {
            Check::Exact => assert_eq!(printed, step.output, "{context}"),
            Check::Shape => {
                let shaped = |lines: &[String]| lines.iter().map(|l| shape(l)).collect::<Vec<_>>();
                assert_eq!(shaped(&printed), shaped(&step.output), "{context}");
            }
            Check::ClusterCounts => {
                cluster_counts(&step.output, GUIDE);
                counts = cluster_counts(&printed, "the demo");
            }
            Check::ZoneCStats => {
                for (origin, lines, counts) in [
                    (GUIDE, &step.output, cluster_counts(&steps[0].output, GUIDE)),
                    ("the demo", &printed, counts.clone()),
                ] {
                    let stats = stat_lines(lines);
                    let failures = counts.get("fault filter abort").copied().unwrap_or(0);
                    let successes = counts.get("zone-c").copied().unwrap_or(0);
                    let stat = |name: &str| stats.get(&format!("wasmcustom.floodgate.cluster.zone-c.{name}")).copied();
                    assert_eq!(stat("failure"), Some(failures), "{origin}: {context}");
                    assert_eq!(stat("selected"), Some(failures + successes), "{origin}: {context}");
                }
                let names = |lines: &[String]| stat_lines(lines).into_keys().collect::<Vec<_>>();
                assert_eq!(names(&printed), names(&step.output), "{context}");
            }
        }
    }
    // Only the cluster-selection loop met cluster selection: the /api/ steps never reach the
    // flaky zone-c, whatever order a reader runs them in.
    let stats = stats_of(demo.admin);
    let selected: u64 = ["zone-a", "zone-b", "zone-c"]
        .iter()
        .map(|zone| stats.get(&format!("wasmcustom.floodgate.cluster.{zone}.selected")).copied().unwrap_or(0))
        .sum();
    assert_eq!(selected, 300, "requests that went through cluster selection");
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
