//! Leased global scope (`"consistency": "leased"`): a proxy takes units of a key's quota from the
//! store ahead of use (`floodgate-sync`'s `POST /v1/lease`), admits locally from its lease, and
//! gives back what it did not use; a request waits on the store only when its key's lease is
//! empty. The lease is the proxy's, not a worker's: it lives in shared data ([`record`]), one
//! record per key, and every worker takes from it, refills it and settles it with the same
//! compare-and-swap update ([`crate::primitives::store::update_from`]). One call per key is on its
//! way for the whole proxy; requests of the key on any worker wait for it.
//!
//! A lease asks for about the proxy's rate of the key over a `sync_interval`, or, for a key that
//! comes back less often than that, for its next [`HORIZON_GAPS`] requests (over
//! [`HOLD_MAX_MS`] at most, [`KeyLease::want`]), and is refilled in the background below half of
//! that (a slow key's, once empty). An unused lease goes back after two periods, or that horizon if longer. A call asks for
//! the units of every request of the proxy waiting for the key (the record counts them), which
//! take them at once.
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

pub mod protocol;
mod record;

pub use crate::config::OnStoreFailure;
use crate::keys::fleet::FleetKey;
use crate::primitives::store::{update_from, Attempt, SharedStore, StoreError, MAX_ATTEMPTS};
use crate::primitives::time::UnixMillis;
use crate::ratelimit::window::{Counts, Window};
use std::collections::HashMap;
use std::num::NonZeroU32;

/// After a failed call, a key decides without the store for this long (then asks again).
pub const RETRY_AFTER_FAILURE_MS: u64 = 1_000;
/// A lease unused for this many periods goes back to the store (a slow key's: its horizon).
pub const IDLE_PERIODS: u64 = 2;
/// A slow key's lease covers this many of its gaps between requests...
pub const HORIZON_GAPS: u64 = 4;
/// ...over this long at most, and is kept that long unused.
pub const HOLD_MAX_MS: u64 = 10_000;
/// Records of leases per key the book may follow: two keys share a record only when their ids
/// fall in one slot (about one key in eight when the book is full).
pub const SLOTS_PER_KEY: u64 = 4;
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

/// The call of a key that is on its way, as its record names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CallMark {
    /// The call's id ([`Ask::call`]).
    id: u64,
    /// The worker that sent it.
    owner: u64,
    /// When its answer is overdue (its timeout and a `lease_timeout` more): its sender is
    /// gone, another may ask.
    deadline: UnixMillis,
}

/// One key's lease in the proxy (its shared-data record, [`record`]).
#[derive(Clone, Debug, PartialEq, Eq)]
struct KeyLease {
    spec: LeaseSpec,
    /// The bucket `held` belongs to.
    bucket: u64,
    /// Units granted and not used yet.
    held: u32,
    /// Units of `bucket` admitted without a grant (the store was down), not yet reported.
    consumed: u32,
    /// Unused units of `bucket` and of the bucket before, to give back.
    returned: u32,
    returned_previous: u32,
    /// Units of `bucket`'s grants (and of the bucket before's) admitted since the last call.
    unreported: u32,
    unreported_previous: u32,
    /// Units held that the store counts as used already (granted `at_once` to waiting
    /// requests, or given back by a settled reservation after they were reported): when they
    /// go back unused, they go as `refunded`, not `returned`.
    prereported: u32,
    /// Units the store counts as used in `bucket` and in the bucket before that were not used
    /// after all, to give back.
    refunded: u32,
    refunded_previous: u32,
    /// The store's counts as of `view_bucket`, from its last answer (and when).
    view: Counts,
    view_bucket: u64,
    view_at: Option<UnixMillis>,
    /// The call asking for units that is on its way.
    call: Option<CallMark>,
    /// The workers with requests waiting on it, other than its sender (0: none), told of its
    /// answer.
    watchers: [u64; WATCHERS],
    /// Units of the proxy's requests waiting for the key, as of `waiting_at` (a count left by
    /// a worker that stopped is forgotten once no request can still be waiting).
    waiting: u32,
    waiting_at: UnixMillis,
    /// The last call failed at that time.
    failed_at: Option<UnixMillis>,
    /// Units used since `rate_since`, and the average rate in units per 1000 s.
    used: u32,
    rate_since: UnixMillis,
    rate_per_ks: u64,
    /// When the last grant of at least one unit came, and its size.
    last_grant: Option<(UnixMillis, u32)>,
    last_used: UnixMillis,
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

impl KeyLease {
    fn new(spec: LeaseSpec, now: UnixMillis) -> KeyLease {
        let bucket = spec.window.phase(now).bucket_index;
        KeyLease {
            spec,
            bucket,
            held: 0,
            consumed: 0,
            returned: 0,
            returned_previous: 0,
            unreported: 0,
            unreported_previous: 0,
            prereported: 0,
            refunded: 0,
            refunded_previous: 0,
            view: Counts::default(),
            view_bucket: bucket,
            view_at: None,
            call: None,
            watchers: [0; WATCHERS],
            waiting: 0,
            waiting_at: now,
            failed_at: None,
            used: 0,
            rate_since: now,
            rate_per_ks: 0,
            last_grant: None,
            last_used: now,
        }
    }

