#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic, clippy::cast_possible_truncation)]

use super::*;
use crate::primitives::store::{MemoryStore, SharedStore};
use crate::primitives::time::UnixMillis;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::num::NonZeroU64;
use std::rc::Rc;

const KEY: FleetKey = FleetKey(7);
const PERIOD_MS: u64 = 100;

fn spec(window_ms: u64, limit: u32) -> LeaseSpec {
    LeaseSpec { window: Window::new(NonZeroU64::new(window_ms).unwrap()), limit: NonZeroU32::new(limit).unwrap() }
}

const LEASE_TIMEOUT_MS: u64 = 50;

/// The longest a call takes (the root's calls' timeout).
const CALL_TIMEOUT_MS: u64 = 1_000;

/// A worker: its book over its proxy's shared data, called as the leased stage calls it.
struct Worker {
    book: LeaseBook,
    shared: Rc<MemoryStore>,
}

impl Worker {
    /// A worker of a proxy of its own.
    fn with(max_keys: usize, policy: OnStoreFailure, max_lease: u32) -> Worker {
        Worker::of(Rc::new(MemoryStore::new()), max_keys, policy, max_lease, 1)
    }

    /// Worker `caller` of the proxy whose shared data is `shared`.
    fn of(shared: Rc<MemoryStore>, max_keys: usize, policy: OnStoreFailure, max_lease: u32, caller: u64) -> Worker {
        let terms = Terms { period_ms: PERIOD_MS, policy, max_lease, lease_timeout_ms: LEASE_TIMEOUT_MS, call_timeout_ms: CALL_TIMEOUT_MS, caller };
        let book = LeaseBook::new("test", max_keys, terms);
        Worker { book, shared }
    }

    /// Takes for a new request, or (`waited`) for one that waited within `lease_timeout`.
    fn take(&mut self, key: FleetKey, spec: LeaseSpec, cost: u32, waited: bool, now: UnixMillis) -> Take {
        self.take_after(key, spec, cost, if waited { Waited::Within } else { Waited::No }, now)
    }

    fn take_after(&mut self, key: FleetKey, spec: LeaseSpec, cost: u32, waited: Waited, now: UnixMillis) -> Take {
        self.book.take(&*self.shared, key, spec, cost, waited, now).0
    }

    fn answered(&mut self, ask: &Ask, grant: Option<Grant>, now: UnixMillis) {
        self.book.answered(&*self.shared, ask, grant, now);
    }

    fn heartbeat(&mut self, now: UnixMillis) -> Vec<Ask> {
        self.book.heartbeat(&*self.shared, now)
    }

    fn refund(&mut self, key: FleetKey, spec: LeaseSpec, units: u32, taken_at: UnixMillis, now: UnixMillis) {
        self.book.refund(&*self.shared, key, spec, units, taken_at, now);
    }

    fn roll_due(&self, now: UnixMillis) -> bool {
        self.book.roll_due(now)
    }

    fn keys(&self) -> usize {
        self.book.keys()
    }

    /// Units the proxy holds of `key`, as its record says.
    fn held_of(&self, key: FleetKey) -> u64 {
        let stored = self.shared.get(&self.book.seat(key)).unwrap();
        stored.and_then(|s| record::decode(&s.value).ok()).filter(|(k, _)| *k == key).map_or(0, |(_, lease)| u64::from(lease.held))
    }

    /// Units the proxy holds of [`KEY`].
    fn held(&self) -> u64 {
        self.held_of(KEY)
    }
}

fn book() -> Worker {
    Worker::with(1000, OnStoreFailure::LastState, u32::MAX)
}

/// The store as `sync/src/lease.lua` is: a counter per (key, window, bucket) of the units
/// granted and not given back; grants of at most a quarter of the sliding window's room; each
/// holder's outstanding units per bucket, and those of the previous bucket taken back once its
/// grace passed.
#[derive(Default)]
struct FakeStore {
    counters: HashMap<(FleetKey, u64, u64), u64>,
    holders: HashMap<(FleetKey, u64, u64), HashMap<u64, u64>>,
}

impl FakeStore {
    fn get(&self, key: FleetKey, window_ms: u64, bucket: u64) -> u64 {
        self.counters.get(&(key, window_ms, bucket)).copied().unwrap_or(0)
    }

    fn serve(&mut self, ask: &Ask) -> Grant {
        self.serve_as(1, ask)
    }

    /// `lease.lua`'s give-back of `holder`: at most what it has outstanding in the bucket.
    fn give_back(&mut self, holder: u64, counter: (FleetKey, u64, u64), value: u64, returned: u32, used: u32) -> u64 {
        let holders = self.holders.entry(counter).or_default();
        let outstanding = holders.get(&holder).copied().unwrap_or(0);
        if outstanding == 0 || returned + used == 0 {
            return value;
        }
        let back = u64::from(returned).min(outstanding).min(value);
        let left = outstanding.saturating_sub(u64::from(returned) + u64::from(used));
        if left == 0 {
            holders.remove(&holder);
        } else {
            holders.insert(holder, left);
        }
        value - back
    }

    fn serve_as(&mut self, holder: u64, ask: &Ask) -> Grant {
        let (w, b) = (ask.window_ms, ask.bucket);
        let mut current = self.get(ask.key, w, b) + u64::from(ask.consumed);
        let mut previous = if b > 0 { self.get(ask.key, w, b - 1) } else { 0 };
        if b > 0 {
            let counter = (ask.key, w, b - 1);
            previous = self.give_back(holder, counter, previous, ask.returned_previous, ask.used_previous);
            previous -= previous.min(u64::from(ask.refunded_previous));
            if ask.grace_ms > 0 && ask.elapsed_ms >= ask.grace_ms && previous > 0 {
                let stranded: u64 = self.holders.remove(&counter).unwrap_or_default().values().sum();
                previous -= previous.min(stranded);
            }
        }
        current = self.give_back(holder, (ask.key, w, b), current, ask.returned, ask.used);
        current -= current.min(u64::from(ask.refunded));
        let mut granted = 0;
        if ask.want > 0 {
            let weighted = (u128::from(previous) * u128::from(w - ask.elapsed_ms)).div_ceil(u128::from(w)) as u64;
            let room = u64::from(ask.limit).saturating_sub(weighted).saturating_sub(current);
            if room > 0 {
                granted = u64::from(ask.want).min((room / 4).max(1));
                current += granted;
                let outstanding = granted - granted.min(u64::from(ask.at_once));
                if outstanding > 0 {
                    *self.holders.entry((ask.key, w, b)).or_default().entry(holder).or_default() += outstanding;
                }
            }
        }
        self.counters.insert((ask.key, w, b), current);
        if b > 0 {
            self.counters.insert((ask.key, w, b - 1), previous);
        }
        Grant {
            granted: granted as u32,
            counts: Counts { previous: previous as u32, current: current as u32 },
        }
    }
}

