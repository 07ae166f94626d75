//! The request pipeline: what floodgate does with a request, in pure code, stage by stage.
//!
//! ```text
//! endpoints → shed (→ queue) → cap → leased → rate_limit → delay → select
//! ```
//!
//! Each stage lets the request go on, possibly holding something (an in-flight [`Permit`], a
//! [`KeyPermit`], units of a leased key, a [`ClusterPermit`]), or answers it; the host shell turns
//! the answer ([`Step`]) into host calls. The `leased` stage may make the request wait; the store's
//! answer resumes it on the same stream state ([`Stream`]); the `delay` stage parks
//! a request a token bucket let in to wait for its turn, and the root's tick resumes it;
//! with `load_shedding.queue`, a request the in-flight limit would shed
//! waits in the `queue` stage for a slot, which the root's tick gives it. A stream waits on one
//! thing at a time, holding what that wait holds; one [`resume`] and one [`abandon`] take every
//! kind of wait ([`Waiting`]).
//! Before all stages, a request whose estimate a rule reads in its JSON body
//! (`cost.estimate.body`) waits for its body, holding nothing; the body's callbacks decide it
//! once the estimate is read ([`request_body_estimates`]), or the root's tick, when none of the
//! body reached the filter ([`Waiting::Body`], [`body_wait`]).
//! The stream state also takes the
//! stream's later events (body, response, end). What the pipeline needs of the host is narrow: the
//! shared store, metrics and the VM's id ([`Env`]), the request's attributes ([`Request`]), the
//! response's ([`Attributes`], [`StreamEnd`]), and a random source.
//!
//! Invariant: everything a stage holds goes back exactly once: before the reply when a later stage
//! answers, otherwise when the stream ends, whatever ended it.
//!
//! Rationale: docs/design.md, section "A request's path".

pub mod body_wait;
pub mod decision;
pub mod delay;
pub mod headers;
pub mod asked;
pub mod leased;
pub mod queue;
pub mod stats;
#[cfg(test)]
mod tests;

use crate::config::{Config, Dependencies, KeyPart, RateLimitHeaders};
use crate::config::GrpcStatus;
use crate::fleet::batched::{GlobalScope, VmNode};
use headers::HeaderPlan;
use crate::keys::{self, KeyHasher, Source};
use crate::primitives::inflight::{LocalCount, Permit, HEARTBEAT_MS};
use crate::primitives::store::SharedStore;
use crate::primitives::time::{MonoMillis, Now, UnixMillis};
use crate::ratelimit::estimate::BodyEstimates;
use crate::ratelimit::reserve::Reserves;
use crate::ratelimit::rules::{self, Charges, Later, Report, Rules, Settle};
use crate::ratelimit::usage;
use crate::ratelimit::{Cause, Limiter, Probe, Standing, Verdict, Violation};
use crate::replies::grpc::{self, GrpcReply};
use crate::replies::{self, AdmittedFields, Reply, Tightest};
use crate::selection::outcome::Outcome;
use crate::selection::partition::Partitioner;
use crate::primitives::hash::Random;
use crate::selection::{ClusterPermit, Confinement, Exhausted, Selector, Timing, VmState};
use crate::shedding::lag::LagMonitor;
use crate::shedding::per_key::{CapRefusal, KeyPermit, LocalKeys, PerKeyCap};
use crate::shedding::{Classes, Shedder};
use crate::watchdog::{self, Watchdog, WorkerState};
use decision::{By, Decision};
use delay::{DelayStage, Delayed};
use leased::{LeasedStage, StoreWait, Taken};
use queue::{QueueStage, Queued, Ready};
pub use rules::Attributes;
use stats::{increment, Metrics, Stats};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// The host's types the pipeline runs with: Envoy's in the module, fakes in the tests. The
/// pipeline is compiled for each, so its calls to the host are direct.
pub trait Host {
    /// The shared data.
    type Store: SharedStore;
    /// The stats.
    type Metrics: Metrics;
    /// The clocks.
    type Clock: Clock;
}

/// What the pipeline needs of its host besides the request.
pub struct Env<'a, H: Host> {
    /// Envoy's shared data (a map with Envoy's semantics in tests).
    pub store: &'a H::Store,
    /// Envoy's stats.
    pub metrics: &'a H::Metrics,
    /// The clocks, read only when a stage needs them (the host reads them at most once per
    /// callback).
    pub clock: &'a H::Clock,
    /// This VM's random id in the shared records.
    pub vm: u64,
}

impl<H: Host> Clone for Env<'_, H> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H: Host> Copy for Env<'_, H> {}

/// The host's clocks.
pub trait Clock {
    /// Both clocks, now.
    fn now(&self) -> Now;
}

/// A request's attributes (its headers, and its source address), read from the host as the
/// pipeline asks for them.
pub trait Request: Attributes {
    /// The downstream address as Envoy settled it (`source_ip`), with its port.
    fn source_address(&self) -> Option<Cow<'_, [u8]>>;
    /// A key part's attribute.
    fn fetch(&self, source: Source<'_>) -> Option<Cow<'_, [u8]>> {
        match source {
            Source::Header(name) => self.get(name),
            Source::SourceAddress => self.source_address(),
        }
    }
}

/// What ended a stream, read only when the pipeline needs it (each is a host call).
pub trait StreamEnd {
    /// The response's status, if one was sent.
    fn status(&self) -> Option<u16>;
    /// Envoy's response flags (`UT`, `UF`, ...).
    fn flags(&self) -> u64;
}

/// A local reply, in the form the request's protocol needs.
#[derive(Clone, Debug, PartialEq)]
pub enum LocalReply {
    /// An HTTP reply.
    Http(Reply),
    /// A gRPC trailers-only reply, for a gRPC request.
    Grpc(GrpcReply),
}

/// What the host does next with a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// The request goes on; with `route`, the cluster (an index in `cluster_selection.clusters`)
    /// whose name the host sets in the route header first.
    Continue {
        /// The chosen cluster.
        route: Option<usize>,
    },
    /// The request is answered here.
    Reply(LocalReply),
    /// The request waits for the store: the host pauses it, and resumes it when the leased stage
    /// wakes it.
    Wait,
}

/// Whether a body or trailers callback lets the data through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Let it through.
    Continue,
    /// Hold it: the request waits for the store.
    Pause,
}

/// What a stream knows of gRPC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrpcCall {
    /// The request is gRPC (known for a refused request and for one routed by selection).
    pub request: bool,
    /// The `grpc-status` the response ended with, once read.
    pub status: Option<GrpcStatus>,
}

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
    reserved_reported: RefCell<Vec<u64>>,
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
    watchdog_state: RefCell<WorkerState>,
    /// The configuration was replaced or its root context retired ([`Filter::retire`]): streams
    /// that still finish under it write their outcomes at once.
    retired: Cell<bool>,
    /// The log said that a response came compressed (it says so once).
    said_compressed: Cell<bool>,
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
    rules: Vec<bool>,
    /// Some rule is.
    any_rule: bool,
    /// Load shedding (in-flight and loop lag).
    shedding: bool,
    /// The per-key cap.
    per_key: bool,
    /// Partitions.
    partition: bool,
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

/// A request's state, from its request headers to the end of its stream.
#[derive(Debug, Default)]
pub struct Stream {
    /// Its unit of the proxy-wide in-flight count (`load_shedding.max_active_requests`).
    permit: Option<Permit>,
    /// Its unit of its key's cap (`load_shedding.per_key`).
    key_permit: Option<KeyPermit>,
    /// The chosen cluster's permit.
    cluster_permit: Option<ClusterPermit>,
    /// The units it took of the leased rules' keys.
    leased: Taken,
    /// What it waits on while it is paused, and what it holds meanwhile (one thing at a time).
    wait: Option<Wait>,
    /// For an admitted request: the tightest rule and its `ratelimit` value.
    fields: Option<Tightest>,
    /// Costs it still owes its rules (a streamed body, a reported count).
    charges: Charges,
    /// It was answered locally.
    replied: bool,
    /// The stream ended (`end`).
    ended: bool,
    /// Whether it is gRPC, and the status its response ended with.
    grpc: GrpcCall,
    /// When the request ended and the response headers came (with a cluster permit): the
    /// upstream's latency, which decides "slow".
    timing: Timing,
    /// How the request was decided, for the access log.
    decision: Decision,
    /// What the estimates its rules read in its body (`cost.estimate.body`) found, once read
    /// (while they are read, its wait holds them: [`Wait::Body`]).
    estimates: Option<Box<BodyEstimates>>,
    /// With cluster selection, the rules' keys that counted the admitted request, and when:
    /// given back if selection refuses it.
    counted: Option<(Vec<Probe>, UnixMillis)>,
}

/// A stream's state as its host context and the leased stage's waiting lists share it.
pub type SharedStream = Rc<RefCell<Stream>>;

