//! What operators look at (`observability/`, docs/observability.md), checked with the real tools:
//!
//! * the rules: `promtool check rules` and `promtool test rules` on observability/prometheus/;
//!   every alert has a unit test that fires it and one that does not, every recording rule a
//!   unit test of its value, and every one of those tests can fail (the rules are mutated: an
//!   alert that never fires, one that always fires, no `for:`, a recording rule with another
//!   value; promtool must then fail);
//! * the `stats_tags` block: the same in envoy/demo.yaml, envoy/compose-envoy.yaml,
//!   docs/observability.md and the Istio bootstrap override; Envoy 1.40's `/stats/prometheus`
//!   with and without it prints what docs/observability.md quotes; names with dots, dashes and
//!   `|` become labels, merged into an Istio-like bootstrap the way pilot-agent does it
//!   (`--config-yaml`);
//! * end to end: a real Prometheus scrapes a real Envoy running the demo (envoy/demo.yaml, plus a
//!   global rule whose floodgate-sync is down) under load; through Prometheus's HTTP API, every
//!   recording rule produces series, the alerts of what the load does fire (their `for:` cut to
//!   seconds) and the others do not, and every query of the Grafana dashboard returns data;
//! * the Grafana dashboard: valid JSON with the panels and variables it needs, and every query
//!   parses (Prometheus's API).
//!
//! Prometheus and promtool: `$PROMETHEUS_BIN` (test.sh gets it from scripts/prometheus.sh, which
//! installs Debian's `prometheus`), else `prometheus` on the PATH; promtool next to it. Each
//! Prometheus here listens on a free 127.0.0.1 port with a temporary data directory, and is
//! killed when its test ends.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_cli::parse_documents;
use floodgate_harness::bootstrap::wasm_config;
use floodgate_integration::*;

// ---------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------

