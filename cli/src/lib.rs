//! floodgate's operator tooling, behind the `floodgate` command.
//!
//! [`find_configurations`] finds every floodgate configuration in a file: a bare JSON
//! configuration, an Envoy bootstrap or xDS resource file (YAML or JSON) with HTTP Wasm filters that
//! load floodgate, or an Istio `WasmPlugin` manifest. For each it gives the exact bytes the module
//! would receive in `on_configure`. [`check`] parses them with
//! [`floodgate::config::Config::parse`], the very parser the module runs, so this command and the
//! proxy accept and refuse the same configurations with the same field-named messages.
//! [`explain`] tells what the module would do with one request. [`run`] is the command line
//! itself.

pub mod explain;

use floodgate::selection::partition::Partitioner;
use floodgate::config::{Config, KeyPart};
use serde::Deserialize;
use serde_json::{Map, Value};
use std::io::{Read, Write};

/// The JSON Schema (draft 2020-12) of the configuration: `schema/floodgate.schema.json`.
pub const SCHEMA: &str = include_str!("../../schema/floodgate.schema.json");

/// The `@type` of Envoy's HTTP Wasm filter.
pub const WASM_FILTER_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";

/// Keys that make a document an Envoy or Kubernetes one rather than a bare floodgate
/// configuration (which has none of them).
const MARKERS: &[&str] = &[
    "static_resources",
    "dynamic_resources",
    "admin",
    "node",
    "layered_runtime",
    "overload_manager",
    "resources",
    "version_info",
    "apiVersion",
    "kind",
    "metadata",
    "spec",
    "listeners",
    "clusters",
    "filter_chains",
    "http_filters",
    "typed_config",
    "route_config",
    "virtual_hosts",
    "services",
];

/// The top-level fields of a floodgate configuration.
const FIELDS: &[&str] = &[
    "rate_limits",
    "stat_prefix",
    "ratelimit_headers",
    "load_shedding",
    "cluster_selection",
    "health",
    "global",
    "grpc",
    "mode",
    "access_log",
];

/// How to find configurations.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Check every HTTP Wasm filter and `WasmPlugin`, not only those whose name, root id, VM id,
    /// module path or URL mentions "floodgate".
    pub any_wasm: bool,
}

/// A floodgate configuration found in a file.
#[derive(Debug, Clone)]
pub struct Found {
    /// Where it is in the file: empty when the file is the configuration itself, else e.g.
    /// `listener "front", Wasm filter "floodgate"`.
    pub location: String,
    /// What the module would receive in `on_configure`, or why that cannot be told.
    pub bytes: Result<Vec<u8>, String>,
    /// Remarks that do not make the configuration invalid (an unset failure policy, ...).
    pub warnings: Vec<String>,
    /// What the enclosing Envoy configuration defines, for cross-checks.
    pub envoy: Option<EnvoyContext>,
    /// How the enclosing HTTP connection manager tells the client's address, when the filter is
    /// inside one in this file (`None` for a bare `http_filters` list, an ECDS resource, ...).
    pub connection_manager: Option<ClientAddress>,
}

/// The settings of an HTTP connection manager that decide the downstream address Envoy gives
/// the filter (floodgate's `source_ip`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientAddress {
    /// `use_remote_address` (Envoy's default: false).
    pub use_remote_address: bool,
    /// `xff_num_trusted_hops` (default 0).
    pub xff_num_trusted_hops: u64,
    /// Whether `original_ip_detection_extensions` lists an extension, which then decides.
    pub detection_extensions: bool,
}

/// The `@type` of Envoy's HTTP connection manager.
pub const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

/// What an Envoy configuration that holds a floodgate filter defines statically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvoyContext {
    /// Names of `static_resources.clusters`; `None` when clusters can also come from CDS/ADS or
    /// the file defines none.
    pub static_clusters: Option<Vec<String>>,
    /// Every `cluster_header` of the file's inline routes; `None` when the file has no inline
    /// route configuration (routes from RDS).
    pub cluster_headers: Option<Vec<String>>,
    /// The smallest `request_body_buffer_limit` of the file's inline routes, 0 when a route
    /// sets none; `None` when the file has no inline route.
    pub body_buffer_limit: Option<u64>,
    /// The largest `per_connection_buffer_limit_bytes` of the file's listeners (Envoy's default,
    /// 1 MiB, for a listener without one): how much Envoy reads from a client at once.
    pub read_limit: u64,
}

/// Envoy's default `per_connection_buffer_limit_bytes`.
const ENVOY_BUFFER_LIMIT: u64 = 1 << 20;

/// Room for one more frame in a stream's buffer, beyond the estimate's bound and one read.
const FRAME_BYTES: u64 = 64 << 10;

/// A configuration that parsed, with remarks about how it fits its Envoy configuration.
#[derive(Debug)]
pub struct Checked {
    /// The parsed configuration.
    pub config: Config,
    /// Remarks that do not make it invalid.
    pub warnings: Vec<String>,
}

