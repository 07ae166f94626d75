//! Fuzz entry points of floodgate: arbitrary bytes in, every invariant checked, never a panic.
//!
//! One file serves two builds: the cargo-fuzz targets (`fuzz/fuzz_targets/<name>.rs`, one line
//! each, built with libFuzzer and sanitizers by `fuzz/run.sh`) and the native replay test
//! `filter/tests/fuzz_regressions.rs`, which includes this file with `#[path]` and feeds every
//! committed input (`fuzz/seeds/<name>/`, `fuzz/regressions/<name>/`) through [`TARGETS`] under
//! plain `cargo test -p floodgate`. It only uses `floodgate`'s public API and `std`.
//!
//! Each entry point documents the byte layout it reads. Inputs too short for their parameters are
//! padded with zeros, so every input is meaningful and the fuzzer never wastes executions.
//!
//! To add a target (e.g. the cluster-selection record): write `pub fn name(data: &[u8])` here,
//! list it in [`TARGETS`], add `fuzz/fuzz_targets/name.rs` (one `fuzz_target!` line) and its
//! `[[bin]]` in `fuzz/Cargo.toml`, and put a few seed inputs in `fuzz/seeds/name/`.
#![allow(
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing,
    clippy::missing_panics_doc,
    clippy::unwrap_used,
    clippy::expect_used
)]

use floodgate::config::{Config, KeyPart, MissingKey};
use floodgate::keys::fleet::{FleetHasher, FleetKeys};
use floodgate::keys::{self, KeyHasher, Source};
use floodgate::ratelimit::table::{self, fingerprint, Set, RECORD_LEN, RECORD_LEN_TWO_DOORS, RECORD_VERSION, RECORD_VERSION_TWO_DOORS, SHAPE_OFFSET};
use floodgate::ratelimit::probes;
use floodgate::ratelimit::window::Window;
use floodgate::ratelimit::reserve::Reserves;
use floodgate::ratelimit::{Limiter, Probe, Verdict};
use floodgate::replies::{self, Reply};
use floodgate::primitives::inflight::LocalCount;
use floodgate::primitives::inflight::{self, InFlight, MAX_VMS, STALE_AFTER_MS};
use floodgate::primitives::record::DecodeError;
use floodgate::shedding::Shedder;
use floodgate::primitives::store::{Cas, SharedStore, StoreError, Stored, TOKEN_KEY};
use floodgate::primitives::time::{MonoMillis, UnixMillis};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroU64};
use std::rc::Rc;
use std::sync::OnceLock;

/// A fuzz entry point: arbitrary bytes in, a panic on any broken invariant.
pub type Entry = fn(&[u8]);

/// Every fuzz target: its name (the cargo-fuzz target and the folder of its inputs) and its
/// entry point.
pub const TARGETS: &[(&str, Entry)] = &[
    ("config", config),
    ("key", key),
    ("ratelimit_record", ratelimit_record),
    ("inflight_record", inflight_record),
    ("cluster_record", cluster_record),
    ("watchdog_record", watchdog_record),
    ("usage_body", usage_body),
];

// -------------------------------------------------------------------------------------------
// Reading parameters out of the fuzzer's bytes
// -------------------------------------------------------------------------------------------

/// A cursor over the input; reads past the end give zeros.
struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    fn u8(&mut self) -> u8 {
        let (first, rest) = self.data.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
        self.data = rest;
        first
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// `n` bytes (fewer if the input ends).
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (taken, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        taken
    }

    fn rest(self) -> &'a [u8] {
        self.data
    }
}

/// Checks a reply the filter would send: a status it can send, header values that cannot split
/// a header (no CR, LF or NUL), and a JSON body.
/// The gRPC form of a refusal: a status other than OK, one line, a pushback of the wait.
fn check_grpc_reply(reply: &Reply, config: &Config) {
    let grpc = floodgate::replies::grpc::reply(reply, &config.grpc).expect("a refusal has a gRPC form");
    assert_ne!(grpc.status, floodgate::config::GrpcStatus::OK);
    assert!(!grpc.message.contains(['\r', '\n']), "{:?}", grpc.message);
    let pushback: u64 = grpc.metadata.first().expect("pushback first").1.parse().expect("pushback is an integer");
    assert!(pushback >= 1, "pushback {pushback}");
    for (name, value) in &grpc.metadata {
        assert!(!value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0), "metadata {name}: {value:?}");
    }
}

fn check_reply(reply: &Reply) {
    assert!(matches!(reply.status, 200 | 429 | 503), "status {}", reply.status);
    for (name, value) in &reply.headers {
        assert!(
            !value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0),
            "header {name}: {value:?} would break the response"
        );
    }
    let body: serde_json::Value =
        serde_json::from_str(&reply.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", reply.body));
    assert!(body.is_object(), "{body}");
    if let Some(retry) = reply.headers.iter().find(|(n, _)| *n == "retry-after") {
        let secs: u64 = retry.1.parse().expect("retry-after is an integer");
        assert!(secs >= 1, "retry-after {secs}");
    }
}

// -------------------------------------------------------------------------------------------
// A shared-data store that holds whatever the fuzzer planted
// -------------------------------------------------------------------------------------------

/// Envoy's shared data as `MemoryStore` models it (one global CAS counter, tokens ignored for
/// absent keys), except that **every key already exists** and holds the planted bytes, with a
/// token (or none, as a host that gave no token). Optionally fails chosen operations: bit `i`
/// of `faults` makes the `i`-th operation fail (a CAS mismatch on even ones, a host error on
/// odd ones).
struct PlantedStore {
    planted: Vec<u8>,
    planted_cas: bool,
    entries: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    faults: u64,
    op: Cell<u32>,
    /// Keys written, other than the CAS scratch key.
    writes: RefCell<Vec<String>>,
}

impl PlantedStore {
    fn new(planted: &[u8], planted_cas: bool, faults: u64) -> PlantedStore {
        PlantedStore {
            planted: planted.to_vec(),
            planted_cas,
            entries: RefCell::new(HashMap::new()),
            next_cas: Cell::new(0),
            faults,
            op: Cell::new(0),
            writes: RefCell::new(Vec::new()),
        }
    }

