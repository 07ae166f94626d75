//! Primitives every mechanism builds on: time, the shared store and its compare-and-swap
//! discipline, and the proxy-wide in-flight count.

pub mod inflight;
pub mod store;
pub mod time;
