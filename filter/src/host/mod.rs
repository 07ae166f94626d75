//! The proxy-wasm shell: reads the host (clock, headers, shared data) once per callback, hands
//! plain values to the core, and turns the core's decisions into host calls. Nothing here
//! decides anything.

mod stats;
mod store;

use crate::config::{Config, KeyPart, RateLimitHeaders};
use crate::key::{self, KeyHasher, Source};
use crate::ratelimit::{Cause, Limiter, Verdict};
use crate::response::{self, Reply};
use crate::shed::{LocalCount, Lease, Shedder, HEARTBEAT_MS};
use crate::store::{insert_if_absent, SharedStore};
use crate::time::UnixMillis;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use stats::{increment, Stats};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};
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
    proxy_wasm::set_root_context(|_| Box::new(FilterRoot::default()));
}

/// Everything a stream needs, built once per configuration and shared by reference.
struct Filter {
    config: Config,
    limiter: Limiter,
    hasher: KeyHasher,
    stats: Stats,
    shedder: Option<Shedder>,
    /// This VM's in-flight count for the filter's namespace.
    local: LocalCount,
}

thread_local! {
    /// This VM's random id in the shared in-flight record (drawn when the VM starts).
    static VM_ID: u64 = {
        let mut bytes = [0u8; 8];
        if getrandom::fill(&mut bytes).is_err() {
            log::warn!("floodgate: getrandom failed; the VM id falls back to the clock");
            bytes = now().0.to_le_bytes();
        }
        u64::from_le_bytes(bytes)
    };
    /// One in-flight count per filter namespace in this VM, shared by its configurations.
    static LOCAL_COUNTS: RefCell<HashMap<String, LocalCount>> = RefCell::new(HashMap::new());
}

fn vm_id() -> u64 {
    VM_ID.with(|id| *id)
}

fn local_count(namespace: &str) -> LocalCount {
    LOCAL_COUNTS.with(|counts| Rc::clone(counts.borrow_mut().entry(namespace.to_owned()).or_default()))
}

#[derive(Default)]
struct FilterRoot {
    filter: Option<Rc<Filter>>,
}

impl Context for FilterRoot {}

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
        let shedder = config.load_shedding.as_ref().map(|s| Shedder::new(s, &namespace));
        if shedder.is_some() {
            if let Err(status) = hostcalls::set_tick_period(Duration::from_millis(HEARTBEAT_MS)) {
                log::warn!("floodgate: no tick ({status:?}): in-flight heartbeats disabled");
            }
        }
        log::info!(
            "floodgate: configured {namespace:?}: {} ({} shared-data records at most)",
            config.summary(),
            limiter.tables().iter().map(|t| t.set_count()).sum::<u64>()
        );
        self.filter = Some(Rc::new(Filter {
            stats: Stats::define(&config),
            hasher: KeyHasher::new(seed),
            limiter,
            shedder,
            local: local_count(&namespace),
            config,
        }));
        true
    }

    fn on_tick(&mut self) {
        let Some(filter) = &self.filter else { return };
        if let Some(shedder) = &filter.shedder {
            let total = shedder.heartbeat(&EnvoyStore, vm_id(), &filter.local, now());
            stats::set(filter.stats.in_flight, u64::from(total));
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let filter = self.filter.clone()?;
        Some(Box::new(FilterStream {
            filter,
            ratelimit_fields: None,
            replied: false,
            lease: None,
        }))
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
/// by whichever VM configures first, and read by all others.
fn shared_seed(store: &dyn SharedStore, namespace: &str) -> Result<[u8; 16], String> {
    let key = format!("floodgate/{namespace}/seed");
    for _ in 0..2 {
        if let Some(stored) = store.get(&key).map_err(|e| e.to_string())? {
            return <[u8; 16]>::try_from(stored.value.as_slice())
                .map_err(|_| format!("shared key {key} holds {} bytes, not 16", stored.value.len()));
        }
        let mut seed = [0u8; 16];
        getrandom::fill(&mut seed).map_err(|e| format!("getrandom: {e}"))?;
        insert_if_absent(store, &key, &seed).map_err(|e| e.to_string())?;
    }
    Err(format!("shared key {key} could not be created"))
}

struct FilterStream {
    filter: Rc<Filter>,
    ratelimit_fields: Option<(String, String)>,
    replied: bool,
    /// Held from admission to the end of the stream (released in `on_log`; `Drop` is the net).
    lease: Option<Lease>,
}

impl FilterStream {
    /// Sends a local reply; the filter then stops the request.
    fn reply(&mut self, reply: &Reply) -> Action {
        let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        self.replied = true;
        if let Err(status) = hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes())) {
            log::warn!("floodgate: local reply failed: {status:?}");
        }
        Action::Pause
    }

    /// The health endpoint, if this request is for it.
    fn health(&self, filter: &Filter, now: UnixMillis) -> Option<Reply> {
        let health = filter.config.health.as_ref()?;
        let path = fetch(Source::Header(":path"))?;
        if KeyPart::Path.normalize(&path) != health.path.as_bytes() {
            return None;
        }
        let in_flight = filter
            .shedder
            .as_ref()
            .map(|s| s.in_flight(&EnvoyStore, vm_id(), &filter.local, now));
        Some(response::health(filter.shedder.as_ref(), in_flight))
    }

    /// Load shedding: takes a lease, or returns the 503.
    fn shed(&mut self, filter: &Filter, now: UnixMillis) -> Option<Reply> {
        let shedder = filter.shedder.as_ref()?;
        let value = fetch(Source::Header(&shedder.priority_header));
        let class = shedder.class_of(value.as_deref());
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
                Some(response::shed(shedder, &shed))
            }
        }
    }

    fn release(&mut self) {
        if let (Some(lease), Some(shedder)) = (self.lease.take(), self.filter.shedder.as_ref()) {
            shedder.release(&EnvoyStore, vm_id(), lease, now());
        }
    }
}

