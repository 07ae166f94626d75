//! Deltas: requests a proxy admitted under global rules and has not sent to the store yet, merged
//! per key and window bucket, so that their size follows the number of active keys, not the request
//! rate. Each worker VM adds its admissions to its own [`Deltas`] (no host call), and once per
//! `sync_interval` moves them into one of [`OUTBOXES`] shared-data records (chosen by its VM id)
//! with a compare-and-swap; the flusher takes every outbox (a compare-and-swap that leaves it
//! empty).
//!
//! Invariant: a delta is always in exactly one place: a VM's memory, an outbox, or the flusher's
//! batch.
//!
//! Record layout (little-endian): version `u8`, 3 zero bytes, count `u32`, then per delta the rule
//! id `u64`, the local fingerprint `u64`, the fleet key `u128`, the window `u64` (ms), the bucket
//! `u64`, the delta `u32`, the requests `u32`, the refund `u32` (version 3; version 2, without the
//! refund, is still read: the outboxes a module update finds keep their admissions).
//!
//! Rationale: docs/design.md, section "Batched consistency".

use crate::keys::fleet::FleetKey;
use crate::primitives::hash::MixMap;
use crate::primitives::record::{DecodeError, Reader, Writer};

/// Outbox records per proxy.
pub const OUTBOXES: u64 = 4;
/// Deltas one outbox record holds at most (about 53 KiB).
pub const OUTBOX_CAPACITY: usize = 1024;
const RECORD_VERSION: u8 = 3;
const HEADER_LEN: usize = 8;
const DELTA_LEN: usize = 8 + 8 + 16 + 8 + 8 + 4 + 4 + 4;
/// Version 2's delta: no refund.
const DELTA_LEN_V2: usize = DELTA_LEN - 4;

/// A counter to send, as the proxy knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delta {
    /// The rule's id (a hash of its name: stable across configuration changes).
    pub rule: u64,
    /// The key's local fingerprint (its hash under this proxy's seed): where the view keeps it.
    pub fingerprint: u64,
    /// The key's fleet-wide id.
    pub key: FleetKey,
    /// The rule's window.
    pub window_ms: u64,
    /// The window bucket.
    pub bucket: u64,
    /// Units admitted (0: a key refused here, whose fleet-wide count is wanted anyway).
    pub delta: u32,
    /// Requests this proxy decided for the key, admitted or refused: its demand, from which
    /// its share of the key is learned ([`super::view::Share`]). Never sent to the store.
    pub requests: u32,
    /// Units given back: reserved at admission in this bucket, not used (a reservation settled
    /// below its estimate). The store takes them off the bucket's count, never below zero.
    pub refund: u32,
}

impl Delta {
    /// The counter it adds to: rule id, key fingerprint, bucket (deltas of one counter merge).
    pub fn counter(&self) -> (u64, u64, u64) {
        (self.rule, self.fingerprint, self.bucket)
    }
}

/// Deltas merged by rule, key and bucket, at most `max` of them, in arrival order.
#[derive(Clone, Debug, Default)]
pub struct Deltas {
    entries: Vec<Delta>,
    index: MixMap<(u64, u64, u64), usize>,
    max: usize,
}

