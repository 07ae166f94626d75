//! The proxy-wasm shell: reads the host (clock, headers, shared data) once per callback, hands
//! plain values to the core, and turns the core's decisions into host calls. Nothing here
//! decides anything.
//!
//! **Lifecycle, as Envoy drives it** (proxy-wasm-cpp-host; `shared/notes/proxy-wasm-envoy.md`):
//! - one VM per worker thread and one for the main thread, plus a throw-away VM that validates
//!   each new configuration; statics (`thread_local!` here) are per VM;
//! - a configuration gets a root context ([`FilterRoot`]) in every VM: `on_configure` builds its
//!   [`Filter`], `on_tick` runs its heartbeat (every second, or every `sync_interval` with a
//!   global scope);
//! - a stream ([`FilterStream`]) holds the `Filter` of the root context that created it, to its
//!   end (`on_log`), even if the configuration changes meanwhile;
//! - a changed plugin configuration gets a **new root context in the same VM**, and the old one
//!   is retired with `on_done` (also when the filter is removed or the VM shuts down); a root
//!   context configured a second time replaces its `Filter`. Either way the old `Filter` is
//!   retired ([`Filter::retire`]): what it held ahead of use goes back, what it counted
//!   locally is written;
//! - a new VM (new code or `vm_config`) starts empty; shared data (same `vm_id`) survives it.
//!
//! **Pipeline** of a request's headers: `health → shed → cap → lease → rate_limit → select`;
//! the first stage that answers sends the local reply, after giving back the in-flight units
//! the request held (proxy-wide, and its key's under the per-key cap). The `lease` stage (rules
//! in `consistency: leased`, [`lease`]) may pause a request until the store answers; the rest
//! of its pipeline then runs from that answer's callback.

mod call;
mod clock;
mod global;
mod grpc;
mod header_map;
mod lease;
mod stats;
mod store;

use crate::selection::partition::Partitioner;
use crate::shedding::per_key::{KeyLease, LocalKeys, PerKeyCap};
use crate::config::{Config, Dependencies, KeyPart, RateLimitHeaders};
use crate::global::{GlobalScope, VmNode};
use crate::keys::headers::{HeaderPlan, HeaderView, Lookup};
use crate::keys::{self, KeyHasher, Source};
use crate::ratelimit::reserve::Reserves;
use crate::ratelimit::{Cause, Limiter, Standing, Verdict};
use crate::replies::{self, AdmittedFields, Reply, Tightest};
use crate::ratelimit::rules::{self, Attributes, Charges, Later, Rules};
use crate::selection::outcome::Outcome;
use crate::selection::shuffle::SplitMix64;
use crate::selection::{ClusterLease, Confinement, Selector, Timing, VmState};
use crate::primitives::inflight::{Lease, LocalCount};
use crate::shedding::lag::LagMonitor;
use crate::primitives::inflight::HEARTBEAT_MS;
use crate::shedding::{Classes, Shedder};
use crate::primitives::store::{write_back, SharedStore, StoreError};
use crate::primitives::time::{MonoMillis, Now};
use lease::{LeaseStage, Parked, Step};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use stats::{increment, Stats};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;
use store::EnvoyStore;

proxy_wasm::main! {{
    start();
}}

