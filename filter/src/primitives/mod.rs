//! Primitives every mechanism builds on: time, the shared store and its compare-and-swap
//! discipline, the hashes and the random source, and the proxy-wide in-flight count.

pub mod hash;
pub mod inflight;
pub mod store;
pub mod time;
