//! The bounded key table of one rule: memory fixed by `capacity`, whatever the number of keys. A
//! rule owns `capacity / WAYS` shared-data records ("sets"); a key's secret-keyed hash picks its
//! set and is its fingerprint. A set holds, for the previous and the current window bucket,
//! [`WAYS`] exact entries and an overflow for every other key: a ladder of [`DOORS`] doorkeepers
//! (Bloom filters, a key's first units) then a count-min sketch of [`SKETCH_ROWS`] ×
//! [`SKETCH_COLUMNS`] cells with conservative update. Which keys own the entries follows TinyLFU: a
//! newcomer replaces the least frequent resident (frequency: its count over both buckets) only when
//! it beats it by [`PROMOTION_MARGIN`].
//!
//! Invariants: a key's count is never below its true count (an overflow estimate never is, a
//! resident entered at its overflow estimate, and an evicted key's counters go into the overflow),
//! so no quota is looser than configured and no key escapes its limit through eviction; a refused
//! request writes nothing.
//!
//! The overflow's doorkeepers and sketch are in `table/overflow.rs`, the record a set is stored in
//! (and the reading of the previous layout) in `table/record.rs`, a token-bucket rule's sets in
//! `table/gcra.rs`.
//!
//! Rationale: docs/design.md, section "The bounded key table".

mod gcra;
mod overflow;
mod record;

pub use overflow::{Overflow, ABSORBED, DOORS, DOOR_BITS, DOOR_HASHES, SKETCH_COLUMNS, SKETCH_ROWS};
pub use record::{RECORD_LEN, RECORD_LEN_TWO_DOORS, RECORD_VERSION, RECORD_VERSION_TWO_DOORS, SHAPE_OFFSET};

use super::window::{Counts, Window};
use overflow::Spots;

/// Entries per set.
pub const WAYS: usize = 4;
/// How much more frequent than the victim a newcomer must be to take its entry.
pub const PROMOTION_MARGIN: u64 = 2;

/// One key's counters in a set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// The owning key's hash; 0 marks a free entry.
    pub fingerprint: u64,
    /// Its counters.
    pub counts: Counts,
}

impl Entry {
    fn is_free(&self) -> bool {
        self.fingerprint == 0 || self.counts.is_zero()
    }
}

/// A set of [`WAYS`] entries plus the overflow of both buckets, as stored in one shared-data
/// record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Set {
    /// The stamp of the rule definition the set belongs to.
    pub shape: u64,
    /// The window bucket all counters are rolled to.
    pub bucket_index: u64,
    /// The entries.
    pub entries: [Entry; WAYS],
    /// Non-resident counts of the bucket before `bucket_index`.
    pub previous: Overflow,
    /// Non-resident counts of bucket `bucket_index`.
    pub current: Overflow,
}

/// What [`Set::add`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Added {
    /// The key owns an entry now.
    pub resident: bool,
    /// A key with live counts that lost its entry to make room (its counts went to the
    /// overflow).
    pub evicted: Option<Entry>,
}

/// The fingerprint stored for a key hash: never 0, which marks a free entry.
pub fn fingerprint(key_hash: u64) -> u64 {
    key_hash.max(1)
}

/// A key's frequency for admission: its count over both buckets.
fn frequency(counts: Counts) -> u64 {
    u64::from(counts.previous).saturating_add(u64::from(counts.current))
}

impl Set {
    /// An empty set of rule shape `shape` as of `bucket_index`.
    pub fn empty(shape: u64, bucket_index: u64) -> Set {
        Set {
            shape,
            bucket_index,
            ..Set::default()
        }
    }

    /// The set as seen from window bucket `bucket_index` (see [`Counts::rolled`]): one step
    /// moves the current bucket's counts (entries and overflow) to the previous one, two or more
    /// clear them.
    pub fn rolled_to(mut self, bucket_index: u64) -> Set {
        let from = self.bucket_index;
        if bucket_index <= from {
            return self;
        }
        for entry in &mut self.entries {
            entry.counts = entry.counts.rolled(from, bucket_index);
        }
        self.rolled_overflow_to(bucket_index)
    }

