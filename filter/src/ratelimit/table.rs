//! The bounded key table of one rule: memory fixed by `capacity`, whatever the number of keys.
//!
//! Envoy cannot delete shared-data keys, so one key per client key would grow without end under
//! spoofed or random keys. Instead a rule owns `capacity / WAYS` shared-data records ("sets"),
//! each holding [`WAYS`] entries. A client key is hashed with a secret seed (so nobody can aim
//! collisions at a victim); the hash picks the set and is the entry's fingerprint.
//!
//! Within a set, entries are managed like Space-Saving (Metwally, Agrawal, El Abbadi, "Efficient
//! Computation of Frequent and Top-k Elements in Data Streams", 2005):
//! - a key that owns an entry counts exactly on it;
//! - a key that owns none takes the entry with the smallest estimate (or a free one). The
//!   evicted counts are folded into the set's **floor** (componentwise maximum of everything
//!   ever evicted in the live window), and the newcomer starts from the floor as it was before
//!   (the newcomer's own past, if any, is already in it).
//!
//! Guarantees, for every key at every moment (previous and current bucket alike):
//! - **never looser than configured**: a key's counters are at least its true counts. An
//!   evicted key's true counts are at most the floor (they were folded into it, and every later
//!   request of that key makes it an owner again), and a newcomer starts at the floor.
//! - **bounded over-count, not the sum of a crowd**: a key's excess is at most the floor when it
//!   (re)entered the set, and the floor only ever receives the counts of the set's *smallest*
//!   entry, at most `requests to the set in the window / WAYS`. A flood of one-off keys
//!   therefore inflates a well-behaved key by roughly `flood per set / WAYS`, not by the flood.
//! - A request that is refused writes nothing (the newcomer is only inserted when admitted).
//!
//! Record layout (little-endian, [`RECORD_LEN`] bytes): version `u8`, ways `u8`, 2 zero bytes,
//! bucket index `u64`, floor previous `u32`, floor current `u32`, then per entry fingerprint
//! `u64` (0 = free), previous `u32`, current `u32`. All entries of a set are kept rolled to the
//! same window bucket.

use super::window::{Counts, Window};

/// Entries per set.
pub const WAYS: usize = 4;
const RECORD_VERSION: u8 = 1;
const HEADER_LEN: usize = 4 + 8 + 8;
const ENTRY_LEN: usize = 16;
/// Bytes of one encoded set.
pub const RECORD_LEN: usize = HEADER_LEN + WAYS * ENTRY_LEN;

/// One key's counters in a set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// The owning key's hash; 0 marks a free entry.
    pub fingerprint: u64,
    /// Its counters.
    pub counts: Counts,
}

/// A set of [`WAYS`] entries plus the floor, as stored in one shared-data record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Set {
    /// The window bucket all counters are rolled to.
    pub bucket_index: u64,
    /// Componentwise maximum of the counts evicted from this set.
    pub floor: Counts,
    /// The entries.
    pub entries: [Entry; WAYS],
}

/// Why a stored record could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Wrong length for this version.
    Length(usize),
    /// A version or layout this build does not know.
    Version(u8, u8),
}

/// The fingerprint stored for a key hash: never 0, which marks a free entry.
pub fn fingerprint(key_hash: u64) -> u64 {
    key_hash.max(1)
}

impl Set {
    /// An empty set as of `bucket_index`.
    pub fn empty(bucket_index: u64) -> Set {
        Set {
            bucket_index,
            ..Set::default()
        }
    }

    /// Reads a record, refusing anything truncated, padded or of another version.
    pub fn decode(bytes: &[u8]) -> Result<Set, DecodeError> {
        let header: &[u8; RECORD_LEN] =
            bytes.try_into().map_err(|_| DecodeError::Length(bytes.len()))?;
        let mut reader = Reader { bytes: header, at: 0 };
        let version = reader.u8();
        let ways = reader.u8();
        reader.skip(2);
        if version != RECORD_VERSION || usize::from(ways) != WAYS {
            return Err(DecodeError::Version(version, ways));
        }
        let bucket_index = reader.u64();
        let floor = reader.counts();
        let mut entries = [Entry::default(); WAYS];
        for entry in &mut entries {
            entry.fingerprint = reader.u64();
            entry.counts = reader.counts();
        }
        Ok(Set {
            bucket_index,
            floor,
            entries,
        })
    }

