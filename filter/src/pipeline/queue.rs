//! The queue stage (load leveling, [`crate::shedding::queue`]): a request the in-flight limit
//! would shed takes a ticket and is parked here until a slot is its, or its wait ends. The
//! root's tick ([`TICK_MS`], only with `load_shedding.queue`) first ends the waits that are
//! over (their requests get the shed `503`), then, while the next slot goes to one of this
//! VM's tickets and the in-flight count has room for its class, takes the slot for that
//! request; the host then resumes each from its own context ([`super::Waiting::Slot`]). A
//! stream that ends while it waits leaves the queue ([`super::Stream::end`]).
//!
//! In a class shared by flow ([`crate::shedding::flows`]), a request waits in its flow's fair
//! queue instead of the class's line, and the tick gives a slot the in-flight count has room
//! for to the waiter the fair queues say it is due to; a waiter another flow's request pushed
//! out (its flow held the most when the class's queue was full) is shed at the tick.
//!
//! Nothing here calls the host.

use super::stats::{self, increment, Stats};
use super::{Clock, Env, Host, SharedStream, Shedding};
use crate::primitives::time::MonoMillis;
use crate::primitives::inflight::Permit;
use crate::shedding::fair::{Claim, Place, Slot};
use crate::shedding::flows::{share_of, Flows, Share};
use crate::shedding::queue::{Leveler, LocalWaiters, NoRoom, Ticket};
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

/// The tick period with a queue, ms: a free slot reaches its waiter, and a wait ends, at most
/// this late (plus the event loop's own lateness).
pub const TICK_MS: u64 = 10;

/// A request waiting for a slot (kept in its stream's state).
#[derive(Clone, Debug)]
pub struct Queued {
    /// Its place.
    pub ticket: Ticket,
    /// In a class shared by flow: its fair queue (the ticket is its ticket there).
    pub fair_queue: Option<usize>,
    /// When it started to wait.
    pub since: MonoMillis,
    /// When its wait ends.
    pub until: MonoMillis,
    /// Whether the request headers ended the request.
    pub end_of_stream: bool,
    /// Request body seen while waiting: bytes, and whether it ended.
    pub body: (usize, bool),
    /// Its wait is over: a slot (its in-flight permit is in the stream) or not.
    pub ready: Option<Ready>,
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ready {
    /// It has a slot.
    Admitted,
    /// Its time ran out.
    Expired,
    /// A request of a lighter flow took its place: its flow held the most of its class.
    Evicted(Share),
}

/// A slot of a class shared by flow, held by an admitted request until its stream ends.
#[derive(Debug)]
pub struct FairSlot {
    /// Its class.
    pub class: usize,
    /// The slot.
    pub slot: Slot,
}

/// A parked stream: its context, when its wait ends, its state.
type Parked = (u32, MonoMillis, SharedStream);

/// This VM's waiters under one configuration.
pub struct QueueStage {
    /// The proxy-wide queue.
    pub leveler: Leveler,
    /// The fair queues of the classes shared by flow.
    pub flows: Option<Flows>,
    local: RefCell<LocalWaiters>,
    /// By (class, ticket): the stream and when its wait ends.
    parked: RefCell<HashMap<(usize, u64), Parked>>,
    /// (end of wait, class, ticket), in that order.
    deadlines: RefCell<BTreeSet<(MonoMillis, usize, u64)>>,
}

impl QueueStage {
    /// The stage of `leveler`, with the fair queues of the classes shared by flow.
    pub fn new(leveler: Leveler, flows: Option<Flows>) -> QueueStage {
        QueueStage { leveler, flows, local: RefCell::default(), parked: RefCell::default(), deadlines: RefCell::default() }
    }

    /// Whether a request of `class` must wait behind a waiter even if a slot is free: one in
    /// the proxy's line, or in the fair queues of another class ranked at least as high (in
    /// its own class shared by flow, its fair queue decides).
    pub fn must_wait<H: Host>(&self, env: &Env<'_, H>, class: usize, now: MonoMillis) -> bool {
        if self.leveler.must_wait(env.store, class, now) {
            return true;
        }
        let Some(flows) = &self.flows else { return false };
        let others = self.leveler.ahead(class).iter().filter(|c| **c != class);
        others.filter_map(|c| flows.class(*c)).any(|fair| fair.read(env.store).waiting() > 0)
    }

    /// Requests waiting now, proxy-wide.
    pub fn waiting<H: Host>(&self, env: &Env<'_, H>, now: MonoMillis) -> u32 {
        let fair = self.flows.iter().flat_map(Flows::iter).map(|(_, class)| class.read(env.store).waiting());
        let fair = fair.fold(0u32, |sum, w| sum.saturating_add(u32::try_from(w).unwrap_or(u32::MAX)));
        self.leveler.waiting(env.store, now).saturating_add(fair)
    }

