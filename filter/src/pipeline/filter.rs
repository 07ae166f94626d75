//! A configuration as its streams share it ([`Filter`]): built once per configuration in each
//! VM, with the per-VM parts it shares, which mechanisms are in shadow ([`Shadows`]), and when
//! the root's periodic work is due ([`Schedule`]).
//!
//! Invariant: nothing here decides a request; what a configuration holds in shared data goes
//! back when it retires ([`Filter::retire`]).

use crate::config::Config;
use crate::fleet::batched::{GlobalScope, VmNode};
use crate::keys::KeyHasher;
use crate::primitives::inflight::{LocalCount, HEARTBEAT_MS};
use crate::primitives::time::MonoMillis;
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
/// VM and shared by its streams.
pub struct Filter {
    /// The configuration.
    pub config: Config,
    /// The request headers the configuration reads, and whether to fetch the whole map.
    pub headers: HeaderPlan,
    /// The rate-limit tables.
    pub limiter: Limiter,
    /// This VM's reserves of keys' quotas under `limiter`.
    pub reserves: RefCell<Reserves>,
    /// The units per rule this VM last added to the `reserved` gauges.
    pub(super) reserved_reported: RefCell<Vec<u64>>,
    /// The `RateLimit` fields of admitted responses, formatted once per rule.
    pub admitted_fields: AdmittedFields,
    /// The keyed hash of keys.
    pub hasher: KeyHasher,
    /// The rules' conditions, limits by key and costs.
    pub rules: Rules,
    /// Metric ids.
    pub stats: Stats,
    /// The in-flight limit (`max_active_requests`).
    pub shedder: Option<Shedder>,
    /// The priority classes, for both shedding signals.
    pub classes: Option<Classes>,
    /// This VM's loop-lag probe (`max_loop_lag`).
    pub lag: Option<RefCell<LagMonitor>>,
    /// This VM's in-flight count for the filter's namespace.
    pub local: LocalCount,
    /// Cluster selection.
    pub selector: Option<Selector>,
    /// Each key's partition of the clusters (`cluster_selection.partition`).
    pub partitioner: Option<Partitioner>,
    /// The cap on each key's requests in flight (`load_shedding.per_key`).
    pub per_key: Option<PerKeyCap>,
    /// This VM's requests in flight per key under `per_key`.
    pub key_counts: LocalKeys,
    /// This VM's side of cluster selection (permit counts, recent weights).
    pub selection_vm: RefCell<VmState>,
    /// Rules in global scope: how they reach the fleet's store.
    pub global: Option<GlobalScope>,
    /// This VM's side of the global scope.
    pub global_node: Option<Rc<RefCell<VmNode>>>,
    /// Rules in batched global scope: this worker's requests that asked the store.
    pub asks: Option<asked::AskStage>,
    /// Rules in leased consistency: the proxy's leases as this worker takes from them, and its
    /// requests waiting for them.
    pub leased: Option<LeasedStage>,
    /// Token buckets with `max_delay`: the requests waiting for their turn.
    pub delays: Option<DelayStage>,
    /// Load leveling (`load_shedding.queue`): the requests waiting for a slot.
    pub queue: Option<QueueStage>,
    /// Estimates in request bodies: the requests waiting for their body.
    pub body_waits: Option<body_wait::BodyWaitStage>,
    /// Which mechanisms only count what they would refuse.
    pub shadows: Shadows,
    /// The filter-state names of a decision's fields (`access_log`).
    pub decision_names: decision::Names,
    /// The liveness answer (`watchdog`).
    pub watchdog: Option<Watchdog>,
    /// This VM's side of the watchdog: its heartbeats, lag and recovery.
    pub(super) watchdog_state: RefCell<WorkerState>,
    /// The configuration was replaced or its root context retired ([`Filter::retire`]): streams
    /// that still finish under it write their outcomes at once.
    pub(super) retired: Cell<bool>,
    /// The log said that a response came compressed (it says so once).
    pub(super) said_compressed: Cell<bool>,
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
        Filter {
            stats: Stats::define(&config, metrics),
            hasher: KeyHasher::new(seed),
            headers: HeaderPlan::new(&config),
            admitted_fields: AdmittedFields::new(&limiter).in_shadow(|rule| config.rate_limits.get(rule).is_some_and(|r| config.shadows(r.mode))),
            reserves: RefCell::new(Reserves::new()),
            reserved_reported: RefCell::new(vec![0; config.rate_limits.len()]),
            limiter,
            local: vm.local,
            shedder,
            classes: config.load_shedding.as_ref().map(Classes::new),
            lag: config.load_shedding.as_ref().and_then(LagMonitor::new).map(RefCell::new),
            partitioner: config.cluster_selection.as_ref().and_then(Partitioner::new),
            selection_vm: RefCell::new(VmState::new(vm_id, vm.cluster_counts)),
            selector,
            per_key,
            key_counts: vm.key_counts,
            asks: asked::AskStage::new(&config, global.as_ref()),
            global_node: global.as_ref().and(vm.global_node),
            global,
            leased: LeasedStage::new(&config, namespace, stats::LeaseStats::define(&config, metrics), root, vm_id, crate::fleet::leased::holder(seed)),
            delays: DelayStage::new(&config),
            queue: config.load_shedding.as_ref().and_then(|s| crate::shedding::queue::Leveler::new(s, namespace)).map(QueueStage::new),
            body_waits: body_wait::BodyWaitStage::new(rules.reads_request_bodies()),
            rules,
            shadows: Shadows::new(&config),
            decision_names: if config.access_log { decision::Names::new(namespace) } else { decision::Names::default() },
            watchdog: config.watchdog.as_ref().map(|w| Watchdog::new(w, namespace)),
            watchdog_state: RefCell::new(WorkerState::default()),
            config,
            retired: Cell::new(false),
            said_compressed: Cell::new(false),
        }
    }

    /// How often the VM's root ticks, when it needs to: every second (heartbeats, reserves,
    /// the watchdog), a global scope every `sync_interval`, a lag probe every
    /// `lag_probe_interval`, leased rules every quarter `lease_timeout` (2 to 10 ms: to send the
    /// calls queued for the root, again those of streams that ended, and to end waits past the
    /// timeout), the delay and queue stages at their own ticks. `None`: nothing needs a tick.
    pub fn tick_ms(&self) -> Option<u64> {
        let ticks = self.shedder.is_some()
            || self.lag.is_some()
            || self.selector.is_some()
            || self.watchdog.is_some()
            || !self.config.rate_limits.is_empty();
        let periods = [
            self.global.as_ref().map(|g| g.interval_ms),
            self.lag.as_ref().map(|l| l.borrow().probe_ms()),
            self.leased.as_ref().map(|l| crate::fleet::leased::tick_ms(l.timeout_ms)),
            self.delays.as_ref().map(|_| delay::TICK_MS),
            self.queue.as_ref().map(|_| queue::TICK_MS),
        ];
        ticks.then(|| periods.into_iter().flatten().fold(HEARTBEAT_MS, u64::min))
    }

    /// No quota reserves: the VM does not tick, and reserves need the heartbeat to come back
    /// when unused.
    pub fn without_reserves(&self) {
        *self.reserves.borrow_mut() = Reserves::disabled();
    }

    /// Whether the configuration is retired.
    pub fn is_retired(&self) -> bool {
        self.retired.get()
    }

    /// Once a second: reserves unused for a second go back, in-flight entries and cluster
    /// records are refreshed, and their gauges set.
    pub fn heartbeat<H: Host>(&self, env: &Env<'_, H>) {
        let now = env.clock.now();
        if let Some(stage) = &self.leased {
            stage.heartbeat(env.store, env.metrics, now);
        }
        self.limiter.heartbeat(env.store, &mut self.reserves.borrow_mut(), now.wall);
        self.report_reserved(env.metrics);
        if let Some(shedder) = &self.shedder {
            let total = shedder.heartbeat(env.store, env.vm, &self.local, now.mono);
            stats::set(env.metrics, self.stats.shedding.in_flight, u64::from(total));
        }
        if let Some(cap) = &self.per_key {
            cap.heartbeat(env.store, env.vm, &self.key_counts, now.mono);
        }
        if let Some(stage) = &self.queue {
            stage.heartbeat(env, now.mono);
        }
        self.selection_heartbeat(env);
        if let Some(dog) = &self.watchdog {
            let lag_hint = self.lag.as_ref().map_or(0, |lag| lag.borrow().lag_ms());
            let memory = watchdog::linear_memory_bytes();
            if let Err(err) = dog.heartbeat(env.store, env.vm, &mut self.watchdog_state.borrow_mut(), now.mono, lag_hint, memory) {
                log::debug!("floodgate: watchdog heartbeat not written: {err}");
            }
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
        if let Some(lag) = &self.lag {
            let lag_ms = lag.borrow_mut().probe(env.clock.now().mono);
            stats::set(env.metrics, self.stats.shedding.loop_lag_ms, lag_ms);
        }
    }

    /// Ends this configuration's claims on shared data, once it takes no new requests (its
    /// root context was re-configured or retired): gives back its quota reserves (their units
    /// were counted ahead in the keys' counters), the in-flight and cluster reserves, and
    /// writes the cluster outcomes it counted locally (successes and AIMD growth). Without
    /// this, a configuration change would leave those units counted for up to two windows,
    /// and drop the pending outcomes. Streams still running under it write their outcomes at
    /// once from now on.
    pub fn retire<H: Host>(&self, env: &Env<'_, H>) {
        let now = env.clock.now();
        self.retired.set(true);
        {
            let mut reserves = self.reserves.borrow_mut();
            self.limiter.drain(env.store, &mut reserves);
            *reserves = Reserves::disabled();
        }
        self.report_reserved(env.metrics);
        if let Some(shedder) = &self.shedder {
            shedder.heartbeat(env.store, env.vm, &self.local, now.mono);
        }
        if let Some(cap) = &self.per_key {
            cap.heartbeat(env.store, env.vm, &self.key_counts, now.mono);
        }
        if let Some(selector) = &self.selector {
            selector.heartbeat(env.store, &mut self.selection_vm.borrow_mut(), now.mono);
        }
        if let Some(stage) = &self.leased {
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
        let Some(selector) = &self.selector else { return };
        let now = env.clock.now().mono;
        let states = selector.heartbeat(env.store, &mut self.selection_vm.borrow_mut(), now);
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
        let mut reported = self.reserved_reported.borrow_mut();
        let held = self.reserves.borrow().held(reported.len());
        for (rule, (units, before)) in held.into_iter().zip(reported.iter_mut()).enumerate() {
            let delta = i64::try_from(units).unwrap_or(i64::MAX).saturating_sub(i64::try_from(*before).unwrap_or(i64::MAX));
            stats::add(metrics, self.stats.rule(rule).reserved, delta);
            *before = units;
        }
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

/// When the root's periodic work is due: the heartbeat every second, the global scope's sync
/// every `sync_interval`, the lag probe every `lag_probe_interval`, whatever the tick period
/// (the fastest of them).
#[derive(Clone, Copy, Debug, Default)]
pub struct Schedule {
    last_heartbeat: Option<MonoMillis>,
    last_sync: Option<MonoMillis>,
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
    pub fn due(&mut self, filter: &Filter, now: MonoMillis) -> Due {
        let take = |last: &mut Option<MonoMillis>, every_ms: u64| {
            // A tick a few milliseconds early still counts: the timer's period is the interval.
            let due = last.is_none_or(|at| now.saturating_since(at).saturating_add(5) >= every_ms || at > now);
            if due {
                *last = Some(now);
            }
            due
        };
        let lag_probe = filter.lag.as_ref().is_some_and(|lag| take(&mut self.last_lag_probe, lag.borrow().probe_ms()));
        let sync = filter.global.as_ref().is_some_and(|g| take(&mut self.last_sync, g.interval_ms));
        let heartbeat = take(&mut self.last_heartbeat, HEARTBEAT_MS);
        Due { lag_probe, sync, heartbeat }
    }
}