    /// Moves to `now`'s bucket: what is held goes back to the bucket it belongs to. Units
    /// admitted without the store in a bucket that ended are not reported (the store only
    /// takes them in the current bucket): after an outage, the previous bucket weighs a little
    /// less than it should.
    fn roll(&mut self, now: UnixMillis) {
        let bucket = self.spec.window.phase(now).bucket_index;
        if bucket <= self.bucket {
            return;
        }
        let next = bucket == self.bucket.saturating_add(1);
        self.release_held();
        self.returned_previous = if next { self.returned } else { 0 };
        self.refunded_previous = if next { self.refunded } else { 0 };
        self.unreported_previous = if next { self.unreported } else { 0 };
        self.returned = 0;
        self.refunded = 0;
        self.unreported = 0;
        self.consumed = 0;
        self.bucket = bucket;
    }

    /// Everything held goes back: what the store counts as used already as `refunded`, the
    /// rest as `returned`.
    fn release_held(&mut self) {
        let prereported = self.prereported.min(self.held);
        self.refunded = self.refunded.saturating_add(prereported);
        self.returned = self.returned.saturating_add(self.held.saturating_sub(prereported));
        self.held = 0;
        self.prereported = 0;
    }

    /// The fleet's counts as known now: the store's last view, moved to the current bucket,
    /// plus what the proxy admitted without the store.
    fn known(&self) -> Counts {
        self.view.rolled(self.view_bucket, self.bucket).plus(self.consumed)
    }

    /// Whether a call of the key is on its way and not past its timeout.
    fn calling(&self, now: UnixMillis) -> bool {
        self.call.is_some_and(|c| now < c.deadline)
    }

    /// The mean gap between the key's requests, ms, once its rate is known.
    fn gap_ms(&self) -> Option<u64> {
        1_000_000u64.checked_div(self.rate_per_ks)
    }

    /// The stretch of the key's traffic a lease covers: a period, or for a key whose requests
    /// come further apart than a period over [`HORIZON_GAPS`], that many of its gaps (at most
    /// [`HOLD_MAX_MS`]).
    fn horizon_ms(&self, period_ms: u64) -> u64 {
        self.gap_ms().map_or(period_ms, |gap| gap.saturating_mul(HORIZON_GAPS).min(HOLD_MAX_MS).max(period_ms))
    }

    /// Units of the proxy's requests waiting for the key.
    fn waiting(&self, now: UnixMillis, terms: &Terms) -> u32 {
        let live = now.saturating_since(self.waiting_at) < terms.lease_timeout_ms.saturating_add(terms.call_timeout_ms);
        if live {
            self.waiting
        } else {
            0
        }
    }

    fn set_waiting(&mut self, units: u32, now: UnixMillis) {
        self.waiting = units;
        self.waiting_at = now;
    }

    /// Whether the lease is to be refilled, `want` being what a call would ask: below half of
    /// it; a slow key's (its horizon longer than a period), once empty (the refill comes long
    /// before its next request).
    fn low(&self, want: u32, period_ms: u64) -> bool {
        if self.horizon_ms(period_ms) > period_ms {
            self.held == 0
        } else {
            self.held.saturating_mul(2) < want
        }
    }

    /// How long an unused lease is kept: two periods, or its horizon if longer.
    fn hold_ms(&self, period_ms: u64) -> u64 {
        period_ms.saturating_mul(IDLE_PERIODS).max(self.horizon_ms(period_ms))
    }

    /// Units to ask for: about the proxy's traffic of the key over its horizon
    /// ([`KeyLease::horizon_ms`]), twice the last grant when the key used more than that grant
    /// within half a period of it (a key heating up faster than the average follows; a key
    /// seen once does not), and at least what the requests waiting for it need (`waiting`).
    fn want(&self, now: UnixMillis, terms: &Terms, waiting: u32) -> u32 {
        let per_horizon = u128::from(self.rate_per_ks).saturating_mul(u128::from(self.horizon_ms(terms.period_ms))).div_ceil(1_000_000);
        let per_horizon = u32::try_from(per_horizon).unwrap_or(u32::MAX);
        let growing = self
            .last_grant
            .filter(|(at, granted)| now.saturating_since(*at) < terms.period_ms / 2 && self.used > *granted)
            .map_or(0, |(_, granted)| granted.saturating_mul(2));
        per_horizon.max(growing).min(terms.max_lease).max(waiting).max(1).min(self.spec.limit.get().max(waiting))
    }

