//! The overflow of a set: the counts of the keys without an entry, for one window bucket. A
//! ladder of [`DOORS`] doorkeepers (Bloom filters of [`DOOR_BITS`] bits, [`DOOR_HASHES`] bits per
//! key each: a key's first units) then a count-min sketch of [`SKETCH_ROWS`] × [`SKETCH_COLUMNS`]
//! cells with conservative update, kept as stored in the record.
//!
//! Invariant: a key's estimate is never below its true count in the bucket (a unit sets bits or
//! raises cells, and within a bucket nothing clears or lowers them), so a key without an entry is
//! never counted below what it sent.

use crate::primitives::hash::{mix64, GOLDEN_GAMMA};

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
pub(super) const DOOR_BYTES: usize = door_bits_total() / 8;
pub(super) const SKETCH_CELLS: usize = SKETCH_ROWS * SKETCH_COLUMNS;
/// Bytes of one overflow: every doorkeeper's bits, then the sketch cells.
pub(super) const OVERFLOW_LEN: usize = DOOR_BYTES + 4 * SKETCH_CELLS;

/// The counts of the keys without an entry, for one window bucket: a ladder of doorkeepers and
/// a conservative-update count-min sketch (module doc), kept as they are stored (every
/// doorkeeper's bits in rank order, then the cells, `u32` little-endian, row-major), so that a
/// record is read and written by copying, and only the positions a key uses are looked at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overflow(pub(super) [u8; OVERFLOW_LEN]);

impl Default for Overflow {
    fn default() -> Self {
        Overflow([0; OVERFLOW_LEN])
    }
}

/// Where a fingerprint lands in an overflow: its bits in each doorkeeper (positions in
/// [`Overflow::doors`]) and its cell in each row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Spots {
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
    pub(super) fn of(fingerprint: u64) -> Spots {
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

    pub(super) fn any_cell_counted(&self) -> bool {
        self.0.iter().skip(DOOR_BYTES).any(|&byte| byte != 0)
    }

    fn min_cell(&self, spots: &Spots) -> u32 {
        spots.cells.iter().map(|&cell| self.cell(cell)).min().unwrap_or(0)
    }

    /// The key's estimated count in this bucket: never below its true count.
    pub(super) fn estimate(&self, spots: &Spots) -> u32 {
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
    pub(super) fn add(&mut self, spots: &Spots, units: u32) {
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
    pub(super) fn raise_to(&mut self, spots: &Spots, count: u32) {
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
    pub(super) fn fill_doors(&mut self, ranks: std::ops::Range<usize>) {
        let start: usize = DOOR_BITS.iter().take(ranks.start).sum::<usize>() / 8;
        let end: usize = DOOR_BITS.iter().take(ranks.end).sum::<usize>() / 8;
        if let Some(bytes) = self.doors_mut().get_mut(start..end) {
            bytes.fill(u8::MAX);
        }
    }
}