fn observability() -> PathBuf {
    workspace_root().join("observability")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The one YAML document of `path`, as JSON.
fn yaml_file(path: &Path) -> Value {
    let mut documents = parse_documents(&read(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(documents.len(), 1, "{}: one YAML document", path.display());
    documents.remove(0)
}

/// Every rule of a Prometheus rule file, in order.
fn rules_of(file: &Value) -> Vec<&Value> {
    file["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
        .collect()
}

fn names_of(file: &Value, key: &str) -> Vec<String> {
    rules_of(file)
        .iter()
        .filter_map(|r| r[key].as_str().map(str::to_owned))
        .collect()
}

/// The fenced blocks of a Markdown file: (language, text).
fn markdown_blocks(text: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        match (open.take(), line.trim_start().strip_prefix("```")) {
            (None, Some(lang)) => open = Some((lang.trim().to_owned(), String::new())),
            (Some(block), Some(_)) => blocks.push(block),
            (Some((lang, mut body)), None) => {
                body.push_str(line);
                body.push('\n');
                open = Some((lang, body));
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "a code block is not closed");
    blocks
}

fn docs() -> String {
    read(&workspace_root().join("docs/observability.md"))
}

// ---------------------------------------------------------------------------------------------
// Prometheus and promtool
// ---------------------------------------------------------------------------------------------

/// Debian's Prometheus: `$PROMETHEUS_BIN`, else `prometheus` on the PATH.
fn prometheus_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("PROMETHEUS_BIN") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "PROMETHEUS_BIN={} does not exist: run ./test.sh (scripts/prometheus.sh installs Prometheus)",
            p.display()
        );
        return p;
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("prometheus"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "Prometheus is not installed (no prometheus on the PATH, PROMETHEUS_BIN unset): \
                 run ./test.sh, which installs Debian's prometheus with scripts/prometheus.sh"
            )
        })
}

fn promtool_binary() -> PathBuf {
    let promtool = prometheus_binary().with_file_name("promtool");
    assert!(promtool.is_file(), "no promtool next to Prometheus ({})", promtool.display());
    promtool
}

/// Runs promtool (bounded by `timeout`), in `dir`.
fn promtool(dir: &Path, args: &[&str]) -> Output {
    let out = Command::new("timeout")
        .arg("60")
        .arg(promtool_binary())
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run promtool");
    assert_ne!(out.status.code(), Some(124), "promtool {args:?} timed out");
    out
}

fn text_of(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// The last lines of a log file.
fn log_tail(path: &Path) -> String {
    tail(&std::fs::read_to_string(path).unwrap_or_default(), 40)
}

/// Polls `ready` every 100 ms for at most `limit`; panics with the end of `log` if `child` (a
/// `what`) exits or is not ready in time. The caller's owner of `child` kills it when dropped.
fn wait_ready(child: &mut Child, what: &str, log: &Path, limit: Duration, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("{what} exited ({status}):\n{}", log_tail(log));
        }
        if ready() {
            return;
        }
        assert!(Instant::now() < deadline, "{what} not ready after {limit:?}:\n{}", log_tail(log));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A Prometheus of its own: free 127.0.0.1 port, temporary configuration and data; killed when
/// dropped.
struct Prometheus {
    child: Child,
    dir: tempfile::TempDir,
    addr: SocketAddr,
}

impl Prometheus {
    /// Starts Prometheus with `config` (JSON, which Prometheus reads as YAML) and the given rule
    /// files (name, text) next to it, and waits (bounded) until it is ready.
    fn start(config: &Value, rule_files: &[(&str, String)]) -> Prometheus {
        let dir = tempfile::Builder::new().prefix("floodgate-prometheus-").tempdir().expect("tempdir");
        for (name, text) in rule_files {
            std::fs::write(dir.path().join(name), text).expect("write rule file");
        }
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config.to_string()).expect("write prometheus.yml");
        let port = free_ports(1)[0];
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new(prometheus_binary())
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start prometheus");
        let mut prometheus = Prometheus { child, dir, addr };
        let log = prometheus.dir.path().join("prometheus.log");
        wait_ready(&mut prometheus.child, "Prometheus", &log, Duration::from_secs(30), || {
            matches!(http_get_blocking(addr, "/-/ready"), Ok((200, _)))
        });
        prometheus
    }

    fn log(&self) -> String {
        log_tail(&self.dir.path().join("prometheus.log"))
    }

    /// GET on the HTTP API: the `data` of a `success` answer, or the error it gave.
    fn api(&self, path_and_query: &str) -> Result<Value, String> {
        let (status, body) = http_get_blocking(self.addr, path_and_query).map_err(|e| e.to_string())?;
        let answer: Value = serde_json::from_str(&body).map_err(|e| format!("HTTP {status}, not JSON ({e}): {body}"))?;
        if answer["status"] == "success" {
            Ok(answer["data"].clone())
        } else {
            Err(format!("HTTP {status}: {} {}", answer["errorType"], answer["error"]))
        }
    }

    /// An instant query: the result vector (or scalar).
    fn query(&self, expr: &str) -> Result<Value, String> {
        self.api(&format!("/api/v1/query?query={}", encode(expr))).map(|d| d["result"].clone())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- end of Prometheus's log ----\n{}\n----", self.log());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The rules, with promtool
// ---------------------------------------------------------------------------------------------

/// `promtool test rules tests/<test>` in `scratch`, with `recording` and `alerts` as the rule
/// files: whether every test passed, and promtool's output.
fn unit_tests_pass(scratch: &Path, test: &str, recording: &str, alerts: &str) -> (bool, String) {
    std::fs::write(scratch.join("recording.yaml"), recording).expect("write");
    std::fs::write(scratch.join("alerts.yaml"), alerts).expect("write");
    let out = promtool(scratch, &["test", "rules", &format!("tests/{test}")]);
    (out.status.success(), text_of(&out))
}

/// `file` (a rule file as JSON) with rule `index` changed by `change`, as text Prometheus reads
/// (JSON is YAML).
fn mutated(file: &Value, index: usize, change: impl Fn(&mut serde_json::Map<String, Value>)) -> String {
    let mut file = file.clone();
    let mut seen = 0;
    for group in file["groups"].as_array_mut().expect("groups") {
        for rule in group["rules"].as_array_mut().expect("rules") {
            if seen == index {
                change(rule.as_object_mut().expect("a rule"));
            }
            seen += 1;
        }
    }
    file.to_string()
}

/// `promtool check rules` accepts both files; `promtool test rules` passes; every alert has a
/// test case that expects it to fire and one that expects silence, every recording rule a test
/// of its value; and every one of those tests can fail: with an alert's expression replaced by
/// one that never fires, by one that always fires, or its `for:` removed, or a recording rule's
/// expression replaced, promtool fails, naming what it expected.
#[test]
fn promtool_checks_the_rules_and_every_unit_test_can_fail() {
    let dir = observability().join("prometheus");
    let recording = yaml_file(&dir.join("recording.yaml"));
    let alerts = yaml_file(&dir.join("alerts.yaml"));
    let records = names_of(&recording, "record");
    let alert_names = names_of(&alerts, "alert");
    assert!(records.len() >= 10 && alert_names.len() >= 9, "{records:?} {alert_names:?}");

    let out = promtool(&dir, &["check", "rules", "recording.yaml", "alerts.yaml"]);
    let text = text_of(&out);
    println!("$ promtool check rules recording.yaml alerts.yaml\n{text}");
    assert!(out.status.success(), "{text}");
    let page = docs();
    for count in [records.len(), alert_names.len()] {
        let line = format!("SUCCESS: {count} rules found");
        assert!(text.contains(&line), "{text}");
        assert!(page.contains(&line), "docs/observability.md shows promtool's output: `{line}` is missing");
    }

    let out = promtool(&dir, &["test", "rules", "tests/recording.test.yaml", "tests/alerts.test.yaml"]);
    let text = text_of(&out);
    println!("$ promtool test rules tests/recording.test.yaml tests/alerts.test.yaml\n{text}");
    assert!(out.status.success(), "{text}");

    // Every alert: a case that fires it, and one (after its `for:` has elapsed) that does not.
    let tests = yaml_file(&dir.join("tests/alerts.test.yaml"));
    let mut firing = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for case in tests["tests"].as_array().expect("tests") {
        let inputs = case["input_series"].as_array().map_or(0, Vec::len);
        for check in case["alert_rule_test"].as_array().into_iter().flatten() {
            let name = check["alertname"].as_str().expect("alertname").to_owned();
            match check["exp_alerts"].as_array().map_or(0, Vec::len) {
                0 if inputs > 0 => silent.insert(name),
                0 => false,
                _ => firing.insert(name),
            };
        }
    }
    for name in &alert_names {
        assert!(firing.contains(name), "no unit test expects {name} to fire");
        assert!(silent.contains(name), "no unit test with series expects {name} to stay quiet");
    }
    let recording_tests = read(&dir.join("tests/recording.test.yaml"));
    for record in &records {
        assert!(recording_tests.contains(&format!("expr: {record}\n")), "no unit test of {record}");
    }

    // Each test can fail: every mutation below is one `promtool test rules` run, each in a
    // scratch copy of its own, run on as many threads as there are cores (promtool computes; it
    // times nothing).
    let (recording_text, alerts_text) = (recording.to_string(), alerts.to_string());
    // (test file, recording rules, alerting rules)
    let mut runs: Vec<(&str, String, String)> = Vec::new();
    for test in ["alerts.test.yaml", "recording.test.yaml"] {
        runs.push((test, recording_text.clone(), alerts_text.clone()));
    }
    for index in 0..alert_names.len() {
        let expr = |e: &'static str| move |rule: &mut serde_json::Map<String, Value>| {
            rule.insert("expr".into(), json!(e));
        };
        runs.push(("alerts.test.yaml", recording_text.clone(), mutated(&alerts, index, expr("vector(0) > 1"))));
        runs.push(("alerts.test.yaml", recording_text.clone(), mutated(&alerts, index, expr("vector(1)"))));
        let no_for = mutated(&alerts, index, |rule| {
            rule.remove("for");
        });
        runs.push(("alerts.test.yaml", recording_text.clone(), no_for));
    }
    for index in 0..records.len() {
        let text = mutated(&recording, index, |rule| {
            rule.insert("expr".into(), json!("vector(0.25)"));
        });
        runs.push(("recording.test.yaml", text, alerts_text.clone()));
    }
    let mut outcomes = unit_test_runs(&dir, &runs).into_iter();
    for test in ["alerts.test.yaml", "recording.test.yaml"] {
        assert!(outcomes.next().expect("an outcome").0, "{test} on the copies");
    }
    for name in &alert_names {
        for what in ["never fires", "always fires", "no for:"] {
            let (passed, output) = outcomes.next().expect("an outcome");
            assert!(!passed, "{name} {what}: promtool test rules still passes");
            assert!(output.contains(&format!("alertname: {name},")), "{name} {what}:\n{output}");
        }
        println!("{name}: its unit tests fail when it never fires, always fires, or has no for:");
    }
    for record in &records {
        let (passed, output) = outcomes.next().expect("an outcome");
        assert!(!passed, "{record} replaced: promtool test rules still passes");
        assert!(output.contains(&format!("expr: \"{record}\"")), "{record}:\n{output}");
    }
    println!("every recording rule: its unit test fails when its expression is replaced");
}

/// [`unit_tests_pass`] for each run (test file, recording rules, alerting rules), in a scratch
/// copy of `dir`'s tests each, on as many threads as there are cores: the outcomes in order.
fn unit_test_runs(dir: &Path, runs: &[(&str, String, String)]) -> Vec<(bool, String)> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from).clamp(1, runs.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let outcomes = std::sync::Mutex::new(vec![None; runs.len()]);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let scratch = tempfile::tempdir().expect("tempdir");
                std::fs::create_dir(scratch.path().join("tests")).expect("mkdir");
                for test in ["alerts.test.yaml", "recording.test.yaml"] {
                    std::fs::copy(dir.join("tests").join(test), scratch.path().join("tests").join(test)).expect("copy");
                }
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some((test, recording, alerts)) = runs.get(i) else { break };
                    let outcome = unit_tests_pass(scratch.path(), test, recording, alerts);
                    outcomes.lock().expect("outcomes")[i] = Some(outcome);
                }
            });
        }
    });
    outcomes.into_inner().expect("outcomes").into_iter().map(|o| o.expect("every run ran")).collect()
}