/// Installs the logger, the panic hook and the root context factory.
fn start() {
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("floodgate panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| Box::new(FilterRoot { id: context_id, ..FilterRoot::default() }));
}

/// Everything a stream needs, built once per configuration and shared by reference.
struct Filter {
    config: Config,
    /// The request headers the configuration reads, and whether to fetch the whole map.
    headers: HeaderPlan,
    limiter: Limiter,
    /// This VM's reserves of keys' quotas under `limiter`.
    reserves: RefCell<Reserves>,
    /// The units per rule this VM last added to the `reserved` gauges.
    reserved_reported: RefCell<Vec<u64>>,
    /// The `RateLimit` fields of admitted responses, formatted once per rule.
    admitted_fields: AdmittedFields,
    hasher: KeyHasher,
    /// The rules' conditions, limits by key and costs.
    rules: Rules,
    stats: Stats,
    /// The in-flight limit (`max_active_requests`).
    shedder: Option<Shedder>,
    /// The priority classes, for both shedding signals.
    classes: Option<Classes>,
    /// This VM's loop-lag probe (`max_loop_lag`).
    lag: Option<RefCell<LagMonitor>>,
    /// This VM's in-flight count for the filter's namespace.
    local: LocalCount,
    selector: Option<Selector>,
    /// Each key's partition of the clusters (`cluster_selection.partition`).
    partitioner: Option<Partitioner>,
    /// The cap on each key's requests in flight (`load_shedding.per_key`).
    per_key: Option<PerKeyCap>,
    /// This VM's requests in flight per key under `per_key`.
    key_counts: LocalKeys,
    /// This VM's side of cluster selection (lease counts, recent weights).
    selection_vm: RefCell<VmState>,
    /// Rules in global scope: how they reach the fleet's store.
    global: Option<GlobalScope>,
    /// This VM's side of the global scope (it outlives configurations).
    global_node: Option<Rc<RefCell<VmNode>>>,
    /// Rules in leased consistency: this worker's leases and the requests waiting for them.
    lease: Option<LeaseStage>,
    /// The root context's id (calls it sends are answered to it).
    root_id: u32,
    /// The configuration was replaced or its root context retired ([`Filter::retire`]): streams
    /// that still finish under it write their outcomes at once.
    retired: Cell<bool>,
}

thread_local! {
    /// This VM's random id in the shared in-flight record (drawn when the VM starts).
    static VM_ID: u64 = {
        let mut bytes = [0u8; 8];
        if getrandom::fill(&mut bytes).is_err() {
            log::warn!("floodgate: getrandom failed; the VM id falls back to the clock");
            bytes = clock::wall().0.to_le_bytes();
        }
        u64::from_le_bytes(bytes)
    };
    /// One in-flight count per shared record (the shedder's, each cluster's) in this VM,
    /// shared by the configurations that use the record.
    static LOCAL_COUNTS: RefCell<HashMap<String, LocalCount>> = RefCell::new(HashMap::new());
    /// Likewise, this VM's requests in flight per key, per per-key cap table.
    static LOCAL_KEYS: RefCell<HashMap<String, LocalKeys>> = RefCell::new(HashMap::new());
    /// This VM's random source for the cluster shuffle, seeded from `getrandom`.
    static RNG: RefCell<SplitMix64> = RefCell::new(SplitMix64::new({
        let mut bytes = [0u8; 8];
        if getrandom::fill(&mut bytes).is_err() {
            bytes = clock::mono().0.to_le_bytes();
        }
        u64::from_le_bytes(bytes)
    }));
}

fn vm_id() -> u64 {
    VM_ID.with(|id| *id)
}

fn local_count(record_key: &str) -> LocalCount {
    LOCAL_COUNTS.with(|counts| Rc::clone(counts.borrow_mut().entry(record_key.to_owned()).or_default()))
}

fn local_keys(table: &str) -> LocalKeys {
    LOCAL_KEYS.with(|tables| Rc::clone(tables.borrow_mut().entry(table.to_owned()).or_default()))
}

#[derive(Default)]
struct FilterRoot {
    /// Its context id.
    id: u32,
    filter: Option<Rc<Filter>>,
    /// When the per-second heartbeat last ran (the tick is faster with a global scope or a lag
    /// probe).
    last_heartbeat: Option<MonoMillis>,
    /// When the global scope's tick last ran (every `sync_interval`).
    last_sync: Option<MonoMillis>,
    /// When the loop-lag probe last ran (every `lag_probe_interval`).
    last_lag_probe: Option<MonoMillis>,
}

impl Context for FilterRoot {
    /// The host retires this root context: its configuration was replaced by another (which
    /// Envoy gives a new root context, in the same VM for a plugin-configuration change), or
    /// the filter was removed, or the VM shuts down. What the configuration holds for itself
    /// goes back now ([`Filter::retire`]); no later tick of this root context will.
    fn on_done(&mut self) -> bool {
        if let Some(filter) = self.filter.take() {
            filter.retire(clock::now());
            log::debug!("floodgate: root context retired; its reserves were given back");
        }
        true
    }

    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let Some(filter) = &self.filter else { return };
        if let Some(stage) = &filter.lease {
            if stage.answered(filter, token_id, num_headers, body_size, self.id, clock::now()) {
                return;
            }
        }
        if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
            global::answered(scope, node, &filter.stats.global, token_id, num_headers, body_size, clock::now().wall);
        }
    }
}

