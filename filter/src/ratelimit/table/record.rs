//! A set as stored in one shared-data record: its encoding, and the reading of a record of the
//! previous layout.
//!
//! Layout (little-endian, [`RECORD_LEN`] bytes): version `u8`, ways `u8`, 2 zero bytes, shape
//! `u64` (a stamp of the rule's key, window and capacity: a record of another shape reads as
//! empty), bucket index `u64`, per entry fingerprint `u64` (0 = free), previous `u32`, current
//! `u32`, then the previous bucket's overflow and the current one's, each every doorkeeper's bits
//! in rank order ([`super::DOOR_BITS`] / 8 bytes each) and the sketch cells (`u32` each,
//! row-major). Everything is kept rolled to the same window bucket. A record of the previous
//! layout (version 2: two doorkeepers) is read as this one, never below what it counted
//! ([`Set::decode`]).
//!
//! Invariant: what [`Set::encode`] writes, [`Set::decode`] reads back as it was; anything else it
//! reads is refused or, in the previous layout, never counts less than it did.

use super::overflow::{Overflow, DOORS, DOOR_BYTES, OVERFLOW_LEN, SKETCH_CELLS};
use super::{Entry, Set, WAYS};
use crate::primitives::record::{DecodeError, Fill, Reader, Writer};
use crate::ratelimit::window::Counts;

/// The layout version written in the first byte of every record.
pub const RECORD_VERSION: u8 = 3;
/// The previous layout's version (two doorkeepers, of 1 024 and 256 bits), read and converted
/// ([`Set::decode`]).
pub const RECORD_VERSION_TWO_DOORS: u8 = 2;
const TWO_DOORS_BYTES: usize = (1024 + 256) / 8;
const HEADER_LEN: usize = 4 + 8 + 8;
/// Where the shape stamp sits in a record (after version, ways and 2 zero bytes).
pub const SHAPE_OFFSET: usize = 4;
const ENTRY_LEN: usize = 16;
/// Bytes of one encoded set.
pub const RECORD_LEN: usize = HEADER_LEN + WAYS * ENTRY_LEN + 2 * OVERFLOW_LEN;
/// Bytes of one encoded set of the previous layout.
pub const RECORD_LEN_TWO_DOORS: usize = HEADER_LEN + WAYS * ENTRY_LEN + 2 * (TWO_DOORS_BYTES + 4 * SKETCH_CELLS);

impl Set {
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
    use super::super::tests::{add, key};
    use super::*;

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
}
