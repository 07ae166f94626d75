//! Pieces of an Envoy bootstrap (as JSON, which Envoy reads as YAML) that the integration tests
//! and the benchmarks share.

use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;

/// A `socket_address` on 127.0.0.1 (`port` 0: Envoy picks one).
pub fn loopback_address(port: u16) -> Value {
    json!({"socket_address": {"address": "127.0.0.1", "port_value": port}})
}

/// The admin API on 127.0.0.1, on a port Envoy picks (read back with `--admin-address-path`).
pub fn admin() -> Value {
    json!({"address": loopback_address(0)})
}

/// One load-balancing endpoint.
pub fn endpoint(addr: SocketAddr) -> Value {
    json!({"endpoint": {"address": {"socket_address": {
        "address": addr.ip().to_string(), "port_value": addr.port()
    }}}})
}

/// A static cluster with generous circuit breakers (the tests and benchmarks measure floodgate,
/// not Envoy's limits).
pub fn static_cluster(name: &str, endpoints: Vec<Value>) -> Value {
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "circuit_breakers": {"thresholds": [{
            "max_connections": 100000,
            "max_pending_requests": 100000,
            "max_requests": 100000,
            "max_retries": 100000
        }]},
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": endpoints}]
        }
    })
}

/// A cluster's `typed_extension_protocol_options` for endpoints that speak HTTP/2 without TLS
/// (prior knowledge), as `floodgate-sync` and gRPC servers do.
pub fn http2_protocol_options() -> Value {
    json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}
        }
    })
}

/// `envoy.filters.http.wasm` with `module` and the plugin configuration `config` (failing
/// closed, V8, `vm_id` and `root_id` `floodgate`).
pub fn wasm_filter(module: &Path, config: &str) -> Value {
    json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "floodgate",
                "root_id": "floodgate",
                "failure_policy": "FAIL_CLOSED",
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": config},
                "vm_config": {
                    "vm_id": "floodgate",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": module.display().to_string()}}
                }
            }
        }
    })
}

/// The router, the last HTTP filter.
pub fn router() -> Value {
    json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    })
}
