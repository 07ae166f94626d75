//! The batched global scope's root side ([`crate::fleet::batched`] keeps the deltas, the view
//! and the flusher): its tick, the batch it sends, and the answer, each decided here and handed
//! to the host as what to do ([`Outgoing`]: a batch to post), and the one way a request's units
//! go into the VM's next batch (`count`). The requests' own work (counting, the projection,
//! the ask) is the `rate_limit` stage's, which decides batched rules with the local ones.
//!
//! Invariant: nothing here calls the host: the host posts the batch a tick returns and reports
//! whether it went ([`Filter::batch_sent`], [`Filter::batch_not_sent`]), and hands over the
//! answer it read ([`Filter::batch_answered`]).
//!
//! Rationale: docs/design.md, section "Batched consistency".

use super::stats::{self, increment, GlobalStats, Metrics};
use super::{Clock, Env, Filter, Host};
use crate::fleet::batched::leadership::Failure;
use crate::fleet::batched::{fleet_size, GlobalScope, VmNode};
use crate::fleet::Answer;
use crate::keys::fleet::FleetKey;
use crate::primitives::time::UnixMillis;
use crate::ratelimit::Probe;

/// A batch for the host to post to `floodgate-sync`, from the root context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing {
    /// Its request body.
    pub body: Vec<u8>,
    /// The counters in it.
    pub counters: usize,
}

impl Filter {
    /// The global scope's tick, once per `sync_interval`: moves this VM's deltas, refreshes its
    /// view, sets the scope's gauges and counts what was dropped, and, on the proxy's flusher,
    /// returns the batch for the host to post (`None`: nothing to send, or no batched rules).
    pub fn sync<H: Host>(&self, env: &Env<'_, H>) -> Option<Outgoing> {
        let (Some(scope), Some(node)) = (&self.fleet.global, &self.fleet.global_node) else { return None };
        let ids = &self.stats.global;
        let mut node = node.borrow_mut();
        let tick = scope.tick(env.store, &mut node, env.vm, env.clock.now().wall);
        stats::add_count(env.metrics, ids.dropped, tick.expired.saturating_add(tick.dropped));
        stats::add_count(env.metrics, ids.errors, u64::from(tick.errors));
        stats::set(env.metrics, ids.view_keys, u64::try_from(node.cache.keys()).unwrap_or(u64::MAX));
        stats::set(env.metrics, ids.proxies, u64::from(node.proxies));
        if let Some(staleness) = tick.staleness_ms {
            stats::set(env.metrics, ids.staleness_ms, staleness);
        }
        tick.send.map(|body| Outgoing { body, counters: tick.counters })
    }

    /// The host posted `batch` as call `token`.
    pub fn batch_sent<H: Host>(&self, env: &Env<'_, H>, batch: &Outgoing, token: u32) {
        let Some(node) = &self.fleet.global_node else { return };
        node.borrow_mut().flusher.sent(token, env.clock.now().wall);
        increment(env.metrics, self.stats.global.batches);
        stats::add_count(env.metrics, self.stats.global.counters, u64::try_from(batch.counters).unwrap_or(u64::MAX));
    }

    /// The host could not post the batch (no such cluster, or it refused): the batch stays for
    /// the next tick.
    pub fn batch_not_sent<H: Host>(&self, env: &Env<'_, H>) {
        increment(env.metrics, self.stats.global.failures);
    }

    /// Whether call `token` is this VM's batch on its way.
    pub fn owns_batch(&self, token: u32) -> bool {
        self.fleet.global_node.as_ref().is_some_and(|node| node.borrow().flusher.owns(token))
    }

    /// The answer to the batch call `token`, with the fleet-size header's value as read
    /// (`proxies`; absent from an older `floodgate-sync`: the last known size stays): on
    /// success the totals go into the view; a failed batch is sent again at the next tick.
    pub fn batch_answered<H: Host>(&self, env: &Env<'_, H>, token: u32, answer: Answer, proxies: Option<&[u8]>) {
        let (Some(scope), Some(node)) = (&self.fleet.global, &self.fleet.global_node) else { return };
        let mut node = node.borrow_mut();
        if !node.flusher.owns(token) {
            return;
        }
        let proxies = proxies.and_then(fleet_size);
        match scope.answered(env.store, &mut node, token, answer, proxies, env.clock.now().wall) {
            Ok(counters) => {
                increment(env.metrics, self.stats.global.confirmed);
                log::debug!("floodgate: global batch of {counters} counters confirmed");
            }
            Err(failure) => {
                increment(env.metrics, self.stats.global.failures);
                match failure {
                    Failure::Status(status) => log::debug!("floodgate: global batch failed ({status:?}); sent again next tick"),
                    Failure::Protocol(e) => log::warn!("floodgate: global batch answer not understood: {e}"),
                }
            }
        }
    }
}

/// Counts `cost` units and `requests` requests of `probe`'s key (`key`, its fleet-wide id)
/// into the VM's next batch ([`GlobalScope::count`]); units the VM's buffer has no room for
/// are counted as dropped. Inlined where the request path counts, as the two calls it joins were.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn count<M: Metrics + ?Sized>(
    metrics: &M,
    ids: &GlobalStats,
    scope: &GlobalScope,
    node: &mut VmNode,
    probe: &Probe,
    key: FleetKey,
    now: UnixMillis,
    cost: u32,
    requests: u32,
) {
    let dropped = scope.count(node, probe, key, now, cost, requests);
    stats::add_count(metrics, ids.dropped, dropped);
}