    fn issue(&self) -> u32 {
        let next = match self.next_cas.get().wrapping_add(1) {
            0 => 1,
            n => n,
        };
        self.next_cas.set(next);
        next
    }

    fn fault(&self) -> Option<StoreError> {
        let op = self.op.get();
        self.op.set(op.saturating_add(1));
        let fails = op < 64 && self.faults & (1u64 << op) != 0;
        fails.then_some(if op % 2 == 0 { StoreError::CasMismatch } else { StoreError::Host(1) })
    }

    fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.entries.borrow().get(key).map(|(v, _)| v.clone())
    }
}

impl SharedStore for PlantedStore {
    fn get(&self, key: &str) -> Result<Option<Stored>, StoreError> {
        if let Some(err) = self.fault() {
            return Err(err);
        }
        let mut entries = self.entries.borrow_mut();
        if !entries.contains_key(key) {
            let cas = if self.planted_cas { self.issue() } else { 0 };
            entries.insert(key.to_owned(), (self.planted.clone(), cas));
        }
        Ok(entries.get(key).map(|(value, cas)| Stored {
            value: value.clone(),
            cas: NonZeroU32::new(*cas).map(Cas),
        }))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        if let Some(err) = self.fault() {
            return Err(err);
        }
        let mut entries = self.entries.borrow_mut();
        if let (Some((_, stored)), Some(Cas(expected))) = (entries.get(key), cas) {
            if *stored != expected.get() {
                return Err(StoreError::CasMismatch);
            }
        }
        let issued = self.issue();
        entries.insert(key.to_owned(), (value.to_vec(), issued));
        if key != TOKEN_KEY {
            self.writes.borrow_mut().push(key.to_owned());
        }
        Ok(())
    }
}

// -------------------------------------------------------------------------------------------
// config: the configuration parser
// -------------------------------------------------------------------------------------------

/// The whole input is a configuration (what Envoy hands `on_configure`).
///
/// Checks: parsing never panics and is deterministic; a refusal is one non-empty log line; an
/// accepted configuration builds its limiter and shedder, whose derived figures are in range,
/// and its first request (empty shared data) is admitted by every rule and answered with
/// well-formed fields and bodies.
pub fn config(data: &[u8]) {
    let parsed = Config::parse(data);
    assert_eq!(parsed, Config::parse(data), "parsing is deterministic");
    match parsed {
        Err(err) => {
            let line = err.to_string();
            assert!(!line.is_empty(), "an error says what is wrong");
            assert!(
                !line.contains(['\n', '\r']),
                "a configuration error is one log line: {line:?}"
            );
        }
        Ok(config) => accepted_config(&config),
    }
}

fn accepted_config(config: &Config) {
    let summary = config.summary();
    assert!(!summary.contains(['\n', '\r']), "the configure-time summary is one line: {summary:?}");

    let limiter = Limiter::new(config, "fuzz");
    assert_eq!(limiter.tables().len(), config.rate_limits.len());
    // The rules' conditions, limits and costs compile, and answer for a request with every
    // attribute a rule can read, and for one with none.
    let rules = floodgate::ratelimit::rules::Rules::new(config, &KeyHasher::new([0x5a; 16]));
    struct Everything;
    impl floodgate::ratelimit::rules::Attributes for Everything {
        fn get(&self, name: &str) -> Option<std::borrow::Cow<'_, [u8]>> {
            Some(std::borrow::Cow::Owned(match name {
                ":path" => b"/users/1/orders?x=1".to_vec(),
                ":method" => b"POST".to_vec(),
                ":authority" => b"api.example.com:443".to_vec(),
                _ => b"4096".to_vec(),
            }))
        }
    }
    struct Nothing;
    impl floodgate::ratelimit::rules::Attributes for Nothing {
        fn get(&self, _: &str) -> Option<std::borrow::Cow<'_, [u8]>> {
            None
        }
    }
    for rule in 0..config.rate_limits.len() {
        for request in [&Everything as &dyn floodgate::ratelimit::rules::Attributes, &Nothing] {
            let _ = rules.applies(rule, request);
            let _ = rules.limit(rule, 42, request);
            let _ = rules.admission(rule, request, None);
            if let Some(mut estimates) = rules.body_estimates(request) {
                let _ = estimates.feed(b"{\"max_tokens\":12}", true, |r| rules.estimate_places(r));
                let _ = rules.admission(rule, request, Some(&estimates));
            }
        }
        let limit = std::num::NonZeroU32::MIN;
        let _ = rules.settled_units(rule, floodgate::ratelimit::rules::Report::Missing, 7, limit);
        if let Some(Ok(mut scan)) = rules.body_scan(rule, Some(b"text/event-stream"), false) {
            let _ = scan.feed(b"data: {\"usage\":{\"total_tokens\":3}}\n\n", rules.body_usage(rule));
            let _ = scan.end(rules.body_usage(rule));
        }
        if let Some(scan) = rules.body_scan(rule, None, true) {
            assert!(scan.is_err(), "a compressed body is never read");
        }
    }
    for (table, rule) in limiter.tables().iter().zip(&config.rate_limits) {
        let capacity = u64::from(rule.capacity.get().get());
        assert!(table.set_count() >= 1 && table.set_count() <= capacity.div_ceil(table::WAYS as u64));
        assert!(!rule.key.is_empty());
        assert_eq!(table.limit, rule.limit.get());
        assert_eq!(table.window.length_ms(), rule.window.get().get());
    }

    if let Some(shedding) = &config.load_shedding {
        let classes = floodgate::shedding::Classes::new(shedding);
        assert_eq!(classes.class_of(None), classes.default_class);
        assert_eq!(classes.name(classes.default_class), shedding.default_class.as_str());
        let lag = floodgate::shedding::lag::LagMonitor::new(shedding);
        assert_eq!(lag.is_some(), shedding.max_loop_lag.is_some());
        if let Some(lag) = lag {
            for class in 0..shedding.classes.len() {
                let threshold = lag.threshold_ms(class).expect("a threshold per class");
                assert!(threshold >= 1 && threshold <= lag.max_loop_lag_ms(), "lag threshold {threshold}");
            }
        }
        if let Some(shedder) = Shedder::new(shedding, "fuzz") {
        let max = shedder.max_active_requests;
        assert_eq!(Some(max), shedding.max_active_requests.map(|m| m.get().get()));
        assert_eq!(shedder.classes.len(), shedding.classes.len());
        for class in &shedder.classes {
            assert!(class.threshold >= 1 && class.threshold <= max, "threshold {} of {max}", class.threshold);
        }
        let default = shedder.classes.get(shedder.default_class).expect("the default class exists");
        assert_eq!(default.name, shedding.default_class);
        assert_eq!(shedder.class_of(None), shedder.default_class);
        for (index, class) in shedder.classes.iter().enumerate() {
            assert_eq!(shedder.class_of(Some(class.name.as_str().as_bytes())), index);
        }
        assert!(shedder.retry_after_secs >= 1);
        let idle = health_of(&shedder, 0);
        assert_eq!(idle.status, 200, "an idle proxy is healthy");
        check_reply(&idle);
        let full = health_of(&shedder, max);
        assert_eq!(full.status, 503, "a full proxy is overloaded");
        check_reply(&full);
        let shed = replies::shed(&shedder, &floodgate::shedding::Shed { in_flight: max, class: shedder.default_class, contention: false });
        check_reply(&shed);
        check_grpc_reply(&shed, config);
        } else {
            assert!(shedding.max_active_requests.is_none(), "an in-flight limit makes a shedder");
        }
    } else {
        check_reply(&replies::health(&replies::LocalLoad::default(), None));
    }
    if let Some(health) = &config.health {
        assert!(health.path.starts_with('/') && !health.path.contains(['?', '#']));
    }

    // The first request, every attribute present, on empty shared data: admitted by every rule.
    let store = floodgate::primitives::store::MemoryStore::new();
    let hasher = KeyHasher::new([0x5a; 16]);
    let mut skipped = Vec::new();
    let probes = probes::probes(config, &hasher, |_| Some(b"10.0.0.1:1234".to_vec()), &mut skipped);
    assert!(skipped.is_empty(), "every part is present");
    assert_eq!(probes.len(), config.rate_limits.len());
    let now = UnixMillis(1_700_000_000_123);
    match limiter.check(&store, &mut Reserves::new(), &probes, &[], now) {
        Verdict::Admitted { standings, evictions } => {
            assert_eq!(standings.len(), probes.len());
            assert!(evictions.is_empty());
            if let Some((policy, fields)) = replies::admitted_fields(&limiter, &standings) {
                assert!(!policy.contains(['\r', '\n']) && !fields.contains(['\r', '\n']));
            }
        }
        rejected @ Verdict::Refused { .. } => panic!("a first request is admitted: {rejected:?}"),
    }
}