/// Finds the floodgate configurations in a file's contents. `name` is the file's name (its
/// extension tells JSON from YAML when the contents do not parse). An error means the file holds
/// no configuration to check.
pub fn find_configurations(name: &str, contents: &[u8], options: Options) -> Result<Vec<Found>, String> {
    let bare = |bytes: Vec<u8>| Found {
        location: String::new(),
        bytes: Ok(bytes),
        warnings: Vec::new(),
        envoy: None,
        connection_manager: None,
    };
    let Ok(text) = std::str::from_utf8(contents) else {
        // The parser says what is wrong, exactly as the module would.
        return Ok(vec![bare(contents.to_vec())]);
    };
    let (documents, is_json) = match serde_json::from_str::<Value>(text) {
        Ok(document) => (vec![document], true),
        Err(_) if name.ends_with(".json") || text.trim_start().starts_with(['{', '[']) => {
            // Meant as JSON: the parser reports the syntax error as the module would.
            return Ok(vec![bare(contents.to_vec())]);
        }
        Err(_) => (parse_documents(text)?, false),
    };
    let mut walker = Walker {
        options,
        found: Vec::new(),
        skipped: 0,
        envoy: EnvoyContext::default(),
    };
    let several = documents.len() > 1;
    for (index, document) in documents.iter().enumerate() {
        let before = walker.found.len();
        walker.envoy = envoy_context(document);
        walker.walk(document, &mut Vec::new(), Scope::default());
        if several {
            for found in walker.found.iter_mut().skip(before) {
                found.location = format!("document {}, {}", index + 1, found.location);
            }
        }
        let is_bare = match document {
            // A YAML document is a configuration only if it looks like one (Istio's pluginConfig
            // written alone); a JSON one always is, so that a misspelt field gets its message.
            Value::Object(map) if !is_json => map.keys().any(|key| FIELDS.contains(&key.as_str())),
            Value::Object(map) => !map.keys().any(|key| MARKERS.contains(&key.as_str())),
            Value::Null => false,
            _ => is_json,
        };
        if walker.found.len() == before && is_bare && !several {
            let bytes = if is_json {
                contents.to_vec()
            } else {
                serde_json::to_vec(document).map_err(|err| err.to_string())?
            };
            walker.found.push(bare(bytes));
        }
    }
    dedupe_locations(&mut walker.found);
    if walker.found.is_empty() {
        let mut message = String::from(
            "no floodgate configuration found (expected a floodgate JSON configuration, an Envoy \
             configuration with an envoy.filters.http.wasm filter that loads floodgate, or an Istio WasmPlugin)",
        );
        if walker.skipped > 0 {
            message.push_str(&format!(
                "; {} other Wasm filter(s) or WasmPlugin(s) skipped because nothing in their name, root_id, \
                 vm_id, module path or URL says \"floodgate\": pass --any-wasm to check them",
                walker.skipped
            ));
        }
        return Err(message);
    }
    Ok(walker.found)
}

/// The rules that read their estimate from the request body, where the file's routes let Envoy
/// hold less of a body than the estimate's bound plus one read from the client: Envoy answers
/// `413` to such a request when its first bytes come alone and the rest at once.
fn body_buffer_warnings(config: &Config, envoy: &EnvoyContext) -> Vec<String> {
    let Some(limit) = envoy.body_buffer_limit else { return Vec::new() };
    let mut warnings = Vec::new();
    for (index, rule) in config.rate_limits.iter().enumerate() {
        let Some(estimate) = rule.cost.as_ref().and_then(|cost| cost.estimate.as_ref()) else { continue };
        if estimate.body.is_none() && estimate.sum.is_none() {
            continue;
        }
        let bound = estimate.max_body_bytes.map_or(floodgate::config::DEFAULT_ESTIMATE_BODY_BYTES, |b| u64::from(b.get().get()));
        let needed = bound.saturating_add(envoy.read_limit).saturating_add(FRAME_BYTES);
        if limit >= needed {
            continue;
        }
        let routes = if limit == 0 {
            "a route of this file sets no request_body_buffer_limit".to_owned()
        } else {
            format!("a route of this file sets request_body_buffer_limit: {limit}")
        };
        warnings.push(format!(
            "rate_limits[{index}] (\"{name}\"): reads its estimate from the request body (up to {bound} bytes), but \
             {routes}: Envoy holds what it read of a body plus one read from the client (up to the listener's \
             per_connection_buffer_limit_bytes, {read}) and answers 413 past the stream's limit, so a long body whose \
             first bytes come alone is refused. Set request_body_buffer_limit: {needed} (or more) on the routes (Envoy \
             1.37 and later; docs/llm.md, \"The estimate in the request body\")",
            name = rule.name,
            read = envoy.read_limit,
        ));
    }
    warnings
}

/// Parses a configuration found by [`find_configurations`] with the module's own parser, then
/// cross-checks it against the Envoy configuration around it.
pub fn check(found: &Found) -> Result<Checked, String> {
    let bytes = found.bytes.as_ref().map_err(Clone::clone)?;
    let config = Config::parse(bytes).map_err(|err| err.to_string())?;
    let mut warnings = found.warnings.clone();
    if let (Some(selection), Some(envoy)) = (&config.cluster_selection, &found.envoy) {
        if let Some(headers) = &envoy.cluster_headers {
            let header = &selection.route_header;
            if !headers.iter().any(|h| h.eq_ignore_ascii_case(header)) {
                warnings.push(format!(
                    "cluster_selection.route_header: no route in this file reads \"{header}\" \
                     (the route must say `cluster_header: {header}`)"
                ));
            }
        }
        if let Some(clusters) = &envoy.static_clusters {
            for (index, cluster) in selection.clusters.iter().enumerate() {
                if !clusters.iter().any(|c| c == cluster.as_str()) {
                    warnings.push(format!(
                        "cluster_selection.clusters[{index}]: \"{cluster}\" is not one of this file's \
                         static_resources.clusters"
                    ));
                }
            }
        }
    }
    if let (Some(global), Some(clusters)) =
        (&config.global, found.envoy.as_ref().and_then(|envoy| envoy.static_clusters.as_ref()))
    {
        if !clusters.iter().any(|c| c == global.cluster.as_str()) {
            warnings.push(format!(
                "global.cluster: \"{}\" is not one of this file's static_resources.clusters (every batch to \
                 floodgate-sync would fail, and the global rules would hold per proxy only)",
                global.cluster
            ));
        }
    }
    if let Some(envoy) = &found.envoy {
        warnings.extend(body_buffer_warnings(&config, envoy));
    }
    if let Some(manager) = &found.connection_manager {
        if !manager.use_remote_address && !manager.detection_extensions {
            for (index, rule) in config.rate_limits.iter().enumerate() {
                if rule.key.iter().any(|part| matches!(part, KeyPart::SourceIp)) {
                    warnings.push(format!(
                        "rate_limits[{index}] (\"{name}\"): keys on source_ip, but this listener's connection \
                         manager does not set use_remote_address: true, so Envoy takes the client's address \
                         from X-Forwarded-For when a request has one ({nth}): a client that reaches this Envoy \
                         directly writes that header itself and gets a fresh quota with every request. At the \
                         edge set use_remote_address: true (the address is the TCP peer's); behind N proxies \
                         you trust that append to X-Forwarded-For, use_remote_address: true and \
                         xff_num_trusted_hops: N (docs/configuration.md, \"Which address source_ip is\")",
                        name = rule.name,
                        nth = match manager.xff_num_trusted_hops {
                            0 => "its last entry".to_owned(),
                            hops => format!("the {} entry from the right", ordinal(hops.saturating_add(1))),
                        },
                    ));
                }
            }
        }
    }
    Ok(Checked { config, warnings })
}