impl RootContext for FilterRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        if let Ok(level) = hostcalls::get_log_level() {
            proxy_wasm::set_log_level(level);
        }
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match Config::parse(&bytes) {
            Ok(config) => config,
            Err(err) => {
                log::error!("floodgate: invalid configuration: {err}");
                return false;
            }
        };
        let namespace = plugin_name();
        let seed = match shared_seed(&EnvoyStore, &namespace) {
            Ok(seed) => seed,
            Err(err) => {
                log::error!("floodgate: cannot set up the shared key seed: {err}");
                return false;
            }
        };
        let limiter = Limiter::new(&config, &namespace);
        let shedder = config.load_shedding.as_ref().and_then(|s| Shedder::new(s, &namespace));
        let classes = config.load_shedding.as_ref().map(Classes::new);
        let lag = config.load_shedding.as_ref().and_then(LagMonitor::new);
        let selector = config.cluster_selection.as_ref().map(|s| Selector::new(s, &namespace));
        let partitioner = config.cluster_selection.as_ref().and_then(Partitioner::new);
        let per_key = config.load_shedding.as_ref().and_then(|s| s.per_key.as_ref()).map(|p| PerKeyCap::new(p, &namespace));
        let cluster_leases = selector.as_ref().map_or_else(Vec::new, |s| {
            (0..s.clusters.len()).filter_map(|i| s.record_key(i)).map(local_count).collect()
        });
        if let Some(old) = &self.filter {
            old.retire(clock::now());
        }
        let global = GlobalScope::new(&config, &namespace);
        let global_node = global.as_ref().map(|_| global::node(&namespace, vm_id()));
        let lease = LeaseStage::new(&config, stats::LeaseStats::define(&config), self.id);
        // The heartbeat is every second; a global scope ticks every sync_interval, a lag probe
        // every lag_probe_interval, leased rules every quarter lease_timeout (2 to 10 ms) to send
        // the calls queued for the root, again those of streams that ended, and to end waits
        // past the timeout.
        let lease_tick = lease.as_ref().map(|l| crate::lease::tick_ms(l.timeout_ms));
        let tick_ms = [global.as_ref().map(|g| g.interval_ms), lag.as_ref().map(LagMonitor::probe_ms), lease_tick]
            .into_iter()
            .flatten()
            .fold(HEARTBEAT_MS, u64::min);
        let mut ticking = false;
        if shedder.is_some() || lag.is_some() || selector.is_some() || !config.rate_limits.is_empty() {
            match hostcalls::set_tick_period(Duration::from_millis(tick_ms)) {
                Ok(()) => ticking = true,
                Err(status) => log::warn!(
                    "floodgate: no tick ({status:?}): in-flight heartbeats and quota reserves disabled"
                ),
            }
        }
        log::info!(
            "floodgate: configured {namespace:?}: {} ({} shared-data records at most)",
            config.summary(),
            limiter.tables().iter().map(|t| t.set_count()).sum::<u64>()
        );
        self.filter = Some(Rc::new(Filter {
            stats: Stats::define(&config),
            rules: Rules::new(&config, &KeyHasher::new(seed)),
            hasher: KeyHasher::new(seed),
            headers: HeaderPlan::new(&config),
            admitted_fields: AdmittedFields::new(&limiter),
            limiter,
            // Reserves need the heartbeat to come back when unused.
            reserves: RefCell::new(if ticking { Reserves::new() } else { Reserves::disabled() }),
            reserved_reported: RefCell::new(vec![0; config.rate_limits.len()]),
            local: local_count(shedder.as_ref().map_or("", |s| s.record_key())),
            shedder,
            classes,
            lag: lag.map(RefCell::new),
            selector,
            partitioner,
            key_counts: local_keys(per_key.as_ref().map_or("", PerKeyCap::table)),
            per_key,
            selection_vm: RefCell::new(VmState::new(vm_id(), cluster_leases)),
            global,
            global_node,
            lease,
            root_id: self.id,
            config,
            retired: Cell::new(false),
        }));
        if let Some(filter) = &self.filter {
            filter.selection_heartbeat(clock::now().mono);
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(filter) = &self.filter else { return };
        let now = clock::now();
        let due = |last: Option<MonoMillis>, every_ms: u64| {
            // A tick a few milliseconds early still counts: the timer's period is the interval.
            last.is_none_or(|last| now.mono.saturating_since(last).saturating_add(5) >= every_ms || last > now.mono)
        };
        if let Some(lag) = &filter.lag {
            // Probed every lag_probe_interval, also when the tick is faster (a shorter
            // sync_interval, leased rules): the lag is the lateness past that interval.
            let probe_ms = lag.borrow().probe_ms();
            if due(self.last_lag_probe, probe_ms) {
                self.last_lag_probe = Some(now.mono);
                let lag_ms = lag.borrow_mut().probe(now.mono);
                stats::record(filter.stats.loop_lag_ms, lag_ms);
            }
        }
        if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
            if due(self.last_sync, scope.interval_ms) {
                self.last_sync = Some(now.mono);
                global::tick(scope, node, &filter.stats.global, vm_id(), now.wall);
            }
        }
        if let Some(stage) = &filter.lease {
            stage.tick(filter, self.id, now);
        }
        if !due(self.last_heartbeat, HEARTBEAT_MS) {
            return;
        }
        self.last_heartbeat = Some(now.mono);
        if let Some(stage) = &filter.lease {
            stage.heartbeat(self.id, now);
        }
        filter.limiter.heartbeat(&EnvoyStore, &mut filter.reserves.borrow_mut(), now.wall);
        filter.report_reserved();
        if let Some(shedder) = &filter.shedder {
            let total = shedder.heartbeat(&EnvoyStore, vm_id(), &filter.local, now.mono);
            stats::set(filter.stats.in_flight, u64::from(total));
        }
        if let Some(cap) = &filter.per_key {
            cap.heartbeat(&EnvoyStore, vm_id(), &filter.key_counts, now.mono);
        }
        filter.selection_heartbeat(now.mono);
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let filter = self.filter.clone()?;
        Some(Box::new(FilterStream::new(filter, context_id)))
    }
}

impl Filter {
    /// Ends this configuration's claims on shared data, once it takes no new requests (its
    /// root context was re-configured or retired): gives back its quota reserves (their units
    /// were counted ahead in the keys' counters), the in-flight and cluster reserves, and
    /// writes the cluster outcomes it counted locally (successes and AIMD growth). Without
    /// this, a configuration change would leave those units counted for up to two windows,
    /// and drop the pending outcomes. Streams still running under it write their outcomes at
    /// once from now on.
    fn retire(&self, now: Now) {
        self.retired.set(true);
        {
            let mut reserves = self.reserves.borrow_mut();
            self.limiter.drain(&EnvoyStore, &mut reserves);
            *reserves = Reserves::disabled();
        }
        self.report_reserved();
        if let Some(shedder) = &self.shedder {
            shedder.heartbeat(&EnvoyStore, vm_id(), &self.local, now.mono);
        }
        if let Some(cap) = &self.per_key {
            cap.heartbeat(&EnvoyStore, vm_id(), &self.key_counts, now.mono);
        }
        if let Some(selector) = &self.selector {
            selector.heartbeat(&EnvoyStore, &mut self.selection_vm.borrow_mut(), now.mono);
        }
        if let Some(stage) = &self.lease {
            stage.drain(self.root_id, now);
        }
    }

    /// The selection's heartbeat (each cluster's in-flight count published, its shared state
    /// read) and its gauges; also run once at configuration, so that the gauges show the
    /// clusters' limits and success rates from the start rather than 0 until the first tick.
    fn selection_heartbeat(&self, now: MonoMillis) {
        let Some(selector) = &self.selector else { return };
        let states = selector.heartbeat(&EnvoyStore, &mut self.selection_vm.borrow_mut(), now);
        for (index, state) in states.into_iter().enumerate() {
            let (Some(state), ids) = (state, self.stats.cluster(index)) else { continue };
            // The rate is in [0, 1]: millionths fit.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let ppm = (state.success_rate * 1_000_000.0).round() as u64;
            stats::set(ids.success_rate_ppm, ppm);
            stats::set(ids.concurrency_limit, u64::from(state.limit));
            stats::set(ids.in_flight, u64::from(state.in_flight));
        }
    }