// -------------------------------------------------------------------------------------------
// key: key extraction from arbitrary request bytes
// -------------------------------------------------------------------------------------------

/// Rules covering every key part, both missing-key modes, and two parts that read the same
/// attribute differently (`path` drops the query, `{"header": ":path"}` keeps it). Limit 1, so
/// a second request of the same key is refused.
const KEY_CONFIG: &str = r#"{
  "rate_limits": [
    {"name": "api-key", "key": [{"header": "x-api-key"}], "limit": 1, "window": "1h"},
    {"name": "ip-path", "key": ["source_ip", "path"], "limit": 1, "window": "1m", "missing_key": "shared"},
    {"name": "all", "key": ["method", "authority", {"header": "X-Api-Key"}, "source_ip"], "limit": 1, "window": "10s", "capacity": 4},
    {"name": "raw-path", "key": [{"header": ":path"}], "limit": 1, "window": "250ms", "capacity": 1},
    {"name": "path", "key": ["path"], "limit": 1, "window": "1s", "missing_key": "shared"}
  ],
  "load_shedding": {"max_active_requests": 10}
}"#;

/// The attributes [`key`] reads, in input order.
const KEY_SOURCES: [Source<'static>; 6] = [
    Source::Header("x-api-key"),
    Source::Header(":path"),
    Source::Header(":method"),
    Source::Header(":authority"),
    Source::SourceAddress,
    Source::Header("x-floodgate-priority"),
];