// ---------------------------------------------------------------------------------------------
// Envoy: the demo, and stats_tags
// ---------------------------------------------------------------------------------------------

/// An Envoy started here (through the harness: a port taken before Envoy bound it makes it start
/// again on others); killed when dropped (its log printed if the test is failing).
struct RunningEnvoy {
    envoy: Envoy,
    admin: SocketAddr,
    front: SocketAddr,
}

impl RunningEnvoy {
    /// Starts Envoy 1.40 (2 workers) on the bootstrap `make` returns (its ports picked free, made
    /// afresh for each start) with `extra` arguments, and waits (bounded) until its admin says
    /// LIVE.
    fn start(make: impl FnMut() -> String, extra: &[&str]) -> RunningEnvoy {
        let envoy = Envoy::launched_with(&launch().log_level("warning").args(extra), make);
        RunningEnvoy { admin: envoy.admin_addr(), front: envoy.addr(), envoy }
    }

    fn admin_get(&self, path: &str) -> String {
        let (status, body) = self.envoy.admin_get(path);
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }
}

/// `text` with `from` replaced by `to`, which must be there exactly once.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "expected once: {from}");
    text.replace(from, to)
}

/// The `stats_config` of the shipped Envoy configurations, the docs and the Istio override.
fn stats_configs() -> Vec<(String, Value)> {
    let root = workspace_root();
    let mut found = Vec::new();
    for file in ["envoy/demo.yaml", "envoy/compose-envoy.yaml"] {
        found.push((file.to_owned(), yaml_file(&root.join(file))["stats_config"].clone()));
    }
    let istio = "observability/istio/stats-tags-bootstrap.yaml";
    let map = yaml_file(&root.join(istio));
    let json: Value = serde_json::from_str(map["data"]["custom_bootstrap.json"].as_str().expect("custom_bootstrap.json"))
        .expect("custom_bootstrap.json is JSON");
    found.push((istio.to_owned(), json["stats_config"].clone()));
    for (lang, text) in markdown_blocks(&docs()) {
        if lang == "yaml" && text.starts_with("stats_config:") {
            let block = parse_documents(&text).expect("docs/observability.md: the stats_config block is YAML");
            found.push(("docs/observability.md".to_owned(), block[0]["stats_config"].clone()));
        }
    }
    found
}

/// The lines of a `/stats/prometheus` page, by metric: (name, labels) → (type, value).
fn prometheus_series(page: &str) -> BTreeMap<(String, String), (String, String)> {
    let mut types = BTreeMap::new();
    let mut series = BTreeMap::new();
    for line in page.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            types.insert(name.to_owned(), kind.to_owned());
        } else if !line.starts_with('#') && !line.is_empty() {
            let (metric, value) = line.rsplit_once(' ').expect("name{labels} value");
            let (name, labels) = metric.split_once('{').expect("name{labels}");
            // A histogram's series are name_bucket, name_sum and name_count under one `# TYPE`.
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).filter(|b| types.get(*b).is_some_and(|k| k == "histogram"));
            let kind = types.get(base.unwrap_or(name)).cloned().unwrap_or_default();
            series.insert((name.to_owned(), format!("{{{labels}")), (kind, value.to_owned()));
        }
    }
    series
}

