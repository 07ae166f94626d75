//! The view: what a proxy last learned of its keys' fleet-wide counts. For each key the flusher
//! synced, a [`ViewEntry`] keeps the fleet totals of the key's bucket and of the one before, this
//! proxy's confirmed part of them, how fast the others' part grew ([`RemoteRate`]) and this proxy's
//! share of the key's traffic ([`Share`]). Entries live in [`VIEW_RECORDS`] shared-data records
//! written only by the flusher, plus an index of versions; every worker keeps a copy
//! ([`ViewCache`]), refreshed by the records whose version moved, so a request finds its key's
//! counts without a host call.
//!
//! Invariants: `remote = total − applied`, never below zero. The two projections (one interval of
//! the others' growth, and their traffic since in proportion to this proxy's:
//! [`ViewEntry::shared_at`]) count until [`ViewEntry::projected_until`], [`HOLD_INTERVALS`]
//! intervals after the last sync that found the others' part grown or the key at its limit
//! ([`ViewEntry::contended_at`]), and not after it. A proxy's part counts at least a quarter of
//! its requests, refused ones included ([`DEMAND_WEIGHT`]), so a proxy that loses a race for a
//! saturated key keeps its share. A key the
//! proxy stops sending is still refreshed: each batch reads up to [`REFRESH_PER_BATCH`] keys synced
//! longest ago, a key near its rule's least limit (its fleet total at least half of it) once it
//! was not synced for [`REFRESH_AFTER_INTERVALS`] intervals, a key far under it once it was not
//! for [`REFRESH_FAR_AFTER_MS`], and only while the proxy still sends it: until
//! [`REFRESH_WHILE_USED_MS`] after a sync last carried its own requests of the key. Every key the
//! proxy uses is thus re-read at least once a second, one whose staleness could cost its limit
//! more often; a key it no longer sees is not re-read until it sees it again, and is then
//! decided on its units since, spread over the fleet ([`super::ask::spread`]), until its next
//! batch brings the key's counts back.
//!
//! Each record also names the last batch whose totals it took ([`Confirmed`]): an ask finds
//! there whether the batch on its way ([`super::in_flight`]) is in the view it read.
//!
//! Record layout (little-endian, version 7; a record of another version reads as empty): version
//! `u8`, 3 zero bytes, count `u32`, the last batch confirmed in it (its source `u64` and seq `u64`,
//! 0 and 0 for none), then per entry the rule id `u64`, the fingerprint `u64`, the
//! fleet key `u128`, the window (ms) `u64`, the bucket `u64`, total previous and current `u32`,
//! applied previous and current `u32`, when it was last synced (ms) `u64`, the remote rate's units
//! and milliseconds `u32`, the share's local and remote averages (`f32` bits, finite), when a sync
//! last found the others' part grown or the key at its limit (ms) `u64`, and when one last
//! carried this proxy's own requests or units of the key (ms) `u64`. Index
//! (version 3): version `u8`, 7 zero bytes, last success (ms, 0 for never) `u64`, then
//! [`VIEW_RECORDS`] versions `u64`.
//!
//! Rationale: docs/design.md, section "Batched consistency".

use super::outbox::Delta;
use crate::keys::fleet::FleetKey;
use super::protocol::Totals;
use crate::ratelimit::remote::Remote;
use crate::ratelimit::window::Counts;
use crate::primitives::time::UnixMillis;
use crate::primitives::hash::MixMap;
use crate::primitives::record::{DecodeError, Reader, Writer};

/// Records the view is spread over. Every worker reads the index and each record that changed
/// at every tick, one host call each, and a batch of a busy proxy changes them all: few records
/// keep those calls few (4: 1 024 entries each at the default `max_keys`), and a record is
/// only rewritten when one of its keys was synced.
pub const VIEW_RECORDS: usize = 4;
/// Keys a batch re-reads at most besides its deltas.
pub const REFRESH_PER_BATCH: usize = 128;
/// A key near its limit is re-read once it was not synced for this many intervals.
pub const REFRESH_AFTER_INTERVALS: u64 = 5;
/// A key far under its limit (its fleet total under half the rule's least limit) is re-read
/// once it was not synced for this long (ms), or [`REFRESH_AFTER_INTERVALS`] if longer.
pub const REFRESH_FAR_AFTER_MS: u64 = 1_000;
/// A key is re-read only until this long (ms) after a sync last carried this proxy's own
/// requests or units of it.
pub const REFRESH_WHILE_USED_MS: u64 = 10_000;

/// Which keys a batch re-reads: those near their limit not synced since `near`, the others not
/// synced since `far`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Due {
    /// Keys near their limit synced before this are due.
    pub near: UnixMillis,
    /// Every key synced before this is due.
    pub far: UnixMillis,
}
/// A key's projections count for this many intervals after the last sync that found the other
/// proxies' part grown, and no longer.
pub const HOLD_INTERVALS: u64 = 3;
const RECORD_VERSION: u8 = 7;
const INDEX_VERSION: u8 = 3;
const ENTRY_LEN: usize = 8 + 8 + 16 + 8 + 8 + 4 * 4 + 8 + 4 + 4 + 4 + 4 + 8 + 8;
const INDEX_LEN: usize = 16 + 8 * VIEW_RECORDS;
const HEADER_LEN: usize = 8 + 8 + 8;

/// What the proxy knows of one key's fleet-wide counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ViewEntry {
    /// The rule's id.
    pub rule: u64,
    /// The key's local fingerprint.
    pub fingerprint: u64,
    /// The key's fleet-wide id.
    pub key: FleetKey,
    /// The rule's window.
    pub window_ms: u64,
    /// The bucket `total.current` and `applied.current` are of.
    pub bucket: u64,
    /// Fleet totals of the bucket before and of `bucket`.
    pub total: Counts,
    /// This proxy's confirmed part of them.
    pub applied: Counts,
    /// When the flusher last synced the key.
    pub synced: UnixMillis,
    /// How fast the other proxies' part grew between the two last syncs.
    pub rate: RemoteRate,
    /// How the key's growth splits between this proxy and the others, over the recent syncs.
    pub share: Share,
    /// When a sync last found the other proxies' part grown, or the key at its limit (its fleet
    /// count within 1 % of it, where every proxy refuses and nothing grows: the projections count
    /// on, so the room the window's decay frees is not offered to every proxy at once) (0: never).
    pub contended_at: UnixMillis,
    /// When a sync last carried this proxy's own requests or units of the key (0: never).
    pub used: UnixMillis,
}

