//! A token-bucket rule's set ([`crate::ratelimit::bucket`]): an entry holds its key's TAT,
//! microseconds since the Unix epoch, in the same eight bytes as a window's two counts (high word
//! in `previous`, low in `current`); the overflow counts the units the other keys take, as for a
//! window whose buckets are the table's `period`, at least the bucket's horizon (`τ +
//! max_delay`, for the smallest limit of the rule). Over one period a key's TAT runs ahead of
//! now by at most the units it took in it, times `T`, since at the period's start it was at
//! most one horizon ahead: so a non-resident key's TAT is taken as `now + (previous + current)
//! × T` with its overflow estimates, never earlier than its true TAT. An evicted key's level
//! (in units of the rule's smallest `T`, never fewer than its own) goes into the overflow of
//! the current period, where it stays at least one period, the time its bucket takes to drain.
//!
//! Admission is TinyLFU's, with a resident's level as its frequency: a newcomer takes an entry
//! whose bucket is full of tokens (its TAT past), or one whose level it beats by
//! [`PROMOTION_MARGIN`] units with its overflow estimate plus its cost: a key at its limit is
//! the last to go.

use super::overflow::Spots;
use super::{frequency, Added, Entry, Set, PROMOTION_MARGIN};
use crate::ratelimit::window::Counts;

impl Entry {
    /// The TAT a token-bucket entry holds.
    pub fn tat(&self) -> u64 {
        (u64::from(self.counts.previous) << 32) | u64::from(self.counts.current)
    }

    fn holding(fingerprint: u64, tat: u64) -> Entry {
        let (high, low) = ((tat >> 32) as u32, (tat & u64::from(u32::MAX)) as u32);
        Entry { fingerprint, counts: Counts { previous: high, current: low } }
    }
}

impl Set {
    /// The TAT that stands for `fingerprint` at `now_us` for a key whose emission interval is
    /// `interval_us`: its entry's, or its overflow estimates' bound.
    pub fn tat_of(&self, fingerprint: u64, now_us: u64, interval_us: u64) -> u64 {
        match self.owned(fingerprint) {
            Some(index) => self.entry(index).tat(),
            None => {
                let counts = self.overflow_counts(&Spots::of(fingerprint));
                let units = u64::from(counts.previous).saturating_add(u64::from(counts.current));
                now_us.saturating_add(units.saturating_mul(interval_us))
            }
        }
    }

    /// Stores `tat` for `fingerprint`, which just took `units`, at `now_us`; `unit_us` is the
    /// rule's smallest emission interval (levels compared in it). On its entry; or on a new
    /// entry when the victim's bucket is full or the key beats its level; or `units` go into
    /// the overflow.
    pub fn put_tat(&mut self, fingerprint: u64, tat: u64, units: u32, now_us: u64, unit_us: u64) -> Added {
        let level = |entry: &Entry| -> u64 {
            if entry.fingerprint == 0 {
                return 0;
            }
            entry.tat().saturating_sub(now_us).div_ceil(unit_us.max(1))
        };
        if let Some(index) = self.owned(fingerprint) {
            if let Some(entry) = self.entries.get_mut(index) {
                *entry = Entry::holding(fingerprint, tat);
            }
            return Added { resident: true, evicted: None };
        }
        let spots = Spots::of(fingerprint);
        let candidate = frequency(self.overflow_counts(&spots)).saturating_add(u64::from(units));
        let victim = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| level(e))
            .map_or(0, |(index, _)| index);
        let Some(slot) = self.entries.get(victim).copied() else {
            return Added::default();
        };
        let victim_level = level(&slot);
        let free = victim_level == 0;
        if !free && victim_level.saturating_add(PROMOTION_MARGIN) > candidate {
            self.current.add(&spots, units);
            return Added::default();
        }
        if !free {
            self.current.raise_to(&Spots::of(slot.fingerprint), u32::try_from(victim_level).unwrap_or(u32::MAX));
        }
        if let Some(entry) = self.entries.get_mut(victim) {
            *entry = Entry::holding(fingerprint, tat);
        }
        Added { resident: true, evicted: (!free).then_some(slot) }
    }

    /// Moves `fingerprint`'s TAT back by `span_us` (units it took and gives back), if it still
    /// owns its entry (units that went to the overflow stay there: a harmless over-count).
    pub fn untake_tat(&mut self, fingerprint: u64, span_us: u64) {
        let Some(index) = self.owned(fingerprint) else { return };
        if let Some(entry) = self.entries.get_mut(index) {
            *entry = Entry::holding(fingerprint, entry.tat().saturating_sub(span_us));
        }
    }
}
