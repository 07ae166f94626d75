//! The whole request header map in one host call, as the host serialized it.
//!
//! The SDK's `hostcalls::get_map_bytes` copies every name into a `String` and every value into
//! a `Vec` (and panics on a buffer it cannot parse); floodgate only needs a few values, which
//! [`crate::pipeline::headers`] finds in place. So this module declares the ABI import itself, as the SDK
//! does (`proxy-wasm` 0.2 `src/hostcalls.rs`), and takes ownership of the buffer the host
//! returns. It is the crate's only `unsafe` code.
#![allow(unsafe_code)]

use proxy_wasm::types::{MapType, Status};
use std::ptr::null_mut;

#[link(wasm_import_module = "env")]
extern "C" {
    /// proxy-wasm ABI 0.2.1: writes the address and size of the serialized map (a buffer the
    /// host obtained from this module's `proxy_on_memory_allocate`), or null for an empty map.
    /// Map type and status are `u32`s on the wire.
    fn proxy_get_header_map_pairs(map_type: u32, return_map_data: *mut *mut u8, return_map_size: *mut usize) -> u32;
}

/// The serialized request header map (empty for a map without headers), or `None` when the
/// host refused (the caller then reads headers one by one).
pub(super) fn request_headers() -> Option<Vec<u8>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: both out-parameters are valid for writes for the duration of the call, and the
    // import has the ABI's signature (the SDK declares the same one).
    let status = unsafe { proxy_get_header_map_pairs(MapType::HttpRequestHeaders as u32, &mut data, &mut size) };
    if status != Status::Ok as u32 {
        return None;
    }
    if data.is_null() {
        return Some(Vec::new());
    }
    // SAFETY: a non-null `data` is a buffer of exactly `size` initialized bytes that the host
    // allocated with this module's `proxy_on_memory_allocate` (the SDK's: a boxed `[u8]` of
    // `size` bytes, i.e. the global allocator with the layout of a `Vec<u8>` of capacity
    // `size`) and hands over to the module; nothing else refers to it. Rebuilding the `Vec`
    // makes it ours to free, as the SDK's `get_map_bytes` does.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
}
