//! Test harness for floodgate's integration tests.
//!
//! The tests in `integration/tests/` load the built Wasm module into a real Envoy process, put a
//! real HTTP/1.1 upstream behind it, and talk to it over loopback (127.0.0.1 only). This crate
//! holds what they share, re-exported at its root (`use floodgate_integration::*;`):
//!
//! * [`artifacts`]: [`wasm_module`] and [`envoy_binary`] locate the artifacts (`FLOODGATE_WASM` /
//!   `ENVOY_BIN`, or their default places in the workspace). A missing artifact fails the test
//!   with a message telling to run `./test.sh`; nothing is ever skipped silently.
//! * [`upstream`]: [`Upstream`], a hyper HTTP/1.1 server on an ephemeral port that counts what it
//!   receives.
//! * [`envoy`]: [`Envoy`], a real Envoy started from a generated bootstrap with the floodgate
//!   filter in front of the router; exposes its listener address, admin API, stats, RSS and log.
//!   It starts through `floodgate-harness` ([`Launch`], [`launch`]), which the benchmarks use
//!   too, and which starts Envoy again on fresh ports when one it was to bind was taken.
//!   [`stats`] reads its counters, [`logs`] scans its log.
//! * [`client`]: [`Client`] (hyper, keep-alive) and [`raw_request`] (arbitrary bytes over a
//!   `TcpStream`) to send requests; [`load`] drives many of them.
//! * [`window`]: [`wait_for_window_phase`] to keep a timing-sensitive test clear of an
//!   epoch-aligned window boundary.
//! * [`ports`]: free loopback ports, and the demo's configuration on them.
//! * [`ratelimit_headers`]: parsing the rate-limit response headers.
//! * [`shedding`]: the load-shedding configuration several tests share.
//! * [`slow_clients`]: slow uploads and downloads, and an HTTP/2 client that grants no window.
//! * [`wallclock`]: a wall clock of Envoy's own that a test can step.
//! * [`dynamic`], [`faults`], [`grpc`], [`store`]: an Envoy whose filter configuration changes
//!   while it runs, misbehaving upstreams and clients, real gRPC peers, and Redis with
//!   `floodgate-sync` for the global scope; [`tls`], certificates for Redis over TLS.
//!
//! Every wait in here is bounded; every server binds 127.0.0.1.

pub use serde_json::{json, Value};

pub mod artifacts;
pub mod client;
pub mod dynamic;
pub mod envoy;
pub mod faults;
pub mod grpc;
pub mod llm;
pub mod load;
pub mod logs;
pub mod ports;
pub mod ratelimit_headers;
pub mod shedding;
pub mod slow_clients;
pub mod stats;
pub mod store;
pub mod tls;
pub mod upstream;
pub mod wallclock;
pub mod window;

pub use artifacts::*;
pub use client::*;
pub use envoy::*;
pub use llm::*;
pub use load::*;
pub use logs::*;
pub use ports::*;
pub use ratelimit_headers::*;
pub use shedding::*;
pub use stats::*;
pub use upstream::*;
pub use window::*;
