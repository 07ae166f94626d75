//! A configuration as its streams share it ([`Filter`]): built once per configuration in each
//! VM, with the per-VM parts it shares, which mechanisms are in shadow ([`Shadows`]), and when
//! the root's periodic work is due ([`Schedule`]). Its state is grouped by what uses it: rate
//! limiting ([`Limits`]), load shedding ([`Shedding`]), cluster selection ([`Selection`]), the
//! global scope ([`Fleet`]) and the stages that keep requests waiting ([`Waits`]); a stage takes
//! the parts it uses, and the host reads them through accessors.
//!
//! Invariant: nothing here decides a request; what a configuration holds in shared data goes
//! back when it retires ([`Filter::retire`]).

use crate::config::Config;
use crate::fleet::batched::{GlobalScope, VmNode};
use crate::keys::KeyHasher;
use crate::primitives::inflight::{LocalCount, HEARTBEAT_MS};
use crate::primitives::time::{MonoMillis, Now, UnixMillis};
use crate::ratelimit::Limiter;
use crate::ratelimit::reserve::Reserves;
use crate::ratelimit::rules::Rules;
use crate::replies::AdmittedFields;
use crate::selection::partition::Partitioner;
use crate::selection::{Selector, VmState};
use crate::shedding::lag::LagMonitor;
use crate::shedding::per_key::{LocalKeys, PerKeyCap};
use crate::shedding::{Classes, Shedder};
use crate::watchdog::{self, Watchdog, WorkerState};
use super::*;
use super::delay::DelayStage;
use super::headers::HeaderPlan;
use super::leased::LeasedStage;
use super::queue::QueueStage;
use super::stats::{Metrics, Stats};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// The shared-data records under which a configuration keeps counts of its own VM (the host
/// keeps one VM-local count per record, which the configurations of the VM share): what
/// [`Filter::new`] hands the host to get the configuration's [`VmParts`].
pub struct Records<'a> {
    /// The shedder's in-flight record ("" when nothing is shed).
    pub inflight: &'a str,
    /// The per-key cap's table ("" when there is no cap).
    pub key_table: &'a str,
    /// Each selected cluster's permit record.
    pub clusters: Vec<&'a str>,
    /// Whether the configuration has a global scope (its VM's side outlives configurations).
    pub global: bool,
}

/// The per-VM parts a configuration shares with the other configurations of its VM.
pub struct VmParts {
    /// This VM's in-flight count under the shedder's record.
    pub local: LocalCount,
    /// This VM's requests in flight per key under the per-key cap's table.
    pub key_counts: LocalKeys,
    /// This VM's permit counts, one per cluster.
    pub cluster_counts: Vec<LocalCount>,
    /// This VM's side of the global scope (it outlives configurations).
    pub global_node: Option<Rc<RefCell<VmNode>>>,
}

/// Everything a configuration needs to decide requests, built once per configuration in each
/// VM and shared by its streams: a few parts shared by every stage, and one part per concern,
/// which the stages of that concern take.
pub struct Filter {
    /// The configuration.
    pub(super) config: Config,
    /// The request headers the configuration reads, and whether to fetch the whole map.
    pub(super) headers: HeaderPlan,
    /// Metric ids.
    pub(super) stats: Stats,
    /// Which mechanisms only count what they would refuse.
    pub(super) shadows: Shadows,
    /// Rate limiting in this proxy.
    pub(super) limits: Limits,
    /// Load shedding.
    pub(super) shedding: Shedding,
    /// Cluster selection.
    pub(super) selection: Selection,
    /// Rules in global scope.
    pub(super) fleet: Fleet,
    /// The stages that keep requests waiting on this worker.
    pub(super) waits: Waits,
    /// The stages the configuration has, in [`Stage::ORDER`]: the ones a request's walk runs.
    pub(super) stages: Box<[Stage]>,
    /// The filter-state names of a decision's fields (`access_log`).
    pub(super) decision_names: decision::Names,
    /// The liveness answer (`watchdog`).
    pub(super) watchdog: Option<Watchdog>,
    /// This VM's side of the watchdog: its heartbeats, lag and recovery.
    pub(super) watchdog_state: RefCell<WorkerState>,
    /// The configuration was replaced or its root context retired ([`Filter::retire`]): streams
    /// that still finish under it write their grades at once.
    pub(super) retired: Cell<bool>,
    /// The log said that a response came compressed (it says so once).
    pub(super) said_compressed: Cell<bool>,
}

