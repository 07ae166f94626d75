//! The shared-data record of one key's lease in the proxy ([`super::key::KeyLease`]), which every
//! worker reads and writes with a compare-and-swap.
//!
//! Layout, [`LEN`] bytes little-endian ([`crate::primitives::record`]): version (1 byte, then 3
//! zero bytes), the key (u128), the window (u64 ms, not 0) and the limit (u32, not 0), the bucket
//! (u64), `held`, `consumed`, `returned`, `returned_previous`, `unreported`,
//! `unreported_previous`, `prereported`, `refunded`, `refunded_previous` (u32 each), the view's
//! previous and current counts (u32 each), its bucket (u64) and time, the call on its way (id
//! u64, 0 for none, its sender's id and its deadline), the workers to tell of its answer
//! ([`super::WATCHERS`] u64 ids, 0 for none), the units waiting (u32) and when they were
//! counted, the last failure's time, `used` (u32), `rate_since`, the rate (u64, units per
//! 1000 s), the last grant's time and size (u32), `last_used`, the units taken in the bucket
//! and in the bucket before (u32 each), and when the key was last found rationed. A time is a
//! u64 of ms since the epoch, [`NONE`] for none.
//!
//! Invariant: [`decode`] reads exactly what [`encode`] wrote; anything else (another length or
//! version, a window or limit of 0) is refused, and the next write replaces it with a new lease.

use super::key::{CallMark, KeyLease};
use super::{LeaseSpec, WATCHERS};
use crate::keys::fleet::FleetKey;
use crate::primitives::record::{DecodeError, Reader, Writer};
use crate::primitives::time::UnixMillis;
use crate::ratelimit::window::{Counts, Window};
use std::num::{NonZeroU32, NonZeroU64};

/// The layout's version.
pub const VERSION: u8 = 2;
/// The record's length.
pub const LEN: usize = 4 + 16 + 8 + 4 + 8 + 9 * 4 + 2 * 4 + 8 + 8 + 8 + 8 + 8 + 8 * WATCHERS + 4 + 8 + 8 + 4 + 8 + 8 + 8 + 4 + 8 + 4 + 4 + 8;
/// A time that is not set.
pub const NONE: u64 = u64::MAX;

fn time(at: Option<UnixMillis>) -> u64 {
    at.map_or(NONE, |t| t.0)
}

fn read_time(reader: &mut Reader<'_>) -> Result<Option<UnixMillis>, DecodeError> {
    let at = reader.u64()?;
    Ok((at != NONE).then_some(UnixMillis(at)))
}

/// The record of `key`'s lease.
pub fn encode(key: FleetKey, lease: &KeyLease) -> Vec<u8> {
    let mut out = Vec::with_capacity(LEN);
    out.put(&[VERSION, 0, 0, 0]);
    out.put_u128(key.0);
    out.put_u64(lease.spec.window.length_ms());
    out.put_u32(lease.spec.limit.get());
    out.put_u64(lease.bucket);
    for units in [
        lease.held,
        lease.consumed,
        lease.returned,
        lease.returned_previous,
        lease.unreported,
        lease.unreported_previous,
        lease.prereported,
        lease.refunded,
        lease.refunded_previous,
        lease.view.previous,
        lease.view.current,
    ] {
        out.put_u32(units);
    }
    out.put_u64(lease.view_bucket);
    out.put_u64(time(lease.view_at));
    out.put_u64(lease.call.map_or(0, |c| c.id));
    out.put_u64(lease.call.map_or(0, |c| c.owner));
    out.put_u64(lease.call.map_or(NONE, |c| c.deadline.0));
    for watcher in lease.watchers {
        out.put_u64(watcher);
    }
    out.put_u32(lease.waiting);
    out.put_u64(lease.waiting_at.0);
    out.put_u64(time(lease.failed_at));
    out.put_u32(lease.used);
    out.put_u64(lease.rate_since.0);
    out.put_u64(lease.rate_per_ks);
    out.put_u64(time(lease.last_grant.map(|(at, _)| at)));
    out.put_u32(lease.last_grant.map_or(0, |(_, units)| units));
    out.put_u64(lease.last_used.0);
    out.put_u32(lease.taken);
    out.put_u32(lease.taken_previous);
    out.put_u64(time(lease.rationed_at));
    out
}

