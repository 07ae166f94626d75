//! Batched global scope: one quota across every proxy of the fleet, every decision local. Each
//! worker moves its admissions into a shared-data outbox ([`outbox`]); the proxy's one flusher
//! ([`leadership`]) sends them to `floodgate-sync` in one batch per `sync_interval` ([`protocol`])
//! and writes the fleet totals it gets back into the [`view`], which every worker copies at its
//! tick. A decision adds to the proxy's own exact counts the other proxies' counts and their
//! projections ([`crate::ratelimit::remote`]).
//!
//! Invariants: no request waits on the store; every admission reaches the store exactly once
//! (batches are sent again unchanged until confirmed, and the store applies a (source, seq) batch
//! once); projected units only weigh in decisions, never in the table, a batch or the store; with
//! the store down, decisions go on on the last view, and admissions wait in the outboxes. Quota
//! reserves are used only while the whole estimate fits. A token reservation's unused part goes
//! back to the bucket it was counted in, as a give-back beside that bucket's units
//! ([`GlobalScope::refund`]), sent and applied once like them, never below zero in the store.
//!
//! Rationale: docs/design.md, section "Batched consistency"; bounds and measurements:
//! docs/global.md.

pub mod ask;
pub mod in_flight;
pub mod leadership;
pub mod outbox;
pub mod protocol;
pub mod view;

use crate::keys::fleet::{FleetHasher, FleetKey};
use crate::config::{Config, Consistency, Scope, StoreRoute};
use crate::primitives::hash::{fnv1a, FNV1A_BASIS};
use crate::ratelimit::remote::Remote;
use crate::ratelimit::Probe;
use crate::primitives::store::{update, Attempt, SharedStore, StoreError};
use crate::primitives::time::UnixMillis;
use crate::fleet::Answer;
use leadership::{Failure, Flusher};
use outbox::{Delta, Deltas, OUTBOXES, OUTBOX_CAPACITY};
use view::{record_of, Due, ViewCache, ViewIndex, ViewRecord, REFRESH_AFTER_INTERVALS, REFRESH_FAR_AFTER_MS, REFRESH_PER_BATCH, VIEW_RECORDS};

/// Deltas a worker keeps in memory at most while its outbox is full.
pub const MAX_VM_DELTAS: usize = 4096;
/// The header of `floodgate-sync`'s answer to a batch that gives the fleet size ([`ask`]).
pub const PROXIES_HEADER: &str = "floodgate-proxies";
/// A batch with nothing but refreshes goes out at most this often (ms).
pub const REFRESH_ONLY_EVERY_MS: u64 = 1000;

/// The fleet size in the value of [`PROXIES_HEADER`] (`None`: not a number).
pub fn fleet_size(value: &[u8]) -> Option<u32> {
    std::str::from_utf8(value).ok()?.parse().ok()
}


/// What a decision adds for the other proxies of the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projection {
    /// Their counts as last synced, without projections (kept to compare against).
    AsSynced,
    /// Their counts as last synced, what the store had not seen of them yet, and their likely
    /// growth since, in proportion to this proxy's ([`view`], [`crate::ratelimit::remote`]).
    /// The default.
    Ahead,
}

/// A rule in global scope, as the global machinery needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalRule {
    /// A stable id: a hash of the rule's name (indices change with configurations).
    pub id: u64,
    /// The window.
    pub window_ms: u64,
    /// The least of the limits the rule may apply (its tiers' and overrides' included): what
    /// tells a key near its limit from one far under it ([`view::ViewCache::refreshes`]).
    pub least_limit: u32,
}

/// The global scope of one configuration, shared by reference.
#[derive(Clone, Debug)]
pub struct GlobalScope {
    /// Per rule, in configuration order: `Some` for rules in global scope.
    pub rules: Vec<Option<GlobalRule>>,
    /// The fleet-wide key hasher.
    pub hasher: FleetHasher,
    /// Where the calls to floodgate-sync go, and their credential.
    pub route: StoreRoute,
    /// The interval between syncs, ms.
    pub interval_ms: u64,
    /// A call's timeout, ms.
    pub timeout_ms: u64,
    /// Whether decisions project the other proxies' traffic since the last sync.
    pub projection: Projection,
    /// View entries per record at most.
    view_capacity: usize,
    lease_key: String,
    in_flight_key: String,
    outbox_keys: Vec<String>,
    index_key: String,
    view_keys: Vec<String>,
}

