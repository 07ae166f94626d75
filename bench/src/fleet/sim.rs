//! The simulated fleet: each proxy is its own shared data (a [`MemoryStore`], Envoy's semantics)
//! and its workers, each worker one [`Filter`] as a VM of its own, all running the module's own
//! code natively. This file plays the Envoy shell's part (filter/src/host/mod.rs and
//! filter/src/host/global.rs) on the real clock: the request headers of each request, the root
//! context's ticks, the calls to `floodgate-sync` (sent by [`super::calls`]) and their answers,
//! the leased stage's wake queues between workers, the paused requests resumed.
//!
//! A request's upstream answers at once: an admitted request's stream ends as soon as it is
//! decided. Everything runs on one thread, as each Envoy worker does.

use super::calls::{Call, Conn, Done, Kind};
use super::tally::{Admission, Tally};
use floodgate::config::{Config, SYNC_PATH};
use floodgate::fleet::batched::VmNode;
use floodgate::fleet::leased::protocol::LEASE_PATH;
use floodgate::keys::fleet::FleetKey;
use floodgate::pipeline::stats::{MetricKind, Metrics};
use floodgate::pipeline::{self, Attributes, Clock, Env, Filter, Host, Request, Schedule, Records, SharedStream, Step, StreamCell, StreamEnd, VmParts, Waiting};
use floodgate::primitives::hash::{Random, SplitMix64};
use floodgate::primitives::inflight::HEARTBEAT_MS;
use floodgate::primitives::store::MemoryStore;
use floodgate::primitives::time::{MonoMillis, Now, UnixMillis};
use floodgate::shedding::per_key::LocalKeys;
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::{BinaryHeap, HashMap};
use std::cmp::Reverse;
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedSender;

/// The header the rules key on.
pub const KEY_HEADER: &str = "x-key";
/// The plugin's name (the shared data's namespace).
const NAMESPACE: &str = "fleet";

/// The fleet's stats, summed over every worker of every proxy (Envoy's stats of one proxy,
/// added up).
#[derive(Default)]
pub struct FleetMetrics {
    names: RefCell<Vec<String>>,
    values: RefCell<Vec<i64>>,
}

impl Metrics for FleetMetrics {
    fn define(&self, _kind: MetricKind, name: &str) -> Option<u32> {
        let mut names = self.names.borrow_mut();
        let id = names.iter().position(|n| n == name).unwrap_or_else(|| {
            names.push(name.to_owned());
            self.values.borrow_mut().push(0);
            names.len() - 1
        });
        u32::try_from(id).ok()
    }
    fn add(&self, id: u32, delta: i64) {
        if let Some(v) = self.values.borrow_mut().get_mut(id as usize) {
            *v += delta;
        }
    }
    fn record(&self, id: u32, value: u64) {
        if let Some(v) = self.values.borrow_mut().get_mut(id as usize) {
            *v = i64::try_from(value).unwrap_or(i64::MAX);
        }
    }
}

impl FleetMetrics {
    /// A counter's value, by name (0 when never defined).
    pub fn get(&self, name: &str) -> i64 {
        let names = self.names.borrow();
        names.iter().position(|n| n == name).and_then(|i| self.values.borrow().get(i).copied()).unwrap_or(0)
    }
}

/// The clocks of one callback.
pub struct CallbackClock(Now);

impl Clock for CallbackClock {
    fn now(&self) -> Now {
        self.0
    }
}

/// The simulated host, as the pipeline sees it.
pub struct Sim;

impl Host for Sim {
    type Store = MemoryStore;
    type Metrics = FleetMetrics;
    type Clock = CallbackClock;
}

/// A request: its method, path and key.
struct SimRequest<'a> {
    key: &'a str,
}

impl Attributes for SimRequest<'_> {
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        match name {
            ":method" => Some(Cow::Borrowed(b"GET")),
            ":path" => Some(Cow::Borrowed(b"/")),
            KEY_HEADER => Some(Cow::Borrowed(self.key.as_bytes())),
            _ => None,
        }
    }
}

