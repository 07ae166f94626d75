//! Limiter tests over the in-memory store (Envoy's shared-data semantics), deterministic time.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use super::*;
use crate::primitives::store::{Cas, MemoryStore};
use proptest::prelude::*;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;

fn config(rules: &str) -> Config {
    Config::parse(format!(r#"{{"rate_limits":[{rules}]}}"#).as_bytes()).unwrap()
}

fn rule(name: &str, limit: u32, window: &str, capacity: u32) -> String {
    format!(r#"{{"name":"{name}","key":["path"],"limit":{limit},"window":"{window}","capacity":{capacity}}}"#)
}

fn admitted(verdict: &Verdict) -> bool {
    matches!(verdict, Verdict::Admitted { .. })
}

/// The exact sliding-window counter, one entry per key (docs/design.md, "Sliding window counter").
#[derive(Default)]
struct Reference {
    counters: HashMap<(usize, u64), (u64, Counts)>,
}

impl Reference {
    fn check(&mut self, limiter: &Limiter, probes: &[Probe], now: UnixMillis) -> bool {
        let mut next = Vec::new();
        for probe in probes {
            let table = &limiter.tables()[probe.rule];
            let phase = table.window.phase(now);
            let (bucket, counts) = self
                .counters
                .get(&(probe.rule, probe.key_hash))
                .copied()
                .unwrap_or((phase.bucket_index, Counts::default()));
            let counts = counts.rolled(bucket, phase.bucket_index);
            let w = table.window.length_ms() as f64;
            let estimate = counts.previous as f64 * (1.0 - phase.elapsed_ms as f64 / w) + counts.current as f64;
            if estimate + 1.0 > table.limit.get() as f64 + 1e-9 {
                return false;
            }
            next.push(((probe.rule, probe.key_hash), (phase.bucket_index, counts.plus(1))));
        }
        self.counters.extend(next);
        true
    }
}

proptest! {
    /// With room for every key, the limiter decides exactly like the per-key reference, over
    /// random arrival sequences on two rules and several keys.
    ///
    /// In one VM, quota reserves change nothing: a reserve only ever admits what the counter
    /// would have admitted (limits of 60 and 90 leave room for grants; 5 and 9 for none).
    #[test]
    fn decisions_match_the_exact_per_key_counter(
        arrivals in proptest::collection::vec((0u64..3, prop_oneof![19 => 0u64..8, 1 => 0u64..1500], any::<bool>(), 0u8..20), 1..600),
        (limit_a, limit_b) in prop_oneof![Just((5u32, 9u32)), Just((60, 90))],
        with_reserves in any::<bool>(),
    ) {
        let rules = [rule("a", limit_a, "1s", 4096), rule("b", limit_b, "3s", 4096)].join(",");
        let limiter = Limiter::new(&config(&rules), "t");
        let store = MemoryStore::new();
        let mut reserves = if with_reserves { Reserves::new() } else { Reserves::disabled() };
        let mut reference = Reference::default();
        let mut now = 1_700_000_000_000u64;
        for (key, gap_ms, both, tick) in arrivals {
            now += gap_ms;
            if tick == 0 {
                limiter.heartbeat(&store, &mut reserves, UnixMillis(now));
            }
            let mut probes = vec![Probe::new(0, key * 7919 + 1)];
            if both { probes.push(Probe::new(1, key * 104_729 + 3)); }
            let ours = admitted(&limiter.check(&store, &mut reserves, &probes, &[], UnixMillis(now)));
            prop_assert_eq!(ours, reference.check(&limiter, &probes, UnixMillis(now)), "at {} key {}", now, key);
        }
    }

    /// Several VMs with reserves over one store, across window buckets: every request they
    /// admit, the exact per-key counter admits too (reserves may refuse early, never late).
    #[test]
    fn reserves_in_several_vms_are_never_looser_than_the_exact_counter(
        limit in 8u32..200,
        picks in proptest::collection::vec(
            (0usize..3, prop_oneof![19 => 0u64..6, 1 => 0u64..1500], 0u8..30),
            0..1500,
        ),
    ) {
        let limiter = Limiter::new(&config(&rule("a", limit, "1s", 64)), "t");
        let store = MemoryStore::new();
        let mut vms = [Reserves::new(), Reserves::new(), Reserves::new()];
        let mut reference = Reference::default();
        let probe = [Probe::new(0, 77)];
        let mut now = 1_700_000_000_000u64;
        for (vm, gap, tick) in picks {
            now += gap;
            if tick == 0 {
                limiter.heartbeat(&store, &mut vms[vm], UnixMillis(now));
            }
            if admitted(&limiter.check(&store, &mut vms[vm], &probe, &[], UnixMillis(now))) {
                prop_assert!(reference.check(&limiter, &probe, UnixMillis(now)), "admitted past the limit at {}", now);
            }
        }
    }

    /// Several VMs with reserves over one store, one bucket: together they never admit more
    /// than the limit, and once the idle reserves are given back they admit exactly the limit.
    #[test]
    fn reserves_never_let_vms_past_the_limit_and_come_back(
        limit in 1u32..400,
        picks in proptest::collection::vec((0usize..3, 0u8..30), 0..1200),
    ) {
        let limiter = Limiter::new(&config(&rule("a", limit, "1h", 64)), "t");
        let store = MemoryStore::new();
        let mut vms = [Reserves::new(), Reserves::new(), Reserves::new()];
        let now = UnixMillis(1_700_000_000_000);
        let probe = [Probe::new(0, 77)];
        let mut admitted_total = 0u32;
        for (vm, tick) in picks {
            if tick == 0 {
                limiter.heartbeat(&store, &mut vms[vm], now);
            }
            if admitted(&limiter.check(&store, &mut vms[vm], &probe, &[], now)) {
                admitted_total += 1;
            }
            prop_assert!(admitted_total <= limit, "{} admitted, limit {}", admitted_total, limit);
        }
        // Two idle heartbeats give every reserve back; then the VMs take what is left.
        for _ in 0..2 {
            for reserves in &mut vms { limiter.heartbeat(&store, reserves, now); }
        }
        for reserves in &mut vms {
            while admitted(&limiter.check(&store, reserves, &probe, &[], now)) {
                admitted_total += 1;
                prop_assert!(admitted_total <= limit);
            }
        }
        prop_assert_eq!(admitted_total, limit);
    }

    /// Retry-After is tight: at `retry_at − 1 ms` the same request is still refused, at
    /// `retry_at` it is admitted (nothing else arriving in between).
    #[test]
    fn retry_at_is_the_first_admitted_millisecond(
        limit in 1u32..20, extra in 1u32..30, start in 0u64..10_000, gap in 0u64..400,
    ) {
        let limiter = Limiter::new(&config(&rule("a", limit, "2s", 64)), "t");
        let store = MemoryStore::new();
        let probes = [Probe::new(0, 42)];
        let mut now = 1_700_000_000_000 + start;
        let mut refusal = None;
        for _ in 0..limit + extra {
            now += gap;
            if let v @ Verdict::Refused { .. } = limiter.check(&store, &mut Reserves::disabled(), &probes, &[], UnixMillis(now)) {
                refusal = Some((now, v));
                break;
            }
        }
        let Some((at, verdict)) = refusal else { return Ok(()); };
        let retry_at = verdict.retry_at().unwrap();
        prop_assert!(retry_at.0 > at);
        // A refused probe writes nothing, so the second probe sees the same state.
        let probe_store = |t: u64| limiter.check(&store, &mut Reserves::disabled(), &probes, &[], UnixMillis(t));
        prop_assert!(!admitted(&probe_store(retry_at.0 - 1)));
        prop_assert!(admitted(&probe_store(retry_at.0)));
    }
}

fn stored_counts(store: &MemoryStore, limiter: &Limiter, probe: Probe, bucket: u64) -> Counts {
    let (_, key) = limiter.locate(probe).unwrap();
    let set = table::Set::decode(&store.get(&key).unwrap().unwrap().value).unwrap();
    set.rolled_to(bucket).counts_of(fingerprint(probe.key_hash))
}

#[test]
fn grants_start_at_nothing_double_and_vanish_near_the_limit() {
    let limiter = Limiter::new(&config(&rule("a", 200, "1h", 64)), "t");
    let store = MemoryStore::new();
    let mut reserves = Reserves::new();
    let probe = Probe::new(0, 5);
    let now = UnixMillis(1_700_000_000_000);
    let bucket = limiter.tables()[0].window.phase(now).bucket_index;
    let mut writes = Vec::new();
    let mut last = 0;
    for n in 1..=200u32 {
        match limiter.check(&store, &mut reserves, &[probe], &[], now) {
            Verdict::Admitted { standings, .. } => {
                assert_eq!(standings[0].remaining, u64::from(200 - n), "request {n}: r counts only used units");
            }
            other => panic!("request {n}: {other:?}"),
        }
        let stored = stored_counts(&store, &limiter, probe, bucket).current;
        if stored != last {
            writes.push(stored - n);
            last = stored;
        }
    }
    // Units granted at each write: none at first sight, then doubling to 16, then bounded by
    // an eighth of the room, then none.
    assert_eq!(&writes[..7], &[0, 1, 2, 4, 8, 16, 16]);
    assert!(writes.windows(2).skip(6).all(|w| w[1] <= w[0]), "{writes:?}");
    assert_eq!(*writes.last().unwrap(), 0, "no reserve at the limit: {writes:?}");
    assert!(!admitted(&limiter.check(&store, &mut reserves, &[probe], &[], now)));
    assert_eq!(stored_counts(&store, &limiter, probe, bucket).current, 200);
}

#[test]
fn leftover_units_go_back_at_the_next_bucket_and_at_idle_heartbeats() {
    let limiter = Limiter::new(&config(&rule("a", 1000, "1m", 64)), "t");
    let store = MemoryStore::new();
    let mut reserves = Reserves::new();
    let probe = Probe::new(0, 5);
    let start = UnixMillis(1_700_000_040_000); // a multiple of the window
    let bucket = limiter.tables()[0].window.phase(start).bucket_index;
    for _ in 0..10 {
        assert!(admitted(&limiter.check(&store, &mut reserves, &[probe], &[], start)));
    }
    assert!(stored_counts(&store, &limiter, probe, bucket).current > 10, "a reserve is counted");
    // The next bucket's first request gives the unused units back in its own write.
    let next = UnixMillis(start.0 + 60_000);
    assert!(admitted(&limiter.check(&store, &mut reserves, &[probe], &[], next)));
    assert_eq!(stored_counts(&store, &limiter, probe, bucket + 1).previous, 10);
    // Idle for a heartbeat period: the reserve goes back.
    for _ in 0..5 {
        assert!(admitted(&limiter.check(&store, &mut reserves, &[probe], &[], next)));
    }
    limiter.heartbeat(&store, &mut reserves, next);
    assert!(stored_counts(&store, &limiter, probe, bucket + 1).current > 6, "used since the last heartbeat: kept");
    limiter.heartbeat(&store, &mut reserves, next);
    assert_eq!(stored_counts(&store, &limiter, probe, bucket + 1).current, 6, "idle: given back");
    // A replaced configuration gives back everything.
    for _ in 0..10 {
        assert!(admitted(&limiter.check(&store, &mut reserves, &[probe], &[], next)));
    }
    limiter.drain(&store, &mut reserves);
    assert_eq!(stored_counts(&store, &limiter, probe, bucket + 1).current, 16);
}

#[test]
fn a_refusal_by_another_rule_puts_reserved_units_back() {
    let limiter = Limiter::new(&config(&[rule("wide", 1000, "1h", 64), rule("narrow", 1000, "1h", 64)].join(",")), "t");
    let store = MemoryStore::new();
    let mut reserves = Reserves::new();
    let now = UnixMillis(1_700_000_000_000);
    let wide = Probe::new(0, 1);
    let narrow = Probe::new(1, 2);
    // Writes grant 0, 1, 2 units: after 5 requests the VM holds 1 unit of 6 counted.
    for _ in 0..5 {
        assert!(admitted(&limiter.check(&store, &mut reserves, &[wide], &[], now)));
    }
    let bucket = limiter.tables()[0].window.phase(now).bucket_index;
    let before = stored_counts(&store, &limiter, wide, bucket);
    // Another VM fills the narrow rule's key.
    let mut other = Reserves::disabled();
    for _ in 0..1000 {
        assert!(admitted(&limiter.check(&store, &mut other, &[narrow], &[], now)));
    }
    match limiter.check(&store, &mut reserves, &[wide, narrow], &[], now) {
        Verdict::Refused { violations } => assert_eq!(violations[0].standing.rule, 1),
        other => panic!("{other:?}"),
    }
    match limiter.check(&store, &mut reserves, &[wide], &[], now) {
        Verdict::Admitted { standings, .. } => assert_eq!(standings[0].remaining, 1000 - 6, "the refused request used nothing"),
        other => panic!("{other:?}"),
    }
    assert_eq!(stored_counts(&store, &limiter, wide, bucket), before, "served from the reserve");
}

#[test]
fn concurrent_workers_never_lose_an_update() {
    let limiter = Arc::new(Limiter::new(&config(&rule("a", 300, "1h", 64)), "t"));
    let store = Arc::new(MemoryStore::new());
    let now = UnixMillis(1_700_000_000_000);
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (limiter, store) = (limiter.clone(), store.clone());
            std::thread::spawn(move || {
                (0..250)
                    .filter(|_| admitted(&limiter.check(&*store, &mut Reserves::disabled(), &[Probe::new(0, 9)], &[], now)))
                    .count()
            })
        })
        .collect();
    let total: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert_eq!(total, 300);
}

/// A store that makes the next `mismatches` CAS writes fail, as if another worker had written
/// the key just before.
struct Interfering {
    inner: MemoryStore,
    mismatches: Cell<u32>,
}

impl SharedStore for Interfering {
    fn get(&self, key: &str) -> Result<Option<Stored>, StoreError> {
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        if cas.is_some() && key != crate::primitives::store::TOKEN_KEY && self.mismatches.get() > 0 {
            self.mismatches.set(self.mismatches.get() - 1);
            // Another worker rewrites the key unchanged: its token moves on.
            if let Some(current) = self.inner.get(key)? {
                self.inner.set(key, &current.value, None)?;
            }
        }
        self.inner.set(key, value, cas)
    }
}

#[test]
fn cas_mismatches_are_retried_and_nothing_is_lost() {
    let limiter = Limiter::new(&config(&rule("a", 10, "1m", 64)), "t");
    let store = Interfering { inner: MemoryStore::new(), mismatches: Cell::new(0) };
    let probes = [Probe::new(0, 5)];
    let now = UnixMillis(1_700_000_000_000);
    assert!(admitted(&limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now)));
    store.mismatches.set(MAX_ATTEMPTS - 1);
    assert!(admitted(&limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now)));
    assert_eq!(store.mismatches.get(), 0);
    match limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now) {
        Verdict::Admitted { standings, .. } => assert_eq!(standings[0].remaining, 7),
        other => panic!("{other:?}"),
    }
}