/// A stream's state as its host context holds it: its own, until the leased stage parks the
/// request ([`StreamCell::share`]); shared with the waiting list from then on. Most requests
/// never wait, and their state is never allocated on its own.
#[derive(Debug)]
// Inline on purpose: the host context that holds it is on the heap already.
#[allow(clippy::large_enum_variant)]
pub enum StreamCell {
    /// Held by the host context alone.
    Own(RefCell<Stream>),
    /// Shared with the leased stage.
    Shared(SharedStream),
}

impl Default for StreamCell {
    fn default() -> StreamCell {
        StreamCell::Own(RefCell::default())
    }
}

impl std::ops::Deref for StreamCell {
    type Target = RefCell<Stream>;

    fn deref(&self) -> &RefCell<Stream> {
        match self {
            StreamCell::Own(stream) => stream,
            StreamCell::Shared(stream) => stream,
        }
    }
}

impl StreamCell {
    /// The state, shared from now on (moved out of the host context the first time).
    pub fn share(&mut self) -> SharedStream {
        let shared = match self {
            StreamCell::Shared(stream) => return Rc::clone(stream),
            StreamCell::Own(stream) => Rc::new(RefCell::new(std::mem::take(stream.get_mut()))),
        };
        *self = StreamCell::Shared(Rc::clone(&shared));
        shared
    }
}

/// The request headers came: runs the pipeline, or, when a rule that applies reads its
/// estimate in the request's body, waits for the body ([`request_body_estimates`] decides).
#[allow(clippy::too_many_arguments)]
pub fn request_headers<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    context: u32,
    request: &R,
    end_of_stream: bool,
    rng: &mut G,
) -> Step {
    filter.serving(env);
    // The stage exists only where some rule reads its estimate in request bodies.
    if !end_of_stream && filter.body_waits.as_ref().is_some_and(|s| !s.withheld()) {
        if let Some(estimates) = filter.rules.body_estimates(request) {
            // Nothing is taken yet: a client that goes away now leaves nothing behind.
            cell.borrow_mut().wait = Some(Wait::Body(Box::new(estimates)));
            if let Some(stage) = &filter.body_waits {
                stage.park(env.clock.now().mono, context, cell.share());
            }
            return Step::Wait;
        }
    }
    decide(filter, env, cell, context, request, end_of_stream, rng)
}

/// For a request that waits for its body's estimates, the bytes of the body (of `body_size`
/// bytes held so far) to read next: from `start`, `len` bytes (`len` 0: none, the bound is
/// reached); `None` when the request does not wait for them.
pub fn estimate_wants(cell: &StreamCell, body_size: usize) -> Option<(usize, usize)> {
    let stream = cell.borrow();
    let Some(Wait::Body(estimates)) = stream.wait.as_ref().filter(|_| !stream.ended) else { return None };
    Some(estimates.wants(body_size).unwrap_or((body_size, 0)))
}

/// The next bytes of the request body (`chunk`, those [`estimate_wants`] asked; `body_size`
/// bytes held so far, `None` for the request trailers: as before; `end`: the body ended) of a
/// request that waits for its estimates: once they are known (or the body ended, or the bound
/// is reached), the pipeline decides the request, and the body held so far goes on with it
/// (`Some(step)`); `None`: it waits on.
#[allow(clippy::too_many_arguments)]
pub fn request_body_estimates<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    context: u32,
    request: &R,
    chunk: &[u8],
    body_size: Option<usize>,
    end: bool,
    rng: &mut G,
) -> Option<Step> {
    let body_size = {
        let mut stream = cell.borrow_mut();
        let Some(Wait::Body(estimates)) = stream.wait.as_mut() else { return None };
        estimates.hold(body_size.unwrap_or_default());
        if !chunk.is_empty() {
            if let Some(stage) = &filter.body_waits {
                stage.body_arrived();
            }
        }
        let rules = &filter.rules;
        if !estimates.feed(chunk, end, |rule| rules.estimate_places(rule)) {
            return None;
        }
        let held = estimates.held();
        stream.estimates_read(false);
        held
    };
    let step = decide(filter, env, cell, context, request, false, rng);
    if !matches!(step, Step::Reply(_)) {
        // The body held so far: it waits on with the request (for the store, its turn or a
        // slot), or is counted now.
        let _ = cell.borrow_mut().request_body(filter, env, body_size, end);
    }
    Some(step)
}

/// The pipeline's stages, in the order a request meets them (the module doc's diagram;
/// `floodgate explain` tells a request's path in this order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The health endpoint and the watchdog's liveness path, answered by the filter itself.
    Endpoints,
    /// Load shedding: the loop lag, then the proxy-wide in-flight count, by priority class.
    Shed,
    /// The load-leveling queue: a request the in-flight count would shed waits for a slot.
    Queue,
    /// The per-key in-flight cap (the bulkhead).
    Cap,
    /// Leased global rules: units the store lends ahead of use.
    Leased,
    /// The rate-limit rules (local, and batched global ones).
    RateLimit,
    /// A token bucket's delay instead of refusal: the request waits for its turn.
    Delay,
    /// Cluster selection.
    Select,
}

impl Stage {
    /// Every stage, in order.
    pub const ORDER: [Stage; 8] =
        [Stage::Endpoints, Stage::Shed, Stage::Queue, Stage::Cap, Stage::Leased, Stage::RateLimit, Stage::Delay, Stage::Select];
}

/// What a paused request waits for. A stage that makes a request wait parks its stream where
/// that comes from; the shell, told it came, checks [`Stream::waits_for`] and then [`resume`]s
/// the request from its own context, or [`abandon`]s it when that context is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Units of a leased rule's key (the `leased` stage; the store's answer).
    Store,
    /// Its turn (the `delay` stage; the root's tick).
    Turn,
    /// A slot (the `queue` stage; a freed slot or the root's tick).
    Slot,
    /// Its body, none of which came in time (an estimate read from the body; the root's tick).
    Body,
    /// The answer to its ask (a batched global rule's key; the store's answer).
    Asked,
}

/// What a paused request waits on, holding what that kind of wait holds: a stream has one
/// ([`Stream`]), so it waits on one thing at a time, and what it holds goes back once, taken
/// out of it ([`resume`], [`abandon`], [`Stream::end`]).
#[derive(Debug)]
enum Wait {
    /// Units of a leased rule's key: its keys, and the units it wants.
    Store(StoreWait),
    /// Its turn: the turns it took of token buckets.
    Turn(Delayed),
    /// A slot: its ticket, and, once the wait is over, how it ended.
    Slot(Queued),
    /// Its body: the estimates read in it so far (none done).
    Body(Box<BodyEstimates>),
    /// The answer to its ask, then its decision with the answer.
    Asked(asked::Asking),
}

impl Wait {
    /// Its kind.
    fn kind(&self) -> Waiting {
        match self {
            Wait::Store(_) => Waiting::Store,
            Wait::Turn(_) => Waiting::Turn,
            Wait::Slot(_) => Waiting::Slot,
            Wait::Body(_) => Waiting::Body,
            Wait::Asked(_) => Waiting::Asked,
        }
    }

    /// Whether it holds something to give back when the stream ends: units wanted of a leased
    /// key, turns, a ticket. One for its body or its ask holds nothing yet (its ask's answer is
    /// still learned: [`asked`]).
    fn holds(&self) -> bool {
        matches!(self, Wait::Store(_) | Wait::Turn(_) | Wait::Slot(_))
    }

    /// The request body that comes while it waits, held (`None`: the body is read, waiting for
    /// its estimates).
    fn body(&mut self) -> Option<&mut (usize, bool)> {
        match self {
            Wait::Store(wait) => Some(&mut wait.body),
            Wait::Turn(delayed) => Some(&mut delayed.body),
            Wait::Slot(queued) => Some(&mut queued.body),
            Wait::Asked(asking) => Some(&mut asking.body),
            Wait::Body(_) => None,
        }
    }
}

/// A paused request whose `what` came (its stream `context`, made the host's effective
/// context): the rest of its pipeline from where it waited, and the body that came meanwhile.
/// [`Step::Wait`] when it waits on (for the same or the next thing).
pub fn resume<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    shared: &SharedStream,
    context: u32,
    request: &R,
    rng: &mut G,
    what: Waiting,
) -> Step {
    match what {
        Waiting::Store => resume_store(filter, env, shared, context, request, rng),
        Waiting::Turn => resume_turn(filter, env, shared, request, rng),
        Waiting::Slot => resume_slot(filter, env, shared, context, request, rng),
        Waiting::Body => resume_body(filter, env, shared, context, request, rng),
        Waiting::Asked => resume_asked(filter, env, shared, context, request, rng),
    }
}