/// Rate limiting in this proxy: the rules, their tables and this VM's reserves of them.
pub struct Limits {
    /// The rate-limit tables.
    pub(super) limiter: Limiter,
    /// This VM's reserves of keys' quotas under `limiter`.
    pub(super) reserves: RefCell<Reserves>,
    /// The units per rule this VM last added to the `reserved` gauges.
    pub(super) reserved_reported: RefCell<Vec<u64>>,
    /// The `RateLimit` fields of admitted responses, formatted once per rule.
    pub(super) admitted_fields: AdmittedFields,
    /// The keyed hash of keys.
    pub(super) hasher: KeyHasher,
    /// The rules' conditions, limits by key and costs.
    pub(super) rules: Rules,
}

/// Load shedding: the in-flight limit, the loop-lag probe and the per-key cap, with this VM's
/// counts under them.
pub struct Shedding {
    /// The in-flight limit (`max_active_requests`).
    pub(super) shedder: Option<Shedder>,
    /// The priority classes, for both shedding signals.
    pub(super) classes: Option<Classes>,
    /// This VM's loop-lag probe (`max_loop_lag`).
    pub(super) lag: Option<RefCell<LagMonitor>>,
    /// This VM's in-flight count for the filter's namespace.
    pub(super) local: LocalCount,
    /// The cap on each key's requests in flight (`load_shedding.per_key`).
    pub(super) per_key: Option<PerKeyCap>,
    /// This VM's requests in flight per key under `per_key`.
    pub(super) key_counts: LocalKeys,
    /// The `Retry-After` of their `503`s, whole seconds (`load_shedding.retry_after`, at least 1).
    pub(super) retry_after_secs: u64,
}

/// Cluster selection, with this VM's side of it.
pub struct Selection {
    /// The clusters and how to choose among them.
    pub(super) selector: Option<Selector>,
    /// Each key's partition of the clusters (`cluster_selection.partition`).
    pub(super) partitioner: Option<Partitioner>,
    /// This VM's side of cluster selection (permit counts, recent weights).
    pub(super) vm: RefCell<VmState>,
}

/// Rules in global scope: how they reach the fleet's store, and this worker's requests on
/// their way there.
pub struct Fleet {
    /// Rules in batched global scope: how they reach the fleet's store.
    pub(super) global: Option<GlobalScope>,
    /// This VM's side of the global scope.
    pub(super) global_node: Option<Rc<RefCell<VmNode>>>,
    /// Rules in batched global scope: this worker's requests that asked the store.
    pub(super) asks: Option<asked::AskStage>,
    /// Rules in leased consistency: the proxy's leases as this worker takes from them, and its
    /// requests waiting for them.
    pub(super) leased: Option<LeasedStage>,
}

/// The stages whose requests wait on this worker for a time, a slot or their body.
pub struct Waits {
    /// Token buckets with `max_delay`: the requests waiting for their turn.
    pub(super) delays: Option<DelayStage>,
    /// Load leveling (`load_shedding.queue`): the requests waiting for a slot.
    pub(super) queue: Option<QueueStage>,
    /// Estimates in request bodies: the requests waiting for their body.
    pub(super) body_waits: Option<body_wait::BodyWaitStage>,
    /// Per class shared by flow: the slots its record held beyond the in-flight count at the
    /// last heartbeat.
    pub(super) flows_excess: RefCell<Vec<u32>>,
}

