//! Cluster selection, shared by every worker of the proxy: the "success-prioritized,
//! concurrency-limited stochastic fallback cascade". Per request, each cluster's success rate
//! ([`buckets`]) gives its weight, `rate^exponent` (cubed by default; the no-data floor bounds the
//! weight unless `no_data_floor_on: "rate"`); an exact weighted [`shuffle`] orders the clusters;
//! the request takes a permit on the first whose proxy-wide in-flight count is below its [`limit`]
//! (a compare-and-swap on its [`record`]), or fails fast. At the stream's end its [`grade`] is
//! counted, the limit moves (AIMD) and the permit goes back.
//!
//! Invariants: a cluster's in-flight count is exact across workers, like the shedder's
//! ([`crate::primitives::inflight`]: reserves, heartbeats, a dead VM's entries expiring after
//! [`crate::primitives::inflight::STALE_AFTER_MS`]). Successes wait in the VM's pending tally
//! ([`Pending`]) until its next write to the record, at most a heartbeat; a failure, a timeout or a
//! slow response is written at once, so the weight and the limit react within the request.
//!
//! Rationale: docs/design.md, section "Cluster selection".

pub mod buckets;
pub mod limit;
pub mod grade;
pub mod partition;
pub mod record;
pub mod shuffle;

#[cfg(test)]
mod tests;

use crate::config::{ClusterName, ClusterSelection, FloorOn, StatusMatch};
use crate::primitives::inflight::{in_flight_units, Permit, LocalCount};
use crate::primitives::store::{update, update_from, Attempt, SharedStore, StoreError, Stored, MAX_ATTEMPTS};
use crate::primitives::time::MonoMillis;
use buckets::{Basis, Tally};
use limit::{Aimd, Sample};
use grade::{Ending, Grade};
use record::ClusterRecord;
use crate::primitives::hash::Random;
use shuffle::weighted_shuffle;

/// How long a VM reuses a cluster's weight it computed from a record it read, instead of reading
/// the record again just to weigh it. The chosen cluster's record is always read afresh for its
/// permit, and every read (permit, finish, heartbeat) refreshes the weight, so under load a weight
/// is rarely older than a few requests; idle clusters are re-read after this long.
pub const WEIGHT_TTL_MS: u64 = 100;

/// One configured cluster.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// The Envoy cluster name (the route header's value).
    pub name: ClusterName,
    key: String,
}

/// The cluster selection of one filter configuration.
#[derive(Clone, Debug)]
pub struct Selector {
    /// The clusters, in configuration order.
    pub clusters: Vec<Cluster>,
    /// The request header the route reads with `cluster_header`.
    pub route_header: String,
    /// `retry-after` of the 503 when no cluster has room, in seconds.
    pub retry_after_secs: u64,
    bucket_width_ms: u64,
    bucket_count: usize,
    decay_factor: f64,
    weight_exponent: f64,
    /// `no_data_floor / clusters`.
    sticky_floor: f64,
    floor_on_weight: bool,
    failure_statuses: Vec<StatusMatch>,
    limit: Aimd,
    /// Every cluster's index: the one tier of a request that may use them all.
    all: Vec<usize>,
}

/// A permit on one unit of a cluster's concurrency limit, held from selection to the end of the
/// stream and released exactly once by [`Selector::finish`] (or, should the stream vanish, by
/// `Drop`, which lowers the local count for the next heartbeat to publish).
#[derive(Debug)]
#[must_use = "a chosen cluster's permit must be finished when the stream ends"]
pub struct ClusterPermit {
    /// Index of the chosen cluster.
    pub cluster: usize,
    /// When it was taken.
    pub started: MonoMillis,
    /// The cluster's proxy-wide in-flight count with this permit.
    pub in_flight: u32,
    unit: Permit,
}

/// When a stream's milestones happened on the monotonic clock, as the shell saw them: what
/// the upstream's latency is measured on (see [`grade`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timing {
    /// The request's last byte passed the filter (`None`: it had not, or never did, as for an
    /// upgraded connection).
    pub request_end: Option<MonoMillis>,
    /// The response headers passed the filter (`None`: none came, or they were the filter's
    /// own reply).
    pub response_headers: Option<MonoMillis>,
}

impl Timing {
    /// Milliseconds from the end of the request (or `started`, the permit, when the response
    /// came first) to the response headers; `None` without response headers.
    pub fn upstream_latency_ms(&self, started: MonoMillis) -> Option<u64> {
        let headers = self.response_headers?;
        let from = self
            .request_end
            .filter(|end| *end <= headers)
            .map_or(started, |end| end.max(started));
        Some(headers.saturating_since(from))
    }
}