    /// Moves the `reserved` gauges by what this VM's reserves changed since it last reported.
    fn report_reserved(&self) {
        let mut reported = self.reserved_reported.borrow_mut();
        let held = self.reserves.borrow().held(reported.len());
        for (rule, (units, before)) in held.into_iter().zip(reported.iter_mut()).enumerate() {
            let delta = i64::try_from(units).unwrap_or(i64::MAX).saturating_sub(i64::try_from(*before).unwrap_or(i64::MAX));
            stats::add(self.stats.rule(rule).reserved, delta);
            *before = units;
        }
    }
}

/// The plugin's `name` from the Envoy config: the namespace of its shared data.
fn plugin_name() -> String {
    hostcalls::get_property(vec!["plugin_name"])
        .ok()
        .flatten()
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "default".into())
}

/// The secret key-hash seed every worker of this proxy shares: drawn once from `getrandom`
/// by whichever VM configures first, and read by all others. A record of the wrong length
/// (corrupt, or from another version) is replaced, with a compare-and-swap, by a fresh seed.
fn shared_seed(store: &dyn SharedStore, namespace: &str) -> Result<[u8; 16], String> {
    let key = format!("floodgate/{namespace}/seed");
    for _ in 0..4 {
        let stored = store.get(&key).map_err(|e| e.to_string())?;
        if let Some(seed) = stored.as_ref().and_then(|s| <[u8; 16]>::try_from(s.value.as_slice()).ok()) {
            return Ok(seed);
        }
        let mut seed = [0u8; 16];
        getrandom::fill(&mut seed).map_err(|e| format!("getrandom: {e}"))?;
        match write_back(store, &key, stored.as_ref(), &seed) {
            Ok(()) | Err(StoreError::CasMismatch) => continue,
            Err(err) => return Err(err.to_string()),
        }
    }
    Err(format!("shared key {key} could not be created"))
}

struct FilterStream {
    filter: Rc<Filter>,
    /// Its context id.
    context_id: u32,
    /// The units an admitted request took of the leased rules' keys.
    lease_taken: lease::Taken,
    /// While the request waits for the store (`lease` stage), and until the stream takes over
    /// the rest of its pipeline, run elsewhere.
    parked: Option<Rc<Parked>>,
    /// For an admitted request: the tightest rule and its `ratelimit` value.
    ratelimit_fields: Option<Tightest>,
    /// Costs the admitted request still owes its rules (a streamed body, a reported count).
    charges: Charges,
    replied: bool,
    /// Held from admission to the end of the stream (released in `on_log`; `Drop` is the net).
    lease: Option<Lease>,
    /// The unit of its key's cap (`load_shedding.per_key`), likewise.
    key_lease: Option<KeyLease>,
    /// The chosen cluster's lease, likewise.
    cluster_lease: Option<ClusterLease>,
    /// Whether the request is gRPC, and the status its response ended with.
    grpc: grpc::Call,
    /// When the request ended and the response headers came (only with a cluster lease): the
    /// upstream's latency, which decides "slow".
    timing: Timing,
}

impl FilterStream {
    fn new(filter: Rc<Filter>, context_id: u32) -> FilterStream {
        FilterStream {
            filter,
            context_id,
            lease_taken: lease::Taken::default(),
            parked: None,
            ratelimit_fields: None,
            charges: Charges::default(),
            replied: false,
            lease: None,
            key_lease: None,
            cluster_lease: None,
            grpc: grpc::Call::default(),
            timing: Timing::default(),
        }
    }

    /// The rest of the pipeline after the `lease` stage (`reply`: its refusal, if any):
    /// `rate_limit → select`, then the local reply or the request goes on.
    fn finish_headers(&mut self, filter: &Filter, headers: &RequestHeaders<'_, '_>, now: Now, end_of_stream: bool, reply: Option<Reply>) -> Action {
        let refused_here = reply.is_some();
        let reply = reply
            .or_else(|| self.rate_limit(filter, headers, now.wall))
            .or_else(|| self.select(filter, headers, now.mono));
        if let (Some(stage), false, true) = (&filter.lease, refused_here, reply.is_some()) {
            // A later stage refused: the leased units go back.
            stage.untake(&std::mem::take(&mut self.lease_taken));
        }
        if reply.as_ref().is_some_and(|r| r.refusal.is_some()) || self.cluster_lease.is_some() {
            self.grpc.request = crate::replies::grpc::is_grpc(headers.get("content-type").as_deref());
        }
        match reply {
            Some(reply) => self.reply(&reply, now),
            None => {
                if end_of_stream && self.cluster_lease.is_some() {
                    self.timing.request_end = Some(now.mono);
                }
                if end_of_stream && self.charges.counts_body() {
                    // No body: nothing to count.
                    let _ = self.charges.body_done();
                }
                Action::Continue
            }
        }
    }