    /// A call that asks for nothing: it gives back and reports, in the lease's bucket.
    fn give_back(&mut self, key: FleetKey, now: UnixMillis, terms: &Terms) -> Ask {
        let phase = self.spec.window.phase(now);
        let elapsed_ms = if phase.bucket_index == self.bucket { phase.elapsed_ms } else { 0 };
        self.call_in(key, self.bucket, elapsed_ms, 0, terms)
    }

    /// The call `id` for `want` ≥ 1 units, of which the requests waiting for it (`waiting`
    /// units) take theirs at once, with the give-backs, which go once; it fails after
    /// `timeout_ms`. Consumed units are forgotten when the store's answer confirms them.
    #[allow(clippy::too_many_arguments)]
    fn ask(&mut self, key: FleetKey, want: u32, waiting: u32, id: u64, timeout_ms: u64, now: UnixMillis, terms: &Terms) -> Ask {
        let phase = self.spec.window.phase(now);
        // The host reports its failure at `timeout_ms`; past that and a `lease_timeout` more,
        // its sender is gone and another may ask.
        let deadline = UnixMillis(now.0.saturating_add(timeout_ms).saturating_add(terms.lease_timeout_ms));
        self.call = Some(CallMark { id, owner: terms.caller, deadline });
        let at_once = waiting.min(want);
        Ask { at_once, call: id, ..self.call_in(key, phase.bucket_index, phase.elapsed_ms, want, terms) }
    }

    /// A call in `bucket`: the give-backs and the reports go with it, once.
    fn call_in(&mut self, key: FleetKey, bucket: u64, elapsed_ms: u64, want: u32, terms: &Terms) -> Ask {
        let window_ms = self.spec.window.length_ms();
        let ask = Ask {
            key,
            window_ms,
            bucket,
            elapsed_ms,
            limit: self.spec.limit.get(),
            want,
            consumed: self.consumed,
            returned: self.returned,
            returned_previous: self.returned_previous,
            used: self.unreported,
            used_previous: self.unreported_previous,
            grace_ms: grace_ms(window_ms, terms.lease_timeout_ms),
            at_once: 0,
            refunded: self.refunded,
            refunded_previous: self.refunded_previous,
            call: 0,
        };
        self.returned = 0;
        self.returned_previous = 0;
        self.refunded = 0;
        self.refunded_previous = 0;
        self.unreported = 0;
        self.unreported_previous = 0;
        ask
    }

    /// The lease is closed: the call that gives back all it holds and reports what it owes,
    /// if anything.
    fn close(&mut self, key: FleetKey, now: UnixMillis, terms: &Terms) -> Option<Ask> {
        self.roll(now);
        self.release_held();
        self.owes().then(|| self.give_back(key, now, terms))
    }

    /// Whether there is anything to give back or report.
    fn owes(&self) -> bool {
        self.settles() || self.consumed > 0 || self.unreported > 0
    }

    /// Whether there is anything to give back, or a report of an ended bucket to send.
    fn settles(&self) -> bool {
        self.returned > 0 || self.returned_previous > 0 || self.refunded > 0 || self.refunded_previous > 0 || self.unreported_previous > 0
    }

    /// Updates the rate: an average over the periods since the last update (at most one
    /// update per period).
    fn note_rate(&mut self, now: UnixMillis, period_ms: u64) {
        let elapsed = now.saturating_since(self.rate_since);
        if elapsed < period_ms.max(1) {
            return;
        }
        let measured = u64::from(self.used).saturating_mul(1_000_000).checked_div(elapsed).unwrap_or(0);
        // Half the old rate and half the new one: a hot key's lease grows within two periods,
        // an idle key's shrinks as fast. The first measure is taken whole: a key that comes
        // back a second time has its rate at once.
        self.rate_per_ks = if self.rate_per_ks == 0 { measured } else { (self.rate_per_ks / 2).saturating_add(measured / 2) };
        self.used = 0;
        self.rate_since = now;
    }

    /// `cost` units taken in this bucket come back: held again (those the store counts as
    /// used already as such).
    fn untake(&mut self, cost: u32) {
        self.held = self.held.saturating_add(cost);
        self.used = self.used.saturating_sub(cost);
        let back = self.unreported.min(cost);
        self.unreported = self.unreported.saturating_sub(back);
        self.prereported = self.prereported.saturating_add(cost.saturating_sub(back));
    }

    fn admit(&mut self, cost: u32, now: UnixMillis) {
        self.used = self.used.saturating_add(cost);
        self.last_used = now;
    }

