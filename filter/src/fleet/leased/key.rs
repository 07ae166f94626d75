//! One key's lease in the proxy, as its shared-data record holds it ([`super::record`]): what
//! the proxy holds of the key's quota, what it owes the store (give-backs, reports, refunds),
//! the call on its way and who waits on it, and the key's rate, which sizes the next ask. A pure
//! state machine: every change is a method that takes `now`; [`super::LeaseBook`] reads the
//! record, applies one, and writes it back with a compare-and-swap.
//!
//! Invariants: the module doc of [`super`].

use super::{grace_ms, Ask, Grant, LeaseSpec, Refusal, Take, Terms, Waited, HOLD_MAX_MS, HORIZON_GAPS, IDLE_PERIODS, RATIONED_MIN_UNITS, RETRY_AFTER_FAILURE_MS, WATCHERS};
use crate::keys::fleet::FleetKey;
use crate::config::OnStoreFailure;
use crate::primitives::time::UnixMillis;
use crate::ratelimit::window::{Counts, Window};

/// The call of a key that is on its way, as its record names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CallMark {
    /// The call's id ([`Ask::call`]).
    pub(super) id: u64,
    /// The worker that sent it.
    pub(super) owner: u64,
    /// When its answer is overdue (its timeout and a `lease_timeout` more): its sender is
    /// gone, another may ask.
    pub(super) deadline: UnixMillis,
}

/// One key's lease in the proxy (its shared-data record, [`super::record`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct KeyLease {
    pub(super) spec: LeaseSpec,
    /// The bucket `held` belongs to.
    pub(super) bucket: u64,
    /// Units granted and not used yet.
    pub(super) held: u32,
    /// Units of `bucket` admitted without a grant (the store was down), not yet reported.
    pub(super) consumed: u32,
    /// Unused units of `bucket` and of the bucket before, to give back.
    pub(super) returned: u32,
    pub(super) returned_previous: u32,
    /// Units of `bucket`'s grants (and of the bucket before's) admitted since the last call.
    pub(super) unreported: u32,
    pub(super) unreported_previous: u32,
    /// Units held that the store counts as used already (granted `at_once` to waiting
    /// requests, or given back by a settled reservation after they were reported): when they
    /// go back unused, they go as `refunded`, not `returned`.
    pub(super) prereported: u32,
    /// Units the store counts as used in `bucket` and in the bucket before that were not used
    /// after all, to give back.
    pub(super) refunded: u32,
    pub(super) refunded_previous: u32,
    /// The store's counts as of `view_bucket`, from its last answer (and when).
    pub(super) view: Counts,
    pub(super) view_bucket: u64,
    pub(super) view_at: Option<UnixMillis>,
    /// The call asking for units that is on its way.
    pub(super) call: Option<CallMark>,
    /// The workers with requests waiting on it, other than its sender (0: none), told of its
    /// answer.
    pub(super) watchers: [u64; WATCHERS],
    /// Units of the proxy's requests waiting for the key, as of `waiting_at` (a count left by
    /// a worker that stopped is forgotten once no request can still be waiting).
    pub(super) waiting: u32,
    pub(super) waiting_at: UnixMillis,
    /// The last call failed at that time.
    pub(super) failed_at: Option<UnixMillis>,
    /// Units used since `rate_since`, and the average rate in units per 1000 s.
    pub(super) used: u32,
    pub(super) rate_since: UnixMillis,
    pub(super) rate_per_ks: u64,
    /// When the last grant of at least one unit came, and its size.
    pub(super) last_grant: Option<(UnixMillis, u32)>,
    pub(super) last_used: UnixMillis,
    /// Units the proxy took of the key in `bucket` and in the bucket before (its share of the
    /// window, [`KeyLease::rationed`]).
    pub(super) taken: u32,
    pub(super) taken_previous: u32,
    /// When the store's last answer left the window no room (the key's window is at its limit,
    /// its room shared out a unit or a few at a time as it frees); `None` once an answer in the
    /// bucket leaves room for four such asks.
    pub(super) rationed_at: Option<UnixMillis>,
}


