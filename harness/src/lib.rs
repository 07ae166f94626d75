//! A real Envoy for floodgate's integration tests (`floodgate-integration`) and benchmarks
//! (`floodgate-bench`), written once:
//!
//! * [`ports`]: free loopback ports for a configuration to bind.
//! * [`bootstrap`]: the pieces of a bootstrap both use (static clusters, the floodgate Wasm
//!   filter, the router, HTTP/2 upstreams).
//! * [`launch`]: [`Launch`] starts Envoy on a bootstrap, waits until its admin API says it is
//!   ready, and starts it again on freshly picked ports when a port it was to bind was taken in
//!   the meantime; [`Running`] is the process with its admin address, listeners and log, killed
//!   when dropped.
//! * [`http`]: the blocking `GET` the readiness check (and a caller's admin requests) use.
//!
//! Everything binds 127.0.0.1; every wait is bounded.

pub mod bootstrap;
pub mod http;
pub mod launch;
pub mod ports;

pub use http::http_get;
pub use launch::{Launch, Running, Spawned, Wait};
pub use ports::{free_ports, loopback};

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