    /// A request of `class` takes a ticket (`Err`: it cannot wait).
    pub fn enter<H: Host>(&self, stats: &Stats, env: &Env<'_, H>, class: usize, end_of_stream: bool, now: MonoMillis) -> Result<Queued, NoRoom> {
        let ticket = self.leveler.enter(env.store, env.vm, &mut self.local.borrow_mut(), class, now)?;
        increment(env.metrics, stats.class(class).queued);
        stats::add(env.metrics, stats.shedding.queue_length, 1);
        Ok(Queued { ticket, fair_queue: None, since: now, until: now.plus_ms(ticket.wait_ms), end_of_stream, body: (0, false), ready: None })
    }

    /// A request of a class shared by flow waits in fair queue `queue` with `ticket` (its
    /// ticket there).
    pub fn enter_fair<H: Host>(&self, stats: &Stats, env: &Env<'_, H>, ticket: Ticket, queue: usize, end_of_stream: bool, now: MonoMillis) -> Queued {
        increment(env.metrics, stats.class(ticket.class).queued);
        stats::add(env.metrics, stats.shedding.queue_length, 1);
        Queued { ticket, fair_queue: Some(queue), since: now, until: now.plus_ms(ticket.wait_ms), end_of_stream, body: (0, false), ready: None }
    }

    /// Parks the stream `context` of a request that took `queued`'s ticket.
    pub fn park(&self, queued: &Queued, context: u32, shared: SharedStream) {
        let Ticket { class, ticket, .. } = queued.ticket;
        self.parked.borrow_mut().insert((class, ticket), (context, queued.until, shared));
        self.deadlines.borrow_mut().insert((queued.until, class, ticket));
    }

    /// Streams waiting on this VM.
    pub fn len(&self) -> usize {
        self.parked.borrow().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.parked.borrow().is_empty()
    }

    /// Takes `(class, ticket)` off this VM's queue: the ticket leaves the record (in a class
    /// shared by flow, the waiter leaves the fair queue `fair_queue`; `None` when it has left
    /// it already, admitted or pushed out) and the stream is unparked (returned).
    fn take<H: Host>(&self, stats: &Stats, env: &Env<'_, H>, class: usize, ticket: u64, fair_queue: Option<usize>, now: MonoMillis) -> Option<(u32, SharedStream)> {
        match self.flows.as_ref().and_then(|f| f.class(class)) {
            Some(fair) => {
                if let Some(queue) = fair_queue {
                    fair.abandon(env.store, Place { queue, ticket });
                }
            }
            None => self.leveler.leave(env.store, env.vm, &mut self.local.borrow_mut(), class, ticket, now),
        }
        let (context, until, shared) = self.parked.borrow_mut().remove(&(class, ticket))?;
        self.deadlines.borrow_mut().remove(&(until, class, ticket));
        stats::add(env.metrics, stats.shedding.queue_length, -1);
        Some((context, shared))
    }

    /// A waiting stream ended (its client hung up, reset, or timed out): its ticket leaves.
    pub fn abandon<H: Host>(&self, stats: &Stats, env: &Env<'_, H>, queued: &Queued) {
        let now = env.clock.now().mono;
        let Ticket { class, ticket, .. } = queued.ticket;
        if self.take(stats, env, class, ticket, queued.fair_queue, now).is_some() {
            increment(env.metrics, stats.class(class).abandoned);
        }
    }

    /// The root's tick: the waits that are over end, then the free slots that are this VM's
    /// (under `shedding`'s in-flight limit) go to its waiters, in order. Returns the streams to
    /// resume, each marked [`Ready`].
    pub fn tick<H: Host>(&self, shedding: &Shedding, stats: &Stats, env: &Env<'_, H>) -> Vec<(u32, SharedStream)> {
        if self.is_empty() {
            return Vec::new();
        }
        let now = env.clock.now().mono;
        let mut ready = Vec::new();
        let expired: Vec<(MonoMillis, usize, u64)> = {
            let mut deadlines = self.deadlines.borrow_mut();
            let later = deadlines.split_off(&(now.plus_ms(1), 0, 0));
            std::mem::replace(&mut *deadlines, later).into_iter().collect()
        };
        for (_, class, ticket) in expired {
            if let Some((context, shared)) = self.take(stats, env, class, ticket, self.fair_queue_of(class, ticket), now) {
                increment(env.metrics, stats.class(class).timed_out);
                mark(&shared, Ready::Expired, None, None);
                ready.push((context, shared));
            }
        }
        let Some(shedder) = shedding.shedder.as_ref() else { return ready };
        self.tick_fair(shedding, stats, env, &mut ready, now);
        loop {
            let next = self.leveler.next_up(env.store, env.vm, &self.local.borrow(), now);
            let Some((class, ticket)) = next else { break };
            let Ok(permit) = shedder.try_acquire(env.store, env.vm, &shedding.local, class, now) else { break };
            match self.take(stats, env, class, ticket, None, now) {
                Some((context, shared)) => {
                    increment(env.metrics, stats.class(class).dequeued);
                    mark(&shared, Ready::Admitted, Some(permit), None);
                    ready.push((context, shared));
                }
                None => shedder.release(env.store, env.vm, permit, now),
            }
        }
        ready
    }

