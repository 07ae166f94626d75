//! Leased global scope (`"consistency": "leased"`): each worker takes units of a key's quota from
//! the store ahead of use (`floodgate-sync`'s `POST /v1/lease`), admits locally from its lease, and
//! gives back what it did not use; a request waits on the store only when its key's lease is empty.
//! A worker asks for about its own rate of the key over a `sync_interval` ([`LeaseBook::take`]),
//! and refills a lease below half of that in the background.
//!
//! Invariants: the store grants only what the key's sliding window has room for (at most a quarter
//! of the room, at least one unit while there is any), so the units held or used across the fleet
//! in a bucket always fit the limit. A unit belongs to the bucket it was granted in; what is left
//! goes back at its end. A give-back is sent once and a grant whose answer is lost stays counted: a
//! lost message makes the fleet admit less, never more. A worker names itself in its calls, so once
//! a bucket has ended and a grace passed, a dead worker's outstanding units come off its counter.
//! Units the store counts as used that come back unused (a token reservation settled below its
//! estimate, an `at_once` grant left over) go back as `refunded`, off the counter, so the store
//! ends with the units used; a count above a reservation is reported like units admitted without
//! a grant ([`LeaseBook::refund`], [`LeaseBook::consume`]).
//! With the store down, `on_store_failure` decides (the last counts plus this worker's admissions
//! since, reported with its next call; or refuse), and a failed key asks again after
//! `RETRY_AFTER_FAILURE_MS`.
//!
//! Rationale: docs/design.md, section "Leased consistency".

pub mod protocol;

pub use crate::config::OnStoreFailure;
use crate::keys::fleet::FleetKey;
use crate::ratelimit::window::{Counts, Window};
use crate::primitives::time::UnixMillis;
use std::collections::HashMap;
use std::num::NonZeroU32;

/// After a failed call, a key decides without the store for this long (then asks again).
pub const RETRY_AFTER_FAILURE_MS: u64 = 1_000;
/// A lease unused for this many periods goes back to the store.
pub const IDLE_PERIODS: u64 = 2;

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
    /// The store could not be reached and `on_store_failure` is `refuse`.
    StoreDown,
}