impl Deltas {
    /// Empty, holding at most `max` deltas.
    pub fn new(max: usize) -> Deltas {
        Deltas { entries: Vec::new(), index: MixMap::default(), max }
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The deltas, in arrival order.
    pub fn iter(&self) -> impl Iterator<Item = &Delta> {
        self.entries.iter()
    }

    /// Adds `delta`, merged with the same key's delta of the same bucket. False when it would be
    /// a new entry and there is no room (nothing is added).
    pub fn add(&mut self, delta: Delta) -> bool {
        if let Some(&at) = self.index.get(&delta.counter()) {
            if let Some(entry) = self.entries.get_mut(at) {
                entry.delta = entry.delta.saturating_add(delta.delta);
                entry.requests = entry.requests.saturating_add(delta.requests);
                entry.refund = entry.refund.saturating_add(delta.refund);
                return true;
            }
        }
        if self.entries.len() >= self.max {
            return false;
        }
        self.index.insert(delta.counter(), self.entries.len());
        self.entries.push(delta);
        true
    }

    /// Adds every delta of `others` that fits; returns those that did not.
    pub fn absorb(&mut self, others: impl IntoIterator<Item = Delta>) -> Vec<Delta> {
        let others = others.into_iter();
        self.reserve(others.size_hint().0);
        others.filter(|d| !self.add(*d)).collect()
    }

    /// Makes room for `more` new deltas (as many as fit) at once rather than growing step by step.
    fn reserve(&mut self, more: usize) {
        let more = more.min(self.max.saturating_sub(self.entries.len()));
        self.entries.reserve(more);
        self.index.reserve(more);
    }

    /// Takes every delta out.
    pub fn take(&mut self) -> Vec<Delta> {
        self.index.clear();
        std::mem::take(&mut self.entries)
    }

    /// Drops the deltas of buckets that ended more than a bucket ago (`now_bucket(window_ms)`
    /// gives the current bucket of a window): the store no longer weighs them. Returns how many
    /// requests they held.
    pub fn drop_expired(&mut self, now_bucket: impl Fn(u64) -> u64) -> u64 {
        if self.entries.iter().all(|d| d.bucket.saturating_add(1) >= now_bucket(d.window_ms)) {
            return 0;
        }
        let before: u64 = self.entries.iter().map(|d| u64::from(d.delta)).sum();
        let kept: Vec<Delta> = self
            .take()
            .into_iter()
            .filter(|d| d.bucket.saturating_add(1) >= now_bucket(d.window_ms))
            .collect();
        self.absorb(kept);
        let after: u64 = self.entries.iter().map(|d| u64::from(d.delta)).sum();
        before.saturating_sub(after)
    }

    /// The outbox record of these deltas.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(record_len(self.entries.len()));
        put_record(&mut out, &self.entries);
        out
    }

    /// Reads an outbox record holding at most `max` deltas (an empty value is an empty outbox).
    pub fn decode(bytes: &[u8], max: usize) -> Result<Deltas, DecodeError> {
        let mut deltas = Deltas::new(max);
        if bytes.is_empty() {
            return Ok(deltas);
        }
        let v2 = bytes.first() == Some(&2);
        let mut reader = Reader::new(bytes);
        let (version, count) = reader.list_header(if v2 { DELTA_LEN_V2 } else { DELTA_LEN })?;
        if (version != RECORD_VERSION && !v2) || count > max {
            return Err(DecodeError::Malformed);
        }
        deltas.reserve(count);
        for _ in 0..count {
            let delta = Delta {
                rule: reader.u64()?,
                fingerprint: reader.u64()?,
                key: FleetKey(reader.u128()?),
                window_ms: reader.u64()?,
                bucket: reader.u64()?,
                delta: reader.u32()?,
                requests: reader.u32()?,
                refund: if v2 { 0 } else { reader.u32()? },
            };
            if delta.window_ms == 0 {
                return Err(DecodeError::Malformed);
            }
            deltas.add(delta);
        }
        Ok(deltas)
    }
}

/// The length of the outbox record of `count` deltas.
pub fn record_len(count: usize) -> usize {
    HEADER_LEN.saturating_add(count.saturating_mul(DELTA_LEN))
}