/// What `/stats/prometheus` shows of every metric declared in filter/src/pipeline/stats.rs (its
/// table, the one place the metrics are declared), for `prefix` and the given rules, classes
/// and clusters (as metric-safe names), and the global scope's if `global`: (name, labels) →
/// type, with or without the stats_tags.
#[allow(clippy::too_many_arguments)]
fn expected_series(
    prefix: &str,
    rules: &[&str],
    classes: &[&str],
    clusters: &[&str],
    global: bool,
    leased: bool,
    tagged: bool,
    flow_classes: Option<&[&str]>,
) -> BTreeMap<(String, String), String> {
    let table = read(&workspace_root().join("filter/src/pipeline/stats.rs"));
    let mut expected = BTreeMap::new();
    let rows: Vec<(String, String)> = table
        .lines()
        .filter_map(|l| l.strip_prefix("//! | `<prefix>."))
        .map(|rest| {
            let (name, rest) = rest.split_once("` | ").expect("| `name` | type |");
            let kind = rest.split(' ').next().expect("type").to_owned();
            (name.to_owned(), kind)
        })
        .collect();
    assert!(rows.len() >= 28, "filter/src/pipeline/stats.rs: its metric table shrank: {rows:?}");
    let flat = |name: &str| format!("{prefix}_{name}").replace(['.', '-'], "_");
    for (pattern, kind) in rows {
        if (pattern.starts_with("global.") && !global) || (pattern.starts_with("lease.") && !leased) {
            continue;
        }
        // Defined only for a token bucket with `max_delay`, or for a cost the upstream reports,
        // which none of these configurations has; with `load_shedding.queue` (`flow_classes`
        // `Some`), and for a class with a flow key (those it names).
        let queue = [".queued", ".dequeued", ".queue_timeout", ".queue_abandoned", ".queue_length", ".queue_wait_ms"];
        let flow = [".flows", ".fair_share_ppm", ".flow_wait_ms", ".shed_by_flow"];
        let reported = [".refunded", ".unreported", ".unreadable", ".unreadable_compressed"];
        if pattern.ends_with(".delayed")
            || pattern.ends_with(".delay_abandoned")
            || reported.iter().any(|q| pattern.ends_with(q))
            || (flow_classes.is_none() && queue.iter().any(|q| pattern.ends_with(q)))
        {
            continue;
        }
        let is_flow = flow.iter().any(|f| pattern.ends_with(f));
        let classes = if is_flow { flow_classes.unwrap_or_default() } else { classes };
        let placeholders = [("<rule>", "rule", rules), ("<class>", "class", classes), ("<cluster>", "upstream_cluster", clusters)];
        let mut matched = false;
        for (placeholder, label, values) in placeholders {
            if let Some((before, after)) = pattern.split_once(placeholder) {
                matched = true;
                // A histogram is checked by its name_count series.
                let count = if kind == "histogram" { "_count" } else { "" };
                for value in values {
                    let key = if tagged {
                        (format!("{}{count}", flat(&format!("{before}{}", after.trim_start_matches('.')))), format!("{{{label}=\"{value}\"}}"))
                    } else {
                        (format!("{}{count}", flat(&format!("{before}{value}{after}"))), "{}".to_owned())
                    };
                    expected.insert(key, kind.clone());
                }
            }
        }
        if !matched {
            // A histogram is checked by its name_count series.
            let name = if kind == "histogram" { format!("{}_count", flat(&pattern)) } else { flat(&pattern) };
            expected.insert((name, "{}".to_owned()), kind);
        }
    }
    expected
}

/// The `$ curl ... /stats/prometheus` examples of docs/observability.md, each replayed with bash
/// and curl against `admin`: the lines printed, and the lines the docs print.
fn docs_prometheus_examples(admin: SocketAddr) -> Vec<(String, Vec<String>, Vec<String>)> {
    let mut examples = Vec::new();
    for (lang, text) in markdown_blocks(&docs()) {
        let Some(command) = text.lines().next().and_then(|l| l.strip_prefix("$ ")) else { continue };
        if lang != "console" || !command.contains("localhost:9901/stats/prometheus") {
            continue;
        }
        let documented: Vec<String> = text.lines().skip(1).map(str::to_owned).collect();
        let command = command.replace("localhost:9901", &admin.to_string());
        let out = Command::new("timeout")
            .args(["30", "bash", "-c", &command])
            .stdin(Stdio::null())
            .output()
            .expect("run bash and curl");
        assert!(out.status.success(), "{command}: {}", text_of(&out));
        let printed = String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect();
        examples.push((command, printed, documented));
    }
    examples
}

/// A line with every run of digits as `#` (the counts depend on the traffic).
fn shape(line: &str) -> String {
    let mut out = String::new();
    for c in line.chars() {
        if !c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('#') {
            out.push('#');
        }
    }
    out
}

