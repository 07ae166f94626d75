//! Limiter tests over the in-memory store (Envoy's shared-data semantics), deterministic time.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use super::*;
use crate::store::{Cas, MemoryStore};
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

/// The exact sliding-window counter, one entry per key, as SPEC.md defines it.
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
    #[test]
    fn decisions_match_the_exact_per_key_counter(
        arrivals in proptest::collection::vec((0u64..6, 0u64..700, any::<bool>()), 1..300),
    ) {
        let limiter = Limiter::new(&config(&[rule("a", 5, "1s", 4096), rule("b", 9, "3s", 4096)].join(",")), "t");
        let store = MemoryStore::new();
        let mut reference = Reference::default();
        let mut now = 1_700_000_000_000u64;
        for (key, gap_ms, both) in arrivals {
            now += gap_ms;
            let mut probes = vec![Probe { rule: 0, key_hash: key * 7919 + 1 }];
            if both { probes.push(Probe { rule: 1, key_hash: key * 104_729 + 3 }); }
            let ours = admitted(&limiter.check(&store, &probes, UnixMillis(now), 1));
            prop_assert_eq!(ours, reference.check(&limiter, &probes, UnixMillis(now)), "at {} key {}", now, key);
        }
    }

    /// Retry-After is tight: at `retry_at − 1 ms` the same request is still refused, at
    /// `retry_at` it is admitted (nothing else arriving in between).
    #[test]
    fn retry_at_is_the_first_admitted_millisecond(
        limit in 1u32..20, extra in 1u32..30, start in 0u64..10_000, gap in 0u64..400,
    ) {
        let limiter = Limiter::new(&config(&rule("a", limit, "2s", 64)), "t");
        let store = MemoryStore::new();
        let probes = [Probe { rule: 0, key_hash: 42 }];
        let mut now = 1_700_000_000_000 + start;
        let mut refusal = None;
        for _ in 0..limit + extra {
            now += gap;
            if let v @ Verdict::Rejected { .. } = limiter.check(&store, &probes, UnixMillis(now), 1) {
                refusal = Some((now, v));
                break;
            }
        }
        let Some((at, verdict)) = refusal else { return Ok(()); };
        let retry_at = verdict.retry_at().unwrap();
        prop_assert!(retry_at.0 > at);
        // A refused probe writes nothing, so the second probe sees the same state.
        let probe_store = |t: u64| limiter.check(&store, &probes, UnixMillis(t), 1);
        prop_assert!(!admitted(&probe_store(retry_at.0 - 1)));
        prop_assert!(admitted(&probe_store(retry_at.0)));
    }
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
                    .filter(|_| admitted(&limiter.check(&*store, &[Probe { rule: 0, key_hash: 9 }], now, 1)))
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
        if cas.is_some() && key != crate::store::TOKEN_KEY && self.mismatches.get() > 0 {
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
    let probes = [Probe { rule: 0, key_hash: 5 }];
    let now = UnixMillis(1_700_000_000_000);
    assert!(admitted(&limiter.check(&store, &probes, now, 1)));
    store.mismatches.set(MAX_ATTEMPTS - 1);
    assert!(admitted(&limiter.check(&store, &probes, now, 1)));
    assert_eq!(store.mismatches.get(), 0);
    match limiter.check(&store, &probes, now, 1) {
        Verdict::Admitted { standings, .. } => assert_eq!(standings[0].remaining, 7),
        other => panic!("{other:?}"),
    }
}

