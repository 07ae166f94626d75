//! The proxy-wasm shell: reads the host (clock, headers, properties, call answers) once per
//! callback, hands what it read to the pipeline ([`crate::pipeline`]), and turns the pipeline's
//! answer into host calls (a local reply, a route header, a paused or resumed request, calls to
//! `floodgate-sync`). Nothing here decides anything.
//!
//! Lifecycle, as Envoy drives it: one VM per worker thread (statics are per VM) and a throw-away VM
//! that validates each configuration; a configuration gets a root context ([`FilterRoot`]) in every
//! VM, whose `on_configure` builds its [`Filter`] and whose `on_tick` runs its periodic work (every second, or faster with a global scope, a lag
//! probe, leased rules or a token bucket that delays requests); a
//! stream ([`FilterStream`]) keeps the `Filter` that created it to its end, even if the
//! configuration changes. A changed configuration gets a new root context in the same VM and the
//! old `Filter` is retired ([`Filter::retire`]): what it held ahead of use goes back, what it
//! counted locally is written. A new VM starts empty; shared data (same `vm_id`) survives it.
//!
//! Rationale: docs/design.md, section "A request's path".

mod call;
mod clock;
mod global;
mod grpc;
mod header_map;
mod metrics;
mod store;

use crate::config::{Config, SYNC_PATH};
use crate::fleet::batched::PROXIES_HEADER;
use crate::keys::fleet::FleetKey;
use crate::pipeline::headers::{HeaderPlan, HeaderView, Lookup};
use crate::keys::Source;
use crate::pipeline::{self, Attributes, Clock, Env, Filter, Host, Flow, LocalReply, Request, Schedule, SharedStream, Records, Step, Stream, StreamCell, StreamEnd, VmParts, Waiting};
use crate::primitives::inflight::LocalCount;
use crate::primitives::time::Now;
use crate::primitives::hash::{Random, SplitMix64};
use crate::shedding::per_key::LocalKeys;
use metrics::EnvoyMetrics;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use std::borrow::Cow;
use std::cell::{Cell, OnceCell, RefCell};
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
    /// The other workers' lease wake queues, by name, once resolved.
    static WAKE_QUEUES: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
    /// The `vm_id` Envoy runs this module under (its shared queues are named within it).
    static PLUGIN_VM_ID: String = hostcalls::get_property(vec!["plugin_vm_id"])
        .ok()
        .flatten()
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default();
    /// This VM's random source for the cluster shuffle, seeded from `getrandom`.
    static RNG: RefCell<SplitMix64> = RefCell::new(SplitMix64::new({
        let mut bytes = [0u8; 8];
        if getrandom::fill(&mut bytes).is_err() {
            bytes = clock::mono().0.to_le_bytes();
        }
        u64::from_le_bytes(bytes)
    }));
}

/// This VM's random source ([`RNG`]), reached only when a stage draws from it.
struct VmRandom;

impl Random for VmRandom {
    fn next_u64(&mut self) -> u64 {
        RNG.with(|rng| rng.borrow_mut().next_u64())
    }
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


/// The clocks as one callback sees them: read at the first need, then the same value.
#[derive(Default)]
struct CallbackClock(Cell<Option<Now>>);

impl Clock for CallbackClock {
    fn now(&self) -> Now {
        match self.0.get() {
            Some(now) => now,
            None => {
                let now = clock::now();
                self.0.set(Some(now));
                now
            }
        }
    }
}

/// Envoy, as the pipeline sees it.
struct Envoy;

impl Host for Envoy {
    type Store = EnvoyStore;
    type Metrics = EnvoyMetrics;
    type Clock = CallbackClock;
}

/// The pipeline's view of the host, for one callback.
fn env(clock: &CallbackClock) -> Env<'_, Envoy> {
    Env { store: &EnvoyStore, metrics: &EnvoyMetrics, clock, vm: vm_id() }
}