/// The key and lease a record holds.
pub fn decode(bytes: &[u8]) -> Result<(FleetKey, KeyLease), DecodeError> {
    if bytes.len() != LEN {
        return Err(DecodeError::Length(bytes.len()));
    }
    let mut r = Reader::new(bytes);
    let [version, layout, _, _] = r.array()?;
    if version != VERSION {
        return Err(DecodeError::Version(version, layout));
    }
    let key = FleetKey(r.u128()?);
    let window = Window::new(NonZeroU64::new(r.u64()?).ok_or(DecodeError::Malformed)?);
    let limit = NonZeroU32::new(r.u32()?).ok_or(DecodeError::Malformed)?;
    let bucket = r.u64()?;
    let mut units = [0u32; 11];
    for unit in &mut units {
        *unit = r.u32()?;
    }
    let [held, consumed, returned, returned_previous, unreported, unreported_previous, prereported, refunded, refunded_previous, previous, current] = units;
    let view_bucket = r.u64()?;
    let view_at = read_time(&mut r)?;
    let call_id = r.u64()?;
    let owner = r.u64()?;
    let deadline = r.u64()?;
    let mut watchers = [0u64; WATCHERS];
    for watcher in &mut watchers {
        *watcher = r.u64()?;
    }
    let waiting = r.u32()?;
    let waiting_at = UnixMillis(r.u64()?);
    let failed_at = read_time(&mut r)?;
    let used = r.u32()?;
    let rate_since = UnixMillis(r.u64()?);
    let rate_per_ks = r.u64()?;
    let grant_at = read_time(&mut r)?;
    let grant = r.u32()?;
    let last_used = UnixMillis(r.u64()?);
    let taken = r.u32()?;
    let taken_previous = r.u32()?;
    let rationed_at = read_time(&mut r)?;
    r.end()?;
    let lease = KeyLease {
        spec: LeaseSpec { window, limit },
        bucket,
        held,
        consumed,
        returned,
        returned_previous,
        unreported,
        unreported_previous,
        prereported,
        refunded,
        refunded_previous,
        view: Counts { previous, current },
        view_bucket,
        view_at,
        call: (call_id != 0).then_some(CallMark { id: call_id, owner, deadline: UnixMillis(deadline) }),
        watchers,
        waiting,
        waiting_at,
        failed_at,
        used,
        rate_since,
        rate_per_ks,
        last_grant: grant_at.map(|at| (at, grant)),
        last_used,
        taken,
        taken_previous,
        rationed_at,
    };
    Ok((key, lease))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn a_record_reads_back_as_written_and_anything_else_is_refused() {
        let spec = LeaseSpec { window: Window::new(NonZeroU64::new(60_000).unwrap()), limit: NonZeroU32::new(500).unwrap() };
        let mut lease = KeyLease::new(spec, UnixMillis(1_700_000_000_123));
        lease.held = 7;
        lease.prereported = 2;
        lease.refunded_previous = 3;
        lease.view = Counts { previous: 40, current: 9 };
        lease.view_at = Some(UnixMillis(1_700_000_000_100));
        lease.call = Some(CallMark { id: 0xfeed, owner: 7, deadline: UnixMillis(1_700_000_001_000) });
        lease.watchers = [3, 9, 0, 0];
        lease.rate_per_ks = 123_456;
        lease.waiting = 3;
        lease.last_grant = Some((UnixMillis(1_700_000_000_050), 12));
        lease.rationed_at = Some(UnixMillis(1_700_000_000_060));
        lease.taken = 31;
        lease.taken_previous = 45;
        let bytes = encode(FleetKey(u128::MAX - 5), &lease);
        assert_eq!(bytes.len(), LEN);
        assert_eq!(decode(&bytes).unwrap(), (FleetKey(u128::MAX - 5), lease));
        assert_eq!(decode(&bytes[1..]), Err(DecodeError::Length(LEN - 1)));
        let mut other = bytes.clone();
        other[0] = 9;
        assert_eq!(decode(&other), Err(DecodeError::Version(9, 0)));
        let mut zero_window = bytes;
        zero_window[20..28].fill(0);
        assert_eq!(decode(&zero_window), Err(DecodeError::Malformed));
    }
}
