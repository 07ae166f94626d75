//! Deterministic tests of cluster selection: injected time and random source, the in-memory
//! store with Envoy's CAS semantics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic, clippy::cast_precision_loss)]

use super::buckets::{Buckets, Tally};
use super::limit::{Aimd, Sample};
use super::grade::{flags, Ending, Grade};
use super::record::ClusterRecord;
use super::shuffle::weighted_shuffle;
use crate::primitives::hash::{Random, SplitMix64};
use super::*;
use crate::config::{Config, StatusMatch};
use crate::primitives::inflight::{HEARTBEAT_MS, STALE_AFTER_MS};
use crate::primitives::record::DecodeError;
use crate::primitives::store::{MemoryStore, SharedStore, StoreError, Stored};
use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;

const T0: MonoMillis = MonoMillis(1_700_000_000_000);

fn tally(finished: u32, succeeded: u32) -> Tally {
    Tally { finished, succeeded }
}

fn selector(json: &str) -> Selector {
    let config = Config::parse(format!(r#"{{"cluster_selection":{json}}}"#).as_bytes()).unwrap();
    Selector::new(config.cluster_selection.as_ref().unwrap(), "test")
}

fn locals(n: usize) -> Vec<LocalCount> {
    (0..n).map(|_| Rc::default()).collect()
}

/// VM `id` holding the permit counts `locals`, with nothing pending and no recent weights.
fn vm(id: u64, locals: &[LocalCount]) -> VmState {
    VmState::new(id, locals.to_vec())
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

// ---- success rate and weight: every case of the published algorithm ----

#[test]
fn success_rate_weights_newer_buckets_by_the_decay_factor() {
    let mut buckets = Buckets::new(6, 0);
    buckets.recent[0] = tally(10, 10); // newest: all good
    buckets.recent[1] = tally(10, 0); // one older: all failed
    buckets.recent[5] = tally(30, 0);
    // (10 + 0/3 + 0/243) / (10 + 10/3 + 30/243)
    let expected = 10.0 / (10.0 + 10.0 / 3.0 + 30.0 / 243.0);
    assert!(close(buckets.success_rate(3.0, 0.0), expected));
    // Decay 1 is the plain ratio.
    assert!(close(buckets.success_rate(1.0, 0.0), 10.0 / 50.0));
    // The sticky bucket is ignored while the window has data.
    buckets.sticky = tally(5, 0);
    assert!(close(buckets.success_rate(3.0, 0.5), expected));
}

#[test]
fn success_rate_from_the_sticky_bucket_is_floored() {
    let mut buckets = Buckets::new(6, 0);
    buckets.sticky = tally(4, 1);
    assert!(close(buckets.success_rate(3.0, 0.0001 / 3.0), 0.25));
    buckets.sticky = tally(4, 0);
    assert!(close(buckets.success_rate(3.0, 0.0001 / 3.0), 0.0001 / 3.0), "0% is floored");
    // Without the sticky bucket, a window with data at 0% has no floor.
    let mut failing = Buckets::new(6, 0);
    failing.recent[2] = tally(7, 0);
    assert_eq!(failing.success_rate(3.0, 0.0001), 0.0);
}

#[test]
fn success_rate_without_any_data_is_one() {
    assert_eq!(Buckets::new(6, 0).success_rate(3.0, 0.0001), 1.0);
}

#[test]
fn weight_is_the_rate_cubed_by_default() {
    let s = selector(r#"{"clusters":["a","b","c"]}"#);
    assert!(close(s.weight(0.5), 0.125));
    assert!(close(s.weight(1.0), 1.0));
    assert_eq!(s.weight(0.0), 0.0);
    let squared = selector(r#"{"clusters":["a"],"weight_exponent":2}"#);
    assert!(close(squared.weight(0.5), 0.25));
    // The floor is divided by the number of clusters.
    let mut record = ClusterRecord::new(6, 0, 20);
    record.buckets.sticky = tally(3, 0);
    assert!(close(s.success_rate(&record), 0.0001 / 3.0));
}

// ---- bucket ageing and the sticky copy ----

#[test]
fn ageing_shifts_one_bucket_per_width_and_copies_data_to_sticky() {
    let mut buckets = Buckets::new(3, 100);
    buckets.record(true);
    buckets.record(false);
    assert_eq!(buckets.recent, vec![tally(2, 1), tally(0, 0), tally(0, 0)]);
    buckets.advance_to(101);
    buckets.record(true);
    assert_eq!(buckets.recent, vec![tally(1, 1), tally(2, 1), tally(0, 0)]);
    assert_eq!(buckets.sticky, tally(0, 0), "the empty oldest bucket left nothing");
    buckets.advance_to(102);
    assert_eq!(buckets.recent, vec![tally(0, 0), tally(1, 1), tally(2, 1)]);
    buckets.advance_to(103);
    assert_eq!(buckets.sticky, tally(2, 1), "the oldest bucket held data: copied");
    assert_eq!(buckets.recent, vec![tally(0, 0), tally(0, 0), tally(1, 1)]);
    buckets.advance_to(104);
    assert_eq!(buckets.sticky, tally(1, 1));
    buckets.advance_to(105);
    assert_eq!(buckets.sticky, tally(1, 1), "an empty bucket ageing out keeps the sticky data");
    assert_eq!(buckets.recent, vec![tally(0, 0); 3]);
    assert_eq!(buckets.success_rate(3.0, 0.0), 1.0, "sticky 1/1");
}

#[test]
fn a_long_gap_ages_everything_out_and_keeps_the_newest_data() {
    let mut buckets = Buckets::new(3, 0);
    buckets.recent = vec![tally(1, 1), tally(0, 0), tally(9, 0)];
    buckets.advance_to(1_000_000);
    assert_eq!(buckets.recent, vec![tally(0, 0); 3]);
    assert_eq!(buckets.sticky, tally(1, 1), "the newest bucket with data aged out last");
    assert_eq!(buckets.epoch, 1_000_000);
}

#[test]
fn a_clock_step_backwards_changes_nothing() {
    let mut buckets = Buckets::new(3, 50);
    buckets.record(true);
    buckets.advance_to(49);
    assert_eq!(buckets.epoch, 50);
    assert_eq!(buckets.recent[0], tally(1, 1));
}

// ---- the shuffle ----

fn chi_square(observed: &[u64], expected: &[f64]) -> f64 {
    observed
        .iter()
        .zip(expected)
        .map(|(o, e)| {
            let d = *o as f64 - e;
            d * d / e
        })
        .sum()
}

#[test]
fn the_shuffle_draws_every_order_with_its_exact_probability() {
    let weights = [1.0, 0.5f64.powi(3), 0.2f64.powi(3)];
    let total: f64 = weights.iter().sum();
    let mut rng = SplitMix64::new(42);
    let draws = 200_000u64;
    let mut counts: HashMap<Vec<usize>, u64> = HashMap::new();
    let mut order = Vec::new();
    for _ in 0..draws {
        weighted_shuffle(&weights, &mut rng, &mut order);
        *counts.entry(order.clone()).or_default() += 1;
    }
    let perms = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
    let mut observed = Vec::new();
    let mut expected = Vec::new();
    for p in perms {
        let first = weights[p[0]] / total;
        let second = weights[p[1]] / (total - weights[p[0]]);
        expected.push(first * second * draws as f64);
        observed.push(counts.get(p.as_slice()).copied().unwrap_or(0));
    }
    // 5 degrees of freedom: P(χ² > 20.5) ≈ 0.001.
    let statistic = chi_square(&observed, &expected);
    assert!(statistic < 20.5, "χ² = {statistic}: observed {observed:?}, expected {expected:?}");
}

#[test]
fn zero_weights_come_last_in_uniform_order() {
    let mut rng = SplitMix64::new(7);
    let mut order = Vec::new();
    let mut last = [0u64; 4];
    for _ in 0..40_000 {
        weighted_shuffle(&[0.0, 2.0, 0.0, f64::NAN], &mut rng, &mut order);
        assert_eq!(order[0], 1, "the only weighted cluster always comes first");
        last[order[3]] += 1;
    }
    assert_eq!(last[1], 0);
    // The three zero-weight clusters share the last place evenly (2 degrees of freedom).
    let observed = [last[0], last[2], last[3]];
    let statistic = chi_square(&observed, &[40_000.0 / 3.0; 3]);
    assert!(statistic < 13.8, "χ² = {statistic}: {observed:?}");
}

#[test]
fn splitmix_is_deterministic_and_spread() {
    let mut a = SplitMix64::new(1);
    let mut b = SplitMix64::new(1);
    assert_eq!(a.next_u64(), b.next_u64());
    let mean: f64 = (0..100_000).map(|_| a.next_unit()).sum::<f64>() / 100_000.0;
    assert!((mean - 0.5).abs() < 0.01, "{mean}");
}

// ---- AIMD ----

fn aimd() -> Aimd {
    Aimd { initial: 20, min: 2, max: 30, backoff_ratio: 0.9, timeout_ms: 100 }
}

#[test]
fn aimd_grows_by_one_only_when_half_the_limit_is_in_use() {
    let limit = aimd();
    assert_eq!(limit.update(20, 10, Sample::Success), 21);
    assert_eq!(limit.update(20, 9, Sample::Success), 20, "mostly idle: no growth");
    assert_eq!(limit.update(30, 30, Sample::Success), 30, "bounded by max");
}

#[test]
fn aimd_backs_off_multiplicatively_on_a_drop() {
    let limit = aimd();
    assert_eq!(limit.update(20, 1, Sample::Dropped), 18);
    assert_eq!(limit.update(10, 1, Sample::Dropped), 9);
    assert_eq!(limit.update(2, 1, Sample::Dropped), 2, "bounded by min");
    let mut value = 30;
    for _ in 0..50 {
        value = limit.update(value, 1, Sample::Dropped);
    }
    assert_eq!(value, 2);
    assert_eq!(limit.update(17, 17, Sample::Ignored), 17, "ignored samples do not move it");
    assert_eq!(limit.clamp(500), 30);
    assert_eq!(limit.clamp(0), 2);
}

// ---- grades ----

#[test]
fn grades_by_status_flags_and_time() {
    let fail = [StatusMatch::Class(5), StatusMatch::Code(429)];
    let classify = |status: Option<u16>, flags: u64, latency_ms: u64| {
        Grade::classify(&Ending { status, flags, latency_ms: Some(latency_ms) }, &fail, 1000)
    };
    assert_eq!(classify(Some(200), 0, 10), Grade::Success);
    assert_eq!(classify(Some(404), 0, 10), Grade::Success);
    assert_eq!(classify(Some(429), 0, 10), Grade::Failure);
    assert_eq!(classify(Some(500), 0, 10), Grade::Failure);
    assert_eq!(classify(Some(503), flags::UPSTREAM_CONNECTION_FAILURE, 10), Grade::Failure);
    assert_eq!(classify(Some(503), flags::NO_CLUSTER_FOUND, 1), Grade::Failure);
    assert_eq!(classify(Some(200), flags::UPSTREAM_REMOTE_RESET, 10), Grade::Failure, "reset mid-body");
    assert_eq!(classify(Some(504), flags::UPSTREAM_REQUEST_TIMEOUT, 1500), Grade::Timeout);
    assert_eq!(classify(Some(504), 0, 10), Grade::Timeout);
    assert_eq!(classify(None, flags::UPSTREAM_REQUEST_TIMEOUT, 10), Grade::Timeout);
    assert_eq!(classify(Some(200), 0, 1001), Grade::Slow);
    assert_eq!(classify(None, 0x4000, 10), Grade::Ignored, "client left (DC)");
    assert_eq!(classify(Some(503), flags::UPSTREAM_OVERFLOW, 1), Grade::Overflow, "circuit breaker (UO)");
    assert_eq!(Grade::Overflow.tally(), Some(false), "a failure for the success rate");
    assert_eq!(Grade::Overflow.sample(), Sample::Dropped, "and the limit backs off");
    let no_headers = Ending { status: Some(200), flags: 0, latency_ms: None };
    assert_eq!(Grade::classify(&no_headers, &fail, 1000), Grade::Success, "no latency: not slow");
    assert_eq!(Grade::Slow.tally(), Some(true));
    assert_eq!(Grade::Slow.sample(), Sample::Dropped);
    assert_eq!(Grade::Timeout.tally(), Some(false));
    assert_eq!(Grade::Failure.sample(), Sample::Ignored);
    assert_eq!(Grade::Ignored.tally(), None);
}

// ---- the record ----

#[test]
fn records_round_trip_and_refuse_anything_malformed() {
    let mut record = ClusterRecord::new(6, 123, 17);
    record.buckets.record(true);
    record.buckets.sticky = tally(4, 3);
    assert!(record.in_flight.publish(9, 3, T0));
    let bytes = record.encode();
    assert_eq!(ClusterRecord::decode(&bytes, 6), Ok(record.clone()));
    assert_eq!(ClusterRecord::decode(&bytes, 5), Err(DecodeError::Malformed), "another layout");
    for cut in 0..bytes.len() {
        assert!(ClusterRecord::decode(&bytes[..cut], 6).is_err(), "truncated at {cut}");
    }
    let mut padded = bytes.clone();
    padded.push(0);
    assert!(ClusterRecord::decode(&padded, 6).is_err());
    let mut version = bytes.clone();
    version[0] = 9;
    assert!(ClusterRecord::decode(&version, 6).is_err());
    let mut impossible = bytes.clone();
    impossible[16..20].copy_from_slice(&0u32.to_le_bytes()); // newest finished 0 < succeeded 1
    assert!(ClusterRecord::decode(&impossible, 6).is_err());
}

// ---- the cascade on a shared store ----

#[test]
fn the_cascade_takes_the_next_cluster_with_room_then_fails_fast() {
    let s = selector(r#"{"clusters":["a","b","c"],"concurrency_limit":{"initial_limit":2,"min_limit":1,"max_limit":5}}"#);
    let store = MemoryStore::new();
    let mut mine = vm(1, &locals(3));
    let mut rng = SplitMix64::new(3);
    let mut permits = Vec::new();
    for _ in 0..6 {
        permits.push(s.choose(&store, &mut mine, T0, &mut rng).unwrap());
    }
    let per_cluster: Vec<usize> = (0..3).map(|c| permits.iter().filter(|l| l.cluster == c).count()).collect();
    assert_eq!(per_cluster, vec![2, 2, 2], "each cluster up to its limit");
    let exhausted = s.choose(&store, &mut vm(2, &locals(3)), T0, &mut rng).unwrap_err();
    assert_eq!(exhausted.clusters, vec![Some((2, 2)); 3]);
    assert!(!exhausted.contention);
    // One release makes room again, on that cluster only.
    let permit = permits.pop().unwrap();
    let freed = permit.cluster;
    let done = s.finish(&store, &mut mine, permit, Grade::Failure, T0);
    assert!(done.recorded);
    let again = s.choose(&store, &mut mine, T0, &mut rng).unwrap();
    assert_eq!(again.cluster, freed);
    permits.push(again);
    for permit in permits {
        s.finish(&store, &mut mine, permit, Grade::Ignored, T0);
    }
    assert!(mine.permits.iter().all(|l| l.in_use() == 0));
    let states = s.heartbeat(&store, &mut mine, T0);
    assert!(states.iter().all(|st| st.unwrap().in_flight == 0));
}

#[test]
fn permits_are_exact_across_vms_and_a_dead_vm_stops_counting() {
    let s = selector(r#"{"clusters":["only"],"concurrency_limit":{"initial_limit":3,"min_limit":3,"max_limit":3}}"#);
    let store = MemoryStore::new();
    let (mut one, mut two) = (vm(1, &locals(1)), vm(2, &locals(1)));
    let mut rng = SplitMix64::new(5);
    let a = s.choose(&store, &mut one, T0, &mut rng).unwrap();
    let b = s.choose(&store, &mut two, T0, &mut rng).unwrap();
    let c = s.choose(&store, &mut one, T0, &mut rng).unwrap();
    assert_eq!((a.in_flight, b.in_flight, c.in_flight), (1, 2, 3));
    assert!(
        s.choose(&store, &mut two, T0, &mut rng).is_err(),
        "3 of 3 taken across two VMs"
    );
    // VM 1 dies holding two permits (never finished, never heartbeats again).
    std::mem::forget(a);
    std::mem::forget(c);
    let later = T0.plus_ms(STALE_AFTER_MS / 2);
    s.heartbeat(&store, &mut two, later);
    assert!(
        s.choose(&store, &mut two, later, &mut rng).is_err(),
        "still counted before it is stale"
    );
    let stale = T0.plus_ms(STALE_AFTER_MS + 1);
    let d = s.choose(&store, &mut two, stale, &mut rng).unwrap();
    assert_eq!(d.in_flight, 2, "only VM 2's permits count");
    s.finish(&store, &mut two, d, Grade::Success, stale);
    s.finish(&store, &mut two, b, Grade::Success, stale);
    assert_eq!(
        s.heartbeat(&store, &mut two, stale)[0].unwrap().in_flight,
        0
    );
}

#[test]
fn a_dropped_permit_gives_its_unit_back_and_the_heartbeat_publishes_it() {
    let s = selector(r#"{"clusters":["only"],"concurrency_limit":{"initial_limit":1,"min_limit":1,"max_limit":1}}"#);
    let store = MemoryStore::new();
    let mut mine = vm(1, &locals(1));
    let mut rng = SplitMix64::new(5);
    let permit = s.choose(&store, &mut mine, T0, &mut rng).unwrap();
    drop(permit);
    assert_eq!(mine.permits[0].in_use(), 0);
    assert!(
        s.choose(&store, &mut vm(2, &locals(1)), T0, &mut rng)
            .is_err(),
        "the record still says 1"
    );
    assert_eq!(s.heartbeat(&store, &mut mine, T0)[0].unwrap().in_flight, 0);
    assert!(s
        .choose(&store, &mut vm(2, &locals(1)), T0, &mut rng)
        .is_ok());
}

#[test]
fn finishing_records_the_grade_and_moves_the_limit() {
    let s = selector(
        r#"{"clusters":["a"],"concurrency_limit":{"initial_limit":20,"min_limit":1,"max_limit":40,"timeout":"1s"}}"#,
    );
    let store = MemoryStore::new();
    let mut mine = vm(1, &locals(1));
    let mut rng = SplitMix64::new(5);
    let mut finish = |grade: Grade| {
        let permit = s.choose(&store, &mut mine, T0, &mut rng).unwrap();
        s.finish(&store, &mut mine, permit, grade, T0)
    };
    finish(Grade::Timeout);
    finish(Grade::Failure);
    finish(Grade::Slow);
    finish(Grade::Ignored);
    let view = s.read(&store, 0, T0).unwrap();
    assert_eq!(view.record.buckets.recent[0], tally(3, 1), "ignored is not counted");
    assert_eq!(view.record.limit, 16, "20 → 18 (timeout) → 18 (failure) → ⌊16.2⌋ (slow) → 16 (ignored)");
    // Growth needs half the limit in use: hold 8 permits, then succeed.
    let held: Vec<_> = (0..7)
        .map(|_| s.choose(&store, &mut mine, T0, &mut rng).unwrap())
        .collect();
    let permit = s.choose(&store, &mut mine, T0, &mut rng).unwrap();
    assert_eq!(permit.in_flight, 8);
    s.finish(&store, &mut mine, permit, Grade::Success, T0);
    assert_eq!(
        s.read(&store, 0, T0).unwrap().record.limit,
        16,
        "a success waits in the VM's pending tally"
    );
    assert_eq!(mine.pending[0].finished(), 1);
    s.heartbeat(&store, &mut mine, T0);
    assert!(mine.pending[0].is_empty(), "the heartbeat writes it");
    let view = s.read(&store, 0, T0).unwrap();
    assert_eq!(view.record.limit, 17, "8 × 2 ≥ 16: grows by one");
    assert_eq!(view.record.buckets.recent[0], tally(4, 2));
    for permit in held {
        s.finish(&store, &mut mine, permit, Grade::Ignored, T0);
    }
    let permit = s.choose(&store, &mut mine, T0, &mut rng).unwrap();
    let answered_after = |ms| Timing { request_end: Some(T0), response_headers: Some(T0.plus_ms(ms)) };
    assert_eq!(s.classify(&permit, Some(200), 0, answered_after(1001)), Grade::Slow);
    assert_eq!(s.classify(&permit, Some(200), 0, answered_after(999)), Grade::Success);
    assert_eq!(s.classify(&permit, Some(502), 0, answered_after(0)), Grade::Failure);
    s.finish(&store, &mut mine, permit, Grade::Success, T0);
}

/// Runs `requests` requests at `rate_per_sec` through the selector, each finishing at once with
/// the grade `health(cluster, now)` gives, with the VM's heartbeat every second as in Envoy;
/// returns the requests per cluster.
fn traffic(
    s: &Selector,
    store: &MemoryStore,
    rng: &mut SplitMix64,
    start: MonoMillis,
    requests: u64,
    rate_per_sec: u64,
    health: impl Fn(&str) -> Grade,
) -> Vec<u64> {
    let mut state = vm(1, &locals(s.clusters.len()));
    let mut per_cluster = vec![0u64; s.clusters.len()];
    let mut next_tick = start.plus_ms(HEARTBEAT_MS);
    for i in 0..requests {
        let now = start.plus_ms(i * 1000 / rate_per_sec);
        if now >= next_tick {
            s.heartbeat(store, &mut state, now);
            next_tick = now.plus_ms(HEARTBEAT_MS);
        }
        let permit = s.choose(store, &mut state, now, rng).unwrap();
        per_cluster[permit.cluster] += 1;
        let grade = health(s.clusters[permit.cluster].name.as_str());
        s.finish(store, &mut state, permit, grade, now);
    }
    s.heartbeat(store, &mut state, start.plus_ms(requests * 1000 / rate_per_sec));
    per_cluster
}

#[test]
fn a_failing_cluster_loses_its_traffic_and_wins_it_back_when_it_recovers() {
    // A floor of 0.03 gives c (sticky data only) a weight of 0.01: about one request a second at
    // 200 requests/s (with the default 0.0001 it would take some 15 minutes at this rate).
    let s = selector(r#"{"clusters":["a","b","c"],"no_data_floor":0.03}"#);
    let store = MemoryStore::new();
    let mut rng = SplitMix64::new(11);
    let bad_c = |name: &str| if name == "c" { Grade::Failure } else { Grade::Success };
    // 10 s at 200 requests/s while c fails everything: after the first second c gets ≲1%.
    traffic(&s, &store, &mut rng, T0, 200, 200, bad_c);
    let counts = traffic(&s, &store, &mut rng, T0.plus_ms(1000), 1800, 200, bad_c);
    let share = counts[2] as f64 / 1800.0;
    assert!(share < 0.01, "failing cluster share {share} ({counts:?})");
    // c recovers. Its window must age out (6 × 5 s) before the sticky floor lets it back in;
    // once one request succeeds, it is competitive again.
    let healthy = |_: &str| Grade::Success;
    let mut back_at = None;
    for second in 10..120u64 {
        let counts = traffic(&s, &store, &mut rng, T0.plus_ms(second * 1000), 200, 200, healthy);
        if counts[2] >= 40 {
            back_at = Some(second);
            break;
        }
    }
    let back_at = back_at.expect("c never won its share back");
    // c's last request was in the first seconds; its window (6 × 5 s, epoch-aligned) ages out
    // 25 to 35 s later, then a probe within a few seconds at this floor.
    assert!((25..=45).contains(&back_at), "c back to ≥ 20% of traffic after {back_at} s");
}

#[test]
fn the_floor_bounds_the_weight_unless_configured_for_the_rate_only() {
    let mut record = ClusterRecord::new(6, 0, 20);
    record.buckets.sticky = tally(10, 0);
    let on_weight = selector(r#"{"clusters":["a","b"]}"#);
    assert!(close(on_weight.success_rate(&record), 0.00005));
    assert!(close(on_weight.record_weight(&record), 0.00005));
    let on_rate = selector(r#"{"clusters":["a","b"],"no_data_floor_on":"rate"}"#);
    assert!(close(on_rate.record_weight(&record), 0.00005f64.powi(3)));
    // In the window, a 0% rate has weight 0 either way: it is only a fallback.
    record.buckets.record(false);
    assert_eq!(on_weight.record_weight(&record), 0.0);
}

#[test]
fn a_slow_cluster_s_limit_falls_and_the_others_take_the_load() {
    let s = selector(
        r#"{"clusters":["a","slow"],"concurrency_limit":{"initial_limit":10,"min_limit":1,"max_limit":50,"timeout":"100ms"}}"#,
    );
    let store = MemoryStore::new();
    let mut rng = SplitMix64::new(13);
    let mut mine = vm(1, &locals(2));
    for i in 0..500u64 {
        let now = T0.plus_ms(i);
        let permit = s.choose(&store, &mut mine, now, &mut rng).unwrap();
        let grade = if permit.cluster == 1 {
            Grade::Slow
        } else {
            Grade::Success
        };
        s.finish(&store, &mut mine, permit, grade, now);
    }
    assert_eq!(s.read(&store, 1, T0.plus_ms(500)).unwrap().record.limit, 1, "slow cluster at min_limit");
    // With one permit held on the slow cluster, every further request goes to `a`.
    let held = loop {
        let permit = s
            .choose(&store, &mut mine, T0.plus_ms(600), &mut rng)
            .unwrap();
        if permit.cluster == 1 {
            break permit;
        }
        s.finish(&store, &mut mine, permit, Grade::Success, T0.plus_ms(600));
    };
    for _ in 0..100 {
        let permit = s
            .choose(&store, &mut mine, T0.plus_ms(601), &mut rng)
            .unwrap();
        assert_eq!(permit.cluster, 0);
        s.finish(&store, &mut mine, permit, Grade::Success, T0.plus_ms(601));
    }
    s.finish(&store, &mut mine, held, Grade::Slow, T0.plus_ms(700));
}

#[test]
fn a_record_from_another_layout_or_corrupt_reads_as_fresh() {
    let s = selector(r#"{"clusters":["a"]}"#);
    let store = MemoryStore::new();
    store
        .set(s.record_key(0).unwrap(), b"garbage", None)
        .unwrap();
    let mut mine = vm(1, &locals(1));
    let mut rng = SplitMix64::new(1);
    let permit = s.choose(&store, &mut mine, T0, &mut rng).unwrap();
    assert_eq!(permit.in_flight, 1);
    s.finish(&store, &mut mine, permit, Grade::Success, T0);
    s.heartbeat(&store, &mut mine, T0);
    let view = s.read(&store, 0, T0).unwrap();
    assert_eq!(view.record.buckets.recent[0], tally(1, 1));
    assert_eq!(view.record.limit, 20);
}

/// Counts the reads that reach the store.
struct CountingStore {
    inner: MemoryStore,
    gets: Cell<u32>,
}

impl SharedStore for CountingStore {
    fn get(&self, key: &str) -> Result<Option<Stored>, StoreError> {
        self.gets.set(self.gets.get() + 1);
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<crate::primitives::store::Cas>) -> Result<(), StoreError> {
        self.inner.set(key, value, cas)
    }
}

#[test]
fn recent_weights_spare_reading_every_record_on_every_request() {
    let s = selector(r#"{"clusters":["a","b","c","d"]}"#);
    let store = CountingStore { inner: MemoryStore::new(), gets: Cell::new(0) };
    let mut state = vm(1, &locals(4));
    let mut rng = SplitMix64::new(2);
    let first = s.choose(&store, &mut state, T0, &mut rng).unwrap();
    let cold = store.gets.get();
    assert!(cold >= 4, "the first choice reads every record ({cold} reads)");
    store.gets.set(0);
    let second = s.choose(&store, &mut state, T0.plus_ms(WEIGHT_TTL_MS - 1), &mut rng).unwrap();
    assert!(store.gets.get() <= 2, "within the TTL only the chosen record is read ({} reads)", store.gets.get());
    store.gets.set(0);
    let third = s
        .choose(&store, &mut state, T0.plus_ms(WEIGHT_TTL_MS), &mut rng)
        .unwrap();
    // Every weight older than the TTL is read again (the second choice's own read refreshed one).
    assert!(
        store.gets.get() >= 3,
        "stale weights are read again ({} reads)",
        store.gets.get()
    );
    for permit in [first, second, third] {
        s.finish(&store, &mut state, permit, Grade::Success, T0);
    }
}

#[test]
fn a_finish_on_this_vm_updates_its_weight_at_once() {
    let s = selector(r#"{"clusters":["a","b"]}"#);
    let store = MemoryStore::new();
    let mut state = vm(1, &locals(2));
    let mut rng = SplitMix64::new(9);
    let permit = s.choose(&store, &mut state, T0, &mut rng).unwrap();
    let failed = permit.cluster;
    s.finish(&store, &mut state, permit, Grade::Failure, T0);
    // Within the TTL, the failed cluster (weight 0 now) is never chosen first again.
    for i in 0..50 {
        let permit = s.choose(&store, &mut state, T0.plus_ms(i), &mut rng).unwrap();
        assert_ne!(permit.cluster, failed);
        s.finish(&store, &mut state, permit, Grade::Success, T0.plus_ms(i));
    }
}

// ---- reserves and pending grades ----

#[test]
fn far_below_the_limit_permits_come_from_a_reserve_and_successes_wait() {
    let s = selector(
        r#"{"clusters":["a"],"concurrency_limit":{"initial_limit":200,"min_limit":1,"max_limit":200}}"#,
    );
    let store = CountingStore {
        inner: MemoryStore::new(),
        gets: Cell::new(0),
    };
    let mut one = vm(1, &locals(1));
    let mut rng = SplitMix64::new(4);
    let held: Vec<_> = (0..50)
        .map(|_| s.choose(&store, &mut one, T0, &mut rng).unwrap())
        .collect();
    assert!(
        store.gets.get() <= 12,
        "{} reads for 50 permits",
        store.gets.get()
    );
    assert!(one.permits[0].held() >= 50);
    store.gets.set(0);
    let mut held = held.into_iter();
    for permit in held.by_ref().take(49) {
        s.finish(&store, &mut one, permit, Grade::Success, T0);
    }
    // Successes are counted locally; the VM writes only to give back units it stopped using
    // (once more than RESERVE_MAX of them are idle), with whatever is pending.
    assert!(
        store.gets.get() <= 3,
        "{} reads for 49 successes",
        store.gets.get()
    );
    let last = held.next().unwrap();
    s.finish(&store, &mut one, last, Grade::Success, T0);
    s.heartbeat(&store, &mut one, T0);
    assert!(one.pending[0].is_empty(), "the heartbeat writes everything");
    let view = s.read(&store.inner, 0, T0).unwrap();
    assert_eq!(view.record.buckets.recent[0], tally(50, 50));
    assert_eq!(
        view.record.in_flight.total(T0),
        0,
        "and gives the reserve back"
    );
}

#[test]
fn a_failure_is_written_at_once_with_what_is_pending() {
    let s = selector(
        r#"{"clusters":["a"],"concurrency_limit":{"initial_limit":200,"min_limit":1,"max_limit":200}}"#,
    );
    let store = MemoryStore::new();
    let mut one = vm(1, &locals(1));
    let mut rng = SplitMix64::new(4);
    let permits: Vec<_> = (0..4)
        .map(|_| s.choose(&store, &mut one, T0, &mut rng).unwrap())
        .collect();
    let mut permits = permits.into_iter();
    for permit in permits.by_ref().take(2) {
        s.finish(&store, &mut one, permit, Grade::Success, T0);
    }
    s.finish(
        &store,
        &mut one,
        permits.next().unwrap(),
        Grade::Failure,
        T0.plus_ms(1),
    );
    let view = s.read(&store, 0, T0).unwrap();
    assert_eq!(view.record.buckets.recent[0], tally(3, 2));
    assert_eq!(
        view.record.in_flight.total(T0),
        1,
        "the reserve is given back: only the permit in use counts"
    );
    s.finish(
        &store,
        &mut one,
        permits.next().unwrap(),
        Grade::Success,
        T0,
    );
}

#[test]
fn pending_grades_land_in_the_bucket_they_happened_in() {
    let s = selector(
        r#"{"clusters":["a"],"concurrency_limit":{"initial_limit":200,"min_limit":1,"max_limit":200}}"#,
    );
    let store = MemoryStore::new();
    let mut one = vm(1, &locals(1));
    let mut rng = SplitMix64::new(4);
    let keep = s.choose(&store, &mut one, T0, &mut rng).unwrap();
    let early = s.choose(&store, &mut one, T0, &mut rng).unwrap();
    s.finish(&store, &mut one, early, Grade::Success, T0);
    let later = T0.plus_ms(5_000);
    let late = s.choose(&store, &mut one, later, &mut rng).unwrap();
    s.finish(&store, &mut one, late, Grade::Success, later);
    s.heartbeat(&store, &mut one, later);
    let view = s.read(&store, 0, later).unwrap();
    assert_eq!(view.record.buckets.recent[0], tally(1, 1));
    assert_eq!(view.record.buckets.recent[1], tally(1, 1));
    s.finish(&store, &mut one, keep, Grade::Success, later);
}

#[test]
fn reserves_never_let_two_vms_past_a_cluster_limit() {
    for limit in [1u32, 5, 40, 200] {
        let s = selector(&format!(
            r#"{{"clusters":["a"],"concurrency_limit":{{"initial_limit":{limit},"min_limit":{limit},"max_limit":{limit}}}}}"#
        ));
        let store = MemoryStore::new();
        let (mut one, mut two) = (vm(1, &locals(1)), vm(2, &locals(1)));
        let mut rng = SplitMix64::new(8);
        let mut permits = 0u32;
        let mut kept = Vec::new();
        for i in 0..(3 * limit + 10) {
            let state = if i % 3 == 0 { &mut one } else { &mut two };
            if let Ok(permit) = s.choose(&store, state, T0, &mut rng) {
                permits += 1;
                kept.push(permit);
            }
            let published = s.read(&store, 0, T0).unwrap().record.in_flight.total(T0);
            assert!(published <= limit, "limit {limit}: {published} published");
        }
        assert!(
            permits <= limit && permits + 2 * crate::primitives::inflight::RESERVE_MAX >= limit,
            "limit {limit}: {permits} permits"
        );
        drop(kept);
    }
}

// ---- what "slow" measures, overflows, reserves under a lowered limit ----

#[test]
fn the_upstream_latency_runs_from_the_end_of_the_request_to_the_response_headers() {
    let at = |ms: u64| Some(T0.plus_ms(ms));
    let timing = |request_end, response_headers| Timing { request_end, response_headers };
    // A slow upload: the request ended 6 s after the permit, the upstream answered 10 ms later.
    assert_eq!(timing(at(6_000), at(6_010)).upstream_latency_ms(T0), Some(10));
    // The upstream answered before the request ended (a streaming upload, an early 413).
    assert_eq!(timing(at(9_000), at(50)).upstream_latency_ms(T0), Some(50));
    // An upgraded connection (WebSocket): the request never ends; the 101 came at once.
    assert_eq!(timing(None, at(3)).upstream_latency_ms(T0), Some(3));
    // No response headers (the client left, a reset): no latency to judge.
    assert_eq!(timing(at(1), None).upstream_latency_ms(T0), None);
    // A request that ended before its permit (its body passed before selection) starts at the permit.
    assert_eq!(timing(Some(MonoMillis(0)), at(20)).upstream_latency_ms(T0), Some(20));
}

/// 20 successful requests whose client took 6 s each (a slow reader: the response
/// headers came at once) cut a healthy cluster's limit from 200 to 21 when "slow" was the
/// whole stream. The upstream answered in 5 ms: they are successes.
#[test]
fn slow_clients_do_not_shrink_a_healthy_cluster() {
    let s = selector(
        r#"{"clusters":["a"],"concurrency_limit":{"initial_limit":200,"min_limit":1,"max_limit":200,"timeout":"1s"}}"#,
    );
    let store = MemoryStore::new();
    let mut rng = SplitMix64::new(5);
    let mut mine = vm(1, &locals(1));
    let permits: Vec<_> = (0..20).map(|_| s.choose(&store, &mut mine, T0, &mut rng).unwrap()).collect();
    let stream_end = T0.plus_ms(6_000);
    for permit in permits {
        let timing = Timing { request_end: Some(T0), response_headers: Some(T0.plus_ms(5)) };
        let grade = s.classify(&permit, Some(200), 0, timing);
        assert_eq!(grade, Grade::Success);
        s.finish(&store, &mut mine, permit, grade, stream_end);
    }
    s.heartbeat(&store, &mut mine, stream_end);
    assert_eq!(s.read(&store, 0, stream_end).unwrap().record.limit, 200);
}

/// An overflow (Envoy's circuit breaker, flag UO) backs the limit off as a timeout
/// does, and counts as a failure.
#[test]
fn an_overflow_backs_the_limit_off() {
    let s = selector(
        r#"{"clusters":["a"],"concurrency_limit":{"initial_limit":100,"min_limit":1,"max_limit":200}}"#,
    );
    let store = MemoryStore::new();
    let mut rng = SplitMix64::new(6);
    let mut mine = vm(1, &locals(1));
    let permit = s.choose(&store, &mut mine, T0, &mut rng).unwrap();
    let timing = Timing { request_end: Some(T0), response_headers: Some(T0.plus_ms(1)) };
    let grade = s.classify(&permit, Some(503), flags::UPSTREAM_OVERFLOW, timing);
    assert_eq!(grade, Grade::Overflow);
    let finished = s.finish(&store, &mut mine, permit, grade, T0);
    assert!(finished.recorded, "written at once");
    let record = s.read(&store, 0, T0).unwrap().record;
    assert_eq!(record.limit, 90, "×0.9");
    assert_eq!(record.buckets.recent[0], tally(1, 0), "a failure for the success rate");
}

/// Units a VM reserved under a cluster's limit are not spent past a lower limit
/// that another VM's back-off set, once this VM has read it (within `WEIGHT_TTL_MS`).
#[test]
fn a_reserve_is_not_spent_past_a_limit_another_vm_lowered() {
    let s = selector(
        r#"{"clusters":["a"],"concurrency_limit":{"initial_limit":100,"min_limit":1,"max_limit":200,"backoff_ratio":0.5}}"#,
    );
    let store = MemoryStore::new();
    let mut rng = SplitMix64::new(7);
    let (mine, theirs) = (locals(1), locals(1));
    let (mut one, mut two) = (vm(1, &mine), vm(2, &theirs));
    let mut held = vec![s.choose(&store, &mut one, T0, &mut rng).unwrap()];
    let reserved = mine[0].held();
    assert_eq!(reserved, 1 + crate::primitives::inflight::RESERVE_MAX, "a full reserve far below the limit");
    // VM 2 sees timeouts until the limit is below what VM 1 holds (100, 50, 25, 12).
    while s.read(&store, 0, T0).unwrap().record.limit >= reserved {
        let permit = s.choose(&store, &mut two, T0, &mut rng).unwrap();
        s.finish(&store, &mut two, permit, Grade::Timeout, T0);
    }
    let limit = s.read(&store, 0, T0).unwrap().record.limit;
    assert_eq!(limit, 12);
    // Once VM 1's weight is stale it reads the record, and takes no permit past the new limit.
    let later = T0.plus_ms(WEIGHT_TTL_MS);
    while let Ok(permit) = s.choose(&store, &mut one, later, &mut rng) {
        held.push(permit);
    }
    assert_eq!(held.len() as u32, limit, "{} permits against a limit of {limit}", held.len());
    for permit in held {
        s.finish(&store, &mut one, permit, Grade::Ignored, later);
    }
}

// ---- confinement to a partition (crate::shedding::per_key) ----

fn confinement(members: &[usize], n: usize, spill_below: Option<f64>) -> Confinement {
    Confinement {
        members: members.to_vec(),
        others: (0..n).filter(|i| !members.contains(i)).collect(),
        spill_below,
    }
}

#[test]
fn a_confined_request_stays_in_its_partition_and_is_refused_when_it_is_full() {
    let s = selector(r#"{"clusters":["a","b","c","d"],"concurrency_limit":{"initial_limit":2,"min_limit":1,"max_limit":5}}"#);
    let store = MemoryStore::new();
    let mut mine = vm(1, &locals(4));
    let mut rng = SplitMix64::new(5);
    let within = confinement(&[1, 3], 4, None);
    let permits: Vec<ClusterPermit> = (0..4).map(|_| s.choose_within(&store, &mut mine, T0, &mut rng, &within).unwrap()).collect();
    let per_cluster: Vec<usize> = (0..4).map(|c| permits.iter().filter(|l| l.cluster == c).count()).collect();
    assert_eq!(per_cluster, vec![0, 2, 0, 2]);
    let exhausted = s.choose_within(&store, &mut mine, T0, &mut rng, &within).unwrap_err();
    assert_eq!(exhausted.clusters, vec![None, Some((2, 2)), None, Some((2, 2))], "the others are not even read");
    // Another key's partition still has room.
    let other = s.choose_within(&store, &mut mine, T0, &mut rng, &confinement(&[0, 1], 4, None)).unwrap();
    assert_eq!(other.cluster, 0);
    // A failing member is still used when confined: the weights decide among members only.
    let failing = confinement(&[2], 4, None);
    let permit = s.choose_within(&store, &mut mine, T0, &mut rng, &failing).unwrap();
    s.finish(&store, &mut mine, permit, Grade::Failure, T0);
    assert_eq!(s.choose_within(&store, &mut mine, T0, &mut rng, &failing).unwrap().cluster, 2);
}

#[test]
fn a_spilling_request_borrows_the_others_when_its_partition_is_full_or_failing() {
    let s = selector(r#"{"clusters":["a","b","c"],"concurrency_limit":{"initial_limit":1,"min_limit":1,"max_limit":5}}"#);
    let store = MemoryStore::new();
    let mut mine = vm(1, &locals(3));
    let mut rng = SplitMix64::new(9);
    let within = confinement(&[0], 3, Some(0.5));
    let first = s.choose_within(&store, &mut mine, T0, &mut rng, &within).unwrap();
    assert_eq!(first.cluster, 0, "members first");
    let spilled = s.choose_within(&store, &mut mine, T0, &mut rng, &within).unwrap();
    assert_ne!(spilled.cluster, 0, "full: spills");
    for permit in [first, spilled] {
        s.finish(&store, &mut mine, permit, Grade::Ignored, T0);
    }
    // Member 0 fails: its rate falls below spill_below, the others come first.
    let permit = s.choose_within(&store, &mut mine, T0, &mut rng, &within).unwrap();
    assert_eq!(permit.cluster, 0);
    s.finish(&store, &mut mine, permit, Grade::Failure, T0);
    for _ in 0..20 {
        let permit = s.choose_within(&store, &mut mine, T0, &mut rng, &within).unwrap();
        assert_ne!(permit.cluster, 0, "failing member tried last");
        s.finish(&store, &mut mine, permit, Grade::Ignored, T0);
    }
}
