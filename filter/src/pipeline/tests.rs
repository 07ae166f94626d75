//! The pipeline, natively: every stage combination the real-Envoy tests cover, against the
//! in-memory store with Envoy's semantics, a fake clock and fake host attributes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use super::decision::{By, Decision};
use super::headers::HeaderPlan;
use super::stats::{MetricKind, Metrics};
use super::*;
use crate::fleet::batched::VmNode;
use crate::primitives::inflight::LocalCount;
use crate::primitives::time::{MonoMillis, Now, UnixMillis};
use crate::shedding::per_key::LocalKeys;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use crate::config::Config;
use crate::fleet::Answer;
use crate::primitives::inflight::InFlight;
use crate::primitives::store::MemoryStore;
use crate::primitives::hash::SplitMix64;
use std::collections::HashMap;

const VM: u64 = 7;
const ROOT: u32 = 1;
/// A moment 2 s into a one-hour window bucket.
const T0: u64 = 1_800_000_000_000 / 3_600_000 * 3_600_000 + 2_000;

/// Metrics by name.
#[derive(Default)]
struct TestMetrics {
    names: RefCell<Vec<String>>,
    values: RefCell<HashMap<u32, i64>>,
}

impl Metrics for TestMetrics {
    fn define(&self, _kind: MetricKind, name: &str) -> Option<u32> {
        let mut names = self.names.borrow_mut();
        let id = names.iter().position(|n| n == name).unwrap_or_else(|| {
            names.push(name.to_owned());
            names.len() - 1
        });
        Some(u32::try_from(id).unwrap())
    }
    fn add(&self, id: u32, delta: i64) {
        *self.values.borrow_mut().entry(id).or_default() += delta;
    }
    fn record(&self, id: u32, value: u64) {
        self.values.borrow_mut().insert(id, i64::try_from(value).unwrap());
    }
}

impl TestMetrics {
    fn get(&self, name: &str) -> i64 {
        let id = self.names.borrow().iter().position(|n| n == name).unwrap_or_else(|| panic!("no metric {name}"));
        self.values.borrow().get(&u32::try_from(id).unwrap()).copied().unwrap_or(0)
    }
}

/// A clock the test moves.
struct TestClock(Cell<Now>);

/// A moment `ms` milliseconds from both clocks' zero.
fn both_at(ms: u64) -> Now {
    Now { wall: UnixMillis(ms), mono: MonoMillis(ms) }
}

impl Clock for TestClock {
    fn now(&self) -> Now {
        self.0.get()
    }
}

impl TestClock {
    fn at(ms: u64) -> TestClock {
        TestClock(Cell::new(both_at(ms)))
    }
    fn advance(&self, ms: u64) {
        let now = self.0.get();
        self.0.set(Now { wall: UnixMillis(now.wall.0 + ms), mono: MonoMillis(now.mono.0 + ms) });
    }
}

/// A request's headers and address.
#[derive(Default)]
struct TestRequest {
    headers: Vec<(&'static str, String)>,
}

impl TestRequest {
    fn get(path: &str) -> TestRequest {
        TestRequest { headers: vec![(":method", "GET".into()), (":path", path.into())] }
    }
    fn with(mut self, name: &'static str, value: &str) -> TestRequest {
        self.headers.push((name, value.into()));
        self
    }
}

impl Attributes for TestRequest {
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| Cow::Borrowed(v.as_bytes()))
    }
}

impl Request for TestRequest {    fn source_address(&self) -> Option<Cow<'_, [u8]>> {
        Some(Cow::Borrowed(b"10.0.0.1:5555"))
    }
}

/// How the stream ended, as Envoy reports it.
struct Ended {
    status: Option<u16>,
    flags: u64,
}

impl StreamEnd for Ended {
    fn status(&self) -> Option<u16> {
        self.status
    }
    fn flags(&self) -> u64 {
        self.flags
    }
}

const OK: Ended = Ended { status: Some(200), flags: 0 };

/// One VM of one proxy under a configuration.
/// The fakes, as the pipeline's host.
struct TestHost;

impl super::Host for TestHost {
    type Store = MemoryStore;
    type Metrics = TestMetrics;
    type Clock = TestClock;
}

struct Host {
    filter: Filter,
    store: MemoryStore,
    metrics: TestMetrics,
    clock: TestClock,
    rng: RefCell<SplitMix64>,
    next_context: Cell<u32>,
}

impl Host {
    fn new(config: serde_json::Value) -> Host {
        let config = Config::parse(config.to_string().as_bytes()).unwrap();
        let metrics = TestMetrics::default();
        let vm = |records: Records<'_>| VmParts {
            local: LocalCount::default(),
            key_counts: LocalKeys::default(),
            cluster_counts: records.clusters.iter().map(|_| LocalCount::default()).collect(),
            global_node: records.global.then(|| Rc::new(RefCell::new(VmNode::new(VM)))),
        };
        let filter = Filter::new(config, "test", [3; 16], VM, ROOT, vm, &metrics);
        Host {
            filter,
            store: MemoryStore::new(),
            metrics,
            clock: TestClock::at(T0),
            rng: RefCell::new(SplitMix64::new(5)),
            next_context: Cell::new(100),
        }
    }

    fn env(&self) -> Env<'_, TestHost> {
        Env { store: &self.store, metrics: &self.metrics, clock: &self.clock, vm: VM }
    }

    /// A new stream: its context id and state.
    fn stream(&self) -> (u32, StreamCell) {
        let context = self.next_context.get();
        self.next_context.set(context + 1);
        (context, StreamCell::default())
    }

    /// The request headers of a new stream.
    fn send(&self, request: &TestRequest) -> (u32, StreamCell, Step) {
        let (context, mut stream) = self.stream();
        let step = self.headers_of(&mut stream, context, request);
        (context, stream, step)
    }

    fn headers_of(&self, stream: &mut StreamCell, context: u32, request: &TestRequest) -> Step {
        request_headers(&self.filter, &self.env(), stream, context, request, true, &mut *self.rng.borrow_mut())
    }

    fn end(&self, context: u32, stream: &RefCell<Stream>, ended: &Ended) {
        stream.borrow_mut().end(&self.filter, &self.env(), context, ended);
    }

    /// The proxy-wide in-flight count, as the shared record says.
    fn in_flight(&self) -> u32 {
        let shedder = self.filter.shedding.shedder.as_ref().unwrap();
        let record = self.store.get(shedder.record_key()).unwrap().map(|s| InFlight::decode(&s.value).unwrap()).unwrap_or_default();
        record.total(self.clock.now().mono)
    }

    fn metric(&self, name: &str) -> i64 {
        self.metrics.get(name)
    }
}

fn status(step: &Step) -> u32 {
    match step {
        Step::Continue { .. } => 0,
        Step::Reply(LocalReply::Http(reply)) => reply.status,
        Step::Reply(LocalReply::Grpc(reply)) => 1000 + u32::from(reply.status.code()),
        Step::Wait => 1,
    }
}

fn rule(limit: u32) -> serde_json::Value {
    serde_json::json!({"name": "r", "key": [{"header": "x-key"}], "limit": limit, "window": "1h"})
}

fn keyed(key: &str) -> TestRequest {
    TestRequest::get("/").with("x-key", key)
}

// ---- stage order ----

#[test]
fn the_health_endpoint_answers_first_and_counts_nowhere() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [rule(1)],
        "load_shedding": {"max_active_requests": 1},
        "health": {"path": "/health"},
    }));
    let (_, held, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    // In flight: 1 of 1. The health endpoint still answers, with its 503 of "shedding", and
    // neither the rule nor the shedder counted it.
    let (_, health, step) = host.send(&TestRequest::get("/health").with("x-key", "k"));
    assert_eq!(status(&step), 503);
    assert!(!health.borrow().holds_permits());
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.rejected"), 0);
    assert_eq!(host.metric("floodgate.load_shedding.normal.shed"), 0);
    host.end(100, &held, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn a_shed_request_consumes_no_quota_and_a_refused_one_gives_its_permits_back() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [rule(2)],
        "load_shedding": {"max_active_requests": 1, "per_key": {"key": [{"header": "x-key"}], "max_active_requests": 5}},
    }));
    let (first, held, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    assert_eq!(host.in_flight(), 1);
    // Shed before the rate limit: no quota counted, no key permit left behind.
    let (_, shed, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 503);
    assert!(!shed.borrow().holds_permits());
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 1);
    host.end(first, &held, &OK);
    assert_eq!(host.in_flight(), 0);
    // Room for the second request of the quota, which is the last.
    let (second, held, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    host.end(second, &held, &OK);
    // Refused by the rate limit after shedding and the cap took their permits: both go back
    // with the reply, before the stream ends.
    let (_, refused, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 429);
    assert!(!refused.borrow().holds_permits());
    assert_eq!(host.in_flight(), 0);
    assert_eq!(host.filter.shedding.per_key.as_ref().unwrap().in_flight(&host.store, VM, &host.filter.shedding.key_counts, 0, host.clock.now().mono), 0);
    assert_eq!(host.metric("floodgate.rate_limit.r.rejected"), 1);
}

#[test]
fn a_key_over_its_cap_is_refused_before_the_rate_limit_counts_it() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [rule(10)],
        "load_shedding": {"per_key": {"key": [{"header": "x-key"}], "max_active_requests": 1}},
    }));
    let (first, held, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    let (_, _, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 503);
    assert_eq!(host.metric("floodgate.load_shedding.per_key.refused"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 1, "the capped request counted no quota");
    host.end(first, &held, &OK);
    let (_, _, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0, "the cap came back at the end of the first stream");
}

#[test]
fn the_root_ticks_as_often_as_its_most_frequent_need_and_not_at_all_without_one() {
    let tick = |config: serde_json::Value| Host::new(config).filter.tick_ms();
    assert_eq!(tick(serde_json::json!({})), None, "nothing configured");
    assert_eq!(tick(serde_json::json!({"health": {"path": "/healthz"}})), None, "the health endpoint alone needs no tick");
    assert_eq!(tick(serde_json::json!({"rate_limits": [rule(5)]})), Some(1_000), "reserves and heartbeats: every second");
    assert_eq!(tick(serde_json::json!({"load_shedding": {"max_active_requests": 4}})), Some(1_000));
    assert_eq!(tick(serde_json::json!({"rate_limits": [bucket_rule(Some("1s"))]})), Some(delay::TICK_MS), "the delay stage's tick");
    let global = |consistency: &str, interval: &str| {
        serde_json::json!({"rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 5, "window": "1m",
                                            "scope": "global", "consistency": consistency}],
                           "global": {"cluster": "floodgate-sync", "sync_interval": interval, "lease_timeout": "24ms"}})
    };
    assert_eq!(tick(global("batched", "300ms")), Some(300), "every sync_interval");
    assert_eq!(tick(global("leased", "1s")), Some(6), "a quarter of lease_timeout");
}

#[test]
fn a_filter_walks_only_the_stages_its_configuration_has_in_their_order() {
    let stages = |config: serde_json::Value| Host::new(config).filter.stages.to_vec();
    assert_eq!(stages(serde_json::json!({})), Vec::<Stage>::new(), "nothing configured: nothing to walk");
    assert_eq!(stages(serde_json::json!({"rate_limits": [rule(5)]})), [Stage::RateLimit]);
    let many = serde_json::json!({
        "health": {"path": "/health"},
        "load_shedding": {"max_active_requests": 4, "per_key": {"key": [{"header": "x-key"}], "max_active_requests": 2}},
        "rate_limits": [bucket_rule(Some("1s"))],
        "cluster_selection": selection(&["a", "b"], 4),
    });
    assert_eq!(stages(many), [Stage::Endpoints, Stage::Shed, Stage::Cap, Stage::RateLimit, Stage::Delay, Stage::Select]);
}

fn selection(clusters: &[&str], max: u32) -> serde_json::Value {
    serde_json::json!({
        "route_header": "x-cluster",
        "clusters": clusters,
        "concurrency_limit": {"initial_limit": max, "min_limit": 1, "max_limit": max},
    })
}

#[test]
fn a_request_that_selection_cannot_place_holds_nothing_afterwards() {
    let host = Host::new(serde_json::json!({
        "load_shedding": {"max_active_requests": 10},
        "cluster_selection": selection(&["a"], 1),
    }));
    let (first, held, step) = host.send(&TestRequest::get("/"));
    assert_eq!(step, Step::Continue { route: Some(0) });
    assert_eq!(host.in_flight(), 1);
    let (_, refused, step) = host.send(&TestRequest::get("/"));
    assert_eq!(status(&step), 503);
    assert!(!refused.borrow().holds_permits());
    assert_eq!(host.in_flight(), 1, "the refused request's in-flight unit went back");
    assert_eq!(host.metric("floodgate.cluster_selection.exhausted"), 1);
    host.end(first, &held, &OK);
    assert_eq!(host.in_flight(), 0);
    assert_eq!(host.metric("floodgate.cluster.a.success"), 1);
}

/// Under `rules` and one cluster of one permit: a request of key `k` goes there, the next one
/// is admitted by the rules and refused by selection (`503`), then both end; a third goes
/// there and ends.
fn refused_by_selection_then_another(rules: serde_json::Value) -> (Host, Step) {
    let host = Host::new(serde_json::json!({"rate_limits": rules, "cluster_selection": selection(&["a"], 1)}));
    let (first, held, step) = host.send(&keyed("k"));
    assert_eq!(step, Step::Continue { route: Some(0) });
    let (second, refused, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 503);
    host.end(second, &refused, &Ended { status: Some(503), flags: 0 });
    host.end(first, &held, &OK);
    let (third, held, step) = host.send(&keyed("k"));
    host.end(third, &held, &OK);
    (host, step)
}

#[test]
fn a_request_that_selection_refuses_after_admission_gives_its_units_back() {
    let bucket = serde_json::json!({"name": "b", "key": [{"header": "x-key"}], "limit": 2, "window": "1h", "algorithm": "token_bucket", "burst": 2});
    // The refused request's units went back: the third fits in both rules (limit 2).
    let (host, third) = refused_by_selection_then_another(serde_json::json!([rule(2), bucket]));
    assert_eq!(third, Step::Continue { route: Some(0) }, "a quota the refused request never used");
    assert_eq!(status(&host.send(&keyed("k")).2), 429, "the limit of 2 holds");
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 3);
}