/// No cluster had room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exhausted {
    /// Per cluster, in configuration order: in-flight count and limit as last seen
    /// (`None` when the record could not be read).
    pub clusters: Vec<Option<(u32, u32)>>,
    /// True when some cluster may have had room but its record could not be updated.
    pub contention: bool,
}

/// The clusters a request may use when its key is confined to a partition
/// ([`crate::selection::partition::Partitioner`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Confinement {
    /// The partition's clusters (indexes).
    pub members: Vec<usize>,
    /// The other clusters.
    pub others: Vec<usize>,
    /// `None`: the request stays within its members (`503` when none has room). `Some(rate)`:
    /// it spills over to the others when every member is full, and tries them first when every
    /// member's success rate is below `rate`.
    pub spill_below: Option<f64>,
}

/// What ending a permit did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Finished {
    /// Index of the cluster.
    pub cluster: usize,
    /// How the request counted.
    pub grade: Grade,
    /// False when the record could not be updated (the stats and limit move were lost; the
    /// permit itself is released regardless).
    pub recorded: bool,
}

/// A cluster's state as the gauges show it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClusterState {
    /// The current success rate.
    pub success_rate: f64,
    /// The current concurrency limit.
    pub limit: u32,
    /// Permits held proxy-wide.
    pub in_flight: u32,
}

/// What this VM last computed of each cluster's weight, and when: lets [`Selector::choose`]
/// skip reading every cluster's record on every request (see [`WEIGHT_TTL_MS`]).
#[derive(Clone, Debug, Default)]
pub struct Sightings {
    weights: Vec<Option<(f64, MonoMillis)>>,
}

impl Sightings {
    fn fresh(&self, index: usize, now: MonoMillis) -> Option<f64> {
        let (weight, at) = (*self.weights.get(index)?)?;
        (now.saturating_since(at) < WEIGHT_TTL_MS && at <= now).then_some(weight)
    }

    fn note(&mut self, index: usize, weight: f64, now: MonoMillis) {
        if self.weights.len() <= index {
            self.weights.resize(index.saturating_add(1), None);
        }
        if let Some(slot) = self.weights.get_mut(index) {
            *slot = Some((weight, now));
        }
    }
}

/// Grades this VM counted for one cluster and has not yet written to its record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    /// Per bucket epoch, oldest first.
    tallies: Vec<(u64, Tally)>,
    /// Successes that each raise the limit by one (AIMD) when written.
    grows: u32,
    /// The cluster's limit as this VM last read it.
    limit_seen: u32,
}

impl Pending {
    fn count(&mut self, epoch: u64, succeeded: bool, buckets: usize) {
        if self.tallies.last().map(|(last, _)| *last) != Some(epoch) {
            if self.tallies.len() >= buckets {
                self.tallies.remove(0);
            }
            self.tallies.push((epoch, Tally::default()));
        }
        if let Some((_, tally)) = self.tallies.last_mut() {
            tally.finished = tally.finished.saturating_add(1);
            tally.succeeded = tally.succeeded.saturating_add(u32::from(succeeded));
        }
    }

    /// Whether there is anything to write.
    pub fn is_empty(&self) -> bool {
        self.tallies.is_empty() && self.grows == 0
    }

    /// Requests counted and not yet written.
    pub fn finished(&self) -> u32 {
        self.tallies
            .iter()
            .fold(0u32, |sum, (_, t)| sum.saturating_add(t.finished))
    }
}

/// One VM's side of cluster selection: its id in the records, its permit count per cluster
/// (configuration order; the truth that the records mirror), its pending grades and its recent
/// weights.
#[derive(Clone, Debug)]
pub struct VmState {
    /// The VM's random id.
    pub vm: u64,
    /// Permits held by this VM, per cluster.
    pub permits: Vec<LocalCount>,
    /// Grades not yet written, per cluster.
    pub pending: Vec<Pending>,
    /// Recent weights.
    pub seen: Sightings,
    /// Buffers a choice fills and empties, kept from one request to the next.
    scratch: Scratch,
}

/// The weights and the order of a choice, reused across requests.
#[derive(Clone, Debug, Default)]
struct Scratch {
    weights: Vec<f64>,
    order: Vec<usize>,
}