/// One worker VM's side of the global scope: its admissions not yet moved to an outbox, its
/// copy of the view, and its flusher. It lives as long as the VM, across configurations.
#[derive(Clone, Debug)]
pub struct VmNode {
    /// Admissions not yet in an outbox.
    pub deltas: Deltas,
    /// The view as last read.
    pub cache: ViewCache,
    /// The sending side (used while this VM leads, and until its last batch is confirmed).
    pub flusher: Flusher,
    /// Whether this VM held the leadership at its last tick.
    pub leading: bool,
    /// When this VM last sent a new batch.
    pub last_batch: UnixMillis,
    /// The fleet size as the store last gave it (0: not known yet).
    pub proxies: u32,
}

impl VmNode {
    /// The node of VM `vm` (its id is also its batches' source).
    pub fn new(vm: u64) -> VmNode {
        VmNode {
            deltas: Deltas::new(MAX_VM_DELTAS),
            cache: ViewCache::new(),
            flusher: Flusher::new(vm),
            leading: false,
            last_batch: UnixMillis::default(),
            proxies: 0,
        }
    }
}

/// What a tick did, for the metrics and the host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tick {
    /// A batch to send now: its request body (the host dispatches it and reports the token).
    pub send: Option<Vec<u8>>,
    /// Whether this VM leads.
    pub leading: bool,
    /// Requests dropped because their bucket ended before they could be sent.
    pub expired: u64,
    /// Requests dropped because the outboxes and the VM's buffer were full.
    pub dropped: u64,
    /// How long ago the last batch was confirmed (`None`: never).
    pub staleness_ms: Option<u64>,
    /// Counters in the batch sent.
    pub counters: usize,
    /// Host errors met (the tick went on).
    pub errors: u32,
}

impl GlobalScope {
    /// The global scope of `config` under `namespace`, if it has batched rules in global scope
    /// (leased ones are [`crate::fleet::leased`]'s).
    pub fn new(config: &Config, namespace: &str) -> Option<GlobalScope> {
        let global = config.global.as_ref()?;
        let rules: Vec<Option<GlobalRule>> = config
            .rate_limits
            .iter()
            .map(|r| {
                (r.scope == Scope::Global && r.consistency == Consistency::Batched).then(|| GlobalRule {
                    id: rule_id(r.name.as_str()),
                    window_ms: r.window.get().get(),
                    least_limit: r.limits().min().map_or(1, std::num::NonZeroU32::get),
                })
            })
            .collect();
        let count = rules.iter().flatten().count();
        if count == 0 {
            return None;
        }
        let max_keys = usize::try_from(global.max_keys.get().get()).unwrap_or(usize::MAX);
        let base = format!("floodgate/{namespace}/global");
        Some(GlobalScope {
            rules,
            hasher: FleetHasher::new(global.key_secret.as_deref()),
            route: global.route(),
            interval_ms: global.sync_interval.get().get(),
            timeout_ms: global.timeout.get().get(),
            projection: Projection::Ahead,
            view_capacity: max_keys.saturating_mul(count).div_ceil(VIEW_RECORDS).max(1),
            lease_key: format!("{base}/flusher"),
            in_flight_key: format!("{base}/in-flight"),
            outbox_keys: (0..OUTBOXES).map(|i| format!("{base}/outbox/{i}")).collect(),
            index_key: format!("{base}/view"),
            view_keys: (0..VIEW_RECORDS).map(|i| format!("{base}/view/{i}")).collect(),
        })
    }

    /// The least limit of the rule of id `id`, if it is in global scope.
    fn least_limit_of(&self, id: u64) -> Option<u32> {
        self.rules.iter().flatten().find(|r| r.id == id).map(|r| r.least_limit)
    }

    /// Rule `rule`'s global side, if it is in global scope.
    pub fn rule(&self, rule: usize) -> Option<GlobalRule> {
        self.rules.get(rule).copied().flatten()
    }

    /// What the other proxies add to the counts of the probes' keys, by rule (what the local
    /// limiter decides on: [`crate::ratelimit::Limiter::check`]), from the VM's view: nothing
    /// for a rule not in global scope.
    pub fn remotes(&self, node: &VmNode, probes: &[Probe], now: UnixMillis) -> Vec<Remote> {
        let mut remotes = vec![Remote::NONE; self.rules.len()];
        for probe in probes {
            if let Some(remote) = remotes.get_mut(probe.rule) {
                *remote = self.remote_of(node, probe, now);
            }
        }
        remotes
    }

