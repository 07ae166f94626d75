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

/// The Wasm module's `vm_id`: Envoy shares its shared data among the VMs of one `vm_id`, across
/// configurations and new VMs alike.
pub const VM_ID: &str = "floodgate";

/// `envoy.filters.http.wasm` with `module` and the plugin configuration `config` (see
/// [`wasm_config`]).
pub fn wasm_filter(module: &Path, config: &str) -> Value {
    json!({"name": "envoy.filters.http.wasm", "typed_config": wasm_config(module, config, None)})
}

/// The Wasm filter's own configuration (`envoy.extensions.filters.http.wasm.v3.Wasm`): `module`
/// and the plugin configuration `config`, failing closed, on V8, `root_id` `floodgate` and
/// [`VM_ID`]. `vm_configuration` is the VM's configuration (`vm_config.configuration`, which
/// floodgate ignores): a changed one makes Envoy start new VMs, as a code update would.
pub fn wasm_config(module: &Path, config: &str, vm_configuration: Option<&str>) -> Value {
    let mut vm_config = json!({
        "vm_id": VM_ID,
        "runtime": "envoy.wasm.runtime.v8",
        "code": {"local": {"filename": module.display().to_string()}}
    });
    if let Some(vm_configuration) = vm_configuration {
        vm_config["configuration"] = json!({"@type": "type.googleapis.com/google.protobuf.StringValue", "value": vm_configuration});
    }
    json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        "config": {
            "name": "floodgate",
            "root_id": "floodgate",
            "failure_policy": "FAIL_CLOSED",
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": config},
            "vm_config": vm_config
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wasm_filter_and_a_dynamic_configuration_are_one_message() {
        let module = Path::new("/m.wasm");
        let filter = wasm_filter(module, "{}");
        assert_eq!(filter["name"], "envoy.filters.http.wasm");
        assert_eq!(filter["typed_config"], wasm_config(module, "{}", None));
        let vm = &filter["typed_config"]["config"]["vm_config"];
        assert_eq!((&vm["vm_id"], &vm["code"]["local"]["filename"]), (&json!(VM_ID), &json!("/m.wasm")));
        assert!(vm.get("configuration").is_none(), "no VM configuration unless asked: {vm}");
        let next = wasm_config(module, "{}", Some("2"));
        assert_eq!(next["config"]["vm_config"]["configuration"]["value"], "2");
        assert_eq!(next["config"]["configuration"], filter["typed_config"]["config"]["configuration"]);
    }
}