impl Filter {
    /// The filter of `config` under `namespace` (the plugin's name), with the proxy's key seed,
    /// in the VM whose id is `vm_id`, under the root context `root`; `vm` gives the VM's parts
    /// kept under the configuration's records.
    pub fn new(
        config: Config,
        namespace: &str,
        seed: [u8; 16],
        vm_id: u64,
        root: u32,
        vm: impl FnOnce(Records<'_>) -> VmParts,
        metrics: &dyn Metrics,
    ) -> Filter {
        let limiter = Limiter::new(&config, namespace);
        let shedder = config.load_shedding.as_ref().and_then(|s| Shedder::new(s, namespace));
        let selector = config.cluster_selection.as_ref().map(|s| Selector::new(s, namespace));
        let per_key = config.load_shedding.as_ref().and_then(|s| s.per_key.as_ref()).map(|p| PerKeyCap::new(p, namespace));
        let vm = vm(Records {
            inflight: shedder.as_ref().map_or("", |s| s.record_key()),
            key_table: per_key.as_ref().map_or("", |p| p.table()),
            clusters: selector.as_ref().map_or_else(Vec::new, |s| (0..s.clusters.len()).filter_map(|i| s.record_key(i)).collect()),
            global: config.global.is_some(),
        });
        let global = GlobalScope::new(&config, namespace);
        let rules = Rules::new(&config, &KeyHasher::new(seed));
        let body_waits = body_wait::BodyWaitStage::new(rules.reads_request_bodies());
        let mut filter = Filter {
            stats: Stats::define(&config, metrics),
            headers: HeaderPlan::new(&config),
            limits: Limits {
                hasher: KeyHasher::new(seed),
                admitted_fields: AdmittedFields::new(&limiter).in_shadow(|rule| config.rate_limits.get(rule).is_some_and(|r| config.shadows(r.mode))),
                reserves: RefCell::new(Reserves::new()),
                reserved_reported: RefCell::new(vec![0; config.rate_limits.len()]),
                limiter,
                rules,
            },
            shedding: Shedding {
                local: vm.local,
                shedder,
                classes: config.load_shedding.as_ref().map(Classes::new),
                lag: config.load_shedding.as_ref().and_then(LagMonitor::new).map(RefCell::new),
                per_key,
                key_counts: vm.key_counts,
                retry_after_secs: config.load_shedding.as_ref().map_or(1, |s| s.retry_after.ceil_secs().max(1)),
            },
            selection: Selection {
                partitioner: config.cluster_selection.as_ref().and_then(Partitioner::new),
                vm: RefCell::new(VmState::new(vm_id, vm.cluster_counts)),
                selector,
            },
            fleet: Fleet {
                asks: asked::AskStage::new(&config, global.as_ref()),
                global_node: global.as_ref().and(vm.global_node),
                global,
                leased: LeasedStage::new(&config, namespace, stats::LeaseStats::define(&config, metrics), root, vm_id, crate::fleet::leased::holder(seed)),
            },
            waits: Waits {
                delays: DelayStage::new(&config),
                queue: config.load_shedding.as_ref().and_then(|s| {
                    let leveler = crate::shedding::queue::Leveler::new(s, namespace)?;
                    Some(QueueStage::new(leveler, crate::shedding::flows::Flows::new(s, namespace)))
                }),
                body_waits,
                flows_excess: RefCell::default(),
            },
            shadows: Shadows::new(&config),
            decision_names: if config.access_log { decision::Names::new(namespace) } else { decision::Names::default() },
            watchdog: config.watchdog.as_ref().map(|w| Watchdog::new(w, namespace)),
            watchdog_state: RefCell::new(WorkerState::default()),
            config,
            retired: Cell::new(false),
            said_compressed: Cell::new(false),
            stages: Box::default(),
        };
        filter.stages = Stage::configured_in(&filter);
        filter
    }

    /// How often the VM's root ticks, when it needs to: every second (heartbeats, reserves,
    /// the watchdog), a global scope every `sync_interval`, a lag probe every
    /// `lag_probe_interval`, leased rules every quarter `lease_timeout` (2 to 10 ms: to send the
    /// calls queued for the root, again those of streams that ended, and to end waits past the
    /// timeout), the delay and queue stages at their own ticks. `None`: nothing needs a tick.
    pub fn tick_ms(&self) -> Option<u64> {
        let ticks = self.shedding.shedder.is_some()
            || self.shedding.lag.is_some()
            || self.selection.selector.is_some()
            || self.watchdog.is_some()
            || !self.config.rate_limits.is_empty();
        let periods = [
            self.fleet.global.as_ref().map(|g| g.interval_ms),
            self.shedding.lag.as_ref().map(|l| l.borrow().probe_ms()),
            self.fleet.leased.as_ref().map(|l| crate::fleet::leased::tick_ms(l.timeout_ms)),
            self.waits.delays.as_ref().map(|_| delay::TICK_MS),
            self.waits.queue.as_ref().map(|_| queue::TICK_MS),
        ];
        ticks.then(|| periods.into_iter().flatten().fold(HEARTBEAT_MS, u64::min))
    }

    /// No quota reserves: the VM does not tick, and reserves need the heartbeat to come back
    /// when unused.
    pub fn without_reserves(&self) {
        *self.limits.reserves.borrow_mut() = Reserves::disabled();
    }

    /// Whether the configuration is retired.
    pub fn is_retired(&self) -> bool {
        self.retired.get()
    }

    /// Once a second: reserves unused for a second go back, in-flight entries and cluster
    /// records are refreshed, and their gauges set.
    pub fn heartbeat<H: Host>(&self, env: &Env<'_, H>) {
        let now = env.clock.now();
        if let Some(stage) = &self.fleet.leased {
            stage.heartbeat(env.store, env.metrics, now);
        }
        self.limits.limiter.heartbeat(env.store, &mut self.limits.reserves.borrow_mut(), now.wall);
        self.report_reserved(env.metrics);
        if let Some(shedder) = &self.shedding.shedder {
            let total = shedder.heartbeat(env.store, env.vm, &self.shedding.local, now.mono);
            stats::set(env.metrics, self.stats.shedding.in_flight, u64::from(total));
            self.flows_heartbeat(env, total);
        }
        if let Some(cap) = &self.shedding.per_key {
            cap.heartbeat(env.store, env.vm, &self.shedding.key_counts, now.mono);
        }
        if let Some(stage) = &self.waits.queue {
            stage.heartbeat(env, now.mono);
        }
        self.selection_heartbeat(env);
        if let Some(dog) = &self.watchdog {
            let lag_hint = self.shedding.lag.as_ref().map_or(0, |lag| lag.borrow().lag_ms());
            let memory = watchdog::linear_memory_bytes();
            if let Err(err) = dog.heartbeat(env.store, env.vm, &mut self.watchdog_state.borrow_mut(), now.mono, lag_hint, memory) {
                log::debug!("floodgate: watchdog heartbeat not written: {err}");
            }
        }
    }

    /// The classes shared by flow, once a second: slots held beyond the proxy-wide in-flight
    /// count `in_flight` are forgotten (their worker is gone), and the flows' gauges set.
    fn flows_heartbeat<H: Host>(&self, env: &Env<'_, H>, in_flight: u32) {
        let Some(flows) = self.waits.queue.as_ref().and_then(|q| q.flows.as_ref()) else { return };
        let mut excess = self.waits.flows_excess.borrow_mut();
        excess.resize(self.stats.flows.len(), 0);
        for (class, fair) in flows.iter() {
            let record = fair.read(env.store);
            if let Some(before) = excess.get_mut(class) {
                *before = fair.forget_beyond(env.store, &record, in_flight, *before);
            }
            let active = u64::try_from(record.flows()).unwrap_or(u64::MAX);
            let ids = self.stats.flow(class);
            stats::set(env.metrics, ids.flows, active);
            stats::set(env.metrics, ids.fair_share_ppm, 1_000_000u64.checked_div(active).unwrap_or(0));
        }
    }

    /// The configuration starts in this VM ([`WorkerState::started`]).
    pub fn configured<H: Host>(&self, env: &Env<'_, H>) {
        *self.watchdog_state.borrow_mut() = WorkerState::started(env.clock.now().mono);
    }

    /// A stream starts: with a watchdog, the first one of this configuration writes that this
    /// VM is a worker ([`Watchdog::serving`]).
    pub fn serving<H: Host>(&self, env: &Env<'_, H>) {
        let Some(dog) = &self.watchdog else { return };
        let mut state = self.watchdog_state.borrow_mut();
        if !state.serves() {
            if let Err(err) = dog.serving(env.store, env.vm, &mut state, env.clock.now().mono) {
                log::debug!("floodgate: watchdog entry not written: {err}");
            }
        }
    }

    /// The loop-lag probe, when it is due: how late it ran.
    pub fn probe_lag<H: Host>(&self, env: &Env<'_, H>) {
        if let Some(lag) = &self.shedding.lag {
            let lag_ms = lag.borrow_mut().probe(env.clock.now().mono);
            stats::set(env.metrics, self.stats.shedding.loop_lag_ms, lag_ms);
        }
    }

    /// Ends this configuration's claims on shared data, once it takes no new requests (its
    /// root context was re-configured or retired): gives back its quota reserves (their units
    /// were counted ahead in the keys' counters), the in-flight and cluster reserves, and
    /// writes the cluster grades it counted locally (successes and AIMD growth). Without
    /// this, a configuration change would leave those units counted for up to two windows,
    /// and drop the pending grades. Streams still running under it write their grades at
    /// once from now on.
    pub fn retire<H: Host>(&self, env: &Env<'_, H>) {
        let now = env.clock.now();
        self.retired.set(true);
        {
            let mut reserves = self.limits.reserves.borrow_mut();
            self.limits.limiter.drain(env.store, &mut reserves);
            *reserves = Reserves::disabled();
        }
        self.report_reserved(env.metrics);
        if let Some(shedder) = &self.shedding.shedder {
            shedder.heartbeat(env.store, env.vm, &self.shedding.local, now.mono);
        }
        if let Some(cap) = &self.shedding.per_key {
            cap.heartbeat(env.store, env.vm, &self.shedding.key_counts, now.mono);
        }
        if let Some(selector) = &self.selection.selector {
            selector.heartbeat(env.store, &mut self.selection.vm.borrow_mut(), now.mono);
        }
        if let Some(stage) = &self.fleet.leased {
            stage.drain(env.store, now);
        }
        if let Some(dog) = &self.watchdog {
            if let Err(err) = dog.retire(env.store, env.vm, now.mono) {
                log::debug!("floodgate: watchdog entry not retired: {err}");
            }
        }
    }

    /// The selection's heartbeat (each cluster's in-flight count published, its shared state
    /// read) and its gauges; also run once at configuration, so that the gauges show the
    /// clusters' limits and success rates from the start rather than 0 until the first tick.
    pub fn selection_heartbeat<H: Host>(&self, env: &Env<'_, H>) {
        let Some(selector) = &self.selection.selector else { return };
        let now = env.clock.now().mono;
        let states = selector.heartbeat(env.store, &mut self.selection.vm.borrow_mut(), now);
        for (index, state) in states.into_iter().enumerate() {
            let (Some(state), ids) = (state, self.stats.cluster(index)) else { continue };
            // The rate is in [0, 1]: millionths fit.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let ppm = (state.success_rate * 1_000_000.0).round() as u64;
            stats::set(env.metrics, ids.success_rate_ppm, ppm);
            stats::set(env.metrics, ids.concurrency_limit, u64::from(state.limit));
            stats::set(env.metrics, ids.in_flight, u64::from(state.in_flight));
        }
    }

    /// Moves the `reserved` gauges by what this VM's reserves changed since it last reported.
    fn report_reserved(&self, metrics: &dyn Metrics) {
        let mut reported = self.limits.reserved_reported.borrow_mut();
        let held = self.limits.reserves.borrow().held(reported.len());
        for (rule, (units, before)) in held.into_iter().zip(reported.iter_mut()).enumerate() {
            let delta = i64::try_from(units).unwrap_or(i64::MAX).saturating_sub(i64::try_from(*before).unwrap_or(i64::MAX));
            stats::add(metrics, self.stats.rule(rule).reserved, delta);
            *before = units;
        }
    }
}

impl Filter {
    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The request headers the configuration reads.
    pub fn headers(&self) -> &HeaderPlan {
        &self.headers
    }