/// The configurations of a file ([`find_configurations`]), each with the prefix of its lines
/// (`FILE: ` or `FILE: location: `); `None`, the problem written to `err`, when there are none.
fn configurations(name: &str, contents: &[u8], options: Options, err: &mut dyn Write) -> Option<Vec<(String, Found)>> {
    match find_configurations(name, contents, options) {
        Ok(found) => Some(
            found
                .into_iter()
                .map(|item| {
                    let prefix =
                        if item.location.is_empty() { format!("{name}: ") } else { format!("{name}: {}: ", item.location) };
                    (prefix, item)
                })
                .collect(),
        ),
        Err(problem) => {
            let _ = writeln!(err, "{name}: {problem}");
            None
        }
    }
}

/// `1` → "1st", `2` → "2nd", `3` → "3rd", `4` → "4th", ...
fn ordinal(n: u64) -> String {
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// Checks one file: every configuration in it, printed to `out` (valid) or `err` (invalid, with
/// warnings). Returns whether every configuration is valid.
pub fn validate_file(name: &str, contents: &[u8], options: Options, out: &mut dyn Write, err: &mut dyn Write) -> bool {
    let Some(found) = configurations(name, contents, options, err) else { return false };
    let mut all_valid = true;
    for (prefix, item) in &found {
        match check(item) {
            Ok(checked) => {
                let _ = writeln!(out, "{prefix}ok: {}", checked.config.summary());
                for warning in &checked.warnings {
                    let _ = writeln!(err, "{prefix}warning: {warning}");
                }
            }
            Err(problem) => {
                all_valid = false;
                let _ = writeln!(err, "{prefix}{problem}");
                for warning in &item.warnings {
                    let _ = writeln!(err, "{prefix}warning: {warning}");
                }
            }
        }
    }
    all_valid
}

const USAGE: &str = "\
usage:
  floodgate validate [--any-wasm] FILE...
      Checks floodgate configurations with the parser the Wasm module runs, and prints
      `FILE: ok: <what it enforces>` or `FILE: <field path>: <problem>` for each.
      FILE is a floodgate JSON configuration, an Envoy configuration (YAML or JSON: a bootstrap,
      an LDS/ECDS resource file, ...) whose envoy.filters.http.wasm filters load floodgate, or an
      Istio WasmPlugin manifest; `-` reads standard input. A Wasm filter or WasmPlugin counts as
      floodgate when its name, root_id, vm_id, module path or URL says \"floodgate\"; --any-wasm
      checks all of them. Exit status: 0 all valid, 1 something invalid or not found, 2 usage.
  floodgate partition FILE [PART...]
      With cluster_selection.partition: prints how the clusters are partitioned, and the
      partition of the key made of these PARTs (the values of the partition's key parts, in
      order, as the request carries them). The mapping depends on the configuration only, so it
      is what every proxy running it computes. FILE as for validate.
  floodgate explain CONFIG [--method M] [--path P] [--authority A] [--route NAME]
                           [--header name:value]... [--source-ip IP[:PORT]]
      Tells what the filter would do with the request described (by default GET /, without
      authority, route name, headers or source address), with the module's own code. CONFIG
      as FILE for validate; each configuration found is explained under a line
      `CONFIG[: location]:`, then, indented:
        request: the request as the filter sees it;
        mode: shadow (top-level), when the whole filter is in shadow;
        health: the health endpoint answers it (and then nothing else is listed);
        rate_limits[i] \"name\": applies | does not apply: <the first condition that fails:
          path, method, header, authority, route; or a key part missing, missing_key: skip>;
          a rule that applies has the lines
            mode: enforce | shadow (the rule's own mode or the top-level one);
            key: each key part and its value as the rule reads it (a header's value,
              source_ip without port, path without query);
            limit: N per WINDOW (overrides[i] | tier \"T\" named by header H | the rule's limit);
            cost: units now (1 per request | request header H | content-length),
              or later (the request body's bytes, a response header), capped at the limit;
            scope: proxy | global, consistency batched | leased;
        partition: the key and its clusters (cluster_selection.partition), or
          cluster selection: every cluster, without a partition;
        priority class: the class (load_shedding) and the thresholds that shed it;
        per-key cap: the key of load_shedding.per_key and its cap.
      Exit status: 0 explained, 1 a configuration invalid or none found, 2 usage.
  floodgate schema
      Prints the JSON Schema (draft 2020-12) of the configuration.
  floodgate --version | --help
";

/// The `floodgate` command: `args` without the program name. Returns the exit status.
pub fn run(args: &[String], out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let Some((command, rest)) = args.split_first() else {
        let _ = write!(err, "{USAGE}");
        return 2;
    };
    match command.as_str() {
        "validate" => {
            let any_wasm = rest.iter().any(|a| a == "--any-wasm");
            let files: Vec<&String> = rest.iter().filter(|a| *a != "--any-wasm").collect();
            if let Some(unknown) = files.iter().find(|a| a.starts_with("--")) {
                let _ = write!(err, "floodgate: unknown option {unknown}\n{USAGE}");
                return 2;
            }
            if files.is_empty() {
                let _ = write!(err, "floodgate validate: no FILE given\n{USAGE}");
                return 2;
            }
            let options = Options { any_wasm };
            let mut all_valid = true;
            for file in files {
                match read_input(file) {
                    Ok(contents) => all_valid &= validate_file(file, &contents, options, out, err),
                    Err(problem) => {
                        let _ = writeln!(err, "{file}: cannot read: {problem}");
                        all_valid = false;
                    }
                }
            }
            u8::from(!all_valid)
        }
        "partition" => {
            let Some((file, parts)) = rest.split_first() else {
                let _ = write!(err, "floodgate partition: no FILE given\n{USAGE}");
                return 2;
            };
            match read_input(file) {
                Ok(contents) => partition(file, &contents, parts, out, err),
                Err(problem) => {
                    let _ = writeln!(err, "{file}: cannot read: {problem}");
                    1
                }
            }
        }
        "explain" => {
            let (file, request) = match explain::Request::from_args(rest) {
                Ok(parsed) => parsed,
                Err(problem) => {
                    let _ = write!(err, "floodgate explain: {problem}\n{USAGE}");
                    return 2;
                }
            };
            match read_input(&file) {
                Ok(contents) => explain_file(&file, &contents, &request, out, err),
                Err(problem) => {
                    let _ = writeln!(err, "{file}: cannot read: {problem}");
                    1
                }
            }
        }
        "schema" if rest.is_empty() => {
            let _ = write!(out, "{SCHEMA}");
            0
        }
        "--version" | "version" => {
            let _ = writeln!(out, "floodgate {}", env!("CARGO_PKG_VERSION"));
            0
        }
        "--help" | "-h" | "help" => {
            let _ = write!(out, "{USAGE}");
            0
        }
        other => {
            let _ = write!(err, "floodgate: unknown command {other}\n{USAGE}");
            2
        }
    }
}

/// A file's contents, or standard input's for `-`.
fn read_input(file: &str) -> std::io::Result<Vec<u8>> {
    if file == "-" {
        let mut buffer = Vec::new();
        std::io::stdin().read_to_end(&mut buffer).map(|_| buffer)
    } else {
        std::fs::read(file)
    }
}

/// `floodgate explain`: every configuration of the file, under its location, explained for
/// `request` ([`explain::explain`]). Returns the exit status.
fn explain_file(name: &str, contents: &[u8], request: &explain::Request, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let Some(found) = configurations(name, contents, Options::default(), err) else { return 1 };
    let mut status = 0;
    for (prefix, item) in &found {
        match check(item) {
            Ok(checked) => {
                let _ = write!(out, "{}:\n{}", prefix.trim_end_matches(": "), explain::explain(&checked.config, request));
            }
            Err(problem) => {
                let _ = writeln!(err, "{prefix}{problem}");
                status = 1;
            }
        }
    }
    status
}

/// `floodgate partition`: for each configuration of the file with partitions, the summary and
/// the partition of the key made of `parts`, computed by the module's own code.
fn partition(name: &str, contents: &[u8], parts: &[String], out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let Some(found) = configurations(name, contents, Options::default(), err) else { return 1 };
    let mut shown = 0;
    for (prefix, item) in &found {
        let config = match check(item) {
            Ok(checked) => checked.config,
            Err(problem) => {
                let _ = writeln!(err, "{prefix}{problem}");
                return 1;
            }
        };
        let Some(selection) = &config.cluster_selection else { continue };
        let (Some(settings), Some(partitioner)) = (&selection.partition, Partitioner::new(selection)) else { continue };
        shown += 1;
        let _ = writeln!(out, "{prefix}{}", settings.summary(selection.clusters.len()));
        if parts.is_empty() {
            continue;
        }
        if parts.len() != settings.key.len() {
            let key: Vec<String> = settings.key.iter().map(ToString::to_string).collect();
            let _ = writeln!(
                err,
                "{prefix}the partition's key has {} part(s) ([{}]); {} value(s) given",
                settings.key.len(),
                key.join(", "),
                parts.len()
            );
            return 2;
        }
        let mut values = parts.iter();
        let Some(hash) = partitioner.key_hash(|_| values.next().map(String::as_bytes)) else { continue };
        let confinement = partitioner.confine(hash);
        let names: Vec<&str> =
            confinement.members.iter().filter_map(|i| selection.clusters.get(*i)).map(|c| c.as_str()).collect();
        let _ = writeln!(out, "{prefix}key {parts:?}: {}", names.join(", "));
    }
    if shown == 0 {
        let _ = writeln!(err, "{name}: no configuration with cluster_selection.partition");
        return 1;
    }
    0
}

/// Parses YAML text (one document or several, `---`-separated) into JSON values, as Envoy and
/// Kubernetes read it.
pub fn parse_documents(text: &str) -> Result<Vec<Value>, String> {
    let mut documents = Vec::new();
    for document in serde_norway::Deserializer::from_str(text) {
        let value = Value::deserialize(document).map_err(|err| format!("neither JSON nor YAML: {err}"))?;
        documents.push(value);
    }
    Ok(documents)
}

struct Walker {
    options: Options,
    found: Vec<Found>,
    skipped: usize,
    envoy: EnvoyContext,
}

/// Where the walk is: the enclosing listener's name and connection manager, if any.
#[derive(Clone, Copy, Default)]
struct Scope<'a> {
    listener: Option<&'a str>,
    connection_manager: Option<ClientAddress>,
}

impl ClientAddress {
    /// The settings of a connection manager message (proto3 JSON: a bool or `{"value": bool}`).
    fn of(manager: &Map<String, Value>) -> ClientAddress {
        let unwrap = |v: &Value| v.get("value").cloned().unwrap_or_else(|| v.clone());
        ClientAddress {
            use_remote_address: manager
                .get("use_remote_address")
                .map(unwrap)
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            xff_num_trusted_hops: manager
                .get("xff_num_trusted_hops")
                .and_then(|v| v.as_u64().or_else(|| v.as_str().and_then(|t| t.parse().ok())))
                .unwrap_or(0),
            detection_extensions: manager
                .get("original_ip_detection_extensions")
                .and_then(Value::as_array)
                .is_some_and(|extensions| !extensions.is_empty()),
        }
    }
}

impl Walker {
    fn walk<'a>(&mut self, value: &'a Value, path: &mut Vec<String>, scope: Scope<'a>) {
        match value {
            Value::Object(map) => {
                if str_at(value, &["kind"]) == Some("WasmPlugin") {
                    self.wasm_plugin(value);
                    return;
                }
                let mut scope = scope;
                match map.get("@type").and_then(Value::as_str) {
                    Some(WASM_FILTER_TYPE) => {
                        self.wasm_filter(value, path, scope);
                        return;
                    }
                    Some(t)
                        if t.ends_with(".TypedStruct") && str_at(value, &["type_url"]) == Some(WASM_FILTER_TYPE) =>
                    {
                        let message = map.get("value").unwrap_or(&Value::Null);
                        self.wasm_filter(message, path, scope);
                        return;
                    }
                    Some(HCM_TYPE) => scope.connection_manager = Some(ClientAddress::of(map)),
                    _ => {}
                }
                let is_listener = map.contains_key("filter_chains") || map.contains_key("default_filter_chain");
                if let Some(name) = map.get("name").and_then(Value::as_str).filter(|_| is_listener) {
                    scope.listener = Some(name);
                }
                for (key, child) in map {
                    path.push(format!(".{key}"));
                    self.walk(child, path, scope);
                    path.pop();
                }
            }
            Value::Array(items) => {
                for (index, child) in items.iter().enumerate() {
                    path.push(format!("[{index}]"));
                    self.walk(child, path, scope);
                    path.pop();
                }
            }
            _ => {}
        }
    }

    fn wasm_filter(&mut self, message: &Value, path: &[String], scope: Scope<'_>) {
        let config = message.get("config").unwrap_or(&Value::Null);
        let named = [
            str_at(config, &["name"]),
            str_at(config, &["root_id"]),
            str_at(config, &["vm_config", "vm_id"]),
            str_at(config, &["vm_config", "code", "local", "filename"]),
            str_at(config, &["vm_config", "code", "remote", "http_uri", "uri"]),
        ];
        if !self.options.any_wasm && !named.iter().flatten().any(|s| says_floodgate(s)) {
            self.skipped += 1;
            return;
        }
        let label = str_at(config, &["name"])
            .or_else(|| str_at(config, &["root_id"]))
            .unwrap_or("");
        let location = match scope.listener {
            Some(listener) => format!("listener \"{listener}\", Wasm filter \"{label}\""),
            None => {
                let at = path.concat();
                format!("Wasm filter \"{label}\" at {}", at.trim_start_matches('.'))
            }
        };
        let mut warnings = Vec::new();
        if config.get("failure_policy").is_none() && config.get("fail_open").is_none() {
            warnings.push(
                "failure_policy is not set: set it explicitly (FAIL_CLOSED answers 503 if the VM fails; \
                 FAIL_OPEN lets traffic through unprotected; FAIL_RELOAD starts a new VM)"
                    .to_owned(),
            );
        }
        self.found.push(Found {
            location,
            bytes: configuration_bytes(config.get("configuration")),
            warnings,
            envoy: Some(self.envoy.clone()),
            connection_manager: scope.connection_manager,
        });
    }

    fn wasm_plugin(&mut self, manifest: &Value) {
        let named = [
            str_at(manifest, &["metadata", "name"]),
            str_at(manifest, &["spec", "url"]),
            str_at(manifest, &["spec", "pluginName"]),
        ];
        if !self.options.any_wasm && !named.iter().flatten().any(|s| says_floodgate(s)) {
            self.skipped += 1;
            return;
        }
        let name = str_at(manifest, &["metadata", "name"]).unwrap_or("");
        let location = match str_at(manifest, &["metadata", "namespace"]) {
            Some(namespace) => format!("WasmPlugin \"{namespace}/{name}\""),
            None => format!("WasmPlugin \"{name}\""),
        };
        // Istio hands pluginConfig to the module as its JSON text; none at all is like `{}`.
        let bytes = match manifest.get("spec").and_then(|spec| spec.get("pluginConfig")) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(config) => serde_json::to_vec(config).map_err(|err| err.to_string()),
        };
        self.found.push(Found {
            location,
            bytes,
            warnings: Vec::new(),
            envoy: None,
            connection_manager: None,
        });
    }
}

fn says_floodgate(text: &str) -> bool {
    text.to_ascii_lowercase().contains("floodgate")
}

/// The string at a path of object keys.
fn str_at<'a>(value: &'a Value, keys: &[&str]) -> Option<&'a str> {
    keys.iter().try_fold(value, |v, key| v.get(key))?.as_str()
}

