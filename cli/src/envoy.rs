//! What the Envoy configuration around a floodgate filter defines, read from the same document:
//! the static clusters, the routes' `cluster_header`s and `request_body_buffer_limit`s, the
//! listeners' read limit, and how an HTTP connection manager tells the client's address.
//!
//! Invariant: facts only, with Envoy's defaults where the file is silent and `None` where the file
//! cannot tell (clusters from CDS, routes from RDS); judging them against a configuration is for
//! [`crate::check`].

use serde_json::{Map, Value};

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

impl ClientAddress {
    /// The settings of a connection manager message (proto3 JSON: a bool or `{"value": bool}`).
    pub(crate) fn of(manager: &Map<String, Value>) -> ClientAddress {
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

/// The clusters and route `cluster_header`s an Envoy document defines statically.
pub(crate) fn envoy_context(document: &Value) -> EnvoyContext {
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
