//! A key a proxy has not learned from the store, and the asks that keep a low limit spread over
//! many proxies from being admitted once per proxy.
//!
//! Every sync answer gives the fleet size `P` (the distinct proxies that sent a batch in the last
//! seconds, counted by `floodgate-sync` in Redis). For a key its view does not hold, a proxy
//! projects its own counts as if the `P − 1` others admitted alike ([`unlearned`]): it admits
//! locally while `P ×` its own count fits the limit (its share, `limit / P`); so does it for a
//! key its view has stopped following, on its units since its last confirmation ([`spread`]).
//! A request that the
//! projection refuses while the store may still have room asks the store for its units
//! synchronously ([`GlobalScope::wants_ask`]: a key not learned, or one whose counts as last
//! synced leave room for the request and for 1 % of the limit): one `POST /v1/lease` entry,
//! `exact`, that takes the units `at_once` (no lease is kept), granted whole while the sliding
//! window has room for them, else not at all. The answer
//! teaches the proxy the key's counts ([`GlobalScope::learn`]), and an admitted unit is then in
//! the store already: it is never sent in a batch, nor is a read of the key (the answer gave its
//! totals).
//!
//! Invariants: a request its projection admits never asks, nor one whose key's counts as synced
//! are within 1 % of the limit (a key each proxy admits many units of per interval thus never
//! asks; one spread so thin that each proxy sees it every interval or two does, near its limit);
//! a key at its limit by that test keeps the view's projections counting
//! ([`GlobalScope::at_limit`], [`super::view::ViewEntry::contended_at`]); a request asks at most
//! once; a refused ask's answer counts nothing; with `P` unknown (no answer yet) or 1, a proxy
//! decides a key it has not learned on its own counts.
//!
//! Rationale: docs/global.md, "A key a proxy has not learned".

use super::{bucket_of, in_flight, GlobalRule, GlobalScope, VmNode};
use crate::fleet::batched::outbox::Delta;
use crate::fleet::batched::protocol::Totals;
use crate::fleet::batched::view::ViewEntry;
use crate::fleet::leased::{Ask, Grant};
use crate::fleet::protocol::Carried;
use crate::keys::fleet::FleetKey;
use crate::primitives::store::SharedStore;
use crate::primitives::time::UnixMillis;
use crate::ratelimit::remote::Remote;
use crate::ratelimit::window::{Counts, Window};
use crate::ratelimit::Probe;
use std::num::{NonZeroU32, NonZeroU64};

/// The largest fleet size a projection takes (the others' units per own unit fit 16 bits).
pub const MAX_PROXIES: u32 = 1 << 16;
/// A request that the projection refuses asks the store while the counts as synced leave room
/// for it and this fraction of the limit more (1 / 100); a key with less room than that
/// fraction is at its limit ([`GlobalScope::at_limit`]).
pub const ROOM_DIVISOR: u32 = 100;

/// What the other proxies add to the counts of a key this proxy has not learned, in a fleet of
/// `proxies`: as many units per unit of its own as there are other proxies (each admitting
/// alike), for the next 3 intervals (a projection, recomputed at every request); nothing with the
/// fleet size unknown or 1.
pub fn unlearned(proxies: u32, now: UnixMillis, interval_ms: u64) -> Remote {
    let others = proxies.min(MAX_PROXIES).saturating_sub(1);
    if others == 0 {
        return Remote::NONE;
    }
    Remote {
        per_local_q16: others.saturating_mul(1 << 16),
        projected_until: now.plus_ms(interval_ms.saturating_mul(3)),
        ..Remote::NONE
    }
}

/// A key this proxy has not synced for this many intervals (it sends nothing of it: it admits
/// little of it) is projected like a key it has not learned, on its units since its last
/// confirmation ([`spread`]).
pub const STALE_INTERVALS: u64 = 2;

/// What the other proxies add to a key this proxy has learned, last synced at `synced`: the
/// view's own projection ([`crate::fleet::batched::view`]), and, once the view of the key is
/// older than [`STALE_INTERVALS`], at least [`unlearned`]'s for the units since this proxy's part
/// was last confirmed. A key the proxy admits regularly is synced at every interval and keeps
/// the view's projection alone; a key spread thin, which its view no longer follows, does not
/// take the room its view shows on every proxy at once.
pub fn spread(remote: Remote, synced: UnixMillis, proxies: u32, now: UnixMillis, interval_ms: u64) -> Remote {
    if now.saturating_since(synced) <= interval_ms.saturating_mul(STALE_INTERVALS) {
        return remote;
    }
    let floor = unlearned(proxies, now, interval_ms);
    if floor.per_local_q16 <= remote.per_local_q16 {
        return remote;
    }
    Remote { per_local_q16: floor.per_local_q16, projected_until: remote.projected_until.max(floor.projected_until), ..remote }
}

