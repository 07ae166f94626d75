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
//! Record layout (little-endian, [`RECORD_LEN`] bytes): version `u8`, ways `u8`, 2 zero bytes,
//! shape `u64` (a stamp of the rule's key, window and capacity: a record of another shape reads as
//! empty), bucket index `u64`, per entry fingerprint `u64` (0 = free), previous `u32`, current
//! `u32`, then the previous bucket's overflow and the current one's, each every doorkeeper's bits
//! in rank order ([`DOOR_BITS`] / 8 bytes each) and the sketch cells (`u32` each, row-major).
//! Everything is kept rolled to the same window bucket. A record of the previous layout (version 2:
//! two doorkeepers) is read as this one, never below what it counted ([`Set::decode`]).
//!
//! Rationale: docs/design.md, section "The bounded key table".

use super::window::{Counts, Window};
use crate::primitives::hash::{mix64, GOLDEN_GAMMA};
use crate::primitives::record::{DecodeError, Fill, Reader, Writer};

/// Entries per set.
pub const WAYS: usize = 4;
/// Doorkeepers per set and bucket: the first absorbs a key's first unit, each next one its next
/// unit; the sketch counts the units past them.
pub const DOORS: usize = 5;
/// Bits of each doorkeeper per set and bucket. A doorkeeper holds the keys that sent at least
/// its rank of units: every key of a flood sets bits in the first, fewer keys reach the later
/// ones, which are smaller. Sized so that a flood of 75 requests per set and window, however
/// they are spread over its keys, fills no doorkeeper enough to add a unit to another key's
/// estimate more than a few times in a thousand (docs/configuration.md, *Sizing*).
pub const DOOR_BITS: [usize; DOORS] = [2048, 1024, 512, 512, 512];
/// Bits a key sets in each doorkeeper.
pub const DOOR_HASHES: usize = 3;
/// A key's units the doorkeepers absorb before its sketch cells count the rest.
pub const ABSORBED: u32 = DOORS as u32;
/// Count-min rows per set and bucket.
pub const SKETCH_ROWS: usize = 2;
/// Count-min cells per row.
pub const SKETCH_COLUMNS: usize = 8;
/// How much more frequent than the victim a newcomer must be to take its entry.
pub const PROMOTION_MARGIN: u64 = 2;

/// The layout version written in the first byte of every record.
pub const RECORD_VERSION: u8 = 3;
/// The previous layout's version (two doorkeepers, of 1 024 and 256 bits), read and converted
/// ([`Set::decode`]).
pub const RECORD_VERSION_TWO_DOORS: u8 = 2;
const TWO_DOORS_BYTES: usize = (1024 + 256) / 8;

/// Bits of all doorkeepers together.
// Evaluated at compile time only: an overflow or an index out of range fails the build.
#[allow(clippy::arithmetic_side_effects, clippy::indexing_slicing)]
const fn door_bits_total() -> usize {
    let mut total = 0;
    let mut rank = 0;
    while rank < DOORS {
        total += DOOR_BITS[rank];
        rank += 1;
    }
    total
}

/// Whether every doorkeeper's size is a power of two and a whole number of bytes (positions
/// are cut from 64-bit hashes by masks and shifts).
#[allow(clippy::arithmetic_side_effects, clippy::indexing_slicing)]
const fn door_sizes_are_powers_of_two() -> bool {
    let mut rank = 0;
    while rank < DOORS {
        if !DOOR_BITS[rank].is_power_of_two() || DOOR_BITS[rank] % 8 != 0 {
            return false;
        }
        rank += 1;
    }
    true
}

const _: () = assert!(SKETCH_COLUMNS.is_power_of_two() && door_sizes_are_powers_of_two() && DOORS >= 2);
const DOOR_BYTES: usize = door_bits_total() / 8;
const SKETCH_CELLS: usize = SKETCH_ROWS * SKETCH_COLUMNS;
const HEADER_LEN: usize = 4 + 8 + 8;
/// Where the shape stamp sits in a record (after version, ways and 2 zero bytes).
pub const SHAPE_OFFSET: usize = 4;
const ENTRY_LEN: usize = 16;
const OVERFLOW_LEN: usize = DOOR_BYTES + 4 * SKETCH_CELLS;
/// Bytes of one encoded set.
pub const RECORD_LEN: usize = HEADER_LEN + WAYS * ENTRY_LEN + 2 * OVERFLOW_LEN;
/// Bytes of one encoded set of the previous layout.
pub const RECORD_LEN_TWO_DOORS: usize = HEADER_LEN + WAYS * ENTRY_LEN + 2 * (TWO_DOORS_BYTES + 4 * SKETCH_CELLS);

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