/// What Envoy passes to the module for a `PluginConfig.configuration` (a `google.protobuf.Any`):
/// a `StringValue` or `BytesValue` as is, a `Struct` serialized to JSON, nothing when absent.
fn configuration_bytes(configuration: Option<&Value>) -> Result<Vec<u8>, String> {
    let any = match configuration {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(any)) => any,
        Some(_) => return Err("configuration: must be a google.protobuf.Any with an \"@type\"".into()),
    };
    let type_url = any.get("@type").and_then(Value::as_str).unwrap_or("");
    let value = any.get("value");
    match type_url.rsplit('/').next().unwrap_or("") {
        "google.protobuf.StringValue" => match value {
            None => Ok(Vec::new()),
            Some(Value::String(text)) => Ok(text.as_bytes().to_vec()),
            Some(_) => Err("configuration.value: must be a string holding the JSON configuration".into()),
        },
        "google.protobuf.BytesValue" => match value {
            None => Ok(Vec::new()),
            Some(Value::String(text)) => base64_decode(text)
                .ok_or_else(|| "configuration.value: is not base64 (a BytesValue holds base64 text)".to_owned()),
            Some(_) => Err("configuration.value: must be a base64 string".into()),
        },
        "google.protobuf.Struct" => match value {
            None => Ok(b"{}".to_vec()),
            Some(object @ Value::Object(_)) => serde_json::to_vec(object).map_err(|err| err.to_string()),
            Some(_) => Err("configuration.value: must be an object (a google.protobuf.Struct)".into()),
        },
        "" => Err("configuration: has no \"@type\" (use type.googleapis.com/google.protobuf.StringValue)".into()),
        other => Err(format!(
            "configuration: floodgate reads a google.protobuf.StringValue (JSON text) or a google.protobuf.Struct, not {other}"
        )),
    }
}

fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let sextet = |c: u8| -> Option<u32> {
        Some(u32::from(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        }))
    };
    let digits: Vec<u8> = text.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let digits = digits
        .strip_suffix(b"==")
        .or_else(|| digits.strip_suffix(b"="))
        .unwrap_or(&digits);
    if digits.len() % 4 == 1 {
        return None;
    }
    let mut bytes = Vec::with_capacity(digits.len() / 4 * 3 + 2);
    for chunk in digits.chunks(4) {
        let mut bits = 0u32;
        for &c in chunk {
            bits = (bits << 6) | sextet(c)?;
        }
        let bits = bits << (6 * (4 - chunk.len()));
        let decoded = bits.to_be_bytes();
        bytes.extend(decoded.iter().skip(1).take(chunk.len().saturating_sub(1)));
    }
    Some(bytes)
}

/// The clusters and route `cluster_header`s an Envoy document defines statically.
fn envoy_context(document: &Value) -> EnvoyContext {
    let dynamic_clusters = ["cds_config", "ads_config"]
        .iter()
        .any(|key| document.get("dynamic_resources").and_then(|d| d.get(key)).is_some());
    let static_clusters = document
        .get("static_resources")
        .and_then(|s| s.get("clusters"))
        .and_then(Value::as_array)
        .filter(|_| !dynamic_clusters)
        .map(|clusters| {
            clusters
                .iter()
                .filter_map(|c| c.get("name").and_then(Value::as_str).map(str::to_owned))
                .collect()
        });
    let mut routes = Routes::default();
    collect_routes(document, &mut routes);
    EnvoyContext {
        static_clusters,
        cluster_headers: routes.inline.then_some(routes.cluster_headers),
        body_buffer_limit: routes.body_buffer_limit,
        read_limit: routes.read_limit.unwrap_or(ENVOY_BUFFER_LIMIT),
    }
}

