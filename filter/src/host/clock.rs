//! The host's clocks, read once per callback (see [`crate::primitives::time`] for which clock serves what).
//!
//! The monotonic clock is WASI's `clock_time_get(CLOCK_MONOTONIC)`, which Envoy answers with its
//! `monotonicTime()` (proxy-wasm-cpp-host `exports.cc`): one steady clock for every worker of the
//! process. The SDK has no call for it and `std::time::Instant` hides its value, so this module
//! declares the import itself (the crate's second and last `unsafe` code, beside
//! `header_map.rs`). The wall clock is derived from it ([`WallEstimate`]: read once a second per
//! VM), so a callback that needs both reads one clock.
#![allow(unsafe_code)]

use crate::primitives::time::{MonoMillis, Now, UnixMillis, WallEstimate};
use proxy_wasm::hostcalls;
use std::cell::Cell;
use std::time::UNIX_EPOCH;

#[link(wasm_import_module = "wasi_snapshot_preview1")]
extern "C" {
    /// WASI preview 1: writes the clock's time in nanoseconds; returns an errno (0: success).
    /// The wasm signature is `(i32, i64, i32) -> i32`, the one the standard library imports.
    #[link_name = "clock_time_get"]
    fn wasi_clock_time_get(clock_id: u32, precision_ns: u64, time_ns: *mut u64) -> u32;
}

/// WASI's `CLOCK_MONOTONIC`.
const CLOCK_MONOTONIC: u32 = 1;

thread_local! {
    /// This VM's wall-clock anchor.
    static WALL: Cell<WallEstimate> = Cell::new(WallEstimate::default());
    /// Whether the monotonic clock failed once (then the wall clock stands in for it).
    static NO_MONOTONIC: Cell<bool> = const { Cell::new(false) };
}

/// The monotonic clock, in milliseconds. Should the host not have it (it always does in Envoy),
/// the wall clock stands in, as before this clock was used, with a warning logged once.
pub fn mono() -> MonoMillis {
    if !NO_MONOTONIC.with(Cell::get) {
        let mut ns: u64 = 0;
        // SAFETY: `ns` is valid for writes for the duration of the call, and the import has
        // WASI preview 1's signature for `clock_time_get`.
        let errno = unsafe { wasi_clock_time_get(CLOCK_MONOTONIC, 1_000_000, &mut ns) };
        if errno == 0 {
            return MonoMillis(ns / 1_000_000);
        }
        NO_MONOTONIC.with(|c| c.set(true));
        log::warn!("floodgate: the host has no monotonic clock (errno {errno}); using the wall clock");
    }
    MonoMillis(wall().0)
}

/// The wall clock, read from the host (proxy-wasm's `get_current_time`).
pub fn wall() -> UnixMillis {
    let ms = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    UnixMillis(ms)
}

/// Both clocks: the monotonic one read, the wall clock derived from it (read once a second).
pub fn now() -> Now {
    let mono = mono();
    WALL.with(|cell| {
        let mut estimate = cell.get();
        let now = estimate.at(mono, wall);
        cell.set(estimate);
        now
    })
}
