//! Fair shares under overload, within one priority class: requests carry a flow (a tenant, a
//! client: the hash of a key the caller reads), and no flow can take the class's slots from the
//! others. This is the pure core of one class ([`FairClass`]): its state, the decisions taken on
//! it, and its record in shared data; time is passed in.
//!
//! Flows are shuffle-sharded onto `queues` queues: each flow is dealt a stable hand of
//! `hand_size` of them ([`deal`], from the flow's hash). A request joins the queue of its hand
//! its flow already uses (holds a slot or waits in), else the shortest queue of its hand (fewest
//! slots held plus requests waiting; the hand's order among equals), which its flow then uses
//! while it is not empty. The state is per queue, never per flow (a queue notes only the flow
//! that took it empty), so its size does not grow with the number of flows; two flows share a
//! queue only when every queue of a hand is taken, and a heavy flow keeps to one queue, so it
//! gets one queue's share, not one per queue of its hand.
//!
//! - **Admission.** A request for which a slot is free and no waiter is ahead goes on at once,
//!   holding a [`Slot`] of its queue until [`FairClass::release`] gives it back.
//! - **Dispatch.** A free slot goes to the head (oldest waiter) of the non-empty queue holding
//!   the fewest slots; among equals, to the queue that gave one back least recently, then to the
//!   queue granted one least recently (round robin), then to the oldest head. The record hands no slot to anyone: the waiter a slot is due to
//!   takes it with [`FairClass::claim`] (from whichever worker it waits on); a newcomer goes on
//!   at once only where this rule, had it been waiting, would pick it.
//! - **Shedding.** When the class already has `max_queued` waiting, the request shed is the
//!   newest waiter of the queue holding the most slots plus waiters (among equals, the newest):
//!   possibly the arriving request itself ([`FairClass::holder_of_most`]).
//! - **Expiry.** A waiter older than `max_wait` is gone: its worker gives up on it then anyway,
//!   and the record drops it too, so a dead worker's waiters block no one.
//!
//! Invariants: the class is work-conserving, a slot is free while a request waits only until the
//! waiter it is due to claims it; a queue's share of the slots is max-min fair (water-filling):
//! a queue holding fewer slots than the others is first for the next one, and the slots go
//! round the queues holding alike, so queues asking less than an equal share of what is left
//! get all they ask and the others share the rest equally. Only admission makes a [`Slot`], one
//! per request, and it is not `Clone`, so what a request gives back is the one slot it got.
//!
//! The order among equals matters where the counts cannot tell the queues apart. With one slot,
//! every queue holds none when it frees: oldest head first would then serve a heavy flow's
//! standing backlog ahead of a light flow's newcomer (in the simulation of the property tests,
//! a flow asking exactly its share got up to 6.5% of the class's throughput less than its share
//! that way, and gets within 0.3% of it with the round robin). With slots that two flows cannot
//! share evenly (5 between two flows asking more), one holds one more than the other; when it
//! gives that one back the two hold alike, and the slot goes to the other flow, which gave none
//! back since: so the extra slot goes round. Granted least recently first instead keeps it where
//! it is (the flow holding fewer is refilled at each of its own releases, so it is always the one
//! granted last): tenants keeping 16 and 4 requests outstanding on 5 slots were served 28 to 22
//! in the pipeline's simulation, and 24 to 26 going round.
//!
//! Sources: Kubernetes KEP-1040, "Priority and Fairness for API Server Requests" (API Priority
//! and Fairness: shuffle-sharded queues within a priority level, each flow's hand, the shortest
//! queue of the hand, fair dispatch among the queues); the Amazon Builders' Library articles
//! "Fairness in multi-tenant systems" (each tenant should see a single-tenant service: the one
//! over its share is pushed back, not its neighbours) and "Workload isolation using
//! shuffle-sharding". APF orders its queues by virtual finish time; here by slots held, then a
//! round robin, which for requests of one cost gives the same max-min shares of concurrency and
//! keeps no clock in the record.
//!
//! Record layout (little-endian): version `u8`, a zero byte, queue count `u16`, next ticket
//! `u64`, slots granted so far `u64`; per queue its slots held `u32`, its waiter count `u32`,
//! the count of slots granted when it was last granted one `u64` (0: never), the hash of the
//! flow that took it empty `u64`, and the count of slots granted when it last gave one back
//! `u64` (0: never); then the waiters, queue by queue, oldest first, each its
//! ticket `u64` and since when it waits (monotonic ms) `u64`. Its size is
//! `20 + 32·queues + 16·waiting` bytes, at most [`MAX_RECORD_LEN`] (20 KB): 64 queues with 100
//! waiting take 3.7 KB, however many flows there are.

use crate::primitives::hash::deal;
use crate::primitives::record::{entry, field, DecodeError, Reader, Writer};
use crate::primitives::time::MonoMillis;
use std::collections::VecDeque;

const RECORD_VERSION: u8 = 1;
const HEADER_LEN: usize = 20;
const QUEUE_LEN: usize = 32;
const WAITER_LEN: usize = 16;

/// The most queues of a class.
pub const MAX_QUEUES: usize = crate::config::MAX_FLOW_QUEUES as usize;

/// The most requests a class holds waiting (`max_queued` is capped to it), which bounds the record.
pub const MAX_WAITING: usize = crate::config::MAX_FLOW_QUEUED as usize;

/// The longest record: [`MAX_QUEUES`] queues and [`MAX_WAITING`] waiters.
pub const MAX_RECORD_LEN: usize = HEADER_LEN + QUEUE_LEN * MAX_QUEUES + WAITER_LEN * MAX_WAITING;

/// A class's shape and bounds, from its configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    queues: usize,
    hand_size: usize,
    max_active: u32,
    max_queued: u32,
    max_wait_ms: u64,
}

impl Limits {
    /// `queues` queues (1 to [`MAX_QUEUES`]), hands of `hand_size` (1 to `queues`), at most
    /// `max_active` slots held and `max_queued` requests waiting (at most [`MAX_WAITING`]), each
    /// at most `max_wait_ms`. Out-of-range values are brought to the nearest bound.
    pub fn new(queues: usize, hand_size: usize, max_active: u32, max_queued: u32, max_wait_ms: u64) -> Limits {
        let queues = queues.clamp(1, MAX_QUEUES);
        Limits {
            queues,
            hand_size: hand_size.clamp(1, queues),
            max_active,
            max_queued: max_queued.min(u32::try_from(MAX_WAITING).unwrap_or(u32::MAX)),
            max_wait_ms,
        }
    }

    /// Queues of the class.
    pub fn queues(&self) -> usize {
        self.queues
    }

    /// Queues dealt to each flow.
    pub fn hand_size(&self) -> usize {
        self.hand_size
    }

    /// Slots of the class.
    pub fn max_active(&self) -> u32 {
        self.max_active
    }

    /// Requests waiting at most.
    pub fn max_queued(&self) -> u32 {
        self.max_queued
    }

    /// The longest wait, ms.
    pub fn max_wait_ms(&self) -> u64 {
        self.max_wait_ms
    }
}