/// Appends to `out` the outbox record of `deltas`, as they are: deltas already merged (a
/// [`Deltas`]' own, or those a batch took out of one) make the record [`Deltas::encode`] makes.
pub fn put_record(out: &mut Vec<u8>, deltas: &[Delta]) {
    out.put_list_header(RECORD_VERSION, deltas.len());
    for d in deltas {
        out.put_u64(d.rule);
        out.put_u64(d.fingerprint);
        out.put_u128(d.key.0);
        out.put_u64(d.window_ms);
        out.put_u64(d.bucket);
        out.put_u32(d.delta);
        out.put_u32(d.requests);
        out.put_u32(d.refund);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn delta(key: u64, bucket: u64, n: u32) -> Delta {
        Delta { rule: 7, fingerprint: key, key: FleetKey(u128::from(key) << 64 | 1), window_ms: 1000, bucket, delta: n, requests: 1, refund: 0 }
    }

    #[test]
    fn give_backs_merge_beside_the_units_of_their_bucket() {
        let mut d = Deltas::new(2);
        assert!(d.add(delta(1, 5, 100)));
        assert!(d.add(Delta { refund: 70, requests: 0, ..delta(1, 5, 0) }));
        assert!(d.add(Delta { refund: 20, requests: 0, ..delta(1, 4, 0) }), "the admission's bucket, not now's");
        assert!(d.add(Delta { refund: 5, requests: 0, ..delta(1, 5, 0) }));
        assert!(!d.add(Delta { refund: 1, requests: 0, ..delta(2, 5, 0) }), "full: a give-back needs room like a delta");
        let merged: Vec<(u64, u32, u32, u32)> = d.iter().map(|x| (x.bucket, x.delta, x.refund, x.requests)).collect();
        assert_eq!(merged, vec![(5, 100, 75, 1), (4, 0, 20, 0)]);
        let back = Deltas::decode(&d.encode(), 2).unwrap();
        assert_eq!(back.iter().copied().collect::<Vec<_>>(), d.iter().copied().collect::<Vec<_>>());
        // A give-back of a bucket the store no longer weighs is dropped with it.
        d.drop_expired(|_| 6);
        assert_eq!(d.iter().map(|x| x.bucket).collect::<Vec<_>>(), vec![5]);
    }

    #[test]
    fn deltas_merge_per_key_and_bucket_and_stay_bounded() {
        let mut d = Deltas::new(2);
        assert!(d.add(delta(1, 5, 1)));
        assert!(d.add(delta(1, 5, 2)));
        assert!(d.add(delta(1, 6, 1)), "another bucket is another delta");
        assert!(!d.add(delta(2, 5, 1)), "full");
        assert!(d.add(delta(1, 6, 4)), "merging needs no room");
        assert_eq!(d.iter().map(|x| (x.bucket, x.delta)).collect::<Vec<_>>(), vec![(5, 3), (6, 5)]);
        let rejected = Deltas::new(1).absorb(d.take());
        assert_eq!(rejected.len(), 1);
        assert!(d.is_empty());
    }

    #[test]
    fn records_round_trip_and_refuse_corruption() {
        let mut d = Deltas::new(10);
        for k in 0..4 {
            d.add(delta(k, 9, k as u32));
        }
        let bytes = d.encode();
        let back = Deltas::decode(&bytes, 10).unwrap();
        assert_eq!(back.iter().copied().collect::<Vec<_>>(), d.iter().copied().collect::<Vec<_>>());
        assert!(Deltas::decode(&[], 10).unwrap().is_empty());
        for cut in 1..bytes.len() {
            assert!(Deltas::decode(&bytes[..cut], 10).is_err(), "cut at {cut}");
        }
        assert!(Deltas::decode(&bytes, 3).is_err(), "more than allowed");
        let mut other = bytes.clone();
        other[0] = 9;
        assert!(Deltas::decode(&other, 10).is_err());
        // Version 2 (no refund) is read: an outbox written by the module before an update.
        let mut v2 = bytes[..8].to_vec();
        v2[0] = 2;
        for chunk in bytes[8..].chunks(DELTA_LEN) {
            v2.extend_from_slice(&chunk[..DELTA_LEN_V2]);
        }
        let back = Deltas::decode(&v2, 10).unwrap();
        assert_eq!(back.iter().copied().collect::<Vec<_>>(), d.iter().copied().collect::<Vec<_>>());
        assert!(Deltas::decode(&v2[..v2.len() - 1], 10).is_err());
    }

    #[test]
    fn deltas_of_buckets_the_store_no_longer_weighs_are_dropped() {
        let mut d = Deltas::new(10);
        d.add(delta(1, 3, 2));
        d.add(delta(2, 4, 1));
        d.add(delta(3, 5, 1));
        assert_eq!(d.drop_expired(|_| 5), 2);
        assert_eq!(d.iter().map(|x| x.bucket).collect::<Vec<_>>(), vec![4, 5]);
    }
}