    /// Writes the record.
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut out = [0u8; RECORD_LEN];
        let mut writer = Writer { bytes: &mut out, at: 0 };
        writer.put(&[RECORD_VERSION, WAYS as u8, 0, 0]);
        writer.put(&self.bucket_index.to_le_bytes());
        writer.counts(self.floor);
        for entry in &self.entries {
            writer.put(&entry.fingerprint.to_le_bytes());
            writer.counts(entry.counts);
        }
        out
    }

    /// The set as seen from window bucket `bucket_index` (see [`Counts::rolled`]).
    pub fn rolled_to(mut self, bucket_index: u64) -> Set {
        let from = self.bucket_index;
        if bucket_index <= from {
            return self;
        }
        self.floor = self.floor.rolled(from, bucket_index);
        for entry in &mut self.entries {
            entry.counts = entry.counts.rolled(from, bucket_index);
        }
        self.bucket_index = bucket_index;
        self
    }

    /// The counters that stand for `fingerprint`: its own entry's, or the floor.
    pub fn counts_of(&self, fingerprint: u64) -> Counts {
        self.owned(fingerprint)
            .map_or(self.floor, |index| self.entry(index).counts)
    }

    /// Adds `cost` for `fingerprint`, taking an entry if it owns none. Returns the evicted
    /// entry when a key with live counts had to make room. `elapsed_ms` (into the current
    /// bucket) ranks the candidates by their sliding estimate.
    pub fn add(&mut self, fingerprint: u64, cost: u32, window: Window, elapsed_ms: u64) -> Option<Entry> {
        if let Some(index) = self.owned(fingerprint) {
            if let Some(entry) = self.entries.get_mut(index) {
                entry.counts = entry.counts.plus(cost);
            }
            return None;
        }
        let victim = self.victim(window, elapsed_ms);
        let floor = self.floor;
        let slot = self.entries.get_mut(victim)?;
        let evicted = *slot;
        *slot = Entry {
            fingerprint,
            counts: floor.plus(cost),
        };
        self.floor = floor.max(evicted.counts);
        (evicted.fingerprint != 0 && !evicted.counts.is_zero()).then_some(evicted)
    }

    /// Takes back `cost` that [`Set::add`] added in window bucket `added_in`, if the key still
    /// owns its entry (an evicted key's counts live on in the floor: a harmless over-count).
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

    /// A free or idle entry if there is one, else the one with the smallest estimate.
    fn victim(&self, window: Window, elapsed_ms: u64) -> usize {
        self.entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| {
                let live = e.fingerprint != 0 && !e.counts.is_zero();
                (live, window.scaled_estimate(e.counts, elapsed_ms))
            })
            .map_or(0, |(index, _)| index)
    }
}

struct Reader<'a> {
    bytes: &'a [u8; RECORD_LEN],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        if let Some(src) = self.bytes.get(self.at..self.at.saturating_add(N)) {
            out.copy_from_slice(src);
        }
        self.at = self.at.saturating_add(N);
        out
    }
    fn skip(&mut self, n: usize) {
        self.at = self.at.saturating_add(n);
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
    fn counts(&mut self) -> Counts {
        let previous = u32::from_le_bytes(self.take());
        let current = u32::from_le_bytes(self.take());
        Counts { previous, current }
    }
}