/// Layout: a presence mask (bit `i` = attribute `i` of [`KEY_SOURCES`] is present), then for
/// each present attribute a length byte and that many bytes of value (arbitrary, not UTF-8).
///
/// Checks: each attribute is fetched at most once; every rule is either probed or skipped,
/// never both, and skipped only when it skips missing keys and lacks a part; a rule's hash is
/// the hash of its normalised parts (address without port, path without query); the same
/// request hashes the same; the first request is admitted, the second refused by every rule
/// with a well-formed `429`; the priority value always names a valid class.
pub fn key(data: &[u8]) {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    let config = CONFIG.get_or_init(|| Config::parse(KEY_CONFIG.as_bytes()).expect("the key fuzz config is valid"));
    let mut input = Input { data };
    let mask = input.u8();
    let mut values: [Option<Vec<u8>>; KEY_SOURCES.len()] = Default::default();
    for (bit, value) in values.iter_mut().enumerate() {
        if mask & (1 << bit) != 0 {
            let len = usize::from(input.u8());
            *value = Some(input.bytes(len).to_vec());
        }
    }
    let value_of = |source: Source<'_>| -> Option<Vec<u8>> {
        let index = KEY_SOURCES.iter().position(|s| *s == source)?;
        values[index].clone()
    };

    for raw in values.iter().flatten() {
        let ip = keys::strip_port(raw);
        assert!(raw.windows(ip.len().max(1)).any(|w| w == ip) || ip.is_empty(), "a port strip is a substring");
        let path = KeyPart::Path.normalize(raw);
        assert!(raw.starts_with(path) && !path.contains(&b'?'), "a path loses its query only");
    }

    let hasher = KeyHasher::new([0x42; 16]);
    let mut asked = Vec::new();
    let mut skipped = Vec::new();
    let fleet = FleetHasher::new(Some("fuzzing-fleet-secret"));
    let mut fleet_keys = FleetKeys::default();
    let probes = probes::probes_where(
        config,
        &hasher,
        |source| {
            asked.push(format!("{source:?}"));
            value_of(source)
        },
        &mut skipped,
        |_| true,
        |index, rule, parts| fleet_keys.keep(&fleet, index, rule, parts),
    );
    let mut distinct = asked.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), asked.len(), "an attribute is fetched once: {asked:?}");

    let mut seen = vec![false; config.rate_limits.len()];
    for rule in probes.iter().map(|p| p.rule).chain(skipped.iter().copied()) {
        assert!(!seen[rule], "rule {rule} probed or skipped twice");
        seen[rule] = true;
    }
    assert!(seen.iter().all(|s| *s), "every rule is probed or skipped");
    assert!(probes.windows(2).all(|w| w[0].rule < w[1].rule), "probes in rule order");
    for (index, rule) in config.rate_limits.iter().enumerate() {
        let parts: Vec<Option<&[u8]>> = rule
            .key
            .iter()
            .map(|part| {
                let index = KEY_SOURCES.iter().position(|s| *s == part.source())?;
                values[index].as_deref().map(|raw| part.normalize(raw))
            })
            .collect();
        let complete = parts.iter().all(Option::is_some);
        let skips = rule.missing_key == MissingKey::Skip && !complete;
        assert_eq!(skipped.contains(&index), skips, "rule {}", rule.name);
        if let Some(probe) = probes.iter().find(|p| p.rule == index) {
            // A key lacking any part (missing_key "shared") is one counter per rule: every part
            // hashed as missing, whatever the present ones hold.
            let expected = if complete {
                hasher.hash(parts.iter().copied())
            } else {
                hasher.hash(parts.iter().map(|_| None))
            };
            assert_eq!(probe.key_hash, expected, "rule {}", rule.name);
        }
    }
    let (mut again, mut keys_again) = (Vec::new(), FleetKeys::default());
    let probed_again = probes::probes_where(config, &hasher, value_of, &mut again, |_| true, |index, rule, parts| keys_again.keep(&fleet, index, rule, parts));
    assert_eq!(probed_again, probes, "deterministic");
    assert_eq!(keys_again, fleet_keys, "deterministic fleet-wide ids");

    let classes = floodgate::shedding::Classes::new(config.load_shedding.as_ref().expect("shedding"));
    let priority = values[5].as_deref();
    assert!(classes.class_of(priority) < classes.names.len());

    let limiter = Limiter::new(config, "fuzz");
    let store = floodgate::primitives::store::MemoryStore::new();
    let now = UnixMillis(1_700_000_000_500);
    match limiter.check(&store, &mut Reserves::new(), &probes, &[], now) {
        Verdict::Admitted { standings, .. } => assert_eq!(standings.len(), probes.len()),
        rejected @ Verdict::Refused { .. } => panic!("first request refused: {rejected:?}"),
    }
    let second = limiter.check(&store, &mut Reserves::new(), &probes, &[], now);
    match &second {
        Verdict::Refused { violations } => {
            assert_eq!(violations.len(), probes.len(), "limit 1: every rule refuses the second");
            let reply = replies::rate_limited(&limiter, &second, now).expect("a 429");
            assert_eq!(reply.status, 429);
            check_reply(&reply);
        }
        Verdict::Admitted { .. } => assert!(probes.is_empty(), "limit 1 admits one request per key"),
    }
}

// -------------------------------------------------------------------------------------------
// ratelimit_record: a rate-limit set as read from shared data
// -------------------------------------------------------------------------------------------

const WINDOWS_MS: [u64; 6] = [1, 250, 1000, 60_000, 3_600_000, floodgate::config::MAX_DURATION_MS];
const LIMITS: [u32; 6] = [1, 2, 5, 100, 65_536, u32::MAX];