/// The counts of the keys without an entry, for one window bucket: a ladder of doorkeepers and
/// a conservative-update count-min sketch (module doc), kept as they are stored (every
/// doorkeeper's bits in rank order, then the cells, `u32` little-endian, row-major), so that a
/// record is read and written by copying, and only the positions a key uses are looked at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overflow([u8; OVERFLOW_LEN]);

impl Default for Overflow {
    fn default() -> Self {
        Overflow([0; OVERFLOW_LEN])
    }
}

/// Where a fingerprint lands in an overflow: its bits in each doorkeeper (positions in
/// [`Overflow::doors`]) and its cell in each row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Spots {
    bits: [[usize; DOOR_HASHES]; DOORS],
    cells: [usize; SKETCH_ROWS],
}

fn all_set(doors: &[u8], bits: &[usize]) -> bool {
    bits.iter()
        .all(|&bit| doors.get(bit / 8).is_some_and(|byte| byte & (1 << (bit % 8)) != 0))
}

/// Sets `bits` in `doors`; false when they were all set already.
fn set_all(doors: &mut [u8], bits: &[usize]) -> bool {
    if all_set(doors, bits) {
        return false;
    }
    for &bit in bits {
        if let Some(byte) = doors.get_mut(bit / 8) {
            *byte |= 1 << (bit % 8);
        }
    }
    true
}

/// Hash bits handed out a few at a time: a 64-bit word, low bits first, then the next word,
/// drawn from the previous one by a mixing step.
struct HashBits {
    /// The word drawn last, whole.
    drawn: u64,
    /// What is left of it.
    word: u64,
    left: u32,
}

impl HashBits {
    fn new(seed: u64) -> HashBits {
        let drawn = mix64(seed);
        HashBits { drawn, word: drawn, left: 64 }
    }

    /// The next `width` bits (`width` ≤ 32) as a position, from one word.
    fn take(&mut self, width: u32) -> usize {
        if self.left < width {
            self.drawn = mix64(self.drawn ^ GOLDEN_GAMMA);
            self.word = self.drawn;
            self.left = 64;
        }
        let value = self.word & 1u64.wrapping_shl(width).wrapping_sub(1);
        self.word = self.word.wrapping_shr(width);
        self.left = self.left.saturating_sub(width);
        usize::try_from(value).unwrap_or(0)
    }
}

impl Spots {
    /// Positions from a fingerprint, through mixing steps, so that they do not depend on the
    /// bits that chose the set.
    fn of(fingerprint: u64) -> Spots {
        let mut hash = HashBits::new(fingerprint);
        let mut bits = [[0; DOOR_HASHES]; DOORS];
        let mut offset = 0usize;
        for (door, &size) in bits.iter_mut().zip(&DOOR_BITS) {
            for bit in door {
                *bit = offset.saturating_add(hash.take(size.trailing_zeros()));
            }
            offset = offset.saturating_add(size);
        }
        let mut cells = [0; SKETCH_ROWS];
        for (row, cell) in cells.iter_mut().enumerate() {
            let column = hash.take(SKETCH_COLUMNS.trailing_zeros());
            *cell = row.saturating_mul(SKETCH_COLUMNS).saturating_add(column);
        }
        Spots { bits, cells }
    }
}

impl Overflow {
    fn doors(&self) -> &[u8] {
        self.0.get(..DOOR_BYTES).unwrap_or_default()
    }

    fn doors_mut(&mut self) -> &mut [u8] {
        self.0.get_mut(..DOOR_BYTES).unwrap_or_default()
    }

    /// Sketch cell `index` (row-major).
    fn cell(&self, index: usize) -> u32 {
        let at = DOOR_BYTES.saturating_add(index.saturating_mul(4));
        self.0
            .get(at..at.saturating_add(4))
            .and_then(|bytes| <[u8; 4]>::try_from(bytes).ok())
            .map_or(u32::MAX, u32::from_le_bytes)
    }

