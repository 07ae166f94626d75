//! The operator's side of floodgate, kept true:
//!
//! * the JSON Schema (`schema/floodgate.schema.json`) is a valid draft 2020-12 schema and accepts
//!   every example configuration in the repository, each of which the module's parser accepts
//!   too: the ```json blocks of README.md and docs/*.md, the floodgate filters of every Envoy
//!   configuration in envoy/ and of the docs' ```yaml blocks, the Istio WasmPlugin's pluginConfig;
//! * the schema agrees with the parser on hand-written edge cases and on mutations of a
//!   configuration that sets every field; where JSON Schema cannot express a check of the parser
//!   (the cross-field rules in [`KNOWN_GAPS`], integers written as `5.0`) the schema is looser,
//!   never stricter;
//! * every Envoy configuration in envoy/ and every Envoy snippet of the docs passes
//!   `envoy --mode validate` with the built module;
//! * the `floodgate validate` command on good and bad files, with the very message the module
//!   logs in Envoy, and the same field named by the parser, the command and the schema for an
//!   unknown `mode` and for `match.routes` beside `cluster_selection`;
//! * `floodgate explain` on an Envoy file of the repository;
//! * the Istio manifests of floodgate-sync (Deployment, Service) agree with the WasmPlugin that
//!   calls it and with the flags the built floodgate-sync reads;
//! * envoy/docker-compose.yaml for real (scripts/compose-test.sh), envoy/docker-compose.global.yaml
//!   (scripts/compose-global-test.sh: two Envoys sharing one quota through floodgate-sync and
//!   Redis) and the OCI image for Istio (scripts/oci-image.sh), with the Docker engine: without one
//!   these tests fail, saying so;
//! * the README's two commands check the machine first (scripts/preflight.sh), naming everything
//!   missing at once as docs/getting-started.md shows, before building anything.
//!
//! Conventions of the docs that these tests rely on: a ```json block in README.md or docs/*.md is
//! a complete floodgate configuration; a ```yaml block holding an `envoy.filters.http.wasm` filter
//! or a WasmPlugin is checked too, and goes through `envoy --mode validate` when its top level is
//! a bootstrap (`static_resources`) or an `http_filters` list. Anything else goes in ```text
//! blocks (or blocks of another language).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use floodgate::config::Config;
use floodgate_cli::{find_configurations, parse_documents, Options, WASM_FILTER_TYPE};
use floodgate_integration::*;

/// Parser refusals that JSON Schema cannot express (cross-field rules): the schema accepts these
/// configurations and the parser refuses them, with a message containing one of these.
const KNOWN_GAPS: &[&str] = &[
    "duplicate rule name",
    "duplicate class name",
    "is not one of the classes",
    "is above max_limit",
    "is outside [min_limit, max_limit]",
    "must be between 10ms and 60s",
    "global.timeout: must be at most 60s",
    "lag_probe_interval: must be from 10ms to 1000ms",
    "must give exactly one of",
    "must give at least one condition",
    "must give one value per key part",
    "the same key as",
    "is required when the cost comes from a header",
    "has no meaning with \"from\": \"request_body\"",
    "a '*' must be a whole segment",
    "reports the clusters of cluster_selection, which is not configured",
    "must be at most the number of clusters",
    "applies only with \"when_unavailable\": \"spill\"",
    "watchdog.worker_silence: must be at least",
    "watchdog.max_loop_lag: must be at least",
    "is health.path too",
    "(a request waits in the proxy, holding its connection)",
    "(a waiting request holds its connection)",
    "must be at most max_wait",
    "must be at least target",
    "has no meaning with \"from\": \"response_body\"",
    "is required with \"from\": \"response_body\"",
    "has meaning only with \"from\": \"response_body\"",
    "has meaning only for a cost the upstream reports",
    "has meaning only with \"estimate\"",
    "has no meaning with \"estimate\"",
    "must be at most estimate.max",
    "has meaning only with estimate.body",
];

fn validator() -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(floodgate_cli::SCHEMA).expect("the schema is JSON");
    jsonschema::draft202012::new(&schema).unwrap_or_else(|e| panic!("the schema does not compile: {e}"))
}

fn schema_errors(validator: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    validator
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}

/// A fenced code block of a Markdown file.
struct Block {
    origin: String,
    lang: String,
    text: String,
}

fn markdown_files() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut files = vec![root.join("README.md")];
    files.extend(files_under(&root.join("docs"), &["md"]));
    files
}

fn markdown_blocks() -> Vec<Block> {
    let root = workspace_root();
    let mut blocks = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let name = file.strip_prefix(&root).unwrap_or(&file).display().to_string();
        let mut open: Option<(usize, String, String)> = None;
        for (index, line) in text.lines().enumerate() {
            let fence = line.trim_start().strip_prefix("```");
            match (&mut open, fence) {
                (None, Some(lang)) => open = Some((index + 1, lang.trim().to_owned(), String::new())),
                (Some(_), Some(_)) => {
                    let (start, lang, body) = open.take().expect("open block");
                    blocks.push(Block {
                        origin: format!("{name}:{start}"),
                        lang,
                        text: body,
                    });
                }
                (Some((_, _, body)), None) => {
                    body.push_str(line);
                    body.push('\n');
                }
                (None, None) => {}
            }
        }
        assert!(open.is_none(), "{name}: a code block is not closed");
    }
    blocks
}