    /// A token-bucket set as seen from period `bucket_index`: the overflow rolls as a window's;
    /// entries hold instants, which do not.
    pub fn rolled_overflow_to(mut self, bucket_index: u64) -> Set {
        if bucket_index <= self.bucket_index {
            return self;
        }
        if bucket_index.saturating_sub(self.bucket_index) == 1 {
            self.previous = std::mem::take(&mut self.current);
        } else {
            self.previous = Overflow::default();
            self.current = Overflow::default();
        }
        self.bucket_index = bucket_index;
        self
    }

    /// The counters that stand for `fingerprint`: its own entry's, or its overflow estimates.
    pub fn counts_of(&self, fingerprint: u64) -> Counts {
        match self.owned(fingerprint) {
            Some(index) => self.entry(index).counts,
            None => self.overflow_counts(&Spots::of(fingerprint)),
        }
    }

    /// Whether `fingerprint` owns an entry.
    pub fn is_resident(&self, fingerprint: u64) -> bool {
        self.owned(fingerprint).is_some()
    }

    fn overflow_counts(&self, spots: &Spots) -> Counts {
        Counts {
            previous: self.previous.estimate(spots),
            current: self.current.estimate(spots),
        }
    }

    /// Counts `cost` for `fingerprint` (module doc, "Admission"): on its entry, or by taking an
    /// entry when the key is more frequent than the victim, or in the overflow. `elapsed_ms`
    /// (into the current bucket) breaks ties between victims of equal frequency: the one with
    /// the lower sliding estimate goes.
    pub fn add(&mut self, fingerprint: u64, cost: u32, window: Window, elapsed_ms: u64) -> Added {
        if let Some(index) = self.owned(fingerprint) {
            if let Some(entry) = self.entries.get_mut(index) {
                entry.counts = entry.counts.plus(cost);
            }
            return Added {
                resident: true,
                evicted: None,
            };
        }
        let spots = Spots::of(fingerprint);
        let candidate = self.overflow_counts(&spots).plus(cost);
        let victim = self.victim(window, elapsed_ms);
        let Some(slot) = self.entries.get(victim).copied() else {
            return Added::default();
        };
        let free = slot.is_free();
        if !free && frequency(slot.counts).saturating_add(PROMOTION_MARGIN) > frequency(candidate) {
            self.current.add(&spots, cost);
            return Added::default();
        }
        if !free {
            let evicted = Spots::of(slot.fingerprint);
            self.previous.raise_to(&evicted, slot.counts.previous);
            self.current.raise_to(&evicted, slot.counts.current);
        }
        if let Some(entry) = self.entries.get_mut(victim) {
            *entry = Entry {
                fingerprint,
                counts: candidate,
            };
        }
        Added {
            resident: true,
            evicted: (!free).then_some(slot),
        }
    }

    /// Counts `units` more on `fingerprint`'s entry (units reserved ahead of use); false, and
    /// nothing counted, when it owns none.
    pub fn add_to_entry(&mut self, fingerprint: u64, units: u32) -> bool {
        let Some(index) = self.owned(fingerprint) else { return false };
        match self.entries.get_mut(index) {
            Some(entry) => {
                entry.counts = entry.counts.plus(units);
                true
            }
            None => false,
        }
    }

    /// Takes back `cost` that was counted on `fingerprint`'s entry in window bucket `added_in`,
    /// if the key still owns its entry (counts that went to the overflow stay there: a harmless
    /// over-count).
    pub fn subtract(&mut self, fingerprint: u64, cost: u32, added_in: u64) {
        let Some(index) = self.owned(fingerprint) else { return };
        let Some(entry) = self.entries.get_mut(index) else { return };
        if self.bucket_index == added_in {
            entry.counts.current = entry.counts.current.saturating_sub(cost);
        } else if self.bucket_index == added_in.saturating_add(1) {
            entry.counts.previous = entry.counts.previous.saturating_sub(cost);
        }
    }

    fn owned(&self, fingerprint: u64) -> Option<usize> {
        self.entries.iter().position(|e| e.fingerprint == fingerprint)
    }

    fn entry(&self, index: usize) -> Entry {
        self.entries.get(index).copied().unwrap_or_default()
    }