impl VmState {
    /// The state of VM `vm` with the given permit counts.
    pub fn new(vm: u64, permits: Vec<LocalCount>) -> VmState {
        let pending = vec![Pending::default(); permits.len()];
        VmState {
            vm,
            permits,
            pending,
            seen: Sightings::default(),
            scratch: Scratch::default(),
        }
    }
}

/// A record as read: the stored bytes' token and the decoded, aged record.
struct View {
    stored: Option<Stored>,
    record: ClusterRecord,
}

impl Selector {
    /// The selector of `config`, its records under `namespace`.
    pub fn new(config: &ClusterSelection, namespace: &str) -> Selector {
        let width = config.bucket_width.get().get();
        let count = config.buckets.get().get();
        let clusters = config
            .clusters
            .iter()
            .map(|name| Cluster {
                key: format!("floodgate/{namespace}/cluster/{name}/{count}x{width}ms"),
                name: name.clone(),
            })
            .collect::<Vec<_>>();
        #[allow(clippy::cast_precision_loss)]
        let sticky_floor = config.no_data_floor / clusters.len().max(1) as f64;
        Selector {
            route_header: config.route_header.clone(),
            retry_after_secs: config.retry_after.ceil_secs().max(1),
            bucket_width_ms: width,
            bucket_count: usize::try_from(count).unwrap_or(1),
            decay_factor: config.decay_factor,
            weight_exponent: config.weight_exponent,
            sticky_floor,
            floor_on_weight: config.no_data_floor_on == FloorOn::Weight,
            failure_statuses: config.failure_statuses.clone(),
            limit: Aimd::new(&config.concurrency_limit),
            all: (0..clusters.len()).collect(),
            clusters,
        }
    }

    /// The shared-data key of cluster `index`'s record (one per cluster and bucket layout).
    pub fn record_key(&self, index: usize) -> Option<&str> {
        self.clusters.get(index).map(|c| c.key.as_str())
    }

    /// The concurrency-limit parameters.
    pub fn limit(&self) -> &Aimd {
        &self.limit
    }

    fn epoch(&self, now: MonoMillis) -> u64 {
        now.0.checked_div(self.bucket_width_ms).unwrap_or(0)
    }

    /// Reads cluster `index`'s record, aged to `now`; a missing or malformed record reads as a
    /// fresh one (and is replaced at the next write).
    fn read<S: SharedStore + ?Sized>(&self, store: &S, index: usize, now: MonoMillis) -> Result<View, StoreError> {
        let key = self.record_key(index).ok_or(StoreError::Host(0))?;
        let stored = store.get(key)?;
        let record = self.record_of(stored.as_ref(), now);
        Ok(View { stored, record })
    }

    /// A record as read (`None`: absent), aged to `now`; a missing or malformed one is a fresh
    /// one.
    fn record_of(&self, stored: Option<&Stored>, now: MonoMillis) -> ClusterRecord {
        let epoch = self.epoch(now);
        let mut record = stored
            .and_then(|s| ClusterRecord::decode(&s.value, self.bucket_count).ok())
            .unwrap_or_else(|| ClusterRecord::new(self.bucket_count, epoch, self.limit.initial));
        record.buckets.advance_to(epoch);
        record.limit = self.limit.clamp(record.limit);
        record
    }

    /// The success rate of a record.
    pub fn success_rate(&self, record: &ClusterRecord) -> f64 {
        record.buckets.success_rate(self.decay_factor, self.sticky_floor)
    }

    /// The shuffle weight of a success rate: `rate ^ weight_exponent`.
    pub fn weight(&self, success_rate: f64) -> f64 {
        success_rate.powf(self.weight_exponent)
    }

    /// A record's shuffle weight: `rate ^ weight_exponent`, and, when the rate comes from the
    /// sticky bucket only, at least `no_data_floor / clusters` unless the floor is configured to
    /// bound the rate only (see `no_data_floor_on`).
    pub fn record_weight(&self, record: &ClusterRecord) -> f64 {
        let weight = self.weight(self.success_rate(record));
        if self.floor_on_weight && record.buckets.basis() == Basis::Sticky {
            weight.max(self.sticky_floor)
        } else {
            weight
        }
    }

    /// Writes `pending` into a record read for a write: tallies into their buckets, limit moves.
    fn apply(&self, record: &mut ClusterRecord, pending: &Pending) {
        for (epoch, tally) in &pending.tallies {
            record.buckets.add(*epoch, *tally);
        }
        record.limit = self.limit.clamp(record.limit.saturating_add(pending.grows));
    }