/// The stats_tags block is the same in every place that ships it, and on Envoy 1.40 it turns
/// the demo's per-rule, per-class and per-cluster metric names into one metric with a label in
/// `/stats/prometheus` (and leaves `/stats` alone); docs/observability.md's examples, with and
/// without it, are what the demo prints. Every metric of filter/src/pipeline/stats.rs is checked in
/// both forms.
#[test]
fn stats_tags_give_one_metric_with_a_label_per_rule_class_and_cluster() {
    let configs = stats_configs();
    let origins: Vec<&str> = configs.iter().map(|(o, _)| o.as_str()).collect();
    assert_eq!(configs.len(), 4, "stats_config in {origins:?}");
    let tags = configs[0].1["stats_tags"].as_array().expect("stats_tags").clone();
    let names: Vec<&str> = tags.iter().map(|t| t["tag_name"].as_str().expect("tag_name")).collect();
    assert_eq!(names, ["rule", "class", "upstream_cluster"]);
    for (origin, config) in &configs {
        assert_eq!(config, &configs[0].1, "{origin} and {} differ", configs[0].0);
    }

    let demo = |tagged: bool| {
        let text = demo_config(|text| text).0;
        if tagged {
            return text;
        }
        let mut bootstrap = parse_documents(&text).expect("demo.yaml").remove(0);
        bootstrap.as_object_mut().expect("a bootstrap").remove("stats_config");
        bootstrap.to_string()
    };
    let mut pages = Vec::new();
    let mut examples = Vec::new();
    for tagged in [false, true] {
        let envoy = RunningEnvoy::start(|| demo(tagged), &[]);
        let (admin, front) = (envoy.admin, envoy.front);
        // A little traffic: a refusal, a few routed requests.
        for i in 0..7 {
            let path = if i % 2 == 0 { "/api/" } else { "/" };
            let _ = http_get_blocking(front, path);
        }
        let page = envoy.admin_get("/stats/prometheus");
        let (rules, classes, clusters) = (["per-api-key", "logins", "per-ip"], ["critical", "normal", "low"], ["zone-a", "zone-b", "zone-c"]);
        let expected = expected_series("floodgate", &rules, &classes, &clusters, false, false, tagged, None);
        let series = prometheus_series(&page);
        let floodgate: BTreeMap<_, _> = series
            .iter()
            .filter(|((n, _), (kind, _))| n.starts_with("floodgate_") && (kind != "histogram" || n.ends_with("_count")))
            .collect();
        for ((name, labels), kind) in &expected {
            let found = series.get(&(name.clone(), labels.clone()));
            assert_eq!(found.map(|(k, _)| k), Some(kind), "{name}{labels} ({kind}), tagged: {tagged}");
        }
        assert_eq!(floodgate.len(), expected.len(), "floodgate_ series beyond stats.rs's, tagged: {tagged}: {floodgate:?}");
        // /stats keeps the full names either way.
        let stats = envoy.admin_get("/stats");
        assert!(stats.contains("wasmcustom.floodgate.rate_limit.per-api-key.rejected: "), "{stats}");
        examples.push((tagged, docs_prometheus_examples(admin)));
        pages.push(page);
    }
    let example = pages[1].lines().filter(|l| l.contains("rate_limit_rejected")).collect::<Vec<_>>().join("\n");
    println!("/stats/prometheus with the stats_tags:\n{example}");

    // docs/observability.md: one example without the stats_tags, one with.
    let mut checked = [false, false];
    for (tagged, replayed) in examples {
        for (command, printed, documented) in replayed {
            let labelled = documented.iter().any(|l| l.contains("{rule=\""));
            if labelled != tagged {
                continue;
            }
            let shaped = |lines: &[String]| lines.iter().map(|l| shape(l)).collect::<Vec<_>>();
            assert_eq!(shaped(&printed), shaped(&documented), "docs/observability.md: $ {command} (stats_tags: {tagged})");
            checked[usize::from(tagged)] = true;
        }
    }
    assert_eq!(checked, [true, true], "docs/observability.md: an example of /stats/prometheus without and one with the stats_tags");
}

/// In Istio the stats_tags go in through a bootstrap override: pilot-agent hands the ConfigMap's
/// custom_bootstrap.json to Envoy with `--config-yaml`, merged into a bootstrap that has its
/// own stats_config (use_all_default_tags false, its own tags, a stats_matcher that keeps
/// `wasm*` stats). Here an Istio-like bootstrap of that shape, with awkward names (a stat_prefix
/// other than floodgate, dots in a rule and a class, an Istio cluster name with `|`), a global
/// rule, and the queue with a class shared by flow (its per-class histogram among them): every metric of stats.rs comes out with its label, and the bootstrap's own tag
/// and matcher still work.
#[test]
fn the_istio_bootstrap_override_labels_awkward_names_too() {
    let override_json = {
        let map = yaml_file(&observability().join("istio/stats-tags-bootstrap.yaml"));
        map["data"]["custom_bootstrap.json"].as_str().expect("custom_bootstrap.json").to_owned()
    };
    let nowhere = free_ports(1)[0];
    let istio_cluster = "outbound|80||reviews.shop.svc.cluster.local";
    let filter = json!({
        "stat_prefix": "edge",
        "rate_limits": [
            {"name": "tenant.v2", "key": [{"header": "x-tenant"}], "limit": 10, "window": "1m"},
            {"name": "per-api-key", "key": [{"header": "x-api-key"}], "limit": 5, "window": "10s"},
            {"name": "fleet", "key": [{"header": "x-tenant"}], "limit": 100, "window": "1m", "scope": "global"},
            {"name": "paid", "key": [{"header": "x-tenant"}], "limit": 100, "window": "1m", "scope": "global", "consistency": "leased"}
        ],
        "load_shedding": {"max_active_requests": 10, "classes": [{"name": "critical", "shed_at": 1.0}, {"name": "batch.low", "shed_at": 0.5, "flow": {"key": [{"header": "x-tenant"}]}}], "default_class": "batch.low",
                          "queue": {"max_queued": 16, "max_wait": "1s"}},
        "cluster_selection": {"clusters": ["zone-a", istio_cluster]},
        "global": {"cluster": "floodgate-sync"}
    });
    let cluster = |name: &str| {
        json!({"name": name, "type": "STATIC", "connect_timeout": "0.25s", "load_assignment": {"cluster_name": name,
               "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": nowhere}}}}]}]}})
    };
    // The admin API and the listener on ports picked free, afresh for each start.
    let bootstrap = || {
        let ports = free_ports(2);
        let (admin, front) = (ports[0], ports[1]);
        json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "stats_config": {
            "use_all_default_tags": false,
            "stats_tags": [{"tag_name": "cluster_name", "regex": "^cluster\\.((.+?)\\.)"}],
            "stats_matcher": {"inclusion_list": {"patterns": [{"prefix": "cluster_manager"}, {"prefix": "cluster.zone-a."}, {"prefix": "server"}, {"prefix": "wasm"}]}}
        },
        "static_resources": {
            "listeners": [{"name": "front", "address": {"socket_address": {"address": "127.0.0.1", "port_value": front}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "inbound",
                    "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"}, "route": {"cluster_header": "x-floodgate-cluster"}}]}]},
                    "http_filters": [
                        {"name": "floodgate", "typed_config": wasm_config(&wasm_module(), &filter.to_string(), None)},
                        {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
                    ]}}]}]}],
            "clusters": [cluster("zone-a"), cluster(istio_cluster), cluster("floodgate-sync")]
        }
        })
        .to_string()
    };
    let envoy = RunningEnvoy::start(bootstrap, &["--config-yaml", &override_json]);
    let page = envoy.admin_get("/stats/prometheus");
    let series = prometheus_series(&page);
    let expected = expected_series(
        "edge",
        &["tenant.v2", "per-api-key", "fleet", "paid"],
        &["critical", "batch.low"],
        &["zone-a", "outbound_80__reviews.shop.svc.cluster.local"],
        true,
        true,
        true,
        Some(&["batch.low"]),
    );
    for ((name, labels), kind) in &expected {
        let found = series.get(&(name.clone(), labels.clone()));
        assert_eq!(found.map(|(k, _)| k), Some(kind), "{name}{labels} ({kind}):\n{page}");
    }
    let edge: Vec<_> = series
        .iter()
        .filter(|((n, _), (kind, _))| n.starts_with("edge_") && (kind != "histogram" || n.ends_with("_count")))
        .map(|(key, _)| key)
        .collect();
    assert_eq!(edge.len(), expected.len(), "edge_ series beyond stats.rs's: {edge:?}");
    for line in ["edge_rate_limit_rejected{rule=\"tenant.v2\"}", "edge_load_shedding_shed{class=\"batch.low\"}", "edge_load_shedding_flow_wait_ms_count{class=\"batch.low\"}",
                 "edge_cluster_selected{upstream_cluster=\"outbound_80__reviews.shop.svc.cluster.local\"}"] {
        println!("{}", page.lines().find(|l| l.starts_with(line)).unwrap_or_else(|| panic!("{line}:\n{page}")));
    }
    // The bootstrap's own tag and matcher: Envoy's cluster stats keep their tag, others are out.
    assert!(series.keys().any(|(n, l)| n == "envoy_cluster_upstream_cx_total" && l == "{cluster_name=\"zone-a\"}"), "{page}");
    assert!(!page.contains("envoy_http_downstream_rq_total"), "the stats_matcher was not applied:\n{page}");
}