/// What [`collect_routes`] finds in a document.
#[derive(Default)]
struct Routes {
    /// Whether it holds an inline route configuration.
    inline: bool,
    cluster_headers: Vec<String>,
    /// The smallest `request_body_buffer_limit` of a route (0: a route without one).
    body_buffer_limit: Option<u64>,
    /// The largest `per_connection_buffer_limit_bytes` of a listener (default for one without).
    read_limit: Option<u64>,
}

fn collect_routes(value: &Value, routes: &mut Routes) {
    match value {
        Value::Object(map) => {
            routes.inline |= map.contains_key("virtual_hosts");
            if let Some(header) = map.get("cluster_header").and_then(Value::as_str) {
                routes.cluster_headers.push(header.to_owned());
            }
            if map.contains_key("match") && map.contains_key("route") {
                let limit = map.get("request_body_buffer_limit").and_then(Value::as_u64).unwrap_or(0);
                routes.body_buffer_limit = Some(routes.body_buffer_limit.map_or(limit, |l| l.min(limit)));
            }
            if map.contains_key("filter_chains") {
                let read = map.get("per_connection_buffer_limit_bytes").and_then(Value::as_u64).unwrap_or(ENVOY_BUFFER_LIMIT);
                routes.read_limit = Some(routes.read_limit.map_or(read, |r| r.max(read)));
            }
            map.values().for_each(|v| collect_routes(v, routes));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_routes(v, routes)),
        _ => {}
    }
}