    /// What the other proxies add to the counts of `probe`'s key, from the VM's view (nothing
    /// for a rule not in global scope).
    pub fn remote_of(&self, node: &VmNode, probe: &Probe, now: UnixMillis) -> Remote {
        let Some(rule) = self.rule(probe.rule) else { return Remote::NONE };
        let bucket = bucket_of(now, rule.window_ms);
        match self.projection {
            Projection::AsSynced => Remote { synced: node.cache.remote(rule.id, probe.key_hash, bucket), ..Remote::NONE },
            // A key not learned yet: the others admit alike ([`ask`]).
            Projection::Ahead => match node.cache.shared_known(rule.id, probe.key_hash, bucket, now, self.interval_ms) {
                Some((remote, synced)) => ask::spread(remote, synced, node.proxies, now, self.interval_ms),
                None => ask::unlearned(node.proxies, now, self.interval_ms),
            },
        }
    }

    /// Counts `cost` units admitted for the fleet, and `requests` requests decided (1 when a
    /// request was decided, 0 for a cost charged later), of `probe`'s key (`key`, its
    /// fleet-wide id), if its rule is in global scope. A refused request (`cost` 0) asks for the
    /// key's fleet-wide count all the same, and counts as demand.
    pub fn count(&self, node: &mut VmNode, probe: &Probe, key: FleetKey, now: UnixMillis, cost: u32, requests: u32) -> u64 {
        let Some(rule) = self.rule(probe.rule) else { return 0 };
        let delta = Delta {
            rule: rule.id,
            fingerprint: probe.key_hash,
            key,
            window_ms: rule.window_ms,
            bucket: bucket_of(now, rule.window_ms),
            delta: cost,
            requests,
            refund: 0,
        };
        if node.deltas.add(delta) {
            0
        } else {
            u64::from(cost)
        }
    }

    /// Gives back `units` of a reservation admitted at `admitted_at` (settled below its
    /// estimate) to the fleet-wide count of the bucket they were counted in. A give-back of a
    /// bucket the store no longer weighs (ended more than a bucket ago) is dropped: it no
    /// longer matters. Returns the units dropped for want of room.
    pub fn refund(&self, node: &mut VmNode, probe: &Probe, key: FleetKey, units: u32, admitted_at: UnixMillis, now: UnixMillis) -> u64 {
        let Some(rule) = self.rule(probe.rule) else { return 0 };
        let bucket = bucket_of(admitted_at, rule.window_ms);
        if units == 0 || bucket.saturating_add(1) < bucket_of(now, rule.window_ms) {
            return 0;
        }
        let delta = Delta { rule: rule.id, fingerprint: probe.key_hash, key, window_ms: rule.window_ms, bucket, delta: 0, requests: 0, refund: units };
        if node.deltas.add(delta) {
            0
        } else {
            u64::from(units)
        }
    }

