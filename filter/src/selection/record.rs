//! A cluster's shared-data record: its stat buckets, its concurrency limit and its in-flight
//! count per VM, in one value so that taking a permit is one compare-and-swap and ending a
//! request (stats, limit, release) is one more.
//!
//! Layout (little-endian): version `u8`, bucket count `u8`, 2 zero bytes, limit `u32`, epoch
//! `u64`, then per bucket (newest first) finished `u32` and succeeded `u32`, the sticky bucket
//! the same way, and last the in-flight entries as [`InFlight`] encodes them.
//!
//! Rationale: docs/design.md, section "Cluster selection" (state).

use super::buckets::{Buckets, Tally};
use crate::primitives::inflight::InFlight;
use crate::primitives::record::{DecodeError, Reader, Writer};

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

fn tally(reader: &mut Reader<'_>) -> Result<Tally, DecodeError> {
    let finished = reader.u32()?;
    let succeeded = reader.u32()?;
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
        let mut reader = Reader::new(bytes);
        let [version, count, _, _] = reader.array::<4>()?;
        if version != RECORD_VERSION || usize::from(count) != buckets {
            return Err(DecodeError::Malformed);
        }
        let limit = reader.u32()?;
        let epoch = reader.u64()?;
        let mut recent = Vec::with_capacity(buckets);
        for _ in 0..buckets {
            recent.push(tally(&mut reader)?);
        }
        let sticky = tally(&mut reader)?;
        Ok(ClusterRecord {
            limit,
            buckets: Buckets { epoch, recent, sticky },
            in_flight: InFlight::decode(reader.rest())?,
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
        out.put(&[RECORD_VERSION, u8::try_from(count).unwrap_or(u8::MAX), 0, 0]);
        out.put_u32(self.limit);
        out.put_u64(self.buckets.epoch);
        for tally in self.buckets.recent.iter().take(count).chain(std::iter::once(&self.buckets.sticky)) {
            out.put_u32(tally.finished);
            out.put_u32(tally.succeeded);
        }
        out.put(&in_flight);
        out
    }
}