    /// Takes `cost` units of the lease held (those the store counts as used already first).
    fn take_held(&mut self, cost: u32, now: UnixMillis) {
        self.held = self.held.saturating_sub(cost);
        let prereported = self.prereported.min(cost);
        self.prereported = self.prereported.saturating_sub(prereported);
        self.unreported = self.unreported.saturating_add(cost.saturating_sub(prereported));
        self.admit(cost, now);
    }

    /// Takes `cost` units for a request (module doc); `id`: the id of the call to send, if one
    /// goes. A request that waited stops waiting first; one that waits (again) is counted.
    /// Also says whether it was decided without the store (as `on_store_failure` says).
    fn take(&mut self, key: FleetKey, cost: u32, waited: Waited, id: u64, now: UnixMillis, terms: &Terms) -> (Take, bool) {
        if waited != Waited::No {
            let left = self.waiting(now, terms).saturating_sub(cost);
            self.set_waiting(left, now);
        }
        let others = self.waiting(now, terms);
        let (take, alone) = self.take_units(key, cost, waited, others, id, now, terms);
        if let Take::Wait { .. } = take {
            self.set_waiting(others.saturating_add(cost), now);
        }
        (take, alone)
    }

    /// [`KeyLease::take`], with `others` units of the proxy's requests waiting.
    #[allow(clippy::too_many_arguments)]
    fn take_units(&mut self, key: FleetKey, cost: u32, waited: Waited, others: u32, id: u64, now: UnixMillis, terms: &Terms) -> (Take, bool) {
        let spec = self.spec;
        let elapsed_ms = spec.window.phase(now).elapsed_ms;
        if self.held >= cost {
            self.take_held(cost, now);
            let want = self.want(now, terms, others);
            // A lease of one unit is not refilled ahead: a cold key holds nothing between its
            // requests.
            let refill = (!self.calling(now)
                && want >= 2
                && self.low(want, terms.period_ms)
                && !recently(self.failed_at, now, RETRY_AFTER_FAILURE_MS)
                && spec.window.admits(self.known(), elapsed_ms, 1, spec.limit))
            .then(|| self.ask(key, want, others, id, terms.call_timeout_ms, now, terms));
            return (Take::Admitted { counts: self.known(), held: self.held, refill }, false);
        }
        // The store failed lately, or the request waited as long as any call takes: decide
        // without it (never while a call of the key that may still answer is on its way).
        if waited == Waited::Overdue || recently(self.failed_at, now, RETRY_AFTER_FAILURE_MS) {
            return (self.without_store(terms.policy, cost, now), true);
        }
        let known = self.known();
        // The store said within a period that the window is full: refuse without asking again.
        // The units the proxy holds are counted in the store's view already, and they are the
        // request's to take: only what it still needs must fit.
        let fresh = self.view_at.is_some_and(|at| now.saturating_since(at) < terms.period_ms);
        if fresh && !spec.window.admits(known, elapsed_ms, cost.saturating_sub(self.held), spec.limit) {
            // What it holds cannot cover this request and the window has no room for more: it
            // goes back with the key's next call or settlement, for a proxy it covers
            // (requests of many units would otherwise stay refused while their units sit
            // split over leases none of which covers one).
            self.release_held();
            return (Take::Refused { refusal: Refusal::OverLimit, counts: known }, false);
        }
        if self.calling(now) {
            if self.call.is_some_and(|c| c.owner != terms.caller) {
                self.watch(terms.caller);
            }
            return (Take::Wait { call: None }, false);
        }
        // What the waiting requests still need beyond the units held: a grant of that covers
        // them whole.
        let waiting = others.saturating_add(cost).saturating_sub(self.held);
        let want = self.want(now, terms, waiting);
        // A new request's call goes from its own stream, with `lease_timeout`; another from
        // the root, with the longer timeout.
        let timeout_ms = if waited == Waited::No { terms.lease_timeout_ms } else { terms.call_timeout_ms };
        (Take::Wait { call: Some(self.ask(key, want, waiting, id, timeout_ms, now, terms)) }, false)
    }

    /// A decision without the store (module doc, "Store down").
    fn without_store(&mut self, policy: OnStoreFailure, cost: u32, now: UnixMillis) -> Take {
        let known = self.known();
        let spec = self.spec;
        let elapsed_ms = spec.window.phase(now).elapsed_ms;
        if self.held >= cost {
            self.take_held(cost, now);
            return Take::Admitted { counts: known, held: self.held, refill: None };
        }
        match policy {
            OnStoreFailure::Refuse => Take::Refused { refusal: Refusal::StoreDown, counts: known },
            OnStoreFailure::LastState if spec.window.admits(known, elapsed_ms, cost, spec.limit) => {
                self.consumed = self.consumed.saturating_add(cost);
                self.admit(cost, now);
                Take::Admitted { counts: self.known(), held: self.held, refill: None }
            }
            OnStoreFailure::LastState => Take::Refused { refusal: Refusal::OverLimit, counts: known },
        }
    }

