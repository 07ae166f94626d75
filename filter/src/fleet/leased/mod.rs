//! Leased global scope (`"consistency": "leased"`): a proxy takes units of a key's quota from the
//! store ahead of use (`floodgate-sync`'s `POST /v1/lease`), admits locally from its lease, and
//! gives back what it did not use; a request waits on the store only when its key's lease is
//! empty. The lease is the proxy's, not a worker's: it lives in shared data (`record`), one
//! record per key, and every worker takes from it, refills it and settles it with the same
//! compare-and-swap update ([`crate::primitives::store::update_from`]). One call per key is on its
//! way for the whole proxy; requests of the key on any worker wait for it.
//!
//! A lease asks for about the proxy's rate of the key over a `sync_interval`, or, for a key that
//! comes back less often than that, for its next [`HORIZON_GAPS`] requests (over
//! [`HOLD_MAX_MS`] at most, `KeyLease::want` in `key`), and is refilled in the background below half of
//! that (a slow key's, once empty). An unused lease goes back after two periods, or that horizon if longer. A call asks for
//! the units of every request of the proxy waiting for the key (the record counts them), which
//! take them at once. At the limit (the key *rationed*, `KeyLease::rationed`), a proxy that takes
//! a share of the key ([`RATIONED_MIN_UNITS`]) refuses at once what its lease cannot cover, and
//! asks in the background for the units of its next request.
//!
//! Invariants: the store grants only what the key's sliding window has room for (at most a quarter
//! of the room, at least one unit while there is any), so the units held or used across the fleet
//! in a bucket always fit the limit. A unit granted to the proxy is taken by exactly one request
//! (the record's update is a compare-and-swap). A unit belongs to the bucket it was granted in;
//! what is left goes back at its end. A give-back is sent once and a grant whose answer is lost
//! stays counted: a lost message makes the fleet admit less, never more. A proxy names itself in
//! its calls, so once a bucket has ended and a grace passed, a dead proxy's outstanding units come
//! off its counter.
//! Units the store counts as used that come back unused (a token reservation settled below its
//! estimate, an `at_once` grant left over) go back as `refunded`, off the counter, so the store
//! ends with the units used; a count above a reservation is reported like units admitted without
//! a grant ([`LeaseBook::refund`], [`LeaseBook::consume`]).
//! With the store down, `on_store_failure` decides (the last counts plus the proxy's admissions
//! since, reported with its next call; or refuse), and a failed key asks again after
//! `RETRY_AFTER_FAILURE_MS`. A request never decides without the store while a call of its key
//! is on its way and not past its timeout.
//!
//! Rationale: docs/design.md, section "Leased consistency".

mod book;
mod key;
pub mod protocol;
mod record;

pub use book::LeaseBook;

pub use crate::config::OnStoreFailure;
use crate::keys::fleet::FleetKey;
use crate::ratelimit::window::{Counts, Window};
use std::num::NonZeroU32;

/// After a failed call, a key decides without the store for this long (then asks again).
pub const RETRY_AFTER_FAILURE_MS: u64 = 1_000;
/// A lease unused for this many periods goes back to the store (a slow key's: its horizon).
pub const IDLE_PERIODS: u64 = 2;
/// A slow key's lease covers this many of its gaps between requests...
pub const HORIZON_GAPS: u64 = 4;
/// ...over this long at most, and is kept that long unused.
pub const HOLD_MAX_MS: u64 = 10_000;
/// A rationed key (its window at its limit) has its requests refused at once, rather than
/// waiting for the store, only on a proxy that took at least this many of its units over the
/// sliding window. The unit such a proxy asks for in the background waits in its lease for the
/// key's next request there: a proxy with `n` units a window holds one about half the time, so
/// the fleet's leases hold about `1 / (2n)` of the window idle, a sixteenth at most with `n` ≥ 8.
/// A proxy that sees the key less often waits for its units.
pub const RATIONED_MIN_UNITS: u32 = 8;
/// Seats (records of leases) per key the book may follow: two keys share a record only when
/// their ids fall in one seat (about one key in eight when the book is full).
pub const SEATS_PER_KEY: u64 = 4;
/// Workers a key's record names as waiting on a call another worker sent, to be told of its
/// answer; more look at the key at their root's ticks.
pub const WATCHERS: usize = 4;

/// How a key of a leased rule is limited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseSpec {
    /// The rule's window.
    pub window: Window,
    /// The key's limit (the rule's, a tier's or an override's).
    pub limit: NonZeroU32,
}