/// A waiting request's place: its queue and its ticket (unique in the class, rising with
/// arrival, so a lower ticket is an older waiter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Place {
    /// Its queue.
    pub queue: usize,
    /// Its ticket.
    pub ticket: u64,
}

/// A slot held by an admitted request, counted against its queue until given back with
/// [`FairClass::release`]. Not `Clone`: each admission makes one, for one request. `release`
/// borrows it, so that a compare-and-swap that loses its race gives it back again to the state
/// it reads anew; the caller drops it once the write lands (an `Option<Slot>` it `take`s).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a slot is held until `FairClass::release` gives it back"]
pub struct Slot {
    queue: usize,
}

impl Slot {
    /// The queue holding it.
    pub fn queue(&self) -> usize {
        self.queue
    }
}

/// What became of an arriving request.
#[derive(Debug, PartialEq, Eq)]
pub enum Arrival {
    /// A slot was free and due to it: it goes on now.
    Admitted(Slot),
    /// It waits at this place (until [`FairClass::claim`] admits it, or it is gone).
    Queued(Place),
    /// The class already had `max_queued` waiting: a request is shed.
    Shed(Victim),
}

/// The request shed when a class's queue is full: the newest waiter of the queue holding the
/// most slots plus waiters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Victim {
    /// The arriving request itself (its queue holds the most): it is refused.
    Arrival,
    /// The newest waiter of another queue (in its own, the arrival is the newest): `evicted` is
    /// shed, and the arrival waits at `place`.
    Waiter {
        /// The waiter shed.
        evicted: Place,
        /// Where the arrival waits.
        place: Place,
    },
}

/// A waiter's answer from [`FairClass::claim`].
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// A slot was due to it: it goes on now.
    Admitted(Slot),
    /// It waits on.
    Waiting,
    /// It is no longer in the queue: shed to make room, expired, or abandoned.
    Gone,
}

/// One waiting request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Waiter {
    ticket: u64,
    since: MonoMillis,
}

/// One queue of a class: the slots its flows hold, its waiters (oldest first), and when it was
/// last granted a slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Queue {
    held: u32,
    last_granted: u64,
    /// The flow that took it empty (meaningless while it is empty).
    flow: u64,
    /// The count of slots granted when it last gave one back (0: never).
    released: u64,
    waiters: VecDeque<Waiter>,
}

impl Queue {
    /// Slots its flows hold.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// Requests waiting in it.
    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// Slots held plus requests waiting: how long it is.
    pub fn load(&self) -> u64 {
        u64::from(self.held).saturating_add(u64::try_from(self.waiters.len()).unwrap_or(u64::MAX))
    }

    /// The class's count of slots granted when this queue was last granted one (0: never).
    pub fn last_granted(&self) -> u64 {
        self.last_granted
    }

    /// The oldest waiter's ticket.
    pub fn head(&self) -> Option<u64> {
        self.waiters.front().map(|w| w.ticket)
    }

    /// Whether the flow of hash `flow_hash` uses it: it took it empty, and it is not empty.
    pub fn is_used_by(&self, flow_hash: u64) -> bool {
        self.load() > 0 && self.flow == flow_hash
    }

    /// The class's count of slots granted when it last gave one back (0: never).
    pub fn released(&self) -> u64 {
        self.released
    }

    /// The newest waiter's ticket.
    pub fn newest(&self) -> Option<u64> {
        self.waiters.back().map(|w| w.ticket)
    }

    fn position(&self, ticket: u64) -> Option<usize> {
        self.waiters.binary_search_by_key(&ticket, |w| w.ticket).ok()
    }
}

/// The fair queues of one priority class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FairClass {
    limits: Limits,
    next_ticket: u64,
    /// Slots granted so far (admissions), which orders the queues' last grants.
    granted: u64,
    queues: Vec<Queue>,
}

impl FairClass {
    /// An idle class of `limits`.
    pub fn new(limits: Limits) -> FairClass {
        FairClass { limits, next_ticket: 0, granted: 0, queues: vec![Queue::default(); limits.queues] }
    }

    /// Its limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Its queues.
    pub fn queues(&self) -> &[Queue] {
        &self.queues
    }

    /// Slots held, every queue.
    pub fn held(&self) -> u32 {
        self.queues.iter().fold(0u32, |sum, q| sum.saturating_add(q.held))
    }

    /// Requests waiting, every queue.
    pub fn waiting(&self) -> usize {
        self.queues.iter().map(Queue::waiting).fold(0usize, usize::saturating_add)
    }

    /// Slots not held (due to waiters, if any wait).
    pub fn free(&self) -> u32 {
        self.limits.max_active.saturating_sub(self.held())
    }

    /// The queues dealt to the flow of hash `flow_hash`, in the order they are tried.
    pub fn hand(&self, flow_hash: u64) -> impl Iterator<Item = usize> {
        let mut deck = [0u8; MAX_QUEUES];
        for (card, index) in deck.iter_mut().zip(0u8..) {
            *card = index;
        }
        deal(flow_hash, deck.get_mut(..self.limits.queues).unwrap_or_default(), self.limits.hand_size);
        deck.into_iter().take(self.limits.hand_size).map(usize::from)
    }

    /// A request of the flow of hash `flow_hash` arrives at `now`: it joins its flow's queue
    /// ([`FairClass::queue_of`]) and goes on at once if a free slot is due to it, else waits,
    /// or, when that makes one waiter more than `max_queued`, the newest waiter of the queue
    /// holding the most is shed.
    pub fn arrive(&mut self, flow_hash: u64, now: MonoMillis) -> Arrival {
        self.arrive_as(flow_hash, now, true)
    }

    /// As [`FairClass::arrive`], but the request may not go on now even if a slot is due to it
    /// (something outside the class, such as the in-flight limit of the whole proxy, has no
    /// room): it waits, or is shed as there.
    pub fn arrive_to_wait(&mut self, flow_hash: u64, now: MonoMillis) -> Arrival {
        self.arrive_as(flow_hash, now, false)
    }

    /// In shadow: a request of the flow of hash `flow_hash` takes a slot of its flow's queue at
    /// `now` whatever the class holds (so the class sees its load), and the answer says whether
    /// it would have gone on at once.
    pub fn arrive_in_shadow(&mut self, flow_hash: u64, now: MonoMillis) -> (Slot, bool) {
        self.expire(now);
        let place = self.join(flow_hash, now);
        let due = self.is_due(place);
        (self.take(place), due)
    }

    /// The queue a request of the flow of hash `flow_hash` joins: the queue of its hand its flow
    /// uses, else the shortest of its hand (the hand's order among equals).
    pub fn queue_of(&self, flow_hash: u64) -> usize {
        let own = self.hand(flow_hash).find(|q| self.queues.get(*q).is_some_and(|queue| queue.is_used_by(flow_hash)));
        own.or_else(|| self.hand(flow_hash).min_by_key(|q| self.queues.get(*q).map_or(u64::MAX, Queue::load))).unwrap_or(0)
    }