#[test]
fn exhausted_attempts_reject_as_contention_and_count_nothing() {
    let limiter = Limiter::new(&config(&rule("a", 10, "1m", 64)), "t");
    let store = Interfering { inner: MemoryStore::new(), mismatches: Cell::new(0) };
    let probes = [Probe::new(0, 5)];
    let now = UnixMillis(1_700_000_000_000);
    assert!(admitted(&limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now)));
    store.mismatches.set(MAX_ATTEMPTS);
    match limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now) {
        Verdict::Refused { violations } => assert_eq!(violations[0].cause, Cause::Contention),
        other => panic!("{other:?}"),
    }
    match limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now) {
        Verdict::Admitted { standings, .. } => assert_eq!(standings[0].remaining, 8, "the contended request was not counted"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_refused_request_consumes_no_quota_of_any_rule() {
    let limiter = Limiter::new(&config(&[rule("wide", 100, "1m", 64), rule("narrow", 2, "1m", 64)].join(",")), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    let both = [Probe::new(0, 1), Probe::new(1, 2)];
    assert!(admitted(&limiter.check(&store, &mut Reserves::disabled(), &both, &[], now)));
    assert!(admitted(&limiter.check(&store, &mut Reserves::disabled(), &both, &[], now)));
    for _ in 0..5 {
        match limiter.check(&store, &mut Reserves::disabled(), &both, &[], now) {
            Verdict::Refused { violations } => {
                assert_eq!(violations.len(), 1);
                assert_eq!(violations[0].standing.rule, 1);
                assert_eq!(violations[0].cause, Cause::OverLimit);
            }
            other => panic!("{other:?}"),
        }
    }
    match limiter.check(&store, &mut Reserves::disabled(), &both[..1], &[], now) {
        Verdict::Admitted { standings, .. } => assert_eq!(standings[0].remaining, 97),
        other => panic!("{other:?}"),
    }
}

/// Between this request's read and its commit, another worker takes the last unit of the second
/// rule: the first rule's unit is taken back.
#[test]
fn a_lost_race_on_a_later_rule_takes_back_the_earlier_ones() {
    struct Racing<'a> {
        inner: MemoryStore,
        limiter: &'a Limiter,
        armed: Cell<bool>,
    }
    impl SharedStore for Racing<'_> {
        fn get(&self, key: &str) -> Result<Option<Stored>, StoreError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
            if self.armed.replace(false) {
                let other = [Probe::new(1, 2)];
                assert!(admitted(&self.limiter.check(&self.inner, &mut Reserves::disabled(), &other, &[], UnixMillis(1_700_000_000_000))));
            }
            self.inner.set(key, value, cas)
        }
    }
    let limiter = Limiter::new(&config(&[rule("wide", 100, "1m", 64), rule("narrow", 1, "1m", 64)].join(",")), "t");
    let store = Racing { inner: MemoryStore::new(), limiter: &limiter, armed: Cell::new(true) };
    let now = UnixMillis(1_700_000_000_000);
    let both = [Probe::new(0, 1), Probe::new(1, 2)];
    match limiter.check(&store, &mut Reserves::disabled(), &both, &[], now) {
        Verdict::Refused { violations } => assert_eq!(violations[0].standing.rule, 1),
        other => panic!("{other:?}"),
    }
    match limiter.check(&store.inner, &mut Reserves::disabled(), &both[..1], &[], now) {
        Verdict::Admitted { standings, .. } => assert_eq!(standings[0].remaining, 99, "rule 0 got its unit back"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_full_table_stays_bounded_and_never_loosens_a_quota() {
    // capacity 8 = 2 sets of 4; 10 000 distinct keys.
    let limiter = Limiter::new(&config(&rule("a", 3, "1h", 8)), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    let mut admitted_per_key: HashMap<u64, u32> = HashMap::new();
    for round in 0..4 {
        for key in 0..10_000u64 {
            let hash = key.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ round;
            let hash = hash & !0xff | (key & 0xff); // keep keys distinct
            if admitted(&limiter.check(&store, &mut Reserves::disabled(), &[Probe::new(0, hash)], &[], now)) {
                *admitted_per_key.entry(hash).or_default() += 1;
            }
        }
    }
    assert!(admitted_per_key.values().all(|n| *n <= 3), "no key beyond its limit");
    assert_eq!(store.len(), 2 + 1, "two sets and the token key, whatever the number of keys");
}

#[test]
fn a_steady_key_keeps_its_quota_under_a_flood_of_other_keys() {
    // 64 tracked keys (16 sets of 4); a steady key sends 40 requests (limit 50) among a flood of
    // 800 one-off keys, ~50 per set. Sharing a counter with the ~50 others of its set would
    // starve it; the one-off keys never take its entry, so its count stays exact.
    let limiter = Limiter::new(&config(&rule("a", 50, "1h", 64)), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    let steady = [Probe::new(0, 1)];
    let mut steady_admitted = 0;
    for i in 0..40u64 {
        if admitted(&limiter.check(&store, &mut Reserves::disabled(), &steady, &[], now)) {
            steady_admitted += 1;
        }
        for j in 0..20u64 {
            let flood_key = (i * 20 + j + 7).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            limiter.check(&store, &mut Reserves::disabled(), &[Probe::new(0, flood_key)], &[], now);
        }
    }
    assert_eq!(steady_admitted, 40);
    match limiter.check(&store, &mut Reserves::disabled(), &steady, &[], now) {
        Verdict::Admitted { standings, .. } => {
            assert_eq!(standings[0].estimate, 41.0, "exact");
        }
        other => panic!("{other:?}"),
    }
}

/// A flood of one-shot keys through the limiter: limit 5, a flood of one-shot keys (120 per set, as
/// 480 000 per window would be at the default capacity), an established key sending every now
/// and then, and brand-new keys during and after the flood. Before frequency-aware admission,
/// every new key started from the set's floor, above 5: all 7 of its requests got `429`.
#[test]
fn a_flood_of_one_shot_keys_locks_no_well_behaved_key_out() {
    let sets = 16u64;
    let limiter = Limiter::new(&config(&rule("per-key", 5, "1h", (sets * 4) as u32)), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    let mut reserves = Reserves::new();
    let mut check = |hash: u64| admitted(&limiter.check(&store, &mut reserves, &[Probe::new(0, hash)], &[], now));
    let mix = |n: u64| n.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(23);
    let established = mix(1);
    let mut established_admitted = 0;
    let mut newcomers = Vec::new();
    let flood = sets * 120;
    for n in 0..flood {
        assert!(check(mix(1_000_000 + n)), "a one-shot key is under its limit");
        if n % (flood / 7) == 0 {
            established_admitted += u32::from(check(established));
        }
        if n % (flood / 10) == 0 {
            let newcomer = mix(2_000_000 + n);
            newcomers.push((0..7).filter(|_| check(newcomer)).count());
        }
    }
    for n in 0..20 {
        let newcomer = mix(3_000_000 + n);
        newcomers.push((0..7).filter(|_| check(newcomer)).count());
    }
    assert_eq!(established_admitted, 5, "the established key keeps its exact quota");
    assert!(newcomers.iter().all(|&n| n == 5 || n == 4), "new keys get their quota (one less at most): {newcomers:?}");
    assert!(newcomers.iter().filter(|&&n| n == 5).count() * 10 >= newcomers.len() * 9, "{newcomers:?}");
}

#[test]
fn a_corrupt_record_is_not_trusted_and_gets_replaced() {
    let limiter = Limiter::new(&config(&rule("a", 2, "1m", 4)), "t");
    let store = MemoryStore::new();
    let key = format!("{}0", limiter.tables()[0].key_prefix);
    store.set(&key, b"\x01garbage", None).unwrap();
    let probes = [Probe::new(0, 8)];
    let now = UnixMillis(1_700_000_000_000);
    assert!(admitted(&limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now)));
    assert!(table::Set::decode(&store.get(&key).unwrap().unwrap().value).is_ok());
}

#[test]
fn namespaces_and_rule_definitions_separate_counters() {
    let a = Limiter::new(&config(&rule("a", 2, "1m", 4)), "one");
    let b = Limiter::new(&config(&rule("a", 2, "1m", 4)), "two");
    let c = Limiter::new(&config(&rule("a", 2, "2m", 4)), "one");
    let d = Limiter::new(&config(&rule("a", 99, "1m", 4)), "one");
    let prefix = |l: &Limiter| l.tables()[0].key_prefix.clone();
    assert_ne!(prefix(&a), prefix(&b));
    assert_eq!(prefix(&a), prefix(&c), "one rule name, one set of records");
    assert_eq!(prefix(&a), prefix(&d));
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    let probes = [Probe::new(0, 9)];
    let check = |l: &Limiter| admitted(&l.check(&store, &mut Reserves::disabled(), &probes, &[], now));
    assert!(check(&a) && check(&a) && !check(&a), "a's limit of 2");
    assert!(check(&d), "a new limit applies to the existing counters");
    assert!(check(&c) && check(&c), "another window starts fresh counters");
    assert!(check(&a), "and a's record, now c's, reads as empty for a again");
    assert_eq!(store.len(), 2, "the rule's one record and the token key, whatever the changes");
}

/// Shared data has no delete, so records are per rule name: a definition change reuses them
/// rather than leaving the old definition's records behind.
#[test]
fn changing_a_rule_any_number_of_times_reuses_its_records() {
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    for (window, capacity) in [("1m", 64), ("2m", 64), ("1m", 32), ("1h", 64), ("1m", 64)] {
        let limiter = Limiter::new(&config(&rule("a", 100, window, capacity)), "t");
        for key in 0..2_000u64 {
            let hash = key.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            limiter.check(&store, &mut Reserves::disabled(), &[Probe::new(0, hash)], &[], now);
        }
    }
    assert_eq!(store.len(), 64 / 4 + 1, "the largest capacity's records and the token key");
}

/// Units a VM reserved and left unused when the bucket ended are not held against its own next
/// request: it decides on the exact count.
#[test]
fn unused_units_of_the_last_bucket_do_not_count_against_their_owner() {
    let limiter = Limiter::new(&config(&rule("a", 100, "1m", 64)), "t");
    let store = MemoryStore::new();
    let (mut a, mut b) = (Reserves::new(), Reserves::disabled());
    let probe = [Probe::new(0, 3)];
    let start = UnixMillis(1_700_000_040_000); // a multiple of the window
    // Writes grant 0, 1, 2, 4 units: after 8 requests A holds 3 of the 11 counted.
    for _ in 0..8 {
        assert!(admitted(&limiter.check(&store, &mut a, &probe, &[], start)));
    }
    let mut by_b = 0;
    while admitted(&limiter.check(&store, &mut b, &probe, &[], start)) {
        by_b += 1;
    }
    assert_eq!(by_b, 89, "B sees A's 3 unused units counted");
    // The next bucket begins: previous holds 97 requests, so exactly 3 more fit right now.
    let next = UnixMillis(start.0 + 60_000);
    assert!(!admitted(&limiter.check(&store, &mut b, &probe, &[], next)), "B still sees 100");
    for n in 0..3 {
        assert!(admitted(&limiter.check(&store, &mut a, &probe, &[], next)), "A's request {n}");
    }
    assert!(!admitted(&limiter.check(&store, &mut a, &probe, &[], next)));
}

#[test]
fn a_vm_follows_a_bounded_number_of_keys_and_forgets_idle_ones() {
    use reserve::MAX_KEYS;
    let limiter = Limiter::new(&config(&rule("a", 1000, "1h", 64)), "t");
    let store = MemoryStore::new();
    let mut reserves = Reserves::new();
    let now = UnixMillis(1_700_000_000_000);
    for key in 0..MAX_KEYS as u64 + 100 {
        assert!(admitted(&limiter.check(&store, &mut reserves, &[Probe::new(0, key + 1)], &[], now)));
    }
    assert_eq!(reserves.followed(), MAX_KEYS);
    let hot = Probe::new(0, 1);
    limiter.heartbeat(&store, &mut reserves, now);
    assert!(admitted(&limiter.check(&store, &mut reserves, &[hot], &[], now)));
    limiter.heartbeat(&store, &mut reserves, now);
    assert_eq!(reserves.followed(), 1, "only the key used in the last period is still followed");
}

#[test]
fn a_heartbeat_gives_back_a_bounded_number_of_reserves_and_the_next_one_the_rest() {
    use reserve::MAX_RETURNS_PER_HEARTBEAT;
    let limiter = Limiter::new(&config(&rule("a", 1000, "1h", 4096)), "t");
    let store = MemoryStore::new();
    let mut reserves = Reserves::new();
    let now = UnixMillis(1_700_000_000_000);
    let keys = MAX_RETURNS_PER_HEARTBEAT as u64 + 40;
    // Four requests per key: writes grant 0, then 1 unit (which the third request uses), then
    // 2 units, which stay unused.
    for key in 1..=keys {
        for _ in 0..4 {
            assert!(admitted(&limiter.check(&store, &mut reserves, &[Probe::new(0, key)], &[], now)));
        }
    }
    assert_eq!(reserves.held(1), vec![2 * keys]);
    limiter.heartbeat(&store, &mut reserves, now); // used in this period: kept
    assert_eq!(reserves.held(1), vec![2 * keys]);
    limiter.heartbeat(&store, &mut reserves, now);
    assert_eq!(reserves.held(1), vec![2 * 40], "at most {MAX_RETURNS_PER_HEARTBEAT} given back per heartbeat");
    limiter.heartbeat(&store, &mut reserves, now);
    assert_eq!(reserves.held(1), vec![0]);
    assert_eq!(reserves.followed(), 0);
    let bucket = limiter.tables()[0].window.phase(now).bucket_index;
    for key in 1..=keys {
        assert_eq!(stored_counts(&store, &limiter, Probe::new(0, key), bucket).current, 4, "key {key}");
    }
}

// ---- limits by key, costs other than 1, costs charged later ----

fn with(probe: Probe, limit: Option<u32>, cost: u32) -> Probe {
    Probe { limit: limit.and_then(NonZeroU32::new), cost, ..probe }
}

proptest! {
    /// Whatever the costs, the units admitted within one window bucket never exceed the key's
    /// limit, over two VMs with quota reserves, and a request is refused only when its cost
    /// does not fit (exact in one bucket: no previous-bucket weight).
    #[test]
    fn costs_never_take_a_key_past_its_limit(
        limit in 1u32..200,
        costs in proptest::collection::vec((0u32..40, any::<bool>()), 1..120),
    ) {
        let limiter = Limiter::new(&config(&rule("c", limit, "1h", 64)), "t");
        let store = MemoryStore::new();
        let mut vms = [Reserves::new(), Reserves::new()];
        let start = UnixMillis(1_700_003_600_000); // 800 s into an hour: one bucket throughout
        let mut admitted_units = 0u64;
        for (i, (cost, second)) in costs.iter().enumerate() {
            let cost = (*cost).min(limit);
            let probe = with(Probe::new(0, 7), None, cost);
            let vm = &mut vms[usize::from(*second)];
            let now = start.plus_ms(i as u64);
            let fits = admitted_units + u64::from(probe.needs()) <= u64::from(limit);
            match limiter.check(&store, vm, &[probe], &[], now) {
                Verdict::Admitted { .. } => {
                    prop_assert!(fits, "admitted {cost} with {admitted_units} of {limit} used");
                    admitted_units += u64::from(cost);
                }
                Verdict::Refused { .. } => {}
            }
            prop_assert!(admitted_units <= u64::from(limit));
        }
    }
}

#[test]
fn a_key_of_a_tier_or_an_override_gets_its_own_limit() {
    let limiter = Limiter::new(&config(&rule("t", 3, "1h", 64)), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_003_600_000);
    let count = |limit: Option<u32>, key: u64| {
        (0..20)
            .filter(|_| admitted(&limiter.check(&store, &mut Reserves::disabled(), &[with(Probe::new(0, key), limit, 1)], &[], now)))
            .count()
    };
    assert_eq!(count(None, 1), 3, "the rule's limit");
    assert_eq!(count(Some(12), 2), 12, "a tier's");
    // The same key, its tier raised by a reload or its header: the counts stay, the new limit applies.
    assert_eq!(count(Some(5), 1), 2);
    let Verdict::Refused { violations } = limiter.check(&store, &mut Reserves::disabled(), &[with(Probe::new(0, 2), Some(12), 1)], &[], now) else {
        panic!("refused")
    };
    assert_eq!(violations[0].standing.limit.get(), 12, "the refusal names the key's limit");
}

#[test]
fn a_cost_charged_later_refuses_the_key_once_its_quota_is_spent() {
    let limiter = Limiter::new(&config(&rule("tokens", 100, "1h", 64)), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_003_600_000);
    let probe = with(Probe::new(0, 9), None, 0);
    let check = |reserves: &mut Reserves| limiter.check(&store, reserves, &[probe], &[], now);
    let mut reserves = Reserves::new();
    // Admitted while there is room for one unit, counting nothing; the upstream reports 60, then 45.
    assert!(admitted(&check(&mut reserves)));
    assert!(limiter.charge(&store, probe, 60, now));
    assert!(admitted(&check(&mut reserves)));
    assert!(limiter.charge(&store, probe, 45, now));
    let Verdict::Refused { violations } = check(&mut reserves) else { panic!("spent: refused") };
    assert_eq!(violations[0].standing.remaining, 0);
    assert!(violations[0].standing.estimate >= 105.0);
    // Retry-After is tight: in the next bucket (now is 800 s into the hour) the 105 weigh
    // 105 × (1 − f), and one unit fits once 105 × (1 − f) + 1 ≤ 100: f ≥ 6/105, 205.715 s in.
    let next_bucket = now.plus_ms(3_600_000 - 800_000);
    assert_eq!(violations[0].standing.retry_at, Some(next_bucket.plus_ms(205_715)));
}

#[test]
fn a_cost_larger_than_one_needs_room_for_all_of_it_and_retry_after_says_when() {
    let limiter = Limiter::new(&config(&rule("bytes", 1000, "1m", 64)), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_040_000); // the start of a minute
    let probe = |cost| with(Probe::new(0, 3), None, cost);
    assert!(admitted(&limiter.check(&store, &mut Reserves::disabled(), &[probe(700)], &[], now)));
    let Verdict::Refused { violations } = limiter.check(&store, &mut Reserves::disabled(), &[probe(400)], &[], now) else {
        panic!("400 more do not fit")
    };
    assert!(admitted(&limiter.check(&store, &mut Reserves::disabled(), &[probe(300)], &[], now)), "300 do");
    // When 400 were refused, 700 were counted: in the next minute they weigh 700 × (1 − f), and
    // 400 fit once 700 × (1 − f) + 400 ≤ 1000: f ≥ 1/7, 8.572 s in (rounded up to the ms).
    assert_eq!(violations[0].standing.retry_at, Some(now.plus_ms(60_000 + 8_572)));
}

mod token_bucket {
    use super::*;
    use crate::ratelimit::bucket::{micros, Bucket, Turn};
    use crate::ratelimit::reserve::Reserves;

    fn bucket_rule(name: &str, limit: u32, window: &str, burst: u32, extra: &str) -> String {
        format!(
            r#"{{"name":"{name}","key":["path"],"limit":{limit},"window":"{window}","algorithm":"token_bucket","burst":{burst}{extra}}}"#
        )
    }

    fn check(limiter: &Limiter, store: &MemoryStore, probes: &[Probe], now: u64) -> Verdict {
        limiter.check(store, &mut Reserves::new(), probes, &[], UnixMillis(now))
    }

    const NOW: u64 = 1_800_000_000_000;

    #[test]
    fn burst_then_the_rate_with_a_tight_retry_at() {
        let limiter = Limiter::new(&config(&bucket_rule("b", 10, "1s", 5, "")), "t");
        let store = MemoryStore::default();
        let probe = [Probe::new(0, 42)];
        let verdicts: Vec<Verdict> = (0..40).map(|_| check(&limiter, &store, &probe, NOW)).collect();
        assert_eq!(verdicts.iter().filter(|v| admitted(v)).count(), 5);
        let Verdict::Admitted { standings, .. } = &verdicts[4] else { panic!() };
        assert_eq!((standings[0].remaining, standings[0].reset_ms, standings[0].go_at), (0, 500, None));
        assert_eq!(verdicts[5].retry_at(), Some(UnixMillis(NOW + 100)));
        assert!(!admitted(&check(&limiter, &store, &probe, NOW + 99)));
        assert!(admitted(&check(&limiter, &store, &probe, NOW + 100)));
        // Then 10 per second: one every 100 ms, exactly.
        let mut admitted_per_second = vec![0; 5];
        for ms in (101..5101).step_by(10) {
            if admitted(&check(&limiter, &store, &probe, NOW + ms)) {
                admitted_per_second[((ms - 101) / 1000) as usize] += 1;
            }
        }
        // The first second's first unit went at NOW + 100, above.
        assert_eq!(admitted_per_second, vec![9, 10, 10, 10, 10]);
    }

    #[test]
    fn a_request_over_the_rate_waits_for_its_turn_within_max_delay() {
        let limiter = Limiter::new(&config(&bucket_rule("b", 10, "1s", 5, r#","max_delay":"500ms""#)), "t");
        let store = MemoryStore::default();
        let probe = [Probe::new(0, 42)];
        let mut turns = Vec::new();
        for _ in 0..30 {
            match check(&limiter, &store, &probe, NOW) {
                Verdict::Admitted { standings, .. } => turns.push(standings[0].go_at),
                refused => {
                    // Let in to wait from the moment the tenth turn is 500 ms away.
                    assert_eq!(refused.retry_at(), Some(UnixMillis(NOW + 100)));
                }
            }
        }
        let expected: Vec<Option<UnixMillis>> =
            (0..10).map(|i: u64| (i >= 5).then(|| UnixMillis(NOW + (i - 4) * 100))).collect();
        assert_eq!(turns, expected);
        // A waiting client goes away: its turn comes back.
        limiter.give_back_turn(&store, probe[0]);
        assert!(admitted(&check(&limiter, &store, &probe, NOW)));
        assert!(!admitted(&check(&limiter, &store, &probe, NOW)));
    }

    #[test]
    fn all_or_nothing_with_a_window_rule_and_costs() {
        let rules = format!("{},{}", bucket_rule("b", 10, "1s", 5, r#","cost":{"from":"request_header","header":"x-cost"}"#), rule("w", 2, "1m", 64));
        let limiter = Limiter::new(&config(&rules), "t");
        let store = MemoryStore::default();
        let probes = |cost| [Probe { cost, ..Probe::new(0, 7) }, Probe::new(1, 7)];
        assert!(admitted(&check(&limiter, &store, &probes(3), NOW)));
        assert!(admitted(&check(&limiter, &store, &probes(1), NOW)));
        // The window refuses the third: the bucket's unit is not taken.
        assert!(!admitted(&check(&limiter, &store, &probes(1), NOW)));
        let Verdict::Admitted { standings, .. } = check(&limiter, &store, &[Probe::new(0, 7)], NOW) else { panic!() };
        assert_eq!(standings[0].remaining, 0, "3 + 1 + this one of 5");
        // A cost above the burst never goes.
        let verdict = check(&limiter, &store, &[Probe { cost: 6, ..Probe::new(0, 8) }], NOW);
        assert_eq!(verdict.retry_at(), None);
        // A cost charged later moves the TAT.
        assert!(limiter.charge(&store, Probe::new(0, 9), 5, UnixMillis(NOW)));
        assert_eq!(check(&limiter, &store, &[Probe::new(0, 9)], NOW).retry_at(), Some(UnixMillis(NOW + 100)));
    }

    /// Two VMs (workers) on one store: the bucket holds across them, whatever the interleaving.
    #[test]
    fn exact_across_workers() {
        let config = config(&bucket_rule("b", 10, "1s", 5, ""));
        let (a, b) = (Limiter::new(&config, "t"), Limiter::new(&config, "t"));
        let store = MemoryStore::default();
        let probe = [Probe::new(0, 1)];
        let mut admitted_count = 0;
        for step in 0..400u64 {
            let limiter = if step % 3 == 0 { &a } else { &b };
            if admitted(&check(limiter, &store, &probe, NOW + step * 5)) {
                admitted_count += 1;
            }
        }
        // Arrivals over 0..2 s: 5 at once, then one at each 100 ms up to 1.9 s.
        assert_eq!(admitted_count, 5 + 19);
    }

    /// The bounded table: a flood of one-shot keys neither evicts a key at its limit nor lets
    /// an evicted or non-resident key past its bucket.
    #[test]
    fn a_flood_of_keys_keeps_every_key_within_its_bucket() {
        let rules = r#"{"name":"b","key":["path"],"limit":10,"window":"1s","algorithm":"token_bucket","burst":5,"capacity":4}"#;
        let limiter = Limiter::new(&config(rules), "t");
        let store = MemoryStore::default();
        let heavy = [Probe::new(0, 1)];
        for _ in 0..5 {
            assert!(admitted(&check(&limiter, &store, &heavy, NOW)));
        }
        for n in 0..500u64 {
            check(&limiter, &store, &[Probe::new(0, 1000 + n)], NOW + n % 50);
        }
        assert!(!admitted(&check(&limiter, &store, &heavy, NOW + 50)), "the heavy key's bucket is still empty");
        // Every flooding key that came back at once is refused or within its burst.
        let mut per_key: HashMap<u64, u32> = HashMap::new();
        for round in 0..8u64 {
            for n in 0..40u64 {
                if admitted(&check(&limiter, &store, &[Probe::new(0, 5000 + n)], NOW + 60 + round)) {
                    *per_key.entry(n).or_default() += 1;
                }
            }
        }
        assert!(per_key.values().all(|&count| count <= 5), "{per_key:?}");
    }

    proptest! {
        /// Whatever the arrivals of two keys through two workers, each key's decisions are
        /// those of its own exact bucket (room for every key in the table).
        #[test]
        fn decisions_match_the_exact_bucket(
            arrivals in proptest::collection::vec((0u64..2, 0u64..2, 0u64..80, 1u32..3), 1..200),
        ) {
            let config = config(&bucket_rule("b", 7, "1s", 4, r#","max_delay":"300ms","cost":{"from":"request_header","header":"x-cost"}"#));
            let workers = [Limiter::new(&config, "t"), Limiter::new(&config, "t")];
            let store = MemoryStore::default();
            let reference = Bucket::new(workers[0].tables()[0].window, NonZeroU32::new(7).unwrap(), NonZeroU32::new(4).unwrap(), 300);
            let mut tats = [0u64; 2];
            let mut now = NOW;
            for (worker, key, gap, cost) in arrivals {
                now += gap;
                let probe = Probe { cost, ..Probe::new(0, 100 + key) };
                let verdict = check(&workers[worker as usize], &store, &[probe], now);
                let expected = reference.decide(tats[key as usize], UnixMillis(now), cost, cost);
                match (&verdict, expected) {
                    (Verdict::Admitted { standings, .. }, Turn::Go { tat, at }) => {
                        tats[key as usize] = tat;
                        prop_assert_eq!(standings[0].go_at, Some(at).filter(|at| at.0 > now));
                    }
                    (Verdict::Refused { .. }, Turn::Refuse { retry_at }) => prop_assert_eq!(verdict.retry_at(), retry_at),
                    (got, want) => prop_assert!(false, "{:?} where the bucket says {:?} at {}", got, want, micros(UnixMillis(now))),
                }
            }
        }
    }
}