fn dedupe_locations(found: &mut [Found]) {
    let mut seen: Map<String, Value> = Map::new();
    for item in found.iter_mut() {
        if item.location.is_empty() {
            continue;
        }
        let count = seen.entry(item.location.clone()).or_insert(Value::from(0u64));
        let n = count.as_u64().unwrap_or(0).saturating_add(1);
        *count = Value::from(n);
        if n > 1 {
            item.location = format!("{} #{n}", item.location);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn find(name: &str, text: &str) -> Vec<Found> {
        find_configurations(name, text.as_bytes(), Options::default()).unwrap()
    }

    #[test]
    fn a_bare_json_file_is_the_configuration_byte_for_byte() {
        let text = "{\"rate_limits\": []}\n";
        let found = find("c.json", text);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].location, "");
        assert_eq!(found[0].bytes.as_deref().unwrap(), text.as_bytes());
        assert!(check(&found[0]).is_ok());
    }

    #[test]
    fn broken_json_gets_the_parsers_message() {
        let found = find("c.json", "{\"rate_limits\": [");
        let error = check(&found[0]).unwrap_err();
        assert!(error.contains("EOF"), "{error}");
        let found = find("c.conf", "{\"health\": {\"path\": \"/h\"},}");
        assert!(check(&found[0]).unwrap_err().contains("trailing comma"));
    }

    #[test]
    fn envoy_yaml_string_value_struct_and_bytes_value() {
        let yaml = r#"
static_resources:
  listeners:
  - name: front
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          route_config:
            virtual_hosts:
            - routes:
              - route: { cluster_header: X-Floodgate-Cluster }
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: floodgate
                failure_policy: FAIL_CLOSED
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{"cluster_selection": {"clusters": ["a", "b"]}}'
          - name: other
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: edge
                root_id: x
                vm_config: { code: { local: { filename: /etc/floodgate.wasm } } }
                configuration:
                  "@type": type.googleapis.com/google.protobuf.Struct
                  value: { health: { path: 7 } }
          - name: b64
            typed_config:
              "@type": type.googleapis.com/udpa.type.v1.TypedStruct
              type_url: type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              value:
                config:
                  root_id: floodgate
                  failure_policy: FAIL_OPEN
                  configuration:
                    "@type": type.googleapis.com/google.protobuf.BytesValue
                    value: eyJoZWFsdGgiOnsicGF0aCI6Ii9oIn19
          - name: not-ours
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config: { name: auth }
  clusters:
  - name: a
"#;
        let found = find("e.yaml", yaml);
        let locations: Vec<&str> = found.iter().map(|f| f.location.as_str()).collect();
        assert_eq!(
            locations,
            [
                "listener \"front\", Wasm filter \"floodgate\"",
                "listener \"front\", Wasm filter \"edge\"",
                "listener \"front\", Wasm filter \"floodgate\" #2"
            ]
        );
        let first = check(&found[0]).unwrap();
        assert_eq!(
            first.warnings,
            ["cluster_selection.clusters[1]: \"b\" is not one of this file's static_resources.clusters"]
        );
        assert_eq!(
            check(&found[1]).unwrap_err(),
            "health.path: invalid type: integer `7`, expected a string"
        );
        assert!(found[1].warnings[0].starts_with("failure_policy is not set"));
        assert_eq!(found[2].bytes.as_deref().unwrap(), br#"{"health":{"path":"/h"}}"#);
        assert!(check(&found[2]).unwrap().warnings.is_empty());
    }

    #[test]
    fn a_route_without_the_cluster_header_is_reported() {
        let yaml = r#"
route_config: { virtual_hosts: [ { routes: [ { route: { cluster: a } } ] } ] }
http_filters:
- typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
    config:
      root_id: floodgate
      failure_policy: FAIL_CLOSED
      configuration:
        "@type": type.googleapis.com/google.protobuf.StringValue
        value: '{"cluster_selection": {"clusters": ["a"], "route_header": "x-c"}}'
"#;
        let found = find("snippet.yaml", yaml);
        assert_eq!(
            found[0].location,
            "Wasm filter \"floodgate\" at http_filters[0].typed_config"
        );
        let warnings = check(&found[0]).unwrap().warnings;
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].starts_with("cluster_selection.route_header: no route in this file reads \"x-c\""));
    }

    /// A listener whose connection manager sets `settings`, with a floodgate filter configured
    /// with `config`.
    fn edge_listener(settings: &str, config: &str) -> String {
        format!(
            r#"
static_resources:
  listeners:
  - name: edge
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          {settings}
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: floodgate
                failure_policy: FAIL_CLOSED
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{config}'
"#
        )
    }

    #[test]
    fn a_source_ip_rule_without_use_remote_address_is_reported() {
        let per_ip = r#"{"rate_limits": [{"name": "by-key", "key": [{"header": "k"}], "limit": 5, "window": "1s"},
                                          {"name": "per-ip", "key": ["path", "source_ip"], "limit": 5, "window": "1s"}]}"#;
        let warnings = |settings: &str, config: &str| check(&find("e.yaml", &edge_listener(settings, config))[0]).unwrap().warnings;
        // Envoy's default (false): the client's address is the last X-Forwarded-For entry.
        for settings in ["stat_prefix: edge", "use_remote_address: false", "xff_num_trusted_hops: 1"] {
            let found = warnings(settings, per_ip);
            assert_eq!(found.len(), 1, "{settings}: {found:?}");
            assert!(
                found[0].starts_with("rate_limits[1] (\"per-ip\"): keys on source_ip, but this listener's connection manager does not set use_remote_address: true"),
                "{}",
                found[0]
            );
            assert!(found[0].contains("xff_num_trusted_hops"), "{}", found[0]);
        }
        // At the edge, or behind trusted proxies counted by xff_num_trusted_hops: nothing to say.
        assert!(warnings("use_remote_address: true", per_ip).is_empty());
        assert!(warnings("use_remote_address: true\n          xff_num_trusted_hops: 2", per_ip).is_empty());
        // An original-IP detection extension decides the address instead.
        assert!(warnings("original_ip_detection_extensions: [{name: xff}]", per_ip).is_empty());
        // No rule keyed on source_ip, or no connection manager in sight (an http_filters snippet).
        assert!(warnings("stat_prefix: edge", r#"{"rate_limits": [{"name": "a", "key": ["path"], "limit": 5, "window": "1s"}]}"#).is_empty());
        let snippet = format!(
            "http_filters:\n- typed_config:\n    \"@type\": {WASM_FILTER_TYPE}\n    config: {{name: floodgate, failure_policy: FAIL_CLOSED, configuration: {{\"@type\": type.googleapis.com/google.protobuf.StringValue, value: '{per_ip}'}}}}\n"
        );
        assert!(check(&find("s.yaml", &snippet)[0]).unwrap().warnings.is_empty());
    }

    #[test]
    fn a_global_cluster_the_file_does_not_define_is_reported() {
        let config = r#"{"rate_limits": [{"name": "t", "key": [{"header": "t"}], "limit": 5, "window": "1s", "scope": "global"}], "global": {"cluster": "floodgate-sync"}}"#;
        let listener = edge_listener("use_remote_address: true", config);
        let warnings = |yaml: &str| check(&find("g.yaml", yaml)[0]).unwrap().warnings;
        assert_eq!(
            warnings(&format!("{listener}  clusters:\n  - name: upstream\n")),
            ["global.cluster: \"floodgate-sync\" is not one of this file's static_resources.clusters (every batch to \
              floodgate-sync would fail, and the global rules would hold per proxy only)"]
        );
        assert!(warnings(&format!("{listener}  clusters:\n  - name: upstream\n  - name: floodgate-sync\n")).is_empty());
        // Without static clusters (they may come from CDS) there is nothing to compare with.
        assert!(warnings(&listener).is_empty());
    }

    #[test]
    fn a_body_estimate_without_room_for_the_body_in_the_routes_is_reported() {
        let config = r#"{"rate_limits": [{"name": "tokens", "key": [{"header": "k"}], "limit": 1000, "window": "1m",
            "cost": {"from": "response_body", "path": "usage.total_tokens",
                     "estimate": {"body": ["max_tokens"], "default": 256, "max": 4096}}}]}"#;
        let routes = |route_settings: &str| {
            format!(
                "route_config:\n            virtual_hosts:\n            - name: all\n              domains: [\"*\"]\n              \
                 routes:\n              - match: {{ prefix: \"/\" }}\n                route: {{ cluster: upstream }}\n{route_settings}"
            )
        };
        let warnings = |settings: &str, config: &str| check(&find("b.yaml", &edge_listener(settings, config))[0]).unwrap().warnings;
        let missing = warnings(&routes(""), config);
        assert_eq!(missing.len(), 1, "{missing:?}");
        assert!(missing[0].starts_with("rate_limits[0] (\"tokens\"): reads its estimate from the request body (up to 262144 bytes), but a route of this file sets no request_body_buffer_limit"), "{}", missing[0]);
        assert!(missing[0].contains("request_body_buffer_limit: 1376256 (or more)"), "{}", missing[0]);
        let small = warnings(&routes("                request_body_buffer_limit: 1048576\n"), config);
        assert!(small[0].contains("sets request_body_buffer_limit: 1048576"), "{small:?}");
        assert!(warnings(&routes("                request_body_buffer_limit: 2097152\n"), config).is_empty());
        // Without inline routes (RDS) or without a body estimate there is nothing to compare.
        assert!(warnings("stat_prefix: edge", config).is_empty());
        let header_only = config.replace(r#""body": ["max_tokens"], "#, r#""header": "x-max-tokens", "#);
        assert!(warnings(&routes(""), &header_only).is_empty());
    }

    #[test]
    fn the_shipped_llm_example_leaves_room_for_the_body() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/llm.yaml")).expect("envoy/llm.yaml");
        let found = find("llm.yaml", &text);
        assert!(found[0].envoy.as_ref().is_some_and(|e| e.body_buffer_limit == Some(2 << 20)), "{:?}", found[0].envoy);
        assert!(check(&found[0]).unwrap().warnings.is_empty(), "{:?}", check(&found[0]).unwrap().warnings);
    }

    #[test]
    fn istio_wasm_plugins_in_a_multi_document_file() {
        let yaml = r#"
apiVersion: v1
kind: Namespace
metadata: { name: shop }
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: { name: floodgate, namespace: shop }
spec:
  url: oci://registry.example/floodgate:0.2.0
  pluginConfig:
    rate_limits:
    - { name: per-ip, key: [source_ip], limit: 100, window: 1m }
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: { name: limits }
spec:
  url: oci://registry.example/floodgate:0.2.0
"#;
        let found = find("istio.yaml", yaml);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].location, "document 2, WasmPlugin \"shop/floodgate\"");
        assert!(check(&found[0])
            .unwrap()
            .config
            .summary()
            .contains("per-ip = 100 per 1m"));
        assert_eq!(found[1].bytes.as_deref().unwrap(), b"");
    }

    #[test]
    fn nothing_to_check_is_an_error_that_says_why() {
        let yaml = "static_resources:\n  listeners: []\n";
        let error = find_configurations("e.yaml", yaml.as_bytes(), Options::default()).unwrap_err();
        assert!(error.starts_with("no floodgate configuration found"), "{error}");
        let yaml = "http_filters:\n- typed_config:\n    \"@type\": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\n    config: {name: auth}\n";
        let error = find_configurations("e.yaml", yaml.as_bytes(), Options::default()).unwrap_err();
        assert!(error.contains("1 other Wasm filter(s)"), "{error}");
        let found = find_configurations("e.yaml", yaml.as_bytes(), Options { any_wasm: true }).unwrap();
        assert_eq!(found.len(), 1);
        assert!(find_configurations("e.yaml", b"a: [b", Options::default())
            .unwrap_err()
            .starts_with("neither JSON nor YAML"));
    }

    #[test]
    fn a_yaml_file_without_envoy_keys_is_a_configuration() {
        let error = find_configurations("compose.yaml", b"services:\n  envoy: {}\n", Options::default()).unwrap_err();
        assert!(error.starts_with("no floodgate configuration found"), "{error}");
        let found = find("c.yaml", "health:\n  path: /h\nrate_limit: []\n");
        assert_eq!(check(&found[0]).unwrap_err(), "rate_limit: unknown field `rate_limit`, expected one of `rate_limits`, `stat_prefix`, `ratelimit_headers`, `refusal_format`, `load_shedding`, `cluster_selection`, `health`, `watchdog`, `global`, `grpc`, `mode`, `access_log`");
    }

    #[test]
    fn partition_prints_a_key_s_clusters() {
        let dir = std::env::temp_dir().join(format!("floodgate-cli-partition-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("p.json");
        std::fs::write(
            &file,
            r#"{"cluster_selection": {"clusters": ["a", "b", "c", "d", "e", "f", "g", "h"], "partition": {"key": [{"header": "x-client"}], "size": 2}}}"#,
        )
        .unwrap();
        let name = file.display().to_string();
        let run_with = |args: &[&str]| {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
            let status = run(&args, &mut out, &mut err);
            (status, String::from_utf8_lossy(&out).into_owned(), String::from_utf8_lossy(&err).into_owned())
        };
        let (status, out, _) = run_with(&["partition", &name, "client-7"]);
        assert_eq!(status, 0);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], format!("{name}: partitions of 2 of 8 clusters by [header:x-client] (28 possible: a key shares its whole partition with 1 key in 28), refuse when unavailable"));
        let clusters = lines[1].strip_prefix(&format!("{name}: key [\"client-7\"]: ")).unwrap();
        assert_eq!(clusters.split(", ").count(), 2, "{clusters}");
        assert_eq!(run_with(&["partition", &name, "client-7"]).1, out, "stable");
        let (status, _, err) = run_with(&["partition", &name, "a", "b"]);
        assert_eq!(status, 2);
        assert!(err.contains("1 part(s) ([header:x-client]); 2 value(s) given"), "{err}");
        std::fs::write(&file, r#"{"health": {"path": "/h"}}"#).unwrap();
        let (status, _, err) = run_with(&["partition", &name]);
        assert_eq!(status, 1);
        assert!(err.contains("no configuration with cluster_selection.partition"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn base64_round_trips() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode("aGk=").unwrap(), b"hi");
        assert_eq!(base64_decode("").unwrap(), b"");
        assert!(base64_decode("a").is_none());
        assert!(base64_decode("a$==").is_none());
    }

    #[test]
    fn run_reports_and_exits() {
        let dir = std::env::temp_dir().join(format!("floodgate-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.json");
        let bad = dir.join("bad.json");
        std::fs::write(&good, r#"{"health": {"path": "/h"}}"#).unwrap();
        std::fs::write(
            &bad,
            r#"{"rate_limits": [{"name": "a", "key": ["path"], "limit": 0, "window": "1s"}]}"#,
        )
        .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let args = |files: &[&std::path::Path]| -> Vec<String> {
            std::iter::once("validate".to_owned())
                .chain(files.iter().map(|f| f.display().to_string()))
                .collect()
        };
        assert_eq!(run(&args(&[&good]), &mut out, &mut err), 0);
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("{}: ok: no rate limits; health endpoint /h\n", good.display())
        );
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(run(&args(&[&good, &bad]), &mut out, &mut err), 1);
        assert_eq!(
            String::from_utf8_lossy(&err),
            format!(
                "{}: rate_limits[0].limit: must be a positive integer of at most 4294967295, got 0\n",
                bad.display()
            )
        );
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(run(&["validate".into()], &mut out, &mut err), 2);
        assert_eq!(run(&["schema".into()], &mut out, &mut err), 0);
        assert_eq!(run(&["partition".into()], &mut out, &mut err), 2);
        assert!(String::from_utf8_lossy(&out).contains("2020-12"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