/// The outcome of [`LeaseBook::take`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Units taken.
    Admitted {
        /// The fleet's counts as last known (for the `RateLimit` fields).
        counts: Counts,
        /// Units this worker still holds.
        held: u32,
        /// A call to send in the background (the lease runs low).
        refill: Option<Ask>,
    },
    /// The request waits for the store.
    Wait {
        /// The call to send; `None` when one is on its way (the request waits for its answer).
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

/// One key's lease in this worker.
#[derive(Clone, Debug)]
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
    /// A call asking for units is on its way.
    in_flight: bool,
    /// The last call failed at that time.
    failed_at: Option<UnixMillis>,
    /// Units of the requests waiting for the store.
    waiting: u32,
    /// Units used since `rate_since`, and the average rate in units per 1000 ms.
    used: u32,
    rate_since: UnixMillis,
    rate_per_s: u32,
    /// When the last grant of at least one unit came, and its size.
    last_grant: Option<(UnixMillis, u32)>,
    last_used: UnixMillis,
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
            in_flight: false,
            failed_at: None,
            waiting: 0,
            used: 0,
            rate_since: now,
            rate_per_s: 0,
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
    /// plus what this worker admitted without the store.
    fn known(&self) -> Counts {
        self.view.rolled(self.view_bucket, self.bucket).plus(self.consumed)
    }

    /// Units to ask for: about one period of this worker's traffic of the key, twice the last
    /// grant when the key used more than that grant within half a period of it (a key heating
    /// up faster than the average follows; a key seen once does not), and at least what the
    /// requests waiting for it need.
    fn want(&self, now: UnixMillis, period_ms: u64, max_lease: u32) -> u32 {
        let per_period = u64::from(self.rate_per_s).saturating_mul(period_ms).div_ceil(1000);
        let per_period = u32::try_from(per_period).unwrap_or(u32::MAX);
        let growing = self
            .last_grant
            .filter(|(at, granted)| now.saturating_since(*at) < period_ms / 2 && self.used > *granted)
            .map_or(0, |(_, granted)| granted.saturating_mul(2));
        per_period.max(growing).min(max_lease).max(self.waiting).max(1).min(self.spec.limit.get().max(self.waiting))
    }

    /// A call that asks for nothing: it gives back and reports, in the lease's bucket.
    fn give_back(&mut self, key: FleetKey, now: UnixMillis, lease_timeout_ms: u64) -> Ask {
        let phase = self.spec.window.phase(now);
        let elapsed_ms = if phase.bucket_index == self.bucket { phase.elapsed_ms } else { 0 };
        self.call(key, self.bucket, elapsed_ms, 0, lease_timeout_ms)
    }

    /// The call for `want` ≥ 1 units, with the give-backs, which go once. Consumed units are
    /// forgotten when the store's answer confirms them.
    fn ask(&mut self, key: FleetKey, want: u32, now: UnixMillis, lease_timeout_ms: u64) -> Ask {
        let phase = self.spec.window.phase(now);
        self.in_flight = true;
        let at_once = self.waiting.min(want);
        Ask { at_once, ..self.call(key, phase.bucket_index, phase.elapsed_ms, want, lease_timeout_ms) }
    }

    /// A call in `bucket`: the give-backs and the reports go with it, once.
    fn call(&mut self, key: FleetKey, bucket: u64, elapsed_ms: u64, want: u32, lease_timeout_ms: u64) -> Ask {
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
            grace_ms: grace_ms(window_ms, lease_timeout_ms),
            at_once: 0,
            refunded: self.refunded,
            refunded_previous: self.refunded_previous,
        };
        self.returned = 0;
        self.returned_previous = 0;
        self.refunded = 0;
        self.refunded_previous = 0;
        self.unreported = 0;
        self.unreported_previous = 0;
        ask
    }

    /// The lease leaves the book: the call that gives back all it holds and reports what it
    /// owes, if anything.
    fn close(&mut self, key: FleetKey, now: UnixMillis, lease_timeout_ms: u64) -> Option<Ask> {
        self.release_held();
        self.owes().then(|| self.give_back(key, now, lease_timeout_ms))
    }

    /// Whether there is anything to give back or report.
    fn owes(&self) -> bool {
        self.returned > 0
            || self.returned_previous > 0
            || self.refunded > 0
            || self.refunded_previous > 0
            || self.consumed > 0
            || self.unreported > 0
            || self.unreported_previous > 0
    }

    /// When the lease's bucket ends.
    fn bucket_end(&self) -> UnixMillis {
        UnixMillis(self.bucket.saturating_add(1).saturating_mul(self.spec.window.length_ms()))
    }

    /// Updates the rate: an average over the periods since the last update (at most one
    /// update per period).
    fn note_rate(&mut self, now: UnixMillis, period_ms: u64) {
        let elapsed = now.saturating_since(self.rate_since);
        if elapsed < period_ms.max(1) {
            return;
        }
        let measured = u64::from(self.used).saturating_mul(1000).checked_div(elapsed).unwrap_or(0);
        let measured = u32::try_from(measured).unwrap_or(u32::MAX);
        // Half the old rate and half the new one: a hot key's lease grows within two periods,
        // an idle key's shrinks as fast.
        self.rate_per_s = (self.rate_per_s / 2).saturating_add(measured / 2);
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
}

/// The root's tick with leased rules, in milliseconds: a quarter of `lease_timeout`, within
/// 2..=10 ms (background calls are sent, and ended buckets settled, at the next tick).
pub fn tick_ms(lease_timeout_ms: u64) -> u64 {
    (lease_timeout_ms / 4).clamp(2, 10)
}

/// How long into a bucket the holders of the bucket before have to settle it (module doc):
/// `min(window / 4, 4 × lease_timeout)`, or 0 (the store never takes units back) when that
/// leaves a live worker less than a tick and a call's timeout to settle.
pub fn grace_ms(window_ms: u64, lease_timeout_ms: u64) -> u64 {
    let grace = (window_ms / 4).min(lease_timeout_ms.saturating_mul(4));
    if grace < lease_timeout_ms.saturating_add(tick_ms(lease_timeout_ms)) {
        0
    } else {
        grace
    }
}

/// This worker's leases of every leased rule's keys.
#[derive(Clone, Debug)]
pub struct LeaseBook {
    leases: HashMap<FleetKey, KeyLease>,
    max_keys: usize,
    /// `sync_interval`: what a lease should cover, in milliseconds of the key's traffic.
    period_ms: u64,
    policy: OnStoreFailure,
    /// `max_lease`: the most units asked for beyond the waiting requests' needs.
    max_lease: u32,
    /// `lease_timeout`, ms (the grace sent with calls: module doc).
    lease_timeout_ms: u64,
    /// Give-backs of keys dropped from the book, for the next heartbeat.
    orphan_returns: Vec<Ask>,
    /// The earliest end of a lease's bucket: the book settles at the first tick after it.
    next_roll: UnixMillis,
}

