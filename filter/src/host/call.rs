//! HTTP calls to `floodgate-sync` (the global scope's batches, the leased rules' leases): a JSON
//! `POST` to the store's cluster, and its answer read once.

use crate::config::StoreRoute;
use crate::fleet::Answer;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, Status};
use std::time::Duration;

/// Sends `body` as a JSON `POST` to `path` on the route's cluster, with its `:authority` and
/// `authorization`; the token of the call, or why the host did not send it (no such cluster, say).
pub fn post_json(route: &StoreRoute, path: &str, body: &[u8], timeout: Duration) -> Result<u32, Status> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", route.authority.as_str()),
        ("content-type", "application/json"),
    ];
    if let Some(authorization) = &route.authorization {
        headers.push(("authorization", authorization.as_str()));
    }
    hostcalls::dispatch_http_call(&route.cluster, headers, Some(body), vec![], timeout)
}

/// The answer to the call whose response callback runs: a `200`'s body, or the other status
/// (`None`: no response at all: reset, timeout, no such cluster).
pub fn answer(num_headers: usize, body_size: usize) -> Answer {
    // The bytes getter: the `String` ones panic on a value that is not UTF-8.
    let status = (num_headers > 0)
        .then(|| hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status").ok().flatten())
        .flatten()
        .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
    match status {
        Some(200) => Answer::Ok(hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).ok().flatten().unwrap_or_default()),
        other => Answer::Failed(other),
    }
}