// ---------------------------------------------------------------------------------------------
// The Grafana dashboard
// ---------------------------------------------------------------------------------------------

fn dashboard() -> Value {
    let path = observability().join("grafana/floodgate.json");
    serde_json::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()))
}

/// Every panel's queries: (panel title, expression with the dashboard's variables as Grafana
/// sends them with "All" selected).
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target's expr");
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$proxy", ".*")
                .replace("$rule", ".*");
            assert!(!expr.contains('$'), "{}: a variable the test does not know: {expr}", panel["title"]);
            queries.push((panel["title"].as_str().expect("title").to_owned(), expr));
        }
    }
    queries
}

/// The dashboard's query variables: (name, label, series selector) of `label_values(selector, label)`.
fn dashboard_variables(dashboard: &Value) -> Vec<(String, String, String)> {
    let mut variables = Vec::new();
    for variable in dashboard["templating"]["list"].as_array().expect("templating.list") {
        if variable["type"] != "query" {
            continue;
        }
        let query = variable["query"]["query"].as_str().expect("a variable's query");
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("not label_values(...): {query}"));
        let (selector, label) = inner.rsplit_once(", ").expect("label_values(selector, label)");
        let selector = selector.replace("$proxy", ".*");
        variables.push((variable["name"].as_str().expect("name").to_owned(), label.to_owned(), selector));
    }
    variables
}

/// The dashboard is a Grafana dashboard (uid, title, schemaVersion, panels with unique ids, a
/// place on the grid, the `${datasource}` variable as data source, targets with a refId); its
/// variables are `datasource`, `proxy` and `rule`, the query variables `label_values` queries;
/// and every query of every panel parses and evaluates in a real Prometheus (its HTTP API
/// refuses bad PromQL, which this test checks too, so the check can fail).
#[test]
fn the_grafana_dashboard_is_valid_and_every_query_parses() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "floodgate");
    assert!(dashboard["title"].is_string() && dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36));
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut rows = Vec::new();
    for panel in panels {
        let title = panel["title"].as_str().expect("every panel has a title");
        assert!(ids.insert(panel["id"].as_u64().expect("id")), "{title}: duplicate id");
        let grid = &panel["gridPos"];
        for key in ["h", "w", "x", "y"] {
            assert!(grid[key].is_u64(), "{title}: gridPos.{key}");
        }
        assert!(grid["x"].as_u64().unwrap_or(0) + grid["w"].as_u64().unwrap_or(0) <= 24, "{title}: wider than the grid");
        if panel["type"] == "row" {
            rows.push(title.to_owned());
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        let refs: BTreeSet<&str> = targets.iter().map(|t| t["refId"].as_str().expect("refId")).collect();
        assert_eq!(refs.len(), targets.len(), "{title}: refIds");
    }
    println!("rows: {rows:?}");
    for area in ["Rate limits", "Load shedding", "Cluster selection", "global"] {
        assert!(rows.iter().any(|r| r.contains(area)), "no row for {area}: {rows:?}");
    }
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .map(|v| v["name"].as_str().expect("name"))
        .collect();
    assert_eq!(variables, ["datasource", "proxy", "rule"]);
    let query_variables = dashboard_variables(&dashboard);
    assert_eq!(query_variables.len(), 2);

    let prometheus = Prometheus::start(&json!({"global": {"evaluation_interval": "1m"}}), &[]);
    assert!(prometheus.query("sum(rate(floodgate_rate_limit_allowed[5m])").is_err(), "Prometheus accepted bad PromQL");
    let queries = dashboard_queries(&dashboard);
    for (title, expr) in &queries {
        if let Err(e) = prometheus.query(expr) {
            panic!("{title}: {expr}: {e}");
        }
    }
    for (name, label, selector) in &query_variables {
        let path = format!("/api/v1/label/{label}/values?match[]={}", encode(selector));
        if let Err(e) = prometheus.api(&path) {
            panic!("variable {name}: {selector}: {e}");
        }
    }
    println!("{} panel queries and {} variable queries parse", queries.len(), query_variables.len());
}