    /// Names `worker` among those told of the answer of the call on its way (if there is room).
    fn watch(&mut self, worker: u64) {
        if !self.watchers.contains(&worker) {
            if let Some(free) = self.watchers.iter_mut().find(|w| **w == 0) {
                *free = worker;
            }
        }
    }

    /// The call on its way is over: the workers to tell.
    fn call_ended(&mut self) -> [u64; WATCHERS] {
        self.call = None;
        std::mem::take(&mut self.watchers)
    }

    /// The store's answer to `ask` (`None`: the call failed or timed out); returns the
    /// workers to tell of it.
    fn answered(&mut self, ask: &Ask, grant: Option<Grant>, now: UnixMillis) -> [u64; WATCHERS] {
        let standing = ask.call != 0 && self.call.is_some_and(|c| c.id == ask.call);
        let watchers = if standing { self.call_ended() } else { [0; WATCHERS] };
        let Some(grant) = grant else {
            // A failure counts when it was the call the key waits on (or none is on its way).
            if ask.want > 0 && (standing || !self.calling(now)) {
                self.failed_at = Some(now);
            }
            return watchers;
        };
        self.failed_at = None;
        self.roll(now);
        if grant.granted > 0 {
            self.last_grant = Some((now, grant.granted));
        }
        if ask.bucket == self.bucket {
            self.held = self.held.saturating_add(grant.granted);
            self.prereported = self.prereported.saturating_add(grant.granted.min(ask.at_once));
            self.consumed = self.consumed.saturating_sub(ask.consumed);
        } else if ask.bucket.saturating_add(1) == self.bucket {
            self.returned_previous = self.returned_previous.saturating_add(grant.granted);
        }
        if ask.bucket >= self.view_bucket {
            self.view = grant.counts;
            self.view_bucket = ask.bucket;
            self.view_at = Some(now);
        }
        watchers
    }
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

/// A key this worker follows: it took units of it, so it settles the key's lease too.
#[derive(Clone, Copy, Debug)]
struct Followed {
    spec: LeaseSpec,
    /// Units of this worker's requests waiting for the key.
    waiting: u32,
}

/// The proxy's leases of every leased rule's keys, as one worker sees and updates them: the
/// leases are in shared data, this book holds the keys the worker follows and its requests
/// waiting for them.
#[derive(Clone, Debug)]
pub struct LeaseBook {
    followed: HashMap<FleetKey, Followed>,
    max_keys: usize,
    /// Where the records are: `<prefix><slot>`, `slots` of them.
    prefix: String,
    slots: u64,
    terms: Terms,
    /// Its last call's number (with the worker's id, a call's id).
    calls: u64,
    /// Give-backs of leases closed by another key taking their record, for the next heartbeat.
    orphan_returns: Vec<Ask>,
    /// The earliest end of a followed key's bucket: the book settles at the first tick after it.
    next_roll: UnixMillis,
    /// Units the proxy held of the followed keys at the last heartbeat.
    held: u64,
    /// Workers to tell that a call of a key they wait on ended ([`LeaseBook::take_notices`]).
    notices: Vec<(u64, FleetKey)>,
}

impl LeaseBook {
    /// A book over the records `<namespace>/lease/<slot>` (`SLOTS_PER_KEY × max_keys` of them)
    /// of at most `max_keys` keys, on `terms`.
    pub fn new(namespace: &str, max_keys: usize, terms: Terms) -> LeaseBook {
        let max_keys = max_keys.max(1);
        LeaseBook {
            followed: HashMap::new(),
            max_keys,
            prefix: format!("floodgate/{namespace}/lease/"),
            slots: u64::try_from(max_keys).unwrap_or(u64::MAX).saturating_mul(SLOTS_PER_KEY),
            terms: Terms {
                period_ms: terms.period_ms.max(1),
                max_lease: terms.max_lease.max(1),
                call_timeout_ms: terms.call_timeout_ms.max(terms.lease_timeout_ms),
                ..terms
            },
            calls: 0,
            orphan_returns: Vec::new(),
            next_roll: UnixMillis(u64::MAX),
            held: 0,
            notices: Vec::new(),
        }
    }

    /// The workers to tell that a call of a key their requests wait on ended (answered,
    /// failed or lost): they look at the key at once.
    pub fn take_notices(&mut self) -> Vec<(u64, FleetKey)> {
        std::mem::take(&mut self.notices)
    }