/// A key's recent traffic here and elsewhere: exponentially weighted moving averages, per sync,
/// of what this proxy admitted of the key (at least its requests, refused ones included, over
/// [`DEMAND_WEIGHT`]) and of what the other proxies' part grew by since the sync before (weight
/// [`SHARE_WEIGHT`] on the newest). Only their ratio is used; a sync that finds nothing new at
/// all, or nothing grown elsewhere while this proxy refused requests, leaves it as it was.
/// Both are always finite (learned from integers; a record holding anything else is refused),
/// which is what makes the `Eq` below sound.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Share {
    /// This proxy's admissions per sync (at least its requests over [`DEMAND_WEIGHT`]), averaged.
    pub local: f32,
    /// The other proxies' growth per sync, averaged.
    pub remote: f32,
}

/// A sync's local sample is this proxy's admitted units, or its requests (refused ones
/// included) divided by this, whichever is larger: admissions keep the fleet tight at the
/// limit, and the floor keeps a proxy that loses the race for a saturated key's refill from
/// seeing its share fall to nothing (1: shares by demand, fair but looser at the limit; 8:
/// unfair in the tests; 4 keeps every proxy above a quarter of its fair part of each window).
pub const DEMAND_WEIGHT: u32 = 4;
/// The newest sample's weight in [`Share`]'s averages.
pub const SHARE_WEIGHT: f32 = 0.25;
/// The other proxies' units per local unit at most (a proxy with a share of 1/65 or less).
pub const MAX_PER_LOCAL: f32 = 64.0;

impl Share {
    fn learn(&mut self, local: u32, remote: u32) {
        if local == 0 && remote == 0 {
            return;
        }
        #[allow(clippy::cast_precision_loss)]
        let (local, remote) = (local as f32, remote as f32);
        if self.local == 0.0 && self.remote == 0.0 {
            *self = Share { local, remote };
            return;
        }
        self.local += SHARE_WEIGHT * (local - self.local);
        self.remote += SHARE_WEIGHT * (remote - self.remote);
    }

    /// The other proxies' units per local unit, × 2¹⁶ ([`crate::ratelimit::remote`]).
    pub fn per_local_q16(&self) -> u32 {
        if self.remote <= 0.0 {
            return 0;
        }
        let ratio = if self.local <= 0.0 { MAX_PER_LOCAL } else { (self.remote / self.local).min(MAX_PER_LOCAL) };
        // In range by the clamp above: at most 64 × 2¹⁶.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let q16 = (ratio * 65_536.0) as u32;
        q16
    }
}

impl Eq for Share {}

/// How much the other proxies' part of a key grew between two syncs, and over how long: a rate
/// kept as a fraction, so that projecting it is exact integer arithmetic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteRate {
    /// Units the other proxies added (0: none, or not known).
    pub grew_units: u32,
    /// Milliseconds between the two syncs.
    pub over_ms: u32,
}

fn clamp(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

impl ViewEntry {
    /// The fleet's totals, as seen from window bucket `bucket`.
    pub fn total_at(&self, bucket: u64) -> Counts {
        self.total.rolled(self.bucket, bucket)
    }

    /// What the other proxies admitted, as seen from window bucket `bucket`.
    pub fn remote_at(&self, bucket: u64) -> Counts {
        let remote = Counts {
            previous: self.total.previous.saturating_sub(self.applied.previous),
            current: self.total.current.saturating_sub(self.applied.current),
        };
        remote.rolled(self.bucket, bucket)
    }

    /// The last millisecond the key's projections count if no sync finds the other proxies'
    /// part grown or the key at its limit again: [`HOLD_INTERVALS`] after the last sync that did
    /// (`None`: none did).
    pub fn projected_until(&self, interval_ms: u64) -> Option<UnixMillis> {
        let hold_ms = interval_ms.saturating_mul(HOLD_INTERVALS).saturating_sub(1);
        (self.contended_at > UnixMillis(0)).then(|| self.contended_at.plus_ms(hold_ms))
    }

    /// What the other proxies add to this proxy's counts of the key in bucket `bucket` at `now`
    /// ([`crate::ratelimit::remote`]): their counts as last synced ([`Self::remote_at`]) and,
    /// until [`Self::projected_until`], two projections of their traffic (module doc): what
    /// their rate gives over one interval, the part of it before this proxy's last sync that
    /// the store had not seen yet (nothing when that sync found their part not grown), and
    /// their growth since in proportion to this proxy's growth past its confirmed part
    /// ([`Share`]).
    pub fn shared_at(&self, bucket: u64, now: UnixMillis, interval_ms: u64) -> Remote {
        let remote = Remote { synced: self.remote_at(bucket), confirmed: self.applied.rolled(self.bucket, bucket).current, ..Remote::NONE };
        let Some(until) = self.projected_until(interval_ms).filter(|until| now <= *until) else {
            return remote;
        };
        let span_ms = u64::from(self.rate.over_ms).max(interval_ms).max(1);
        let unseen = u64::from(self.rate.grew_units).saturating_mul(interval_ms).checked_div(span_ms).unwrap_or(0);
        Remote { unseen: clamp(unseen), per_local_q16: self.share.per_local_q16(), projected_until: until, ..remote }
    }

    /// The other proxies' counts with what the store had not seen of them ([`Self::shared_at`]).
    #[cfg(test)]
    pub fn projected_at(&self, bucket: u64, now: UnixMillis, interval_ms: u64) -> Counts {
        let remote = self.shared_at(bucket, now, interval_ms);
        remote.synced.plus(remote.unseen)
    }

    /// Takes the sample of the remote rate between the sync of `before` (this entry as it was)
    /// and this one, at `now`, and renews the projections' hold ([`Self::contended_at`]) when
    /// the others' part grew or the key is `at_limit`. A first sync, a clock that went back and
    /// a second delta of the same batch keep the rate and the hold as they were.
    fn learn_rate(&mut self, before: Option<&ViewEntry>, demand: u32, at_limit: bool, now: UnixMillis) {
        let Some(before) = before else { return };
        if now <= before.synced {
            return;
        }
        let over_ms = clamp(now.saturating_since(before.synced));
        let growth = |was: Counts, is: Counts| is.previous.saturating_sub(was.previous).saturating_add(is.current.saturating_sub(was.current));
        match self.bucket.checked_sub(before.bucket) {
            Some(0 | 1) => {
                let grew_units = growth(before.remote_at(self.bucket), self.remote_at(self.bucket));
                let grew_here = growth(before.applied.rolled(before.bucket, self.bucket), self.applied);
                self.rate = RemoteRate { grew_units, over_ms };
                if grew_units > 0 || at_limit {
                    self.contended_at = now;
                }
                // Nothing admitted elsewhere while this proxy refused some of its own: every
                // proxy is at the limit, and the ratio stays (the room held back is not offered
                // to all of them at once).
                if grew_units > 0 || grew_here >= demand {
                    self.share.learn(grew_here.max(demand / DEMAND_WEIGHT), grew_units);
                }
            }
            // Two buckets or more apart (or a bucket back): the difference means nothing.
            _ => self.rate = RemoteRate { grew_units: 0, over_ms },
        }
    }

    /// Takes in a confirmed delta and the store's totals after it. Totals only grow between
    /// batches without give-backs (the larger one is kept, whatever order answers come in); a
    /// batch that gave units back makes its answer's totals the key's (they may be lower).
    fn update(&mut self, delta: &Delta, totals: Totals, now: UnixMillis) {
        let (previous, current) = (clamp(totals.previous), clamp(totals.current));
        let lower = delta.refund > 0;
        let merged = |was: u32, is: u32| if lower { is } else { was.max(is) };
        let net = |was: u32| was.saturating_add(delta.delta).saturating_sub(delta.refund);
        match delta.bucket.checked_sub(self.bucket) {
            Some(0) => {
                self.applied.current = net(self.applied.current);
                self.total.previous = self.total.previous.max(previous);
                self.total.current = merged(self.total.current, current);
            }
            Some(1) => {
                self.applied = Counts { previous: self.applied.current, current: net(0) };
                self.total = Counts { previous: self.total.current.max(previous), current };
                self.bucket = delta.bucket;
            }
            Some(_) => {
                // Two buckets or more later: nothing older counts any more.
                self.applied = Counts { previous: 0, current: net(0) };
                self.total = Counts { previous, current };
                self.bucket = delta.bucket;
            }
            None if delta.bucket.saturating_add(1) == self.bucket => {
                // A delta of the bucket before this entry's (sent just before it rolled, or a
                // give-back of a reservation admitted in it).
                self.applied.previous = net(self.applied.previous);
                self.total.previous = merged(self.total.previous, current);
            }
            None => {}
        }
        self.synced = now;
        if delta.requests > 0 || delta.delta > 0 || delta.refund > 0 {
            self.used = now;
        }
    }
}

/// Which record keeps a fingerprint.
pub fn record_of(fingerprint: u64) -> usize {
    usize::try_from(fingerprint.checked_rem(VIEW_RECORDS as u64).unwrap_or(0)).unwrap_or(0)
}

/// One view record's entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ViewRecord {
    /// By (rule id, fingerprint).
    pub entries: MixMap<(u64, u64), ViewEntry>,
    /// The last batch whose totals the record took.
    pub confirmed: Confirmed,
}