#[derive(Default)]
struct FilterRoot {
    /// Its context id.
    id: u32,
    filter: Option<Rc<Filter>>,
    /// When its periodic work last ran.
    schedule: Schedule,
    /// The shared queue where other workers put the keys whose call ended, for this worker's
    /// requests that wait on it (with leased rules).
    wake_queue: Option<u32>,
}

impl Context for FilterRoot {
    /// The host retires this root context: its configuration was replaced by another (which
    /// Envoy gives a new root context, in the same VM for a plugin-configuration change), or
    /// the filter was removed, or the VM shuts down. What the configuration holds for itself
    /// goes back now ([`Filter::retire`]); no later tick of this root context will.
    fn on_done(&mut self) -> bool {
        if let Some(filter) = self.filter.take() {
            let clock = CallbackClock::default();
            retire(&filter, self.id, &clock);
            log::debug!("floodgate: root context retired; its reserves were given back");
        }
        true
    }

    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let Some(filter) = &self.filter else { return };
        let clock = CallbackClock::default();
        // The answer goes to the first part whose call it is.
        let _ = lease_answered(filter, token_id, num_headers, body_size, self.id, &clock)
            || ask_answered(filter, token_id, num_headers, body_size, self.id, &clock)
            || batch_answered(filter, token_id, num_headers, body_size, &clock);
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
        if let (false, Some(at)) = (cfg!(feature = "response-body"), config.response_body_cost()) {
            log::error!(
                "floodgate: invalid configuration: {at}: \"response_body\" needs the module that reads response bodies (floodgate-llm.wasm); this one does not"
            );
            return false;
        }
        let namespace = plugin_name();
        let seed = match crate::keys::shared_seed(&EnvoyStore, &namespace, |seed| getrandom::fill(seed).map_err(|e| format!("getrandom: {e}"))) {
            Ok(seed) => seed,
            Err(err) => {
                log::error!("floodgate: cannot set up the shared key seed: {err}");
                return false;
            }
        };
        let clock = CallbackClock::default();
        if let Some(old) = self.filter.take() {
            retire(&old, self.id, &clock);
        }
        let vm = |records: Records<'_>| VmParts {
            local: local_count(records.inflight),
            key_counts: local_keys(records.key_table),
            cluster_counts: records.clusters.into_iter().map(local_count).collect(),
            global_node: records.global.then(|| global::node(&namespace, vm_id())),
        };
        let filter = Filter::new(config, &namespace, seed, vm_id(), self.id, vm, &EnvoyMetrics);
        self.wake_queue = filter.fleet().leased().and_then(|stage| match hostcalls::register_shared_queue(&stage.wake_queue(vm_id())) {
            Ok(queue) => Some(queue),
            Err(status) => {
                log::warn!("floodgate: no lease wake queue ({status:?}): requests waiting on another worker's call look at it at each tick");
                None
            }
        });
        if let Some(tick_ms) = filter.tick_ms() {
            if let Err(status) = hostcalls::set_tick_period(Duration::from_millis(tick_ms)) {
                log::warn!("floodgate: no tick ({status:?}): in-flight heartbeats and quota reserves disabled");
                // Reserves need the heartbeat to come back when unused.
                filter.without_reserves();
            }
        }
        log::info!(
            "floodgate: configured {namespace:?}: {} ({} shared-data records at most)",
            filter.config().summary(),
            filter.limits().limiter().tables().iter().map(|t| t.set_count()).sum::<u64>()
        );
        filter.selection_heartbeat(&env(&clock));
        filter.configured(&env(&clock));
        self.filter = Some(Rc::new(filter));
        true
    }

    fn on_tick(&mut self) {
        let Some(filter) = self.filter.clone() else { return };
        let clock = CallbackClock::default();
        let env = env(&clock);
        let now = clock.now();
        let due = self.schedule.due(&filter, now);
        if due.lag_probe {
            filter.probe_lag(&env);
        }
        if due.sync {
            sync(&filter, &clock);
        }
        if let Some(stage) = filter.fleet().leased() {
            let keys = stage.tick(&EnvoyStore, &EnvoyMetrics, now);
            wake(&filter, keys, self.id, &clock);
            stage.flush();
        }
        if let Some(stage) = filter.waits().delays() {
            let due = stage.take_due(now.mono);
            if !due.is_empty() {
                resume_streams(&filter, due, self.id, &clock, Waiting::Turn);
            }
        }
        if let Some(stage) = filter.waits().queue() {
            let ready = stage.tick(filter.shedding(), filter.stats(), &env);
            if !ready.is_empty() {
                resume_streams(&filter, ready, self.id, &clock, Waiting::Slot);
            }
        }
        if let Some(stage) = filter.waits().body_waits() {
            let due = stage.take_due(now.mono);
            if !due.is_empty() {
                resume_streams(&filter, due, self.id, &clock, Waiting::Body);
            }
        }
        if let Some(stage) = filter.fleet().asks() {
            let ready = stage.take_ready();
            if !ready.is_empty() {
                resume_streams(&filter, ready, self.id, &clock, Waiting::Asked);
            }
        }
        if due.heartbeat {
            filter.heartbeat(&env);
        }
        send_calls(&filter, self.id, &clock);
        // The next tick on the fleet's grid (Envoy arms the timer with the period as it stands
        // when this callback returns).
        if let Some(period) = Schedule::tick_period(&filter, now.wall) {
            let _ = hostcalls::set_tick_period(Duration::from_millis(period));
        }
    }

    /// Another worker put keys in this worker's wake queue: a call they wait on ended.
    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(filter) = self.filter.clone().filter(|_| self.wake_queue == Some(queue_id)) else { return };
        let mut keys = Vec::new();
        while let Ok(Some(bytes)) = hostcalls::dequeue_shared_queue(queue_id) {
            if let Ok(key) = <[u8; 16]>::try_from(bytes.as_slice()) {
                let key = FleetKey(u128::from_le_bytes(key));
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
        }
        let clock = CallbackClock::default();
        wake(&filter, keys, self.id, &clock);
        if let Some(stage) = filter.fleet().leased() {
            stage.flush();
        }
        send_calls(&filter, self.id, &clock);
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let filter = self.filter.clone()?;
        Some(Box::new(FilterStream { filter, context_id, stream: StreamCell::default() }))
    }
}