    /// Notes the workers to tell of `key`'s call.
    fn notify(&mut self, key: FleetKey, watchers: [u64; WATCHERS]) {
        let caller = self.terms.caller;
        self.notices.extend(watchers.into_iter().filter(|w| *w != 0 && *w != caller).map(|w| (w, key)));
    }

    /// Whether a followed key's bucket ended since the last [`LeaseBook::heartbeat`]: the book
    /// has something to settle (call the heartbeat at once).
    pub fn roll_due(&self, now: UnixMillis) -> bool {
        now >= self.next_roll
    }

    /// The keys this worker follows.
    pub fn keys(&self) -> usize {
        self.followed.len()
    }

    /// Units the proxy held of the keys this worker follows, at the last heartbeat.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// The shared-data key of `key`'s record.
    fn slot(&self, key: FleetKey) -> String {
        let [low, high] = [key.0 % (1u128 << 64), key.0 >> 64].map(|half| u64::try_from(half).unwrap_or(0));
        let folded = crate::primitives::hash::mix64(low ^ high);
        format!("{}{:x}", self.prefix, folded.checked_rem(self.slots).unwrap_or(0))
    }

    /// The id of the next call.
    fn next_call(&mut self) -> u64 {
        self.calls = self.calls.wrapping_add(1);
        let id = self.terms.caller.rotate_left(24) ^ self.calls;
        id.max(1)
    }

    /// Follows `key` (at most `max_keys`: another, with no request waiting, is dropped, its
    /// lease closed); returns its entry.
    fn follow(&mut self, store: &dyn SharedStore, key: FleetKey, spec: LeaseSpec, now: UnixMillis) -> &mut Followed {
        if !self.followed.contains_key(&key) && self.followed.len() >= self.max_keys {
            if let Some(old) = self.followed.iter().find(|(_, f)| f.waiting == 0).map(|(k, _)| *k) {
                self.followed.remove(&old);
                self.close(store, old, now);
            }
        }
        let end = bucket_end(spec.window, now);
        self.next_roll = self.next_roll.min(end);
        let entry = self.followed.entry(key).or_insert(Followed { spec, waiting: 0 });
        entry.spec = spec;
        entry
    }

    /// Updates `key`'s record with `f` (a compare-and-swap: `f` may run again on a newer
    /// record). With `create`, a record of another key or window is closed (its give-back goes
    /// with the next heartbeat) and a new lease made; without, `None` is returned for it.
    fn with_lease<T>(
        &mut self,
        store: &dyn SharedStore,
        key: FleetKey,
        create: Option<LeaseSpec>,
        now: UnixMillis,
        mut f: impl FnMut(&mut KeyLease) -> T,
    ) -> Result<Option<T>, StoreError> {
        let name = self.slot(key);
        let terms = self.terms;
        let mut read = store.get(&name)?;
        let (answer, closed) = update_from(store, &name, &mut read, MAX_ATTEMPTS, |stored| {
            let found = stored.and_then(|s| record::decode(&s.value).ok());
            let (mut lease, closed) = match (found, create) {
                (Some((k, lease)), create) if k == key && create.is_none_or(|s| s.window == lease.spec.window) => (lease, None),
                (found, Some(spec)) => {
                    let closed = found.and_then(|(k, mut old)| old.close(k, now, &terms));
                    (KeyLease::new(spec, now), closed)
                }
                (_, None) => return Attempt::Done((None, None)),
            };
            let answer = f(&mut lease);
            let bytes = record::encode(key, &lease);
            if stored.is_some_and(|s| s.value == bytes) {
                Attempt::Done((Some(answer), closed))
            } else {
                Attempt::Write(bytes, (Some(answer), closed))
            }
        })?;
        self.orphan_returns.extend(closed);
        Ok(answer)
    }

    /// [`LeaseBook::with_lease`] where a failure of shared data only costs this update (the
    /// host refused, or the record stayed contended): logged, and `None` as for a record of
    /// another key.
    fn update_lease<T>(
        &mut self,
        store: &dyn SharedStore,
        key: FleetKey,
        create: Option<LeaseSpec>,
        now: UnixMillis,
        f: impl FnMut(&mut KeyLease) -> T,
    ) -> Option<T> {
        self.with_lease(store, key, create, now, f).unwrap_or_else(|err| {
            log::debug!("floodgate: lease record not updated: {err}");
            None
        })
    }

    /// Closes `key`'s lease: what it holds and owes goes back with the next heartbeat.
    fn close(&mut self, store: &dyn SharedStore, key: FleetKey, now: UnixMillis) {
        let terms = self.terms;
        if let Some(Some(ask)) = self.update_lease(store, key, None, now, |lease| lease.close(key, now, &terms)) {
            self.orphan_returns.push(ask);
        }
    }