// ---------------------------------------------------------------------------------------------
// End to end
// ---------------------------------------------------------------------------------------------

/// Traffic for the demo until `stop`: one API key far over its quota (per-api-key: 5 per 10 s)
/// ten times a second; cluster selection (whose zone-c fails 90 %) three times a second, with
/// a tenant of the global rule; and every two seconds 12 concurrent slow requests (1 s), of
/// which 3 are shed (10 in flight at most, normal priority shed from 9). In all about 8
/// admitted requests a second, under the per-ip limit of 1000 a minute.
fn load(front: SocketAddr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<BTreeMap<String, u64>> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        runtime.block_on(async move {
            let tally = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
            let count = |tally: &Arc<std::sync::Mutex<BTreeMap<String, u64>>>, what: String| {
                *tally.lock().expect("tally").entry(what).or_insert(0) += 1;
            };
            let steady = |path: &'static str, header: (&'static str, &'static str), every: Duration| {
                let (stop, tally) = (stop.clone(), tally.clone());
                tokio::spawn(async move {
                    let mut client = None;
                    while !stop.load(Ordering::Relaxed) {
                        if client.is_none() {
                            client = Client::connect(front).await.ok();
                        }
                        if let Some(c) = client.as_mut() {
                            match c.get(path, &[header]).await {
                                Ok(r) => count(&tally, format!("{path} {}", r.status)),
                                Err(_) => client = None,
                            }
                        }
                        tokio::time::sleep(every).await;
                    }
                })
            };
            let hot = steady("/api/", ("x-api-key", "hot"), Duration::from_millis(100));
            let clusters = steady("/", ("x-tenant", "t1"), Duration::from_millis(300));
            let mut burst = 0u64;
            while !stop.load(Ordering::Relaxed) {
                burst += 1;
                let requests: Vec<_> = (0..12)
                    .map(|i| {
                        let key = format!("burst-{burst}-{i}");
                        tokio::spawn(async move {
                            let mut c = Client::connect(front).await.ok()?;
                            let headers = [("x-api-key", key.as_str()), ("x-envoy-fault-delay-request", "1000")];
                            c.get("/api/", &headers).await.ok().map(|r| r.status)
                        })
                    })
                    .collect();
                for request in requests {
                    if let Ok(Some(status)) = request.await {
                        count(&tally, format!("burst {status}"));
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            let _ = hot.await;
            let _ = clusters.await;
            let tally = tally.lock().expect("tally").clone();
            tally
        })
    })
}

/// A series' or an alert's own labels as `k=v,...`: without the name, the alert's name and
/// severity, and the scrape target's labels.
fn own_labels(labels: &Value) -> String {
    labels
        .as_object()
        .expect("labels")
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "__name__" | "alertname" | "severity" | "instance" | "job"))
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(",")
}

/// Alerts as Prometheus's API lists them: (name, [`own_labels`]) → state.
fn alerts(prometheus: &Prometheus) -> BTreeMap<(String, String), String> {
    let data = prometheus.api("/api/v1/alerts").expect("GET /api/v1/alerts");
    let mut found = BTreeMap::new();
    for alert in data["alerts"].as_array().expect("alerts") {
        let name = alert["labels"]["alertname"].as_str().expect("alertname").to_owned();
        found.insert((name, own_labels(&alert["labels"])), alert["state"].as_str().expect("state").to_owned());
    }
    found
}