/// A paused request whose `what` came and whose host context is gone: it will never be
/// decided, and what it holds goes back (units of a leased key, the turns it took, a queue
/// slot). One waiting for its body or its ask holds nothing yet (a grant its ask took stays
/// counted: the fleet admits less, never more).
pub fn abandon<H: Host>(filter: &Filter, env: &Env<'_, H>, shared: &SharedStream, what: Waiting) {
    match what {
        Waiting::Store => abandon_store(filter, env, shared),
        Waiting::Turn => abandon_turn(filter, env, shared),
        Waiting::Slot => abandon_slot(filter, env, shared),
        Waiting::Body | Waiting::Asked => {}
    }
}

/// A request none of whose body reached the filter in time (its stream `context`, made the
/// host's effective context): decided without its body, on its rules' `estimate.default`.
fn resume_body<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    shared: &SharedStream,
    context: u32,
    request: &R,
    rng: &mut G,
) -> Step {
    {
        let mut stream = shared.borrow_mut();
        if !stream.body_never_came() {
            return Step::Wait;
        }
        stream.estimates_read(true);
    }
    let mut cell = StreamCell::Shared(Rc::clone(shared));
    decide(filter, env, &mut cell, context, request, false, rng)
}

/// Runs the pipeline on the request headers.
#[allow(clippy::too_many_arguments)]
fn decide<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    context: u32,
    request: &R,
    end_of_stream: bool,
    rng: &mut G,
) -> Step {
    let now = env.clock.now();
    let mut stream = cell.borrow_mut();
    let reply = stream.endpoints(filter, env, request, now.mono).or_else(|| stream.shed(filter, env, request, end_of_stream, now.mono));
    if let Some(Wait::Slot(queued)) = &stream.wait {
        // The queue stage: it waits for a slot; its state is shared from now on.
        let queued = queued.clone();
        drop(stream);
        if let Some(stage) = &filter.queue {
            stage.park(&queued, context, cell.share());
        }
        return Step::Wait;
    }
    drop(stream);
    after_shed(filter, env, cell, context, request, end_of_stream, reply, rng, now)
}

/// The pipeline after the `shed` stage (`reply`: a refusal so far, if any): `cap → leased →
/// rate_limit → delay → select`, parking the stream where a stage makes it wait.
#[allow(clippy::too_many_arguments)]
fn after_shed<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    context: u32,
    request: &R,
    end_of_stream: bool,
    reply: Option<Reply>,
    rng: &mut G,
    now: Now,
) -> Step {
    let mut stream = cell.borrow_mut();
    let mut reply = reply.or_else(|| stream.cap(filter, env, request, now.mono));
    if let (None, Some(stage)) = (&reply, &filter.leased) {
        let probes = stage.probes(filter, env.metrics, request, stream.estimates.as_deref());
        if !probes.is_empty() {
            match stage.admit(filter, env.store, env.metrics, &probes, context, now) {
                leased::Admission::All(taken) => stream.took(taken),
                leased::Admission::Refused(refusal) => reply = Some(stream.leased_refusal(refusal)),
                leased::Admission::Wait(key, units) => {
                    stream.wait = Some(Wait::Store(StoreWait { probes, since: now.mono, on: (key, units), end_of_stream, body: (0, false) }));
                    drop(stream);
                    stage.park(key, context, cell.share());
                    return Step::Wait;
                }
            }
        }
    }
    let step = stream.finish_headers(filter, env, request, end_of_stream, reply, rng, now);
    if let (Step::Wait, Some(asks), Some(stage)) = (&step, stream.pending_asks(), &filter.asks) {
        drop(stream);
        stage.park(context, cell.share(), &asks);
        return Step::Wait;
    }
    // A request the `delay` stage holds waits for its turn: its state is shared from now on.
    let until = match &stream.wait {
        Some(Wait::Turn(delayed)) if step == Step::Wait => Some(delayed.until),
        _ => None,
    };
    drop(stream);
    if let (Some(until), Some(stage)) = (until, &filter.delays) {
        stage.park(until, context, cell.share());
    }
    step
}

/// A request whose turn came (its stream `context`, made the host's effective context): the
/// rest of its pipeline after the `delay` stage, and the body that came while it waited.
fn resume_turn<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    shared: &SharedStream,
    request: &R,
    rng: &mut G,
) -> Step {
    let mut stream = shared.borrow_mut();
    let Some(Wait::Turn(delayed)) = stream.take_wait(Waiting::Turn).filter(|_| !stream.ended) else { return Step::Wait };
    let now = env.clock.now();
    stream.decision.delayed(By::Rule(delayed.rule), now.mono.saturating_since(delayed.since));
    let step = stream.finish_selected(filter, env, request, delayed.end_of_stream, None, false, rng, now);
    stream.body_held(filter, env, delayed.body);
    step
}

/// A request whose turn came and whose host context is gone: its turns go back.
fn abandon_turn<H: Host>(filter: &Filter, env: &Env<'_, H>, shared: &SharedStream) {
    let mut stream = shared.borrow_mut();
    if let Some(Wait::Turn(delayed)) = stream.take_wait(Waiting::Turn) {
        stream.give_back_turns(filter, env, &delayed);
    }
}

/// A request whose wait for a slot is over (its stream `context`, made the host's effective
/// context): admitted, the rest of its pipeline after the `shed` stage; its wait ended, the
/// shed `503`. Then the body that came while it waited.
fn resume_slot<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    shared: &SharedStream,
    context: u32,
    request: &R,
    rng: &mut G,
) -> Step {
    let now = env.clock.now();
    let (queued, reply) = {
        let mut stream = shared.borrow_mut();
        let over = |wait: &mut Wait| matches!(wait, Wait::Slot(queued) if queued.ready.is_some());
        let Some(Wait::Slot(queued)) = stream.wait.take_if(over).filter(|_| !stream.ended) else { return Step::Wait };
        let waited_ms = now.mono.saturating_since(queued.since);
        stream.decision.waited_ms = Some(waited_ms);
        stats::set(env.metrics, filter.stats.shedding.queue_wait_ms, waited_ms);
        let reply = match queued.ready {
            Some(Ready::Admitted) => None,
            _ => stream.wait_ended(filter, env, &queued, waited_ms, now.mono),
        };
        (queued, reply)
    };
    let mut cell = StreamCell::Shared(Rc::clone(shared));
    let step = after_shed(filter, env, &mut cell, context, request, queued.end_of_stream, reply, rng, now);
    shared.borrow_mut().carry_body(filter, env, &step, queued.body);
    step
}

/// A request whose wait for a slot is over and whose host context is gone: the slot it was
/// given goes back.
fn abandon_slot<H: Host>(filter: &Filter, env: &Env<'_, H>, shared: &SharedStream) {
    let mut stream = shared.borrow_mut();
    if stream.take_wait(Waiting::Slot).is_some() {
        let now = env.clock.now().mono;
        stream.release(filter, env, now);
    }
}

/// A request the leased stage woke (its stream `context`, made the host's effective context):
/// takes its units again; decided, runs the rest of its pipeline; still short of units, waits
/// again.
fn resume_store<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    shared: &SharedStream,
    context: u32,
    request: &R,
    rng: &mut G,
) -> Step {
    let Some(stage) = &filter.leased else { return Step::Wait };
    let now = env.clock.now();
    let mut stream = shared.borrow_mut();
    let Some(Wait::Store(wait)) = stream.take_wait(Waiting::Store) else { return Step::Wait };
    let reply = match stage.decide(filter, env.store, env.metrics, &wait, now) {
        leased::Admission::All(taken) => {
            stream.took(taken);
            None
        }
        leased::Admission::Refused(refusal) => Some(stream.leased_refusal(refusal)),
        leased::Admission::Wait(key, units) => {
            stream.wait = Some(Wait::Store(StoreWait { on: (key, units), ..wait }));
            drop(stream);
            stage.park(key, context, Rc::clone(shared));
            return Step::Wait;
        }
    };
    let step = stream.finish_headers(filter, env, request, wait.end_of_stream, reply, rng, now);
    stream.carry_body(filter, env, &step, wait.body);
    stream.park(filter, context, shared, step)
}

/// A request whose ask was answered (its stream `context`, made the host's effective context):
/// decided again with the answer, then the rest of its pipeline.
fn resume_asked<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    shared: &SharedStream,
    context: u32,
    request: &R,
    rng: &mut G,
) -> Step {
    let now = env.clock.now();
    let mut stream = shared.borrow_mut();
    if !stream.ask_answered() {
        return Step::Wait;
    }
    let Some(Wait::Asked(asking)) = stream.wait.as_mut() else { return Step::Wait };
    let (end_of_stream, body) = (asking.end_of_stream, std::mem::take(&mut asking.body));
    let step = stream.finish_headers(filter, env, request, end_of_stream, None, rng, now);
    stream.carry_body(filter, env, &step, body);
    stream.park(filter, context, shared, step)
}

/// A woken request whose host context is gone: it will never be decided.
fn abandon_store<H: Host>(filter: &Filter, env: &Env<'_, H>, shared: &SharedStream) {
    let mut stream = shared.borrow_mut();
    if let (Some(Wait::Store(wait)), Some(stage)) = (stream.take_wait(Waiting::Store), &filter.leased) {
        stage.abandon(env.store, &wait, env.clock.now());
    }
}