impl LeaseBook {
    /// An empty book of at most `max_keys` keys, whose leases cover about `period_ms` of a
    /// key's traffic and `max_lease` units at most beyond what waiting requests need; its calls
    /// wait `lease_timeout_ms` at most.
    pub fn new(max_keys: usize, period_ms: u64, policy: OnStoreFailure, max_lease: u32, lease_timeout_ms: u64) -> LeaseBook {
        LeaseBook {
            leases: HashMap::new(),
            max_keys: max_keys.max(1),
            period_ms: period_ms.max(1),
            policy,
            max_lease: max_lease.max(1),
            lease_timeout_ms,
            orphan_returns: Vec::new(),
            next_roll: UnixMillis(u64::MAX),
        }
    }

    /// Whether a lease's bucket ended since the last [`LeaseBook::heartbeat`]: the book has
    /// something to settle (call the heartbeat at once).
    pub fn roll_due(&self, now: UnixMillis) -> bool {
        now >= self.next_roll
    }

    /// The keys in the book.
    pub fn keys(&self) -> usize {
        self.leases.len()
    }

    /// Units this worker holds, over every key.
    pub fn held(&self) -> u64 {
        self.leases.values().map(|l| u64::from(l.held)).sum()
    }

    /// Takes `cost` units of `key` for a request (module doc); `waited`: the request waited
    /// for the store already (it takes again once the answer came).
    pub fn take(&mut self, key: FleetKey, spec: LeaseSpec, cost: u32, waited: bool, now: UnixMillis) -> Take {
        if !self.leases.contains_key(&key) && self.leases.len() >= self.max_keys {
            self.evict_one(now);
        }
        let (period_ms, policy, max_lease, timeout_ms) = (self.period_ms, self.policy, self.max_lease, self.lease_timeout_ms);
        let lease = self.leases.entry(key).or_insert_with(|| KeyLease::new(spec, now));
        if lease.spec.window != spec.window {
            // The rule's window changed: another set of counters.
            *lease = KeyLease::new(spec, now);
        }
        // A tier or override may change the key's limit: the latest applies.
        lease.spec = spec;
        lease.roll(now);
        self.next_roll = self.next_roll.min(lease.bucket_end());
        lease.note_rate(now, period_ms);
        if waited {
            lease.waiting = lease.waiting.saturating_sub(cost);
        }
        let elapsed_ms = spec.window.phase(now).elapsed_ms;
        if lease.held >= cost {
            lease.take_held(cost, now);
            let want = lease.want(now, period_ms, max_lease);
            // A lease of one unit is not refilled ahead: a cold key holds nothing between its
            // requests.
            let refill = (!lease.in_flight
                && want >= 2
                && lease.held.saturating_mul(2) < want
                && !recently(lease.failed_at, now, RETRY_AFTER_FAILURE_MS)
                && spec.window.admits(lease.known(), elapsed_ms, 1, spec.limit))
            .then(|| lease.ask(key, want, now, timeout_ms));
            return Take::Admitted { counts: lease.known(), held: lease.held, refill };
        }
        let known = lease.known();
        // The store failed lately: decide without it.
        if recently(lease.failed_at, now, RETRY_AFTER_FAILURE_MS) {
            return without_store(lease, policy, cost, now);
        }
        // The store said within a period that the window is full: refuse without asking again.
        let fresh = lease.view_at.is_some_and(|at| now.saturating_since(at) < period_ms);
        if fresh && !spec.window.admits(known, elapsed_ms, cost, spec.limit) {
            if lease.held > 0 {
                // What it holds cannot cover this request and the window has no room for more:
                // it goes back at the root's next tick, for a worker it covers (requests of
                // many units would otherwise stay refused while their units sit split over
                // leases none of which covers one).
                lease.release_held();
                self.next_roll = now;
            }
            return Take::Refused { refusal: Refusal::OverLimit, counts: known };
        }
        lease.waiting = lease.waiting.saturating_add(cost);
        if lease.in_flight {
            return Take::Wait { call: None };
        }
        let want = lease.want(now, period_ms, max_lease);
        Take::Wait { call: Some(lease.ask(key, want, now, timeout_ms)) }
    }

    /// A waiting request whose wait is over (`global.lease_timeout`) is decided without the
    /// store, as `on_store_failure` says.
    pub fn without_store(&mut self, key: FleetKey, spec: LeaseSpec, cost: u32, now: UnixMillis) -> Take {
        let policy = self.policy;
        let lease = self.leases.entry(key).or_insert_with(|| KeyLease::new(spec, now));
        lease.roll(now);
        self.next_roll = self.next_roll.min(lease.bucket_end());
        lease.waiting = lease.waiting.saturating_sub(cost);
        without_store(lease, policy, cost, now)
    }