    /// Metric ids.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Rate limiting in this proxy.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Load shedding.
    pub fn shedding(&self) -> &Shedding {
        &self.shedding
    }

    /// Cluster selection.
    pub fn selection(&self) -> &Selection {
        &self.selection
    }

    /// Rules in global scope.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// The stages that keep requests waiting on this worker.
    pub fn waits(&self) -> &Waits {
        &self.waits
    }

    /// The filter-state names of a decision's fields.
    pub fn decision_names(&self) -> &decision::Names {
        &self.decision_names
    }
}

impl Limits {
    /// The rate-limit tables.
    pub fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// The `RateLimit` fields of admitted responses.
    pub fn admitted_fields(&self) -> &AdmittedFields {
        &self.admitted_fields
    }
}

impl Selection {
    /// The clusters and how to choose among them, with cluster selection.
    pub fn selector(&self) -> Option<&Selector> {
        self.selector.as_ref()
    }
}

impl Fleet {
    /// Rules in batched global scope: how they reach the fleet's store.
    pub fn scope(&self) -> Option<&GlobalScope> {
        self.global.as_ref()
    }

    /// This VM's side of the global scope.
    pub fn node(&self) -> Option<&Rc<RefCell<VmNode>>> {
        self.global_node.as_ref()
    }

    /// This worker's requests that asked the store, with rules in batched global scope.
    pub fn asks(&self) -> Option<&asked::AskStage> {
        self.asks.as_ref()
    }