    /// Raises sketch cell `index` to at least `value`.
    fn raise_cell(&mut self, index: usize, value: u32) {
        if self.cell(index) >= value {
            return;
        }
        let at = DOOR_BYTES.saturating_add(index.saturating_mul(4));
        if let Some(bytes) = self.0.get_mut(at..at.saturating_add(4)) {
            bytes.copy_from_slice(&value.to_le_bytes());
        }
    }

    fn any_cell_counted(&self) -> bool {
        self.0.iter().skip(DOOR_BYTES).any(|&byte| byte != 0)
    }

    fn min_cell(&self, spots: &Spots) -> u32 {
        spots.cells.iter().map(|&cell| self.cell(cell)).min().unwrap_or(0)
    }

    /// The key's estimated count in this bucket: never below its true count.
    fn estimate(&self, spots: &Spots) -> u32 {
        let doors = spots.bits.iter().take_while(|bits| all_set(self.doors(), bits.as_slice())).count();
        if doors < DOORS {
            u32::try_from(doors).unwrap_or(ABSORBED)
        } else {
            self.min_cell(spots).saturating_add(ABSORBED)
        }
    }

    /// Counts `units` for the key: a unit sets its bits in the lowest doorkeeper where they are
    /// not all set yet, the units left past the ladder raise its cells to at least their
    /// minimum plus those units (conservative update; saturating).
    fn add(&mut self, spots: &Spots, units: u32) {
        let mut units = units;
        for bits in &spots.bits {
            if units > 0 && set_all(self.doors_mut(), bits) {
                units = units.saturating_sub(1);
            }
        }
        if units == 0 {
            return;
        }
        let raised = self.min_cell(spots).saturating_add(units);
        for &cell in &spots.cells {
            self.raise_cell(cell, raised);
        }
    }

    /// Raises the key's estimate to at least `count` (an evicted entry's counts, which already
    /// include what the overflow estimated for it when it entered): its bits set in the first
    /// `count` doorkeepers and its cells raised to `count − ABSORBED`, never lowered. Adding the
    /// count instead would count that entry estimate twice at every eviction, and a key that
    /// churns in and out would see its estimate grow without bound.
    fn raise_to(&mut self, spots: &Spots, count: u32) {
        let ranks = usize::try_from(count).unwrap_or(usize::MAX);
        for bits in spots.bits.iter().take(ranks) {
            set_all(self.doors_mut(), bits);
        }
        if count <= ABSORBED {
            return;
        }
        let floor = count.saturating_sub(ABSORBED);
        for &cell in &spots.cells {
            self.raise_cell(cell, floor);
        }
    }

    /// Bits set in the first doorkeeper, for sizing diagnostics.
    pub fn door_bits_set(&self) -> u32 {
        let first = DOOR_BITS.first().map_or(0, |bits| bits / 8);
        self.doors().iter().take(first).map(|byte| byte.count_ones()).sum()
    }