    /// Takes `cost` units of `key` for a request (module doc); `waited`: whether it waited for
    /// the store already (it takes again once the answer came, or at a tick: it stops waiting,
    /// and waits again if it must). Also says whether it was decided without the store.
    pub fn take(&mut self, store: &dyn SharedStore, key: FleetKey, spec: LeaseSpec, cost: u32, waited: Waited, now: UnixMillis) -> (Take, bool) {
        let entry = self.follow(store, key, spec, now);
        if waited != Waited::No {
            entry.waiting = entry.waiting.saturating_sub(cost);
        }
        let (terms, id) = (self.terms, self.next_call());
        let outcome = self.with_lease(store, key, Some(spec), now, |lease| {
            // A tier or override may change the key's limit: the latest applies.
            lease.spec = spec;
            lease.roll(now);
            lease.note_rate(now, terms.period_ms);
            let held = lease.held;
            let (take, alone) = lease.take(key, cost, waited, id, now, &terms);
            (take, alone, held > 0 && lease.held == 0 && matches!(take, Take::Refused { .. }))
        });
        let (take, alone) = match outcome {
            Ok(Some((take, alone, released))) => {
                if released {
                    // Its units go back at the root's next tick.
                    self.next_roll = now;
                }
                (take, alone)
            }
            Ok(None) | Err(_) => {
                log::warn!("floodgate: the lease record of a key could not be updated in shared data");
                (Take::Refused { refusal: Refusal::StoreDown, counts: Counts::default() }, true)
            }
        };
        if let (Take::Wait { .. }, Some(entry)) = (take, self.followed.get_mut(&key)) {
            entry.waiting = entry.waiting.saturating_add(cost);
        }
        (take, alone)
    }

    /// A call's answer will never come (the stream that sent it ended, and the host cancelled
    /// it): the key may send another. Units it may have been granted stay counted.
    pub fn lost(&mut self, store: &dyn SharedStore, ask: &Ask, now: UnixMillis) {
        if ask.call == 0 {
            return;
        }
        let ended = self.update_lease(store, ask.key, None, now, |lease| {
            if lease.call.is_some_and(|c| c.id == ask.call) {
                lease.call_ended()
            } else {
                [0; WATCHERS]
            }
        });
        if let Some(watchers) = ended {
            self.notify(ask.key, watchers);
        }
    }

    /// A waiting request of this worker gave up (its deadline passed, or its client left).
    pub fn abandon(&mut self, store: &dyn SharedStore, key: FleetKey, cost: u32, now: UnixMillis) {
        if let Some(entry) = self.followed.get_mut(&key) {
            entry.waiting = entry.waiting.saturating_sub(cost);
        }
        let terms = self.terms;
        self.update_lease(store, key, None, now, |lease| {
            let left = lease.waiting(now, &terms).saturating_sub(cost);
            lease.set_waiting(left, now);
        });
    }

    /// Gives back units taken by [`LeaseBook::take`] for a request another rule refused.
    pub fn untake(&mut self, store: &dyn SharedStore, key: FleetKey, cost: u32, taken_at: UnixMillis) {
        self.update_lease(store, key, None, taken_at, |lease| {
            if lease.spec.window.phase(taken_at).bucket_index == lease.bucket {
                lease.untake(cost);
            }
        });
    }

    /// Gives back `units` of `key` taken at `taken_at` and not used after all (a reservation
    /// settled below its estimate). In the lease's bucket they are the lease's again
    /// ([`LeaseBook::untake`]); in the bucket before, those not reported yet go back as
    /// `returned_previous` and the rest, which the store counts as used, as
    /// `refunded_previous`; older ones no longer weigh and are dropped. A key whose record went
    /// meanwhile comes back for them.
    pub fn refund(&mut self, store: &dyn SharedStore, key: FleetKey, spec: LeaseSpec, units: u32, taken_at: UnixMillis, now: UnixMillis) {
        let taken_in = spec.window.phase(taken_at).bucket_index;
        if units == 0 || taken_in.saturating_add(1) < spec.window.phase(now).bucket_index {
            return;
        }
        self.follow(store, key, spec, now);
        self.update_lease(store, key, Some(spec), now, |lease| {
            lease.roll(now);
            if taken_in == lease.bucket {
                lease.untake(units);
            } else if taken_in.saturating_add(1) == lease.bucket {
                let unreported = lease.unreported_previous.min(units);
                lease.unreported_previous = lease.unreported_previous.saturating_sub(unreported);
                lease.returned_previous = lease.returned_previous.saturating_add(unreported);
                lease.refunded_previous = lease.refunded_previous.saturating_add(units.saturating_sub(unreported));
            }
        });
    }