    /// Queues in use (holding a slot or a waiter): the flows active, as far as the queues tell.
    pub fn flows(&self) -> usize {
        self.queues.iter().filter(|q| q.load() > 0).count()
    }

    /// Whether the class's queue stands: its oldest waiter has waited `interval_ms` by `now`.
    pub fn standing(&self, interval_ms: u64, now: MonoMillis) -> bool {
        self.queues.iter().filter_map(|q| q.waiters.front()).any(|w| now.saturating_since(w.since) >= interval_ms)
    }

    /// Joins the request of the flow of hash `flow_hash` to its flow's queue at `now`.
    fn join(&mut self, flow_hash: u64, now: MonoMillis) -> Place {
        let queue = self.queue_of(flow_hash);
        let place = Place { queue, ticket: self.next_ticket };
        if let Some(line) = self.queues.get_mut(queue) {
            if line.load() == 0 {
                line.flow = flow_hash;
            }
            line.waiters.push_back(Waiter { ticket: place.ticket, since: now });
        }
        self.next_ticket = self.next_ticket.wrapping_add(1);
        place
    }

    fn arrive_as(&mut self, flow_hash: u64, now: MonoMillis, may_go: bool) -> Arrival {
        self.expire(now);
        let place = self.join(flow_hash, now);
        if may_go && self.is_due(place) {
            return Arrival::Admitted(self.take(place));
        }
        if self.waiting() <= usize::try_from(self.limits.max_queued).unwrap_or(usize::MAX) {
            return Arrival::Queued(place);
        }
        match self.holder_of_most().and_then(|q| self.queues.get(q).and_then(Queue::newest).map(|ticket| Place { queue: q, ticket })) {
            Some(evicted) if evicted != place => {
                self.abandon(evicted);
                Arrival::Shed(Victim::Waiter { evicted, place })
            }
            _ => {
                self.abandon(place);
                Arrival::Shed(Victim::Arrival)
            }
        }
    }

    /// The waiter at `place` asks, at `now`, whether a free slot is due to it: if so, it takes it.
    pub fn claim(&mut self, place: Place, now: MonoMillis) -> Claim {
        self.expire(now);
        if !self.holds(place) {
            Claim::Gone
        } else if self.is_due(place) {
            Claim::Admitted(self.take(place))
        } else {
            Claim::Waiting
        }
    }

    /// Gives a slot back at `now`. Returns the waiter it is now due to, who takes it with
    /// [`FairClass::claim`] (of the waiters free slots are due to, the last in line), if any waits.
    pub fn release(&mut self, slot: &Slot, now: MonoMillis) -> Option<Place> {
        // A slot of a queue the class no longer has (its queues were reconfigured) is forgotten.
        if let Some(queue) = self.queues.get_mut(slot.queue) {
            queue.held = queue.held.saturating_sub(1);
            queue.released = self.granted;
        }
        self.expire(now);
        self.dispatch(|_| false)
    }

    /// The waiter at `place` leaves (its wait ran out, or its client went away). Returns whether
    /// it was still waiting.
    pub fn abandon(&mut self, place: Place) -> bool {
        let Some(queue) = self.queues.get_mut(place.queue) else { return false };
        queue.position(place.ticket).and_then(|at| queue.waiters.remove(at)).is_some()
    }

    /// Whether the waiter at `place` is still waiting.
    pub fn holds(&self, place: Place) -> bool {
        self.queues.get(place.queue).and_then(|q| q.position(place.ticket)).is_some()
    }

    /// Whether a free slot is due to the waiter at `place`.
    pub fn is_due(&self, place: Place) -> bool {
        self.dispatch(|due| due == place) == Some(place)
    }

    /// The waiter the next free slot is due to, if a slot is free and a request waits.
    pub fn next_up(&self) -> Option<Place> {
        self.dispatch(|_| true)
    }

    /// The queue the next request shed comes from: of the queues with a waiter, the one holding
    /// the most slots plus waiters (among equals, the one with the newest waiter).
    pub fn holder_of_most(&self) -> Option<usize> {
        self.queues
            .iter()
            .enumerate()
            .filter_map(|(index, queue)| queue.newest().map(|newest| (queue.load(), newest, index)))
            .max()
            .map(|(_, _, index)| index)
    }

    /// Brings the slots held down to `held` at most, from the queues holding the most (slots
    /// whose requests are known to be gone). Returns how many were forgotten.
    pub fn forget_beyond(&mut self, held: u32) -> u32 {
        let mut forgotten = 0u32;
        while self.held() > held {
            let Some(queue) = self.queues.iter_mut().max_by_key(|q| q.held) else { break };
            queue.held = queue.held.saturating_sub(1);
            forgotten = forgotten.saturating_add(1);
        }
        forgotten
    }

    /// Drops the waiters that have waited `max_wait` by `now`. Returns how many.
    pub fn expire(&mut self, now: MonoMillis) -> usize {
        let max_wait_ms = self.limits.max_wait_ms;
        let mut dropped = 0usize;
        for queue in &mut self.queues {
            let before = queue.waiters.len();
            queue.waiters.retain(|w| now.saturating_since(w.since) < max_wait_ms);
            dropped = dropped.saturating_add(before.saturating_sub(queue.waiters.len()));
        }
        dropped
    }

    /// Walks the waiters free slots are due to, in order, one per free slot: each step takes the
    /// head of the non-empty queue holding the fewest slots, then granted one least recently,
    /// then of the oldest head (each counting the steps before). Stops when `stop` says so;
    /// returns the last place walked.
    fn dispatch(&self, mut stop: impl FnMut(Place) -> bool) -> Option<Place> {
        let mut held = [0u32; MAX_QUEUES];
        let mut granted = [0u64; MAX_QUEUES];
        let mut walked = [0usize; MAX_QUEUES];
        for ((count, last), queue) in held.iter_mut().zip(granted.iter_mut()).zip(&self.queues) {
            *count = queue.held;
            *last = queue.last_granted;
        }
        let mut last = None;
        let mut step = self.granted;
        for _ in 0..self.free() {
            step = step.wrapping_add(1);
            let next = self
                .queues
                .iter()
                .zip(held.iter().zip(&walked).zip(&granted))
                .enumerate()
                .filter_map(|(index, (queue, ((held, walked), granted)))| queue.waiters.get(*walked).map(|w| (*held, queue.released, *granted, w.ticket, index)))
                .min();
            let Some((_, _, _, ticket, queue)) = next else { break };
            if let (Some(held), Some(walked), Some(granted)) = (held.get_mut(queue), walked.get_mut(queue), granted.get_mut(queue)) {
                *held = held.saturating_add(1);
                *walked = walked.saturating_add(1);
                *granted = step;
            }
            let place = Place { queue, ticket };
            last = Some(place);
            if stop(place) {
                break;
            }
        }
        last
    }