impl Stream {
    /// How the request was decided (complete once a step other than [`Step::Wait`] came).
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// A request the `delay` stage holds (`step` is [`Step::Wait`] and it waits for its turn)
    /// is parked there under its stream `context`; returns `step`.
    fn park(&self, filter: &Filter, context: u32, shared: &SharedStream, step: Step) -> Step {
        if let (Step::Wait, Some(stage), Some(Wait::Turn(delayed))) = (&step, &filter.delays, &self.wait) {
            stage.park(delayed.until, context, Rc::clone(shared));
        }
        if let (Step::Wait, Some(stage), Some(asks)) = (&step, &filter.asks, self.pending_asks()) {
            stage.park(context, Rc::clone(shared), &asks);
        }
        step
    }

    /// The keys it asks the store for, while it waits for the answer.
    fn pending_asks(&self) -> Option<Vec<crate::fleet::batched::ask::KeyAsk>> {
        self.asking().filter(|a| a.outcomes.is_none()).map(|a| a.asks.clone())
    }

    /// Its ask, while it waits for the answer and then to be decided with it.
    fn asking(&self) -> Option<&asked::Asking> {
        match &self.wait {
            Some(Wait::Asked(asking)) => Some(asking),
            _ => None,
        }
    }

    /// Takes its wait out, if it waits for `what`.
    fn take_wait(&mut self, what: Waiting) -> Option<Wait> {
        self.wait.take_if(|wait| wait.kind() == what)
    }

    /// Whether it still waits for `what`, and what it waits for came (and it has not ended):
    /// the shell resumes only those.
    pub fn waits_for(&self, what: Waiting) -> bool {
        if self.ended {
            return false;
        }
        match (&self.wait, what) {
            (Some(Wait::Store(_)), Waiting::Store) | (Some(Wait::Turn(_)), Waiting::Turn) => true,
            (Some(Wait::Slot(queued)), Waiting::Slot) => queued.ready.is_some(),
            (Some(Wait::Body(estimates)), Waiting::Body) => !estimates.started(),
            (Some(Wait::Asked(asking)), Waiting::Asked) => !self.replied && asking.outcomes.is_some(),
            _ => false,
        }
    }

    /// Whether its ask was answered and it waits to be decided again.
    pub fn ask_answered(&self) -> bool {
        self.waits_for(Waiting::Asked)
    }