/// A batch, by its source and seq: the last one whose totals a view record took (seq 0: none;
/// a source's seqs start at 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Confirmed {
    /// The batch's source.
    pub source: u64,
    /// Its seq.
    pub seq: u64,
}

impl Confirmed {
    /// Whether batch `seq` of `source` is known not to be in the record: no batch is, or the
    /// last one is of the same source and before it (a source sends its next batch once the one
    /// before is confirmed). A batch of another source (the leadership moved) cannot be placed:
    /// not known.
    pub fn lacks(&self, source: u64, seq: u64) -> bool {
        self.seq == 0 || (self.source == source && self.seq < seq)
    }

    /// Takes batch `seq` of `source` as the last confirmed (a later one of the same source
    /// stays).
    pub fn take(&mut self, source: u64, seq: u64) {
        if self.source != source || self.seq < seq {
            *self = Confirmed { source, seq };
        }
    }
}

impl ViewRecord {
    /// Reads a record (an absent one is empty).
    pub fn decode(bytes: &[u8]) -> Result<ViewRecord, DecodeError> {
        let mut record = ViewRecord::default();
        if bytes.is_empty() {
            return Ok(record);
        }
        let mut reader = Reader::new(bytes);
        let [version, _, _, _] = reader.array()?;
        let count = usize::try_from(reader.u32()?).map_err(|_| DecodeError::Malformed)?;
        record.confirmed = Confirmed { source: reader.u64()?, seq: reader.u64()? };
        if version != RECORD_VERSION || reader.remaining() != count.saturating_mul(ENTRY_LEN) {
            return Err(DecodeError::Malformed);
        }
        record.entries.reserve(count);
        for _ in 0..count {
            let entry = ViewEntry {
                rule: reader.u64()?,
                fingerprint: reader.u64()?,
                key: FleetKey(reader.u128()?),
                window_ms: reader.u64()?,
                bucket: reader.u64()?,
                total: Counts { previous: reader.u32()?, current: reader.u32()? },
                applied: Counts { previous: reader.u32()?, current: reader.u32()? },
                synced: UnixMillis(reader.u64()?),
                rate: RemoteRate { grew_units: reader.u32()?, over_ms: reader.u32()? },
                share: Share { local: f32::from_bits(reader.u32()?), remote: f32::from_bits(reader.u32()?) },
                contended_at: UnixMillis(reader.u64()?),
                used: UnixMillis(reader.u64()?),
            };
            if !entry.share.local.is_finite() || !entry.share.remote.is_finite() {
                return Err(DecodeError::Malformed);
            }
            if entry.window_ms == 0 {
                return Err(DecodeError::Malformed);
            }
            record.entries.insert((entry.rule, entry.fingerprint), entry);
        }
        Ok(record)
    }

    /// Writes the record.
    pub fn encode(&self) -> Vec<u8> {
        let count = self.entries.len().min(u32::MAX as usize);
        let mut out = Vec::with_capacity(HEADER_LEN.saturating_add(count.saturating_mul(ENTRY_LEN)));
        out.put_list_header(RECORD_VERSION, count);
        out.put_u64(self.confirmed.source);
        out.put_u64(self.confirmed.seq);
        for e in self.entries.values().take(count) {
            out.put_u64(e.rule);
            out.put_u64(e.fingerprint);
            out.put_u128(e.key.0);
            out.put_u64(e.window_ms);
            out.put_u64(e.bucket);
            for value in [e.total.previous, e.total.current, e.applied.previous, e.applied.current] {
                out.put_u32(value);
            }
            out.put_u64(e.synced.0);
            out.put_u32(e.rate.grew_units);
            out.put_u32(e.rate.over_ms);
            out.put_u32(e.share.local.to_bits());
            out.put_u32(e.share.remote.to_bits());
            out.put_u64(e.contended_at.0);
            out.put_u64(e.used.0);
        }
        out
    }

    /// Takes in a confirmed delta and its totals, keeping at most `capacity` entries (the key
    /// synced longest ago goes first): a batch of one ([`Self::apply_batch`]), for the tests.
    #[cfg(test)]
    pub fn apply(&mut self, delta: &Delta, totals: Totals, now: UnixMillis, capacity: usize) {
        self.apply_batch(&[(*delta, totals)], now, capacity, |_| false);
    }