impl Request for SimRequest<'_> {
    fn source_address(&self) -> Option<Cow<'_, [u8]>> {
        Some(Cow::Borrowed(b"10.0.0.1:5555"))
    }
}

/// How a stream ended.
struct Ended(u16);

impl StreamEnd for Ended {
    fn status(&self) -> Option<u16> {
        Some(self.0)
    }
    fn flags(&self) -> u64 {
        0
    }
}

/// A paused request.
struct Paused {
    key: u32,
    arrived: Instant,
    /// The stream's state as the host context holds it (shared with the stage that parked it).
    _cell: StreamCell,
}

/// One worker: a VM with its filter.
struct Worker {
    filter: Rc<Filter>,
    vm: u64,
    schedule: Schedule,
    paused: HashMap<u32, Paused>,
    rng: SplitMix64,
}

/// One proxy: its shared data, its workers, its connection to its `floodgate-sync` replica.
struct Proxy {
    store: MemoryStore,
    /// The VMs: first those that serve requests, then the idle ones (Envoy's main thread's).
    workers: Vec<Worker>,
    /// VMs that serve requests.
    serving: usize,
    /// Which worker gets the next request.
    next: usize,
    generation: u32,
    conn: Rc<Conn>,
}

/// The fleet's counters of store calls.
#[derive(Clone, Debug, Default)]
pub struct CallCounts {
    /// Calls sent, by kind: batches, asks, leases.
    pub sent: [u64; 3],
    /// Calls that failed (no answer in time, a connection lost, a status other than 200).
    pub failed: u64,
    /// Request and response body bytes.
    pub bytes: u64,
    /// Each call's time to its answer (or failure), µs.
    pub took_us: Vec<u64>,
}

/// The tick heap's entry: when, which proxy, its generation, which worker.
type TickAt = Reverse<(u64, usize, u32, usize)>;

/// The whole simulated fleet.
pub struct Fleet {
    config: String,
    /// VMs per proxy that serve no request but tick, as the main thread's VM of an Envoy does
    /// (`on_tick` fires in every VM: it may lead the proxy's batches).
    idle_vms: usize,
    proxies: Vec<Proxy>,
    metrics: FleetMetrics,
    /// When the run started (the monotonic clock's origin).
    origin: Instant,
    /// The key values, by index (`<run>-<index>`).
    prefix: String,
    ticks: BinaryHeap<TickAt>,
    tick_ms: u64,
    done: UnboundedSender<Done>,
    next_token: Cell<u32>,
    next_context: Cell<u32>,
    seed: RefCell<SplitMix64>,
    /// Calls in flight.
    pub in_flight: u64,
    /// Counters of store calls.
    pub calls: CallCounts,
    /// Every decision.
    pub tally: Tally,
    /// Requests still paused when a proxy was restarted (lost with it).
    pub abandoned: u64,
    /// Leased keys as the store names them (32 hex characters) and their window, the first
    /// [`HOLDER_SAMPLE`] seen in lease calls: whose holders the run reads at its end.
    pub leased_keys: Vec<(String, u64)>,
}

/// Leased keys whose holders a run reads.
const HOLDER_SAMPLE: usize = 8;