/// Retires a configuration ([`Filter::retire`]) from the root context `current`: the requests
/// waiting for a slot under it are shed (no tick of it will run again), the calls it queued
/// sent.
fn retire(filter: &Rc<Filter>, current: u32, clock: &CallbackClock) {
    filter.retire(&env(clock));
    if let Some(stage) = filter.waits().queue() {
        let ready = stage.drain(filter.stats(), &env(clock));
        if !ready.is_empty() {
            resume_streams(filter, ready, current, clock, Waiting::Slot);
        }
    }
    send_calls(filter, current, clock);
}

/// One tick of the batched global scope ([`Filter::sync`]): posts the batch it returns.
fn sync(filter: &Filter, clock: &CallbackClock) {
    let env = env(clock);
    let (Some(batch), Some(scope)) = (filter.sync(&env), filter.fleet().scope()) else { return };
    match call::post_json(&scope.route, SYNC_PATH, &batch.body, Duration::from_millis(scope.timeout_ms)) {
        Ok(token) => filter.batch_sent(&env, &batch, token),
        Err(status) => {
            filter.batch_not_sent(&env);
            log::warn!("floodgate: global sync to cluster {:?} not sent: {status:?}", scope.route.cluster);
        }
    }
}

/// The answer to the batched scope's batch call (`false`: `token` is not one): its status, body
/// and fleet-size header, read for [`Filter::batch_answered`].
fn batch_answered(filter: &Filter, token: u32, num_headers: usize, body_size: usize, clock: &CallbackClock) -> bool {
    if !filter.owns_batch(token) {
        return false;
    }
    let answer = call::answer(num_headers, body_size);
    let proxies = (num_headers > 0)
        .then(|| hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, PROXIES_HEADER).ok().flatten())
        .flatten();
    filter.batch_answered(&env(clock), token, answer, proxies.as_deref());
    true
}