    /// Once per `sync_interval` on every worker: moves the VM's deltas to its outbox, refreshes
    /// its view, and, on the leader, takes the outboxes into a batch to send (or sends the
    /// unconfirmed batch again).
    pub fn tick<S: SharedStore + ?Sized>(&self, store: &S, node: &mut VmNode, vm: u64, now: UnixMillis) -> Tick {
        let mut tick = Tick { expired: node.deltas.drop_expired(|w| bucket_of(now, w)), ..Tick::default() };
        node.leading = leadership::lead(store, &self.lease_key, vm, now, self.interval_ms).unwrap_or(false);
        tick.leading = node.leading;
        // A VM that lost the leadership still finishes its unconfirmed batch (module doc).
        let sends = (node.leading || node.flusher.pending().is_some()) && !node.flusher.busy(now, self.timeout_ms);
        // The leader's own admissions go straight into its next batch, not through its outbox.
        let keeps_own = node.leading && sends && node.flusher.pending().is_none();
        let outbox = self.outbox_keys.get(usize::try_from(vm % OUTBOXES).unwrap_or(0));
        if let Some(key) = outbox.filter(|_| !keeps_own && !node.deltas.is_empty()) {
            if self.move_to_outbox(store, key, &mut node.deltas).is_err() {
                tick.errors = tick.errors.saturating_add(1);
            }
        }
        if self.refresh(store, &mut node.cache).is_err() {
            tick.errors = tick.errors.saturating_add(1);
        }
        node.proxies = node.cache.index.proxies;
        tick.staleness_ms = node.cache.index.last_success.map(|t| now.saturating_since(t));
        if sends {
            let leading = node.leading;
            let source = node.flusher.source;
            let refresh_cache = &node.cache;
            let own = &mut node.deltas;
            let last_batch = node.last_batch;
            let mut fresh = false;
            let mut take_errors = 0u32;
            let batch = node.flusher.next_batch(|| {
                if !leading {
                    return None;
                }
                let (deltas, errors) = self.take_outboxes(store);
                take_errors = errors;
                let mut merged = Deltas::new(usize::MAX);
                merged.absorb(deltas);
                merged.absorb(own.take());
                merged.drop_expired(|w| bucket_of(now, w));
                // A batch of refreshes alone goes out at most once a second.
                if merged.is_empty() && now.saturating_since(last_batch) < REFRESH_ONLY_EVERY_MS {
                    return None;
                }
                fresh = true;
                let before = |ms: u64| UnixMillis(now.0.saturating_sub(ms));
                let near = REFRESH_AFTER_INTERVALS.saturating_mul(self.interval_ms);
                let due = Due { near: before(near), far: before(near.max(REFRESH_FAR_AFTER_MS)) };
                merged.absorb(refresh_cache.refreshes(now, due, REFRESH_PER_BATCH, |rule| self.least_limit_of(rule)));
                // Possibly empty: a proxy calls in at least once a second, so the store counts
                // it in the fleet size.
                Some(merged.take())
            });
            tick.errors = tick.errors.saturating_add(take_errors);
            if fresh && batch.is_some() {
                node.last_batch = now;
            }
            if let Some(batch) = batch {
                tick.counters = batch.deltas.len();
                tick.send = Some(batch.body(source));
                // What an ask of a key in it names ([`in_flight`]); without it, an ask only
                // leaves the batch's units out of its limit.
                if fresh && in_flight::carries_units(batch) && in_flight::publish(store, &self.in_flight_key, source, batch).is_err() {
                    tick.errors = tick.errors.saturating_add(1);
                }
            }
        }
        tick
    }

