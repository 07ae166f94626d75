//! Host calls per request of a configuration, counted natively and deterministically: the
//! module's own pipeline runs here (not in Envoy) against a host that counts each call, the
//! way the proxy-wasm shell (filter/src/host/mod.rs) makes them in the three callbacks of an
//! admitted `GET` without a body:
//!
//! * `on_http_request_headers`: the clock (one call if a stage reads it), the request headers
//!   (the whole map in one call when the configuration's [`HeaderPlan`] says so, then one call
//!   per name it did not look up; else one call per name), `source.address` and the route name
//!   (one call each, if read), shared data (one per get or set), stats (one per increment or
//!   record), and the route header set for a selected cluster (one);
//! * `on_http_response_headers`: the clock, each response header read, the two `RateLimit`
//!   fields added;
//! * `on_log`: the clock, `response.code` and `response.flags` (one each, if read), shared data
//!   and stats.
//!
//! The ticks (heartbeat, lag probe) are left out: their calls are per second, not per request;
//! so is the wall clock, which the shell reads once a second. The traffic is the
//! instructions measurement's: `x-api-key` over [`crate::instructions::KEYS`] values, after as
//! many warm-up requests, at the same fixed rate (the clock moves `1 / rate` per request).

use floodgate::config::Config;
use floodgate::pipeline::headers::HeaderPlan;
use floodgate::pipeline::stats::{MetricKind, Metrics};
use floodgate::pipeline::{self, Attributes, Clock, Env, Filter, Host, Records, Request, Step, StreamCell, StreamEnd, VmParts};
use floodgate::primitives::hash::SplitMix64;
use floodgate::primitives::store::{Cas, MemoryStore, SharedStore, StoreError, Stored};
use floodgate::primitives::time::{MonoMillis, Now, UnixMillis};
use floodgate::shedding::per_key::LocalKeys;
use std::borrow::Cow;
use std::cell::{Cell, OnceCell};

/// Shared data with Envoy's semantics, one call per get or set.
#[derive(Default)]
pub struct CountingStore {
    inner: MemoryStore,
    calls: Cell<u64>,
}

impl SharedStore for CountingStore {
    fn get(&self, key: &str) -> Result<Option<Stored>, StoreError> {
        self.calls.set(self.calls.get() + 1);
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        self.calls.set(self.calls.get() + 1);
        self.inner.set(key, value, cas)
    }
}

/// Stats that keep no values: one call per definition, increment or record.
#[derive(Default)]
pub struct CountingMetrics {
    names: std::cell::RefCell<Vec<String>>,
    calls: Cell<u64>,
}

impl Metrics for CountingMetrics {
    fn define(&self, _kind: MetricKind, name: &str) -> Option<u32> {
        self.calls.set(self.calls.get() + 1);
        let mut names = self.names.borrow_mut();
        let id = names.iter().position(|n| n == name).unwrap_or_else(|| {
            names.push(name.to_owned());
            names.len() - 1
        });
        u32::try_from(id).ok()
    }
    fn add(&self, _id: u32, _delta: i64) {
        self.calls.set(self.calls.get() + 1);
    }
    fn record(&self, _id: u32, _value: u64) {
        self.calls.set(self.calls.get() + 1);
    }
}

/// The clocks of one callback: the shell reads the host's clock at most once per callback.
pub struct CountingClock {
    now: Now,
    read: Cell<bool>,
}

impl Clock for CountingClock {
    fn now(&self) -> Now {
        self.read.set(true);
        self.now
    }
}

/// The counting host, as the pipeline sees it.
pub struct Counting;

impl Host for Counting {
    type Store = CountingStore;
    type Metrics = CountingMetrics;
    type Clock = CountingClock;
}

/// A request's headers as the shell reads them ([`HeaderPlan`]).
struct CountedRequest<'p> {
    plan: &'p HeaderPlan,
    headers: Vec<(&'static str, Vec<u8>)>,
    calls: Cell<u64>,
    route: OnceCell<Option<Vec<u8>>>,
}

impl<'p> CountedRequest<'p> {
    fn new(plan: &'p HeaderPlan, headers: Vec<(&'static str, Vec<u8>)>) -> CountedRequest<'p> {
        // With the whole map, it is fetched before the pipeline runs.
        CountedRequest { plan, headers, calls: Cell::new(u64::from(plan.whole_map())), route: OnceCell::new() }
    }
}

impl Attributes for CountedRequest<'_> {
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        let in_map = self.plan.whole_map() && self.plan.names().iter().any(|n| n.eq_ignore_ascii_case(name));
        if !in_map {
            self.calls.set(self.calls.get() + 1);
        }
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| Cow::Borrowed(v.as_slice()))
    }
    fn route(&self) -> Option<Cow<'_, [u8]>> {
        let route = self.route.get_or_init(|| {
            self.calls.set(self.calls.get() + 1);
            Some(b"bench".to_vec())
        });
        route.as_deref().map(Cow::Borrowed)
    }
}

impl Request for CountedRequest<'_> {
    fn source_address(&self) -> Option<Cow<'_, [u8]>> {
        self.calls.set(self.calls.get() + 1);
        Some(Cow::Borrowed(b"127.0.0.1:40000"))
    }
}