    /// A free or idle entry if there is one, else the one with the lowest frequency (the lower
    /// sliding estimate among equals).
    fn victim(&self, window: Window, elapsed_ms: u64) -> usize {
        self.entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| {
                (
                    !e.is_free(),
                    frequency(e.counts),
                    window.scaled_estimate(e.counts, elapsed_ms),
                )
            })
            .map_or(0, |(index, _)| index)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;
    use std::num::NonZeroU64;

    fn window() -> Window {
        Window::new(NonZeroU64::new(60_000).unwrap())
    }

    /// A spread of fingerprints (the limiter's are SipHash outputs).
    pub(super) fn key(n: u64) -> u64 {
        fingerprint(n.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17) ^ 0x5555)
    }

    pub(super) fn add(set: &mut Set, fp: u64, cost: u32) -> Added {
        set.add(fp, cost, window(), 0)
    }

    #[test]
    fn owners_count_exactly_and_free_entries_are_used_first() {
        let mut set = Set::empty(0, 0);
        for n in 1..=WAYS as u64 {
            assert_eq!(add(&mut set, key(n), n as u32), Added { resident: true, evicted: None });
        }
        for n in 1..=WAYS as u64 {
            assert_eq!(set.counts_of(key(n)).current, n as u32);
        }
        assert_eq!(set.current, Overflow::default(), "nothing in the overflow");
    }

    #[test]
    fn a_one_shot_newcomer_waits_in_the_overflow_and_a_repeat_takes_an_entry() {
        let mut set = Set::empty(0, 0);
        for n in 1..=WAYS as u64 {
            add(&mut set, key(n), 1);
        }
        // Every entry has frequency 1: a newcomer (1, then 2) does not beat them by 2.
        let newcomer = key(99);
        assert_eq!(add(&mut set, newcomer, 1), Added { resident: false, evicted: None });
        assert_eq!(set.counts_of(newcomer).current, 1, "counted in the overflow, exactly");
        assert_eq!(add(&mut set, newcomer, 1), Added { resident: false, evicted: None });
        assert_eq!(set.counts_of(newcomer).current, 2, "still exactly");
        // Its third request makes it a 3 against 1s: it takes the lowest entry.
        let added = add(&mut set, newcomer, 1);
        assert!(added.resident);
        let evicted = added.evicted.unwrap();
        assert_eq!(evicted.counts.current, 1);
        assert_eq!(set.counts_of(newcomer).current, 3, "its entry starts at its overflow count");
        // The evicted key is judged by the overflow now: never below its true count (1).
        assert!(set.counts_of(evicted.fingerprint).current >= 1);
    }

    /// 120 one-shot keys per set and bucket: 480 000 per window over the default 4 096 sets.
    const FLOOD_PER_SET: u64 = 120;

    #[test]
    fn an_active_key_is_never_replaced_by_one_shot_keys() {
        let mut set = Set::empty(0, 0);
        let active = key(1);
        add(&mut set, active, 1);
        for n in 1000..1000 + FLOOD_PER_SET {
            add(&mut set, key(n), 1);
            if n == 1000 + FLOOD_PER_SET / 2 {
                add(&mut set, active, 1);
            }
        }
        assert!(set.is_resident(active));
        assert_eq!(set.counts_of(active).current, 2, "exact");
        // Still protected in the next bucket (frequency counts both buckets).
        let mut set = set.rolled_to(1);
        for n in 5000..5000 + FLOOD_PER_SET {
            add(&mut set, key(n), 1);
        }
        assert_eq!(set.counts_of(active), Counts { previous: 2, current: 0 });
        assert!(set.is_resident(active));
    }

    #[test]
    fn a_heavy_key_is_the_last_to_go_and_keeps_its_counts_in_the_overflow() {
        let mut set = Set::empty(0, 0);
        let heavy = key(1);
        add(&mut set, heavy, 40);
        for n in 2..=WAYS as u64 {
            add(&mut set, key(n), 3);
        }
        // A key with 10 takes the place of a 3, not of the heavy key.
        let ten = key(50);
        for _ in 0..10 {
            add(&mut set, ten, 1);
        }
        assert!(set.is_resident(heavy) && set.is_resident(ten));
        // A key more frequent than everything pushes the heavy key out only when the heavy key
        // is the least frequent left; its counts stay counted.
        for n in 60..60 + WAYS as u64 {
            for _ in 0..45 {
                add(&mut set, key(n), 1);
            }
        }
        assert!(!set.is_resident(heavy));
        assert!(set.counts_of(heavy).current >= 40, "no escape through eviction");
    }

    #[test]
    fn idle_entries_are_reused_without_touching_the_overflow() {
        let mut set = Set::empty(0, 0);
        for n in 1..=WAYS as u64 {
            add(&mut set, key(n), 5);
        }
        let mut set = set.rolled_to(2);
        assert_eq!(add(&mut set, key(42), 1), Added { resident: true, evicted: None });
        assert_eq!(set.current, Overflow::default());
        assert_eq!(set.previous, Overflow::default());
        assert_eq!(set.counts_of(key(42)).current, 1);
    }

    #[test]
    fn the_overflow_rolls_with_the_entries() {
        let mut set = Set::empty(0, 10);
        for n in 1..=WAYS as u64 {
            add(&mut set, key(n), 9);
        }
        let outsider = key(77);
        add(&mut set, outsider, 1);
        add(&mut set, outsider, 1);
        add(&mut set, outsider, 1);
        assert_eq!(set.counts_of(outsider), Counts { previous: 0, current: 3 });
        let set = set.rolled_to(11);
        assert_eq!(set.counts_of(outsider), Counts { previous: 3, current: 0 });
        let set = set.rolled_to(13);
        assert_eq!(set.counts_of(outsider), Counts::default());
    }

    #[test]
    fn subtract_undoes_an_entry_add_in_the_same_or_next_bucket() {
        let mut set = Set::empty(0, 5);
        add(&mut set, key(7), 3);
        set.subtract(key(7), 1, 5);
        assert_eq!(set.counts_of(key(7)).current, 2);
        let mut set = set.rolled_to(6);
        set.subtract(key(7), 1, 5);
        assert_eq!(set.counts_of(key(7)), Counts { previous: 1, current: 0 });
        set.subtract(key(8), 1, 6); // not an owner: nothing to take back
        assert_eq!(set.counts_of(key(7)), Counts { previous: 1, current: 0 });
        assert!(set.add_to_entry(key(7), 4));
        assert!(!set.add_to_entry(key(8), 4));
        assert_eq!(set.counts_of(key(7)).current, 4);
    }

    #[test]
    fn saturated_cells_stay_saturated() {
        let mut set = Set::empty(0, 0);
        for n in 1..=WAYS as u64 {
            add(&mut set, key(n), u32::MAX);
        }
        let outsider = key(99);
        add(&mut set, outsider, u32::MAX - 5);
        add(&mut set, outsider, 70_000);
        assert_eq!(set.counts_of(outsider).current, u32::MAX);
    }

    /// A brand-new key in a set that a flood of one-shot keys keeps full starts from 0, or from
    /// 1 when the doorkeeper mistakes it for a repeat, and more only through the sketch's noise:
    /// at [`FLOOD_PER_SET`] one-shot keys, in 2 000 sets.
    #[test]
    fn a_flood_of_one_shot_keys_leaves_new_keys_their_quota() {
        let mut over_by = [0u32; 4];
        let trials = 2000u64;
        for trial in 0..trials {
            let mut set = Set::empty(0, 0);
            let base = trial * 1_000_000;
            for n in 0..FLOOD_PER_SET {
                add(&mut set, key(base + n), 1);
            }
            let newcomer = key(base + 999_999);
            let before = set.counts_of(newcomer).current;
            over_by[(before as usize).min(3)] += 1;
        }
        let (exact, one, two, more) = (over_by[0], over_by[1], over_by[2], over_by[3]);
        assert!(exact as f64 >= 0.95 * trials as f64, "{over_by:?}");
        assert!(((two + more) as f64) <= 0.002 * trials as f64, "{over_by:?}");
        assert!(one > 0, "the doorkeeper does have false positives: {over_by:?}");
    }

    /// The flood the docs size the table for: 75 requests per set and window (300 000 a
    /// minute at the default capacity) from keys that each send `repeats` of them.
    const FLOOD_REQUESTS_PER_SET: u64 = 75;

    /// Whatever each key of such a flood sends, a brand-new key's count stays exact as it
    /// sends its first [`ABSORBED`] units in all but a few sets in a thousand, and is then one
    /// over: the doorkeeper a key's k-th unit sets holds at most 75 / k of the flood's keys.
    #[test]
    fn a_flood_of_keys_that_repeat_leaves_new_keys_their_quota() {
        let trials = 2000u64;
        for repeats in [1u64, 2, 3, 4, 8] {
            let keys = FLOOD_REQUESTS_PER_SET / repeats;
            let mut over_by = [0u64; 3];
            for trial in 0..trials {
                let mut set = Set::empty(0, 0);
                let base = (repeats * trials + trial) * 1_000_000;
                for n in 0..keys * repeats {
                    add(&mut set, key(base + n % keys), 1);
                }
                let newcomer = key(base + 999_999);
                let mut worst = 0;
                for sent in 0..ABSORBED {
                    worst = worst.max(set.counts_of(newcomer).current - sent);
                    add(&mut set, newcomer, 1);
                }
                over_by[(worst as usize).min(2)] += 1;
            }
            assert!(over_by[0] as f64 >= 0.99 * trials as f64, "{repeats} requests per key: {over_by:?}");
            assert!(over_by[2] as f64 <= 0.001 * trials as f64, "{repeats} requests per key: {over_by:?}");
        }
    }


    proptest! {
        /// Whatever the arrival order and costs, every key's counters are at least its true
        /// count (its quota is never looser), in both buckets, across roll-overs.
        #[test]
        fn counts_never_fall_below_the_truth(
            arrivals in proptest::collection::vec((1u64..40, 1u32..4, 0u64..8), 1..600),
        ) {
            let mut set = Set::empty(0, 0);
            let mut truth: HashMap<u64, Counts> = HashMap::new();
            let mut bucket = 0;
            for (k, cost, step) in arrivals {
                if step == 0 {
                    bucket += 1;
                    set = set.rolled_to(bucket);
                    for c in truth.values_mut() { *c = c.rolled(bucket - 1, bucket); }
                }
                set.add(key(k), cost, window(), 0);
                let t = truth.entry(key(k)).or_default();
                *t = t.plus(cost);
                for (fp, true_counts) in &truth {
                    let ours = set.counts_of(*fp);
                    prop_assert!(ours.current >= true_counts.current, "key {} current {:?} < {:?}", fp, ours, true_counts);
                    prop_assert!(ours.previous >= true_counts.previous, "key {} previous {:?} < {:?}", fp, ours, true_counts);
                }
            }
        }

        /// Adversarial sequences: whatever other keys do, a resident is only ever replaced by a
        /// key whose frequency beats its own, and a resident's counts are exact.
        #[test]
        fn residents_count_exactly_and_yield_only_to_more_frequent_keys(
            arrivals in proptest::collection::vec((0u64..60, 1u32..3), 1..800),
        ) {
            let mut set = Set::empty(0, 0);
            let mut truth: HashMap<u64, u32> = HashMap::new();
            // Counts a resident had when it entered above its true count (the overflow's noise),
            // for the exactness check.
            let mut entered_over: HashMap<u64, u32> = HashMap::new();
            for (k, cost) in arrivals {
                let fp = key(k);
                let was_resident = set.is_resident(fp);
                let before: Vec<Entry> = set.entries.to_vec();
                let candidate = set.counts_of(fp).current + cost;
                let added = set.add(fp, cost, window(), 0);
                *truth.entry(fp).or_default() += cost;
                if added.resident && !was_resident {
                    entered_over.insert(fp, set.counts_of(fp).current - truth[&fp]);
                }
                if let Some(evicted) = added.evicted {
                    prop_assert!(u64::from(evicted.counts.current) + PROMOTION_MARGIN <= u64::from(candidate), "{:?} replaced by a candidate of {}", evicted, candidate);
                    prop_assert!(before.contains(&evicted));
                }
                for entry in set.entries.iter().filter(|e| e.fingerprint != 0) {
                    let over = entered_over.get(&entry.fingerprint).copied().unwrap_or(0);
                    prop_assert_eq!(entry.counts.current, truth[&entry.fingerprint] + over);
                }
            }
        }
    }
}