    /// Takes in one batch's confirmed deltas of this record and their totals (in bucket order),
    /// then each key's sample of the remote rate since its sync before this one; `at_limit`
    /// tells whether a key's fleet count, as it now reads, is at its limit
    /// ([`ViewEntry::contended_at`]).
    pub fn apply_batch(&mut self, list: &[(Delta, Totals)], now: UnixMillis, capacity: usize, at_limit: impl Fn(&ViewEntry) -> bool) {
        let mut before: MixMap<(u64, u64), (Option<ViewEntry>, u32)> = MixMap::default();
        for (delta, totals) in list {
            let id = (delta.rule, delta.fingerprint);
            let (_, demand) = before.entry(id).or_insert_with(|| (self.entries.get(&id).copied(), 0));
            *demand = demand.saturating_add(delta.requests);
            self.apply_one(delta, *totals, now, capacity);
        }
        for (id, (was, demand)) in before {
            if let Some(entry) = self.entries.get_mut(&id) {
                let at_limit = at_limit(entry);
                entry.learn_rate(was.as_ref(), demand, at_limit, now);
            }
        }
    }

    fn apply_one(&mut self, delta: &Delta, totals: Totals, now: UnixMillis, capacity: usize) {
        let id = (delta.rule, delta.fingerprint);
        if !self.entries.contains_key(&id) && self.entries.len() >= capacity {
            let oldest = self.entries.iter().min_by_key(|(_, e)| e.synced).map(|(k, _)| *k);
            if let Some(oldest) = oldest {
                self.entries.remove(&oldest);
            }
        }
        if self.entries.len() >= capacity.max(1) && !self.entries.contains_key(&id) {
            return;
        }
        let entry = self.entries.entry(id).or_insert(ViewEntry {
            rule: delta.rule,
            fingerprint: delta.fingerprint,
            key: delta.key,
            window_ms: delta.window_ms,
            bucket: delta.bucket,
            ..ViewEntry::default()
        });
        entry.update(delta, totals, now);
    }
}

/// The index record: each view record's version, when the last sync succeeded, and the fleet
/// size the store last gave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ViewIndex {
    /// When the last batch was confirmed (`None`: never).
    pub last_success: Option<UnixMillis>,
    /// Per record, bumped at every write.
    pub versions: [u64; VIEW_RECORDS],
    /// The fleet size (0: not known yet), in the header's last four bytes.
    pub proxies: u32,
}

impl ViewIndex {
    /// Reads the index (an absent one is all zeros).
    pub fn decode(bytes: &[u8]) -> Result<ViewIndex, DecodeError> {
        if bytes.is_empty() {
            return Ok(ViewIndex::default());
        }
        if bytes.len() != INDEX_LEN || bytes.first() != Some(&INDEX_VERSION) {
            return Err(DecodeError::Malformed);
        }
        let mut reader = Reader::new(bytes);
        let header = reader.array::<8>()?;
        let proxies = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        let last = reader.u64()?;
        let mut versions = [0u64; VIEW_RECORDS];
        for v in &mut versions {
            *v = reader.u64()?;
        }
        Ok(ViewIndex { last_success: (last > 0).then_some(UnixMillis(last)), versions, proxies })
    }

    /// Writes the index.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(INDEX_LEN);
        let [a, b, c, d] = self.proxies.to_le_bytes();
        out.put(&[INDEX_VERSION, 0, 0, 0, a, b, c, d]);
        out.put_u64(self.last_success.map_or(0, |t| t.0));
        for v in &self.versions {
            out.put_u64(*v);
        }
        out
    }
}

/// A worker's copy of the view.
#[derive(Clone, Debug, Default)]
pub struct ViewCache {
    /// The index as last read.
    pub index: ViewIndex,
    records: Vec<ViewRecord>,
}

impl ViewCache {
    /// An empty cache.
    pub fn new() -> ViewCache {
        ViewCache { index: ViewIndex::default(), records: vec![ViewRecord::default(); VIEW_RECORDS] }
    }

    /// Which records to read again, given the index just read.
    pub fn stale(&self, index: &ViewIndex) -> Vec<usize> {
        (0..VIEW_RECORDS)
            .filter(|&i| index.versions.get(i) != self.index.versions.get(i) || self.records.get(i).is_none())
            .collect()
    }

    /// Replaces record `i` (read after `index`).
    pub fn store(&mut self, i: usize, record: ViewRecord) {
        if self.records.len() < VIEW_RECORDS {
            self.records.resize(VIEW_RECORDS, ViewRecord::default());
        }
        if let Some(slot) = self.records.get_mut(i) {
            *slot = record;
        }
    }

    /// Takes record `i` as this VM just wrote it, the index going from `before` to `after`
    /// with that write: only if this copy of the record was of `before`'s version (nobody else
    /// wrote it since this VM read it; otherwise the next tick reads it).
    pub fn took_own_write(&mut self, i: usize, record: ViewRecord, before: &ViewIndex, after: &ViewIndex) {
        let (Some(&was), Some(&now), Some(mine)) = (before.versions.get(i), after.versions.get(i), self.index.versions.get(i).copied()) else {
            return;
        };
        if was != mine || self.records.get(i).is_none() {
            return;
        }
        self.store(i, record);
        if let Some(v) = self.index.versions.get_mut(i) {
            *v = now;
        }
    }

    /// Adopts the index whose stale records were stored.
    pub fn adopt(&mut self, index: ViewIndex) {
        self.index = index;
    }

    /// The other proxies' counts of a key, as seen from `bucket` (zero for a key never synced).
    pub fn remote(&self, rule: u64, fingerprint: u64, bucket: u64) -> Counts {
        self.entry(rule, fingerprint).map_or_else(Counts::default, |e| e.remote_at(bucket))
    }

    /// What the other proxies add to this proxy's counts of a key ([`ViewEntry::shared_at`];
    /// nothing for a key never synced).
    pub fn shared(&self, rule: u64, fingerprint: u64, bucket: u64, now: UnixMillis, interval_ms: u64) -> Remote {
        self.entry(rule, fingerprint).map_or(Remote::NONE, |e| e.shared_at(bucket, now, interval_ms))
    }

    /// Whether batch `seq` of `source` is known not to be confirmed in the record that keeps
    /// `fingerprint`: neither its totals nor this proxy's units in it are in this copy
    /// ([`Confirmed::lacks`]).
    pub fn lacks(&self, fingerprint: u64, source: u64, seq: u64) -> bool {
        self.records.get(record_of(fingerprint)).is_some_and(|r| r.confirmed.lacks(source, seq))
    }

    /// This proxy's confirmed part of a key's counts in `bucket` (0 for a key never told of).
    pub fn confirmed(&self, rule: u64, fingerprint: u64, bucket: u64) -> u32 {
        self.entry(rule, fingerprint).map_or(0, |e| e.applied.rolled(e.bucket, bucket).current)
    }

    /// Whether the view holds a key (a sync or an ask told of it).
    pub fn knows(&self, rule: u64, fingerprint: u64) -> bool {
        self.entry(rule, fingerprint).is_some()
    }