#[test]
fn exhausted_attempts_reject_as_contention_and_count_nothing() {
    let limiter = Limiter::new(&config(&rule("a", 10, "1m", 64)), "t");
    let store = Interfering { inner: MemoryStore::new(), mismatches: Cell::new(0) };
    let probes = [Probe { rule: 0, key_hash: 5 }];
    let now = UnixMillis(1_700_000_000_000);
    assert!(admitted(&limiter.check(&store, &probes, now, 1)));
    store.mismatches.set(MAX_ATTEMPTS);
    match limiter.check(&store, &probes, now, 1) {
        Verdict::Rejected { violations } => assert_eq!(violations[0].cause, Cause::Contention),
        other => panic!("{other:?}"),
    }
    match limiter.check(&store, &probes, now, 1) {
        Verdict::Admitted { standings, .. } => assert_eq!(standings[0].remaining, 8, "the contended request was not counted"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_refused_request_consumes_no_quota_of_any_rule() {
    let limiter = Limiter::new(&config(&[rule("wide", 100, "1m", 64), rule("narrow", 2, "1m", 64)].join(",")), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    let both = [Probe { rule: 0, key_hash: 1 }, Probe { rule: 1, key_hash: 2 }];
    assert!(admitted(&limiter.check(&store, &both, now, 1)));
    assert!(admitted(&limiter.check(&store, &both, now, 1)));
    for _ in 0..5 {
        match limiter.check(&store, &both, now, 1) {
            Verdict::Rejected { violations } => {
                assert_eq!(violations.len(), 1);
                assert_eq!(violations[0].standing.rule, 1);
                assert_eq!(violations[0].cause, Cause::OverLimit);
            }
            other => panic!("{other:?}"),
        }
    }
    match limiter.check(&store, &both[..1], now, 1) {
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
                let other = [Probe { rule: 1, key_hash: 2 }];
                assert!(admitted(&self.limiter.check(&self.inner, &other, UnixMillis(1_700_000_000_000), 1)));
            }
            self.inner.set(key, value, cas)
        }
    }
    let limiter = Limiter::new(&config(&[rule("wide", 100, "1m", 64), rule("narrow", 1, "1m", 64)].join(",")), "t");
    let store = Racing { inner: MemoryStore::new(), limiter: &limiter, armed: Cell::new(true) };
    let now = UnixMillis(1_700_000_000_000);
    let both = [Probe { rule: 0, key_hash: 1 }, Probe { rule: 1, key_hash: 2 }];
    match limiter.check(&store, &both, now, 1) {
        Verdict::Rejected { violations } => assert_eq!(violations[0].standing.rule, 1),
        other => panic!("{other:?}"),
    }
    match limiter.check(&store.inner, &both[..1], now, 1) {
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
            if admitted(&limiter.check(&store, &[Probe { rule: 0, key_hash: hash }], now, 1)) {
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
    // starve it; Space-Saving bounds its over-count by about 50 / 4.
    let limiter = Limiter::new(&config(&rule("a", 50, "1h", 64)), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    let steady = [Probe { rule: 0, key_hash: 1 }];
    let mut steady_admitted = 0;
    for i in 0..40u64 {
        if admitted(&limiter.check(&store, &steady, now, 1)) {
            steady_admitted += 1;
        }
        for j in 0..20u64 {
            let flood_key = (i * 20 + j + 7).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            limiter.check(&store, &[Probe { rule: 0, key_hash: flood_key }], now, 1);
        }
    }
    assert_eq!(steady_admitted, 40);
    match limiter.check(&store, &steady, now, 1) {
        Verdict::Admitted { standings, .. } => {
            let excess = standings[0].estimate - 41.0;
            assert!((0.0..=16.0).contains(&excess), "over-count {excess}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_over_count_of_a_flooded_set_is_bounded_by_the_flood_over_the_ways() {
    // The worst case: a single set of 4 entries and 400 one-off keys. Space-Saving's bound is
    // 400 / 4 = 100 (the floor), whatever the order.
    let limiter = Limiter::new(&config(&rule("a", 1000, "1h", 4)), "t");
    let store = MemoryStore::new();
    let now = UnixMillis(1_700_000_000_000);
    for key in 0..400u64 {
        limiter.check(&store, &[Probe { rule: 0, key_hash: 10 + key }], now, 1);
    }
    match limiter.check(&store, &[Probe { rule: 0, key_hash: 5 }], now, 1) {
        Verdict::Admitted { standings, .. } => {
            let excess = standings[0].estimate - 1.0;
            assert!((1.0..=100.0).contains(&excess), "over-count {excess}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_corrupt_record_is_not_trusted_and_gets_replaced() {
    let limiter = Limiter::new(&config(&rule("a", 2, "1m", 4)), "t");
    let store = MemoryStore::new();
    let key = format!("{}0", limiter.tables()[0].key_prefix);
    store.set(&key, b"\x01garbage", None).unwrap();
    let probes = [Probe { rule: 0, key_hash: 8 }];
    let now = UnixMillis(1_700_000_000_000);
    assert!(admitted(&limiter.check(&store, &probes, now, 1)));
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
    assert_ne!(prefix(&a), prefix(&c));
    assert_eq!(prefix(&a), prefix(&d), "a new limit applies to the existing counters");
}