    /// Moves the waiter at `place` from its queue to a slot of it.
    fn take(&mut self, place: Place) -> Slot {
        self.abandon(place);
        self.granted = self.granted.wrapping_add(1);
        if let Some(queue) = self.queues.get_mut(place.queue) {
            queue.held = queue.held.saturating_add(1);
            queue.last_granted = self.granted;
        }
        Slot { queue: place.queue }
    }

    /// The record's length.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN
            .saturating_add(QUEUE_LEN.saturating_mul(self.queues.len()))
            .saturating_add(WAITER_LEN.saturating_mul(self.waiting()))
    }

    /// Writes the record.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.put(&[RECORD_VERSION, 0]);
        out.put(&u16::try_from(self.queues.len()).unwrap_or(u16::MAX).to_le_bytes());
        out.put_u64(self.next_ticket);
        out.put_u64(self.granted);
        for queue in &self.queues {
            out.put(&queue.entry());
        }
        for waiter in self.queues.iter().flat_map(|q| &q.waiters) {
            out.put(&entry::<8, 2, WAITER_LEN>([waiter.ticket.to_le_bytes(), waiter.since.0.to_le_bytes()]));
        }
        out
    }

    /// Reads a record of a class of `limits`, refusing anything malformed or of another number
    /// of queues (the caller then starts from [`FairClass::new`]).
    pub fn decode(bytes: &[u8], limits: Limits) -> Result<FairClass, DecodeError> {
        let (header, rest) = bytes.split_first_chunk::<HEADER_LEN>().ok_or(DecodeError::Malformed)?;
        let mut reader = Reader::new(header);
        let [version, zero, low, high] = reader.array::<4>()?;
        let count = usize::from(u16::from_le_bytes([low, high]));
        if version != RECORD_VERSION || zero != 0 || count != limits.queues {
            return Err(DecodeError::Malformed);
        }
        let next_ticket = reader.u64()?;
        let granted = reader.u64()?;
        let (table, mut tail) = rest.split_at_checked(QUEUE_LEN.saturating_mul(count)).ok_or(DecodeError::Malformed)?;
        let entries = table.chunks_exact(QUEUE_LEN).filter_map(|entry| entry.first_chunk::<QUEUE_LEN>());
        let waiting = entries.clone().fold(0usize, |sum, entry| sum.saturating_add(usize::try_from(u32::from_le_bytes(field(entry, 4))).unwrap_or(usize::MAX)));
        if waiting > MAX_WAITING || tail.len() != waiting.saturating_mul(WAITER_LEN) {
            return Err(DecodeError::Malformed);
        }
        let mut queues = Vec::with_capacity(count);
        for entry in entries {
            let held = u32::from_le_bytes(field(entry, 0));
            let waiters = usize::try_from(u32::from_le_bytes(field(entry, 4))).unwrap_or(usize::MAX);
            let last_granted = u64::from_le_bytes(field(entry, 8));
            let flow = u64::from_le_bytes(field(entry, 16));
            let released = u64::from_le_bytes(field(entry, 24));
            if last_granted > granted || released > granted {
                return Err(DecodeError::Malformed);
            }
            let mut queue = Queue { held, last_granted, flow, released, waiters: VecDeque::with_capacity(waiters) };
            for _ in 0..waiters {
                let (waiter, rest) = tail.split_first_chunk::<WAITER_LEN>().ok_or(DecodeError::Malformed)?;
                tail = rest;
                let ticket = u64::from_le_bytes(field(waiter, 0));
                let since = MonoMillis(u64::from_le_bytes(field(waiter, 8)));
                // Oldest first, every ticket issued: anything else no writer makes.
                if ticket >= next_ticket || queue.waiters.back().is_some_and(|w: &Waiter| w.ticket >= ticket) {
                    return Err(DecodeError::Malformed);
                }
                queue.waiters.push_back(Waiter { ticket, since });
            }
            queues.push(queue);
        }
        if queues.len() != count || !tail.is_empty() {
            return Err(DecodeError::Malformed);
        }
        Ok(FairClass { limits, next_ticket, granted, queues })
    }
}