    /// The leased stage, with rules in leased consistency.
    pub fn leased(&self) -> Option<&LeasedStage> {
        self.leased.as_ref()
    }
}

impl Waits {
    /// The requests waiting for their turn, with token buckets that delay.
    pub fn delays(&self) -> Option<&DelayStage> {
        self.delays.as_ref()
    }

    /// The requests waiting for a slot, with load leveling.
    pub fn queue(&self) -> Option<&QueueStage> {
        self.queue.as_ref()
    }

    /// The requests waiting for their body, with estimates in request bodies.
    pub fn body_waits(&self) -> Option<&body_wait::BodyWaitStage> {
        self.body_waits.as_ref()
    }
}

/// Which mechanisms are in shadow: they let through what they would refuse, consume nothing
/// for it, and count it.
#[derive(Clone, Debug, Default)]
pub struct Shadows {
    /// Per rate-limit rule.
    pub(super) rules: Vec<bool>,
    /// Some rule is.
    pub(super) any_rule: bool,
    /// Load shedding (in-flight and loop lag).
    pub(super) shedding: bool,
    /// The per-key cap.
    pub(super) per_key: bool,
    /// Partitions.
    pub(super) partition: bool,
}

impl Shadows {
    /// The modes of `config`.
    pub fn new(config: &Config) -> Shadows {
        let rules: Vec<bool> = config.rate_limits.iter().map(|r| config.shadows(r.mode)).collect();
        let shedding = config.load_shedding.as_ref();
        Shadows {
            any_rule: rules.iter().any(|s| *s),
            rules,
            shedding: shedding.is_some_and(|s| config.shadows(s.mode)),
            per_key: shedding.and_then(|s| s.per_key.as_ref()).is_some_and(|p| config.shadows(p.mode)),
            partition: config
                .cluster_selection
                .as_ref()
                .and_then(|s| s.partition.as_ref())
                .is_some_and(|p| config.shadows(p.mode)),
        }
    }