/// A take whose background refill (if any) the store answers at once.
fn refilled(book: &mut Worker, store: &mut FakeStore, take: Take, now: UnixMillis) -> Take {
    if let Take::Admitted { refill: Some(ask), .. } = take {
        book.answered(&ask, Some(store.serve(&ask)), now);
    }
    take
}

/// The call a take sends, whatever its outcome: a refill, the call it waits on, a rationed
/// refusal's background call.
fn outgoing(take: Take) -> Option<Ask> {
    match take {
        Take::Admitted { refill, .. } | Take::Refused { refill, .. } => refill,
        Take::Wait { call } => call,
    }
}

/// `book` (of `holder`) takes a lease of 100 units of `KEY` at `at`, its first unit to the
/// request that waited for it, and 29 more for requests.
fn lease_100_use_30(book: &mut Worker, store: &mut FakeStore, holder: u64, s: LeaseSpec, at: UnixMillis) {
    let ask = Ask { want: 100, ..wait_call(book.take(KEY, s, 1, false, at)).unwrap() };
    book.answered(&ask, Some(store.serve_as(holder, &ask)), at);
    for _ in 0..30 {
        assert!(matches!(book.take(KEY, s, 1, true, at), Take::Admitted { refill: None, .. }));
    }
}

fn wait_call(take: Take) -> Option<Ask> {
    match take {
        Take::Wait { call } => call,
        other => panic!("expected a wait, got {other:?}"),
    }
}

#[test]
fn a_cold_key_waits_for_one_unit_and_waiters_share_the_call() {
    let mut book = book();
    let mut store = FakeStore::default();
    let s = spec(60_000, 100);
    let now = UnixMillis(60_000 * 1000 + 10);
    let ask = wait_call(book.take(KEY, s, 1, false, now)).expect("the first miss sends the call");
    assert_eq!((ask.want, ask.bucket, ask.elapsed_ms, ask.limit), (1, 1000, 10, 100));
    // Two more requests while it is on its way: they wait for the same answer.
    assert_eq!(wait_call(book.take(KEY, s, 1, false, now)), None);
    assert_eq!(wait_call(book.take(KEY, s, 1, false, now)), None);
    let grant = store.serve(&ask);
    assert_eq!(grant.granted, 1);
    book.answered(&ask, Some(grant), now);
    // In order: the first gets the unit, and its lease being empty, asks for what the two
    // others still need (twice the last grant); they wait for that call.
    let Take::Admitted { held: 0, refill: Some(again), .. } = book.take(KEY, s, 1, true, now) else {
        panic!("admitted, with a refill");
    };
    assert_eq!(again.want, 2, "the units of both requests still waiting");
    assert_eq!(wait_call(book.take(KEY, s, 1, true, now)), None);
    assert_eq!(wait_call(book.take(KEY, s, 1, true, now)), None);
    book.answered(&again, Some(store.serve(&again)), now);
    assert!(matches!(book.take(KEY, s, 1, true, now), Take::Admitted { .. }));
    assert!(matches!(book.take(KEY, s, 1, true, now), Take::Admitted { held: 0, .. }));
    assert_eq!(store.get(KEY, 60_000, 1000), 3);
}

#[test]
fn a_hot_key_gets_leases_of_about_one_period_and_rarely_waits() {
    let mut book = book();
    let mut store = FakeStore::default();
    let s = spec(60_000, 1_000_000);
    let start = 60_000 * 1000;
    let (mut waited, mut calls, mut largest) = (0, 0, 0);
    // 1 000 requests a second for 2 s; every call is answered 1 ms later.
    let mut pending: VecDeque<(u64, Ask)> = VecDeque::new();
    let mut waiting = 0;
    for t in 0..2000u64 {
        let now = UnixMillis(start + t);
        while pending.front().is_some_and(|(at, _)| *at <= t) {
            let (_, ask) = pending.pop_front().unwrap();
            book.answered(&ask, Some(store.serve(&ask)), now);
        }
        let mut sent = |call: Option<Ask>, pending: &mut VecDeque<(u64, Ask)>| {
            if let Some(ask) = call {
                calls += 1;
                largest = largest.max(ask.want);
                pending.push_back((t + 1, ask));
            }
        };
        for _ in 0..std::mem::take(&mut waiting) {
            match book.take(KEY, s, 1, true, now) {
                Take::Admitted { refill, .. } => sent(refill, &mut pending),
                other => panic!("a waiting request is served by the answer: {other:?}"),
            }
        }
        match book.take(KEY, s, 1, false, now) {
            Take::Admitted { refill, .. } => sent(refill, &mut pending),
            Take::Wait { call } => {
                waited += 1;
                waiting += 1;
                sent(call, &mut pending);
            }
            Take::Refused { .. } => panic!("far from the limit"),
        }
    }
    println!("2 000 requests: {waited} waited, {calls} calls, largest lease {largest}");
    assert!(waited <= 10, "{waited} requests waited");
    assert!(calls <= 60, "{calls} calls");
    // About one period of traffic, up to twice that while the lease doubles as the key heats.
    assert!((80..=256).contains(&largest), "a lease of one to two periods of traffic: {largest}");
}