impl Fleet {
    /// A fleet of `proxies` proxies with `workers` workers each running `config` (JSON), the
    /// proxy `i` calling `sync[i % sync.len()]`; keys named `<prefix>-<index>`; `idle_vms` more
    /// VMs per proxy that tick and serve no request (Envoy's main thread's).
    #[allow(clippy::too_many_arguments)]
    pub fn new(config: &str, proxies: usize, workers: usize, idle_vms: usize, sync: &[std::net::SocketAddr], prefix: &str, tally: Tally, done: UnboundedSender<Done>, seed: u64) -> Result<Fleet, String> {
        Config::parse(config.as_bytes()).map_err(|e| e.to_string())?;
        let mut fleet = Fleet {
            config: config.to_owned(),
            idle_vms,
            proxies: Vec::new(),
            metrics: FleetMetrics::default(),
            origin: Instant::now(),
            prefix: prefix.to_owned(),
            ticks: BinaryHeap::new(),
            tick_ms: HEARTBEAT_MS,
            done,
            next_token: Cell::new(1),
            next_context: Cell::new(1000),
            seed: RefCell::new(SplitMix64::new(seed)),
            in_flight: 0,
            calls: CallCounts::default(),
            tally,
            abandoned: 0,
            leased_keys: Vec::new(),
        };
        for p in 0..proxies {
            let conn = Conn::new(sync[p % sync.len()]);
            let proxy = fleet.proxy(workers, 0, conn)?;
            if let Some(worker) = proxy.workers.first() {
                fleet.tick_ms = tick_ms(&worker.filter);
            }
            fleet.proxies.push(proxy);
            fleet.schedule_ticks(p);
        }
        Ok(fleet)
    }

    /// The fleet's stats.
    pub fn metrics(&self) -> &FleetMetrics {
        &self.metrics
    }

    /// Both clocks now.
    pub fn now(&self) -> Now {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        // A monotonic clock far from 0, as a host's is.
        let mono = 1_000_000_000 + self.origin.elapsed().as_millis() as u64;
        Now { wall: UnixMillis(wall), mono: MonoMillis(mono) }
    }