impl KeyLease {
    pub(super) fn new(spec: LeaseSpec, now: UnixMillis) -> KeyLease {
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
            taken: 0,
            taken_previous: 0,
            rationed_at: None,
        }
    }

    /// Moves to `now`'s bucket: what is held goes back to the bucket it belongs to. Units
    /// admitted without the store in a bucket that ended are not reported (the store only
    /// takes them in the current bucket): after an outage, the previous bucket weighs a little
    /// less than it should.
    pub(super) fn roll(&mut self, now: UnixMillis) {
        let bucket = self.spec.window.phase(now).bucket_index;
        if bucket <= self.bucket {
            return;
        }
        let next = bucket == self.bucket.saturating_add(1);
        self.release_held();
        self.returned_previous = if next { self.returned } else { 0 };
        self.refunded_previous = if next { self.refunded } else { 0 };
        self.unreported_previous = if next { self.unreported } else { 0 };
        self.taken_previous = if next { self.taken } else { 0 };
        self.taken = 0;
        self.returned = 0;
        self.refunded = 0;
        self.unreported = 0;
        self.consumed = 0;
        self.bucket = bucket;
    }

    /// Everything held goes back: what the store counts as used already as `refunded`, the
    /// rest as `returned`.
    pub(super) fn release_held(&mut self) {
        let prereported = self.prereported.min(self.held);
        self.refunded = self.refunded.saturating_add(prereported);
        self.returned = self.returned.saturating_add(self.held.saturating_sub(prereported));
        self.held = 0;
        self.prereported = 0;
    }

    /// The fleet's counts as known now: the store's last view, moved to the current bucket,
    /// plus what the proxy admitted without the store.
    pub(super) fn known(&self) -> Counts {
        self.view.rolled(self.view_bucket, self.bucket).plus(self.consumed)
    }

    /// Whether a call of the key is on its way and not past its timeout.
    pub(super) fn calling(&self, now: UnixMillis) -> bool {
        self.call.is_some_and(|c| now < c.deadline)
    }

    /// Whether the key is rationed ([`KeyLease::rationed_at`], in this bucket or the one
    /// before: a window later the sliding estimate no longer holds any of what made it so) on
    /// a proxy that took at least [`RATIONED_MIN_UNITS`] of its units over the sliding window.
    /// A rationed key's requests never wait for the store: those the lease cannot cover are
    /// refused at once, and the proxy asks for its next units in the background, whose answer
    /// says whether the key is still rationed.
    pub(super) fn rationed(&self, now: UnixMillis) -> bool {
        let window = self.spec.window;
        let phase = window.phase(now);
        let mine = if phase.bucket_index == self.bucket { Counts { previous: self.taken_previous, current: self.taken } } else { Counts::default() };
        window.estimate(mine, phase.elapsed_ms) >= f64::from(RATIONED_MIN_UNITS)
            && self.rationed_at.is_some_and(|at| window.phase(at).bucket_index.saturating_add(1) >= phase.bucket_index)
    }

    /// The mean gap between the key's requests, ms, once its rate is known.
    pub(super) fn gap_ms(&self) -> Option<u64> {
        1_000_000u64.checked_div(self.rate_per_ks)
    }

    /// The stretch of the key's traffic a lease covers: a period, or for a key whose requests
    /// come further apart than a period over [`HORIZON_GAPS`], that many of its gaps (at most
    /// [`HOLD_MAX_MS`]).
    pub(super) fn horizon_ms(&self, period_ms: u64) -> u64 {
        self.gap_ms().map_or(period_ms, |gap| gap.saturating_mul(HORIZON_GAPS).min(HOLD_MAX_MS).max(period_ms))
    }

    /// Units of the proxy's requests waiting for the key.
    pub(super) fn waiting(&self, now: UnixMillis, terms: &Terms) -> u32 {
        let live = now.saturating_since(self.waiting_at) < terms.lease_timeout_ms.saturating_add(terms.call_timeout_ms);
        if live {
            self.waiting
        } else {
            0
        }
    }

    pub(super) fn set_waiting(&mut self, units: u32, now: UnixMillis) {
        self.waiting = units;
        self.waiting_at = now;
    }

    /// Whether the lease is to be refilled, `want` being what a call would ask: below half of
    /// it; a slow key's (its horizon longer than a period), once empty (the refill comes long
    /// before its next request).
    pub(super) fn low(&self, want: u32, period_ms: u64) -> bool {
        if self.horizon_ms(period_ms) > period_ms {
            self.held == 0
        } else {
            self.held.saturating_mul(2) < want
        }
    }

    /// How long an unused lease is kept: two periods, or its horizon if longer.
    pub(super) fn hold_ms(&self, period_ms: u64) -> u64 {
        period_ms.saturating_mul(IDLE_PERIODS).max(self.horizon_ms(period_ms))
    }

    /// Units to ask for: about the proxy's traffic of the key over its horizon
    /// ([`KeyLease::horizon_ms`]), twice the last grant when the key used more than that grant
    /// within half a period of it (a key heating up faster than the average follows; a key
    /// seen once does not), and at least what the requests waiting for it need (`waiting`).
    pub(super) fn want(&self, now: UnixMillis, terms: &Terms, waiting: u32) -> u32 {
        let per_horizon = u128::from(self.rate_per_ks).saturating_mul(u128::from(self.horizon_ms(terms.period_ms))).div_ceil(1_000_000);
        let per_horizon = u32::try_from(per_horizon).unwrap_or(u32::MAX);
        let growing = self
            .last_grant
            .filter(|(at, granted)| now.saturating_since(*at) < terms.period_ms / 2 && self.used > *granted)
            .map_or(0, |(_, granted)| granted.saturating_mul(2));
        per_horizon.max(growing).min(terms.max_lease).max(waiting).max(1).min(self.spec.limit.get().max(waiting))
    }

    /// A call that asks for nothing: it gives back and reports, in the lease's bucket.
    pub(super) fn give_back(&mut self, key: FleetKey, now: UnixMillis, terms: &Terms) -> Ask {
        let phase = self.spec.window.phase(now);
        let elapsed_ms = if phase.bucket_index == self.bucket { phase.elapsed_ms } else { 0 };
        self.call_in(key, self.bucket, elapsed_ms, 0, terms)
    }

    /// The call `id` for `want` ≥ 1 units, of which the requests waiting for it (`waiting`
    /// units) take theirs at once, with the give-backs, which go once; it fails after
    /// `timeout_ms`. Consumed units are forgotten when the store's answer confirms them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn ask(&mut self, key: FleetKey, want: u32, waiting: u32, id: u64, timeout_ms: u64, now: UnixMillis, terms: &Terms) -> Ask {
        let phase = self.spec.window.phase(now);
        // The host reports its failure at `timeout_ms`; past that and a `lease_timeout` more,
        // its sender is gone and another may ask.
        let deadline = UnixMillis(now.0.saturating_add(timeout_ms).saturating_add(terms.lease_timeout_ms));
        self.call = Some(CallMark { id, owner: terms.caller, deadline });
        let at_once = waiting.min(want);
        Ask { at_once, call: id, ..self.call_in(key, phase.bucket_index, phase.elapsed_ms, want, terms) }
    }

    /// A call in `bucket`: the give-backs and the reports go with it, once.
    pub(super) fn call_in(&mut self, key: FleetKey, bucket: u64, elapsed_ms: u64, want: u32, terms: &Terms) -> Ask {
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
    pub(super) fn close(&mut self, key: FleetKey, now: UnixMillis, terms: &Terms) -> Option<Ask> {
        self.roll(now);
        self.release_held();
        self.owes().then(|| self.give_back(key, now, terms))
    }

    /// The units a failed call reported as used go with the next call again: the store may not
    /// have seen the report, and what it believes a holder still has outstanding comes off the
    /// counter once the bucket's grace passed, used units too, had the holder died. Reported
    /// twice, they only lower what the store believes outstanding (the holder's give-backs are
    /// then taken up to that only): the safe side. Give-backs are not sent again: the store may
    /// have taken them already.
    fn report_again(&mut self, ask: &Ask, now: UnixMillis) {
        self.roll(now);
        if ask.bucket == self.bucket {
            self.unreported = self.unreported.saturating_add(ask.used);
            self.unreported_previous = self.unreported_previous.saturating_add(ask.used_previous);
        } else if ask.bucket.saturating_add(1) == self.bucket {
            self.unreported_previous = self.unreported_previous.saturating_add(ask.used);
        }
    }

    /// Whether there is anything to give back or report.
    pub(super) fn owes(&self) -> bool {
        self.settles() || self.consumed > 0 || self.unreported > 0
    }

    /// Whether there is anything to give back, or a report of an ended bucket to send.
    pub(super) fn settles(&self) -> bool {
        self.returned > 0 || self.returned_previous > 0 || self.refunded > 0 || self.refunded_previous > 0 || self.unreported_previous > 0
    }

    /// Updates the rate: an average over the periods since the last update (at most one
    /// update per period).
    pub(super) fn note_rate(&mut self, now: UnixMillis, period_ms: u64) {
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
    pub(super) fn untake(&mut self, cost: u32) {
        self.held = self.held.saturating_add(cost);
        self.used = self.used.saturating_sub(cost);
        self.taken = self.taken.saturating_sub(cost);
        let back = self.unreported.min(cost);
        self.unreported = self.unreported.saturating_sub(back);
        self.prereported = self.prereported.saturating_add(cost.saturating_sub(back));
    }

    pub(super) fn admit(&mut self, cost: u32, now: UnixMillis) {
        self.used = self.used.saturating_add(cost);
        self.taken = self.taken.saturating_add(cost);
        self.last_used = now;
    }

    /// Takes `cost` units of the lease held (those the store counts as used already first).
    pub(super) fn take_held(&mut self, cost: u32, now: UnixMillis) {
        self.held = self.held.saturating_sub(cost);
        let prereported = self.prereported.min(cost);
        self.prereported = self.prereported.saturating_sub(prereported);
        self.unreported = self.unreported.saturating_add(cost.saturating_sub(prereported));
        self.admit(cost, now);
    }

    /// Takes `cost` units for a request (module doc); `id`: the id of the call to send, if one
    /// goes. A request that waited stops waiting first; one that waits (again) is counted.
    /// Also says whether it was decided without the store (as `on_store_failure` says).
    pub(super) fn take(&mut self, key: FleetKey, cost: u32, waited: Waited, id: u64, now: UnixMillis, terms: &Terms) -> (Take, bool) {
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
    pub(super) fn take_units(&mut self, key: FleetKey, cost: u32, waited: Waited, others: u32, id: u64, now: UnixMillis, terms: &Terms) -> (Take, bool) {
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
            return (Take::Refused { refusal: Refusal::OverLimit, counts: known, refill: None }, false);
        }
        let needed = cost.saturating_sub(self.held);
        if self.rationed(now) {
            // The fleet's proxies share the window's room a unit or a few at a time: a request
            // that waited for a call would mostly wait to be refused. It is refused at once, and
            // the proxy asks for the units of one request like it in the background (no more:
            // units held wait for the key's next request, and the fleet's other proxies could
            // have used them meanwhile), if the last counts leave room for them (they are a
            // floor: other proxies only add to them), or once they are a period old (units
            // given back may have made room).
            let worth_asking = !fresh || spec.window.admits(known, elapsed_ms, needed, spec.limit);
            let refill = (worth_asking && !self.calling(now)).then(|| self.ask(key, needed, 0, id, terms.call_timeout_ms, now, terms));
            let counts = full(spec.window, known, elapsed_ms, spec.limit);
            return (Take::Refused { refusal: Refusal::OverLimit, counts, refill }, false);
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
    pub(super) fn without_store(&mut self, policy: OnStoreFailure, cost: u32, now: UnixMillis) -> Take {
        let known = self.known();
        let spec = self.spec;
        let elapsed_ms = spec.window.phase(now).elapsed_ms;
        if self.held >= cost {
            self.take_held(cost, now);
            return Take::Admitted { counts: known, held: self.held, refill: None };
        }
        match policy {
            OnStoreFailure::Refuse => Take::Refused { refusal: Refusal::StoreDown, counts: known, refill: None },
            OnStoreFailure::LastState if spec.window.admits(known, elapsed_ms, cost, spec.limit) => {
                self.consumed = self.consumed.saturating_add(cost);
                self.admit(cost, now);
                Take::Admitted { counts: self.known(), held: self.held, refill: None }
            }
            OnStoreFailure::LastState => Take::Refused { refusal: Refusal::OverLimit, counts: known, refill: None },
        }
    }

    /// Names `worker` among those told of the answer of the call on its way (if there is room).
    pub(super) fn watch(&mut self, worker: u64) {
        if !self.watchers.contains(&worker) {
            if let Some(free) = self.watchers.iter_mut().find(|w| **w == 0) {
                *free = worker;
            }
        }
    }

    /// The call on its way is over: the workers to tell.
    pub(super) fn call_ended(&mut self) -> [u64; WATCHERS] {
        self.call = None;
        std::mem::take(&mut self.watchers)
    }

    /// The store's answer to `ask` (`None`: the call failed or timed out); returns the
    /// workers to tell of it.
    pub(super) fn answered(&mut self, ask: &Ask, grant: Option<Grant>, now: UnixMillis) -> [u64; WATCHERS] {
        let standing = ask.call != 0 && self.call.is_some_and(|c| c.id == ask.call);
        let watchers = if standing { self.call_ended() } else { [0; WATCHERS] };
        let Some(grant) = grant else {
            // A failure counts when it was the call the key waits on (or none is on its way).
            if ask.want > 0 && (standing || !self.calling(now)) {
                self.failed_at = Some(now);
            }
            self.report_again(ask, now);
            return watchers;
        };
        self.failed_at = None;
        self.roll(now);
        if grant.granted > 0 {
            self.last_grant = Some((now, grant.granted));
        }
        // Rationed from an answer that left the window no room at all, until one leaves room
        // for four such asks (the store would grant them whole); in between, a rationed key
        // stays so. (A grant short of a large ask while room is left is the quarter-of-the-room
        // rule: the requests waiting for it get the rest from the next calls.)
        let phase = self.spec.window.phase(now);
        if ask.want > 0 && ask.bucket == phase.bucket_index {
            let room = self.spec.window.remaining(grant.counts, phase.elapsed_ms, self.spec.limit);
            if room == 0 || (self.rationed_at.is_some() && room < u64::from(ask.want).saturating_mul(4)) {
                self.rationed_at = Some(now);
            } else {
                self.rationed_at = None;
            }
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

/// `counts` with the current bucket filled to the limit: a rationed refusal's counts, so that its
/// `RateLimit` fields say no unit is left and `Retry-After` when the window frees one.
fn full(window: Window, counts: Counts, elapsed_ms: u64, limit: std::num::NonZeroU32) -> Counts {
    let room = u32::try_from(window.remaining(counts, elapsed_ms, limit)).unwrap_or(u32::MAX);
    counts.plus(room)
}

pub(super) fn recently(at: Option<UnixMillis>, now: UnixMillis, within_ms: u64) -> bool {
    at.is_some_and(|at| now.saturating_since(at) < within_ms)
}