    /// Whether rule `rule` is in shadow.
    pub fn rule(&self, rule: usize) -> bool {
        self.rules.get(rule).copied().unwrap_or(false)
    }

    /// Whether any rule is.
    pub fn any_rule(&self) -> bool {
        self.any_rule
    }
}

/// When the root's periodic work is due: the heartbeat every second, the lag probe every
/// `lag_probe_interval`, whatever the tick period (the fastest of them); and the global scope's
/// sync once per slot of `sync_interval` on the wall clock, a grid every proxy shares.
///
/// The grid lines up the fleet: when the sync drives the tick, [`Schedule::tick_period`] sets each
/// tick on the next slot's start, so every proxy's batch leaves at about the same moment, and
/// floodgate-sync, which merges the batches that arrive together, makes one store call of them
/// rather than one per proxy (docs/global.md, "The store's load").
#[derive(Clone, Copy, Debug, Default)]
pub struct Schedule {
    last_heartbeat: Option<MonoMillis>,
    /// The slot (`wall / sync_interval`) of the last sync.
    last_sync: Option<u64>,
    last_lag_probe: Option<MonoMillis>,
}

/// What a tick is to do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Due {
    /// Probe the loop lag.
    pub lag_probe: bool,
    /// Run the global scope's tick.
    pub sync: bool,
    /// Run the heartbeat.
    pub heartbeat: bool,
}