    /// The body that came while the request waited (bytes, and whether it ended), counted now
    /// that it goes on.
    fn body_held<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, (bytes, ended): (usize, bool)) {
        if self.charges.counts_body() && bytes > 0 {
            self.charges.body(bytes);
        }
        if ended && self.charges.counts_body() {
            let owed = self.charges.body_done();
            self.charge(filter, env, owed);
        }
    }

    /// The body that came while the request waited (bytes, and whether it ended), now that it
    /// is decided (`step`): it waits on with the request if the request waits again (for the
    /// store or its turn), else it is counted.
    fn carry_body<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, step: &Step, body: (usize, bool)) {
        match (step, &mut self.wait) {
            (Step::Wait, Some(Wait::Store(wait))) => wait.body = body,
            (Step::Wait, Some(Wait::Turn(delayed))) => delayed.body = body,
            _ => self.body_held(filter, env, body),
        }
    }

    /// The turns a request waiting for its turn took go back (its client went away).
    fn give_back_turns<H: Host>(&self, filter: &Filter, env: &Env<'_, H>, delayed: &Delayed) {
        for probe in &delayed.turns {
            filter.limiter.give_back_turn(env.store, *probe);
            increment(env.metrics, filter.stats.rule(probe.rule).delay_abandoned);
        }
    }

    /// Whether it waits for the body its estimate is read from, none of which came yet.
    pub fn body_never_came(&self) -> bool {
        self.waits_for(Waiting::Body)
    }

    /// Its body's estimates are read (`give_up`: none is, as none of the body came): its wait
    /// for them is over, and what they found stays with the request.
    fn estimates_read(&mut self, give_up: bool) {
        if let Some(Wait::Body(mut estimates)) = self.take_wait(Waiting::Body) {
            if give_up {
                estimates.give_up();
            }
            self.estimates = Some(estimates);
        }
    }

    /// When it goes, while it waits for its turn.
    pub fn delayed_until(&self) -> Option<MonoMillis> {
        match &self.wait {
            Some(Wait::Turn(delayed)) if !self.ended => Some(delayed.until),
            _ => None,
        }
    }

    /// The body slot of a request that waits (for the store, its turn, a slot, or its ask's
    /// answer and its decision with it).
    fn held_body(&mut self) -> Option<&mut (usize, bool)> {
        if self.ended {
            return None;
        }
        self.wait.as_mut().and_then(Wait::body)
    }

    /// The leased rules took the request's units (shadow rules that would have refused it
    /// took none).
    fn took(&mut self, taken: Taken) {
        for standing in &taken.shadowed {
            self.decision.shadow(By::Rule(standing.rule), Some(standing));
        }
        self.leased = taken;
    }

    /// A leased rule refused the request.
    fn leased_refusal(&mut self, refusal: leased::Refused) -> Reply {
        self.decision.refused(decision::Outcome::Refused, By::Rule(refusal.rule), refusal.standing.as_ref());
        refusal.reply
    }

    /// When it started to wait for the store, while it waits.
    pub fn waiting_since(&self) -> Option<MonoMillis> {
        match &self.wait {
            Some(Wait::Store(wait)) if !self.ended => Some(wait.since),
            _ => None,
        }
    }

    /// Whether it holds anything a stage gave it (for tests and the host's checks).
    pub fn holds_permits(&self) -> bool {
        self.permit.is_some() || self.key_permit.is_some() || self.cluster_permit.is_some()
    }

    /// The rest of the pipeline after the `leased` stage (`reply`: a refusal so far, if any):
    /// `rate_limit → delay → select`, then the local reply or the request goes on; or it
    /// waits for its turn ([`Step::Wait`], the stream to park in the `delay` stage). A later
    /// stage's refusal gives the leased units back.
    #[allow(clippy::too_many_arguments)]
    fn finish_headers<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
        &mut self,
        filter: &Filter,
        env: &Env<'_, H>,
        request: &R,
        end_of_stream: bool,
        reply: Option<Reply>,
        rng: &mut G,
        now: Now,
    ) -> Step {
        let refused_before = reply.is_some();
        let reply = reply.or_else(|| self.rate_limit(filter, env, request, now.wall));
        match self.wait.as_mut() {
            Some(Wait::Asked(asking)) if asking.outcomes.is_none() => {
                // It waits for its ask's answer ([`asked`]).
                asking.end_of_stream = end_of_stream;
                return Step::Wait;
            }
            // Decided with the answer: its wait is over.
            Some(Wait::Asked(_)) => self.wait = None,
            _ => {}
        }
        if let (None, Some(Wait::Turn(delayed))) = (&reply, self.wait.as_mut()) {
            // The delay stage: it goes at its turn.
            delayed.until = now.mono.plus_ms(delayed.go_at.saturating_since(now.wall));
            delayed.since = now.mono;
            delayed.end_of_stream = end_of_stream;
            return Step::Wait;
        }
        self.finish_selected(filter, env, request, end_of_stream, reply, refused_before, rng, now)
    }

    /// The rest of the pipeline after the `delay` stage (`reply`: a refusal so far, if any;
    /// `refused_before`: by a stage before `rate_limit`): `select`, then the local reply or the
    /// request goes on. A later stage's refusal gives the leased units back.
    #[allow(clippy::too_many_arguments)]
    fn finish_selected<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
        &mut self,
        filter: &Filter,
        env: &Env<'_, H>,
        request: &R,
        end_of_stream: bool,
        reply: Option<Reply>,
        refused_before: bool,
        rng: &mut G,
        now: Now,
    ) -> Step {
        let mut route = None;
        let reply = reply
            .or_else(|| match self.select(filter, env, request, rng, now.mono) {
                Ok(chosen) => {
                    route = chosen;
                    self.decision.cluster = chosen;
                    None
                }
                Err(reply) => Some(reply),
            });
        if let (Some(stage), false, true) = (&filter.leased, refused_before, reply.is_some()) {
            stage.untake(env.store, &std::mem::take(&mut self.leased));
        }
        if reply.is_some() {
            self.give_back_counted(filter, env, now.wall);
        }
        if reply.is_none() {
            // The leased rules' reservations settle when the upstream reports.
            for (probe, later, limit) in std::mem::take(&mut self.leased.owed) {
                self.charges.owe(probe, later, limit, now.wall);
            }
        }
        if reply.as_ref().is_some_and(|r| r.refusal.is_some()) || self.cluster_permit.is_some() {
            self.grpc.request = grpc::is_grpc(request.get("content-type").as_deref());
        }
        match reply {
            Some(reply) => Step::Reply(self.reply(filter, env, reply, now.mono)),
            None => {
                if end_of_stream && self.cluster_permit.is_some() {
                    self.timing.request_end = Some(now.mono);
                }
                if end_of_stream && self.charges.counts_body() {
                    // No body: nothing to count.
                    let _ = self.charges.body_done();
                }
                Step::Continue { route }
            }
        }
    }

    /// The reply, in the request's protocol. A refused request gives its permits back at once:
    /// it never reaches an upstream, and a client that reads its refusal slowly (an HTTP/2
    /// client withholding flow-control credit) must not hold a unit of the proxy's capacity
    /// meanwhile.
    fn reply<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, reply: Reply, now: MonoMillis) -> LocalReply {
        self.release(filter, env, now);
        self.replied = true;
        match grpc::reply(&reply, &filter.config.grpc).filter(|_| self.grpc.request) {
            Some(grpc) => LocalReply::Grpc(grpc),
            None => LocalReply::Http(reply.with_exact_wait()),
        }
    }

    /// The paths the filter answers itself, if this request is for one: a `GET` or `HEAD` of
    /// the health endpoint's or the watchdog's path. Other methods on those paths are ordinary
    /// requests (they go on to the upstream, through the other stages). Without either, nothing
    /// is read; with them, `:path` is (one lookup, and one comparison per path).
    fn endpoints<H: Host, R: Request + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, request: &R, now: MonoMillis) -> Option<Reply> {
        if filter.config.health.is_none() && filter.watchdog.is_none() {
            return None;
        }
        let path = request.get(":path")?;
        let path = KeyPart::Path.normalize(&path);
        let health = filter.config.health.as_ref().filter(|h| path == h.path.as_bytes());
        let dog = filter.watchdog.as_ref().filter(|w| health.is_none() && path == w.path.as_bytes());
        if health.is_none() && dog.is_none() {
            return None;
        }
        // Read only for those paths (one host call there, none on the common path).
        let method = request.get(":method")?;
        if !replies::is_health_method(&method) {
            return None;
        }
        if let Some(dog) = dog {
            let verdict = dog.verdict(env.store, now);
            if !verdict.alive() {
                log::warn!("floodgate: the watchdog fails liveness: {verdict:?}");
            }
            self.decision.outcome = decision::Outcome::Watchdog;
            return Some(replies::liveness(dog, &verdict));
        }
        self.health(filter, env, now)
    }

    /// The health endpoint's answer: the proxy-wide in-flight count (and queue), this worker's
    /// loop lag, and, when configured, the clusters.
    fn health<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, now: MonoMillis) -> Option<Reply> {
        let health = filter.config.health.as_ref()?;
        let in_flight = filter.shedder.as_ref().map(|s| (s, s.in_flight(env.store, env.vm, &filter.local, now)));
        let lag = filter.lag.as_ref().map(|lag| {
            let lag = lag.borrow();
            let default_class = filter.classes.as_ref().map_or(0, |c| c.default_class);
            replies::LagStatus {
                lag_ms: lag.lag_ms(),
                max_loop_lag_ms: lag.max_loop_lag_ms(),
                sheds_default_class: lag.sheds(default_class).is_some(),
                shedding: lag.is_shedding(),
            }
        });
        let dependencies = match (health.dependencies, filter.selector.as_ref()) {
            (Dependencies::Off, _) | (_, None) => None,
            (mode, Some(selector)) => {
                let states = selector.states(env.store, &filter.selection_vm.borrow(), now);
                let clusters = selector
                    .clusters
                    .iter()
                    .zip(states)
                    .filter_map(|(cluster, state)| {
                        let state = state?;
                        Some(replies::ClusterHealth {
                            name: cluster.name.as_str().to_owned(),
                            success_rate: state.success_rate,
                            limit: state.limit,
                            in_flight: state.in_flight,
                        })
                    })
                    .collect();
                Some(replies::DependencyView { fail: mode == Dependencies::Fail, min_success_rate: health.min_success_rate.get(), clusters })
            }
        };
        let queued = filter.queue.as_ref().map(|stage| stage.waiting(env, now));
        Some(replies::health(&replies::LocalLoad { in_flight, queued, lag }, dependencies.as_ref()))
            .inspect(|_| self.decision.outcome = decision::Outcome::Health)
    }

    /// Load shedding: on this worker's loop lag, then on the proxy-wide in-flight count (taking
    /// a permit); returns the 503 of either. With a queue, a request the in-flight count would
    /// shed, or that finds a waiter ahead of it, waits instead (`queued` set) while its class's
    /// queue has room.
    fn shed<H: Host, R: Request + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, request: &R, end_of_stream: bool, now: MonoMillis) -> Option<Reply> {
        let classes = filter.classes.as_ref()?;
        let value = request.get(&classes.priority_header);
        let class = classes.class_of(value.as_deref());
        let retry_after = || filter.config.load_shedding.as_ref().map_or(1, |s| s.retry_after.ceil_secs().max(1));
        let shadow = filter.shadows.shedding;
        if let Some(lag) = &filter.lag {
            let lag = lag.borrow();
            if let Some(shed) = lag.sheds(class) {
                if shadow {
                    // Shed requests hold no permit: neither does this one.
                    increment(env.metrics, filter.stats.class(class).shadow_shed);
                    self.decision.shadow(By::LoopLag, None);
                    return None;
                }
                increment(env.metrics, filter.stats.class(class).shed);
                increment(env.metrics, filter.stats.class(class).shed_by_lag);
                log::debug!("floodgate: shed for the loop lag {shed:?}");
                self.decision.refused(decision::Outcome::Shed, By::LoopLag, None);
                return Some(replies::shed_by_lag(classes, &lag, &shed, retry_after()));
            }
        }
        let shedder = filter.shedder.as_ref()?;
        let queue = filter.queue.as_ref().filter(|_| !shadow);
        if let Some(stage) = queue.filter(|stage| stage.must_wait(env, class, now)) {
            // Waiters come first: it waits behind them.
            let in_flight = || shedder.in_flight(env.store, env.vm, &filter.local, now);
            return self.wait_for_slot(filter, env, stage, class, end_of_stream, in_flight, now);
        }
        match shedder.try_acquire(env.store, env.vm, &filter.local, class, now) {
            Ok(permit) => {
                self.permit = Some(permit);
                None
            }
            Err(shed) => {
                if shed.contention {
                    increment(env.metrics, filter.stats.shedding.contention);
                }
                if shadow {
                    increment(env.metrics, filter.stats.class(class).shadow_shed);
                    self.decision.shadow(By::InFlight, None);
                    return None;
                }
                if let Some(stage) = queue.filter(|_| !shed.contention) {
                    return self.wait_for_slot(filter, env, stage, class, end_of_stream, || shed.in_flight, now);
                }
                increment(env.metrics, filter.stats.class(class).shed);
                log::debug!("floodgate: shed {shed:?}");
                self.decision.refused(decision::Outcome::Shed, By::InFlight, None);
                Some(replies::shed(shedder, &shed))
            }
        }
    }

    /// Load leveling: the request takes a ticket of its class and waits for a slot (`None`), or,
    /// its class's queue full, is shed (`in_flight`: the count, for the reply).
    #[allow(clippy::too_many_arguments)]
    fn wait_for_slot<H: Host>(
        &mut self,
        filter: &Filter,
        env: &Env<'_, H>,
        stage: &QueueStage,
        class: usize,
        end_of_stream: bool,
        in_flight: impl FnOnce() -> u32,
        now: MonoMillis,
    ) -> Option<Reply> {
        let shedder = filter.shedder.as_ref()?;
        match stage.enter(filter, env, class, end_of_stream, now) {
            Ok(queued) => {
                log::debug!("floodgate: waits for a slot {:?}", queued.ticket);
                self.wait = Some(Wait::Slot(queued));
                None
            }
            Err(no_room) => {
                let contention = no_room == crate::shedding::queue::NoRoom::Contention;
                if contention {
                    increment(env.metrics, filter.stats.shedding.contention);
                }
                increment(env.metrics, filter.stats.class(class).shed);
                let shed = crate::shedding::Shed { in_flight: in_flight(), class, contention };
                log::debug!("floodgate: shed, no room to wait ({no_room:?}) {shed:?}");
                self.decision.refused(decision::Outcome::Shed, By::InFlight, None);
                Some(replies::shed(shedder, &shed))
            }
        }
    }

    /// A waiting request's wait is over (`ready`; with a slot, its in-flight `permit`): the
    /// host resumes it next ([`Waiting::Slot`]).
    pub(crate) fn wait_over(&mut self, ready: Ready, permit: Option<Permit>) {
        if let Some(Wait::Slot(queued)) = self.wait.as_mut() {
            queued.ready = Some(ready);
        }
        if permit.is_some() {
            self.permit = permit;
        }
    }

    /// Whether its wait for a slot is over and it awaits its resumption.
    pub fn slot_decided(&self) -> bool {
        self.waits_for(Waiting::Slot)
    }

    /// A request's wait for a slot ended without one (`waited_ms` long): the shed `503`.
    fn wait_ended<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, queued: &Queued, waited_ms: u64, now: MonoMillis) -> Option<Reply> {
        let shedder = filter.shedder.as_ref()?;
        let class = queued.ticket.class;
        increment(env.metrics, filter.stats.class(class).shed);
        let shed = crate::shedding::Shed { in_flight: shedder.in_flight(env.store, env.vm, &filter.local, now), class, contention: false };
        log::debug!("floodgate: shed after waiting {waited_ms} ms {shed:?}");
        self.decision.refused(decision::Outcome::Shed, By::InFlight, None);
        Some(replies::shed_after_wait(shedder, &shed, waited_ms))
    }

    /// The per-key cap: takes a unit of the request's key's in-flight cap, or returns its 503.
    /// A request without the key is not capped.
    fn cap<H: Host, R: Request + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, request: &R, now: MonoMillis) -> Option<Reply> {
        let cap = filter.per_key.as_ref()?;
        let Some(key) = keys::hash_key(&cap.key, &filter.hasher, |source| request.fetch(source)) else {
            increment(env.metrics, filter.stats.shedding.per_key_unkeyed);
            return None;
        };
        match cap.try_acquire(env.store, env.vm, &filter.key_counts, key, now) {
            Ok(permit) => {
                self.key_permit = Some(permit);
                None
            }
            Err(refusal) => {
                if filter.shadows.per_key {
                    increment(env.metrics, filter.stats.shedding.per_key_shadow_refused);
                    self.decision.shadow(By::PerKey, None);
                    return None;
                }
                increment(
                    env.metrics,
                    match refusal {
                        CapRefusal::Full { .. } => filter.stats.shedding.per_key_refused,
                        CapRefusal::Untracked => filter.stats.shedding.per_key_untracked,
                    },
                );
                log::debug!("floodgate: per-key cap {refusal:?}");
                self.decision.refused(decision::Outcome::Capped, By::PerKey, None);
                let retry_after = filter.config.load_shedding.as_ref().map_or(1, |s| s.retry_after.ceil_secs().max(1));
                Some(replies::per_key_capped(cap, &refusal, retry_after))
            }
        }
    }

    /// Rate limiting: records the admission in every applicable rule, or returns the 429.
    fn rate_limit<H: Host, R: Request + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, request: &R, now: UnixMillis) -> Option<Reply> {
        if filter.config.rate_limits.is_empty() {
            return None;
        }
        let mut skipped = Vec::new();
        let fleet = filter.global.as_ref().map(|g| &g.hasher);
        let rules = &filter.rules;
        let headers = request;
        let mut probes = crate::ratelimit::probes::probes_where(
            &filter.config,
            &filter.hasher,
            fleet,
            |source| request.fetch(source),
            &mut skipped,
            |rule| !filter.leased.as_ref().is_some_and(|l| l.is_leased(rule)) && rules.applies(rule, headers),
        );
        if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
            scope.annotate(&node.borrow(), &mut probes, now);
            if let Some(asking) = self.asking() {
                asked::apply_outcomes(asking, scope, &node.borrow(), &mut probes);
            }
        }
        // Each rule's limit for the key and the request's cost against it.
        let mut later = Vec::new();
        let mut invalid = Vec::new();
        for probe in &mut probes {
            probe.limit = rules.limit(probe.rule, probe.key_hash, headers);
            let limit = probe.limit.or_else(|| filter.limiter.tables().get(probe.rule).map(|t| t.limit));
            let admission = rules.admission(probe.rule, headers, self.estimates.as_deref());
            if admission.invalid {
                invalid.push(probe.rule);
            }
            probe.cost = limit.map_or(admission.now, |limit| rules::capped(admission.now, limit));
            if let (Later::BodyBytes | Later::ResponseHeader | Later::ResponseBody, Some(limit)) = (admission.later, limit) {
                later.push((*probe, admission.later, limit));
            }
        }
        let mut verdict = filter.limiter.check(env.store, &mut filter.reserves.borrow_mut(), &probes, now);
        // Rules in shadow: a request only they refuse goes on, counted by the other rules alone.
        let (mut shadowed, mut shadow_refusals) = (Vec::new(), Vec::new());
        if filter.shadows.any_rule() {
            while let Verdict::Refused { violations } = &verdict {
                if !violations.iter().all(|v| filter.shadows.rule(v.standing.rule)) {
                    break;
                }
                shadow_refusals.extend(violations.iter().copied());
                let (refused, admitting): (Vec<Probe>, Vec<Probe>) =
                    probes.iter().partition(|p| violations.iter().any(|v| v.standing.rule == p.rule));
                shadowed.extend(refused);
                probes = admitting;
                verdict = filter.limiter.check(env.store, &mut filter.reserves.borrow_mut(), &probes, now);
            }
        }
        if let (Some(scope), Some(node), Some(stage), None) = (&filter.global, &filter.global_node, &filter.asks, self.asking()) {
            // A refusal of a batched global rule may ask the store first ([`asked`]).
            // This proxy's units of the key that the store has not counted yet: its counts less
            // its part the store confirmed, as the view holds it now (another worker's ask may
            // have been answered since this VM's last tick).
            let pending = |probe: &Probe| {
                let counts = filter.limiter.counts_of(env.store, &filter.reserves.borrow(), probe, now);
                let mut fresh = [*probe];
                scope.annotate(&node.borrow(), &mut fresh, now);
                counts.map_or(0, |c| c.current.saturating_sub(fresh[0].remote.confirmed))
            };
            if matches!(verdict, Verdict::Refused { .. }) {
                let _ = scope.refresh(env.store, &mut node.borrow_mut().cache);
            }
            if let Some(asks) = stage.asks_of(scope, &node.borrow(), &verdict, &probes, pending, now) {
                self.wait = Some(Wait::Asked(asked::Asking { asks, outcomes: None, end_of_stream: false, body: (0, false) }));
                return None;
            }
        }
        // Counted once the request is decided (not when it goes to ask first).
        for rule in skipped {
            increment(env.metrics, filter.stats.rule(rule).skipped);
        }
        for rule in invalid {
            increment(env.metrics, filter.stats.rule(rule).invalid_cost);
        }
        for violation in &shadow_refusals {
            increment(env.metrics, filter.stats.rule(violation.standing.rule).shadow_refused);
            self.decision.shadow(By::Rule(violation.standing.rule), Some(&violation.standing));
        }
        if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
            // An admission counts fleet-wide; a refusal asks for the key's fleet-wide count.
            let admitted = matches!(verdict, Verdict::Admitted { .. });
            let mut node = node.borrow_mut();
            for probe in &probes {
                // Units the store granted to an ask are counted there already.
                let asked = self.asking().and_then(|a| a.outcome(probe.rule, probe.key_hash));
                let granted = asked == Some(crate::fleet::batched::ask::Asked::Granted);
                if granted && !admitted {
                    let back = scope.refund(&mut node, probe, probe.cost, now, now);
                    stats::add_count(env.metrics, filter.stats.global.dropped, back);
                }
                let cost = if admitted && !granted { probe.cost } else { 0 };
                // An answered ask has just read the key's totals into the view and counted the
                // request there (`GlobalScope::learn`): no read of it goes in the next batch.
                if cost == 0 && matches!(asked, Some(crate::fleet::batched::ask::Asked::Granted | crate::fleet::batched::ask::Asked::Refused)) {
                    continue;
                }
                let dropped = scope.count(&mut node, std::slice::from_ref(probe), now, cost, 1);
                stats::add_count(env.metrics, filter.stats.global.dropped, dropped);
            }
            for probe in &shadowed {
                let dropped = scope.count(&mut node, std::slice::from_ref(probe), now, 0, 1);
                stats::add_count(env.metrics, filter.stats.global.dropped, dropped);
            }
        }
        match &verdict {
            Verdict::Admitted { standings, evictions } => {
                for (probe, when, limit) in later {
                    self.charges.owe(probe, when, limit, now);
                }
                for standing in standings {
                    increment(env.metrics, filter.stats.rule(standing.rule).allowed);
                }
                if filter.delays.is_some() {
                    self.delay_for_turn(filter, env, standings, &probes);
                }
                if filter.selector.is_some() {
                    // Selection may still refuse it: its units then go back.
                    self.counted = Some((std::mem::take(&mut probes), now));
                }
                for rule in evictions {
                    increment(env.metrics, filter.stats.rule(*rule).evictions);
                }
                if filter.config.access_log {
                    self.decision.admitted(standings.iter().chain(&self.leased.standings));
                }
                if filter.config.ratelimit_headers == RateLimitHeaders::Always {
                    self.fields = if self.leased.standings.is_empty() {
                        filter.admitted_fields.tightest(standings)
                    } else {
                        let all: Vec<Standing> = standings.iter().chain(&self.leased.standings).copied().collect();
                        filter.admitted_fields.tightest(&all)
                    };
                }
                None
            }
            Verdict::Refused { violations } => {
                for violation in violations {
                    let ids = filter.stats.rule(violation.standing.rule);
                    if filter.shadows.rule(violation.standing.rule) {
                        // Refused by another rule; this one would have refused it too.
                        increment(env.metrics, ids.shadow_refused);
                        continue;
                    }
                    increment(env.metrics, ids.refused);
                    if violation.cause == Cause::Contention {
                        increment(env.metrics, ids.contention);
                    }
                }
                let enforced: Vec<Violation> = if filter.shadows.any_rule() {
                    violations.iter().filter(|v| !filter.shadows.rule(v.standing.rule)).copied().collect()
                } else {
                    Vec::new()
                };
                let verdict = if enforced.is_empty() { verdict } else { Verdict::Refused { violations: enforced } };
                if let Verdict::Refused { violations } = &verdict {
                    if let Some(first) = violations.first() {
                        self.decision.refused(decision::Outcome::Refused, By::Rule(first.standing.rule), Some(&first.standing));
                    }
                }
                let reply = replies::rate_limited(&filter.limiter, &verdict, now)?;
                log::debug!("floodgate: 429 {}", reply.body);
                Some(reply)
            }
        }
    }

    /// The `delay` stage's part of an admission: the latest turn of the enforced token buckets
    /// that let the request in to wait (a bucket in shadow lets it go at once), and the turns
    /// it took of every bucket, to give back if its client goes away while it waits.
    fn delay_for_turn<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, standings: &[Standing], probes: &[Probe]) {
        let waits = standings.iter().filter(|s| s.go_at.is_some() && !filter.shadows.rule(s.rule));
        let Some((go_at, rule)) = waits.clone().filter_map(|s| Some((s.go_at?, s.rule))).max_by_key(|(go_at, _)| *go_at) else { return };
        for standing in waits {
            increment(env.metrics, filter.stats.rule(standing.rule).delayed);
        }
        let tables = filter.limiter.tables();
        let turns = probes.iter().filter(|p| tables.get(p.rule).is_some_and(|t| t.bucket.is_some())).copied().collect();
        // After an ask, this ends its wait for the answer (decided with it).
        self.wait = Some(Wait::Turn(Delayed { go_at, rule, turns, ..Delayed::default() }));
    }

    /// Cluster selection: takes a permit on a cluster (the request goes there: `Ok(Some(index))`),
    /// or returns the 503 when none has room; `Ok(None)` without cluster selection.
    fn select<H: Host, R: Request + ?Sized, G: Random + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, request: &R, rng: &mut G, now: MonoMillis) -> Result<Option<usize>, Reply> {
        let Some(selector) = filter.selector.as_ref() else { return Ok(None) };
        // The request's partition, when its key is confined to one; a request without the key
        // may use every cluster.
        let confinement: Option<Confinement> = filter.partitioner.as_ref().and_then(|partitioner| {
            let confinement = partitioner.key_hash(|source| request.fetch(source)).map(|hash| partitioner.confine(hash));
            if confinement.is_none() {
                increment(env.metrics, filter.stats.selection.partition_unkeyed);
            }
            confinement
        });
        let chosen = {
            let mut state = filter.selection_vm.borrow_mut();
            match &confinement {
                Some(within) => selector.choose_within(env.store, &mut state, now, rng, within).or_else(|exhausted| {
                    if !filter.shadows.partition || within.spill_below.is_some() {
                        return Err(exhausted);
                    }
                    // In shadow, a request its partition would refuse may use every cluster.
                    let anywhere = selector.choose(env.store, &mut state, now, rng);
                    if anywhere.is_ok() {
                        increment(env.metrics, filter.stats.selection.partition_shadow_refused);
                        self.decision.shadow(By::Partition, None);
                    }
                    anywhere
                }),
                None => selector.choose(env.store, &mut state, now, rng),
            }
        };
        let permit = match chosen {
            Ok(permit) => permit,
            Err(exhausted) => {
                increment(env.metrics, filter.stats.selection.exhausted);
                if exhausted.contention {
                    increment(env.metrics, filter.stats.selection.contention);
                }
                log::debug!("floodgate: no cluster has room: {exhausted:?}");
                let by = if confinement.as_ref().is_some_and(|c| c.spill_below.is_none()) { By::Partition } else { By::Selection };
                self.decision.refused(decision::Outcome::NoCluster, by, None);
                return Err(replies::no_capacity_within(selector, &exhausted, confinement.as_ref()));
            }
        };
        increment(env.metrics, filter.stats.cluster(permit.cluster).selected);
        if confinement.is_some_and(|c| !c.members.contains(&permit.cluster) && c.spill_below.is_some()) {
            increment(env.metrics, filter.stats.selection.partition_spilled);
        }
        log::debug!("floodgate: routed to cluster {} ({} in flight)", permit.cluster, permit.in_flight);
        let cluster = permit.cluster;
        self.cluster_permit = Some(permit);
        Ok(Some(cluster))
    }

    /// The host could not set the route header: the request cannot reach its cluster, whose
    /// permit ends unused; the 503 of no capacity.
    pub fn unroutable<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>) -> LocalReply {
        let now = env.clock.now().mono;
        let selector = filter.selector.as_ref();
        if let (Some(permit), Some(selector)) = (self.cluster_permit.take(), selector) {
            selector.finish(env.store, &mut filter.selection_vm.borrow_mut(), permit, Outcome::Ignored, now);
        }
        self.decision.refused(decision::Outcome::NoCluster, By::Selection, None);
        self.decision.cluster = None;
        if let Some(stage) = &filter.leased {
            stage.untake(env.store, &std::mem::take(&mut self.leased));
        }
        self.give_back_counted(filter, env, env.clock.now().wall);
        let reply = match selector {
            Some(selector) => replies::no_capacity(selector, &Exhausted { clusters: Vec::new(), contention: true }),
            None => replies::health(&replies::LocalLoad::default(), None),
        };
        self.reply(filter, env, reply, now)
    }

    /// A request body frame (`bytes` of it; `end`: the last): held while the request waits for
    /// the store, counted for a cost of body bytes.
    pub fn request_body<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, bytes: usize, end: bool) -> Flow {
        if let Some(body) = self.held_body() {
            // Held until the request is decided or its turn comes; counted then.
            *body = (bytes, end);
            return Flow::Pause;
        }
        if end && self.cluster_permit.is_some() && self.timing.request_end.is_none() {
            self.timing.request_end = Some(env.clock.now().mono);
        }
        if self.charges.counts_body() {
            self.charges.body(bytes);
            if end {
                let owed = self.charges.body_done();
                self.charge(filter, env, owed);
            }
        }
        Flow::Continue
    }

    /// The request trailers: the request ended.
    pub fn request_trailers<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>) -> Flow {
        if let Some(body) = self.held_body() {
            body.1 = true;
            return Flow::Pause;
        }
        if self.cluster_permit.is_some() && self.timing.request_end.is_none() {
            self.timing.request_end = Some(env.clock.now().mono);
        }
        if self.charges.counts_body() {
            let owed = self.charges.body_done();
            self.charge(filter, env, owed);
        }
        Flow::Continue
    }

    /// The response headers (`headers`; `end_of_stream`: they end the response): charges the
    /// units the upstream reports, notes gRPC's status and the latency, and returns, for an
    /// admitted request, the tightest rule whose `RateLimit` fields the response gets
    /// ([`AdmittedFields::policy`] and [`Tightest::ratelimit`]).
    pub fn response_headers<H: Host, A: Attributes + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, headers: &A, end_of_stream: bool) -> Option<Tightest> {
        if self.replied {
            return None;
        }
        if self.cluster_permit.is_some() {
            if self.grpc.request && end_of_stream {
                self.grpc.status = headers.get("grpc-status").map(|v| grpc::parse_status(&v));
            }
            if self.timing.response_headers.is_none() {
                self.timing.response_headers = Some(env.clock.now().mono);
            }
        }
        if self.charges.awaits_response() {
            let rules = &filter.rules;
            let body = rules.reads_response_bodies() && !end_of_stream;
            let content_type = if body { headers.get("content-type") } else { None };
            let encoded = body && usage::is_encoded(headers.get("content-encoding").as_deref());
            let owed = self.charges.response(
                |rule| Rules::response_report(rules.response_header(rule).and_then(|name| headers.get(name)).as_deref()),
                |rule| if end_of_stream { None } else { rules.body_scan(rule, content_type.as_deref(), encoded) },
            );
            if encoded && owed.iter().any(|s| s.report == Report::Compressed) && !filter.said_compressed.replace(true) {
                log::warn!(
                    "floodgate: a response whose usage a rule reads came compressed (content-encoding: {}): it cannot be read, and is settled as unreported (counted in unreadable and unreadable_compressed). Put Envoy's decompressor filter after floodgate, or remove accept-encoding from the requests (docs/llm.md). Said once.",
                    String::from_utf8_lossy(headers.get("content-encoding").as_deref().unwrap_or_default())
                );
            }
            self.charge(filter, env, owed);
        }
        self.fields.take()
    }

    /// Whether the response body is read (a rule's count is in it).
    pub fn reads_response_body(&self) -> bool {
        self.charges.reads_response_body()
    }

    /// A chunk of the response body (`end`: the last): read for the counts the rules wait for;
    /// those it settles are charged (or given back).
    pub fn response_body<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, chunk: &[u8], end: bool) {
        if !self.charges.reads_response_body() {
            return;
        }
        let rules = &filter.rules;
        let owed = self.charges.response_body(chunk, end, |rule| rules.body_usage(rule));
        self.charge(filter, env, owed);
    }

    /// The response trailers: a gRPC call's status.
    pub fn response_trailers<A: Attributes + ?Sized>(&mut self, trailers: &A) {
        if self.cluster_permit.is_some() && self.grpc.request {
            self.grpc.status = trailers.get("grpc-status").map(|v| grpc::parse_status(&v));
        }
    }

    /// Whether the stream still needs what [`Stream::end`] reads of the host.
    pub fn needs_end(&self) -> bool {
        !self.charges.is_empty() || self.holds_permits() || self.wait.as_ref().is_some_and(Wait::holds) || self.pending_asks().is_some()
    }

    /// The stream ended, whatever ended it (`context`: its host context): a waiting request
    /// stops waiting, costs still owed are charged (what is known, or the rule's default), the
    /// permits are released and the chosen cluster's is finished with the stream's outcome.
    pub fn end<H: Host, E: StreamEnd + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, context: u32, ended: &E) {
        if self.ended {
            return;
        }
        self.ended = true;
        // What its wait holds goes back (one for its body or its ask holds nothing).
        let held = self.wait.take_if(|wait| wait.holds());
        if let Some(stage) = &filter.leased {
            let wait = match &held {
                Some(Wait::Store(wait)) => Some(wait),
                _ => None,
            };
            stage.stream_ended(env.store, context, wait, env.clock.now());
        }
        if let (Some(_), Some(stage)) = (self.pending_asks(), &filter.asks) {
            stage.forget(context);
        }
        match (held, &filter.queue) {
            (Some(Wait::Turn(delayed)), _) => {
                // Its client went away while it waited for its turn.
                self.give_back_turns(filter, env, &delayed);
            }
            (Some(Wait::Slot(queued)), Some(stage)) => {
                // Its client went away while it waited for a slot (or before its resumption).
                stage.abandon(filter, env, &queued);
            }
            _ => {}
        }
        if !self.charges.is_empty() {
            let owed = self.charges.end();
            self.charge(filter, env, owed);
        }
        if self.holds_permits() {
            let now = env.clock.now().mono;
            self.release(filter, env, now);
            self.finish_cluster(filter, env, ended, now);
        }
    }

    /// Ends the chosen cluster's permit with the stream's outcome.
    fn finish_cluster<H: Host, E: StreamEnd + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, ended: &E, now: MonoMillis) {
        let (Some(permit), Some(selector)) = (self.cluster_permit.take(), filter.selector.as_ref()) else {
            return;
        };
        let status = ended.status().filter(|c| *c > 0);
        // Flags change the outcome of a stream without a status or with a 5xx; a status below
        // 500 already sent downstream stands (one host call saved on the common path), unless
        // a gRPC call's status needs them.
        let failures = filter.config.cluster_selection.as_ref().map_or(&[][..], |s| &s.failure_grpc_statuses);
        let grpc_status = self.grpc.request.then_some(self.grpc.status);
        let flags = match status {
            Some(code) if code < 500 && grpc_status.is_none_or(|s| !grpc::needs_flags(s, failures)) => 0,
            _ => ended.flags(),
        };
        let mut outcome = selector.classify(&permit, status, flags, self.timing);
        if let Some(grpc_status) = grpc_status {
            outcome = grpc::outcome(outcome, grpc::effective_status(grpc_status, status, flags), failures);
        }
        let finished = selector.finish(env.store, &mut filter.selection_vm.borrow_mut(), permit, outcome, now);
        if filter.is_retired() {
            // Its configuration is gone: no heartbeat of it will write what is pending.
            selector.heartbeat(env.store, &mut filter.selection_vm.borrow_mut(), now);
        }
        let ids = filter.stats.cluster(finished.cluster);
        increment(
            env.metrics,
            match outcome {
                Outcome::Success => ids.success,
                Outcome::Slow => ids.slow,
                Outcome::Failure | Outcome::Overflow => ids.failure,
                Outcome::Timeout => ids.timeout,
                Outcome::Ignored => ids.ignored,
            },
        );
        if !finished.recorded {
            increment(env.metrics, filter.stats.selection.contention);
        }
        log::debug!("floodgate: {outcome:?} (status {status:?}, gRPC {grpc_status:?}, flags {flags:#x}) on cluster {}", finished.cluster);
    }

    /// Settles costs the admitted request owes its rules, known after admission: what was
    /// counted at admission (a reservation, or nothing) becomes the units the rule charges for
    /// what came (a count, capped at the limit; without one, the rule's policy): the difference
    /// is charged into the key's counters, or given back to the window bucket it was counted in;
    /// fleet-wide too for rules in global scope.
    fn charge<H: Host>(&self, filter: &Filter, env: &Env<'_, H>, owed: Vec<Settle>) {
        let now = env.clock.now().wall;
        for Settle { probe, report, limit } in owed {
            let ids = filter.stats.rule(probe.rule);
            match report {
                Report::Count(_) | Report::Missing => {}
                Report::Invalid => increment(env.metrics, ids.invalid_cost),
                Report::Unreadable => increment(env.metrics, ids.unreadable),
                Report::Compressed => {
                    increment(env.metrics, ids.unreadable);
                    increment(env.metrics, ids.unreadable_compressed);
                }
            }
            if !matches!(report, Report::Count(_)) {
                increment(env.metrics, ids.unreported);
            }
            let units = filter.rules.settled_units(probe.rule, report, probe.cost, limit);
            let reserved = probe.cost;
            if let Some(stage) = filter.leased.as_ref().filter(|l| l.is_leased(probe.rule)) {
                stage.settle(env.store, &probe, units, limit, self.charges.admitted_at(), now);
                let (charged, refunded) = (units.saturating_sub(reserved), reserved.saturating_sub(units));
                stats::add_count(env.metrics, ids.charged, u64::from(charged));
                stats::add_count(env.metrics, ids.refunded, u64::from(refunded));
            } else if units > reserved {
                let extra = units.saturating_sub(reserved);
                if filter.limiter.charge(env.store, probe, extra, now) {
                    stats::add_count(env.metrics, ids.charged, u64::from(extra));
                } else {
                    increment(env.metrics, ids.contention);
                }
                if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
                    let dropped = scope.count(&mut node.borrow_mut(), std::slice::from_ref(&probe), now, extra, 0);
                    stats::add_count(env.metrics, filter.stats.global.dropped, dropped);
                }
            } else if units < reserved {
                let back = reserved.saturating_sub(units);
                give_back(filter, env, &probe, back, self.charges.admitted_at(), now);
                stats::add_count(env.metrics, ids.refunded, u64::from(back));
            }
        }
    }

    /// An admitted request that cluster selection refused (or that could not be routed) never
    /// reaches an upstream: the units its rules counted at admission go back, as a settlement
    /// gives back a reservation's unused part, and it owes nothing more.
    fn give_back_counted<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, now: UnixMillis) {
        let Some((probes, admitted_at)) = self.counted.take() else { return };
        for probe in &probes {
            give_back(filter, env, probe, probe.cost, admitted_at, now);
        }
        self.charges = Charges::default();
    }

    /// Releases the in-flight and per-key permits (each once: taken out of the state).
    fn release<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, now: MonoMillis) {
        if let (Some(permit), Some(shedder)) = (self.permit.take(), filter.shedder.as_ref()) {
            shedder.release(env.store, env.vm, permit, now);
        }
        if let (Some(permit), Some(cap)) = (self.key_permit.take(), filter.per_key.as_ref()) {
            cap.release(env.store, env.vm, permit, now);
        }
    }
}

/// Gives back `units` that `probe`'s key counted at `admitted_at` and that were not used: out
/// of the key's counters, and fleet-wide for a rule in batched global scope.
fn give_back<H: Host>(filter: &Filter, env: &Env<'_, H>, probe: &Probe, units: u32, admitted_at: UnixMillis, now: UnixMillis) {
    filter.limiter.refund(env.store, *probe, units, admitted_at);
    if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
        // A give-back with no room in the VM's buffer is lost: the fleet over-counts.
        let _ = scope.refund(&mut node.borrow_mut(), probe, units, admitted_at, now);
    }
}