    /// Every bit of doorkeepers `ranks` set: a key whose bits are all set in the doorkeepers
    /// below reads as having sent a unit in each of these.
    fn fill_doors(&mut self, ranks: std::ops::Range<usize>) {
        let start: usize = DOOR_BITS.iter().take(ranks.start).sum::<usize>() / 8;
        let end: usize = DOOR_BITS.iter().take(ranks.end).sum::<usize>() / 8;
        if let Some(bytes) = self.doors_mut().get_mut(start..end) {
            bytes.fill(u8::MAX);
        }
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

    /// Reads a record, refusing anything truncated, padded, of another version, or with a key
    /// owning two entries. A record of the previous layout (two doorkeepers) keeps its entries
    /// and its cells; its doorkeepers' bits, laid out otherwise, cannot say which keys they
    /// hold, so each doorkeeper of this layout that stands for one of them holding anything is
    /// full, and those past the second too when its cells counted anything (a key counted
    /// `2 + cell` there reads `ABSORBED + cell` here): never below what it counted, and for at
    /// most two window buckets over.
    pub fn decode(bytes: &[u8]) -> Result<Set, DecodeError> {
        let version = bytes.first().copied().unwrap_or(0);
        let ways = bytes.get(1).copied().unwrap_or(0);
        let current_layout = match bytes.len() {
            RECORD_LEN if version == RECORD_VERSION => true,
            RECORD_LEN_TWO_DOORS if version == RECORD_VERSION_TWO_DOORS => false,
            RECORD_LEN | RECORD_LEN_TWO_DOORS => return Err(DecodeError::Version(version, ways)),
            len => return Err(DecodeError::Length(len)),
        };
        if usize::from(ways) != WAYS {
            return Err(DecodeError::Version(version, ways));
        }
        // The length is checked: every field below is there.
        let mut reader = Reader::new(bytes);
        reader.array::<4>()?;
        let shape = reader.u64()?;
        let bucket_index = reader.u64()?;
        let mut entries = [Entry::default(); WAYS];
        for entry in &mut entries {
            entry.fingerprint = reader.u64()?;
            entry.counts = Counts { previous: reader.u32()?, current: reader.u32()? };
        }
        let (previous, current) = if current_layout {
            (Overflow(reader.array()?), Overflow(reader.array()?))
        } else {
            (two_doors_overflow(&mut reader)?, two_doors_overflow(&mut reader)?)
        };
        // Evicting one copy of a key that owns two entries would expose the other's counts.
        for (i, entry) in entries.iter().enumerate() {
            let later = entries.iter().skip(i.saturating_add(1));
            if entry.fingerprint != 0 && later.clone().any(|e| e.fingerprint == entry.fingerprint) {
                return Err(DecodeError::Duplicate(entry.fingerprint));
            }
        }
        Ok(Set {
            shape,
            bucket_index,
            entries,
            previous,
            current,
        })
    }

    /// Writes the record.
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut out = [0u8; RECORD_LEN];
        let mut writer = Fill::new(&mut out);
        writer.put(&[RECORD_VERSION, WAYS as u8, 0, 0]);
        writer.put_u64(self.shape);
        writer.put_u64(self.bucket_index);
        for entry in &self.entries {
            writer.put_u64(entry.fingerprint);
            writer.put_u32(entry.counts.previous);
            writer.put_u32(entry.counts.current);
        }
        writer.put(&self.previous.0);
        writer.put(&self.current.0);
        out
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

/// A token-bucket rule's set ([`super::bucket`]): an entry holds its key's TAT, microseconds
/// since the Unix epoch, in the same eight bytes as a window's two counts (high word in
/// `previous`, low in `current`); the overflow counts the units the other keys take, as for a
/// window whose buckets are the table's `period`, at least the bucket's horizon (`τ +
/// max_delay`, for the smallest limit of the rule). Over one period a key's TAT runs ahead of
/// now by at most the units it took in it, times `T`, since at the period's start it was at
/// most one horizon ahead: so a non-resident key's TAT is taken as `now + (previous + current)
/// × T` with its overflow estimates, never earlier than its true TAT. An evicted key's level
/// (in units of the rule's smallest `T`, never fewer than its own) goes into the overflow of
/// the current period, where it stays at least one period, the time its bucket takes to drain.
///
/// Admission is TinyLFU's, with a resident's level as its frequency: a newcomer takes an entry
/// whose bucket is full of tokens (its TAT past), or one whose level it beats by
/// [`PROMOTION_MARGIN`] units with its overflow estimate plus its cost: a key at its limit is
/// the last to go.
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

/// An overflow of the previous layout, converted ([`Set::decode`]).
fn two_doors_overflow(reader: &mut Reader<'_>) -> Result<Overflow, DecodeError> {
    let first: [u8; 1024 / 8] = reader.array()?;
    let second: [u8; 256 / 8] = reader.array()?;
    let cells: [u8; 4 * SKETCH_CELLS] = reader.array()?;
    let mut overflow = Overflow::default();
    if let Some(stored) = overflow.0.get_mut(DOOR_BYTES..) {
        stored.copy_from_slice(&cells);
    }
    let holds = |bytes: &[u8]| bytes.iter().any(|&byte| byte != 0);
    let ranks = if overflow.any_cell_counted() {
        DOORS
    } else if holds(&second) {
        2
    } else if holds(&first) {
        1
    } else {
        0
    };
    overflow.fill_doors(0..ranks);
    Ok(overflow)
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
    fn key(n: u64) -> u64 {
        fingerprint(n.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17) ^ 0x5555)
    }

    fn add(set: &mut Set, fp: u64, cost: u32) -> Added {
        set.add(fp, cost, window(), 0)
    }

    #[test]
    fn records_round_trip_and_refuse_corruption() {
        let mut set = Set::empty(0xabc, 77);
        add(&mut set, key(5), 3);
        add(&mut set, key(9), 1);
        for n in 100..140 {
            add(&mut set, key(n), 2);
        }
        let set = set.rolled_to(78);
        let mut set = set;
        add(&mut set, key(200), 1);
        let bytes = set.encode();
        assert_eq!(Set::decode(&bytes), Ok(set.clone()));
        assert_eq!(Set::decode(&bytes[..RECORD_LEN - 1]), Err(DecodeError::Length(RECORD_LEN - 1)));
        assert_eq!(Set::decode(&[]), Err(DecodeError::Length(0)));
        let mut other_version = bytes;
        other_version[0] = 1;
        assert_eq!(Set::decode(&other_version), Err(DecodeError::Version(1, WAYS as u8)));
        let mut duplicate = set;
        duplicate.entries[3] = duplicate.entries[0];
        let owner = duplicate.entries[0].fingerprint;
        assert_eq!(Set::decode(&duplicate.encode()), Err(DecodeError::Duplicate(owner)));
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

    /// A record of the previous layout: every entry as it was, and every key's estimate at
    /// least the most that layout could have said of it (0 with nothing stored, 1 with only
    /// its first doorkeeper's bits, 2 with its second's, `2 + cell` with cells).
    #[test]
    fn a_record_of_the_previous_layout_keeps_its_entries_and_never_counts_less() {
        let entry = Entry { fingerprint: key(1), counts: Counts { previous: 3, current: 7 } };
        let two_doors = |first: u8, second: u8, cell: u32| {
            let mut bytes = vec![RECORD_VERSION_TWO_DOORS, WAYS as u8, 0, 0];
            bytes.extend_from_slice(&0xabcu64.to_le_bytes());
            bytes.extend_from_slice(&77u64.to_le_bytes());
            bytes.extend_from_slice(&entry.fingerprint.to_le_bytes());
            bytes.extend_from_slice(&entry.counts.previous.to_le_bytes());
            bytes.extend_from_slice(&entry.counts.current.to_le_bytes());
            bytes.extend_from_slice(&[0; (WAYS - 1) * ENTRY_LEN]);
            bytes.extend_from_slice(&[0; TWO_DOORS_BYTES + 4 * SKETCH_CELLS]);
            bytes.extend_from_slice(&[first; 1024 / 8]);
            bytes.extend_from_slice(&[second; 256 / 8]);
            for _ in 0..SKETCH_CELLS {
                bytes.extend_from_slice(&cell.to_le_bytes());
            }
            assert_eq!(bytes.len(), RECORD_LEN_TWO_DOORS);
            Set::decode(&bytes).unwrap()
        };
        for (first, second, cell, at_least) in [(0, 0, 0, 0), (0x10, 0, 0, 1), (0xff, 0x01, 0, 2), (0xff, 0xff, 9, 11)] {
            let set = two_doors(first, second, cell);
            assert_eq!((set.shape, set.bucket_index, set.entries[0]), (0xabc, 77, entry));
            assert_eq!(set.previous, Overflow::default());
            for n in 2..200 {
                assert!(set.counts_of(key(n)).current >= at_least, "{first:#x} {second:#x} {cell}");
            }
            if at_least == 0 {
                assert_eq!(set.current, Overflow::default());
            }
        }
        let mut other_version = two_doors(0, 0, 0).encode();
        assert_eq!(Set::decode(&other_version).map(|s| s.entries[0]), Ok(entry), "written back in this layout");
        other_version[0] = RECORD_VERSION_TWO_DOORS;
        assert_eq!(Set::decode(&other_version), Err(DecodeError::Version(RECORD_VERSION_TWO_DOORS, WAYS as u8)));
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