/// Whether `totals` of a key in a window of `window_ms` leave room at `now`, under `limit`, for
/// `cost` or 1 % of the limit ([`ROOM_DIVISOR`]), whichever is more (at least one unit), and
/// `pending` units more.
fn has_room(window_ms: u64, totals: Counts, cost: u32, pending: u32, limit: NonZeroU32, now: UnixMillis) -> bool {
    let Some(window_ms) = NonZeroU64::new(window_ms) else { return false };
    let window = Window::new(window_ms);
    let need = cost.max(limit.get() / ROOM_DIVISOR).max(1).saturating_add(pending);
    window.fits(totals.plus(need), window.phase(now).elapsed_ms, limit)
}

/// One request's ask of one key: what to send, and what to learn from its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyAsk {
    /// The rule's index in the configuration.
    pub rule: usize,
    /// The rule's global side.
    pub global: GlobalRule,
    /// The key's local hash.
    pub key_hash: u64,
    /// The call's entry.
    pub ask: Ask,
    /// The key's units in this proxy's batch on its way that `ask.limit` leaves out, if any.
    pub carried: Option<Carried>,
}

/// How a key's ask ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    /// The store counted the request's units (the whole cost).
    Granted,
    /// The window had no room for them (a part granted went back as a refund).
    Refused,
    /// No answer (the store down, a timeout): decided without the store, on the proxy's own
    /// counts for a key it has not learned.
    Failed,
}

impl GlobalScope {
    /// Whether this VM's view holds `probe`'s key.
    pub fn learned(&self, node: &VmNode, probe: &Probe) -> bool {
        self.rule(probe.rule).is_some_and(|rule| node.cache.knows(rule.id, probe.key_hash))
    }

    /// Whether a request of `probe` that its rule refused asks the store (module doc): the key
    /// is not learned and the fleet has other proxies, or its counts as last synced leave room
    /// for the request and for `limit / 100`. Never for a cost over the limit.
    pub fn wants_ask(&self, node: &VmNode, probe: &Probe, limit: NonZeroU32, pending: u32, now: UnixMillis) -> bool {
        let Some(rule) = self.rule(probe.rule) else { return false };
        if probe.cost == 0 || probe.cost.saturating_add(pending) > limit.get() {
            return false;
        }
        match node.cache.totals(rule.id, probe.key_hash, bucket_of(now, rule.window_ms)) {
            None => node.proxies > 1,
            // Room for the request, and more than 1 % of the limit.
            Some(totals) => has_room(rule.window_ms, totals, probe.cost, pending, limit, now),
        }
    }

    /// Whether `entry`'s key, its fleet count as it reads at `now`, is at its rule's least limit:
    /// within 1 % of it, where a refused request does not ask.
    pub fn at_limit(&self, entry: &ViewEntry, now: UnixMillis) -> bool {
        let Some(limit) = self.least_limit_of(entry.rule).and_then(NonZeroU32::new) else { return false };
        !has_room(entry.window_ms, entry.total_at(bucket_of(now, entry.window_ms)), 0, 0, limit, now)
    }

    /// The ask of `probe`'s key for its cost under `limit`, at `now`, with `pending` units of
    /// the key this proxy admitted that the store has not counted yet (on their way in a
    /// batch): the store grants only while its room holds the request and them, so it is asked
    /// under `limit − pending`.
    /// `carried` of them travel in this proxy's batch on its way ([`in_flight`]).
    pub fn ask_for(&self, probe: &Probe, key: FleetKey, limit: NonZeroU32, pending: u32, carried: Option<Carried>, now: UnixMillis) -> Option<KeyAsk> {
        let limit = NonZeroU32::new(limit.get().saturating_sub(pending))?;
        let global = self.rule(probe.rule)?;
        let window_ms = global.window_ms.max(1);
        Some(KeyAsk {
            rule: probe.rule,
            global,
            key_hash: probe.key_hash,
            ask: Ask {
                key,
                window_ms,
                bucket: bucket_of(now, window_ms),
                elapsed_ms: now.0.checked_rem(window_ms).unwrap_or(0),
                limit: limit.get(),
                want: probe.cost,
                consumed: 0,
                returned: 0,
                returned_previous: 0,
                used: 0,
                used_previous: 0,
                grace_ms: 0,
                at_once: probe.cost,
                refunded: 0,
                refunded_previous: 0,
                call: 0,
            },
            carried,
        })
    }