    /// Takes over the stream that ran the rest of the pipeline for a request that waited for
    /// the store, once it was decided (a no-op otherwise): its quota fields, costs owed, cluster
    /// lease and gRPC state become this stream's, and the body seen meanwhile is counted.
    fn unpark(&mut self) {
        let Some(parked) = &self.parked else { return };
        let Some(resumed) = parked.take_resumed() else { return };
        let (body_bytes, body_ended) = parked.body.get();
        self.parked = None;
        let FilterStream { ratelimit_fields, charges, replied, mut cluster_lease, grpc, timing, .. } = resumed;
        self.ratelimit_fields = ratelimit_fields;
        self.charges = charges;
        self.replied = replied;
        self.cluster_lease = cluster_lease.take();
        self.grpc = grpc;
        self.timing = timing;
        if self.replied {
            self.release(clock::mono());
        }
        if self.charges.counts_body() && body_bytes > 0 {
            self.charges.body(body_bytes);
        }
        if body_ended && self.charges.counts_body() {
            let owed = self.charges.body_done();
            self.charge(owed);
        }
    }

    /// Sends a local reply (its gRPC form to a gRPC request); the filter then stops the
    /// request. A refused request gives its in-flight unit back at once: it never reaches an
    /// upstream, and a client that reads its refusal slowly (an HTTP/2 client withholding
    /// flow-control credit) must not hold a unit of the proxy's capacity meanwhile.
    fn reply(&mut self, reply: &Reply, now: Now) -> Action {
        self.release(now.mono);
        if let Some(grpc) = crate::replies::grpc::reply(reply, &self.filter.config.grpc).filter(|_| self.grpc.request) {
            self.replied = true;
            grpc::send(&grpc);
            return Action::Pause;
        }
        let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        self.replied = true;
        if let Err(status) = hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes())) {
            log::warn!("floodgate: local reply failed: {status:?}");
        }
        Action::Pause
    }

    /// The health endpoint, if this request is for it: a `GET` or `HEAD` of its path. Other
    /// methods on that path are ordinary requests (they go on to the upstream, through the
    /// other stages). It reports the proxy-wide in-flight count and this worker's loop lag, and,
    /// when configured, the clusters.
    fn health(&self, filter: &Filter, headers: &RequestHeaders<'_, '_>, now: MonoMillis) -> Option<Reply> {
        let health = filter.config.health.as_ref()?;
        let path = headers.get(":path")?;
        if KeyPart::Path.normalize(&path) != health.path.as_bytes() {
            return None;
        }
        // Read only for the health path (one host call there, none on the common path).
        let method = headers.get(":method")?;
        if !replies::is_health_method(&method) {
            return None;
        }
        let in_flight = filter
            .shedder
            .as_ref()
            .map(|s| (s, s.in_flight(&EnvoyStore, vm_id(), &filter.local, now)));
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
                let states = selector.states(&EnvoyStore, &filter.selection_vm.borrow(), now);
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
                Some(replies::DependencyView {
                    fail: mode == Dependencies::Fail,
                    min_success_rate: health.min_success_rate.get(),
                    clusters,
                })
            }
        };
        Some(replies::health(&replies::LocalLoad { in_flight, lag }, dependencies.as_ref()))
    }

    /// Load shedding: on this worker's loop lag, then on the proxy-wide in-flight count (taking
    /// a lease); returns the 503 of either.
    fn shed(&mut self, filter: &Filter, headers: &RequestHeaders<'_, '_>, now: MonoMillis) -> Option<Reply> {
        let classes = filter.classes.as_ref()?;
        let value = headers.get(&classes.priority_header);
        let class = classes.class_of(value.as_deref());
        if let Some(lag) = &filter.lag {
            let lag = lag.borrow();
            if let Some(shed) = lag.sheds(class) {
                increment(filter.stats.shed.get(class).copied().flatten());
                increment(filter.stats.shed_by_lag.get(class).copied().flatten());
                log::debug!("floodgate: shed for the loop lag {shed:?}");
                let retry_after = filter.config.load_shedding.as_ref().map_or(1, |s| s.retry_after.ceil_secs().max(1));
                return Some(replies::shed_by_lag(classes, &lag, &shed, retry_after));
            }
        }
        let shedder = filter.shedder.as_ref()?;
        match shedder.try_acquire(&EnvoyStore, vm_id(), &filter.local, class, now) {
            Ok(lease) => {
                self.lease = Some(lease);
                None
            }
            Err(shed) => {
                increment(filter.stats.shed.get(class).copied().flatten());
                if shed.contention {
                    increment(filter.stats.shed_contention);
                }
                log::debug!("floodgate: shed {shed:?}");
                Some(replies::shed(shedder, &shed))
            }
        }
    }

    /// The per-key cap: takes a unit of the request's key's in-flight cap, or returns its 503.
    /// A request without the key is not capped.
    fn cap(&mut self, filter: &Filter, headers: &RequestHeaders<'_, '_>, now: MonoMillis) -> Option<Reply> {
        let cap = filter.per_key.as_ref()?;
        let Some(key) = keys::hash_key(&cap.key, &filter.hasher, |source| headers.fetch(source)) else {
            increment(filter.stats.per_key_unkeyed);
            return None;
        };
        match cap.try_acquire(&EnvoyStore, vm_id(), &filter.key_counts, key, now) {
            Ok(lease) => {
                self.key_lease = Some(lease);
                None
            }
            Err(refusal) => {
                increment(match refusal {
                    crate::shedding::per_key::CapRefusal::Full { .. } => filter.stats.per_key_refused,
                    crate::shedding::per_key::CapRefusal::Untracked => filter.stats.per_key_untracked,
                });
                log::debug!("floodgate: per-key cap {refusal:?}");
                let retry_after = filter.config.load_shedding.as_ref().map_or(1, |s| s.retry_after.ceil_secs().max(1));
                Some(replies::per_key_capped(cap, &refusal, retry_after))
            }
        }
    }

    /// Rate limiting: records the admission in every applicable rule, or returns the 429.
    fn rate_limit(&mut self, filter: &Filter, headers: &RequestHeaders<'_, '_>, now: crate::primitives::time::UnixMillis) -> Option<Reply> {
        if filter.config.rate_limits.is_empty() {
            return None;
        }
        let mut skipped = Vec::new();
        let fleet = filter.global.as_ref().map(|g| &g.hasher);
        let rules = &filter.rules;
        let mut probes = keys::probes_where(
            &filter.config,
            &filter.hasher,
            fleet,
            |source| headers.fetch(source),
            &mut skipped,
            |rule| !filter.lease.as_ref().is_some_and(|l| l.is_leased(rule)) && rules.applies(rule, headers),
        );
        if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
            scope.annotate(&node.borrow(), &mut probes, now);
        }
        for rule in skipped {
            increment(filter.stats.rule(rule).skipped);
        }
        // Each rule's limit for the key and the request's cost against it (crate::ratelimit::rules).
        let mut later = Vec::new();
        for probe in &mut probes {
            probe.limit = rules.limit(probe.rule, probe.key_hash, headers);
            let limit = probe.limit.or_else(|| filter.limiter.tables().get(probe.rule).map(|t| t.limit));
            let admission = rules.admission(probe.rule, headers);
            if admission.invalid {
                increment(filter.stats.rule(probe.rule).invalid_cost);
            }
            probe.cost = limit.map_or(admission.now, |limit| rules::capped(admission.now, limit));
            if let (Later::BodyBytes | Later::ResponseHeader, Some(limit)) = (admission.later, limit) {
                later.push((*probe, admission.later, limit));
            }
        }
        let verdict = filter.limiter.check(&EnvoyStore, &mut filter.reserves.borrow_mut(), &probes, now);
        if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
            // An admission counts fleet-wide; a refusal asks for the key's fleet-wide count.
            let admitted = matches!(verdict, Verdict::Admitted { .. });
            let mut node = node.borrow_mut();
            for probe in &probes {
                let cost = if admitted { probe.cost } else { 0 };
                let dropped = scope.count(&mut node, std::slice::from_ref(probe), now, cost, 1);
                stats::add_count(filter.stats.global.dropped, dropped);
            }
        }
        match &verdict {
            Verdict::Admitted { standings, evictions } => {
                for (probe, when, limit) in later {
                    self.charges.owe(probe, when, limit);
                }
                for standing in standings {
                    increment(filter.stats.rule(standing.rule).allowed);
                }
                for rule in evictions {
                    increment(filter.stats.rule(*rule).evictions);
                }
                if filter.config.ratelimit_headers == RateLimitHeaders::Always {
                    self.ratelimit_fields = if self.lease_taken.standings.is_empty() {
                        filter.admitted_fields.tightest(standings)
                    } else {
                        let all: Vec<Standing> = standings.iter().chain(&self.lease_taken.standings).copied().collect();
                        filter.admitted_fields.tightest(&all)
                    };
                }
                None
            }
            Verdict::Rejected { violations } => {
                for violation in violations {
                    let stats = filter.stats.rule(violation.standing.rule);
                    increment(stats.rejected);
                    if violation.cause == Cause::Contention {
                        increment(stats.contention);
                    }
                }
                let reply = replies::rate_limited(&filter.limiter, &verdict, now)?;
                log::debug!("floodgate: 429 {}", reply.body);
                Some(reply)
            }
        }
    }

    /// Cluster selection: takes a lease on a cluster and routes the request to it (overwriting
    /// whatever the client sent in the route header), or returns the 503 when none has room.
    fn select(&mut self, filter: &Filter, headers: &RequestHeaders<'_, '_>, now: MonoMillis) -> Option<Reply> {
        let selector = filter.selector.as_ref()?;
        // The request's partition, when its key is confined to one (crate::shedding::per_key); a request
        // without the key may use every cluster.
        let confinement: Option<Confinement> = filter.partitioner.as_ref().and_then(|partitioner| {
            let confinement = partitioner.key_hash(|source| headers.fetch(source)).map(|hash| partitioner.confine(hash));
            if confinement.is_none() {
                increment(filter.stats.partition_unkeyed);
            }
            confinement
        });
        let chosen = RNG.with(|rng| {
            let mut rng = rng.borrow_mut();
            let mut state = filter.selection_vm.borrow_mut();
            match &confinement {
                Some(within) => selector.choose_within(&EnvoyStore, &mut state, now, &mut *rng, within),
                None => selector.choose(&EnvoyStore, &mut state, now, &mut *rng),
            }
        });
        let lease = match chosen {
            Ok(lease) => lease,
            Err(exhausted) => {
                increment(filter.stats.exhausted);
                if exhausted.contention {
                    increment(filter.stats.selection_contention);
                }
                log::debug!("floodgate: no cluster has room: {exhausted:?}");
                return Some(replies::no_capacity_within(selector, &exhausted, confinement.as_ref()));
            }
        };
        let cluster = selector.clusters.get(lease.cluster)?;
        // Setting a request header clears the route cache (ABI 0.2.1), so the route's
        // `cluster_header` reads the new value.
        let routed = hostcalls::set_map_value(MapType::HttpRequestHeaders, &selector.route_header, Some(cluster.name.as_str()));
        if let Err(status) = routed {
            log::warn!("floodgate: cannot set {}: {status:?}", selector.route_header);
            selector.finish(&EnvoyStore, &mut filter.selection_vm.borrow_mut(), lease, Outcome::Ignored, now);
            return Some(replies::no_capacity(selector, &crate::selection::Exhausted { clusters: Vec::new(), contention: true }));
        }
        increment(filter.stats.cluster(lease.cluster).selected);
        if confinement.is_some_and(|c| !c.members.contains(&lease.cluster)) {
            increment(filter.stats.partition_spilled);
        }
        log::debug!("floodgate: routed to {} ({} in flight)", cluster.name, lease.in_flight);
        self.cluster_lease = Some(lease);
        None
    }

    /// Ends the chosen cluster's lease with the stream's outcome.
    fn finish_cluster(&mut self, now: MonoMillis) {
        let (Some(lease), Some(selector)) = (self.cluster_lease.take(), self.filter.selector.as_ref()) else {
            return;
        };
        let status = property_u64(&["response", "code"])
            .and_then(|code| u16::try_from(code).ok())
            .filter(|c| *c > 0);
        // Flags change the outcome of a stream without a status or with a 5xx; a status below
        // 500 already sent downstream stands (one host call saved on the common path), unless
        // a gRPC call's status needs them.
        let failures = self.filter.config.cluster_selection.as_ref().map_or(&[][..], |s| &s.failure_grpc_statuses);
        let grpc = self.grpc.request.then_some(self.grpc.status);
        let flags = match status {
            Some(code) if code < 500 && grpc.is_none_or(|s| !crate::replies::grpc::needs_flags(s, failures)) => 0,
            _ => property_u64(&["response", "flags"]).unwrap_or(0),
        };
        let mut outcome = selector.classify(&lease, status, flags, self.timing);
        if let Some(grpc) = grpc {
            outcome = crate::replies::grpc::outcome(outcome, crate::replies::grpc::effective_status(grpc, status, flags), failures);
        }
        let finished = selector.finish(&EnvoyStore, &mut self.filter.selection_vm.borrow_mut(), lease, outcome, now);
        if self.filter.retired.get() {
            // Its configuration is gone: no heartbeat of it will write what is pending.
            selector.heartbeat(&EnvoyStore, &mut self.filter.selection_vm.borrow_mut(), now);
        }
        let ids = self.filter.stats.cluster(finished.cluster);
        increment(match outcome {
            Outcome::Success => ids.success,
            Outcome::Slow => ids.slow,
            Outcome::Failure | Outcome::Overflow => ids.failure,
            Outcome::Timeout => ids.timeout,
            Outcome::Ignored => ids.ignored,
        });
        if !finished.recorded {
            increment(self.filter.stats.selection_contention);
        }
        log::debug!("floodgate: {outcome:?} (status {status:?}, gRPC {grpc:?}, flags {flags:#x}) on cluster {}", finished.cluster);
    }

    /// Charges costs the admitted request owes its rules, known after admission (see
    /// [`crate::ratelimit::rules`]): into the keys' counters, and fleet-wide for rules in global scope.
    fn charge(&self, owed: Vec<(crate::ratelimit::Probe, u32)>) {
        if owed.iter().all(|(_, units)| *units == 0) {
            return;
        }
        let filter = &self.filter;
        let now = clock::now().wall;
        for (probe, units) in owed {
            let ids = filter.stats.rule(probe.rule);
            if filter.limiter.charge(&EnvoyStore, probe, units, now) {
                stats::add_count(ids.charged, u64::from(units));
            } else {
                increment(ids.contention);
            }
            if let (Some(scope), Some(node)) = (&filter.global, &filter.global_node) {
                let dropped = scope.count(&mut node.borrow_mut(), std::slice::from_ref(&probe), now, units, 0);
                stats::add_count(filter.stats.global.dropped, dropped);
            }
        }
    }

    /// The response headers came: charges the units the upstream reports (or the rules'
    /// defaults without a valid report).
    fn charge_response(&mut self) {
        let filter = Rc::clone(&self.filter);
        let rules = &filter.rules;
        let owed = self.charges.response(|rule| {
            let raw = rules
                .response_header(rule)
                .and_then(|name| hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name).ok().flatten());
            let (units, invalid) = rules.response_units(rule, raw.as_deref());
            if invalid {
                increment(filter.stats.rule(rule).invalid_cost);
            }
            units
        });
        self.charge(owed);
    }

    fn release(&mut self, now: MonoMillis) {
        if let (Some(lease), Some(shedder)) = (self.lease.take(), self.filter.shedder.as_ref()) {
            shedder.release(&EnvoyStore, vm_id(), lease, now);
        }
        if let (Some(lease), Some(cap)) = (self.key_lease.take(), self.filter.per_key.as_ref()) {
            cap.release(&EnvoyStore, vm_id(), lease, now);
        }
    }
}