#[test]
fn a_reservation_that_selection_refuses_goes_back_whole_and_owes_nothing() {
    let (host, third) = refused_by_selection_then_another(serde_json::json!([
        {"name": "t", "key": [{"header": "x-key"}], "limit": 150, "window": "1h",
         "cost": {"from": "response_header", "header": "x-used", "estimate": {"default": 60, "max": 100}}}
    ]));
    // 60 counted for the first (it ended without a count: charged its estimate): another
    // reservation of 60 fits.
    assert_eq!(third, Step::Continue { route: Some(0) }, "the refused request's 60 went back");
    assert_eq!(host.metric("floodgate.rate_limit.t.unreported"), 2, "the first and the third; the refused request owes nothing");
}

#[test]
fn a_refused_grpc_request_gets_a_grpc_status() {
    let host = Host::new(serde_json::json!({"rate_limits": [rule(1)]}));
    let grpc = || keyed("k").with("content-type", "application/grpc");
    assert_eq!(status(&host.send(&grpc()).2), 0);
    let (_, _, step) = host.send(&grpc());
    assert_eq!(status(&step), 1000 + 8, "RESOURCE_EXHAUSTED");
    let (_, _, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 429, "the same refusal over HTTP");
}

// ---- the end of a stream, in every way it can end ----

#[test]
fn every_ending_releases_the_permits_once_and_finishes_the_cluster_with_its_grade() {
    let host = Host::new(serde_json::json!({
        "load_shedding": {"max_active_requests": 10},
        "cluster_selection": selection(&["a"], 10),
    }));
    let endings = [
        (Ended { status: Some(200), flags: 0 }, "success"),
        (Ended { status: Some(503), flags: 0 }, "failure"),
        (Ended { status: Some(504), flags: 0 }, "timeout"),
        // Reset by the upstream before any response: no status, Envoy's flag UR.
        (Ended { status: None, flags: 0x10 }, "failure"),
        // The client hung up first: no status, no flag.
        (Ended { status: None, flags: 0 }, "ignored"),
    ];
    for (n, (ended, counter)) in endings.iter().enumerate() {
        let (context, stream, step) = host.send(&TestRequest::get("/"));
        assert_eq!(step, Step::Continue { route: Some(0) });
        assert_eq!(host.in_flight(), 1);
        host.end(context, &stream, ended);
        assert_eq!(host.in_flight(), 0, "ending {n}");
        assert!(!stream.borrow().holds_permits());
        // A second end (Envoy calls on_log once; the state must not release twice anyway).
        host.end(context, &stream, ended);
        assert_eq!(host.in_flight(), 0);
        assert!(host.metric(&format!("floodgate.cluster.a.{counter}")) >= 1, "ending {n} counted as {counter}");
    }
    assert_eq!(host.metric("floodgate.cluster.a.selected"), 5);
}

#[test]
fn a_stream_dropped_without_an_end_gives_its_units_back_through_the_heartbeat() {
    let host = Host::new(serde_json::json!({"load_shedding": {"max_active_requests": 10}}));
    let (_, stream, _) = host.send(&TestRequest::get("/"));
    assert_eq!(host.in_flight(), 1);
    drop(stream);
    host.clock.advance(1_000);
    host.filter.heartbeat(&host.env());
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn costs_charged_after_admission_follow_the_stream_to_its_end() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 100, "window": "1h",
                         "cost": {"from": "response_header", "header": "x-units", "default": 7}}],
    }));
    // Reported by the upstream.
    let (context, stream, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    let fields = stream.borrow_mut().response_headers(&host.filter, &host.env(), &TestRequest::default().with("x-units", "30"), false);
    assert!(fields.is_some(), "the admitted response gets its RateLimit fields");
    host.end(context, &stream, &OK);
    assert_eq!(host.metric("floodgate.rate_limit.r.charged"), 30);
    // Never reported (the response never came): the rule's default.
    let (context, stream, _) = host.send(&keyed("k"));
    host.end(context, &stream, &Ended { status: None, flags: 0 });
    assert_eq!(host.metric("floodgate.rate_limit.r.charged"), 37);
}

#[test]
fn a_reservation_holds_its_estimate_in_flight_and_settles_to_the_body_s_count() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 250, "window": "1h",
                         "cost": {"from": "response_body", "path": "usage.total_tokens",
                                  "estimate": {"header": "x-max", "default": 100, "max": 100}}}],
    }));
    let request = || keyed("k").with("x-max", "100");
    let (first, a, step_a) = host.send(&request());
    let (second, b, step_b) = host.send(&request());
    let (_, _, step_c) = host.send(&request());
    assert_eq!((status(&step_a), status(&step_b), status(&step_c)), (0, 0, 429), "two estimates of 100 in flight fill 250");
    let json = TestRequest::default().with("content-type", "application/json");
    a.borrow_mut().response_headers(&host.filter, &host.env(), &json, false);
    assert!(a.borrow().reads_response_body());
    a.borrow_mut().response_body(&host.filter, &host.env(), br#"{"usage":{"total_tokens":"#, false);
    a.borrow_mut().response_body(&host.filter, &host.env(), br#"30}}"#, true);
    assert_eq!(host.metric("floodgate.rate_limit.r.refunded"), 70, "30 used: 70 back");
    host.end(first, &a, &OK);
    let (_, _, step_d) = host.send(&request());
    assert_eq!(status(&step_d), 0, "the refund makes room: 30 + 100 + 100 ≤ 250");
    // A body that never reports: the reservation stays.
    b.borrow_mut().response_headers(&host.filter, &host.env(), &json, false);
    b.borrow_mut().response_body(&host.filter, &host.env(), b"<html>", false);
    assert_eq!(host.metric("floodgate.rate_limit.r.unreadable"), 1);
    host.end(second, &b, &OK);
    assert_eq!(host.metric("floodgate.rate_limit.r.unreported"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.refunded"), 70);
}

#[test]
fn a_compressed_answer_is_not_read_and_says_why() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 1000, "window": "1h",
                         "cost": {"from": "response_body", "path": "usage.total_tokens",
                                  "estimate": {"header": "x-max", "default": 100, "max": 100}}}],
    }));
    let (context, stream, step) = host.send(&keyed("k").with("x-max", "100"));
    assert_eq!(status(&step), 0);
    let gzip = TestRequest::default().with("content-type", "application/json").with("content-encoding", "gzip");
    stream.borrow_mut().response_headers(&host.filter, &host.env(), &gzip, false);
    assert!(!stream.borrow().reads_response_body(), "its bytes are not JSON: not read");
    assert_eq!(
        (host.metric("floodgate.rate_limit.r.unreadable"), host.metric("floodgate.rate_limit.r.unreadable_compressed"), host.metric("floodgate.rate_limit.r.unreported")),
        (1, 1, 1)
    );
    host.end(context, &stream, &OK);
    assert_eq!(host.metric("floodgate.rate_limit.r.refunded"), 0, "the reservation stays");
    // `identity` is no encoding: read as usual.
    let (context, stream, _) = host.send(&keyed("k").with("x-max", "100"));
    let identity = TestRequest::default().with("content-type", "application/json").with("content-encoding", "identity");
    stream.borrow_mut().response_headers(&host.filter, &host.env(), &identity, false);
    stream.borrow_mut().response_body(&host.filter, &host.env(), br#"{"usage":{"total_tokens":30}}"#, true);
    host.end(context, &stream, &OK);
    assert_eq!((host.metric("floodgate.rate_limit.r.refunded"), host.metric("floodgate.rate_limit.r.unreadable_compressed")), (70, 1));
}

#[test]
fn an_anthropic_stream_settles_to_input_plus_four_times_output() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 1000, "window": "1h",
                         "cost": {"from": "response_body",
                                  "sum": [{"path": ["usage.input_tokens", "message.usage.input_tokens"]},
                                          {"path": "usage.output_tokens", "weight": 4}],
                                  "estimate": {"sum": [{"path": "max_tokens", "weight": 4}], "default": 100, "max": 800}}}],
    }));
    let request = keyed("k").with("content-type", "application/json");
    let (context, mut cell, step) = host.send_with_body(&request);
    assert_eq!(step, Step::Wait, "waits for its body");
    let step = host.body(&mut cell, context, &request, &[br#"{"model":"claude","max_tokens":50,"messages":[]}"#], true);
    assert_eq!(step.map(|s| status(&s)), Some(0), "admitted, reserving 4 × 50");
    let sse = TestRequest::default().with("content-type", "text/event-stream");
    let stream = &cell;
    stream.borrow_mut().response_headers(&host.filter, &host.env(), &sse, false);
    let events: [&[u8]; 3] = [
        b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":40,\"output_tokens\":1}}}\n\n",
        b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\n",
        b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":25}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    ];
    for (i, event) in events.iter().enumerate() {
        stream.borrow_mut().response_body(&host.filter, &host.env(), event, i == 2);
    }
    host.end(context, stream, &OK);
    assert_eq!(host.metric("floodgate.rate_limit.r.refunded"), 200 - 140, "40 + 4 × 25 = 140 of the 200 reserved");
    assert_eq!(host.metric("floodgate.rate_limit.r.unreported"), 0);
}

#[test]
fn every_http_refusal_with_a_retry_after_carries_the_exact_wait() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 1, "window": "10s"}],
        "load_shedding": {"max_active_requests": 1, "retry_after": "2s"},
        "health": {"path": "/health"},
    }));
    let header = |step: &Step, name: &str| match step {
        Step::Reply(LocalReply::Http(reply)) => reply.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()),
        _ => None,
    };
    let (_, _held, first) = host.send(&keyed("a"));
    assert_eq!(status(&first), 0);
    let (_, _, shed) = host.send(&keyed("b"));
    assert_eq!((status(&shed), header(&shed, "retry-after-ms").as_deref()), (503, Some("2000")));
    let (_, _, health) = host.send(&TestRequest::get("/health"));
    assert_eq!((status(&health), header(&health, "retry-after-ms")), (503, None), "the health answer refuses nothing");
    let host = Host::new(serde_json::json!({"rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 1, "window": "10s"}]}));
    let (_, _, _) = host.send(&keyed("a"));
    let (_, _, limited) = host.send(&keyed("a"));
    let Step::Reply(LocalReply::Http(reply)) = &limited else { panic!("a 429") };
    let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(header(&limited, "retry-after-ms"), Some(body["retry_after_ms"].to_string()), "the body's exact wait");
    // A gRPC refusal says it in grpc-retry-pushback-ms, not retry-after-ms.
    let (_, _, grpc) = host.send(&keyed("a").with("content-type", "application/grpc"));
    let Step::Reply(LocalReply::Grpc(grpc)) = &grpc else { panic!("a gRPC refusal") };
    assert!(grpc.metadata.iter().all(|(n, _)| *n != "retry-after-ms"));
}

fn llm_rule(limit: u32, consistency: &str) -> serde_json::Value {
    serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": limit, "window": "1h",
                         "scope": "global", "consistency": consistency,
                         "cost": {"from": "response_body", "path": "usage.total_tokens",
                                  "estimate": {"header": "x-max", "default": 100, "max": 100}}}],
        "global": {"cluster": "floodgate-sync", "sync_interval": "1s", "lease_timeout": "50ms"},
    })
}

/// Settles a stream's reservation at the JSON body's `tokens`, and ends it.
fn settle(host: &Host, context: u32, stream: &RefCell<Stream>, tokens: u32) {
    let json = TestRequest::default().with("content-type", "application/json");
    stream.borrow_mut().response_headers(&host.filter, &host.env(), &json, false);
    stream.borrow_mut().response_body(&host.filter, &host.env(), format!(r#"{{"usage":{{"total_tokens":{tokens}}}}}"#).as_bytes(), true);
    host.end(context, stream, &OK);
}

#[test]
fn a_batched_reservation_gives_back_to_its_admission_s_bucket_and_charges_its_excess_now() {
    let host = Host::new(llm_rule(250, "batched"));
    let request = || keyed("k").with("x-max", "100");
    let (first, a, step_a) = host.send(&request());
    let (second, b, step_b) = host.send(&request());
    let (_, _, step_c) = host.send(&request());
    assert_eq!((status(&step_a), status(&step_b), status(&step_c)), (0, 0, 429), "two estimates of 100 in flight fill 250");
    let deltas = || -> Vec<(u64, u32, u32)> {
        let node = host.filter.fleet.global_node.as_ref().unwrap().borrow();
        node.deltas.iter().map(|d| (d.bucket, d.delta, d.refund)).collect()
    };
    let bucket = T0 / 3_600_000;
    assert_eq!(deltas(), vec![(bucket, 200, 0)], "the reservations are counted as the requests' units");
    settle(&host, first, &a, 30);
    assert_eq!(deltas(), vec![(bucket, 200, 70)], "30 used: 70 given back fleet-wide");
    let (_, _, step_d) = host.send(&request());
    assert_eq!(status(&step_d), 0, "the proxy admits again at once: 30 + 100 + 100 ≤ 250");
    // A count above the reservation, settled in the next bucket: the excess is charged in
    // now's bucket.
    host.clock.advance(3_600_000);
    settle(&host, second, &b, 130);
    assert_eq!(deltas(), vec![(bucket, 300, 70), (bucket + 1, 30, 0)]);
    assert_eq!(host.metric("floodgate.rate_limit.r.charged"), 30);
    // A reservation settled once its bucket is past the window: nothing fleet-wide.
    host.clock.advance(2 * 3_600_000);
    let (late, l, step_late) = host.send(&request());
    assert_eq!(status(&step_late), 0);
    host.clock.advance(2 * 3_600_000);
    settle(&host, late, &l, 0);
    assert_eq!(host.filter.fleet.global_node.as_ref().unwrap().borrow().deltas.iter().map(|d| d.refund).sum::<u32>(), 70);
    assert_eq!(host.metric("floodgate.rate_limit.r.refunded"), 170, "counted locally all the same");
}

#[test]
fn a_leased_reservation_is_taken_from_the_lease_given_back_to_it_and_its_excess_reported() {
    let host = Host::new(llm_rule(1000, "leased"));
    let request = || keyed("k").with("x-max", "100");
    let (context, stream, step) = host.send(&request());
    assert_eq!(step, Step::Wait);
    let tokens = send_calls(&host, context);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    let keys = stage.answered(&host.store, &host.metrics, tokens[0], grant(250), host.clock.now()).unwrap();
    assert_eq!(wake(&host, keys, &request()), vec![(context, Step::Continue { route: None })]);
    // 150 left: one more reservation of 100 fits, a third does not wait (the lease is short).
    let (second, b, step_b) = host.send(&request());
    assert_eq!(step_b, Step::Continue { route: None });
    settle(&host, context, &stream, 30);
    assert_eq!(host.metric("floodgate.rate_limit.r.refunded"), 70);
    // The 70 are the lease's again: 50 + 70 = 120 held, a request reserving 100 goes on.
    let (third, c, step_c) = host.send(&request());
    assert_eq!(step_c, Step::Continue { route: None }, "taken from the units given back");
    settle(&host, third, &c, 100);
    // 130 reported for a reservation of 100: 30 charged, admitted without a grant.
    settle(&host, second, &b, 130);
    assert_eq!(host.metric("floodgate.rate_limit.r.charged"), 30);
    stage.drain(&host.store, host.clock.now());
    let asks: Vec<_> = stage.take_outgoing().into_iter().flat_map(|c| c.asks).collect();
    let consumed: u32 = asks.iter().map(|a| a.consumed).sum();
    let returned: u32 = asks.iter().map(|a| a.returned).sum();
    assert_eq!(consumed, 30, "the excess is reported with the next call");
    assert_eq!(returned, 250 + 70 - 100 - 100 - 100, "what is held goes back");
}

fn body_estimate_host(limit: u32) -> Host {
    Host::new(serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": limit, "window": "1h",
                         "match": {"methods": ["POST"]},
                         "cost": {"from": "response_body", "path": "usage.total_tokens",
                                  "estimate": {"header": "x-max", "body": ["max_completion_tokens", "max_tokens"],
                                               "max_body_bytes": 64, "default": 50, "max": 400}}}],
    }))
}