    /// A call's answer will never come (the stream that sent it ended, and the host cancelled
    /// it): the key may send another. Units it may have been granted stay counted.
    pub fn lost(&mut self, ask: &Ask) {
        if let (Some(lease), true) = (self.leases.get_mut(&ask.key), ask.want > 0) {
            lease.in_flight = false;
        }
    }

    /// The call for the requests waiting on `key`, if they have none on its way.
    pub fn resend(&mut self, key: FleetKey, now: UnixMillis) -> Option<Ask> {
        let (period_ms, max_lease, timeout_ms) = (self.period_ms, self.max_lease, self.lease_timeout_ms);
        let lease = self.leases.get_mut(&key).filter(|l| !l.in_flight && l.waiting > 0)?;
        lease.roll(now);
        self.next_roll = self.next_roll.min(lease.bucket_end());
        let want = lease.want(now, period_ms, max_lease);
        Some(lease.ask(key, want, now, timeout_ms))
    }

    /// A waiting request gave up (its deadline passed, or its client left).
    pub fn abandon(&mut self, key: FleetKey, cost: u32) {
        if let Some(lease) = self.leases.get_mut(&key) {
            lease.waiting = lease.waiting.saturating_sub(cost);
        }
    }

    /// Gives back units taken by [`LeaseBook::take`] for a request another rule refused.
    pub fn untake(&mut self, key: FleetKey, cost: u32, taken_at: UnixMillis) {
        if let Some(lease) = self.leases.get_mut(&key) {
            if lease.spec.window.phase(taken_at).bucket_index == lease.bucket {
                lease.untake(cost);
            }
        }
    }

    /// Gives back `units` of `key` taken at `taken_at` and not used after all (a reservation
    /// settled below its estimate). In the lease's bucket they are the lease's again
    /// ([`LeaseBook::untake`]); in the bucket before, those not reported yet go back as
    /// `returned_previous` and the rest, which the store counts as used, as
    /// `refunded_previous`; older ones no longer weigh and are dropped. A key that left the
    /// book meanwhile comes back for them.
    pub fn refund(&mut self, key: FleetKey, spec: LeaseSpec, units: u32, taken_at: UnixMillis, now: UnixMillis) {
        let taken_in = spec.window.phase(taken_at).bucket_index;
        if units == 0 || taken_in.saturating_add(1) < spec.window.phase(now).bucket_index {
            return;
        }
        if !self.leases.contains_key(&key) && self.leases.len() >= self.max_keys {
            self.evict_one(now);
        }
        let lease = self.leases.entry(key).or_insert_with(|| KeyLease::new(spec, now));
        if lease.spec.window != spec.window {
            return;
        }
        lease.roll(now);
        self.next_roll = self.next_roll.min(lease.bucket_end());
        if taken_in == lease.bucket {
            lease.untake(units);
        } else if taken_in.saturating_add(1) == lease.bucket {
            let unreported = lease.unreported_previous.min(units);
            lease.unreported_previous = lease.unreported_previous.saturating_sub(unreported);
            lease.returned_previous = lease.returned_previous.saturating_add(unreported);
            lease.refunded_previous = lease.refunded_previous.saturating_add(units.saturating_sub(unreported));
        }
    }

    /// Charges `units` of `key` beyond what a request took (a count reported above its
    /// reservation): admitted without a grant, like units admitted while the store was down,
    /// and reported with the key's next call (the store adds them whatever the room).
    pub fn consume(&mut self, key: FleetKey, spec: LeaseSpec, units: u32, now: UnixMillis) {
        if units == 0 {
            return;
        }
        if !self.leases.contains_key(&key) && self.leases.len() >= self.max_keys {
            self.evict_one(now);
        }
        let lease = self.leases.entry(key).or_insert_with(|| KeyLease::new(spec, now));
        lease.roll(now);
        self.next_roll = self.next_roll.min(lease.bucket_end());
        lease.consumed = lease.consumed.saturating_add(units);
        lease.admit(units, now);
    }

