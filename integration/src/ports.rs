//! Free loopback ports for a configuration to bind, and the demo's Envoy configuration moved onto
//! them.

use std::net::SocketAddr;

use crate::artifacts::{wasm_module, workspace_root};

pub use floodgate_harness::free_ports;

/// `envoy/demo.yaml` (what `./demo.sh` runs) passed through `edit`, then with its fixed ports
/// (admin 9901, front 10000, zones 10001 to 10003) replaced by free ones and its module path made
/// absolute: the text, the admin address and the front listener's address.
pub fn demo_config(edit: impl FnOnce(String) -> String) -> (String, SocketAddr, SocketAddr) {
    let path = workspace_root().join("envoy/demo.yaml");
    let mut text = edit(std::fs::read_to_string(&path).expect("read envoy/demo.yaml"));
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
    let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    (text, at(ports[0]), at(ports[1]))
}