impl Context for FilterStream {
    /// The answer to a lease call this stream sent ([`lease`]): it decides the requests
    /// waiting on the call's keys, this one among them.
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let filter = Rc::clone(&self.filter);
        if let Some(stage) = &filter.lease {
            stage.answered(&filter, token_id, num_headers, body_size, self.context_id, clock::now());
        }
        self.unpark();
    }
}

/// An integer attribute (Envoy encodes them as 8 little-endian bytes).
fn property_u64(path: &[&str]) -> Option<u64> {
    let bytes = hostcalls::get_property(path.to_vec()).ok().flatten()?;
    <[u8; 8]>::try_from(bytes.as_slice()).ok().map(u64::from_le_bytes)
}

fn fetch(source: Source<'_>) -> Option<Vec<u8>> {
    match source {
        Source::Header(name) => hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten(),
        Source::SourceAddress => hostcalls::get_property(vec!["source", "address"]).ok().flatten(),
    }
}

/// The request headers of the stream being decided, read as the configuration's
/// [`HeaderPlan`] says: from the whole map fetched once, or each on its own when asked (one
/// name only, or the host's map could not be read).
struct RequestHeaders<'p, 'm> {
    view: Option<HeaderView<'p, 'm>>,
}

impl<'p, 'm> RequestHeaders<'p, 'm> {
    /// Looks the plan's names up in `map` (the serialized request header map, if fetched).
    fn new(plan: &'p HeaderPlan, map: Option<&'m [u8]>) -> RequestHeaders<'p, 'm> {
        let view = map.and_then(|map| match HeaderView::parse(plan, map) {
            Ok(view) => Some(view),
            Err(malformed) => {
                log::debug!("floodgate: request header map not understood ({malformed:?}); reading headers one by one");
                None
            }
        });
        RequestHeaders { view }
    }