fn files_under(dir: &Path, extensions: &[&str]) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| extensions.contains(&e))
            {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn envoy_dir_files() -> Vec<PathBuf> {
    files_under(&workspace_root().join("envoy"), &["yaml", "yml", "json"])
}

fn relative(path: &Path) -> String {
    path.strip_prefix(workspace_root())
        .unwrap_or(path)
        .display()
        .to_string()
}

fn holds_wasm(text: &str) -> bool {
    text.contains("envoy.filters.http.wasm") || text.contains(WASM_FILTER_TYPE) || text.contains("kind: WasmPlugin")
}

/// Every floodgate configuration in the repository's examples: (where, the bytes the module gets).
fn repository_examples() -> Vec<(String, Vec<u8>)> {
    let mut examples = Vec::new();
    let mut add_found =
        |origin: &str, name: &str, text: &str| match find_configurations(name, text.as_bytes(), Options::default()) {
            Ok(found) => {
                for f in found {
                    let bytes = f.bytes.unwrap_or_else(|e| panic!("{origin} ({}): {e}", f.location));
                    examples.push((format!("{origin} {}", f.location).trim_end().to_owned(), bytes));
                }
            }
            Err(e) => assert!(!holds_wasm(text), "{origin}: {e}"),
        };
    for block in markdown_blocks() {
        match block.lang.as_str() {
            "json" => add_found(&block.origin, "block.json", &block.text),
            "yaml" | "yml" if holds_wasm(&block.text) => add_found(&block.origin, "block.yaml", &block.text),
            _ => {}
        }
    }
    for file in envoy_dir_files() {
        let text = std::fs::read_to_string(&file).expect("read");
        add_found(&relative(&file), &file.display().to_string(), &text);
    }
    examples
}

#[test]
fn the_schema_is_a_valid_draft_2020_12_schema() {
    let schema: Value = serde_json::from_str(floodgate_cli::SCHEMA).expect("the schema is JSON");
    assert_eq!(schema["$schema"], "https://json-schema.org/draft/2020-12/schema");
    if let Err(e) = jsonschema::draft202012::meta::validate(&schema) {
        panic!("schema/floodgate.schema.json is not a valid draft 2020-12 schema: {e}");
    }
    let on_disk =
        std::fs::read_to_string(workspace_root().join("schema/floodgate.schema.json")).expect("read the schema");
    assert_eq!(on_disk, floodgate_cli::SCHEMA);
    validator();
    // The committed schema is what schema/generate.py writes.
    let dir = tempfile::tempdir().expect("tempdir");
    let generated = dir.path().join("schema.json");
    let status = Command::new("python3")
        .arg(workspace_root().join("schema/generate.py"))
        .arg(&generated)
        .stdout(Stdio::null())
        .status()
        .expect("run python3 schema/generate.py");
    assert!(status.success(), "schema/generate.py failed");
    let generated = std::fs::read_to_string(&generated).expect("read the generated schema");
    assert!(
        generated == on_disk,
        "schema/floodgate.schema.json differs from what schema/generate.py writes: run it"
    );
}

#[test]
fn every_example_configuration_in_the_repository_matches_the_schema_and_parses() {
    let validator = validator();
    let examples = repository_examples();
    for expected in [
        "README.md",
        "docs/configuration.md",
        "docs/istio.md",
        "envoy/demo.yaml",
        "envoy/compose-envoy.yaml",
        "envoy/compose-global-envoy.yaml",
        "envoy/istio/wasmplugin.yaml",
        "envoy/istio/global-wasmplugin.yaml",
        "envoy/istio/llm-wasmplugin.yaml",
        "envoy/llm.yaml",
        "docs/llm.md",
    ] {
        assert!(
            examples.iter().any(|(origin, _)| origin.starts_with(expected)),
            "no example configuration found in {expected}"
        );
    }
    let mut problems = Vec::new();
    for (origin, bytes) in &examples {
        if let Err(e) = Config::parse(bytes) {
            problems.push(format!("{origin}: the parser refuses it: {e}"));
        }
        let text = String::from_utf8_lossy(bytes);
        let instance: Value = if text.trim().is_empty() {
            json!({})
        } else {
            match serde_json::from_str(&text) {
                Ok(v) => v,
                Err(e) => {
                    problems.push(format!("{origin}: not JSON: {e}"));
                    continue;
                }
            }
        };
        for error in schema_errors(&validator, &instance) {
            problems.push(format!("{origin}: the schema refuses it: {error}"));
        }
    }
    for (origin, _) in &examples {
        println!("example: {origin}");
    }
    println!(
        "{} example configurations, each accepted by the schema and the parser",
        examples.len()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Each object of the configuration: (a JSON pointer into [`everything`], its `$defs` name in the
/// schema, the smallest valid configuration that has it).
const OBJECTS: &[(&str, &str, &str)] = &[
    ("", "", "{}"),
    (
        "/rate_limits/0",
        "rateLimitRule",
        r#"{"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s"}]}"#,
    ),
    (
        "/load_shedding",
        "loadShedding",
        r#"{"load_shedding": {"max_active_requests": 5}}"#,
    ),
    (
        "/load_shedding/classes/0",
        "priorityClass",
        r#"{"load_shedding": {"max_active_requests": 5, "classes": [{"name": "normal", "shed_at": 1}]}}"#,
    ),
    (
        "/load_shedding/queue",
        "queue",
        r#"{"load_shedding": {"max_active_requests": 5, "queue": {"max_queued": 2, "max_wait": "1s"}}}"#,
    ),
    (
        "/load_shedding/classes/0/queue",
        "classQueue",
        r#"{"load_shedding": {"max_active_requests": 5, "queue": {"max_queued": 2, "max_wait": "1s"}, "classes": [{"name": "normal", "shed_at": 1, "queue": {}}]}}"#,
    ),
    ("/health", "health", r#"{"health": {"path": "/h"}}"#),
    ("/watchdog", "watchdog", r#"{"watchdog": {"path": "/alive"}}"#),
    (
        "/rate_limits/0/match",
        "match",
        r#"{"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"methods": ["GET"]}}]}"#,
    ),
    (
        "/rate_limits/0/match/path",
        "pathMatch",
        r#"{"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"path": {"exact": "/a"}}}]}"#,
    ),
    (
        "/rate_limits/0/match/headers/0",
        "headerCondition",
        r#"{"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"headers": [{"name": "x", "present": true}]}}]}"#,
    ),
    (
        "/rate_limits/0/tiers",
        "tiers",
        r#"{"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "tiers": {"header": "x-plan", "limits": {"gold": 9}}}]}"#,
    ),
    (
        "/rate_limits/0/overrides/0",
        "override",
        r#"{"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "overrides": [{"key": ["/a"], "limit": 9}]}]}"#,
    ),
    (
        "/rate_limits/1/cost/estimate",
        "estimate",
        r#"{"rate_limits": [{"name": "q", "key": ["path"], "limit": 5, "window": "1s"},
            {"name": "r", "key": ["path"], "limit": 5, "window": "1s", "cost": {"from": "response_body", "path": "a.b", "estimate": {"default": 1, "max": 2}}}]}"#,
    ),
    (
        "/rate_limits/0/cost",
        "cost",
        r#"{"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "cost": {"from": "request_body"}}]}"#,
    ),
    ("/global", "global", r#"{"global": {"cluster": "floodgate-sync"}}"#),
    (
        "/cluster_selection",
        "clusterSelection",
        r#"{"cluster_selection": {"clusters": ["a"]}}"#,
    ),
    (
        "/cluster_selection/concurrency_limit",
        "concurrencyLimit",
        r#"{"cluster_selection": {"clusters": ["a"], "concurrency_limit": {}}}"#,
    ),
    ("/grpc", "grpc", r#"{"grpc": {}}"#),
    (
        "/load_shedding/per_key",
        "perKey",
        r#"{"load_shedding": {"per_key": {"key": ["path"], "max_active_requests": 2}}}"#,
    ),
    (
        "/cluster_selection/partition",
        "partition",
        r#"{"cluster_selection": {"clusters": ["a"], "partition": {"key": ["path"], "size": 1}}}"#,
    ),
];

/// Optional fields whose default depends on another field, so the schema gives no `default`:
/// ($defs name, field).
const DEFAULT_DEPENDS_ON_ANOTHER_FIELD: &[(&str, &str)] = &[("cost", "default")];

/// The field names serde lists in its "unknown field" message for the object at `pointer`.
fn parser_fields(pointer: &str) -> BTreeSet<String> {
    let mut config = everything();
    config
        .pointer_mut(pointer)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("no object at {pointer}"))
        .insert("zz_unknown".into(), json!(1));
    let error = Config::parse(config.to_string().as_bytes())
        .expect_err("an unknown field is refused")
        .to_string();
    let expected = error
        .split_once("expected ")
        .map(|(_, names)| names)
        .unwrap_or_else(|| panic!("no field list in: {error}"));
    expected.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

#[test]
fn the_schema_and_the_reference_know_every_field_and_default_of_the_parser() {
    let schema: Value = serde_json::from_str(floodgate_cli::SCHEMA).expect("the schema is JSON");
    let reference =
        std::fs::read_to_string(workspace_root().join("docs/configuration.md")).expect("docs/configuration.md");
    let mut problems = Vec::new();
    let mut fields = 0;
    for (pointer, def, minimal) in OBJECTS {
        let object = if def.is_empty() {
            &schema
        } else {
            &schema["$defs"][*def]
        };
        let properties = object["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("$defs.{def} has no properties"));
        let in_schema: BTreeSet<String> = properties.keys().cloned().collect();
        let in_parser = parser_fields(pointer);
        if in_schema != in_parser {
            problems.push(format!(
                "object at `{pointer}`: the parser knows {in_parser:?}, the schema {in_schema:?}"
            ));
        }
        let required: BTreeSet<&str> = object["required"]
            .as_array()
            .map_or_else(BTreeSet::new, |r| r.iter().filter_map(Value::as_str).collect());
        let base: Value = serde_json::from_str(minimal).expect("minimal JSON");
        let parsed_base = Config::parse(minimal.as_bytes()).unwrap_or_else(|e| panic!("{minimal}: {e}"));
        for (name, property) in properties {
            fields += 1;
            if !reference.contains(&format!("`{name}`")) {
                problems.push(format!("docs/configuration.md does not mention `{name}`"));
            }
            if property.get("description").is_none()
                && property.get("$ref").is_none()
                && property.get("anyOf").is_none()
            {
                problems.push(format!("{def}.{name}: no description in the schema"));
            }
            let Some(default) = property.get("default") else {
                let section = property.get("anyOf").is_some()
                    || ["#/$defs/concurrencyLimit", "#/$defs/grpc"].iter().any(|def| property.get("$ref") == Some(&json!(def)));
                // A default that depends on another field (`cost.default`: by `from`) has no
                // single value for the schema to give; the reference states it per case.
                let depends = DEFAULT_DEPENDS_ON_ANOTHER_FIELD.contains(&(*def, name.as_str()));
                if !required.contains(name.as_str()) && !section && !depends {
                    problems.push(format!("{def}.{name}: optional but the schema gives no default"));
                }
                continue;
            };
            // Setting a field to the schema's default must change nothing (a field the minimal
            // configuration sets, one of two that can stand for each other, is not at its default).
            if base.pointer(pointer).and_then(|o| o.get(name)).is_some() {
                continue;
            }
            let mut explicit = base.clone();
            explicit
                .pointer_mut(pointer)
                .and_then(Value::as_object_mut)
                .expect("object in the minimal configuration")
                .insert(name.clone(), default.clone());
            match Config::parse(explicit.to_string().as_bytes()) {
                Ok(parsed) if parsed == parsed_base => {}
                Ok(_) => problems.push(format!(
                    "{def}.{name}: the schema's default {default} is not the parser's"
                )),
                // A cross-field rule the schema cannot express (`spill_below` only with
                // `when_unavailable: spill`) may refuse the default in the minimal configuration.
                Err(e) if is_known_gap(&e.to_string(), Some(default)) => {}
                Err(e) => problems.push(format!("{def}.{name}: the schema's default {default} is refused: {e}")),
            }
        }
    }
    println!(
        "{fields} fields in {} objects: the schema, the parser and docs/configuration.md agree",
        OBJECTS.len()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A configuration that sets every field, to a value other than its default.
fn everything() -> Value {
    json!({
        "rate_limits": [
            {"name": "per-key", "key": [{"header": "x-api-key"}, "source_ip", "path", "method", "authority"],
             "limit": 100, "window": "1m", "capacity": 1024, "missing_key": "shared", "scope": "global",
             "match": {"path": {"template": "/users/*/orders"}, "methods": ["POST"],
                       "headers": [{"name": "x-env", "equals": "prod"}], "authority": "api.example.com"},
             "tiers": {"header": "x-plan", "limits": {"gold": 1000}},
             "overrides": [{"key": ["vip", "10.0.0.1", "/users/1/orders", "POST", "api.example.com"], "limit": 5000}],
             "cost": {"from": "response_header", "header": "x-tokens-used", "default": 1}, "mode": "shadow"},
            {"name": "per-ip", "key": ["source_ip"], "limit": 1000, "window": "10s",
             "cost": {"from": "response_body", "path": "usage.total_tokens", "max_body_bytes": 65536,
                      "estimate": {"header": "x-max-tokens", "body": ["max_completion_tokens", "max_tokens"], "max_body_bytes": 131072,
                                   "default": 100, "max": 1000}, "unreported": "refund"}}
        ],
        "stat_prefix": "edge",
        "ratelimit_headers": "on_reject",
        "mode": "shadow",
        "access_log": true,
        "load_shedding": {
            "max_active_requests": 500, "max_loop_lag": "50ms", "lag_probe_interval": "20ms", "priority_header": "x-priority",
            "classes": [{"name": "critical", "shed_at": 1.0, "queue": {"max_queued": 10, "max_wait": "500ms"}}, {"name": "batch", "shed_at": 0.5}],
            "default_class": "batch", "retry_after": "2s", "mode": "shadow",
            "queue": {"max_queued": 100, "max_wait": "2s", "order": "fifo", "target": "10ms", "interval": "200ms"},
            "per_key": {"key": [{"header": "x-api-key"}, "source_ip"], "max_active_requests": 8, "capacity": 2048, "mode": "shadow"}
        },
        "cluster_selection": {
            "route_header": "x-cluster", "clusters": ["zone-a", "zone-b"], "bucket_width": "2s", "buckets": 10,
            "decay_factor": 2, "weight_exponent": 2.5, "no_data_floor": 0.001, "no_data_floor_on": "rate",
            "failure_statuses": ["5xx", 429], "failure_grpc_statuses": ["UNAVAILABLE", 13, "RESOURCE_EXHAUSTED"],
            "concurrency_limit": {"algorithm": "aimd", "initial_limit": 10, "min_limit": 2, "max_limit": 100,
                                  "backoff_ratio": 0.8, "timeout": "2s"},
            "retry_after": "3s",
            "partition": {"key": [{"header": "x-api-key"}], "size": 1, "when_unavailable": "spill", "spill_below": 0.25, "mode": "shadow"}
        },
        "health": {"path": "/healthz", "dependencies": "fail", "min_success_rate": 0.25},
        "watchdog": {"path": "/livez", "worker_silence": "8s", "max_loop_lag": "1s", "lag_for": "1m",
                     "max_memory_mb": 512, "recover_after": 5},
        "global": {"cluster": "outbound|9090||floodgate-sync.floodgate.svc.cluster.local",
                   "authority": "floodgate-sync.floodgate.svc.cluster.local", "sync_interval": "250ms",
                   "timeout": "2s", "max_keys": 1000, "key_secret": "a fleet-wide secret of ours",
                   "token": "a-fleet-token-0123456789"},
        "grpc": {"rate_limited_status": "UNAVAILABLE", "shed_status": 8, "no_capacity_status": "ABORTED"}
    })
}

/// Values put in place of every node of [`everything`].
fn replacements() -> Vec<Value> {
    vec![
        json!(null),
        json!(true),
        json!(0),
        json!(-1),
        json!(1),
        json!(2.0),
        json!(0.5),
        json!(1.5),
        json!(100),
        json!(4294967296u64),
        json!(""),
        json!("x"),
        json!("10s"),
        json!("0s"),
        json!("/p"),
        json!("5xx"),
        json!(":authority"),
        json!([]),
        json!({}),
        json!(["path"]),
        json!([{}]),
        json!([1]),
    ]
}

/// Every JSON pointer below the root of `value`.
fn pointers(value: &Value, at: String, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let p = format!("{at}/{key}");
                out.push(p.clone());
                pointers(child, p, out);
            }
        }
        Value::Array(items) => {
            for (index, child) in items.iter().enumerate() {
                let p = format!("{at}/{index}");
                out.push(p.clone());
                pointers(child, p, out);
            }
        }
        _ => {}
    }
}

/// (what, the mutated configuration, the value put in, if any).
fn mutations(base: &Value) -> Vec<(String, Value, Option<Value>)> {
    let mut out = Vec::new();
    let mut all = vec![String::new()];
    pointers(base, String::new(), &mut all);
    for p in &all {
        let node = base.pointer(p).expect("pointer").clone();
        if !p.is_empty() {
            for r in replacements() {
                let mut doc = base.clone();
                *doc.pointer_mut(p).expect("pointer") = r.clone();
                out.push((format!("{p} = {r}"), doc, Some(r)));
            }
        }
        match &node {
            Value::Object(map) => {
                for key in map.keys() {
                    let mut doc = base.clone();
                    doc.pointer_mut(p)
                        .and_then(Value::as_object_mut)
                        .expect("object")
                        .remove(key);
                    out.push((format!("{p}/{key} removed"), doc, None));
                }
                let mut doc = base.clone();
                doc.pointer_mut(p)
                    .and_then(Value::as_object_mut)
                    .expect("object")
                    .insert("unknown_field".into(), json!(1));
                out.push((format!("{p}/unknown_field added"), doc, None));
            }
            Value::Array(items) if !items.is_empty() => {
                let mut doc = base.clone();
                doc.pointer_mut(p).and_then(Value::as_array_mut).expect("array").clear();
                out.push((format!("{p} emptied"), doc, None));
                let mut doc = base.clone();
                let array = doc.pointer_mut(p).and_then(Value::as_array_mut).expect("array");
                let first = array[0].clone();
                array.push(first);
                out.push((format!("{p} with its first item repeated"), doc, None));
            }
            _ => {}
        }
    }
    out
}

/// Hand-written samples: (configuration, accepted by the parser?). The schema must agree, but
/// for the documented gaps (`gap: true`: the schema accepts, the parser refuses).
fn edge_cases() -> Vec<(Value, bool, bool)> {
    let rule = |field: &str, v: Value| {
        let mut r = json!({"name": "r", "key": ["path"], "limit": 5, "window": "1s"});
        r[field] = v;
        json!({"rate_limits": [r]})
    };
    let selection = |field: &str, v: Value| {
        let mut s = json!({"clusters": ["a"]});
        s[field] = v;
        json!({"cluster_selection": s})
    };
    let limit =
        |field: &str, v: Value| json!({"cluster_selection": {"clusters": ["a"], "concurrency_limit": {field: v}}});
    let shedding = |field: &str, v: Value| {
        let mut s = json!({"max_active_requests": 5});
        s[field] = v;
        json!({"load_shedding": s})
    };
    let (ok, bad, gap) = ((true, false), (false, false), (false, true));
    let cases: Vec<(Value, (bool, bool))> = vec![
        (json!({}), ok),
        (json!([]), bad),
        (json!("{}"), bad),
        (
            json!({"load_shedding": null, "cluster_selection": null, "health": null}),
            ok,
        ),
        (json!({"rate_limits": null}), bad),
        (json!({"stat_prefix": null}), bad),
        (json!({"rate_limits": []}), ok),
        (json!({"$schema": "x"}), bad),
        (json!({"rate_limits": [{"name": "b", "key": ["path"], "limit": 5, "window": "1s", "algorithm": "token_bucket", "burst": 3, "max_delay": "2s"}]}), ok),
        (json!({"rate_limits": [{"name": "b", "key": ["path"], "limit": 5, "window": "1s", "algorithm": "token_bucket", "burst": 3, "max_delay": null}]}), ok),
        (json!({"rate_limits": [{"name": "b", "key": ["path"], "limit": 5, "window": "1s", "algorithm": "token_bucket", "burst": null}]}), bad),
        (json!({"rate_limits": [{"name": "b", "key": ["path"], "limit": 5, "window": "1s", "algorithm": "token_bucket", "burst": 3, "max_delay": "61s"}]}), gap),
        (json!({"global": {"cluster": "s"}, "rate_limits": [{"name": "b", "key": ["path"], "limit": 5, "window": "1s", "algorithm": "token_bucket", "burst": 3, "scope": "global"}]}), bad),
        (rule("algorithm", json!("sliding_window")), ok),
        (rule("algorithm", json!("token_bucket")), bad),
        (rule("burst", json!(3)), bad),
        (rule("burst", json!(null)), ok),
        (rule("max_delay", json!("1s")), bad),
        // durations
        (rule("window", json!("250ms")), ok),
        (rule("window", json!("010s")), ok),
        (rule("window", json!("0s")), bad),
        (rule("window", json!("000ms")), bad),
        (rule("window", json!("8784h")), ok),
        (rule("window", json!("8785h")), bad),
        (rule("window", json!("527040m")), ok),
        (rule("window", json!("527041m")), bad),
        (rule("window", json!("31622400s")), ok),
        (rule("window", json!("31622401s")), bad),
        (rule("window", json!("31622400000ms")), ok),
        (rule("window", json!("31622400001ms")), bad),
        (rule("window", json!("99999999999999999999999h")), bad),
        (rule("window", json!("1.5s")), bad),
        (rule("window", json!("1d")), bad),
        (rule("window", json!("10S")), bad),
        (rule("window", json!(" 1s")), bad),
        (rule("window", json!("-1s")), bad),
        (rule("window", json!(10)), bad),
        // names and key parts
        (rule("name", json!("a".repeat(64))), ok),
        (rule("name", json!("a".repeat(65))), bad),
        (rule("name", json!("per-key_v1.2")), ok),
        (rule("name", json!("a b")), bad),
        (rule("name", json!("ü")), bad),
        (rule("key", json!([{"header": ":authority"}])), ok),
        (rule("key", json!([{"header": "X-Api-Key"}])), ok),
        (rule("key", json!([{"header": "a b"}])), bad),
        (rule("key", json!([{"header": ":"}])), bad),
        (rule("key", json!([{"header": "::a"}])), bad),
        (rule("key", json!([{"header": "x", "cookie": "y"}])), bad),
        (rule("key", json!(["ip"])), bad),
        (rule("key", json!([])), bad),
        // integers
        (rule("limit", json!(4294967295u64)), ok),
        (rule("limit", json!(4294967296u64)), bad),
        (rule("limit", json!(5.0)), gap),
        (rule("limit", json!(5.5)), bad),
        (rule("limit", json!("5")), bad),
        (rule("capacity", json!(16777216)), ok),
        (rule("capacity", json!(16777217)), bad),
        (rule("missing_key", json!("shared")), ok),
        (rule("missing_key", json!("deny")), bad),
        (
            json!({"rate_limits": [{"name": "a", "key": ["path"], "limit": 1, "window": "1s"},
                                {"name": "a", "key": ["method"], "limit": 1, "window": "1s"}]}),
            gap,
        ),
        (json!({"ratelimit_headers": "never"}), bad),
        // modes and the access log
        (json!({"mode": "shadow"}), ok),
        (json!({"mode": "enforce"}), ok),
        (json!({"mode": "dry_run"}), bad),
        (json!({"mode": "Shadow"}), bad),
        (json!({"mode": null}), bad),
        (json!({"access_log": true}), ok),
        (json!({"access_log": "yes"}), bad),
        (json!({"access_log": null}), bad),
        (rule("mode", json!("shadow")), ok),
        (rule("mode", json!("observe")), bad),
        (shedding("mode", json!("shadow")), ok),
        (shedding("mode", json!("off")), bad),
        (json!({"load_shedding": {"per_key": {"key": ["path"], "max_active_requests": 2, "mode": "shadow"}}}), ok),
        (json!({"load_shedding": {"per_key": {"key": ["path"], "max_active_requests": 2, "mode": "log"}}}), bad),
        (json!({"cluster_selection": {"clusters": ["a"], "partition": {"key": ["path"], "size": 1, "mode": "shadow"}}}), ok),
        (json!({"cluster_selection": {"clusters": ["a"], "partition": {"key": ["path"], "size": 1, "mode": 1}}}), bad),
        // routes, and not with cluster selection
        (rule("match", json!({"routes": ["checkout"]})), ok),
        (rule("match", json!({"routes": ["a", "b"], "methods": ["POST"]})), ok),
        (rule("match", json!({"routes": ["x".repeat(1024)]})), ok),
        (rule("match", json!({"routes": ["x".repeat(1025)]})), bad),
        (rule("match", json!({"routes": (0..1024).map(|i| format!("r{i}")).collect::<Vec<_>>()})), ok),
        (rule("match", json!({"routes": (0..1025).map(|i| format!("r{i}")).collect::<Vec<_>>()})), bad),
        (rule("match", json!({"routes": []})), bad),
        (rule("match", json!({"routes": [""]})), bad),
        (rule("match", json!({"routes": "checkout"})), bad),
        (rule("match", json!({"routes": [7]})), bad),
        (rule("match", json!({"routes": null, "methods": ["GET"]})), ok),
        (
            json!({"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"routes": ["checkout"]}}],
                   "cluster_selection": {"clusters": ["a"]}}),
            bad,
        ),
        (
            json!({"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"routes": ["checkout"]}}],
                   "cluster_selection": null}),
            ok,
        ),
        (
            json!({"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"routes": null, "methods": ["GET"]}}],
                   "cluster_selection": {"clusters": ["a"]}}),
            ok,
        ),
        // load shedding and health
        (shedding("retry_after", json!("5s")), ok),
        (shedding("priority_header", json!(":authority")), ok),
        (shedding("classes", json!([{"name": "normal", "shed_at": 1}])), ok),
        (shedding("classes", json!([{"name": "normal", "shed_at": 0}])), bad),
        (shedding("classes", json!([{"name": "normal", "shed_at": 1.01}])), bad),
        (
            shedding(
                "classes",
                json!([{"name": "normal", "shed_at": 0.5}, {"name": "normal", "shed_at": 1}]),
            ),
            gap,
        ),
        (shedding("classes", json!([{"name": "low", "shed_at": 0.5}])), gap),
        (shedding("default_class", json!("low")), ok),
        (shedding("default_class", json!("bulk")), gap),
        (json!({"load_shedding": {}}), bad),
        (json!({"health": {"path": "/"}}), ok),
        (json!({"health": {"path": "/a?b"}}), bad),
        (json!({"health": {"path": "/a#b"}}), bad),
        (json!({"health": {"path": "a"}}), bad),
        (json!({"health": {}}), bad),
        // cluster selection
        (
            selection("clusters", json!(["outbound|80||reviews.default.svc.cluster.local"])),
            ok,
        ),
        (selection("clusters", json!(["x".repeat(255)])), ok),
        (selection("clusters", json!(["x".repeat(256)])), bad),
        (selection("clusters", json!(["a", "a"])), bad),
        (selection("clusters", json!(["é"])), bad),
        (
            selection("clusters", json!((0..64).map(|i| format!("c{i}")).collect::<Vec<_>>())),
            ok,
        ),
        (
            selection("clusters", json!((0..65).map(|i| format!("c{i}")).collect::<Vec<_>>())),
            bad,
        ),
        (selection("route_header", json!("X-Cluster")), ok),
        (selection("route_header", json!(":authority")), bad),
        (selection("buckets", json!(60)), ok),
        (selection("buckets", json!(61)), bad),
        (selection("decay_factor", json!(1)), ok),
        (selection("decay_factor", json!(0.99)), bad),
        (selection("decay_factor", json!(1000)), ok),
        (selection("decay_factor", json!(1000.5)), bad),
        (selection("weight_exponent", json!(100)), ok),
        (selection("weight_exponent", json!(100.5)), bad),
        (selection("weight_exponent", json!(0.001)), ok),
        (selection("weight_exponent", json!(0)), bad),
        (selection("no_data_floor", json!(0)), ok),
        (selection("no_data_floor", json!(1)), ok),
        (selection("no_data_floor", json!(-0.1)), bad),
        (
            selection(
                "failure_statuses",
                json!(["1xx", "5xx", 100, 599, "404", "+404", "0404"]),
            ),
            ok,
        ),
        (selection("failure_statuses", json!(["6xx"])), bad),
        (selection("failure_statuses", json!(["0xx"])), bad),
        (selection("failure_statuses", json!(["5XX"])), bad),
        (selection("failure_statuses", json!([600])), bad),
        (selection("failure_statuses", json!([99])), bad),
        (selection("failure_statuses", json!(["99"])), bad),
        (selection("failure_statuses", json!([503.0])), gap),
        (selection("failure_statuses", json!([])), bad),
        (selection("retry_after", json!("2s")), ok),
        // gRPC status codes
        (selection("failure_grpc_statuses", json!([])), ok),
        (selection("failure_grpc_statuses", json!(["CANCELLED", "UNAUTHENTICATED", 1, 16])), ok),
        (selection("failure_grpc_statuses", json!(["OK"])), bad),
        (selection("failure_grpc_statuses", json!([0])), bad),
        (selection("failure_grpc_statuses", json!([17])), bad),
        (selection("failure_grpc_statuses", json!(["unavailable"])), bad),
        (selection("failure_grpc_statuses", json!(["14"])), bad),
        (selection("failure_grpc_statuses", json!([14.0])), gap),
        (json!({"grpc": {"rate_limited_status": "UNAVAILABLE"}}), ok),
        (json!({"grpc": {"shed_status": 16, "no_capacity_status": "DATA_LOSS"}}), ok),
        (json!({"grpc": {"rate_limited_status": "OK"}}), bad),
        (json!({"grpc": {"rate_limited_status": null}}), bad),
        (json!({"grpc": {"rate_limited_as_resource_exhausted": false}}), bad),
        (json!({"grpc": null}), bad),
        (json!({"grpc": {}}), ok),
        (limit("algorithm", json!("aimd")), ok),
        (limit("algorithm", json!("vegas")), bad),
        (limit("backoff_ratio", json!(0.5)), ok),
        (limit("backoff_ratio", json!(1)), bad),
        (limit("backoff_ratio", json!(0)), bad),
        (limit("max_limit", json!(5)), gap),
        (limit("min_limit", json!(50)), gap),
        (limit("initial_limit", json!(200)), ok),
        (limit("timeout", json!("250ms")), ok),
        (
            json!({"cluster_selection": {"clusters": ["a"], "concurrency_limit": null}}),
            bad,
        ),
    ];
    cases
        .into_iter()
        .map(|(v, (accepted, gap))| (v, accepted, gap))
        .collect()
}

fn is_known_gap(problem: &str, put: Option<&Value>) -> bool {
    let whole_float = put.is_some_and(|v| v.is_f64() && v.as_f64().is_some_and(|f| f.fract() == 0.0));
    KNOWN_GAPS.iter().any(|gap| problem.contains(gap))
        || (whole_float && (problem.contains("positive integer, got") || problem.contains("floating point")))
}

#[test]
fn the_schema_agrees_with_the_parser() {
    let validator = validator();
    let mut problems = Vec::new();
    let (mut accepted, mut refused, mut gaps) = (0, 0, 0);

    for (config, parser_accepts, gap) in edge_cases() {
        let parsed = Config::parse(config.to_string().as_bytes());
        let schema_accepts = validator.is_valid(&config);
        assert_eq!(parsed.is_ok(), parser_accepts, "the parser on {config}: {parsed:?}");
        let expected_schema = parser_accepts || gap;
        if schema_accepts != expected_schema {
            problems.push(format!(
                "edge case {config}: the schema {} it (parser: {:?}; schema: {:?})",
                if schema_accepts { "accepts" } else { "refuses" },
                parsed.as_ref().err().map(ToString::to_string),
                schema_errors(&validator, &config)
            ));
        }
        if gap {
            let problem = parsed.as_ref().err().map(ToString::to_string).unwrap_or_default();
            assert!(
                is_known_gap(&problem, None)
                    || problem.contains("positive integer, got")
                    || problem.contains("floating point"),
                "{config}: `{problem}` is not a documented gap"
            );
        }
        match (parser_accepts, gap) {
            (true, _) => accepted += 1,
            (false, false) => refused += 1,
            (false, true) => gaps += 1,
        }
    }

    let base = everything();
    assert!(Config::parse(base.to_string().as_bytes()).is_ok());
    assert!(validator.is_valid(&base), "{:?}", schema_errors(&validator, &base));
    let samples = mutations(&base);
    for (what, config, put) in &samples {
        let schema_accepts = validator.is_valid(config);
        match (schema_accepts, Config::parse(config.to_string().as_bytes())) {
            (true, Ok(_)) => accepted += 1,
            (false, Err(_)) => refused += 1,
            (false, Ok(_)) => problems.push(format!(
                "{what}: the parser accepts it, the schema refuses it: {:?}",
                schema_errors(&validator, config)
            )),
            (true, Err(e)) if is_known_gap(&e.to_string(), put.as_ref()) => gaps += 1,
            (true, Err(e)) => problems.push(format!("{what}: the schema accepts it, the parser refuses it: {e}")),
        }
    }
    println!(
        "schema vs parser: {} edge cases + {} mutations: {accepted} accepted by both, {refused} refused by both, \
         {gaps} refused by the parser alone (documented gaps), {} disagreements",
        edge_cases().len(),
        samples.len(),
        problems.len()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(accepted > 100 && refused > 300 && gaps > 5, "too few samples of a kind");
}

// ---------------------------------------------------------------------------------------------
// envoy --mode validate
// ---------------------------------------------------------------------------------------------

/// Points every `vm_config.code.local.filename` of an Envoy document at the built module (the
/// one that reads response bodies where the document names `floodgate-llm.wasm`).
fn use_module(value: &mut Value, module: &str) {
    match value {
        Value::Object(map) => {
            if let Some(Value::Object(local)) = map.get_mut("local") {
                let llm = local.get("filename").and_then(Value::as_str).is_some_and(|f| f.ends_with("floodgate-llm.wasm"));
                if local.contains_key("filename") {
                    let module = if llm { llm_wasm_module().display().to_string() } else { module.to_owned() };
                    local.insert("filename".into(), json!(module));
                }
            }
            map.values_mut().for_each(|v| use_module(v, module));
        }
        Value::Array(items) => items.iter_mut().for_each(|v| use_module(v, module)),
        _ => {}
    }
}

/// A bootstrap around an `http_filters` snippet: one listener routing to `backend`, and a static
/// cluster for `backend` and for every cluster named in the snippet's floodgate configurations.
fn bootstrap_around(snippet: &Value, clusters: &BTreeSet<String>) -> Value {
    let cluster = |name: &str| {
        json!({"name": name, "type": "STATIC", "connect_timeout": "1s", "load_assignment": {"cluster_name": name,
               "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9}}}}]}]}})
    };
    let mut all: Vec<Value> = vec![cluster("backend")];
    all.extend(clusters.iter().map(|c| cluster(c)));
    json!({"static_resources": {
        "listeners": [{"name": "front", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "snippet",
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "backend"}}]}]},
                "http_filters": snippet["http_filters"]}}]}]}],
        "clusters": all}})
}