    /// The fleet's counts of a key as the store last gave them, as seen from `bucket` (`None`:
    /// never told of).
    pub fn totals(&self, rule: u64, fingerprint: u64, bucket: u64) -> Option<Counts> {
        self.entry(rule, fingerprint).map(|e| e.total_at(bucket))
    }

    /// [`Self::shared`] and when the key was last synced; `None` for a key never told of.
    pub fn shared_known(&self, rule: u64, fingerprint: u64, bucket: u64, now: UnixMillis, interval_ms: u64) -> Option<(Remote, UnixMillis)> {
        self.entry(rule, fingerprint).map(|e| (e.shared_at(bucket, now, interval_ms), e.synced))
    }

    fn entry(&self, rule: u64, fingerprint: u64) -> Option<&ViewEntry> {
        self.records.get(record_of(fingerprint)).and_then(|r| r.entries.get(&(rule, fingerprint)))
    }

    /// Keys in the view.
    pub fn keys(&self) -> usize {
        self.records.iter().map(|r| r.entries.len()).sum()
    }

    /// Reads (0-delta deltas) of up to `max` keys to refresh, the longest unsynced first: those
    /// whose bucket is still weighed at `now`, that the proxy used within
    /// [`REFRESH_WHILE_USED_MS`], and that `due` names, a key being near its limit when its fleet
    /// total (both buckets, as last read) is at least half of `least_limit` of its rule (`None`:
    /// a rule no longer in global scope, never near).
    pub fn refreshes(&self, now: UnixMillis, due: Due, max: usize, least_limit: impl Fn(u64) -> Option<u32>) -> Vec<Delta> {
        let near = |e: &ViewEntry| {
            let total = e.total_at(now.0.checked_div(e.window_ms).unwrap_or(e.bucket));
            least_limit(e.rule).is_some_and(|l| u64::from(total.previous).saturating_add(u64::from(total.current)).saturating_mul(2) >= u64::from(l))
        };
        let mut picked: Vec<&ViewEntry> = self
            .records
            .iter()
            .flat_map(|r| r.entries.values())
            .filter(|e| now.saturating_since(e.used) <= REFRESH_WHILE_USED_MS)
            .filter(|e| e.synced < due.far || (e.synced < due.near && near(e)))
            .filter(|e| e.bucket.saturating_add(1) >= now.0.checked_div(e.window_ms).unwrap_or(0))
            .collect();
        picked.sort_by_key(|e| e.synced);
        picked.into_iter()
            .take(max)
            .map(|e| Delta {
                rule: e.rule,
                fingerprint: e.fingerprint,
                key: e.key,
                window_ms: e.window_ms,
                bucket: now.0.checked_div(e.window_ms).unwrap_or(e.bucket),
                delta: 0,
                requests: 0,
                refund: 0,
            })
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::keys::fleet::FleetKey;

    fn delta(bucket: u64, n: u32) -> Delta {
        Delta { rule: 1, fingerprint: 33, key: FleetKey(5), window_ms: 1000, bucket, delta: n, requests: n, refund: 0 }
    }

    #[test]
    fn a_key_near_its_limit_is_re_read_sooner_than_one_far_under_it() {
        const HOUR: u64 = 3_600_000;
        let synced = UnixMillis(10 * HOUR + 1_000);
        let key = |rule: u64, fingerprint: u64| Delta { rule, fingerprint, window_ms: HOUR, ..delta(10, 1) };
        let mut cache = ViewCache::new();
        // Rule 1's least limit is 100: half of it is near; rule 2 is no longer in global scope.
        for (rule, fingerprint, totals) in [(1, 4, Totals { previous: 20, current: 30 }), (1, 5, Totals { previous: 0, current: 49 }), (2, 6, Totals { previous: 0, current: 90 })] {
            cache.records[record_of(fingerprint)].apply(&key(rule, fingerprint), totals, synced, 8);
        }
        let least_limit = |rule: u64| (rule == 1).then_some(100);
        let due_at = |cache: &ViewCache, now: UnixMillis| {
            let due = Due { near: UnixMillis(now.0 - 5 * 100), far: UnixMillis(now.0 - 1_000) };
            let mut keys: Vec<u64> = cache.refreshes(now, due, 128, least_limit).iter().map(|d| d.fingerprint).collect();
            keys.sort_unstable();
            keys
        };
        assert_eq!(due_at(&cache, synced.plus_ms(500)), Vec::<u64>::new(), "nothing is due within 5 intervals");
        assert_eq!(due_at(&cache, synced.plus_ms(501)), vec![4], "the key at half its limit, after 5 intervals");
        assert_eq!(due_at(&cache, synced.plus_ms(1_000)), vec![4]);
        assert_eq!(due_at(&cache, synced.plus_ms(1_001)), vec![4, 5, 6], "every key after a second");
        // A refresh (no request of its own) does not make a key used: 10 s after a sync last
        // carried this proxy's requests of it, it is no longer re-read.
        let read = Delta { delta: 0, requests: 0, ..key(1, 4) };
        cache.records[record_of(4)].apply(&read, Totals { previous: 20, current: 40 }, synced.plus_ms(1_500), 8);
        assert_eq!(due_at(&cache, synced.plus_ms(10_000)), vec![4, 5, 6]);
        assert_eq!(due_at(&cache, synced.plus_ms(10_001)), Vec::<u64>::new(), "no key used within 10 s");
        // A refresh names the key's current bucket.
        cache.records[record_of(4)].apply(&key(1, 4), Totals { previous: 20, current: 41 }, UnixMillis(11 * HOUR - 5_000), 8);
        let now = UnixMillis(11 * HOUR);
        let refreshed = cache.refreshes(now, Due { near: now, far: now }, 128, least_limit);
        assert_eq!(refreshed.iter().map(|d| (d.fingerprint, d.bucket, d.delta)).collect::<Vec<_>>(), vec![(4, 11, 0)]);
    }

    #[test]
    fn remote_is_the_total_less_this_proxys_part_and_rolls() {
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 3), Totals { previous: 4, current: 10 }, UnixMillis(1), 8);
        let e = r.entries[&(1, 33)];
        assert_eq!(e.remote_at(10), Counts { previous: 4, current: 7 });
        assert_eq!(e.remote_at(11), Counts { previous: 7, current: 0 });
        assert_eq!(e.remote_at(12), Counts::default());
        // The next batch in the same bucket: this proxy's part grows.
        r.apply(&delta(10, 2), Totals { previous: 4, current: 20 }, UnixMillis(2), 8);
        assert_eq!(r.entries[&(1, 33)].remote_at(10), Counts { previous: 4, current: 15 });
        // A batch in the next bucket: this proxy's part of the old bucket becomes "previous".
        r.apply(&delta(11, 1), Totals { previous: 21, current: 6 }, UnixMillis(3), 8);
        assert_eq!(r.entries[&(1, 33)].remote_at(11), Counts { previous: 16, current: 5 });
        // A late delta of the bucket before.
        r.apply(&delta(10, 1), Totals { previous: 0, current: 22 }, UnixMillis(4), 8);
        assert_eq!(r.entries[&(1, 33)].remote_at(11), Counts { previous: 16, current: 5 });
    }

    #[test]
    fn a_batch_that_gives_back_lowers_this_proxys_part_and_the_total_alike() {
        let mut r = ViewRecord::default();
        // This proxy reserved 200, the others counted 300.
        r.apply(&delta(10, 200), Totals { previous: 0, current: 500 }, UnixMillis(1), 8);
        assert_eq!(r.entries[&(1, 33)].remote_at(10).current, 300);
        // It gives 140 back while the others gave back 100: the store has 260 (60 + 200).
        let back = Delta { refund: 140, requests: 0, ..delta(10, 0) };
        r.apply(&back, Totals { previous: 0, current: 260 }, UnixMillis(2), 8);
        let e = r.entries[&(1, 33)];
        assert_eq!((e.applied.current, e.total.current), (60, 260));
        assert_eq!(e.remote_at(10).current, 200, "the others' 300 less their 100, not more");
        // A give-back of the bucket before (a reservation admitted before the bucket rolled).
        r.apply(&delta(11, 10), Totals { previous: 260, current: 10 }, UnixMillis(3), 8);
        let late = Delta { refund: 50, requests: 0, ..delta(10, 0) };
        r.apply(&late, Totals { previous: 0, current: 210 }, UnixMillis(4), 8);
        let e = r.entries[&(1, 33)];
        assert_eq!((e.applied.previous, e.total.previous), (10, 210));
        assert_eq!(e.remote_at(11).previous, 200);
    }

    #[test]
    fn records_and_index_round_trip_and_stay_bounded() {
        let mut r = ViewRecord::default();
        for k in 0..5u64 {
            let d = Delta { fingerprint: k, ..delta(3, 1) };
            r.apply(&d, Totals { previous: 0, current: 2 }, UnixMillis(k), 3);
        }
        assert_eq!(r.entries.len(), 3, "the oldest synced went");
        assert!(r.entries.contains_key(&(1, 4)) && !r.entries.contains_key(&(1, 0)));
        assert_eq!(ViewRecord::decode(&r.encode()).unwrap(), r);
        assert!(ViewRecord::decode(&r.encode()[..5]).is_err());
        let index = ViewIndex { last_success: Some(UnixMillis(77)), versions: [3; VIEW_RECORDS], proxies: 100 };
        assert_eq!(ViewIndex::decode(&index.encode()).unwrap(), index);
        assert_eq!(ViewIndex::decode(&[]).unwrap(), ViewIndex::default());
        assert!(ViewIndex::decode(&[1, 2, 3]).is_err());
    }

    #[test]
    fn the_cache_reads_only_records_whose_version_moved() {
        let mut cache = ViewCache::new();
        let mut index = ViewIndex::default();
        assert!(cache.stale(&index).is_empty());
        index.versions[record_of(33)] = 1;
        assert_eq!(cache.stale(&index), vec![record_of(33)]);
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 3), Totals { previous: 0, current: 9 }, UnixMillis(1), 8);
        cache.store(record_of(33), r);
        cache.adopt(index);
        assert!(cache.stale(&index).is_empty());
        assert_eq!(cache.remote(1, 33, 10), Counts { previous: 0, current: 6 });
        assert_eq!(cache.remote(2, 33, 10), Counts::default());
        assert_eq!(cache.keys(), 1);
    }

    #[test]
    fn the_remote_rate_is_learned_between_two_syncs_and_projected_over_one_interval() {
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 3), Totals { previous: 0, current: 10 }, UnixMillis(1_000), 8);
        let e = r.entries[&(1, 33)];
        assert_eq!(e.rate, RemoteRate::default(), "one sync: no rate");
        assert_eq!(e.projected_at(10, UnixMillis(1_050), 100), e.remote_at(10));
        // 100 ms later the others' part went from 7 to 17.
        r.apply(&delta(10, 3), Totals { previous: 0, current: 23 }, UnixMillis(1_100), 8);
        let e = r.entries[&(1, 33)];
        assert_eq!(e.rate, RemoteRate { grew_units: 10, over_ms: 100 });
        assert_eq!(e.remote_at(10), Counts { previous: 0, current: 17 });
        // One interval at 10 units per 100 ms, whatever the view's age...
        assert_eq!(e.projected_at(10, UnixMillis(1_150), 100), Counts { previous: 0, current: 27 });
        assert_eq!(e.projected_at(10, UnixMillis(1_399), 100).current, 17 + 10);
        // ... and none once three intervals passed since that sync found their part grown.
        assert_eq!(e.projected_at(10, UnixMillis(1_400), 100), e.remote_at(10));
        // In the next bucket the projection goes to the current bucket.
        assert_eq!(e.projected_at(11, UnixMillis(1_150), 100), Counts { previous: 17, current: 10 });
        // No growth: no rate.
        r.apply(&delta(10, 1), Totals { previous: 0, current: 24 }, UnixMillis(1_200), 8);
        assert_eq!(r.entries[&(1, 33)].rate.grew_units, 0);
        assert_eq!(r.entries[&(1, 33)].projected_at(10, UnixMillis(1_250), 100).current, 17);
    }

    #[test]
    fn a_sync_that_finds_the_key_at_its_limit_keeps_the_projections_counting() {
        let at_limit = |limit: u32| move |e: &ViewEntry| e.total.current >= limit;
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 10), Totals { previous: 0, current: 10 }, UnixMillis(1_000), 8);
        r.apply(&delta(10, 10), Totals { previous: 0, current: 40 }, UnixMillis(1_100), 8);
        let until = r.entries[&(1, 33)].projected_until(100);
        assert_eq!(until, Some(UnixMillis(1_399)));
        // Nothing grew anywhere, the key under its limit: the projections end as they were.
        r.apply_batch(&[(Delta { requests: 5, ..delta(10, 0) }, Totals { previous: 0, current: 40 })], UnixMillis(1_200), 8, at_limit(41));
        assert_eq!(r.entries[&(1, 33)].projected_until(100), until);
        // Nothing grew, the key at its limit (every proxy refusing): they count on.
        r.apply_batch(&[(Delta { requests: 5, ..delta(10, 0) }, Totals { previous: 0, current: 40 })], UnixMillis(1_300), 8, at_limit(40));
        let e = r.entries[&(1, 33)];
        assert_eq!(e.projected_until(100), Some(UnixMillis(1_599)));
        assert_eq!(e.shared_at(10, UnixMillis(1_500), 100).per_local_q16, 2 << 16, "the share, as learned");
        assert_eq!(e.shared_at(10, UnixMillis(1_500), 100).unseen, 0, "no growth to project");
    }

    #[test]
    fn the_rate_spans_one_bucket_roll_but_not_two_nor_a_few_milliseconds() {
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 3), Totals { previous: 0, current: 10 }, UnixMillis(1_000), 8);
        // Next bucket: the old bucket ended at 30 (others 27, +20), the new one holds 4 (+4).
        r.apply(&delta(11, 1), Totals { previous: 30, current: 5 }, UnixMillis(1_100), 8);
        assert_eq!(r.entries[&(1, 33)].rate, RemoteRate { grew_units: 24, over_ms: 100 });
        // Two buckets later: the buckets between are unknown.
        r.apply(&delta(13, 1), Totals { previous: 50, current: 50 }, UnixMillis(1_200), 8);
        assert_eq!(r.entries[&(1, 33)].rate.grew_units, 0);
        // Two syncs 5 ms apart: the span is read as one interval.
        r.apply(&delta(13, 1), Totals { previous: 50, current: 81 }, UnixMillis(1_205), 8);
        let e = r.entries[&(1, 33)];
        assert_eq!(e.rate, RemoteRate { grew_units: 30, over_ms: 5 });
        assert_eq!(e.projected_at(13, UnixMillis(1_205), 100).current, e.remote_at(13).current + 30 * 100 / 100);
        // A batch with two deltas of a key learns once, over both.
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 3), Totals { previous: 0, current: 10 }, UnixMillis(1_000), 8);
        r.apply_batch(
            &[(delta(10, 1), Totals { previous: 0, current: 20 }), (delta(11, 1), Totals { previous: 20, current: 6 })],
            UnixMillis(1_100),
            8,
            |_| false,
        );
        assert_eq!(r.entries[&(1, 33)].rate, RemoteRate { grew_units: 9 + 5, over_ms: 100 });
    }

    #[test]
    fn a_record_of_an_earlier_layout_reads_as_malformed() {
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 3), Totals { previous: 0, current: 10 }, UnixMillis(1_000), 8);
        // Version 5: no last batch confirmed (the entries right after the count).
        let mut v5 = r.encode();
        v5.drain(8..24);
        v5[0] = 5;
        assert_eq!(ViewRecord::decode(&v5), Err(DecodeError::Malformed));
        // Version 3: no share; version 4: no time the others' part last grew; version 6: no
        // time of the proxy's own last requests.
        for (version, fields) in [(3, 24), (4, 16), (6, 8)] {
            let mut old = r.encode();
            old.truncate(old.len() - fields);
            old[0] = version;
            assert_eq!(ViewRecord::decode(&old), Err(DecodeError::Malformed));
            let mut other = r.encode();
            other[0] = version;
            assert_eq!(ViewRecord::decode(&other), Err(DecodeError::Malformed));
        }
        // A share that is not a finite number.
        let mut nan = r.encode();
        let at = nan.len() - 16 - 4;
        nan[at..at + 4].copy_from_slice(&f32::NAN.to_bits().to_le_bytes());
        assert_eq!(ViewRecord::decode(&nan), Err(DecodeError::Malformed));
    }

    #[test]
    fn a_record_names_the_last_batch_it_confirmed_and_an_ask_places_a_batch_against_it() {
        let mut cache = ViewCache::new();
        let mut index = ViewIndex::default();
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 3), Totals { previous: 0, current: 10 }, UnixMillis(1_000), 8);
        // No batch confirmed yet: any batch is known not to be in it.
        assert!(r.confirmed.lacks(7, 1) && r.confirmed.lacks(8, 9));
        r.confirmed.take(7, 4);
        assert_eq!(ViewRecord::decode(&r.encode()).unwrap(), r, "round trip");
        assert!(r.confirmed.lacks(7, 5), "the source's next batch");
        assert!(!r.confirmed.lacks(7, 4) && !r.confirmed.lacks(7, 2), "that batch and the ones before");
        assert!(!r.confirmed.lacks(8, 5), "another source's batch cannot be placed");
        r.confirmed.take(7, 3);
        assert_eq!(r.confirmed, Confirmed { source: 7, seq: 4 }, "a later one of the same source stays");
        r.confirmed.take(8, 1);
        assert_eq!(r.confirmed, Confirmed { source: 8, seq: 1 }, "another source's replaces it");
        // A worker's copy answers for the record that keeps a fingerprint.
        index.versions[record_of(33)] = 1;
        cache.store(record_of(33), r);
        cache.adopt(index);
        assert!(cache.lacks(33, 8, 2) && !cache.lacks(33, 8, 1));
        assert_eq!(cache.confirmed(1, 33, 10), 3, "this proxy's confirmed part");
        assert_eq!(cache.confirmed(1, 33, 11), 0, "rolled");
        assert!(cache.lacks(34, 8, 1), "another record: none confirmed");
    }

    #[test]
    fn the_share_follows_demand_here_and_growth_elsewhere_and_keeps_its_ratio_at_the_limit() {
        let mut r = ViewRecord::default();
        r.apply(&delta(10, 10), Totals { previous: 0, current: 10 }, UnixMillis(1_000), 8);
        assert_eq!(r.entries[&(1, 33)].share, Share::default(), "one sync: nothing learned");
        assert_eq!(r.entries[&(1, 33)].shared_at(10, UnixMillis(1_000), 100).per_local_q16, 0);
        // This proxy +10, the others +20: two remote units per local one.
        r.apply(&delta(10, 10), Totals { previous: 0, current: 40 }, UnixMillis(1_100), 8);
        let e = r.entries[&(1, 33)];
        assert_eq!(e.share, Share { local: 10.0, remote: 20.0 });
        let remote = e.shared_at(10, UnixMillis(1_150), 100);
        let until = UnixMillis(1_100 + 3 * 100 - 1);
        assert_eq!(remote, Remote { synced: Counts { previous: 0, current: 20 }, confirmed: 20, unseen: 20, per_local_q16: 2 << 16, projected_until: until });
        // 5 local units past the confirmed 20: 10 more remote ones.
        assert_eq!(remote.fleet(Counts { previous: 0, current: 25 }).current, 25 + 40 + 10);
        // Nothing grew anywhere (every proxy refusing): the ratio stays, whether this proxy had
        // requests (all refused) or none.
        r.apply(&delta(10, 0), Totals { previous: 0, current: 40 }, UnixMillis(1_200), 8);
        assert_eq!(r.entries[&(1, 33)].share.per_local_q16(), 2 << 16);
        let refused = Delta { requests: 12, ..delta(10, 0) };
        r.apply(&refused, Totals { previous: 0, current: 40 }, UnixMillis(1_250), 8);
        assert_eq!(r.entries[&(1, 33)].share.per_local_q16(), 2 << 16);
        // This proxy refused its 40 requests while the others admitted 10: its demand counts,
        // so the ratio falls (10 per 40 requests) instead of growing (it would starve).
        let mut starving = r.clone();
        starving.apply(&Delta { requests: 40, ..delta(10, 0) }, Totals { previous: 0, current: 50 }, UnixMillis(1_300), 8);
        assert!(starving.entries[&(1, 33)].share.per_local_q16() < 2 << 16);
        // The others stopped and this proxy goes on: the ratio falls at every sync.
        let mut last = 2 << 16;
        for (i, total) in [(3u64, 50), (4, 60), (5, 70)] {
            r.apply(&delta(10, 10), Totals { previous: 0, current: total }, UnixMillis(1_300 + i * 100), 8);
            let now = r.entries[&(1, 33)].share.per_local_q16();
            assert!(now < last, "{now} < {last}");
            last = now;
        }
        // A proxy that never grew the key itself: the cap.
        let lonely = Share { local: 0.0, remote: 5.0 };
        assert_eq!(lonely.per_local_q16(), (MAX_PER_LOCAL as u32) << 16);
        assert_eq!(Share::default().per_local_q16(), 0);
    }

    use proptest::prelude::*;

    fn entry() -> impl Strategy<Value = ViewEntry> {
        (any::<u64>(), 1..u64::MAX, any::<[u32; 4]>(), any::<u64>(), any::<(u32, u32)>()).prop_map(
            |(bucket, window_ms, [tp, tc, ap, ac], synced, (grew_units, over_ms))| ViewEntry {
                rule: 1,
                fingerprint: 33,
                key: FleetKey(5),
                window_ms,
                bucket,
                total: Counts { previous: tp, current: tc },
                applied: Counts { previous: ap, current: ac },
                synced: UnixMillis(synced),
                rate: RemoteRate { grew_units, over_ms },
                share: Share { local: f32::from(u16::try_from(grew_units % 60_000).unwrap()), remote: f32::from(u16::try_from(over_ms % 60_000).unwrap()) },
                contended_at: UnixMillis(synced),
                used: UnixMillis(synced.rotate_left(7)),
            },
        )
    }

    proptest! {
        #[test]
        fn the_projection_never_panics_and_never_lowers_the_estimate(
            e in entry(), bucket in any::<u64>(), now in any::<u64>(), interval_ms in any::<u64>(),
        ) {
            let (projected, synced) = (e.projected_at(bucket, UnixMillis(now), interval_ms), e.remote_at(bucket));
            prop_assert!(projected.previous == synced.previous && projected.current >= synced.current);
            let remote = e.shared_at(bucket, UnixMillis(now), interval_ms);
            for local in [Counts::default(), Counts { previous: 3, current: 9 }, Counts { previous: u32::MAX, current: u32::MAX }] {
                let fleet = remote.fleet(local);
                prop_assert!(fleet.previous >= local.previous.saturating_add(synced.previous));
                prop_assert!(fleet.current >= local.current.saturating_add(synced.current));
                prop_assert!(remote.fleet(local.plus(1)).current >= fleet.current, "more local units never lower the fleet's");
            }
        }

        #[test]
        fn any_sequence_of_syncs_keeps_the_projection_at_or_above_the_counts(
            steps in proptest::collection::vec((0..3u64, 0..50u32, 0..200u64, 0..200u64, 0..300u64), 1..40),
            interval_ms in 1..1000u64,
        ) {
            let mut r = ViewRecord::default();
            let (mut bucket, mut now) = (100u64, 1_000u64);
            for (step, n, previous, current, after_ms) in steps {
                bucket += step;
                now += after_ms;
                r.apply(&delta(bucket, n), Totals { previous, current }, UnixMillis(now), 8);
                let e = r.entries[&(1, 33)];
                for later in [0, 50, 400, 5_000] {
                    let at = UnixMillis(now + later);
                    let (projected, synced) = (e.projected_at(bucket, at, interval_ms), e.remote_at(bucket));
                    prop_assert!(projected.previous == synced.previous && projected.current >= synced.current);
                }
                prop_assert_eq!(ViewRecord::decode(&r.encode()).unwrap(), r.clone());
            }
        }

        /// A refusal's `retry_at` is the first millisecond at which the view, as it is, admits the
        /// same request (nothing else arriving): every projection ending on its own time, the
        /// buckets rolling.
        #[test]
        fn retry_at_is_the_first_millisecond_the_view_admits(
            (window_ms, interval_ms, limit, cost) in (50..2_000u64, 10..200u64, 1..60u32, 1..20u32),
            ([tp, tc, ap, ac], (previous, current)) in (any::<[u8; 4]>(), (0..40u32, 0..40u32)),
            (grew_units, over_ms, share) in (0..60u32, 0..1_500u32, (0..20u8, 0..40u8)),
            (synced_ago, quiet_for, behind, start) in (0..2_000u64, prop_oneof![Just(0u64), 1..400u64], 0..2u64, 0..10_000u64),
        ) {
            let now = UnixMillis(1_700_000_000_000 + start);
            let window = crate::ratelimit::window::Window::new(std::num::NonZeroU64::new(window_ms).unwrap());
            let bucket = now.0 / window_ms;
            let synced = UnixMillis(now.0 - synced_ago);
            let e = ViewEntry {
                rule: 1,
                fingerprint: 33,
                key: FleetKey(5),
                window_ms,
                bucket: (synced.0 / window_ms).saturating_sub(behind),
                total: Counts { previous: u32::from(tp) + u32::from(ap), current: u32::from(tc) + u32::from(ac) },
                applied: Counts { previous: u32::from(ap), current: u32::from(ac) },
                synced,
                rate: RemoteRate { grew_units: if quiet_for > 0 { 0 } else { grew_units }, over_ms },
                share: Share { local: f32::from(share.0), remote: f32::from(share.1) },
                contended_at: UnixMillis(synced.0 - quiet_for),
                used: synced,
            };
            let local = Counts { previous, current };
            let limit = std::num::NonZeroU32::new(limit).unwrap();
            let admits = |at: UnixMillis| {
                let b = at.0 / window_ms;
                let fleet = e.shared_at(b, at, interval_ms).fleet(local.rolled(bucket, b).plus(cost));
                window.fits(fleet, window.phase(at).elapsed_ms, limit)
            };
            let retry_at = e.shared_at(bucket, now, interval_ms).earliest_admission(window, local, now, cost, limit);
            let horizon = now.plus_ms(3 * window_ms + HOLD_INTERVALS * interval_ms);
            let first = (now.0..=horizon.0).map(UnixMillis).find(|at| admits(*at));
            match retry_at {
                Some(at) if at <= horizon => prop_assert_eq!(Some(at), first),
                Some(_) => prop_assert_eq!(first, None),
                None => prop_assert!(cost > limit.get() && first.is_none()),
            }
        }

        #[test]
        fn arbitrary_bytes_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ViewRecord::decode(&bytes);
            let _ = ViewIndex::decode(&bytes);
        }
    }
}