/// Sends the calls the ask step queued ([`pipeline::asked`]), from `current`; a call the host
/// does not send decides its request at once, without the store.
fn send_asks(filter: &Rc<Filter>, current: u32, clock: &CallbackClock) {
    let (Some(stage), Some(scope), Some(node)) = (filter.fleet().asks(), filter.fleet().scope(), filter.fleet().node()) else { return };
    let timeout = Duration::from_millis(stage.timeout_ms);
    for call in stage.take_outgoing() {
        match call::post_json(&stage.route, crate::fleet::leased::protocol::LEASE_PATH, &call.body, timeout) {
            Ok(token) => stage.sent(&EnvoyMetrics, &filter.stats().global, call, token),
            Err(status) => {
                // Decided at the next tick: not from the callback that paused it.
                log::warn!("floodgate: ask to cluster {:?} not sent from {current}: {status:?}", stage.route.cluster);
                stage.not_sent(scope, node, &EnvoyStore, &EnvoyMetrics, &filter.stats().global, call, clock.now().wall);
            }
        }
    }
}

/// The answer to an ask's call (`false`: `token` is not one): decides its request again, from
/// the context `current` whose callback runs.
fn ask_answered(filter: &Rc<Filter>, token: u32, num_headers: usize, body_size: usize, current: u32, clock: &CallbackClock) -> bool {
    let (Some(stage), Some(scope), Some(node)) = (filter.fleet().asks(), filter.fleet().scope(), filter.fleet().node()) else { return false };
    if !stage.owns(token) {
        return false;
    }
    let answer = call::answer(num_headers, body_size);
    if let Some(stream) = stage.answered(scope, node, &EnvoyStore, &EnvoyMetrics, &filter.stats().global, token, answer, clock.now().wall) {
        resume_streams(filter, [stream], current, clock, Waiting::Asked);
    }
    true
}

/// Sends the calls the leased stage queued, from `current` (the context whose callback runs).
fn send_calls(filter: &Rc<Filter>, current: u32, clock: &CallbackClock) {
    send_asks(filter, current, clock);
    let Some(stage) = filter.fleet().leased() else { return };
    for call in stage.take_outgoing() {
        if call.owner != current {
            log::debug!("floodgate: a lease call of context {} sent from {current}", call.owner);
        }
        let timeout = Duration::from_millis(call.timeout_ms);
        match call::post_json(&stage.route, crate::fleet::leased::protocol::LEASE_PATH, &call.body, timeout) {
            Ok(token) => stage.sent(&EnvoyMetrics, call, token, clock.now()),
            Err(status) => {
                log::warn!("floodgate: lease call to cluster {:?} not sent: {status:?}", stage.route.cluster);
                stage.not_sent(&EnvoyStore, &EnvoyMetrics, &call, clock.now());
            }
        }
    }
    tell_all(filter);
}

/// Tells the other workers of this proxy that the calls of keys their requests wait on ended.
fn tell_all(filter: &Filter) {
    if let Some(stage) = filter.fleet().leased() {
        for (vm, key) in stage.take_notices() {
            tell(&stage.wake_queue(vm), key);
        }
    }
}

/// Puts `key` in the wake queue `name` of another worker of this proxy (its requests wait on
/// the call of `key` that ended).
fn tell(name: &str, key: FleetKey) {
    let queue = WAKE_QUEUES.with(|queues| {
        if let Some(queue) = queues.borrow().get(name) {
            return Some(*queue);
        }
        let vm = PLUGIN_VM_ID.with(|id| id.clone());
        let queue = hostcalls::resolve_shared_queue(&vm, name).ok().flatten()?;
        queues.borrow_mut().insert(name.to_owned(), queue);
        Some(queue)
    });
    match queue.map(|queue| hostcalls::enqueue_shared_queue(queue, Some(&key.0.to_le_bytes()))) {
        Some(Ok(())) => {}
        // Its requests look at the key at their root's next tick.
        other => log::debug!("floodgate: lease wake queue {name} not reached ({other:?})"),
    }
}