/// One key's call to the store: what to ask and what to give back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ask {
    /// The key.
    pub key: FleetKey,
    /// The window, in milliseconds.
    pub window_ms: u64,
    /// The bucket asked in.
    pub bucket: u64,
    /// Milliseconds into the bucket.
    pub elapsed_ms: u64,
    /// The key's limit.
    pub limit: u32,
    /// Units asked for (0: only give back and report).
    pub want: u32,
    /// Units of `bucket` admitted without a grant (the store was down), counted first.
    pub consumed: u32,
    /// Unused units of `bucket` given back.
    pub returned: u32,
    /// Unused units of `bucket − 1` given back.
    pub returned_previous: u32,
    /// Units of `bucket`'s grants admitted since the last call.
    pub used: u32,
    /// Units of `bucket − 1`'s grants admitted since the last call.
    pub used_previous: u32,
    /// How long into `bucket` the holders of `bucket − 1` have to settle it (module doc).
    pub grace_ms: u64,
    /// Units of the grant the requests waiting for it take at once: counted as used, not held
    /// (a cold key's unit then needs no report).
    pub at_once: u32,
    /// Units of `bucket` the store counts as used (reported, or taken at once) that were not
    /// used after all (given back by a settled reservation, or left of an `at_once` grant):
    /// taken off the counter.
    pub refunded: u32,
    /// The same for `bucket − 1`.
    pub refunded_previous: u32,
    /// The id of the call that asks (the key's record names it while it is on its way); 0 for
    /// a call that asks for nothing. Not sent.
    pub call: u64,
}

/// The store's answer to one [`Ask`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Units granted.
    pub granted: u32,
    /// The key's counters after the call, as of the ask's bucket.
    pub counts: Counts,
}

/// Why a leased rule refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The fleet's counts leave no room for the request.
    OverLimit,
    /// The store could not be reached and `on_store_failure` is `refuse` (or shared data
    /// failed).
    StoreDown,
}

/// The outcome of [`LeaseBook::take`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Units taken.
    Admitted {
        /// The fleet's counts as last known (for the `RateLimit` fields).
        counts: Counts,
        /// Units the proxy still holds.
        held: u32,
        /// A call to send in the background (the lease runs low).
        refill: Option<Ask>,
    },
    /// The request waits for the store.
    Wait {
        /// The call to send; `None` when the proxy has one on its way (the request waits for
        /// its answer).
        call: Option<Ask>,
    },
    /// Refused.
    Refused {
        /// Why.
        refusal: Refusal,
        /// The fleet's counts as last known.
        counts: Counts,
        /// A call to send in the background (a rationed key's next units).
        refill: Option<Ask>,
    },
}

/// How long the request taking units has waited already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// It has not waited: a new request.
    No,
    /// It waited: for a call of its key, which answered, failed, or is on its way. (A request
    /// whose own call failed after `lease_timeout` is decided without the store, as the key's
    /// failure says; one waiting on a longer call, a refill or another worker's, waits for it.)
    Within,
    /// It waited `lease_timeout` and the longest a call takes: decided without the store.
    Overdue,
}

/// What a book's leases and calls are sized by, and who calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terms {
    /// `sync_interval`: what a lease should cover, in milliseconds of the key's traffic.
    pub period_ms: u64,
    /// `on_store_failure`.
    pub policy: OnStoreFailure,
    /// `max_lease`: the most units asked for beyond the waiting requests' needs.
    pub max_lease: u32,
    /// `lease_timeout`, ms: how long a request waits for the call it sends (and the grace sent
    /// with calls: module doc).
    pub lease_timeout_ms: u64,
    /// The longest another call takes before it fails (`timeout`, at least `lease_timeout`).
    pub call_timeout_ms: u64,
    /// This worker's id.
    pub caller: u64,
}

/// The proxy's id in its calls (the store's holder of its units): the same on every worker, as
/// it derives from the proxy's shared key seed (a keyed hash of it, so the seed stays secret).
pub fn holder(seed: [u8; 16]) -> u64 {
    use std::hash::Hasher;
    let mut h = siphasher::sip::SipHasher13::new_with_key(&seed);
    h.write(b"floodgate lease holder");
    h.finish()
}

/// The root's tick with leased rules, in milliseconds: a quarter of `lease_timeout`, within
/// 2..=10 ms (background calls are sent, ended buckets settled, and requests waiting on another
/// worker's call look at their key again, at the next tick).
pub fn tick_ms(lease_timeout_ms: u64) -> u64 {
    (lease_timeout_ms / 4).clamp(2, 10)
}

/// How long into a bucket the holders of the bucket before have to settle it (module doc):
/// `min(window / 4, 4 × lease_timeout)`, or 0 (the store never takes units back) when that
/// leaves a live proxy less than a tick and a call's timeout to settle.
pub fn grace_ms(window_ms: u64, lease_timeout_ms: u64) -> u64 {
    let grace = (window_ms / 4).min(lease_timeout_ms.saturating_mul(4));
    if grace < lease_timeout_ms.saturating_add(tick_ms(lease_timeout_ms)) {
        0
    } else {
        grace
    }
}

#[cfg(test)]
mod tests;
