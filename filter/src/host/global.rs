//! The global scope's host side: the batch call to `floodgate-sync` and its answer, on the root
//! context, and the VM's node, which outlives configurations ([`crate::fleet::batched`] decides
//! everything).

use super::call;
use super::metrics::EnvoyMetrics;
use crate::pipeline::stats::{self, GlobalStats};
use super::store::EnvoyStore;
use crate::config::SYNC_PATH;
use crate::fleet::batched::PROXIES_HEADER;
use crate::fleet::batched::leadership::Failure;
use crate::fleet::batched::{GlobalScope, VmNode};
use crate::primitives::time::UnixMillis;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MapType;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

thread_local! {
    /// This VM's node per filter namespace: its deltas, view and flusher survive a
    /// configuration change (a new root context in the same VM).
    static NODES: RefCell<HashMap<String, Rc<RefCell<VmNode>>>> = RefCell::new(HashMap::new());
}

/// This VM's node for `namespace`.
pub fn node(namespace: &str, vm: u64) -> Rc<RefCell<VmNode>> {
    NODES.with(|nodes| {
        Rc::clone(
            nodes
                .borrow_mut()
                .entry(namespace.to_owned())
                .or_insert_with(|| Rc::new(RefCell::new(VmNode::new(vm)))),
        )
    })
}

/// One tick of the global scope: moves this VM's deltas, refreshes its view, and, on the
/// proxy's flusher, sends the batch.
pub fn tick(scope: &GlobalScope, node: &RefCell<VmNode>, ids: &GlobalStats, vm: u64, now: UnixMillis) {
    let mut node = node.borrow_mut();
    let tick = scope.tick(&EnvoyStore, &mut node, vm, now);
    stats::add_count(&EnvoyMetrics, ids.dropped, tick.expired.saturating_add(tick.dropped));
    stats::add_count(&EnvoyMetrics, ids.errors, u64::from(tick.errors));
    stats::set(&EnvoyMetrics, ids.view_keys, u64::try_from(node.cache.keys()).unwrap_or(u64::MAX));
    stats::set(&EnvoyMetrics, ids.proxies, u64::from(node.proxies));
    if let Some(staleness) = tick.staleness_ms {
        stats::set(&EnvoyMetrics, ids.staleness_ms, staleness);
    }
    let Some(body) = tick.send else { return };
    let timeout = Duration::from_millis(scope.timeout_ms);
    match call::post_json(&scope.route, SYNC_PATH, &body, timeout) {
        Ok(token) => {
            node.flusher.sent(token, now);
            stats::increment(&EnvoyMetrics, ids.batches);
            stats::add_count(&EnvoyMetrics, ids.counters, u64::try_from(tick.counters).unwrap_or(u64::MAX));
        }
        Err(status) => {
            // No such cluster, or the host refused: the batch stays for the next tick.
            stats::increment(&EnvoyMetrics, ids.failures);
            log::warn!("floodgate: global sync to cluster {:?} not sent: {status:?}", scope.route.cluster);
        }
    }
}

/// The answer to a batch call.
pub fn answered(
    scope: &GlobalScope,
    node: &RefCell<VmNode>,
    ids: &GlobalStats,
    token: u32,
    num_headers: usize,
    body_size: usize,
    now: UnixMillis,
) {
    let mut node = node.borrow_mut();
    if !node.flusher.owns(token) {
        return;
    }
    let answer = call::answer(num_headers, body_size);
    // floodgate-sync's fleet size (absent from an older one: the last known stays).
    let proxies = (num_headers > 0)
        .then(|| hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, PROXIES_HEADER).ok().flatten())
        .flatten()
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u32>().ok());
    match scope.answered(&EnvoyStore, &mut node, token, answer, proxies, now) {
        Ok(counters) => {
            stats::increment(&EnvoyMetrics, ids.confirmed);
            log::debug!("floodgate: global batch of {counters} counters confirmed");
        }
        Err(failure) => {
            stats::increment(&EnvoyMetrics, ids.failures);
            match failure {
                Failure::Status(status) => log::debug!("floodgate: global batch failed ({status:?}); sent again next tick"),
                Failure::Protocol(e) => log::warn!("floodgate: global batch answer not understood: {e}"),
            }
        }
    }
}