#[test]
fn a_full_window_refuses_without_asking_again_within_a_period() {
    let mut book = book();
    let mut store = FakeStore::default();
    let s = spec(60_000, 3);
    let now = UnixMillis(60_000 * 1000);
    let mut admitted = 0;
    let mut calls = 0;
    for _ in 0..10 {
        match book.take(KEY, s, 1, false, now) {
            Take::Admitted { refill, .. } => {
                admitted += 1;
                if let Some(ask) = refill {
                    calls += 1;
                    book.answered(&ask, Some(store.serve(&ask)), now);
                }
            }
            Take::Wait { call: Some(ask) } => {
                calls += 1;
                book.answered(&ask, Some(store.serve(&ask)), now);
                match book.take(KEY, s, 1, true, now) {
                    Take::Admitted { refill, .. } => {
                        admitted += 1;
                        if let Some(ask) = refill {
                            calls += 1;
                            book.answered(&ask, Some(store.serve(&ask)), now);
                        }
                    }
                    Take::Refused { refusal, counts, .. } => {
                        assert_eq!((refusal, counts), (Refusal::OverLimit, Counts { previous: 0, current: 3 }));
                    }
                    other => panic!("{other:?}"),
                }
            }
            Take::Refused { refusal, .. } => assert_eq!(refusal, Refusal::OverLimit),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(admitted, 3);
    assert_eq!(calls, 3, "three grants of one unit (a quarter of a small room), then no call while the view is a period old at most");
    // A period later it asks again (the window may have room by then). The proxy took too few
    // units for the key to be rationed on it: the request waits for the call.
    assert!(matches!(book.take(KEY, s, 1, false, now.plus_ms(PERIOD_MS)), Take::Wait { call: Some(_) }));
}

#[test]
fn units_left_at_the_end_of_a_bucket_or_idle_go_back_once() {
    let mut book = book();
    let mut store = FakeStore::default();
    let s = spec(1_000, 1000);
    let t0 = UnixMillis(1_000 * 500 + 900);
    let ask = wait_call(book.take(KEY, s, 1, false, t0)).unwrap();
    // Pretend a larger want (a hot key): 20 units.
    let ask = Ask { want: 20, ..ask };
    book.answered(&ask, Some(store.serve(&ask)), t0);
    let take = book.take(KEY, s, 1, true, t0);
    refilled(&mut book, &mut store, take, t0);
    let held = book.held();
    assert!(held >= 19);
    assert_eq!(store.get(KEY, 1_000, 500), held + 1, "the store counts what is held and the unit used");
    // The next bucket: what is held goes back to bucket 500 with the next call.
    let t1 = UnixMillis(1_000 * 501 + 10);
    let ask = wait_call(book.take(KEY, s, 1, false, t1)).unwrap();
    assert_eq!((ask.bucket, ask.returned, u64::from(ask.returned_previous)), (501, 0, held));
    book.answered(&ask, Some(store.serve(&ask)), t1);
    assert_eq!(store.get(KEY, 1_000, 500), 1, "only the used unit stays counted");
    let take = book.take(KEY, s, 1, true, t1);
    assert!(matches!(refilled(&mut book, &mut store, take, t1), Take::Admitted { .. }));
    // Unused for longer than two periods and its horizon (four of its gaps, which its rate says
    // are 220 ms): what is held goes back at the heartbeat, once.
    let held = book.held();
    assert_eq!(store.get(KEY, 1_000, 501), held + 1);
    assert!(book.heartbeat(t1.plus_ms(2 * PERIOD_MS)).is_empty(), "not yet: its horizon is longer");
    let returns = book.heartbeat(t1.plus_ms(9 * PERIOD_MS));
    assert_eq!(returns.iter().map(|a| u64::from(a.returned)).sum::<u64>(), held);
    for ask in &returns {
        book.answered(ask, Some(store.serve(ask)), t1.plus_ms(9 * PERIOD_MS));
    }
    assert_eq!(store.get(KEY, 1_000, 501), 1, "only the used unit stays counted");
    assert_eq!(book.keys(), 0, "an idle key with nothing to report leaves the book");
    assert!(book.heartbeat(t1.plus_ms(9 * PERIOD_MS + 10)).is_empty());
}

#[test]
fn a_store_failure_decides_on_the_last_state_and_reports_it_later() {
    let mut store = FakeStore::default();
    let s = spec(60_000, 10);
    let now = UnixMillis(60_000 * 1000);
    for policy in [OnStoreFailure::LastState, OnStoreFailure::Refuse] {
        let mut book = Worker::with(1000, policy, u32::MAX);
        let key = FleetKey(policy as u128 + 100);
        let ask = wait_call(book.take(key, s, 1, false, now)).unwrap();
        let ask = Ask { want: 4, ..ask };
        book.answered(&ask, Some(store.serve(&ask)), now);
        // 2 units (a quarter of the room), used; the next call fails.
        let mut admitted = 0;
        let failing = loop {
            match book.take(key, s, 1, admitted == 0, now) {
                Take::Admitted { refill: None, .. } => admitted += 1,
                Take::Admitted { refill: Some(ask), .. } => {
                    admitted += 1;
                    break ask;
                }
                Take::Wait { call: Some(ask) } => break ask,
                other => panic!("{other:?}"),
            }
        };
        while admitted < 2 {
            assert!(matches!(book.take(key, s, 1, false, now), Take::Admitted { .. }));
            admitted += 1;
        }
        assert_eq!(wait_call(book.take(key, s, 1, false, now)), None, "waits for the call on its way");
        book.answered(&failing, None, now.plus_ms(50));
        let later = now.plus_ms(60);
        match policy {
            OnStoreFailure::LastState => {
                // The last state (2 of 10) plus what is admitted meanwhile: 8 more, then none.
                assert!(matches!(book.take(key, s, 1, true, later), Take::Admitted { .. }));
                for _ in 0..7 {
                    assert!(matches!(book.take(key, s, 1, false, later), Take::Admitted { .. }));
                }
                assert!(matches!(book.take(key, s, 1, false, later), Take::Refused { refusal: Refusal::OverLimit, .. }));
                // A second later it asks the store again, reporting the 8.
                let back = now.plus_ms(50 + RETRY_AFTER_FAILURE_MS);
                let ask = wait_call(book.take(key, s, 1, false, back)).unwrap();
                assert_eq!(ask.consumed, 8);
                let grant = store.serve(&ask);
                assert_eq!(grant, Grant { granted: 0, counts: Counts { previous: 0, current: 10 } });
                book.answered(&ask, Some(grant), back);
                assert!(matches!(book.take(key, s, 1, true, back), Take::Refused { refusal: Refusal::OverLimit, .. }));
                // Nothing reported twice (the key is rationed: its next call goes in the
                // background, the request refused at once).
                let Take::Refused { refill: Some(ask), .. } = book.take(key, s, 1, false, back.plus_ms(PERIOD_MS)) else {
                    panic!("refused, with a call in the background");
                };
                assert_eq!(ask.consumed, 0);
            }
            OnStoreFailure::Refuse => {
                assert!(matches!(book.take(key, s, 1, true, later), Take::Refused { refusal: Refusal::StoreDown, .. }));
                let back = now.plus_ms(50 + RETRY_AFTER_FAILURE_MS);
                assert!(matches!(book.take(key, s, 1, false, back), Take::Wait { call: Some(_) }));
            }
        }
    }
}

#[test]
fn a_full_book_closes_a_lease_and_gives_its_units_back() {
    // Two keys at most: as many records, and as many keys followed.
    let mut book = Worker::with(2, OnStoreFailure::LastState, u32::MAX);
    let mut store = FakeStore::default();
    let s = spec(60_000, 1000);
    let now = UnixMillis(60_000 * 1000);
    let keys = [FleetKey(1), FleetKey(2), FleetKey(3)];
    for key in keys {
        let ask = Ask { want: 10, ..wait_call(book.take(key, s, 1, false, now)).unwrap() };
        book.answered(&ask, Some(store.serve(&ask)), now);
        let take = book.take(key, s, 1, true, now);
        assert!(matches!(refilled(&mut book, &mut store, take, now), Take::Admitted { .. }));
    }
    let counted = |store: &FakeStore| keys.iter().map(|k| store.get(*k, 60_000, 1000)).sum::<u64>();
    let held = |book: &Worker| keys.iter().map(|k| book.held_of(*k)).sum::<u64>();
    assert_eq!(book.keys(), 2, "one of the first two keys is no longer followed");
    assert!(counted(&store) > held(&book) + 3, "a closed lease's units are still counted");
    let returns = book.heartbeat(now);
    assert!(!returns.is_empty());
    for ask in &returns {
        store.serve(ask);
    }
    assert_eq!(counted(&store), held(&book) + 3, "the closed leases' units came back");
}

/// Three proxies of two workers each take units of one key from one store, with calls
/// answered after 0 to 5 ms, a tick every millisecond (a request waiting on its proxy's call
/// from the other worker looks again), heartbeats every second and three windows' worth of
/// traffic well above the limit: in every bucket the admitted units never exceed the limit,
/// and the fleet gets close to it.
#[test]
fn three_proxies_of_two_workers_never_admit_more_than_the_limit_in_any_bucket() {
    let window_ms = 1_000;
    let limit = 500;
    let s = spec(window_ms, limit);
    let mut store = FakeStore::default();
    let proxies: Vec<Rc<MemoryStore>> = (0..3).map(|_| Rc::new(MemoryStore::new())).collect();
    let mut books: Vec<Worker> =
        (0..6).map(|w| Worker::of(Rc::clone(&proxies[w / 2]), 1000, OnStoreFailure::LastState, u32::MAX, w as u64 + 1)).collect();
    // Calls in the air: (answer at, worker, ask); requests waiting: per worker, since when.
    let mut calls: VecDeque<(u64, usize, Ask)> = VecDeque::new();
    let mut waiting: Vec<VecDeque<u64>> = vec![VecDeque::new(); 6];
    let mut admitted: HashMap<u64, u32> = HashMap::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let start = 1_000 * 1_000_000u64;
    let (mut requests, mut refused, mut waits, mut sent) = (0u64, 0u64, 0u64, 0u64);
    let mut late_at_once: Vec<(u64, u32)> = Vec::new();
    for t in 0..3_500u64 {
        let now = UnixMillis(start + t);
        let bucket = now.0 / window_ms;
        // Answers due now.
        while calls.front().is_some_and(|(at, ..)| *at <= t) {
            let (_, worker, ask) = calls.pop_front().unwrap();
            let grant = store.serve_as((worker / 2) as u64, &ask);
            if ask.bucket < bucket && ask.at_once > 0 && grant.granted > 0 {
                late_at_once.push((ask.bucket, grant.granted.min(ask.at_once)));
            }
            books[worker].answered(&ask, Some(grant), now);
        }
        // Every worker's tick: its waiting requests take again, in order.
        for worker in 0..6 {
            let queue = std::mem::take(&mut waiting[worker]);
            for since in queue {
                let take = books[worker].take(KEY, s, 1, true, now);
                if let Some(ask) = outgoing(take) {
                    sent += 1;
                    calls.push_back((t + next() % 6, worker, ask));
                }
                match take {
                    Take::Admitted { .. } => *admitted.entry(bucket).or_default() += 1,
                    Take::Wait { .. } => waiting[worker].push_back(since),
                    Take::Refused { .. } => refused += 1,
                }
            }
        }
        for (worker, b) in books.iter_mut().enumerate() {
            if t % 1000 == 0 || b.roll_due(now) {
                for ask in b.heartbeat(now) {
                    calls.push_back((t + next() % 6, worker, ask));
                }
            }
        }
        // Two requests a millisecond on random workers: 2 000 a second, four times the limit.
        for _ in 0..2 {
            let worker = (next() % 6) as usize;
            requests += 1;
            let take = books[worker].take(KEY, s, 1, false, now);
            if let Some(ask) = outgoing(take) {
                sent += 1;
                calls.push_back((t + next() % 6, worker, ask));
            }
            match take {
                Take::Admitted { .. } => *admitted.entry(bucket).or_default() += 1,
                Take::Wait { .. } => {
                    waits += 1;
                    waiting[worker].push_back(t);
                }
                Take::Refused { .. } => refused += 1,
            }
        }
        calls.make_contiguous().sort_by_key(|(at, ..)| *at);
    }
    let mut buckets: Vec<_> = admitted.into_iter().collect();
    buckets.sort();
    println!("{requests} requests, {waits} waited, {refused} refused, {sent} calls; admitted per bucket {buckets:?}; late at once {late_at_once:?}");
    for (bucket, n) in &buckets {
        assert!(*n <= limit, "bucket {bucket}: {n} admitted over a limit of {limit}");
        let counted = store.get(KEY, window_ms, *bucket);
        assert!(u64::from(*n) <= counted, "bucket {bucket}: the store counts {counted}, fewer than the {n} admitted");
        // Every proxy settled its ended buckets: once the next bucket's grace passed, the
        // store counts exactly what was admitted, and the units granted at once to requests
        // whose answer came after the bucket ended (counted as used, they cannot be given back:
        // the fleet admits that much less, never more).
        if *bucket + 1 < (start + 3_500) / window_ms {
            let late: u64 = late_at_once.iter().filter(|(b, _)| b == bucket).map(|(_, n)| u64::from(*n)).sum();
            assert_eq!(counted, u64::from(*n) + late, "bucket {bucket}: settled");
        }
    }
    // The sliding window lets a full bucket's successor admit as the previous one decays:
    // the first full bucket reaches the limit within a few units.
    let first_full = buckets.iter().find(|(b, _)| *b == start / window_ms).map(|(_, n)| *n).unwrap();
    assert!(first_full + 12 >= limit, "{first_full} of {limit}");
}

/// The workers of a proxy take from one lease: a request on one worker waits for the call
/// another worker's request sent, and one grant serves both workers' requests.
#[test]
fn the_workers_of_a_proxy_share_its_lease_and_its_call() {
    let shared = Rc::new(MemoryStore::new());
    let mut a = Worker::of(Rc::clone(&shared), 1000, OnStoreFailure::LastState, u32::MAX, 1);
    let mut b = Worker::of(Rc::clone(&shared), 1000, OnStoreFailure::LastState, u32::MAX, 2);
    let mut store = FakeStore::default();
    let s = spec(60_000, 1000);
    let now = UnixMillis(60_000 * 1000 + 10);
    let ask = wait_call(a.take(KEY, s, 1, false, now)).expect("the proxy's first request sends its call");
    assert_eq!(wait_call(b.take(KEY, s, 1, false, now)), None, "the other worker's request waits for the same call");
    let ask = Ask { want: 10, ..ask };
    assert!(a.book.take_notices().is_empty());
    a.answered(&ask, Some(store.serve(&ask)), now.plus_ms(1));
    assert_eq!(a.book.take_notices(), vec![(2, KEY)], "the other worker is told the call ended");
    // The sender's request, woken by the answer, and the other's, told.
    assert!(matches!(a.take(KEY, s, 1, true, now.plus_ms(1)), Take::Admitted { .. }));
    assert!(matches!(b.take(KEY, s, 1, true, now.plus_ms(2)), Take::Admitted { held: 8, .. }));
    let mut admitted = 2;
    for n in 0..8 {
        let worker = if n % 2 == 0 { &mut a } else { &mut b };
        assert!(matches!(worker.take(KEY, s, 1, false, now.plus_ms(3)), Take::Admitted { refill: None, .. }));
        admitted += 1;
    }
    assert_eq!((admitted, a.held(), b.held()), (10, 0, 0), "one grant of 10 served ten requests over both workers");
    assert!(matches!(b.take(KEY, s, 1, false, now.plus_ms(4)), Take::Wait { call: Some(_) }));
    assert!(matches!(a.take(KEY, s, 1, false, now.plus_ms(4)), Take::Wait { call: None }));
    assert_eq!(store.get(KEY, 60_000, 1000), 10);
}

/// A request waiting on its proxy's call does not decide without the store while the call is
/// on its way (it would admit on stale counts while the call may grant the units, or take
/// them): it waits for the answer, or for the call's own timeout, and decides without the store
/// once the call failed, or once it waited as long as any call takes.
#[test]
fn a_request_waiting_on_another_workers_call_decides_without_the_store_only_once_it_failed() {
    let shared = Rc::new(MemoryStore::new());
    let mut a = Worker::of(Rc::clone(&shared), 1000, OnStoreFailure::Refuse, u32::MAX, 1);
    let mut b = Worker::of(Rc::clone(&shared), 1000, OnStoreFailure::Refuse, u32::MAX, 2);
    let mut store = FakeStore::default();
    let s = spec(60_000, 1000);
    let now = UnixMillis(60_000 * 1000 + 10);
    // A call from worker a's root is on its way (a request asking again; its timeout is the
    // longer one).
    let refill = wait_call(a.take(KEY, s, 1, true, now)).unwrap();
    let later = now.plus_ms(20);
    assert_eq!(wait_call(b.take(KEY, s, 1, false, later)), None);
    let expired = later.plus_ms(LEASE_TIMEOUT_MS);
    assert_eq!(wait_call(b.take(KEY, s, 1, true, expired)), None, "past lease_timeout, the call may still answer");
    // It answers, for both waiting requests: each takes its unit, whatever its worker.
    assert_eq!(refill.at_once, 1);
    let refill = Ask { want: 4, at_once: 2, ..refill };
    a.answered(&refill, Some(store.serve(&refill)), expired.plus_ms(1));
    assert!(matches!(b.take(KEY, s, 1, true, expired.plus_ms(2)), Take::Admitted { .. }));
    assert!(matches!(a.take(KEY, s, 1, true, expired.plus_ms(2)), Take::Admitted { .. }));
    // Another call, whose sender is gone: the waiters wait for it until its timeout, then one
    // of them asks again.
    let t1 = now.plus_ms(5_000);
    let (lost, a_waits) = loop {
        match a.take(KEY, s, 1, false, t1) {
            Take::Admitted { refill: Some(call), .. } => break (call, 0),
            Take::Wait { call: Some(call) } => break (call, 1),
            Take::Admitted { refill: None, .. } => {}
            other => panic!("{other:?}"),
        }
    };
    assert!(lost.want >= 1);
    // b takes what the proxy still holds, then waits on that call.
    loop {
        match b.take(KEY, s, 1, false, t1) {
            Take::Admitted { refill: None, .. } => {}
            Take::Wait { call: None } => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(wait_call(b.take(KEY, s, 1, true, t1.plus_ms(LEASE_TIMEOUT_MS))), None);
    assert_eq!(wait_call(b.take(KEY, s, 1, true, t1.plus_ms(CALL_TIMEOUT_MS))), None, "its failure may still come");
    let past = t1.plus_ms(CALL_TIMEOUT_MS + LEASE_TIMEOUT_MS);
    let again = wait_call(b.take(KEY, s, 1, true, past)).expect("the lost call is past its timeout: b asks");
    assert_eq!(again.at_once, 1 + a_waits, "for every request of the proxy waiting");
    // Overdue, a request decides without the store (here: refuse).
    assert!(matches!(b.take_after(KEY, s, 1, Waited::Overdue, past.plus_ms(LEASE_TIMEOUT_MS)), Take::Refused { refusal: Refusal::StoreDown, .. }));
    // A failed call lets the waiters decide at once.
    b.answered(&again, None, past.plus_ms(LEASE_TIMEOUT_MS + 1));
    assert!(matches!(a.take(KEY, s, 1, true, past.plus_ms(LEASE_TIMEOUT_MS + 2)), Take::Refused { refusal: Refusal::StoreDown, .. }));
}

/// A key whose requests come every 2 s (slower than once a period) gets leases that cover
/// its next four requests, kept that long and refilled once empty: once its rate is known (at
/// its second request), a call every four requests.
#[test]
fn a_slow_key_takes_a_call_every_few_requests() {
    let mut book = book();
    let mut store = FakeStore::default();
    let s = spec(3_600_000, 10_000);
    let t0 = UnixMillis(3_600_000 * 400);
    let (mut calls, mut give_backs) = (0, 0);
    for n in 0..20u64 {
        let now = t0.plus_ms(n * 2_000);
        for ask in book.heartbeat(now) {
            give_backs += 1;
            book.answered(&ask, Some(store.serve(&ask)), now);
        }
        let take = match book.take(KEY, s, 1, false, now) {
            Take::Wait { call: Some(ask) } => {
                calls += 1;
                book.answered(&ask, Some(store.serve(&ask)), now.plus_ms(1));
                book.take(KEY, s, 1, true, now.plus_ms(1))
            }
            other => other,
        };
        let Take::Admitted { refill, .. } = take else { panic!("admitted: {take:?}") };
        if let Some(ask) = refill {
            calls += 1;
            book.answered(&ask, Some(store.serve(&ask)), now.plus_ms(2));
        }
    }
    println!("20 requests: {calls} calls, {give_backs} give-backs");
    assert!(calls <= 6, "{calls} calls for 20 requests");
    assert_eq!(give_backs, 0, "nothing sat unused long enough to go back");
    assert_eq!(store.get(KEY, 3_600_000, 400), 20 + book.held());
}

/// `max_lease: 1`: every request asks the store; requests waiting together share a call that
/// asks for what they need, and nothing is held between requests.
#[test]
fn a_lease_of_one_unit_holds_nothing_between_requests() {
    let mut book = Worker::with(1000, OnStoreFailure::LastState, 1);
    let mut store = FakeStore::default();
    let s = spec(60_000, 1_000_000);
    let start = 60_000 * 1000;
    for t in 0..300u64 {
        let now = UnixMillis(start + t);
        let ask = wait_call(book.take(KEY, s, 1, false, now)).expect("every request asks");
        assert_eq!(wait_call(book.take(KEY, s, 1, false, now)), None, "a second request waits for the same call");
        assert_eq!(ask.want, 1);
        book.answered(&ask, Some(store.serve(&ask)), now);
        assert!(matches!(book.take(KEY, s, 1, true, now), Take::Admitted { refill: None, held: 0, .. }));
        let again = wait_call(book.take(KEY, s, 1, true, now)).expect("the second request asks for its unit");
        assert_eq!(again.want, 1);
        book.answered(&again, Some(store.serve(&again)), now);
        assert!(matches!(book.take(KEY, s, 1, true, now), Take::Admitted { held: 0, .. }));
        assert_eq!(book.held(), 0);
    }
    assert_eq!(store.get(KEY, 60_000, 1000), 600);
}

/// A key seen once a minute: one call per request, which asks for its unit, and no refill (the
/// unit would be held for nothing).
#[test]
fn a_key_seen_once_asks_for_one_unit_and_nothing_ahead() {
    let mut book = book();
    let mut store = FakeStore::default();
    let s = spec(3_600_000, 1000);
    for n in 0..5u64 {
        let now = UnixMillis(3_600_000 * 1000 + n * 60_000);
        let ask = wait_call(book.take(KEY, s, 1, false, now)).expect("a cold key's request asks");
        assert_eq!(ask.want, 1);
        book.answered(&ask, Some(store.serve(&ask)), now);
        assert!(matches!(book.take(KEY, s, 1, true, now), Take::Admitted { held: 0, .. }));
    }
    assert_eq!(store.get(KEY, 3_600_000, 1000), 5);
}

/// A proxy that stops (it died) holding a lease: its units weigh in their bucket, and
/// come back once the next bucket is `grace_ms` old, with the units it used since its last call
/// (the store cannot tell them apart); a live proxy's settlement at the bucket's end keeps what
/// it used counted.
#[test]
fn a_dead_proxys_units_come_back_after_its_bucket_and_the_grace() {
    let (window_ms, limit) = (1_000, 1_000);
    let s = spec(window_ms, limit);
    let grace = grace_ms(window_ms, LEASE_TIMEOUT_MS);
    assert_eq!(grace, 200, "min(window / 4, 4 × lease_timeout)");
    assert_eq!((grace_ms(240, 50), grace_ms(236, 50)), (60, 0), "at least lease_timeout and a tick, or none");
    let mut store = FakeStore::default();
    let (mut live, mut dead) = (book(), book());
    let t0 = UnixMillis(window_ms * 700 + 100);
    // Both take a lease of 100 units and use 30 of it; the live one reports them with a call.
    for (holder, book) in [(1u64, &mut live), (2, &mut dead)] {
        lease_100_use_30(book, &mut store, holder, s, t0);
    }
    assert_eq!(store.get(KEY, window_ms, 700), 200);
    // The live proxy settles at the next bucket's first tick: 70 back, 30 reported used.
    let t1 = UnixMillis(window_ms * 701 + 5);
    assert!(live.roll_due(t1) && !live.roll_due(UnixMillis(window_ms * 701 - 1)));
    let settle = live.heartbeat(t1);
    assert_eq!(settle.len(), 1);
    // Its first unit went to the request that waited for it: counted as used at once.
    assert_eq!((settle[0].bucket, settle[0].returned_previous, settle[0].used_previous), (701, 70, 29));
    live.answered(&settle[0], Some(store.serve_as(1, &settle[0])), t1);
    assert!(!live.roll_due(t1));
    assert_eq!(store.get(KEY, window_ms, 700), 130, "the dead proxy's 100 still count");
    // Within the grace, the dead proxy's units still weigh: 130 × 0.9 = 117 of 1 000.
    let t2 = UnixMillis(window_ms * 701 + 100);
    let ask = wait_call(live.take(KEY, s, 1, false, t2)).unwrap();
    assert_eq!(ask.grace_ms, grace);
    let grant = store.serve_as(1, &ask);
    assert_eq!(grant.counts.previous, 130);
    live.answered(&ask, Some(grant), t2);
    // Past the grace, they come back: the previous bucket counts the live proxy's 30 and the
    // dead proxy's first unit (its waiting request took it at once: counted as used).
    let t3 = UnixMillis(window_ms * 701 + grace);
    let ask = Ask { elapsed_ms: t3.0 % window_ms, want: 1, returned: 0, returned_previous: 0, used: 0, used_previous: 0, at_once: 0, ..ask };
    assert_eq!(ask.elapsed_ms, grace);
    let grant = store.serve_as(1, &ask);
    assert_eq!(grant.counts.previous, 31, "the dead proxy's 70 unused and 29 unreported units came back");
    assert_eq!(store.get(KEY, window_ms, 700), 31);
    // A settlement arriving after that takes nothing more off.
    let late = Ask { want: 0, returned: 0, returned_previous: 70, used: 0, used_previous: 29, ..ask };
    assert_eq!(store.serve_as(2, &late).counts.previous, 31);
}

/// A settlement that fails: the units it reported used go with the next call again, so that
/// once the grace passed the store takes back only the unused ones (the give-backs of the
/// failed call are not sent again: the store may have taken them).
#[test]
fn a_failed_settlement_reports_its_used_units_again() {
    let (window_ms, limit) = (1_000, 1_000);
    let s = spec(window_ms, limit);
    let grace = grace_ms(window_ms, LEASE_TIMEOUT_MS);
    let mut store = FakeStore::default();
    let mut live = book();
    let t0 = UnixMillis(window_ms * 700 + 100);
    lease_100_use_30(&mut live, &mut store, 1, s, t0);
    // The settlement at the next bucket's first tick fails.
    let t1 = UnixMillis(window_ms * 701 + 5);
    let settle = live.heartbeat(t1);
    assert_eq!((settle.len(), settle[0].returned_previous, settle[0].used_previous), (1, 70, 29));
    live.answered(&settle[0], None, t1);
    // The next heartbeat reports the 29 again, without the 70.
    let again = live.heartbeat(t1.plus_ms(1_000 / 10));
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].returned_previous, again[0].used_previous), (0, 29));
    live.answered(&again[0], Some(store.serve_as(1, &again[0])), t1.plus_ms(100));
    // Past the grace, what the store still believed outstanding comes back: the 70 unused,
    // not the 29 used (the first unit went to the waiting request, counted at once).
    let t2 = UnixMillis(window_ms * 701 + grace);
    let ask = wait_call(live.take(KEY, s, 1, false, t2)).unwrap();
    assert_eq!(ask.elapsed_ms, grace);
    assert_eq!(store.serve_as(1, &ask).counts.previous, 30, "the units used stay counted");
}

#[test]
fn give_backs_of_reservations_end_in_the_store_as_the_units_used_exactly() {
    let (window_ms, limit) = (60_000, 1_000);
    let s = spec(window_ms, limit);
    let mut store = FakeStore::default();
    let mut book = book();
    let t0 = UnixMillis(window_ms * 500 + 1_000);
    // A reservation of 100 waits for the lease, which comes with 200 (100 taken at once: the
    // store counts them as used).
    let ask = wait_call(book.take(KEY, s, 100, false, t0)).unwrap();
    let ask = Ask { want: 200, ..ask };
    book.answered(&ask, Some(store.serve(&ask)), t0);
    assert!(matches!(book.take(KEY, s, 100, true, t0), Take::Admitted { .. }));
    // Another reservation of 100, not reported yet.
    assert!(matches!(book.take(KEY, s, 100, false, t0), Take::Admitted { .. }));
    // The first settles at 30 in the bucket: 70 are the lease's again.
    book.refund(KEY, s, 70, t0, t0);
    // The bucket ends: what is held goes back, what was used is reported.
    let t1 = UnixMillis(window_ms * 501 + 10);
    let settle = book.heartbeat(t1);
    let sent: Vec<(u32, u32, u32)> = settle.iter().map(|a| (a.returned_previous, a.refunded_previous, a.used_previous)).collect();
    assert_eq!(sent, vec![(70, 0, 30)]);
    for ask in &settle {
        book.answered(ask, Some(store.serve(ask)), t1);
    }
    // The second settles at 30 after that: its 70, reported used, come off the ended bucket.
    book.refund(KEY, s, 70, t0, t1);
    let late = book.heartbeat(t1);
    assert_eq!(late.iter().map(|a| (a.bucket, a.refunded_previous)).collect::<Vec<_>>(), vec![(501, 70)]);
    for ask in &late {
        book.answered(ask, Some(store.serve(ask)), t1);
    }
    assert_eq!(store.get(KEY, window_ms, 500), 60, "the store ends with what the two reservations used: 30 + 30");
    // Two buckets later, a give-back no longer matters: nothing is sent.
    book.refund(KEY, s, 10, t0, UnixMillis(window_ms * 502));
    assert!(book.heartbeat(UnixMillis(window_ms * 502)).iter().all(|a| a.refunded_previous == 0 && a.refunded == 0));
}

#[test]
fn a_give_back_finds_its_key_even_after_the_lease_left_the_book() {
    let (window_ms, limit) = (60_000, 1_000);
    let s = spec(window_ms, limit);
    let mut store = FakeStore::default();
    let mut book = book();
    let t0 = UnixMillis(window_ms * 500 + 1_000);
    let ask = wait_call(book.take(KEY, s, 100, false, t0)).unwrap();
    book.answered(&ask, Some(store.serve(&Ask { want: 100, ..ask })), t0);
    assert!(matches!(book.take(KEY, s, 100, true, t0), Take::Admitted { .. }));
    assert_eq!(store.get(KEY, window_ms, 500), 100);
    // The request is held upstream for a while: its idle lease leaves the book.
    let later = t0.plus_ms(PERIOD_MS * IDLE_PERIODS);
    for ask in book.heartbeat(later) {
        book.answered(&ask, Some(store.serve(&ask)), later);
    }
    assert_eq!(book.keys(), 0);
    // It settles at 30: the 70 the store counts as used come back to it.
    book.refund(KEY, s, 70, t0, later);
    let idle = later.plus_ms(PERIOD_MS * IDLE_PERIODS);
    let calls = book.heartbeat(idle);
    assert_eq!(calls.iter().map(|a| (a.returned, a.refunded)).collect::<Vec<_>>(), vec![(0, 70)]);
    for ask in &calls {
        book.answered(ask, Some(store.serve(ask)), idle);
    }
    assert_eq!(store.get(KEY, window_ms, 500), 30);
}

#[test]
fn the_units_a_proxy_holds_count_for_its_request_not_against_it() {
    let mut store = FakeStore::default();
    let s = spec(60_000, 100);
    let now = UnixMillis(60_000 * 1000 + 10);
    // Another proxy takes 60 units of the window.
    let mut other = Worker::of(Rc::new(MemoryStore::new()), 1000, OnStoreFailure::LastState, u32::MAX, 2);
    let ask = wait_call(other.take(KEY, s, 60, false, now)).expect("a call");
    let mut granted = 0;
    let mut ask = Some(ask);
    while let Some(a) = ask.take() {
        let grant = store.serve_as(2, &a);
        granted += grant.granted;
        other.answered(&a, Some(grant), now);
        if granted < 60 {
            ask = wait_call(other.take(KEY, s, 60, true, now));
        }
    }
    assert_eq!(store.get(KEY, 60_000, 1000), 60);
    // This proxy's request of 40 units: a grant of a quarter of the room covers part of it.
    let mut book = book();
    let first = wait_call(book.take(KEY, s, 40, false, now)).expect("a call");
    book.answered(&first, Some(store.serve(&first)), now);
    assert_eq!(book.held(), 10);
    // The view is fresh and counts 70 units, 10 of them the request's own: the 30 it still
    // needs fit, and that is what it asks for (taken at once when granted).
    let mut calls = 0;
    let mut take = book.take(KEY, s, 40, true, now);
    while let Take::Wait { call } = take {
        let ask = call.expect("a call of its own");
        assert_eq!((ask.want, ask.at_once), (40 - book.held() as u32, 40 - book.held() as u32), "what it still needs");
        book.answered(&ask, Some(store.serve(&ask)), now);
        calls += 1;
        assert!(calls < 30, "the request gets its units");
        take = book.take(KEY, s, 40, true, now);
    }
    assert!(matches!(take, Take::Admitted { held: 0, .. }), "admitted: {take:?}");
    assert_eq!(store.get(KEY, 60_000, 1000), 100, "the window is used to its limit");
}

#[test]
fn a_rationed_key_refuses_at_once_and_asks_for_its_next_request_in_the_background() {
    let mut store = FakeStore::default();
    let s = spec(10_000, 1_000);
    let mut book = book();
    // A request every 10 ms for a second, the store answering at once: the proxy admits about a
    // hundred units a second, far more than `RATIONED_MIN_UNITS` per window.
    let start = UnixMillis(10_000 * 1000 + 1_000);
    let serve = |book: &mut Worker, store: &mut FakeStore, take: Take, now: UnixMillis| -> Take {
        match take {
            Take::Wait { call: Some(ask) } => {
                book.answered(&ask, Some(store.serve(&ask)), now);
                let take = book.take(KEY, s, 1, true, now);
                refilled(book, store, take, now)
            }
            other => refilled(book, store, other, now),
        }
    };
    for i in 0..100 {
        let now = start.plus_ms(10 * i);
        let take = book.take(KEY, s, 1, false, now);
        let served = serve(&mut book, &mut store, take, now);
        assert!(matches!(served, Take::Admitted { .. }), "request {i}: {served:?}");
    }
    // Other proxies take the rest of the window: the next call finds no room.
    let mut now = start.plus_ms(1_000);
    store.counters.insert((KEY, 10_000, 1000), 1_000);
    loop {
        let take = book.take(KEY, s, 1, false, now);
        match serve(&mut book, &mut store, take, now) {
            Take::Admitted { .. } => now = now.plus_ms(10),
            Take::Refused { refusal: Refusal::OverLimit, .. } => break,
            other => panic!("{other:?}"),
        }
    }
    // From now on no request waits. Within a period, on the fresh counts: refused, no call.
    assert!(matches!(book.take(KEY, s, 1, false, now.plus_ms(10)), Take::Refused { refill: None, .. }));
    // Three units given back elsewhere: once the counts are a period old, a request is still
    // refused at once, with the `RateLimit` counts of a full window, while one unit is asked
    // for in the background...
    store.counters.insert((KEY, 10_000, 1000), 997);
    let later = now.plus_ms(PERIOD_MS + 10);
    let Take::Refused { refusal: Refusal::OverLimit, counts, refill: Some(next) } = book.take(KEY, s, 1, false, later) else {
        panic!("refused at once, the next unit asked for");
    };
    assert!(!s.window.admits(counts, 2_000, 1, s.limit), "no room shown: {counts:?}");
    assert_eq!((next.want, next.at_once), (1, 0), "one request's units, none taken at once");
    // ...once (one call on its way at a time).
    assert!(matches!(book.take(KEY, s, 1, false, later), Take::Refused { refill: None, .. }));
    let grant = store.serve(&next);
    assert_eq!(grant.granted, 1);
    book.answered(&next, Some(grant), later.plus_ms(1));
    // The next request takes it without waiting. While other proxies take nearly every unit
    // the window frees, the proxy's requests are admitted from what its calls in the background
    // bring, or refused at once: none waits.
    let mut now = later.plus_ms(5);
    let (mut admitted, mut refused, mut asks) = (0, 0, 0);
    for _ in 0..50 {
        let take = match book.take(KEY, s, 1, false, now) {
            Take::Admitted { refill, .. } => {
                admitted += 1;
                refill
            }
            Take::Refused { refusal: Refusal::OverLimit, refill, .. } => {
                refused += 1;
                refill
            }
            other => panic!("a rationed key's request waits: {other:?}"),
        };
        if let Some(ask) = take {
            // The window has two units free at every other call of the proxy, none at the others.
            asks += 1;
            store.counters.insert((KEY, 10_000, 1000), if asks % 2 == 0 { 998 } else { 1_000 });
            book.answered(&ask, Some(store.serve(&ask)), now.plus_ms(1));
        }
        now = now.plus_ms(10);
    }
    assert!(admitted >= 4 && refused >= 20, "{admitted} admitted, {refused} refused");
    // Units given back elsewhere leave room for four such asks: the next background call's
    // answer says so, and the key is no longer rationed: a lease miss waits for its call again.
    store.counters.insert((KEY, 10_000, 1000), 900);
    let stale = now.plus_ms(PERIOD_MS + 10);
    let ask = match book.take(KEY, s, 1, false, stale) {
        Take::Refused { refill: Some(ask), .. } | Take::Admitted { refill: Some(ask), .. } => ask,
        other => panic!("a call in the background: {other:?}"),
    };
    book.answered(&ask, Some(store.serve(&ask)), stale);
    while let Take::Admitted { .. } = book.take(KEY, s, 1, false, stale) {}
    assert!(matches!(book.take(KEY, s, 1, false, stale), Take::Wait { .. }), "not rationed: it waits");
}

#[test]
fn a_key_a_proxy_sees_rarely_waits_for_the_store_even_when_rationed() {
    // One request a second on a window at its limit: the proxy admits too few units per window
    // for a unit asked ahead to be worth holding; its requests wait for their calls.
    let mut store = FakeStore::default();
    let s = spec(10_000, 100);
    let start = UnixMillis(10_000 * 1000 + 5_000);
    store.counters.insert((KEY, 10_000, 999), 100);
    store.counters.insert((KEY, 10_000, 1000), 50);
    let mut book = book();
    for i in 0..5 {
        // Other proxies take what the window frees meanwhile.
        store.counters.insert((KEY, 10_000, 1000), 50 + 10 * i);
        let now = start.plus_ms(1_000 * i);
        let ask = wait_call(book.take(KEY, s, 1, false, now)).expect("a request waits for its call");
        book.answered(&ask, Some(store.serve(&ask)), now);
        assert!(matches!(book.take(KEY, s, 1, true, now), Take::Refused { refusal: Refusal::OverLimit, refill: None, .. }));
    }
}