/// Layout: `now` (u64 LE, ms since the epoch), the key hash (u64), a window selector, a limit
/// selector, a flags byte (bit 0: the host gives no CAS token; bit 1: inject store faults; bit
/// 2: stamp the record with the rule's shape, so that a well-formed one is trusted), a fault mask
/// (u64), then the record bytes (a valid record is [`RECORD_LEN`] bytes).
///
/// Checks: decoding never panics and refuses exactly what is truncated, padded or of another
/// version; what it accepts re-encodes to the same bytes (a record of the previous layout, to a
/// record of this one that decodes to the same set); the set's operations keep their
/// guarantees on any decoded values; through the limiter (the record planted under every key of
/// a one-set rule), a record that does not decode is never trusted: it cannot refuse a request,
/// and the write that admits it replaces it with a valid one; a refusal writes nothing; the
/// replies are well-formed. With faults injected, only the absence of panics is required.
pub fn ratelimit_record(data: &[u8]) {
    let mut input = Input { data };
    let now = UnixMillis(input.u64());
    let key_hash = input.u64();
    let window_ms = WINDOWS_MS[usize::from(input.u8()) % WINDOWS_MS.len()];
    let limit = LIMITS[usize::from(input.u8()) % LIMITS.len()];
    let flags = input.u8();
    let faults = input.u64();
    let mut record = input.rest().to_vec();
    let window = Window::new(NonZeroU64::new(window_ms).expect("non-zero"));
    let phase = window.phase(now);
    let config = Config::parse(
        format!(
            r#"{{"rate_limits": [{{"name": "r", "key": ["path"], "limit": {limit}, "window": "{window_ms}ms", "capacity": 4}}]}}"#
        )
        .as_bytes(),
    )
    .expect("the record fuzz config is valid");
    let limiter = Limiter::new(&config, "fuzz");
    let shape = limiter.tables()[0].shape();
    if flags & 4 != 0 {
        if let Some(stamp) = record.get_mut(SHAPE_OFFSET..SHAPE_OFFSET + 8) {
            stamp.copy_from_slice(&shape.to_le_bytes());
        }
    }
    let record = record.as_slice();

    // 1. The decoder alone.
    let decoded = Set::decode(record);
    match &decoded {
        Ok(set) => {
            let encoded = set.encode();
            if record[0] == RECORD_VERSION {
                assert_eq!(record.len(), RECORD_LEN);
                let mut expected = record.to_vec();
                expected[2] = 0;
                expected[3] = 0;
                assert_eq!(&encoded[..], &expected[..], "a decoded record re-encodes to its bytes");
            } else {
                assert_eq!((record[0], record.len()), (RECORD_VERSION_TWO_DOORS, RECORD_LEN_TWO_DOORS));
            }
            assert_eq!(Set::decode(&encoded).as_ref(), Ok(set));
            set_operations(set.clone(), fingerprint(key_hash), window, phase.bucket_index, phase.elapsed_ms);
        }
        Err(DecodeError::Length(len)) => {
            assert_eq!(*len, record.len());
            assert!(record.len() != RECORD_LEN && record.len() != RECORD_LEN_TWO_DOORS);
        }
        Err(DecodeError::Version(version, ways)) => {
            assert!(record.len() == RECORD_LEN || record.len() == RECORD_LEN_TWO_DOORS);
            assert_eq!((*version, *ways), (record[0], record[1]));
            let known = if record.len() == RECORD_LEN { RECORD_VERSION } else { RECORD_VERSION_TWO_DOORS };
            assert!(record[0] != known || usize::from(record[1]) != table::WAYS);
        }
        Err(DecodeError::Duplicate(fingerprint)) => {
            assert!(record.len() == RECORD_LEN || record.len() == RECORD_LEN_TWO_DOORS);
            assert_ne!(*fingerprint, 0);
        }
        Err(DecodeError::Malformed) => panic!("a set is refused for its length, version or entries, never as malformed"),
    }
    // A record of another rule definition is not trusted either.
    let trusted = decoded.as_ref().is_ok_and(|set| set.shape == shape);

    // 2. Through the limiter, the record planted under the rule's only set.
    let with_faults = flags & 2 != 0;
    let store = PlantedStore::new(record, flags & 1 == 0, if with_faults { faults } else { 0 });
    let probes = [Probe::new(0, key_hash)];
    let mut reserves = Reserves::new();
    let verdict = limiter.check(&store, &mut reserves, &probes, &[], now);
    match &verdict {
        Verdict::Admitted { standings, .. } => {
            assert_eq!(standings.len(), 1);
            if let Some((policy, fields)) = replies::admitted_fields(&limiter, standings) {
                assert!(!policy.contains(['\r', '\n']) && !fields.contains(['\r', '\n']));
            }
            if !with_faults && store.planted_cas {
                let writes = store.writes.borrow();
                assert_eq!(writes.len(), 1, "one write admits: {writes:?}");
                let written = store.value(&writes[0]).expect("written");
                let set = Set::decode(&written).expect("what the limiter writes decodes");
                assert!(set.counts_of(fingerprint(key_hash)).current >= 1, "the request is counted");
                assert_eq!(set.shape, shape, "what the limiter writes carries the rule's shape");
                if !trusted {
                    assert_eq!(set.bucket_index, phase.bucket_index, "an untrusted record is replaced");
                    assert_eq!(set.counts_of(fingerprint(key_hash)).current, 1);
                }
            }
        }
        Verdict::Refused { violations } => {
            assert!(!violations.is_empty());
            let reply = replies::rate_limited(&limiter, &verdict, now).expect("a 429");
            check_reply(&reply);
            if let Some(at) = verdict.retry_at() {
                assert!(at >= now, "retry_at {at:?} before now {now:?}");
            }
            if !with_faults && store.planted_cas {
                assert!(trusted, "an untrusted record refused a request: {violations:?}");
                assert!(store.writes.borrow().is_empty(), "a refusal writes nothing");
            }
        }
    }
    // The reserve paths over the same record: later requests, heartbeats, a drain.
    for step in 0..6u64 {
        let later = UnixMillis(now.0.saturating_add(step.saturating_mul(700)));
        let _ = limiter.check(&store, &mut reserves, &probes, &[], later);
        if step % 2 == 1 {
            limiter.heartbeat(&store, &mut reserves, later);
        }
    }
    limiter.drain(&store, &mut reserves);
}

/// The set's operations on arbitrary (decoded) values.
fn set_operations(set: Set, fp: u64, window: Window, now_bucket: u64, elapsed_ms: u64) {
    let rolled = set.clone().rolled_to(now_bucket);
    assert_eq!(rolled.bucket_index, set.bucket_index.max(now_bucket));
    for bucket in [now_bucket.saturating_add(1), u64::MAX, 0] {
        let _ = rolled.clone().rolled_to(bucket);
    }
    let before = rolled.counts_of(fp);
    let _ = window.scaled_estimate(before, elapsed_ms);
    let _ = window.estimate(before, elapsed_ms);
    for limit in [1, 7, u32::MAX] {
        let limit = NonZeroU32::new(limit).expect("non-zero");
        let admits = window.admits(before, elapsed_ms, 1, limit);
        let _ = window.remaining(before, elapsed_ms, limit);
        let at = window.earliest_admission(before, UnixMillis(now_bucket.saturating_mul(window.length_ms())), 1, limit);
        if admits {
            assert!(at.is_some());
        }
    }
    let mut added = rolled.clone();
    let result = added.add(fp, 1, window, elapsed_ms);
    let after = added.counts_of(fp);
    // More than before, unless saturated.
    assert!(after.current > before.current || after.current == u32::MAX, "adding counts the cost");
    assert!(after.current >= 1);
    assert_eq!(result.resident, added.is_resident(fp));
    // Never looser: no key's counts go down when another is added (an evicted key's counts
    // go to the overflow), whatever the record held.
    // (Fingerprint 0 marks a free entry; no key has it.)
    for other in rolled.entries.iter().map(|e| e.fingerprint).chain([fp ^ 1, fp.rotate_left(7)]).filter(|f| *f != 0) {
        let (was, now) = (rolled.counts_of(other), added.counts_of(other));
        assert!(now.current >= was.current && now.previous >= was.previous, "{other:#x}: {was:?} then {now:?}");
    }
    if let Some(e) = result.evicted {
        assert_ne!(e.fingerprint, 0);
        assert!(!e.counts.is_zero());
        assert!(result.resident);
    }
    let resident = added.is_resident(fp);
    assert_eq!(added.add_to_entry(fp, 2), resident);
    added.subtract(fp, 1, added.bucket_index);
    let _ = Set::decode(&added.encode()).expect("an encoded set decodes");
}

