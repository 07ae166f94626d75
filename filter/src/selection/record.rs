//! A cluster's shared-data record: its stat buckets, its concurrency limit and its in-flight
//! count per VM, in one value so that taking a permit is one compare-and-swap and ending a
//! request (stats, limit, release) is one more.
//!
//! Layout (little-endian): version `u8`, bucket count `u8`, 2 zero bytes, limit `u32`, epoch
//! `u64`, then per bucket (newest first) finished `u32` and succeeded `u32`, the sticky bucket
//! the same way, and last the in-flight entries as [`InFlight`] encodes them.

use super::buckets::{Buckets, Tally};
use crate::primitives::inflight::{DecodeError, InFlight};

const RECORD_VERSION: u8 = 1;
const HEADER_LEN: usize = 4 + 4 + 8;
const TALLY_LEN: usize = 8;

/// One cluster's shared state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterRecord {
    /// The current concurrency limit.
    pub limit: u32,
    /// Finished and successful requests.
    pub buckets: Buckets,
    /// Permits held, per VM.
    pub in_flight: InFlight,
}

fn u32_at(bytes: &[u8], at: usize) -> Result<u32, DecodeError> {
    let end = at.checked_add(4).ok_or(DecodeError::Malformed)?;
    let slice = bytes.get(at..end).ok_or(DecodeError::Malformed)?;
    <[u8; 4]>::try_from(slice).map(u32::from_le_bytes).map_err(|_| DecodeError::Malformed)
}

fn u64_at(bytes: &[u8], at: usize) -> Result<u64, DecodeError> {
    let end = at.checked_add(8).ok_or(DecodeError::Malformed)?;
    let slice = bytes.get(at..end).ok_or(DecodeError::Malformed)?;
    <[u8; 8]>::try_from(slice).map(u64::from_le_bytes).map_err(|_| DecodeError::Malformed)
}

fn tally_at(bytes: &[u8], at: usize) -> Result<Tally, DecodeError> {
    let finished = u32_at(bytes, at)?;
    let succeeded = u32_at(bytes, at.saturating_add(4))?;
    if succeeded > finished {
        return Err(DecodeError::Malformed);
    }
    Ok(Tally { finished, succeeded })
}

impl ClusterRecord {
    /// A fresh record: no data, the initial limit.
    pub fn new(buckets: usize, epoch: u64, limit: u32) -> ClusterRecord {
        ClusterRecord {
            limit,
            buckets: Buckets::new(buckets, epoch),
            in_flight: InFlight::default(),
        }
    }

    /// Reads a record written with `buckets` buckets, refusing anything malformed (truncated,
    /// padded, another version or bucket count, more successes than requests).
    pub fn decode(bytes: &[u8], buckets: usize) -> Result<ClusterRecord, DecodeError> {
        let [version, count, _, _] = <[u8; 4]>::try_from(bytes.get(..4).ok_or(DecodeError::Malformed)?)
            .map_err(|_| DecodeError::Malformed)?;
        if version != RECORD_VERSION || usize::from(count) != buckets {
            return Err(DecodeError::Malformed);
        }
        let limit = u32_at(bytes, 4)?;
        let epoch = u64_at(bytes, 8)?;
        let mut recent = Vec::with_capacity(buckets);
        let mut at = HEADER_LEN;
        for _ in 0..buckets {
            recent.push(tally_at(bytes, at)?);
            at = at.saturating_add(TALLY_LEN);
        }
        let sticky = tally_at(bytes, at)?;
        let rest = bytes.get(at.saturating_add(TALLY_LEN)..).ok_or(DecodeError::Malformed)?;
        Ok(ClusterRecord {
            limit,
            buckets: Buckets { epoch, recent, sticky },
            in_flight: InFlight::decode(rest)?,
        })
    }

    /// Writes the record.
    pub fn encode(&self) -> Vec<u8> {
        let in_flight = self.in_flight.encode();
        let count = self.buckets.recent.len().min(usize::from(u8::MAX));
        let mut out = Vec::with_capacity(
            HEADER_LEN
                .saturating_add(count.saturating_add(1).saturating_mul(TALLY_LEN))
                .saturating_add(in_flight.len()),
        );
        out.extend_from_slice(&[RECORD_VERSION, u8::try_from(count).unwrap_or(u8::MAX), 0, 0]);
        out.extend_from_slice(&self.limit.to_le_bytes());
        out.extend_from_slice(&self.buckets.epoch.to_le_bytes());
        for tally in self.buckets.recent.iter().take(count).chain(std::iter::once(&self.buckets.sticky)) {
            out.extend_from_slice(&tally.finished.to_le_bytes());
            out.extend_from_slice(&tally.succeeded.to_le_bytes());
        }
        out.extend_from_slice(&in_flight);
        out
    }
}
