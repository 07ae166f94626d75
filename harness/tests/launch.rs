//! The launch's port-race retry: a port picked free and taken by another process before Envoy
//! binds it makes Envoy exit with `Address already in use`; the launch starts it again on a
//! bootstrap made afresh, and reports the ports it actually bound. Against a stand-in for Envoy
//! (`fake-envoy`), and against the real Envoy when `ENVOY_BIN` names one.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use floodgate_harness::bootstrap::{loopback_address, router, static_cluster};
use floodgate_harness::{free_ports, http_get, loopback, Launch};
use serde_json::{json, Value};

/// A bootstrap with the admin API on `admin` and listener `front` on `front`, answering 200 itself.
fn bootstrap(admin: u16, front: u16) -> Value {
    json!({
        "admin": {"address": loopback_address(admin)},
        "static_resources": {
            "listeners": [{
                "name": "front",
                "address": loopback_address(front),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "front",
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]},
                        "http_filters": [router()]
                    }
                }]}]
            }],
            "clusters": [static_cluster("unused", Vec::new())]
        }
    })
}

/// Holds a port, and makes the first bootstrap (and only the first) use it for `which` (0: the
/// admin API, 1: the listener): the first start fails, the second gets fresh ports.
fn starts_again_on_fresh_ports(launch: Launch, which: usize) {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken_port = taken.local_addr().expect("addr").port();
    let made = Arc::new(AtomicU32::new(0));
    let counter = made.clone();
    let envoy = launch
        .start_with(move || {
            let mut ports = free_ports(2);
            if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                ports[which] = taken_port;
            }
            bootstrap(ports[0], ports[1]).to_string()
        })
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(made.load(Ordering::SeqCst), 2, "one bootstrap per start");
    let (admin, front) = (envoy.admin().expect("admin"), envoy.listener("front").expect("front"));
    assert_ne!(admin.port(), taken_port);
    assert_ne!(front.port(), taken_port);
    assert_eq!(admin.ip(), loopback(0).ip());
    let (status, body) = http_get(admin, "/ready").expect("GET /ready");
    assert_eq!((status, body.trim()), (200, "LIVE"));
    drop(taken);
}

fn fake() -> Launch {
    Launch::new(env!("CARGO_BIN_EXE_fake-envoy"))
}

#[test]
fn a_taken_listener_port_starts_envoy_again_on_fresh_ports() {
    starts_again_on_fresh_ports(fake(), 1);
}

#[test]
fn a_taken_admin_port_starts_envoy_again_on_fresh_ports() {
    starts_again_on_fresh_ports(fake(), 0);
}

#[test]
fn the_retry_is_bounded_and_the_error_shows_the_log() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let made = Arc::new(AtomicU32::new(0));
    let counter = made.clone();
    let error = fake()
        .attempts(2)
        .start_with(move || {
            counter.fetch_add(1, Ordering::SeqCst);
            bootstrap(0, port).to_string()
        })
        .err()
        .expect("no start while the port is held");
    assert_eq!(made.load(Ordering::SeqCst), 2);
    assert!(error.contains("Address already in use"), "{error}");
}

#[test]
fn ports_left_to_envoy_are_reported_as_bound() {
    let envoy = fake().start(&bootstrap(0, 0).to_string()).unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(envoy.listener("front").expect("front").port(), 0);
    assert!(envoy.is_ready());
}

/// The same against the real Envoy (`ENVOY_BIN`), when there is one.
#[test]
fn the_real_envoy_starts_again_on_fresh_ports() {
    let Some(envoy) = std::env::var_os("ENVOY_BIN") else {
        println!("ENVOY_BIN not set: the retry was checked against fake-envoy only");
        return;
    };
    for which in [1, 0] {
        starts_again_on_fresh_ports(Launch::new(&envoy).log_level("warning"), which);
    }
}