/// The answer to a lease call (`false`: `token` is not one): wakes the requests waiting on its
/// keys, from the context `current` whose callback runs.
fn lease_answered(filter: &Rc<Filter>, token: u32, num_headers: usize, body_size: usize, current: u32, clock: &CallbackClock) -> bool {
    let Some(stage) = filter.fleet().leased() else { return false };
    if !stage.owns(token) {
        return false;
    }
    let answer = call::answer(num_headers, body_size);
    if let Some(keys) = stage.answered(&EnvoyStore, &EnvoyMetrics, token, answer, clock.now()) {
        wake(filter, keys, current, clock);
    }
    send_calls(filter, current, clock);
    true
}

/// Decides the requests waiting on `keys` again, in order, each from its own context (made the
/// effective one), then gives the effective context back to `current`.
fn wake(filter: &Rc<Filter>, keys: Vec<FleetKey>, current: u32, clock: &CallbackClock) {
    let Some(stage) = filter.fleet().leased() else { return };
    // Every stream the answer wakes is taken before any is resumed: a resumed request that goes
    // on to wait on another of these keys waits for that key's next answer.
    let streams: Vec<(u32, SharedStream)> = keys.into_iter().flat_map(|key| stage.take_waiting(key)).collect();
    resume_streams(filter, streams, current, clock, Waiting::Store);
}

/// Resumes the paused `streams`, in order, each from its own context (made the effective one),
/// then gives the effective context back to `current`.
fn resume_streams(filter: &Rc<Filter>, streams: impl IntoIterator<Item = (u32, SharedStream)>, current: u32, clock: &CallbackClock, what: Waiting) {
    for (context, shared) in streams {
        if !shared.borrow().waits_for(what) {
            continue;
        }
        let env = env(clock);
        if hostcalls::set_effective_context(context).is_err() {
            pipeline::abandon(filter, &env, &shared, what);
            continue;
        }
        let map = if filter.headers().whole_map() { header_map::request_headers() } else { None };
        let request = RequestHeaders::new(filter.headers(), map.as_deref());
        let step = pipeline::resume(filter, &env, &shared, context, &request, &mut VmRandom, what);
        if apply(filter, &env, &shared, step) == Action::Continue {
            if let Err(status) = hostcalls::resume_http_request() {
                log::debug!("floodgate: cannot resume a request: {status:?}");
            }
        }
    }
    if let Err(status) = hostcalls::set_effective_context(current) {
        log::debug!("floodgate: cannot restore the effective context: {status:?}");
    }
}

/// Turns the pipeline's step into host calls: the route header set, or the local reply sent.
fn apply(filter: &Filter, env: &Env<'_, Envoy>, shared: &RefCell<Stream>, step: Step) -> Action {
    let decided = step != Step::Wait;
    let action = act(filter, env, shared, step);
    if decided && filter.config().access_log {
        // Filter state, which access logs read as %FILTER_STATE(wasm.floodgate.outcome:PLAIN)%.
        for (name, value) in shared.borrow().decision().fields(filter, filter.decision_names()) {
            if let Err(status) = hostcalls::set_property(vec![name], Some(value.as_bytes())) {
                log::debug!("floodgate: cannot set {name}: {status:?}");
            }
        }
    }
    action
}

/// Carries out a step.
fn act(filter: &Filter, env: &Env<'_, Envoy>, shared: &RefCell<Stream>, step: Step) -> Action {
    match step {
        Step::Continue { route: None } => Action::Continue,
        Step::Continue { route: Some(cluster) } => {
            let Some(selector) = filter.selection().selector() else { return Action::Continue };
            let name = selector.clusters.get(cluster).map_or("", |c| c.name.as_str());
            // Setting a request header clears the route cache (ABI 0.2.1), so the route's
            // `cluster_header` reads the new value.
            match hostcalls::set_map_value(MapType::HttpRequestHeaders, &selector.route_header, Some(name)) {
                Ok(()) => Action::Continue,
                Err(status) => {
                    log::warn!("floodgate: cannot set {}: {status:?}", selector.route_header);
                    let reply = shared.borrow_mut().unroutable(filter, env);
                    send_reply(&reply)
                }
            }
        }
        Step::Reply(reply) => send_reply(&reply),
        Step::Wait => Action::Pause,
    }
}

