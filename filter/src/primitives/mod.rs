//! Primitives every mechanism builds on: time, the shared store and its compare-and-swap
//! discipline, the byte codec of its records, the hashes and the random source, and the
//! proxy-wide in-flight count.
//!
//! Rationale: docs/design.md, sections "Shared data and compare-and-swap" and "Reserves".

pub mod hash;
pub mod inflight;
pub mod record;
pub mod store;
pub mod time;