    /// The store's answer to `ask` (`None`: the call failed or timed out). The requests
    /// waiting for the key then take again, in the order they came.
    pub fn answered(&mut self, ask: &Ask, grant: Option<Grant>, now: UnixMillis) {
        // A grant of another window's counters (the rule's window changed since) is an orphan.
        let lease = self.leases.get_mut(&ask.key).filter(|l| l.spec.window.length_ms() == ask.window_ms);
        let Some(lease) = lease else {
            if let Some(grant) = grant.filter(|g| g.granted > 0) {
                // The key left the book meanwhile, or its window changed: its grant goes
                // straight back.
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
                    ..*ask
                });
            }
            return;
        };
        if ask.want > 0 {
            lease.in_flight = false;
        }
        let Some(grant) = grant else {
            lease.failed_at = Some(now);
            return;
        };
        lease.failed_at = None;
        lease.roll(now);
        if grant.granted > 0 {
            lease.last_grant = Some((now, grant.granted));
        }
        if ask.bucket == lease.bucket {
            lease.held = lease.held.saturating_add(grant.granted);
            lease.prereported = lease.prereported.saturating_add(grant.granted.min(ask.at_once));
            lease.consumed = lease.consumed.saturating_sub(ask.consumed);
        } else if ask.bucket.saturating_add(1) == lease.bucket {
            lease.returned_previous = lease.returned_previous.saturating_add(grant.granted);
        }
        if ask.bucket >= lease.view_bucket {
            lease.view = grant.counts;
            lease.view_bucket = ask.bucket;
            lease.view_at = Some(now);
        }
    }

    /// Once per heartbeat, and at once when [`LeaseBook::roll_due`]: the give-backs of leases
    /// unused for [`IDLE_PERIODS`] periods or whose bucket ended (with the units used since the
    /// last call: the ended bucket is settled), and of keys dropped from the book, as calls that
    /// ask for nothing. Idle keys with nothing left to report leave the book.
    pub fn heartbeat(&mut self, now: UnixMillis) -> Vec<Ask> {
        let idle_after = self.period_ms.saturating_mul(IDLE_PERIODS);
        let timeout_ms = self.lease_timeout_ms;
        let mut returns = std::mem::take(&mut self.orphan_returns);
        let mut next_roll = UnixMillis(u64::MAX);
        self.leases.retain(|key, lease| {
            lease.roll(now);
            let idle = now.saturating_since(lease.last_used) >= idle_after && !lease.in_flight && lease.waiting == 0;
            if idle {
                lease.release_held();
            }
            let settles = lease.returned > 0
                || lease.returned_previous > 0
                || lease.refunded > 0
                || lease.refunded_previous > 0
                || lease.unreported_previous > 0;
            if settles || (idle && (lease.consumed > 0 || lease.unreported > 0)) {
                returns.push(lease.give_back(*key, now, timeout_ms));
            }
            let keep = !idle || lease.consumed > 0;
            if keep {
                next_roll = next_roll.min(lease.bucket_end());
            }
            keep
        });
        self.next_roll = next_roll;
        returns
    }

    /// Everything held goes back (the configuration is replaced).
    pub fn drain(&mut self, now: UnixMillis) -> Vec<Ask> {
        let mut returns = std::mem::take(&mut self.orphan_returns);
        for (key, mut lease) in self.leases.drain() {
            lease.roll(now);
            returns.extend(lease.close(key, now, self.lease_timeout_ms));
        }
        returns
    }

    /// Drops a key without a call on its way nor requests waiting; what it holds goes back at
    /// the next heartbeat.
    fn evict_one(&mut self, now: UnixMillis) {
        let Some(key) = self.leases.iter().find(|(_, l)| !l.in_flight && l.waiting == 0).map(|(k, _)| *k) else {
            return;
        };
        if let Some(mut lease) = self.leases.remove(&key) {
            self.orphan_returns.extend(lease.close(key, now, self.lease_timeout_ms));
        }
    }
}

/// A decision without the store (module doc, "Store down").
fn without_store(lease: &mut KeyLease, policy: OnStoreFailure, cost: u32, now: UnixMillis) -> Take {
    let known = lease.known();
    let spec = lease.spec;
    let elapsed_ms = spec.window.phase(now).elapsed_ms;
    if lease.held >= cost {
        lease.take_held(cost, now);
        return Take::Admitted { counts: known, held: lease.held, refill: None };
    }
    match policy {
        OnStoreFailure::Refuse => Take::Refused { refusal: Refusal::StoreDown, counts: known },
        OnStoreFailure::LastState if spec.window.admits(known, elapsed_ms, cost, spec.limit) => {
            lease.consumed = lease.consumed.saturating_add(cost);
            lease.admit(cost, now);
            Take::Admitted { counts: lease.known(), held: lease.held, refill: None }
        }
        OnStoreFailure::LastState => Take::Refused { refusal: Refusal::OverLimit, counts: known },
    }
}

fn recently(at: Option<UnixMillis>, now: UnixMillis, within_ms: u64) -> bool {
    at.is_some_and(|at| now.saturating_since(at) < within_ms)
}

#[cfg(test)]
mod tests;