/// Sends a local reply; the filter then stops the request.
fn send_reply(reply: &LocalReply) -> Action {
    match reply {
        LocalReply::Grpc(reply) => grpc::send(reply),
        LocalReply::Http(reply) => {
            let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            if let Err(status) = hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes())) {
                log::warn!("floodgate: local reply failed: {status:?}");
            }
        }
    }
    Action::Pause
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

struct FilterStream {
    filter: Rc<Filter>,
    /// Its context id.
    context_id: u32,
    /// The request's state, shared with the leased stage once it waits.
    stream: StreamCell,
}

impl Context for FilterStream {
    /// The answer to a lease call this stream sent: it decides the requests waiting on the
    /// call's keys, this one among them.
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let clock = CallbackClock::default();
        if !lease_answered(&self.filter, token_id, num_headers, body_size, self.context_id, &clock) {
            ask_answered(&self.filter, token_id, num_headers, body_size, self.context_id, &clock);
        }
    }
}

/// A response header map of the callback that runs (headers, or trailers).
struct ResponseMap(MapType);

impl Attributes for ResponseMap {
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        // The bytes getter: the `String` ones panic on a value that is not UTF-8.
        hostcalls::get_map_value_bytes(self.0, name).ok().flatten().map(Cow::Owned)
    }
}

/// What ended the stream, read from Envoy's attributes when asked.
struct EnvoyStreamEnd;

impl StreamEnd for EnvoyStreamEnd {
    fn status(&self) -> Option<u16> {
        property_u64(&["response", "code"]).and_then(|code| u16::try_from(code).ok())
    }
    fn flags(&self) -> u64 {
        property_u64(&["response", "flags"]).unwrap_or(0)
    }
}

