//! The batch on its way, as an ask names it: the units of the asked key that the ask leaves out
//! of its limit (this proxy admitted them, the store had not confirmed them) and that a batch
//! sent and not yet confirmed carries. While that batch waits in `floodgate-sync`, its units may
//! be applied in Redis before the ask is answered; the ask then names them ([`Carried`]), and the
//! store takes them back into the ask's limit once its dedup shows that batch applied, instead of
//! counting them twice (a refusal while the fleet has room).
//!
//! The VM that sends a batch writes this record in shared data once it took the batch's deltas
//! (its source, seq, longest window and deltas). When the batch is confirmed, the view takes its
//! totals, and every view record written marks the batch as the last one it confirmed
//! ([`super::view::Confirmed`]); then this record is emptied. A worker that asks reads its view
//! and its counts (its `pending` units: those counts less the view's confirmed part), and, with
//! units pending, this record, then the view again, then the counts again; it names the batch's
//! units of its key when the view it read after the record does not hold the batch confirmed.
//!
//! Invariant: an ask weighs each of its proxy's units once. A source sends a batch only once the
//! one before is confirmed, and writes its record after that batch's totals are in the view: so
//! the view read after the record holds every batch before the record's confirmed (its units
//! out of `pending`, in the store's count), and the record's own batch either confirmed (not
//! named) or not (its units in `pending`, named, at most `pending`, and taken back by the store
//! once it shows the batch applied). An emptied record finds its batch confirmed in the view
//! read after it. A unit is thus never left out of the limit while in the store's count (a
//! refusal while the fleet has room) nor named while confirmed (an admission over the limit).
//! A batch of another source than the last one the view record confirmed (the leadership
//! moved) is not named: should it be applied, its units are weighed twice until it is
//! confirmed; the proxy admits less, never more.
//!
//! Rationale: docs/global.md, "A key a proxy has not learned".

use super::leadership::Batch;
use super::outbox::{self, Delta, Deltas};
use crate::fleet::protocol::Carried;
use crate::primitives::record::{DecodeError, Reader, Writer};
use crate::primitives::store::{SharedStore, StoreError};

const HEADER_LEN: usize = 3 * 8;

/// The record of `batch` from `source`: a header (source, seq, longest window), then the batch's
/// deltas as an outbox record. A batch's deltas are already merged (it took them out of a
/// [`Deltas`]), so they are written as they are.
pub fn encode(source: u64, batch: &Batch) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN.saturating_add(outbox::record_len(batch.deltas.len())));
    out.put_u64(source);
    out.put_u64(batch.seq);
    out.put_u64(batch.deltas.iter().map(|d| d.window_ms).max().unwrap_or(0));
    outbox::put_record(&mut out, &batch.deltas);
    out
}

/// Whether `batch` carries units an ask could name (a batch of reads alone does not).
pub fn carries_units(batch: &Batch) -> bool {
    batch.deltas.iter().any(|d| d.delta > 0)
}

/// Writes the record of `batch`, sent by `source`, over any other (one
/// write: the batch of another VM, which a VM that lost the leadership may still be sending,
/// is then not named by asks, which leave its units out of their limits as before).
pub fn publish<S: SharedStore + ?Sized>(store: &S, key: &str, source: u64, batch: &Batch) -> Result<(), StoreError> {
    store.set(key, &encode(source, batch), None)
}

/// Empties the record once the view holds its batch confirmed (one write, whichever batch it
/// holds: one another VM sent is then not named, as above).
pub fn clear<S: SharedStore + ?Sized>(store: &S, key: &str) -> Result<(), StoreError> {
    store.set(key, &[], None)
}

fn header(bytes: &[u8]) -> Result<(u64, u64, u64), DecodeError> {
    let mut reader = Reader::new(bytes);
    Ok((reader.u64()?, reader.u64()?, reader.u64()?))
}

/// The units of `counter` (rule id, key fingerprint, bucket) that the batch in the record
/// `bytes` carries (`None`: no batch, or none of them).
pub fn carried(bytes: &[u8], counter: (u64, u64, u64)) -> Option<Carried> {
    if bytes.len() < HEADER_LEN {
        return None;
    }
    let (source, seq, longest_window_ms) = header(bytes).ok()?;
    let deltas = Deltas::decode(bytes.get(HEADER_LEN..)?, usize::MAX).ok()?;
    let units = deltas
        .iter()
        .filter(|d: &&Delta| d.counter() == counter)
        .map(|d| d.delta.saturating_sub(d.refund))
        .fold(0u32, u32::saturating_add);
    (units > 0).then_some(Carried { source, seq, units, longest_window_ms })
}