    fn proxy(&self, workers: usize, generation: u32, conn: Rc<Conn>) -> Result<Proxy, String> {
        let mut seed = [0u8; 16];
        {
            let mut rng = self.seed.borrow_mut();
            seed[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
            seed[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let mut proxy = Proxy { store: MemoryStore::new(), workers: Vec::new(), serving: workers.max(1), next: 0, generation, conn };
        for _ in 0..workers.max(1) + self.idle_vms {
            let config = Config::parse(self.config.as_bytes()).map_err(|e| e.to_string())?;
            let vm = self.seed.borrow_mut().next_u64();
            let root = self.context();
            let parts = |records: Records<'_>| VmParts {
                local: Default::default(),
                key_counts: LocalKeys::default(),
                cluster_counts: records.clusters.iter().map(|_| Default::default()).collect(),
                global_node: records.global.then(|| Rc::new(RefCell::new(VmNode::new(vm)))),
            };
            let filter = Filter::new(config, NAMESPACE, seed, vm, root, parts, &self.metrics);
            let clock = CallbackClock(self.now());
            let env = Env::<Sim> { store: &proxy.store, metrics: &self.metrics, clock: &clock, vm };
            filter.selection_heartbeat(&env);
            filter.configured(&env);
            proxy.workers.push(Worker { filter: Rc::new(filter), vm, schedule: Schedule::default(), paused: HashMap::new(), rng: SplitMix64::new(vm) });
        }
        Ok(proxy)
    }

    fn context(&self) -> u32 {
        let c = self.next_context.get();
        self.next_context.set(c.wrapping_add(1));
        c
    }

    fn token(&self) -> u32 {
        let t = self.next_token.get();
        self.next_token.set(t.wrapping_add(1).max(1));
        t
    }

    /// Each worker of proxy `p` ticks from now on, their first ticks spread over a period.
    fn schedule_ticks(&mut self, p: usize) {
        let now = self.now().mono.0;
        let proxy = &self.proxies[p];
        let spread = self.tick_ms.max(1);
        let offset = (p as u64).wrapping_mul(7) % spread;
        for w in 0..proxy.workers.len() {
            self.ticks.push(Reverse((now + offset + w as u64 % spread, p, proxy.generation, w)));
        }
    }

    /// When the next tick is due (monotonic ms).
    pub fn next_tick(&self) -> Option<u64> {
        self.ticks.peek().map(|Reverse((at, ..))| *at)
    }

    /// Runs the ticks due now.
    pub fn run_ticks(&mut self) {
        let now = self.now().mono.0;
        while let Some(&Reverse((at, p, generation, w))) = self.ticks.peek() {
            if at > now {
                break;
            }
            self.ticks.pop();
            if self.proxies.get(p).is_none_or(|proxy| proxy.generation != generation) {
                continue;
            }
            self.tick(p, w);
            // The period the tick sets, as the host shell does: on the fleet's grid when the sync
            // drives the tick.
            let aligned = self.proxies.get(p).and_then(|proxy| proxy.workers.get(w)).and_then(|worker| Schedule::tick_period(&worker.filter, self.now().wall));
            let next = match aligned {
                Some(period) => now + period,
                None => at.max(now.saturating_sub(self.tick_ms)) + self.tick_ms,
            };
            self.ticks.push(Reverse((next, p, generation, w)));
        }
    }

    /// One request of key `key` on proxy `p`.
    pub fn request(&mut self, p: usize, key: u32) {
        let Some(proxy) = self.proxies.get_mut(p) else { return };
        let w = proxy.next % proxy.serving;
        proxy.next = proxy.next.wrapping_add(1);
        let context = self.context();
        let name = format!("{}-{key}", self.prefix);
        let now = self.now();
        let clock = CallbackClock(now);
        let proxy = &mut self.proxies[p];
        let worker = &mut proxy.workers[w];
        let filter = Rc::clone(&worker.filter);
        let env = Env::<Sim> { store: &proxy.store, metrics: &self.metrics, clock: &clock, vm: worker.vm };
        let mut cell = StreamCell::default();
        let step = pipeline::request_headers(&filter, &env, &mut cell, context, &SimRequest { key: &name }, true, &mut worker.rng);
        match step {
            Step::Wait => {
                worker.paused.insert(context, Paused { key, arrived: Instant::now(), _cell: cell });
            }
            step => {
                let status = status_of(&step);
                record(&mut self.tally, &filter, p, key, status, now.wall.0, None);
                let mut stream = cell.borrow_mut();
                if stream.needs_end() {
                    stream.end(&filter, &env, context, &Ended(status));
                }
            }
        }
        self.send_calls(p, w);
    }

    /// One tick of worker `w` of proxy `p` (`on_tick`).
    fn tick(&mut self, p: usize, w: usize) {
        let now = self.now();
        let clock = CallbackClock(now);
        let proxy = &mut self.proxies[p];
        let generation = proxy.generation;
        let worker = &mut proxy.workers[w];
        let filter = Rc::clone(&worker.filter);
        let env = Env::<Sim> { store: &proxy.store, metrics: &self.metrics, clock: &clock, vm: worker.vm };
        let due = worker.schedule.due(&filter, now);
        if due.lag_probe {
            filter.probe_lag(&env);
        }
        let mut batch = None;
        if let (true, Some(scope)) = (due.sync, filter.fleet().scope()) {
            if let Some(outgoing) = filter.sync(&env) {
                let token = self.next_token.get();
                self.next_token.set(token.wrapping_add(1).max(1));
                filter.batch_sent(&env, &outgoing, token);
                batch = Some(Call {
                    proxy: p,
                    generation,
                    worker: w,
                    token,
                    kind: Kind::Batch,
                    path: SYNC_PATH,
                    authority: scope.route.authority.clone(),
                    body: outgoing.body,
                    timeout: Duration::from_millis(scope.timeout_ms),
                });
            }
        }
        let mut woken = Vec::new();
        if let Some(stage) = filter.fleet().leased() {
            woken = stage.tick(&proxy.store, &self.metrics, now);
        }
        let ready = filter.fleet().asks().map(|s| s.take_ready()).unwrap_or_default();
        if due.heartbeat {
            filter.heartbeat(&env);
        }
        if let Some(call) = batch {
            self.send(call);
        }
        self.wake(p, w, woken);
        if let Some(stage) = filter.fleet().leased() {
            stage.flush();
        }
        self.resume(p, w, ready, Waiting::Asked);
        self.send_calls(p, w);
    }

    fn send(&mut self, call: Call) {
        if call.kind == Kind::Lease && self.leased_keys.len() < HOLDER_SAMPLE {
            for (key, window_ms) in lease_keys(&call.body) {
                if self.leased_keys.len() < HOLDER_SAMPLE && !self.leased_keys.iter().any(|(k, _)| *k == key) {
                    self.leased_keys.push((key, window_ms));
                }
            }
        }
        let Some(proxy) = self.proxies.get(call.proxy) else { return };
        self.calls.sent[match call.kind {
            Kind::Batch => 0,
            Kind::Ask => 1,
            Kind::Lease => 2,
        }] += 1;
        self.in_flight += 1;
        proxy.conn.send(call, self.done.clone());
    }

    /// Sends the calls worker `w` of proxy `p` queued (asks, leases), then tells the other
    /// workers about the keys whose calls ended (`send_calls`).
    fn send_calls(&mut self, p: usize, w: usize) {
        let now = self.now();
        let proxy = &self.proxies[p];
        let generation = proxy.generation;
        let filter = Rc::clone(&proxy.workers[w].filter);
        let mut calls = Vec::new();
        if let (Some(stage), Some(_)) = (filter.fleet().asks(), filter.fleet().scope()) {
            for call in stage.take_outgoing() {
                let token = self.token();
                calls.push(Call {
                    proxy: p,
                    generation,
                    worker: w,
                    token,
                    kind: Kind::Ask,
                    path: LEASE_PATH,
                    authority: stage.route.authority.clone(),
                    body: call.body.clone(),
                    timeout: Duration::from_millis(stage.timeout_ms),
                });
                stage.sent(&self.metrics, &filter.stats().global, call, token);
            }
        }
        if let Some(stage) = filter.fleet().leased() {
            for call in stage.take_outgoing() {
                let token = self.token();
                calls.push(Call {
                    proxy: p,
                    generation,
                    worker: w,
                    token,
                    kind: Kind::Lease,
                    path: LEASE_PATH,
                    authority: stage.route.authority.clone(),
                    body: call.body.clone(),
                    timeout: Duration::from_millis(call.timeout_ms),
                });
                stage.sent(&self.metrics, call, token, now);
            }
        }
        for call in calls {
            self.send(call);
        }
        self.tell_all(p, w);
    }

    /// The other workers of proxy `p` whose requests wait on keys whose calls ended are told
    /// (Envoy's shared queues), and wake them.
    fn tell_all(&mut self, p: usize, w: usize) {
        let mut todo = vec![w];
        while let Some(w) = todo.pop() {
            let proxy = &self.proxies[p];
            let Some(stage) = proxy.workers[w].filter.fleet().leased() else { return };
            let notices = stage.take_notices();
            let mut by_worker: Vec<(usize, Vec<FleetKey>)> = Vec::new();
            for (vm, key) in notices {
                let Some(other) = proxy.workers.iter().position(|x| x.vm == vm) else { continue };
                match by_worker.iter_mut().find(|(o, _)| *o == other) {
                    Some((_, keys)) if !keys.contains(&key) => keys.push(key),
                    Some(_) => {}
                    None => by_worker.push((other, vec![key])),
                }
            }
            for (other, keys) in by_worker {
                // on_queue_ready: wake, flush, send.
                self.wake(p, other, keys);
                if let Some(stage) = self.proxies[p].workers[other].filter.fleet().leased() {
                    stage.flush();
                }
                self.send_calls_only(p, other);
                todo.push(other);
            }
        }
    }

    /// [`Fleet::send_calls`] without telling the other workers (the caller does).
    fn send_calls_only(&mut self, p: usize, w: usize) {
        let now = self.now();
        let proxy = &self.proxies[p];
        let generation = proxy.generation;
        let filter = Rc::clone(&proxy.workers[w].filter);
        let mut calls = Vec::new();
        if let Some(stage) = filter.fleet().leased() {
            for call in stage.take_outgoing() {
                let token = self.token();
                calls.push(Call {
                    proxy: p,
                    generation,
                    worker: w,
                    token,
                    kind: Kind::Lease,
                    path: LEASE_PATH,
                    authority: stage.route.authority.clone(),
                    body: call.body.clone(),
                    timeout: Duration::from_millis(call.timeout_ms),
                });
                stage.sent(&self.metrics, call, token, now);
            }
        }
        for call in calls {
            self.send(call);
        }
    }

    /// The requests of worker `w` waiting on `keys` decided again.
    fn wake(&mut self, p: usize, w: usize, keys: Vec<FleetKey>) {
        let filter = Rc::clone(&self.proxies[p].workers[w].filter);
        let Some(stage) = filter.fleet().leased() else { return };
        let streams: Vec<(u32, SharedStream)> = keys.into_iter().flat_map(|key| stage.take_waiting(key)).collect();
        self.resume(p, w, streams, Waiting::Store);
    }

    /// Resumes paused requests of worker `w` of proxy `p`.
    fn resume(&mut self, p: usize, w: usize, streams: Vec<(u32, SharedStream)>, what: Waiting) {
        if streams.is_empty() {
            return;
        }
        let now = self.now();
        let clock = CallbackClock(now);
        let proxy = &mut self.proxies[p];
        let worker = &mut proxy.workers[w];
        let filter = Rc::clone(&worker.filter);
        let env = Env::<Sim> { store: &proxy.store, metrics: &self.metrics, clock: &clock, vm: worker.vm };
        for (context, shared) in streams {
            if !shared.borrow().waits_for(what) {
                continue;
            }
            let Some(paused) = worker.paused.remove(&context) else {
                pipeline::abandon(&filter, &env, &shared, what);
                continue;
            };
            let name = format!("{}-{}", self.prefix, paused.key);
            let request = SimRequest { key: &name };
            let step = pipeline::resume(&filter, &env, &shared, context, &request, &mut worker.rng, what);
            match step {
                Step::Wait => {
                    worker.paused.insert(context, paused);
                }
                step => {
                    let status = status_of(&step);
                    record(&mut self.tally, &filter, p, paused.key, status, now.wall.0, Some(paused.arrived.elapsed()));
                    let mut stream = shared.borrow_mut();
                    if stream.needs_end() {
                        stream.end(&filter, &env, context, &Ended(status));
                    }
                }
            }
        }
    }

    /// A call's answer (`on_http_call_response`).
    pub fn answered(&mut self, done: Done) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.calls.bytes += done.bytes;
        self.calls.took_us.push(done.took_us);
        if !matches!(done.answer, floodgate::fleet::Answer::Ok(_)) {
            self.calls.failed += 1;
        }
        let (p, w) = (done.proxy, done.worker);
        if self.proxies.get(p).is_none_or(|proxy| proxy.generation != done.generation || proxy.workers.len() <= w) {
            return;
        }
        let now = self.now();
        let filter = Rc::clone(&self.proxies[p].workers[w].filter);
        if let Some(stage) = filter.fleet().leased().filter(|s| s.owns(done.token)) {
            let keys = stage.answered(&self.proxies[p].store, &self.metrics, done.token, done.answer, now);
            if let Some(keys) = keys {
                self.wake(p, w, keys);
            }
            self.send_calls(p, w);
            return;
        }
        if let (Some(stage), Some(scope), Some(node)) = (filter.fleet().asks(), filter.fleet().scope(), filter.fleet().node()) {
            if stage.owns(done.token) {
                let stream = stage.answered(scope, node, &self.proxies[p].store, &self.metrics, &filter.stats().global, done.token, done.answer, now.wall);
                if let Some(stream) = stream {
                    self.resume(p, w, vec![stream], Waiting::Asked);
                }
                self.send_calls(p, w);
                return;
            }
        }
        if filter.owns_batch(done.token) {
            let clock = CallbackClock(now);
            let proxy = &self.proxies[p];
            let env = Env::<Sim> { store: &proxy.store, metrics: &self.metrics, clock: &clock, vm: proxy.workers[w].vm };
            filter.batch_answered(&env, done.token, done.answer, done.proxies.as_deref());
        }
    }

    /// Requests still paused, over the fleet.
    pub fn paused(&self) -> usize {
        self.proxies.iter().flat_map(|p| &p.workers).map(|w| w.paused.len()).sum()
    }

    /// Restarts proxy `p`: its workers retire (what they hold ahead goes back, their calls
    /// queued are sent), its paused requests are lost, and a new proxy (new shared data, new
    /// VMs, a new seed) takes its place.
    pub fn restart(&mut self, p: usize) -> Result<(), String> {
        let Some(proxy) = self.proxies.get(p) else { return Ok(()) };
        let (workers, serving) = (proxy.workers.len(), proxy.serving);
        let now = self.now();
        let clock = CallbackClock(now);
        for w in 0..workers {
            let proxy = &self.proxies[p];
            let worker = &proxy.workers[w];
            let env = Env::<Sim> { store: &proxy.store, metrics: &self.metrics, clock: &clock, vm: worker.vm };
            worker.filter.retire(&env);
            self.send_calls(p, w);
        }
        self.abandoned += self.proxies[p].workers.iter().map(|w| w.paused.len() as u64).sum::<u64>();
        let generation = self.proxies[p].generation.wrapping_add(1);
        let conn = Rc::clone(&self.proxies[p].conn);
        let fresh = self.proxy(serving, generation, conn)?;
        self.proxies[p] = fresh;
        self.schedule_ticks(p);
        Ok(())
    }
}

/// The keys (and windows) a lease call's body asks about.
fn lease_keys(body: &[u8]) -> Vec<(String, u64)> {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else { return Vec::new() };
    let Some(leases) = value.get("leases").and_then(|l| l.as_array()) else { return Vec::new() };
    leases
        .iter()
        .filter_map(|l| Some((l.get("key")?.as_str()?.to_owned(), l.get("window_ms")?.as_u64()?)))
        .collect()
}

/// The step's status: 200 for a request that goes on, the reply's status otherwise.
fn status_of(step: &Step) -> u16 {
    match step {
        Step::Reply(pipeline::LocalReply::Http(reply)) => u16::try_from(reply.status).unwrap_or(500),
        Step::Reply(pipeline::LocalReply::Grpc(_)) => 500,
        Step::Continue { .. } | Step::Wait => 200,
    }
}

/// A decision of `filter` (a VM of proxy `proxy`) into the tally at `wall_ms`: when it was made. A request that waited takes its
/// units when it is resumed, from a lease the store may have granted well after the request
/// came (a call that failed, another asked later): its admission weighs in the sliding window
/// from then, as in the store.
fn record(tally: &mut Tally, filter: &Filter, proxy: usize, key: u32, status: u16, wall_ms: u64, waited: Option<Duration>) {
    match status {
        200 => {
            let leads = filter.fleet().node().is_some_and(|n| n.borrow().leading);
            tally.admit_from(key, wall_ms, Admission { proxy, leads, waited: waited.is_some() });
        }
        _ => {
            tally.refuse(key, wall_ms);
        }
    }
    if let Some(waited) = waited {
        tally.waited(waited.as_micros() as u64);
    }
}

/// The root context's tick period for `filter` ([`Filter::tick_ms`], as `on_configure` sets it;
/// the heartbeat's when nothing needs a tick: the simulation ticks anyway).
fn tick_ms(filter: &Filter) -> u64 {
    filter.tick_ms().unwrap_or(HEARTBEAT_MS)
}