/// No `on_http_response_body`: the build removes that callback's export (`trim/`, run by
/// `wasm-build.sh`), so Envoy does not call into the VM for every response frame. Implementing it
/// here means taking it off `floodgate_trim::UNUSED_CALLBACKS` first.
impl HttpContext for FilterStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let filter = Rc::clone(&self.filter);
        let clock = CallbackClock::default();
        let env = env(&clock);
        let map = if filter.headers().whole_map() { header_map::request_headers() } else { None };
        let request = RequestHeaders::new(filter.headers(), map.as_deref());
        let step = pipeline::request_headers(&filter, &env, &mut self.stream, self.context_id, &request, end_of_stream, &mut VmRandom);
        send_calls(&filter, self.context_id, &clock);
        apply(&filter, &env, &self.stream, step)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if let Some((start, len)) = pipeline::estimate_wants(&self.stream, body_size) {
            // The request waits for its estimates: the new bytes of the body Envoy holds.
            let chunk = if len == 0 { None } else { hostcalls::get_buffer(BufferType::HttpRequestBody, start, len).ok().flatten() };
            return self.decide_on_body(chunk.as_deref().unwrap_or_default(), Some(body_size), end_of_stream);
        }
        let clock = CallbackClock::default();
        let flow = self.stream.borrow_mut().request_body(&self.filter, &env(&clock), body_size, end_of_stream);
        action(flow)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if pipeline::estimate_wants(&self.stream, 0).is_some() {
            return self.decide_on_body(&[], None, true);
        }
        let clock = CallbackClock::default();
        let flow = self.stream.borrow_mut().request_trailers(&self.filter, &env(&clock));
        action(flow)
    }

    fn on_log(&mut self) {
        let mut stream = self.stream.borrow_mut();
        if !stream.needs_end() {
            return;
        }
        let clock = CallbackClock::default();
        stream.end(&self.filter, &env(&clock), self.context_id, &EnvoyStreamEnd);
        drop(stream);
        // A lease call this stream sent is lost with it: the workers waiting on it are told.
        tell_all(&self.filter);
    }

    /// A response body frame (`body_size` bytes; `end_of_stream`: the last), read for the
    /// counts the rules wait for. Built only into the module that reads response bodies (see
    /// `filter/Cargo.toml`, feature `response-body`): the default module does not export this
    /// callback at all.
    #[cfg(feature = "response-body")]
    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mut stream = self.stream.borrow_mut();
        if !stream.reads_response_body() {
            return Action::Continue;
        }
        // The frame only (the filter returns Continue: Envoy buffers nothing for it).
        let chunk = if body_size == 0 { None } else { hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size).ok().flatten() };
        let clock = CallbackClock::default();
        stream.response_body(&self.filter, &env(&clock), chunk.as_deref().unwrap_or_default(), end_of_stream);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let clock = CallbackClock::default();
        let tightest = self.stream.borrow_mut().response_headers(&self.filter, &env(&clock), &ResponseMap(MapType::HttpResponseHeaders), end_of_stream);
        if let Some(tightest) = tightest {
            let policy = self.filter.limits().admitted_fields().policy(&tightest).unwrap_or_default();
            for (name, value) in [("ratelimit-policy", policy.as_ref()), ("ratelimit", tightest.ratelimit.as_str())] {
                if let Err(status) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
                    log::debug!("floodgate: cannot add {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.stream.borrow_mut().response_trailers(&ResponseMap(MapType::HttpResponseTrailers));
        Action::Continue
    }
}

impl FilterStream {
    /// The next bytes of the body of a request that waits for its estimates (`body_size`: held
    /// so far; `end`: the body ended): decided once they are known, the request goes on with
    /// the body Envoy held (`Continue`), or is answered; else Envoy holds the body on (`Pause`).
    fn decide_on_body(&mut self, chunk: &[u8], body_size: Option<usize>, end: bool) -> Action {
        let filter = Rc::clone(&self.filter);
        let clock = CallbackClock::default();
        let env = env(&clock);
        let map = if filter.headers().whole_map() { header_map::request_headers() } else { None };
        let request = RequestHeaders::new(filter.headers(), map.as_deref());
        let decided = pipeline::request_body_estimates(&filter, &env, &mut self.stream, self.context_id, &request, chunk, body_size, end, &mut VmRandom);
        let Some(step) = decided else { return Action::Pause };
        send_calls(&filter, self.context_id, &clock);
        apply(&filter, &env, &self.stream, step)
    }
}

fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
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
    /// The matched route's name, once a rule asked for it.
    route: OnceCell<Option<Vec<u8>>>,
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
        RequestHeaders { view, route: OnceCell::new() }
    }

    /// The value of request header `name` (the first, as `get_map_value` reads it).
    fn get(&self, name: &str) -> Option<Cow<'m, [u8]>> {
        match self.view.as_ref().map(|view| view.get(name)) {
            Some(Lookup::Present(value)) => Some(Cow::Borrowed(value)),
            Some(Lookup::Absent) => None,
            Some(Lookup::NotLookedUp) | None => fetch(Source::Header(name)).map(Cow::Owned),
        }
    }
}

impl Attributes for RequestHeaders<'_, '_> {
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        RequestHeaders::get(self, name)
    }

    fn route(&self) -> Option<Cow<'_, [u8]>> {
        let route = self.route.get_or_init(|| hostcalls::get_property(vec!["xds", "route_name"]).ok().flatten().filter(|r| !r.is_empty()));
        route.as_deref().map(Cow::Borrowed)
    }
}

impl Request for RequestHeaders<'_, '_> {
    fn source_address(&self) -> Option<Cow<'_, [u8]>> {
        fetch(Source::SourceAddress).map(Cow::Owned)
    }
}
