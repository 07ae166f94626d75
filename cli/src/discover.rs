//! Finding the floodgate configurations in a file: a bare JSON configuration, the HTTP Wasm
//! filters of an Envoy bootstrap or xDS resource file (YAML or JSON) that load floodgate, or an
//! Istio `WasmPlugin` manifest.
//!
//! Invariant: each [`Found`] carries the exact bytes the module would receive in `on_configure`
//! (or why they cannot be told) and, inside an Envoy configuration, what [`crate::envoy`] reads of
//! the configuration around it. Nothing here runs the module's parser: whether a configuration is
//! valid is for [`crate::check`].

use crate::envoy::{envoy_context, ClientAddress, EnvoyContext, HCM_TYPE};
use serde::Deserialize;
use serde_json::{Map, Value};

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
    fn base64_round_trips() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode("aGk=").unwrap(), b"hi");
        assert_eq!(base64_decode("").unwrap(), b"");
        assert!(base64_decode("a").is_none());
        assert!(base64_decode("a$==").is_none());
    }
}