impl Context for FilterStream {}

fn now() -> UnixMillis {
    let ms = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    UnixMillis(ms)
}

fn fetch(source: Source<'_>) -> Option<Vec<u8>> {
    match source {
        Source::Header(name) => hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten(),
        Source::SourceAddress => hostcalls::get_property(vec!["source", "address"]).ok().flatten(),
    }
}

impl HttpContext for FilterStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let filter = Rc::clone(&self.filter);
        let now = now();
        if let Some(reply) = self.health(&filter, now) {
            return self.reply(&reply);
        }
        if let Some(reply) = self.shed(&filter, now) {
            return self.reply(&reply);
        }
        if filter.config.rate_limits.is_empty() {
            return Action::Continue;
        }
        let mut skipped = Vec::new();
        let probes = key::probes(&filter.config, &filter.hasher, fetch, &mut skipped);
        for rule in skipped {
            increment(filter.stats.rule(rule).skipped);
        }
        let verdict = filter.limiter.check(&EnvoyStore, &probes, now, 1);
        match &verdict {
            Verdict::Admitted { standings, evictions } => {
                for standing in standings {
                    increment(filter.stats.rule(standing.rule).allowed);
                }
                for rule in evictions {
                    increment(filter.stats.rule(*rule).evictions);
                }
                if filter.config.ratelimit_headers == RateLimitHeaders::Always {
                    self.ratelimit_fields = response::admitted_fields(&filter.limiter, standings);
                }
                Action::Continue
            }
            Verdict::Rejected { violations } => {
                for violation in violations {
                    let stats = filter.stats.rule(violation.standing.rule);
                    increment(stats.rejected);
                    if violation.cause == Cause::Contention {
                        increment(stats.contention);
                    }
                }
                let Some(reply) = response::rate_limited(&filter.limiter, &verdict, now) else {
                    return Action::Continue;
                };
                log::debug!("floodgate: 429 {}", reply.body);
                self.reply(&reply)
            }
        }
    }

    fn on_log(&mut self) {
        self.release();
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.replied {
            return Action::Continue;
        }
        if let Some((policy, ratelimit)) = self.ratelimit_fields.take() {
            for (name, value) in [("ratelimit-policy", policy), ("ratelimit", ratelimit)] {
                if let Err(status) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, &value) {
                    log::debug!("floodgate: cannot add {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }
}