/// A real Prometheus scrapes the demo's Envoy (envoy/demo.yaml as shipped, with its stats_tags,
/// plus a global rule whose floodgate-sync is down, a rule whose cost the upstream never
/// reports, and a short queue) every second, with recording.yaml and alerts.yaml (their `for:`
/// cut to 3 s, everything else as shipped), while [`load`] runs. Through Prometheus's HTTP API:
/// the scrape is up; the alerts of what the load does fire: the quota being hit
/// (FloodgateRateLimitRejecting for per-api-key), the unreported cost, shedding (normal class),
/// zone-c's success rate, the global sync failing; the others stay inactive; every rule
/// evaluates without error and every recording rule has produced series; every query of the
/// Grafana dashboard and its variables return data.
#[test]
fn prometheus_scrapes_the_demo_under_load_records_and_alerts() {
    let nowhere = free_ports(1)[0];
    // The demo on ports picked free, afresh for each start.
    let demo = || demo_config(|text| {
        let per_ip = r#"{"name": "per-ip", "key": ["source_ip"], "limit": 1000, "window": "1m"}],"#;
        let global_rule = r#"{"name": "per-tenant", "key": [{"header": "x-tenant"}], "limit": 100000, "window": "1m", "scope": "global"}"#;
        // A cost the upstream reports in a header it never sends: every admission unreported.
        let reported = r#"{"name": "reported", "key": [{"header": "x-tenant"}], "limit": 100000, "window": "1m", "cost": {"from": "response_header", "header": "x-cost"}}"#;
        let text = edit(&text, per_ip, &per_ip.replace("}],", &format!("}}, {global_rule}, {reported}],")));
        // A short queue, shared by API key: the bursts wait in it, then are shed (by flow).
        let shedding = r#""load_shedding": {"max_active_requests": 10}"#;
        let queued = r#""load_shedding": {"max_active_requests": 10, "queue": {"max_queued": 4, "max_wait": "20ms"}, "flow": {"key": [{"header": "x-api-key"}]}}"#;
        let text = edit(&text, shedding, queued);
        let health = r#""health": {"path": "/floodgate/health"}}"#;
        let global = r#""global": {"cluster": "floodgate-sync", "timeout": "250ms"}"#;
        let text = edit(&text, health, &health.replace("}}", &format!("}}, {global}}}")));
        let sync = [
            "  # floodgate-sync, down: nothing listens there.",
            "  - name: floodgate-sync",
            "    type: STATIC",
            "    connect_timeout: 0.25s",
            "    load_assignment:",
            "      cluster_name: floodgate-sync",
            "      endpoints:",
            "      - lb_endpoints:",
            &format!("        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {nowhere} }} }} }}"),
        ];
        format!("{text}{}\n", sync.join("\n"))
    }).0;
    let envoy = RunningEnvoy::start(demo, &[]);
    let (admin, front) = (envoy.admin, envoy.front);

    let dir = observability().join("prometheus");
    let mut alert_rules = yaml_file(&dir.join("alerts.yaml"));
    let mut cut = 0;
    for group in alert_rules["groups"].as_array_mut().expect("groups") {
        for rule in group["rules"].as_array_mut().expect("rules") {
            rule["for"] = json!("3s");
            cut += 1;
        }
    }
    assert!(cut >= 9);
    let config = json!({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["recording.yaml", "alerts.yaml"],
        "scrape_configs": [{"job_name": "floodgate-demo", "metrics_path": "/stats/prometheus",
                            "static_configs": [{"targets": [admin.to_string()]}]}]
    });
    let prometheus = Prometheus::start(&config, &[("recording.yaml", read(&dir.join("recording.yaml"))), ("alerts.yaml", alert_rules.to_string())]);

    let stop = Arc::new(AtomicBool::new(false));
    let traffic = load(front, stop.clone());
    let must_fire: [(&str, &str); 5] = [
        ("FloodgateRateLimitRejecting", "rule=per-api-key"),
        ("FloodgateCostUnreported", "rule=reported"),
        ("FloodgateSheddingSustained", "class=normal"),
        ("FloodgateClusterSuccessRateLow", "upstream_cluster=zone-c"),
        ("FloodgateGlobalSyncFailing", ""),
    ];
    let started = Instant::now();
    let deadline = started + Duration::from_secs(120);
    let key = |name: &str, labels: &str| (name.to_owned(), labels.to_owned());
    let mut seen;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        seen = alerts(&prometheus);
        let firing = |(name, labels): &(&str, &str)| seen.get(&key(name, labels)).is_some_and(|s| s == "firing");
        if must_fire.iter().all(firing) || Instant::now() > deadline {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let tally = traffic.join().expect("the load thread");
    println!("load for {:.0} s: {tally:?}", started.elapsed().as_secs_f64());
    println!("alerts: {seen:#?}");
    for (name, labels) in must_fire {
        let state = seen.get(&key(name, labels)).map(String::as_str);
        assert_eq!(state, Some("firing"), "{name} {{{labels}}}: {seen:#?}");
    }
    for quiet in [
        "FloodgateContention",
        "FloodgateRateLimitTableTooSmall",
        "FloodgateClustersAllFull",
        "FloodgateClusterConcurrencyLimitCollapsed",
        "FloodgateGlobalViewStale",
        "FloodgateQueueAbandoned",
    ] {
        assert!(!seen.keys().any(|(n, _)| n == quiet), "{quiet} is active: {seen:#?}");
    }
    for zone in ["zone-a", "zone-b"] {
        let low = key("FloodgateClusterSuccessRateLow", &format!("upstream_cluster={zone}"));
        assert!(!seen.contains_key(&low), "{zone}: {seen:#?}");
    }

    // The scrape, every rule's health, every recording rule's series.
    let targets = prometheus.api("/api/v1/targets").expect("targets");
    assert_eq!(targets["activeTargets"][0]["health"], "up", "{targets}");
    let groups = prometheus.api("/api/v1/rules").expect("rules");
    let mut evaluated = 0;
    for group in groups["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            assert_eq!(rule["health"], "ok", "{rule}");
            evaluated += 1;
        }
    }
    let records = names_of(&yaml_file(&dir.join("recording.yaml")), "record");
    assert_eq!(evaluated, records.len() + cut);
    for record in &records {
        let result = prometheus.query(record).unwrap_or_else(|e| panic!("{record}: {e}"));
        let result = result.as_array().expect("a vector");
        assert!(!result.is_empty(), "{record}: no series");
        let samples: Vec<String> = result
            .iter()
            .map(|s| format!("{{{}}} {}", own_labels(&s["metric"]), s["value"][1].as_str().unwrap_or_default()))
            .collect();
        println!("{record}: {}", samples.join(" "));
    }
    let ratio = prometheus
        .query(r#"instance_rule:floodgate_rate_limit_rejected:ratio_rate5m{rule="per-api-key"}"#)
        .expect("ratio");
    let ratio: f64 = ratio[0]["value"][1].as_str().and_then(|v| v.parse().ok()).expect("a ratio");
    assert!(ratio > 0.2, "per-api-key refused share {ratio}");

    // The dashboard on real data: every query and every variable returns something.
    let dashboard = dashboard();
    for (title, expr) in dashboard_queries(&dashboard) {
        let result = prometheus.query(&expr).unwrap_or_else(|e| panic!("{title}: {expr}: {e}"));
        assert!(result.as_array().is_some_and(|r| !r.is_empty()), "{title}: {expr}: no data");
    }
    for (name, label, selector) in dashboard_variables(&dashboard) {
        let values = prometheus
            .api(&format!("/api/v1/label/{label}/values?match[]={}", encode(&selector)))
            .unwrap_or_else(|e| panic!("variable {name}: {e}"));
        println!("variable {name}: {values}");
        let expected = if name == "rule" { json!(["logins", "per-api-key", "per-ip", "per-tenant", "reported"]) } else { json!([admin.to_string()]) };
        assert_eq!(values, expected, "variable {name}");
    }
    drop(envoy);
}