struct Writer<'a> {
    bytes: &'a mut [u8; RECORD_LEN],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, src: &[u8]) {
        let end = self.at.saturating_add(src.len());
        if let Some(dst) = self.bytes.get_mut(self.at..end) {
            dst.copy_from_slice(src);
        }
        self.at = end;
    }
    fn counts(&mut self, counts: Counts) {
        self.put(&counts.previous.to_le_bytes());
        self.put(&counts.current.to_le_bytes());
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

    #[test]
    fn records_round_trip_and_refuse_corruption() {
        let mut set = Set::empty(77);
        set.add(5, 3, window(), 0);
        set.add(9, 1, window(), 0);
        set.floor = Counts { previous: 2, current: 1 };
        let bytes = set.encode();
        assert_eq!(Set::decode(&bytes), Ok(set));
        assert_eq!(Set::decode(&bytes[..RECORD_LEN - 1]), Err(DecodeError::Length(RECORD_LEN - 1)));
        assert_eq!(Set::decode(&[]), Err(DecodeError::Length(0)));
        let mut other_version = bytes;
        other_version[0] = 9;
        assert_eq!(Set::decode(&other_version), Err(DecodeError::Version(9, WAYS as u8)));
    }

    #[test]
    fn owners_count_exactly_and_free_entries_are_used_first() {
        let mut set = Set::empty(0);
        for key in 1..=WAYS as u64 {
            assert_eq!(set.add(key, key as u32, window(), 0), None);
        }
        for key in 1..=WAYS as u64 {
            assert_eq!(set.counts_of(key).current, key as u32);
        }
        assert_eq!(set.floor, Counts::default());
    }

    #[test]
    fn a_newcomer_evicts_the_smallest_and_inherits_the_floor() {
        let mut set = Set::empty(0);
        for (key, n) in [(1, 10), (2, 3), (3, 7), (4, 5)] {
            set.add(key, n, window(), 0);
        }
        let evicted = set.add(99, 1, window(), 0).unwrap();
        assert_eq!(evicted.fingerprint, 2);
        assert_eq!(set.floor.current, 3);
        assert_eq!(set.counts_of(99).current, 1, "the floor before (0) + its own 1");
        // The evicted key is now judged by the floor: never less than its true count (3).
        assert_eq!(set.counts_of(2).current, 3);
        // When it returns, it evicts the newcomer (now the smallest) and starts from the floor.
        set.add(2, 1, window(), 0);
        assert_eq!(set.counts_of(2).current, 4);
    }

    #[test]
    fn idle_entries_are_reused_without_raising_the_floor() {
        let mut set = Set::empty(0);
        for key in 1..=WAYS as u64 {
            set.add(key, 5, window(), 0);
        }
        let mut set = set.rolled_to(2);
        assert_eq!(set.add(42, 1, window(), 0), None);
        assert_eq!(set.floor, Counts::default());
        assert_eq!(set.counts_of(42).current, 1);
    }

    #[test]
    fn subtract_undoes_an_add_in_the_same_or_next_bucket() {
        let mut set = Set::empty(5);
        set.add(7, 3, window(), 0);
        set.subtract(7, 1, 5);
        assert_eq!(set.counts_of(7).current, 2);
        let mut set = set.rolled_to(6);
        set.subtract(7, 1, 5);
        assert_eq!(set.counts_of(7), Counts { previous: 1, current: 0 });
        set.subtract(8, 1, 6); // not an owner: nothing to take back
        assert_eq!(set.counts_of(7), Counts { previous: 1, current: 0 });
    }

    /// A well-behaved key among a flood of one-off keys suffers an over-count of about the flood
    /// per set divided by WAYS, not the flood.
    #[test]
    fn a_flood_of_other_keys_inflates_a_steady_key_only_by_the_floor() {
        let mut set = Set::empty(0);
        let steady = 1u64;
        let mut flood_key = 1000u64;
        for _ in 0..10 {
            set.add(steady, 1, window(), 0);
            for _ in 0..20 {
                flood_key += 1;
                set.add(flood_key, 1, window(), 0);
            }
        }
        let estimate = set.counts_of(steady).current;
        // 200 flood requests over 4 ways: Space-Saving bounds the excess by 200 / 4 = 50.
        assert!(estimate >= 10, "never below the truth: {estimate}");
        assert!(estimate <= 10 + 200 / WAYS as u32, "bounded excess: {estimate}");
    }

    proptest! {
        /// Whatever the arrival order, every key's counters are at least its true count
        /// (its quota is never looser), in both buckets, across a roll-over.
        #[test]
        fn counts_never_fall_below_the_truth(
            arrivals in proptest::collection::vec((1u64..24, 0u64..2), 1..400),
        ) {
            let mut set = Set::empty(0);
            let mut truth: HashMap<u64, Counts> = HashMap::new();
            let mut bucket = 0;
            for (key, step) in arrivals {
                if step == 1 && bucket < 1 {
                    bucket += 1;
                    set = set.rolled_to(bucket);
                    for c in truth.values_mut() { *c = c.rolled(bucket - 1, bucket); }
                }
                set.add(key, 1, window(), 0);
                let t = truth.entry(key).or_default();
                *t = t.plus(1);
                for (k, true_counts) in &truth {
                    let ours = set.counts_of(*k);
                    prop_assert!(ours.current >= true_counts.current, "key {} current {:?} < {:?}", k, ours, true_counts);
                    prop_assert!(ours.previous >= true_counts.previous, "key {} previous {:?} < {:?}", k, ours, true_counts);
                }
            }
        }
    }
}