/// The upstream's response headers: one call per read.
#[derive(Default)]
struct ResponseHeaders {
    calls: Cell<u64>,
}

impl Attributes for ResponseHeaders {
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.calls.set(self.calls.get() + 1);
        match name {
            ":status" => Some(Cow::Borrowed(b"200")),
            "content-type" => Some(Cow::Borrowed(b"text/plain")),
            "content-length" => Some(Cow::Borrowed(b"12")),
            _ => None,
        }
    }
}

/// A `200` without response flags, one call per property read.
#[derive(Default)]
struct Ended {
    calls: Cell<u64>,
}

impl StreamEnd for Ended {
    fn status(&self) -> Option<u16> {
        self.calls.set(self.calls.get() + 1);
        Some(200)
    }
    fn flags(&self) -> u64 {
        self.calls.set(self.calls.get() + 1);
        0
    }
}

/// The host calls per request of `config` (JSON) over `requests` requests after `warm` of
/// warm-up, `x-api-key` cycling over `keys` values, `rate` requests per second; `Err` for a
/// configuration that does not parse, or a request not admitted.
pub fn per_request(config: &str, keys: usize, warm: u64, requests: u64, rate: f64) -> Result<f64, String> {
    let parsed = Config::parse(config.as_bytes()).map_err(|e| e.to_string())?;
    let store = CountingStore::default();
    let metrics = CountingMetrics::default();
    let vm = 7;
    let parts = |records: Records<'_>| VmParts {
        local: Default::default(),
        key_counts: LocalKeys::default(),
        cluster_counts: records.clusters.iter().map(|_| Default::default()).collect(),
        global_node: None,
    };
    let filter = Filter::new(parsed, "bench", [7; 16], vm, 1, parts, &metrics);
    let step_ms = 1000.0 / rate.max(1e-3);
    let at = |i: u64| {
        let ms = (i as f64 * step_ms) as u64;
        CountingClock { now: Now { wall: UnixMillis(1_800_000_000_000 + ms), mono: MonoMillis(1_000_000_000 + ms) }, read: Cell::new(false) }
    };
    let start = at(0);
    let env = Env::<Counting> { store: &store, metrics: &metrics, clock: &start, vm };
    filter.selection_heartbeat(&env);
    filter.configured(&env);
    let mut rng = SplitMix64::new(vm);
    let mut counted = 0;
    for i in 0..warm + requests {
        let before = store.calls.get() + metrics.calls.get();
        let mut calls = 0;
        let context = 1000 + u32::try_from(i % 1_000_000).unwrap_or(0);
        let headers = vec![
            (":method", b"GET".to_vec()),
            (":path", b"/".to_vec()),
            (":authority", b"bench.floodgate".to_vec()),
            (":scheme", b"http".to_vec()),
            ("x-api-key", format!("k{}", i % keys.max(1) as u64).into_bytes()),
            ("x-forwarded-proto", b"http".to_vec()),
        ];
        // on_http_request_headers
        let clock = at(i);
        let env = Env::<Counting> { store: &store, metrics: &metrics, clock: &clock, vm };
        let request = CountedRequest::new(filter.headers(), headers);
        let mut cell = StreamCell::default();
        let step = pipeline::request_headers(&filter, &env, &mut cell, context, &request, true, &mut rng);
        match step {
            Step::Continue { route } => calls += u64::from(route.is_some()),
            other => return Err(format!("request {i} not admitted: {other:?}")),
        }
        calls += request.calls.get() + u64::from(clock.read.get());
        // on_http_response_headers
        let clock = at(i);
        let env = Env::<Counting> { store: &store, metrics: &metrics, clock: &clock, vm };
        let response = ResponseHeaders::default();
        let tightest = cell.borrow_mut().response_headers(&filter, &env, &response, false);
        calls += response.calls.get() + u64::from(clock.read.get()) + if tightest.is_some() { 2 } else { 0 };
        // on_log
        let clock = at(i);
        let env = Env::<Counting> { store: &store, metrics: &metrics, clock: &clock, vm };
        let ended = Ended::default();
        let mut stream = cell.borrow_mut();
        if stream.needs_end() {
            stream.end(&filter, &env, context, &ended);
        }
        calls += ended.calls.get() + u64::from(clock.read.get());
        calls += store.calls.get() + metrics.calls.get() - before;
        if i >= warm {
            counted += calls;
        }
    }
    Ok(counted as f64 / requests.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::per_request;

    #[test]
    fn an_empty_configuration_makes_at_most_a_clock_read_and_a_rule_makes_more() {
        let empty = per_request("{}", 20, 420, 2000, 100.0).unwrap();
        assert!(empty <= 1.0, "{empty}");
        let rule = format!(r#"{{"rate_limits": [{}]}}"#, crate::variant::rule("per-key"));
        let rl = per_request(&rule, 20, 420, 2000, 100.0).unwrap();
        assert!(rl >= empty + 2.0, "{rl}");
        assert_eq!(per_request(&rule, 20, 420, 2000, 100.0).unwrap(), rl, "deterministic");
    }

    #[test]
    fn a_configuration_that_does_not_parse_is_an_error() {
        assert!(per_request(r#"{"rate_limits": 3}"#, 20, 0, 10, 100.0).is_err());
    }
}