/// Every Envoy configuration to validate: (where, the JSON bootstrap with the module path set).
fn envoy_configurations() -> Vec<(String, Value)> {
    let module = wasm_module().display().to_string();
    let mut configs = Vec::new();
    for file in envoy_dir_files() {
        let text = std::fs::read_to_string(&file).expect("read");
        let documents = parse_documents(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for mut document in documents {
            if document.get("static_resources").is_some() || document.get("admin").is_some() {
                use_module(&mut document, &module);
                configs.push((relative(&file), document));
            }
        }
    }
    for block in markdown_blocks() {
        if !matches!(block.lang.as_str(), "yaml" | "yml") || !holds_wasm(&block.text) {
            continue;
        }
        let documents = parse_documents(&block.text).unwrap_or_else(|e| panic!("{}: {e}", block.origin));
        for mut document in documents {
            if document.get("static_resources").is_some() {
                use_module(&mut document, &module);
                configs.push((block.origin.clone(), document));
            } else if document.get("http_filters").is_some() {
                let clusters: BTreeSet<String> =
                    find_configurations("snippet.yaml", block.text.as_bytes(), Options::default())
                        .unwrap_or_default()
                        .iter()
                        .filter_map(|f| f.bytes.as_ref().ok().and_then(|b| Config::parse(b).ok()))
                        .filter_map(|c| c.cluster_selection)
                        .flat_map(|s| s.clusters.into_iter().map(|c| c.as_str().to_owned()))
                        .collect();
                let mut bootstrap = bootstrap_around(&document, &clusters);
                use_module(&mut bootstrap, &module);
                configs.push((format!("{} (http_filters in a bootstrap)", block.origin), bootstrap));
            }
        }
    }
    configs
}

#[test]
fn every_envoy_configuration_passes_envoy_validate() {
    let configs = envoy_configurations();
    for expected in [
        "envoy/demo.yaml",
        "envoy/compose-envoy.yaml",
        "envoy/compose-upstreams.yaml",
        "envoy/compose-global-envoy.yaml",
        "envoy/llm.yaml",
        "README.md",
    ] {
        assert!(
            configs.iter().any(|(o, _)| o.starts_with(expected)),
            "no Envoy configuration found in {expected}"
        );
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut problems = Vec::new();
    for (index, (origin, bootstrap)) in configs.iter().enumerate() {
        let path = dir.path().join(format!("config-{index}.json"));
        std::fs::write(&path, bootstrap.to_string()).expect("write");
        let out = Command::new(envoy_binary())
            .args(["--mode", "validate", "-l", "warning", "-c"])
            .arg(&path)
            .current_dir(workspace_root())
            .output()
            .expect("run envoy --mode validate");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() && text.contains("OK") {
            println!("envoy --mode validate: {origin}: OK");
        } else {
            problems.push(format!("{origin}: envoy --mode validate failed:\n{}", tail(&text, 12)));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Gives every non-zero `port_value` a free port (the same old port, the same new one), so a
/// configuration with fixed ports can run beside anything else on this machine.
fn remap_ports(value: &mut Value) {
    fn collect(value: &Value, found: &mut Vec<u64>) {
        match value {
            Value::Object(map) => {
                for (key, child) in map {
                    match (key.as_str(), child.as_u64()) {
                        ("port_value", Some(port)) if port != 0 => {
                            if !found.contains(&port) {
                                found.push(port);
                            }
                        }
                        _ => collect(child, found),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| collect(v, found)),
            _ => {}
        }
    }
    fn replace(value: &mut Value, ports: &BTreeMap<u64, u16>) {
        match value {
            Value::Object(map) => {
                for (key, child) in map.iter_mut() {
                    match (key.as_str(), child.as_u64().and_then(|p| ports.get(&p))) {
                        ("port_value", Some(new)) => *child = json!(new),
                        _ => replace(child, ports),
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| replace(v, ports)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    collect(value, &mut found);
    let ports = found.iter().copied().zip(free_ports(found.len())).collect();
    replace(value, &ports);
}

/// Every `socket_address.address` of a document.
fn addresses(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            if let Some(address) = map
                .get("socket_address")
                .and_then(|s| s.get("address"))
                .and_then(Value::as_str)
            {
                out.push(address.to_owned());
            }
            map.values().for_each(|v| addresses(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| addresses(v, out)),
        _ => {}
    }
}

async fn probe(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> RawResponse {
    let headers: Vec<(&[u8], &[u8])> = headers.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())).collect();
    raw_request(addr, &raw_get_request(path.as_bytes(), &headers))
        .await
        .unwrap_or_else(|e| panic!("GET {path} on {addr}: {e}"))
}

/// The Envoy configurations of envoy/ that bind only loopback addresses (the Docker Compose ones
/// bind all of a container's addresses and run in docker_compose_demo_serves_limits_sheds_and_counts)
/// are started here and probed: ready, a 200 through floodgate, the health endpoint, a 429 with
/// its headers from a rule keyed on headers only, floodgate's metrics in /stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_envoy_configurations_start_and_answer() {
    let module = wasm_module().display().to_string();
    let mut started_any = Vec::new();
    for file in envoy_dir_files() {
        let text = std::fs::read_to_string(&file).expect("read");
        let Ok(documents) = parse_documents(&text) else {
            continue;
        };
        let Some(mut bootstrap) = documents.into_iter().find(|d| d.get("static_resources").is_some()) else {
            continue;
        };
        let mut bound = Vec::new();
        addresses(&bootstrap, &mut bound);
        if !bound.iter().all(|a| a == "127.0.0.1" || a == "::1") {
            continue;
        }
        let Ok(found) = find_configurations(&file.display().to_string(), text.as_bytes(), Options::default()) else {
            continue;
        };
        let origin = relative(&file);
        let config =
            Config::parse(found[0].bytes.as_ref().expect("configuration bytes")).expect("a valid configuration");
        use_module(&mut bootstrap, &module);
        let front = bootstrap["static_resources"]["listeners"]
            .as_array()
            .and_then(|ls| ls.iter().find(|l| l.to_string().contains(WASM_FILTER_TYPE)))
            .and_then(|l| l["name"].as_str())
            .expect("a listener with the floodgate filter")
            .to_owned();
        println!("{origin}: starting Envoy");
        // Its fixed ports moved to free ones, afresh for each start (one can be taken before
        // Envoy binds it).
        let envoy = Envoy::launched_with(&launch().current_dir(workspace_root()), || {
            let mut bootstrap = bootstrap.clone();
            remap_ports(&mut bootstrap);
            bootstrap.to_string()
        });
        let admin = envoy.admin_addr();
        let front = envoy.process().listener(&front).unwrap_or_else(|| panic!("{origin}: no address for listener {front}"));

        let mut statuses = Vec::new();
        for i in 0..10 {
            let key = format!("operator-probe-{i}");
            let response = probe(front, "/", &[("x-api-key", key.as_str())]).await;
            statuses.push(response.status);
            if response.status == 200 {
                break;
            }
        }
        assert_eq!(statuses.last(), Some(&200), "{origin}: no 200 in {statuses:?}");
        if let Some(health) = &config.health {
            let response = probe(front, &health.path, &[]).await;
            assert_eq!(
                response.status,
                200,
                "{origin}: {}: {}",
                health.path,
                String::from_utf8_lossy(&response.body)
            );
            assert!(
                String::from_utf8_lossy(&response.body).contains(r#""status":"ok""#),
                "{origin}: health body"
            );
        }
        let headers_only = config.rate_limits.iter().find(|r| {
            r.limit.get().get() <= 50 && r.key.iter().all(|k| matches!(k, floodgate::config::KeyPart::Header(_)))
        });
        if let Some(rule) = headers_only {
            let value = format!("operator-429-{}", std::process::id());
            let names: Vec<String> = rule
                .key
                .iter()
                .filter_map(|k| match k {
                    floodgate::config::KeyPart::Header(name) => Some(name.clone()),
                    _ => None,
                })
                .collect();
            let headers: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), value.as_str())).collect();
            let mut last = None;
            for _ in 0..=rule.limit.get().get() {
                last = Some(probe(front, "/", &headers).await);
            }
            let last = last.expect("a response");
            let head = last.head.to_ascii_lowercase();
            assert_eq!(
                last.status,
                429,
                "{origin}: request {} with one key of rule {}: {}",
                rule.limit.get().get() + 1,
                rule.name,
                last.head
            );
            assert!(
                head.contains("retry-after:") && head.contains("content-type: application/problem+json"),
                "{origin}: {}",
                last.head
            );
            assert!(
                head.contains(&format!("ratelimit-policy: \"{}\"", rule.name)),
                "{origin}: {}",
                last.head
            );
        }
        let (status, stats) = http_get_blocking(admin, "/stats").expect("GET /stats");
        let prefix = format!("{WASM_CUSTOM_NAMESPACE}{}.", config.stat_prefix);
        assert!(
            status == 200 && stats.contains(&prefix),
            "{origin}: no {prefix}* in /stats"
        );
        println!(
            "{origin}: started; 200 after {statuses:?}; health {}; 429 {}; {} metrics under {prefix}",
            if config.health.is_some() {
                "ok"
            } else {
                "not configured"
            },
            headers_only.map_or("not probed (no rule keyed on headers only)".to_owned(), |r| format!(
                "from {}",
                r.name
            )),
            stats.lines().filter(|l| l.starts_with(&prefix)).count()
        );
        started_any.push(origin);
        drop(envoy);
    }
    assert!(
        started_any.iter().any(|o| o == "envoy/demo.yaml"),
        "envoy/demo.yaml was not started: {started_any:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The floodgate command
// ---------------------------------------------------------------------------------------------

/// The `floodgate` binary of floodgate-cli, built once.
fn cli() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = Command::new(env!("CARGO"))
            .args([
                "build",
                "-q",
                "-p",
                "floodgate-cli",
                "--bin",
                "floodgate",
                "--message-format=json",
            ])
            .current_dir(workspace_root())
            .stderr(Stdio::inherit())
            .output()
            .expect("run cargo build -p floodgate-cli");
        assert!(out.status.success(), "cargo build -p floodgate-cli failed");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|m| m["target"]["name"] == "floodgate")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo build names the floodgate executable")
    })
}

fn floodgate(args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    let mut child = Command::new(cli())
        .args(args)
        .current_dir(workspace_root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run floodgate");
    {
        use std::io::Write;
        let mut input = child.stdin.take().expect("stdin");
        input.write_all(stdin.unwrap_or("").as_bytes()).expect("write stdin");
    }
    let Output { status, stdout, stderr } = child.wait_with_output().expect("wait");
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

#[test]
fn floodgate_validate_accepts_every_example_file_without_a_warning() {
    let files: Vec<String> = envoy_dir_files()
        .iter()
        .filter(|f| holds_wasm(&std::fs::read_to_string(f).expect("read")))
        .map(|f| relative(f))
        .collect();
    assert!(files.len() >= 3, "{files:?}");
    let mut args = vec!["validate"];
    args.extend(files.iter().map(String::as_str));
    let (code, out, err) = floodgate(&args, None);
    print!("{out}{err}");
    assert_eq!(code, 0, "floodgate validate {files:?}:\n{out}{err}");
    assert_eq!(err, "", "warnings or errors on the repository's own examples");
    for file in &files {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("{file}: ")) && l.contains(": ok: ")),
            "{file}:\n{out}"
        );
    }
}

#[test]
fn floodgate_validate_names_the_field_like_the_module_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.display().to_string()
    };
    // A bare JSON configuration.
    let bad_window =
        r#"{"rate_limits": [{"name": "per-ip", "key": ["source_ip"], "limit": 5, "window": "ten seconds"}]}"#;
    let bare = write("bad.json", bad_window);
    let (code, out, err) = floodgate(&["validate", &bare], None);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    let expected = r#"rate_limits[0].window: "ten seconds" is not a duration (use a whole number and a unit: "250ms", "10s", "1m", "1h")"#;
    assert_eq!(err, format!("{bare}: {expected}\n"));
    // The module logs the same words in Envoy.
    let line = config_error_line(&Envoy::start_expecting_failure(bad_window)).expect("an invalid configuration line");
    assert_eq!(line.trim_end(), format!("invalid configuration: {expected}"));

    // An Envoy bootstrap: the compose one with an empty cluster list.
    let compose = std::fs::read_to_string(workspace_root().join("envoy/compose-envoy.yaml")).expect("read");
    let broken = compose.replace(r#""clusters": ["zone-a", "zone-b", "zone-c"]"#, r#""clusters": []"#);
    assert_ne!(
        broken, compose,
        "envoy/compose-envoy.yaml no longer lists its clusters as expected"
    );
    let envoy_file = write("envoy.yaml", &broken);
    let (code, _, err) = floodgate(&["validate", &envoy_file], None);
    assert_eq!(code, 1);
    let message = "cluster_selection.clusters: must list at least one cluster";
    assert_eq!(
        err,
        format!("{envoy_file}: listener \"front\", Wasm filter \"floodgate-clusters\": {message}\n")
    );
    let line = config_error_line(&Envoy::start_expecting_failure(
        r#"{"cluster_selection": {"clusters": []}}"#,
    ))
    .expect("an invalid configuration line");
    assert_eq!(line.trim_end(), format!("invalid configuration: {message}"));

    // An Istio WasmPlugin.
    let plugin = std::fs::read_to_string(workspace_root().join("envoy/istio/wasmplugin.yaml")).expect("read");
    let broken = plugin.replace("max_active_requests: 200", "max_active_requests: -200");
    assert_ne!(broken, plugin);
    let plugin_file = write("plugin.yaml", &broken);
    let (code, _, err) = floodgate(&["validate", &plugin_file], None);
    assert_eq!(code, 1);
    assert_eq!(
        err,
        format!("{plugin_file}: WasmPlugin \"shop/floodgate\": load_shedding.max_active_requests: must be a positive integer, got -200\n")
    );

    // Warnings: no failure_policy, a route that does not read the route header, an unknown cluster.
    let warned = compose
        .lines()
        .filter(|line| !line.contains("failure_policy"))
        .map(|line| format!("{line}\n"))
        .collect::<String>()
        .replace("cluster_header: x-floodgate-cluster", "cluster: zone-a")
        .replace(r#""zone-c"]"#, r#""zone-d"]"#);
    let warned_file = write("warned.yaml", &warned);
    let (code, out, err) = floodgate(&["validate", &warned_file], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(": ok: "), "{out}");
    let at = |filter: &str| format!("{warned_file}: listener \"front\", Wasm filter \"{filter}\": warning: ");
    let warnings: Vec<&str> = err.lines().collect();
    assert_eq!(warnings.len(), 4, "{err}");
    let expected = [
        (at("floodgate"), "failure_policy is not set"),
        (at("floodgate-clusters"), "failure_policy is not set"),
        (at("floodgate-clusters"), "cluster_selection.route_header: no route in this file reads"),
        (at("floodgate-clusters"), "cluster_selection.clusters[2]: \"zone-d\" is not one of"),
    ];
    for (warning, (prefix, start)) in warnings.iter().zip(&expected) {
        assert!(
            warning.strip_prefix(prefix.as_str()).is_some_and(|w| w.starts_with(start)),
            "{warning:?} is not {prefix}{start}..."
        );
    }
    // A rule keyed on source_ip in a connection manager without use_remote_address: true.
    let spoofable = compose.replace("use_remote_address: true", "use_remote_address: false");
    assert_ne!(spoofable, compose, "envoy/compose-envoy.yaml no longer sets use_remote_address: true");
    let spoofable_file = write("spoofable.yaml", &spoofable);
    let (code, _, err) = floodgate(&["validate", &spoofable_file], None);
    assert_eq!(code, 0, "{err}");
    // Two rules key on source_ip there: "logins" and "per-ip", one warning each.
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    for (line, rule) in lines.iter().zip(["rate_limits[1] (\"logins\")", "rate_limits[2] (\"per-ip\")"]) {
        assert!(
            line.starts_with(&format!(
                "{}{rule}: keys on source_ip, but this listener's connection manager does not set use_remote_address: true",
                at("floodgate").replace(&warned_file, &spoofable_file)
            )),
            "{err}"
        );
    }

    // Nothing to check, an unreadable file, standard input, usage.
    let (code, _, err) = floodgate(&["validate", "envoy/compose-upstreams.yaml"], None);
    assert_eq!(code, 1);
    assert!(
        err.starts_with("envoy/compose-upstreams.yaml: no floodgate configuration found"),
        "{err}"
    );
    let (code, _, err) = floodgate(&["validate", "no/such/file.json"], None);
    assert_eq!(code, 1);
    assert!(err.starts_with("no/such/file.json: cannot read"), "{err}");
    let (code, out, _) = floodgate(&["validate", "-"], Some(r#"{"health": {"path": "/h"}}"#));
    assert_eq!((code, out.as_str()), (0, "-: ok: no rate limits; health endpoint /h\n"));
    let (code, out, _) = floodgate(&["validate", "--any-wasm", "-"], Some("{}"));
    assert_eq!((code, out.as_str()), (0, "-: ok: no rate limits\n"));
    assert_eq!(floodgate(&["validate"], None).0, 2);
    assert_eq!(floodgate(&["frobnicate"], None).0, 2);
    assert_eq!(floodgate(&["--help"], None).0, 0);
}

#[test]
fn floodgate_schema_prints_the_schema_file() {
    let (code, out, err) = floodgate(&["schema"], None);
    assert_eq!(code, 0, "{err}");
    let on_disk = std::fs::read_to_string(workspace_root().join("schema/floodgate.schema.json")).expect("read");
    assert_eq!(out, on_disk);
}

/// A `mode` no mechanism knows, and `match.routes` beside `cluster_selection`: the parser, the
/// `floodgate validate` command and the schema all refuse them, naming the same field.
#[test]
fn unknown_modes_and_routes_with_cluster_selection_are_refused_naming_the_field() {
    let validator = validator();
    let rule = json!({"name": "r", "key": ["path"], "limit": 5, "window": "1s"});
    let with_rule = |field: &str, value: Value| {
        let mut r = rule.clone();
        r[field] = value;
        json!({"rate_limits": [r]})
    };
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"mode": "dry_run"}), "mode", "unknown variant `dry_run`, expected `enforce` or `shadow`"),
        (with_rule("mode", json!("observe")), "rate_limits[0].mode", "unknown variant `observe`, expected `enforce` or `shadow`"),
        (
            json!({"load_shedding": {"max_active_requests": 5, "mode": "off"}}),
            "load_shedding.mode",
            "unknown variant `off`, expected `enforce` or `shadow`",
        ),
        (
            json!({"load_shedding": {"per_key": {"key": ["path"], "max_active_requests": 2, "mode": "log"}}}),
            "load_shedding.per_key.mode",
            "unknown variant `log`, expected `enforce` or `shadow`",
        ),
        (
            json!({"cluster_selection": {"clusters": ["a"], "partition": {"key": ["path"], "size": 1, "mode": "Shadow"}}}),
            "cluster_selection.partition.mode",
            "unknown variant `Shadow`, expected `enforce` or `shadow`",
        ),
        (
            json!({"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"routes": ["checkout"], "methods": ["POST"]}}],
                   "cluster_selection": {"clusters": ["a"]}}),
            "rate_limits[0].match.routes",
            "cannot be used with \"cluster_selection\"",
        ),
    ];
    refused_alike(&validator, &cases);
    // Without cluster selection (or with `"cluster_selection": null`), routes are fine.
    for config in [
        json!({"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"routes": ["checkout"]}}]}),
        json!({"rate_limits": [{"name": "r", "key": ["path"], "limit": 5, "window": "1s", "match": {"routes": ["checkout"]}}],
               "cluster_selection": null, "mode": "shadow", "access_log": true}),
    ] {
        assert!(Config::parse(config.to_string().as_bytes()).is_ok(), "{config}");
        assert!(validator.is_valid(&config), "{config}: {:?}", schema_errors(&validator, &config));
    }
    println!("{} refusals named alike by the parser, floodgate validate and the schema", cases.len());
}

/// Load leveling's settings: a queue without a bound or a wait, a zero or negative wait, a
/// class's wait without the section's queue, a queue without an in-flight limit: the parser,
/// `floodgate validate` and the schema all refuse them, naming the same field.
#[test]
fn queue_settings_are_refused_naming_the_field() {
    let validator = validator();
    let shedding = |queue: Value| json!({"load_shedding": {"max_active_requests": 4, "queue": queue}});
    // Required fields: without them the queue is refused too, so only the refusal is compared.
    let dir = tempfile::tempdir().expect("tempdir");
    let required: Vec<(Value, &str, &str)> = vec![
        (shedding(json!({"max_queued": 0, "max_wait": "1s"})), "load_shedding.queue.max_queued", "must be a positive integer"),
        (shedding(json!({"max_queued": 5, "max_wait": "0s"})), "load_shedding.queue.max_wait", "\"0s\" must be longer than zero"),
        (shedding(json!({"max_queued": 5, "max_wait": "-1s"})), "load_shedding.queue.max_wait", "\"-1s\" is not a duration"),
        (shedding(json!({"max_wait": "1s"})), "load_shedding.queue", "missing field `max_queued`"),
    ];
    for (index, (config, field, words)) in required.iter().enumerate() {
        refused_by_all(&validator, dir.path(), index, config, field, words);
    }
    let cases: Vec<(Value, &str, &str)> = vec![
        (shedding(json!({"max_queued": 5, "max_wait": "1s", "order": "lifo"})), "load_shedding.queue.order", "unknown variant `lifo`"),
        (shedding(json!({"max_queued": 5, "max_wait": "1s", "target": "0ms"})), "load_shedding.queue.target", "\"0ms\" must be longer than zero"),
        (
            json!({"load_shedding": {"max_active_requests": 4, "classes": [{"name": "normal", "shed_at": 1.0, "queue": {"max_wait": "1s"}}]}}),
            "load_shedding.classes[0].queue",
            "needs load_shedding.queue",
        ),
        (
            json!({"load_shedding": {"max_loop_lag": "100ms", "queue": {"max_queued": 5, "max_wait": "1s"}}}),
            "load_shedding.queue",
            "needs max_active_requests",
        ),
        (
            json!({"load_shedding": {"max_active_requests": 4, "queue": {"max_queued": 5, "max_wait": "1s"},
                   "classes": [{"name": "normal", "shed_at": 1.0, "queue": {"max_queued": 0}}]}}),
            "load_shedding.classes[0].queue.max_queued",
            "must be a positive integer",
        ),
    ];
    refused_alike(&validator, &cases);
    println!("{} queue refusals named alike by the parser, floodgate validate and the schema", required.len() + cases.len());
}

/// Each case (a configuration, the field, the words): the parser refuses it naming the field
/// with those words; `floodgate validate` says the parser's very words after the file's name;
/// the schema refuses it at the field or at a section that holds it, and accepts it, as the
/// parser does, without the field.
fn refused_alike(validator: &jsonschema::Validator, cases: &[(Value, &str, &str)]) {
    let dir = tempfile::tempdir().expect("tempdir");
    for (index, (config, field, words)) in cases.iter().enumerate() {
        let pointer = refused_by_all(validator, dir.path(), index, config, field, words);
        let (parent, last) = pointer.rsplit_once('/').expect("a field");
        let mut without = config.clone();
        without.pointer_mut(parent).and_then(Value::as_object_mut).expect("an object").remove(last);
        assert!(validator.is_valid(&without), "{without}: {:?}", schema_errors(validator, &without));
        assert!(Config::parse(without.to_string().as_bytes()).is_ok(), "{without}");
    }
}

/// The parser refuses `config` naming `field` with `words`; `floodgate validate` (with the file
/// written in `dir` as case `index`) says the parser's very words after the file's name; the
/// schema refuses it at the field or at a section that holds it. Returns the field's JSON
/// pointer.
fn refused_by_all(validator: &jsonschema::Validator, dir: &Path, index: usize, config: &Value, field: &str, words: &str) -> String {
    let text = config.to_string();
    // The parser.
    let error = Config::parse(text.as_bytes()).expect_err("refused").to_string();
    assert!(
        error.starts_with(&format!("{field}: {words}")),
        "{text}\n  parser: {error}\n  want: {field}: {words}..."
    );
    // floodgate validate: the parser's very words, after the file's name.
    let file = dir.join(format!("case-{index}.json"));
    std::fs::write(&file, &text).expect("write");
    let name = file.display().to_string();
    let (code, out, err) = floodgate(&["validate", &name], None);
    assert_eq!((code, out.as_str(), err.as_str()), (1, "", format!("{name}: {error}\n").as_str()), "{text}");
    // The schema: it refuses the configuration at the field or at a section that holds it
    // (an `anyOf` of a nullable section reports there).
    let pointer = format!("/{}", field.replace('[', "/").replace(']', "").replace('.', "/"));
    let errors: Vec<String> = validator.iter_errors(config).map(|e| e.instance_path().to_string()).collect();
    assert!(
        !errors.is_empty() && errors.iter().all(|at| pointer == *at || pointer.starts_with(&format!("{at}/"))),
        "{text}: the schema does not refuse {pointer}: {:?}",
        schema_errors(validator, config)
    );
    pointer
}

#[test]
fn the_schema_validate_and_the_parser_refuse_a_zero_watchdog_threshold_naming_it() {
    let validator = validator();
    let with = |field: &str, value: Value| {
        let mut dog = json!({"path": "/floodgate/alive"});
        dog[field] = value;
        json!({"watchdog": dog})
    };
    let cases: Vec<(Value, &str, &str)> = vec![
        (with("worker_silence", json!("0s")), "watchdog.worker_silence", "\"0s\" must be longer than zero"),
        (with("max_loop_lag", json!("0ms")), "watchdog.max_loop_lag", "\"0ms\" must be longer than zero"),
        (with("lag_for", json!("0s")), "watchdog.lag_for", "\"0s\" must be longer than zero"),
        (with("max_memory_mb", json!(0)), "watchdog.max_memory_mb", "must be a positive integer"),
        (with("recover_after", json!(0)), "watchdog.recover_after", "must be a positive integer"),
        (with("recover_after", json!(61)), "watchdog.recover_after", "must be at most 60, got 61"),
    ];
    refused_alike(&validator, &cases);
    println!("{} watchdog refusals named alike by the parser, floodgate validate and the schema", cases.len());
}

/// `floodgate explain` on an Envoy bootstrap of the repository: every floodgate configuration
/// in it, each under its location, with the module's decisions for the request described.
#[test]
fn floodgate_explain_tells_each_configuration_of_an_envoy_file() {
    let (code, out, err) = floodgate(
        &["explain", "envoy/compose-envoy.yaml", "--path", "/api/orders", "--source-ip", "10.1.2.3:5555", "--header", "x-api-key:k-1"],
        None,
    );
    print!("{out}{err}");
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("envoy/compose-envoy.yaml: listener \"front\", Wasm filter \"floodgate\":\n"), "{out}");
    assert!(out.contains("\nenvoy/compose-envoy.yaml: listener \"front\", Wasm filter \"floodgate-clusters\":\n"), "{out}");
    assert!(out.contains("  request: GET /api/orders"), "{out}");
    assert!(out.contains("source_ip \"10.1.2.3\""), "the port is not part of the key: {out}");
    let (code, _, err) = floodgate(&["explain", "envoy/compose-envoy.yaml", "--header", "no-colon"], None);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = floodgate(&["explain", "-"], Some(r#"{"mode": "dry_run"}"#));
    assert_eq!((code, err.as_str()), (1, "-: mode: unknown variant `dry_run`, expected `enforce` or `shadow`\n"));
}

// ---------------------------------------------------------------------------------------------
// Istio: floodgate-sync's Deployment and Service, and the WasmPlugin that calls it
// ---------------------------------------------------------------------------------------------

/// envoy/istio/floodgate-sync.yaml holds together and with envoy/istio/global-wasmplugin.yaml:
/// the plugin's `global.cluster` is the cluster Istio makes of that Service
/// (`outbound|PORT||NAME.NAMESPACE.svc.cluster.local`) and its `authority` the Service's host;
/// the Service selects the Deployment's pods on the container's port, over HTTP/2; the probes
/// are floodgate-sync's routes; every environment variable is one floodgate-sync reads (its
/// `--help` names each), and the built binary starts with the manifest's values.
#[test]
fn istio_floodgate_sync_manifest_is_what_the_plugin_calls_and_what_the_binary_reads() {
    let documents_of = |text: &str| parse_documents(text).expect("YAML");
    let text = std::fs::read_to_string(workspace_root().join("envoy/istio/floodgate-sync.yaml")).expect("read");
    let documents = parse_documents(&text).expect("YAML");
    let of_kind = |kind: &str| {
        documents
            .iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} in envoy/istio/floodgate-sync.yaml"))
    };
    let (deployment, service) = (of_kind("Deployment"), of_kind("Service"));
    let name = service["metadata"]["name"].as_str().expect("Service name");
    let namespace = service["metadata"]["namespace"].as_str().expect("Service namespace");
    assert_eq!(deployment["metadata"]["namespace"], namespace);
    assert_eq!(of_kind("Namespace")["metadata"]["name"], namespace);
    let port = &service["spec"]["ports"][0];
    assert_eq!(port["appProtocol"], "http2", "HTTP/2 without TLS, which floodgate-sync serves");
    let host = format!("{name}.{namespace}.svc.cluster.local");
    let cluster = format!("outbound|{}||{host}", port["port"]);

    let plugin = std::fs::read_to_string(workspace_root().join("envoy/istio/global-wasmplugin.yaml")).expect("read");
    let found = find_configurations("global-wasmplugin.yaml", plugin.as_bytes(), Options::default()).expect("a WasmPlugin");
    let config = Config::parse(found[0].bytes.as_ref().expect("pluginConfig")).expect("a valid configuration");
    let global = config.global.expect("a global section");
    assert_eq!(global.cluster.as_str(), cluster, "global.cluster names the Service's cluster");
    assert_eq!(global.authority(), host, "global.authority is the Service's host");
    assert!(config.rate_limits.iter().any(|r| r.scope == floodgate::config::Scope::Global));

    let pod = &deployment["spec"]["template"];
    let selector = service["spec"]["selector"].as_object().expect("selector");
    assert!(!selector.is_empty());
    for (label, value) in selector {
        assert_eq!(&pod["metadata"]["labels"][label], value, "the Service selects the pods by {label}");
        assert_eq!(&deployment["spec"]["selector"]["matchLabels"][label], value);
    }
    let container = &pod["spec"]["containers"][0];
    let container_port = &container["ports"][0]["containerPort"];
    assert_eq!(&port["targetPort"], container_port);
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(&container[probe]["httpGet"]["port"], container_port, "{probe}");
    }

    let binary = floodgate_integration::store::sync_binary();
    let help = Command::new(&binary).arg("--help").output().expect("floodgate-sync --help");
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    // A value, or one from a Secret of the manifest.
    let env: Vec<(String, String)> = container["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            let name = e["name"].as_str().expect("env name").to_owned();
            if let Some(value) = e["value"].as_str() {
                return (name, value.to_owned());
            }
            let reference = &e["valueFrom"]["secretKeyRef"];
            let secret = documents
                .iter()
                .find(|d| d["kind"] == "Secret" && d["metadata"]["name"] == reference["name"])
                .unwrap_or_else(|| panic!("{name}: no Secret {} in the manifest", reference["name"]));
            assert_eq!(secret["metadata"]["namespace"], namespace);
            let key = reference["key"].as_str().expect("secretKeyRef.key");
            (name, secret["stringData"][key].as_str().unwrap_or_else(|| panic!("Secret key {key}")).to_owned())
        })
        .collect();
    for (name, _) in &env {
        assert!(
            name == "RUST_LOG"
                || (name.starts_with("FLOODGATE_SYNC_")
                    && (help.contains(&format!("[env: {name}=")) || help.contains(&format!("[env: {name}]")))),
            "{name} is not a variable floodgate-sync reads"
        );
    }
    // The plugin's token is the one floodgate-sync accepts.
    let token = &env.iter().find(|(n, _)| n == "FLOODGATE_SYNC_TOKEN").expect("FLOODGATE_SYNC_TOKEN").1;
    assert_eq!(global.token.as_deref(), Some(token.as_str()), "global.token is the Secret's token");
    assert!(global.key_secret.is_some(), "the plugin sets a key_secret");
    // Only the plugin's workload may call the port, and only the POST routes.
    let policy = of_kind("AuthorizationPolicy");
    assert_eq!(policy["apiVersion"], "security.istio.io/v1");
    assert_eq!(policy["metadata"]["namespace"], namespace);
    assert_eq!(policy["spec"]["action"], "ALLOW");
    for (label, value) in selector {
        assert_eq!(&policy["spec"]["selector"]["matchLabels"][label], value, "the policy selects floodgate-sync's pods");
    }
    let plugin_namespace = documents_of(&plugin)[0]["metadata"]["namespace"].as_str().expect("plugin namespace").to_owned();
    for rule in policy["spec"]["rules"].as_array().expect("rules") {
        for source in rule["from"].as_array().expect("from") {
            let principals = source["source"]["principals"].as_array().expect("principals only");
            assert!(!principals.is_empty());
            for principal in principals {
                let principal = principal.as_str().expect("a principal");
                assert!(principal.starts_with(&format!("cluster.local/ns/{plugin_namespace}/sa/")), "{principal}");
            }
        }
        for operation in rule["to"].as_array().expect("to") {
            assert_eq!(operation["operation"]["ports"], json!([port["port"].to_string()]));
            assert_eq!(operation["operation"]["methods"], json!(["POST"]));
            assert_eq!(operation["operation"]["paths"], json!(["/v1/sync", "/v1/lease"]));
        }
    }
    let listen = &env.iter().find(|(n, _)| n == "FLOODGATE_SYNC_LISTEN").expect("FLOODGATE_SYNC_LISTEN").1;
    let listen: std::net::SocketAddr = listen.parse().expect("an address");
    assert_eq!(u64::from(listen.port()), container_port.as_u64().expect("containerPort"));
    // The values parse: it starts with them (listening here instead; the manifest's Redis is not
    // reachable from this machine, so it is alive and not ready).
    let here = std::net::SocketAddr::from(([127, 0, 0, 1], free_ports(1)[0]));
    let mut child = Command::new(&binary)
        .envs(env.iter().map(|(n, v)| (n.as_str(), v.as_str())))
        .env("FLOODGATE_SYNC_LISTEN", here.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start floodgate-sync");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut healthy = false;
    while std::time::Instant::now() < deadline && child.try_wait().expect("try_wait").is_none() {
        if http_get_blocking(here, "/healthz").is_ok_and(|(s, _)| s == 200) {
            healthy = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let ready = http_get_blocking(here, "/readyz").map(|(s, _)| s).unwrap_or(0);
    let _ = child.kill();
    let out = child.wait_with_output().expect("wait");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(healthy, "floodgate-sync did not start with the manifest's environment:\n{log}");
    assert_eq!(ready, 503, "not ready without its Redis");
    println!("{cluster}: the plugin's cluster; floodgate-sync starts with the manifest's environment: {}", log.lines().next().unwrap_or(""));
}

// ---------------------------------------------------------------------------------------------
// Docker: the compose demo and the OCI image for Istio
// ---------------------------------------------------------------------------------------------

fn require_docker() {
    let ok = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "these tests need a Docker engine (`docker info` failed): install Docker with Compose and start it"
    );
}

/// Runs `scripts/<script>` (a compose test, which builds its local images from this machine's
/// binaries) and checks that it ends with `<summary>: N passed, 0 failed`.
fn compose_script(script: &str, summary: &str) {
    require_docker();
    let out = Command::new("bash")
        .arg(workspace_root().join("scripts").join(script))
        .env("FLOODGATE_WASM", wasm_module())
        .env("ENVOY_BIN", envoy_binary())
        // The images are built here, from scratch; floodgate-sync's from its static musl build.
        .env_remove("FLOODGATE_ENVOY_IMAGE")
        .env_remove("FLOODGATE_REDIS_IMAGE")
        .env_remove("FLOODGATE_SYNC_IMAGE")
        .env_remove("FLOODGATE_SYNC_BIN")
        .current_dir(workspace_root())
        .output()
        .unwrap_or_else(|e| panic!("run scripts/{script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "scripts/{script} failed:\n{stdout}\n{}",
        tail(&stderr, 40)
    );
    let last = stdout.lines().last().unwrap_or("");
    assert!(
        last.starts_with(&format!("{summary}: ")) && last.ends_with(" passed, 0 failed"),
        "{last}"
    );
}

#[test]
fn docker_compose_demo_serves_limits_sheds_and_counts() {
    compose_script("compose-test.sh", "compose");
}

/// envoy/docker-compose.global.yaml: Redis, floodgate-sync and two Envoys; one tenant's
/// requests split over both Envoys get one quota of 10, the proxy-scope rule 10 per Envoy.
#[test]
fn docker_compose_global_two_envoys_share_one_quota_through_redis() {
    compose_script("compose-global-test.sh", "compose-global");
}

#[test]
fn oci_image_for_istio_holds_plugin_wasm_in_one_layer() {
    require_docker();
    let tag = format!("floodgate-oci-test:{}", std::process::id());
    let out = Command::new("bash")
        .arg(workspace_root().join("scripts/oci-image.sh"))
        .arg(&tag)
        .env("FLOODGATE_WASM", wasm_module())
        .current_dir(workspace_root())
        .output()
        .expect("run scripts/oci-image.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "scripts/oci-image.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().last(), Some(tag.as_str()));
    let dir = tempfile::tempdir().expect("tempdir");
    let saved = dir.path().join("image.tar");
    let save = Command::new("docker")
        .args(["save", "-o"])
        .arg(&saved)
        .arg(&tag)
        .status()
        .expect("docker save");
    let _ = Command::new("docker")
        .args(["rmi", &tag])
        .stdout(Stdio::null())
        .status();
    assert!(save.success(), "docker save {tag}");
    let untar = |archive: &Path, into: &Path| {
        std::fs::create_dir_all(into).expect("mkdir");
        let ok = Command::new("tar")
            .arg("-xf")
            .arg(archive)
            .arg("-C")
            .arg(into)
            .status()
            .expect("tar");
        assert!(ok.success(), "tar -xf {}", archive.display());
    };
    let image = dir.path().join("image");
    untar(&saved, &image);
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(image.join("manifest.json")).expect("manifest.json"))
            .expect("manifest JSON");
    let layers = manifest[0]["Layers"].as_array().expect("Layers");
    assert_eq!(layers.len(), 1, "Istio wants exactly one layer: {manifest}");
    let layer = dir.path().join("layer");
    untar(&image.join(layers[0].as_str().expect("layer path")), &layer);
    let entries: Vec<String> = std::fs::read_dir(&layer)
        .expect("layer")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(entries, ["plugin.wasm"]);
    let inside = std::fs::read(layer.join("plugin.wasm")).expect("plugin.wasm");
    assert!(
        inside == std::fs::read(wasm_module()).expect("module"),
        "plugin.wasm differs from the module"
    );
    println!(
        "{tag}: one layer holding plugin.wasm ({} bytes), the module byte for byte",
        inside.len()
    );
}

// ---------------------------------------------------------------------------------------------
// Prerequisites: scripts/preflight.sh
// ---------------------------------------------------------------------------------------------

/// A directory of links to every program on this machine's PATH but `hidden` (and, for each
/// name in `fakes`, a script printing its text to standard error and failing instead), to run
/// scripts/preflight.sh as on a machine that lacks them.
fn path_without(hidden: &[&str], fakes: &[(&str, &str)]) -> tempfile::TempDir {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = std::env::var_os("PATH").expect("PATH");
    for entry in std::env::split_paths(&path).filter_map(|d| std::fs::read_dir(d).ok()).flatten().flatten() {
        let name = entry.file_name();
        let name_str = name.to_string_lossy().into_owned();
        let link = dir.path().join(&name);
        if hidden.contains(&name_str.as_str()) || fakes.iter().any(|(n, _)| *n == name_str) || link.exists() {
            continue;
        }
        let _ = symlink(entry.path(), &link);
    }
    for (name, message) in fakes {
        let fake = dir.path().join(name);
        std::fs::write(&fake, format!("#!/bin/sh\necho '{message}' >&2\nexit 1\n")).expect("write fake");
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    dir
}

fn preflight(for_what: &str, path: &Path) -> (i32, String, String) {
    let out = Command::new("bash")
        .arg(workspace_root().join("scripts/preflight.sh"))
        .arg(for_what)
        .env("PATH", path)
        .output()
        .expect("run scripts/preflight.sh");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_readme_commands_check_the_machine_before_building_anything() {
    for (script, check) in [("test.sh", "scripts/preflight.sh test"), ("demo.sh", "scripts/preflight.sh demo")] {
        let text = std::fs::read_to_string(workspace_root().join(script)).expect("read");
        let code: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
        let at = |needle: &str| code.iter().position(|l| l.contains(needle));
        let preflight = at(check).unwrap_or_else(|| panic!("{script} does not run {check}"));
        let build = at("./wasm-build.sh").unwrap_or_else(|| panic!("{script} does not build the module"));
        assert!(preflight < build, "{script} builds before it runs {check}");
    }
}

#[test]
fn preflight_names_everything_missing_at_once_as_getting_started_shows() {
    // This machine has everything (./test.sh got here).
    let all = std::env::var_os("PATH").expect("PATH");
    for for_what in ["demo", "test"] {
        let (code, out, err) = preflight(for_what, Path::new(&all));
        assert_eq!(code, 0, "{err}");
        assert!(out.starts_with(&format!("preflight: ./{for_what}.sh has what it needs: rustc ")), "{out}");
    }

    // Without curl and Docker: docs/getting-started.md's example, line for line, and nothing on stdout.
    let bare = path_without(&["curl", "docker", "docker-compose"], &[]);
    let (code, out, err) = preflight("test", bare.path());
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    let readme = std::fs::read_to_string(workspace_root().join("docs/getting-started.md")).expect("read docs/getting-started.md");
    let first = "preflight: ./test.sh cannot run on this machine yet. Missing:";
    let start = readme.find(first).expect("docs/getting-started.md shows no preflight output");
    let last = "Nothing was built. Install what is missing, then run ./test.sh again.";
    let end = start + readme[start..].find(last).expect("docs/getting-started.md: end of the preflight output") + last.len();
    assert_eq!(err.trim_end(), &readme[start..end], "docs/getting-started.md's example differs from scripts/preflight.sh");
    // ./demo.sh needs curl (for the walkthrough) but no Docker.
    let (code, _, err) = preflight("demo", bare.path());
    assert_eq!(code, 1);
    assert_eq!(err.lines().filter(|l| l.starts_with("  - ")).count(), 1, "{err}");
    assert!(err.contains("  - curl"), "{err}");

    // A Docker engine this user may not use, and no C++ compiler nor Rust.
    let denied = path_without(
        &["c++", "rustup", "cargo", "rustc", "docker-compose"],
        &[("docker", "permission denied while trying to connect to the Docker daemon socket")],
    );
    let (code, _, err) = preflight("test", denied.path());
    assert_eq!(code, 1);
    let missing: Vec<&str> = err.lines().filter(|l| l.starts_with("  - ")).collect();
    assert_eq!(missing.len(), 4, "{err}");
    assert!(missing[0].starts_with("  - Rust 1.85 or newer"), "{err}");
    assert!(missing[1].starts_with("  - a C++ compiler"), "{err}");
    assert!(missing[2].starts_with("  - a running Docker engine"), "{err}");
    assert!(missing[3].starts_with("  - Docker Compose"), "{err}");
    assert!(err.contains("add yourself to the docker group"), "{err}");
    assert!(err.contains("https://rustup.rs"), "{err}");
}