    /// The value of request header `name` (the first, as `get_map_value` reads it).
    fn get(&self, name: &str) -> Option<Cow<'m, [u8]>> {
        match self.view.as_ref().map(|view| view.get(name)) {
            Some(Lookup::Present(value)) => Some(Cow::Borrowed(value)),
            Some(Lookup::Absent) => None,
            Some(Lookup::NotLookedUp) | None => fetch(Source::Header(name)).map(Cow::Owned),
        }
    }

    /// A key part's attribute: a header from [`RequestHeaders::get`], a property from the host.
    fn fetch(&self, source: Source<'_>) -> Option<Cow<'m, [u8]>> {
        match source {
            Source::Header(name) => self.get(name),
            Source::SourceAddress => fetch(source).map(Cow::Owned),
        }
    }
}

impl Attributes for RequestHeaders<'_, '_> {
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        RequestHeaders::get(self, name)
    }
}

/// No `on_http_response_body`: the build removes that callback's export (`trim/`, run by
/// `wasm-build.sh`), so Envoy does not call into the VM for every response frame. Implementing it
/// here means taking it off `floodgate_trim::UNUSED_CALLBACKS` first.
impl HttpContext for FilterStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let filter = Rc::clone(&self.filter);
        let now = clock::now();
        let map = if filter.headers.whole_map() { header_map::request_headers() } else { None };
        let headers = RequestHeaders::new(&filter.headers, map.as_deref());
        let mut reply = self
            .health(&filter, &headers, now.mono)
            .or_else(|| self.shed(&filter, &headers, now.mono))
            .or_else(|| self.cap(&filter, &headers, now.mono));
        if let (None, Some(stage)) = (&reply, &filter.lease) {
            match stage.admit(&filter, &headers, self.context_id, end_of_stream, now) {
                Step::Go(taken) => self.lease_taken = taken,
                Step::Refuse(refusal) => reply = Some(refusal),
                Step::Wait(parked) => {
                    self.parked = Some(parked);
                    return Action::Pause;
                }
            }
        }
        self.finish_headers(&filter, &headers, now, end_of_stream, reply)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.unpark();
        if let Some(parked) = self.parked.as_ref().filter(|p| p.waits()) {
            // Held until the request is decided; counted then.
            parked.body.set((body_size, end_of_stream));
            return Action::Pause;
        }
        if end_of_stream && self.cluster_lease.is_some() && self.timing.request_end.is_none() {
            self.timing.request_end = Some(clock::mono());
        }
        if self.charges.counts_body() {
            self.charges.body(body_size);
            if end_of_stream {
                let owed = self.charges.body_done();
                self.charge(owed);
            }
        }
        Action::Continue
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.unpark();
        if let Some(parked) = self.parked.as_ref().filter(|p| p.waits()) {
            let (bytes, _) = parked.body.get();
            parked.body.set((bytes, true));
            return Action::Pause;
        }
        if self.cluster_lease.is_some() && self.timing.request_end.is_none() {
            self.timing.request_end = Some(clock::mono());
        }
        if self.charges.counts_body() {
            let owed = self.charges.body_done();
            self.charge(owed);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.unpark();
        if let Some(stage) = &self.filter.lease {
            stage.stream_ended(self.context_id, self.parked.as_ref());
        }
        if !self.charges.is_empty() {
            // A body cut short, a response that never came: charged what is known, or the
            // rule's default.
            let rules = &self.filter.rules;
            let owed = self.charges.end(|rule| rules.response_units(rule, None).0);
            self.charge(owed);
        }
        if self.lease.is_none() && self.key_lease.is_none() && self.cluster_lease.is_none() {
            return;
        }
        // One clock read for both: the stream ended once.
        let now = clock::mono();
        self.release(now);
        self.finish_cluster(now);
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.unpark();
        if self.replied {
            return Action::Continue;
        }
        if self.cluster_lease.is_some() {
            self.grpc.headers(end_of_stream);
        }
        if self.cluster_lease.is_some() && self.timing.response_headers.is_none() {
            self.timing.response_headers = Some(clock::mono());
        }
        if self.charges.awaits_response() {
            self.charge_response();
        }
        if let Some(tightest) = self.ratelimit_fields.take() {
            let policy = self.filter.admitted_fields.policy(&tightest).unwrap_or_default();
            for (name, value) in [("ratelimit-policy", policy.as_ref()), ("ratelimit", tightest.ratelimit.as_str())] {
                if let Err(status) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
                    log::debug!("floodgate: cannot add {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.unpark();
        if self.cluster_lease.is_some() {
            self.grpc.trailers();
        }
        Action::Continue
    }
}