/// [`carried`] of the record under `key` in `store`.
pub fn read<S: SharedStore + ?Sized>(store: &S, key: &str, counter: (u64, u64, u64)) -> Option<Carried> {
    let stored = store.get(key).ok()??;
    carried(&stored.value, counter)
}

/// What an ask names ([`Carried`], at most `pending`) with `pending` units of its key
/// unconfirmed, as `pending` gives them once the record was read (`None`: nothing).
pub fn named(carried: Option<Carried>, pending: u32) -> Option<Carried> {
    carried.map(|c| Carried { units: c.units.min(pending), ..c }).filter(|c| c.units > 0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::keys::fleet::FleetKey;
    use crate::primitives::store::MemoryStore;

    fn delta(fingerprint: u64, bucket: u64, units: u32, refund: u32) -> Delta {
        Delta { rule: 9, fingerprint, key: FleetKey(u128::from(fingerprint)), window_ms: 60_000, bucket, delta: units, requests: units, refund }
    }

    #[test]
    fn an_ask_names_the_units_of_its_key_in_the_batch_at_most_its_pending() {
        let batch = Batch { seq: 12, deltas: vec![delta(1, 5, 30, 0), delta(2, 5, 8, 3), delta(1, 4, 9, 0), Delta { window_ms: 3_600_000, ..delta(3, 0, 1, 0) }] };
        let record = encode(0xab, &batch);
        assert_eq!(carried(&record, (9, 1, 5)), Some(Carried { source: 0xab, seq: 12, units: 30, longest_window_ms: 3_600_000 }));
        assert_eq!(named(carried(&record, (9, 1, 5)), 20).map(|c| c.units), Some(20), "at most what the view leaves unconfirmed");
        assert_eq!(named(carried(&record, (9, 1, 5)), 0), None, "nothing pending");
        assert_eq!(carried(&record, (9, 2, 5)).map(|c| c.units), Some(5), "less what it gives back");
        assert_eq!(carried(&record, (9, 1, 6)), None, "another bucket");
        assert_eq!(carried(&record, (8, 1, 5)), None, "another rule");
        assert_eq!(carried(b"", (9, 1, 5)), None, "no batch on its way");
        assert_eq!(carried(&record[..20], (9, 1, 5)), None, "unreadable");
    }

    #[test]
    fn the_record_is_its_header_then_the_outbox_record_of_the_batch_s_merged_deltas() {
        let mut merged = Deltas::new(usize::MAX);
        merged.absorb([delta(1, 5, 30, 0), delta(2, 5, 8, 3), delta(1, 5, 4, 1), Delta { window_ms: 1_000, ..delta(3, 0, 1, 0) }]);
        let expected = merged.encode();
        let batch = Batch { seq: 12, deltas: merged.take() };
        assert_eq!(batch.deltas.len(), 3, "merged per key and bucket");
        let record = encode(0xab, &batch);
        assert_eq!(record.len(), HEADER_LEN + expected.len());
        assert_eq!(header(&record).unwrap(), (0xab, 12, 60_000), "source, seq, longest window");
        assert_eq!(&record[HEADER_LEN..], expected.as_slice(), "the outbox layout");
        assert_eq!(carried(&record, (9, 1, 5)).map(|c| c.units), Some(33), "the merged units, less what they give back");
        let empty = encode(0xab, &Batch { seq: 13, deltas: Vec::new() });
        assert_eq!(header(&empty).unwrap(), (0xab, 13, 0));
        assert_eq!(&empty[HEADER_LEN..], Deltas::new(usize::MAX).encode().as_slice());
        assert_eq!(carried(&empty, (9, 1, 5)), None, "nothing carried");
    }

    #[test]
    fn a_published_batch_is_named_until_it_is_cleared() {
        let store = MemoryStore::new();
        let batch = Batch { seq: 3, deltas: vec![delta(1, 5, 2, 0)] };
        assert!(carries_units(&batch));
        assert!(!carries_units(&Batch { seq: 4, deltas: vec![delta(1, 5, 0, 0)] }), "reads alone");
        publish(&store, "b", 7, &batch).unwrap();
        assert_eq!(read(&store, "b", (9, 1, 5)).map(|c| (c.source, c.seq)), Some((7, 3)));
        clear(&store, "b").unwrap();
        assert_eq!(read(&store, "b", (9, 1, 5)), None);
    }
}