    /// The tick of the classes shared by flow: each of this VM's waiters to which its class's
    /// fair queues give a free slot takes it, while the in-flight count has room; each one a
    /// lighter flow's request pushed out is shed.
    fn tick_fair<H: Host>(&self, shedding: &Shedding, stats: &Stats, env: &Env<'_, H>, ready: &mut Vec<(u32, SharedStream)>, now: MonoMillis) {
        let (Some(flows), Some(shedder)) = (&self.flows, &shedding.shedder) else { return };
        for (class, fair) in flows.iter() {
            let waiters: Vec<Place> = {
                let parked = self.parked.borrow();
                let mut waiters: Vec<Place> = parked
                    .iter()
                    .filter(|((c, _), _)| *c == class)
                    .filter_map(|((_, ticket), (_, _, shared))| fair_queue(shared).map(|queue| Place { queue, ticket: *ticket }))
                    .collect();
                waiters.sort_unstable_by_key(|p| p.ticket);
                waiters
            };
            if waiters.is_empty() {
                continue;
            }
            let record = fair.read(env.store);
            // Once the in-flight count has no room, the waiters pushed out are still shed.
            let mut room = true;
            for place in waiters {
                if !record.holds(place) {
                    let share = share_of(&record, place.queue);
                    self.evicted(stats, env, class, place, share, ready, now);
                    continue;
                }
                if !room || !record.is_due(place) {
                    continue;
                }
                let Ok(permit) = shedder.try_acquire(env.store, env.vm, &shedding.local, class, now) else {
                    room = false;
                    continue;
                };
                match fair.claim(env.store, place, now) {
                    Ok(Claim::Admitted(slot)) => match self.take(stats, env, class, place.ticket, None, now) {
                        Some((context, shared)) => {
                            increment(env.metrics, stats.class(class).dequeued);
                            mark(&shared, Ready::Admitted, Some(permit), Some(FairSlot { class, slot }));
                            ready.push((context, shared));
                        }
                        None => {
                            fair.release(env.store, &slot, now);
                            shedder.release(env.store, env.vm, permit, now);
                        }
                    },
                    Ok(Claim::Gone) => {
                        shedder.release(env.store, env.vm, permit, now);
                        let share = fair.share(env.store, place.queue);
                        self.evicted(stats, env, class, place, share, ready, now);
                    }
                    Ok(Claim::Waiting) | Err(_) => shedder.release(env.store, env.vm, permit, now),
                }
            }
        }
    }

    /// The fair queue of this VM's waiter `(class, ticket)`, in a class shared by flow.
    fn fair_queue_of(&self, class: usize, ticket: u64) -> Option<usize> {
        self.parked.borrow().get(&(class, ticket)).and_then(|(_, _, shared)| fair_queue(shared))
    }

    /// A waiter of this VM that its fair queues no longer hold (pushed out, or past `max_wait`
    /// there) is shed now.
    #[allow(clippy::too_many_arguments)]
    fn evicted<H: Host>(&self, stats: &Stats, env: &Env<'_, H>, class: usize, place: Place, share: Share, ready: &mut Vec<(u32, SharedStream)>, now: MonoMillis) {
        if let Some((context, shared)) = self.take(stats, env, class, place.ticket, None, now) {
            increment(env.metrics, stats.class(class).timed_out);
            mark(&shared, Ready::Evicted(share), None, None);
            ready.push((context, shared));
        }
    }

    /// The configuration is retired: every wait ends now (no tick of it will run again).
    /// Returns the streams to resume.
    pub fn drain<H: Host>(&self, stats: &Stats, env: &Env<'_, H>) -> Vec<(u32, SharedStream)> {
        let now = env.clock.now().mono;
        let keys: Vec<(usize, u64)> = self.parked.borrow().keys().copied().collect();
        let mut ready = Vec::new();
        for (class, ticket) in keys {
            if let Some((context, shared)) = self.take(stats, env, class, ticket, self.fair_queue_of(class, ticket), now) {
                increment(env.metrics, stats.class(class).timed_out);
                mark(&shared, Ready::Expired, None, None);
                ready.push((context, shared));
            }
        }
        ready
    }

    /// Refreshes this VM's entry in the record (every heartbeat).
    pub fn heartbeat<H: Host>(&self, env: &Env<'_, H>, now: MonoMillis) {
        self.leveler.heartbeat(env.store, env.vm, &self.local.borrow(), now);
    }
}

/// Marks a parked stream's wait over (with its in-flight permit, and in a class shared by flow
/// its fair slot, when it has a slot).
fn mark(shared: &SharedStream, ready: Ready, permit: Option<Permit>, slot: Option<FairSlot>) {
    let mut stream = shared.borrow_mut();
    stream.wait_over(ready, permit, slot);
}

/// The fair queue a parked stream waits in, if its class is shared by flow.
fn fair_queue(shared: &SharedStream) -> Option<usize> {
    shared.try_borrow().ok().and_then(|stream| stream.waiting_in_fair_queue())
}