impl Queue {
    /// Its entry in the record.
    fn entry(&self) -> [u8; QUEUE_LEN] {
        let waiting = u32::try_from(self.waiters.len()).unwrap_or(u32::MAX);
        let counts = entry([self.held.to_le_bytes(), waiting.to_le_bytes()]);
        entry([counts, self.last_granted.to_le_bytes(), self.flow.to_le_bytes(), self.released.to_le_bytes()])
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use crate::primitives::store::{update, Attempt, MemoryStore, SharedStore, Stored};
    use proptest::prelude::*;
    use std::collections::HashMap;

    const T0: MonoMillis = MonoMillis(1_700_000_000_000);

    fn class(queues: usize, hand_size: usize, max_active: u32, max_queued: u32) -> FairClass {
        FairClass::new(Limits::new(queues, hand_size, max_active, max_queued, 1_000))
    }

    /// A flow whose hand starts with `queue` (with hands of one: whose queue it is).
    fn flow_to(class: &FairClass, queue: usize) -> u64 {
        (0u64..).find(|h| class.hand(*h).next() == Some(queue)).unwrap()
    }

    fn admitted(arrival: Arrival) -> Slot {
        match arrival {
            Arrival::Admitted(slot) => slot,
            other => panic!("not admitted: {other:?}"),
        }
    }

    fn queued(arrival: Arrival) -> Place {
        match arrival {
            Arrival::Queued(place) => place,
            other => panic!("not queued: {other:?}"),
        }
    }

    fn claimed(claim: Claim) -> Slot {
        match claim {
            Claim::Admitted(slot) => slot,
            other => panic!("not admitted: {other:?}"),
        }
    }

    #[test]
    fn a_request_goes_on_while_a_slot_is_free_and_waits_once_none_is() {
        let mut class = class(4, 1, 2, 10);
        let flow = flow_to(&class, 0);
        let first = admitted(class.arrive(flow, T0));
        let _second = admitted(class.arrive(flow, T0));
        let third = queued(class.arrive(flow, T0));
        assert_eq!(third, Place { queue: 0, ticket: 2 });
        assert_eq!((class.held(), class.waiting(), class.free()), (2, 1, 0));
        assert_eq!(class.claim(third, T0), Claim::Waiting);
        assert_eq!(class.release(&first, T0.plus_ms(5)), Some(third), "the freed slot is due to the waiter");
        assert_eq!(class.free(), 1);
        assert_eq!(queued(class.arrive(flow, T0.plus_ms(6))).ticket, 3, "a newcomer does not pass it");
        let slot = claimed(class.claim(third, T0.plus_ms(6)));
        assert_eq!(slot.queue(), 0);
        assert_eq!((class.held(), class.waiting(), class.free()), (2, 1, 0));
    }

    #[test]
    fn a_light_flow_never_waits_behind_a_heavy_one() {
        let mut class = class(8, 1, 4, 20);
        let (heavy, light) = (flow_to(&class, 0), flow_to(&class, 1));
        let mut heavy_slots: Vec<Slot> = (0..4).map(|_| admitted(class.arrive(heavy, T0))).collect();
        let heavy_waiters: Vec<Place> = (0..3).map(|_| queued(class.arrive(heavy, T0))).collect();
        let light_waiter = queued(class.arrive(light, T0.plus_ms(1)));
        // The next slot freed goes to the light flow, the heavy flow's older waiters notwithstanding.
        assert_eq!(class.release(&heavy_slots.pop().unwrap(), T0.plus_ms(2)), Some(light_waiter));
        assert_eq!(class.claim(heavy_waiters[0], T0.plus_ms(2)), Claim::Waiting);
        let light_slot = claimed(class.claim(light_waiter, T0.plus_ms(2)));
        // Holding fewer slots, it goes on at once even when a slot is due to a heavy waiter.
        assert_eq!(class.release(&heavy_slots.pop().unwrap(), T0.plus_ms(3)), Some(heavy_waiters[0]));
        let _again = admitted(class.arrive(light, T0.plus_ms(3)));
        assert_eq!(class.claim(heavy_waiters[0], T0.plus_ms(3)), Claim::Waiting);
        // A slot the light flow gives back goes to the heavy flow's waiter: none idles.
        assert_eq!((class.queues()[0].held(), class.queues()[1].held()), (2, 2));
        assert_eq!(class.release(&light_slot, T0.plus_ms(4)), Some(heavy_waiters[0]));
    }

    #[test]
    fn no_slot_idles_while_a_request_waits() {
        let mut class = class(8, 1, 3, 20);
        let flows: Vec<u64> = (0..3).map(|q| flow_to(&class, q)).collect();
        let mut slots: Vec<Slot> = Vec::new();
        let mut waiters: Vec<Place> = Vec::new();
        for (i, flow) in flows.iter().cycle().take(9).enumerate() {
            match class.arrive(*flow, T0.plus_ms(i as u64)) {
                Arrival::Admitted(slot) => slots.push(slot),
                Arrival::Queued(place) => waiters.push(place),
                Arrival::Shed(victim) => panic!("shed {victim:?}"),
            }
        }
        assert_eq!((slots.len(), waiters.len()), (3, 6));
        let mut now = T0.plus_ms(100);
        while let Some(slot) = slots.pop() {
            now = now.plus_ms(1);
            if let Some(place) = class.release(&slot, now) {
                slots.insert(0, claimed(class.claim(place, now)));
                waiters.retain(|w| *w != place);
            }
            assert!(class.waiting() == 0 || class.free() == 0, "a slot idles while {} wait", class.waiting());
        }
        assert!(waiters.is_empty());
        assert_eq!((class.held(), class.waiting()), (0, 0));
    }

    #[test]
    fn among_queues_holding_alike_the_slots_go_round() {
        let mut class = class(8, 1, 1, 20);
        let (a, b) = (flow_to(&class, 0), flow_to(&class, 1));
        let mut slot = admitted(class.arrive(a, T0));
        let waiters = [
            queued(class.arrive(a, T0.plus_ms(1))),
            queued(class.arrive(a, T0.plus_ms(2))),
            queued(class.arrive(b, T0.plus_ms(3))),
            queued(class.arrive(b, T0.plus_ms(4))),
        ];
        // With one slot every queue holds none when it frees: a's older heads wait their turn.
        let mut order = Vec::new();
        for ms in 10..14 {
            let place = class.release(&slot, T0.plus_ms(ms)).unwrap();
            order.push(waiters.iter().position(|w| *w == place).unwrap());
            slot = claimed(class.claim(place, T0.plus_ms(ms)));
        }
        assert_eq!(order, [2, 0, 3, 1], "b, a, b, a");
        assert_eq!(class.queues()[1].last_granted(), 4);
    }

    #[test]
    fn among_queues_holding_alike_and_never_granted_the_oldest_head_goes_first() {
        let mut class = class(8, 1, 2, 20);
        let (a, b, c) = (flow_to(&class, 0), flow_to(&class, 1), flow_to(&class, 2));
        let mut held_by_c = vec![admitted(class.arrive(c, T0)), admitted(class.arrive(c, T0))];
        let b_waiter = queued(class.arrive(b, T0.plus_ms(1)));
        let a_waiter = queued(class.arrive(a, T0.plus_ms(2)));
        assert_eq!(class.release(&held_by_c.pop().unwrap(), T0.plus_ms(3)), Some(b_waiter), "neither holds nor was granted one: the older");
        let _b = claimed(class.claim(b_waiter, T0.plus_ms(3)));
        assert_eq!(class.release(&held_by_c.pop().unwrap(), T0.plus_ms(4)), Some(a_waiter));
    }

    #[test]
    fn a_full_class_sheds_the_newest_waiter_of_the_queue_holding_the_most() {
        let mut class = class(8, 1, 2, 3);
        let (heavy, light) = (flow_to(&class, 0), flow_to(&class, 1));
        let _slots = [admitted(class.arrive(heavy, T0)), admitted(class.arrive(heavy, T0))];
        let first = queued(class.arrive(heavy, T0));
        let newest = queued(class.arrive(heavy, T0));
        let _light = queued(class.arrive(light, T0));
        assert_eq!(class.holder_of_most(), Some(0));
        // Full: the light arrival waits, the heavy queue's newest is shed in its stead.
        let Arrival::Shed(Victim::Waiter { evicted, place }) = class.arrive(light, T0) else { panic!("no eviction") };
        assert_eq!((evicted, place.queue), (newest, 1));
        assert_eq!(class.claim(newest, T0), Claim::Gone);
        assert!(class.holds(first));
        // The heavy flow's own arrival is the newest of the queue holding the most: it is shed.
        assert_eq!(class.arrive(heavy, T0), Arrival::Shed(Victim::Arrival));
        // Queues holding alike: the newest waiter of them is the arrival.
        assert_eq!(class.queues()[0].load(), 3);
        assert_eq!(class.queues()[1].load(), 2);
        assert_eq!(class.arrive(light, T0), Arrival::Shed(Victim::Arrival));
        assert_eq!((class.held(), class.waiting()), (2, 3));
    }

    #[test]
    fn a_waiter_leaves_when_it_abandons_or_its_wait_runs_out() {
        let mut class = FairClass::new(Limits::new(4, 1, 1, 10, 100));
        let flow = flow_to(&class, 2);
        let slot = admitted(class.arrive(flow, T0));
        let gone = queued(class.arrive(flow, T0));
        assert!(class.abandon(gone));
        assert!(!class.abandon(gone), "once");
        assert_eq!(class.claim(gone, T0), Claim::Gone);
        let late = queued(class.arrive(flow, T0.plus_ms(10)));
        assert_eq!(class.claim(late, T0.plus_ms(109)), Claim::Waiting);
        assert_eq!(class.claim(late, T0.plus_ms(110)), Claim::Gone, "waited max_wait");
        assert_eq!(class.release(&slot, T0.plus_ms(110)), None, "no one waits");
        assert_eq!(class.free(), 1);
    }

    const KEY: &str = "floodgate/t/fair/0";

    fn stored_class(stored: Option<&Stored>, limits: Limits) -> FairClass {
        stored.and_then(|s| FairClass::decode(&s.value, limits).ok()).unwrap_or_else(|| FairClass::new(limits))
    }

    /// One decision on the class in `store`, as a worker takes it.
    fn with_class<T>(store: &MemoryStore, limits: Limits, mut decide: impl FnMut(&mut FairClass) -> T) -> T {
        update(store, KEY, |stored| {
            let mut class = stored_class(stored, limits);
            let answer = decide(&mut class);
            Attempt::Write(class.encode(), answer)
        })
        .unwrap()
    }

    #[test]
    fn two_workers_share_a_class_in_the_store_and_a_release_that_loses_a_race_lands_once() {
        let store = MemoryStore::new();
        let limits = Limits::new(8, 1, 1, 4, 1_000);
        let probe = FairClass::new(limits);
        let (tenant_a, tenant_b) = (flow_to(&probe, 0), flow_to(&probe, 1));
        let slot = admitted(with_class(&store, limits, |c| c.arrive(tenant_a, T0)));
        let place = queued(with_class(&store, limits, |c| c.arrive(tenant_b, T0.plus_ms(1))));
        assert_eq!(with_class(&store, limits, |c| c.claim(place, T0.plus_ms(2))), Claim::Waiting);
        // The first worker gives its slot back while the second writes between its read and
        // its write: the release is decided again on the state read anew.
        let mut attempts = 0;
        let due = update(&store, KEY, |stored| {
            attempts += 1;
            if attempts == 1 {
                let _ = queued(with_class(&store, limits, |c| c.arrive(tenant_b, T0.plus_ms(4))));
            }
            let mut class = stored_class(stored, limits);
            let due = class.release(&slot, T0.plus_ms(5));
            Attempt::Write(class.encode(), due)
        })
        .unwrap();
        assert_eq!((attempts, due), (2, Some(place)));
        let class = stored_class(store.get(KEY).unwrap().as_ref(), limits);
        assert_eq!((class.held(), class.waiting()), (0, 2), "given back once");
        let _slot = claimed(with_class(&store, limits, |c| c.claim(place, T0.plus_ms(6))));
    }

    #[test]
    fn a_slot_names_its_queue_and_one_of_a_queue_no_longer_there_is_forgotten() {
        let mut wide = class(8, 1, 4, 10);
        let slot = admitted(wide.arrive(flow_to(&wide, 7), T0));
        assert_eq!(slot.queue(), 7);
        let mut narrow = class(4, 1, 4, 10);
        let _kept = admitted(narrow.arrive(1, T0));
        assert_eq!(narrow.release(&slot, T0), None);
        assert_eq!(narrow.held(), 1);
    }

    #[test]
    fn a_flow_is_dealt_a_stable_hand_and_keeps_to_the_queue_it_took_while_it_uses_it() {
        let mut class = class(16, 3, 100, 10);
        for flow in 0..200u64 {
            let hand: Vec<usize> = class.hand(flow).collect();
            assert_eq!(hand.len(), 3);
            assert!(hand.iter().all(|q| *q < 16));
            assert!(hand[0] != hand[1] && hand[1] != hand[2] && hand[0] != hand[2]);
            assert_eq!(class.hand(flow).collect::<Vec<_>>(), hand, "stable");
        }
        let hand: Vec<usize> = class.hand(42).collect();
        let mut slots: Vec<Slot> = (0..6).map(|_| admitted(class.arrive(42, T0))).collect();
        assert!(slots.iter().all(|s| s.queue() == hand[0]), "one queue, the first of its hand");
        assert_eq!((class.flows(), class.queue_of(42)), (1, hand[0]));
        // Another flow whose hand starts with that queue takes the shortest other queue of its hand.
        let other = (0u64..).find(|h| *h != 42 && class.hand(*h).next() == Some(hand[0])).unwrap();
        let taken = admitted(class.arrive(other, T0)).queue();
        assert_ne!(taken, hand[0]);
        assert_eq!(class.queue_of(other), taken);
        assert_eq!(class.flows(), 2);
        // Once the first flow's queue is empty, it is anyone's again.
        for slot in slots.drain(..) {
            let _ = class.release(&slot, T0);
        }
        assert!(!class.queues()[hand[0]].is_used_by(42));
        assert_eq!(class.queue_of(other), taken, "the other flow keeps its own");
        assert_eq!(FairClass::new(Limits::new(0, 9, 1, 1, 1)).hand(5).collect::<Vec<_>>(), vec![0], "bounds clamp");
    }

    #[test]
    fn a_heavy_flow_dealt_several_queues_gets_one_share() {
        let mut class = class(16, 4, 4, 40);
        let heavy = 7u64;
        let light = (0u64..).find(|h| class.hand(*h).all(|q| !class.hand(heavy).any(|own| own == q))).unwrap();
        let mut heavy_slots: Vec<Slot> = (0..4).map(|_| admitted(class.arrive(heavy, T0))).collect();
        let heavy_waiters: Vec<Place> = (0..12).map(|_| queued(class.arrive(heavy, T0))).collect();
        assert!(heavy_waiters.iter().all(|w| w.queue == heavy_waiters[0].queue));
        let light_waiter = queued(class.arrive(light, T0.plus_ms(1)));
        assert_eq!(class.release(&heavy_slots.pop().unwrap(), T0.plus_ms(2)), Some(light_waiter));
    }

    #[test]
    fn a_request_told_to_wait_waits_even_with_a_slot_due_to_it_and_in_shadow_every_request_takes_one() {
        let mut class = class(8, 2, 2, 4);
        let place = queued(class.arrive_to_wait(3, T0));
        assert!(class.is_due(place));
        let _slot = claimed(class.claim(place, T0));
        let (first, due) = class.arrive_in_shadow(3, T0);
        assert!(due, "a slot was free");
        let (second, due) = class.arrive_in_shadow(3, T0);
        assert!(!due, "none was");
        assert_eq!((class.held(), class.waiting(), class.free()), (3, 0, 0));
        assert_eq!(class.release(&first, T0), None);
        assert_eq!(class.release(&second, T0), None);
        assert_eq!(class.free(), 1);
    }

    #[test]
    fn slots_beyond_the_proxy_wide_count_are_forgotten_from_the_queues_holding_most() {
        let mut class = class(8, 1, 6, 4);
        let (a, b) = (flow_to(&class, 0), flow_to(&class, 1));
        let _a: Vec<Slot> = (0..4).map(|_| admitted(class.arrive(a, T0))).collect();
        let _b = admitted(class.arrive(b, T0));
        assert_eq!(class.forget_beyond(5), 0);
        assert_eq!(class.forget_beyond(3), 2);
        assert_eq!((class.queues()[0].held(), class.queues()[1].held()), (2, 1));
    }

    #[test]
    fn a_class_stands_once_its_oldest_waiter_has_waited_the_interval() {
        let mut class = class(8, 1, 1, 4);
        let _slot = admitted(class.arrive(1, T0));
        assert!(!class.standing(100, T0.plus_ms(500)), "no waiter");
        let _place = queued(class.arrive(1, T0.plus_ms(10)));
        assert!(!class.standing(100, T0.plus_ms(109)));
        assert!(class.standing(100, T0.plus_ms(110)));
    }

    fn sample() -> FairClass {
        let mut class = FairClass::new(Limits::new(5, 2, 3, 10, 1_000));
        for i in 0..9u64 {
            let _ = class.arrive(i.wrapping_mul(0x9e37_79b9), T0.plus_ms(i));
        }
        class
    }

    #[test]
    fn the_record_round_trips_and_refuses_every_truncation() {
        let class = sample();
        assert_eq!((class.held(), class.waiting()), (3, 6));
        let bytes = class.encode();
        assert_eq!(bytes.len(), class.encoded_len());
        assert_eq!(bytes.len(), 20 + 5 * 32 + 6 * 16);
        assert_eq!(FairClass::decode(&bytes, class.limits()), Ok(class.clone()));
        for cut in 0..bytes.len() {
            assert!(FairClass::decode(&bytes[..cut], class.limits()).is_err(), "cut at {cut}");
        }
        let mut padded = bytes.clone();
        padded.extend_from_slice(&[0; 16]);
        assert!(FairClass::decode(&padded, class.limits()).is_err());
        assert!(FairClass::decode(&bytes, Limits::new(6, 2, 3, 10, 1_000)).is_err(), "another number of queues");
        let mut version = bytes.clone();
        version[0] = 2;
        assert!(FairClass::decode(&version, class.limits()).is_err());
        let mut stale_ticket = bytes.clone();
        stale_ticket[4..12].copy_from_slice(&0u64.to_le_bytes());
        assert!(FairClass::decode(&stale_ticket, class.limits()).is_err(), "a ticket not yet issued");
        let idle = FairClass::new(class.limits());
        assert_eq!(FairClass::decode(&idle.encode(), idle.limits()), Ok(idle));
    }

    #[test]
    fn the_record_of_64_queues_stays_within_a_few_kilobytes_however_many_flows() {
        let mut class = FairClass::new(Limits::new(64, 8, 256, 100, 60_000));
        for flow in 0..100_000u64 {
            let _ = class.arrive(flow.wrapping_mul(0x2545_f491_4f6c_dd1d), T0);
        }
        assert_eq!((class.held(), class.waiting()), (256, 100));
        assert_eq!(class.encode().len(), 20 + 64 * 32 + 100 * 16);
        assert_eq!(MAX_RECORD_LEN, 20_500);
        assert_eq!(Limits::new(1, 1, 1, u32::MAX, 1).max_queued(), 1024);
    }

    /// Max-min fair shares of `capacity` among `demands` (water-filling): ascending, each takes
    /// its demand or an equal part of what is left, whichever is less.
    fn water_fill(demands: &[f64], capacity: f64) -> Vec<f64> {
        let mut order: Vec<usize> = (0..demands.len()).collect();
        order.sort_by(|a, b| demands[*a].total_cmp(&demands[*b]));
        let mut shares = vec![0.0; demands.len()];
        let mut left = capacity;
        for (taken, index) in order.iter().enumerate() {
            let share = demands[*index].min(left / (order.len() - taken) as f64);
            shares[*index] = share;
            left -= share;
        }
        shares
    }

    #[test]
    fn water_filling_is_max_min() {
        assert_eq!(water_fill(&[1.0, 5.0, 5.0], 5.0), vec![1.0, 2.0, 2.0]);
        assert_eq!(water_fill(&[0.5, 0.7], 1.0), vec![0.5, 0.5]);
        assert_eq!(water_fill(&[1.0, 1.0], 4.0), vec![1.0, 1.0]);
    }

    /// One class in front of a server of `max_active` slots, each request busy `service_ms`;
    /// flows `(hash, demand)` arrive at steady rates, a demand of `d` being `d / 10` slots'
    /// worth (`d / 10` requests per service time). Driven one millisecond at a time, as a worker
    /// would: a slot given back is claimed by the waiter it is due to, a waiter whose wait runs
    /// out abandons. Checks at every step that no slot idles while a request waits. Returns the
    /// requests each flow got a slot for.
    fn serve(limits: Limits, flows: &[(u64, u64)], service_ms: u64, run_ms: u64) -> Result<Vec<u64>, TestCaseError> {
        let mut class = FairClass::new(limits);
        let mut running: Vec<(MonoMillis, Slot)> = Vec::new();
        let mut waiting: HashMap<Place, (usize, MonoMillis)> = HashMap::new();
        let mut credit = vec![0u64; flows.len()];
        let mut served = vec![0u64; flows.len()];
        for ms in 0..run_ms {
            let now = T0.plus_ms(ms);
            let (done, busy): (Vec<_>, Vec<_>) = running.into_iter().partition(|(end, _)| *end <= now);
            running = busy;
            for (_, slot) in done {
                class.release(&slot, now);
            }
            while let Some(place) = class.next_up() {
                let (flow, _) = waiting.remove(&place).unwrap();
                match class.claim(place, now) {
                    Claim::Admitted(slot) => {
                        served[flow] += 1;
                        running.push((now.plus_ms(service_ms), slot));
                    }
                    Claim::Gone => {}
                    Claim::Waiting => prop_assert!(false, "the next up is not due"),
                }
            }
            waiting.retain(|place, (_, since)| {
                let waits = now.saturating_since(*since) < limits.max_wait_ms();
                if !waits {
                    class.abandon(*place);
                }
                waits
            });
            for (flow, (hash, demand)) in flows.iter().enumerate() {
                credit[flow] += demand;
                while credit[flow] >= 10 * service_ms {
                    credit[flow] -= 10 * service_ms;
                    match class.arrive(*hash, now) {
                        Arrival::Admitted(slot) => {
                            served[flow] += 1;
                            running.push((now.plus_ms(service_ms), slot));
                        }
                        Arrival::Queued(place) => {
                            waiting.insert(place, (flow, now));
                        }
                        Arrival::Shed(Victim::Arrival) => {}
                        Arrival::Shed(Victim::Waiter { evicted, place }) => {
                            prop_assert!(waiting.remove(&evicted).is_some());
                            waiting.insert(place, (flow, now));
                        }
                    }
                }
            }
            prop_assert!(class.waiting() == 0 || class.free() == 0, "at {}ms a slot idles while {} wait", ms, class.waiting());
            prop_assert_eq!(class.held() as usize, running.len());
            prop_assert_eq!(class.waiting(), waiting.len());
            prop_assert!(class.waiting() <= limits.max_queued() as usize);
        }
        Ok(served)
    }

    const SERVICE_MS: u64 = 10;
    const PERIODS: u64 = 400;

    /// Checks `served` (per flow, or per queue) against the water-filling shares of `demands`
    /// over the run: each within 1% of the class's throughput, plus two requests; and all of the
    /// capacity used when the demand reaches it.
    fn check_shares(served: &[u64], demands: &[u64], max_active: u32) -> Result<(), TestCaseError> {
        let capacity = f64::from(max_active) * PERIODS as f64;
        let wanted: Vec<f64> = demands.iter().map(|d| *d as f64 / 10.0 * PERIODS as f64).collect();
        let shares = water_fill(&wanted, capacity);
        let tolerance = 0.01 * capacity + 2.0;
        for (index, (got, share)) in served.iter().zip(&shares).enumerate() {
            prop_assert!((*got as f64 - share).abs() <= tolerance, "{}: served {} for a share of {:.1} (±{:.1}); served {:?}, shares {:?}", index, got, share, tolerance, served, shares);
        }
        let total: u64 = served.iter().sum();
        if wanted.iter().sum::<f64>() >= capacity {
            prop_assert!(total as f64 >= capacity - 2.0 * f64::from(max_active), "served {} of a capacity of {}", total, capacity);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn garbage_never_decodes_into_a_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..400),
            queues in 1usize..6,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        ) {
            let limits = Limits::new(queues, 1, 4, 8, 100);
            let mut framed = vec![RECORD_VERSION, 0];
            framed.extend_from_slice(&u16::try_from(queues).unwrap().to_le_bytes());
            framed.extend_from_slice(&bytes);
            let sample = sample();
            let mut flipped = sample.encode();
            for (at, byte) in flips {
                let len = flipped.len();
                flipped[at % len] ^= byte;
            }
            for (candidate, limits) in [(&bytes, limits), (&framed, limits), (&flipped, sample.limits())] {
                if let Ok(class) = FairClass::decode(candidate, limits) {
                    prop_assert_eq!(&class.encode(), candidate, "what decodes is what the writer writes");
                    prop_assert!(class.waiting() <= MAX_WAITING);
                }
            }
        }

        #[test]
        fn any_sequence_of_operations_keeps_the_bounds_and_round_trips(
            ops in proptest::collection::vec((0u8..4, any::<u64>(), 0u64..40), 1..300),
        ) {
            let limits = Limits::new(6, 2, 4, 5, 200);
            let mut class = FairClass::new(limits);
            let mut slots: Vec<Slot> = Vec::new();
            let mut places: Vec<Place> = Vec::new();
            let mut now = T0;
            for (op, pick, step) in ops {
                now = now.plus_ms(step);
                match op {
                    0 | 1 => match class.arrive(pick % 16, now) {
                        Arrival::Admitted(slot) => slots.push(slot),
                        Arrival::Queued(place) | Arrival::Shed(Victim::Waiter { place, .. }) => places.push(place),
                        Arrival::Shed(Victim::Arrival) => {}
                    },
                    2 if !slots.is_empty() => {
                        let slot = slots.swap_remove(pick as usize % slots.len());
                        let _ = class.release(&slot, now);
                    }
                    _ if !places.is_empty() => {
                        let place = places.swap_remove(pick as usize % places.len());
                        match class.claim(place, now) {
                            Claim::Admitted(slot) => slots.push(slot),
                            Claim::Waiting => places.push(place),
                            Claim::Gone => {}
                        }
                    }
                    _ => {}
                }
                prop_assert!(class.held() <= limits.max_active());
                prop_assert_eq!(class.held() as usize, slots.len());
                prop_assert!(class.waiting() <= limits.max_queued() as usize);
                prop_assert_eq!(FairClass::decode(&class.encode(), limits), Ok(class.clone()));
            }
        }

        #[test]
        fn flows_on_queues_of_their_own_get_their_max_min_fair_share(
            max_active in 1u32..5,
            demands in proptest::collection::vec(0u64..40, 1..6),
        ) {
            let limits = Limits::new(8, 1, max_active, 16, SERVICE_MS * PERIODS);
            let probe = FairClass::new(limits);
            let flows: Vec<(u64, u64)> = demands.iter().enumerate().map(|(q, d)| (flow_to(&probe, q), *d)).collect();
            let served = serve(limits, &flows, SERVICE_MS, SERVICE_MS * PERIODS)?;
            check_shares(&served, &demands, max_active)?;
        }

        #[test]
        fn flows_sharing_a_queue_share_its_max_min_fair_share(
            max_active in 1u32..5,
            flows in proptest::collection::vec((any::<u64>(), 0u64..40), 2..7),
        ) {
            let limits = Limits::new(4, 1, max_active, 16, SERVICE_MS * PERIODS);
            let probe = FairClass::new(limits);
            let served = serve(limits, &flows, SERVICE_MS, SERVICE_MS * PERIODS)?;
            let mut per_queue = [(0u64, 0u64); 4];
            for ((hash, demand), got) in flows.iter().zip(&served) {
                let queue = probe.hand(*hash).next().unwrap();
                per_queue[queue].0 += demand;
                per_queue[queue].1 += got;
            }
            let (demands, served): (Vec<u64>, Vec<u64>) = per_queue.iter().copied().unzip();
            check_shares(&served, &demands, max_active)?;
        }

        #[test]
        fn flows_dealt_hands_of_several_queues_get_their_max_min_fair_share(
            max_active in 1u32..7,
            hand_size in 2usize..6,
            flows in proptest::collection::vec((any::<u64>(), 0u64..40), 1..6),
        ) {
            let limits = Limits::new(64, hand_size, max_active, 32, SERVICE_MS * PERIODS);
            let probe = FairClass::new(limits);
            let mut hashes: Vec<u64> = flows.iter().map(|(h, _)| *h).collect();
            hashes.sort_unstable();
            hashes.dedup();
            prop_assume!(hashes.len() == flows.len());
            // Each flow has a queue of its hand no other flow's hand starts with, so no two need share.
            prop_assume!(flows.iter().all(|(h, _)| probe.hand(*h).any(|q| flows.iter().all(|(o, _)| o == h || !probe.hand(*o).any(|oq| oq == q)))));
            let served = serve(limits, &flows, SERVICE_MS, SERVICE_MS * PERIODS)?;
            let demands: Vec<u64> = flows.iter().map(|(_, d)| *d).collect();
            check_shares(&served, &demands, max_active)?;
        }

        #[test]
        fn with_hands_of_several_queues_the_class_stays_work_conserving(
            max_active in 1u32..5,
            hand_size in 2usize..4,
            flows in proptest::collection::vec((any::<u64>(), 0u64..40), 1..7),
        ) {
            let limits = Limits::new(6, hand_size, max_active, 16, SERVICE_MS * PERIODS);
            let served = serve(limits, &flows, SERVICE_MS, SERVICE_MS * PERIODS)?;
            let capacity = u64::from(max_active) * PERIODS;
            let demand: u64 = flows.iter().map(|(_, d)| d).sum();
            let total: u64 = served.iter().sum();
            prop_assert!(total <= capacity + u64::from(max_active));
            if demand * PERIODS >= capacity * 10 {
                prop_assert!(total + 2 * u64::from(max_active) >= capacity, "served {} of {}", total, capacity);
            }
        }
    }
}
