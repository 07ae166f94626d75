//! The proxy's leases as one worker sees and updates them ([`LeaseBook`]): the keys it follows,
//! its requests waiting for them, and the shared-data records of their leases
//! ([`super::record`], one per key in one of `SEATS_PER_KEY × max_keys` seats), each read,
//! changed by [`super::key::KeyLease`] and written back with a compare-and-swap.
//!
//! Invariants: the module doc of [`super`].

use super::key::KeyLease;
use super::record;
use super::{Ask, Grant, LeaseSpec, Refusal, Take, Terms, Waited, SEATS_PER_KEY, WATCHERS};
use crate::keys::fleet::FleetKey;
use crate::primitives::store::{update_from, Attempt, SharedStore, StoreError, MAX_ATTEMPTS};
use crate::primitives::time::UnixMillis;
use crate::ratelimit::window::{Counts, Window};
use std::collections::HashMap;

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
    /// Where the records are: `<prefix><seat>`, `seats` of them.
    prefix: String,
    seats: u64,
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
    /// A book over the records `<namespace>/lease/<seat>` (`SEATS_PER_KEY × max_keys` of them)
    /// of at most `max_keys` keys, on `terms`.
    pub fn new(namespace: &str, max_keys: usize, terms: Terms) -> LeaseBook {
        let max_keys = max_keys.max(1);
        LeaseBook {
            followed: HashMap::new(),
            max_keys,
            prefix: format!("floodgate/{namespace}/lease/"),
            seats: u64::try_from(max_keys).unwrap_or(u64::MAX).saturating_mul(SEATS_PER_KEY),
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

    /// The shared-data key of `key`'s record: its seat, by a hash of its id.
    pub(super) fn seat(&self, key: FleetKey) -> String {
        let [low, high] = [key.0 % (1u128 << 64), key.0 >> 64].map(|half| u64::try_from(half).unwrap_or(0));
        let folded = crate::primitives::hash::mix64(low ^ high);
        format!("{}{:x}", self.prefix, folded.checked_rem(self.seats).unwrap_or(0))
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
        let name = self.seat(key);
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
                (Take::Refused { refusal: Refusal::StoreDown, counts: Counts::default(), refill: None }, true)
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
            ours.then(|| {
                let watchers = lease.answered(ask, grant, now);
                (watchers, lease.spec, lease.owes())
            })
        });
        if let Ok(Some(Some((watchers, spec, owes)))) = result {
            if grant.is_none() && owes {
                // What the failed call carried and the lease still owes (the units it reported:
                // `KeyLease::report_again`) goes again, at the next heartbeat at the latest.
                self.follow(store, ask.key, spec, now);
            }
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