    /// The ask a refusal of `probe` (its key `key`) under `limit` makes, if it asks
    /// ([`GlobalScope::wants_ask`]), with `counts` giving this proxy's count of the key in its
    /// current bucket. Its reads, in [`in_flight`]'s order: the view (refreshed into this VM's
    /// copy: another worker may have written it since this VM's tick), the counts (this proxy's
    /// units the view has not confirmed: `pending`), and when there are some, the batch on its
    /// way, the view again and the counts again. The ask names the key's units of that batch
    /// when the view read after it does not hold the batch confirmed ([`ViewCache::lacks`]);
    /// every batch before it is. A request whose counts as synced leave room only if the
    /// batch's units are in them asks too: the store tells.
    ///
    /// [`ViewCache::lacks`]: super::view::ViewCache::lacks
    #[allow(clippy::too_many_arguments)]
    pub fn ask_of<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        node: &mut VmNode,
        probe: &Probe,
        key: FleetKey,
        limit: NonZeroU32,
        counts: impl Fn(&Probe) -> u32,
        now: UnixMillis,
    ) -> Option<KeyAsk> {
        let rule = self.rule(probe.rule)?;
        let bucket = bucket_of(now, rule.window_ms);
        let pending = |node: &VmNode| counts(probe).saturating_sub(node.cache.confirmed(rule.id, probe.key_hash, bucket));
        // A refresh that fails leaves the copy as it was: its batches confirmed are still
        // confirmed, and the ask leaves more units out of its limit (the fleet admits less).
        let _ = self.refresh(store, &mut node.cache);
        let first = pending(node);
        if !self.wants_ask(node, probe, limit, 0, now) {
            return None;
        }
        let (pending, named) = if first == 0 {
            (0, None)
        } else {
            let batch = self.carried(store, probe, now);
            let _ = self.refresh(store, &mut node.cache);
            let pending = pending(node);
            let unconfirmed = batch.filter(|b| node.cache.lacks(probe.key_hash, b.source, b.seq));
            (pending, in_flight::named(unconfirmed, pending))
        };
        // Room for the request with the units that are not in the store's count yet (the named
        // ones may be).
        let unsent = pending.saturating_sub(named.map_or(0, |c| c.units));
        if !self.wants_ask(node, probe, limit, unsent, now) {
            return None;
        }
        self.ask_for(probe, key, limit, pending, named, now)
    }

    /// The units of `probe`'s key at `now` in this proxy's batch on its way ([`in_flight`]: read
    /// before the view and the counts that give the ask's `pending`).
    pub fn carried<S: SharedStore + ?Sized>(&self, store: &S, probe: &Probe, now: UnixMillis) -> Option<Carried> {
        let rule = self.rule(probe.rule)?;
        in_flight::read(store, &self.in_flight_key, (rule.id, probe.key_hash, bucket_of(now, rule.window_ms)))
    }

    /// Takes the store's answer to `asked` (`None`: the call failed): writes the key's counts
    /// into the proxy's view (a granted unit as this proxy's, confirmed), and gives back a grant
    /// short of the cost (in the next batch). Returns how the ask ended.
    pub fn learn<S: SharedStore + ?Sized>(&self, store: &S, node: &mut VmNode, asked: &KeyAsk, grant: Option<Grant>, now: UnixMillis) -> Asked {
        let Some(grant) = grant else { return Asked::Failed };
        let whole = grant.granted >= asked.ask.want;
        let delta = Delta {
            rule: asked.global.id,
            fingerprint: asked.key_hash,
            key: asked.ask.key,
            window_ms: asked.ask.window_ms,
            bucket: asked.ask.bucket,
            delta: grant.granted,
            requests: 1,
            refund: 0,
        };
        let totals = Totals { previous: u64::from(grant.counts.previous), current: u64::from(grant.counts.current) };
        self.write_totals(store, node, &[(delta, totals)], None, None, now);
        if whole {
            return Asked::Granted;
        }
        if grant.granted > 0 {
            let back = Delta { delta: 0, requests: 0, refund: grant.granted, ..delta };
            // A give-back with no room in the VM's buffer is lost: the fleet admits less.
            let _ = node.deltas.add(back);
        }
        Asked::Refused
    }
}

/// The key of an ask (for the metrics and logs).
pub fn key_of(asked: &KeyAsk) -> FleetKey {
    asked.ask.key
}