    /// Charges `units` of `key` beyond what a request took (a count reported above its
    /// reservation): admitted without a grant, like units admitted while the store was down,
    /// and reported with the key's next call (the store adds them whatever the room).
    pub fn consume(&mut self, store: &dyn SharedStore, key: FleetKey, spec: LeaseSpec, units: u32, now: UnixMillis) {
        if units == 0 {
            return;
        }
        self.follow(store, key, spec, now);
        self.update_lease(store, key, Some(spec), now, |lease| {
            lease.roll(now);
            lease.consumed = lease.consumed.saturating_add(units);
            lease.admit(units, now);
        });
    }

    /// The store's answer to `ask` (`None`: the call failed or timed out). The requests
    /// waiting for the key then take again, in the order they came.
    pub fn answered(&mut self, store: &dyn SharedStore, ask: &Ask, grant: Option<Grant>, now: UnixMillis) {
        let result = self.with_lease(store, ask.key, None, now, |lease| {
            // A grant of another window's counters (the rule's window changed since) is an
            // orphan.
            let ours = lease.spec.window.length_ms() == ask.window_ms;
            ours.then(|| lease.answered(ask, grant, now))
        });
        if let Ok(Some(Some(watchers))) = result {
            self.notify(ask.key, watchers);
            return;
        }
        if let Err(err) = result {
            log::warn!("floodgate: a lease answer could not be written to shared data ({err}): its units go back");
        }
        if let Some(grant) = grant.filter(|g| g.granted > 0) {
            // The key's record went meanwhile (another key took it, or its window changed): its
            // grant goes straight back.
            self.orphan_returns.push(Ask {
                want: 0,
                consumed: 0,
                returned: grant.granted,
                returned_previous: 0,
                used: 0,
                used_previous: 0,
                at_once: 0,
                refunded: 0,
                refunded_previous: 0,
                call: 0,
                ..*ask
            });
        }
    }

    /// Once per heartbeat, and at once when [`LeaseBook::roll_due`]: for every key this worker
    /// follows, the give-backs of a lease unused for its hold time or whose bucket ended (with
    /// the units used since the last call: the ended bucket is settled), and those of closed
    /// leases, as calls that ask for nothing. Idle keys with nothing left to report are no
    /// longer followed (their record keeps the key's rate until another key takes it).
    pub fn heartbeat(&mut self, store: &dyn SharedStore, now: UnixMillis) -> Vec<Ask> {
        let terms = self.terms;
        let mut returns = std::mem::take(&mut self.orphan_returns);
        let mut next_roll = UnixMillis(u64::MAX);
        let mut held = 0u64;
        let keys: Vec<(FleetKey, Followed)> = self.followed.iter().map(|(k, f)| (*k, *f)).collect();
        for (key, followed) in keys {
            let result = self.with_lease(store, key, None, now, |lease| {
                lease.roll(now);
                let idle = now.saturating_since(lease.last_used) >= lease.hold_ms(terms.period_ms) && !lease.calling(now) && followed.waiting == 0;
                if idle {
                    lease.release_held();
                }
                let ask = (lease.settles() || (idle && lease.owes())).then(|| lease.give_back(key, now, &terms));
                (ask, !idle || lease.consumed > 0, lease.held)
            });
            let keep = match result {
                Ok(Some((ask, keep, units))) => {
                    returns.extend(ask);
                    held = held.saturating_add(u64::from(units));
                    keep || followed.waiting > 0
                }
                // Another key took the record: the lease was closed then.
                Ok(None) => followed.waiting > 0,
                Err(err) => {
                    log::debug!("floodgate: lease record not settled: {err}");
                    true
                }
            };
            if keep {
                next_roll = next_roll.min(bucket_end(followed.spec.window, now));
            } else {
                self.followed.remove(&key);
            }
        }
        self.next_roll = next_roll;
        self.held = held;
        returns.append(&mut self.orphan_returns);
        returns
    }

    /// Everything the followed keys' leases hold goes back (the configuration is replaced).
    pub fn drain(&mut self, store: &dyn SharedStore, now: UnixMillis) -> Vec<Ask> {
        let keys: Vec<FleetKey> = self.followed.drain().map(|(k, _)| k).collect();
        for key in keys {
            self.close(store, key, now);
        }
        std::mem::take(&mut self.orphan_returns)
    }
}

/// When the bucket of `now` ends.
fn bucket_end(window: Window, now: UnixMillis) -> UnixMillis {
    let bucket = window.phase(now).bucket_index;
    UnixMillis(bucket.saturating_add(1).saturating_mul(window.length_ms()))
}

fn recently(at: Option<UnixMillis>, now: UnixMillis, within_ms: u64) -> bool {
    at.is_some_and(|at| now.saturating_since(at) < within_ms)
}

#[cfg(test)]
mod tests;