// -------------------------------------------------------------------------------------------
// inflight_record: the load-shedding record as read from shared data
// -------------------------------------------------------------------------------------------

const MAX_ACTIVE: [u32; 5] = [1, 2, 10, 500, u32::MAX];

/// Layout: `now` (u64 LE), this VM's id (u64), a limit selector, a class selector, a flags byte
/// (bit 0: no CAS token; bit 1: inject store faults), a fault mask (u64), then the record bytes.
///
/// Checks: decoding never panics and refuses exactly what is malformed; what it accepts
/// re-encodes to the same bytes (up to [`MAX_VMS`] entries); the record's operations keep
/// their guarantees on any values; through the shedder (the record planted in shared data), a
/// record that does not decode is never trusted (the request is admitted); an admitted
/// request's lease leaves the record valid and its release leaves no count of this VM behind;
/// a refusal is a well-formed `503`. With faults, only the absence of panics and a local count
/// back at zero after the release are required.
pub fn inflight_record(data: &[u8]) {
    let mut input = Input { data };
    let now = MonoMillis(input.u64());
    let vm = input.u64();
    let max = MAX_ACTIVE[usize::from(input.u8()) % MAX_ACTIVE.len()];
    let class_pick = input.u8();
    let flags = input.u8();
    let faults = input.u64();
    let record = input.rest();

    // 1. The decoder alone.
    let decoded = InFlight::decode(record);
    match &decoded {
        Ok(inflight) => {
            assert!(record.len() >= 4 && record[0] == 1);
            assert_eq!(inflight.entries.len(), usize::from(record[1]));
            if inflight.entries.len() <= MAX_VMS {
                let mut expected = record.to_vec();
                expected[2] = 0;
                expected[3] = 0;
                assert_eq!(inflight.encode(), expected, "a decoded record re-encodes to its bytes");
            }
            let reencoded = InFlight::decode(&inflight.encode()).expect("an encoded record decodes");
            assert!(reencoded.entries.len() <= MAX_VMS);
            record_operations(inflight.clone(), vm, now);
        }
        Err(DecodeError::Malformed) => {
            let well_formed = record.len() >= 4
                && record[0] == 1
                && record.len() == 4 + 20 * usize::from(record[1]);
            assert!(!well_formed, "a well-formed record was refused");
        }
        Err(other) => panic!("an in-flight record is refused as malformed, not {other:?}"),
    }

    // 2. Through the shedder, the record planted in shared data.
    let config = Config::parse(format!(r#"{{"load_shedding": {{"max_active_requests": {max}}}}}"#).as_bytes())
        .expect("the shedding fuzz config is valid");
    let shedder = Shedder::new(config.load_shedding.as_ref().expect("shedding"), "fuzz").expect("an in-flight limit");
    let class = usize::from(class_pick) % shedder.classes.len();
    let with_faults = flags & 2 != 0;
    let store = PlantedStore::new(record, flags & 1 == 0, if with_faults { faults } else { 0 });
    let local: LocalCount = Rc::default();
    let seen = shedder.in_flight(&store, vm, &local, now);
    check_reply(&health_of(&shedder, seen));
    match shedder.try_acquire(&store, vm, &local, class, now) {
        Ok(lease) => {
            assert_eq!(local.in_use(), 1);
            if !with_faults && store.planted_cas {
                let key = store.writes.borrow().last().cloned().expect("an admission is published");
                let written = InFlight::decode(&store.value(&key).expect("written")).expect("a published record decodes");
                let own: Vec<_> = written.entries.iter().filter(|e| e.vm == vm).collect();
                assert_eq!(own.len(), 1, "one entry per VM");
                assert_eq!(
                    (own[0].in_flight, own[0].heartbeat),
                    (local.held(), now),
                    "the VM's units, its reserve included"
                );
                assert!((1..=1 + floodgate::primitives::inflight::RESERVE_MAX).contains(&own[0].in_flight));
                assert!(written.entries.len() <= MAX_VMS);
                assert!(written.total(now) >= 1);
            }
            shedder.release(&store, vm, lease, now);
            assert_eq!(local.in_use(), 0, "the release gives the unit back");
            shedder.heartbeat(&store, vm, &local, now);
            if !with_faults && store.planted_cas {
                let key = store.writes.borrow().last().cloned().expect("written");
                let written = InFlight::decode(&store.value(&key).expect("written")).expect("decodes");
                assert!(written.entries.iter().all(|e| e.vm != vm), "an idle VM leaves no entry after a heartbeat");
            }
        }
        Err(shed) => {
            assert_eq!(local.in_use(), 0, "a shed request holds nothing");
            assert_eq!(shed.class, class);
            let threshold = shedder.classes[class].threshold;
            if !with_faults && store.planted_cas {
                assert!(decoded.is_ok(), "a record that does not decode shed a request: {shed:?}");
                if !shed.contention {
                    assert!(shed.in_flight >= threshold, "shed below the threshold: {shed:?}");
                }
            }
            check_reply(&replies::shed(&shedder, &shed));
        }
    }
    let total = shedder.heartbeat(&store, vm, &local, now);
    check_reply(&health_of(&shedder, total));
    assert_eq!(local.in_use(), 0);
}

/// The record's operations on arbitrary (decoded) values.
fn record_operations(mut record: InFlight, vm: u64, now: MonoMillis) {
    let total = record.total(now);
    let others = record.others(vm, now);
    assert!(others <= total);
    let later = now.plus_ms(STALE_AFTER_MS);
    let _ = record.needs_heartbeat(vm, 0, now);
    let _ = inflight::admits(&record, vm, 0, 1, now);
    if record.publish(vm, 3, now) {
        assert_eq!(record.entries.iter().filter(|e| e.vm == vm).count(), 1);
        assert!(record.total(now) >= 3);
        assert!(!record.needs_heartbeat(vm, 3, now), "a fresh publish needs no heartbeat");
    }
    assert!(record.publish(vm, 0, later), "removing an entry always fits");
    assert!(record.entries.iter().all(|e| e.vm != vm && e.in_flight > 0));
}

// -------------------------------------------------------------------------------------------
// cluster_record: a cluster-selection record as read from shared data
// -------------------------------------------------------------------------------------------

/// Layout: `now` (u64 LE), this VM's id (u64), a bucket-count selector (1 to 8 buckets), a
/// flags byte (bit 0: no CAS token; bit 1: inject store faults), a fault mask (u64), the
/// upstream status (u16) and response flags (u64) the request ends with, a shuffle seed (u64),
/// then the record bytes.
///
/// Checks: decoding never panics and refuses what is malformed; what it accepts re-encodes to
/// the same bytes (up to [`MAX_VMS`] lease entries); its success rate is a rate and its weight
/// finite; through the selector (the record planted under the only cluster), a record that does
/// not decode is never trusted (a lease is granted on a fresh record), an admitted lease is
/// published and its end leaves no lease of this VM behind, whatever the outcome; a refusal is
/// a well-formed `503`. With faults, only the absence of panics and the local count back at
/// zero are required.
pub fn cluster_record(data: &[u8]) {
    use floodgate::selection::record::ClusterRecord;
    use floodgate::primitives::hash::SplitMix64;
    use floodgate::selection::{Selector, Timing, VmState};

    let mut input = Input { data };
    let now = MonoMillis(input.u64());
    let vm = input.u64();
    let buckets = usize::from(input.u8() % 8) + 1;
    let flags = input.u8();
    let faults = input.u64();
    let status = u16::from_le_bytes([input.u8(), input.u8()]);
    let response_flags = input.u64();
    let seed = input.u64();
    let record = input.rest();

    let config = Config::parse(
        format!(r#"{{"cluster_selection": {{"clusters": ["a"], "buckets": {buckets}, "bucket_width": "1s"}}}}"#).as_bytes(),
    )
    .expect("the selection fuzz config is valid");
    let selector = Selector::new(config.cluster_selection.as_ref().expect("selection"), "fuzz");

    // 1. The decoder alone.
    let decoded = ClusterRecord::decode(record, buckets);
    if let Ok(cluster) = &decoded {
        assert_eq!(cluster.buckets.recent.len(), buckets);
        for tally in cluster.buckets.recent.iter().chain([&cluster.buckets.sticky]) {
            assert!(tally.succeeded <= tally.finished, "{tally:?}");
        }
        if cluster.in_flight.entries.len() <= MAX_VMS {
            let mut expected = record.to_vec();
            expected[2] = 0;
            expected[3] = 0;
            let in_flight_at = record.len() - cluster.in_flight.encode().len();
            expected[in_flight_at + 2] = 0;
            expected[in_flight_at + 3] = 0;
            assert_eq!(cluster.encode(), expected, "a decoded record re-encodes to its bytes");
        }
        assert!(ClusterRecord::decode(&cluster.encode(), buckets).is_ok(), "an encoded record decodes");
        let rate = selector.success_rate(cluster);
        assert!((0.0..=1.0).contains(&rate), "success rate {rate}");
        let weight = selector.record_weight(cluster);
        assert!(weight.is_finite() && weight >= 0.0, "weight {weight}");
        let mut aged = cluster.clone();
        aged.buckets.advance_to(now.0 / 1000);
        aged.buckets.record(status < 500);
        let _ = aged.buckets.success_rate(3.0, 0.0001);
    }

    // 2. Through the selector, the record planted in shared data.
    let with_faults = flags & 2 != 0;
    let store = PlantedStore::new(record, flags & 1 == 0, if with_faults { faults } else { 0 });
    let locals: Vec<LocalCount> = vec![Rc::default()];
    let mut state = VmState::new(vm, locals.clone());
    let mut rng = SplitMix64::new(seed);
    match selector.choose(&store, &mut state, now, &mut rng) {
        Ok(lease) => {
            assert_eq!((lease.cluster, locals[0].in_use()), (0, 1));
            let key = selector.record_key(0).expect("a key").to_owned();
            if !with_faults && store.planted_cas {
                let written = ClusterRecord::decode(&store.value(&key).expect("written"), buckets)
                    .expect("a published record decodes");
                let own: Vec<_> = written.in_flight.entries.iter().filter(|e| e.vm == vm).collect();
                assert_eq!(own.len(), 1, "one entry per VM");
                assert_eq!(
                    own[0].in_flight,
                    locals[0].held(),
                    "the VM's units, its reserve included"
                );
                assert!((1..=1 + floodgate::primitives::inflight::RESERVE_MAX).contains(&own[0].in_flight));
            }
            let timing = Timing { request_end: Some(now), response_headers: Some(now.plus_ms(status.into())) };
            let outcome = selector.classify(&lease, Some(status), response_flags, timing);
            let finished = selector.finish(&store, &mut state, lease, outcome, now);
            assert_eq!(
                locals[0].in_use(),
                0,
                "the lease is released whatever happens"
            );
            selector.heartbeat(&store, &mut state, now);
            if !with_faults && store.planted_cas {
                assert!(finished.recorded, "the outcome is recorded");
                let written = ClusterRecord::decode(&store.value(&key).expect("written"), buckets).expect("decodes");
                assert!(written.in_flight.entries.iter().all(|e| e.vm != vm), "an idle VM leaves no lease after a heartbeat");
                let (limit, bounds) = (written.limit, selector.limit());
                assert!((bounds.min..=bounds.max).contains(&limit), "limit {limit} within [{}, {}]", bounds.min, bounds.max);
            }
        }
        Err(exhausted) => {
            assert_eq!(locals[0].in_use(), 0, "a refused request holds nothing");
            assert_eq!(exhausted.clusters.len(), 1);
            if !with_faults && store.planted_cas {
                assert!(decoded.is_ok(), "a record that does not decode refused a lease: {exhausted:?}");
            }
            check_reply(&replies::no_capacity(&selector, &exhausted));
        }
    }
    for cluster in selector
        .heartbeat(&store, &mut state, now)
        .into_iter()
        .flatten()
    {
        assert!((0.0..=1.0).contains(&cluster.success_rate), "{cluster:?}");
    }
    assert_eq!(locals[0].in_use(), 0);
}

/// The health endpoint's answer for an in-flight count alone.
fn health_of(shedder: &Shedder, in_flight: u32) -> replies::Reply {
    replies::health(&replies::LocalLoad { in_flight: Some((shedder, in_flight)), queued: None, lag: None }, None)
}

// -------------------------------------------------------------------------------------------
// watchdog_record: the watchdog's heartbeat record as read from shared data
// -------------------------------------------------------------------------------------------

/// Watchdog configurations the target picks from.
const WATCHDOGS: [&str; 3] = [
    r#"{"watchdog":{"path":"/alive"}}"#,
    r#"{"watchdog":{"path":"/alive","worker_silence":"3s","max_loop_lag":"100ms","lag_for":"1ms","recover_after":1}}"#,
    r#"{"watchdog":{"path":"/alive","max_memory_mb":1,"recover_after":60,"lag_for":"8784h"}}"#,
];

/// A response body read for a usage count (`cost.from: response_body`): the first byte picks
/// JSON or an event stream, one path or a weighted sum of several (Anthropic's input and output
/// tokens), and the byte bound, the second where the body is cut into chunks; a scan never
/// panics, and chunking never changes its answer.
pub fn usage_body(data: &[u8]) {
    use floodgate::ratelimit::usage::{Format, Scan, Usage, UsageScan};
    let mut input = Input { data };
    let flags = input.u8();
    let cut = usize::from(input.u8());
    let body = input.rest();
    let format = if flags & 1 == 0 { Format::Json } else { Format::EventStream };
    let max_bytes = if flags & 2 == 0 { u64::MAX } else { u64::from(flags >> 3) };
    let path = if flags & 4 == 0 {
        Usage::path("usage.total_tokens")
    } else {
        Usage::new([(vec!["usage.input_tokens", "message.usage.input_tokens"], 1), (vec!["usage.output_tokens"], 4)])
    };
    let mut whole = UsageScan::new(format, &path, max_bytes);
    whole.feed(body, &path);
    let whole = whole.end(&path);
    let mut chunked = UsageScan::new(format, &path, max_bytes);
    let (head, tail) = body.split_at(cut.min(body.len()));
    chunked.feed(head, &path);
    chunked.feed(tail, &path);
    let chunked = chunked.end(&path);
    if !matches!(whole, Scan::Gave(_)) {
        assert_eq!(whole, chunked, "chunking changed the answer");
    }
}

/// Layout: `now` (u64 LE), this VM's id (u64), the lag probe's lag (u32), a configuration
/// selector, then the record bytes.
///
/// Checks: decoding never panics, and what it accepts re-encodes to a record that decodes to the
/// same entries; the verdict on any record (planted in shared data) names only VMs of the record
/// and its answer is a well-formed `200` or `503` that agrees with it; a heartbeat over any
/// record leaves a record that decodes, holds this VM exactly once (live, as of `now`) and at
/// most [`MAX_VMS`] entries; a retirement marks it retired, and the verdict then leaves it out.
pub fn watchdog_record(data: &[u8]) {
    use floodgate::primitives::store::MemoryStore;
    use floodgate::watchdog::{Record, Watchdog, WorkerState};
    let mut input = Input { data };
    let now = MonoMillis(input.u64());
    let vm = input.u64();
    let lag_hint = u64::from(input.u32());
    let pick = usize::from(input.u8()) % WATCHDOGS.len();
    let bytes = input.rest();
    let config = Config::parse(WATCHDOGS[pick].as_bytes()).expect("a valid configuration");
    let dog = Watchdog::new(config.watchdog.as_ref().expect("a watchdog"), "fuzz");

    // 1. The decoder alone.
    let decoded = Record::decode(bytes);
    if let Ok(record) = &decoded {
        assert!(record.beats.len() <= MAX_VMS);
        assert_eq!(Record::decode(&record.encode()).as_ref(), Ok(record), "an encoded record decodes to itself");
    }

    // 2. The verdict, from the record as planted in shared data.
    let store = MemoryStore::new();
    store.set(dog.record_key(), bytes, None).expect("plant the record");
    let verdict = dog.verdict(&store, now);
    let known = decoded.as_ref().map(|r| r.beats.iter().map(|b| b.vm).collect::<Vec<_>>()).unwrap_or_default();
    assert!(verdict.workers.iter().all(|w| known.contains(&w.vm)), "{verdict:?}");
    let reply = replies::liveness(&dog, &verdict);
    check_reply(&reply);
    assert_eq!(reply.status, if verdict.alive() { 200 } else { 503 });

    // 3. A heartbeat of this VM over it, then its retirement.
    let mut state = WorkerState::default();
    dog.heartbeat(&store, vm, &mut state, now, lag_hint, Some(1 << 20)).expect("a heartbeat is written");
    let stored = store.get(dog.record_key()).expect("read").expect("the record exists");
    let after = Record::decode(&stored.value).expect("a heartbeat leaves a record that decodes");
    assert!(after.beats.len() <= MAX_VMS);
    let own: Vec<_> = after.beats.iter().filter(|b| b.vm == vm).collect();
    assert_eq!(own.len(), 1, "this VM once: {after:?}");
    assert!(!own[0].retired && own[0].last == now, "{:?}", own[0]);
    let _ = dog.verdict(&store, now);
    dog.retire(&store, vm, now).expect("a retirement is written");
    let stored = store.get(dog.record_key()).expect("read").expect("the record exists");
    let retired = Record::decode(&stored.value).expect("a retirement leaves a record that decodes");
    assert!(retired.beats.iter().filter(|b| b.vm == vm).all(|b| b.retired));
    assert!(dog.verdict(&store, now).workers.iter().all(|w| w.vm != vm), "a retired VM is no worker");
}