    /// Chooses the cluster of a request among all the clusters and takes a permit on it (module
    /// doc, steps 1 to 4).
    pub fn choose<S: SharedStore + ?Sized, R: Random + ?Sized>(
        &self,
        store: &S,
        state: &mut VmState,
        now: MonoMillis,
        rng: &mut R,
    ) -> Result<ClusterPermit, Exhausted> {
        self.walk_tiers(store, state, now, rng, &[&self.all], Vec::new())
    }

    /// Chooses the cluster of a request confined to a partition ([`crate::shedding::per_key`]): the same
    /// steps within its members; with `spill`, then among the other clusters (first, when
    /// every member is failing).
    pub fn choose_within<S: SharedStore + ?Sized, R: Random + ?Sized>(
        &self,
        store: &S,
        state: &mut VmState,
        now: MonoMillis,
        rng: &mut R,
        confinement: &Confinement,
    ) -> Result<ClusterPermit, Exhausted> {
        let Some(spill_below) = confinement.spill_below else {
            return self.walk_tiers(store, state, now, rng, &[&confinement.members], Vec::new());
        };
        let mut views = Vec::new();
        let failing_weight = self.weight(spill_below);
        let mut weights = std::mem::take(&mut state.scratch.weights);
        self.weigh(store, state, &mut views, &confinement.members, now, &mut weights);
        let healthy = weights.iter().any(|weight| *weight >= failing_weight);
        state.scratch.weights = weights;
        let tiers: [&[usize]; 2] = if healthy {
            [&confinement.members, &confinement.others]
        } else {
            [&confinement.others, &confinement.members]
        };
        self.walk_tiers(store, state, now, rng, &tiers, views)
    }