    /// Takes the answer to a batch call: on success, writes the totals into the view and returns
    /// how many counters were confirmed.
    pub fn answered<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        node: &mut VmNode,
        token: u32,
        answer: Answer,
        proxies: Option<u32>,
        now: UnixMillis,
    ) -> Result<usize, Failure> {
        let (batch, totals) = node.flusher.answered(token, answer)?;
        // Every worker reads the fleet size with the view's index at its next tick.
        let proxies = proxies.filter(|p| *p > 0);
        if let Some(proxies) = proxies {
            node.proxies = proxies;
        }
        let pairs: Vec<(Delta, protocol::Totals)> = batch.deltas.iter().copied().zip(totals).collect();
        let source = node.flusher.source;
        self.write_totals(store, node, &pairs, proxies, Some((source, batch.seq)), now);
        // Once the view holds the batch, marked confirmed ([`in_flight`]'s order): an ask that
        // still finds the record finds the batch confirmed in the view it reads next. A record
        // left (a host error) is only read, never named.
        if in_flight::carries_units(&batch) {
            let _ = in_flight::clear(store, &self.in_flight_key);
        }
        Ok(batch.deltas.len())
    }

    /// Writes the fleet totals the store answered for `pairs` (a batch's, or an ask's) into
    /// the proxy's view, and into this VM's copy; each record written takes `batch` (source,
    /// seq: the batch answered) as its last batch confirmed.
    fn write_totals<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        node: &mut VmNode,
        pairs: &[(Delta, protocol::Totals)],
        proxies: Option<u32>,
        batch: Option<(u64, u64)>,
        now: UnixMillis,
    ) {
        let mut by_record: Vec<Vec<(Delta, protocol::Totals)>> = vec![Vec::new(); VIEW_RECORDS];
        let mut pairs = pairs.to_vec();
        pairs.sort_by_key(|(d, _)| d.bucket);
        for (delta, totals) in pairs {
            if let Some(list) = by_record.get_mut(record_of(delta.fingerprint)) {
                list.push((delta, totals));
            }
        }
        let mut written = Vec::new();
        for (i, list) in by_record.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let Some(key) = self.view_keys.get(i) else { continue };
            if let Ok(record) = self.update_record(store, key, list, batch, now) {
                written.push((i, record));
            }
        }
        let indices: Vec<usize> = written.iter().map(|(i, _)| *i).collect();
        if let Some((before, after)) = self.bump_index(store, &indices, proxies, now) {
            // This VM's copy takes the records it wrote, saving their reads at its next tick:
            // each one whose version nobody else moved since this VM last read it.
            for (i, record) in written {
                node.cache.took_own_write(i, record, &before, &after);
            }
        }
    }

    fn move_to_outbox<S: SharedStore + ?Sized>(&self, store: &S, key: &str, deltas: &mut Deltas) -> Result<(), StoreError> {
        let left = update(store, key, |current| {
            let mut outbox = current
                .and_then(|s| Deltas::decode(&s.value, OUTBOX_CAPACITY).ok())
                .unwrap_or_else(|| Deltas::new(OUTBOX_CAPACITY));
            let left = outbox.absorb(deltas.iter().copied());
            Attempt::Write(outbox.encode(), left)
        })?;
        // What the outbox had no room for stays in the VM.
        deltas.take();
        deltas.absorb(left);
        Ok(())
    }

    /// Takes every outbox's deltas, leaving them empty; returns them and the host errors met.
    fn take_outboxes<S: SharedStore + ?Sized>(&self, store: &S) -> (Vec<Delta>, u32) {
        let mut taken = Vec::new();
        let mut errors = 0u32;
        for key in &self.outbox_keys {
            let emptied = update(store, key, |current| match current.filter(|s| !s.value.is_empty()) {
                None => Attempt::Done(None),
                // An unreadable outbox is emptied all the same (nothing in it can be trusted).
                Some(current) => Attempt::Write(Vec::new(), Some(Deltas::decode(&current.value, OUTBOX_CAPACITY).unwrap_or_default())),
            });
            match emptied {
                Ok(Some(outbox)) => taken.extend(outbox.iter().copied()),
                Ok(None) | Err(StoreError::CasMismatch) => {}
                Err(StoreError::Host(_)) => errors = errors.saturating_add(1),
            }
        }
        (taken, errors)
    }

    /// Reads into this VM's copy of the view the records another VM wrote since (a tick's work;
    /// an ask's too, whose units must be weighed against the proxy's latest confirmed part).
    pub fn refresh<S: SharedStore + ?Sized>(&self, store: &S, cache: &mut ViewCache) -> Result<(), StoreError> {
        let index = store
            .get(&self.index_key)?
            .and_then(|s| ViewIndex::decode(&s.value).ok())
            .unwrap_or_default();
        for i in cache.stale(&index) {
            let Some(key) = self.view_keys.get(i) else { continue };
            let record = store
                .get(key)?
                .and_then(|s| ViewRecord::decode(&s.value).ok())
                .unwrap_or_default();
            cache.store(i, record);
        }
        cache.adopt(index);
        Ok(())
    }

    fn update_record<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        key: &str,
        list: &[(Delta, protocol::Totals)],
        batch: Option<(u64, u64)>,
        now: UnixMillis,
    ) -> Result<ViewRecord, StoreError> {
        update(store, key, |current| {
            let mut record = current.and_then(|s| ViewRecord::decode(&s.value).ok()).unwrap_or_default();
            record.apply_batch(list, now, self.view_capacity, |entry| self.at_limit(entry, now));
            if let Some((source, seq)) = batch {
                record.confirmed.take(source, seq);
            }
            Attempt::Write(record.encode(), record)
        })
    }

    /// Moves the versions of the records `written` and the time of the last success; returns
    /// the index as read and as written.
    fn bump_index<S: SharedStore + ?Sized>(&self, store: &S, written: &[usize], proxies: Option<u32>, now: UnixMillis) -> Option<(ViewIndex, ViewIndex)> {
        update(store, &self.index_key, |current| {
            let before = current.and_then(|s| ViewIndex::decode(&s.value).ok()).unwrap_or_default();
            let mut index = before;
            for &i in written {
                if let Some(v) = index.versions.get_mut(i) {
                    *v = v.wrapping_add(1);
                }
            }
            index.last_success = Some(now);
            if let Some(proxies) = proxies {
                index.proxies = proxies;
            }
            Attempt::Write(index.encode(), (before, index))
        })
        .ok()
    }
}

/// The window bucket of `now` for a window of `window_ms`.
pub fn bucket_of(now: UnixMillis, window_ms: u64) -> u64 {
    now.0.checked_div(window_ms).unwrap_or(0)
}

/// A rule's stable id: FNV-1a of its name.
pub fn rule_id(name: &str) -> u64 {
    fnv1a(name.as_bytes(), FNV1A_BASIS)
}

#[cfg(test)]
mod tests;