fn post(key: &str) -> TestRequest {
    TestRequest { headers: vec![(":method", "POST".into()), (":path", "/v1/chat/completions".into())] }.with("x-key", key)
}

impl Host {
    /// The request headers of a new stream with a body to come.
    fn send_with_body(&self, request: &TestRequest) -> (u32, StreamCell, Step) {
        let (context, mut stream) = self.stream();
        let step = request_headers(&self.filter, &self.env(), &mut stream, context, request, false, &mut *self.rng.borrow_mut());
        (context, stream, step)
    }

    /// Body frames of a request that waits for its estimates, each as the host reads it (the
    /// new bytes of all it holds): the step once decided.
    fn body(&self, stream: &mut StreamCell, context: u32, request: &TestRequest, frames: &[&[u8]], end: bool) -> Option<Step> {
        let mut held: Vec<u8> = Vec::new();
        for (index, frame) in frames.iter().enumerate() {
            held.extend_from_slice(frame);
            let last = end && index + 1 == frames.len();
            let (start, len) = estimate_wants(stream, held.len())?;
            let chunk = &held[start..start + len];
            let step = request_body_estimates(&self.filter, &self.env(), stream, context, request, chunk, Some(held.len()), last, &mut *self.rng.borrow_mut());
            if step.is_some() {
                return step;
            }
        }
        None
    }
}