impl Schedule {
    /// What is due at `now` for `filter` (and marks it done).
    pub fn due(&mut self, filter: &Filter, now: Now) -> Due {
        let take = |last: &mut Option<MonoMillis>, every_ms: u64| {
            // A tick a few milliseconds early still counts: the timer's period is the interval.
            let due = last.is_none_or(|at| now.mono.saturating_since(at).saturating_add(5) >= every_ms || at > now.mono);
            if due {
                *last = Some(now.mono);
            }
            due
        };
        let lag_probe = filter.shedding.lag.as_ref().is_some_and(|lag| take(&mut self.last_lag_probe, lag.borrow().probe_ms()));
        // A slot not synced yet (a wall clock that went back too: due rather than never).
        let sync = filter.fleet.global.as_ref().is_some_and(|g| {
            let slot = now.wall.0.checked_div(g.interval_ms).unwrap_or(0);
            let due = self.last_sync != Some(slot);
            self.last_sync = Some(slot);
            due
        });
        let heartbeat = take(&mut self.last_heartbeat, HEARTBEAT_MS);
        Due { lag_probe, sync, heartbeat }
    }

    /// The root's tick period to set at a tick at `now`, when the sync drives the tick (its period
    /// is `sync_interval`): the time to the start of the next slot of the grid, 1 ms to one
    /// interval (a timer fires a little late, never early, so each tick lands just inside a new
    /// slot). `None` when another period drives the tick, which then meets each slot within one
    /// of its periods.
    pub fn tick_period(filter: &Filter, now: UnixMillis) -> Option<u64> {
        let interval = filter.fleet.global.as_ref()?.interval_ms;
        if filter.tick_ms() != Some(interval) {
            return None;
        }
        Some(interval.saturating_sub(now.0.checked_rem(interval).unwrap_or(0)))
    }
}