    /// Cluster `index`'s slot in `views` (which holds none until a record is read, then one
    /// per cluster).
    fn view_slot<'v>(&self, views: &'v mut Vec<Option<View>>, index: usize) -> Option<&'v mut Option<View>> {
        if views.len() <= index {
            views.resize_with(self.clusters.len(), || None);
        }
        views.get_mut(index)
    }

    /// The weights of clusters `indices`, into `weights`: recent ones reused
    /// ([`WEIGHT_TTL_MS`]), the others from their records, read into `views`.
    fn weigh<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        state: &mut VmState,
        views: &mut Vec<Option<View>>,
        indices: &[usize],
        now: MonoMillis,
        weights: &mut Vec<f64>,
    ) {
        let VmState { vm, permits: locals, pending, seen, .. } = state;
        let vm = *vm;
        weights.clear();
        weights.extend(indices.iter().map(|&index| {
                if let Some(weight) = seen.fresh(index, now) {
                    return weight;
                }
                let Some(slot) = self.view_slot(views, index) else { return 0.0 };
                if slot.is_none() {
                    *slot = self.read(store, index, now).ok();
                }
                let weight = slot.as_ref().map_or(0.0, |v| self.record_weight(&v.record));
                if let (Some(view), Some(p), Some(local)) = (slot.as_ref(), pending.get_mut(index), locals.get(index)) {
                    // What a permit from the reserve is checked against (`take_reserved`).
                    p.limit_seen = view.record.limit;
                    local.saw(view.record.in_flight.others(vm, now));
                }
                seen.note(index, weight, now);
                weight
            }));
    }

    /// Walks each tier in weighted random order and takes the first permit with room.
    fn walk_tiers<S: SharedStore + ?Sized, R: Random + ?Sized>(
        &self,
        store: &S,
        state: &mut VmState,
        now: MonoMillis,
        rng: &mut R,
        tiers: &[&[usize]],
        mut views: Vec<Option<View>>,
    ) -> Result<ClusterPermit, Exhausted> {
        let Scratch { mut weights, mut order } = std::mem::take(&mut state.scratch);
        let chosen = 'walk: {
            let mut contention = false;
            for tier in tiers {
                self.weigh(store, state, &mut views, tier, now, &mut weights);
                weighted_shuffle(&weights, rng, &mut order);
                let VmState { vm, permits: locals, pending, seen, .. } = &mut *state;
                let vm = *vm;
                for &position in order.iter() {
                    let Some(&index) = tier.get(position) else { continue };
                    let (Some(local), Some(p)) = (locals.get(index), pending.get_mut(index)) else {
                        continue;
                    };
                    if local.take_reserved(p.limit_seen) {
                        break 'walk Ok(ClusterPermit {
                            cluster: index,
                            started: now,
                            in_flight: local.others().saturating_add(local.in_use()),
                            unit: Permit::taken(local),
                        });
                    }
                    let Some(slot) = self.view_slot(&mut views, index) else { continue };
                    if slot.is_none() {
                        *slot = self.read(store, index, now).ok();
                    }
                    let taken = self.try_permit(store, index, slot, vm, local, p, now);
                    if let Some(view) = slot.as_ref() {
                        seen.note(index, self.record_weight(&view.record), now);
                    }
                    match taken {
                        Ok(Some(permit)) => break 'walk Ok(permit),
                        Ok(None) => {}
                        Err(()) => contention = true,
                    }
                }
            }
            let (vm, locals) = (state.vm, &state.permits);
            let clusters = locals
                .iter()
                .enumerate()
                .map(|(index, local)| {
                    let view = views.get(index).and_then(Option::as_ref);
                    view.map(|v| (v.record.in_flight.others(vm, now).saturating_add(local.in_use()), v.record.limit))
                })
                .collect();
            Err(Exhausted { clusters, contention })
        };
        state.scratch = Scratch { weights, order };
        chosen
    }

    /// Takes a permit on cluster `index` if it has room, writing the VM's pending grades and,
    /// far below the limit, a reserve in the same compare-and-swap: `Ok(None)` when it is full,
    /// `Err` when its record could not be updated.
    #[allow(clippy::too_many_arguments)]
    fn try_permit<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        index: usize,
        slot: &mut Option<View>,
        vm: u64,
        local: &LocalCount,
        pending: &mut Pending,
        now: MonoMillis,
    ) -> Result<Option<ClusterPermit>, ()> {
        let key = self.record_key(index).ok_or(())?;
        let View { stored, record } = slot.as_mut().ok_or(())?;
        // The first attempt decides on the record in `slot`, a later one on the record read again.
        let mut fresh = false;
        let taken = update_from(store, key, stored, MAX_ATTEMPTS, |current| {
            if fresh {
                *record = self.record_of(current, now);
            }
            fresh = true;
            self.apply(record, pending);
            pending.limit_seen = record.limit;
            let mine = local.in_use();
            let others = record.in_flight.others(vm, now);
            let in_flight = others.saturating_add(mine);
            if in_flight >= record.limit {
                return Attempt::Done(Ok(None));
            }
            let other_vms = record.in_flight.other_vms(vm, now);
            let wanted = in_flight_units(mine.saturating_add(1), others, other_vms, record.limit);
            if !record.in_flight.publish(vm, wanted, now) {
                return Attempt::Done(Err(()));
            }
            Attempt::Write(record.encode(), Ok(Some((wanted, others, in_flight, record.limit))))
        });
        match taken {
            Ok(Ok(Some((wanted, others, in_flight, limit)))) => {
                *pending = Pending {
                    limit_seen: limit,
                    ..Pending::default()
                };
                local.admitted(wanted, others);
                Ok(Some(ClusterPermit {
                    cluster: index,
                    started: now,
                    in_flight: in_flight.saturating_add(1),
                    unit: Permit::taken(local),
                }))
            }
            Ok(Ok(None)) => Ok(None),
            Ok(Err(())) | Err(StoreError::Host(_)) => Err(()),
            Err(StoreError::CasMismatch) => {
                // Every race lost: the record as it is now, for the weight and the answer.
                *slot = self.read(store, index, now).ok();
                Err(())
            }
        }
    }

    /// Classifies how a stream ended, given when its milestones happened ([`Timing`]).
    pub fn classify(&self, permit: &ClusterPermit, status: Option<u16>, flags: u64, timing: Timing) -> Grade {
        let ending = Ending {
            status,
            flags,
            latency_ms: timing.upstream_latency_ms(permit.started),
        };
        Grade::classify(&ending, &self.failure_statuses, self.limit.timeout_ms)
    }

    /// Ends a permit with its grade (module doc, step 5): the permit is released whatever
    /// happens. A success is counted locally; a failure, a timeout or a slow response, or a
    /// release that gives units back (see [`crate::primitives::inflight::Local::idle_surplus`]), writes
    /// everything pending at once.
    pub fn finish<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        state: &mut VmState,
        mut permit: ClusterPermit,
        grade: Grade,
        now: MonoMillis,
    ) -> Finished {
        let VmState {
            vm,
            permits: locals,
            pending,
            seen,
            ..
        } = state;
        let vm = *vm;
        permit.unit.end();
        let index = permit.cluster;
        let mut finished = Finished {
            cluster: index,
            grade,
            recorded: false,
        };
        let (Some(key), Some(local), Some(p)) = (
            self.record_key(index),
            locals.get(index),
            pending.get_mut(index),
        ) else {
            return finished;
        };
        if let Some(succeeded) = grade.tally() {
            p.count(self.epoch(now), succeeded, self.bucket_count);
        }
        let sample = grade.sample();
        if sample == Sample::Success
            && self.limit.update(p.limit_seen, permit.in_flight, sample) > p.limit_seen
        {
            p.grows = p.grows.saturating_add(1);
        }
        let urgent = grade.tally() == Some(false) || sample == Sample::Dropped;
        if !urgent && !local.idle_surplus() {
            finished.recorded = true;
            return finished;
        }
        let written = update(store, key, |current| {
            let mut record = self.record_of(current, now);
            self.apply(&mut record, p);
            if sample == Sample::Dropped {
                record.limit = self.limit.update(record.limit, permit.in_flight, sample);
            }
            let others = record.in_flight.others(vm, now);
            // Lowering is safe before the write lands: the record holds at least as much.
            local.published(local.in_use(), others);
            record.in_flight.publish(vm, local.in_use(), now);
            Attempt::Write(record.encode(), record)
        });
        if let Ok(record) = written {
            finished.recorded = true;
            *p = Pending {
                limit_seen: record.limit,
                ..Pending::default()
            };
            seen.note(index, self.record_weight(&record), now);
        }
        finished
    }

    /// Each cluster's state as this VM sees it now, read without writing anything (the health
    /// endpoint's dependency view); `None` for a record that could not be read.
    pub fn states<S: SharedStore + ?Sized>(&self, store: &S, state: &VmState, now: MonoMillis) -> Vec<Option<ClusterState>> {
        (0..self.clusters.len())
            .map(|index| {
                let view = self.read(store, index, now).ok()?;
                let local = state.permits.get(index)?;
                Some(ClusterState {
                    success_rate: self.success_rate(&view.record),
                    limit: view.record.limit,
                    in_flight: view.record.in_flight.others(state.vm, now).saturating_add(local.in_use()),
                })
            })
            .collect()
    }

    /// Refreshes this VM's entries (on every tick): writes its pending grades, gives back its
    /// reserves, and returns each cluster's state for the gauges (`None` for a record that could
    /// not be read).
    pub fn heartbeat<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        state: &mut VmState,
        now: MonoMillis,
    ) -> Vec<Option<ClusterState>> {
        let VmState {
            vm,
            permits: locals,
            pending,
            ..
        } = state;
        let vm = *vm;
        (0..self.clusters.len())
            .map(|index| {
                let (local, p) = (locals.get(index)?, pending.get_mut(index)?);
                let key = self.record_key(index)?;
                let mut view = self.read(store, index, now).ok()?;
                let View { stored, record } = &mut view;
                // The first attempt decides on the record just read, a later one on the record
                // read again.
                let mut fresh = false;
                let written = update_from(store, key, stored, MAX_ATTEMPTS, |current| {
                    if fresh {
                        *record = self.record_of(current, now);
                    }
                    fresh = true;
                    let mine = local.in_use();
                    local.published(mine, record.in_flight.others(vm, now));
                    let stale = record.in_flight.needs_heartbeat(vm, mine, now);
                    if (!stale && p.is_empty()) || (current.is_none() && mine == 0 && p.is_empty()) {
                        return Attempt::Done(false);
                    }
                    self.apply(record, p);
                    record.in_flight.publish(vm, mine, now);
                    Attempt::Write(record.encode(), true)
                });
                match written {
                    Ok(true) => *p = Pending::default(),
                    Ok(false) | Err(StoreError::Host(_)) => {}
                    // Every race lost: the record as it is now, for the gauges.
                    Err(StoreError::CasMismatch) => view = self.read(store, index, now).ok()?,
                }
                p.limit_seen = view.record.limit;
                Some(ClusterState {
                    success_rate: self.success_rate(&view.record),
                    limit: view.record.limit,
                    in_flight: view
                        .record
                        .in_flight
                        .others(vm, now)
                        .saturating_add(local.in_use()),
                })
            })
            .collect()
    }
}