#[test]
fn a_request_waits_for_the_estimate_in_its_body_and_reserves_it() {
    let host = body_estimate_host(250);
    let (context, mut stream, step) = host.send_with_body(&post("k"));
    assert_eq!(step, Step::Wait, "the body holds the estimate");
    assert!(!stream.borrow().needs_end(), "nothing is taken while it waits");
    let frames: [&[u8]; 2] = [br#"{"max_tokens":1"#, br#"20,"messages":[]}"#];
    assert_eq!(host.body(&mut stream, context, &post("k"), &frames, false), None, "the first listed place may come later");
    let step = host.body(&mut stream, context, &post("k"), &[b" "], true).unwrap();
    assert_eq!(status(&step), 0);
    // 120 reserved: one more request of 120 fits in 250, a third does not.
    let (c2, mut s2, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s2, c2, &post("k"), &[br#"{"max_completion_tokens":120}"#], true).unwrap()), 0);
    let (c3, mut s3, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s3, c3, &post("k"), &[br#"{"max_tokens":120}"#], true).unwrap()), 429);
    assert!(!s3.borrow().needs_end(), "the refused request holds nothing");
    // The first settles to 30: 90 come back.
    let json = TestRequest::default().with("content-type", "application/json");
    stream.borrow_mut().response_headers(&host.filter, &host.env(), &json, false);
    stream.borrow_mut().response_body(&host.filter, &host.env(), br#"{"usage":{"total_tokens":30}}"#, true);
    host.end(context, &stream, &OK);
    assert_eq!(host.metric("floodgate.rate_limit.r.refunded"), 90);
    assert_eq!(host.metric("floodgate.rate_limit.r.invalid_cost"), 0);
}

#[test]
fn the_header_wins_and_requests_without_body_or_rule_decide_at_once() {
    let host = body_estimate_host(1000);
    let (_, stream, step) = host.send_with_body(&post("k").with("x-max", "300"));
    assert_eq!(status(&step), 0, "the header gives the estimate: the body is not read");
    assert!(estimate_wants(&stream, 10).is_none());
    let (_, _, step) = host.send(&post("k"));
    assert_eq!(status(&step), 0, "no body: the default at once");
    let (_, stream, step) = host.send_with_body(&keyed("k"));
    assert_eq!(status(&step), 0, "a GET the rule does not match: no wait");
    assert!(estimate_wants(&stream, 10).is_none());
    // 300 + 50 reserved; a body asking 9999 reserves max (400), once.
    let (c, mut s, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s, c, &post("k"), &[br#"{"max_completion_tokens":9999}"#], false).unwrap()), 0, "known at once");
    let (c, mut s, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s, c, &post("k"), &[br#"{"max_completion_tokens":251}"#], false).unwrap()), 429);
    let (c, mut s, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s, c, &post("k"), &[br#"{"max_completion_tokens":250}"#], false).unwrap()), 0);
}

#[test]
fn bad_estimates_in_the_body_reserve_the_default_and_invalid_ones_are_counted() {
    let host = body_estimate_host(100_000);
    let cases: [(&[u8], bool, bool); 8] = [
        (br#"{"max_tokens":-1}"#, true, true),
        (br#"{"max_tokens":1e9}"#, true, true),
        (br#"{"max_tokens":"abc"}"#, true, true),
        (br#"{"model":"m"}"#, true, false),
        (b"max_tokens=100", true, false),
        (br#"{"model":"m","max_tok"#, true, false),
        (br#"{"model":"m","messages":"0123456789012345678901234567890123456789012345","max_tokens":3}"#, true, false),
        (br#"{"max_tokens":9999}"#, true, false),
    ];
    for (index, (body, end, invalid)) in cases.into_iter().enumerate() {
        let before = host.metric("floodgate.rate_limit.r.invalid_cost");
        let (context, mut stream, _) = host.send_with_body(&post("k"));
        let step = host.body(&mut stream, context, &post("k"), &[body], end).unwrap();
        assert_eq!(status(&step), 0, "case {index}");
        assert_eq!(host.metric("floodgate.rate_limit.r.invalid_cost") - before, i64::from(invalid), "case {index}");
        stream.borrow_mut().response_headers(&host.filter, &host.env(), &TestRequest::default(), false);
        stream.borrow_mut().response_body(&host.filter, &host.env(), br#"{"usage":{"total_tokens":0}}"#, true);
        host.end(context, &stream, &OK);
    }
    // Refunds tell what each reserved: the default (50) but for 9999, capped at max (400).
    assert_eq!(host.metric("floodgate.rate_limit.r.refunded"), 7 * 50 + 400);
}

#[test]
fn a_client_that_leaves_while_its_estimate_is_read_leaves_nothing_behind() {
    let host = Host::new(serde_json::json!({
        "load_shedding": {"max_active_requests": 10},
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 100, "window": "1h",
                         "cost": {"from": "response_body", "path": "usage.total_tokens",
                                  "estimate": {"body": ["max_tokens"], "default": 50, "max": 400}}}],
    }));
    let (context, mut stream, step) = host.send_with_body(&keyed("k"));
    assert_eq!(step, Step::Wait);
    assert!(host.body(&mut stream, context, &keyed("k"), &[br#"{"messages":["#], false).is_none());
    assert_eq!(host.in_flight(), 0, "no permit while it waits");
    host.end(context, &stream, &Ended { status: None, flags: 0 });
    assert_eq!(host.in_flight(), 0);
    assert!(estimate_wants(&stream, 100).is_none(), "an ended stream reads no more");
    // The key's quota is whole: two requests of 50 fit.
    for _ in 0..2 {
        let (c, mut s, _) = host.send_with_body(&keyed("k"));
        assert_eq!(status(&host.body(&mut s, c, &keyed("k"), &[br#"{"max_tokens":50}"#], false).unwrap()), 0);
        assert!(s.borrow().holds_permits());
    }
}

#[test]
fn a_request_whose_body_never_reaches_the_filter_is_decided_on_the_default_by_the_tick() {
    let host = body_estimate_host(1000);
    let stage = host.filter.waits.body_waits.as_ref().unwrap();
    let (_, mut never, _) = host.send_with_body(&post("k"));
    let (c2, mut flowing, _) = host.send_with_body(&post("k"));
    assert!(host.body(&mut flowing, c2, &post("k"), &[b"{"], false).is_none(), "its body started: it waits on for the rest");
    assert_eq!(stage.len(), 2);
    host.clock.advance(body_wait::BODY_WAIT_MS - 1);
    assert!(stage.take_due(host.clock.now().mono).is_empty(), "not yet");
    host.clock.advance(1);
    let due = stage.take_due(host.clock.now().mono);
    assert_eq!(due.len(), 1, "only the one whose body never came");
    assert!(stage.is_empty(), "the other is dropped: its body flows");
    let (context, shared) = due.into_iter().next().unwrap();
    assert!(Rc::ptr_eq(&shared, &never.share()));
    let step = resume(&host.filter, &host.env(), &shared, context, &post("k"), &mut *host.rng.borrow_mut(), Waiting::Body);
    assert_eq!(status(&step), 0, "decided on the default");
    assert!(estimate_wants(&never, 10).is_none(), "its body, if it comes now, goes by unread");
    assert_eq!(status(&resume(&host.filter, &host.env(), &shared, context, &post("k"), &mut *host.rng.borrow_mut(), Waiting::Body)), 1, "once");
    // 50 reserved: 950 left.
    let (c, mut s, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s, c, &post("k"), &[br#"{"max_completion_tokens":400}"#, b"}"], false).unwrap()), 0);
    let (c, mut s, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s, c, &post("k"), &[br#"{"max_completion_tokens":400}"#], false).unwrap()), 0);
    let (c, mut s, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s, c, &post("k"), &[br#"{"max_completion_tokens":151}"#], false).unwrap()), 429, "50 + 800 + 151 > 1000");
}

#[test]
fn after_two_requests_without_their_body_requests_no_longer_wait_unless_a_body_ever_came() {
    let host = body_estimate_host(100_000);
    let stage = host.filter.waits.body_waits.as_ref().unwrap();
    let miss = |host: &Host| {
        let (_, _stream, step) = host.send_with_body(&post("k"));
        assert_eq!(step, Step::Wait);
        host.clock.advance(body_wait::BODY_WAIT_MS);
        for (context, shared) in host.filter.waits.body_waits.as_ref().unwrap().take_due(host.clock.now().mono) {
            assert_eq!(status(&resume(&host.filter, &host.env(), &shared, context, &post("k"), &mut *host.rng.borrow_mut(), Waiting::Body)), 0);
        }
    };
    miss(&host);
    assert!(!stage.withheld(), "one slow client is not enough");
    miss(&host);
    assert!(stage.withheld());
    // Decided on the headers, on the default, without waiting.
    let (_, _stream, step) = host.send_with_body(&post("k"));
    assert_eq!(status(&step), 0);
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 3);
    assert!(stage.is_empty());

    // Where a waiting request once got its body, misses never stop the waiting.
    let host = body_estimate_host(100_000);
    let (c, mut s, _) = host.send_with_body(&post("k"));
    assert_eq!(status(&host.body(&mut s, c, &post("k"), &[br#"{"max_tokens":10}"#], true).unwrap()), 0);
    for _ in 0..3 {
        miss(&host);
    }
    assert!(!host.filter.waits.body_waits.as_ref().unwrap().withheld());
    assert_eq!(host.send_with_body(&post("k")).2, Step::Wait);
}

// ---- waiting for the store: pause and resume ----

fn leased(limit: u32) -> serde_json::Value {
    serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": limit, "window": "1h",
                         "scope": "global", "consistency": "leased"}],
        "load_shedding": {"max_active_requests": 10},
        "global": {"cluster": "floodgate-sync", "sync_interval": "1s", "lease_timeout": "50ms"},
    })
}

fn grant(granted: u32) -> Answer {
    Answer::Ok(format!(r#"{{"version":1,"leases":[{{"granted":{granted},"current":{granted},"previous":0}}]}}"#).into_bytes())
}

/// Sends the stage's queued calls as the host would: the tokens, in order.
fn send_calls(host: &Host, from: u32) -> Vec<u32> {
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    stage
        .take_outgoing()
        .into_iter()
        .enumerate()
        .map(|(n, call)| {
            assert_eq!(call.owner, from, "a call goes from the context whose callback runs");
            let token = 500 + u32::try_from(n).unwrap() + from * 10;
            stage.sent(&host.metrics, call, token, host.clock.now());
            token
        })
        .collect()
}

/// The host's wake loop: each woken stream resumed in turn.
fn wake(host: &Host, keys: Vec<crate::keys::fleet::FleetKey>, request: &TestRequest) -> Vec<(u32, Step)> {
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    let mut steps = Vec::new();
    for key in keys {
        for (context, stream) in stage.take_waiting(key) {
            if stream.borrow().waiting_since().is_none() {
                continue;
            }
            steps.push((context, resume(&host.filter, &host.env(), &stream, context, request, &mut *host.rng.borrow_mut(), Waiting::Store)));
        }
    }
    steps
}

#[test]
fn a_request_waits_for_the_store_and_resumes_on_the_same_state() {
    let host = Host::new(leased(10));
    let (context, stream, step) = host.send(&keyed("k"));
    assert_eq!(step, Step::Wait);
    assert!(stream.borrow().holds_permits(), "the in-flight permit is held while it waits");
    // A body that arrives meanwhile is held.
    assert_eq!(stream.borrow_mut().request_body(&host.filter, &host.env(), 10, true), Flow::Pause);
    let tokens = send_calls(&host, context);
    assert_eq!(tokens.len(), 1, "one call, from the waiting stream itself");
    host.clock.advance(5);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    let keys = stage.answered(&host.store, &host.metrics, tokens[0], grant(3), host.clock.now()).unwrap();
    let steps = wake(&host, keys, &keyed("k"));
    assert_eq!(steps, vec![(context, Step::Continue { route: None })]);
    assert!(stream.borrow().waiting_since().is_none());
    assert_eq!(stream.borrow_mut().request_body(&host.filter, &host.env(), 10, true), Flow::Continue, "decided: bodies go through");
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 1);
    assert_eq!(host.metric("floodgate.lease.waited"), 1);
    // Served from the lease now: no wait.
    let (other, held, step) = host.send(&keyed("k"));
    assert_eq!(step, Step::Continue { route: None });
    host.end(other, &held, &OK);
    host.end(context, &stream, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn a_request_refused_after_its_wait_gives_back_its_permit_at_once() {
    let host = Host::new(leased(10));
    let (context, stream, _) = host.send(&keyed("k"));
    let tokens = send_calls(&host, context);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    // The store has no room for the key: the fleet's counts are at the limit.
    let full = Answer::Ok(br#"{"version":1,"leases":[{"granted":0,"current":10,"previous":0}]}"#.to_vec());
    let keys = stage.answered(&host.store, &host.metrics, tokens[0], full, host.clock.now()).unwrap();
    let steps = wake(&host, keys, &keyed("k"));
    assert_eq!(steps.len(), 1);
    assert_eq!(status(&steps[0].1), 429);
    assert!(!stream.borrow().holds_permits());
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn a_later_refusal_gives_the_leased_units_back() {
    let mut config = leased(100);
    config["rate_limits"].as_array_mut().unwrap().push(serde_json::json!({"name": "local", "key": [{"header": "x-key"}], "limit": 1, "window": "1h"}));
    let host = Host::new(config);
    let (context, stream, _) = host.send(&keyed("k"));
    let tokens = send_calls(&host, context);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    let keys = stage.answered(&host.store, &host.metrics, tokens[0], grant(10), host.clock.now()).unwrap();
    assert_eq!(wake(&host, keys, &keyed("k")), vec![(context, Step::Continue { route: None })]);
    host.end(context, &stream, &OK);
    // The local rule refuses the next: the unit the leased rule took for it goes back to the
    // lease.
    let (_, refused, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 429);
    assert!(refused.borrow().leased.units.is_empty(), "untaken");
    assert_eq!(host.metric("floodgate.rate_limit.local.rejected"), 1);
    // What the lease still holds: 10 granted − 1 used = 9, none lost to the refusal.
    let returned = host.filter.fleet.leased.as_ref().unwrap();
    returned.drain(&host.store, host.clock.now());
    let calls = returned.take_outgoing();
    let given_back: u32 = calls.iter().flat_map(|c| c.asks.iter()).map(|a| a.returned).sum();
    assert_eq!(given_back, 9);
}

/// The leased stage comes before the rate-limit stage: a request waiting for the store has
/// counted no local quota, so a request its leased rule ends up refusing never made another one
/// of the same local key refused meanwhile.
#[test]
fn a_request_waiting_for_the_store_holds_no_local_quota() {
    let mut config = leased(10);
    config["rate_limits"].as_array_mut().unwrap().push(serde_json::json!({"name": "local", "key": [{"header": "x-user"}], "limit": 1, "window": "1h"}));
    let host = Host::new(config);
    let (first, first_stream, step) = host.send(&keyed("k1").with("x-user", "u"));
    assert_eq!(step, Step::Wait);
    let first_tokens = send_calls(&host, first);
    let (second, second_stream, step) = host.send(&keyed("k2").with("x-user", "u"));
    assert_eq!(step, Step::Wait, "the user's local quota is untouched while the first waits");
    let second_tokens = send_calls(&host, second);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    // The store has no room for k1: the first is refused, having counted nothing locally.
    let full = Answer::Ok(br#"{"version":1,"leases":[{"granted":0,"current":10,"previous":0}]}"#.to_vec());
    let keys = stage.answered(&host.store, &host.metrics, first_tokens[0], full, host.clock.now()).unwrap();
    let steps = wake(&host, keys, &keyed("k1").with("x-user", "u"));
    assert_eq!((steps.len(), status(&steps[0].1)), (1, 429));
    // k2 has room: the second is admitted, the user's one local unit its.
    let keys = stage.answered(&host.store, &host.metrics, second_tokens[0], grant(3), host.clock.now()).unwrap();
    assert_eq!(wake(&host, keys, &keyed("k2").with("x-user", "u")), vec![(second, Step::Continue { route: None })]);
    assert_eq!(host.metric("floodgate.rate_limit.local.rejected"), 0);
    assert_eq!(host.metric("floodgate.rate_limit.local.allowed"), 1);
    host.end(first, &first_stream, &OK);
    host.end(second, &second_stream, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn a_stream_that_ends_while_waiting_leaves_nothing_behind() {
    let host = Host::new(leased(10));
    let (gone, gone_stream, _) = host.send(&keyed("k"));
    let tokens = send_calls(&host, gone);
    let (staying, stream, step) = host.send(&keyed("k"));
    assert_eq!(step, Step::Wait, "it waits on the same call");
    assert!(send_calls(&host, staying).is_empty(), "one call per key at a time");
    // The first stream's client hangs up: its call is lost with it (the host cancels it).
    host.end(gone, &gone_stream, &Ended { status: None, flags: 0 });
    assert!(!gone_stream.borrow().holds_permits());
    assert_eq!(host.in_flight(), 1);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    assert!(!stage.owns(tokens[0]), "its call is forgotten");
    // The root's next tick sends the key's call again, for the request still waiting.
    host.clock.advance(10);
    let keys = stage.tick(&host.store, &host.metrics, host.clock.now());
    assert!(wake(&host, keys, &keyed("k")).iter().all(|(_, step)| *step == Step::Wait));
    stage.flush();
    let tokens = send_calls(&host, ROOT);
    assert_eq!(tokens.len(), 1);
    let keys = stage.answered(&host.store, &host.metrics, tokens[0], grant(2), host.clock.now()).unwrap();
    assert_eq!(wake(&host, keys, &keyed("k")), vec![(staying, Step::Continue { route: None })]);
    host.end(staying, &stream, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn a_request_waiting_past_the_timeout_is_decided_without_the_store() {
    let host = Host::new(leased(10));
    let (context, stream, _) = host.send(&keyed("k"));
    let tokens = send_calls(&host, context);
    // No answer: its call, sent from its stream, times out at lease_timeout (50 ms), and it is
    // decided as on_store_failure says (last_state: admitted on the last counts, none here).
    host.clock.advance(50);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    let keys = stage.tick(&host.store, &host.metrics, host.clock.now());
    assert!(wake(&host, keys, &keyed("k")).iter().all(|(_, step)| *step == Step::Wait), "its call has not failed yet");
    let keys = stage.answered(&host.store, &host.metrics, tokens[0], Answer::Failed(None), host.clock.now()).unwrap();
    assert_eq!(wake(&host, keys, &keyed("k")), vec![(context, Step::Continue { route: None })]);
    assert_eq!(host.metric("floodgate.lease.without_store"), 1);
    host.end(context, &stream, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn a_woken_request_whose_context_is_gone_is_abandoned() {
    let host = Host::new(leased(10));
    let (context, stream, _) = host.send(&keyed("k"));
    let tokens = send_calls(&host, context);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    let keys = stage.answered(&host.store, &host.metrics, tokens[0], grant(1), host.clock.now()).unwrap();
    for key in keys {
        for (_, woken) in stage.take_waiting(key) {
            abandon(&host.filter, &host.env(), &woken, Waiting::Store);
        }
    }
    assert!(stream.borrow().waiting_since().is_none());
    // Its permit goes back when its stream state goes (the host dropped it).
    drop(stream);
    host.clock.advance(1_000);
    host.filter.heartbeat(&host.env());
    assert_eq!(host.in_flight(), 0);
}

// ---- shadow mode, and the decision the access log shows ----

fn decision(stream: &RefCell<Stream>) -> Decision {
    *stream.borrow().decision()
}

#[test]
fn a_rule_in_shadow_lets_everything_through_and_counts_exactly_what_it_would_refuse() {
    let mut shadow = rule(5);
    shadow["mode"] = "shadow".into();
    let host = Host::new(serde_json::json!({"rate_limits": [shadow], "access_log": true}));
    let steps: Vec<u32> = (0..12).map(|_| status(&host.send(&keyed("k")).2)).collect();
    assert_eq!(steps, vec![0; 12]);
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 5);
    assert_eq!(host.metric("floodgate.rate_limit.r.shadow_rejected"), 7);
    assert_eq!(host.metric("floodgate.rate_limit.r.rejected"), 0);
    let (_, stream, _) = host.send(&keyed("k"));
    let d = decision(&stream);
    assert_eq!((d.outcome, d.by, d.standing), (decision::Outcome::ShadowRefused, Some(By::Rule(0)), Some((5, 0))));
    // Enforced under a new configuration on the same store: the counts stand, and the next
    // request is refused at once.
    let mut enforced = Host::new(serde_json::json!({"rate_limits": [rule(5)]}));
    enforced.store = host.store;
    assert_eq!(status(&enforced.send(&keyed("k")).2), 429);
    assert_eq!(status(&enforced.send(&keyed("other")).2), 0);
}

#[test]
fn a_request_only_a_shadow_rule_refuses_is_counted_by_the_enforced_rules() {
    let mut shadow = rule(1);
    shadow["mode"] = "shadow".into();
    let host = Host::new(serde_json::json!({"rate_limits": [
        shadow,
        {"name": "e", "key": [{"header": "x-key"}], "limit": 3, "window": "1h"},
    ]}));
    let steps: Vec<u32> = (0..4).map(|_| status(&host.send(&keyed("k")).2)).collect();
    assert_eq!(steps, vec![0, 0, 0, 429]);
    assert_eq!(host.metric("floodgate.rate_limit.e.allowed"), 3);
    assert_eq!(host.metric("floodgate.rate_limit.e.rejected"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 1);
    // The second and third went on past the shadow rule; the fourth is refused by the enforced
    // rule, and the shadow rule would have refused it as well.
    assert_eq!(host.metric("floodgate.rate_limit.r.shadow_rejected"), 3);
    assert_eq!(host.metric("floodgate.rate_limit.r.rejected"), 0);
}

/// The rule whose `RateLimit` fields an admitted request's response carries, if any.
fn fields_rule(stream: &StreamCell) -> Option<usize> {
    stream.borrow().fields.as_ref().map(|t| t.rule)
}

#[test]
fn a_rule_in_shadow_alone_shows_no_field_whether_it_would_admit_or_refuse() {
    let mut shadow = rule(2);
    shadow["mode"] = "shadow".into();
    let host = Host::new(serde_json::json!({"rate_limits": [shadow], "access_log": true}));
    for n in 0..4 {
        let (_, stream, step) = host.send(&keyed("k"));
        assert_eq!(status(&step), 0);
        assert_eq!(fields_rule(&stream), None, "request {n}");
    }
    assert_eq!(host.metric("floodgate.rate_limit.r.shadow_rejected"), 2);
    let (_, stream, _) = host.send(&keyed("k"));
    let d = decision(&stream);
    assert_eq!((d.outcome, d.standing), (decision::Outcome::ShadowRefused, Some((2, 0))), "the log still tells");
}

#[test]
fn beside_an_enforced_rule_a_rule_in_shadow_never_takes_over_the_fields() {
    let mut shadow = rule(2);
    shadow["mode"] = "shadow".into();
    let host = Host::new(serde_json::json!({"rate_limits": [
        shadow,
        {"name": "e", "key": [{"header": "x-key"}], "limit": 4, "window": "1h"},
    ]}));
    for n in 0..4 {
        let (_, stream, step) = host.send(&keyed("k"));
        assert_eq!(status(&step), 0);
        assert_eq!(fields_rule(&stream), Some(1), "request {n}: the enforced rule's fields, though the shadow rule has less left");
    }
    let (_, _, step) = host.send(&keyed("k"));
    let Step::Reply(LocalReply::Http(reply)) = step else { panic!("refused: {step:?}") };
    assert_eq!(reply.status, 429);
    let named: Vec<&str> = reply.headers.iter().filter(|(name, _)| name.starts_with("ratelimit")).map(|(_, value)| value.as_str()).collect();
    assert!(!named.is_empty() && named.iter().all(|v| v.starts_with("\"e\"")), "{named:?}");
}

#[test]
fn the_top_level_mode_puts_every_mechanism_in_shadow() {
    let host = Host::new(serde_json::json!({
        "mode": "shadow",
        "rate_limits": [rule(1)],
        "load_shedding": {
            "max_active_requests": 1, "classes": [{"name": "normal", "shed_at": 1.0}],
            "per_key": {"key": [{"header": "x-key"}], "max_active_requests": 1},
        },
    }));
    let (first, held, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    let (second, other, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    // The second would have been shed: it holds nothing, so the cap and the rule never saw it.
    assert!(!other.borrow().holds_permits());
    assert_eq!(host.metric("floodgate.load_shedding.normal.shadow_shed"), 1);
    assert_eq!(host.metric("floodgate.load_shedding.normal.shed"), 0);
    // It goes on to the upstream, so the later mechanisms see it: each counts it as it would
    // if it alone were enforced.
    assert_eq!(host.metric("floodgate.load_shedding.per_key.shadow_refused"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.shadow_rejected"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 1);
    assert_eq!(decision(&other).by, Some(By::InFlight), "the first mechanism that would have refused it");
    host.end(first, &held, &OK);
    host.end(second, &other, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn shedding_in_shadow_admits_all_and_holds_only_the_permits_it_would_grant() {
    let host = Host::new(serde_json::json!({"load_shedding": {
        "max_active_requests": 4, "mode": "shadow", "classes": [{"name": "normal", "shed_at": 1.0}],
    }}));
    let streams: Vec<(u32, StreamCell, Step)> = (0..10).map(|_| host.send(&TestRequest::get("/"))).collect();
    assert!(streams.iter().all(|(_, _, step)| status(step) == 0));
    assert_eq!(host.metric("floodgate.load_shedding.normal.shadow_shed"), 6);
    assert_eq!(host.in_flight(), 4);
    for (context, stream, _) in &streams {
        host.end(*context, stream, &OK);
    }
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn the_per_key_cap_in_shadow_counts_its_would_be_refusals() {
    let host = Host::new(serde_json::json!({
        "load_shedding": {"per_key": {"key": [{"header": "x-key"}], "max_active_requests": 1, "mode": "shadow"}},
        "access_log": true,
    }));
    let (first, held, _) = host.send(&keyed("k"));
    let (_, capped, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    assert!(!capped.borrow().holds_permits());
    assert_eq!(host.metric("floodgate.load_shedding.per_key.shadow_refused"), 1);
    assert_eq!(host.metric("floodgate.load_shedding.per_key.refused"), 0);
    assert_eq!(decision(&capped).by, Some(By::PerKey));
    host.end(first, &held, &OK);
}

#[test]
fn a_partition_in_shadow_sends_a_request_it_would_refuse_to_another_cluster() {
    let mut selection = selection(&["a", "b", "c"], 1);
    selection["partition"] = serde_json::json!({"key": [{"header": "x-key"}], "size": 1, "mode": "shadow"});
    let host = Host::new(serde_json::json!({"cluster_selection": selection, "access_log": true}));
    let (_, _held, first) = host.send(&keyed("k"));
    let (_, second, step) = host.send(&keyed("k"));
    let (Step::Continue { route: Some(a) }, Step::Continue { route: Some(b) }) = (first, step) else { panic!("both routed") };
    assert_ne!(a, b, "its partition is full");
    assert_eq!(host.metric("floodgate.cluster_selection.partition.shadow_refused"), 1);
    assert_eq!(host.metric("floodgate.cluster_selection.partition.spilled"), 0);
    let d = decision(&second);
    assert_eq!((d.outcome, d.by, d.cluster), (decision::Outcome::ShadowRefused, Some(By::Partition), Some(b)));
}

#[test]
fn the_decision_names_the_outcome_the_mechanism_the_tightest_rule_and_the_cluster() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [rule(2), {"name": "wide", "key": [{"header": "x-key"}], "limit": 100, "window": "1h"}],
        "cluster_selection": selection(&["a"], 10),
        "access_log": true,
    }));
    let (_, admitted, _) = host.send(&keyed("k"));
    let fields = decision(&admitted).fields(&host.filter, &host.filter.decision_names);
    assert_eq!(
        fields,
        vec![
            ("test.outcome", "admitted".to_owned()),
            ("test.limit", "2".to_owned()),
            ("test.remaining", "1".to_owned()),
            ("test.cluster", "a".to_owned()),
        ]
    );
    host.send(&keyed("k"));
    let (_, refused, _) = host.send(&keyed("k"));
    let fields = decision(&refused).fields(&host.filter, &host.filter.decision_names);
    assert_eq!(
        fields,
        vec![
            ("test.outcome", "refused".to_owned()),
            ("test.by", "r".to_owned()),
            ("test.limit", "2".to_owned()),
            ("test.remaining", "0".to_owned()),
        ]
    );
}

#[test]
fn a_leased_rule_in_shadow_takes_nothing_for_a_request_it_would_refuse() {
    let mut config = leased(10);
    config["rate_limits"][0]["mode"] = "shadow".into();
    let host = Host::new(config);
    let (context, stream, _) = host.send(&keyed("k"));
    let tokens = send_calls(&host, context);
    let stage = host.filter.fleet.leased.as_ref().unwrap();
    let full = Answer::Ok(br#"{"version":1,"leases":[{"granted":0,"current":10,"previous":0}]}"#.to_vec());
    let keys = stage.answered(&host.store, &host.metrics, tokens[0], full, host.clock.now()).unwrap();
    assert_eq!(wake(&host, keys, &keyed("k")), vec![(context, Step::Continue { route: None })]);
    assert!(stream.borrow().leased.units.is_empty());
    assert_eq!(host.metric("floodgate.rate_limit.r.shadow_rejected"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.rejected"), 0);
    assert_eq!(decision(&stream).outcome, decision::Outcome::ShadowRefused);
}

// ---- the watchdog ----

#[test]
fn the_watchdog_answers_liveness_from_every_worker_s_heartbeat_and_counts_nowhere() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [rule(1)],
        "load_shedding": {"max_active_requests": 1},
        "health": {"path": "/health"},
        "watchdog": {"path": "/alive", "worker_silence": "5s", "max_loop_lag": "2s", "lag_for": "30s"},
    }));
    // Another worker of the same proxy: its own VM id, its own state, the same record.
    let other = crate::watchdog::Watchdog::new(host.filter.config.watchdog.as_ref().unwrap(), "test");
    let mut other_state = crate::watchdog::WorkerState::default();
    let beat = |host: &Host, other_state: &mut crate::watchdog::WorkerState, other_beats: bool| {
        host.clock.advance(1_000);
        host.filter.heartbeat(&host.env());
        if other_beats {
            other.heartbeat(&host.store, 99, other_state, host.clock.now().mono, 0, None).unwrap();
        }
    };
    for _ in 0..5 {
        beat(&host, &mut other_state, true);
    }
    // The other worker serves a stream (this one does with the next request): both are workers.
    other.serving(&host.store, 99, &mut other_state, host.clock.now().mono).unwrap();
    // The one in-flight unit is taken: readiness says 503, liveness 200.
    let (held_context, held, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    let (_, _, step) = host.send(&TestRequest::get("/health"));
    assert_eq!(status(&step), 503, "readiness: shedding");
    let (_, alive, step) = host.send(&TestRequest::get("/alive?probe=1").with("x-key", "k"));
    let Step::Reply(LocalReply::Http(reply)) = &step else { panic!("{step:?}") };
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(body["status"], "alive");
    assert_eq!(body["workers"].as_array().unwrap().len(), 2, "{body}");
    assert!(!alive.borrow().holds_permits());
    assert_eq!(alive.borrow().decision().outcome, decision::Outcome::Watchdog);
    // The other worker stops beating: 5 s of silence are tolerated, the sixth fails.
    for _ in 0..5 {
        beat(&host, &mut other_state, false);
    }
    assert_eq!(status(&host.send(&TestRequest::get("/alive")).2), 200);
    beat(&host, &mut other_state, false);
    let (_, _, step) = host.send(&TestRequest::get("/alive"));
    let Step::Reply(LocalReply::Http(reply)) = &step else { panic!("{step:?}") };
    assert_eq!(reply.status, 503, "{}", reply.body);
    let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(body["status"], "failing");
    assert!(body["reasons"][0].as_str().unwrap().contains("0000000000000063 has not beaten for 6000 ms"), "{body}");
    // HEAD too; another method on the path is an ordinary request.
    let head = TestRequest { headers: vec![(":method", "HEAD".into()), (":path", "/alive".into())] };
    assert_eq!(status(&host.send(&head).2), 503);
    host.end(held_context, &held, &OK);
    let post = TestRequest { headers: vec![(":method", "POST".into()), (":path", "/alive".into())] };
    let (post_context, post_stream, step) = host.send(&post);
    assert_eq!(status(&step), 0, "POST /alive goes to the upstream");
    host.end(post_context, &post_stream, &OK);
    // None of the answers was counted by a rule or the shedder.
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.rejected"), 0);
    assert_eq!(host.metric("floodgate.load_shedding.normal.shed"), 0);
    // The other worker comes back: failing until it has beaten recover_after (3) times on time.
    let mut seen = Vec::new();
    for _ in 0..4 {
        beat(&host, &mut other_state, true);
        seen.push(status(&host.send(&TestRequest::get("/alive")).2));
    }
    assert_eq!(seen, [503, 503, 503, 200]);
    // This worker's configuration is retired: its entry no longer counts, even once silent.
    host.filter.retire(&host.env());
    for _ in 0..10 {
        host.clock.advance(1_000);
        other.heartbeat(&host.store, 99, &mut other_state, host.clock.now().mono, 0, None).unwrap();
    }
    let verdict = other.verdict(&host.store, host.clock.now().mono);
    assert!(verdict.alive(), "{verdict:?}");
    assert_eq!(verdict.workers.len(), 1);
}

#[test]
fn without_a_watchdog_or_a_health_endpoint_no_path_is_read() {
    /// A request that fails the test if its `:path` is read.
    struct NoPath;
    impl Attributes for NoPath {
        fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
            assert_ne!(name, ":path", "the common path reads no :path");
            None
        }
    }
    impl Request for NoPath {
        fn source_address(&self) -> Option<Cow<'_, [u8]>> {
            None
        }
    }
    let host = Host::new(serde_json::json!({"load_shedding": {"max_active_requests": 5}}));
    let (context, mut stream) = host.stream();
    let step = request_headers(&host.filter, &host.env(), &mut stream, context, &NoPath, true, &mut *host.rng.borrow_mut());
    assert_eq!(status(&step), 0);
    host.end(context, &stream, &OK);
    assert!(HeaderPlan::new(&Config::parse(br#"{"watchdog":{"path":"/alive"}}"#).unwrap()).names().iter().any(|n| n == ":path"));
}

// ---- token buckets: waiting for a turn ----

fn bucket_rule(max_delay: Option<&str>) -> serde_json::Value {
    let mut rule = serde_json::json!({"name": "b", "key": [{"header": "x-key"}], "limit": 10, "window": "1s", "algorithm": "token_bucket", "burst": 5});
    if let Some(delay) = max_delay {
        rule["max_delay"] = delay.into();
    }
    rule
}

/// The host's tick: the streams whose turn came, resumed in turn.
fn tick(host: &Host) -> Vec<(u32, Step)> {
    let stage = host.filter.waits.delays.as_ref().unwrap();
    let mut steps = Vec::new();
    for (context, stream) in stage.take_due(host.clock.now().mono) {
        if stream.borrow().delayed_until().is_none() {
            continue;
        }
        let request = keyed("k");
        steps.push((context, resume(&host.filter, &host.env(), &stream, context, &request, &mut *host.rng.borrow_mut(), Waiting::Turn)));
    }
    steps
}

#[test]
fn without_max_delay_there_is_no_delay_stage_and_a_bucket_refuses_with_its_fields() {
    let host = Host::new(serde_json::json!({"rate_limits": [bucket_rule(None)], "ratelimit_headers": "always"}));
    assert!(host.filter.waits.delays.is_none());
    let steps: Vec<u32> = (0..8).map(|_| status(&host.send(&keyed("k")).2)).collect();
    assert_eq!(steps, [0, 0, 0, 0, 0, 429, 429, 429]);
    let Step::Reply(LocalReply::Http(reply)) = host.send(&keyed("k")).2 else { panic!() };
    let header = |name: &str| reply.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()).unwrap();
    assert_eq!(header("retry-after"), "1");
    assert_eq!(header("ratelimit-policy"), "\"b\";q=5;w=1");
    assert_eq!(header("ratelimit"), "\"b\";r=0;t=1");
    let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!((body["retry_after_ms"].as_u64(), body["burst"].as_u64(), body["algorithm"].as_str()), (Some(100), Some(5), Some("token_bucket")));
    assert_eq!(host.metric("floodgate.rate_limit.b.allowed"), 5);
    assert_eq!(host.metric("floodgate.rate_limit.b.rejected"), 4);
    // gRPC: RESOURCE_EXHAUSTED.
    let grpc = keyed("k").with("content-type", "application/grpc");
    assert_eq!(status(&host.send(&grpc).2), 1008);
}

#[test]
fn a_request_that_waited_for_its_turn_is_logged_as_delayed_with_its_wait() {
    let host = Host::new(serde_json::json!({"rate_limits": [bucket_rule(Some("500ms"))], "access_log": true}));
    let sent: Vec<(u32, StreamCell, Step)> = (0..6).map(|_| host.send(&keyed("k"))).collect();
    assert_eq!(status(&sent[5].2), 1, "the sixth waits for its turn");
    let d = decision(&sent[0].1);
    assert_eq!((d.outcome, d.by, d.waited_ms), (decision::Outcome::Admitted, None, None), "the first went at once");
    host.clock.advance(100);
    let went = tick(&host);
    assert_eq!(went.len(), 1);
    let d = decision(&sent[5].1);
    assert_eq!((d.outcome, d.by, d.waited_ms), (decision::Outcome::Delayed, Some(By::Rule(0)), Some(100)));
    let fields = d.fields(&host.filter, &host.filter.decision_names);
    let field = |name: &str| fields.iter().find(|(n, _)| n.ends_with(name)).map(|(_, v)| v.as_str());
    assert_eq!((field(".outcome"), field(".by"), field(".waited_ms")), (Some("delayed"), Some("b"), Some("100")));
}

#[test]
fn a_request_over_the_rate_waits_for_its_turn_and_the_tick_resumes_it() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [bucket_rule(Some("500ms"))],
        "load_shedding": {"max_active_requests": 100},
    }));
    let sent: Vec<(u32, StreamCell, Step)> = (0..12).map(|_| host.send(&keyed("k"))).collect();
    let statuses: Vec<u32> = sent.iter().map(|(_, _, step)| status(step)).collect();
    assert_eq!(statuses, [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 429, 429], "5 go, 5 wait, 2 refused");
    let Step::Reply(LocalReply::Http(refused)) = &sent[10].2 else { panic!() };
    let body: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
    assert_eq!(body["retry_after_ms"], 100, "let in to wait 100 ms later");
    assert_eq!(host.metric("floodgate.rate_limit.b.delayed"), 5);
    // Waiting requests hold their in-flight permit; the body waits with them.
    assert!(sent[..10].iter().all(|(_, stream, _)| stream.borrow().holds_permits()));
    assert!(!sent[10].1.borrow().holds_permits());
    assert_eq!(sent[5].1.borrow_mut().request_body(&host.filter, &host.env(), 10, true), Flow::Pause);
    // Each goes at its turn, 100 ms apart.
    let mut went = Vec::new();
    for _ in 0..60 {
        host.clock.advance(10);
        for (context, step) in tick(&host) {
            assert_eq!(step, Step::Continue { route: None });
            went.push((context, host.clock.now().mono.0 - T0));
        }
    }
    let first = sent[5].0;
    assert_eq!(went, (0..5).map(|i| (first + i, 100 * (u64::from(i) + 1))).collect::<Vec<_>>());
    assert!(host.filter.waits.delays.as_ref().unwrap().is_empty());
    for (context, stream, _) in &sent {
        host.end(*context, stream, &OK);
    }
    let shedder = host.filter.shedding.shedder.as_ref().unwrap();
    assert_eq!(shedder.in_flight(&host.store, VM, &host.filter.shedding.local, host.clock.now().mono), 0);
}

#[test]
fn a_client_that_leaves_while_it_waits_gives_its_slot_back() {
    let host = Host::new(serde_json::json!({"rate_limits": [bucket_rule(Some("1s"))]}));
    let sent: Vec<(u32, StreamCell, Step)> = (0..7).map(|_| host.send(&keyed("k"))).collect();
    assert_eq!(status(&sent[6].2), 1);
    // The last waiting client goes away: its slot (at 200 ms) comes back.
    let (context, stream, _) = &sent[6];
    host.end(*context, stream, &Ended { status: None, flags: 0 });
    assert_eq!(host.metric("floodgate.rate_limit.b.delay_abandoned"), 1);
    let (_, _, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 1);
    assert_eq!(host.metric("floodgate.rate_limit.b.delayed"), 3);
    // The tick skips the stream that ended.
    host.clock.advance(200);
    let resumed: Vec<u32> = tick(&host).into_iter().map(|(c, _)| c).collect();
    assert_eq!(resumed, [sent[5].0, sent[6].0 + 1], "the one that left is skipped");
}

#[test]
fn a_request_whose_turn_came_and_whose_context_is_gone_gives_its_turns_back_once() {
    let host = Host::new(serde_json::json!({"rate_limits": [bucket_rule(Some("1s"))]}));
    let sent: Vec<(u32, StreamCell, Step)> = (0..6).map(|_| host.send(&keyed("k"))).collect();
    assert_eq!(status(&sent[5].2), 1);
    host.clock.advance(100);
    let due = host.filter.waits.delays.as_ref().unwrap().take_due(host.clock.now().mono);
    assert_eq!(due.len(), 1);
    for _ in 0..2 {
        abandon(&host.filter, &host.env(), &due[0].1, Waiting::Turn);
    }
    assert_eq!(host.metric("floodgate.rate_limit.b.delay_abandoned"), 1);
    assert!(sent[5].1.borrow().delayed_until().is_none());
    // Ending its stream afterwards gives nothing back again.
    host.end(sent[5].0, &sent[5].1, &OK);
    assert_eq!(host.metric("floodgate.rate_limit.b.delay_abandoned"), 1);
}

#[test]
fn a_bucket_in_shadow_neither_delays_nor_refuses() {
    let mut rule = bucket_rule(Some("200ms"));
    rule["mode"] = "shadow".into();
    let host = Host::new(serde_json::json!({"rate_limits": [rule]}));
    let statuses: Vec<u32> = (0..10).map(|_| status(&host.send(&keyed("k")).2)).collect();
    assert_eq!(statuses, [0; 10]);
    assert_eq!(host.metric("floodgate.rate_limit.b.shadow_rejected"), 3);
    assert_eq!(host.metric("floodgate.rate_limit.b.delayed"), 0);
}

// ---- load leveling: waiting for a slot ----

fn leveling(max_active: u32, queue: serde_json::Value) -> Host {
    let classes = serde_json::json!([{"name": "normal", "shed_at": 1.0}]);
    Host::new(serde_json::json!({"load_shedding": {"max_active_requests": max_active, "classes": classes, "queue": queue}}))
}

/// The host's tick: the waits that are over, resumed in order.
fn slot_tick(host: &Host, request: &TestRequest) -> Vec<(u32, Step)> {
    let stage = host.filter.waits.queue.as_ref().unwrap();
    let mut steps = Vec::new();
    for (context, stream) in stage.tick(&host.filter.shedding, &host.filter.stats, &host.env()) {
        if !stream.borrow().slot_decided() {
            continue;
        }
        steps.push((context, resume(&host.filter, &host.env(), &stream, context, request, &mut *host.rng.borrow_mut(), Waiting::Slot)));
    }
    steps
}

#[test]
fn without_a_queue_there_is_no_queue_stage_and_the_limit_sheds_at_once() {
    let host = Host::new(serde_json::json!({"load_shedding": {"max_active_requests": 1}}));
    assert!(host.filter.waits.queue.is_none());
    let (_, _held, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
    assert_eq!(status(&host.send(&keyed("k")).2), 503);
}

#[test]
fn requests_over_the_limit_wait_for_a_slot_in_order_and_the_queue_is_bounded() {
    let host = leveling(2, serde_json::json!({"max_queued": 3, "max_wait": "1s", "order": "fifo"}));
    let sent: Vec<(u32, StreamCell, Step)> = (0..6).map(|_| host.send(&keyed("k"))).collect();
    let statuses: Vec<u32> = sent.iter().map(|(_, _, step)| status(step)).collect();
    assert_eq!(statuses, [0, 0, 1, 1, 1, 503], "2 go, 3 wait, the queue is full for the sixth");
    let Step::Reply(LocalReply::Http(full)) = &sent[5].2 else { panic!() };
    let body: serde_json::Value = serde_json::from_str(&full.body).unwrap();
    assert_eq!((body["type"].as_str(), body["max_active_requests"].as_u64()), (Some(crate::replies::TEMPORARY_REDUCED_CAPACITY), Some(2)));
    assert_eq!(host.metric("floodgate.load_shedding.normal.queued"), 3);
    assert_eq!(host.metric("floodgate.load_shedding.queue_length"), 3);
    assert_eq!(host.metric("floodgate.load_shedding.normal.shed"), 1);
    // Waiting requests hold no slot; a body that comes meanwhile waits with them.
    assert!(!sent[2].1.borrow().holds_permits());
    assert_eq!(sent[2].1.borrow_mut().request_body(&host.filter, &host.env(), 10, true), Flow::Pause);
    host.clock.advance(10);
    assert!(slot_tick(&host, &keyed("k")).is_empty(), "no slot is free");
    // A slot frees: it goes to the first waiter, at the next tick.
    host.end(sent[0].0, &sent[0].1, &OK);
    host.clock.advance(10);
    assert_eq!(slot_tick(&host, &keyed("k")), [(sent[2].0, Step::Continue { route: None })]);
    assert!(sent[2].1.borrow().holds_permits());
    assert_eq!(decision(&sent[2].1).waited_ms, Some(20));
    // A newcomer finds a free slot but a waiter ahead of it: it waits behind.
    host.end(sent[1].0, &sent[1].1, &OK);
    let (late, late_stream, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 1);
    host.clock.advance(10);
    assert_eq!(slot_tick(&host, &keyed("k")), [(sent[3].0, Step::Continue { route: None })]);
    for i in [2, 3] {
        host.end(sent[i].0, &sent[i].1, &OK);
    }
    host.clock.advance(10);
    let order: Vec<u32> = slot_tick(&host, &keyed("k")).into_iter().map(|(c, _)| c).collect();
    assert_eq!(order, [sent[4].0, late]);
    assert_eq!(host.metric("floodgate.load_shedding.normal.dequeued"), 4);
    assert_eq!(host.metric("floodgate.load_shedding.queue_length"), 0);
    host.end(sent[4].0, &sent[4].1, &OK);
    host.end(late, &late_stream, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn a_waiter_given_a_slot_whose_context_is_gone_gives_the_slot_back() {
    let host = leveling(1, serde_json::json!({"max_queued": 10, "max_wait": "5s"}));
    let (first, held, _) = host.send(&keyed("k"));
    let (waiter, stream, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 1);
    host.end(first, &held, &OK);
    host.clock.advance(10);
    let ready = host.filter.waits.queue.as_ref().unwrap().tick(&host.filter.shedding, &host.filter.stats, &host.env());
    assert_eq!(ready.iter().map(|(c, _)| *c).collect::<Vec<_>>(), [waiter]);
    assert!(stream.borrow().slot_decided() && stream.borrow().holds_permits());
    assert_eq!(host.in_flight(), 1);
    abandon(&host.filter, &host.env(), &ready[0].1, Waiting::Slot);
    assert!(!stream.borrow().slot_decided() && !stream.borrow().holds_permits());
    assert_eq!(host.in_flight(), 0);
    host.end(waiter, &stream, &OK);
    assert_eq!(host.metric("floodgate.load_shedding.normal.queue_abandoned"), 0, "its ticket had left the queue");
}

#[test]
fn a_wait_that_ends_gets_the_shed_reply_saying_how_long_it_waited() {
    let host = leveling(1, serde_json::json!({"max_queued": 10, "max_wait": "400ms"}));
    let (first, held, _) = host.send(&keyed("k"));
    let (_, http, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 1);
    let (_, grpc, step) = host.send(&keyed("k").with("content-type", "application/grpc"));
    assert_eq!(status(&step), 1);
    let mut ended = Vec::new();
    for _ in 0..45 {
        host.clock.advance(10);
        ended.extend(slot_tick(&host, &keyed("k").with("content-type", "application/grpc")).into_iter().map(|(_, step)| (host.clock.now().mono.0 - T0, step)));
    }
    assert_eq!(ended.len(), 2);
    assert!(ended.iter().all(|(at, _)| *at == 400), "{ended:?}");
    // Resumed with the gRPC request's headers: both replies are gRPC here; the reply's fields
    // are the shed reply's.
    assert!(ended.iter().all(|(_, step)| status(step) == 1014));
    let Step::Reply(LocalReply::Grpc(reply)) = &ended[0].1 else { panic!() };
    assert!(reply.message.contains("waited 400 ms for a slot"), "{}", reply.message);
    assert_eq!(host.metric("floodgate.load_shedding.normal.queue_timeout"), 2);
    assert_eq!(host.metric("floodgate.load_shedding.normal.shed"), 2);
    assert_eq!(decision(&http).outcome, decision::Outcome::Shed);
    assert_eq!(decision(&grpc).waited_ms, Some(400));
    assert!(!http.borrow().holds_permits() && !grpc.borrow().holds_permits());
    assert_eq!(host.metric("floodgate.load_shedding.queue_length"), 0);
    host.end(first, &held, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn clients_that_leave_while_queued_leave_nothing_behind() {
    let host = leveling(1, serde_json::json!({"max_queued": 10, "max_wait": "5s"}));
    let (first, held, _) = host.send(&keyed("k"));
    let waiting: Vec<(u32, StreamCell, Step)> = (0..10).map(|_| host.send(&keyed("k"))).collect();
    assert!(waiting.iter().all(|(_, _, step)| *step == Step::Wait));
    assert!(waiting.iter().all(|(_, stream, _)| stream.borrow().needs_end()));
    for (context, stream, _) in &waiting {
        host.end(*context, stream, &Ended { status: None, flags: 0x4000 });
    }
    assert_eq!(host.metric("floodgate.load_shedding.normal.queue_abandoned"), 10);
    assert_eq!(host.metric("floodgate.load_shedding.queue_length"), 0);
    let stage = host.filter.waits.queue.as_ref().unwrap();
    assert!(stage.is_empty());
    let record = stage.leveler.read(&host.store);
    assert!(record.entries.is_empty() && record.lines.iter().all(|l| l.since.is_none()), "{record:?}");
    host.end(first, &held, &OK);
    assert_eq!(host.in_flight(), 0);
    // Later requests are admitted at once.
    let (_, _next, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 0);
}

#[test]
fn the_health_endpoint_reports_the_requests_waiting_in_the_queue() {
    let classes = serde_json::json!([{"name": "normal", "shed_at": 1.0}]);
    let host = Host::new(serde_json::json!({
        "load_shedding": {"max_active_requests": 1, "classes": classes, "queue": {"max_queued": 5, "max_wait": "1s"}},
        "health": {"path": "/health"},
    }));
    let queued = |host: &Host| {
        let (_, _, step) = host.send(&TestRequest::get("/health"));
        let Step::Reply(LocalReply::Http(reply)) = step else { panic!("the health endpoint answers") };
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        (reply.status, body["queued"].as_u64())
    };
    assert_eq!(queued(&host), (200, Some(0)));
    let sent: Vec<(u32, StreamCell, Step)> = (0..3).map(|_| host.send(&keyed("k"))).collect();
    assert_eq!(sent.iter().map(|(_, _, step)| status(step)).collect::<Vec<_>>(), [0, 1, 1]);
    assert_eq!(queued(&host), (503, Some(2)));
    for (context, stream, _) in &sent[1..] {
        host.end(*context, stream, &Ended { status: None, flags: 0x4000 });
    }
    host.end(sent[0].0, &sent[0].1, &OK);
    assert_eq!(queued(&host), (200, Some(0)));
}

#[test]
fn shedding_in_shadow_never_queues() {
    let host = Host::new(serde_json::json!({"load_shedding": {"max_active_requests": 1, "mode": "shadow", "queue": {"max_queued": 5, "max_wait": "1s"}}}));
    let sent: Vec<(u32, StreamCell, Step)> = (0..3).map(|_| host.send(&keyed("k"))).collect();
    assert!(sent.iter().all(|(_, _, step)| status(step) == 0));
    assert_eq!(host.metric("floodgate.load_shedding.normal.queued"), 0);
    assert_eq!(host.metric("floodgate.load_shedding.normal.shadow_shed"), 2);
}

// ---- fair shares between flows ----

/// One class of `max_active` slots shared by the flow of header `x-key`, queues of one
/// (each flow its own queue).
fn fair(max_active: u32, max_queued: u32) -> Host {
    let classes = serde_json::json!([{"name": "normal", "shed_at": 1.0}]);
    Host::new(serde_json::json!({"load_shedding": {
        "max_active_requests": max_active, "classes": classes,
        "queue": {"max_queued": max_queued, "max_wait": "5s"},
        "flow": {"key": [{"header": "x-key"}], "queues": 16, "hand_size": 2},
    }, "access_log": true}))
}

fn fair_record(host: &Host) -> crate::shedding::fair::FairClass {
    host.filter.waits.queue.as_ref().unwrap().flows.as_ref().unwrap().class(0).unwrap().read(&host.store)
}

#[test]
fn a_light_flow_passes_the_heavy_flows_waiters_and_no_slot_idles() {
    let host = fair(2, 16);
    let heavy: Vec<(u32, StreamCell, Step)> = (0..6).map(|_| host.send(&keyed("heavy"))).collect();
    assert_eq!(heavy.iter().map(|(_, _, step)| status(step)).collect::<Vec<_>>(), [0, 0, 1, 1, 1, 1], "2 go, 4 wait");
    assert!(!heavy[2].1.borrow().holds_permits());
    let (light, light_stream, step) = host.send(&keyed("light"));
    assert_eq!(status(&step), 1, "no slot is free");
    assert_eq!(host.metric("floodgate.load_shedding.normal.queued"), 5);
    // The first slot freed goes to the light flow, ahead of the heavy flow's older waiters.
    host.end(heavy[0].0, &heavy[0].1, &OK);
    host.clock.advance(10);
    assert_eq!(slot_tick(&host, &keyed("light")), [(light, Step::Continue { route: None })]);
    assert!(light_stream.borrow().holds_permits());
    assert_eq!(decision(&light_stream).waited_ms, Some(10));
    // The next one goes to the heavy flow's oldest waiter: the light flow holds one, as it asks.
    host.end(heavy[1].0, &heavy[1].1, &OK);
    host.clock.advance(10);
    assert_eq!(slot_tick(&host, &keyed("heavy")), [(heavy[2].0, Step::Continue { route: None })]);
    // A light request that finds the heavy flow holding the rest goes on as soon as its flow
    // holds fewer: when the light flow's request ends, its next one passes the heavy waiters.
    host.end(light, &light_stream, &OK);
    let (again, again_stream, step) = host.send(&keyed("light"));
    assert_eq!(status(&step), 0, "its flow holds none, the heavy one holds one: due to it at once");
    assert_eq!(host.in_flight(), 2);
    host.filter.heartbeat(&host.env());
    assert_eq!(host.metric("floodgate.load_shedding.normal.flows"), 2);
    assert_eq!(host.metric("floodgate.load_shedding.normal.fair_share_ppm"), 500_000);
    for (context, stream) in [(heavy[2].0, &heavy[2].1), (again, &again_stream)] {
        host.end(context, stream, &OK);
    }
    for _ in 0..3 {
        host.clock.advance(10);
        for (context, _) in slot_tick(&host, &keyed("heavy")) {
            let (_, stream, _) = heavy.iter().find(|(c, _, _)| *c == context).unwrap();
            host.end(context, stream, &OK);
        }
    }
    assert_eq!(host.in_flight(), 0);
    let record = fair_record(&host);
    assert_eq!((record.held(), record.waiting()), (0, 0), "every slot and place given back once");
    assert_eq!(host.metric("floodgate.load_shedding.normal.dequeued"), 5);
    assert_eq!(host.metric("floodgate.load_shedding.normal.shed"), 0);
}

/// Tenants `(name, requests kept outstanding)` in front of a class of `max_active` slots whose
/// upstream answers after 1 s, for `run_ms`, one worker, time in steps of 1 ms and the root's
/// tick every 10 ms: each client sends its next request 1 ms after its last one ended, was
/// refused or was shed. Returns the requests each tenant got a slot for after the first second.
fn closed_loop(max_active: u32, tenants: &[(&str, usize)], run_ms: u64) -> Vec<u64> {
    const TICK: u64 = 10;
    #[derive(Clone, Copy, PartialEq)]
    enum Client {
        Idle(u64),
        Waiting(u32),
        Served(u32, u64),
    }
    let host = fair(max_active, 64);
    let mut clients: Vec<(usize, Client)> = tenants.iter().enumerate().flat_map(|(t, (_, n))| (0..*n).map(move |_| (t, Client::Idle(0)))).collect();
    let mut streams: HashMap<u32, StreamCell> = HashMap::new();
    let mut served = vec![0u64; tenants.len()];
    for ms in 0..run_ms {
        let admitted = |served: &mut Vec<u64>, tenant: usize| {
            if ms >= 1_000 {
                served[tenant] += 1;
            }
        };
        if ms % TICK == 0 {
            let ready: HashMap<u32, Step> = clients
                .iter()
                .filter_map(|(t, c)| match c {
                    Client::Waiting(context) => Some((*context, *t)),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .first()
                .map(|_| slot_tick(&host, &keyed("any")).into_iter().collect())
                .unwrap_or_default();
            for (tenant, client) in clients.iter_mut() {
                let Client::Waiting(context) = *client else { continue };
                match ready.get(&context) {
                    Some(Step::Continue { .. }) => {
                        admitted(&mut served, *tenant);
                        *client = Client::Served(context, ms + 1_000);
                    }
                    Some(_) => {
                        host.end(context, &streams.remove(&context).unwrap(), &OK);
                        *client = Client::Idle(ms + 1);
                    }
                    None => {}
                }
            }
        }
        for (tenant, client) in clients.iter_mut() {
            match *client {
                Client::Served(context, until) if until <= ms => {
                    host.end(context, &streams.remove(&context).unwrap(), &OK);
                    *client = Client::Idle(ms + 1);
                }
                Client::Idle(at) if at <= ms => {
                    let (context, stream, step) = host.send(&keyed(tenants[*tenant].0));
                    match status(&step) {
                        0 => {
                            admitted(&mut served, *tenant);
                            *client = Client::Served(context, ms + 1_000);
                            streams.insert(context, stream);
                        }
                        1 => {
                            *client = Client::Waiting(context);
                            streams.insert(context, stream);
                        }
                        _ => {
                            host.end(context, &stream, &OK);
                            *client = Client::Idle(ms + 1);
                        }
                    }
                }
                _ => {}
            }
        }
        host.clock.advance(1);
    }
    served
}

#[test]
fn tenants_that_retry_at_once_get_their_max_min_fair_shares() {
    let served = closed_loop(6, &[("heavy", 16), ("medium", 4), ("light", 1)], 11_000);
    let total: u64 = served.iter().sum();
    println!("6 slots, 10 s: heavy, medium, light served {served:?} of {total}");
    assert!(total >= 58, "the slots stay busy: {total}");
    for (got, share) in served.iter().zip([2.5, 2.5, 1.0]) {
        let expected = share / 6.0 * total as f64;
        assert!((*got as f64 - expected).abs() <= 0.1 * expected, "{served:?}: {got} for a share of {expected:.1}");
    }
}

#[test]
fn a_full_class_sheds_the_heaviest_flows_newest_waiter_and_says_its_share() {
    let host = fair(2, 3);
    let heavy: Vec<(u32, StreamCell, Step)> = (0..5).map(|_| host.send(&keyed("heavy"))).collect();
    assert_eq!(heavy.iter().map(|(_, _, step)| status(step)).collect::<Vec<_>>(), [0, 0, 1, 1, 1]);
    // The queue is full: the light arrival waits, the heavy flow's newest waiter is pushed out.
    let (light, light_stream, step) = host.send(&keyed("light"));
    assert_eq!(status(&step), 1);
    host.clock.advance(10);
    let ended = slot_tick(&host, &keyed("heavy"));
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].0, heavy[4].0, "the newest of the flow holding the most");
    let Step::Reply(LocalReply::Http(reply)) = &ended[0].1 else { panic!("{:?}", ended[0].1) };
    assert_eq!(reply.status, 503);
    let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!((body["flow_in_flight"].as_u64(), body["flow_waiting"].as_u64(), body["flows"].as_u64()), (Some(2), Some(2), Some(2)));
    assert_eq!(body["fair_share"].as_f64(), Some(1.0));
    assert!(body["detail"].as_str().unwrap().contains("this request's flow holds the most"), "{body}");
    assert_eq!(decision(&heavy[4].1).by, Some(By::Flow));
    // The access log names the flow's share as the body does.
    let fields = decision(&heavy[4].1).fields(&host.filter, &host.filter.decision_names);
    let field = |name: &str| fields.iter().find(|(n, _)| *n == format!("test.{name}")).map(|(_, v)| v.as_str());
    assert_eq!([field("by"), field("flow_in_flight"), field("flow_waiting"), field("flows"), field("fair_share")], [Some("flow"), Some("2"), Some("2"), Some("2"), Some("1")]);
    // A heavy arrival now is itself the newest of the flow holding the most: shed at once.
    let (_, shed, step) = host.send(&keyed("heavy"));
    assert_eq!(status(&step), 503);
    assert_eq!(decision(&shed).by, Some(By::Flow));
    assert_eq!(host.metric("floodgate.load_shedding.normal.shed_by_flow"), 2);
    assert_eq!(host.metric("floodgate.load_shedding.normal.shed"), 2);
    // The light waiter gets the next slot.
    host.end(heavy[0].0, &heavy[0].1, &OK);
    host.clock.advance(10);
    assert_eq!(slot_tick(&host, &keyed("light")), [(light, Step::Continue { route: None })]);
    host.end(light, &light_stream, &OK);
    for (context, stream, _) in &heavy[1..4] {
        host.end(*context, stream, &Ended { status: None, flags: 0x4000 });
    }
    assert_eq!(host.in_flight(), 0);
    let record = fair_record(&host);
    assert_eq!((record.held(), record.waiting()), (0, 0));
}

#[test]
fn a_grpc_call_shed_by_its_flow_gets_unavailable_with_pushback() {
    let host = fair(1, 1);
    let grpc = |tenant: &str| keyed(tenant).with("content-type", "application/grpc");
    let (first, held, step) = host.send(&grpc("heavy"));
    assert_eq!(status(&step), 0);
    let (waiter, waiting, step) = host.send(&grpc("heavy"));
    assert_eq!(status(&step), 1);
    let (_, shed, step) = host.send(&grpc("heavy"));
    let Step::Reply(LocalReply::Grpc(reply)) = &step else { panic!("{step:?}") };
    assert_eq!(status(&step), 1014, "UNAVAILABLE");
    assert!(reply.message.contains("this request's flow holds the most"), "{}", reply.message);
    assert_eq!(reply.metadata.first().map(|(name, value)| (*name, value.as_str())), Some(("grpc-retry-pushback-ms", "1000")));
    assert_eq!(decision(&shed).by, Some(By::Flow));
    host.end(first, &held, &OK);
    host.end(waiter, &waiting, &Ended { status: None, flags: 0x4000 });
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn a_request_without_the_flow_key_is_one_flow_and_a_class_without_a_flow_is_as_before() {
    let classes = serde_json::json!([{"name": "fair", "shed_at": 1.0, "flow": {"key": [{"header": "x-key"}]}}, {"name": "plain", "shed_at": 1.0}]);
    let host = Host::new(serde_json::json!({"load_shedding": {
        "max_active_requests": 1, "classes": classes, "default_class": "plain",
        "queue": {"max_queued": 4, "max_wait": "5s", "order": "fifo"},
    }}));
    let flows = host.filter.waits.queue.as_ref().unwrap().flows.as_ref().unwrap();
    assert!(flows.class(0).is_some() && flows.class(1).is_none());
    let (first, held, step) = host.send(&TestRequest::get("/").with("x-floodgate-priority", "fair"));
    assert_eq!(status(&step), 0);
    assert!(held.borrow().holds_permits());
    let (plain, plain_stream, step) = host.send(&keyed("k"));
    assert_eq!(status(&step), 1, "the plain class waits in the proxy's line");
    host.end(first, &held, &OK);
    host.clock.advance(10);
    assert_eq!(slot_tick(&host, &keyed("k")), [(plain, Step::Continue { route: None })]);
    host.end(plain, &plain_stream, &OK);
    assert_eq!(host.in_flight(), 0);
}

#[test]
fn flows_in_shadow_admit_everything_and_count_what_would_have_waited() {
    let classes = serde_json::json!([{"name": "normal", "shed_at": 1.0}]);
    let host = Host::new(serde_json::json!({"load_shedding": {
        "max_active_requests": 2, "classes": classes, "mode": "shadow",
        "queue": {"max_queued": 4, "max_wait": "5s"}, "flow": {"key": [{"header": "x-key"}]},
    }}));
    let sent: Vec<(u32, StreamCell, Step)> = (0..4).map(|_| host.send(&keyed("heavy"))).collect();
    assert!(sent.iter().all(|(_, _, step)| status(step) == 0));
    assert_eq!(host.metric("floodgate.load_shedding.normal.shadow_shed"), 2);
    assert_eq!(host.metric("floodgate.load_shedding.normal.queued"), 0);
    assert_eq!(decision(&sent[3].1).by, Some(By::Flow));
    assert_eq!(decision(&sent[3].1).outcome, decision::Outcome::ShadowRefused);
    assert_eq!(decision(&sent[3].1).share.map(|s| (s.held, s.flows, s.slots)), Some((3, 1, 2)), "three held in shadow, the fourth among them");
    assert_eq!(decision(&sent[0].1).share, None);
    for (context, stream, _) in &sent {
        host.end(*context, stream, &OK);
    }
    assert_eq!(fair_record(&host).held(), 0);
}

// ---- batched global scope: a key not learned asks the store ----

fn batched(limit: u32) -> serde_json::Value {
    serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": limit, "window": "1h",
                         "scope": "global", "consistency": "batched"}],
        "global": {"cluster": "floodgate-sync", "sync_interval": "1s", "lease_timeout": "50ms"},
    })
}

/// A host whose proxy knows a fleet of `proxies`.
fn fleet_host(limit: u32, proxies: u32) -> Host {
    let host = Host::new(batched(limit));
    host.filter.fleet.global_node.as_ref().unwrap().borrow_mut().proxies = proxies;
    host
}

/// Sends the ask stage's queued calls: the tokens, in order.
fn send_asks(host: &Host) -> Vec<u32> {
    let stage = host.filter.fleet.asks.as_ref().unwrap();
    stage
        .take_outgoing()
        .into_iter()
        .enumerate()
        .map(|(n, call)| {
            let token = 700 + u32::try_from(n).unwrap();
            stage.sent(&host.metrics, &host.filter.stats.global, call, token);
            token
        })
        .collect()
}

/// The answer to ask `token`: the request resumed with it.
fn answer_ask(host: &Host, token: u32, answer: Answer, request: &TestRequest) -> (u32, Step) {
    let stage = host.filter.fleet.asks.as_ref().unwrap();
    let (scope, node) = (host.filter.fleet.global.as_ref().unwrap(), host.filter.fleet.global_node.as_ref().unwrap());
    let (context, stream) = stage.answered(scope, node, &host.store, &host.metrics, &host.filter.stats.global, token, answer, host.clock.now().wall).unwrap();
    assert!(stream.borrow().ask_answered());
    (context, resume(&host.filter, &host.env(), &stream, context, request, &mut *host.rng.borrow_mut(), Waiting::Asked))
}

#[test]
fn a_key_not_learned_in_a_fleet_asks_the_store_and_holds_its_body_until_decided() {
    // A limit of 4 over 8 proxies: the projection refuses the key's first request, which asks.
    let host = fleet_host(4, 8);
    let request = keyed("k");
    let (context, mut stream) = host.stream();
    let step = request_headers(&host.filter, &host.env(), &mut stream, context, &request, false, &mut *host.rng.borrow_mut());
    assert_eq!(step, Step::Wait, "it waits for the store's answer");
    let shared = stream.share();
    // Its body arrives meanwhile: held, never forwarded before the decision.
    assert_eq!(shared.borrow_mut().request_body(&host.filter, &host.env(), 10, false), Flow::Pause);
    assert_eq!(shared.borrow_mut().request_trailers(&host.filter, &host.env()), Flow::Pause);
    let tokens = send_asks(&host);
    assert_eq!(tokens.len(), 1);
    assert_eq!(host.metric("floodgate.global.asked"), 1);
    let (resumed, step) = answer_ask(&host, tokens[0], grant(1), &request);
    assert_eq!((resumed, step), (context, Step::Continue { route: None }), "the store counted it: admitted");
    assert!(!shared.borrow().ask_answered(), "decided once");
    assert_eq!(shared.borrow_mut().request_body(&host.filter, &host.env(), 10, true), Flow::Continue, "decided: bodies go through");
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 1);
    assert_eq!(host.metric("floodgate.rate_limit.r.rejected"), 0);
    // The granted unit is in the store already: the batch does not count it again, nor read the
    // key (the answer gave its totals).
    let node = host.filter.fleet.global_node.as_ref().unwrap().borrow();
    assert!(node.deltas.is_empty(), "{:?}", node.deltas.iter().collect::<Vec<_>>());
}

#[test]
fn a_refused_ask_is_a_429_counted_once_and_its_held_body_never_goes_on() {
    let host = fleet_host(4, 8);
    let request = keyed("k");
    let (context, mut stream) = host.stream();
    let step = request_headers(&host.filter, &host.env(), &mut stream, context, &request, false, &mut *host.rng.borrow_mut());
    assert_eq!(step, Step::Wait);
    let shared = stream.share();
    assert_eq!(shared.borrow_mut().request_body(&host.filter, &host.env(), 10, true), Flow::Pause);
    let tokens = send_asks(&host);
    let full = Answer::Ok(br#"{"version":1,"leases":[{"granted":0,"current":4,"previous":0}]}"#.to_vec());
    let (_, step) = answer_ask(&host, tokens[0], full, &request);
    assert_eq!(status(&step), 429, "the fleet's counts are at the limit");
    assert_eq!(host.metric("floodgate.rate_limit.r.rejected"), 1, "counted once, not once per decision");
    assert_eq!(host.metric("floodgate.rate_limit.r.allowed"), 0);
    // The answer gave the key's totals: the next batch does not read it.
    assert!(host.filter.fleet.global_node.as_ref().unwrap().borrow().deltas.is_empty());
    // The key is learned now: its next request is refused at once, without asking.
    let (_, _, again) = host.send(&request);
    assert_eq!(status(&again), 429);
    assert!(send_asks(&host).is_empty(), "a learned key at its limit does not ask");
}

// ---- batched global scope: the root's tick and its batch's answer ----

/// The `counters` of a store's answer to a batch: each counter's fleet-wide totals.
fn totals(counters: &[(u64, u64)]) -> Answer {
    let counters: Vec<String> = counters.iter().map(|(previous, current)| format!(r#"{{"previous":{previous},"current":{current}}}"#)).collect();
    Answer::Ok(format!(r#"{{"version":1,"counters":[{}]}}"#, counters.join(",")).into_bytes())
}

#[test]
fn the_flusher_s_tick_hands_the_host_its_batch_and_the_answer_fills_the_view() {
    let host = Host::new(batched(100));
    for _ in 0..3 {
        assert_eq!(status(&host.send(&keyed("k")).2), 0);
    }
    let batch = host.filter.sync(&host.env()).expect("the only VM leads: its admissions go out");
    assert_eq!(batch.counters, 1, "one key, one bucket: one counter");
    assert!(String::from_utf8(batch.body.clone()).unwrap().contains(r#""delta":3"#), "{:?}", String::from_utf8(batch.body));
    assert_eq!((host.metric("floodgate.global.batches"), host.metric("floodgate.global.counters")), (0, 0), "not sent yet");
    host.filter.batch_sent(&host.env(), &batch, 9);
    assert_eq!((host.metric("floodgate.global.batches"), host.metric("floodgate.global.counters")), (1, 1));
    assert!(host.filter.owns_batch(9) && !host.filter.owns_batch(10), "the batch's call is 9 alone");
    host.clock.advance(20);
    host.filter.batch_answered(&host.env(), 9, totals(&[(0, 12)]), Some(b"4"));
    assert_eq!((host.metric("floodgate.global.confirmed"), host.metric("floodgate.global.failures")), (1, 0));
    assert!(!host.filter.owns_batch(9), "answered");
    assert_eq!(host.filter.fleet.global_node.as_ref().unwrap().borrow().proxies, 4, "the fleet size the answer gave");
    host.clock.advance(1_000);
    let next = host.filter.sync(&host.env());
    assert_eq!(next.map(|b| b.counters), Some(0), "nothing new: a batch that only calls in, once a second");
    assert_eq!(host.metric("floodgate.global.staleness_ms"), 1_000, "the last batch was confirmed a second ago");
    assert_eq!(host.metric("floodgate.global.view_keys"), 1);
    assert_eq!(host.metric("floodgate.global.proxies"), 4);
}

#[test]
fn a_batch_the_host_does_not_post_or_that_fails_goes_out_again_unchanged() {
    let host = Host::new(batched(100));
    host.send(&keyed("k"));
    let batch = host.filter.sync(&host.env()).unwrap();
    host.filter.batch_not_sent(&host.env());
    assert_eq!(host.metric("floodgate.global.failures"), 1);
    assert!(!host.filter.owns_batch(0));
    // Another request meanwhile waits for the next batch: this one is the same again.
    host.send(&keyed("k"));
    let again = host.filter.sync(&host.env()).unwrap();
    assert_eq!(again, batch, "sent again as it was (the store applies a batch once)");
    host.filter.batch_sent(&host.env(), &again, 3);
    // Another call's answer is not the batch's; a failed one leaves the batch for the next tick,
    // and a fleet-size header that does not read leaves the size known.
    host.filter.batch_answered(&host.env(), 4, totals(&[(0, 1)]), Some(b"9"));
    assert_eq!(host.metric("floodgate.global.confirmed") + host.metric("floodgate.global.failures"), 1, "not its call");
    host.filter.batch_answered(&host.env(), 3, Answer::Failed(Some(503)), Some(b"nine"));
    assert_eq!(host.metric("floodgate.global.failures"), 2);
    assert_eq!(host.filter.fleet.global_node.as_ref().unwrap().borrow().proxies, 0);
    assert_eq!(host.filter.sync(&host.env()).unwrap(), batch, "still the same batch");
    // An answer that does not read is a failure too.
    host.filter.batch_sent(&host.env(), &batch, 5);
    host.filter.batch_answered(&host.env(), 5, Answer::Ok(b"{".to_vec()), None);
    assert_eq!(host.metric("floodgate.global.failures"), 3);
    // Confirmed at last: the next batch carries the request that waited.
    host.filter.batch_sent(&host.env(), &batch, 6);
    host.filter.batch_answered(&host.env(), 6, totals(&[(0, 1)]), None);
    assert_eq!(host.metric("floodgate.global.confirmed"), 1);
    let next = host.filter.sync(&host.env()).unwrap();
    assert_ne!(next, batch);
    assert!(String::from_utf8(next.body).unwrap().contains(r#""delta":1"#));
}

#[test]
fn admissions_whose_bucket_ended_before_the_tick_are_counted_as_dropped() {
    let host = Host::new(batched(100));
    host.send(&keyed("k"));
    host.send(&keyed("k"));
    // Two buckets later: the store no longer weighs them.
    host.clock.advance(2 * 3_600_000);
    let batch = host.filter.sync(&host.env());
    assert_eq!(batch.map(|b| b.counters), Some(0));
    assert_eq!(host.metric("floodgate.global.dropped"), 2);
}

// ---- the root's schedule ----

#[test]
fn each_periodic_task_is_due_at_its_own_interval_whatever_the_tick() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 10, "window": "1h",
                         "scope": "global", "consistency": "batched"}],
        "load_shedding": {"max_loop_lag": "50ms", "lag_probe_interval": "100ms"},
        "global": {"cluster": "floodgate-sync", "sync_interval": "250ms"},
    }));
    let mut schedule = Schedule::default();
    let due = |schedule: &mut Schedule, at: u64| schedule.due(&host.filter, both_at(at));
    let all = Due { lag_probe: true, sync: true, heartbeat: true };
    assert_eq!(due(&mut schedule, 10_000), all, "everything at the first tick");
    // Ticks every 50 ms (the fastest period would be the lag probe's; a timer may be early).
    let mut seen = (0, 0, 0);
    for at in (10_050..=12_000).step_by(50) {
        let d = due(&mut schedule, at);
        seen.0 += u32::from(d.lag_probe);
        seen.1 += u32::from(d.sync);
        seen.2 += u32::from(d.heartbeat);
    }
    // 2 s after the first tick: a probe every 100 ms, a sync in each slot of 250 ms of the wall
    // clock, a heartbeat every second. The lag probe drives the tick: no period to set.
    assert_eq!(seen, (20, 8, 2));
    assert_eq!(Schedule::tick_period(&host.filter, UnixMillis(10_010)), None);
    // A tick 4 ms early still counts; 6 ms early does not.
    let mut schedule = Schedule::default();
    due(&mut schedule, 0);
    assert!(due(&mut schedule, 96).lag_probe);
    assert!(!due(&mut schedule, 190).lag_probe);
    // A clock that went back makes everything due rather than never.
    let mut schedule = Schedule::default();
    due(&mut schedule, 10_000);
    assert_eq!(due(&mut schedule, 5_000), all);
}

#[test]
fn without_lag_probe_or_global_scope_only_the_heartbeat_is_due() {
    let host = Host::new(serde_json::json!({"rate_limits": [rule(5)]}));
    let mut schedule = Schedule::default();
    let first = schedule.due(&host.filter, both_at(1_000));
    assert_eq!(first, Due { lag_probe: false, sync: false, heartbeat: true });
    assert_eq!(schedule.due(&host.filter, both_at(1_500)), Due::default());
    assert!(schedule.due(&host.filter, both_at(2_000)).heartbeat);
    assert_eq!(Schedule::tick_period(&host.filter, UnixMillis(1_010)), None);
}

/// When the sync drives the tick, each tick sets the next on the start of the wall clock's next
/// slot: proxies that started at any phase tick, and send their batches, at the same moments
/// after their first tick, one sync per slot even with a timer that fires late or jitters.
#[test]
fn the_sync_s_ticks_line_up_on_the_wall_clock_s_slots() {
    let host = Host::new(serde_json::json!({
        "rate_limits": [{"name": "r", "key": [{"header": "x-key"}], "limit": 10, "window": "1h",
                         "scope": "global", "consistency": "batched"}],
        "global": {"cluster": "floodgate-sync", "sync_interval": "100ms"},
    }));
    assert_eq!(host.filter.tick_ms(), Some(100));
    for start in [1_000_000u64, 1_000_037, 1_000_099] {
        let mut schedule = Schedule::default();
        let (mut wall, mut mono) = (start, 5_000u64);
        let mut syncs = Vec::new();
        for n in 0..50u64 {
            if schedule.due(&host.filter, Now { wall: UnixMillis(wall), mono: MonoMillis(mono) }).sync {
                syncs.push(wall);
            }
            let period = Schedule::tick_period(&host.filter, UnixMillis(wall)).unwrap();
            assert!((1..=100).contains(&period), "{period}");
            // The timer fires 0 to 4 ms late.
            let late = n * 7 % 5;
            wall += period + late;
            mono += period + late;
        }
        // Every tick after the first falls within 4 ms of a slot's start, and syncs.
        assert_eq!(syncs.len(), 50, "{start}");
        assert!(syncs[1..].iter().all(|at| at % 100 <= 4), "{syncs:?}");
        assert_eq!(syncs[1] / 100, start / 100 + 1);
    }
    // On a slot's start, a whole interval; just before it, a millisecond.
    assert_eq!(Schedule::tick_period(&host.filter, UnixMillis(2_000)), Some(100));
    assert_eq!(Schedule::tick_period(&host.filter, UnixMillis(2_099)), Some(1));
}
